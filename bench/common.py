"""What several benchmark scripts share: the model arguments and the model they name.

ap = argparse.ArgumentParser(...)
add_model_args(ap)            # --model-dir, --llama8b, --tiny, --backend
...
args.model_dir = resolve_model_dir(args, "lora-bench-")
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--model-dir (default: the demo model), --llama8b (the Llama-3.1-8B shape, dummy bf16
    weights), --tiny (with --llama8b: 2 tiny layers, a CPU test) and --backend."""
    ap.add_argument("--model-dir", default=None, help="default: the demo model (or --llama8b)")
    ap.add_argument("--llama8b", action="store_true", help="Llama-3.1-8B shape, dummy bf16")
    ap.add_argument("--tiny", action="store_true", help="with --llama8b: 2 tiny layers (CPU test)")
    ap.add_argument("--backend", default="auto")


def resolve_model_dir(args: argparse.Namespace, prefix: str) -> str:
    """args.model_dir when given; else with --llama8b a Llama-3.1-8B-shaped config (32 layers,
    or 2 tiny ones with --tiny) written under a new temporary directory named `prefix`...;
    else the demo model's directory."""
    if args.model_dir is not None:
        return args.model_dir
    if args.llama8b:
        from xlaserve.bench.gpu_bench import write_model_dir

        work = tempfile.mkdtemp(prefix=prefix)
        return write_model_dir(
            os.path.join(work, "llama8b"), num_layers=2 if args.tiny else 32, tiny=args.tiny
        )
    from xlaserve.demo import demo_model_path

    return demo_model_path()


def model_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keywords for the arguments of `add_model_args`: with --llama8b dummy bf16
    weights at 0.9 of the GPU memory (--tiny: float32, the default memory share, for the CPU);
    --backend unless "auto"."""
    kw: dict[str, Any] = {}
    if args.llama8b:
        kw.update(load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.9)
        if args.tiny:
            kw.update(dtype="float32")
            del kw["gpu_memory_utilization"]
    if args.backend != "auto":
        kw["backend"] = args.backend
    return kw


def wait_background_compiles(llm: Any) -> bool:  # noqa: ANN401
    """Block until an XLA runner's background compiles are done — the larger token buckets
    (compiled after ready) and the sampler specializations the steps so far asked for (each
    compiled the first time a request bucket and sampling mode meet) — so timed steps run at
    steady state; False when the backend has none. Works in-process and with the engine core
    in its own process (`LLM(..., engine_process=True)`)."""
    engine = llm.llm_engine
    if engine.backend != "xla":
        return False
    engine.wait_compiled()
    return True


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    """`n` prompts of `length` random token ids in [10, min(vocab, 30000)) (seeded)."""
    rng = random.Random(seed)
    hi = min(vocab, 30000) - 1
    return [{"prompt_token_ids": [rng.randint(10, hi) for _ in range(length)]} for _ in range(n)]


def run_stage(
    in_process: Callable[[], dict[str, Any]] | None,
    cmd: list[str],
    out: str,
    timeout: float,
) -> dict[str, Any]:
    """One benchmark stage: `in_process()` when given (an exception becomes the row's error),
    else `cmd` in a subprocess that writes its JSON to `out` (a timeout or a non-zero exit
    keeps what it wrote, with the error). Adds the stage's wall seconds."""
    t = time.perf_counter()
    if in_process is not None:
        try:
            res = in_process()
        except Exception as e:  # noqa: BLE001 - recorded, the other stages go on
            res = {"error": f"{type(e).__name__}: {e}"[:500]}
    else:
        if os.path.exists(out):
            os.remove(out)
        try:
            rc: int | str = subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        res = {}
        if os.path.exists(out):
            with open(out) as f:
                res = json.load(f)
        if rc != 0:
            res.setdefault("error", f"stage exit {rc}")
    res["stage_wall_s"] = time.perf_counter() - t
    return res
