"""The tensor-parallel process group of this process (one per process, set once by a worker).

Two groups over the same ranks: `device_group` carries tensors (NCCL on CUDA, gloo on CPU) and
`cpu_group` (always gloo) carries pickled control messages (SchedulerOutputs, commands), so an
NCCL group never has to move Python objects.

Layers ask `tp_world_size()` / `tp_rank()` when they are built; with no group both answer as a
single device (1 / 0), so models built outside a TP worker are plain.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int
    world_size: int
    # Tensors: all-reduce after row-parallel linears, all-gather of vocab-parallel logits.
    device_group: dist.ProcessGroup
    # Pickled objects (broadcast of each step's SchedulerOutput): gloo.
    cpu_group: dist.ProcessGroup
    backend: str


_TP: TPGroup | None = None


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str | None = None,
    backend: str = "gloo",
    timeout_s: float = 1800.0,
    store: dist.Store | None = None,
) -> TPGroup:
    """Join the default process group (`init_method` e.g. "tcp://127.0.0.1:29500", or an
    existing `store`) and make the TP groups. backend: "nccl" (CUDA) or "gloo" (CPU)."""
    global _TP
    if _TP is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        init_method=None if store is not None else init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo")
    _TP = TPGroup(rank, world_size, device_group, cpu_group, backend)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP is None:
        return
    _TP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_group() -> TPGroup | None:
    return _TP


def tp_world_size() -> int:
    return 1 if _TP is None else _TP.world_size


def tp_rank() -> int:
    return 0 if _TP is None else _TP.rank


def kv_heads_per_rank(num_kv_heads: int) -> int:
    """KV heads each rank holds: total / tp, or 1 (replicated) when there are fewer than tp."""
    return max(1, num_kv_heads // tp_world_size())


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the TP ranks (in place when possible); identity without a group."""
    if _TP is None or _TP.world_size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=_TP.device_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenation of every rank's x along `dim`, in rank order; identity without a group."""
    if _TP is None or _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.device_group)
    return torch.cat(parts, dim=dim)
