"""Activations and the (gated) MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xlaserve.backends_torch.layers.linear import MergedLinear, make_linear, make_merged_linear
from xlaserve.config import KernelConfig
from xlaserve.kernels_cuda.quant_act import QuantAct

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # Nemotron, Arcee
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTS)}")
    return _ACTS[name]


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up; gate, up: [T, I] (the GPU path fuses this)."""
    return get_activation(act)(gate) * up


# Fused Triton gate kernels (kernels_cuda/activation.py) by activation: x [T, 2I] (gate | up).
_TRITON_GATED = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul", "gelu": "gelu_and_mul"}


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)); plain: down(act(up(x))). x: [T, H] -> [T, H].

    Canonical member names: gate_proj, up_proj, down_proj. `fused` (gated only): one
    `gate_up_proj` layer [2I, H] (gate rows first) instead of gate_proj and up_proj, one GEMM;
    its output [T, 2I] feeds the Triton act-and-mul kernel directly once `use_triton_ops` is set
    (CUDA + Triton attention, see CausalLMBase.set_triton_ops), else it is split (views).
    `kernels` (set by the model's `use_kernels`; None = defaults + environment): the batch-1
    gate-act GEMV switches.
    """

    kernels: KernelConfig | None = None

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        activation: str = "silu",
        gated: bool = True,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.act = get_activation(activation)
        self.gated = gated
        self.fused = gated and fused
        self.use_triton_ops = False
        if self.fused:
            self.gate_up_proj = make_merged_linear(
                hidden, [("gate_proj", intermediate, 1), ("up_proj", intermediate, 1)],
                bias, dtype, device,
            )  # fmt: skip
        elif gated:
            self.gate_proj = make_linear(hidden, intermediate, bias, dtype, device, "column")
        if not self.fused:
            self.up_proj = make_linear(hidden, intermediate, bias, dtype, device, "column")
        self.down_proj = make_linear(intermediate, hidden, bias, dtype, device, "row")

    def _gate_act_gemv(self, x: torch.Tensor) -> bool:
        """Whether a one-row x goes through `dense_gemv_gate_act` (act-and-mul in the gate_up
        GEMV's epilogue): Triton ops on, a plain (not quantized, not tensor-parallel) gate_up
        layer whose shape the dense GEMV serves, an activation the kernels know."""
        if not (self.use_triton_ops and x.numel() == x.shape[-1]):
            return False
        if getattr(self, "lora_attached", False):  # the LoRA hook needs gate_up's own output
            return False
        from xlaserve.kernels_cuda.activation import ACT_CODES
        from xlaserve.kernels_cuda.dense_gemv import gate_act_gemv_enabled, use_dense_gemv

        gu = self.gate_up_proj
        return (
            type(gu) is MergedLinear
            and gu.part_sizes[0] * 2 == gu.weight.shape[0]
            and self.activation in ACT_CODES
            and gu.weight.dtype == x.dtype
            and gate_act_gemv_enabled(self.kernels)
            and use_dense_gemv(1, *gu.weight.shape, x.dtype, x.device, self.kernels)
        )

    def _down_quant_fmt(self, gu: torch.Tensor, kernel: str) -> str | None:
        """The format ("int8" / "fp8") in which the SiLU-and-mul kernel should hand down_proj its
        input already quantized per token (KernelConfig.fuse_act_quant), or None: not SiLU, not
        a w8a8 down_proj that would quantize [T, I] with the Triton kernel, or LoRA attached
        (its down_proj delta needs the float input)."""
        if kernel != "silu_and_mul" or getattr(self, "lora_attached", False):
            return None
        fmt_of = getattr(self.down_proj, "quant_act_fmt", None)  # QuantLinear only
        if fmt_of is None:
            return None
        return fmt_of(gu[:, : gu.shape[1] // 2])

    def forward(self, x: torch.Tensor | QuantAct) -> torch.Tensor:
        """x [T, H] float, or a QuantAct for a w8a8 gate_up_proj (the post-attention norm's
        fused output, see layers.norm.norm_residual_for) -> [T, H]."""
        if self.fused:
            if not isinstance(x, QuantAct) and self._gate_act_gemv(x):
                # Batch-1 decode: act(gate) * up in the gate_up GEMV's epilogue.
                from xlaserve.kernels_cuda.dense_gemv import dense_gemv_gate_act

                gu = self.gate_up_proj
                a = dense_gemv_gate_act(
                    x.reshape(1, -1).contiguous(), gu.weight, gu.bias, self.activation,
                    kernels=self.kernels,
                )  # fmt: skip
                return self.down_proj(a.reshape(*x.shape[:-1], -1))
            gu = self.gate_up_proj(x)  # [T, 2I] (this rank's gate | up shards under TP)
            kernel = _TRITON_GATED.get(self.activation) if self.use_triton_ops else None
            if kernel is not None and gu.dim() == 2:
                from xlaserve import kernels_cuda

                fmt = self._down_quant_fmt(gu, kernel)
                if fmt is not None:  # w8a8 down_proj: the gate kernel quantizes its output
                    from xlaserve.kernels_cuda.fused_act_quant import silu_and_mul_quant

                    return self.down_proj(silu_and_mul_quant(gu, fmt))
                return self.down_proj(getattr(kernels_cuda, kernel)(gu, kernels=self.kernels))
            gate, up = gu.chunk(2, dim=-1)
            return self.down_proj(act_and_mul(gate, up, self.activation))
        if self.gated:
            return self.down_proj(act_and_mul(self.gate_proj(x), self.up_proj(x), self.activation))
        return self.down_proj(self.act(self.up_proj(x)))
