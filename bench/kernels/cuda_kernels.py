"""GPU micro-benchmark of the Triton kernels vs torch references / torch SDPA.

Run on a CUDA machine: ``python -m xlaserve.bench.kernels.cuda_kernels --output-json out.json``
(or ``python bench/kernels/cuda_kernels.py``). Times with CUDA events, median of ``--iters``
after warm-up, and checks each kernel against its reference (max abs error) once per case.
Self-contained: torch + triton only (the MoE and quantized-GEMV benches borrow backends_torch).
``--only qgemv`` sweeps the weight-only quantized GEMV configs (see `bench_qgemv`); the summary
rows ("qgemv_best") print, every config's row goes to ``--output-json``. ``--only dense_gemv``
sweeps the bf16 Triton GEMV against cuBLAS at M == 1 (`bench_dense_gemv`; "dense_gemv_best"
rows print). ``--only decode_small`` times the batch-1 decode kernels: rotary + write_kv vs the
fused kernel, unified_attention over num_kv_splits (`bench_decode_small`). ``--only
decode_large`` sweeps the decode attention tile at batch 256 / 1024 (`bench_decode_large`),
``--only prefill_short`` the prefill tile on 32 x 256-token prompts (`bench_prefill_short`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from xlaserve.bench.timing import event_time_us, graph_time_us
from xlaserve.kernels_cuda.activation import silu_and_mul, silu_and_mul_ref
from xlaserve.kernels_cuda.fused_moe import fused_experts
from xlaserve.kernels_cuda.kv_write import write_kv, write_kv_ref
from xlaserve.kernels_cuda.norm import fused_add_rms_norm, fused_add_rms_norm_ref
from xlaserve.kernels_cuda.paged_attention import unified_attention, unified_attention_ref
from xlaserve.kernels_cuda.rotary import (
    compute_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)


def time_ms(fn: Callable[[], Any], iters: int, warmup: int = 5) -> float:
    """Median milliseconds of fn() over iters runs, each timed by its own CUDA events."""
    return event_time_us(fn, iters, warmup) / 1e3


def _attention_case(
    name: str,
    q_lens: list[int],
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    page: int,
    dtype: torch.dtype,
    iters: int,
    check: bool,
) -> dict[str, Any]:
    dev = torch.device("cuda")
    b = len(q_lens)
    max_blocks = max(math.ceil(s / page) for s in seq_lens)
    n = b * max_blocks
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    t = int(qsl[-1])
    q = torch.randn(t, hq, d, device=dev, dtype=dtype)
    k_cache = torch.randn(n, page, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    bt = torch.randperm(n, device=dev).reshape(b, max_blocks).to(torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, out, qsl, sl, bt, max(q_lens), max(seq_lens), d**-0.5)
    ms = time_ms(lambda: unified_attention(*args), iters)
    kv_bytes = sum(seq_lens) * hkv * d * 2 * k_cache.element_size()
    flops = sum(4 * ql * sl_ * hq * d for ql, sl_ in zip(q_lens, seq_lens, strict=True))
    row: dict[str, Any] = {
        "kernel": "unified_attention",
        "case": name,
        "dtype": str(dtype),
        "B": b,
        "T": t,
        "Hq": hq,
        "Hkv": hkv,
        "D": d,
        "page": page,
        "triton_ms": ms,
        "kv_GBps": kv_bytes / ms / 1e6,
        "TFLOPs_upper": flops / ms / 1e9,  # counts masked-out (non-causal) work: an upper bound
    }
    # torch SDPA on contiguous (pre-gathered) K/V: a dense baseline with no paging cost.
    if all(ql == q_lens[0] for ql in q_lens) and all(s == seq_lens[0] for s in seq_lens):
        ql, length = q_lens[0], seq_lens[0]
        kd = torch.randn(b, hkv, length, d, device=dev, dtype=dtype)
        vd = torch.randn_like(kd)
        qd = q.view(b, ql, hq, d).transpose(1, 2)
        causal = ql == length
        if ql == 1 or causal:

            def sdpa() -> torch.Tensor:
                return torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=causal and ql > 1, enable_gqa=True
                )

            row["sdpa_dense_ms"] = time_ms(sdpa, iters)
    if check:
        ref = unified_attention_ref(*args[:3], None, *args[4:])
        row["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
    return row


def bench_attention(dtype: torch.dtype, iters: int, check: bool) -> list[dict[str, Any]]:
    hq, hkv, d, page = 32, 8, 128, 16
    cases = [
        ("decode_b1_ctx2k", [1], [2048]),
        ("decode_b1_ctx16k", [1], [16384]),
        ("decode_b8_ctx2k", [1] * 8, [2048] * 8),
        ("decode_b64_ctx2k", [1] * 64, [2048] * 64),
        ("decode_b256_ctx1k", [1] * 256, [1024] * 256),
        ("prefill_1x2048", [2048], [2048]),
        ("prefill_4x512", [512] * 4, [512] * 4),
        ("mixed_chunk512_plus_63_decodes", [512] + [1] * 63, [2048] + [2048] * 63),
    ]
    return [
        _attention_case(name, ql, sl, hq, hkv, d, page, dtype, iters, check)
        for name, ql, sl in cases
    ]


def bench_small_kernels(dtype: torch.dtype, iters: int) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    rows: list[dict[str, Any]] = []

    def add(kernel: str, case: str, fast: Callable[[], Any], ref: Callable[[], Any], nbytes: int):
        ms, ref_ms = time_ms(fast, iters), time_ms(ref, iters)
        rows.append({"kernel": kernel, "case": case, "dtype": str(dtype), "triton_ms": ms,
                     "torch_ref_ms": ref_ms, "speedup": ref_ms / ms,
                     "GBps": nbytes / ms / 1e6})  # fmt: skip

    esz = torch.tensor([], dtype=dtype).element_size()
    for t in (1, 256, 4096):
        h = 4096
        x = torch.randn(t, h, device=dev, dtype=dtype)
        r = torch.randn_like(x)
        w = torch.ones(h, device=dev, dtype=dtype)
        add("fused_add_rms_norm", f"T{t}_H{h}", lambda x=x, r=r, w=w: fused_add_rms_norm(x, r, w, 1e-5),
            lambda x=x, r=r, w=w: fused_add_rms_norm_ref(x, r, w, 1e-5), 4 * t * h * esz)  # fmt: skip
    for t in (1, 256, 4096):
        inter = 14336
        x = torch.randn(t, 2 * inter, device=dev, dtype=dtype)
        add("silu_and_mul", f"T{t}_I{inter}", lambda x=x: silu_and_mul(x),
            lambda x=x: silu_and_mul_ref(x), 3 * t * inter * esz)  # fmt: skip
    for t in (1, 256, 4096):
        q = torch.randn(t, 32, 128, device=dev, dtype=dtype)
        k = torch.randn(t, 8, 128, device=dev, dtype=dtype)
        pos = torch.randint(0, 8192, (t,), device=dev)
        inv = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, device=dev).float() / 128)
        cache = compute_cos_sin_cache(inv, 8192)
        add("rotary_embedding", f"T{t}_32x8x128", lambda q=q, k=k, p=pos, c=cache: rotary_embedding(q, k, p, c),
            lambda q=q, k=k, p=pos, c=cache: rotary_embedding_ref(q, k, p, c), 2 * t * 40 * 128 * esz)  # fmt: skip
    for t in (1, 256, 4096):
        n, page = 4096, 16
        k = torch.randn(t, 8, 128, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        kc = torch.zeros(n, page, 8, 128, device=dev, dtype=dtype)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(n * page, device=dev)[:t].to(torch.int32)
        add("write_kv", f"T{t}_8x128", lambda k=k, v=v, kc=kc, vc=vc, s=slots: write_kv(k, v, kc, vc, s),
            lambda k=k, v=v, kc=kc, vc=vc, s=slots: write_kv_ref(k, v, kc, vc, s), 4 * t * 8 * 128 * esz)  # fmt: skip
    return rows


def bench_moe(dtype: torch.dtype, iters: int, check: bool) -> list[dict[str, Any]]:
    """Triton fused MoE vs the torch reference (backends_torch fused_experts_ref) on
    Mixtral-8x7B (E 8, top-2, H 4096, I 14336) and a DeepSeek-like wide routing (E 64, top-6)."""
    from xlaserve.backends_torch.layers.moe import fused_experts_ref, select_experts

    dev = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    esz = torch.tensor([], dtype=dtype).element_size()
    for name, e, k, h, inter in (("mixtral", 8, 2, 4096, 14336), ("wide", 64, 6, 2048, 1408)):
        wg = 0.02 * torch.randn(e, inter, h, device=dev, dtype=dtype)
        wu = 0.02 * torch.randn_like(wg)
        wd = 0.02 * torch.randn(e, h, inter, device=dev, dtype=dtype)
        for t in (1, 16, 64, 512, 4096):
            x = torch.randn(t, h, device=dev, dtype=dtype)
            w, ids = select_experts(torch.randn(t, e, device=dev), k, True)
            args = (x, wg, wu, wd, w, ids)
            ms = time_ms(lambda a=args: fused_experts(*a), iters)
            ref_ms = time_ms(lambda a=args: fused_experts_ref(*a), iters)
            active = int(torch.unique(ids).numel())
            flops = 6 * t * k * h * inter
            row: dict[str, Any] = {"kernel": "fused_moe", "case": f"{name}_T{t}", "dtype": str(dtype),
                                   "E": e, "topk": k, "H": h, "I": inter, "triton_ms": ms,
                                   "torch_ref_ms": ref_ms, "speedup": ref_ms / ms,
                                   "TFLOPs": flops / ms / 1e9,
                                   "weight_GBps": 3 * active * h * inter * esz / ms / 1e6}  # fmt: skip
            if check:
                row["max_abs_err"] = (fused_experts(*args).float() - fused_experts_ref(*args).float()).abs().max().item()  # fmt: skip
            rows.append(row)
    return rows


# ---- quantized GEMV sweep (--only qgemv) ---------------------------------------------------------

# Llama-3.1-8B linears (N, K): fused qkv, o_proj, fused gate_up, down.
QGEMV_SHAPES = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
                ("down", 4096, 14336))  # fmt: skip
QGEMV_M = (1, 4, 8)
# Candidate GemvTiles (block_n, block_k, split_k, num_warps[, bit_cvt]) per (format, M == 1);
# block_k counts k's (int4 reads block_k / 2 bytes per row). Each config compiles once per M
# (~0.5 s), so the grids stay small; the default config of every case is timed as well.
# fmt: off
_W8_M1 = [(8, 1024, 1, 4), (4, 1024, 1, 4), (16, 1024, 1, 4), (8, 2048, 1, 4), (16, 512, 1, 2),
          (8, 256, 1, 1), (8, 256, 1, 4), (16, 2048, 1, 8), (8, 1024, 2, 4), (8, 1024, 4, 4)]
_W8_MN = [(4, 256, 1, 4), (8, 256, 1, 4), (16, 256, 1, 4), (8, 256, 2, 4), (8, 1024, 1, 4),
          (16, 256, 1, 8), (8, 512, 1, 2)]
_I4_M1 = [(8, 2048, 1, 4), (4, 2048, 1, 4), (16, 2048, 1, 4), (8, 4096, 1, 4), (16, 1024, 1, 2),
          (8, 512, 1, 1), (8, 1024, 1, 4), (16, 4096, 1, 8), (8, 2048, 2, 4), (8, 2048, 4, 4)]
_I4_MN = [(4, 512, 1, 4), (8, 512, 1, 4), (16, 512, 1, 4), (8, 512, 2, 4), (8, 1024, 1, 4),
          (16, 512, 1, 8), (4, 1024, 1, 4)]
# fmt: on
QGEMV_GRID: dict[tuple[str, bool], list[tuple]] = {
    ("int8", True): [*_W8_M1, (8, 1024, 1, 4, False)],  # bit_cvt off: cvt instructions
    ("int8", False): [*_W8_MN, (8, 256, 1, 4, False)],
    ("fp8", True): _W8_M1,
    ("fp8", False): _W8_MN,
    ("int4", True): [*_I4_M1, (8, 2048, 1, 4, False)],
    ("int4", False): [*_I4_MN, (8, 512, 1, 4, False)],
}
# Weight copies cycled through per timing so that every call streams from HBM, as in decode
# (one layer's weights after another), not from the 50 MB L2 of an H200.
_QGEMV_STREAM_BYTES = 256 << 20


def _graph_ms(calls: list[Callable[[], Any]], iters: int) -> float:
    """Median ms per call of `calls` run back to back, replayed from one CUDA graph: no CPU
    launch gaps (decode runs graphs too), so microsecond kernels are timed, not the launcher."""
    return graph_time_us(calls, iters) / 1e3


def _copies(nbytes: int) -> int:
    return max(2, min(32, math.ceil(_QGEMV_STREAM_BYTES / max(nbytes, 1))))


def _err_text(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _qgemv_operands(
    fmt: str, w: torch.Tensor, copies: int | None = None
) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """The quantized operands of W [N, K] for `fmt` (int4: group 128), in `copies` copies
    (default: as many as stream past the L2), and the weight bytes of one copy."""
    from xlaserve.backends_torch.layers.linear import quantize_weight_torch

    q = quantize_weight_torch(fmt, w, 128 if fmt == "int4" else 0)
    names = ("qweight", "scales", "qzeros") if fmt == "int4" else ("qweight", "scales")
    one = tuple(q[name] for name in names)
    nbytes = sum(t.numel() * t.element_size() for t in one)
    copies = _copies(nbytes) if copies is None else copies
    return [one] + [tuple(t.clone() for t in one) for _ in range(copies - 1)], nbytes


def _qgemv_fn(fmt: str) -> Callable[..., torch.Tensor]:
    """The public quantized matmul of `fmt` (takes a `tiles=` override)."""
    from xlaserve.kernels_cuda import quant_matmul as qm

    return {"int8": qm.int8_matmul, "int4": qm.int4_matmul, "fp8": qm.fp8_weight_matmul}[fmt]


def _qgemv_prev_path(fmt: str, x: torch.Tensor, ops: tuple[torch.Tensor, ...]) -> Callable | None:
    """The decode path the GEMV replaces: tl.dot tiles (int8 / int4), per-token _scaled_mm (fp8)."""
    from xlaserve.backends_torch.layers.linear import fp8_linear_scaled_mm, fp8_supported
    from xlaserve.kernels_cuda import quant_matmul as qm

    tiles = qm._tiles(x.shape[0])
    if fmt == "int8":
        return functools.partial(qm._int8_dot, x, ops[0], ops[1], tiles)
    if fmt == "int4":
        return functools.partial(qm._int4_dot, x, *ops, 128, tiles)
    if fp8_supported(x.device):
        return functools.partial(fp8_linear_scaled_mm, x, ops[0].view(torch.float8_e4m3fn), ops[1])
    return None


def _qgemv_case(
    fmt: str,
    x: torch.Tensor,
    operands: list[tuple[torch.Tensor, ...]],
    nbytes: int,
    case: dict[str, Any],
    iters: int,
) -> list[dict[str, Any]]:
    """Sweep one (format, M, shape): a "qgemv_config" row per config (the default first), then
    the "qgemv_best" summary (fastest config whose output matches the reference)."""
    from xlaserve.kernels_cuda import quant_matmul as qm

    fn = _qgemv_fn(fmt)
    ref_fn = {"int8": qm.int8_matmul_ref, "int4": qm.int4_matmul_ref,
              "fp8": qm.fp8_matmul_ref}[fmt]  # fmt: skip
    m, n, k = x.shape[0], case["N"], case["K"]
    ref = ref_fn(x, *operands[0]).float()
    ref_max = ref.abs().max().item()
    tol = (1e-2 if x.dtype == torch.bfloat16 else 2e-3) * ref_max + 1e-6  # output rounding
    default = tuple(qm.gemv_tiles(fmt, m, n, k))
    grid = [default] + [
        t for c in QGEMV_GRID[(fmt, m == 1)] if (t := tuple(qm.GemvTiles(*c))) != default
    ]
    rows: list[dict[str, Any]] = []
    for cfg in grid:
        row: dict[str, Any] = {"kernel": "qgemv_config", **case, "config": list(cfg),
                               "default": cfg == default}  # fmt: skip
        try:
            err = (fn(x, *operands[0], tiles=cfg).float() - ref).abs().max().item()
            ms = _graph_ms([functools.partial(fn, x, *ops, tiles=cfg) for ops in operands], iters)
            row.update(ms=ms, weight_GBps=nbytes / ms / 1e6, max_abs_err=err, ok=err <= tol)
        except Exception as e:  # a config that fails to compile or launch is a result too
            row["error"] = _err_text(e)
        rows.append(row)
    timed = [r for r in rows if "ms" in r]
    good = [r for r in timed if r["ok"]]
    best = min(good, key=lambda r: r["ms"]) if good else {}
    dflt = rows[0]
    summary: dict[str, Any] = {
        "kernel": "qgemv_best", **case,
        "best_config": best.get("config"), "best_ms": best.get("ms"),
        "best_weight_GBps": best.get("weight_GBps"),
        "default_config": list(default), "default_ms": dflt.get("ms"),
        "default_weight_GBps": dflt.get("weight_GBps"),
        "default_max_abs_err": dflt.get("max_abs_err"), "ref_max_abs": ref_max,
        "failed_configs": len(rows) - len(timed), "wrong_configs": len(timed) - len(good),
    }  # fmt: skip
    try:
        prev = [_qgemv_prev_path(fmt, x, ops) for ops in operands]
        if prev[0] is not None:
            summary["prev_path_ms"] = _graph_ms(prev, iters)
    except Exception as e:
        summary["prev_path_error"] = _err_text(e)
    return [*rows, summary]


def _qgemv_configs(fmt: str, m: int) -> list[tuple]:
    """Every config the sweep times for (fmt, m): the defaults of all shapes, then the grid."""
    from xlaserve.kernels_cuda import quant_matmul as qm

    out = [tuple(qm.gemv_tiles(fmt, m, n, k)) for _, n, k in QGEMV_SHAPES]
    out += [tuple(qm.GemvTiles(*c)) for c in QGEMV_GRID[(fmt, m == 1)]]
    return list(dict.fromkeys(out))


def _run_precompile(tasks: list[Callable[[], Any]], start: float) -> float:
    """Run each task once from a thread pool (Triton compiles in parallel; a failing config is
    recorded later, when it is timed); returns seconds since start."""
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    def run(task: Callable[[], Any]) -> None:
        try:
            task()
        except Exception:
            pass

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(run, tasks))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _qgemv_precompile(formats: list[str], dtype: torch.dtype) -> float:
    """Compile every (format, M, config) variant in threads, on a small weight with the same
    integer specializations as the real shapes (N, K multiples of 16): Triton compiles take
    ~0.5 s each and partly overlap. Best effort: failures are ignored here and recorded by the
    timed pass, which finds the rest in Triton's cache. Returns the seconds spent."""
    import time

    start = time.perf_counter()
    w = 0.02 * torch.randn(64, QGEMV_SHAPES[0][2], device="cuda")
    tasks = []
    for fmt in formats:
        fn = _qgemv_fn(fmt)
        ops = _qgemv_operands(fmt, w, copies=1)[0][0]
        for m in QGEMV_M:
            x = torch.randn(m, w.shape[1], device="cuda", dtype=dtype)
            tasks += [functools.partial(fn, x, *ops, tiles=c) for c in _qgemv_configs(fmt, m)]

    return _run_precompile(tasks, start)


