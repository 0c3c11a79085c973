"""Helpers of the XLA multi-LoRA tests: numpy adapters, transformers with an adapter merged, a
mini scheduler that sends lora_slot / lora_loads."""

from __future__ import annotations

import numpy as np

from xlaserve.lora import LoRAAdapter
from xlaserve.runner import CachedRequestData, NewRequestData, SchedulerOutput
from xlaserve.sampling_params import SamplingParams

BUDGET, NEW = 16, 5
# Mixed lengths (prefills chunked under BUDGET).
PROMPTS = [
    [5, 9, 17, 33, 2, 41, 8],
    [12, 7, 3],
    [30, 22, 11, 19, 4, 6, 27, 15, 9, 2, 14],
    [44, 1, 9, 23, 5],
]


def make_adapter(spec, name: str, int_id: int, rank: int, modules, seed: int) -> LoRAAdapter:  # noqa: ANN001
    """A random adapter straight from numpy (B already scaled), big enough to move greedy tokens."""
    rng = np.random.default_rng(seed)
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
    weights = {}
    for layer in range(spec.num_layers):
        for m in modules:
            d_in, d_out = dims[m]
            a = rng.normal(0, 0.3, (rank, d_in)).astype(np.float32)
            b = rng.normal(0, 0.3, (d_out, rank)).astype(np.float32)
            weights[(layer, m)] = (a, b)
    return LoRAAdapter(name, int_id, rank, 1.0, weights)


def hf_merged_greedy(path: str, adapter: LoRAAdapter | None, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation with W + B @ A merged into each targeted projection."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sd = model.state_dict()
    for (layer, m), (a, b) in (adapter.weights if adapter else {}).items():
        part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        sd[f"model.layers.{layer}.{part}.{m}.weight"] += torch.from_numpy(b @ a)
    model.load_state_dict(sd)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                           min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
    return g[0, len(prompt) :].tolist()


def drive_lora(runner, prompts, slots, loads, tag: str) -> list[list[int]]:  # noqa: ANN001
    """All requests join at once (a mixed batch), chunked prefill under BUDGET tokens per step;
    `loads` ride on the first step. Returns each request's NEW greedy tokens."""
    s = runner.block_size
    free = list(range(runner.num_kv_blocks))[::-1]
    reqs = [
        dict(tokens=list(p), n=len(p), done_tok=0, blocks=[], sent=False, out=[]) for p in prompts
    ]
    finished: set[str] = set()
    first = True
    while any(len(r["out"]) < NEW for r in reqs):
        so = SchedulerOutput(finished_req_ids=finished, lora_loads=loads if first else [])
        finished, first, left = set(), False, BUDGET
        for i, r in enumerate(reqs):
            rid = f"{tag}{i}"
            n = min(len(r["tokens"]) - r["done_tok"], left)
            if len(r["out"]) >= NEW or n <= 0:
                continue
            new = [free.pop() for _ in range(-(-(r["done_tok"] + n) // s) - len(r["blocks"]))]
            r["blocks"] += new
            if not r["sent"]:
                params = SamplingParams(temperature=0.0, max_tokens=NEW)
                so.new_requests.append(NewRequestData(rid, list(r["tokens"]), r["n"], params,
                                                      list(r["blocks"]), 0, lora_slot=slots[i]))  # fmt: skip
                r["sent"] = True
            else:
                so.cached_requests.append(CachedRequestData(rid, new, r["done_tok"]))
            so.num_scheduled_tokens[rid] = n
            left -= n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        out = runner.execute(so)
        for i, r in enumerate(reqs):
            rid = f"{tag}{i}"
            if rid not in so.num_scheduled_tokens:
                continue
            r["done_tok"] += so.num_scheduled_tokens[rid]
            toks = out.sampled_token_ids[rid]
            r["tokens"] += toks
            r["out"] += toks
            if len(r["out"]) >= NEW:
                finished.add(rid)
                free += r["blocks"]
    runner.execute(SchedulerOutput(finished_req_ids=finished))
    assert not runner.requests
    return [r["out"] for r in reqs]
