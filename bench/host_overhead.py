"""Host overhead of one engine step, measured on the CPU with a model whose forward is negligible.

A 1-layer, hidden-64 Llama with a 32,000-token vocabulary (random weights, `load_format="dummy"`)
decodes `--batch` requests at once (greedy, EOS ignored, fixed output length): what is left of
each step is host work, i.e. scheduler, metadata building, logits -> token (sampler), detokenizer
and output objects. The same work sits between the GPU kernels of a large decode batch, where it
leaves the GPU idle (issue 7).

Per decode step (medians over the decode steps of each run; wall time and, less sensitive to other
load on the machine, the thread's CPU time): `engine.step`, and its parts
`scheduler.schedule`, `runner.execute` (of which `runner._sample`: logits + sampler),
`scheduler.update_from_output`, and the rest (engine output processing: detokenizer, logprobs,
RequestOutput objects).

    python -m xlaserve.bench.host_overhead                      # one run, JSON on stdout
    python -m xlaserve.bench.host_overhead --compare /tmp/base  # alternate this tree / another

`--compare DIR` runs the benchmark in subprocesses, alternating between this checkout and the
xlaserve source tree at DIR (same layout: DIR/src/xlaserve, DIR/backends_torch, ...), and prints
the median of each figure per tree. `--root DIR` (used by --compare) imports xlaserve from DIR.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)


def _use_root(root: str) -> None:
    """Point the editable install's package mapping at another source tree (before importing)."""
    import importlib

    for name in list(sys.modules):
        if name.startswith("__editable__") and name.endswith("_finder"):
            finder = sys.modules[name]
            break
    else:
        finder = None
        for entry in sys.path:
            if os.path.isdir(entry):
                for f in os.listdir(entry):
                    if f.startswith("__editable__") and f.endswith("_finder.py"):
                        finder = importlib.import_module(f[:-3])
    if finder is None:
        raise RuntimeError("--root needs xlaserve installed in editable mode")
    for k, v in list(finder.MAPPING.items()):
        finder.MAPPING[k] = os.path.join(root, os.path.relpath(v, _REPO))
    for name in [m for m in sys.modules if m == "xlaserve" or m.startswith("xlaserve.")]:
        del sys.modules[name]


