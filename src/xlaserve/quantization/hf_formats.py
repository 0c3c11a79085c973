"""Pre-quantized HF checkpoint formats <-> the canonical layouts of `numpy_quant`.

Read side: `prequantized_stream` turns a checkpoint's per-layer GPTQ / AWQ / compressed-tensors
tensors (already renamed to canonical prefixes by the architecture adapter) into the canonical
`X.qweight / X.scales / X.qzeros [/ X.perm]` tensors. Write side (`pack_gptq`, `pack_awq`,
`quantize_compressed_fp8`): numpy packers that write exactly what the reference tools write,
used by tests to make real checkpoints.

Layouts followed (W [N, K] float, N = out_features, K = in_features, g group size, G = K / g;
4-bit values q in 0..15 with w = (q - z) * s):

GPTQ (auto-gptq / gptqmodel, `checkpoint_format` "gptq" = v1, "gptq_v2"):
    qweight int32 [K/8, N]  packed along K: qweight[i, n] bits 4j..4j+3 = q[n, 8i + j]
    qzeros  int32 [G, N/8]  packed along N: qzeros[t, c] bits 4j..4j+3 = zs[t, 8c + j], where
                            zs = z - 1 in v1 (the historical off-by-one), zs = z in v2
    scales  fp16  [G, N]
    g_idx   int32 [K]       group of each input channel (arange(K) // g unless desc_act, where
                            sorting channels by g_idx gives contiguous groups of g)
AWQ (autoawq GEMM, `version` "gemm"):
    qweight int32 [K, N/8]  packed along N in AWQ order: bits 4i..4i+3 of qweight[k, c] hold
                            q[8c + AWQ_ORDER[i], k], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    qzeros  int32 [G, N/8]  same packing of z (no offset)
    scales  fp16  [G, N]
compressed-tensors, format "float-quantized" (fp8 e4m3 weights, dynamic per-token activations):
    weight        float8_e4m3fn [N, K]
    weight_scale  float32 [N, 1] (strategy "channel") or [1] / [] ("tensor")
    input_scale   float32 (static activation scale; dropped: activations are scaled per token)
compressed-tensors, format "int-quantized" (symmetric int8 weights; W8A8 with int8
input_activations, served with dynamic per-token activation scales):
    weight        int8 [N, K]
    weight_scale  float32 / bfloat16 [N, 1] ("channel") or [1] ("tensor")
    input_scale   (static W8A8 only; dropped)
fp8 block-wise (config quant_method "fp8", weight_block_size [bn, bk]; DeepSeek-V3, Qwen3-FP8):
    weight            float8_e4m3fn [N, K]
    weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)]; W = weight * weight_scale_inv of
                      its block (despite the name, a multiplier)
    -> canonical fp8 {qweight [N, K], scales [ceil(N / bn), ceil(K / bk)]}
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from xlaserve.quantization.numpy_quant import FP8_E4M3, pack_int4, quantize_fp8
from xlaserve.quantization.scheme import (
    QuantScheme,
    read_quantization_config,
    scheme_from_hf_config,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = np.arange(8, dtype=np.uint32) * 4


# ---- int32 nibble packing ------------------------------------------------------------------------


def _pack_rows(q: np.ndarray) -> np.ndarray:
    """uint [8R, C] -> int32 [R, C]: out[i, c] bits 4j.. = q[8i + j, c]."""
    r8, c = q.shape
    qq = q.astype(np.uint32).reshape(r8 // 8, 8, c)
    return np.bitwise_or.reduce(qq << _SHIFTS[None, :, None], axis=1).view(np.int32)


def _unpack_rows(p: np.ndarray) -> np.ndarray:
    """int32 [R, C] -> uint8 [8R, C] (inverse of `_pack_rows`)."""
    u = p.view(np.uint32) if p.dtype == np.int32 else p.astype(np.uint32)
    r, c = u.shape
    return ((u[:, None, :] >> _SHIFTS[None, :, None]) & 0xF).astype(np.uint8).reshape(8 * r, c)


def _pack_cols(q: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """uint [R, 8C] -> int32 [R, C]: out[r, c] bits 4i.. = q[r, 8c + order[i]]."""
    r, c8 = q.shape
    qq = q.astype(np.uint32).reshape(r, c8 // 8, 8)[:, :, list(order)]
    return np.bitwise_or.reduce(qq << _SHIFTS[None, None, :], axis=2).view(np.int32)


def _unpack_cols(p: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """int32 [R, C] -> uint8 [R, 8C] (inverse of `_pack_cols` with the same order)."""
    u = p.view(np.uint32) if p.dtype == np.int32 else p.astype(np.uint32)
    r, c = u.shape
    nib = ((u[:, :, None] >> _SHIFTS[None, None, :]) & 0xF).astype(np.uint8)  # [R, C, 8] by i
    out = np.empty_like(nib)
    out[:, :, list(order)] = nib  # nibble i holds column order[i]
    return out.reshape(r, 8 * c)


# ---- writers (tests, tools) ----------------------------------------------------------------------


def _minmax_int4(wg: np.ndarray, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """wg [N, G, g] -> (q uint8 [N, G, g], s f32 [N, G], z uint8 [N, G])."""
    if sym:  # GPTQ sym=True: z = 8, s = 2 * amax / 15
        amax = np.abs(wg).max(axis=2)
        s = np.where(amax > 0, 2 * amax / 15.0, 1.0).astype(np.float32)
        z = np.full(s.shape, 8.0, np.float32)
    else:
        lo = np.minimum(wg.min(axis=2), 0.0)
        hi = np.maximum(wg.max(axis=2), 0.0)
        s = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
        z = np.clip(np.rint(-lo / s), 0, 15)
    s = s.astype(np.float16).astype(np.float32)  # stored as fp16: quantize with what is stored
    q = np.clip(np.rint(wg / s[:, :, None]) + z[:, :, None], 0, 15).astype(np.uint8)
    return q, s, z.astype(np.uint8)


def pack_gptq(
    w: np.ndarray,
    group_size: int = 128,
    sym: bool = True,
    perm: np.ndarray | None = None,
    v1: bool = True,
) -> dict[str, np.ndarray]:
    """W [N, K] -> GPTQ tensors {qweight, qzeros, scales, g_idx}. `perm` (desc_act): the order
    GPTQ processed the columns in; groups are consecutive runs of that order."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    g = k if group_size <= 0 or group_size >= k else group_size
    perm = np.arange(k) if perm is None else np.asarray(perm)
    ws = w[:, perm].reshape(n, k // g, g)
    q_sorted, s, z = _minmax_int4(ws, sym)
    q = np.empty((n, k), np.uint8)
    q[:, perm] = q_sorted.reshape(n, k)
    g_idx = np.empty(k, np.int32)
    g_idx[perm] = np.arange(k) // g
    zs = (z.astype(np.int32) - 1) & 0xF if v1 else z.astype(np.int32)
    return {
        "qweight": _pack_rows(q.T),
        "qzeros": _pack_cols(zs.T),
        "scales": s.T.astype(np.float16),
        "g_idx": g_idx,
    }


def pack_awq(w: np.ndarray, group_size: int = 128) -> dict[str, np.ndarray]:
    """W [N, K] -> AWQ GEMM tensors {qweight, qzeros, scales} (zero_point=True)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    g = k if group_size <= 0 or group_size >= k else group_size
    q, s, z = _minmax_int4(w.reshape(n, k // g, g), sym=False)
    return {
        "qweight": _pack_cols(q.reshape(n, k).T, AWQ_ORDER),
        "qzeros": _pack_cols(z.T, AWQ_ORDER),
        "scales": s.T.astype(np.float16),
    }


def quantize_compressed_fp8(w: np.ndarray, strategy: str = "channel") -> dict[str, np.ndarray]:
    """W [N, K] -> compressed-tensors fp8 tensors {weight, weight_scale}."""
    if strategy == "channel":
        q, s = quantize_fp8(w)
        return {"weight": q, "weight_scale": s[:, None].astype(np.float32)}
    w = np.asarray(w, dtype=np.float32)
    s = np.float32(max(np.abs(w).max(), 1e-12) / 448.0)
    return {
        "weight": np.clip(w / s, -448, 448).astype(FP8_E4M3),
        "weight_scale": np.array([s], np.float32),
    }


def quantize_compressed_int8(w: np.ndarray, strategy: str = "channel") -> dict[str, np.ndarray]:
    """W [N, K] -> compressed-tensors int8 tensors {weight, weight_scale} (symmetric)."""
    w = np.asarray(w, dtype=np.float32)
    if strategy == "channel":
        amax = np.abs(w).max(axis=1, keepdims=True)
    else:
        amax = np.full((1,), np.abs(w).max(), np.float32)
    s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / s.reshape(-1, 1) if strategy == "channel" else w / s), -127, 127)
    return {"weight": q.astype(np.int8), "weight_scale": s}


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> dict:
    """W [N, K] -> block-wise fp8 tensors {weight, weight_scale_inv} (one amax / 448 scale per
    [bn, bk] block, ragged edge blocks included)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    wp = np.zeros((gn * bn, gk * bk), np.float32)
    wp[:n, :k] = w
    amax = np.abs(wp).reshape(gn, bn, gk, bk).max(axis=(1, 3))
    s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(s, bn, 0)[:n], bk, 1)[:, :k]
    q = np.clip(w / full, -448, 448).astype(FP8_E4M3)
    return {"weight": q, "weight_scale_inv": s}


