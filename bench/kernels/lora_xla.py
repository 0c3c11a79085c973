"""Benchmark: multi-LoRA on the XLA backend, side by side with no LoRA (issue 27).

    python -m xlaserve.bench.kernels.lora_xla --out lora_xla.json [--tiny]

Two parts, one JSON:

- "kernels": one projection's shrink + expand (x [T, in] -> + B[slot] @ A[slot] @ x into
  [T, out]) for the Llama-3.1-8B projections (q 4096->4096, k/v 4096->1024, gate/up
  4096->14336, down 14336->4096) at T = 1, 256 and 2048 tokens spread over 8 rank-16 slots
  (bfloat16), per implementation ("xla" one-hot, "pallas_gpu" Triton kernel on a GPU,
  "pallas_tpu" on a TPU, "reference"), plus the base matmul alone: median of timed calls
  (each `block_until_ready`) and the max abs difference against the reference.
- "runner": the XlaModelRunner on the 8B shape (dummy weights, 32 layers) driven with hand-built
  SchedulerOutputs: decode steps at batch 1 and at batch `--batch` (each request 256 prompt
  tokens, prefilled first), the requests spread round-robin over 8 rank-16 adapters (random
  weights in every module) vs the same runner shape without LoRA, one runner per LoRA
  implementation (--impls, default "xla" + the platform's Pallas kernel); rows: start-up
  seconds, median step ms and output tok/s per batch, and lora / none ratios per
  implementation (goal: >= 0.85 at the big batch).

--tiny runs the same code on tiny shapes (the CPU smoke test; Pallas kernels under the
interpreter). Output: JSON to --out and stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

SLOTS, RANK = 8, 16
PROJ_8B = {"q": (4096, 4096), "kv": (4096, 1024), "gate_up": (4096, 14336), "down": (14336, 4096)}
PROJ_TINY = {"q": (64, 64), "down": (128, 64)}


def _time(fn, reps: int) -> float:  # noqa: ANN001
    """Median ms of `reps` calls after one warm-up call (each waited for)."""
    import jax

    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def bench_kernels(tiny: bool, reps: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from xlaserve.kernels_pallas.lora import lora_expand, lora_shrink, make_segments

    dtype = jnp.float32 if tiny else jnp.bfloat16
    backend = jax.default_backend()
    impls = ["reference", "xla"] + {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(backend, [])
    if tiny:
        impls.append("pallas_gpu")  # the interpreter: checks the script, not the speed
    rows = []
    rng = np.random.default_rng(0)
    for name, (d_in, d_out) in (PROJ_TINY if tiny else PROJ_8B).items():
        for t in (1, 16) if tiny else (1, 256, 2048):
            x = jnp.asarray(rng.normal(size=(t, d_in)), dtype)
            w = jnp.asarray(rng.normal(0, 0.02, size=(d_out, d_in)), dtype)
            a = jnp.asarray(rng.normal(0, 0.02, size=(SLOTS, RANK, d_in)), dtype)
            b = jnp.asarray(rng.normal(0, 0.02, size=(SLOTS, d_out, RANK)), dtype)
            slots = jnp.asarray(np.arange(t) % SLOTS, jnp.int32)
            base = jax.jit(lambda x, w: x @ w.T)
            row: dict[str, Any] = {"proj": name, "in": d_in, "out": d_out, "tokens": t,
                                   "base_ms": _time(lambda: base(x, w), reps)}  # noqa: B023  # fmt: skip
            want = None
            for impl in impls:

                @jax.jit
                def step(x, w, a, b, slots, impl=impl):  # noqa: ANN001, ANN202
                    seg = make_segments(slots, SLOTS)
                    return lora_expand(x @ w.T, lora_shrink(x, a, seg, impl), b, seg, 0, impl)

                try:
                    out = np.asarray(step(x, w, a, b, slots), np.float32)
                    want = out if want is None else want
                    row[f"{impl}_ms"] = _time(lambda: step(x, w, a, b, slots), reps)  # noqa: B023
                    row[f"{impl}_max_abs_diff"] = float(np.abs(out - want).max())
                except Exception as e:  # noqa: BLE001 - one failing impl must not stop the run
                    row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def _adapter(spec, int_id: int, rng: np.random.Generator):  # noqa: ANN001, ANN202
    from xlaserve.lora import LoRAAdapter

    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
    w = {
        (layer, m): (
            rng.normal(0, 0.01, (RANK, d_in)).astype(np.float32),
            rng.normal(0, 0.01, (d_out, RANK)).astype(np.float32),
        )
        for layer in range(spec.num_layers)
        for m, (d_in, d_out) in dims.items()
    }
    return LoRAAdapter(f"a{int_id}", int_id, RANK, 1.0, w)


def _run_decode(runner, batch: int, prompt_len: int, steps: int, lora: bool) -> dict[str, float]:  # noqa: ANN001
    """Prefill `batch` requests (chunks of the token budget), then time `steps` decode steps."""
    from xlaserve.runner import CachedRequestData, NewRequestData, SchedulerOutput
    from xlaserve.sampling_params import SamplingParams

    s, budget = runner.block_size, runner.config.scheduler.max_num_batched_tokens
    rng = np.random.default_rng(batch)
    blocks_per = -(-(prompt_len + steps + 2) // s)
    reqs = {}
    for i in range(batch):
        rid = f"b{batch}-{int(lora)}-{i}"
        reqs[rid] = dict(
            toks=rng.integers(1, runner.vocab, prompt_len).tolist(),
            blocks=list(range(i * blocks_per, (i + 1) * blocks_per)), done=0, sent=False,
            slot=i % SLOTS if lora else -1,
        )  # fmt: skip
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 2)
    times = []
    while True:
        so, left = SchedulerOutput(), budget
        decode = all(len(r["toks"]) - r["done"] == 1 for r in reqs.values())
        for rid, r in reqs.items():
            n = min(len(r["toks"]) - r["done"], left)
            if n <= 0:
                continue
            if not r["sent"]:
                so.new_requests.append(NewRequestData(rid, list(r["toks"]), prompt_len, params,
                                                      r["blocks"], 0, lora_slot=r["slot"]))  # fmt: skip
                r["sent"] = True
            else:
                so.cached_requests.append(CachedRequestData(rid, [], r["done"]))
            so.num_scheduled_tokens[rid] = n
            left -= n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        t0 = time.perf_counter()
        out = runner.execute(so)
        if decode:
            times.append((time.perf_counter() - t0) * 1e3)
        for rid, n in so.num_scheduled_tokens.items():
            reqs[rid]["done"] += n
            reqs[rid]["toks"] += out.sampled_token_ids[rid]
        if len(times) >= steps:
            break
    runner.execute(SchedulerOutput(finished_req_ids=set(reqs)))
    ms = statistics.median(times)
    return {"step_ms": ms, "tok_s": batch / ms * 1e3}


def bench_runner(
    tiny: bool, batch: int, steps: int, impls: list[str], prompt_len: int | None = None
) -> dict[str, Any]:
    """Decode rows of the runner without LoRA and with LoRA per implementation in `impls`
    (KernelConfig.lora_impl); a variant that fails is recorded with its error."""
    from xlaserve.backends_xla.runner import XlaModelRunner
    from xlaserve.bench.gpu_bench import write_model_dir
    from xlaserve.config import EngineConfig
    from xlaserve.model_loader.registry import build_spec

    path = write_model_dir(tempfile.mkdtemp(), num_layers=2 if tiny else 32, tiny=tiny)
    prompt_len = prompt_len or (16 if tiny else 256)
    res: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "slots": SLOTS, "rank": RANK}
    batches = sorted({1, batch})
    for impl in [None, *impls]:
        key = "none" if impl is None else f"lora_{impl}"
        kw: dict[str, Any] = dict(
            model=path, load_format="dummy", max_num_seqs=batch, max_model_len=prompt_len + 64,
            max_num_batched_tokens=max(batch, 64 if tiny else 256), block_size=16,
            num_kv_blocks=batch * (-(-(prompt_len + steps + 2) // 16)) + 8,
        )  # fmt: skip
        if tiny:
            kw["compilation_cache_dir"] = tempfile.mkdtemp()
        if impl is not None:
            kw.update(enable_lora=True, max_loras=SLOTS, max_lora_rank=RANK, lora_impl=impl)
        runner = None
        try:
            t0 = time.perf_counter()
            runner = XlaModelRunner(EngineConfig.from_kwargs(**kw), build_spec(path))
            runner.load_model()
            runner.init_kv_cache(runner.determine_num_kv_blocks())
            res[f"{key}_startup_s"] = time.perf_counter() - t0
            if impl is not None:
                rng = np.random.default_rng(0)
                loads = [(s, _adapter(runner.spec, s + 1, rng)) for s in range(SLOTS)]
                runner.lora_tables.write(loads)
            for b in batches:
                res[f"{key}_b{b}"] = _run_decode(runner, b, prompt_len, steps, impl is not None)
                print(json.dumps({key: b, **res[f"{key}_b{b}"]}), file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - one failing variant must not stop the run
            res[f"{key}_error"] = f"{type(e).__name__}: {e}"[:500]
            print(res[f"{key}_error"], file=sys.stderr)
        finally:
            if runner is not None:
                runner.shutdown()
                del runner
                gc.collect()  # free the device memory before the next variant's weights
    for impl in impls:
        for b in batches:
            if f"lora_{impl}_b{b}" in res and f"none_b{b}" in res:
                ratio = res[f"lora_{impl}_b{b}"]["tok_s"] / res[f"none_b{b}"]["tok_s"]
                res[f"ratio_{impl}_b{b}"] = ratio
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="lora_xla.json")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--batch", type=int, default=256, help="the big decode batch")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per kernel row")
    ap.add_argument("--skip-runner", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256 (tiny: 16)")
    ap.add_argument(
        "--impls", default=None,
        help="LoRA implementations of the runner rows, comma-separated (default: xla + this "
        "platform's Pallas kernel)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    import jax

    out: dict[str, Any] = {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }
    if not args.skip_kernels:
        out["kernels"] = bench_kernels(args.tiny, args.reps)
    if not args.skip_runner:
        pallas = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(jax.default_backend(), [])
        impls = args.impls.split(",") if args.impls else ["xla", *pallas]
        out["runner"] = bench_runner(args.tiny, args.batch, args.steps, impls, args.prompt_len)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
