"""Launch-knob sweep of the Mamba2 SSD prefill kernel (kernels_cuda/ssm_prefill.py, issue 25).

The ninth-session kernel (one program per (head, 64-row P block), exact fp32 dots, 4 warps) ran
2.3x slower than the torch reference on the H200 (5.06 vs 2.34 ms, T = 256, Mamba2-2.7B layer).
This times (block_p, num_warps, precision, chunk) variants on one request's prefill at the
Mamba2-2.7B layer shape, with the max abs error against the torch reference, JSON lines out:

    python -m xlaserve.bench.gpu_probes.ssd_prefill_sweep --tokens 256,1024
The engine's whole varlen prefill step (64 requests of 256 tokens, B / C shared by all heads):
``--varlen 64x256``. CPU smoke run: ``TRITON_INTERPRET=1 python -m
xlaserve.bench.gpu_probes.ssd_prefill_sweep --tiny [--varlen 3x40]``
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from xlaserve.bench.kernels.ssm_prefill import time_ms

# (block_p, num_warps, precision, chunk)
VARIANTS = [
    (32, 8, "ieee", 64), (64, 8, "tf32", 64), (16, 4, "tf32", 64), (32, 4, "tf32", 32),
    (64, 8, "tf32x3", 64), (32, 4, "tf32x3", 64), (16, 4, "tf32x3", 64), (32, 8, "tf32x3", 64),
    (32, 4, "tf32x3", 32), (16, 4, "tf32x3", 32),
]  # fmt: skip


def _rows(
    variants: list,
    base: dict[str, Any],
    run: Callable[..., tuple],
    error: Callable[[tuple], tuple[float, float]],
    finish: Callable[[dict[str, Any]], None],
    iters: int,
    cuda: bool,
    force_bp: int = 0,
) -> list[dict[str, Any]]:
    """One JSON row per (block_p, num_warps, precision, chunk) variant, printed as it lands (a
    call cut short keeps its rows): run(**knobs) -> outputs, error(outputs) -> (max abs error,
    reference scale), the median time of run(**knobs), then finish(row) adds the caller's
    fields; a variant that fails to compile is a row with its error."""
    rows = []
    for bp, nw, prec, chunk in variants:
        bp = force_bp or bp
        row: dict[str, Any] = {**base, "block_p": bp, "num_warps": nw, "precision": prec,
                               "chunk": chunk}  # fmt: skip
        kw = {"chunk": chunk, "block_p": bp, "num_warps": nw, "precision": prec}
        try:
            err, scale = error(run(**kw))
            ms = time_ms(lambda kw=kw: run(**kw), iters, cuda)
            row.update(kernel_ms=round(ms, 4), max_abs_err=err, rel_err=err / max(scale, 1e-30))
            finish(row)
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a row
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _sweep(
    t: int, args: tuple, variants: list, iters: int, cuda: bool, force_bp: int
) -> list[dict[str, Any]]:
    """One row per variant at T = t tokens; args = (x, dt, A, B, C, D, h0)."""
    from xlaserve.kernels_cuda.ssm_prefill import ssd_chunked_prefill, ssd_chunked_prefill_ref

    y_ref, h_ref = ssd_chunked_prefill_ref(*args)
    ref_ms = time_ms(lambda: ssd_chunked_prefill_ref(*args), iters, cuda)

    def error(out: tuple) -> tuple[float, float]:
        y, h = out
        err = max((y - y_ref).abs().max().item(), (h - h_ref).abs().max().item())
        return err, max(y_ref.abs().max().item(), h_ref.abs().max().item())

    def finish(row: dict[str, Any]) -> None:
        row.update(reference_ms=round(ref_ms, 4), speedup=round(ref_ms / row["kernel_ms"], 3))

    def run(**kw: Any) -> tuple:  # noqa: ANN401
        return ssd_chunked_prefill(*args, **kw)

    return _rows(variants, {"tokens": t}, run, error, finish, iters, cuda, force_bp)


# The varlen step the engine runs: (block_p, num_warps, precision, chunk).
VARLEN_VARIANTS = [
    (32, 4, "tf32x3", 64), (32, 4, "tf32", 64), (32, 4, "bf16", 64), (64, 4, "bf16", 64),
    (64, 8, "bf16", 64), (16, 4, "bf16", 64), (32, 4, "bf16", 32), (64, 4, "bf16", 32),
    (32, 8, "tf32", 32), (64, 8, "tf32", 64), (64, 8, "bf16", 32), (64, 4, "bf16", 16),
    (32, 4, "bf16", 16), (64, 2, "bf16", 32),
]  # fmt: skip


def _varlen(seqs: int, length: int, tiny: bool, iters: int, cuda: bool) -> list[dict[str, Any]]:
    """A whole prefill step as the engine's Mamba2 layer runs it: `seqs` fresh requests of
    `length` tokens, x / B / C as views of one activated conv row (G = 1), one ssd_varlen launch
    per variant; errors against the torch reference on the first two requests."""
    from xlaserve.kernels_cuda.ssm_prefill import ssd_chunked_prefill_ref, ssd_varlen

    dev = torch.device("cuda" if cuda else "cpu")
    hs, p, n, grp = (4, 16, 16, 1) if tiny else (80, 64, 128, 1)
    t = seqs * length
    g = torch.Generator(device=dev).manual_seed(1)
    act = torch.nn.functional.silu(torch.randn(t, hs * p + 2 * grp * n, device=dev, generator=g))
    x = act[:, : hs * p].view(t, hs, p)
    B = act[:, hs * p : hs * p + grp * n].view(t, grp, n)
    C = act[:, hs * p + grp * n :].view(t, grp, n)
    dt = torch.nn.functional.softplus(torch.randn(t, hs, device=dev, generator=g) - 2)
    A = -torch.exp(torch.randn(hs, device=dev, generator=g))
    D = torch.randn(hs, device=dev, generator=g)
    states = torch.zeros(seqs + 1, hs, p, n, device=dev)
    cu = torch.arange(0, t + 1, length, dtype=torch.int32, device=dev)
    slots = torch.arange(seqs, device=dev)
    keep = torch.zeros(seqs, device=dev)
    refs = [
        ssd_chunked_prefill_ref(x[r * length : (r + 1) * length], dt[r * length : (r + 1) * length],
                                A, B[r * length : (r + 1) * length],
                                C[r * length : (r + 1) * length], D, states[0])
        for r in range(2)
    ]  # fmt: skip

    def run(**kw: Any) -> tuple:  # noqa: ANN401
        return ssd_varlen(x, dt, A, B, C, D, states, cu, slots, keep, **kw)

    def error(out: tuple) -> tuple[float, float]:
        y, h = out
        err, scale = 0.0, 0.0
        for r, (y_ref, h_ref) in enumerate(refs):
            yr = y[r * length : (r + 1) * length]
            err = max(err, (yr - y_ref).abs().max().item(), (h[r] - h_ref).abs().max().item())
            scale = max(scale, y_ref.abs().max().item(), h_ref.abs().max().item())
        return err, scale

    def finish(row: dict[str, Any]) -> None:
        row["tokens_per_ms"] = round(t / row["kernel_ms"], 1)

    variants = VARLEN_VARIANTS[:2] if tiny else VARLEN_VARIANTS
    base = {"seqs": seqs, "length": length}
    return _rows(variants, base, run, error, finish, iters, cuda, 16 if tiny else 0)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="256,1024")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--varlen", default="", help="SEQSxLEN: time the engine's varlen step")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.varlen:
        seqs, length = (int(v) for v in a.varlen.split("x"))
        return _varlen(seqs, length, a.tiny, a.iters, cuda)
    dev = torch.device("cuda" if cuda else "cpu")
    hs, p, n = (4, 16, 16) if a.tiny else (80, 64, 128)
    variants = VARIANTS[:2] if a.tiny else VARIANTS
    tokens = [37] if a.tiny else [int(v) for v in a.tokens.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for t in tokens:
        args = (
            torch.randn(t, hs, p, device=dev, generator=g),  # x
            torch.nn.functional.softplus(torch.randn(t, hs, device=dev, generator=g) - 2),  # dt
            -torch.exp(torch.randn(hs, device=dev, generator=g)),  # A
            torch.randn(t, hs, n, device=dev, generator=g),  # B
            torch.randn(t, hs, n, device=dev, generator=g),  # C
            torch.randn(hs, device=dev, generator=g),  # D
            torch.randn(hs, p, n, device=dev, generator=g),  # h0
        )
        rows.extend(_sweep(t, args, variants, a.iters, cuda, 16 if a.tiny else 0))
    return rows


if __name__ == "__main__":
    main()
