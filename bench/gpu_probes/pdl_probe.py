#!/usr/bin/env python
"""GPU probe behind bench/RESULTS.md "fourth session", call 3: does programmatic dependent launch
(PDL) work from Triton inside a CUDA graph here, and what does it save on a chain of
decode-shaped kernels?

    OUT=dir python bench/gpu_probes/pdl_probe.py   # -> $OUT/pdl.json (ms per graph replay)

32 "layers" of four bf16 GEMVs of the Llama-8B shapes (optionally each preceded by a small
one-program RMSNorm-like kernel), captured in one graph, replayed 20 times (median): without PDL,
with PDL where each kernel signals its dependents at its start ("early") or after its main loop
("late").
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def gemv(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + (k0 + rk)[None, :])
        xv = tl.load(x_ptr + k0 + rk).to(tl.float32)
        acc += w.to(tl.float32) * xv[None, :]
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + rn, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))


@triton.jit
def small(x_ptr, y_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r, mask=r < N, other=0.0).to(tl.float32)
    s = tl.sum(x * x, 0) / N
    tl.store(y_ptr + r, (x * tl.rsqrt(s + 1e-6)).to(y_ptr.dtype.element_ty), mask=r < N)


dev = "cuda"
H, INTER = 4096, 14336
layers = 32
shapes = [(6144, H), (H, H), (2 * INTER, H), (H, INTER)]
W = [
    [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
    for _ in range(layers)
]
bufs = {
    n: torch.zeros(max(n, 1), device=dev, dtype=torch.bfloat16) for n in (H, 6144, 2 * INTER, INTER)
}
x = torch.randn(H, device=dev, dtype=torch.bfloat16)


def step(pdl, early, with_small):
    kw = dict(launch_pdl=True) if pdl else {}
    for layer in range(layers):
        src = x
        for i, (n, k) in enumerate(shapes):
            if with_small:
                small[(1,)](
                    src,
                    bufs[k] if k != H else x,
                    k,
                    BLOCK=triton.next_power_of_2(k),
                    PDL=pdl,
                    EARLY=early,
                    num_warps=8,
                    **kw,
                )
            inp = x if k == H else bufs[INTER]
            gemv[(n // 2,)](
                inp,
                W[layer][i],
                bufs[n] if n != H else bufs[H],
                n,
                k,
                BLOCK_N=2,
                BLOCK_K=1024,
                PDL=pdl,
                EARLY=early,
                num_warps=4,
                **kw,
            )


res = {"triton": triton.__version__, "torch": torch.__version__}
for name, (pdl, early, sm) in {
    "base": (False, False, False),
    "pdl_late": (True, False, False),
    "pdl_early": (True, True, False),
    "base+small": (False, False, True),
    "pdl_early+small": (True, True, True),
    "pdl_late+small": (True, False, True),
}.items():
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(pdl, early, sm)
            step(pdl, early, sm)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(pdl, early, sm)
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        res[name] = ts[10]
    except Exception as e:  # noqa: BLE001
        res[name] = repr(e)[:300]
    print(name, res[name], flush=True)
json.dump(res, open(os.path.join(OUT, "pdl.json"), "w"), indent=1)