def write_model(path: str, vocab: int, layers: int) -> str:
    """config.json of a tiny Llama with a large vocabulary + a tiny BPE tokenizer."""
    from xlaserve.bench.gpu_bench import TINY, write_model_dir

    write_model_dir(path, num_layers=layers, tiny=True)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(TINY, vocab_size=vocab, num_hidden_layers=layers, torch_dtype="float32")
    cfg.pop("rope_scaling", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def _timed(obj: Any, name: str, acc: list[float], cpu: list[float]) -> None:
    """Wrap obj.name: wall (perf_counter) and this thread's CPU time (robust to other load)."""
    inner = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return inner(*a, **k)
        finally:
            acc.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)

    setattr(obj, name, wrapper)


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from xlaserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as d:
        write_model(d, args.vocab, args.layers)
        llm = LLM(
            model=d,
            backend=args.backend,
            load_format="dummy",
            dtype="float32",
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, args.batch * args.input_len),
            block_size=16,
            num_kv_blocks=args.batch * (-(-(args.input_len + args.output_len) // 16) + 1),
            # Each request's whole length fits (small batches: the cache covers max_model_len).
            max_model_len=16 * (-(-(args.input_len + args.output_len) // 16) + 1),
            enable_prefix_caching=False,
            seed=0,
        )
    engine = llm.llm_engine
    sp = SamplingParams(
        max_tokens=args.output_len,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        ignore_eos=True,
    )
    g = np.random.default_rng(0)
    # Warm-up (allocator, first-call paths).
    llm.generate([{"prompt_token_ids": g.integers(2, 300, args.input_len).tolist()}] * 4, sp, False)
    prompts = [
        {"prompt_token_ids": p} for p in g.integers(2, 300, (args.batch, args.input_len)).tolist()
    ]
    final_only = args.final_only and "final_only" in inspect.signature(engine.step).parameters
    if final_only:  # what LLM.generate needs: outputs of finished requests only
        step = engine.step
        # LLM.generate may pass final_only itself (newer trees): force it either way.
        engine.step = lambda *a, **k: step(*a, **{**k, "final_only": True})
    phases: dict[str, list[float]] = {
        k: []
        for k in ("step", "schedule", "execute", "launch", "finish", "sample", "update", "front")
    }
    cpu: dict[str, list[float]] = {k: [] for k in phases}
    _timed(engine, "step", phases["step"], cpu["step"])
    _timed(engine.scheduler, "schedule", phases["schedule"], cpu["schedule"])
    # Synchronous steps call runner.execute; async scheduling launch + finish (a launch of
    # step N+1 and the finish of step N in one engine step).
    for part in ("execute", "launch", "finish"):
        if hasattr(engine.runner, part):
            _timed(engine.runner, part, phases[part], cpu[part])
    if hasattr(engine.runner, "_sample"):
        _timed(engine.runner, "_sample", phases["sample"], cpu["sample"])
    _timed(engine.scheduler, "update_from_output", phases["update"], cpu["update"])
    if hasattr(engine, "processor"):  # the front half: detokenize, stop strings, outputs
        _timed(engine.processor, "process", phases["front"], cpu["front"])
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    # Step 0 is the prefill (+ first token); the rest are decode steps of the whole batch.
    dec = slice(1, None)

    def medians(ph: dict[str, list[float]]) -> dict[str, float]:
        med = {k: 1e3 * statistics.median(v[dec]) for k, v in ph.items() if len(v) > 1}
        runner = sum(med.get(k, 0.0) for k in ("execute", "launch", "finish"))
        med["output_processing"] = med["step"] - med["schedule"] - runner - med["update"]
        if "front" in med:  # the rest: the core's CoreOutputs, stop / finish bookkeeping
            med["output_processing_core"] = med["output_processing"] - med["front"]
        if "sample" in med and "execute" in med:
            med["execute_minus_sample"] = med["execute"] - med["sample"]
        return med

    med, med_cpu = medians(phases), medians(cpu)
    res: dict[str, Any] = {
        "root": args.root or _REPO,
        "backend": args.backend,
        "batch": args.batch,
        "vocab": args.vocab,
        "temperature": args.temperature,
        "min_tokens": args.min_tokens,
        "final_only": final_only,
        "steps": len(phases["step"]),
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "decode_step_ms_median": med,
        "decode_step_cpu_ms_median": med_cpu,
        "token_checksum": int(sum(sum(o.outputs[0].token_ids) for o in outs)),
    }
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        res["profile_top"] = s.getvalue()
    engine.shutdown()
    return res


def compare(args: argparse.Namespace) -> dict[str, Any]:
    roots = {"after": _REPO, "before": os.path.abspath(args.compare)}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in roots}
    base = [sys.executable, "-m", "xlaserve.bench.host_overhead"]
    keys = ("batch", "vocab", "layers", "input_len", "output_len", "min_tokens", "threads",
            "temperature", "backend")  # fmt: skip
    for k in keys:
        base += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.final_only:
        base.append("--final-only")
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for name in order:
            cmd = base + ["--root", roots[name]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=_REPO)
            res = json.loads(out.stdout)
            runs[name].append(res)
            print(
                f"round {r} {name}: {res['output_tok_s']:.0f} tok/s, step "
                f"{res['decode_step_ms_median']['step']:.2f} ms",
                file=sys.stderr,
            )
    summary: dict[str, Any] = {"rounds": args.rounds, "roots": roots}
    for name, rs in runs.items():
        summary[name] = {"output_tok_s": statistics.median(x["output_tok_s"] for x in rs)}
        for fig in ("decode_step_ms_median", "decode_step_cpu_ms_median"):
            summary[name][fig] = {
                k: round(statistics.median(x[fig][k] for x in rs), 3)
                for k in rs[0][fig]
                if all(k in x[fig] for x in rs)
            }
        summary[name]["token_checksums"] = sorted({x["token_checksum"] for x in rs})
    summary["same_tokens"] = (
        summary["before"]["token_checksums"] == summary["after"]["token_checksums"]
    )
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--backend", default="torch", choices=["torch", "xla"])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--min-tokens", type=int, default=0,
        help="min_tokens of every request (gpu_bench forces its lengths this way, EOS ignored)",
    )  # fmt: skip
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; > 0: the sampling path"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--final-only",
        action="store_true",
        help="engine.step(final_only=True) where the tree has it (outputs of finished requests)",
    )
    ap.add_argument("--profile", type=int, default=0, help="add cProfile's top-N (tottime)")
    ap.add_argument("--root", default=None, help="import xlaserve from this source tree")
    ap.add_argument("--compare", default=None, help="alternate with the tree at this path")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.compare:
        print(json.dumps(compare(args), indent=1))
        return
    if args.root:
        _use_root(os.path.abspath(args.root))
    res = run_once(args)
    prof = res.pop("profile_top", None)
    print(json.dumps(res, indent=1))
    if prof:
        print(prof, file=sys.stderr)


if __name__ == "__main__":
    main()
