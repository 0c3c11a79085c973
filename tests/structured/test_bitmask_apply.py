"""The torch sampler's vectorised bitmask application against a plain per-token reference:
random packed masks (bit 31 set too), a vocab that is not a multiple of 32, masked and
unmasked rows in one batch."""

from __future__ import annotations

import numpy as np
import torch

from xlaserve.backends_torch.sampler import (
    SamplingRow,
    apply_constraints,
    forbidden_from_bytes,
    forbidden_tokens,
)
from xlaserve.sampling_params import SamplingParams

V = 2051  # W = 65 words, the last one partly past the vocab


def _reference_allowed(words: np.ndarray) -> np.ndarray:
    """int32 [W] -> bool [V] by the definition: bit i of word w allows token 32 w + i."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    return np.array([(u[t // 32] >> (t % 32)) & 1 for t in range(V)], dtype=bool)


def test_forbidden_tokens_matches_definition() -> None:
    rng = np.random.default_rng(0)
    packed = rng.integers(-(2**31), 2**31, (3, (V + 31) // 32)).astype("<i4")
    packed[1] = -1  # everything allowed
    got = forbidden_tokens(packed, V, torch.device("cpu"))
    assert got.shape == (3, V) and got.dtype == torch.bool
    for b in range(3):
        assert (got[b].numpy() == ~_reference_allowed(packed[b])).all(), b
    assert not got[1].any()


def test_apply_constraints_masks_only_constrained_rows() -> None:
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.standard_normal((5, V)).astype(np.float32))
    masks = {i: rng.integers(-(2**31), 2**31, (V + 31) // 32).astype(np.int32) for i in (0, 3, 4)}
    rows = [SamplingRow(SamplingParams(), [1], [2], bitmask=masks.get(i)) for i in range(5)]
    got = apply_constraints(logits.clone(), rows)
    for i in range(5):
        want = logits[i].numpy().copy()
        if i in masks:
            want[~_reference_allowed(masks[i])] = -np.inf
        assert (got[i].numpy() == want).all(), i


def test_forbidden_from_bytes_matches_definition() -> None:
    """The device unpack of the late-mask path (uint8 bytes of the packed words)."""
    rng = np.random.default_rng(2)
    packed = rng.integers(-(2**31), 2**31, (3, (V + 31) // 32)).astype("<i4")
    packed[2] = -1
    got = forbidden_from_bytes(torch.from_numpy(packed.view(np.uint8).copy()), V)
    assert got.shape == (3, V) and got.dtype == torch.bool
    for b in range(3):
        assert (got[b].numpy() == ~_reference_allowed(packed[b])).all(), b
    assert not got[2].any()
