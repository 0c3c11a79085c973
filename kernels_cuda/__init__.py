"""Triton kernels for the Torch GPU path, each with a plain torch reference beside it.

Lazy: importing this package imports neither torch nor triton; the kernel functions load on first
attribute access (``from xlaserve.kernels_cuda import unified_attention``). Triton kernels run on
CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before the kernel modules were
imported (tests use that, on small shapes).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    "unified_attention": "paged_attention",
    "unified_attention_ref": "paged_attention",
    "write_kv": "kv_write",
    "write_kv_ref": "kv_write",
    "rms_norm": "norm",
    "rms_norm_ref": "norm",
    "fused_add_rms_norm": "norm",
    "fused_add_rms_norm_ref": "norm",
    "rotary_embedding": "rotary",
    "rotary_embedding_ref": "rotary",
    "compute_cos_sin_cache": "rotary",
    "rotary_embedding_write_kv": "rotary",
    "rotary_embedding_write_kv_ref": "rotary",
    "silu_and_mul": "activation",
    "silu_and_mul_ref": "activation",
    "gelu_tanh_and_mul": "activation",
    "gelu_tanh_and_mul_ref": "activation",
    "gelu_and_mul": "activation",
    "gelu_and_mul_ref": "activation",
    "fused_experts": "fused_moe",
    "moe_align": "fused_moe",
    "greedy_argmax": "sampling",
    "greedy_argmax_packed": "sampling",
    "greedy_argmax_ref": "sampling",
    # State-space decode steps (issue 25).
    "conv_state_update": "ssm",
    "conv_state_update_ref": "ssm",
    "ssm_state_update": "ssm",
    "ssm_state_update_ref": "ssm",
    # State-space prefill (issue 25).
    "causal_conv1d_prefill": "ssm_prefill",
    "causal_conv1d_prefill_ref": "ssm_prefill",
    "ssd_chunked_prefill": "ssm_prefill",
    "ssd_chunked_prefill_ref": "ssm_prefill",
}

__all__ = ["triton_available", *_EXPORTS]


def triton_available() -> bool:
    """True when the Triton kernels can run here: triton imports and either a CUDA GPU is
    present or ``TRITON_INTERPRET=1`` (CPU interpreter) is set."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
