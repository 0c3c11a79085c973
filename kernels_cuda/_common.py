"""Shared helpers for the Triton kernels: launch checks and interpret-mode detection.

Imported only by the kernel modules (which import torch and triton), never by the lazy package
``__init__``.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError unless all tensors share one device that can run the Triton kernels.

    CUDA tensors run compiled kernels; CPU tensors run only under ``TRITON_INTERPRET=1``.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}"
        )
    dev = next(iter(devices))
    if dev.type == "cpu" and not interpret_mode():
        raise ValueError(
            f"{name}: CPU tensors need TRITON_INTERPRET=1 (set before triton is imported); "
            "use the *_ref torch reference on CPU otherwise"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: unsupported device {dev}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype {t.dtype} not in {allowed}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 first.

    Triton's CPU interpreter computes bf16 ``tl.dot`` wrongly (numpy has no bf16; measured here:
    garbage of order 1e10 on triton 3.9), while bf16 loads, stores and casts are right. So under
    the interpreter bf16 tiles are upcast before the dot; on GPU they stay bf16 (tensor cores).
    """
    return interpret_mode() and dtype == torch.bfloat16
