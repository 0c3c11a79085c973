"""Dataset generators and arrival schedules."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from xlaserve.bench.datasets import (
    WORDS,
    BenchTokenizer,
    get_samples,
    sample_file,
    sample_prefix_repetition,
    sample_random,
    sample_sharegpt,
)
from xlaserve.bench.metrics import request_intervals


@pytest.fixture(scope="module")
def tok(bench_tokenizer_dir) -> BenchTokenizer:
    return BenchTokenizer(str(bench_tokenizer_dir))


def test_random_with_tokenizer_lengths_and_seed(tok: BenchTokenizer) -> None:
    reqs = sample_random(20, input_len=40, output_len=12, tokenizer=tok, range_ratio=0.25, seed=3)
    assert len(reqs) == 20
    for r in reqs:
        # The reported length is the true token count of the text.
        assert r.prompt_len == tok.count(r.prompt)
        # Decode/re-encode may shift a token or two, never far from the drawn length range.
        assert 30 - 2 <= r.prompt_len <= 50 + 2
        assert 9 <= r.expected_output_len <= 15
    lens = {r.prompt_len for r in reqs}
    assert len(lens) > 3, "range_ratio must spread the lengths"
    again = sample_random(20, 40, 12, tok, 0.25, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = sample_random(20, 40, 12, tok, 0.25, seed=4)
    assert [r.prompt for r in other] != [r.prompt for r in reqs]


def test_random_fixed_length_is_exact_mostly(tok: BenchTokenizer) -> None:
    reqs = sample_random(30, input_len=32, output_len=8, tokenizer=tok, seed=0)
    exact = sum(r.prompt_len == 32 for r in reqs)
    assert exact >= 25, [r.prompt_len for r in reqs]
    assert all(r.expected_output_len == 8 for r in reqs)
    # No special token text leaks into prompts.
    assert not any("<s>" in r.prompt or "</s>" in r.prompt for r in reqs)


def test_random_without_tokenizer_uses_words() -> None:
    reqs = sample_random(5, input_len=10, output_len=4, tokenizer=None, prefix_len=3, seed=1)
    words = set(WORDS)
    first = reqs[0].prompt.split()
    for r in reqs:
        toks = r.prompt.split()
        assert len(toks) == 13 and r.prompt_len == 13
        assert set(toks) <= words
        assert toks[:3] == first[:3], "the random prefix is shared"


def test_prefix_repetition(tok: BenchTokenizer) -> None:
    reqs = sample_prefix_repetition(
        num_prompts=12,
        prefix_len=20,
        suffix_len=6,
        output_len=5,
        num_prefixes=3,
        tokenizer=tok,
        seed=0,
    )
    assert len(reqs) == 12
    ids = [tok.encode(r.prompt) for r in reqs]
    heads = {tuple(i[:15]) for i in ids}
    assert len(heads) == 3, "exactly num_prefixes distinct shared prefixes"
    for h in heads:
        assert sum(tuple(i[:15]) == h for i in ids) == 4
    assert len({r.prompt for r in reqs}) == 12, "suffixes differ"
    for r in reqs:
        assert r.prompt_len == tok.count(r.prompt)
        assert 20 + 6 - 3 <= r.prompt_len <= 20 + 6 + 3
        assert r.expected_output_len == 5
    again = sample_prefix_repetition(12, 20, 6, 5, 3, tok, seed=0)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_sharegpt(tmp_path, tok: BenchTokenizer) -> None:
    data = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": f"question number {i} about the river and the stone"},
                {"from": "gpt", "value": " ".join(["answer"] * (5 + i))},
            ],
        }
        for i in range(10)
    ]
    data.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sample_sharegpt(str(path), 6, tokenizer=tok, seed=0)
    assert len(reqs) == 6
    by_prompt = {d["conversations"][0]["value"]: d["conversations"][1]["value"] for d in data[:10]}
    for r in reqs:
        assert r.prompt in by_prompt
        assert r.expected_output_len == tok.count(by_prompt[r.prompt])
        assert r.prompt_len == tok.count(r.prompt)
    assert [r.prompt for r in sample_sharegpt(str(path), 6, tok, seed=0)] == [
        r.prompt for r in reqs
    ]
    fixed = sample_sharegpt(str(path), 3, None, output_len=7, seed=0)
    assert all(r.expected_output_len == 7 and r.prompt_len is None for r in fixed)
    with pytest.raises(ValueError, match="only 10 usable"):
        sample_sharegpt(str(path), 50, tok)


def test_file_dataset(tmp_path, tok: BenchTokenizer) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "the river", "output_len": 3}\n\n{"prompt": "a stone"}\n')
    reqs = sample_file(str(path), 5, tok, output_len=None)
    assert [r.prompt for r in reqs] == ["the river", "a stone"] * 2 + ["the river"]
    assert [r.expected_output_len for r in reqs] == [3, None, 3, None, 3]
    assert reqs[0].prompt_len == tok.count("the river")
    assert all(r.expected_output_len == 9 for r in sample_file(str(path), 2, None, output_len=9))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        sample_file(str(bad), 1)
    with pytest.raises(ValueError, match="dataset-path"):
        get_samples("file", 1, None)


def test_poisson_intervals_mean() -> None:
    gaps = np.array(request_intervals(4000, request_rate=5.0, burstiness=1.0, seed=0))
    assert abs(gaps.mean() - 0.2) < 0.2 * 0.05
    # exponential: std == mean
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.06
    assert request_intervals(50, 5.0, 1.0, seed=0) == request_intervals(50, 5.0, 1.0, seed=0)
    assert request_intervals(50, 5.0, 1.0, seed=0) != request_intervals(50, 5.0, 1.0, seed=1)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_intervals_mean_and_spread(burstiness: float) -> None:
    gaps = np.array(request_intervals(8000, request_rate=10.0, burstiness=burstiness, seed=1))
    assert abs(gaps.mean() - 0.1) < 0.1 * 0.06
    # gamma with shape k: coefficient of variation 1/sqrt(k)
    assert abs(gaps.std() / gaps.mean() - 1 / math.sqrt(burstiness)) < 0.1 / math.sqrt(burstiness)


def test_infinite_rate_and_bad_values() -> None:
    assert request_intervals(4, math.inf) == [0.0] * 4
    with pytest.raises(ValueError):
        request_intervals(4, 0.0)
    with pytest.raises(ValueError):
        request_intervals(4, 1.0, burstiness=0.0)
