"""Start-up of `LLM(backend="xla")`, cold and warm, in one command (issue 33).

Cold: a fresh JAX persistent compilation cache; warm: a new process with the cache the cold run
filled (what a restarted server sees). Each run is its own subprocess (a process's in-memory
caches would flatter the warm figure). Per run: seconds from `LLM(...)` to ready and to every
start-up program compiled (the larger token buckets compile in the background after ready: see
KernelConfig.xla_startup_token_bucket), each program's compile seconds, the number of
XLA backend compilations and their summed seconds (JAX's compile-duration events; persistent-cache
hits are counted apart, and so are programs loaded from xlaserve's executable cache, which skip
tracing too: backends_xla/exec_cache.py), the token / request buckets, and the seconds to the first generated token of
one request after start-up (a compile missed at start-up shows there).

    # H200, the Llama-3.1-8B shape with dummy bf16 weights (the issue's goal: cold <= 30 s,
    # warm <= 10 s):
    python -m xlaserve.bench.xla_startup --llama8b --output-json xla_startup.json
    # CPU, the demo model:
    python -m xlaserve.bench.xla_startup --output-json /tmp/xla_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from xlaserve.bench.common import (
    add_model_args,
    model_engine_kwargs,
    resolve_model_dir,
    run_stage,
    wait_background_compiles,
)

# JAX times the whole backend compile step under this event, persistent-cache hits included.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def one_start(args: argparse.Namespace) -> dict[str, Any]:
    """Build the LLM once with args.cache_dir, time it, count compilations, run one request."""
    import jax

    from xlaserve import LLM, SamplingParams

    compiles: list[float] = []

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    hits: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event == CACHE_HIT_EVENT else None
    )
    kw = model_engine_kwargs(args)
    kw["backend"] = "xla"
    max_len = args.max_model_len or (2048 if args.llama8b else None)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    exe = {"auto": None, "on": True, "off": False}[args.executable_cache]
    llm = LLM(args.model_dir, max_num_batched_tokens=args.tokens, max_num_seqs=args.seqs,
              max_model_len=max_len, compilation_cache_dir=args.cache_dir,
              xla_executable_cache=exe, **kw)  # fmt: skip
    ready = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    all_compiled = time.perf_counter() - t0 if wait_background_compiles(llm) else None
    top: list[str] = []
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.profile)
        top = [ln for ln in buf.getvalue().splitlines() if ln.strip()][-args.profile :]
    n_start, s_start, n_hits = len(compiles), sum(compiles), len(hits)
    t1 = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": list(range(10, 42))}],
        SamplingParams(temperature=0.0, max_tokens=1),
        use_tqdm=False,
    )
    first = time.perf_counter() - t1
    out = {
        "seconds_to_ready": round(ready, 2),
        # ready + the background compiles of the larger token buckets (waited for before the
        # request below, so its first-token time counts no compile)
        "seconds_to_all_compiled": all_compiled and round(all_compiled, 2),
        "programs": n_start,
        "persistent_cache_hits": n_hits,
        "xla_compiles": n_start - n_hits,
        "executable_cache_loads": getattr(runner, "exec_cache_loads", 0),
        "compile_seconds": round(s_start, 2),
        "first_token_s": round(first, 3),
        "compiles_during_first_request": len(compiles) - n_start,
        # each start-up program's compile wall seconds (threads overlap them), longest first
        "program_compile_s": {
            f"{k}:{n}": round(v, 2)
            for (k, n), v in sorted(
                getattr(runner, "compile_seconds", {}).items(), key=lambda kv: -kv[1]
            )
        },
        "token_buckets": getattr(runner, "token_buckets", None),
        "seq_buckets": getattr(runner, "seq_buckets", None),
    }
    if top:
        out["profile_top_cumulative"] = top
    llm.llm_engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--seqs", type=int, default=256, help="max_num_seqs")
    ap.add_argument("--max-model-len", type=int, default=0, help="0: the model's (8B: 2048)")
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON path: one start
    ap.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    ap.add_argument("--executable-cache", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.xla_executable_cache (auto: on except on the CPU)")  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, help="cProfile's top N rows per run")
    ap.add_argument("--in-process", action="store_true", help="runs in this process (tests)")
    ap.add_argument("--output-json", default="xla_startup.json")
    a = ap.parse_args(argv)
    if a.worker:
        res = one_start(a)
        with open(a.worker, "w") as f:
            json.dump(res, f)
        return res
    a.model_dir = resolve_model_dir(a, "xla-startup-")
    cache = tempfile.mkdtemp(prefix="xlaserve-jax-startup-")
    results: dict[str, Any] = {"model_dir": a.model_dir, "llama8b": a.llama8b}
    for name in ("cold", "warm"):
        out = os.path.join(cache, f"{name}.json")
        cmd = [sys.executable, "-m", "xlaserve.bench.xla_startup", "--model-dir", a.model_dir,
               "--tokens", str(a.tokens), "--seqs", str(a.seqs), "--max-model-len",
               str(a.max_model_len), "--cache-dir", cache, "--worker", out,
               "--profile", str(a.profile), "--executable-cache", a.executable_cache]  # fmt: skip
        if a.llama8b:  # the dummy-weight keywords (the model dir is already written)
            cmd += ["--llama8b"] + (["--tiny"] if a.tiny else [])

        def here(a: argparse.Namespace = a) -> dict[str, Any]:
            b = argparse.Namespace(**vars(a))
            b.cache_dir = cache
            return one_start(b)

        results[name] = run_stage(here if a.in_process else None, cmd, out, a.timeout)
        print(name, json.dumps(results[name]), flush=True)
    with open(a.output_json, "w") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
