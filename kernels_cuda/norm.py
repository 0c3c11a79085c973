"""RMSNorm (Triton), plain and fused with the residual add.

Numerics (HF-like): the residual sum ``x + residual`` is rounded to the input dtype (that is what
the next layer sees as the residual), the norm is taken in fp32 from that rounded sum, multiplied
by ``weight + weight_offset`` in fp32 (``weight_offset=1.0`` for Gemma's ``(1 + w)`` weights),
and rounded once to the input dtype.
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
    next_pow2,
    pdl_kwargs,
    pdl_prologue,
    row_num_warps,
    use_pdl,
)

_MAX_BLOCK = 8192


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    # Pass 1: residual add (rounded to the storage dtype) and the sum of squares.
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
        hf = h.to(tl.float32)
        sq += hf * hf
    rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / hidden + eps)
    if HAS_RESIDUAL:
        tl.debug_barrier()  # pass 2 reads back what pass 1 stored
    # Pass 2: normalise (re-reading the rounded residual sum) and scale.
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        if HAS_RESIDUAL:
            h = tl.load(res_out_ptr + row * stride_ro + cols, mask=mask, other=0.0)
        else:
            h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
        y = h.to(tl.float32) * rstd * w
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [T, H], got shape {tuple(x.shape)}")
    if weight.ndim != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"{name}: weight must be [H={x.shape[1]}], got shape {tuple(weight.shape)}"
        )
    check_dtype(f"{name} x", x, FLOAT_DTYPES)
    check_dtype(f"{name} weight", weight, FLOAT_DTYPES)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"{name}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
            )
        if residual.dtype != x.dtype:
            raise ValueError(f"{name}: residual dtype {residual.dtype} != x dtype {x.dtype}")


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    kernels: KernelConfig | None,
) -> None:
    t, hidden = x.shape
    if t == 0:
        return
    block = min(_MAX_BLOCK, next_pow2(hidden))
    num_warps = row_num_warps(block)
    has_res = residual is not None
    _rms_norm_kernel[(t,)](
        x, residual if has_res else x, weight, out, res_out if has_res else out,
        x.stride(0), residual.stride(0) if has_res else 0, out.stride(0),
        res_out.stride(0) if has_res else 0,
        hidden, float(eps), float(weight_offset),
        HAS_RESIDUAL=has_res, BLOCK=block, num_warps=num_warps,
        USE_PDL=(pdl := use_pdl(x, kernels)), **pdl_kwargs(pdl),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out: torch.Tensor | None = None,
    *,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """RMSNorm: x [T, H], weight [H] -> [T, H] = x * rsqrt(mean(x^2) + eps) * (weight + offset)."""
    _check("rms_norm", x, weight, None)
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"rms_norm: out must match x {tuple(x.shape)} {x.dtype}")
    check_device("rms_norm", x, weight, out)
    for label, t in (("x", x), ("weight", weight), ("out", out)):
        check_last_dim_contiguous(f"rms_norm {label}", t)
    _launch(x, None, weight, out, None, eps, weight_offset, kernels)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    inplace: bool = False,
    *,
    kernels: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm in one pass.

    Args:
        x: [T, H] sublayer output; residual: [T, H] same dtype; weight: [H].
        inplace: write ``normed`` into ``x`` and ``new_residual`` into ``residual`` (no
            allocation: handy inside CUDA graphs).

    Returns:
        (normed [T, H], new_residual [T, H]) with new_residual = x + residual and
        normed = rms_norm(new_residual) * (weight + weight_offset).
    """
    _check("fused_add_rms_norm", x, weight, residual)
    check_device("fused_add_rms_norm", x, residual, weight)
    for label, t in (("x", x), ("residual", residual), ("weight", weight)):
        check_last_dim_contiguous(f"fused_add_rms_norm {label}", t)
    if inplace:
        out, res_out = x, residual
    else:
        out, res_out = torch.empty_like(x), torch.empty_like(residual)
    _launch(x, residual, weight, out, res_out, eps, weight_offset, kernels)
    return out, res_out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> torch.Tensor:
    """Torch reference of :func:`rms_norm` (fp32 math, one rounding)."""
    _check("rms_norm_ref", x, weight, None)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (weight.float() + weight_offset)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`fused_add_rms_norm` -> (normed, new_residual)."""
    _check("fused_add_rms_norm_ref", x, weight, residual)
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps, weight_offset), new_residual
