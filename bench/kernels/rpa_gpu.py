"""Benchmark: ragged paged attention on a GPU, jnp reference vs the Pallas GPU (Triton) kernel.

    python -m xlaserve.bench.kernels.rpa_gpu --out rpa_gpu.json [--sweep] [--smoke]

Llama-3.1-8B attention shapes (Hq 32, Hkv 8, D 128, page 16, bfloat16): decode batches of 1, 32
and 256 sequences (kv_len uniform in [384, 600]), one 2048-token prefill, and a mixed batch (4
prefill chunks of 256 tokens over cached prefixes + 200 decodes). Per case and impl: compile
time, the median of >= 20 timed calls (each `block_until_ready`), and the mean of 20 calls
queued back to back (closer to device time for short kernels), plus the max abs difference of
the kernel against the reference. The reference gathers every token's pages
(O(T * M * S * Hkv * D) float32 temporaries); cases whose estimate exceeds --ref-limit-gb skip
it and check the kernel against the reference on two 64-query chunks of the same cache (the
first and the last 64 positions) instead, saying so in the JSON.

--sweep times every `GpuBlockSizes` variant of SWEEP_DECODE on the decode cases and of
SWEEP_PREFILL on the prefill / mixed cases and reports the fastest per case: copy it into
TUNED_GPU_BLOCK_SIZES. A variant that fails to compile or run is recorded with its error and
the run goes on. --smoke runs tiny shapes (on CPU the kernel runs under the interpreter) to check
the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels_pallas.ragged_paged_attention import ragged_paged_attention
from xlaserve.kernels_pallas.ragged_paged_attention_gpu import (
    GpuBlockSizes,
    resolve_gpu_block_sizes,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model attention shape."""

    hq: int = 32
    hkv: int = 8
    d: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One batch: q_lens[i] queries over a kv_lens[i] context; T and B padded as given."""

    name: str
    kind: str  # "decode" | "prefill" (which sweep list applies)
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_tokens: int  # T (>= sum(q_lens))
    batch: int  # B (>= len(q_lens))


def make_cases(smoke: bool, seed: int = 0) -> list[BenchCase]:
    rng = np.random.default_rng(seed)

    def decode(b: int, pad_to: int) -> BenchCase:
        kv = tuple(int(x) for x in rng.integers(384, 601, size=b))
        if smoke:
            kv = tuple(int(x) for x in rng.integers(20, 60, size=b))
        return BenchCase(f"decode_b{b}", "decode", (1,) * b, kv, pad_to, pad_to)

    if smoke:
        return [
            decode(1, 8),
            decode(4, 4),
            BenchCase("prefill_1x96", "prefill", (96,), (96,), 96, 1),
            BenchCase("mixed_2x16+6", "prefill", (16, 16) + (1,) * 6,
                      (16, 40) + tuple(int(x) for x in rng.integers(20, 60, size=6)), 40, 8),
        ]  # fmt: skip
    mixed_dec = tuple(int(x) for x in rng.integers(384, 601, size=200))
    return [
        decode(1, 8),
        decode(32, 32),
        decode(256, 256),
        BenchCase("prefill_1x2048", "prefill", (2048,), (2048,), 2048, 1),
        # 4 chunks of 256 over cached prefixes of 0, 128, 256, 512, then 200 decodes.
        BenchCase("mixed_4x256+200", "prefill", (256,) * 4 + (1,) * 200,
                  (256, 384, 512, 768) + mixed_dec, 4 * 256 + 200, 204),
    ]  # fmt: skip


# Sweep lists: (rows_per_block, pages_per_block, num_warps, num_stages, kv_splits). Splits > 1
# are forced (the default only splits small grids).
SWEEP_DECODE: list[tuple[int, int, int, int, int]] = [
    (16, 8, 4, 2, 1), (16, 4, 4, 2, 1), (16, 16, 4, 2, 1), (16, 8, 8, 2, 1), (16, 8, 4, 3, 1),
    (16, 8, 4, 1, 1), (16, 16, 8, 3, 1), (16, 8, 4, 2, 4), (16, 8, 4, 2, 8), (16, 16, 4, 2, 4),
    (32, 8, 4, 2, 1),
]  # fmt: skip
SWEEP_PREFILL: list[tuple[int, int, int, int, int]] = [
    (64, 4, 4, 2, 1), (64, 8, 4, 2, 1), (64, 4, 8, 2, 1), (64, 4, 4, 3, 1), (64, 2, 4, 2, 1),
    (128, 4, 8, 2, 1), (128, 8, 8, 2, 1), (128, 4, 8, 3, 1), (128, 2, 4, 3, 1),
    (32, 4, 4, 2, 1), (32, 8, 4, 2, 1),
]  # fmt: skip


def _block_sizes(v: tuple[int, int, int, int, int]) -> GpuBlockSizes:
    rows, pages, warps, stages, splits = v
    return GpuBlockSizes(rows, pages, num_warps=warps, num_stages=stages, kv_splits=splits,
                         force_splits=splits > 1)  # fmt: skip


def build_inputs(case: BenchCase, shape: Shape, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random q and cache on the device; each sequence's pages are a random set of pages."""
    s = shape.page_size
    n_seq = len(case.q_lens)
    pages_per_seq = [-(-kl // s) for kl in case.kv_lens]
    m = max(pages_per_seq)
    n = sum(pages_per_seq) + 1
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n).astype(np.int32)
    bt = np.zeros((case.batch, m), np.int32)
    used = 0
    for i, npg in enumerate(pages_per_seq):
        bt[i, :npg] = perm[used : used + npg]
        used += npg
    cu = np.zeros(case.batch + 1, np.int32)
    cu[1 : n_seq + 1] = np.cumsum(case.q_lens)
    cu[n_seq + 1 :] = cu[n_seq]
    kvl = np.zeros(case.batch, np.int32)
    kvl[:n_seq] = case.kv_lens
    dt = jnp.dtype(shape.dtype)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (case.num_tokens, shape.hq, shape.d), dt)
    k_cache = jax.random.normal(kk, (n, s, shape.hkv, shape.d), dt)
    v_cache = jax.random.normal(kv, (n, s, shape.hkv, shape.d), dt)
    return (q, k_cache, v_cache, jnp.asarray(kvl), jnp.asarray(bt), jnp.asarray(cu),
            jnp.asarray([n_seq], jnp.int32))  # fmt: skip


