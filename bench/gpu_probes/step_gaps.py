"""Where a served decode step's time goes on the GPU timeline: is the device idle between steps,
and what is the engine thread doing then? (issues 24 / 30: the torch backend's batch-256 decode
steps take 10-11.5 ms in the engine against a 7.36 ms replay of the same CUDA graph.)

One LLM (torch backend) decodes `--batch` requests; after they are prefilled, `--steps` engine
steps run under torch.profiler (CPU + CUDA activity), each engine part marked with a
`record_function` range (schedule, launch, finish, core process, output processing). Reported
per step (medians): wall ms; GPU busy ms (the union of kernel and memcpy intervals); GPU idle ms;
and, for the idle time, which engine part the engine thread was in when each gap began (ms of
idle per part). A device-bound step has little idle; a host-bound one shows which part the
device waits for.

    python -m xlaserve.bench.gpu_probes.step_gaps --batch 256 --steps 24 --out gaps.json
    python -m xlaserve.bench.gpu_probes.step_gaps --tiny --batch 8 --steps 6   # CPU smoke

On the CPU there is no device timeline: the GPU figures are 0 and the part times remain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from typing import Any

# Engine parts marked on the timeline: (label, object path from the LLMEngine, method).
PARTS = (
    ("schedule", "scheduler", "schedule"),
    ("launch", "runner", "launch"),
    ("finish", "runner", "finish"),
    ("execute", "runner", "execute"),
    ("core_process", "core", "_process"),
    ("output_processing", "processor", "process"),
)
STEP = "engine_step"


def _mark(engine: Any, record_function: Any) -> None:  # noqa: ANN401
    """Wrap each part (and LLMEngine.step) in a record_function range of its label."""

    def wrap(obj: Any, meth: str, label: str) -> None:  # noqa: ANN401
        inner = getattr(obj, meth)

        def marked(*a: Any, **k: Any) -> Any:  # noqa: ANN401
            with record_function(label):
                return inner(*a, **k)

        setattr(obj, meth, marked)

    for label, path, meth in PARTS:
        obj = getattr(engine, path, None)
        if obj is not None and hasattr(obj, meth):
            wrap(obj, meth, label)
    wrap(engine, "step", STEP)


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) intervals given in microseconds."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def analyse(events: list[Any]) -> dict[str, Any]:
    """Per-step figures from torch.profiler FunctionEvents (times in microseconds)."""
    steps = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.name == STEP
    )  # fmt: skip
    labels = {label for label, _, _ in PARTS}
    parts = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in events if e.name in labels
    )  # fmt: skip
    dev = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if str(getattr(e, "device_type", "")).endswith("CUDA")
    )  # fmt: skip
    part_ms: dict[str, list[float]] = {label: [] for label in labels}
    rows = []
    for s0, s1 in steps:
        busy = [(max(a, s0), min(b, s1)) for a, b in dev if b > s0 and a < s1]
        busy_ms = _union_ms(busy)
        idle_by_part: dict[str, float] = {}
        last = s0
        for a, b in sorted(busy) + [(s1, s1)]:
            if a > last:  # a gap [last, a): the part the engine thread was in at its start
                inside = [n for p0, p1, n in parts if p0 <= last < p1]
                key = inside[-1] if inside else "between_parts"
                idle_by_part[key] = idle_by_part.get(key, 0.0) + (a - last) / 1e3
            last = max(last, b)
        rows.append({"wall_ms": (s1 - s0) / 1e3, "gpu_busy_ms": busy_ms,
                     "gpu_idle_by_part_ms": idle_by_part})  # fmt: skip
        for label in labels:
            ms = sum(min(p1, s1) - max(p0, s0) for p0, p1, n in parts
                     if n == label and p1 > s0 and p0 < s1) / 1e3  # fmt: skip
            part_ms[label].append(ms)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 3) if xs else 0.0

    idle_keys = {k for r in rows for k in r["gpu_idle_by_part_ms"]}
    return {
        "steps": len(rows),
        "wall_ms": med([r["wall_ms"] for r in rows]),
        "gpu_busy_ms": med([r["gpu_busy_ms"] for r in rows]),
        "gpu_idle_ms": med([r["wall_ms"] - r["gpu_busy_ms"] for r in rows]),
        "gpu_idle_by_part_ms": {
            k: med([r["gpu_idle_by_part_ms"].get(k, 0.0) for r in rows]) for k in sorted(idle_keys)
        },
        "host_part_ms": {k: med(v) for k, v in sorted(part_ms.items()) if any(v)},
        "per_step": rows,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from xlaserve import LLM, SamplingParams
    from xlaserve.bench.common import random_prompts
    from xlaserve.bench.gpu_bench import write_model_dir

    cuda = torch.cuda.is_available()
    model_dir = write_model_dir(tempfile.mkdtemp(), args.num_layers, tiny=args.tiny)
    kw: dict[str, Any] = dict(model=model_dir, load_format="dummy", max_num_seqs=args.batch,
                              max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                              dtype="bfloat16" if cuda else "float32")  # fmt: skip
    if args.async_scheduling:
        kw["async_scheduling"] = args.async_scheduling
    llm = LLM(**kw)
    engine = llm.llm_engine
    vocab = engine.spec.vocab_size
    n_out = args.warmup + args.steps + 8
    sp = SamplingParams(max_tokens=n_out, min_tokens=n_out, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(1, 16, vocab, 1), sp, use_tqdm=False)
    for i, p in enumerate(random_prompts(args.batch, args.prompt_len, vocab, 0)):
        engine.add_request(f"gap-{i}", p, sp)
    for _ in range(args.warmup):  # the prefill and the first decode steps
        engine.step()
    _mark(engine, record_function)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    res = analyse(list(prof.events()))
    res.update(batch=args.batch, device=torch.cuda.get_device_name() if cuda else "cpu",
               async_scheduling=getattr(engine, "_async", None))  # fmt: skip
    engine.shutdown()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--async-scheduling", default=None, choices=["auto", "on", "off"])
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    res = run(args)
    short = {k: v for k, v in res.items() if k != "per_step"}
    print(json.dumps(short, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
