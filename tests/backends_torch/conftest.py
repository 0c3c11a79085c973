"""Fixtures of the Torch backend tests: tiny random HF checkpoints saved with save_pretrained."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from torch_hf_models import make_hf_model  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """name -> directory of a saved tiny checkpoint (built once per session)."""
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            d = str(tmp_path_factory.mktemp(name))
            dtype = torch.bfloat16 if name.endswith("_bf16") else torch.float32
            model = make_hf_model(name.removesuffix("_bf16"), dtype)
            model.save_pretrained(d, safe_serialization=True)
            assert os.path.exists(os.path.join(d, "model.safetensors"))
            cache[name] = d
        return cache[name]

    return get
