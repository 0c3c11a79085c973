"""`xlaserve convert MODEL OUT --to orbax`: load a model onto a mesh like the XLA backend does
and save its parameter tree as an orbax model directory (format, save and restore:
models_flax/orbax_io.py, re-exported here)."""

from __future__ import annotations

from typing import Any

import jax

from xlaserve.model_loader.resolve import is_orbax_dir
from xlaserve.models_flax.orbax_io import (
    FORMAT,
    FORMAT_VERSION,
    MARKER_FILE,
    PARAMS_DIR,
    SPEC_FILE,
    read_marker,
    restore_state,
    save_state,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER_FILE",
    "PARAMS_DIR",
    "SPEC_FILE",
    "convert_to_orbax",
    "read_marker",
    "restore_state",
    "save_state",
]


def convert_to_orbax(
    model: str | None,
    out_dir: str,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    load_format: str = "auto",
) -> dict[str, Any]:
    """Load `model` (HF safetensors directory, hub id or None = the demo model) onto a mesh of
    `tensor_parallel_size` devices, like the XLA backend does, and save it as an orbax model
    directory. Returns the marker dict."""
    from xlaserve.backends_xla.utils import make_mesh, resolve_dtype
    from xlaserve.model_loader.registry import build_spec
    from xlaserve.model_loader.resolve import resolve_model_dir
    from xlaserve.models_flax.loader import load_model

    src_dir = resolve_model_dir(model)
    if is_orbax_dir(src_dir):
        raise ValueError(f"{src_dir} is already an orbax model directory")
    from xlaserve.quantization.scheme import read_quantization_config

    qc = read_quantization_config(src_dir)
    if qc is not None:
        # The orbax tree holds float parameters only (restore casts every array to one dtype).
        raise ValueError(
            f"{src_dir} is a pre-quantized checkpoint ({qc.get('quant_method', '?')}): "
            "`xlaserve convert --to orbax` writes float models only; serve the HF directory "
            "directly (the XLA backend loads it quantized)"
        )
    spec = build_spec(src_dir)
    jdtype = resolve_dtype(dtype, spec.checkpoint_dtype, jax.default_backend())
    mesh = make_mesh(tensor_parallel_size)
    _, state = load_model(spec, jdtype, mesh, load_format)
    return save_state(state, spec, out_dir, jdtype, src_dir, tensor_parallel_size)
