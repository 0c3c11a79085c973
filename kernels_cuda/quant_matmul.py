"""Weight-only quantized matmuls (int8 per-channel, int4 group-wise) in Triton, with torch
references. The weight is dequantized tile by tile in registers, so HBM traffic is the packed
weight: the bound that matters for decode (small M).

Layouts are the canonical ones of `xlaserve.quantization.numpy_quant`:
    int8: qweight int8 [N, K], scales [N]                 y = (x @ q^T) * s
    int4: qweight uint8 [N, K/2] (group half-split), scales [N, G], zeros uint8 [N, G]
          y[m, n] = sum_t s[n, t] * sum_{k in group t} x[m, k] * (q[n, k] - z[n, t])
x: [M, K] float16/bfloat16/float32 -> y: [M, N] x.dtype (fp32 accumulation).
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
    upcast_dot,
)

# Tile sizes as data: (BLOCK_M, BLOCK_N, BLOCK_K) by M bucket. Decode (M <= 16) wants tall N
# tiles; prefill wants square ones. BLOCK_K of int4 is further capped by the group size.
TILES: dict[str, tuple[int, int, int]] = {
    "decode": (16, 64, 64),
    "prefill": (64, 64, 64),
}


def _tiles(m: int) -> tuple[int, int, int]:
    return TILES["decode"] if m <= 16 else TILES["prefill"]


# ---- references ----------------------------------------------------------------------------------


def int8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K], qweight int8 [N, K], scales [N] -> [M, N] x.dtype (fp32 math)."""
    y = x.float() @ qweight.float().t()
    return (y * scales.float()[None, :]).to(x.dtype)


def unpack_int4_torch(qweight: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [N, K/2] (group half-split) -> uint8 [N, K] values 0..15."""
    n, k2 = qweight.shape
    h = group // 2
    p = qweight.view(n, (2 * k2) // group, h)
    return torch.stack([p & 0xF, p >> 4], dim=2).reshape(n, 2 * k2)


def dequant_int4_torch(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(uint8 [N, K/2], scales [N, G], zeros [N, G]) -> W [N, K] in `dtype`."""
    n, k2 = qweight.shape
    k = 2 * k2
    g = k // scales.shape[1]
    q = unpack_int4_torch(qweight, g).view(n, k // g, g).to(torch.float32)
    w = (q - zeros.to(torch.float32)[:, :, None]) * scales.to(torch.float32)[:, :, None]
    return w.view(n, k).to(dtype)


def int4_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """x [M, K] -> [M, N] x.dtype (fp32 math)."""
    w = dequant_int4_torch(qweight, scales, zeros, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)


# ---- kernels -------------------------------------------------------------------------------------


@triton.jit
def _int8_mm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[:, None] * stride_wn + kk[None, :],
            mask=(rn[:, None] < N) & (kk[None, :] < K),
            other=0,
        )
        if UPCAST:
            x = x.to(tl.float32)
        wf = w.to(x.dtype)  # int8 values are exact in fp16/bf16/fp32
        acc += tl.dot(x, tl.trans(wf))
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    acc = acc * s[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _int4_mm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    # BLOCK_K divides GROUP, so one K tile lies inside one group (one scale/zero per column).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    half: tl.constexpr = GROUP // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        grp = k0 // GROUP
        kin = kk - grp * GROUP  # position inside the group
        byte = grp * half + (kin % half)
        shift = (kin >= half).to(tl.int32) * 4
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        packed = tl.load(
            w_ptr + rn[:, None] * stride_wn + byte[None, :],
            mask=(rn[:, None] < N) & (kk[None, :] < K),
            other=0,
        ).to(tl.int32)
        q = (packed >> shift[None, :]) & 0xF
        z = tl.load(z_ptr + rn * stride_sn + grp, mask=rn < N, other=0).to(tl.int32)
        s = tl.load(s_ptr + rn * stride_sn + grp, mask=rn < N, other=0.0).to(tl.float32)
        if UPCAST:
            x = x.to(tl.float32)
        wq = (q - z[:, None]).to(x.dtype)  # -16..15: exact in every float dtype
        acc += tl.dot(x, tl.trans(wq)) * s[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


# ---- wrappers ------------------------------------------------------------------------------------


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float, qweight int8 [N, K], scales float [N] -> y [M, N] x.dtype."""
    check_device("int8_matmul", x, qweight, scales)
    check_dtype("int8_matmul x", x, FLOAT_DTYPES)
    check_dtype("int8_matmul qweight", qweight, (torch.int8,))
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"int8_matmul: x {tuple(x.shape)} and qweight {tuple(qweight.shape)}")
    if scales.shape != (qweight.shape[0],):
        raise ValueError(f"int8_matmul: scales must be [N], got {tuple(scales.shape)}")
    check_last_dim_contiguous("int8_matmul x", x)
    check_last_dim_contiguous("int8_matmul qweight", qweight)
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = _tiles(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int8_mm_kernel[grid](
        x, qweight, scales.contiguous(), y, m, n, k,
        x.stride(0), qweight.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=upcast_dot(x.dtype),
    )  # fmt: skip
    return y


def int4_block_k(group: int, preferred: int = 64) -> int | None:
    """Largest power of two <= preferred (>= 16) dividing `group`; None when there is none."""
    bk = preferred
    while bk >= 16:
        if group % bk == 0:
            return bk
        bk //= 2
    return None


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """x [M, K] float, qweight uint8 [N, K/2], scales [N, G], zeros uint8 [N, G] -> [M, N]."""
    check_device("int4_matmul", x, qweight, scales, zeros)
    check_dtype("int4_matmul x", x, FLOAT_DTYPES)
    check_dtype("int4_matmul qweight", qweight, (torch.uint8,))
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape != (n, k // 2) or k % 2:
        raise ValueError(f"int4_matmul: x {tuple(x.shape)} needs qweight [N, K/2], got "
                         f"{tuple(qweight.shape)}")  # fmt: skip
    if scales.shape != zeros.shape or scales.shape[0] != n or k % scales.shape[1]:
        raise ValueError(
            f"int4_matmul: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} must be "
            f"[N, G] with G dividing K={k}"
        )
    group = k // scales.shape[1]
    bm, bn, bk = _tiles(m)
    bk_g = int4_block_k(group, bk)
    if bk_g is None:
        raise ValueError(f"int4_matmul: group size {group} has no power-of-two divisor >= 16")
    scales, zeros = scales.contiguous(), zeros.contiguous()
    check_last_dim_contiguous("int4_matmul x", x)
    check_last_dim_contiguous("int4_matmul qweight", qweight)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_mm_kernel[grid](
        x, qweight, scales, zeros, y, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk_g, UPCAST=upcast_dot(x.dtype),
    )  # fmt: skip
    return y
