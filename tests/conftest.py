"""Shared fixtures: tiny random models in HF layout (built once per session)."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in the interpreter; the flag must be set before any
# kernels_cuda module is imported, whichever test folder imports it first.
if not os.path.exists("/proc/driver/nvidia/version"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests run with --import-mode=importlib (same-named test files in different folders are fine);
# shared helper modules (uniquely named) are importable from every test folder.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _d in [_HERE] + sorted(os.path.join(_HERE, d) for d in os.listdir(_HERE)):
    if os.path.isdir(_d) and not _d.endswith("__pycache__") and _d not in sys.path:
        sys.path.insert(0, _d)

from tiny_models import make_tiny_model  # noqa: E402


def _has_cuda() -> bool:
    from optional_deps import is_installed

    if not is_installed("torch"):
        return False
    import torch  # installed but broken: fail loudly rather than skip every GPU test

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU/TPU tests skip cleanly (with the reason) on machines without the accelerator."""
    gpu = _has_cuda()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (none on this machine)"))
        if "tpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a TPU (none on this machine)"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """tiny_model_dir(kind) -> path of a tiny random model ('llama', 'mistral', 'qwen2', 'qwen3', 'llama3')."""
    cache: dict[str, str] = {}

    def get(kind: str = "llama") -> str:
        if kind not in cache:
            cache[kind] = make_tiny_model(kind, str(tmp_path_factory.mktemp(f"tiny-{kind}")))
        return cache[kind]

    return get
