"""Offline benchmarks on `xlaserve.LLM`: throughput, latency, prefix caching, structured output.

Prompts are random token ids from the model's vocabulary (special tokens left out), passed as
`{"prompt_token_ids": [...]}` so no tokenizer round trip blurs the lengths; `ignore_eos=True`
makes every request produce exactly `output_len` tokens.
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from xlaserve.bench.common import wait_background_compiles

Echo = Callable[[str], None]


def make_llm(model: str | None, **engine_kwargs: Any) -> Any:
    """`xlaserve.LLM(model, **kwargs)` with the None-valued kwargs dropped (engine defaults)."""
    from xlaserve import LLM

    return LLM(model=model, **{k: v for k, v in engine_kwargs.items() if v is not None})


def _vocab_pool(llm: Any) -> list[int]:
    tok = llm.get_tokenizer()
    special = set(getattr(tok, "all_special_ids", ()) or ())
    return [i for i in range(tok.vocab_size) if i not in special]


def random_token_prompts(
    pool: list[int], num: int, length: int, seed: int
) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.choice(pool) for _ in range(length)]} for _ in range(num)]


def _sampling(
    output_len: int,
    temperature: float,
    seed: int | None = None,
    min_tokens: bool = False,
    detokenize: bool = True,
) -> Any:
    """Every request generates exactly output_len tokens: EOS ignored, or (min_tokens) EOS
    kept and masked by min_tokens = output_len, as a user's min_tokens masks it."""
    from xlaserve import SamplingParams

    length = {"min_tokens": output_len} if min_tokens else {"ignore_eos": True}
    return SamplingParams(
        max_tokens=output_len, temperature=temperature, seed=seed, detokenize=detokenize, **length
    )


def _model_name(llm: Any, model: str | None) -> str | None:
    return getattr(getattr(llm, "llm_engine", None), "model_name", None) or model


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    gc.collect()


def _write(path: str | None, result: dict[str, Any], echo: Echo) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        echo(f"results written to {path}")


def run_throughput(
    model: str | None,
    num_prompts: int,
    input_len: int,
    output_len: int,
    temperature: float = 1.0,
    seed: int = 0,
    warmup: bool = True,
    output_json: str | None = None,
    echo: Echo = print,
    use_tqdm: bool = False,
    min_tokens: bool = False,
    disable_detokenize: bool = False,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """Time one `LLM.generate` over `num_prompts` requests; tokens/s in, out and total.
    `use_tqdm`: LLM.generate's progress bar during the timed run (`bench throughput` shows it
    unless --disable-tqdm). `min_tokens`: lengths forced by min_tokens (EOS masked every step)
    instead of ignore_eos. `disable_detokenize`: SamplingParams(detokenize=False), token ids
    only (vLLM's benchmark flag of the same name)."""
    t0 = time.perf_counter()
    llm = make_llm(model, seed=seed, **engine_kwargs)
    load_s = time.perf_counter() - t0
    name = _model_name(llm, model)
    try:
        pool = _vocab_pool(llm)
        prompts = random_token_prompts(pool, num_prompts, input_len, seed)
        params = _sampling(output_len, temperature, seed, min_tokens, not disable_detokenize)
        if warmup:
            # The timed run's batch shapes with other prompts (no prefix-cache hits), then what
            # they compiled in the background (the XLA sampler's specialization per request
            # bucket, inside the timed run otherwise): a steady-state figure.
            warm = random_token_prompts(pool, num_prompts, input_len, seed + 1)
            short = _sampling(min(output_len, 4), temperature, min_tokens=min_tokens)
            llm.generate(warm, short, use_tqdm=False)
            wait_background_compiles(llm)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - start
    finally:
        _shutdown(llm)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    result = {
        "model": model,
        "model_name": name,
        "engine_kwargs": {k: v for k, v in engine_kwargs.items() if v is not None},
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "min_tokens": min_tokens,
        "detokenize": not disable_detokenize,
        "load_time_s": load_s,
        "elapsed_time": elapsed,
        "num_requests": len(outs),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "total_num_tokens": n_in + n_out,
        "requests_per_second": len(outs) / elapsed,
        "tokens_per_second": (n_in + n_out) / elapsed,
        "input_tokens_per_second": n_in / elapsed,
        "output_tokens_per_second": n_out / elapsed,
    }
    echo(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s "
        f"({result['input_tokens_per_second']:.2f} in, "
        f"{result['output_tokens_per_second']:.2f} out) over {elapsed:.2f} s"
    )
    _write(output_json, result, echo)
    return result


LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def run_latency(
    model: str | None,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int = 10,
    num_iters_warmup: int = 2,
    temperature: float = 1.0,
    seed: int = 0,
    output_json: str | None = None,
    echo: Echo = print,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """End-to-end latency of one fixed batch, `num_iters` times; mean and percentiles."""
    llm = make_llm(model, seed=seed, **engine_kwargs)
    name = _model_name(llm, model)
    try:
        prompts = random_token_prompts(_vocab_pool(llm), batch_size, input_len, seed)
        params = _sampling(output_len, temperature, seed)
        for _ in range(num_iters_warmup):
            llm.generate(prompts, params, use_tqdm=False)
        latencies = []
        for _ in range(num_iters):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
    finally:
        _shutdown(llm)
    arr = np.asarray(latencies)
    result = {
        "model": model,
        "model_name": name,
        "engine_kwargs": {k: v for k, v in engine_kwargs.items() if v is not None},
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "num_iters": num_iters,
        "avg_latency": float(arr.mean()),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(arr, p)) for p in LATENCY_PERCENTILES},
        "output_tokens_per_second": batch_size * output_len / float(np.median(arr)),
    }
    echo(f"Avg latency: {result['avg_latency']:.4f} s")
    for p, v in result["percentiles"].items():
        echo(f"{p}% percentile latency: {v:.4f} s")
    _write(output_json, result, echo)
    return result


