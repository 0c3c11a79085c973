"""Prompt-lookup (n-gram) proposer: backend-neutral, numpy only.

For n from `max_n` down to `min_n`, find the LAST earlier occurrence of the sequence's final n
tokens and propose the (up to) k tokens that followed it. Repetitive text (code edits, quoting
the prompt, lists) gets long accepted runs for free: no draft model, no device work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Drafts for the continuation of `tokens` [L]: up to k ids ([] when no n-gram matches).

    The match must end before the final position (an earlier occurrence), so the proposal
    always has at least one token when a match exists.
    """
    if k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = arr[length - n :]
        # Windows starting at 0 .. L-n-1 (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer:
    """Engine-side proposer: `propose(token_ids, k)` with the config's lookup window."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max ({max_n})"
            )
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(K, max_drafts) drafts following `token_ids` (prompt + output so far)."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        return ngram_propose(token_ids, k, self.min_n, self.max_n)
