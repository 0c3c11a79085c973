"""Multi-LoRA on the XLA runner, driven by hand-built SchedulerOutputs: a mixed batch of two
adapters and the base model gives transformers' greedy tokens of the base with each adapter
merged (W + B @ A), per request; rewriting a slot mid-run changes only the requests that use it
afterwards, and compiles nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from xla_helpers import make_runner  # tests/backends_xla/xla_helpers.py

from xlaserve.lora import LORA_MODULES, LoRAAdapter
from xlaserve.runner import CachedRequestData, NewRequestData, SchedulerOutput
from xlaserve.sampling_params import SamplingParams

LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_events: dict[str, int] = {}
MAX_LORAS, MAX_RANK, BUDGET, NEW = 2, 8, 16, 5


def _listener(event: str, duration: float, **kwargs: object) -> None:
    if event in (LOWERING_EVENT, BACKEND_COMPILE_EVENT):
        _events[event] = _events.get(event, 0) + 1


def _adapter(spec, name: str, int_id: int, rank: int, modules, seed: int) -> LoRAAdapter:  # noqa: ANN001
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


def _hf_merged_greedy(path: str, adapter: LoRAAdapter | None, prompt: list[int]) -> list[int]:
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


def _drive(runner, prompts, slots, loads, tag: str) -> list[list[int]]:  # noqa: ANN001
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


@pytest.fixture(scope="module")
def lora_runner(tiny_model_dir, jax_cache_dir):  # noqa: ANN001, ANN201
    jax.monitoring.register_event_duration_secs_listener(_listener)
    path = tiny_model_dir("llama")
    runner = make_runner(
        path, jax_cache_dir, max_num_batched_tokens=BUDGET, max_num_seqs=4,
        enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK,
    )  # fmt: skip
    spec = runner.spec
    adapters = {
        "a1": _adapter(spec, "a1", 1, 4, ("q_proj", "v_proj", "o_proj", "down_proj"), seed=1),
        "a2": _adapter(spec, "a2", 2, MAX_RANK, LORA_MODULES, seed=2),
        "a3": _adapter(spec, "a3", 3, 6, ("k_proj", "gate_proj", "up_proj"), seed=3),
    }
    yield path, runner, adapters
    runner.shutdown()


PROMPTS = [
    [5, 9, 17, 33, 2, 41, 8],
    [12, 7, 3],
    [30, 22, 11, 19, 4, 6, 27, 15, 9, 2, 14],
    [44, 1, 9, 23, 5],
]


def test_mixed_batch_matches_merged_transformers(lora_runner) -> None:  # noqa: ANN001
    path, runner, ad = lora_runner
    assert runner.capabilities.lora
    # requests: a1, base, a2, a1 (two requests share a slot; mixed prompt lengths, chunked)
    slots = [0, -1, 1, 0]
    got = _drive(runner, PROMPTS, slots, [(0, ad["a1"]), (1, ad["a2"])], "m")
    by_slot = {0: ad["a1"], 1: ad["a2"], -1: None}
    want = [_hf_merged_greedy(path, by_slot[s], p) for s, p in zip(slots, PROMPTS, strict=True)]
    assert got == want
    # The adapters matter: the base model's tokens differ for the adapter requests.
    base = [_hf_merged_greedy(path, None, p) for p in PROMPTS]
    assert all(got[i] != base[i] for i in (0, 2, 3)) and got[1] == base[1]


def test_slot_rewrite_changes_only_its_requests_and_compiles_nothing(lora_runner) -> None:  # noqa: ANN001
    path, runner, ad = lora_runner
    _drive(runner, PROMPTS[:2], [0, 1], [(0, ad["a1"]), (1, ad["a2"])], "w")  # warm every shape
    programs, lazy = set(runner.programs), list(runner.lazy_compiles)
    writes = runner.lora_tables.write_cache_size()
    before = dict(_events)
    # slot 1: a2 -> a3 (rank 6, other modules: a2's rows must be gone); slot 0 keeps a1.
    slots = [0, 1, -1, 1]
    got = _drive(runner, PROMPTS, slots, [(1, ad["a3"])], "r")
    by_slot = {0: ad["a1"], 1: ad["a3"], -1: None}
    want = [_hf_merged_greedy(path, by_slot[s], p) for s, p in zip(slots, PROMPTS, strict=True)]
    assert got == want
    assert set(runner.programs) == programs and runner.lazy_compiles == lazy
    assert runner.lora_tables.write_cache_size() == writes == 1
    for ev in (LOWERING_EVENT, BACKEND_COMPILE_EVENT):
        assert _events.get(ev, 0) == before.get(ev, 0), f"{ev}: compiled while serving"


def test_bad_adapters_and_slots_are_clear_errors(lora_runner) -> None:  # noqa: ANN001
    _, runner, ad = lora_runner
    spec = runner.spec
    big = _adapter(spec, "big", 9, MAX_RANK + 1, ("q_proj",), seed=4)
    with pytest.raises(ValueError, match="max_lora_rank"):
        runner.execute(SchedulerOutput(lora_loads=[(0, big)]))
    wrong = _adapter(spec, "wrong", 9, 2, ("q_proj",), seed=4)
    a, b = wrong.weights[(0, "q_proj")]
    wrong.weights[(0, "q_proj")] = (a[:, :-1], b)
    with pytest.raises(ValueError, match="do not fit"):
        runner.execute(SchedulerOutput(lora_loads=[(0, wrong)]))
    missing = LoRAAdapter("x", 9, 2, 1.0, {(spec.num_layers, "q_proj"): (a, b)})
    with pytest.raises(ValueError, match="no LoRA table"):
        runner.execute(SchedulerOutput(lora_loads=[(0, missing)]))
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(SchedulerOutput(lora_loads=[(MAX_LORAS, ad["a1"])]))
    nr = NewRequestData(
        "bad", [1, 2], 2, SamplingParams(temperature=0.0), [0], 0, lora_slot=MAX_LORAS
    )
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(SchedulerOutput(new_requests=[nr], num_scheduled_tokens={"bad": 2},
                                       total_num_scheduled_tokens=2))  # fmt: skip
    runner.requests.pop("bad", None)