def bench_qgemv(dtype: torch.dtype, iters: int) -> list[dict[str, Any]]:
    """Weight-only quantized GEMV (kernels_cuda/quant_matmul.py) at decode M on the Llama-8B
    shapes, int8 / int4 (group 128) / fp8: per (format, M, shape) the default config and a grid
    of candidates ("qgemv_config" rows: ms, weight GB/s, max abs error vs the torch reference,
    or the error of a config that fails), then "qgemv_best": the fastest correct config beside
    the default, bf16 x @ W^T (bf16_ms) and the path the GEMV replaces (prev_path_ms). Every
    timing cycles through weight copies past the L2, replayed from a CUDA graph."""
    from xlaserve.kernels_cuda import quant_matmul as qm

    dev = torch.device("cuda")
    formats = ["int8", "int4"] + (["fp8"] if qm.fp8_gemv_supported(dev) else [])
    rows: list[dict[str, Any]] = [
        {"kernel": "qgemv_precompile", "seconds": _qgemv_precompile(formats, dtype)}
    ]
    for shape, n, k in QGEMV_SHAPES:
        w = 0.02 * torch.randn(n, k, device=dev)
        wbs = [w.to(dtype)]
        wbs += [wbs[0].clone() for _ in range(_copies(wbs[0].numel() * wbs[0].element_size()) - 1)]
        xs = {m: torch.randn(m, k, device=dev, dtype=dtype) for m in QGEMV_M}
        base_ms = {
            m: _graph_ms([functools.partial(torch.nn.functional.linear, xs[m], wb) for wb in wbs],
                         iters)
            for m in QGEMV_M
        }  # fmt: skip
        del wbs
        for fmt in formats:
            operands, nbytes = _qgemv_operands(fmt, w)
            for m in QGEMV_M:
                case = {"format": fmt, "M": m, "shape": shape, "N": n, "K": k,
                        "dtype": str(dtype)}  # fmt: skip
                case_rows = _qgemv_case(fmt, xs[m], operands, nbytes, case, iters)
                summary = case_rows[-1]
                summary["bf16_ms"] = base_ms[m]
                summary["bf16_GBps"] = 2 * n * k / base_ms[m] / 1e6
                if summary["best_ms"]:
                    summary["speedup_vs_bf16"] = base_ms[m] / summary["best_ms"]
                rows += case_rows
            del operands
        del w
        torch.cuda.empty_cache()
    return rows


