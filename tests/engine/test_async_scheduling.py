"""Async scheduling (scheduler lookahead + runner launch/finish): the same tokens as synchronous
stepping, under chunked prefill, preemption, stop strings, max_tokens 1, seeded sampling, n > 1,
logprobs and aborts; clear errors where it cannot run.

On the CPU every torch op completes inside `launch`, so these tests check the bookkeeping
(pending tokens, PENDING placeholders fed from the previous launch's argmax, dropped extra
tokens); the GPU test below checks the same on CUDA graphs, where launches really overlap.
"""

from __future__ import annotations

import sys
import threading

import pytest

from xlaserve import LLM, SamplingParams
from xlaserve.demo import DEMO_MODEL_DIR
from xlaserve.engine.llm_engine import LLMEngine

PROMPTS = ["In the beginning", "And God said", "The LORD is my shepherd", "And it came to pass"]

# A small cache and token budget: chunked prefill and preemption happen in every run.
TIGHT = dict(max_num_batched_tokens=24, num_kv_blocks=40, block_size=4, max_model_len=128)


def _params(n: int) -> list[SamplingParams]:
    """Greedy requests with max_tokens 1..50 and stop strings / stop ids on some of them."""
    out = []
    for i in range(n):
        out.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=1 + 7 * (i % 8),
                stop=["LORD"] if i % 3 == 0 else None,
                stop_token_ids=[5] if i % 5 == 4 else None,
            )
        )
    return out


def _run(mode: str, prompts: list[str], params: list[SamplingParams], **kw: object) -> tuple:
    llm = LLM(model=DEMO_MODEL_DIR, async_scheduling=mode, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.llm_engine
    got = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    return got, eng


def test_async_matches_sync_greedy_with_preemption_and_chunking() -> None:
    prompts = PROMPTS * 4
    params = _params(len(prompts))
    sync, e0 = _run("off", prompts, params, **TIGHT)
    asyn, e1 = _run("on", prompts, params, **TIGHT)
    assert asyn == sync
    assert e0.num_overlapped_steps == 0 and e1.num_overlapped_steps > 20
    assert e1.scheduler.num_preemptions_total > 0  # preemption under lookahead happened
    assert e1.kv_manager.num_free_blocks == e1.kv_manager.num_blocks  # nothing leaked
    assert not e1.scheduler.requests and e1._inflight is None
    assert [len(g[0][0]) for g in asyn if g[0][2] == "length"] == [
        p.max_tokens for p, g in zip(params, asyn, strict=True) if g[0][2] == "length"
    ]


def test_async_mixed_sampling_seeds_n_logprobs() -> None:
    """Seeded sampled requests (n=2), logprobs and greedy ones in one batch: async steps fall
    back to sampling on the host when a batch needs it, with the same results."""
    prompts = PROMPTS * 2
    params = []
    for i, _ in enumerate(prompts):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, n=2, max_tokens=12))
        elif i % 4 == 1:
            params.append(SamplingParams(temperature=0.0, logprobs=2, max_tokens=9))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0.0, min_tokens=6, max_tokens=10))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=15, repetition_penalty=1.3))
    roomy = dict(TIGHT, num_kv_blocks=400)  # seeded draws: see the test below
    sync, _ = _run("off", prompts, params, **roomy)
    asyn, eng = _run("on", prompts, params, **roomy)
    assert asyn == sync
    assert eng.num_overlapped_steps > 0


def test_async_sampled_requests_stay_on_device() -> None:
    """Seeded temperature / top-k / top-p sampling is deferred like greedy decoding (tokens stay
    on the device until `finish`) and gives the synchronous tokens. Without preemption: a
    request preempted while its token is in flight drops that token, and its generator has
    advanced (as a preempted request's generator restarts from its seed in either mode, seeded
    outputs across preemption depend on when it happened)."""
    prompts = PROMPTS * 3
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i, max_tokens=5 + 3 * i)
        for i in range(len(prompts))
    ]
    roomy = dict(TIGHT, num_kv_blocks=400)
    sync, _ = _run("off", prompts, params, **roomy)
    asyn, eng = _run("on", prompts, params, **roomy)
    assert asyn == sync
    assert eng.scheduler.num_preemptions_total == 0
    assert eng.runner.num_deferred_steps > 20