# ---- readers -------------------------------------------------------------------------------------


def gptq_to_canonical(t: dict[str, np.ndarray], scheme: QuantScheme) -> dict[str, np.ndarray]:
    """GPTQ tensors of one layer -> canonical int4 {qweight, scales, qzeros[, perm]}."""
    q = _unpack_rows(t["qweight"]).T  # [N, K]
    n, k = q.shape
    scales = np.asarray(t["scales"], np.float32)  # [G, N]
    n_groups = scales.shape[0]
    g = k // n_groups
    z = _unpack_cols(t["qzeros"])[:, :n].astype(np.int32)  # [G, N]
    if scheme.gptq_v1:
        z = z + 1
    g_idx = t.get("g_idx")
    trivial = np.arange(k, dtype=np.int64) // g
    perm = None
    if g_idx is not None and not np.array_equal(np.asarray(g_idx, np.int64), trivial):
        perm = np.argsort(np.asarray(g_idx), kind="stable").astype(np.int32)
        if not np.array_equal(np.asarray(g_idx)[perm], trivial):
            raise ValueError("GPTQ g_idx does not form groups of equal size")
        if not scheme.act_order:
            raise ValueError("GPTQ checkpoint has a permuted g_idx but desc_act is false")
        q = q[:, perm]
    out = {
        "qweight": pack_int4(q, g),
        "scales": np.ascontiguousarray(scales.T),
        "qzeros": np.ascontiguousarray(z.T.astype(np.uint8)),
    }
    if scheme.act_order:
        out["perm"] = perm if perm is not None else np.arange(k, dtype=np.int32)
    return out


