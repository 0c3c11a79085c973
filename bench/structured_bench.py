"""Structured output at full speed (issue 30), in ONE command: plain vs JSON-schema-constrained
greedy decoding of the same prompts in one engine, side by side, and the first-request compile
latency of the issue's schema and of a ~2 KB nested schema.

Rows (each repeat runs plain then constrained on the same engine; medians):
  batch B          B random prompts (input-len tokens), max_tokens output-len, EOS ignored for
                   plain; constrained by ISSUE_SCHEMA (the grammar may end a request early, so
                   the tokens actually generated are counted on both sides): output tok/s, ratio
  first32          32 constrained requests with a schema never seen (compile included) vs the
                   same 32 plain
  compile          one request, max_tokens 1: wall time with a fresh schema (compile + one step)
                   minus the same request with that schema cached = first-request compile cost,
                   for ISSUE_SCHEMA and NESTED_SCHEMA (`nested_schema()`, ~2 KB)
  fill             xgrammar's batch bitmask fill (ms per step) of B matchers inside the
                   schema's string, with 1, 2, 4, ... threads (up to the host's cores): the
                   figure to set `bitmask_fill_threads` from; the same for the batch accept
                   of one token per matcher (`accept_threads`)
  jump             jump-forward (--structured-jump-forward): for each batch B and each of
                   ISSUE_SCHEMA and JUMP_SCHEMA (long forced keys), the same greedy constrained
                   requests on the engine above (jump-forward off, the default) and on a second
                   engine with it on (built after the first is shut down): engine steps,
                   output tok/s, tokens jumped over, and whether the tokens are identical
Also per row: engine steps launched while another was in flight (async scheduling stayed on?).

  # H200, Llama-3.1-8B shape, dummy bf16 (torch backend):
  python bench/structured_bench.py --llama8b --backend torch --output-json structured.json
  # CPU, the demo model:
  python bench/structured_bench.py --batches 64,1 --output-len 32 --output-json /tmp/so.json
  # only the jump-forward row (CPU, demo model):
  python bench/structured_bench.py --only-jump --batches 8,1 --output-len 96 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from xlaserve.bench.common import (
    add_model_args,
    model_engine_kwargs,
    random_prompts,
    resolve_model_dir,
)

# The issue's schema.
ISSUE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}


def nested_schema(target_bytes: int = 2048) -> dict[str, Any]:
    """A nested object schema of about `target_bytes` of JSON text: objects of typed fields
    (strings with bounds, integers with ranges, enums, arrays, booleans), nested 3 deep."""

    def leaf(i: int) -> dict[str, Any]:
        kinds: list[dict[str, Any]] = [
            {"type": "string", "maxLength": 12},
            {"type": "integer", "minimum": 0, "maximum": 999},
            {"enum": ["alpha", "beta", "gamma", "delta"]},
            {"type": "boolean"},
            {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        ]
        return kinds[i % len(kinds)]

    def obj(depth: int, width: int, tag: str) -> dict[str, Any]:
        props: dict[str, Any] = {}
        for i in range(width):
            props[f"{tag}_f{i}"] = (
                obj(depth - 1, width, f"{tag}{i}") if depth and i == 0 else leaf(i)
            )
        return {"type": "object", "properties": props, "required": list(props)}

    width = 2
    schema = obj(2, width, "n")
    while len(json.dumps(schema)) < target_bytes:
        width += 1
        schema = obj(2, width, "n")
    return schema


NESTED_SCHEMA = nested_schema()

# Long keys in a fixed order (all required, no other properties): most of the output is forced.
JUMP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer_identifier_string": {"type": "string", "maxLength": 8},
        "number_of_items_in_the_order": {"type": "integer", "minimum": 0, "maximum": 99},
        "delivery_requested_before_noon": {"type": "boolean"},
    },
    "required": [
        "customer_identifier_string",
        "number_of_items_in_the_order",
        "delivery_requested_before_noon",
    ],
    "additionalProperties": False,
}


def _fresh(schema: dict[str, Any], tag: str) -> dict[str, Any]:
    """The same grammar under a new cache key (a title changes no token)."""
    return {**schema, "title": tag}


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_num_seqs": max(args.batches)}
    if args.engine_process:
        kw["engine_process"] = True
    kw.update(model_engine_kwargs(args))
    if args.async_scheduling:
        kw["async_scheduling"] = args.async_scheduling
    if args.fill_thread in ("on", "off"):
        kw["fill_thread"] = args.fill_thread == "on"
    return kw


def _pair_ratios(runs: dict[str, list[float]], mode: str) -> list[float]:
    """Each of mode's runs over the plain run of the same repeat (tok/s ratios)."""
    return [c / p for p, c in zip(runs["plain"], runs[mode], strict=True)]


