"""Per-step profile of decode: wall time against device time, split into the engine's parts.

For each backend (each in its own subprocess) and each batch size: B requests of 128 random prompt
tokens are prefilled, then `--steps` decode steps are timed. Per step:

- ``wall_ms_plain``: `LLMEngine.step()` wall time, median over `--steps` steps with nothing
  timed or traced (the step as served); ``wall_ms_median``: the same over the next `--steps`
  steps, timed by part and traced;
- ``host_ms``: inclusive wall time of the engine's and the runner's parts, found by name (a part
  missing in this version of the code is left out): scheduling, the runner's state update, input
  preparation, host -> device puts, forward dispatch, sampling-tensor building, waits for device
  results (`jax.device_get` / `.tolist()`), output processing;
- ``device_ms`` (XLA): time of each compiled program on the device, read from a `jax.profiler`
  trace of the timed steps ("XLA Modules" lines of the GPU / TPU planes), summed by program name
  (forward, sampler, ...); ``device_busy_ms`` is their sum per step. On XLA:CPU the top ops
  (``kernel_ms``) come from XLA's thread-pool lines instead, summed over its threads.

The step is host-bound where wall_ms is well above device_busy_ms.

Run on a GPU: ``python -m xlaserve.bench.step_profile --output-json out.json``; on a CPU with
``--tiny`` (an 8B-shaped config with tiny sizes) to smoke-test.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from xlaserve.bench.common import wait_background_compiles
from xlaserve.bench.gpu_bench import write_model_dir

# (owner attribute path from the engine, method name, label). Inclusive times; nested parts are
# reported as they are (e.g. "runner.prepare" is inside "runner.launch").
_PARTS: list[tuple[str, str, str]] = [
    ("scheduler", "schedule", "schedule"),
    ("scheduler", "update_from_output", "scheduler.update"),
    ("", "_process", "engine.process"),
    ("runner", "launch", "runner.launch"),
    ("runner", "finish", "runner.finish"),
    ("runner", "execute", "runner.execute"),
    ("runner", "_update_states", "runner.update_states"),
    ("runner", "_prepare", "runner.prepare"),
    ("runner", "_device_inputs", "runner.device_inputs"),
    ("runner", "_forward", "runner.forward_dispatch"),
    ("runner", "_sampling_tensors", "runner.sampling_tensors"),
    ("runner", "_sampling_params", "runner.sampling_params"),
    ("runner", "_emit", "runner.emit"),
]


class _Timers:
    """Accumulates inclusive wall time per label while `on` is set."""

    def __init__(self) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)
        self.count: dict[str, int] = collections.defaultdict(int)
        self.on = False

    def wrap(self, fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:  # noqa: ANN401
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[label] += time.perf_counter() - t0
                self.count[label] += 1

        return timed

    def reset(self) -> None:
        self.total.clear()
        self.count.clear()


def _instrument(
    engine: Any,
    timers: _Timers,
    backend: str,
    sync_programs: bool = False,  # noqa: ANN401
) -> list[str]:
    found = []
    for owner_path, name, label in _PARTS:
        owner = getattr(engine, owner_path) if owner_path else engine
        fn = getattr(owner, name, None)
        if callable(fn):
            setattr(owner, name, timers.wrap(fn, label))
            found.append(label)
    if backend == "xla":
        import jax

        jax.device_get = timers.wrap(jax.device_get, "wait.device_get")
        found.append("wait.device_get")
        if sync_programs:  # each compiled program waited for: dispatch + device time
            found += _sync_programs(engine.runner, timers)
    return found


def _sync_programs(runner: Any, timers: _Timers) -> list[str]:  # noqa: ANN401
    """Wrap the XLA runner's program lookup (`_program(kind, n)`, wherever the runner keeps it)
    so that each call blocks until its results are ready and is timed as "program.<kind>"."""
    import jax

    owner = next(
        (o for o in (runner, getattr(runner, "programs", None)) if hasattr(o, "_program")), None
    )
    if owner is None:
        return []
    lookup = owner._program

    def program(kind: str, n: int, *a: Any, **k: Any) -> Any:  # noqa: ANN401
        prog = lookup(kind, n, *a, **k)

        def call(*args: Any, **kw: Any) -> Any:  # noqa: ANN401
            return jax.block_until_ready(prog(*args, **kw))

        return timers.wrap(call, f"program.{kind}")

    owner._program = program
    return ["program.*"]


# XLA:CPU runtime events on its thread-pool lines (whole-program spans, waits), not ops.
_CPU_RUNTIME_EVENTS = ("ThunkExecutor", "SlinkyThreadPool", "end: ")


def _device_modules(
    trace_dir: str, seen: list[str]
) -> tuple[dict[str, float], dict[str, float], int]:
    """From a jax trace: (ms per XLA module name, ms per kernel name, kernel launches) on the
    accelerator planes.
    Modules come from "XLA Modules" lines where the profiler writes them; kernels from the
    compute stream lines (GPU: "Stream #N(...Compute...)"), on the CPU from XLA's thread-pool
    lines (op time summed over its threads). Plane / line names go to `seen`."""
    from jax.profiler import ProfileData

    mods: dict[str, float] = collections.defaultdict(float)
    kernels: dict[str, float] = collections.defaultdict(float)
    launches = [0]
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        data = ProfileData.from_file(path)
        for plane in data.planes:
            seen.append(f"{plane.name}: {[ln.name for ln in plane.lines][:6]}")
            if plane.name == "/host:CPU":  # XLA:CPU: its ops run on the XLA thread-pool lines
                for line in plane.lines:
                    if line.name.startswith("tf_XLAEigen"):
                        for ev in line.events:
                            if not ev.name.startswith(_CPU_RUNTIME_EVENTS):
                                kernels[ev.name[:80]] += ev.duration_ns / 1e6
                                launches[0] += 1
                continue
            if not any(k in plane.name for k in ("GPU", "TPU")):
                continue
            for line in plane.lines:
                if line.name == "XLA Modules":
                    for ev in line.events:  # "jit_forward(12345)" -> "jit_forward"
                        mods[ev.name.split("(")[0]] += ev.duration_ns / 1e6
                elif "Compute" in line.name or line.name == "XLA Ops":
                    for ev in line.events:
                        kernels[ev.name[:80]] += ev.duration_ns / 1e6
                        launches[0] += 1
    return dict(mods), dict(kernels), launches[0]


def stage(args: argparse.Namespace) -> dict[str, Any]:
    """One backend: prefill B prompts, time `steps` decode steps per batch size."""
    import numpy as np

    from xlaserve import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    kw: dict[str, Any] = {
        "model": args.model_dir,
        "backend": args.backend,
        "load_format": "dummy",
        "dtype": args.dtype or ("float32" if args.tiny else "bfloat16"),
        "max_model_len": args.max_model_len,
        "max_num_seqs": max(batches),
    }
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(**kw)
    result: dict[str, Any] = {"backend": args.backend, "init_s": time.perf_counter() - t0}
    wait_background_compiles(llm)  # XLA: none may run beside the timed steps
    engine = llm.llm_engine
    timers = _Timers()
    result["parts"] = _instrument(engine, timers, args.backend, args.sync_programs)
    vocab = engine.spec.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_model_len - args.prompt_len - 1, ignore_eos=True
    )
    for b in batches:
        ids = []
        for _ in range(b):
            rid = engine.new_request_id()
            prompt = rng.integers(2, vocab, size=args.prompt_len).tolist()
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            ids.append(rid)
        # Prefill (chunked) until every request has decoded a few tokens.
        sched = engine.scheduler
        for _ in range(10_000):
            engine.step()
            reqs = list(sched.requests.values())
            if len(reqs) >= b and all(r.num_output_tokens >= 3 for r in reqs):
                break
        for _ in range(args.warmup):
            engine.step()
        plain = []  # untimed parts, no trace: the step as served
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t)
        trace_dir = tempfile.mkdtemp(prefix="xla_trace_") if args.backend == "xla" else None
        walls = []
        timers.reset()
        timers.on = True
        ctx = None
        if trace_dir:
            import jax

            ctx = jax.profiler.trace(trace_dir)
            ctx.__enter__()
        try:
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - t)
        finally:
            timers.on = False
            if ctx is not None:
                ctx.__exit__(None, None, None)
        row: dict[str, Any] = {
            "batch": b,
            "steps": args.steps,
            "wall_ms_plain": 1e3 * statistics.median(plain),
            "wall_ms_median": 1e3 * statistics.median(walls),
            "wall_ms_mean": 1e3 * statistics.mean(walls),
            "tok_s": b / statistics.median(walls),
            "host_ms": {k: 1e3 * v / args.steps for k, v in sorted(timers.total.items())},
            "calls_per_step": {k: v / args.steps for k, v in sorted(timers.count.items())},
        }
        if trace_dir:
            seen: list[str] = []
            mods, kernels, launches = _device_modules(trace_dir, seen)
            row["trace_planes"] = seen
            row["device_ms"] = {k: v / args.steps for k, v in sorted(mods.items())}
            row["kernel_launches_per_step"] = launches / args.steps
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
            row["kernel_ms"] = {k: v / args.steps for k, v in top}  # top kernels, per step
            row["kernel_count_busy_ms"] = (len(kernels), sum(kernels.values()) / args.steps)
            row["device_busy_ms"] = sum(row["device_ms"].values()) or row["kernel_count_busy_ms"][1]
        result[f"batch{b}"] = row
        engine.abort_request(ids)
        for _ in range(4):  # let aborts reach the runner
            engine.step()
        print(json.dumps(row, indent=1), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="xla,torch")
    p.add_argument("--batches", default="1,256")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--dtype", default="", help="default bfloat16 (float32 with --tiny)")
    p.add_argument("--model", default="", help="a model directory (e.g. the demo) instead of 8B")
    p.add_argument(
        "--sync-programs",
        action="store_true",
        help="XLA: block on each compiled program (its time = dispatch + device; no overlap)",
    )
    p.add_argument("--output-json", default="")
    p.add_argument("--timeout", type=int, default=600)
    # internal: one backend's stage
    p.add_argument("--backend", default="")
    p.add_argument("--model-dir", default="")
    p.add_argument("--stage-out", default="")
    args = p.parse_args(argv)
    if args.backend:
        res = stage(args)
        with open(args.stage_out, "w") as f:
            json.dump(res, f, indent=1)
        return
    model_dir = args.model or write_model_dir(
        tempfile.mkdtemp(prefix="xls_prof_"), num_layers=args.num_layers, tiny=args.tiny
    )
    results: dict[str, Any] = {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M")}
    for backend in args.backends.split(","):
        out = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, "-m", "xlaserve.bench.step_profile", "--backend", backend]
        cmd += ["--model-dir", model_dir, "--stage-out", out, "--batches", args.batches]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--prompt-len", str(args.prompt_len), "--max-model-len", str(args.max_model_len)]
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.tiny:
            cmd.append("--tiny")
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        if args.sync_programs:
            cmd.append("--sync-programs")
        try:
            rc = subprocess.run(cmd, timeout=args.timeout).returncode
            if rc == 0:
                with open(out) as f:
                    results[backend] = json.load(f)
            else:
                results[backend] = {"error": f"exit {rc}"}
        except subprocess.TimeoutExpired:
            results[backend] = {"error": "timeout"}
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
