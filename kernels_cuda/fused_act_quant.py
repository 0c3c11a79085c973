"""Per-token activation quantization fused into the kernel that produces the activation.

A w8a8 linear quantizes its input per token (`scaled_mm.quant_rows`): one extra launch and one
extra pass over the activations per linear. Here the producer emits the quantized activation
directly (as vLLM does):

* `rms_norm_quant`: (residual add +) RMSNorm -> `QuantAct` (the input of qkv / gate_up),
* `silu_and_mul_quant`: silu(gate) * up -> `QuantAct` (the input of down).

Bit-identity rule: the unfused path rounds the norm / activation output to the activation dtype
(bf16 / fp16 / fp32) and then quantizes that rounded row. The fused kernels do the same: the row
is computed in fp32, rounded to the activation dtype, its absmax taken, then recomputed (same
expression, so the same bits) and quantized with `quant_rows`' rule (scale = max(amax, 1e-12) /
QMAX; int8 half away from zero clamped to +-127; fp8 clamp to +-448 then the RTNE e4m3 cast). So
``scaled_mm`` on a `QuantAct` gives the unfused w8a8 linear's bits in exact arithmetic. Compiled,
the two kernels may still differ in the last bit of a row's statistics (on the H100 the scales
did, 2026-12-05: each kernel's own multiply-add contraction and reduction order), so a few codes
land one step apart; the tests hold them to that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xlaserve.kernels_cuda._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    interpret_mode,
    next_pow2,
    row_num_warps,
)
from xlaserve.kernels_cuda.activation import silu_and_mul_ref
from xlaserve.kernels_cuda.norm import fused_add_rms_norm_ref, rms_norm_ref
from xlaserve.kernels_cuda.scaled_mm import (
    QuantAct,
    _qmax,
    _round_half_away,
    _to_fp8,
    quant_rows_ref,
)

# The RMSNorm blocking and warps of norm.py (its _launch): the sum of squares must be reduced in
# the same order for rstd to have the same bits. The activation has no reduction but the absmax.
_NORM_MAX_BLOCK = 8192
_ACT_MAX_BLOCK = 4096


@triton.jit
def _quantize(y, s, QMAX: tl.constexpr, INT8: tl.constexpr, q_dtype, RNE_FIX: tl.constexpr):
    # y f32 (already rounded to the activation dtype), s the row scale: quant_rows' rule.
    v = y / s
    if INT8:
        q = tl.minimum(tl.maximum(_round_half_away(v), -127), 127).to(tl.int8)
    else:
        q = _to_fp8(tl.minimum(tl.maximum(v, -QMAX), QMAX), q_dtype, RNE_FIX)
    return q


@triton.jit
def _normed_tile(
    x_ptr, res_out_ptr, w_ptr, row, cols, mask, stride_x, stride_ro, rstd, weight_offset,
    act_dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Columns `cols` of the normed row as the unfused path stores it (rounded to the
    activation dtype), in fp32; read back from pass 1's residual sum when there is one."""
    if HAS_RESIDUAL:
        h = tl.load(res_out_ptr + row * stride_ro + cols, mask=mask, other=0.0)
    else:
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    return (h.to(tl.float32) * rstd * w).to(act_dtype).to(tl.float32)


@triton.jit
def _silu_mul_tile(x_ptr, row, cols, mask, stride_x, inter, act_dtype: tl.constexpr):
    """Columns `cols` of silu(gate) * up as silu_and_mul stores it (rounded), in fp32."""
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.exp(-tl.abs(g))  # the stable sigmoid of activation.apply_activation
    a = g * tl.where(g >= 0, 1.0 / (1.0 + z), z / (1.0 + z))
    return (a * u).to(act_dtype).to(tl.float32)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, res_out_ptr, q_ptr, s_ptr,
    stride_x, stride_r, stride_ro, stride_q,
    hidden, eps, weight_offset,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr,
    RNE_FIX: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    act_dtype = x_ptr.dtype.element_ty
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    # Pass 1: residual add (rounded to the activation dtype, stored) and the sum of squares.
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(act_dtype)
            tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
        hf = h.to(tl.float32)
        sq += hf * hf
    rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / hidden + eps)
    if HAS_RESIDUAL:
        tl.debug_barrier()  # passes 2 and 3 read back what pass 1 stored
    # Pass 2: absmax of the normed row as the unfused path would store it (rounded).
    run = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        y = _normed_tile(x_ptr, res_out_ptr, w_ptr, row, cols, mask, stride_x, stride_ro, rstd,
                         weight_offset, act_dtype, HAS_RESIDUAL)  # fmt: skip
        run = tl.maximum(run, tl.abs(y))
    s = tl.maximum(tl.max(run, 0), 1e-12) / QMAX
    tl.store(s_ptr + row, s)
    # Pass 3: recompute (same bits) and quantize.
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        y = _normed_tile(x_ptr, res_out_ptr, w_ptr, row, cols, mask, stride_x, stride_ro, rstd,
                         weight_offset, act_dtype, HAS_RESIDUAL)  # fmt: skip
        q = _quantize(y, s, QMAX, INT8, q_ptr.dtype.element_ty, RNE_FIX)
        tl.store(q_ptr + row * stride_q + cols, q, mask=mask)


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, inter,
    BLOCK: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr, RNE_FIX: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    act_dtype = x_ptr.dtype.element_ty
    run = tl.zeros([BLOCK], dtype=tl.float32)
    # Pass 1: absmax of silu(gate) * up rounded to the activation dtype (what silu_and_mul stores).
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < inter
        run = tl.maximum(run, tl.abs(_silu_mul_tile(x_ptr, row, cols, mask, stride_x, inter,
                                                    act_dtype)))  # fmt: skip
    s = tl.maximum(tl.max(run, 0), 1e-12) / QMAX
    tl.store(s_ptr + row, s)
    # Pass 2: recompute (same bits; the re-read hits L2) and quantize.
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < inter
        y = _silu_mul_tile(x_ptr, row, cols, mask, stride_x, inter, act_dtype)
        q = _quantize(y, s, QMAX, INT8, q_ptr.dtype.element_ty, RNE_FIX)
        tl.store(q_ptr + row * stride_q + cols, q, mask=mask)