def run_prefix_caching(
    model: str | None,
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
    output_json: str | None = None,
    echo: Echo = print,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """The same shared-prefix workload with prefix caching on, then off, in one run.

    Phase 1 sends one prompt per prefix (it fills the cache), phase 2 the rest. Reported per mode:
    elapsed times, prefix-cache hit rate from engine stats (hit tokens / queried tokens);
    `speedup` = elapsed(off) / elapsed(on) of phase 2, where the cache is warm. Greedy sampling,
    so both modes must produce the same tokens (`outputs_match`).
    """
    if num_prompts <= num_prefixes:
        raise ValueError("num_prompts must exceed num_prefixes (phase 2 would be empty)")
    rng = random.Random(seed)
    modes: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[list[int]]] = {}
    prompts: list[dict[str, list[int]]] | None = None
    for mode, enabled in (("on", True), ("off", False)):
        llm = make_llm(model, seed=seed, enable_prefix_caching=enabled, **engine_kwargs)
        try:
            if prompts is None:
                pool = _vocab_pool(llm)
                prefixes = [
                    [rng.choice(pool) for _ in range(prefix_len)] for _ in range(num_prefixes)
                ]
                prompts = [
                    {
                        "prompt_token_ids": prefixes[i % num_prefixes]
                        + [rng.choice(pool) for _ in range(suffix_len)]
                    }
                    for i in range(num_prompts)
                ]
            params = _sampling(output_len, 0.0)
            # Warm the model itself (compilation, allocator) on unrelated tokens.
            llm.generate([{"prompt_token_ids": [pool[0]] * 4}], _sampling(2, 0.0), use_tqdm=False)
            engine = llm.llm_engine
            s0 = engine.get_stats()
            t0 = time.perf_counter()
            outs1 = llm.generate(prompts[:num_prefixes], params, use_tqdm=False)
            t1 = time.perf_counter()
            outs2 = llm.generate(prompts[num_prefixes:], params, use_tqdm=False)
            t2 = time.perf_counter()
            s1 = engine.get_stats()
        finally:
            _shutdown(llm)
        queries = s1.prefix_cache_queries - s0.prefix_cache_queries
        hits = s1.prefix_cache_hits - s0.prefix_cache_hits
        tokens[mode] = [list(o.outputs[0].token_ids) for o in outs1 + outs2]
        modes[mode] = {
            "enable_prefix_caching": enabled,
            "phase1_s": t1 - t0,
            "phase2_s": t2 - t1,
            "elapsed_s": t2 - t0,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs1 + outs2),
        }
    total_prompt = sum(len(p["prompt_token_ids"]) for p in prompts or [])
    result = {
        "model": model,
        "engine_kwargs": {k: v for k, v in engine_kwargs.items() if v is not None},
        "num_prompts": num_prompts,
        "num_prefixes": num_prefixes,
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "output_len": output_len,
        "total_prompt_tokens": total_prompt,
        # Fraction of prompt tokens that share a prefix with an earlier prompt (the ideal hit rate,
        # before rounding prefixes down to whole blocks).
        "shareable_fraction": (num_prompts - num_prefixes) * prefix_len / total_prompt,
        "on": modes["on"],
        "off": modes["off"],
        "hit_rate": modes["on"]["hit_rate"],
        "speedup": modes["off"]["phase2_s"] / max(modes["on"]["phase2_s"], 1e-9),
        "total_speedup": modes["off"]["elapsed_s"] / max(modes["on"]["elapsed_s"], 1e-9),
        "outputs_match": tokens["on"] == tokens["off"],
    }
    echo(
        f"prefix caching on: {modes['on']['elapsed_s']:.3f} s (hit rate "
        f"{modes['on']['hit_rate']:.1%}); off: {modes['off']['elapsed_s']:.3f} s (hit rate "
        f"{modes['off']['hit_rate']:.1%}); warm-phase speedup {result['speedup']:.2f}x; "
        f"outputs match: {result['outputs_match']}"
    )
    _write(output_json, result, echo)
    return result


