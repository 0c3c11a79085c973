"""One place for Pallas API names that moved between JAX versions.

Seen here: jax 0.10.2 (CPU, CI) and jax 0.11.2 (the GPU box). Older releases (<= 0.6) spelled
several of these differently (`pltpu.TPUCompilerParams`, `pltpu.TPUMemorySpace.ANY`), so every
name is looked up with a fallback chain instead of being imported directly. Kernel modules import
from here and never touch `jax.experimental.pallas.tpu` names that have moved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3] if x.isdigit())


def _first_attr(*candidates: tuple[Any, str]) -> Any:
    for owner, name in candidates:
        if owner is not None and hasattr(owner, name):
            return getattr(owner, name)
    names = ", ".join(name for _, name in candidates)
    raise ImportError(f"none of [{names}] exists in jax {jax.__version__}")


# Compiler params for Mosaic: `CompilerParams` (>= 0.6), `TPUCompilerParams` before.
_TPUCompilerParams = _first_attr((pltpu, "CompilerParams"), (pltpu, "TPUCompilerParams"))

# Memory space "leave it where it is" (HBM for inputs): `pl.ANY` (new), `pltpu.ANY`,
# `pltpu.TPUMemorySpace.ANY` (old).
ANY_MEMORY_SPACE: Any = _first_attr(
    (pl, "ANY"),
    (pltpu, "ANY"),
    (getattr(pltpu, "TPUMemorySpace", None), "ANY"),
    (getattr(pltpu, "MemorySpace", None), "ANY"),
)

# Scratch allocators: `pltpu.VMEM(shape, dtype)` / `pltpu.SMEM(...)`; old releases only had
# `pltpu.TPUMemorySpace.VMEM`.
VMEM: Any = _first_attr((pltpu, "VMEM"), (getattr(pltpu, "TPUMemorySpace", None), "VMEM"))
SMEM: Any = _first_attr((pltpu, "SMEM"), (getattr(pltpu, "TPUMemorySpace", None), "SMEM"))

PrefetchScalarGridSpec: Any = pltpu.PrefetchScalarGridSpec
make_async_copy = pltpu.make_async_copy


def dma_semaphores(shape: tuple[int, ...]) -> Any:
    """A scratch array of DMA semaphores (`SemaphoreType.DMA(shape)`)."""
    return pltpu.SemaphoreType.DMA(shape)


def compiler_params(dimension_semantics: Sequence[str], vmem_limit_bytes: int | None = None) -> Any:
    """Mosaic compiler params under whichever class name this JAX has."""
    kwargs: dict[str, Any] = {"dimension_semantics": tuple(dimension_semantics)}
    if vmem_limit_bytes is not None:
        kwargs["vmem_limit_bytes"] = vmem_limit_bytes
    return _TPUCompilerParams(**kwargs)


def any_blockspec() -> pl.BlockSpec:
    """A BlockSpec that leaves the operand in HBM (the kernel DMAs from it itself)."""
    return pl.BlockSpec(memory_space=ANY_MEMORY_SPACE)


# --- TPU interpret mode (runs Mosaic kernels on CPU; for tests) ------------------------------

InterpretParams: Any = getattr(pltpu, "InterpretParams", None)


@contextlib.contextmanager
def tpu_interpret_mode(**params: Any) -> Iterator[None]:
    """Run every Pallas TPU kernel traced inside on the CPU TPU interpreter.

    Resets the interpreter's global state if the body raises (otherwise the next kernel sees
    stale simulated buffers/semaphores).
    """
    if InterpretParams is None or not hasattr(pltpu, "force_tpu_interpret_mode"):
        raise RuntimeError(f"jax {jax.__version__} has no TPU interpret mode")
    try:
        with pltpu.force_tpu_interpret_mode(InterpretParams(**params)):
            yield
    except BaseException:
        reset_interpret_state()
        raise


def reset_interpret_state() -> None:
    """`pltpu.reset_tpu_interpret_mode_state()` where it exists (needed after an exception)."""
    reset = getattr(pltpu, "reset_tpu_interpret_mode_state", None)
    if reset is not None:
        reset()


def is_interpret_forced() -> bool:
    """True inside `tpu_interpret_mode()` / `pltpu.force_tpu_interpret_mode()`."""
    try:
        from jax._src import config as _config

        state = getattr(_config, "pallas_tpu_interpret_mode_context_manager", None)
        return state is not None and state.value is not None
    except Exception:  # private API moved: assume not forced
        return False


# --- Pallas GPU (Triton lowering) -------------------------------------------------------------
# `jax.experimental.pallas.triton` (>= 0.4.31; `pallas.gpu` before). Imported lazily: a missing
# module only matters once a GPU kernel is traced.


def _triton_module() -> Any:
    try:
        from jax.experimental.pallas import triton as plgpu
    except ImportError:  # pragma: no cover - very old / future layouts
        try:
            from jax.experimental.pallas import gpu as plgpu  # type: ignore[no-redef]
        except ImportError as e:
            raise ImportError(
                f"jax {jax.__version__} has no Pallas Triton module (jax.experimental.pallas.triton)"
            ) from e
    return plgpu


def gpu_compiler_params(num_warps: int, num_stages: int) -> Any:
    """Triton compiler params: `CompilerParams` (>= 0.6), `TritonCompilerParams` before."""
    plgpu = _triton_module()
    cls = _first_attr((plgpu, "CompilerParams"), (plgpu, "TritonCompilerParams"))
    return cls(num_warps=num_warps, num_stages=num_stages)


def gpu_load(ref: Any, *, mask: Any = None, other: Any = None) -> Any:
    """Masked load from a (possibly `.at[...]`-indexed) ref (`plgpu.load`; it also runs under
    the interpreter). Without a mask it is a plain `ref[...]`."""
    if mask is None:
        return ref[...]
    return _triton_module().load(ref, mask=mask, other=other)


def gpu_store(ref: Any, val: Any, *, mask: Any = None) -> None:
    """Masked store into a (possibly `.at[...]`-indexed) ref (`plgpu.store`)."""
    if mask is None:
        ref[...] = val
        return
    _triton_module().store(ref, val, mask=mask)
