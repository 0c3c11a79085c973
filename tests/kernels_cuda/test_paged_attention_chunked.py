"""Chunked attention (Llama 4: a query at position p sees keys k <= p with k // C == p // C) in
the torch paths: the Triton unified kernel (CPU interpreter here) and its torch reference, by
hand and in a sweep whose prompts and prefill chunks cross chunk boundaries; then the torch
attention backends (torch_ref, torch_batched, triton) against the kernel reference."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import _batch, _one_seq

from xlaserve.backends_torch.layers.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
)
from xlaserve.kernels_cuda.paged_attention import unified_attention, unified_attention_ref


def _run(fn, batch: dict, chunk: int | None, window=None, splits=None, out=None) -> torch.Tensor:  # noqa: ANN001
    return fn(
        batch["q"], batch["k_cache"], batch["v_cache"], out, batch["query_start_loc"],
        batch["seq_lens"], batch["block_tables"], batch["max_query_len"], batch["max_seq_len"],
        batch["sm_scale"], window, None, num_kv_splits=splits, chunk_size=chunk,
    )  # fmt: skip


@pytest.mark.parametrize("fn", [unified_attention, unified_attention_ref])
def test_chunk_of_four_by_hand(fn, device) -> None:  # noqa: ANN001
    # q = 0 -> uniform weights over the visible keys; v at position j is j. Queries at 6..9 of
    # a 10-token context, chunk 4: 6 sees 4..6 (mean 5), 7 sees 4..7 (5.5), 8 starts a chunk
    # and sees only itself (8), 9 sees 8..9 (8.5).
    d = 16
    q = torch.zeros(4, 2, d)
    k = torch.randn(10, 1, d)
    v = torch.arange(10, dtype=torch.float32)[:, None, None].expand(10, 1, d).clone()
    out = _run(fn, _one_seq(q, k, v, page=4, device=device), chunk=4).cpu()
    want = torch.tensor([5.0, 5.5, 8.0, 8.5])[:, None, None].expand(4, 2, d)
    torch.testing.assert_close(out, want)


# (q_lens, seq_lens, chunk, window, dtype): decodes right after a boundary, prefill chunks over a
# cached prefix crossing boundaries, chunks smaller / larger than a page and unaligned to pages.
SWEEP = [
    ([5, 1, 1, 9], [12, 9, 1, 9], 4, None, torch.float32),
    ([13, 1, 3], [13, 17, 20], 8, None, torch.float16),
    ([6, 1, 2], [21, 33, 11], 5, None, torch.bfloat16),
    ([17, 1], [30, 25], 16, 7, torch.float32),  # chunk and sliding window together
]


@pytest.mark.parametrize("case", SWEEP, ids=lambda c: f"q{c[0]}-s{c[1]}-c{c[2]}-w{c[3]}")
def test_sweep_matches_reference(case, device, tolerances) -> None:  # noqa: ANN001
    q_lens, seq_lens, chunk, window, dtype = case
    batch = _batch(q_lens, seq_lens, 4, 2, 64, 4, dtype, device, seed=chunk)
    out = _run(unified_attention, batch, chunk, window)
    ref = _run(unified_attention_ref, batch, chunk, window)
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    full = _run(unified_attention_ref, batch, None, window)  # the chunk mask matters here
    assert not torch.allclose(full.float(), ref.float(), atol=1e-2)


def test_split_kv_matches_reference(device, tolerances) -> None:  # noqa: ANN001
    batch = _batch([1, 1, 1], [40, 3, 70], 4, 2, 64, 8, torch.float16, device, seed=5)
    out = _run(unified_attention, batch, 16, splits=4)
    ref = _run(unified_attention_ref, batch, 16)
    atol, rtol = tolerances[torch.float16]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("splits", [2, 4])
def test_split_kv_with_a_chunk_unlike_the_split_span(splits, device, tolerances) -> None:  # noqa: ANN001
    # Chunk 4, key tiles of 16 (interpreter) / 64 (GPU): the split-KV span (a multiple of the
    # tile) is not the chunk. The kernel once reused the chunk's name for the span, so a decode
    # at position 39 saw keys 32..39 instead of 36..39.
    batch = _batch([1, 1, 1], [40, 3, 70], 4, 2, 64, 8, torch.float32, device, seed=5)
    out = _run(unified_attention, batch, 4, splits=splits)
    ref = _run(unified_attention_ref, batch, 4)
    atol, rtol = tolerances[torch.float32]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_bad_chunk_size_is_a_clear_error(device) -> None:  # noqa: ANN001
    batch = _batch([1], [3], 2, 1, 16, 4, torch.float32, device)
    with pytest.raises(ValueError, match="chunk_size"):
        _run(unified_attention, batch, 0)


def _metadata(batch: dict) -> AttentionMetadata:
    qsl = batch["query_start_loc"]
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=batch["seq_lens"],
        block_tables=batch["block_tables"],
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.long, device=qsl.device),
        max_query_len=batch["max_query_len"],
        max_seq_len=batch["max_seq_len"],
        query_start_loc_host=qsl.tolist(),
        seq_lens_host=batch["seq_lens"].tolist(),
    )


@pytest.mark.parametrize("name", ["torch_ref", "torch_batched", "triton"])
def test_backends_match_kernel_reference(name: str, device, tolerances) -> None:  # noqa: ANN001
    if name != "triton" and device.type != "cpu":
        pytest.skip("the CPU backends are checked on the CPU")
    batch = _batch([5, 1, 9, 2], [12, 9, 9, 19], 4, 2, 32, 4, torch.float32, device, seed=3)
    backend = get_attention_backend(name)
    got = backend.forward(
        batch["q"], batch["k_cache"], batch["v_cache"], _metadata(batch), batch["sm_scale"],
        chunk_size=4,
    )  # fmt: skip
    ref = _run(unified_attention_ref, batch, 4)
    atol, rtol = tolerances[torch.float32]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


def test_backend_without_chunks_is_refused() -> None:
    with pytest.raises(ValueError, match="chunked attention"):
        Attention(4, 2, 16, 0.25, AttentionBackend(), chunk_size=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gpu_real_shapes_chunked(dtype, tolerances) -> None:  # noqa: ANN001
    # Llama 4 Scout's attention shape (40 q / 8 kv heads, D 128), chunk 512 (8192 in the model).
    q_lens = [1] * 6 + [512, 256]
    seq_lens = [2048, 2000, 1537, 31, 2048, 999, 2048, 256]
    batch = _batch(q_lens, seq_lens, 40, 8, 128, 16, dtype, torch.device("cuda"), seed=3)
    out = _run(unified_attention, batch, 512)
    ref = _run(unified_attention_ref, batch, 512)
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