def _set_structured(
    llm: Any,  # noqa: ANN401 - LLM
    fill_thread: bool | None = None,
    accept_threads: int | None = None,
) -> None:
    """Switch the in-process engine's fill thread and accept threads (read at every step)
    between runs; None leaves a setting as it is."""
    if fill_thread is None and accept_threads is None:
        return
    mgr = getattr(llm.llm_engine.core, "_structured", None)
    if mgr is None:
        raise RuntimeError("--fill-thread ab / --accept-ab need an in-process engine with "
                           "structured output")  # fmt: skip
    if fill_thread is not None:
        mgr.config.fill_thread = fill_thread
    if accept_threads is not None:
        mgr.accept_threads = accept_threads


def _timed(llm: Any, prompts: list, sp: Any) -> tuple[float, int, int | None]:  # noqa: ANN401
    """(seconds, output tokens actually generated, steps overlapped meanwhile: None with the
    engine core in its own process, which does not report them)."""
    eng = llm.llm_engine
    ov = getattr(eng, "num_overlapped_steps", None)  # (None: an engine core process)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    k = sum(len(o.outputs[0].token_ids) for o in outs)
    return dt, k, None if ov is None else eng.num_overlapped_steps - ov


# --phases: engine parts timed per call (owner path under LLMEngine, method), in-process engines.
# runner.finish waits for the device (a step's tokens); core._apply_late_fill waits for the fill
# thread; the others are host work on the engine thread (the fill on whichever thread runs it).
PHASES: tuple[tuple[str, str], ...] = (
    ("", "add_request"),
    ("", "step"),
    ("core.scheduler", "schedule"),
    ("core.runner", "launch"),
    ("core.runner", "finish"),
    ("core", "_apply_late_fill"),
    ("core", "_process"),
    ("core._structured", "accept_step"),
    ("core._structured", "_batch_fill"),
    ("processor", "process"),
    # The grammar path's other host parts: picking the rows that sample, taking the upload
    # slot and the matchers, and the sampling launch that waits for the masks.
    ("core", "_attach_bitmasks"),
    ("core", "_late_fill_job"),
    ("core.runner", "apply_bitmasks"),
    ("core", "_fail_bad_grammars"),
)


class PhaseTimer:
    """Wraps PHASES' methods of one in-process LLMEngine while active (`with`): each call's
    seconds are appended to `times[name]` (name "owner.method" or "method"); each `with` is
    one run (`runs`), whose wall seconds the caller may add to `walls`."""

    def __init__(self, eng: Any) -> None:  # noqa: ANN401 - LLMEngine
        self.eng = eng
        self.times: dict[str, list[float]] = {}
        self.runs = 0
        self.walls: list[float] = []
        self._undo: list[tuple[Any, str]] = []

    def __enter__(self) -> PhaseTimer:
        self.runs += 1
        for path, meth in PHASES:
            owner = self.eng
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part, None)
            fn = getattr(owner, meth, None) if owner is not None else None
            if fn is None:
                continue
            acc = self.times.setdefault(f"{path}.{meth}" if path else meth, [])

            def wrapped(*a: Any, _fn: Any = fn, _acc: list = acc, **k: Any) -> Any:  # noqa: ANN401
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    _acc.append(time.perf_counter() - t)

            setattr(owner, meth, wrapped)
            self._undo.append((owner, meth))
        return self

    def __exit__(self, *exc: Any) -> None:  # noqa: ANN401
        for owner, meth in self._undo:
            delattr(owner, meth)  # the instance attribute; the class's method again
        self._undo.clear()

    def medians_ms(self) -> dict[str, float]:
        """Median milliseconds per call of every part that was called."""
        return {k: round(1e3 * statistics.median(v), 3) for k, v in self.times.items() if v}

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per run spent in every part (its calls summed), with "wall" (the runs'
        wall time, where given) and "outside_steps" (wall minus step and add_request: the
        front's own work between steps); where a mode's extra time goes even when the median
        step matches."""
        runs = max(1, self.runs)
        out = {k: round(1e3 * sum(v) / runs, 2) for k, v in self.times.items() if v}
        if self.walls:
            out["wall"] = round(1e3 * sum(self.walls) / len(self.walls), 2)
            out["outside_steps"] = round(
                out["wall"] - out.get("step", 0.0) - out.get("add_request", 0.0), 2
            )
        return out

    def step_tail(self) -> dict[str, float]:
        """The step times' spread (ms): calls per run, p90, max, and the time per run of the
        steps slower than twice the median (prefill steps, stalls)."""
        v = sorted(self.times.get("step", []))
        if not v:
            return {}
        med = statistics.median(v)
        return {
            "calls_per_run": round(len(v) / max(1, self.runs), 1),
            "p90": round(1e3 * v[int(0.9 * (len(v) - 1))], 3),
            "max": round(1e3 * v[-1], 3),
            "slow_ms_per_run": round(1e3 * sum(x for x in v if x > 2 * med) / max(1, self.runs), 2),
        }


def _stats_rows(text: str) -> list[str]:
    """pstats' table rows (after its 'ncalls' header line), blank lines dropped."""
    lines = text.splitlines()
    head = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), -1)
    return [ln for ln in lines[head + 1 :] if ln.strip()]


