"""The verification contract every backend implements (torch: `backends_torch/sampler.py`
`Sampler.verify`; XLA later), with a numpy reference used by tests.

Inputs for one request with d drafts (d >= 0):
- target logits at the last 1 + d scheduled positions [1 + d, V]; row i predicts the token after
  `tokens + drafts[:i]`. Each row is processed exactly like normal sampling (SamplingParams order:
  logit_bias, min_tokens, grammar bitmask row i, penalties over `output + drafts[:i]`, then
  temperature / top-k / top-p / min-p) into a distribution p_i (greedy: argmax of the processed
  logits).
- drafts x_0..x_{d-1} and, optionally, the draft distributions q_i [d, V]; None means the drafts
  were chosen deterministically (n-gram lookup, greedy draft model): q_i is one-hot at x_i.

Output: the accepted drafts followed by exactly one more token (1..d+1 tokens):
- greedy: accept x_i while x_i == argmax p_i; then emit argmax p_k (the correction, or the bonus
  token when all d were accepted). Identical to non-speculative greedy decoding.
- sampled (Leviathan et al. 2023): accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the
  first rejection sample from norm(max(0, p_i - q_i)) and stop; if all were accepted, sample a bonus
  token from p_d. Every emitted token is distributed exactly as under p (lossless).
Random numbers come from the request's generator (seeded requests are reproducible).
Logprobs of each emitted token come from log_softmax of the RAW logits at its position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def residual_distribution(p: np.ndarray, q: np.ndarray | None, draft: int) -> np.ndarray:
    """norm(max(0, p - q)) [V]; q None = one-hot at `draft` (so p with the draft's mass removed)."""
    r = p.astype(np.float64).copy()
    if q is None:
        r[draft] = 0.0
    else:
        r = np.maximum(r - q, 0.0)
    total = r.sum()
    if total <= 0.0:  # p == q: a rejection cannot happen; fall back to p
        return p / p.sum()
    return r / total


def verify_reference(
    target_probs: np.ndarray,
    drafts: Sequence[int],
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,
    greedy: bool = False,
) -> list[int]:
    """Plain-numpy rejection sampler. target_probs [1 + d, V] (processed distributions),
    drafts [d], draft_probs [d, V] or None (one-hot drafts). Returns 1..d+1 tokens."""
    d = len(drafts)
    if target_probs.shape[0] != d + 1:
        raise ValueError(f"need {d + 1} target rows for {d} drafts, got {target_probs.shape[0]}")
    out: list[int] = []
    for i, x in enumerate(drafts):
        p = target_probs[i]
        if greedy:
            best = int(np.argmax(p))
            if best != x:
                return out + [best]
            out.append(int(x))
            continue
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if rng.random() * q_x < p[x]:  # u < p(x) / q(x)
            out.append(int(x))
            continue
        r = residual_distribution(p, None if draft_probs is None else draft_probs[i], int(x))
        return out + [int(rng.choice(r.shape[0], p=r))]
    last = target_probs[d]
    if greedy:
        return out + [int(np.argmax(last))]
    return out + [int(rng.choice(last.shape[0], p=last / last.sum()))]