# ---- dense GEMV sweep (--only dense_gemv) --------------------------------------------------------

# Llama-3.1-8B weights (N, K) at batch-1 decode: the four linears of a layer and the lm head.
DENSE_GEMV_BENCH_SHAPES = (*QGEMV_SHAPES, ("lm_head", 128256, 4096))
# Candidate GemvTiles (block_n, block_k, split_k, num_warps); the default of every shape is timed
# too. block_k >= 8 * 32 * num_warps (bf16) keeps x a vector (no broadcast tile).
# fmt: off
DENSE_GEMV_GRID: list[tuple[int, int, int, int]] = [
    (4, 1024, 1, 4), (2, 1024, 1, 4), (8, 1024, 1, 4), (1, 1024, 1, 4), (4, 2048, 1, 8),
    (8, 512, 1, 2), (4, 512, 1, 2), (16, 256, 1, 1), (4, 1024, 2, 4), (8, 1024, 4, 4),
]
# fmt: on


def _dense_gemv_configs() -> list[tuple]:
    from xlaserve.kernels_cuda import dense_gemv as dg

    out = [tuple(dg.dense_gemv_tiles(n, k)) for _, n, k in DENSE_GEMV_BENCH_SHAPES]
    out += [tuple(dg.GemvTiles(*c)) for c in DENSE_GEMV_GRID]
    return list(dict.fromkeys(out))