def awq_to_canonical(t: dict[str, np.ndarray], scheme: QuantScheme) -> dict[str, np.ndarray]:
    """AWQ GEMM tensors of one layer -> canonical int4 {qweight, scales, qzeros}."""
    q = _unpack_cols(t["qweight"], AWQ_ORDER).T  # [N, K]
    scales = np.asarray(t["scales"], np.float32)  # [G, N]
    z = _unpack_cols(t["qzeros"], AWQ_ORDER)  # [G, N]
    g = q.shape[1] // scales.shape[0]
    return {
        "qweight": pack_int4(q, g),
        "scales": np.ascontiguousarray(scales.T),
        "qzeros": np.ascontiguousarray(z.T),
    }


def compressed_fp8_to_canonical(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """compressed-tensors fp8 / int8 tensors (or block-wise fp8: weight_scale_inv) of one layer
    -> canonical {qweight, scales}."""
    w = t["weight"]
    if "weight_scale_inv" in t:
        return {"qweight": w, "scales": np.asarray(t["weight_scale_inv"], np.float32)}
    s = np.asarray(t["weight_scale"], np.float32).reshape(-1)
    return {"qweight": w, "scales": np.ascontiguousarray(np.broadcast_to(s, (w.shape[0],)))}


_INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_FP8_PARTS = ("weight", "weight_scale", "input_scale")
_SCALE_PARTS = ("weight_scale", "weight_scale_inv", "input_scale")


def _complete(slot: dict, scheme: QuantScheme) -> bool:
    if scheme.source == "gptq":
        return all(p in slot for p in _INT4_PARTS)
    if scheme.source == "awq":
        return all(p in slot for p in _INT4_PARTS[:3])
    return "weight" in slot and ("weight_scale" in slot or "weight_scale_inv" in slot)


def _emit(prefix: str, slot: dict, scheme: QuantScheme) -> list[tuple[str, np.ndarray]]:
    if scheme.source == "gptq":
        out = gptq_to_canonical(slot, scheme)
    elif scheme.source == "awq":
        out = awq_to_canonical(slot, scheme)
    else:
        out = compressed_fp8_to_canonical(slot)
    return [(f"{prefix}.{k}", v) for k, v in out.items()]


def convert_prequantized(
    pairs: Iterable[tuple[str, np.ndarray]], scheme: QuantScheme
) -> Iterator[tuple[str, np.ndarray]]:
    """Canonical-prefix checkpoint pairs -> canonical quantized pairs (float tensors pass)."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    int4 = scheme.source in ("gptq", "awq")
    for name, w in pairs:
        prefix, _, part = name.rpartition(".")
        ours = (int4 and part in _INT4_PARTS) or (
            not int4
            and (part in _SCALE_PARTS or (part == "weight" and w.dtype in (FP8_E4M3, np.int8)))
        )
        if not ours:
            yield name, w
            continue
        slot = pending.setdefault(prefix, {})
        slot[part] = w
        if _complete(slot, scheme):
            yield from _emit(prefix, pending.pop(prefix), scheme)
    for prefix, slot in pending.items():
        if set(slot) <= {"input_scale"}:
            continue  # a static activation scale of an already emitted layer
        needed = ("qweight", "qzeros", "scales") if int4 else ("weight", "weight_scale")
        missing = [p for p in needed if p not in slot]
        if not int4 and "weight_scale_inv" in slot:
            missing = [p for p in missing if p != "weight_scale"]
        if missing:
            raise ValueError(f"{scheme.source} checkpoint: {prefix} lacks {', '.join(missing)}")
        yield from _emit(prefix, slot, scheme)


def prequantized_stream(
    pairs: Iterable[tuple[str, np.ndarray]], model_dir: str | None
) -> Iterator[tuple[str, np.ndarray]]:
    """The hook of `model_loader.registry.iter_canonical_weights`: converts the tensors of a
    pre-quantized checkpoint (detected from config.json), passes anything else through."""
    qc = read_quantization_config(model_dir)
    if qc is None:
        yield from pairs
        return
    yield from convert_prequantized(pairs, scheme_from_hf_config(qc))
