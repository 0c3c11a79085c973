"""Model files carry no tensor-parallel or weight-fusion logic: layers/blocks.py (and linear.py's
factories, backends_torch/distributed/) decide both, so the generic decoder names neither."""

from __future__ import annotations

import inspect

from xlaserve.backends_torch.models import decoder

TP_AND_FUSION = (
    "tp_world_size",
    "kv_heads_per_rank",
    "tp_rank",
    "can_fuse",
    "make_merged_linear",
    "MergedLinear",
    "fuse_projections",
    "qkv_proj",
    "gate_up_proj",
    '"column"',
    '"row"',
)


def test_decoder_names_neither_tensor_parallelism_nor_weight_fusion() -> None:
    src = inspect.getsource(decoder)
    assert [w for w in TP_AND_FUSION if w in src] == []
    assert len(src.splitlines()) < 250