def _dense_gemv_precompile(dtype: torch.dtype) -> float:
    """Compile every config in threads on a small weight with the real shapes' integer
    specializations (N, K multiples of 16); failures are left to the timed pass."""
    import time

    from xlaserve.kernels_cuda.dense_gemv import dense_gemv

    start = time.perf_counter()
    tasks = []
    for k in sorted({k for _, _, k in DENSE_GEMV_BENCH_SHAPES}):
        w = torch.randn(64, k, device="cuda", dtype=dtype)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        tasks += [functools.partial(dense_gemv, x, w, tiles=c) for c in _dense_gemv_configs()]

    return _run_precompile(tasks, start)


def bench_dense_gemv(dtype: torch.dtype, iters: int) -> list[dict[str, Any]]:
    """Triton dense GEMV (kernels_cuda/dense_gemv.py) vs cuBLAS F.linear at M == 1 on the
    Llama-8B shapes: a "dense_gemv_config" row per config (ms, weight GB/s, max abs error vs the
    fp32 reference, or the error of a config that fails), then "dense_gemv_best" per shape: the
    fastest correct config, the default, cuBLAS (cublas_ms) and speedup_vs_cublas. Every timing
    cycles through weight copies past the L2 (>= 256 MB), replayed from a CUDA graph, as in
    `bench_qgemv`. A shape whose best config beats cuBLAS belongs in DENSE_GEMV_SHAPES (and
    that config in DENSE_GEMV_TILES)."""
    from xlaserve.kernels_cuda import dense_gemv as dg

    dev = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    try:
        rows.append({"kernel": "dense_gemv_precompile", "seconds": _dense_gemv_precompile(dtype)})
    except Exception as e:
        rows.append({"kernel": "dense_gemv_precompile", "error": _err_text(e)})
    configs = _dense_gemv_configs()
    for shape, n, k in DENSE_GEMV_BENCH_SHAPES:
        case = {"shape": shape, "N": n, "K": k, "dtype": str(dtype)}
        try:
            w0 = (0.02 * torch.randn(n, k, device=dev)).to(dtype)
            nbytes = w0.numel() * w0.element_size()
            ws = [w0] + [w0.clone() for _ in range(_copies(nbytes) - 1)]
            x = torch.randn(1, k, device=dev, dtype=dtype)
            ref = dg.dense_gemv_ref(x, w0).float()
        except Exception as e:
            rows.append({"kernel": "dense_gemv_best", **case, "error": _err_text(e)})
            torch.cuda.empty_cache()
            continue
        ref_max = ref.abs().max().item()
        tol = (1e-2 if dtype == torch.bfloat16 else 2e-3) * ref_max + 1e-6
        default = tuple(dg.dense_gemv_tiles(n, k))
        grid = [default] + [c for c in configs if c != default]
        case_rows: list[dict[str, Any]] = []
        for cfg in grid:
            row: dict[str, Any] = {"kernel": "dense_gemv_config", **case, "config": list(cfg),
                                   "default": cfg == default}  # fmt: skip
            try:
                err = (dg.dense_gemv(x, w0, tiles=cfg).float() - ref).abs().max().item()
                calls = [functools.partial(dg.dense_gemv, x, w, tiles=cfg) for w in ws]
                ms = _graph_ms(calls, iters)
                row.update(ms=ms, weight_GBps=nbytes / ms / 1e6, max_abs_err=err, ok=err <= tol)
            except Exception as e:  # a config that fails to compile or launch is a result too
                row["error"] = _err_text(e)
            case_rows.append(row)
        summary: dict[str, Any] = {"kernel": "dense_gemv_best", **case, "copies": len(ws)}
        try:
            cub = [functools.partial(torch.nn.functional.linear, x, w) for w in ws]
            summary["cublas_ms"] = _graph_ms(cub, iters)
            summary["cublas_GBps"] = nbytes / summary["cublas_ms"] / 1e6
        except Exception as e:
            summary["cublas_error"] = _err_text(e)
        good = [r for r in case_rows if r.get("ok")]
        best = min(good, key=lambda r: r["ms"]) if good else {}
        dflt = case_rows[0]
        summary.update(
            best_config=best.get("config"), best_ms=best.get("ms"),
            best_weight_GBps=best.get("weight_GBps"), default_config=list(default),
            default_ms=dflt.get("ms"), default_max_abs_err=dflt.get("max_abs_err"),
            ref_max_abs=ref_max, failed_configs=sum("error" in r for r in case_rows),
            wrong_configs=sum("ok" in r and not r["ok"] for r in case_rows),
        )  # fmt: skip
        if best and "cublas_ms" in summary:
            summary["speedup_vs_cublas"] = summary["cublas_ms"] / best["ms"]
        rows += [*case_rows, summary]
        del ws, w0
        torch.cuda.empty_cache()
    return rows