def ref_temp_gb(case: BenchCase, shape: Shape, m: int) -> float:
    """Upper estimate of the reference's temporaries: gathered K/V (cache dtype, then float32)
    [T, M * S, Hkv, D] each, and ~3 float32 logits-sized arrays [T, Hq, M * S]."""
    length = m * shape.page_size
    kv = case.num_tokens * length * shape.hkv * shape.d * (jnp.dtype(shape.dtype).itemsize + 4)
    return (2 * kv + 3 * case.num_tokens * shape.hq * length * 4) / 1e9


def time_fn(fn: Callable[[], jax.Array], iters: int, warmup: int = 3) -> dict[str, float]:
    """Median of `iters` blocking calls and the mean of `iters` queued calls, in microseconds."""
    for _ in range(warmup):
        fn().block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs = [fn() for _ in range(iters)]
    outs[-1].block_until_ready()
    queued = (time.perf_counter() - t0) / iters
    return {"median_us": statistics.median(times) * 1e6, "queued_mean_us": queued * 1e6}


def _run_impl(
    args: tuple[jax.Array, ...], impl: str, sm_scale: float, block_sizes: GpuBlockSizes | None,
    iters: int,
) -> tuple[dict[str, Any], jax.Array | None]:  # fmt: skip
    """Compile + time one impl; errors are returned, never raised."""
    rec: dict[str, Any] = {"impl": impl}
    if block_sizes is not None:
        rec["block_sizes"] = dataclasses.asdict(block_sizes)

    def fn() -> jax.Array:
        return ragged_paged_attention(*args, sm_scale=sm_scale, impl=impl, block_sizes=block_sizes)

    try:
        t0 = time.perf_counter()
        out = fn()
        out.block_until_ready()
        rec["compile_s"] = round(time.perf_counter() - t0, 3)
        rec.update({k: round(v, 2) for k, v in time_fn(fn, iters).items()})
        return rec, out
    except Exception as e:  # noqa: BLE001 - a failing variant is data, not a crash
        rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        return rec, None


