"""KernelConfig.xla_startup_token_bucket: the forwards of larger token buckets compile in a
background thread after the engine is ready; meanwhile each step holds at most the largest ready
bucket's tokens (long prompts are chunked), nothing compiles on the serving path, and the tokens
are those of an engine that compiled everything up front. The background compile is held on an
event here so the capped phase is observed for certain."""

from __future__ import annotations

import threading

import pytest

from xlaserve import LLM, SamplingParams
from xlaserve.backends_xla import runner as runner_mod

PROMPTS = [list(range(3, 63)), list(range(100, 141))]  # 60 and 41 tokens: > the 16-token bucket
LATE = list(range(200, 260))  # after the compiles (no prefix shared with PROMPTS: no cache hit)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(path: str, cache_dir: str, startup_bucket: int) -> LLM:
    return LLM(path, backend="xla", max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128,
               block_size=4, num_kv_blocks=128, compilation_cache_dir=cache_dir,
               xla_startup_token_bucket=startup_bucket)  # fmt: skip


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_larger_buckets_compile_after_ready_and_cap_the_steps(
    tiny_model_dir, jax_cache_dir, monkeypatch
) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama")
    full = _llm(path, jax_cache_dir, -1)  # every bucket up front: the reference tokens
    assert full.llm_engine.runner.deferred_programs() == []
    want = _tokens(full, [*PROMPTS, LATE])
    full.llm_engine.shutdown()

    release = threading.Event()
    real = runner_mod.compile_programs

    def held(r, programs, progress=True):  # noqa: ANN001, ANN202
        if not progress:  # the background compile waits for the test
            assert release.wait(120)
        return real(r, programs, progress)

    monkeypatch.setattr(runner_mod, "compile_programs", held)
    llm = _llm(path, jax_cache_dir, 16)
    engine = llm.llm_engine
    runner = engine.runner
    assert runner.token_buckets == [1, 16, 32, 64]
    assert runner.deferred_programs() == [("forward", 32), ("forward", 64)]
    assert ("forward", 32) not in runner.programs and runner.ready_token_budget() == 16

    sched = engine.scheduler
    seen: list[int] = []
    schedule = sched.schedule

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        so = schedule(*a, **k)
        seen.append(so.total_num_scheduled_tokens)
        return so

    monkeypatch.setattr(sched, "schedule", spy)
    assert _tokens(llm, PROMPTS) == want[:2]  # served while the large buckets wait
    assert max(seen) == 16 and sched.token_cap == 16
    assert not [p for p in runner.lazy_compiles if p[0] == "forward"]  # no serving compile

    release.set()
    engine.wait_compiled()  # EngineCore.wait_compiled: the runner's background compiles
    assert {("forward", 32), ("forward", 64)} <= set(runner.programs)
    seen.clear()
    assert _tokens(llm, [LATE]) == want[2:]
    assert sched.token_cap is None and max(seen) == 60  # the whole prompt in one step again
    assert not [p for p in runner.lazy_compiles if p[0] == "forward"]
    engine.shutdown()


def test_auto_defers_nothing_on_the_cpu_and_bad_values_are_refused(
    tiny_model_dir, jax_cache_dir
) -> None:  # noqa: ANN001
    from xlaserve.config import KernelConfig

    llm = _llm(tiny_model_dir("llama"), jax_cache_dir, 0)
    runner = llm.llm_engine.runner
    assert runner.deferred_programs() == [] and runner.ready_token_budget() is None
    llm.llm_engine.shutdown()
    for bad in (3, -2):
        with pytest.raises(ValueError, match="xla_startup_token_bucket"):
            KernelConfig(xla_startup_token_bucket=bad)