def profile_row(llm: Any, prompts: list, sps: dict[str, Any], top: int) -> dict[str, Any]:  # noqa: ANN401
    """Per mode: the median wall time of one engine step over a whole generate (decode steps
    dominate) and cProfile's top functions by own time (host work; GPU work is asynchronous,
    so a wait for the device shows up in the function that waits)."""
    import cProfile
    import io
    import pstats

    eng = llm.llm_engine
    out: dict[str, Any] = {}
    for name, sp in sps.items():
        times: list[float] = []
        inner = eng.step

        def step(*a: Any, inner: Any = inner, times: list[float] = times, **k: Any) -> Any:  # noqa: ANN401
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                times.append(time.perf_counter() - t)

        eng.step = step
        prof = cProfile.Profile()
        prof.enable()
        try:
            llm.generate(prompts, sp, use_tqdm=False)
        finally:
            prof.disable()
            del eng.step  # the instance attribute; the class method again
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        out[name] = {
            "steps": len(times),
            "step_ms_median": 1e3 * statistics.median(times) if times else None,
            "top": _stats_rows(buf.getvalue()),
        }
    return out


def fill_times(eng: Any, batches: list[int], repeats: int) -> dict[str, float]:  # noqa: ANN401
    """'B=<rows> threads=<t>' -> median ms of one batch bitmask fill, every matcher inside the
    ISSUE_SCHEMA string (the widest mask: most of the vocabulary is allowed)."""
    import numpy as np
    import xgrammar as xgr

    from xlaserve.sampling_params import StructuredOutputsParams as SO

    mgr = eng.core._structured
    compiled = mgr._cache[SO(json=ISSUE_SCHEMA).key()]
    prefix = eng.tokenizer.encode('{"text": "In the beg', add_special_tokens=False)
    threads = [t for t in (1, 2, 4, 8, 16) if t <= (os.cpu_count() or 1)]
    out: dict[str, float] = {}
    for b in batches:
        ms = _matchers_at(compiled, prefix, b)
        mask = np.full((b, mgr.num_words), -1, dtype=np.int32)
        for th in threads:
            bm = xgr.BatchGrammarMatcher(max_threads=th)
            ts = []
            for _ in range(max(5, repeats)):
                t0 = time.perf_counter()
                bm.batch_fill_next_token_bitmask(ms, mask, list(range(b)))
                ts.append(time.perf_counter() - t0)
            out[f"B={b} threads={th}"] = statistics.median(ts) * 1e3
        text = eng.tokenizer.encode(ACCEPT_TEXT, add_special_tokens=False)
        for th, ms_ in accept_times(mgr, compiled, prefix, text, b, threads, repeats).items():
            out[f"B={b} accept threads={th}"] = ms_
        # Does the batch fill release the GIL? (1.0 = fully: a fill on a worker thread would
        # overlap the engine thread's Python.)
        out[f"B={b} python progress beside a fill thread"] = _gil_share(
            xgr.BatchGrammarMatcher(max_threads=1), ms, mask
        )
        # The engine's fill thread: a fill submitted while this thread runs 3 ms of Python
        # (the rest of a step's outputs), at CPython's default switch interval and at the one
        # the engine sets while a fill is in flight (engine/core.py, FILL_SWITCH_INTERVAL_S).
        from xlaserve.engine.core import FILL_SWITCH_INTERVAL_S

        bm = xgr.BatchGrammarMatcher(max_threads=mgr.fill_threads)
        for name, interval in (("5 ms", 5e-3), ("engine's", FILL_SWITCH_INTERVAL_S)):
            done, wait = _fill_beside_python(bm, ms, mask, interval, 3e-3, max(10, repeats))
            out[f"B={b} fill thread done after (switch interval {name})"] = done
            out[f"B={b} engine waits for it (switch interval {name})"] = wait
    return out


