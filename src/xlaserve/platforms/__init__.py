"""What machine this is and which backend it defaults to.

Code asks `current_platform` (e.g. `current_platform.is_cuda()`) instead of probing hardware.
Detection imports nothing heavy: it looks for torch/jax lazily and only when asked.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu" | "cuda" | "rocm" | "tpu"
    default_backend: str  # "torch" | "xla"
    device_name: str = "cpu"
    # Memory of one accelerator (GPU: device 0), GiB; 0 when unknown (CPU, TPU, forced).
    device_memory_gib: float = 0.0

    def is_cpu(self) -> bool:
        return self.name == "cpu"

    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def is_rocm(self) -> bool:
        return self.name == "rocm"

    def is_tpu(self) -> bool:
        return self.name == "tpu"

    def is_gpu(self) -> bool:
        return self.name in ("cuda", "rocm")

    def torch_device(self) -> str:
        return "cuda" if self.is_gpu() else "cpu"


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@functools.lru_cache(maxsize=1)
def detect_platform() -> Platform:
    """Order: XLASERVE_PLATFORM override, TPU (libtpu present), CUDA/ROCm via torch, else CPU."""
    forced = os.environ.get("XLASERVE_PLATFORM")
    if forced:
        if forced not in ("cpu", "cuda", "rocm", "tpu"):
            raise ValueError(f"XLASERVE_PLATFORM must be cpu|cuda|rocm|tpu, got {forced!r}")
        return Platform(forced, "xla" if forced == "tpu" else "torch", forced)
    if _has("libtpu") or os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"):
        return Platform("tpu", "xla", "tpu")
    # /proc/driver/nvidia exists on NVIDIA hosts without importing torch.
    if os.path.exists("/proc/driver/nvidia/version") and _has("torch"):
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return Platform(
                "rocm" if torch.version.hip else "cuda", "torch", props.name,
                props.total_memory / 2**30,
            )  # fmt: skip
    return Platform("cpu", "torch", "cpu")


class _CurrentPlatform:
    """Lazy proxy so `from xlaserve.platforms import current_platform` costs nothing."""

    def __getattr__(self, item: str):  # noqa: ANN204
        return getattr(detect_platform(), item)

    def __repr__(self) -> str:
        return repr(detect_platform())


current_platform = _CurrentPlatform()
