"""pack_bitmask_rows: a step's grammar bitmasks -> the sampler's packed int32 [R, W] rows,
in the batch's row order (issue 30: one concatenate when every row is constrained)."""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve.backends_torch.runner import pack_bitmask_rows

W = 7  # words per row (a 224-token vocabulary)


def _masks(rows: int, seed: int) -> np.ndarray:
    """Distinct random rows: a row written to the wrong place shows."""
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**31), 2**31 - 1, size=(rows, W), dtype=np.int32)


def test_all_constrained_rows_keep_the_batch_order() -> None:
    buf = _masks(5, 0)
    order = [3, 0, 4, 1, 2]  # the manager's buffer order differs from the runner's rows
    masks = [buf[i : i + 1] for i in order]
    out = np.zeros((5, W), np.int32)
    pack_bitmask_rows(out, masks)
    np.testing.assert_array_equal(out, buf[order])


def test_mixed_batch_plain_rows_allow_everything() -> None:
    """Constrained and plain requests in one batch: only the plain rows are all ones; a
    short mask allows everything past its end, a wide one is cut."""
    buf = _masks(3, 1)
    wide = np.concatenate([buf[2:3], np.zeros((1, 3), np.int32)], axis=1)  # [1, W + 3]
    masks = [None, buf[0:1], None, buf[1:2, :4], wide]
    out = np.zeros((5, W), np.int32)  # zeros: anything not written would forbid every token
    pack_bitmask_rows(out, masks)
    want = np.full((5, W), -1, np.int32)
    want[1] = buf[0]
    want[3, :4] = buf[1, :4]
    want[4] = buf[2]
    np.testing.assert_array_equal(out, want)


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 masks for 3 rows"):
        pack_bitmask_rows(np.zeros((3, W), np.int32), [None, None])
