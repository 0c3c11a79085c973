"""Tier 1: tiny ragged paged attention cases whose answers are worked out by hand.

Each case runs on the jnp reference and on the Pallas TPU kernel (TPU interpret mode).
Shapes: D = 8, S = 8 (the kernel's minimum), one or two heads.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels_pallas import BlockSizes, ragged_paged_attention, write_kv

D = 8
S = 8
IMPLS = ["reference", "pallas_tpu"]


def _e(i: int, scale: float = 1.0) -> np.ndarray:
    x = np.zeros(D, np.float32)
    x[i] = scale
    return x


# Every hand case is padded to these shapes so the kernel compiles once per (window, cap).
PAD_PAGES, PAD_TOKENS, PAD_BATCH, PAD_TABLE, PAD_HQ = 6, 4, 2, 2, 2


def _run(
    impl: str,
    q: np.ndarray,  # [T, Hq, D]
    k_pages: np.ndarray,  # [N, S, 1, D]
    v_pages: np.ndarray,
    kv_lens: list[int],
    block_tables: list[list[int]],
    cu_q_lens: list[int],
    num_seqs: int,
    **kw,
) -> np.ndarray:
    t, hq, _ = q.shape
    n = k_pages.shape[0]
    qp = np.zeros((PAD_TOKENS, PAD_HQ, D), np.float32)
    qp[:t] = np.tile(q, (1, PAD_HQ // hq, 1))  # Hq 1 -> 2 identical heads (Hkv is 1)
    kp = np.zeros((PAD_PAGES, S, 1, D), np.float32)
    vp = np.zeros((PAD_PAGES, S, 1, D), np.float32)
    kp[:n], vp[:n] = k_pages, v_pages
    b = len(kv_lens)
    kvl = kv_lens + [0] * (PAD_BATCH - b)
    bt = np.zeros((PAD_BATCH, PAD_TABLE), np.int32)
    for i, row in enumerate(block_tables):
        bt[i, : len(row)] = row
    cu = cu_q_lens + [cu_q_lens[-1]] * (PAD_BATCH + 1 - len(cu_q_lens))
    out = ragged_paged_attention(
        jnp.asarray(qp),
        jnp.asarray(kp),
        jnp.asarray(vp),
        jnp.asarray(kvl, jnp.int32),
        jnp.asarray(bt),
        jnp.asarray(cu, jnp.int32),
        jnp.asarray([num_seqs], jnp.int32),
        impl=impl,
        # Small blocks so the kernel walks several KV blocks even here.
        block_sizes=BlockSizes(pages_per_block=1, queries_per_block=8),
        **kw,
    )
    out = np.asarray(out)
    np.testing.assert_array_equal(out[t:], 0.0)  # padding tokens
    if hq == 1:
        np.testing.assert_array_equal(out[:, 0], out[:, 1])
    return out[:t, :hq]


@pytest.fixture(params=IMPLS)
def impl(request, tpu_interpret) -> str:  # noqa: ANN001
    return request.param


def test_decode_softmax_weights_1_2_4(impl: str) -> None:
    # logits q.k = [0, ln2, ln4] -> softmax [1, 2, 4] / 7; v_j = e_j -> out = [1, 2, 4, 0...] / 7.
    k = np.zeros((3, S, 1, D), np.float32)
    v = np.zeros((3, S, 1, D), np.float32)
    for j, logit in enumerate([0.0, math.log(2), math.log(4)]):
        k[2, j, 0] = _e(0, logit)
        v[2, j, 0] = _e(j)
    q = _e(0)[None, None, :]
    out = _run(impl, q, k, v, [3], [[2]], [0, 1], 1, sm_scale=1.0)
    np.testing.assert_allclose(out[0, 0], _e(0, 1 / 7) + _e(1, 2 / 7) + _e(2, 4 / 7), atol=1e-6)


def _uniform_positions_case() -> tuple[np.ndarray, np.ndarray]:
    """kv_len 10 over pages [4, 1] (non-contiguous); v at position j is j * e0; k = 0."""
    k = np.zeros((5, S, 1, D), np.float32)
    v = np.zeros((5, S, 1, D), np.float32)
    for j in range(10):
        page, off = [4, 1][j // S], j % S
        v[page, off, 0] = _e(0, float(j))
    return k, v


def test_chunked_prefill_is_causal_across_pages(impl: str) -> None:
    # q = 0 -> uniform weights over visible keys; queries at positions 7, 8, 9 (last 3 of 10)
    # see keys 0..p, so out[:, 0] = mean(0..p) = p / 2 = 3.5, 4.0, 4.5.
    k, v = _uniform_positions_case()
    q = np.zeros((3, 1, D), np.float32)
    out = _run(impl, q, k, v, [10], [[4, 1]], [0, 3], 1, sm_scale=1.0)
    np.testing.assert_allclose(out[:, 0, 0], [3.5, 4.0, 4.5], atol=1e-6)
    np.testing.assert_allclose(out[:, 0, 1:], 0.0, atol=1e-6)


def test_sliding_window_keeps_last_w_keys(impl: str) -> None:
    # Window 4: position p sees keys p-3..p, mean = p - 1.5 -> 5.5, 6.5, 7.5.
    k, v = _uniform_positions_case()
    q = np.zeros((3, 1, D), np.float32)
    out = _run(impl, q, k, v, [10], [[4, 1]], [0, 3], 1, sm_scale=1.0, sliding_window=4)
    np.testing.assert_allclose(out[:, 0, 0], [5.5, 6.5, 7.5], atol=1e-6)


def test_soft_cap_squashes_large_logit(impl: str) -> None:
    # raw logits [0, 10], cap 2 -> [0, 2 tanh(5)]: weight of key 1 = 1 / (1 + exp(-2 tanh 5)).
    k = np.zeros((1, S, 1, D), np.float32)
    v = np.zeros((1, S, 1, D), np.float32)
    k[0, 1, 0] = _e(0, 10.0)
    v[0, 0, 0], v[0, 1, 0] = _e(0), _e(1)
    q = _e(0)[None, None, :]
    out = _run(impl, q, k, v, [2], [[0]], [0, 1], 1, sm_scale=1.0, soft_cap=2.0)
    w1 = 1.0 / (1.0 + math.exp(-2.0 * math.tanh(5.0)))
    np.testing.assert_allclose(out[0, 0, :2], [1 - w1, w1], atol=1e-6)
    assert w1 < 0.9  # uncapped it would be 1 / (1 + e^-10) ~ 1


def test_gqa_heads_share_kv_and_padding_rows_are_zero(impl: str) -> None:
    # Hq 2, Hkv 1. head 0 logits [ln3, 0] -> [3/4, 1/4]; head 1 logits [-ln3, 0] -> [1/4, 3/4].
    # Token 1 is padding (cu_q_lens ends at 1; batch padded to 2 with a q_len-0 sequence).
    k = np.zeros((2, S, 1, D), np.float32)
    v = np.zeros((2, S, 1, D), np.float32)
    k[1, 0, 0] = _e(0, math.log(3))
    v[1, 0, 0], v[1, 1, 0] = _e(0), _e(1)
    q = np.zeros((2, 2, D), np.float32)
    q[0, 0], q[0, 1] = _e(0), _e(0, -1.0)
    q[1] = 5.0  # padding token: must not produce anything but zeros
    out = _run(impl, q, k, v, [2, 0], [[1], [0]], [0, 1, 1], 1, sm_scale=1.0)
    np.testing.assert_allclose(out[0, 0, :2], [0.75, 0.25], atol=1e-6)
    np.testing.assert_allclose(out[0, 1, :2], [0.25, 0.75], atol=1e-6)
    np.testing.assert_array_equal(out[1], 0.0)


def test_two_sequences_in_one_query_block(impl: str) -> None:
    # seq 0: decode at position 2 (keys 0..2, v = 0, 1, 2 -> mean 1); seq 1: prefill of 2
    # tokens (positions 0, 1; v = 10, 20 -> 10, 15). All q = 0, one 8-token query block.
    k = np.zeros((3, S, 1, D), np.float32)
    v = np.zeros((3, S, 1, D), np.float32)
    for j in range(3):
        v[0, j, 0] = _e(0, float(j))
    v[2, 0, 0], v[2, 1, 0] = _e(0, 10.0), _e(0, 20.0)
    q = np.zeros((3, 1, D), np.float32)
    out = _run(impl, q, k, v, [3, 2], [[0], [2]], [0, 1, 3], 2, sm_scale=1.0)
    np.testing.assert_allclose(out[:, 0, 0], [1.0, 10.0, 15.0], atol=1e-6)


def test_write_kv_skips_negative_slots() -> None:
    # N 2, S 4: slot 5 -> page 1 offset 1, slot 0 -> page 0 offset 0; -1 and -4 must not wrap.
    n, s = 2, 4
    k = jnp.zeros((n, s, 1, D), jnp.float32)
    v = jnp.zeros((n, s, 1, D), jnp.float32)
    k_new = jnp.arange(1, 5, dtype=jnp.float32)[:, None, None] * jnp.ones((4, 1, D))
    slots = jnp.asarray([5, -1, 0, -4], jnp.int32)
    k2, v2 = write_kv(k, v, k_new, -k_new, slots)
    expected = np.zeros((n, s, 1, D), np.float32)
    expected[1, 1] = 1.0
    expected[0, 0] = 3.0
    np.testing.assert_array_equal(np.asarray(k2), expected)
    np.testing.assert_array_equal(np.asarray(v2), -expected)
