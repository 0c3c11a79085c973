"""Sampler semantics on hand-made logits (jitted exactly as the runner jits it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.backends_xla.sampler import (
    SamplingTensors,
    apply_penalties,
    host_tensors,
    mask_stop_ids,
    needs_extras,
    neutral_extras,
    sample,
    sample_mode,
    sampling_host,
    unpack_bitmask,
)
from xlaserve.sampling_params import SamplingParams

V = 50


def _unregister(listener) -> None:  # noqa: ANN001
    from jax._src import monitoring  # the public module has no unregister in every version

    monitoring.unregister_event_duration_listener(listener)


_jitted = jax.jit(sample)  # one program per shape, whatever features a step uses


def _sample(logits: np.ndarray, t: SamplingTensors, with_logprobs: bool):  # noqa: ANN202
    return _jitted(
        logits, SamplingTensors(**{**vars(t), "want_logprobs": jnp.asarray(with_logprobs)})
    )


def _tensors(b: int, **kw) -> SamplingTensors:
    """Temperature 1 and distinct seeds by default; any dense field given turns the extras on."""
    base = host_tensors(b, V)
    base.update(temperature=np.ones(b, np.float32), seeds=np.arange(b, dtype=np.uint32))
    dense = {"bias", "bitmask", "output_counts", "prompt_mask"}
    base["use_extras"] = np.asarray(bool(dense & set(kw)))
    base.update(kw)
    return SamplingTensors(**{k: jnp.asarray(v) for k, v in base.items()})


def _logits(b: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (b, V)).astype(np.float32)


def test_top_k_1_equals_greedy() -> None:
    logits = _logits(16)
    greedy = _sample(
        logits, _tensors(16, temperature=np.zeros(16, np.float32)), with_logprobs=False
    )
    topk1 = _sample(logits, _tensors(16, top_k=np.ones(16, np.int32)), with_logprobs=False)
    np.testing.assert_array_equal(greedy.token_ids, logits.argmax(-1))
    np.testing.assert_array_equal(topk1.token_ids, logits.argmax(-1))


def test_logit_bias_forces_token() -> None:
    logits = _logits(8)
    bias = np.zeros((8, V), np.float32)
    bias[:, 7] = 100.0
    extras = dict(bitmask=np.full((8, 2), -1, np.int32), output_counts=np.zeros((8, V), np.int32),
                  prompt_mask=np.zeros((8, V), bool))  # fmt: skip
    for temp in (0.0, 1.0):
        out = _sample(
            logits,
            _tensors(8, temperature=np.full(8, temp, np.float32), bias=bias, **extras),
            with_logprobs=True,
        )
        assert (np.asarray(out.token_ids) == 7).all()
        # Logprobs stay those of the raw distribution (the bias is not in them).
        raw = jax.nn.log_softmax(logits, -1)
        np.testing.assert_allclose(out.logprobs[:, 0], raw[:, 7], rtol=1e-5, atol=1e-5)


def test_penalties_formula() -> None:
    rng = np.random.default_rng(3)
    logits = _logits(4, 3)
    counts = rng.integers(0, 3, (4, V)).astype(np.int32)
    pmask = rng.random((4, V)) < 0.3
    rep, freq, pres = (
        np.array([1.0, 1.5, 0.7, 2.0], np.float32),
        np.array([0, 0.5, -0.3, 1], np.float32),
        np.array([0.2, 0, 1, -1], np.float32),
    )
    t = _tensors(
        4,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
        output_counts=counts,
        prompt_mask=pmask,
    )
    got = np.asarray(apply_penalties(jnp.asarray(logits), t))
    seen = (counts > 0) | pmask
    want = np.where(
        seen, np.where(logits > 0, logits / rep[:, None], logits * rep[:, None]), logits
    )
    want = want - freq[:, None] * counts - pres[:, None] * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_seeded_reproducible_and_distribution() -> None:
    logits = np.tile(np.log(np.array([0.5, 0.3, 0.2] + [1e-9] * (V - 3), np.float32)), (1, 1))
    n = 2000
    many = np.repeat(logits, n, 0)
    t = _tensors(n, seeds=np.full(n, 42, np.uint32), steps=np.arange(n, dtype=np.int32))
    a = np.asarray(_sample(many, t, with_logprobs=False).token_ids)
    b = np.asarray(_sample(many, t, with_logprobs=False).token_ids)
    np.testing.assert_array_equal(a, b)  # same seed + step -> same token
    freq = np.bincount(a, minlength=V)[:3] / n
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.04)
    other = np.asarray(
        _sample(
            many,
            _tensors(n, seeds=np.full(n, 7, np.uint32), steps=np.arange(n, dtype=np.int32)),
            with_logprobs=False,
        ).token_ids
    )
    assert (other != a).mean() > 0.3  # another seed gives another stream
    # top_p 0.6 keeps {0, 1}; min_p 0.5 keeps p >= 0.25: {0, 1}; top_k 1 keeps {0}.
    tp = np.asarray(
        _sample(
            many,
            _tensors(n, top_p=np.full(n, 0.6, np.float32), steps=np.arange(n, dtype=np.int32)),
            with_logprobs=False,
        ).token_ids
    )
    assert set(tp.tolist()) == {0, 1}
    mp = np.asarray(
        _sample(
            many,
            _tensors(n, min_p=np.full(n, 0.5, np.float32), steps=np.arange(n, dtype=np.int32)),
            with_logprobs=False,
        ).token_ids
    )
    assert set(mp.tolist()) == {0, 1}


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_bitmask(temp: float) -> None:
    rng = np.random.default_rng(5)
    allowed = rng.random((8, V)) < 0.2
    allowed[:, 3] = True
    words = np.zeros((8, 2), np.uint32)
    for tok in range(V):
        words[:, tok // 32] |= allowed[:, tok].astype(np.uint32) << np.uint32(tok % 32)
    words = words.view(np.int32)
    np.testing.assert_array_equal(np.asarray(unpack_bitmask(jnp.asarray(words), V)), allowed)
    extras = dict(
        bias=np.zeros((8, V), np.float32),
        output_counts=np.zeros((8, V), np.int32),
        prompt_mask=np.zeros((8, V), bool),
    )
    for step in range(5):
        t = _tensors(
            8,
            temperature=np.full(8, temp, np.float32),
            bitmask=words,
            steps=np.full(8, step, np.int32),
            **extras,
        )
        tok = np.asarray(_sample(_logits(8, step), t, with_logprobs=False).token_ids)
        assert allowed[np.arange(8), tok].all()


def test_logprobs_and_rank() -> None:
    logits = _logits(6)
    out = _sample(logits, _tensors(6), with_logprobs=True)
    lp = np.asarray(jax.nn.log_softmax(logits, -1))
    tok = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs[:, 0], lp[np.arange(6), tok], atol=1e-5)
    np.testing.assert_array_equal(out.logprob_ids[:, 1], lp.argmax(-1))
    ranks = 1 + (lp > lp[np.arange(6), tok][:, None]).sum(-1)
    np.testing.assert_array_equal(out.ranks, ranks)
    assert not np.asarray(out.has_nan).any()
    bad = logits.copy()
    bad[2, 4] = np.nan
    assert np.asarray(_sample(bad, _tensors(6), with_logprobs=False).has_nan).tolist() == [
        False,
        False,
        True,
        False,
        False,
        False,
    ]


def test_one_program_serves_every_feature() -> None:
    """Greedy, random, extras and logprobs steps of one bucket share one compiled program, and
    the runtime switches (all-greedy skip, use_extras off) do not change the results."""
    lowerings: list[str] = []

    def listener(event: str, duration: float, **kw: object) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowerings.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    fn = jax.jit(lambda lg, t: sample(lg, t))  # a fresh function: nothing cached yet
    logits = _logits(6, 9)
    bias = np.zeros((6, V), np.float32)
    bias[:, 11] = 100.0
    temps = np.array([0, 1, 0, 1, 0, 0.5], np.float32)
    greedy = fn(logits, _tensors(6, temperature=np.zeros(6, np.float32)))
    mixed = fn(logits, _tensors(6, temperature=temps, want_logprobs=np.asarray(True)))
    # use_extras off: the dense arrays are ignored even when they hold a bias.
    ignored = fn(logits, _tensors(6, temperature=np.zeros(6, np.float32), bias=bias,
                                  use_extras=np.asarray(False)))  # fmt: skip
    forced = fn(logits, _tensors(6, temperature=temps, bias=bias))
    _unregister(listener)
    assert len(lowerings) == 1  # one program for all four feature sets
    np.testing.assert_array_equal(greedy.token_ids, logits.argmax(-1))
    np.testing.assert_array_equal(ignored.token_ids, logits.argmax(-1))
    g = temps == 0
    np.testing.assert_array_equal(np.asarray(mixed.token_ids)[g], logits.argmax(-1)[g])
    assert (np.asarray(forced.token_ids) == 11).all()
    assert not np.asarray(greedy.logprobs).any()  # logprobs not asked: zeros, not computed
    lp = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(mixed.logprobs[:, 0], lp[np.arange(6), mixed.token_ids], atol=1e-5)


def _mode_case(params: list[SamplingParams | None], with_logprobs: bool, seed: int):  # noqa: ANN202
    """Rows (None = padding) -> (host tensors as the runner builds them, the host-decided mode)."""
    from xlaserve.backends_xla.runner import _ReqState  # the runner's per-request state

    rows = [
        None
        if p is None
        else _ReqState([1, 2, 3, 4], 2, p, [0], 4, seed=1000 + i)  # two output tokens so far
        for i, p in enumerate(params)
    ]
    for r in rows:
        if r is not None:
            if r.params.needs_penalties:
                r.output_counts = np.bincount([3, 4], minlength=V).astype(np.int32)
                r.prompt_mask = np.isin(np.arange(V), [1, 2])
    extras = any(needs_extras(r, f"r{i}", {}) for i, r in enumerate(rows))
    ids = [f"r{i}" for i in range(len(rows))]
    h = sampling_host(rows, ids, len(rows), V, True, with_logprobs, {})
    h = {**neutral_extras(len(rows), V), **h}  # dense fields no row uses: neutral
    h["use_extras"] = np.asarray(extras)
    return h, sample_mode(rows, extras, with_logprobs, V)


_CASES = {
    "greedy": ([SamplingParams(temperature=0.0)] * 3 + [None], False),
    "random": ([SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), None], False),
    "top_p": ([SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=0.5)], False),
    "top_k_min_p": ([SamplingParams(temperature=1.0, top_k=5), SamplingParams(min_p=0.1)], False),
    "greedy_row_filters": ([SamplingParams(temperature=0.0, top_p=0.5)] * 2, False),
    "extras": ([SamplingParams(temperature=0.0, logit_bias={7: 50.0}), None], False),
    "penalties_random": ([SamplingParams(temperature=1.0, repetition_penalty=1.3)] * 2, False),
    "logprobs": ([SamplingParams(temperature=0.9, top_p=0.9, logprobs=3)] * 2, True),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_host_decided_specialization_equals_the_general_program(case: str) -> None:
    """The runner serves a step with the SampleMode specialization (no runtime conditional) once
    compiled, else with the general program: both must give the same tokens and logprobs."""
    params, with_lp = _CASES[case]
    h, mode = _mode_case(params, with_lp, 0)
    t = SamplingTensors(**{k: jnp.asarray(v) for k, v in h.items()})
    logits = _logits(len(params), seed=3)
    logits[-1, 11] = np.nan if case == "greedy" else logits[-1, 11]  # has_nan travels too
    general = jax.device_get(_jitted(logits, t))
    special = jax.device_get(jax.jit(sample, static_argnums=2)(logits, t, mode))
    for name in ("token_ids", "logprobs", "logprob_ids", "ranks", "has_nan"):
        np.testing.assert_array_equal(getattr(special, name), getattr(general, name), name)
    # The host decided what the device would have: e.g. no random path for all-greedy rows.
    want_random = any(p is not None and p.temperature > 0 for p in params)
    assert mode.random == want_random and mode.logprobs == with_lp
    assert mode.extras == (case in ("extras", "penalties_random"))
    assert mode.filter == (case in ("top_p", "top_k_min_p", "logprobs"))


def test_packed_stop_ids_mask_until_min_tokens() -> None:
    """mask_stop_ids (in every sampler program): a row's stop ids are -inf while steps <
    min_tokens, untouched after; unused slots (-1) mask nothing (not the last token either)."""
    from xlaserve.backends_xla.sampler import STOP_SLOTS

    logits = _logits(3, seed=4)
    stops = np.full((3, STOP_SLOTS), -1, np.int32)
    stops[0, :2] = [int(logits[0].argmax()), V - 1]
    stops[1, 0] = int(logits[1].argmax())
    t = _tensors(
        3, temperature=np.zeros(3, np.float32), min_tokens=np.array([4, 4, 0], np.int32),
        steps=np.array([3, 4, 0], np.int32), stop_ids=stops,
    )  # fmt: skip
    masked = np.asarray(mask_stop_ids(jnp.asarray(logits), t))
    want = logits.copy()
    want[0, stops[0, :2]] = -np.inf  # steps 3 < 4: masked
    np.testing.assert_array_equal(masked, want)  # row 1 (steps 4 = min_tokens), row 2 untouched
    tokens = np.asarray(_sample(logits, t, with_logprobs=False).token_ids)
    assert tokens[0] != logits[0].argmax() and tokens[1] == logits[1].argmax()


def test_step_summary_equals_the_per_row_predicates() -> None:
    """The runner's one-pass step summary (cached `row_flags`) decides exactly what
    `needs_extras`, the logprobs test and `sample_mode` decide row by row, over random mixes
    (padding rows, grammar bitmasks, min_tokens with packed and dense stop ids, progress)."""
    import random

    from xlaserve.backends_xla.runner import _ReqState
    from xlaserve.backends_xla.sampler import STOP_SLOTS, packed_stops, row_flags, step_summary

    rng = random.Random(0)
    many_stops = list(range(10, 11 + STOP_SLOTS))  # more than the packed slots: dense
    choices = [
        dict(temperature=0.0),
        dict(temperature=0.7),
        dict(temperature=0.7, top_k=5),
        dict(temperature=0.0, top_p=0.5),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.0, logit_bias={3: 1.0}),
        dict(temperature=0.0, presence_penalty=0.5),
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.0, min_tokens=3),
        dict(temperature=0.0, min_tokens=3, stop_token_ids=many_stops),
        dict(temperature=0.0, min_tokens=3, ignore_eos=True),
        dict(temperature=0.0, allowed_token_ids=[1, 2, 3]),
    ]
    seen = set()
    for _ in range(400):
        rows, ids = [], []
        for i in range(rng.randrange(1, 6)):
            ids.append(f"r{i}")
            if rng.random() < 0.2:
                rows.append(None)
                continue
            p = SamplingParams(**rng.choice(choices))
            p.eos_token_ids = [2]
            out = rng.randrange(0, 6)
            r = _ReqState([1] * (4 + out), 4, p, [0], 4 + out, seed=1)
            r.packed_stops = packed_stops(p)
            r.flags = row_flags(p, V)
            rows.append(r)
        bitmasks = {rng.choice(ids): None} if rng.random() < 0.2 else {}
        extras = any(needs_extras(r, rid, bitmasks) for r, rid in zip(rows, ids, strict=True))
        with_lp = any(r is not None and r.params.logprobs is not None for r in rows)
        mode = sample_mode(rows, extras, with_lp, V)
        got = step_summary(rows, ids, bitmasks)
        assert got == (extras, with_lp, mode.random, mode.filter), [r and r.params for r in rows]
        seen.add(got)
    assert len(seen) >= 10  # the mixes really cover the combinations
