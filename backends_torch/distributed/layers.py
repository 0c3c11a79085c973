"""Tensor-parallel layers. Each holds its rank's shard and knows how to cut it from the full
checkpoint tensor (`shard_array`), so weight loading stays "canonical name -> full array".

- ColumnParallelLinear: W [out/tp, in] (the output split); the output stays split (heads, or
  the MLP's intermediate features), no communication. MergedColumnParallelLinear: the same for
  fused q/k/v and gate/up (each member's shard, concatenated).
- RowParallelLinear: W [out, in/tp] (the input split); partial sums are all-reduced, then the
  bias is added once. o_proj, down_proj.
- VocabParallelEmbedding: rows [r * Vr, (r + 1) * Vr) of the (padded) table; ids outside the
  rank's range contribute zeros and the partial embeddings are all-reduced. Used tied as the
  lm head: local logits [B, Vr] are all-gathered to [B, V].
- ParallelLMHead: an untied lm head split by vocab rows, logits all-gathered.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from xlaserve.backends_torch.distributed.parallel_state import (
    tp_all_gather,
    tp_all_reduce,
    tp_rank,
    tp_world_size,
)
from xlaserve.backends_torch.layers.linear import Linear, MergedLinear, fused_members


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


class ColumnParallelLinear(Linear):
    """x [..., in] -> this rank's output columns [..., out / tp].

    `replicas` > 1 gives groups of `replicas` consecutive ranks the same shard (KV heads fewer
    than ranks: each KV head is held by tp / num_kv_heads ranks).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        replicas: int = 1,
    ) -> None:
        tp = tp_world_size()
        if tp % replicas:
            raise ValueError(f"replicas {replicas} must divide tensor_parallel_size {tp}")
        self.num_shards = tp // replicas
        self.shard_id = tp_rank() // replicas
        self.full_out = out_features
        local = _split(out_features, self.num_shards, "output features")
        super().__init__(in_features, local, bias, dtype, device)

    def shard_array(self, part: str, arr: np.ndarray) -> np.ndarray:
        """Full `weight` [out, in] / `bias` [out] -> this rank's rows."""
        n = self.out_features
        return arr[self.shard_id * n : (self.shard_id + 1) * n]


class MergedColumnParallelLinear(MergedLinear):
    """A fused column layer (q/k/v, gate/up) under TP: this rank's shard of every member,
    concatenated in member order, so the local output splits like the full one.

    parts: (canonical name, full out_features, replicas) per member; a member's shard is what
    `ColumnParallelLinear(in, out, replicas=replicas)` would hold on this rank (KV heads fewer
    than ranks: k/v shards repeat over `replicas` consecutive ranks).
    """

    def __init__(
        self,
        in_features: int,
        parts: Sequence[tuple[str, int, int]],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        tp, rank = tp_world_size(), tp_rank()
        sizes, shard_ids, full = [], [], []
        for name, out, replicas in parts:
            if tp % replicas:
                raise ValueError(
                    f"{name}: replicas {replicas} must divide tensor_parallel_size {tp}"
                )
            shards = tp // replicas
            sizes.append(_split(out, shards, f"{name} output features"))
            shard_ids.append(rank // replicas)
            full.append(out)
        super().__init__(in_features, [p[0] for p in parts], sizes, bias, dtype, device)
        self.shard_ids, self.full_sizes = tuple(shard_ids), tuple(full)

    def shard_array(self, part: str, arr: np.ndarray, member: int | None = None) -> np.ndarray:
        """Member `member`'s full `weight` [out_i, in] / `bias` [out_i] -> this rank's rows of it;
        member None: the fused full tensor [sum(out_i), ...] -> the concatenated shards."""
        if member is not None:
            n, sid = self.part_sizes[member], self.shard_ids[member]
            return arr[sid * n : (sid + 1) * n]
        if arr.shape[0] != sum(self.full_sizes):
            raise ValueError(
                f"fused tensor has {arr.shape[0]} rows, expected {sum(self.full_sizes)}"
            )
        bounds = np.cumsum([0, *self.full_sizes])
        return np.concatenate(
            [
                self.shard_array(part, arr[bounds[i] : bounds[i + 1]], i)
                for i in range(len(bounds) - 1)
            ]
        )


class RowParallelLinear(Linear):
    """x [..., in / tp] (this rank's input features) -> all-reduced [..., out]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.full_in = in_features
        self.rank = tp_rank()
        super().__init__(
            _split(in_features, tp_world_size(), "input features"),
            out_features,
            bias,
            dtype,
            device,
        )

    def shard_array(self, part: str, arr: np.ndarray) -> np.ndarray:
        """Full `weight` [out, in] -> this rank's columns; the bias stays whole."""
        if part == "bias":
            return arr
        k, r = self.in_features, self.rank
        return arr[:, r * k : (r + 1) * k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class _VocabShard(nn.Module):
    """Rows [start, start + Vr) of a [V, H] table padded to a multiple of tp (pad rows zero)."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        tp = tp_world_size()
        self.num_embeddings = num_embeddings
        self.rows = -(-num_embeddings // tp)  # Vr
        self.start = tp_rank() * self.rows
        self.weight = nn.Parameter(
            torch.zeros(self.rows, dim, dtype=dtype, device=device), requires_grad=False
        )

    def shard_array(self, part: str, arr: np.ndarray) -> np.ndarray:
        """Full [V, H] -> this rank's rows, zero-padded to Vr."""
        out = arr[self.start : self.start + self.rows]
        if out.shape[0] < self.rows:
            pad = np.zeros((self.rows - out.shape[0], *arr.shape[1:]), dtype=arr.dtype)
            out = np.concatenate([out, pad])
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> full logits [B, V] (local [B, Vr] all-gathered, padding dropped)."""
        return tp_all_gather(F.linear(hidden, self.weight), dim=-1)[..., : self.num_embeddings]


class VocabParallelEmbedding(_VocabShard):
    """ids [T] -> [T, H]; each rank embeds the ids in its row range, partials are summed."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        return tp_all_reduce(x)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied embeddings: hidden [B, H] -> logits [B, V]."""
        return self.logits(hidden)


class ParallelLMHead(_VocabShard):
    """Untied lm head: hidden [B, H] -> logits [B, V] (rows split by vocab, all-gathered)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)


def tp_weight_stream(
    model: nn.Module, weights: Iterable[tuple[str, np.ndarray]]
) -> Iterator[tuple[str, np.ndarray]]:
    """Canonical (name, full array) pairs -> pairs with parallel layers' tensors cut to this
    rank's shard (what `model.load_weights` expects of a TP model). A member of a fused layer
    (e.g. k_proj of qkv_proj) keeps its name and is cut to its own shard."""
    sharded = {n: m for n, m in model.named_modules() if hasattr(m, "shard_array")}
    members = {k: s for k, s in fused_members(model).items() if hasattr(s.module, "shard_array")}
    for name, arr in weights:
        prefix, _, part = name.rpartition(".")
        mod = sharded.get(prefix)
        if mod is not None:
            yield name, mod.shard_array(part, arr)
        elif prefix in members:
            slot = members[prefix]
            yield name, slot.module.shard_array(part, arr, slot.index)
        else:
            yield name, arr
