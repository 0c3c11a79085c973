"""What every Torch model shares: weight loading (canonical names), dummy init, dtype helpers."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from xlaserve.config import KernelConfig, kernel_switch


def triton_ops_default(
    device: str | torch.device, backend: object, kernels: KernelConfig | None = None
) -> bool:
    """Whether a model routes rotary and the gated activation through the Triton kernels:
    KernelConfig.triton_ops "on" / "off" forces it (on needs CUDA or TRITON_INTERPRET=1), "auto"
    is on exactly when the device is CUDA and the attention backend (an AttentionBackend) runs
    Triton kernels."""
    mode = kernel_switch("triton_ops", kernels)
    if mode != "auto":
        return mode == "on"
    return torch.device(device).type == "cuda" and backend.triton_kernels


_NP_TO_TORCH = {
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
}


def numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    """A host tensor viewing (or, for read-only mmaps, copying) `a`; bf16 via its uint16 bits."""
    if a.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16).copy()).view(torch.bfloat16)
    if a.dtype not in _NP_TO_TORCH:
        raise ValueError(f"unsupported weight dtype {a.dtype}")
    # np.array copies read-only memory-mapped views (torch.from_numpy wants writable memory).
    return torch.from_numpy(np.array(a, copy=True) if not a.flags.writeable else a)


class CausalLMBase(nn.Module):
    """Parameters are named by the canonical names of `model_loader/spec.py` (fused layers hold
    their canonical members' rows, see `load_weights`)."""

    triton_ops: bool = False  # set_triton_ops

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        """Copy (canonical name, array) pairs onto the parameters one tensor at a time, casting to
        the parameter's dtype. Unknown names, shape mismatches and missing weights raise.

        Fused layers (`MergedLinear`: qkv_proj, gate_up_proj): a member's tensor (e.g.
        "layers.0.self_attn.k_proj.weight") is copied straight into its row range of the fused
        parameter (no extra copy), and a fused tensor ("...qkv_proj.weight") loads whole, so
        separate and fused checkpoints both load."""
        from xlaserve.backends_torch.layers.linear import fused_members

        params = dict(self.named_parameters())
        members = fused_members(self)
        loaded: set[str] = set()
        filled: dict[str, set[int]] = {}  # fused parameter -> indices of the members loaded
        for name, arr in weights:
            key, slot = name, None
            if name not in params:
                prefix, _, part = name.rpartition(".")
                slot = members.get(prefix)
                key = f"{slot.prefix}.{part}" if slot is not None else name
                if key not in params:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}"
                    )
            p = params[key]
            if slot is not None:
                got = filled.setdefault(key, set())
                if part != "perm":  # per-row tensors: the member's row range
                    p = p[slot.start : slot.start + slot.rows]
                elif got and not torch.equal(p.cpu(), numpy_to_torch(arr).to(p.dtype)):
                    # GPTQ act-order: one input permutation [K] serves all members or none.
                    raise ValueError(
                        f"{name}: act-order permutation differs from the other members of "
                        f"{slot.prefix}; such layers cannot be fused"
                    )
                got.add(slot.index)
                if len(got) == len(slot.module.part_names):
                    loaded.add(key)
            if tuple(arr.shape) != tuple(p.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(arr.shape)} != model shape {tuple(p.shape)}"
                )
            with torch.no_grad():
                p.copy_(numpy_to_torch(arr).to(device=p.device, dtype=p.dtype))
            if slot is None:
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"weights missing from the checkpoint: {', '.join(missing[:8])}"
                + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            )

    def use_kernels(self, kernels: KernelConfig) -> None:
        """Hand `kernels` to every layer that launches kernels by it (modules with a `kernels`
        attribute: Linear, MLP, ...); run again after layers are swapped (quantization)."""
        self.kernels = kernels
        for m in self.modules():
            if m is not self and hasattr(m, "kernels"):
                m.kernels = kernels

    def set_triton_ops(self, enabled: bool) -> None:
        """Route rotary (in place on q/k) and the fused gate_up activation through the Triton
        kernels of kernels_cuda (CUDA, or CPU tensors under TRITON_INTERPRET=1), or back to torch
        ops. Layers with the same rope share one cos/sin table [P, R] float32. DecoderForCausalLM
        turns it on by itself on CUDA with the Triton attention backend (`triton_ops_default`)."""
        from xlaserve.backends_torch.layers.activation import MLP
        from xlaserve.backends_torch.layers.rotary import RotaryEmbedding

        tables: dict[tuple, torch.Tensor] = {}
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                table = None
                if enabled:
                    key = m.table_key()
                    if key not in tables:
                        tables[key] = m.cos_sin_table()
                    table = tables[key]
                m.enable_triton(table)
            elif isinstance(m, MLP):
                m.use_triton_ops = enabled
        self.triton_ops = enabled

    def cover_positions(self, n: int) -> None:
        """Make every rotary's Triton cos/sin table cover positions < n (the engine's
        max_model_len): the table is sized from the model's rope (rope_table_len) and the kernel
        does not bounds-check, while the engine allows max_model_len past max_position_embeddings
        whenever the config declares rope scaling. Rows past the old length come from the same
        inv_freq, as the torch path computes them. Tables shared before stay shared."""
        from xlaserve.backends_torch.layers.rotary import RotaryEmbedding

        grown = False
        for m in self.modules():
            if isinstance(m, RotaryEmbedding) and m.table_len < n:
                m.table_len = n
                grown = True
        if grown and self.triton_ops:
            self.set_triton_ops(True)  # rebuild the (shared) tables at the new length

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random normal(0, std) for matrices and biases; norm weights stay at their init (ones)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(0.0 if getattr(self, "_norm_offset", 0.0) else 1.0)
                    continue
                if p.is_cuda:  # 8B parameters: seconds on the GPU, minutes on the host
                    if g.device != p.device:
                        g = torch.Generator(device=p.device).manual_seed(seed)
                    p.normal_(0.0, std, generator=g)
                    continue
                w = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
                p.copy_(w.to(device=p.device, dtype=p.dtype))
