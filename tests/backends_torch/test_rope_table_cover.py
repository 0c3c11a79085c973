"""The Triton rotary's cos/sin table covers the engine's max_model_len.

The table is sized from the model's rope (rope_table_len: max_position_embeddings, or original *
factor with rope scaling) and the kernel does not bounds-check positions, while the engine allows
a max_model_len past max_position_embeddings whenever rope scaling is declared (Llama 3.1-style
configs at 128k). `cover_positions` (called by the torch runner with max_model_len) grows every
table; the rotation at a position past the old table then matches the torch path's on-the-fly
cos/sin. Run by the Triton interpreter on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch
from arch_zoo import make_arch_model

from xlaserve.backends_torch.layers.rotary import RotaryEmbedding
from xlaserve.backends_torch.models import get_model_class
from xlaserve.model_loader.registry import build_spec

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)


def test_cover_positions_grows_the_triton_rope_tables(tmp_path) -> None:  # noqa: ANN001
    from xlaserve.backends_torch.attention_triton import TritonAttention

    spec = build_spec(make_arch_model("llama", str(tmp_path / "llama")))
    model = get_model_class(spec.family)(spec, dtype=torch.float32, device="cpu",
                                         attn_backend=TritonAttention())  # fmt: skip
    model.set_triton_ops(True)
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and all(r.triton_enabled for r in ropes)
    n0 = ropes[0].table_len
    assert ropes[0].cos_sin_cache.shape[0] == n0
    model.cover_positions(n0 // 2)  # already covered: nothing changes
    assert all(r.table_len == n0 for r in ropes)

    n = n0 + 64
    model.cover_positions(n)
    assert all(r.table_len == n and r.cos_sin_cache.shape[0] == n for r in ropes)
    assert len({r.cos_sin_cache.data_ptr() for r in ropes}) == 1  # still one shared table

    # Positions past the old table rotate as the torch path does (on-the-fly cos/sin).
    rope = ropes[0]
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([n0, n0 + 17, n - 1])
    q = torch.randn(3, spec.num_heads, spec.head_dim, generator=g)
    k = torch.randn(3, spec.num_kv_heads, spec.head_dim, generator=g)
    got_q, got_k = rope(pos, q.clone(), k.clone())
    table = rope.cos_sin_cache
    rope.enable_triton(None)
    want_q, want_k = rope(pos, q.clone(), k.clone())
    rope.enable_triton(table)
    torch.testing.assert_close(got_q, want_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_k, want_k, atol=1e-4, rtol=1e-4)
