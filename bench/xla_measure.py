"""Measure the XLA backend on this machine (CPU numbers go into the lead's notes).

    python -m xlaserve.bench.xla_measure startup [--model DIR] [--tokens 2048] [--seqs 64]
        cold start-up of LLM(backend="xla") with a fresh compilation cache: seconds and the number
        of programs XLA compiled (and how many of them are the model forward).
    python -m xlaserve.bench.xla_measure decode [--model DIR] [--batches 1,32] [--steps 32]
        decode tokens/s of backend "xla" and backend "torch" side by side (same engine, same
        prompts; prefill and the first token excluded).

The model defaults to the shipped demo model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def measure_startup(model: str | None, tokens: int, seqs: int, cache_dir: str | None) -> dict:
    """Seconds to build an LLM on backend "xla" (load + KV cache + every compile) and the
    number of XLA backend compilations it ran."""
    import jax

    from xlaserve import LLM

    compiles: list[float] = []

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="xlaserve-jax-cold-")
    t0 = time.perf_counter()
    llm = LLM(model, backend="xla", max_num_batched_tokens=tokens, max_num_seqs=seqs,
              compilation_cache_dir=cache_dir)  # fmt: skip
    secs = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    out = dict(
        seconds=round(secs, 1),
        xla_compiles=len(compiles),
        compile_seconds=round(sum(compiles), 1),
        token_buckets=getattr(runner, "token_buckets", None),
        seq_buckets=getattr(runner, "seq_buckets", None),
    )
    llm.llm_engine.shutdown()
    return out


def measure_decode(
    model: str | None,
    backend: str,
    batches: list[int],
    steps: int,
    cache_dir: str,
    max_model_len: int | None = None,
) -> dict[int, float]:
    """Decode tokens/s at each batch size (8-token prompts, greedy, ignore_eos), one engine per
    backend configured for the largest batch (as a server would be). max_model_len None: the
    model's own (as a user gets it)."""
    from xlaserve import LLM, SamplingParams

    llm = LLM(model, backend=backend, max_num_seqs=max(batches), max_num_batched_tokens=256,
              max_model_len=max_model_len, compilation_cache_dir=cache_dir)  # fmt: skip
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    out = {}
    for batch in batches:
        for i in range(batch):
            prompt = [(7 * i + j) % 1000 + 5 for j in range(8)]
            eng.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
        eng.step()  # prefill of every request (8 * batch <= 256 tokens) and its first token
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        out[batch] = round(batch * steps / (time.perf_counter() - t0), 1)
        while eng.has_unfinished_requests():
            eng.step()
    eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["startup", "decode"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=0, help="0: the model's own")
    ap.add_argument("--cache-dir", default=None, help="compilation cache (default: a fresh one)")
    args = ap.parse_args()
    if args.what == "startup":
        print(json.dumps(measure_startup(args.model, args.tokens, args.seqs, args.cache_dir)))
        return
    cache = args.cache_dir or tempfile.mkdtemp(prefix="xlaserve-jax-")
    batches = [int(x) for x in args.batches.split(",")]
    res = {
        be: measure_decode(args.model, be, batches, args.steps, cache, args.max_model_len or None)
        for be in ("xla", "torch")
    }
    for b in batches:
        row = {be: res[be][b] for be in res}
        print(json.dumps({"batch": b, "decode_tokens_per_s": row}), flush=True)


if __name__ == "__main__":
    main()
