"""Gated activations (Triton): ``act(x[:, :I]) * x[:, I:]`` for SwiGLU / GeGLU MLPs.

Math in fp32, one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xlaserve.config import KernelConfig

from ._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    pdl_kwargs,
    pdl_prologue,
    use_pdl,
)

# Activation codes of `apply_activation` (shared with the fused MoE kernel).
ACT_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3}


@triton.jit
def apply_activation(x, ACT: tl.constexpr):
    """act(x) for an fp32 tile, in overflow-free forms: silu from exp(-|x|) (a stable sigmoid),
    gelu_tanh with tanh from exp(-2|u|), exact gelu through erf, relu."""
    if ACT == 0:
        z = tl.exp(-tl.abs(x))
        y = x * tl.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))
    elif ACT == 1:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = tl.exp(-2.0 * tl.abs(u))
        th = (1.0 - e) / (1.0 + e)
        th = tl.where(u < 0, -th, th)
        y = 0.5 * x * (1.0 + th)
    elif ACT == 2:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    else:
        y = tl.maximum(x, 0.0)
    return y


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_xt,
    stride_ot,
    inter,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + tok * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + tok * stride_xt + inter + cols, mask=mask, other=0.0).to(tl.float32)
    a = apply_activation(gate, ACT)
    tl.store(out_ptr + tok * stride_ot + cols, (a * up).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, out: torch.Tensor | None, act: str, kernels: KernelConfig | None
) -> torch.Tensor:
    name = f"{act}_and_mul"
    if x.ndim != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"{name}: x must be [T, 2I], got shape {tuple(x.shape)}")
    check_dtype(name, x, FLOAT_DTYPES)
    t, two_i = x.shape
    inter = two_i // 2
    if out is None:
        out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (t, inter) or out.dtype != x.dtype:
        raise ValueError(
            f"{name}: out must be [T, I] = {(t, inter)} of {x.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    check_device(name, x, out)
    check_last_dim_contiguous(f"{name} x", x)
    check_last_dim_contiguous(f"{name} out", out)
    if t == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (t, triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, ACT=ACT_CODES[act], BLOCK=block, num_warps=4,
        USE_PDL=(pdl := use_pdl(x, kernels)), **pdl_kwargs(pdl),
    )  # fmt: skip
    return out


def silu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, *, kernels: KernelConfig | None = None
) -> torch.Tensor:
    """SwiGLU gate: x [T, 2I] (gate | up) -> silu(gate) * up, [T, I] (``out`` if given)."""
    return _launch(x, out, "silu", kernels)


def gelu_tanh_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, *, kernels: KernelConfig | None = None
) -> torch.Tensor:
    """GeGLU gate (tanh approximation, Gemma): x [T, 2I] -> gelu_tanh(gate) * up, [T, I]."""
    return _launch(x, out, "gelu_tanh", kernels)


def gelu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, *, kernels: KernelConfig | None = None
) -> torch.Tensor:
    """GeGLU gate (exact erf GELU): x [T, 2I] -> gelu(gate) * up, [T, I]."""
    return _launch(x, out, "gelu", kernels)


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.ndim != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [T, 2I], got shape {tuple(x.shape)}")
    gate, up = x.float().chunk(2, dim=-1)
    return gate, up


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`silu_and_mul` (fp32 math)."""
    gate, up = _split(x)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`gelu_tanh_and_mul` (fp32 math)."""
    gate, up = _split(x)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)


def gelu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`gelu_and_mul` (fp32 math)."""
    gate, up = _split(x)
    return (torch.nn.functional.gelu(gate) * up).to(x.dtype)