# ---- batch-1 decode small kernels (--only decode_small) -------------------------------------------

# Calls per captured graph: per-call time = replay time / calls (launch gaps excluded).
_DECODE_SMALL_CALLS = 32
# Llama-8B attention: (Hq, Hkv, D, page, cache blocks per layer).
_DECODE_HEADS = (32, 8, 128, 16, 512)


def _timed_row(row: dict[str, Any], key: str, calls: list[Callable[[], Any]], iters: int) -> None:
    """row[key] = ms per call (graph replay), or row[key + "_error"] when it fails."""
    try:
        row[key] = _graph_ms(calls, iters)
    except Exception as e:
        row[key + "_error"] = _err_text(e)


def _decode_rope_kv_row(
    t: int, dtype: torch.dtype, cos_sin: torch.Tensor, iters: int, check: bool
) -> dict[str, Any]:
    """One decode_small row: rotary + write_kv vs the fused kernel at T tokens (Llama-8B heads),
    each call on another layer's cache."""
    from xlaserve.kernels_cuda.rotary import (
        rotary_embedding_write_kv,
        rotary_embedding_write_kv_ref,
    )

    dev = torch.device("cuda")
    hq, hkv, d, page, nblk = _DECODE_HEADS
    layers = _DECODE_SMALL_CALLS
    row: dict[str, Any] = {"kernel": "decode_rope_kv_write", "T": t, "dtype": str(dtype)}
    try:
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dtype)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        pos = torch.randint(0, 8192, (t,), device=dev)
        slots = torch.randperm(nblk * page, device=dev)[:t].to(torch.int32)
        caches = [(torch.zeros(nblk, page, hkv, d, device=dev, dtype=dtype),
                   torch.zeros(nblk, page, hkv, d, device=dev, dtype=dtype))
                  for _ in range(layers)]  # fmt: skip

        def separate(kc: torch.Tensor, vc: torch.Tensor) -> None:
            rotary_embedding(q, k, pos, cos_sin)
            write_kv(k, v, kc, vc, slots)

        _timed_row(row, "rotary_ms",
                   [functools.partial(rotary_embedding, q, k, pos, cos_sin)] * layers, iters)  # fmt: skip
        _timed_row(row, "write_kv_ms",
                   [functools.partial(write_kv, k, v, *c, slots) for c in caches], iters)  # fmt: skip
        _timed_row(row, "separate_ms", [functools.partial(separate, *c) for c in caches], iters)
        fused = [functools.partial(rotary_embedding_write_kv, q, k, v, pos, cos_sin, *c, slots)
                 for c in caches]  # fmt: skip
        _timed_row(row, "fused_ms", fused, iters)
        if "separate_ms" in row and "fused_ms" in row:
            row["saved_us_per_layer"] = 1e3 * (row["separate_ms"] - row["fused_ms"])
        if check:
            q0, k0, v0 = (torch.randn_like(x) for x in (q, k, v))
            kc, vc = torch.zeros_like(caches[0][0]), torch.zeros_like(caches[0][1])
            want = [x.clone() for x in (q0, k0, kc, vc)]
            rotary_embedding_write_kv_ref(want[0], want[1], v0, pos, cos_sin, want[2],
                                          want[3], slots)  # fmt: skip
            rotary_embedding_write_kv(q0, k0, v0, pos, cos_sin, kc, vc, slots)
            row["max_abs_err"] = max(
                (a.float() - b.float()).abs().max().item()
                for a, b in zip((q0, k0, kc, vc), want, strict=True)
            )
        del caches
    except Exception as e:
        row["error"] = _err_text(e)
    return row


