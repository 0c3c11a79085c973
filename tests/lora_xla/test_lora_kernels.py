"""Batched LoRA shrink / expand (kernels_pallas/lora.py): every implementation against a numpy
loop over tokens; the Pallas kernels on the CPU interpreters (TPU interpret mode for the Mosaic
grouped matmul, Pallas' interpreter for the Triton kernel)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels_pallas import compat
from xlaserve.kernels_pallas.lora import (
    SegmentBlockSizes,
    lora_delta_ref,
    lora_expand,
    lora_shrink,
    make_segments,
    segment_matmul_gpu,
)


def _numpy_lora(x, a, b, slots, y, off):  # noqa: ANN001, ANN202
    """The definition, token by token: y_t[off:off+out] += B[s] @ (A[s] @ x_t) for s >= 0."""
    y = y.astype(np.float64).copy()
    for t, s in enumerate(slots):
        if 0 <= s < a.shape[0]:
            y[t, off : off + b.shape[1]] += b[s].astype(np.float64) @ (a[s] @ x[t])
    return y


def _case(t: int, k: int, out: int, n_total: int, num_slots: int, r: int, slots, seed=0):  # noqa: ANN001, ANN202
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(t, k)).astype(np.float32)
    a = rng.normal(size=(num_slots, r, k)).astype(np.float32) * 0.5
    b = rng.normal(size=(num_slots, out, r)).astype(np.float32) * 0.5
    y = rng.normal(size=(t, n_total)).astype(np.float32)
    return x, a, b, np.asarray(slots, np.int32), y


# (T, in, out, N total columns, offset, slots S, rank R, token slots): a mixed batch with base
# tokens (-1) interleaved, all tokens in one slot, a fused projection's middle part (offset),
# out / in not multiples of the GPU tiles, and an all-base batch.
CASES = {
    "mixed": (12, 32, 48, 48, 0, 3, 8, [0, -1, 2, 2, 0, -1, 1, 0, 2, -1, -1, 1]),
    "one-slot": (9, 64, 40, 40, 0, 4, 16, [3] * 9),
    "fused-offset": (10, 32, 24, 80, 32, 2, 8, [1, -1, 0, 0, 1, 1, -1, 0, 1, 0]),
    "ragged-dims": (37, 72, 100, 100, 0, 3, 4, [i % 4 - 1 for i in range(37)]),
    "all-base": (6, 32, 16, 16, 0, 2, 8, [-1] * 6),
}


def _run(impl: str, case) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    t, k, out, n, off, s, r, slots = case
    x, a, b, sl, y = _case(t, k, out, n, s, r, slots)
    seg = make_segments(jnp.asarray(sl), s)
    sh = lora_shrink(jnp.asarray(x), jnp.asarray(a), seg, impl)
    got = lora_expand(jnp.asarray(y), sh, jnp.asarray(b), seg, off, impl)
    return np.asarray(got), _numpy_lora(x, a, b, sl, y, off)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_gpu"])
def test_lora_shrink_expand_match_numpy(impl: str, name: str) -> None:
    got, want = _run(impl, CASES[name])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    t, k, out, n, off, s, r, slots = CASES[name]
    base = np.asarray(slots) < 0  # base tokens and the columns outside [off, off+out): untouched
    x, a, b, sl, y = _case(t, k, out, n, s, r, slots)
    np.testing.assert_array_equal(got[base], y[base])
    np.testing.assert_array_equal(got[:, :off], y[:, :off])
    np.testing.assert_array_equal(got[:, off + out :], y[:, off + out :])


@pytest.mark.parametrize("name", ["mixed", "one-slot", "fused-offset"])
def test_lora_pallas_tpu_interpret_matches_numpy(name: str, tpu_interpret) -> None:  # noqa: ANN001
    got, want = _run("pallas_tpu", CASES[name])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_lora_auto_under_forced_interpret_is_pallas_tpu(tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas.lora import resolve_impl

    assert compat.is_interpret_forced() and resolve_impl("auto") == "pallas_tpu"


def test_delta_ref_is_the_definition() -> None:
    t, k, out, n, off, s, r, slots = CASES["mixed"]
    x, a, b, sl, y = _case(t, k, out, n, s, r, slots, seed=3)
    got = np.asarray(
        lora_delta_ref(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(sl))
    )
    want = _numpy_lora(x, a, b, sl, np.zeros((t, out), np.float32), 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.abs(want).max() > 1.0


@pytest.mark.parametrize("k_splits", [1, 3, None])
def test_segments_and_gpu_segment_matmul_tiles(k_splits: int | None) -> None:
    """Segments: slot order, base tokens last; the Triton kernel with tiles smaller than the
    segments (several tiles per segment, several N and K steps, an empty group), with the
    contraction in one piece, in 3 split-K chunks (4 K steps: uneven) and split automatically."""
    sl = jnp.asarray([2, -1, 0, 2, 5, 0], jnp.int32)  # 5 is out of range for S=3: base
    seg = make_segments(sl, 3)
    assert np.asarray(seg.perm).tolist() == [2, 5, 0, 3, 1, 4]
    assert np.asarray(seg.group_sizes).tolist() == [2, 0, 2]
    assert np.asarray(seg.inv)[np.asarray(seg.perm)].tolist() == list(range(6))
    rng = np.random.default_rng(5)
    sizes = [40, 0, 23, 9]
    m, k, n = 80, 100, 70  # rows past sum(sizes)=72 must come back zero
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(4, n, k)).astype(np.float32)
    bs = SegmentBlockSizes(bt=16, bn=32, bk=32, k_splits=k_splits)
    got = np.asarray(segment_matmul_gpu(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), bs))
    want = np.zeros((m, n), np.float32)
    off = 0
    for g, sz in enumerate(sizes):
        want[off : off + sz] = x[off : off + sz] @ w[g].T
        off += sz
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    assert not got[72:].any()


def test_bad_shapes_are_clear_errors() -> None:
    seg = make_segments(jnp.zeros(4, jnp.int32), 2)
    with pytest.raises(ValueError, match="shrink"):
        lora_shrink(jnp.zeros((4, 8)), jnp.zeros((2, 4, 9)), seg, "xla")
    with pytest.raises(ValueError, match="columns"):
        lora_expand(jnp.zeros((4, 8)), jnp.zeros((4, 4)), jnp.zeros((2, 6, 4)), seg, 4, "xla")
    with pytest.raises(ValueError, match="impl"):
        lora_shrink(jnp.zeros((4, 8)), jnp.zeros((2, 4, 8)), seg, "cuda")


def test_pallas_tpu_lowers_for_tpu_at_8b_shapes() -> None:
    """The Mosaic path (gmm) lowered for a TPU on this CPU host at Llama-8B shapes (bf16, rank
    16, 8 slots): block shapes Mosaic accepts, one kernel each for the shrink and the expand."""
    import jax
    from jax import export

    def f(x, a, b, y, slots):  # noqa: ANN001, ANN202
        seg = make_segments(slots, 8)
        return lora_expand(y, lora_shrink(x, a, seg, "pallas_tpu"), b, seg, 0, "pallas_tpu")

    bf = jnp.bfloat16
    args = (jnp.zeros((256, 4096), bf), jnp.zeros((8, 16, 4096), bf),
            jnp.zeros((8, 14336, 16), bf), jnp.zeros((256, 14336), bf), jnp.zeros(256, jnp.int32))  # fmt: skip
    exported = export.export(jax.jit(f), platforms=["tpu"])(*args)
    assert exported.mlir_module().count("tpu_custom_call") == 2