# An array of objects with free-text fields: the grammar stays open for the whole run, so the
# structured run generates exactly as many tokens as the plain one (ignore_eos, no early stop).
OPEN_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"verse": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["verse", "n"],
    },
    # Without minItems the grammar admits "[]": at this seed the model takes it and the schema
    # run ends after 3 tokens (ratio measured prefill, not decode).
    "minItems": 1,
}


def run_structured_output(
    model: str | None,
    batch_sizes: list[int],
    output_len: int,
    repeats: int = 3,
    seed: int = 0,
    output_json: str | None = None,
    echo: Echo = print,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """Decode tokens/s with and without a JSON schema on the same workload, in one engine.

    For each batch size the plain and the schema run alternate `repeats` times (the machine's load
    drifts; alternating keeps the comparison fair) and the medians are compared:
    `ratio` = structured tokens/s / plain tokens/s (1.0 = free; vLLM's goal: cost under 10%).
    Sampling at temperature 0.8 with a seed so the grammar sees varied tokens.
    """
    from xlaserve import SamplingParams
    from xlaserve.sampling_params import StructuredOutputsParams

    llm = make_llm(model, seed=seed, **engine_kwargs)
    prompts = [f"And God said, let there be light {i}" for i in range(max(batch_sizes))]

    def once(batch: int, structured: bool, max_tokens: int) -> tuple[float, int]:
        so = StructuredOutputsParams(json=OPEN_SCHEMA) if structured else None
        params = SamplingParams(
            temperature=0.8,
            seed=seed,
            max_tokens=max_tokens,
            ignore_eos=True,
            structured_outputs=so,
        )
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    rows: list[dict[str, Any]] = []
    try:
        once(2, True, 8)  # warm up: grammar compilation, model compilation/allocator
        once(2, False, 8)
        for batch in batch_sizes:
            tps: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(repeats):
                for structured in (False, True):
                    dt, n = once(batch, structured, output_len)
                    tps[structured].append(n / dt)
                    if n != batch * output_len:  # e.g. the grammar ended the output early
                        echo(
                            f"warning: batch {batch} {'schema' if structured else 'plain'} run "
                            f"made {n} tokens, not {batch * output_len}: unequal work"
                        )
            plain, so = float(np.median(tps[False])), float(np.median(tps[True]))
            rows.append(
                {
                    "batch_size": batch,
                    "plain_tokens_per_second": plain,
                    "structured_tokens_per_second": so,
                    "ratio": so / plain,
                    "plain_runs": tps[False],
                    "structured_runs": tps[True],
                }
            )
            echo(
                f"batch {batch}: plain {plain:.1f} tok/s, json schema {so:.1f} tok/s, "
                f"ratio {so / plain:.3f}"
            )
    finally:
        _shutdown(llm)
    result = {
        "model": _model_name(llm, model),
        "engine_kwargs": {k: v for k, v in engine_kwargs.items() if v is not None},
        "output_len": output_len,
        "repeats": repeats,
        "schema": OPEN_SCHEMA,
        "results": rows,
    }
    _write(output_json, result, echo)
    return result
