"""Helpers of the XLA backend tests: transformers logits, a runner factory, a mini scheduler."""

from __future__ import annotations

import numpy as np


def hf_logits(path: str, prompt: list[int]) -> np.ndarray:
    """transformers float32 logits [T, V] of one prompt (eager attention)."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


def make_runner(path: str, cache_dir: str, load: bool = True, **kw):  # noqa: ANN201
    """An XlaModelRunner over a tiny model with few buckets (fast compiles), KV cache ready."""
    from xlaserve.backends_xla.runner import XlaModelRunner
    from xlaserve.config import EngineConfig
    from xlaserve.model_loader.registry import build_spec

    args = dict(
        model=path,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=64,
        compilation_cache_dir=cache_dir,
    )
    args.update(kw)
    config = EngineConfig.from_kwargs(**args)
    runner = XlaModelRunner(config, build_spec(path))
    if load:
        runner.load_model()
        runner.init_kv_cache(runner.determine_num_kv_blocks())
    return runner


def drive(runner, prompts, params, max_new: int, budget: int, stagger: bool = True, bitmasks=None):  # noqa: ANN001, ANN201
    """A minimal scheduler: feeds hand-built SchedulerOutputs (chunked prefill under a token
    budget, requests joining one per step when `stagger`) until each request has `max_new`
    tokens. bitmasks: request index -> i32 [W] sent whenever it samples. Returns (outputs per request, list of RunnerOutputs, list of SchedulerOutputs)."""
    from xlaserve.runner import CachedRequestData, NewRequestData, SchedulerOutput

    s = runner.block_size
    free = list(range(runner.num_kv_blocks))[::-1]  # hand out high ids first: non-trivial tables
    if not isinstance(params, list):
        params = [params] * len(prompts)
    reqs = {
        f"r{i}": dict(
            tokens=list(p), n_prompt=len(p), computed=0, blocks=[], sent=False, out=[], done=False
        )
        for i, p in enumerate(prompts)
    }
    order = list(reqs)
    finished: set[str] = set()
    outs, sos, step = [], [], 0
    while not all(r["done"] for r in reqs.values()):
        so = SchedulerOutput(finished_req_ids=finished)
        finished = set()
        left = budget
        active = order[: step + 1] if stagger else order
        for rid in active:
            r = reqs[rid]
            n = min(len(r["tokens"]) - r["computed"], left)
            if r["done"] or n <= 0 or len(so.num_scheduled_tokens) == runner.max_num_seqs:
                continue
            new_blocks = [
                free.pop() for _ in range(-(-(r["computed"] + n) // s) - len(r["blocks"]))
            ]
            r["blocks"] += new_blocks
            pi = order.index(rid)
            if not r["sent"]:
                so.new_requests.append(
                    NewRequestData(
                        rid,
                        list(r["tokens"]),
                        r["n_prompt"],
                        params[pi],
                        list(r["blocks"]),
                        r["computed"],
                    )
                )
                r["sent"] = True
            else:
                so.cached_requests.append(CachedRequestData(rid, new_blocks, r["computed"]))
            so.num_scheduled_tokens[rid] = n
            left -= n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        for pi, mask in (bitmasks or {}).items():
            rid = order[pi]
            if rid in so.num_scheduled_tokens:
                so.grammar_bitmask[rid] = mask[None, :]
        out = runner.execute(so)
        sos.append(so)
        outs.append(out)
        for rid, n in so.num_scheduled_tokens.items():
            r = reqs[rid]
            r["computed"] += n
            toks = out.sampled_token_ids[rid]
            assert len(toks) == (1 if r["computed"] == len(r["tokens"]) else 0)
            r["tokens"] += toks
            r["out"] += toks
            if len(r["out"]) >= max_new:
                r["done"] = True
                free += r["blocks"]
                finished.add(rid)
        step += 1
    assert not runner.execute(SchedulerOutput(finished_req_ids=finished)).sampled_token_ids
    return [reqs[rid]["out"] for rid in order], outs, sos
