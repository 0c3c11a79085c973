"""Fixtures of the XLA backend tests (tiny HF models come from tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One persistent compilation cache for the session (kept out of the user's home)."""
    return str(tmp_path_factory.mktemp("jax-cache"))