def test_async_abort_mid_flight_and_id_reuse() -> None:
    llm = LLM(model=DEMO_MODEL_DIR, async_scheduling="on", **TIGHT)
    eng: LLMEngine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=20)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, sp)
    for _ in range(6):
        eng.step()
    assert eng._inflight is not None  # r1 is in the step in flight
    eng.abort_request(["r1"])
    eng.add_request("r1", PROMPTS[1], sp)  # the id comes back while its old step is in flight
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    # The reused id got exactly its own 20 tokens, as in a fresh synchronous run.
    ref, _ = _run("off", [PROMPTS[1]], [sp], **TIGHT)
    assert done["r1"] == ref[0][0][0]
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_async_refused_where_unsupported(tiny_model_dir) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="async_scheduling='on' is not supported.*speculative"):
        LLM(
            model=DEMO_MODEL_DIR,
            async_scheduling="on",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="async_scheduling='on' is not supported.*offload"):
        LLM(model=DEMO_MODEL_DIR, async_scheduling="on", kv_offload_bytes=1 << 20)
    with pytest.raises(ValueError, match="async_scheduling must be one of"):
        LLM(model=DEMO_MODEL_DIR, async_scheduling="sometimes")
    # "auto": synchronous for torch on the CPU (no gain measured there), async on XLA; torch on
    # CUDA is async by default (the gpu test below checks the property).
    assert LLM(model=DEMO_MODEL_DIR).llm_engine._async is False
    assert LLM(model=tiny_model_dir("llama"), backend="xla").llm_engine._async is True


def test_async_xla_matches_sync(tiny_model_dir) -> None:  # noqa: ANN001
    """XLA: the SAMPLE program's tokens stay on the device and the next forward reads them
    (PENDING inputs); same tokens as synchronous stepping, also with seeded sampling, logprobs
    and penalties (those steps read tokens at once), and no compilation after start-up."""
    model = tiny_model_dir("llama")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(8)]
    params = []
    for i in range(8):
        kw: dict = dict(max_tokens=3 + 5 * (i % 4))
        if i % 4 == 1:
            kw.update(temperature=0.8, seed=i)
        elif i % 4 == 2:
            kw.update(temperature=0.0, logprobs=2)
        params.append(SamplingParams(**kw))
    got = {}
    # "thread": async steps' programs called from the runner's dispatch thread (on by default
    # off the CPU; KernelConfig.xla_dispatch_thread), with logprob and penalty steps draining it.
    for mode in ("off", "on", "thread"):
        interval = sys.getswitchinterval()  # the process's, before this engine
        llm = LLM(
            model=model, backend="xla", async_scheduling="off" if mode == "off" else "on",
            max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=256, enforce_eager=True,
            xla_dispatch_thread="on" if mode == "thread" else "off",
        )  # fmt: skip
        assert (llm.llm_engine.runner._dispatcher is not None) == (mode == "thread")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[mode] = [
            (
                o.outputs[0].token_ids,
                [e and sorted((k, v.rank, v.logprob) for k, v in e.items()) for e in o.outputs[0].logprobs or []],
            )
            for o in outs
        ]  # fmt: skip
        if mode != "off":
            eng = llm.llm_engine
            assert eng.num_overlapped_steps > 5
        if mode == "thread":  # the GIL switch interval is at most 500 us while the thread runs
            assert sys.getswitchinterval() <= 500e-6
            llm.llm_engine.shutdown()
            assert sys.getswitchinterval() == interval  # and as it was after shutdown
    # Tokens, logprob ids and ranks exactly; logprob values to float32 rounding: the two modes
    # batch the steps differently (other token buckets, other attention loop trip counts), and
    # XLA does not promise the same rounding across programs.
    assert got["thread"] == got["on"]  # the same programs on the same inputs: bit for bit
    assert [t for t, _ in got["on"]] == [t for t, _ in got["off"]]
    for (_, a), (_, b) in zip(got["on"], got["off"], strict=True):
        assert [[e[:2] for e in pos or []] for pos in a] == [
            [e[:2] for e in pos or []] for pos in b
        ]
        va = [e[2] for pos in a for e in pos or []]
        assert va == pytest.approx([e[2] for pos in b for e in pos or []], abs=1e-5)
    with_pen = [SamplingParams(max_tokens=8, repetition_penalty=1.2)] * 2
    for thread in ("off", "on"):
        llm = LLM(model=model, backend="xla", async_scheduling="on", max_num_seqs=4,
                  max_num_batched_tokens=32, num_kv_blocks=256, enforce_eager=True,
                  xla_dispatch_thread=thread)  # fmt: skip
        outs = llm.generate(prompts[:2], with_pen)
        assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]


