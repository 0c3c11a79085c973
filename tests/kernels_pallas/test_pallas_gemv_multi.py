"""The multi-weight decode GEMVs (kernels_pallas/gemv.py: gemv_multi, gemv_gated) against jnp
references under Pallas' interpreter (float32 and bfloat16), and through Triton at the 8B shapes
on a GPU (`-m gpu`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels_pallas.gemv import (
    GemvConfig,
    gemv_gated,
    gemv_gated_ref,
    gemv_multi,
    gemv_ref,
)

_TOL = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (2e-2, 5e-2)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("m", "ns", "k", "cfg"),
    [
        (1, (64, 32, 32), 512, GemvConfig(32, 128, 1)),  # qkv-like: q wider than k / v
        (5, (96, 32), 256, GemvConfig(32, 64, 2)),  # odd M, split-K partials, N not pow2
        (16, (48, 16, 80), 128, GemvConfig(16, 128, 1)),  # three odd-block weights, one K step
    ],
)
def test_gemv_multi_matches_separate_references(
    m: int, ns: tuple[int, ...], k: int, cfg: GemvConfig, dtype: jnp.dtype
) -> None:
    rng = np.random.default_rng(m + k + sum(ns))
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    ws = tuple(jnp.asarray(rng.normal(size=(n, k)), dtype) for n in ns)
    got = jax.jit(lambda a, *b: gemv_multi(a, b, cfg, interpret=True))(x, *ws)
    rtol, atol = _TOL[dtype]
    assert len(got) == len(ns)
    for y, w in zip(got, ws, strict=True):
        assert y.shape == (m, w.shape[0]) and y.dtype == x.dtype
        ref = np.asarray(gemv_ref(x, w), np.float32)
        np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=rtol, atol=atol * k**0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("act", [jax.nn.silu, jax.nn.gelu])
@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [(1, 64, 512, GemvConfig(32, 128, 1)), (7, 96, 256, GemvConfig(32, 64, 1))],
)
def test_gemv_gated_matches_reference(
    m: int,
    n: int,
    k: int,
    cfg: GemvConfig,
    act,
    dtype: jnp.dtype,  # noqa: ANN001
) -> None:
    rng = np.random.default_rng(m + n + k)
    x = jnp.asarray(rng.normal(size=(m, k)) / k**0.5, dtype)
    wg = jnp.asarray(rng.normal(size=(n, k)), dtype)
    wu = jnp.asarray(rng.normal(size=(n, k)), dtype)
    got = jax.jit(lambda a, g, u: gemv_gated(a, g, u, act, cfg, interpret=True))(x, wg, wu)
    assert got.shape == (m, n) and got.dtype == x.dtype
    rtol, atol = _TOL[dtype]
    ref = np.asarray(gemv_gated_ref(x, wg, wu, act), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=rtol, atol=atol)


def test_multi_weight_gemvs_refuse_what_they_cannot_tile() -> None:
    x = jnp.zeros((1, 256))
    with pytest.raises(ValueError, match="not covered"):  # 48 not a multiple of BN 32
        gemv_multi(x, (jnp.zeros((64, 256)), jnp.zeros((48, 256))), GemvConfig(32, 128, 1))
    with pytest.raises(ValueError, match="disagree on K"):
        gemv_multi(x, (jnp.zeros((64, 512)),), interpret=True)
    with pytest.raises(ValueError, match="split_k 1"):  # the activation needs the whole sum
        w = jnp.zeros((64, 256))
        gemv_gated(x, w, w, jax.nn.silu, GemvConfig(32, 128, 2), interpret=True)
    with pytest.raises(ValueError, match="disagree"):
        gemv_gated(x, jnp.zeros((64, 256)), jnp.zeros((32, 256)), jax.nn.silu)


def test_merged_capped_sweep_fits_and_runs_on_the_cpu() -> None:
    """bench/gpu_probes/pallas_gemv.py --merged: <= CAPPED_MAX configs a shape, no repeats, the
    tuned pick first, each accepted by its kernel; the tiny shapes run end to end (interpreter)
    with a correct best."""
    from xlaserve.bench.gpu_probes.pallas_gemv import (
        CAPPED_MAX,
        MERGED,
        MERGED_CAPPED,
        sweep_merged,
    )
    from xlaserve.kernels_pallas.gemv import TUNED_GATED, TUNED_MULTI, gemv_supported

    for name, cfgs in MERGED_CAPPED.items():
        ns, k = MERGED[name]
        assert (
            1 <= len(cfgs) <= CAPPED_MAX
            and len(set(cfgs)) == len(cfgs)
            and all(gemv_supported(16, n, k, GemvConfig(*c)) for c in cfgs for n in ns)
        ), name
        pick = (TUNED_GATED if name.endswith("_gated") else TUNED_MULTI).get((sum(ns), k))
        if pick is not None:
            assert tuple(cfgs[0]) == (pick.block_n, pick.block_k, pick.split_k,
                                      pick.num_warps, pick.num_stages), name  # fmt: skip
    res = sweep_merged(["tiny_multi", "tiny_gated"], m=1, iters=1)
    assert all(r["best"] is not None and r["best"]["rel_err"] < 1e-4 for r in res.values())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_llama8b_shapes_through_triton_on_the_gpu(m: int) -> None:
    """The kernels as "auto" runs them on a GPU (Triton lowering, the tuned configs): q/k/v in
    one gemv_multi and gate/up in one gemv_gated at the Llama-3.1-8B shapes, bf16, against float32
    references of the same bf16 inputs."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX's GPU backend (the Triton lowering)")
    rng = np.random.default_rng(m)
    k = 4096
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    ws = tuple(
        jnp.asarray(rng.normal(size=(n, k)) / k**0.5, jnp.bfloat16) for n in (4096, 1024, 1024)
    )
    xf = x.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    for y, w in zip(jax.jit(lambda a, *b: gemv_multi(a, b))(x, *ws), ws, strict=True):
        ref = jnp.dot(xf, w.astype(jnp.float32).T, precision=hi)
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)
    wg, wu = (jnp.asarray(rng.normal(size=(14336, k)) / k**0.5, jnp.bfloat16) for _ in range(2))
    got = jax.jit(lambda a, g, u: gemv_gated(a, g, u, jax.nn.silu))(x, wg, wu)
    g = jnp.dot(xf, wg.astype(jnp.float32).T, precision=hi)
    u = jnp.dot(xf, wu.astype(jnp.float32).T, precision=hi)
    ref = jax.nn.silu(g) * u
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)
