"""Prompt-lookup proposer: exact proposals worked by hand."""

from __future__ import annotations

import pytest

from xlaserve.config import SpeculativeConfig
from xlaserve.spec_decode import NgramProposer, check_speculative_config, ngram_propose


def test_longest_ngram_wins_and_last_occurrence_is_used() -> None:
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    # Suffix 2,3 (n=2) occurs at 1 and 5; the last one (5) is followed by 7, 8, 4.
    assert ngram_propose(toks, 3, 1, 4) == [7, 8, 4]
    # With n up to 3 the suffix 4,2,3 never occurred before: falls back to n=2.
    assert ngram_propose(toks, 2, 2, 3) == [7, 8]
    # A 3-gram match is preferred over a later 1-gram match.
    toks2 = [5, 6, 7, 1, 2, 7, 0, 5, 6, 7]
    assert ngram_propose(toks2, 2, 1, 3) == [1, 2]
    assert ngram_propose(toks2, 2, 1, 1) == [0, 5]  # last 7 before the end is at index 5


def test_no_match_short_tail_and_limits() -> None:
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_propose([4], 3, 1, 3) == []
    assert ngram_propose([1, 2, 1], 5, 1, 2) == [2, 1]  # only 2 tokens follow the match
    assert ngram_propose([1, 2, 1], 0, 1, 2) == []
    # min_n excludes 1-gram matches.
    assert ngram_propose([3, 1, 2, 4, 2], 3, 2, 3) == []
    p = NgramProposer(4, 1, 3)
    assert p.propose([9, 8, 7, 6, 9, 8], max_drafts=2) == [7, 6]
    assert p.propose([9, 8, 7, 6, 9, 8]) == [7, 6, 9, 8]
    with pytest.raises(ValueError):
        NgramProposer(3, 3, 2)


def test_periodic_sequence_proposes_the_period() -> None:
    toks = [4, 5, 6] * 5
    assert ngram_propose(toks, 5, 1, 4) == [4, 5, 6]  # the last earlier match ends 3 back


def test_unsupported_methods_fail_at_config_time() -> None:
    check_speculative_config(None, "xla")
    check_speculative_config(SpeculativeConfig(method="ngram"), "torch")
    check_speculative_config(SpeculativeConfig(method="eagle", model="/x"), "torch")
    with pytest.raises(NotImplementedError, match="eagle"):
        check_speculative_config(SpeculativeConfig(method="eagle", model="/x"), "xla")
    check_speculative_config(SpeculativeConfig(method="draft_model", model="/x"), "xla")
