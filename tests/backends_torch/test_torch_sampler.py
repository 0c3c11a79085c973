"""Sampler: every SamplingParams field has its effect, in the documented order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xlaserve.backends_torch.sampler import (
    Sampler,
    SamplingRow,
    apply_constraints,
    apply_penalties,
    filter_logits,
    unpack_bitmask,
)
from xlaserve.sampling_params import SamplingParams

V = 40


def _logits(b: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def _row(**kw) -> SamplingRow:
    prompt = kw.pop("prompt", [1, 2, 3])
    output = kw.pop("output", [])
    gen = kw.pop("generator", None)
    mask = kw.pop("bitmask", None)
    return SamplingRow(SamplingParams(**kw), prompt, output, gen, mask)


def test_greedy_is_argmax_and_top_k_1_equals_greedy() -> None:
    s = Sampler()
    x = _logits(4)
    greedy = s(x, [_row(temperature=0.0) for _ in range(4)]).token_ids
    assert greedy == x.argmax(-1).tolist()
    topk1 = s(x, [_row(temperature=1.5, top_k=1) for _ in range(4)]).token_ids
    assert topk1 == greedy


def test_logit_bias_forces_token() -> None:
    x = _logits()
    target = int(x[0].argmin())
    out = Sampler()(x, [_row(temperature=0.0, logit_bias={target: 100.0})])
    assert out.token_ids == [target]
    # Added, not set: the exact value.
    y = apply_constraints(x.clone(), [_row(logit_bias={target: 2.5})])
    assert float(y[0, target]) == pytest.approx(float(x[0, target]) + 2.5)


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    x = torch.zeros(1, V)
    x[0, 5] = 10.0  # EOS is the best token
    x[0, 6] = 9.0  # then a stop token id
    p = dict(temperature=0.0, min_tokens=3, eos_token_ids=[5], stop_token_ids=[6])
    assert Sampler()(x, [_row(**p, output=[7])]).token_ids[0] not in (5, 6)
    assert Sampler()(x, [_row(**p, output=[7, 8, 9])]).token_ids == [5]  # min reached
    # ignore_eos: EOS is not a stop token, so min_tokens leaves it alone (stop ids still masked).
    y = apply_constraints(x.clone(), [_row(**{**p, "ignore_eos": True}, output=[])])
    assert float(y[0, 5]) == 10.0 and y[0, 6] == float("-inf")


def test_bitmask_allows_only_allowed_tokens() -> None:
    allowed = [3, 31, 32, 39]
    words = np.zeros((V + 31) // 32, dtype=np.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = words.astype(np.uint32).view(np.int32)  # bit 31 set -> negative int32
    assert mask[0] < 0
    unpacked = unpack_bitmask(torch.from_numpy(mask)[None], V)[0]
    assert unpacked.nonzero().flatten().tolist() == allowed
    s = Sampler(seed=1)
    x = _logits(2)
    for _ in range(20):
        out = s(x, [_row(temperature=1.0, bitmask=mask), _row(temperature=0.0, bitmask=mask)])
        assert all(t in allowed for t in out.token_ids)
    # An unconstrained row in the same batch is unaffected.
    out = s(x, [_row(temperature=0.0, bitmask=mask), _row(temperature=0.0)])
    assert out.token_ids[1] == int(x[1].argmax())


def test_penalties_exact_formula() -> None:
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    prompt, output = [0, 1], [2, 2, 3]
    r = _row(
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        prompt=prompt,
        output=output,
    )
    y = apply_penalties(x.clone(), [r])[0].tolist()
    expect = [
        2.0 / 2,  # prompt token, positive: divided
        -2.0 * 2,  # prompt token, negative: multiplied
        1.0 / 2 - 0.5 * 2 - 0.25,  # output twice
        -1.0 * 2 - 0.5 * 1 - 0.25,  # output once
        0.5,  # unseen
        3.0,
    ]
    assert y == pytest.approx(expect)
    # Frequency/presence use only output tokens: a prompt-only token gets no such penalty.
    y2 = apply_penalties(x.clone(), [_row(frequency_penalty=1.0, prompt=[4], output=[])])
    assert torch.equal(y2, x)


def test_temperature_top_k_top_p_min_p_masks() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]])
    x = probs.log()
    keep = lambda p: torch.isfinite(filter_logits(x.clone(), [SamplingParams(**p)]))[0].tolist()  # noqa: E731
    assert keep(dict(top_k=2)) == [True, True, False, False, False]
    assert keep(dict(top_p=0.7)) == [True, True, False, False, False]  # 0.5 < 0.7 <= 0.75
    assert keep(dict(top_p=0.75)) == [True, True, False, False, False]
    assert keep(dict(top_p=0.76)) == [True, True, True, False, False]
    assert keep(dict(top_p=0.1)) == [True, False, False, False, False]  # best always kept
    assert keep(dict(min_p=0.35)) == [True, True, False, False, False]  # < 0.175 dropped
    assert keep(dict(min_p=0.1)) == [True, True, True, True, False]
    t = filter_logits(x.clone(), [SamplingParams(temperature=0.5)])
    torch.testing.assert_close(t, x / 0.5)
    # Combined, per row in one batch.
    y = filter_logits(x.repeat(2, 1), [SamplingParams(top_k=3), SamplingParams(top_p=0.5)])
    assert torch.isfinite(y).sum(-1).tolist() == [3, 1]


def test_sampling_follows_distribution_and_temperature() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0]]).repeat(1, 1)
    s = Sampler(seed=0)
    counts = np.zeros(3)
    for _ in range(3000):
        counts[s(x, [_row(temperature=1.0)]).token_ids[0]] += 1
    np.testing.assert_allclose(counts / 3000, torch.softmax(x[0], -1).numpy(), atol=0.03)
    low = [s(x, [_row(temperature=0.05)]).token_ids[0] for _ in range(200)]
    assert low.count(2) == 200


def test_seeded_sampling_reproducible_and_seed_dependent() -> None:
    x = _logits(1, seed=3) / 3  # flat-ish distribution

    def run(seed: int, steps: int = 12) -> list[int]:
        s = Sampler(seed=99)
        g = s.make_generator(seed)  # once per request, advanced each step
        return [
            s(x, [_row(temperature=1.0, seed=seed, generator=g)]).token_ids[0] for _ in range(steps)
        ]

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    assert len(set(a)) > 1  # the generator advances between steps

    # A seeded row is unaffected by its batch neighbours.
    s = Sampler(seed=5)
    g = s.make_generator(7)
    mixed = []
    for _ in range(12):
        out = s(
            x.repeat(3, 1),
            [
                _row(temperature=1.0),
                _row(temperature=1.0, seed=7, generator=g),
                _row(temperature=0.0),
            ],
        )
        mixed.append(out.token_ids[1])
    assert mixed == a


def test_logprobs_raw_distribution_topk_and_rank() -> None:
    x = _logits(2)
    rows = [_row(temperature=0.0, logprobs=3, logit_bias={0: 50.0}), _row(temperature=0.0)]
    out = Sampler()(x, rows)
    lp = torch.log_softmax(x, -1)
    e = out.logprobs[0]
    assert out.logprobs[1] is None
    assert e.token_ids[0] == out.token_ids[0] == 0  # forced by the bias
    assert e.logprobs[0] == pytest.approx(float(lp[0, 0]), abs=1e-6)  # raw, not biased
    top = lp[0].topk(3)
    assert e.token_ids[1:] == top.indices.tolist()
    assert e.logprobs[1:] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert e.rank == int((lp[0] > lp[0, 0]).sum()) + 1
    assert e.rank > 1
    # logprobs=0: only the sampled token; greedy token has rank 1.
    out = Sampler()(x[:1], [_row(temperature=0.0, logprobs=0)])
    assert len(out.logprobs[0].token_ids) == 1 and out.logprobs[0].rank == 1


def test_raw_logits_not_modified() -> None:
    x = _logits(1)
    before = x.clone()
    Sampler()(
        x, [_row(temperature=0.7, top_k=3, repetition_penalty=1.3, logit_bias={1: 3.0}, output=[4])]
    )
    assert torch.equal(x, before)


def test_owned_logits_masked_in_place_same_tokens() -> None:
    """`owned=True` (the runner's own logits, dropped after sampling) applies the constraints
    in place instead of on a copy: the same tokens and logprobs; without it the input stays."""
    allowed = [3, 31, 32, 39]
    words = np.zeros((V + 31) // 32, dtype=np.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = words.astype(np.uint32).view(np.int32)
    rows = [
        _row(temperature=0.0, bitmask=mask, logprobs=2),
        _row(temperature=0.8, seed=3, bitmask=mask, logit_bias={5: 2.0}),
    ]
    x = _logits(2, seed=4)
    before = x.clone()
    copy = Sampler(seed=1)(x, rows)
    assert torch.equal(x, before)
    owned = Sampler(seed=1)(x, rows, owned=True)
    assert owned.token_ids == copy.token_ids and set(owned.token_ids) <= set(allowed)
    assert owned.logprobs[0] == copy.logprobs[0]  # from the raw logits, before the masking
    assert not torch.equal(x, before)  # masked in place: no copy was made
    # With a plain greedy row beside them the others are gathered (a copy) either way.
    x = _logits(3, seed=5)
    mixed = [*rows, _row(temperature=0.0)]
    assert Sampler(seed=1)(x, mixed, owned=True).token_ids == Sampler(seed=1)(x, mixed).token_ids
