"""Kernel tests run the Triton kernels in the CPU interpreter when no CUDA GPU is present.

``TRITON_INTERPRET=1`` must be in the environment before the kernel modules are imported (Triton
decides at ``@triton.jit`` decoration time), so it is set here at conftest import time, before any
test module of this folder imports ``xlaserve.kernels_cuda.*``.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# (atol, rtol) per dtype for outputs compared in fp32 against the fp32-math torch references.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


# Triton's CPU interpreter truncates fp32 -> bf16 casts (measured: -2.2794 -> -2.2656, where
# round-to-nearest, as on GPU, gives -2.2812), so bf16 results that are bit-exact on GPU may be
# one bf16 ulp off under the interpreter.
BF16_CAST_TRUNCATES = not ON_GPU


def assert_equal_or_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact, except bf16 under the interpreter: within one bf16 ulp (2^-7 relative)."""
    if BF16_CAST_TRUNCATES and expected.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), atol=0.0, rtol=2.0**-7)
    else:
        assert torch.equal(actual, expected)


@pytest.fixture
def equal_or_ulp():
    return assert_equal_or_ulp


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def tolerances() -> dict[torch.dtype, tuple[float, float]]:
    return TOLERANCES
