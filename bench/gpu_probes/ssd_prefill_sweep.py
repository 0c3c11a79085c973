"""Launch-knob sweep of the Mamba2 SSD prefill kernel (kernels_cuda/ssm_prefill.py, issue 25).

The ninth-session kernel (one program per (head, 64-row P block), exact fp32 dots, 4 warps) ran
2.3x slower than the torch reference on the H200 (5.06 vs 2.34 ms, T = 256, Mamba2-2.7B layer).
This times (block_p, num_warps, precision, chunk) variants on one request's prefill at the
Mamba2-2.7B layer shape, with the max abs error against the torch reference, JSON lines out:

    python -m xlaserve.bench.gpu_probes.ssd_prefill_sweep --tokens 256,1024
CPU smoke run: ``TRITON_INTERPRET=1 python -m xlaserve.bench.gpu_probes.ssd_prefill_sweep --tiny``
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch

from xlaserve.bench.kernels.ssm_prefill import time_ms

# (block_p, num_warps, precision, chunk)
VARIANTS = [
    (64, 4, "ieee", 64), (32, 4, "ieee", 64), (16, 4, "ieee", 64), (32, 8, "ieee", 64),
    (16, 2, "ieee", 64), (64, 8, "tf32", 64), (32, 4, "tf32", 64), (16, 4, "tf32", 64),
    (32, 4, "tf32", 32), (16, 4, "ieee", 32),
]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="256,1024")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    from xlaserve.kernels_cuda.ssm_prefill import ssd_chunked_prefill, ssd_chunked_prefill_ref

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    hs, p, n = (4, 16, 16) if a.tiny else (80, 64, 128)
    variants = VARIANTS[:2] if a.tiny else VARIANTS
    tokens = [37] if a.tiny else [int(v) for v in a.tokens.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for t in tokens:
        x = torch.randn(t, hs, p, device=dev, generator=g)
        dt = torch.nn.functional.softplus(torch.randn(t, hs, device=dev, generator=g) - 2)
        A = -torch.exp(torch.randn(hs, device=dev, generator=g))
        B = torch.randn(t, hs, n, device=dev, generator=g)
        C = torch.randn(t, hs, n, device=dev, generator=g)
        D = torch.randn(hs, device=dev, generator=g)
        h0 = torch.randn(hs, p, n, device=dev, generator=g)
        y_ref, h_ref = ssd_chunked_prefill_ref(x, dt, A, B, C, D, h0)
        ref_ms = time_ms(lambda: ssd_chunked_prefill_ref(x, dt, A, B, C, D, h0), a.iters, cuda)
        for bp, nw, prec, chunk in itertools.chain(variants):
            if a.tiny:
                bp = 16

            def fn(bp=bp, nw=nw, prec=prec, chunk=chunk) -> Any:  # noqa: ANN001
                return ssd_chunked_prefill(
                    x, dt, A, B, C, D, h0, chunk=chunk, block_p=bp, num_warps=nw, precision=prec
                )

            try:
                y, h = fn()
                err = max((y - y_ref).abs().max().item(), (h - h_ref).abs().max().item())
                ms = time_ms(fn, a.iters, cuda)
                row = {"tokens": t, "block_p": bp, "num_warps": nw, "precision": prec,
                       "chunk": chunk, "kernel_ms": round(ms, 4), "reference_ms": round(ref_ms, 4),
                       "speedup": round(ref_ms / ms, 3), "max_abs_err": err}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a row
                row = {"tokens": t, "block_p": bp, "num_warps": nw, "precision": prec,
                       "chunk": chunk, "error": f"{type(e).__name__}: {e}"[:300]}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