def _max_diff(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _chunk_check(
    args: tuple[jax.Array, ...], out: jax.Array, case: BenchCase, sm_scale: float, rows: int = 64
) -> dict[str, float]:
    """Single-sequence prefill whose reference is too big: the reference on the first and the
    last `rows` queries (as chunks over the same pages) against the kernel's rows."""
    q, k_cache, v_cache, _, bt, _, _ = args
    (q_len,), (kv_len,) = case.q_lens, case.kv_lens
    res = {}
    for name, lo in (("first", 0), ("last", q_len - rows)):
        ctx = kv_len - q_len + lo + rows  # context through the chunk's last query
        ref = ragged_paged_attention(
            q[lo : lo + rows], k_cache, v_cache, jnp.asarray([ctx], jnp.int32), bt[:1],
            jnp.asarray([0, rows], jnp.int32), jnp.asarray([1], jnp.int32),
            sm_scale=sm_scale, impl="reference",
        )  # fmt: skip
        res[f"max_abs_diff_{name}_{rows}"] = _max_diff(out[lo : lo + rows], ref)
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape()
    if args.smoke:
        shape = Shape(hq=8, hkv=2, d=64, page_size=16, dtype="bfloat16")
    sm_scale = shape.d**-0.5
    iters = max(20, args.iters)
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "shape": dataclasses.asdict(shape),
        "iters": iters,
        "ref_limit_gb": args.ref_limit_gb,
        "cases": [],
    }
    for case in make_cases(args.smoke):
        if args.only and not any(o in case.name for o in args.only.split(",")):
            continue
        inputs = build_inputs(case, shape)
        m = inputs[4].shape[1]
        est = ref_temp_gb(case, shape, m)
        t = case.num_tokens
        bs, bq, p, n_tiles, splits = resolve_gpu_block_sizes(
            t, case.batch, shape.hkv, shape.hq // shape.hkv, shape.d, shape.page_size,
            jnp.dtype(shape.dtype),
        )  # fmt: skip
        crec: dict[str, Any] = {
            "case": case.name, "T": t, "B": case.batch, "num_seqs": len(case.q_lens),
            "M": m, "kv_tokens": int(sum(case.kv_lens)), "ref_temp_gb_est": round(est, 2),
            "default_block_sizes": dataclasses.asdict(bs),
            "default_tiles": {"bq": bq, "pages_per_step": p, "tiles": n_tiles, "splits": splits},
        }  # fmt: skip
        ref_out = None
        if est <= args.ref_limit_gb:
            crec["reference"], ref_out = _run_impl(inputs, "reference", sm_scale, None, iters)
        else:
            crec["reference"] = {
                "impl": "reference",
                "skipped": f"temporaries ~{est:.1f} GB > --ref-limit-gb {args.ref_limit_gb}",
            }
        crec["pallas_gpu"], out = _run_impl(inputs, "pallas_gpu", sm_scale, None, iters)
        if out is not None:
            if ref_out is not None:
                crec["pallas_gpu"]["max_abs_diff_vs_reference"] = _max_diff(out, ref_out)
            elif len(case.q_lens) == 1:
                crec["pallas_gpu"].update(_chunk_check(inputs, out, case, sm_scale))
        r, k = crec["reference"], crec["pallas_gpu"]
        if "median_us" in r and "median_us" in k:
            crec["speedup_median"] = round(r["median_us"] / k["median_us"], 2)
        if args.sweep:
            variants = SWEEP_DECODE if case.kind == "decode" else SWEEP_PREFILL
            sweep = []
            for v in variants:
                if time.perf_counter() - t_start > args.budget_s:
                    sweep.append({"variant": v, "skipped": "--budget-s exceeded"})
                    continue
                rec, vout = _run_impl(inputs, "pallas_gpu", sm_scale, _block_sizes(v), iters)
                rec["variant"] = v
                if vout is not None and ref_out is not None:
                    rec["max_abs_diff_vs_reference"] = _max_diff(vout, ref_out)
                sweep.append(rec)
                del vout
            crec["sweep"] = sweep
            ok = [s for s in sweep if "median_us" in s]
            if ok:
                best = min(ok, key=lambda s: s["queued_mean_us"])
                crec["sweep_best"] = {"variant": best["variant"],
                                      "queued_mean_us": best["queued_mean_us"],
                                      "median_us": best["median_us"]}  # fmt: skip
        report["cases"].append(crec)
        del inputs, ref_out, out
        _print_case(crec)
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    return report


def _fmt(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return "ERROR"
    if "skipped" in rec:
        return "skipped"
    return f"{rec['median_us']:9.1f} / {rec['queued_mean_us']:9.1f}"


def _print_case(c: dict[str, Any]) -> None:
    k = c["pallas_gpu"]
    diff = k.get("max_abs_diff_vs_reference")
    if diff is None:
        diffs = [v for key, v in k.items() if key.startswith("max_abs_diff")]
        diff = max(diffs) if diffs else None
    line = (
        f"{c['case']:18s} T={c['T']:5d} B={c['B']:4d} | ref {_fmt(c['reference']):>21s} us"
        f" | pallas_gpu {_fmt(k):>21s} us | x{c.get('speedup_median', float('nan')):5.2f}"
        f" | maxdiff {diff if diff is None else f'{diff:.3g}'}"
    )
    print(line, flush=True)
    for rec in (c["reference"], k):
        if "error" in rec:
            print(f"    {rec['impl']} error: {rec['error'][:300]}", flush=True)
    if "sweep" in c:
        for s in c["sweep"]:
            print(f"    sweep {s['variant']}: {_fmt(s)}"
                  + (f"  {s['error'][:200]}" if "error" in s else ""), flush=True)  # fmt: skip
        if "sweep_best" in c:
            print(f"    best: {c['sweep_best']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--sweep", action="store_true", help="time the block-size variants too")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    ap.add_argument("--only", default="", help="comma-separated case name substrings")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per measurement (>= 20)")
    ap.add_argument("--ref-limit-gb", type=float, default=20.0,
                    help="skip the reference where its temporaries would exceed this")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="stop starting sweep variants after this many seconds")  # fmt: skip
    args = ap.parse_args(argv)
    print("times: median of blocking calls / mean of queued calls", flush=True)
    report = run(args)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} ({report['total_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
