"""Grouped matmul (kernels_pallas/gmm.py): the Pallas TPU kernel on the CPU TPU interpreter and the
XLA (ragged_dot) path against a numpy loop over groups; the MoE experts built on it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels_pallas.gmm import GmmBlockSizes, gmm, make_visits


def _numpy_gmm(lhs: np.ndarray, rhs: np.ndarray, sizes: list[int], transpose: bool) -> np.ndarray:
    out = np.zeros((lhs.shape[0], rhs.shape[1] if transpose else rhs.shape[2]), np.float32)
    off = 0
    for g, s in enumerate(sizes):
        w = rhs[g].T if transpose else rhs[g]
        out[off : off + s] = lhs[off : off + s].astype(np.float32) @ w.astype(np.float32)
        off += s
    return out


def _case(m: int, k: int, n: int, sizes: list[int], transpose: bool, seed: int = 0):  # noqa: ANN202
    rng = np.random.default_rng(seed)
    lhs = rng.normal(size=(m, k)).astype(np.float32)
    g = len(sizes)
    rhs = rng.normal(size=(g, n, k) if transpose else (g, k, n)).astype(np.float32)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), _numpy_gmm(lhs, rhs, sizes, transpose)


# (M, K, N, group sizes, transpose_rhs, block sizes): empty groups, groups spanning and sharing
# M tiles, several K and N tiles, rows past sum(sizes) (must be zero), one group only.
CASES = [
    (40, 64, 32, [10, 0, 25, 3], True, None),
    (300, 256, 384, [100, 0, 150, 30, 20], False, GmmBlockSizes(64, 128, 128)),
    (200, 256, 256, [0, 0, 190, 0], True, GmmBlockSizes(64, 128, 128)),
]


@pytest.mark.parametrize("case", CASES, ids=["small-T", "tiled", "one-group-T"])
def test_gmm_pallas_interpret_matches_numpy(case, tpu_interpret) -> None:  # noqa: ANN001
    m, k, n, sizes, tr, bs = case
    lhs, rhs, gs, want = _case(m, k, n, sizes, tr)
    got = np.asarray(gmm(jnp.asarray(lhs), jnp.asarray(rhs), gs, tr, "pallas_tpu", bs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.abs(want).max() > 1.0  # not all zeros
    assert not got[sum(sizes) :].any()


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("case", CASES[:2], ids=["small-T", "tiled"])
def test_gmm_xla_and_reference_match_numpy(case, impl: str) -> None:  # noqa: ANN001
    m, k, n, sizes, tr, _ = case
    lhs, rhs, gs, want = _case(m, k, n, sizes, tr, seed=1)
    got = np.asarray(gmm(jnp.asarray(lhs), jnp.asarray(rhs), gs, tr, impl))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_gmm_visit_table() -> None:
    """Visits: (group, M tile) pairs in group order; the tail repeats the last visit."""
    offsets, gid, tiles = make_visits(jnp.asarray([3, 0, 6, 2], jnp.int32), tm=4, m_padded=12)
    assert offsets.tolist() == [0, 3, 3, 9, 11]
    # group 0 rows 0-2 -> tile 0; group 2 rows 3-8 -> tiles 0,1,2; group 3 rows 9-10 -> tile 2.
    assert gid.tolist() == [0, 2, 2, 2, 3, 3]
    assert tiles.tolist() == [0, 0, 1, 2, 2, 2]


def test_gmm_rejects_bad_shapes() -> None:
    lhs, rhs = jnp.zeros((8, 16)), jnp.zeros((2, 16, 4))
    with pytest.raises(ValueError, match="contraction mismatch"):
        gmm(lhs, rhs, jnp.asarray([4, 4]), transpose_rhs=True)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(lhs, rhs, jnp.asarray([4, 4, 0]))
    with pytest.raises(ValueError, match="impl"):
        gmm(lhs, rhs, jnp.asarray([4, 4]), impl="cuda")


def test_moe_experts_pallas_matches_loop(tpu_interpret) -> None:  # noqa: ANN001
    """FusedMoE's expert path (sort by expert, 3 gmm calls, un-sort, weighted sum) on the Pallas
    kernel equals a per-token loop over the chosen experts."""
    from xlaserve.models_flax.moe import fused_experts, select_experts

    rng = np.random.default_rng(2)
    t, h, i, e, k = 24, 64, 32, 4, 2
    x = rng.normal(size=(t, h)).astype(np.float32)
    wg, wu = (rng.normal(0, 0.2, (e, i, h)).astype(np.float32) for _ in range(2))
    wd = rng.normal(0, 0.2, (e, h, i)).astype(np.float32)
    weights, ids = select_experts(jnp.asarray(rng.normal(size=(t, e))), k, renormalize=True)
    assert np.allclose(np.asarray(weights).sum(-1), 1.0)
    got = np.asarray(
        fused_experts(*map(jnp.asarray, (x, wg, wu, wd)), weights, ids, impl="pallas_tpu")
    )
    want = np.zeros((t, h), np.float32)
    for tok in range(t):
        for slot in range(k):
            ex = int(ids[tok, slot])
            a = x[tok] @ wg[ex].T
            hid = a / (1 + np.exp(-a)) * (x[tok] @ wu[ex].T)
            want[tok] += float(weights[tok, slot]) * (hid @ wd[ex].T)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
