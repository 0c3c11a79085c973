"""Benchmark: the jnp ragged paged attentions, the reference vs the chunked loop, per chunk size.

    python -m xlaserve.bench.kernels.rpa_xla --out rpa_xla.json [--keys 16,32,64,128] [--smoke]

Runs on whatever JAX backend is present (the CPU path of the XLA backend, the GPU fallback).
Shape: the demo model's attention (Hq 4, Hkv 2, D 48, page 16, float32) over a 10,922-page
cache (as the demo engine allocates). Cases (T tokens, B sequences, M pages per sequence, every
context `ctx` long): decodes of 64 sequences at max_model_len 128 and 512 with short and long
contexts, one batch-1 decode, one 256-token prefill. Per case: the median of 7 means of 20
calls (each `block_until_ready`) for the reference and for `chunked_ragged_paged_attention` at
each keys-per-step value, and the chunked result's max abs difference from the reference.
--smoke: tiny cache and two cases (checks the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels_pallas.ragged_paged_attention import (
    chunked_ragged_paged_attention,
    ref_ragged_paged_attention,
)

# (T, B, M, ctx)
CASES = [
    (64, 64, 8, 40),
    (64, 64, 8, 100),
    (64, 64, 32, 40),
    (64, 64, 32, 100),
    (64, 64, 32, 300),
    (1, 1, 32, 100),
    (256, 1, 32, 256),
]
SMOKE_CASES = [(8, 8, 4, 20), (16, 1, 4, 16)]


def _median_ms(fn: Callable[[], jax.Array], calls: int, repeats: int) -> float:
    fn().block_until_ready()  # compile
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn().block_until_ready()
        means.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(means)


def run(keys: list[int], smoke: bool) -> dict:
    rng = np.random.default_rng(0)
    hq, hkv, d, s = 4, 2, 48, 16
    n = 64 if smoke else 10922
    calls, repeats = (2, 1) if smoke else (20, 7)
    k_cache = jnp.asarray(rng.normal(size=(n, s, hkv, d)), jnp.float32)
    v_cache = jnp.asarray(rng.normal(size=(n, s, hkv, d)), jnp.float32)
    rows = []
    for t, b, m, ctx in SMOKE_CASES if smoke else CASES:
        kv_lens = jnp.full((b,), ctx, jnp.int32)
        # decodes: one token per sequence; one sequence: all T tokens are its last T positions
        cu = jnp.arange(b + 1, dtype=jnp.int32) if t == b else jnp.array([0, t], jnp.int32)
        tables = jnp.asarray(rng.integers(0, n, (b, m)), jnp.int32)
        q = jnp.asarray(rng.normal(size=(t, hq, d)), jnp.float32)
        args = (q, k_cache, v_cache, kv_lens, tables, cu, jnp.array([b], jnp.int32))
        ref = jax.jit(functools.partial(ref_ragged_paged_attention, sm_scale=d**-0.5))
        want = ref(*args)
        row = {"T": t, "B": b, "M": m, "ctx": ctx, "reference_ms": _median_ms(
            lambda ref=ref, args=args: ref(*args), calls, repeats)}  # fmt: skip
        for kps in keys:
            fn = jax.jit(functools.partial(
                chunked_ragged_paged_attention, sm_scale=d**-0.5, keys_per_step=kps))  # fmt: skip
            row[f"chunked{kps}_ms"] = _median_ms(lambda fn=fn, args=args: fn(*args), calls, repeats)
            row[f"chunked{kps}_max_abs_diff"] = float(jnp.max(jnp.abs(fn(*args) - want)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"backend": jax.default_backend(), "cases": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", default="16,32,64,128", help="keys_per_step values")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    res = run([int(x) for x in args.keys.split(",")], args.smoke)
    res["date"] = time.strftime("%Y-%m-%d %H:%M")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
