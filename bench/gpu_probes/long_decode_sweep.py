#!/usr/bin/env python
"""Capped sweep of the long-context decode attention tiles (issue 24): batch-1 decode attention
at 30k and 131k contexts and batch 32 at 8k, Llama-3.1-8B shape (32 q / 8 kv heads, head 128,
bf16 or (--kv fp8) fp8 paged KV, 16-token pages), for <= 12 (BLOCK_N, num_warps, num_stages,
splits) configs, each
CUDA-graph captured and replayed (host launch gaps do not count). Reports microseconds, GB/s of
K+V read and the fraction of HBM bandwidth, and prints the best config per shape (the rows to
copy into kernels_cuda/paged_attention.py's LONG_DECODE_CONFIGS / split choice).

    OUT=dir python bench/gpu_probes/long_decode_sweep.py          # H200: ~40-60 s
    OUT=dir python bench/gpu_probes/long_decode_sweep.py --kv fp8 --out $OUT/ld_fp8.json
    OUT=dir python bench/gpu_probes/long_decode_sweep.py --shapes ctx384_b256 --kv fp8  # batch 256
    python bench/gpu_probes/long_decode_sweep.py --tiny --out x.json  # CPU interpreter smoke

Each row also carries max_diff_vs_first: its output against the first config's (same inputs),
so a config that computes something else shows at once.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from xlaserve.bench.timing import graph_time_us

# (BLOCK_N, num_warps, num_stages, splits): the current table (64, 4, 3) at the graph's 16
# splits and the measured optima 32 / 64, the long-decode table (128, 4, 4), and neighbours.
CONFIGS: list[tuple[int, int, int, int]] = [
    (64, 4, 3, 16),
    (64, 4, 3, 32),
    (64, 4, 3, 64),
    (128, 4, 4, 16),
    (128, 4, 4, 32),
    (128, 4, 4, 64),
    (128, 4, 3, 32),
    (128, 8, 4, 32),
    (128, 8, 4, 64),
    (128, 4, 5, 64),
    (64, 4, 4, 32),
    (32, 4, 4, 64),
]
# Batch decode (no split): the offline benchmark's batch-256 step at ~384-token contexts. The
# table's (64, 4, 3) first; wider key tiles keep a quantized cache's bytes per tile (fp8: a
# 128-key tile moves what a 64-key bf16 tile does), so the short loop runs half the trips.
BATCH_CONFIGS: list[tuple[int, int, int, int]] = [
    (64, 4, 3, 1),
    (128, 4, 3, 1),
    (128, 8, 3, 1),
    (128, 4, 2, 1),
    (64, 4, 4, 1),
    (64, 8, 3, 1),
    (32, 4, 3, 1),
    (256, 8, 2, 1),
]


@dataclass
class Shape:
    """One decode launch: batch sequences of ctx keys each, hq / hkv heads of head_dim."""

    name: str
    batch: int
    ctx: int
    hq: int = 32
    hkv: int = 8
    head_dim: int = 128
    page: int = 16
    batch_configs: bool = False  # BATCH_CONFIGS (no split) instead of CONFIGS


def _shapes(tiny: bool, names: list[str] | None = None) -> list[Shape]:
    """The shapes to sweep: names selects among them (default: all but the batch-256 one)."""
    if tiny:  # interpreter: a few hundred keys, 4 / 2 heads of 32
        shapes = [Shape("ctx700_b1", 1, 700, 4, 2, 32), Shape("ctx200_b2", 2, 200, 4, 2, 32),
                  Shape("ctx40_b8", 8, 40, 4, 2, 32, batch_configs=True)]  # fmt: skip
    else:
        shapes = [Shape("ctx30k_b1", 1, 30_000), Shape("ctx131k_b1", 1, 131_072),
                  Shape("ctx8k_b32", 32, 8192),
                  Shape("ctx384_b256", 256, 384, batch_configs=True)]  # fmt: skip
    if names is None:
        return [x for x in shapes if not x.batch_configs]
    unknown = set(names) - {x.name for x in shapes}
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; one of {[x.name for x in shapes]}")
    return [x for x in shapes if x.name in names]


def _inputs(s: Shape, dev: str, dtype: Any) -> dict[str, Any]:
    """Random q [B, Hq, D] and caches [N, page, Hkv, D] with shuffled block tables [B, M]."""
    import torch

    g = torch.Generator().manual_seed(0)
    m = -(-s.ctx // s.page)
    n = s.batch * m
    return dict(
        q=torch.randn(s.batch, s.hq, s.head_dim, generator=g).to(dev, dtype),
        k_cache=torch.randn(n, s.page, s.hkv, s.head_dim, generator=g).to(dev, dtype),
        v_cache=torch.randn(n, s.page, s.hkv, s.head_dim, generator=g).to(dev, dtype),
        query_start_loc=torch.arange(s.batch + 1, dtype=torch.int32).to(dev),
        seq_lens=torch.full((s.batch,), s.ctx, dtype=torch.int32).to(dev),
        block_tables=torch.randperm(n, generator=g).to(torch.int32).reshape(s.batch, m).to(dev),
    )


def run(
    tiny: bool,
    reps: int,
    hbm_gbps: float | None,
    num_configs: int = len(CONFIGS),
    kv: str = "bf16",
    shapes: list[str] | None = None,
) -> dict[str, Any]:
    """Every config on every shape; rows plus the best config per shape. kv "fp8": the caches
    hold fp8 codes with per-token scales (kv_quant), the bytes read counting codes and scales."""
    import torch

    from xlaserve.kernels_cuda.kv_quant import quantize_kv
    from xlaserve.kernels_cuda.paged_attention import unified_attention

    cuda = torch.cuda.is_available() and not tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if hbm_gbps is None:  # nominal rates: H100 SXM 3.35 TB/s, H200 4.8 TB/s
        hbm_gbps = 3350.0 if cuda and "H100" in torch.cuda.get_device_name() else 4800.0
    rows: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    for s in _shapes(tiny, shapes):
        x = _inputs(s, dev, dtype)
        scales: dict[str, Any] = {}
        if kv == "fp8":
            x["k_cache"], scales["k_scale"] = quantize_kv(x["k_cache"].float(), torch.float8_e4m3fn)
            x["v_cache"], scales["v_scale"] = quantize_kv(x["v_cache"].float(), torch.float8_e4m3fn)
        out = torch.empty_like(x["q"])
        per_token = s.head_dim * x["k_cache"].element_size() + (4 if scales else 0)
        kv_bytes = 2 * s.batch * s.ctx * s.hkv * per_token
        first = None
        for block_n, warps, stages, splits in (BATCH_CONFIGS if s.batch_configs else CONFIGS)[
            :num_configs
        ]:
            cfg = {"BLOCK_M": 16, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}

            def fn(
                cfg: dict[str, int] = cfg,
                splits: int = splits,
                x: dict = x,
                out: Any = out,
                s: Shape = s,
                scales: dict = scales,
            ) -> Any:
                return unified_attention(
                    x["q"], x["k_cache"], x["v_cache"], out, x["query_start_loc"],
                    x["seq_lens"], x["block_tables"], 1, s.ctx, s.head_dim**-0.5,
                    num_kv_splits=splits, launch_config=cfg, **scales,
                )  # fmt: skip

            us = graph_time_us([fn], reps, cuda)
            fn()
            res = out.float().clone()
            first = res if first is None else first
            gbps = kv_bytes / (us * 1e-6) / 1e9
            row = dict(shape=asdict(s), kv=kv, kv_bytes=kv_bytes, block_n=block_n, num_warps=warps, num_stages=stages,
                       splits=splits, us=round(us, 2), gbps=round(gbps, 1),
                       hbm_fraction=round(gbps / hbm_gbps, 3),
                       max_diff_vs_first=float((res - first).abs().max()))  # fmt: skip
            rows.append(row)
            print(f"{s.name} BLOCK_N={block_n} warps={warps} stages={stages} splits={splits}: "
                  f"{us:.1f} us {gbps:.0f} GB/s ({gbps / hbm_gbps:.0%} HBM)", flush=True)  # fmt: skip
            if s.name not in best or us < best[s.name]["us"]:
                best[s.name] = row
        del x, out
    for name, row in best.items():
        print(f"best {name}: BLOCK_N={row['block_n']} num_warps={row['num_warps']} "
              f"num_stages={row['num_stages']} splits={row['splits']} {row['us']} us "
              f"{row['gbps']} GB/s ({row['hbm_fraction']:.0%} HBM)", flush=True)  # fmt: skip
    return {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "kv": kv,
            "hbm_gbps": hbm_gbps, "reps": reps, "rows": rows, "best": best}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "long_decode.json"))
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter smoke)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="the first N configs")
    ap.add_argument("--hbm-gbps", type=float, default=None,
                    help="the HBM rate for the fractions (default: by GPU name, H100 3350, "
                    "else the H200's 4800)")  # fmt: skip
    ap.add_argument("--kv", default="bf16", choices=["bf16", "fp8"], help="the cache's codes")
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="shape names (default: the long ones; ctx384_b256: the offline "
                    "benchmark's batch decode, with BATCH_CONFIGS)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    res = run(args.tiny, 1 if args.tiny else args.reps, args.hbm_gbps, args.configs, args.kv,
              args.shapes)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