def _matchers_at(compiled: Any, prefix: list[int], rows: int) -> list:  # noqa: ANN401 - xgrammar
    """`rows` fresh matchers of `compiled`, each past the tokens of `prefix` it accepts."""
    import xgrammar as xgr

    ms = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    for m in ms:
        for t in prefix:
            if not m.accept_token(t):
                break
    return ms


# Text a JSON string takes token by token (no quote, backslash or control character).
ACCEPT_TEXT = (
    "In the beginning the engine took one token for every request of the batch, and the "
    "grammar of each request advanced by one step inside the string of its only field; the "
    "words here are only there to be tokens that a JSON string admits, one after another. "
)


def accept_times(
    mgr: Any,  # noqa: ANN401 - StructuredOutputManager
    compiled: Any,  # noqa: ANN401 - xgrammar CompiledGrammar
    prefix: list[int],
    text: list[int],
    rows: int,
    threads: list[int],
    repeats: int,
) -> dict[int, float]:
    """threads -> median ms of one `StructuredOutputManager.batch_accept` of `rows` matchers
    inside the schema's string, each taking the next token of `text` (ACCEPT_TEXT's tokens: a
    decode step's accept), split over that many threads. Raises if a token is refused (then
    the timing would be of rejections)."""
    ms = _matchers_at(compiled, prefix, rows)
    saved, out, i = mgr.accept_threads, {}, 0
    try:
        for th in threads:
            mgr.accept_threads = th
            ts = []
            for _ in range(max(5, repeats)):
                tok = text[i % len(text)]
                i += 1
                t0 = time.perf_counter()
                ok = mgr.batch_accept(ms, [tok] * rows)
                ts.append(time.perf_counter() - t0)
                if not all(ok):
                    raise RuntimeError(f"token {tok} refused inside the string")
            out[th] = statistics.median(ts) * 1e3
    finally:
        mgr.accept_threads = saved
    return out


def _fill_beside_python(
    batch: Any,  # noqa: ANN401 - xgrammar
    matchers: list,
    mask: Any,  # noqa: ANN401
    interval: float,
    work_s: float,
    repeats: int,
) -> tuple[float, float]:
    """A fill submitted to a worker thread while this thread spins work_s of Python, at switch
    interval `interval`: median ms from the submit to the fill's end, and this thread's wait
    for it after its own work."""
    from concurrent.futures import ThreadPoolExecutor

    rows = list(range(len(matchers)))
    saved = sys.getswitchinterval()
    done_ms, wait_ms = [], []
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # the worker exists before the first timing
        try:
            sys.setswitchinterval(interval)

            def fill() -> float:
                batch.batch_fill_next_token_bitmask(matchers, mask, rows)
                return time.perf_counter()

            for _ in range(repeats):
                t0 = time.perf_counter()
                fut = pool.submit(fill)
                _spin(work_s)
                t1 = time.perf_counter()
                end = fut.result()
                done_ms.append((end - t0) * 1e3)
                wait_ms.append((time.perf_counter() - t1) * 1e3)
        finally:
            sys.setswitchinterval(saved)
    return statistics.median(done_ms), statistics.median(wait_ms)


def _gil_share(batch: Any, matchers: list, mask: Any) -> float:  # noqa: ANN401 - xgrammar
    """Python progress of this thread in 0.5 s while another thread fills `matchers`' rows of
    `mask` back to back, over its progress alone."""
    alone = _spin(0.5)
    stop = threading.Event()
    rows = list(range(len(matchers)))

    def fills() -> None:
        while not stop.is_set():
            batch.batch_fill_next_token_bitmask(matchers, mask, rows)

    worker = threading.Thread(target=fills)
    worker.start()
    try:
        beside = _spin(0.5)
    finally:
        stop.set()
        worker.join()
    return beside / alone


