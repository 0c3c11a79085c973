"""Batch-1 speculative decoding measurement: tokens/s with and without speculation and the mean
acceptance length (tokens emitted per verification step with drafts).

    python -m xlaserve.bench.spec_decode [--model DIR] [--draft DIR] [--eagle DIR] [--k 3]
        [--max-tokens 64] [--backend torch|xla] [--output-json F]

Defaults to the shipped demo model, its draft and its EAGLE head (`--eagle ""` skips EAGLE). Greedy decoding; the outputs of every
speculative run are checked against the plain run (they must be equal).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

# Repetitive prompts (n-gram lookup thrives on them) and plain ones.
PROMPTS = [
    "And God said, Let there be light: and there was light. And God said, Let there be",
    "In the beginning God created the heaven and the earth. In the beginning God created",
    "The LORD is my shepherd; I shall not want.",
    "And it came to pass, when",
]


def _run(model: str, spec: dict | None, prompts: list, max_tokens: int, **engine: Any) -> dict:
    from xlaserve import LLM, SamplingParams

    llm = LLM(model=model, speculative_config=spec, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    eng = llm.llm_engine
    d0, a0, n0 = eng.spec_num_draft_tokens, eng.spec_num_accepted_tokens, eng.spec_num_drafts
    outs, elapsed = [], 0.0
    for p in prompts:  # batch 1
        t = time.perf_counter()
        outs.append(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
        elapsed += time.perf_counter() - t
    drafts = eng.spec_num_draft_tokens - d0
    accepted = eng.spec_num_accepted_tokens - a0
    steps = eng.spec_num_drafts - n0
    llm.llm_engine.shutdown()
    return {
        "tokens_per_s": sum(map(len, outs)) / elapsed,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "outputs": outs,
    }


def measure(
    model: str,
    draft: str | None,
    k: int = 3,
    max_tokens: int = 64,
    prompts: list | None = None,
    eagle: str | None = None,
    **engine: Any,
) -> dict:
    prompts = prompts or PROMPTS
    base = _run(model, None, prompts, max_tokens, **engine)
    results = {"plain": base}
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": k}}
    if draft is not None:
        specs["draft_model"] = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": k,
        }
    if eagle:
        specs["eagle"] = {"method": "eagle", "model": eagle, "num_speculative_tokens": k}
    for name, spec in specs.items():
        r = _run(model, spec, prompts, max_tokens, **engine)
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["same_outputs"] = r["outputs"] == base["outputs"]
        results[name] = r
    for r in results.values():
        del r["outputs"]
    return results


def main() -> None:
    from xlaserve.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEMO_MODEL_DIR)
    ap.add_argument("--draft", default=DEMO_DRAFT_DIR)
    ap.add_argument(
        "--eagle",
        default=None,
        help="EAGLE head directory (default: the shipped demo head when --model is the demo)",
    )
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = default)")
    ap.add_argument("--backend", default="torch", choices=["torch", "xla"])
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.threads:
        import torch  # only to pin threads: on a loaded CPU one thread avoids spin-wait stalls

        torch.set_num_threads(args.threads)
    draft = args.draft  # draft_model runs on both backends
    eagle = args.eagle
    if eagle is None and args.model == DEMO_MODEL_DIR:
        eagle = os.path.join(os.path.dirname(DEMO_MODEL_DIR), "demo-kjv-eagle")
    if args.backend != "torch":  # eagle is torch-only so far
        eagle = None
    res = measure(
        args.model, draft, args.k, args.max_tokens, eagle=eagle or None, backend=args.backend
    )
    print(json.dumps(res, indent=2))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
