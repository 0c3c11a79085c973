"""GPU micro-benchmark of the Triton kernels vs torch references / torch SDPA.

Run on a CUDA machine: ``python -m xlaserve.kernels_cuda.bench_kernels --output-json out.json``
(or ``python kernels_cuda/bench_kernels.py``). Times with CUDA events, median of ``--iters``
after warm-up, and checks each kernel against its reference (max abs error) once per case.
Self-contained: torch + triton only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

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
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--no-check", action="store_true", help="skip reference comparisons")
    parser.add_argument("--only", choices=["attention", "small", "moe"], default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
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
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    for row in rows:
        print(json.dumps(row))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
