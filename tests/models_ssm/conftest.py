"""Fixtures of the state-space model tests: one tiny checkpoint per architecture per session."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from ssm_zoo import make_ssm_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ssm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """name (an ssm_zoo.SSM_ARCHS key) -> directory of its saved tiny checkpoint."""
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = make_ssm_model(name, str(tmp_path_factory.mktemp(f"ssm-{name}")))
        return cache[name]

    return get
