"""Fixtures for the Pallas kernel tests (TPU kernels run on the CPU TPU interpreter)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for _rpa_testlib


@pytest.fixture
def tpu_interpret() -> Iterator[None]:
    """Every Pallas TPU kernel traced in the test runs in TPU interpret mode (on CPU)."""
    from xlaserve.kernels_pallas import compat

    try:
        with compat.tpu_interpret_mode():
            yield
    finally:  # a failed kernel leaves simulated buffers/semaphores behind
        compat.reset_interpret_state()
