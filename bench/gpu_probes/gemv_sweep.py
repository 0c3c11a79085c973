#!/usr/bin/env python
"""GPU probe behind bench/RESULTS.md "fourth session", call 2: the dense Triton GEMV
(kernels_cuda/dense_gemv.py) against cuBLAS at M == 1 on the Llama-8B shapes, 36 tile configs
per shape.

    OUT=dir python bench/gpu_probes/gemv_sweep.py   # -> $OUT/gemv_sweep.json

Each timing is a CUDA graph of one call per weight copy (>= 512 MB of copies, so weights come
from HBM), replayed 5 times; the median replay divided by the copies. The maintained sweep with
the same method is `python -m xlaserve.bench.kernels.cuda_kernels --only dense_gemv`.
"""

from __future__ import annotations

import itertools
import json
import os

import torch
import torch.nn.functional as F

from xlaserve.bench.timing import graph_time_us
from xlaserve.kernels_cuda.dense_gemv import dense_gemv
from xlaserve.kernels_cuda.quant_matmul import GemvTiles

OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
CFGS = [
    GemvTiles(bn, bk, sp, nw)
    for bn, bk, nw, sp in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (0, 1))
]


def timed(fn, ws, x, reps=5):  # noqa: ANN001, ANN201
    return graph_time_us([lambda w=w: fn(x, w) for w in ws], reps)


res = {}
for name, (n, k) in SHAPES.items():
    nbytes = n * k * 2
    copies = max(1, -(-512 * 2**20 // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    r = {
        "cublas_us": timed(lambda x, w: F.linear(x, w), ws, x),
        "copies": copies,
        "mb": nbytes / 2**20,
    }
    best = None
    rows = []
    for cfg in CFGS:
        try:
            err = (dense_gemv(x, ws[0], tiles=cfg).float() - ref).abs().max().item()
            us = timed(lambda x, w, c=cfg: dense_gemv(x, w, tiles=c), ws, x)
            rows.append({"cfg": list(cfg), "us": us, "err": err})
            if best is None or us < best["us"]:
                best = rows[-1]
        except Exception as e:  # noqa: BLE001
            rows.append({"cfg": list(cfg), "error": repr(e)[:200]})
    r["best"] = best
    r["rows"] = rows
    r["cublas_tbs"] = nbytes / r["cublas_us"] / 1e6
    r["best_tbs"] = nbytes / best["us"] / 1e6 if best else None
    res[name] = r
    print(
        name,
        f"cublas {r['cublas_us']:.1f} us ({r['cublas_tbs']:.2f} TB/s)  best {best}",
        flush=True,
    )
    del ws
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(OUT, "gemv_sweep.json"), "w"), indent=1)