def _empty_quant(m: int, k: int, fmt: str, dtype: torch.dtype, device: torch.device) -> QuantAct:
    qdt = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    q = torch.empty((m, k), dtype=qdt, device=device)
    s = torch.empty((m, 1), dtype=torch.float32, device=device)
    if m == 0 or k == 0:
        s.fill_(1e-12 / _qmax(fmt))
    return QuantAct(q, s, dtype)


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    fmt: str,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
) -> tuple[QuantAct, torch.Tensor | None]:
    """(Residual add +) RMSNorm with per-token quantization of the output.

    x [T, H] float, weight [H], residual None or [T, H] like x; fmt "int8" / "fp8".
    Returns (QuantAct(q [T, H] int8 / float8_e4m3fn, scale float32 [T, 1], dtype=x.dtype),
    new_residual [T, H] = x + residual rounded to x.dtype, or None without a residual).
    The math of quant_rows(rms_norm(...)) / quant_rows(fused_add_rms_norm(...)[0]) (module
    docstring: the same bits but for the last bit of a row's statistics on a GPU).
    """
    qmax = _qmax(fmt)
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"rms_norm_quant: x must be [T, H] and weight [H], got {tuple(x.shape)} "
            f"and {tuple(weight.shape)}"
        )
    check_dtype("rms_norm_quant x", x, FLOAT_DTYPES)
    check_dtype("rms_norm_quant weight", weight, FLOAT_DTYPES)
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("rms_norm_quant: residual must match x in shape and dtype")
        tensors.append(residual)
    check_device("rms_norm_quant", *tensors)
    for t in tensors:
        check_last_dim_contiguous("rms_norm_quant", t)
    t_, hidden = x.shape
    out = _empty_quant(t_, hidden, fmt, x.dtype, x.device)
    res_out = torch.empty_like(residual) if residual is not None else None
    if t_ == 0 or hidden == 0:
        return out, res_out
    block = min(_NORM_MAX_BLOCK, next_pow2(hidden))
    has_res = residual is not None
    _rms_norm_quant_kernel[(t_,)](
        x, residual if has_res else x, weight, res_out if has_res else x, out.q, out.scale,
        x.stride(0), residual.stride(0) if has_res else 0, res_out.stride(0) if has_res else 0,
        out.q.stride(0), hidden, float(eps), float(weight_offset),
        HAS_RESIDUAL=has_res, BLOCK=block, QMAX=qmax, INT8=fmt == "int8",
        RNE_FIX=interpret_mode(), num_warps=row_num_warps(block),
    )  # fmt: skip
    return out, res_out


def silu_and_mul_quant(x: torch.Tensor, fmt: str) -> QuantAct:
    """SwiGLU gate with per-token quantization: x [T, 2I] (gate | up) float -> QuantAct(q
    [T, I], scale float32 [T, 1], dtype=x.dtype); the math of quant_rows(silu_and_mul(x))."""
    qmax = _qmax(fmt)
    if x.ndim != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"silu_and_mul_quant: x must be [T, 2I], got {tuple(x.shape)}")
    check_dtype("silu_and_mul_quant x", x, FLOAT_DTYPES)
    check_device("silu_and_mul_quant", x)
    check_last_dim_contiguous("silu_and_mul_quant x", x)
    t, inter = x.shape[0], x.shape[1] // 2
    out = _empty_quant(t, inter, fmt, x.dtype, x.device)
    if t == 0 or inter == 0:
        return out
    block = min(_ACT_MAX_BLOCK, next_pow2(inter))
    _silu_mul_quant_kernel[(t,)](
        x, out.q, out.scale, x.stride(0), out.q.stride(0), inter,
        BLOCK=block, QMAX=qmax, INT8=fmt == "int8", RNE_FIX=interpret_mode(),
        num_warps=row_num_warps(block),
    )  # fmt: skip
    return out


# ---- references ----------------------------------------------------------------------------------


def rms_norm_quant_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    fmt: str,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
) -> tuple[QuantAct, torch.Tensor | None]:
    """Torch reference of `rms_norm_quant`: the unfused chain, norm then `quant_rows_ref`."""
    if residual is None:
        y, new_res = rms_norm_ref(x, weight, eps, weight_offset), None
    else:
        y, new_res = fused_add_rms_norm_ref(x, residual, weight, eps, weight_offset)
    q, s = quant_rows_ref(y, fmt)
    return QuantAct(q, s, x.dtype), new_res


def silu_and_mul_quant_ref(x: torch.Tensor, fmt: str) -> QuantAct:
    """Torch reference of `silu_and_mul_quant`: silu_and_mul_ref then `quant_rows_ref`."""
    q, s = quant_rows_ref(silu_and_mul_ref(x), fmt)
    return QuantAct(q, s, x.dtype)
