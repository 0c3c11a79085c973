#!/usr/bin/env python
"""Capped tile sweep of the large-M quantized GEMMs (issue 24) against bf16 cuBLAS, on the
Llama-3.1-8B linear shapes at the M sizes the scheduler produces (mixed steps 16-256 tokens,
prefill chunks / batch-256 decode up to 8192).

Families (each timed as a layer pays it: the w8a8 rows include the per-token activation
quantization):
- ``int8``: weight-only int8, the tl.dot kernel. The committed table's pick for the M
  (`quant_matmul.int8_dot_tiles`) and candidate `Int8DotTiles`, plain and swapped (swap_ab: the
  converted weight as the dot's first operand, see `quant_matmul._int8_mm_kernel`), with split-K
  slices; and the CUTLASS mixed-input GEMM (`kernels_cuda.cutlass_w8a16`, each tile) on sm_90.
- ``int8_w8a8``: torch._int_mm (cuBLASLt) + the scale epilogue, and the Triton `scaled_mm` with
  the table's tiles and candidates.
- ``fp8``: torch._scaled_mm (row-wise scales) and the Triton `scaled_mm` with candidates.
Each config's output is compared with the family's first (``max_rel_vs_first``), so a config that
computes something else shows at once.

Timing: each variant is captured ``--calls`` times into one CUDA graph and the replay timed with
CUDA events (median of ``--reps``); the calls rotate over weight copies of >= ``--rotate-mb`` in
all, so a weight that fits the 50 MB L2 is not read from L2 (what a model's step sees). Prints
the best config per (family, shape, M): the rows to copy into INT8_DOT_TILES / SCALED_MM_TILES.

    OUT=dir python bench/gpu_probes/quant_gemm_sweep.py            # H200: ~2-3 min
    python bench/gpu_probes/quant_gemm_sweep.py --tiny --out x.json  # CPU interpreter smoke
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from xlaserve.bench.timing import graph_time_us

# (K, N) of the Llama-3.1-8B linears.
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (4096, 6144),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "o": (4096, 4096),
}
TINY_SHAPES: dict[str, tuple[int, int]] = {"a": (128, 192), "b": (256, 128)}
MS = (16, 64, 256, 2048, 8192)
TINY_MS = (16, 40)
FAMILIES = ("int8", "int8_w8a8", "fp8")

# (block_m, block_n, block_k, group_m, num_warps, num_stages[, swap_ab[, split_k]]) candidates;
# a config runs at M when block_m <= pow2ceil(M) (at least 16) and block_m >= min(pow2ceil(M),
# 512) / 8.
INT8_CANDIDATES: list[tuple] = [
    (16, 64, 128, 1, 4, 4, True),
    (16, 128, 128, 1, 4, 4, True),
    (32, 128, 128, 4, 4, 4, True),
    (64, 64, 128, 8, 4, 4, True),
    (64, 128, 128, 8, 4, 4, True),
    (128, 128, 64, 8, 4, 4, True),
    (128, 128, 64, 8, 8, 4, True),
    (128, 128, 128, 8, 8, 3, True),
    (256, 128, 64, 8, 8, 3, True),
    (128, 256, 64, 8, 8, 3, True),
    (128, 128, 64, 8, 8, 4, False),
    (128, 256, 64, 8, 8, 3, False),
    # split_k (8th field; the table's 0 = auto, `quant_matmul.dot_split_k`): none, 2, 4, 8.
    (128, 128, 64, 8, 8, 4, False, 1),
    (128, 128, 64, 8, 8, 4, False, 2),
    (128, 128, 64, 8, 8, 4, False, 4),
    (128, 128, 64, 8, 8, 4, False, 8),
    (64, 64, 128, 8, 4, 4, False, 1),
]
W8A8_CANDIDATES: list[tuple] = [
    (16, 64, 128, 1, 4, 4),
    (32, 128, 128, 4, 4, 4),
    (64, 128, 128, 8, 4, 4),
    (64, 256, 128, 8, 4, 4),
    (128, 128, 128, 8, 4, 4),
    (128, 128, 128, 8, 8, 3),
    (128, 256, 128, 8, 8, 3),
    (256, 128, 128, 8, 8, 3),
    # split_k (7th field; the table's 0 = auto when enabled, `scaled_mm.scaled_mm_split_k`).
    (64, 128, 128, 8, 4, 4, 1),
    (64, 128, 128, 8, 4, 4, 2),
    (64, 128, 128, 8, 4, 4, 4),
]


def _pow2ceil(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def fits(block_m: int, m: int) -> bool:
    """Whether a config with block_m rows is tried at M (see the candidate lists)."""
    p = max(16, _pow2ceil(m))
    return block_m <= p and block_m * 8 >= min(p, 512)


def _weights(k: int, n: int, copies: int, dev: str) -> list[dict[str, Any]]:
    """copies independent weights [N, K]: bf16 / float, int8 codes + scales, fp8 codes + scales."""
    import torch

    from xlaserve.backends_torch.layers.linear import fp8_supported

    out = []
    for c in range(copies):
        g = torch.Generator(device="cpu").manual_seed(c)
        w = torch.randn(n, k, generator=g) * 0.02
        s8 = w.abs().amax(1) / 127
        d: dict[str, Any] = {
            "w": w.to(dev, torch.bfloat16 if dev == "cuda" else torch.float32),
            "q8": torch.round(w / s8[:, None]).to(torch.int8).to(dev),
            "s8": s8.to(dev),
        }
        if fp8_supported(dev) or dev == "cpu":
            sf = w.abs().amax(1) / 448
            d["qf"] = (w / sf[:, None]).to(torch.float8_e4m3fn).to(dev)
            d["sf"] = sf.to(dev)
        out.append(d)
    return out


def variants(family: str, m: int, dev: str) -> list[tuple[str, tuple | None, Any]]:
    """(label, tiles (None: a library GEMM), fn(x, weight dict) -> y [M, N]) for the family
    at M."""
    from xlaserve.config import KernelConfig
    from xlaserve.kernels_cuda import quant_matmul as qm
    from xlaserve.kernels_cuda import scaled_mm as sm

    out: list[tuple[str, tuple | None, Any]] = []
    if family == "int8":
        table = qm.int8_dot_tiles(m)
        cands = [table] + [qm.Int8DotTiles(*c) for c in INT8_CANDIDATES]
        for t in cands:
            if t is table or (fits(t.block_m, m) and t != table):
                label = f"table {tuple(t)}" if t is table else f"{tuple(t)}"
                out.append((label, t, lambda x, d, t=t: qm._int8_dot(x, d["q8"], d["s8"], t)))
        out += _cutlass_int8_variants(dev)
    elif family in ("int8_w8a8", "fp8"):
        # The library GEMM (cuBLASLt: torch._int_mm / torch._scaled_mm) where it runs, then the
        # Triton scaled_mm with the table's tiles and the candidates.
        fmt = "int8" if family == "int8_w8a8" else "fp8"
        mm = sm.int8_w8a8_matmul if fmt == "int8" else sm.fp8_w8a8_matmul
        wq, ws = ("q8", "s8") if fmt == "int8" else ("qf", "sf")
        lib = ("int_mm", KernelConfig(int8_w8a8_gemm="int_mm")) if fmt == "int8" else (
            "scaled_mm", KernelConfig(fp8_gemm="scaled_mm"))  # fmt: skip
        if dev == "cuda" and (fmt == "fp8" or m > 16):  # _int_mm wants M > 16
            out.append((lib[0], None, lambda x, d: mm(x, d[wq], d[ws], kernels=lib[1])))
        if dev == "cuda" and fmt == "fp8":
            out += _fp8_tensorwise_variants()
        table = sm.scaled_mm_tiles(fmt, m)
        cands = [table] + [sm.DotTiles(*c) for c in W8A8_CANDIDATES if sm.DotTiles(*c) != table]
        for t in cands:
            if t is table or fits(t.block_m, m):
                label = f"triton {tuple(t)}" + (" (table)" if t is table else "")
                out.append((label, t, lambda x, d, t=t: mm(x, d[wq], d[ws], tiles=t)))
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    return out


def _cutlass_int8_variants(dev: str) -> list[tuple[str, None, Any]]:
    """The CUTLASS mixed-input GEMM (`cutlass_w8a16`), each compiled tile, where it runs (an
    sm_90 GPU with nvcc and the nvidia-cutlass headers; built on first use)."""
    if dev != "cuda":
        return []
    from xlaserve.kernels_cuda import cutlass_w8a16 as cw

    if not cw.available():
        print("  int8 cutlass: not available here (needs sm_90, nvcc, nvidia-cutlass)")
        return []
    return [
        (f"cutlass {tn}x{tm} {how}", None,
         lambda x, d, i=i: cw.w8a16_gemm(x, d["q8"], d["s8"], tile=i))
        for i, (tn, tm, how) in enumerate(cw.TILES)
    ]  # fmt: skip


def _fp8_tensorwise_variants() -> list[tuple[str, None, Any]]:
    """torch._scaled_mm with unit scalar scales (cuBLASLt's tensor-wise fp8 GEMM, where the
    row-wise form takes another kernel): alone, the ceiling of that route without the per-token
    and per-channel scales; then with `scale_epilogue` applying them to its bf16 output in place
    (what the route would cost a layer). Both include the activation quantization."""
    import torch

    from xlaserve.kernels_cuda import scaled_mm as sm

    def raw(x: Any, d: dict[str, Any]) -> tuple[Any, Any]:
        xq, xs = sm.quant_rows(x, "fp8")
        one = torch.ones((), device=x.device, dtype=torch.float32)
        y = torch._scaled_mm(xq, d["qf"].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return y, xs

    def scaled(x: Any, d: dict[str, Any]) -> Any:
        y, xs = raw(x, d)
        return sm.scale_epilogue(y, xs, d["sf"], None, y.dtype, out=y)

    return [("scaled_mm tensorwise, no scales (ceiling)", None, lambda x, d: raw(x, d)[0]),
            ("scaled_mm tensorwise + scale epilogue", None, scaled)]  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every family x shape x M x config; rows and the best per (family, shape, M)."""
    import torch
    import torch.nn.functional as F

    from xlaserve.backends_torch.layers.linear import fp8_supported

    cuda = torch.cuda.is_available() and not args.tiny
    dev = "cuda" if cuda else "cpu"
    shapes = TINY_SHAPES if args.tiny else SHAPES
    shapes = {k: v for k, v in shapes.items() if not args.shapes or k in args.shapes}
    ms = args.ms or (TINY_MS if args.tiny else MS)
    families = [f for f in args.families if f != "fp8" or fp8_supported(dev) or dev == "cpu"]
    rows: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    for sname, (k, n) in shapes.items():
        w_mb = n * k / 2**20  # one int8 copy
        copies = (
            1 if not cuda else max(1, min(args.calls, -(-int(args.rotate_mb) // max(1, int(w_mb)))))
        )
        ws = _weights(k, n, copies, dev)
        for m in ms:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(
                dev, torch.bfloat16 if cuda else torch.float32
            )
            calls = [ws[i % copies] for i in range(max(copies, args.calls if cuda else 1))]
            base = graph_time_us(
                [lambda d=d, x=x: F.linear(x, d["w"]) for d in calls], args.reps, cuda
            )
            ref = F.linear(x, ws[0]["w"]).float()
            print(f"{sname} M={m}: bf16 {base:.1f} us", flush=True)
            rows.append(dict(shape=sname, k=k, n=n, m=m, family="bf16", config="F.linear",
                             us=round(base, 2), vs_bf16=1.0, copies=copies))  # fmt: skip
            for fam in families:
                first = None
                for label, tiles, fn in variants(fam, m, dev):
                    row: dict[str, Any] = dict(shape=sname, k=k, n=n, m=m, family=fam, config=label,
                                               tiles=list(tiles) if tiles else None)  # fmt: skip
                    try:
                        us = graph_time_us(
                            [lambda d=d, x=x, fn=fn: fn(x, d) for d in calls], args.reps, cuda
                        )
                        y = fn(x, ws[0]).float()
                    except Exception as e:  # noqa: BLE001 - a config failing is a result too
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                        rows.append(row)
                        print(f"  {fam} {label}: {row['error']}", flush=True)
                        continue
                    first = y if first is None else first
                    row.update(us=round(us, 2), vs_bf16=round(base / us, 3),
                               tflops=round(2 * m * n * k / us / 1e6, 1),
                               max_rel_vs_first=float((y - first).abs().max() / first.abs().max().clamp(min=1e-9)),
                               rel_vs_bf16=float((y - ref).abs().max() / ref.abs().max().clamp(min=1e-9)))  # fmt: skip
                    rows.append(row)
                    print(f"  {fam} {label}: {us:.1f} us ({base / us:.2f}x bf16)", flush=True)
                    key = f"{fam} {sname} M={m}"
                    if key not in best or us < best[key]["us"]:
                        best[key] = row
            del x
        del ws
        # After each shape, what is known so far (a sweep cut short by a time limit still
        # leaves its picks for the shapes it finished).
        with open(args.out, "w") as f:
            json.dump({"partial": True, "rows": rows, "best": best, "suggest": suggest(rows)}, f)
    for key, row in best.items():
        print(f"best {key}: {row['config']} {row['us']} us ({row['vs_bf16']}x bf16)", flush=True)
    sug = suggest(rows)
    for fam, buckets in sug.items():
        for max_m, pick in buckets.items():
            print(f"suggest {fam} M<={max_m}: {pick['config']} ({pick['vs_table']}x the table's "
                  f"time, {pick['vs_bf16']}x bf16, summed over shapes)", flush=True)  # fmt: skip
    return {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
            "partial": False, "reps": args.reps, "calls": args.calls, "rows": rows, "best": best,
            "suggest": sug}  # fmt: skip


def _buckets(family: str) -> list[int]:
    from xlaserve.kernels_cuda import quant_matmul as qm
    from xlaserve.kernels_cuda import scaled_mm as sm

    if family == "int8":
        return [max_m for max_m, _ in qm.INT8_DOT_TILES]
    return [max_m for max_m, _ in sm.SCALED_MM_TILES["int8" if family == "int8_w8a8" else family]]


def suggest(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per family and table bucket (keyed by the bucket's max M): the config with the least
    time summed over every (shape, M) of the bucket that it ran on, among configs that ran on
    all of them; with its ratio to the table's pick and to bf16 over the same products."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    base = {(r["shape"], r["m"]): r["us"] for r in rows if r["family"] == "bf16"}
    for fam in sorted({r["family"] for r in rows} - {"bf16"}):
        edges = _buckets(fam)
        per: dict[int, dict[str, dict[tuple[str, int], float]]] = {}
        tiles = {r["config"]: r.get("tiles") for r in rows if r["family"] == fam}
        for r in rows:
            if r["family"] == fam and "us" in r:
                b = next(e for e in edges if r["m"] <= e)
                per.setdefault(b, {}).setdefault(r["config"], {})[(r["shape"], r["m"])] = r["us"]
        for b, cfgs in per.items():
            keys = set().union(*(set(v) for v in cfgs.values()))
            full = {c: sum(v.values()) for c, v in cfgs.items() if set(v) == keys}
            if not full:
                continue
            pick = min(full, key=full.get)
            table = next((c for c in full if "table" in c), None)
            out.setdefault(fam, {})[str(b)] = {
                "config": pick,
                "tiles": tiles[pick],
                "us_sum": round(full[pick], 2),
                "vs_table": round(full[table] / full[pick], 3) if table else None,
                "vs_bf16": round(sum(base[k] for k in keys) / full[pick], 3),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "quant_gemm.json"))
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter smoke)")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--shapes", nargs="*", default=None, help=f"subset of {sorted(SHAPES)}")
    ap.add_argument("--ms", type=int, nargs="*", default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--calls", type=int, default=8, help="calls per captured graph")
    ap.add_argument("--rotate-mb", type=float, default=120.0, help="weight bytes rotated over")
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.reps = 1
    res = run(args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
