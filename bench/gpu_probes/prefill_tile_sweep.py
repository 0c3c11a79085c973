#!/usr/bin/env python
"""Launch-config sweep of the Triton paged attention kernel's prefill (issue 24): the tiles of
`paged_attention.ATTENTION_CONFIGS["prefill"]` were never swept on a GPU.

`long_context --stages kernels` measured the kernel's causal prefill of a 30k prompt at ~360
TFLOP/s against ~600-650 for torch SDPA's square causal call (H100 and H200), with the table's
tile (BLOCK_M 128, BLOCK_N 64, 8 warps, 2 stages; its sm_90 PTX is wgmma,
m64n64k16 for QK^T: `ptx_mix.py --groups attention_prefill`).
The sweep's pick is now `PREFILL_WIDE_CONFIGS` on GPUs with the shared memory for it; the
"table" row is whatever `unified_attention` launches on the GPU at hand.
This probe times the kernel with each candidate launch config (`unified_attention`'s
`launch_config`) on the two shapes a 30k prompt prefills with at the offline budget: the whole
prompt in one chunk, and the second chunk (the last 13,616 queries over 30,000 keys). Each
config's output is compared with the table's (max abs difference), so a config that computes
something else shows at once; a config that does not compile (shared memory) is an error row.
Timing: CUDA-graph replays (`bench.timing`), median of --reps.

    OUT=dir python bench/gpu_probes/prefill_tile_sweep.py            # H100 / H200: ~2-4 min
    python bench/gpu_probes/prefill_tile_sweep.py --tiny --out x.json  # CPU interpreter smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from typing import Any

from xlaserve.bench.timing import graph_time_us

# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M counts query rows of the G heads of one
# KV head (G = 4 for the 8B shape), as in ATTENTION_CONFIGS.
CONFIGS: list[tuple[int, int, int, int]] = [
    (bm, bn, w, s)
    for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    if not (bm == 128 and w == 4)  # a 128-row tile on 4 warps spills
]
TINY_CONFIGS: list[tuple[int, int, int, int]] = [(16, 16, 1, 1), (32, 16, 2, 1), (16, 32, 1, 2)]


def _cases(tiny: bool) -> dict[str, tuple[int, int]]:
    """name -> (context length n, queries q_len: the last q_len positions of n)."""
    return {"whole_prompt": (64, 64), "chunk": (64, 24)} if tiny else {
        "whole_prompt": (30000, 30000), "chunk": (30000, 13616)}  # fmt: skip


def _sweep_case(
    name: str,
    n: int,
    q_len: int,
    args: argparse.Namespace,
    configs: list,
    g: Any,  # noqa: ANN401
) -> list[dict[str, Any]]:
    """One case's rows: the table's launch config first, then each candidate."""
    import torch

    from xlaserve.bench.long_context import _prefill_case
    from xlaserve.kernels_cuda.paged_attention import (
        attention_launch_config,
        unified_attention,
        use_wide_tiles,
    )

    cuda = torch.cuda.is_available() and not args.tiny
    shape = (4, 2, 16) if args.tiny else (32, 8, 128)
    hq, hkv, d = shape
    q, k, v, bt, qsl, sl = _prefill_case(n, q_len, shape, g)
    flops = 4 * hq * d * (q_len * (n - q_len) + q_len * (q_len + 1) / 2)

    def call(cfg: dict[str, int] | None) -> Any:  # noqa: ANN401
        return unified_attention(q, k, v, None, qsl, sl, bt, q_len, n, d**-0.5, launch_config=cfg)

    # The pick unified_attention makes.
    table = attention_launch_config(q_len, hq // hkv, d, bool(args.tiny), wide=use_wide_tiles(q))
    ref = call(None).float()
    rows = []
    candidates = [("table", None)] + [
        (f"{c}", {"BLOCK_M": c[0], "BLOCK_N": c[1], "num_warps": c[2], "num_stages": c[3]})
        for c in configs
    ]
    for label, cfg in candidates:
        row: dict[str, Any] = {"case": name, "config": label, "launch": cfg or table}
        try:
            out = call(cfg).float()
            us = graph_time_us([lambda cfg=cfg: call(cfg)], args.reps, cuda)
        except Exception as e:  # noqa: BLE001 - a config failing is a result too
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(f"{name} {label}: {row['error'][:120]}", flush=True)
            continue
        row.update(us=round(us, 1), tflops=round(flops / us / 1e6, 1),
                   max_abs_diff_vs_table=float((out - ref).abs().max()))  # fmt: skip
        rows.append(row)
        print(f"{name} {label}: {us:.1f} us, {row['tflops']} TFLOP/s, "
              f"diff {row['max_abs_diff_vs_table']:.2e}", flush=True)  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    configs = TINY_CONFIGS if args.tiny else CONFIGS[: args.max_configs]
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    for name, (n, q_len) in _cases(args.tiny).items():
        for row in _sweep_case(name, n, q_len, args, configs, g):
            rows.append(row)
            if "us" in row and (name not in best or row["us"] < best[name]["us"]):
                best[name] = row
        with open(args.out, "w") as f:  # what is known so far (a cut-short sweep keeps it)
            json.dump({"partial": True, "rows": rows, "best": best}, f)
    for name, row in best.items():
        print(f"best {name}: {row['config']} {row['us']} us ({row['tflops']} TFLOP/s)", flush=True)
    return {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
            "partial": False, "reps": args.reps, "rows": rows, "best": best}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill_tiles.json"))
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter smoke)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-configs", type=int, default=len(CONFIGS), help="the first N configs")
    args = ap.parse_args(argv)
    report = run(args)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
