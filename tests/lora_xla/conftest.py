"""Fixtures of the XLA multi-LoRA tests (tiny HF models come from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def tpu_interpret() -> Iterator[None]:
    """Every Pallas TPU kernel traced in the test runs in TPU interpret mode (on CPU)."""
    from xlaserve.kernels_pallas import compat

    try:
        with compat.tpu_interpret_mode():
            yield
    finally:  # a failed kernel leaves simulated buffers/semaphores behind
        compat.reset_interpret_state()


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One persistent compilation cache for the session (kept out of the user's home)."""
    return str(tmp_path_factory.mktemp("jax-cache-lora"))
