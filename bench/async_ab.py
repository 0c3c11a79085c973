"""Async vs synchronous scheduling, side by side: greedy decode tokens/s of one model with
`async_scheduling` "off" and "on", the two engines alternating in every repeat (medians), and
whether they produced the same tokens.

    python -m xlaserve.bench.async_ab [--backend xla] [--batch 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from xlaserve import LLM, SamplingParams
from xlaserve.demo import DEMO_MODEL_DIR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEMO_MODEL_DIR)
    ap.add_argument("--backend", default="xla", choices=["torch", "xla"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    b = args.batch
    llms = {
        m: LLM(model=args.model, backend=args.backend, async_scheduling=m, max_num_seqs=b)
        for m in ("off", "on")
    }
    n = args.output_len
    sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 90, 12]} for i in range(b)]
    for llm in llms.values():  # warm-up
        llm.generate(prompts, sp, use_tqdm=False)
    rates: dict[str, list[float]] = {m: [] for m in llms}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for m, llm in llms.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            rates[m].append(b * n / (time.perf_counter() - t))
            tokens[m] = [o.outputs[0].token_ids for o in outs]
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(json.dumps({
        "backend": args.backend, "batch": b, "tokens_per_s": med, "ratio_on_off": med["on"] / med["off"],
        "same_tokens": tokens["on"] == tokens["off"], "runs": rates,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