def bench_decode_small(dtype: torch.dtype, iters: int, check: bool) -> list[dict[str, Any]]:
    """Batch-1 decode kernels of Llama-8B (32 q / 8 kv heads, D 128, page 16): rotary + write_kv
    (two launches) vs rotary_embedding_write_kv (one), at T 1 and 8; unified_attention at one
    sequence x kv_len 384 (and 2048) with num_kv_splits 1 / 2 / 4 / 8 / auto (None), out
    allocated by the call (empty + in-kernel zero padding) as the attention backend does, beside
    the torch.zeros_like fill it replaced. Each row times _DECODE_SMALL_CALLS calls per CUDA
    graph (32 layers' caches for the KV writes); a failing variant records its error."""
    dev = torch.device("cuda")
    hq, hkv, d, page, _ = _DECODE_HEADS
    layers = _DECODE_SMALL_CALLS
    rows: list[dict[str, Any]] = []
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d)
    cos_sin = compute_cos_sin_cache(inv, 8192)
    for t in (1, 8):
        rows.append(_decode_rope_kv_row(t, dtype, cos_sin, iters, check))
    for kv_len in (384, 2048):
        try:
            q = torch.randn(1, hq, d, device=dev, dtype=dtype)
            nb = -(-kv_len // page)
            kc = torch.randn(4 * nb, page, hkv, d, device=dev, dtype=dtype)
            vc = torch.randn_like(kc)
            qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
            sl = torch.tensor([kv_len], dtype=torch.int32, device=dev)
            bt = torch.randperm(4 * nb, device=dev)[:nb].to(torch.int32)[None]
            args = (q, kc, vc, None, qsl, sl, bt, 1, kv_len, d**-0.5)
            ref = unified_attention_ref(*args).float() if check else None
        except Exception as e:
            rows.append({"kernel": "decode_attention", "kv_len": kv_len, "error": _err_text(e)})
            continue
        fill = {"kernel": "decode_attention", "kv_len": kv_len, "variant": "zeros_like_fill"}
        _timed_row(fill, "ms", [functools.partial(torch.zeros_like, q)] * layers, iters)
        rows.append(fill)
        for splits in (1, 2, 4, 8, None):
            row = {"kernel": "decode_attention", "kv_len": kv_len, "dtype": str(dtype),
                   "num_kv_splits": splits if splits else "auto"}  # fmt: skip
            call = functools.partial(unified_attention, *args, num_kv_splits=splits)
            _timed_row(row, "ms", [call] * layers, iters)
            if check and "ms" in row:
                try:
                    row["max_abs_err"] = (call().float() - ref).abs().max().item()
                except Exception as e:
                    row["check_error"] = _err_text(e)
            rows.append(row)
    return rows


# ---- large-batch decode attention tiles (--only decode_large) -------------------------------------

# (BLOCK_N, num_warps, num_stages) tried for the decode tile of head_dim 128 (BLOCK_M stays 16).
_DECODE_LARGE_CONFIGS = [
    (bn, w, st) for bn in (32, 64, 128) for w in (2, 4) for st in (2, 3, 4)
] + [(16, 2, 3), (16, 4, 3), (64, 8, 3), (128, 8, 3)]
# Calls per captured graph (each reads the whole cache: B x ~384 tokens x 4 KiB).
_DECODE_LARGE_CALLS = 8


def _attention_tile_row(
    row: dict[str, Any],
    kind: str,
    cfg: dict[str, int],
    call: Callable[[], torch.Tensor],
    ref: torch.Tensor | None,
    iters: int,
    rate_key: str,
    amount_per_ms: float,
) -> dict[str, Any]:
    """Time `call` with ATTENTION_CONFIGS[kind][128] = cfg (restored after): row["ms"] per call
    in a CUDA graph of _DECODE_LARGE_CALLS calls, row[rate_key] = amount_per_ms / ms, and
    row["max_abs_err"] against ref when given."""
    from xlaserve.kernels_cuda import paged_attention as pa

    saved = pa.ATTENTION_CONFIGS[kind][128]
    pa.ATTENTION_CONFIGS[kind][128] = cfg
    try:
        _timed_row(row, "ms", [call] * _DECODE_LARGE_CALLS, iters)
        if "ms" in row:
            row[rate_key] = amount_per_ms / row["ms"]
            if ref is not None:
                row["max_abs_err"] = (call().float() - ref).abs().max().item()
    finally:
        pa.ATTENTION_CONFIGS[kind][128] = saved
    return row


def bench_decode_large(dtype: torch.dtype, iters: int, check: bool) -> list[dict[str, Any]]:
    """Decode attention as the offline benchmark's steps see it: Llama-8B heads (32 q / 8 kv, D
    128, page 16), B sequences of one query with context lengths drawn from [257, 512] (a 256 /
    256 wave). Pages: "contiguous" (each sequence's blocks consecutive, as a fresh batch gets
    them from the block manager) or "random" (scattered). Times _DECODE_LARGE_CALLS calls per
    CUDA graph (ms per call). Sweeps the decode tile (BLOCK_N, warps, stages) at B 256 with
    contiguous pages; then the default and the best config at B 256 random and B 1024.
    kv_GBps = K + V bytes read / time (the bound: HBM bandwidth)."""
    from xlaserve.kernels_cuda import paged_attention as pa

    dev = torch.device("cuda")
    hq, hkv, d, page = 32, 8, 128, 16
    default = dict(pa.ATTENTION_CONFIGS["decode"][128])
    rows: list[dict[str, Any]] = []

    def case(b: int, pages: str, cfgs: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
        g = torch.Generator().manual_seed(b)
        lens = torch.randint(257, 513, (b,), generator=g).tolist()
        nblk = [-(-n // page) for n in lens]
        total = sum(nblk)
        q = torch.randn(b, hq, d, device=dev, dtype=dtype)
        kc = torch.randn(total, page, hkv, d, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        ids = torch.arange(total) if pages == "contiguous" else torch.randperm(total, generator=g)
        bt = torch.zeros(b, max(nblk), dtype=torch.int32)
        at = 0
        for i, nb in enumerate(nblk):
            bt[i, :nb] = ids[at : at + nb].to(torch.int32)
            at += nb
        args = (q, kc, vc, None, torch.arange(b + 1, dtype=torch.int32, device=dev),
                torch.tensor(lens, dtype=torch.int32, device=dev), bt.to(dev), 1, max(lens),
                d**-0.5)  # fmt: skip
        kv_bytes = sum(lens) * hkv * d * 2 * kc.element_size()
        ref = unified_attention_ref(*args).float() if check else None
        call = functools.partial(unified_attention, *args, num_kv_splits=1)
        out = []
        for bn, w, st in cfgs:
            row: dict[str, Any] = {"kernel": "decode_large", "B": b, "pages": pages,
                                   "BLOCK_N": bn, "num_warps": w, "num_stages": st,
                                   "mean_ctx": sum(lens) / b}  # fmt: skip
            cfg = dict(default, BLOCK_N=bn, num_warps=w, num_stages=st)
            out.append(_attention_tile_row(row, "decode", cfg, call, ref, iters, "kv_GBps",
                                           kv_bytes / 1e6))  # fmt: skip
        del kc, vc
        return out

    cur = (default["BLOCK_N"], default["num_warps"], default["num_stages"])
    r256 = case(256, "contiguous", _DECODE_LARGE_CONFIGS)
    rows += r256
    ok = [r for r in r256 if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    rows.append({"kernel": "decode_large_best", "B": 256, "default": list(cur), "best": best})
    more = [cur] + ([] if best is None else
                    [(best["BLOCK_N"], best["num_warps"], best["num_stages"])])  # fmt: skip
    more = list(dict.fromkeys(more))
    rows += case(256, "random", more)
    rows += case(1024, "contiguous", more)
    return rows


# ---- short-prompt prefill attention tiles (--only prefill_short) -----------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried for the prefill tile of head_dim 128.
_PREFILL_SHORT_CONFIGS = [
    (bm, bn, w, st) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)
]


def bench_prefill_short(dtype: torch.dtype, iters: int, check: bool) -> list[dict[str, Any]]:
    """Prefill attention as the offline benchmark's prefill steps see it: 32 sequences of 256
    new tokens (an 8192-token step, causal, empty history) and 4 of 2048, Llama-8B heads, page
    16, contiguous pages. Sweeps the prefill tile; ms per call inside a CUDA graph of 8 calls;
    TFLOPs counts the causal half only."""
    from xlaserve.kernels_cuda import paged_attention as pa

    dev = torch.device("cuda")
    hq, hkv, d, page = 32, 8, 128, 16
    default = dict(pa.ATTENTION_CONFIGS["prefill"][128])
    rows: list[dict[str, Any]] = []
    for b, length in ((32, 256), (4, 2048)):
        nb = -(-length // page)
        t = b * length
        q = torch.randn(t, hq, d, device=dev, dtype=dtype)
        kc = torch.randn(b * nb, page, hkv, d, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        bt = torch.arange(b * nb, dtype=torch.int32, device=dev).reshape(b, nb)
        qsl = torch.arange(0, t + 1, length, dtype=torch.int32, device=dev)
        sl = torch.full((b,), length, dtype=torch.int32, device=dev)
        args = (q, kc, vc, None, qsl, sl, bt, length, length, d**-0.5)
        flops = b * length * (length + 1) / 2 * hq * d * 4
        ref = unified_attention_ref(*args).float() if check else None
        call = functools.partial(unified_attention, *args)
        for bm, bn, w, st in _PREFILL_SHORT_CONFIGS:
            row: dict[str, Any] = {"kernel": "prefill_short", "B": b, "len": length,
                                   "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w,
                                   "num_stages": st}  # fmt: skip
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            rows.append(_attention_tile_row(row, "prefill", cfg, call, ref, iters, "TFLOPs",
                                            flops / 1e9))  # fmt: skip
        ok = [r for r in rows if r.get("B") == b and "ms" in r]
        rows.append({"kernel": "prefill_short_best", "B": b, "default": default,
                     "best": min(ok, key=lambda r: r["ms"]) if ok else None})  # fmt: skip
        del kc, vc
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--no-check", action="store_true", help="skip reference comparisons")
    parser.add_argument(
        "--only",
        choices=[
            "attention",
            "small",
            "moe",
            "qgemv",
            "dense_gemv",
            "decode_small",
            "decode_large",
            "prefill_short",
        ],
        default=None,
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    if args.only in (None, "attention"):
        rows += bench_attention(dtype, args.iters, not args.no_check)
    if args.only in (None, "small"):
        rows += bench_small_kernels(dtype, args.iters)
    if args.only in (None, "moe"):
        rows += bench_moe(dtype, args.iters, not args.no_check)
    if args.only in (None, "qgemv"):
        rows += bench_qgemv(dtype, args.iters)
    if args.only in (None, "dense_gemv"):
        rows += bench_dense_gemv(dtype, args.iters)
    if args.only in (None, "decode_small"):
        rows += bench_decode_small(dtype, args.iters, not args.no_check)
    if args.only == "decode_large":  # a tile sweep: only on request
        rows += bench_decode_large(dtype, args.iters, not args.no_check)
    if args.only == "prefill_short":  # a tile sweep: only on request
        rows += bench_prefill_short(dtype, args.iters, not args.no_check)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    for row in rows:
        if row["kernel"] not in ("qgemv_config", "dense_gemv_config"):  # sweeps: JSON only
            print(json.dumps(row))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