@pytest.mark.gpu
def test_async_matches_sync_on_cuda_graphs(tiny_model_dir) -> None:  # noqa: ANN001
    """CUDA: Triton attention + decode graphs, PENDING inputs fed on the device."""
    import torch

    model = tiny_model_dir("llama")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 5 * (i % 6)) for i in range(12)]
    kw = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32)
    got = {}
    for mode in ("off", "auto"):  # "auto" is async on CUDA
        llm = LLM(model=model, async_scheduling=mode, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[mode] = [o.outputs[0].token_ids for o in outs]
        if mode == "auto":
            eng = llm.llm_engine
            assert eng._async and eng.num_overlapped_steps > 0
            assert eng.runner.cuda_step.num_replays > 0  # decode steps ran as graphs
        llm.llm_engine.shutdown()
        torch.cuda.empty_cache()
    assert got["auto"] == got["off"]


# ----- real overlap on the CPU: a runner whose steps finish on another thread, after a delay --


def _overlap_llm(tiny_model_dir, **kw: object) -> LLM:  # noqa: ANN001
    """An LLM whose runner is core_fake_runner.ThreadedFakeRunner (the tiny model's tokenizer
    and config; no weights): launches really run ahead of the engine."""
    from xlaserve.runner import register_backend

    register_backend("threaded-fake", "core_fake_runner:ThreadedFakeRunner")
    return LLM(
        model=tiny_model_dir("llama"),
        backend="threaded-fake",
        async_scheduling="on",
        **{**dict(block_size=4, max_model_len=64, max_num_seqs=8), **kw},
    )


def test_async_overlapping_launches_tokens_and_blocks(tiny_model_dir) -> None:  # noqa: ANN001
    """Each step finishes on the worker thread while the engine schedules the next: every
    request still gets exactly the unbatched reference tokens (the fake runner also checks every
    block table and the KV of every attended position), through chunked prefill, preemption,
    stop tokens and n=2, and every block comes back."""
    import random

    from core_fake_runner import reference_output

    rng = random.Random(0)
    prompts, params = [], []
    for i in range(14):
        p = [rng.randrange(1, 98) for _ in range(rng.randint(2, 20))]
        stop = [rng.randrange(1, 98)] if i % 3 == 0 else None
        prompts.append(p)
        params.append(
            SamplingParams(
                temperature=0.0, max_tokens=rng.randint(1, 64 - len(p)), ignore_eos=True,
                stop_token_ids=stop, n=2 if i % 5 == 0 else 1,
            )
        )  # fmt: skip
    llm = _overlap_llm(tiny_model_dir, num_kv_blocks=24, max_num_batched_tokens=16)
    eng: LLMEngine = llm.llm_engine
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, sp, o in zip(prompts, params, outs, strict=True):
        want = reference_output(p, sp.max_tokens, set(sp.stop_token_ids))
        assert [c.token_ids for c in o.outputs] == [want] * sp.n
        reason = "stop" if want[-1] in sp.stop_token_ids else "length"
        assert [c.finish_reason for c in o.outputs] == [reason] * sp.n
    runner = eng.runner
    assert runner.num_overlapped_launches > 20  # steps really ran while the next was launched
    assert eng.num_overlapped_steps > 20 and eng.scheduler.num_preemptions_total > 0
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks == 24
    assert not eng.scheduler.requests


def test_async_overlapping_launches_abort_mid_flight(tiny_model_dir) -> None:  # noqa: ANN001
    """Aborts (and an aborted id reused) while a step holding them runs on the worker."""
    from core_fake_runner import reference_output

    llm = _overlap_llm(tiny_model_dir, num_kv_blocks=40, max_num_batched_tokens=24)
    eng: LLMEngine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = {f"r{i}": [10 * i + j + 1 for j in range(5 + i)] for i in range(5)}
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    for _ in range(6):
        eng.step()
    assert eng._inflight is not None  # a step holding r1 and r3 is launched, not read back
    eng.abort_request(["r1", "r3"])
    eng.add_request("r3", {"prompt_token_ids": prompts["r3"]}, sp)  # id reused mid-flight
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert sorted(done) == ["r0", "r2", "r3", "r4"]
    for rid, toks in done.items():
        assert toks == reference_output(prompts[rid], 30), rid
    assert eng.runner.num_overlapped_launches > 10
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


@pytest.mark.parametrize("fail_at", [1, 3])
def test_xla_dispatch_thread_error_reaches_the_caller(
    tiny_model_dir, monkeypatch, fail_at: int
) -> None:  # noqa: ANN001, E501
    """A program call that fails on the XLA runner's dispatch thread is raised to the caller by
    the step's `finish` (no hang, no lost error): also a step where no row samples (step 1: the
    first 32-token chunk of a 40-token prompt), and after steps that ran on the thread."""
    llm = LLM(model=tiny_model_dir("llama"), backend="xla", async_scheduling="on",
              max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, enforce_eager=True,
              xla_dispatch_thread="on")  # fmt: skip
    runner = llm.llm_engine.runner
    threads: list[str] = []
    real = runner._dispatch_step

    def failing(*args):  # noqa: ANN002, ANN202
        threads.append(threading.current_thread().name)
        if len(threads) == fail_at:
            raise RuntimeError("device lost")
        return real(*args)

    monkeypatch.setattr(runner, "_dispatch_step", failing)
    prompt = list(range(3, 43))
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(threads) >= fail_at and all(t.startswith("xla-dispatch") for t in threads)
