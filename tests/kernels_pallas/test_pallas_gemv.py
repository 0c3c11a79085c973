"""The decode GEMV (kernels_pallas/gemv.py) against its jnp reference, under Pallas' interpreter
on the CPU (the Triton lowering runs on the GPU: bench/gpu_probes/pallas_gemv.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels_pallas.gemv import GemvConfig, default_config, gemv, gemv_ref, gemv_supported


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        (1, 64, 512, GemvConfig(32, 128, 1)),  # batch 1: M padded to 16, bf16 out directly
        (16, 128, 1024, GemvConfig(64, 128, 2)),  # a full decode bucket, split-K partials
        (5, 96, 512, GemvConfig(32, 64, 4)),  # odd M, N a multiple of BN only
    ],
)
def test_gemv_matches_reference(m: int, n: int, k: int, cfg: GemvConfig) -> None:
    rng = np.random.default_rng(m + n + k)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(n, k)), jnp.float32)
    got = jax.jit(lambda a, b: gemv(a, b, cfg, interpret=True))(x, w)
    assert got.shape == (m, n) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(gemv_ref(x, w)), rtol=1e-5, atol=1e-4)


def test_gemv_refuses_what_its_tiles_do_not_cover() -> None:
    x, w = jnp.zeros((32, 512)), jnp.zeros((64, 512))
    with pytest.raises(ValueError, match="not covered"):
        gemv(x, w, GemvConfig(32, 128, 1), interpret=True)  # M 32 > the decode bucket
    assert not gemv_supported(16, 96, 512, GemvConfig(64, 128, 1))  # N not a multiple of BN
    assert not gemv_supported(16, 64, 384, GemvConfig(32, 256, 1))  # K not a multiple of BK
    with pytest.raises(ValueError, match="disagree on K"):
        gemv(jnp.zeros((1, 256)), jnp.zeros((64, 512)), interpret=True)


def test_default_configs_cover_the_8b_projections() -> None:
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        assert gemv_supported(16, n, k, default_config(n, k)), (n, k)
    assert default_config(6144, 4096).block_n == 32  # the tuned entry, not the fallback


def test_capped_sweep_lists_fit_their_shapes_and_start_with_the_tuned_pick() -> None:
    """bench/gpu_probes/pallas_gemv.py --capped: <= CAPPED_MAX configs a shape (a full sweep
    burned 205 s of device time), each one the kernel accepts at M = 16, TUNED's entry first
    where it has one, and every Flax 8B projection shape in TUNED (what "auto" would turn on)."""
    import dataclasses

    from xlaserve.bench.gpu_probes.pallas_gemv import CAPPED, CAPPED_MAX, SHAPES
    from xlaserve.kernels_pallas.gemv import TUNED

    for name, cfgs in CAPPED.items():
        n, k = SHAPES[name]
        assert 1 <= len(cfgs) <= CAPPED_MAX and len(set(cfgs)) == len(cfgs), name
        assert all(gemv_supported(16, n, k, GemvConfig(*c)) for c in cfgs), name
        if (n, k) in TUNED:
            assert cfgs[0] == dataclasses.astuple(TUNED[(n, k)]), name
    for name in ("o", "kv", "gate", "down", "lm_head"):  # q is o's shape; up is gate's
        assert SHAPES[name] in TUNED, name
