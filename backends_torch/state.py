"""The torch runner's side of recurrent-state models (Mamba, Mamba2, hybrids; core/cache_spec.py).

- `check_state_model_config`: what such models cannot do yet, refused at start-up with a clear
  error (speculative decoding: a rejected draft would need the state rewound; KV offload and a
  quantized KV cache; tensor parallelism).
- `split_cache` (determine_num_kv_blocks): ONE budget of bytes -> (KV blocks, state slots).
- `alloc_caches`: per layer, (K, V) [N, S, Hkv, D] for attention layers and (conv state
  [slots, C, K-1], ssm state [slots, Hs, P, N]) float32 for state layers.
- `set_step_state`: the step's slots and fresh flags into the attention metadata (the model reads
  `md.derived["state_slots"]` / `["state_fresh"]`).
CUDA graphs are not captured for these models (their decode steps run eagerly; logged once).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from xlaserve.model_loader.spec import ModelSpec
from xlaserve.model_loader.ssm import cache_layout, is_state_model, state_shapes

if TYPE_CHECKING:
    from xlaserve.backends_torch.layers.attention import AttentionMetadata
    from xlaserve.backends_torch.runner import TorchModelRunner
    from xlaserve.config import EngineConfig
    from xlaserve.runner_core import ReqState

logger = logging.getLogger(__name__)

__all__ = ["is_state_model"]


def check_state_model_config(config: EngineConfig, spec: ModelSpec) -> None:
    """Raise ValueError for features these models do not support (before loading anything)."""
    if not is_state_model(spec):
        return
    arch = spec.architecture
    if config.speculative is not None:
        raise ValueError(
            f"{arch} keeps a recurrent state per request: speculative decoding is not supported "
            "for it (a rejected draft token would need the state rewound); drop "
            "speculative_config"
        )
    if config.cache.kv_offload_bytes:
        raise ValueError(f"{arch}: KV offload is not supported for recurrent-state models")
    if config.cache.kv_cache_dtype != "auto":
        raise ValueError(f"{arch}: kv_cache_dtype must be 'auto' for recurrent-state models")
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(f"{arch}: tensor parallelism is not supported for recurrent-state models")


def split_cache(runner: TorchModelRunner, budget_bytes: int | None) -> tuple[int, int]:
    """(num KV blocks, num state slots). An explicit num_kv_blocks keeps its blocks and takes
    num_state_slots (default max_num_seqs) slots beside them; else the budget is split
    (CacheLayout.split). An explicit num_state_slots always wins."""
    cc, sc = runner.config.cache, runner.config.scheduler
    elem = torch.empty((), dtype=runner.dtype).element_size()
    layout = cache_layout(runner.spec, elem, runner.block_size)
    if cc.num_kv_blocks is not None:
        return cc.num_kv_blocks, cc.num_state_slots or sc.max_num_seqs
    blocks, slots = layout.split(
        budget_bytes, runner.block_size, sc.max_num_seqs, runner.max_model_len
    )
    if cc.num_state_slots is not None:
        freed = (slots - cc.num_state_slots) * layout.bytes_per_slot
        if layout.bytes_per_block:
            blocks += freed // layout.bytes_per_block
        slots = cc.num_state_slots
    logger.info(
        "cache kinds %s: %d KV blocks, %d state slots (%d B each)",
        "+".join(layout.kinds), blocks, slots, layout.bytes_per_slot,
    )  # fmt: skip
    return int(blocks), int(slots)


def alloc_caches(
    spec: ModelSpec,
    num_blocks: int,
    num_slots: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: attention (K, V) [N, S, Hkv, D]; state (conv [slots, C, K-1], ssm
    [slots, Hs, P, N]) float32, zeroed."""
    kinds = spec.extra.get("layer_kinds") or ["attention"] * spec.num_layers
    (c, k1), (hs, p, n) = state_shapes(spec)
    out: list[tuple[torch.Tensor, ...]] = []
    for kind in kinds:
        if kind == "attention":
            shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            out.append((torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device)))  # fmt: skip
        else:
            out.append((torch.zeros((num_slots, c, k1), dtype=torch.float32, device=device),
                        torch.zeros((num_slots, hs, p, n), dtype=torch.float32, device=device)))  # fmt: skip
    return out


def set_step_state(md: AttentionMetadata, states: list[ReqState], starts: list[int]) -> None:
    """The step's per-request state slots and fresh flags (a chunk starting at position 0 starts
    from a zero state), in batch order."""
    for st in states:
        if st.state_slot < 0:
            raise ValueError("a recurrent-state model got a request without a state slot")
    md.derived["state_slots"] = [st.state_slot for st in states]
    md.derived["state_fresh"] = [s == 0 for s in starts]
