"""Normalization layers. Statistics are computed in float32 whatever the activation dtype (as HF)."""

from __future__ import annotations

import torch
from torch import nn

from xlaserve.config import KernelConfig
from xlaserve.kernels_cuda.quant_act import QuantAct


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + w). x: [..., dim]. offset is 1.0 for Gemma-style weights."""

    kernels: KernelConfig | None = None  # fused add + norm launch switches (model.use_kernels)

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        weight_offset: float = 0.0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            # Gemma multiplies in float32 before the cast.
            return (x32 * (self.weight_offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the fused kernel's contract (GPU path fuses it)."""
        if x.is_cuda and residual is not None and x.dim() == 2:  # one Triton pass, fp32 math
            from xlaserve.kernels_cuda import fused_add_rms_norm

            return fused_add_rms_norm(
                x, residual, self.weight, self.eps, self.weight_offset, inplace=False,
                kernels=self.kernels,
            )  # fmt: skip
        if residual is not None:
            x = x + residual
        return self.forward(x), x


def norm_residual_for(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, consumer: nn.Module | None
) -> tuple[torch.Tensor | QuantAct, torch.Tensor]:
    """norm.forward_residual(x, residual) -> (normed [T, H], x + residual [T, H]), with the normed
    rows handed as a per-token `QuantAct` when `consumer` (the linear that reads them next)
    would quantize them itself: one `rms_norm_quant` kernel instead of the norm then the
    consumer's `quant_rows` (the same math; see kernels_cuda/fused_act_quant.py). That takes
    an RMSNorm, a consumer whose `quant_act_fmt(x)` names a format (a w8a8 QuantLinear on CUDA
    with KernelConfig.fuse_act_quant on, above its GEMV rows), no forward hooks on it (LoRA's
    hook reads the float input) and a residual to add."""
    fmt_of = getattr(consumer, "quant_act_fmt", None)
    fmt = None
    # With a residual only: forward_residual then runs the fused add + norm kernel, whose math
    # rms_norm_quant reproduces; the first layer's plain norm rounds in torch ops.
    if fmt_of is not None and type(norm) is RMSNorm and residual is not None:
        fmt = None if consumer._forward_hooks else fmt_of(x)
    if fmt is None:
        return norm.forward_residual(x, residual)
    from xlaserve.kernels_cuda.fused_act_quant import rms_norm_quant

    return rms_norm_quant(x, norm.weight, norm.eps, fmt, residual, norm.weight_offset)


class LayerNorm(nn.Module):
    """Standard LayerNorm over the last dim (with optional bias). x: [..., dim]."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        b = self.bias.float() if self.bias is not None else None
        y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), w, b, self.eps)
        return y.to(x.dtype)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return self.forward(x), x


def make_norm(
    kind: str,
    dim: int,
    eps: float,
    weight_offset: float = 0.0,
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """ "rms" -> RMSNorm, "layer" -> LayerNorm."""
    if kind == "rms":
        return RMSNorm(dim, eps, weight_offset, dtype=dtype, device=device)
    if kind == "layer":
        return LayerNorm(dim, eps, bias=bias, dtype=dtype, device=device)
    raise ValueError(f"unknown norm kind {kind!r} (expected 'rms' or 'layer')")
