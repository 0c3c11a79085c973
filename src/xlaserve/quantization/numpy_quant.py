"""Backend-neutral (numpy) weight quantizers and their exact inverses.

Internal ("canonical") quantized layouts, shared by every backend. For a linear layer whose float
weight is W [N, K] (torch Linear layout: N = out_features, K = in_features), the checkpoint
stream carries, under the layer's canonical prefix X (e.g. ``layers.0.self_attn.q_proj``):

int8 (weight-only, symmetric, per output channel):
    X.qweight  int8    [N, K]     q = round(W / s) in [-127, 127]
    X.scales   float32 [N]        s = max|W[n]| / 127;   W ~= q * s[:, None]

int4 (weight-only, asymmetric, group-wise along K; group g, G = K / g groups):
    X.qweight  uint8   [N, K/2]   two 4-bit values per byte, "group half-split" order: inside
                                  each group of g consecutive input channels, byte j (0 <= j < g/2)
                                  holds channel j in its low nibble and channel j + g/2 in its
                                  high nibble. (Chosen so a kernel unpacks one group into two
                                  contiguous K ranges with no interleave/reshape: TPU-friendly.)
    X.scales   float32 [N, G]
    X.qzeros   uint8   [N, G]     zero points (0..15; GPTQ v1 checkpoints may give 16)
    X.perm     int32   [K]        only for GPTQ act-order (desc_act) checkpoints: the stored
                                  columns are W[:, perm], so y = x[:, perm] @ W'^T.
    W'[n, k] ~= (q[n, k] - z[n, k // g]) * s[n, k // g]

fp8 (e4m3fn weights, per output channel; activations quantized per token at run time):
    X.qweight  float8_e4m3fn [N, K]   (ml_dtypes.float8_e4m3fn; torch stores its bits as uint8)
    X.scales   float32 [N]            s = max|W[n]| / 448;   W ~= float(q) * s[:, None]
    block-wise (QuantScheme.weight_block = (bn, bk), DeepSeek-V3 / Qwen3-FP8 checkpoints):
    X.scales   float32 [ceil(N / bn), ceil(K / bk)]   W ~= float(q) * s[n // bn, k // bk]

int8_w8a8: the int8 layout above; activations are quantized per token to int8 at run time
(s_x = max|x[m]| / 127, round half away from zero) and the GEMM runs on int8 codes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0
INT4_DEFAULT_GROUP = 128


def _as_f32(w: np.ndarray) -> np.ndarray:
    return np.asarray(w).astype(np.float32, copy=False)


# ---- int8 ----------------------------------------------------------------------------------------


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [N, K] float -> (q int8 [N, K], scales float32 [N]); symmetric per output channel."""
    w = _as_f32(w)
    amax = np.abs(w).max(axis=1)
    s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / s[:, None]), -127, 127).astype(np.int8)
    return q, s


def dequantize_int8(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """(q int8 [N, K], s [N]) -> W float32 [N, K]."""
    return q.astype(np.float32) * s.astype(np.float32)[:, None]


# ---- int4 ----------------------------------------------------------------------------------------


def int4_group_size(in_features: int, group_size: int = INT4_DEFAULT_GROUP) -> int:
    """The group used for runtime int4 quantization of a layer with K = in_features.

    `group_size` when it divides K; else the largest power of two in [32, group_size) dividing K
    (e.g. K=192 -> 64, K=480 -> 32); else one group per row (g = K, K must be even)."""
    if group_size <= 0 or group_size >= in_features:
        g = in_features
    elif in_features % group_size == 0:
        g = group_size
    else:
        g = in_features
        p = 1 << (group_size.bit_length() - 1)
        if p == group_size:
            p //= 2
        while p >= 32:
            if in_features % p == 0:
                g = p
                break
            p //= 2
    if g % 2:
        raise ValueError(f"int4 needs an even group size, got {g} (in_features={in_features})")
    return g


def pack_int4(q: np.ndarray, group: int) -> np.ndarray:
    """q uint8 [N, K] (values 0..15) -> packed uint8 [N, K/2] in group half-split order."""
    n, k = q.shape
    if k % group or group % 2:
        raise ValueError(f"K={k} must be a multiple of an even group size, got group={group}")
    h = group // 2
    qg = q.reshape(n, k // group, 2, h).astype(np.uint8)
    return (qg[:, :, 0, :] | (qg[:, :, 1, :] << 4)).reshape(n, k // 2)


def unpack_int4(packed: np.ndarray, group: int) -> np.ndarray:
    """Inverse of `pack_int4`: uint8 [N, K/2] -> uint8 [N, K] (values 0..15)."""
    n, k2 = packed.shape
    h = group // 2
    pg = packed.reshape(n, (2 * k2) // group, h)
    return np.stack([pg & 0xF, pg >> 4], axis=2).reshape(n, 2 * k2)


def quantize_int4(
    w: np.ndarray, group_size: int = INT4_DEFAULT_GROUP
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [N, K] float -> (packed uint8 [N, K/2], scales float32 [N, G], zeros uint8 [N, G]).

    Asymmetric min/max per group (the range always contains 0, so zeros are exact)."""
    w = _as_f32(w)
    n, k = w.shape
    g = int4_group_size(k, group_size)
    wg = w.reshape(n, k // g, g)
    lo = np.minimum(wg.min(axis=2), 0.0)
    hi = np.maximum(wg.max(axis=2), 0.0)
    s = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    z = np.clip(np.rint(-lo / s), 0, 15)
    q = np.clip(np.rint(wg / s[:, :, None]) + z[:, :, None], 0, 15).astype(np.uint8)
    return pack_int4(q.reshape(n, k), g), s, z.astype(np.uint8)


def dequantize_int4(packed: np.ndarray, s: np.ndarray, z: np.ndarray) -> np.ndarray:
    """(packed [N, K/2], scales [N, G], zeros [N, G]) -> W float32 [N, K]."""
    n, k2 = packed.shape
    k = 2 * k2
    g = k // s.shape[1]
    q = unpack_int4(packed, g).astype(np.float32).reshape(n, k // g, g)
    w = (q - z.astype(np.float32)[:, :, None]) * s.astype(np.float32)[:, :, None]
    return w.reshape(n, k)


# ---- fp8 -----------------------------------------------------------------------------------------


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [N, K] float -> (q float8_e4m3fn [N, K], scales float32 [N]); per output channel."""
    w = _as_f32(w)
    amax = np.abs(w).max(axis=1)
    s = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = np.clip(w / s[:, None], -FP8_MAX, FP8_MAX).astype(FP8_E4M3)
    return q, s


def dequantize_fp8(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """(q float8_e4m3fn [N, K], s [N]) -> W float32 [N, K]."""
    return q.astype(np.float32) * s.astype(np.float32)[:, None]


def quantize_weight(method: str, w: np.ndarray, group_size: int = INT4_DEFAULT_GROUP) -> dict:
    """W [N, K] -> {"qweight", "scales"[, "qzeros"]} in the canonical layout of `method`."""
    if method in ("int8", "int8_w8a8"):  # w8a8: the same weights, activations at run time
        q, s = quantize_int8(w)
        return {"qweight": q, "scales": s}
    if method == "int4":
        q, s, z = quantize_int4(w, group_size)
        return {"qweight": q, "scales": s, "qzeros": z}
    if method == "fp8":
        q, s = quantize_fp8(w)
        return {"qweight": q, "scales": s}
    raise ValueError(f"unknown quantization method {method!r}")
