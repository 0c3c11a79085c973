"""The torch runner's side of recurrent-state models (Mamba, Mamba2, hybrids; core/cache_spec.py).

- `check_state_model_config`: what such models cannot do yet, refused at start-up with a clear
  error (speculative decoding: a rejected draft would need the state rewound; KV offload and a
  quantized KV cache; tensor parallelism).
- `split_cache` (determine_num_kv_blocks): ONE budget of bytes -> (KV blocks, state slots); the
  spare scratch slot is paid out of the budget first.
- `alloc_caches`: per layer, (K, V) [N, S, Hkv, D] for attention layers and (conv state
  [slots + 1, C, K-1], ssm state [slots + 1, Hs, P, N]) float32 for state layers; the last row
  is the scratch slot (index `slots`): padding rows of decode CUDA graphs and warm-up steps read
  and write it, no request ever holds it (the cache manager hands out 0 .. slots - 1).
- `step_state` / `set_step_state`: the step's slots and fresh flags (the model reads
  `md.derived["state_slots"]` / `["state_fresh"]`).
CUDA graphs (cuda_graphs.py) capture their decode steps (every request one token) like those of
attention models; prefill / mixed steps run eagerly, and so does everything with enforce_eager.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from xlaserve.model_loader.spec import ModelSpec
from xlaserve.model_loader.ssm import (
    cache_layout,
    check_state_model_config,
    is_state_model,
    plan_state_cache,
    state_shapes,
)

if TYPE_CHECKING:
    from xlaserve.backends_torch.layers.attention import AttentionMetadata
    from xlaserve.backends_torch.runner import TorchModelRunner
    from xlaserve.runner_core import ReqState

logger = logging.getLogger(__name__)

__all__ = ["check_state_model_config", "is_state_model"]


def split_cache(runner: TorchModelRunner, budget_bytes: int | None) -> tuple[int, int]:
    """(num KV blocks, num state slots) of the runner's model (ssm.plan_state_cache); the
    scratch slot (`alloc_caches`) comes out of budget_bytes first."""
    elem = runner.dtype.itemsize
    if budget_bytes is not None:
        budget_bytes -= cache_layout(runner.spec, elem, runner.block_size).bytes_per_slot
    return plan_state_cache(runner.spec, runner.config, elem, runner.block_size,
                            runner.max_model_len, budget_bytes)  # fmt: skip


def alloc_caches(
    spec: ModelSpec,
    num_blocks: int,
    num_slots: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: attention (K, V) [N, S, Hkv, D]; state (conv [slots + 1, C, K-1], ssm
    [slots + 1, Hs, P, N]) float32, zeroed, row `slots` the scratch slot; Falcon-H1's
    "parallel" layers ((K, V), (conv, ssm)); Nemotron-H's "mlp" layers two empty tensors."""
    kinds = spec.extra.get("layer_kinds") or ["attention"] * spec.num_layers
    (c, k1), (hs, p, n) = state_shapes(spec)
    kv_shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)

    def zeros(shape: tuple[int, ...], dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dt, device=device)

    def kv() -> tuple[torch.Tensor, torch.Tensor]:
        return zeros(kv_shape, dtype), zeros(kv_shape, dtype)

    def state() -> tuple[torch.Tensor, torch.Tensor]:
        return zeros((num_slots + 1, c, k1)), zeros((num_slots + 1, hs, p, n))

    out: list[tuple] = []
    for kind in kinds:
        if kind == "attention":
            out.append(kv())
        elif kind == "parallel":
            out.append((kv(), state()))
        elif kind == "mlp":
            out.append((zeros((0,)), zeros((0,))))
        else:
            out.append(state())
    return out


def step_state(states: list[ReqState], starts: list[int]) -> tuple[list[int], list[bool]]:
    """The step's per-request state slots and fresh flags (a chunk starting at position 0 starts
    from a zero state), in batch order."""
    for st in states:
        if st.state_slot < 0:
            raise ValueError("a recurrent-state model got a request without a state slot")
    return [st.state_slot for st in states], [s == 0 for s in starts]


def set_step_state(md: AttentionMetadata, states: list[ReqState], starts: list[int]) -> None:
    """`step_state` into the attention metadata (the models' md.derived contract)."""
    md.derived["state_slots"], md.derived["state_fresh"] = step_state(states, starts)
