"""Fixtures of the architecture-coverage tests: one tiny checkpoint per architecture per session."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from arch_zoo import make_arch_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def arch_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """name (an arch_zoo.ARCHS key) -> directory of its saved tiny checkpoint."""
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = make_arch_model(name, str(tmp_path_factory.mktemp(f"arch-{name}")))
        return cache[name]

    return get
