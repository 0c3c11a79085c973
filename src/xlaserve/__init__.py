"""xlaserve: LLM inference and serving, JAX/XLA-first with PyTorch/Triton backends.

Importing xlaserve imports neither torch nor jax; backends load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xlaserve.outputs import CompletionOutput, Logprob, RequestOutput
from xlaserve.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from xlaserve.engine.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutputKind",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":  # lazy: keeps `import xlaserve` light
        from xlaserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'xlaserve' has no attribute {name!r}")
