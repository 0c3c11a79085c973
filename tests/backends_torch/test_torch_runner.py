"""TorchModelRunner driven by hand-built SchedulerOutputs (a minimal token-budget scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch_hf_models import load_hf

from xlaserve.backends_torch.runner import TorchModelRunner, resolve_dtype
from xlaserve.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig, SchedulerConfig
from xlaserve.model_loader.registry import build_spec
from xlaserve.runner import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from xlaserve.sampling_params import SamplingParams

BS = 4


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class MiniScheduler:
    """Token budget, running requests in arrival order, chunked prefill, scattered block ids."""

    def __init__(self, runner: TorchModelRunner, num_blocks: int = 128, budget: int = 16) -> None:
        self.runner = runner
        self.free = [int(b) for b in np.random.default_rng(0).permutation(num_blocks)]
        self.budget = budget
        self.reqs: dict[str, _Req] = {}
        self.done: dict[str, _Req] = {}
        self.finished: set[str] = set()
        self.outputs: list[RunnerOutput] = []

    def add(self, rid: str, prompt: list[int], params: SamplingParams, max_tokens: int) -> _Req:
        r = _Req(rid, list(prompt), params, max_tokens)
        self.reqs[rid] = r
        return r

    def step(self, bitmasks: dict | None = None) -> RunnerOutput:
        so = SchedulerOutput(finished_req_ids=set(self.finished), grammar_bitmask=bitmasks or {})
        self.finished.clear()
        budget = self.budget
        for r in self.reqs.values():
            n = min(len(r.tokens) - r.num_computed, budget)
            if n <= 0:
                continue
            need = -(-(r.num_computed + n) // BS) - len(r.blocks)
            new_blocks = [self.free.pop() for _ in range(max(need, 0))]
            r.blocks += new_blocks
            if not r.sent:
                so.new_requests.append(
                    NewRequestData(
                        r.rid, r.tokens, len(r.prompt), r.params, list(r.blocks), r.num_computed
                    )
                )
                r.sent = True
            else:
                so.cached_requests.append(CachedRequestData(r.rid, new_blocks, r.num_computed))
            so.num_scheduled_tokens[r.rid] = n
            budget -= n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        out = self.runner.execute(so)
        self.outputs.append(out)
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            r.num_computed += n
            r.output += out.sampled_token_ids[rid]
            if len(r.output) >= r.max_tokens or rid in out.errors:
                self.finish(rid)
        return out

    def finish(self, rid: str, keep_blocks: bool = False) -> _Req:
        r = self.reqs.pop(rid)
        if not keep_blocks:
            self.free += r.blocks
        self.finished.add(rid)
        self.done[rid] = r
        return r

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.reqs:
                return
            self.step()
        raise AssertionError("did not finish")


def _runner(model_dir: str, **kw) -> TorchModelRunner:
    cfg = EngineConfig(
        model=ModelConfig(
            model=model_dir, dtype=kw.pop("dtype", "float32"), seed=kw.pop("seed", 0)
        ),
        cache=CacheConfig(
            block_size=BS, num_kv_blocks=kw.pop("num_kv_blocks", 128), **kw.pop("cache", {})
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
        load=LoadConfig(load_format=kw.pop("load_format", "auto")),
    )
    runner = TorchModelRunner(cfg, build_spec(model_dir))
    runner.load_model()
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    return runner


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _prompts(vocab: int) -> list[list[int]]:
    g = np.random.default_rng(11)
    return [g.integers(3, vocab, size=n).tolist() for n in (5, 13, 22, 9)]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
def test_greedy_batch_with_chunked_prefill_matches_hf_generate(name: str, hf_model_dir) -> None:
    d = hf_model_dir(name)
    runner = _runner(d)
    hf = load_hf(d)
    sched = MiniScheduler(runner, budget=16)
    prompts = _prompts(runner.spec.vocab_size)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=6)
    sched.run()
    # The 22-token prompt cannot fit the 16-token budget: some step gave it a partial chunk.
    assert any(o.sampled_token_ids.get("r2") == [] for o in sched.outputs)
    for i, p in enumerate(prompts):
        got = sched.done[f"r{i}"].output
        assert got == _hf_greedy(hf, p, 6), f"request r{i}"
    assert len({tuple(sched.done[f"r{i}"].output) for i in range(4)}) > 1  # not degenerate
    # finished_req_ids reach the runner on the next step.
    runner.execute(SchedulerOutput(finished_req_ids=set(sched.finished)))
    assert runner.requests == {}


def test_prefix_cache_hit_and_preemption_resume(hf_model_dir) -> None:
    d = hf_model_dir("llama")
    runner = _runner(d)
    hf = load_hf(d)
    sched = MiniScheduler(runner, budget=32)
    base = list(range(10, 30))
    a = sched.add("a", base, SamplingParams(temperature=0.0), max_tokens=5)
    sched.step()  # prefill a (20 tokens = 5 full blocks)
    # b shares a's first 12 tokens (3 full blocks): it starts with num_computed_tokens = 12.
    prompt_b = base[:12] + [200, 201, 202, 7]
    b = sched.add("b", prompt_b, SamplingParams(temperature=0.0), max_tokens=5)
    b.blocks = list(a.blocks[:3])
    b.num_computed = 12
    sched.step()
    assert sched.outputs[-1].sampled_token_ids["b"] != []
    sched.step()
    # Preempt b (recompute): forget it, then resume with prompt + outputs so far on new blocks.
    done_b = sched.finish("b", keep_blocks=True)
    sofar = list(done_b.output)
    assert len(sofar) == 2
    sched.step()  # runner forgets b this step
    assert "b" not in runner.requests
    b2 = sched.add("b", prompt_b, SamplingParams(temperature=0.0), max_tokens=5)
    b2.output = sofar
    sched.run()
    assert sched.done["a"].output == _hf_greedy(hf, base, 5)
    assert sched.done["b"].output == _hf_greedy(hf, prompt_b, 5)


def test_logprobs_and_chunked_prompt_logprobs_match_hf(hf_model_dir) -> None:
    d = hf_model_dir("qwen2")
    runner = _runner(d)
    hf = load_hf(d)
    sched = MiniScheduler(runner, budget=8)
    prompt = _prompts(runner.spec.vocab_size)[2]  # 22 tokens -> 3 chunks of <= 8
    sched.add(
        "p", prompt, SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2), max_tokens=3
    )
    sched.run()
    got = sched.done["p"].output
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + got])).logits[0].float(), -1)
    plp = [e for o in sched.outputs for e in o.prompt_logprobs.get("p", [])]
    assert len(plp) == len(prompt) - 1  # positions 1..P-1, each exactly once across chunks
    for p, e in enumerate(plp, start=1):
        assert e.token_ids[0] == prompt[p]
        assert e.logprobs[0] == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
        assert e.token_ids[1:] == ref[p - 1].topk(2).indices.tolist()
        assert e.rank == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
    lps = [e for o in sched.outputs for e in o.logprobs.get("p", [])]
    assert len(lps) == 3
    for k, e in enumerate(lps):
        row = ref[len(prompt) - 1 + k]
        assert e.token_ids[0] == got[k] and e.rank == 1
        assert e.logprobs[0] == pytest.approx(float(row.max()), abs=1e-4)
        assert e.token_ids[1:] == row.topk(3).indices.tolist()


def nan_prefix_step(runner):  # noqa: ANN001, ANN201
    """One step of two greedy requests, "bad" on a cached-prefix block full of NaN and "ok":
    (the scheduler, the runner's output)."""
    sched = MiniScheduler(runner, budget=32)
    bad_block = sched.free.pop()
    for k, v in runner.kv_caches:  # a "cached prefix" block full of NaN
        k[bad_block].fill_(float("nan"))
        v[bad_block].fill_(float("nan"))
    bad = sched.add("bad", list(range(3, 10)), SamplingParams(temperature=0.0), max_tokens=3)
    bad.blocks, bad.num_computed = [bad_block], 4
    sched.add("ok", list(range(3, 10)), SamplingParams(temperature=0.0), max_tokens=3)
    return sched, sched.step()


def test_nan_logits_fail_only_that_request(hf_model_dir) -> None:
    d = hf_model_dir("llama")
    runner = _runner(d)
    sched, out = nan_prefix_step(runner)
    assert "non-finite" in out.errors["bad"]
    assert out.sampled_token_ids["bad"] == []
    assert "ok" not in out.errors and len(out.sampled_token_ids["ok"]) == 1
    sched.run()
    assert len(sched.done["ok"].output) == 3


def test_seeded_sampling_reproducible_across_runners(hf_model_dir) -> None:
    d = hf_model_dir("llama")

    def sample(seed: int | None, engine_seed: int = 0) -> list[int]:
        sched = MiniScheduler(_runner(d, seed=engine_seed), budget=32)
        sched.add("s", list(range(3, 12)), SamplingParams(temperature=1.0, seed=seed), max_tokens=8)
        sched.add("t", list(range(40, 45)), SamplingParams(temperature=1.0), max_tokens=8)
        sched.run()
        return sched.done["s"].output

    a = sample(123)
    assert a == sample(123, engine_seed=5)  # per-request seed wins over the engine seed
    assert a != sample(124)
    assert sample(None, 1) == sample(None, 1)  # unseeded: reproducible given the engine seed


def test_grammar_bitmask_through_runner(hf_model_dir) -> None:
    runner = _runner(hf_model_dir("llama"))
    sched = MiniScheduler(runner, budget=32)
    sched.add("g", list(range(3, 10)), SamplingParams(temperature=1.0, seed=1), max_tokens=1)
    words = np.zeros((1, runner.spec.vocab_size // 32), dtype=np.int32)
    words[0, 1] = 1 << 5  # only token 37
    out = sched.step(bitmasks={"g": words})
    assert out.sampled_token_ids["g"] == [37]


def test_cpu_kv_blocks_dtype_dummy_and_spec_decode(hf_model_dir) -> None:
    d = hf_model_dir("llama")
    runner = _runner(
        d, num_kv_blocks=None, cache=dict(cpu_kv_cache_bytes=1 << 20), load_format="dummy"
    )
    per_block = 2 * 2 * 2 * 16 * BS * 4  # K+V, layers, Hkv, D, S, float32
    assert runner.kv_bytes_per_block() == per_block
    if runner.device.type == "cpu":  # on CUDA the block count comes from memory profiling
        assert runner.num_blocks == (1 << 20) // per_block
    else:
        runner.init_kv_cache(512)
    assert runner.kv_caches[0][0].shape == (runner.num_blocks, BS, 2, 16)
    sched = MiniScheduler(runner, num_blocks=runner.num_blocks)
    sched.add("x", [5, 6, 7], SamplingParams(temperature=0.0), max_tokens=2)
    sched.run()
    assert len(sched.done["x"].output) == 2
    so = SchedulerOutput(num_scheduled_tokens={}, spec_token_ids={"x": [1, 2]})
    with pytest.raises(ValueError, match="speculative"):  # drafts of an unscheduled request
        runner.execute(so)
    assert resolve_dtype("auto", "float16", "cpu") == torch.float32
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "float16", "cuda") == torch.float16
    assert resolve_dtype("float32", "bfloat16", "cpu") == torch.float32
