"""TTFT of a long shared-prefix request whose prefix was evicted from the device KV cache:
served from the host tier (KV offload) vs recomputed, with a device-cache hit for reference.

Per repetition: a fresh random prefix P; request A = P + a runs to completion, then a filler
request of the same length evicts A's blocks from the (deliberately small) device cache, then
request B = P + b is timed from add_request to its first token. Modes:
  recompute  no host tier: B recomputes P
  host       kv_offload_bytes > 0: B copies P's blocks back from host memory
  device     a cache big enough to keep P on the device (no copy, no recompute)

    python -m xlaserve.bench.offload_bench [--model DIR] [--prefix-len 448] [--reps 7]

On a GPU, with the Llama-3.1-8B shape of gpu_bench (random weights):
    python -m xlaserve.bench.offload_bench --model DIR --load-format dummy --dtype bfloat16 \
        --prefix-len 4000 --offload-bytes 4294967296
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from xlaserve.config import EngineConfig
from xlaserve.engine.llm_engine import LLMEngine
from xlaserve.sampling_params import SamplingParams


def _engine(args: argparse.Namespace, num_blocks: int, offload_bytes: int) -> LLMEngine:
    cfg = EngineConfig.from_kwargs(
        model=args.model,
        backend=args.backend,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        max_model_len=args.prefix_len + 32,
        max_num_batched_tokens=max(512, args.prefix_len + 32),
        kv_offload_bytes=offload_bytes,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
    )
    return LLMEngine(cfg)


def _finish(eng: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> float:
    """Run one request to completion; returns its TTFT in seconds."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    ttft = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
    return ttft


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    S, P = args.block_size, args.prefix_len
    per_req = -(-(P + 8 + 4) // S)
    # Small cache: the filler evicts (nearly) all of A's blocks from the device.
    small = per_req + 2
    num_blocks = 4 * per_req if mode == "device" else small
    eng = _engine(args, num_blocks, args.offload_bytes if mode == "host" else 0)
    vocab = eng.spec.vocab_size
    rng = random.Random(0)
    ttfts = []
    for i in range(args.warmup + args.reps):
        prefix = [rng.randrange(vocab) for _ in range(P)]
        a = prefix + [rng.randrange(vocab) for _ in range(8)]
        b = prefix + [rng.randrange(vocab) for _ in range(8)]
        _finish(eng, f"a{i}", a, 4)
        if mode != "device":
            _finish(eng, f"f{i}", [rng.randrange(vocab) for _ in range(P + 8)], 4)
        t = _finish(eng, f"b{i}", b, 1)
        if i >= args.warmup:
            ttfts.append(t)
    s = eng.get_stats()
    eng.shutdown()
    return {
        "mode": mode,
        "median_ttft_ms": statistics.median(ttfts) * 1e3,
        "min_ttft_ms": min(ttfts) * 1e3,
        "ttfts_ms": [round(t * 1e3, 3) for t in ttfts],
        "prefix_cache_hits": s.prefix_cache_hits,
        "kv_offload_host_hits": s.kv_offload_host_hits,
        "kv_offload_bytes_in": s.kv_offload_bytes_in,
        "kv_offload_bytes_out": s.kv_offload_bytes_out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: the shipped demo model)")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default="auto", help="'dummy': random weights (GPU shapes)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=448)
    ap.add_argument("--offload-bytes", type=int, default=256 << 20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default="recompute,host,device")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    results = [run_mode(args, m) for m in args.modes.split(",")]
    for r in results:
        print(
            f"{r['mode']:>10}: TTFT median {r['median_ttft_ms']:8.2f} ms, "
            f"min {r['min_ttft_ms']:8.2f} ms  "
            f"host hits {r['kv_offload_host_hits']:6d} tok  prefix hits {r['prefix_cache_hits']:6d}"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
