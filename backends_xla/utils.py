"""Small helpers of the XLA runner: buckets, dtypes, the device mesh, the compilation cache."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def make_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` up to `largest` (which is always the last bucket)."""
    out, b = [], max(1, min(smallest, largest))
    while b < largest:
        out.append(b)
        b *= 2
    return out + [largest]


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


def setup_compilation_cache(path: str | None) -> str:
    """Turn on JAX's persistent compilation cache (every program, however small or fast)."""
    path = os.path.expanduser(path or os.path.join("~", ".cache", "xlaserve", "jax"))
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