def _spin(seconds: float) -> int:
    """Loop iterations of plain Python in `seconds` (a GIL-contention probe)."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def _steps(llm: Any) -> int:  # noqa: ANN401 - LLM
    """Engine steps that computed tokens so far (count of the tokens-per-step histogram)."""
    return sum(llm.llm_engine.get_stats().iteration_tokens_buckets)


def jump_side(llm: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:  # noqa: ANN401
    """One engine's half of the `jump` row: per batch and schema, medians over repeats of
    output tok/s, and the steps, tokens, jumped tokens and token ids of the last repeat."""
    from xlaserve import SamplingParams
    from xlaserve.sampling_params import StructuredOutputsParams as SO

    eng = llm.llm_engine
    out: dict[str, Any] = {}
    for name, schema in (("issue_schema", ISSUE_SCHEMA), ("jump_schema", JUMP_SCHEMA)):
        sp = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, structured_outputs=SO(json=schema)
        )
        llm.generate(random_prompts(2, args.input_len, vocab, args.seed + 7), sp, use_tqdm=False)
        for b in args.batches:
            prompts = random_prompts(b, args.input_len, vocab, args.seed + b)
            tok_s, ids = [], []
            for _ in range(args.repeats):
                s0, j0 = _steps(llm), eng.num_jump_forward_tokens
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.perf_counter() - t
                ids = [o.outputs[0].token_ids for o in outs]
                k = sum(len(i) for i in ids)
                tok_s.append(k / dt)
                steps, jumped = _steps(llm) - s0, eng.num_jump_forward_tokens - j0
            out[f"{name} batch{b}"] = {
                "tok_s": statistics.median(tok_s),
                "steps": steps,
                "output_tokens": k,
                "jumped_tokens": jumped,
                "token_ids": ids,
            }
    return out


def jump_row(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """Side by side: steps and tok/s with and without jump-forward, same prompts."""
    row: dict[str, Any] = {}
    for key, a in off.items():
        b = on[key]
        row[key] = {
            "steps_off": a["steps"],
            "steps_on": b["steps"],
            "step_ratio": b["steps"] / max(1, a["steps"]),
            "tok_s_off": a["tok_s"],
            "tok_s_on": b["tok_s"],
            "speedup": b["tok_s"] / a["tok_s"],
            "output_tokens": {"off": a["output_tokens"], "on": b["output_tokens"]},
            "jumped_tokens": b["jumped_tokens"],
            "same_tokens": a["token_ids"] == b["token_ids"],
        }
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from xlaserve import LLM

    llm = LLM(model=args.model_dir, **_engine_kwargs(args))
    eng = llm.llm_engine
    vocab = eng.spec.vocab_size if hasattr(eng, "spec") else 32000
    report: dict[str, Any] = {"args": vars(args), "rows": {}}
    if not args.only_jump:
        _main_rows(llm, args, vocab, report)
    if args.only_batches or args.only_fill:
        eng.shutdown()
        return report
    jump_off = jump_side(llm, args, vocab)
    report["engine"] = {
        "backend": eng.backend if hasattr(eng, "backend") else None,
        "async_scheduling": getattr(llm.llm_engine, "_async", None),
    }
    eng.shutdown()
    del llm, eng  # one engine's device memory at a time
    llm = LLM(model=args.model_dir, jump_forward=True, **_engine_kwargs(args))
    jump_on = jump_side(llm, args, vocab)
    llm.llm_engine.shutdown()
    report["rows"]["jump"] = jump_row(jump_off, jump_on)
    print(json.dumps({"jump": report["rows"]["jump"]}), flush=True)
    return report


def _main_rows(
    llm: Any,  # noqa: ANN401 - LLM
    args: argparse.Namespace,
    vocab: int,
    report: dict[str, Any],
) -> None:
    """The batch, first32, compile and fill rows on one engine (jump-forward off)."""
    from xlaserve import SamplingParams
    from xlaserve.sampling_params import StructuredOutputsParams as SO

    eng = llm.llm_engine
    n = args.output_len
    plain = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    cons = SamplingParams(temperature=0.0, max_tokens=n, structured_outputs=SO(json=ISSUE_SCHEMA))
    warm = random_prompts(min(8, max(args.batches)), args.input_len, vocab, args.seed + 99)
    llm.generate(warm, plain, use_tqdm=False)
    llm.generate(warm, cons, use_tqdm=False)  # compiles ISSUE_SCHEMA once, caches it
    if args.only_fill:
        report["rows"]["fill"] = fill_times(eng, args.batches, args.repeats)
        print(json.dumps({"fill": report["rows"]["fill"]}), flush=True)
        return

    for b in args.batches:
        prompts = random_prompts(b, args.input_len, vocab, args.seed + b)
        runs: dict[str, list[float]] = {"plain": [], "constrained": []}
        toks: dict[str, int] = {}
        overlapped: dict[str, int] = {}
        phases: dict[str, PhaseTimer] = {}
        # One untimed round at the batch's own size first: on the H200 the first full-size
        # plain run was 1.4x slower than the ones after it in every call (15.3-15.6k vs ~22k
        # tok/s at batch 256, 2026-12-05), which made the first pair's ratio meaningless.
        for sp in (plain, cons):
            _timed(llm, prompts, sp)
        # --fill-thread ab / --accept-ab N: a constrained run with the fill thread on (with N
        # accept threads) after each one with it off (with one), in the same process (separate
        # processes drifted by more than the effect).
        modes: list[tuple[str, Any, dict[str, Any]]] = [("plain", plain, {}),
                                                        ("constrained", cons, {})]  # fmt: skip
        if args.fill_thread == "ab":
            modes[1] = ("constrained", cons, {"fill_thread": False})
            modes.append(("constrained_fill_thread", cons, {"fill_thread": True}))
        if args.accept_ab:
            modes[1] = ("constrained", cons, {**modes[1][2], "accept_threads": 1})
            modes.append(("constrained_accept", cons, {"accept_threads": args.accept_ab}))
        for name, _, _ in modes[2:]:
            runs[name] = []
        for _ in range(args.repeats):
            for name, sp, setting in modes:
                _set_structured(llm, **setting)
                if args.phases:  # (an engine core process: only its step is timed here)
                    with phases.setdefault(name, PhaseTimer(eng)) as pt:
                        dt, k, ov = _timed(llm, prompts, sp)
                    pt.walls.append(dt)
                else:
                    dt, k, ov = _timed(llm, prompts, sp)
                runs[name].append(k / dt)
                toks[name], overlapped[name] = k, ov
        med = {k: statistics.median(v) for k, v in runs.items()}

        # Each constrained run against the plain run of its repeat: steadier than the ratio
        # of medians when the machine's speed drifts between repeats.
        pairs = _pair_ratios(runs, "constrained")
        report["rows"][f"batch{b}"] = {
            "plain_tok_s": med["plain"],
            "constrained_tok_s": med["constrained"],
            "ratio": med["constrained"] / med["plain"],
            "pair_ratios": pairs,
            "pair_ratio_median": statistics.median(pairs),
            "output_tokens": toks,
            "overlapped_steps": overlapped,
            "runs": runs,
        }
        for mode, key in (("constrained_fill_thread", "fill_thread"),
                          ("constrained_accept", "accept_threads")):  # fmt: skip
            if mode in runs:
                ft = _pair_ratios(runs, mode)
                report["rows"][f"batch{b}"][key] = {
                    "constrained_tok_s": statistics.median(runs[mode]),
                    "pair_ratios": ft,
                    "pair_ratio_median": statistics.median(ft),
                }
        if phases:  # --phases: ms per call (median) and per run (summed) of each part, per mode
            row = report["rows"][f"batch{b}"]
            row["phases_ms_median"] = {k: t.medians_ms() for k, t in phases.items()}
            row["phases_ms_per_run"] = {k: t.totals_ms() for k, t in phases.items()}
            row["step_tail_ms"] = {k: t.step_tail() for k, t in phases.items()}
        print(json.dumps({f"batch{b}": report["rows"][f"batch{b}"]}), flush=True)
    if args.profile:
        b = max(args.batches)
        prof = profile_row(llm, random_prompts(b, args.input_len, vocab, args.seed + b),
                           {"plain": plain, "constrained": cons}, args.profile)  # fmt: skip
        report["rows"][f"profile batch{b}"] = prof
        for name, p in prof.items():
            print(f"== profile batch{b} {name}: {p['steps']} steps, median "
                  f"{p['step_ms_median']:.2f} ms/step", flush=True)  # fmt: skip
            print("\n".join(p["top"]), flush=True)
    if args.only_batches:
        return

    # First 32 requests with a schema never compiled (compile included) vs plain.
    p32 = random_prompts(32, args.input_len, vocab, args.seed + 32)
    dt_p, k_p, _ = _timed(llm, p32, plain)
    sp32 = SamplingParams(
        temperature=0.0, max_tokens=n, structured_outputs=SO(json=_fresh(ISSUE_SCHEMA, "first32"))
    )
    dt_c, k_c, _ = _timed(llm, p32, sp32)
    report["rows"]["first32"] = {
        "plain_tok_s": k_p / dt_p,
        "constrained_tok_s": k_c / dt_c,
        "ratio": (k_c / dt_c) / (k_p / dt_p),
        "output_tokens": {"plain": k_p, "constrained": k_c},
    }
    print(json.dumps({"first32": report["rows"]["first32"]}), flush=True)

    # First-request compile latency.
    one = random_prompts(1, args.input_len, vocab, args.seed + 1)
    comp: dict[str, Any] = {}
    for name, schema in (("issue_schema", ISSUE_SCHEMA), ("nested_2kb", NESTED_SCHEMA)):
        fresh, cached = [], []
        for r in range(args.repeats):
            so = SO(json=_fresh(schema, f"{name}-{r}"))
            sp = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=so)
            fresh.append(_timed(llm, one, sp)[0])
            cached.append(_timed(llm, one, sp)[0])
        f, c = statistics.median(fresh), statistics.median(cached)
        comp[name] = {
            "schema_bytes": len(json.dumps(schema)),
            "first_request_s": f,
            "cached_request_s": c,
            "compile_ms": (f - c) * 1e3,
        }
    report["rows"]["compile"] = comp
    print(json.dumps({"compile": comp}), flush=True)
    report["rows"]["fill"] = fill_times(eng, args.batches, args.repeats)
    print(json.dumps({"fill": report["rows"]["fill"]}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output-json", default="structured_bench.json")
    add_model_args(ap)
    ap.add_argument("--async-scheduling", default=None, choices=["auto", "on", "off"])
    ap.add_argument(
        "--fill-thread",
        default=None,
        choices=["on", "off", "ab"],
        help="StructuredOutputConfig.fill_thread (default: the engine's); ab: each repeat also "
        "runs the constrained batch with the fill thread on, in the same engine",
    )
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only-jump", action="store_true", help="only the jump-forward row")
    ap.add_argument("--only-batches", action="store_true", help="only the batch rows")
    ap.add_argument(
        "--only-fill",
        action="store_true",
        help="only the fill row (the batch fill and accept per thread count)",
    )
    ap.add_argument("--accept-ab", type=int, default=0, metavar="N",
                    help="batch rows: each repeat also runs the constrained batch with N accept "
                         "threads (StructuredOutputConfig.accept_threads), the constrained one "
                         "with 1, in the same engine")  # fmt: skip
    ap.add_argument("--phases", action="store_true",
                    help="batch rows: median ms per call of the engine's parts (PHASES), per "
                         "mode")  # fmt: skip
    ap.add_argument("--profile", type=int, default=0,
                    help="also profile one plain and one constrained run of the largest batch: "
                         "median step time and cProfile's top N")  # fmt: skip
    ap.add_argument("--engine-process", action="store_true",
                    help="the engine core in its own process (LLM(..., engine_process=True), "
                         "the server's layout: output processing beside the core, not on its "
                         "thread); batch rows only")  # fmt: skip
    args = ap.parse_args(argv)
    if args.engine_process and (
        args.phases or args.profile or args.fill_thread == "ab" or args.accept_ab
        or not args.only_batches
    ):  # fmt: skip
        ap.error(
            "--engine-process times the batch rows only (--only-batches), without --phases, "
            "--profile, --fill-thread ab or --accept-ab (they look inside an in-process engine)"
        )
    if args.llama8b and args.tiny and args.model_dir is None:
        # Tiny layers but the REAL vocabulary: a grammar's host work per row scales with it
        # (128,256 tokens = 4,008 bitmask words a row), and that is what this bench measures.
        from xlaserve.bench.gpu_bench import LLAMA_8B, write_model_dir

        work = tempfile.mkdtemp(prefix="so-bench-")
        args.model_dir = write_model_dir(
            os.path.join(work, "llama8b"), 2, tiny=True, vocab_size=LLAMA_8B["vocab_size"]
        )
    args.model_dir = resolve_model_dir(args, "so-bench-")
    report = run(args)
    with open(args.output_json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
