"""The torch attention-backend contract: chosen by name, metadata built by the backend's hook,
graph capture gated on the declared `cuda_graphs` capability, metadata handed to the kernel as
one struct (`paged_attention`), the same numbers as the loose-argument kernel call.

CPU: the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from xlaserve.backends_torch.attention_triton import TritonAttention, TritonAttentionMetadata
from xlaserve.backends_torch.layers.attention import (
    AttentionMetadata,
    TorchBatchedAttention,
    TorchRefAttention,
    get_attention_backend,
)
from xlaserve.config import KernelConfig


def _fields(b: int = 2) -> dict:
    qsl = [0, 3, 4][: b + 1]
    seq = [5, 9][:b]
    return dict(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        block_tables=torch.tensor([[0, 1, 0], [2, 3, 4]][:b], dtype=torch.int32),
        slot_mapping=torch.tensor([2, 3, 4, 40][: qsl[-1]], dtype=torch.int64),
        max_query_len=3,
        max_seq_len=max(seq),
        query_start_loc_host=qsl,
        seq_lens_host=seq,
    )


def test_backends_by_name_with_capabilities_and_config() -> None:
    kc = KernelConfig(pdl=False)
    tri = get_attention_backend("triton", kc)
    assert isinstance(tri, TritonAttention) and tri.kernels is kc
    assert tri.cuda_graphs and tri.triton_kernels
    for name in ("torch_ref", "torch_batched"):
        be = get_attention_backend(name)
        assert not be.cuda_graphs and not be.triton_kernels and be.kernels is None
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nope")


def test_metadata_hooks() -> None:
    md = TorchRefAttention().build_metadata(**_fields())
    assert type(md) is AttentionMetadata and md.num_reqs == 2
    with pytest.raises(NotImplementedError, match="cannot be captured in CUDA graphs"):
        TorchBatchedAttention().graph_metadata(md, 4)
    tri = TritonAttention()
    md = tri.build_metadata(**_fields())
    assert type(md) is TritonAttentionMetadata and md.num_kv_splits is None
    g = tri.graph_metadata(md, 4)
    assert g.num_kv_splits == 4 and md.num_kv_splits is None  # a new struct
    assert g.block_tables is md.block_tables  # views of the same (static) buffers


@pytest.mark.parametrize("splits", [None, 2])
def test_struct_call_equals_loose_call_and_reference(splits: int | None) -> None:
    from xlaserve.kernels_cuda.paged_attention import paged_attention, unified_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 16, generator=g)
    kc = torch.randn(5, 4, 2, 16, generator=g)
    vc = torch.randn(5, 4, 2, 16, generator=g)
    tri = TritonAttention()
    md = tri.build_metadata(**_fields())
    if splits is not None:
        md = tri.graph_metadata(md, splits)
    got = paged_attention(q, kc, vc, md, 0.25, soft_cap=20.0)
    loose = unified_attention(
        q, kc, vc, None, md.query_start_loc, md.seq_lens, md.block_tables,
        md.max_query_len, md.max_seq_len, 0.25, soft_cap=20.0, num_kv_splits=splits,
    )  # fmt: skip
    assert torch.equal(got, loose)
    ref = TorchRefAttention().forward(q, kc, vc, md, 0.25, None, 20.0)
    torch.testing.assert_close(tri.forward(q, kc, vc, md, 0.25, None, 20.0), ref, atol=1e-4, rtol=0)
