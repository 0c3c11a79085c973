"""Sampler.verify (torch) against hand-worked cases, the numpy reference and exact
probabilities (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xlaserve.backends_torch.sampler import Sampler, SamplingRow
from xlaserve.sampling_params import SamplingParams
from xlaserve.spec_decode.rejection import residual_distribution, verify_reference

V = 8


def _rows(params: SamplingParams, drafts: list[int], output: list[int] | None = None, gen=None):
    out = list(output or [])
    return [
        SamplingRow(params=params, prompt_ids=[1], output_ids=out + drafts[:i], generator=gen)
        for i in range(len(drafts) + 1)
    ]


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells with expected < 5 are pooled."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_c = np.append(counts[big], counts[~big].sum())
    exp_c = np.append(exp[big], exp[~big].sum())
    if (obs_c[exp_c == 0] > 0).any():
        return 0.0  # an impossible outcome was observed
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    df = len(obs_c) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_greedy_accepts_until_first_mismatch_then_emits_argmax() -> None:
    s = Sampler()
    greedy = SamplingParams(temperature=0.0)
    logits = torch.full((4, V), -1.0)
    for r, t in enumerate([2, 5, 6, 1]):  # argmax per position
        logits[r, t] = 3.0
    assert s.verify(logits, _rows(greedy, [2, 5, 0]), [[2, 5, 0]]).token_ids == [[2, 5, 6]]
    assert s.verify(logits, _rows(greedy, [2, 5, 6]), [[2, 5, 6]]).token_ids == [[2, 5, 6, 1]]
    assert s.verify(logits, _rows(greedy, [7, 5, 6]), [[7, 5, 6]]).token_ids == [[2]]
    # Two requests in one call (spans of 2 and 1 rows) with logprobs per returned token.
    lp = SamplingParams(temperature=0.0, logprobs=1)
    two = torch.cat([logits[:2], logits[2:3]])
    res = s.verify(two, _rows(lp, [2]) + _rows(lp, []), [[2], []])
    assert res.token_ids == [[2, 5], [6]]
    raw = torch.log_softmax(two, -1)
    assert [e.token_ids[0] for e in res.logprobs[0]] == [2, 5]
    assert res.logprobs[0][1].logprobs[0] == pytest.approx(raw[1, 5].item())
    assert res.logprobs[1][0].logprobs[0] == pytest.approx(raw[2, 6].item())


def test_penalties_and_bitmask_apply_per_position() -> None:
    s = Sampler()
    # Same raw logits at every position: 3 > 5 > 4 > rest.
    logits = torch.zeros(3, V)
    logits[:, 3], logits[:, 5], logits[:, 4] = 2.0, 1.9, 1.8
    pres = SamplingParams(temperature=0.0, presence_penalty=0.5)
    # Row 1 sees draft 3 as an output token (penalised to 1.5): argmax becomes 5, and so on.
    assert s.verify(logits, _rows(pres, [3, 5]), [[3, 5]]).token_ids == [[3, 5, 4]]
    # Without the per-position outputs the same drafts would be judged against argmax 3.
    plain = SamplingParams(temperature=0.0)
    assert s.verify(logits, _rows(plain, [3, 5]), [[3, 5]]).token_ids == [[3, 3]]
    # Bitmask row i applies to position i only: row 1 allows only token 6.
    rows = _rows(plain, [3, 6])
    words = np.full((3, 1), -1, dtype=np.int32)
    words[1, 0] = 1 << 6
    for i, r in enumerate(rows):
        r.bitmask = words[i]
    assert s.verify(logits, rows, [[3, 6]]).token_ids == [[3, 6, 3]]


def test_no_drafts_matches_plain_sampling_for_seeded_requests() -> None:
    s = Sampler()
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    seen = set()
    for seed in range(6):
        params = SamplingParams(temperature=1.5, top_k=6, seed=seed)
        g1, g2 = s.make_generator(seed), s.make_generator(seed)
        a = Sampler()(logits, [SamplingRow(params, [1], [], g1)]).token_ids
        b = s.verify(logits, [SamplingRow(params, [1], [], g2)], [[]]).token_ids
        assert b == [a]
        seen.add(a[0])
    assert len(seen) > 1  # really sampled, not argmax


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_is_lossless(with_q: bool) -> None:
    """Drafts of a fixed bad proposal; the FIRST emitted token must follow p exactly, and the
    second (after acceptance) p at the next row. Chi-square over 6000 seeded trials."""
    torch.manual_seed(0)
    p_logits = torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.0, -1.0, 0.5, 0.3]] * 2)
    p_logits[1] = torch.tensor([0.1, 1.2, 0.0, -0.3, 0.6, 0.9, -1.0, 0.2])
    params = SamplingParams(temperature=1.0)
    s = Sampler(seed=1)
    n = 6000
    if with_q:  # drafts sampled from a draft distribution q that over-weights token 5
        qd = torch.softmax(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, -1.0]), -1)
        drafts = np.random.default_rng(0).choice(V, size=n, p=qd.double().numpy() / qd.sum().item())
        drafts = [int(x) for x in drafts]
        q = [qd[None, :]] * n
    else:  # a fixed (one-hot) low-probability draft: many rejections
        drafts, q = [5] * n, None
    logits = p_logits.repeat(n, 1)
    rows = [r for x in drafts for r in _rows(params, [x])]
    res = s.verify(logits, rows, [[x] for x in drafts], draft_probs=q)
    first = np.bincount([t[0] for t in res.token_ids], minlength=V)
    probs = torch.softmax(p_logits, -1).numpy().astype(np.float64)
    assert chi_square_pvalue(first, probs[0]) > 1e-3
    accepted = [t for t, x in zip(res.token_ids, drafts, strict=True) if len(t) == 2]
    assert all(t[0] == x for t, x in zip(res.token_ids, drafts, strict=True) if len(t) == 2)
    assert 0 < len(accepted) < n
    second = np.bincount([t[1] for t in accepted], minlength=V)
    assert chi_square_pvalue(second, probs[1]) > 1e-3
    if with_q:
        return
    draft = 5
    # The check has power: a sampler that resampled from p (not the residual) on rejection
    # would give the draft p(x) + (1 - p(x)) p(x); these counts reject that distribution.
    px = probs[0, draft]
    wrong = (1 - px) * probs[0]
    wrong[draft] += px
    assert chi_square_pvalue(first, wrong) < 1e-4
    assert chi_square_pvalue(first, residual_distribution(probs[0], None, draft)) == 0.0


def test_numpy_reference_is_lossless_and_matches_greedy_rule() -> None:
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    assert verify_reference(p, [0], rng, greedy=True) == [0, 2]
    assert verify_reference(p, [1], rng, greedy=True) == [0]
    firsts = np.bincount([verify_reference(p, [2], rng)[0] for _ in range(4000)], minlength=3)
    assert chi_square_pvalue(firsts, p[0]) > 1e-3
    with pytest.raises(ValueError):
        verify_reference(p, [0, 1], rng)


def peaked_rows(mains: list[int], seconds: list[int], v: int = V) -> torch.Tensor:
    """Logits [R, v]: row r has p(mains[r]) ~ 1 (1 - 2e-9, which is 1.0 in float32), p(seconds[r])
    ~ 2e-9 and the rest ~ 1e-26. A draft equal to the main token is always accepted; any other
    draft is always rejected, and the residual (p without the draft) is then ~ one-hot at the
    main token, or at the second one when the draft was the main token of a DIFFERENT row.
    So a multi-draft verification has exactly one outcome, whatever the random numbers."""
    x = torch.full((len(mains), v), -60.0)
    for r, (m, s) in enumerate(zip(mains, seconds, strict=True)):
        x[r, s] = -20.0
        x[r, m] = 0.0
    return x


# Rows 0..3: main tokens 2, 4, 3, 6; second tokens 7, 6, 0, 1 (so each row's residual differs).
MAINS, SECONDS = [2, 4, 3, 6], [7, 6, 0, 1]
# (drafts, expected tokens): a rejection at draft k must resample from row k's residual.
MULTI_DRAFT_CASES = [
    ([2, 5], [2, 4]),  # 2nd draft rejected: row 1's residual (4), not row 0's (7)
    ([2, 4], [2, 4, 3]),  # both accepted: bonus from row 2
    ([2, 4, 1], [2, 4, 3]),  # 3rd draft rejected: row 2's residual (3)
    ([2, 4, 3], [2, 4, 3, 6]),  # all accepted: bonus from row 3
    ([2, 3, 3], [2, 4]),  # 2nd rejected (3 is row 2's main, not row 1's): stop there
    ([5, 4, 3], [2]),  # 1st rejected
]


@pytest.mark.parametrize("with_q", [False, True])
def test_multi_draft_rejection_resamples_at_the_rejected_row(with_q: bool) -> None:
    """Sampled verification with 2 and 3 drafts has exact outcomes on peaked rows (above); all
    cases in ONE call (spans 3, 3, 4, 4, 4, 4 rows), under several seeds."""
    params = SamplingParams(temperature=1.0)
    logits, rows, drafts, qs = [], [], [], []
    for ds, _ in MULTI_DRAFT_CASES:
        logits.append(peaked_rows(MAINS[: len(ds) + 1], SECONDS[: len(ds) + 1]))
        drafts.append(ds)
        # q: the drafts came from a distribution with mass 0.6 on the draft and 0.4 on token 0;
        # residual max(0, p - q) is then still ~ one-hot at the row's main token (or second).
        q = torch.zeros(len(ds), V)
        for i, t in enumerate(ds):
            q[i, 0] += 0.4
            q[i, t] += 0.6
        qs.append(q)
    for seed in range(5):
        s = Sampler(seed=seed)
        gen = s.make_generator(seed)
        rows = [r for ds in drafts for r in _rows(params, ds, gen=gen)]
        res = s.verify(torch.cat(logits), rows, drafts, draft_probs=qs if with_q else None)
        assert res.token_ids == [want for _, want in MULTI_DRAFT_CASES], f"seed {seed}"
