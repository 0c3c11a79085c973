"""Micro-benchmark of the state-space prefill kernels (kernels_cuda/ssm_prefill.py, issue 25)
against the torch references the torch backend runs today (backends_torch/layers/ssm_ops.py), one
request's prefill of T tokens per row, side by side:

- ``conv``: ``causal_conv1d_prefill`` vs ``ssm_ops.causal_conv1d`` (x [T, C], K taps, state);
- ``ssd``: ``ssd_chunked_prefill`` vs ``ssm_ops.ssd_chunked`` (chunk 64, as SSMMixer calls it)
  with B / C expanded to heads, as the mixer passes them (G = Hs), and with the model's groups.

Shapes: Mamba2-2.7B (C = 5376, K = 4; Hs = 80, P = 64, N = 128, G = 1) and Bamba-9B (C = 8448,
Hs = 128, P = 64, N = 128, G = 1) at T in ``--tokens``. Each row: median ms of the kernel and of
the reference (CUDA events on a GPU, wall clock on the CPU), the speedup, and the max abs error
of the kernel against the reference. The result decides KernelConfig.ssm_prefill_triton's "auto".

GPU (the lead): ``python -m xlaserve.bench.kernels.ssm_prefill --output-json ssm_prefill.json``
CPU smoke run (Triton interpreter, tiny shapes):
``TRITON_INTERPRET=1 python -m xlaserve.bench.kernels.ssm_prefill --tiny --iters 1 \\
--output-json ssm_prefill.json``
Engine level (whole model, the switch on vs off), with the dummy-weight model bench:
``XLASERVE_SSM_PREFILL_TRITON=on python -m xlaserve.bench.ssm_bench --output-json on.json`` and
the same with ``=off``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from xlaserve.bench.timing import event_time_us

# name -> (C conv channels, Hs, P, N, G); C = d_inner + 2 G N.
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "mamba2-2.7b": (5376, 80, 64, 128, 1),
    "bamba-9b": (8448, 128, 64, 128, 1),
}
TINY: dict[str, tuple[int, int, int, int, int]] = {"tiny": (40, 4, 8, 16, 2)}
K = 4


def time_ms(fn: Callable[[], Any], iters: int, cuda: bool, warmup: int = 2) -> float:
    """Median milliseconds of fn() over iters runs."""
    return event_time_us(fn, iters, warmup, cuda) / 1e3


def _row(
    op: str, shape: str, t: int, kern: Callable[[], Any], ref: Callable[[], Any], iters: int
) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    err = max((a - b).abs().max().item() for a, b in zip(kern(), ref(), strict=True))
    k_ms, r_ms = time_ms(kern, iters, cuda), time_ms(ref, iters, cuda)
    return {
        "op": op, "shape": shape, "tokens": t, "kernel_ms": round(k_ms, 4),
        "reference_ms": round(r_ms, 4), "speedup": round(r_ms / k_ms, 3),
        "max_abs_err": err,
    }  # fmt: skip


def run(shapes: dict[str, tuple[int, int, int, int, int]], tokens: list[int], iters: int) -> list:
    """One conv row and two ssd rows (G = Hs as the mixer calls it, and the model's G) per
    (shape, T)."""
    from xlaserve.backends_torch.layers import ssm_ops
    from xlaserve.kernels_cuda.ssm_prefill import causal_conv1d_prefill, ssd_chunked_prefill

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (c, hs, p, n, grp) in shapes.items():
        for t in tokens:
            x = torch.randn(t, c, device=dev, generator=g)
            w = torch.randn(c, K, device=dev, generator=g)
            b = torch.randn(c, device=dev, generator=g)
            st = torch.randn(c, K - 1, device=dev, generator=g)
            rows.append(
                _row(
                    "conv",
                    name,
                    t,
                    lambda x=x, w=w, b=b, st=st: causal_conv1d_prefill(x, w, b, st),
                    lambda x=x, w=w, b=b, st=st: ssm_ops.causal_conv1d(x, w, b, st),
                    iters,
                )  # fmt: skip
            )
            xs = torch.randn(t, hs, p, device=dev, generator=g)
            dt = torch.nn.functional.softplus(torch.randn(t, hs, device=dev, generator=g) - 2)
            a = -torch.exp(torch.randn(hs, device=dev, generator=g))
            d = torch.randn(hs, device=dev, generator=g)
            h0 = torch.randn(hs, p, n, device=dev, generator=g)
            bm = torch.randn(t, grp, n, device=dev, generator=g)
            cm = torch.randn(t, grp, n, device=dev, generator=g)
            bh = bm.repeat_interleave(hs // grp, dim=1)
            ch = cm.repeat_interleave(hs // grp, dim=1)
            a3 = a.reshape(hs, 1, 1)

            def ref(xs=xs, dt=dt, a3=a3, bh=bh, ch=ch, d=d, h0=h0) -> Any:  # noqa: ANN001
                return ssm_ops.ssd_chunked(xs, dt, a3, bh, ch, d, h0, chunk=64)

            for op, bb, cc in (("ssd_g=hs", bh, ch), (f"ssd_g={grp}", bm, cm)):
                rows.append(
                    _row(
                        op,
                        name,
                        t,
                        lambda xs=xs, dt=dt, a=a, bb=bb, cc=cc, d=d, h0=h0: ssd_chunked_prefill(
                            xs, dt, a, bb, cc, d, h0, chunk=64
                        ),
                        ref,
                        iters,
                    )  # fmt: skip
                )
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="256,1024,4096", help="comma list of prefill lengths T")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    tokens = [int(v) for v in args.tokens.split(",")] if not args.tiny else [1, 37]
    rows = run(TINY if args.tiny else SHAPES, tokens, args.iters)
    for r in rows:
        print(json.dumps(r))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": str(torch.cuda.get_device_name(0)) if torch.cuda.is_available()
                       else "cpu", "rows": rows}, f, indent=1)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
