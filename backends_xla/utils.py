"""Small helpers of the XLA runner: buckets, dtypes, the device mesh, the compilation cache."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from xlaserve.config import KernelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def make_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` up to `largest` (which is always the last bucket)."""
    out, b = [], max(1, min(smallest, largest))
    while b < largest:
        out.append(b)
        b *= 2
    return out + [largest]


def _one_then_from_16(largest: int) -> list[int]:
    """1, then the powers of two from 16 up to `largest` (batch 1 keeps a bucket of its own)."""
    return [1, *[b for b in make_buckets(16, largest) if b > 1]]


def dispatch_thread_on(mode: str, platform: str) -> bool:
    """KernelConfig.xla_dispatch_thread -> whether the runner calls async steps' programs from a
    thread of its own: "on" / "off", or "auto" = everywhere but the CPU (`platform` is
    jax.default_backend())."""
    return mode == "on" or (mode == "auto" and platform != "cpu")


class SwitchIntervalHolds:
    """The interpreter's GIL switch interval is process-wide, but each runner with a dispatch
    thread asks for a shorter one while it lives. Holds are counted: the interval is the
    smallest one held (never raised above the interpreter's own), and the interpreter's own
    comes back only when the last holder lets go (two runners in one process: the first
    shutdown must not undo the second's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, float] = {}  # id(owner) -> the interval it asked for (s)
        self._original: float | None = None

    def hold(self, owner: object, interval_s: float) -> None:
        """owner asks for interval_s (ignored unless 0 < interval_s < the current interval)."""
        with self._lock:
            base = self._original if self._held else sys.getswitchinterval()
            if base is None or not 0 < interval_s < base:
                return
            self._original = base
            self._held[id(owner)] = interval_s
            sys.setswitchinterval(min(self._held.values()))

    def release(self, owner: object) -> None:
        """owner's hold ends (a no-op when it holds none)."""
        with self._lock:
            if self._held.pop(id(owner), None) is None:
                return
            if self._held:
                sys.setswitchinterval(min(self._held.values()))
            else:
                sys.setswitchinterval(self._original)
                self._original = None


SWITCH_INTERVAL = SwitchIntervalHolds()


def token_buckets(min_bucket: int, largest: int, platform: str) -> list[int]:
    """The forward's token buckets: powers of two from `min_bucket` to `largest`; min_bucket 0
    (KernelConfig.xla_min_token_bucket auto) = 1 then the powers from 16 on the CPU, from 16
    elsewhere."""
    if min_bucket:
        return make_buckets(min_bucket, largest)
    return _one_then_from_16(largest) if platform == "cpu" else make_buckets(16, largest)


def seq_buckets(min_bucket: int, largest: int, platform: str) -> list[int]:
    """The sampler's request buckets: powers of two from `min_bucket` to `largest`; min_bucket 0
    (KernelConfig.xla_min_seq_bucket auto) = every power from 1 on the CPU, 1 then the powers
    from 16 elsewhere."""
    if min_bucket or platform == "cpu":
        return make_buckets(min_bucket or 1, largest)
    return _one_then_from_16(largest)


def pick_bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest compiled bucket {buckets[-1]}")


def resolve_dtype(name: str, checkpoint_dtype: str, platform: str) -> jnp.dtype:
    """Model dtype: "auto" = the checkpoint's; float16 becomes float32 on CPU (XLA:CPU fp16 is
    slow and inexact)."""
    if name == "auto":
        name = checkpoint_dtype.removeprefix("torch.")
        if name not in _DTYPES:
            name = "float32"
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    if name == "float16" and platform == "cpu":
        name = "float32"
    return jnp.dtype(_DTYPES[name])


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A 1-D mesh with axis "model" over the first `tensor_parallel_size` devices."""
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} exceeds the {len(devices)} visible "
            f"{jax.default_backend()} device(s)"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), ("model",))


def compilation_cache_path(path: str | None) -> str:
    """EngineConfig.compilation_cache_dir, or its default ~/.cache/xlaserve/jax, expanded."""
    return os.path.expanduser(path or os.path.join("~", ".cache", "xlaserve", "jax"))


def setup_compilation_cache(path: str | None) -> str:
    """Turn on JAX's persistent compilation cache (every program, however small or fast)."""
    path = compilation_cache_path(path)
    os.makedirs(path, exist_ok=True)
    current = jax.config.jax_compilation_cache_dir
    if current and current != path:
        # JAX initializes its cache once per process; keep the first directory.
        logger.info("JAX compilation cache already at %s; not switching to %s", current, path)
        return current
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


# XLA_FLAGS defaults on CUDA (KernelConfig.xla_command_buffer / xla_triton_gemm "auto"), from
# the H200 step profile (bench/RESULTS.md, "XLA backend step profile"): None = XLA's default.
XLA_GPU_COMMAND_BUFFER: str | None = None
XLA_GPU_TRITON_GEMM: bool | None = None


def _cuda_plugin() -> bool:
    """A JAX CUDA plugin is installed (found without starting a backend)."""
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return True
    return any("cuda" in ep.name for ep in importlib.metadata.entry_points(group="jax_plugins"))


def xla_gpu_flags(kernels: KernelConfig) -> list[str]:
    """The XLA_FLAGS KernelConfig asks for on CUDA (empty elsewhere or when nothing is asked)."""
    flags = []
    cb = (
        XLA_GPU_COMMAND_BUFFER
        if kernels.xla_command_buffer == "auto"
        else kernels.xla_command_buffer
    )
    if cb is not None and cb != "off":
        # One-kernel sequences too: a decode step's graphs are cut by every non-graphable thunk.
        flags += [f"--xla_gpu_enable_command_buffer={cb}", "--xla_gpu_graph_min_graph_size=1"]
    gemm = {"auto": XLA_GPU_TRITON_GEMM, "on": True, "off": False}[kernels.xla_triton_gemm]
    if gemm is not None:
        flags.append(f"--xla_gpu_enable_triton_gemm={str(gemm).lower()}")
    if kernels.xla_gpu_autotune_level >= 0:
        flags.append(f"--xla_gpu_autotune_level={kernels.xla_gpu_autotune_level}")
    return flags


def apply_xla_gpu_flags(kernels: KernelConfig) -> list[str]:
    """Add `xla_gpu_flags` to XLA_FLAGS before JAX starts its backends (a flag the user set
    wins); returns the flags added. A no-op without a CUDA plugin or once a backend started
    (logged: the process keeps the flags it started with)."""
    from jax._src import xla_bridge

    wanted = xla_gpu_flags(kernels)
    if not wanted or not _cuda_plugin():
        return []
    if xla_bridge.backends_are_initialized():
        logger.info("JAX backends already started; XLA flags %s not applied", wanted)
        return []
    current = os.environ.get("XLA_FLAGS", "")
    added = [f for f in wanted if f.split("=")[0] not in current]
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    if added:
        logger.info("XLA_FLAGS += %s", " ".join(added))
    return added
