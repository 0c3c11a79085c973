"""The batched CPU attention equals the per-request reference on ragged mixed batches."""

from __future__ import annotations

import math

import pytest
import torch

from xlaserve.backends_torch.layers.attention import (
    AttentionMetadata,
    TorchBatchedAttention,
    TorchRefAttention,
)


def _batch(q_lens: list[int], kv_lens: list[int], hq: int, hkv: int, d: int, s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(math.ceil(k / s) for k in kv_lens) + 3
    perm = torch.randperm(nblocks, generator=g).tolist()  # scattered block ids
    tables, used = [], 0
    maxb = max(math.ceil(k / s) for k in kv_lens)
    for k in kv_lens:
        nb = math.ceil(k / s)
        tables.append(perm[used : used + nb] + [0] * (maxb - nb))
        used += nb
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        max_query_len=max(q_lens),
        max_seq_len=max(kv_lens),
        query_start_loc_host=qsl,
        seq_lens_host=kv_lens,
    )
    q = torch.randn(qsl[-1], hq, d, generator=g)
    kc = torch.randn(nblocks, s, hkv, d, generator=g)
    vc = torch.randn(nblocks, s, hkv, d, generator=g)
    return q, kc, vc, md


@pytest.mark.parametrize(
    "q_lens,kv_lens",
    [([1, 1, 1], [5, 9, 1]), ([7], [7]), ([3, 1, 6, 1], [10, 13, 6, 4]), ([2, 5], [9, 5])],
)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window,cap", [(None, None), (3, None), (None, 5.0)])
def test_batched_equals_reference(q_lens, kv_lens, hq, hkv, window, cap) -> None:
    q, kc, vc, md = _batch(q_lens, kv_lens, hq, hkv, 8, 4, seed=len(q_lens) + hq)
    ref = TorchRefAttention().forward(q, kc, vc, md, 0.3, window, cap)
    got = TorchBatchedAttention().forward(q, kc, vc, md, 0.3, window, cap)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # a second layer reuses the per-step layout and gives the same result
    assert torch.equal(TorchBatchedAttention().forward(q, kc, vc, md, 0.3, window, cap), got)
