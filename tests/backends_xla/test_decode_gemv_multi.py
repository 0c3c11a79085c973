"""The Flax sibling projections through the multi-weight Pallas GEMVs (issue 33) on the CPU under
Pallas' interpreter: q / k / v in one `gemv_multi` launch, gate / up with the activation in one
`gemv_gated` launch, equal to the plain path; bias / "off" / prefill buckets keep the plain path.
(The demo model's greedy tokens on vs off: test_decode_gemv.py, which now runs these paths.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels_pallas import gemv as g
from xlaserve.models_flax.layers import (
    GatedMLP,
    Linear,
    gated_linears,
    set_decode_gemv,
    sibling_linears,
)


def _lin(d_in: int, d_out: int, dtype: jnp.dtype, seed: int, bias: bool = False) -> Linear:
    lin = Linear(d_in, d_out, dtype, bias=bias)
    rng = np.random.default_rng(seed)
    lin.weight.set_value(jnp.asarray(rng.normal(size=(d_out, d_in)) / d_in**0.5, dtype))
    return lin


def _close(got: jax.Array, want: jax.Array, tol: float) -> None:
    a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert a.shape == b.shape and got.dtype == want.dtype
    assert np.abs(a - b).max() / max(np.abs(b).max(), 1e-6) < tol


@pytest.mark.parametrize(("m", "dtype", "tol"), [(1, jnp.float32, 1e-5), (7, jnp.bfloat16, 2e-2)])
def test_qkv_in_one_launch_equals_the_separate_dots(m: int, dtype: jnp.dtype, tol: float) -> None:
    mods = (_lin(256, 128, dtype, 1), _lin(256, 32, dtype, 2), _lin(256, 32, dtype, 3))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(m, 256)), dtype)
    want = jax.jit(lambda x: sibling_linears(mods, x))(x)
    set_decode_gemv(mods, "all")
    jaxpr = str(jax.make_jaxpr(lambda x: sibling_linears(mods, x))(x))
    assert jaxpr.count("pallas_call") == 1 and "gemv_multi3" in jaxpr  # one launch, not three
    got = jax.jit(lambda x: sibling_linears(mods, x))(x)
    for y, w in zip(got, want, strict=True):
        _close(y, w, tol)


@pytest.mark.parametrize(("m", "dtype", "tol"), [(1, jnp.float32, 1e-5), (5, jnp.bfloat16, 3e-2)])
def test_gated_mlp_in_one_gate_up_launch_equals_the_plain_path(
    m: int, dtype: jnp.dtype, tol: float
) -> None:
    mlp = GatedMLP(128, 96, "silu", dtype)
    for i, lin in enumerate((mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        d_out, d_in = lin.weight.get_value().shape
        lin.weight.set_value(_lin(d_in, d_out, dtype, 10 + i).weight.get_value())
    x = jnp.asarray(np.random.default_rng(1).normal(size=(m, 128)), dtype)
    want = jax.jit(lambda x: mlp(x))(x)
    set_decode_gemv(mlp, "all")
    jaxpr = str(jax.make_jaxpr(lambda x: mlp(x))(x))
    assert "gemv_gated" in jaxpr and jaxpr.count("pallas_call") == 2  # gate+up, then down
    _close(jax.jit(lambda x: mlp(x))(x), want, tol)


def test_plain_path_where_the_merged_gemv_does_not_apply() -> None:
    x1, x32 = jnp.zeros((1, 256)), jnp.zeros((32, 256))
    mods = (_lin(256, 64, jnp.float32, 1), _lin(256, 64, jnp.float32, 2))
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: sibling_linears(mods, x))(x1))  # off
    set_decode_gemv(mods, "all")
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: sibling_linears(mods, x))(x32))
    act = jax.nn.silu
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: gated_linears(*mods, act, x))(x32))
    biased = (_lin(256, 64, jnp.float32, 3, bias=True), mods[1])
    set_decode_gemv(biased, "all")  # a bias: each Linear on its own GEMV, not the merged one
    assert "gemv_multi" not in str(jax.make_jaxpr(lambda x: sibling_linears(biased, x))(x1))
    # "tuned": the 8B merged shapes have picks; an untuned member keeps the plain path.
    bf = jnp.bfloat16
    assert g.multi_gemv_config("tuned", 16, (4096, 1024, 1024), 4096, bf, bf) is not None
    assert g.gated_gemv_config("tuned", 16, 14336, 4096, bf, bf) is not None
    assert g.multi_gemv_config("tuned", 16, (96, 32), 256, bf, bf) is None
    assert g.gated_gemv_config("all", 16, 96, 200, bf, bf) is None  # K 200: no tile
