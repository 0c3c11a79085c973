"""unified_attention writes zeros into padding rows (past query_start_loc[B]) itself, so `out` is
allocated with torch.empty (no fill kernel): zero-fill programs (one split) or the merge kernel
(split-KV). A given `out` keeps its padding rows unless zero_padding=True."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import _batch, _run

from xlaserve.kernels_cuda import paged_attention as pa
from xlaserve.kernels_cuda.paged_attention import unified_attention, unified_attention_ref


def _run_z(fn, batch: dict, out=None, splits=None, zero_padding=None) -> torch.Tensor:  # noqa: ANN001
    return fn(
        batch["q"], batch["k_cache"], batch["v_cache"], out, batch["query_start_loc"],
        batch["seq_lens"], batch["block_tables"], batch["max_query_len"], batch["max_seq_len"],
        batch["sm_scale"], num_kv_splits=splits, zero_padding=zero_padding,
    )  # fmt: skip


@pytest.fixture
def garbage_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty_like inside paged_attention returns NaN-filled tensors: padding rows that no
    kernel writes show up as NaN instead of the zeros a fresh CPU page happens to hold."""
    real = torch.empty_like

    class _Torch:
        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(torch, name)

        @staticmethod
        def empty_like(x: torch.Tensor, **kw) -> torch.Tensor:  # noqa: ANN003
            return real(x, **kw).fill_(float("nan"))

    monkeypatch.setattr(pa, "torch", _Torch())


@pytest.mark.parametrize(
    "q_lens,seq_lens,hq,hkv,extra,splits",
    [
        ([1, 1], [9, 5], 8, 2, 7, None),  # decode, G = 4: padding spans several zero tiles
        ([3, 1], [6, 4], 2, 1, 5, 1),  # prefill chunk + decode, G = 2
        ([1, 1, 1], [40, 3, 20], 4, 2, 3, 4),  # split-KV: the merge kernel zeroes
        ([2], [5], 4, 4, 0, None),  # no padding rows
    ],
)
def test_allocated_out_has_zero_padding_rows(
    q_lens, seq_lens, hq, hkv, extra, splits, device, garbage_empty
):  # noqa: ANN001
    batch = _batch(q_lens, seq_lens, hq, hkv, 16, 4, torch.float32, device, extra_rows=extra)
    out = _run_z(unified_attention, batch, splits=splits).cpu()
    ref = _run(unified_attention_ref, batch).cpu()
    t = sum(q_lens)
    assert out.shape == batch["q"].shape
    torch.testing.assert_close(out[:t], ref[:t], atol=2e-5, rtol=1e-5)
    assert torch.equal(out[t:], torch.zeros_like(out[t:]))


@pytest.mark.parametrize("splits", [1, 2])
def test_given_out_zero_padding_flag(splits, device):
    batch = _batch([2, 1], [5, 3], 4, 2, 16, 4, torch.float32, device, extra_rows=6)
    out = torch.full_like(batch["q"], float("nan"))
    _run_z(unified_attention, batch, out=out, splits=splits, zero_padding=True)
    ref = _run_z(unified_attention_ref, batch, out=torch.full_like(out, 5.0), zero_padding=True)
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-5, rtol=1e-5)
    assert torch.equal(out[3:].cpu(), torch.zeros(6, 4, 16))
    kept = torch.full_like(batch["q"], 7.0)  # default with a given out: untouched
    _run_z(unified_attention, batch, out=kept, splits=splits)
    assert torch.all(kept[3:] == 7.0)


def test_no_sequences_all_padding(device):
    batch = _batch([1], [3], 2, 1, 16, 4, torch.float32, device, extra_rows=2)
    for key in ("seq_lens", "block_tables"):
        batch[key] = batch[key][:0]
    batch["query_start_loc"] = batch["query_start_loc"][:1]
    out = _run_z(unified_attention, batch)
    assert torch.equal(out.cpu(), torch.zeros(3, 2, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_gpu_decode_padding_zero(splits):
    dev = torch.device("cuda")
    batch = _batch([1] * 5, [384, 17, 900, 2, 384], 32, 8, 128, 16, torch.bfloat16, dev,
                   extra_rows=3)  # fmt: skip
    # Dirty the caching allocator so torch.empty returns non-zero memory.
    torch.full((8, 32, 128), float("nan"), device=dev, dtype=torch.bfloat16)
    out = _run_z(unified_attention, batch, splits=splits)
    ref = _run(unified_attention_ref, batch)
    torch.testing.assert_close(out[:5].float(), ref[:5].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
