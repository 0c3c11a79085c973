"""XlaModelRunner driven by hand-built SchedulerOutputs (mixed batches, chunked prefill)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tiny_models import hf_greedy, hf_logprobs  # tests/tiny_models.py
from xla_helpers import drive, make_runner

from xlaserve.runner import NewRequestData
from xlaserve.sampling_params import SamplingParams

LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
BUDGET = 16
_events: dict[str, int] = {}


def _listener(event: str, duration: float, **kwargs: object) -> None:
    if event in (LOWERING_EVENT, BACKEND_COMPILE_EVENT):
        _events[event] = _events.get(event, 0) + 1


@pytest.fixture(scope="module")
def llama(tiny_model_dir, jax_cache_dir):  # noqa: ANN001, ANN201
    jax.monitoring.register_event_duration_secs_listener(_listener)
    path = tiny_model_dir("llama")
    runner = make_runner(path, jax_cache_dir, max_num_batched_tokens=BUDGET, max_num_seqs=4)
    init_lowerings = _events.get(LOWERING_EVENT, 0)
    yield path, runner, init_lowerings
    runner.shutdown()


def _prompts(n: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, n, k).tolist() for k in lens]


def test_buckets_cover_every_step_shape(llama) -> None:  # noqa: ANN001
    _, runner, _ = llama
    # xla_min_token_bucket auto on the CPU: a 1-token bucket (batch-1 decode) before 16.
    assert runner.token_buckets == [1, 16] and runner.seq_buckets == [1, 2, 4]
    # Forward programs per token bucket + the general sampler and its all-greedy specialization
    # per request bucket: a sum, not a product, and all of them compiled at start-up.
    want = [("forward", 1), ("forward", 16), ("sample", 1), ("sample", 2), ("sample", 4)]
    want += [("sample.----", 1), ("sample.----", 2), ("sample.----", 4)]
    assert runner.startup_programs() == want
    assert set(runner.programs) >= set(want) and not {
        p for p in runner.lazy_compiles if p[0] != "prompt_logprobs"
    }


def test_greedy_matches_hf_generate(llama) -> None:  # noqa: ANN001
    path, runner, _ = llama
    prompts = _prompts(runner.vocab, [5, 17, 30, 9])  # 17 and 30 are chunked under budget 16
    got, outs, sos = drive(
        runner, prompts, SamplingParams(temperature=0.0, max_tokens=8), 8, BUDGET
    )
    assert got == hf_greedy(path, prompts, 8)
    # The run really mixed partial prefill chunks, decodes and several requests per step.
    assert any([] in o.sampled_token_ids.values() for o in outs)
    assert max(len(so.num_scheduled_tokens) for so in sos) == 4
    assert not runner.requests  # finished requests were forgotten


def test_logprobs_and_prompt_logprobs_match_hf(llama) -> None:  # noqa: ANN001
    path, runner, _ = llama
    prompt = _prompts(runner.vocab, [21], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    got, outs, _ = drive(runner, [prompt], params, 4, BUDGET)
    lps = [o.logprobs["r0"][0] for o in outs if o.logprobs.get("r0")]
    assert [lp.token_ids[0] for lp in lps] == got[0]
    assert all(
        len(lp.token_ids) == 4 and lp.rank == 1 and lp.token_ids[1] == lp.token_ids[0] for lp in lps
    )
    np.testing.assert_allclose(
        [lp.logprobs[0] for lp in lps], hf_logprobs(path, prompt, got[0]), atol=1e-4
    )
    plps = [p for o in outs for p in o.prompt_logprobs.get("r0", [])]
    assert [p.token_ids[0] for p in plps] == prompt[1:]  # positions 1..P-1, over two chunks
    assert all(len(p.token_ids) == 3 for p in plps)
    np.testing.assert_allclose(
        [p.logprobs[0] for p in plps], hf_logprobs(path, prompt[:1], prompt[1:]), atol=1e-4
    )
    ranks = [p.rank for p in plps]
    assert all(r >= 1 for r in ranks) and any(r > 1 for r in ranks)


def test_min_tokens_logit_bias_and_seeds(llama) -> None:  # noqa: ANN001
    _, runner, _ = llama
    prompts = _prompts(runner.vocab, [6, 6, 6, 7], seed=4)
    prompts[1] = prompts[2] = prompts[0]
    eos_biased = SamplingParams(
        temperature=0.0, logit_bias={0: 100.0}, min_tokens=3, eos_token_ids=[0], max_tokens=5
    )
    seeded = SamplingParams(temperature=1.5, seed=11, max_tokens=6)
    other_seed = SamplingParams(temperature=1.5, seed=12, max_tokens=6)
    got, _, _ = drive(runner, prompts, [seeded, seeded, other_seed, eos_biased], 6, BUDGET)
    assert got[0] == got[1]  # same seed, same prompt -> same tokens, whatever else is in the batch
    assert got[0] != got[2]
    assert 0 not in got[3][:3] and got[3][3] == 0  # EOS blocked until min_tokens, then forced


@pytest.mark.parametrize("extra_stops", [0, 9], ids=["packed", "dense"])
def test_min_tokens_alone_masks_stop_tokens(llama, extra_stops: int) -> None:  # noqa: ANN001
    """min_tokens with no other extra (no bias, penalties, bitmask): the greedy first token,
    made a stop token, is blocked until min_tokens. With up to STOP_SLOTS stop ids the mask
    travels in the packed parameters (no dense [B, V] bias, no "extras" sampler); with more
    (9 other ids here) the dense bias carries it."""
    from xlaserve.backends_xla.sampler import needs_extras

    _, runner, _ = llama
    prompt = _prompts(runner.vocab, [6], seed=5)
    plain, _, _ = drive(runner, prompt, SamplingParams(temperature=0.0, max_tokens=3), 3, BUDGET)
    first = plain[0][0]
    others = [t for t in range(1, runner.vocab) if t != first][:extra_stops]
    sp = SamplingParams(
        temperature=0.0, min_tokens=2, stop_token_ids=[first, *others], max_tokens=3
    )
    got, _, _ = drive(runner, prompt, sp, 3, BUDGET)
    assert first not in got[0][:2]
    state = runner._new_state(NewRequestData("x", list(prompt[0]), len(prompt[0]), sp, [0], 0))
    assert state.packed_stops == (extra_stops == 0)
    assert needs_extras(state, "x", {}) == (extra_stops > 0)


def test_structured_bitmask_and_penalties(llama) -> None:  # noqa: ANN001
    _, runner, _ = llama
    v = runner.vocab
    allowed = [5, 9, 77]
    mask = np.zeros(-(-v // 32), np.uint32)
    for t in allowed:
        mask[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    prompts = _prompts(v, [8, 8], seed=5)
    rep = SamplingParams(
        temperature=0.0, repetition_penalty=50.0, frequency_penalty=2.0, max_tokens=6
    )
    got, _, _ = drive(runner, prompts, [SamplingParams(temperature=1.0, seed=1), rep], 6, BUDGET,
                      bitmasks={0: mask.view(np.int32)})  # fmt: skip
    assert set(got[0]) <= set(allowed)
    # A huge repetition penalty makes greedy avoid every prompt token and never repeat itself.
    assert not set(got[1]) & set(prompts[1]) and len(set(got[1])) == len(got[1])


def test_no_recompilation_while_serving(llama) -> None:  # noqa: ANN001
    _, runner, init_lowerings = llama
    assert init_lowerings > 0  # the listener does see compilations (those of the warm-up)
    runner.join_sample_variants()  # compiles started by earlier tests' steps are not ours
    programs, lazy = set(runner.programs), len(runner.lazy_compiles)
    background = len(runner.background_compiles)
    before = dict(_events)
    v = runner.vocab
    params = [
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, logprobs=2, max_tokens=5),
        SamplingParams(temperature=1.0, presence_penalty=0.5, prompt_logprobs=1, max_tokens=5),
        SamplingParams(
            temperature=0.0, logit_bias={3: 2.0}, min_tokens=2, eos_token_ids=[0], max_tokens=5
        ),
    ]
    for lens, stagger in (
        ([3, 25, 11, 2], True),
        ([1, 1, 1], False),
        ([16], False),
        ([40, 2], True),
    ):
        drive(runner, _prompts(v, lens, seed=len(lens)), params[: len(lens)], 5, BUDGET, stagger=stagger,
              bitmasks={0: np.full(-(-v // 32), -1, np.int32)})  # fmt: skip
    # The only programs allowed to appear while serving are the lazy prompt-logprobs ones (one
    # per token bucket, at most once each) and the sampler specializations, which compile on a
    # background thread while the general sampler serves (runner._sample_program); each
    # lowering is one of them.
    runner.join_sample_variants()
    new_variants = runner.background_compiles[background:]
    new = runner.lazy_compiles[lazy:]
    assert set(runner.programs) - programs == set(new)
    assert len(set(new_variants)) == len(new_variants)  # each specialization compiled once
    assert all(kind == "prompt_logprobs" for kind, _ in runner.lazy_compiles)
    assert len(runner.lazy_compiles) == len(set(runner.lazy_compiles)) <= len(runner.token_buckets)
    lowered = _events.get(LOWERING_EVENT, 0) - before.get(LOWERING_EVENT, 0)
    compiled = _events.get(BACKEND_COMPILE_EVENT, 0) - before.get(BACKEND_COMPILE_EVENT, 0)
    n = len(new) + len(new_variants)
    assert all(kind.startswith("sample.") for kind, _ in new_variants)
    assert lowered == n and compiled <= n, "a program was compiled while serving"


def test_nan_logits_fail_only_that_step(llama) -> None:  # noqa: ANN001
    _, runner, _ = llama
    w = runner.state["lm_head"]["weight"]
    saved = w.get_value()
    w.set_value(jax.device_put(np.full(saved.shape, np.nan, np.float32), saved.sharding))
    runner.sync_weights()
    try:
        from xlaserve.runner import NewRequestData, SchedulerOutput

        so = SchedulerOutput(
            new_requests=[
                NewRequestData("bad", [1, 2, 3], 3, SamplingParams(temperature=0.0), [0], 0)
            ],
            num_scheduled_tokens={"bad": 3},
            total_num_scheduled_tokens=3,
        )
        out = runner.execute(so)
        assert "NaN" in out.errors["bad"] and "bad" not in out.sampled_token_ids
    finally:
        w.set_value(saved)
        runner.sync_weights()
        runner.execute(type(so)(finished_req_ids={"bad"}))
    assert "bad" not in runner.requests


def test_greedy_min_tokens_steps_compile_nothing(llama) -> None:  # noqa: ANN001
    """The requests benchmarks force lengths with (greedy, min_tokens = max_tokens, with EOS
    ignored or kept) run the all-greedy sampler compiled at start-up, at every request bucket:
    their stop ids travel packed, so no "extras" specialization is compiled in the background
    and none is compiled while serving."""
    _, runner, _ = llama
    runner.join_sample_variants()
    background, lazy = len(runner.background_compiles), len(runner.lazy_compiles)
    v = runner.vocab
    for n in (1, 3, 5):
        for ignore_eos in (True, False):
            sp = SamplingParams(
                temperature=0.0, min_tokens=4, max_tokens=4, ignore_eos=ignore_eos,
                eos_token_ids=[0],
            )  # fmt: skip
            got, _, _ = drive(runner, _prompts(v, [4] * n, seed=n), [sp] * n, 4, BUDGET)
            assert all(len(g) == 4 for g in got)
            if not ignore_eos:  # EOS (0) masked until min_tokens = max_tokens
                assert all(0 not in g for g in got)
    runner.join_sample_variants()
    assert runner.background_compiles[background:] == []
    assert runner.lazy_compiles[lazy:] == []
