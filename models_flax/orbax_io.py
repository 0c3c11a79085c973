"""Orbax checkpoints of the Flax parameter tree (`xlaserve convert MODEL OUT --to orbax`, whose
conversion is backends_xla/orbax_io.py: it loads onto a mesh).

Layout of an orbax model directory:

    OUT/
      xlaserve_orbax.json   marker (`model_loader.resolve.is_orbax_dir` checks it): format version,
                            dtype, family, parameter names -> [shape, dtype], tools' versions
      xlaserve_spec.json    dataclasses.asdict(ModelSpec) at conversion time (for reference)
      config.json           the HF config (its dtype set to the saved dtype), so `build_spec(OUT)`
                            builds the same spec the safetensors directory does
      tokenizer*.json, generation_config.json, chat template, ...   copied unchanged
      params/               the orbax checkpoint (OCDBT + tensorstore): the nnx state of the flax
                            model as a nested dict of arrays, keys = the state's path parts

Restoring builds abstract arrays (`jax.ShapeDtypeStruct` with the mesh's `NamedSharding` of each
parameter) and hands them to orbax, so each device reads only its own shard from disk and no host
copy of the full tree is made. The stored tree does not depend on the mesh it was saved from: a
checkpoint converted with tensor_parallel_size 1 restores onto 8 devices and the other way round.

Only the stable `ocp.Checkpointer(ocp.StandardCheckpointHandler())` + `ocp.args.StandardSave` /
`ocp.args.StandardRestore` API is used (the same on the CPU image's orbax and the GPU image's).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from xlaserve.model_loader.resolve import is_orbax_dir
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax import get_model_class
from xlaserve.models_flax.loader import param_sharding

logger = logging.getLogger(__name__)

MARKER_FILE = "xlaserve_orbax.json"
SPEC_FILE = "xlaserve_spec.json"
PARAMS_DIR = "params"
FORMAT = "xlaserve-orbax"
FORMAT_VERSION = 1
# Files of the source directory that are weights (not copied) rather than metadata (copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _key(part: Any) -> str:
    return str(part.key if hasattr(part, "key") else part)


def _name(path: tuple) -> str:
    return ".".join(_key(p) for p in path)


def _nest(pairs: list[tuple[tuple, Any]]) -> dict[str, Any]:
    """[(path, leaf)] -> nested dict with string keys (orbax-friendly: no ints, no custom nodes)."""
    out: dict[str, Any] = {}
    for path, leaf in pairs:
        d = out
        for p in path[:-1]:
            d = d.setdefault(_key(p), {})
        d[_key(path[-1])] = leaf
    return out


def _lookup(tree: dict[str, Any], path: tuple) -> Any:
    for p in path:
        tree = tree[_key(p)]
    return tree


def read_marker(model_dir: str) -> dict[str, Any]:
    """The marker of an orbax model directory; ValueError for an unknown format or version."""
    path = os.path.join(model_dir, MARKER_FILE)
    with open(path) as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT or marker.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {marker.get('format')!r} version {marker.get('version')!r} is not "
            f"{FORMAT!r} version {FORMAT_VERSION}; re-run `xlaserve convert`"
        )
    return marker


def _copy_metadata(src_dir: str, out_dir: str, dtype: jnp.dtype) -> list[str]:
    """Copy config/tokenizer/generation files (not weights); config.json's dtype -> `dtype`."""
    copied = []
    for fname in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, fname)
        if not os.path.isfile(src) or fname in _WEIGHT_INDEXES or fname == MARKER_FILE:
            continue
        if fname.endswith(_WEIGHT_SUFFIXES):
            continue
        if fname == "config.json":
            with open(src) as f:
                cfg = json.load(f)
            # "auto" dtype of the orbax dir = the dtype its arrays were saved in.
            for k in ("torch_dtype", "dtype"):
                cfg[k] = np.dtype(dtype).name
            with open(os.path.join(out_dir, fname), "w") as f:
                json.dump(cfg, f, indent=2)
        else:
            shutil.copy2(src, os.path.join(out_dir, fname))
        copied.append(fname)
    if "config.json" not in copied:
        raise FileNotFoundError(f"{src_dir}: config.json not found")
    return copied


def save_state(
    state: nnx.State,
    spec: ModelSpec,
    out_dir: str,
    dtype: jnp.dtype,
    src_dir: str,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """Write `state` (the flax model's nnx state, arrays on any mesh) as an orbax model directory.

    `out_dir` must not exist or be empty. Returns the marker dict written beside the checkpoint.
    """
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    os.makedirs(out_dir, exist_ok=True)
    pairs = [(path, var.get_value()) for path, var in nnx.to_flat_state(state)]
    tree = _nest(pairs)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        ckptr.save(os.path.join(out_dir, PARAMS_DIR), args=ocp.args.StandardSave(tree))
    copied = _copy_metadata(src_dir, out_dir, dtype)
    spec_dict = dataclasses.asdict(spec)
    spec_dict["model_dir"] = None  # the source path means nothing once copied elsewhere
    with open(os.path.join(out_dir, SPEC_FILE), "w") as f:
        json.dump(spec_dict, f, indent=2, default=str)
    marker = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "params_dir": PARAMS_DIR,
        "dtype": np.dtype(dtype).name,
        "architecture": spec.architecture,
        "family": spec.family,
        "source": os.path.abspath(src_dir),
        "converted_with_tensor_parallel_size": tensor_parallel_size,
        "num_parameters": int(sum(int(np.prod(a.shape)) for _, a in pairs)),
        "parameters": {_name(p): [list(a.shape), np.dtype(a.dtype).name] for p, a in pairs},
        "copied_files": copied,
        "versions": _versions(),
    }
    # Written last: a directory carries the marker only once everything else is in place.
    with open(os.path.join(out_dir, MARKER_FILE), "w") as f:
        json.dump(marker, f, indent=2)
    return marker


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("xlaserve", "jax", "flax", "orbax-checkpoint"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def restore_state(
    spec: ModelSpec, dtype: jnp.dtype, mesh: Mesh, model_dir: str | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of `spec`'s model restored from an orbax model directory.

    Each array lands directly in its mesh sharding (`param_sharding`, the same rule the
    safetensors loader uses); arrays saved in another dtype are cast to `dtype` by orbax.
    ValueError when the checkpoint's parameter names or shapes differ from the model's.
    """
    import orbax.checkpoint as ocp

    model_dir = os.path.abspath(model_dir or spec.model_dir or "")
    if not is_orbax_dir(model_dir):
        raise ValueError(f"{model_dir} is not an orbax model directory (no {MARKER_FILE})")
    marker = read_marker(model_dir)
    cls = get_model_class(spec.family)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(spec, dtype)))
    flat = list(nnx.to_flat_state(abstract))
    stored = marker["parameters"]
    want = {_name(p): list(v.get_value().shape) for p, v in flat}
    missing = sorted(set(want) - set(stored))
    extra = sorted(set(stored) - set(want))
    if missing or extra:
        raise ValueError(
            f"{model_dir}: checkpoint parameters do not match {cls.__name__} "
            f"(missing: {', '.join(missing[:8]) or '-'}; unexpected: {', '.join(extra[:8]) or '-'}); "
            "re-run `xlaserve convert` with this version of xlaserve"
        )
    for n, shape in want.items():
        if stored[n][0] != shape:
            raise ValueError(
                f"{model_dir}: {n!r} is stored as {stored[n][0]}, model expects {shape}"
            )
    target = _nest(
        [
            (
                path,
                jax.ShapeDtypeStruct(
                    var.get_value().shape,
                    dtype,
                    sharding=param_sharding(_name(path), var, spec, mesh),
                ),
            )
            for path, var in flat
        ]
    )
    t0 = time.perf_counter()
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        restored = ckptr.restore(
            os.path.join(model_dir, marker.get("params_dir", PARAMS_DIR)),
            args=ocp.args.StandardRestore(target),
        )
    logger.info(
        "restored %d arrays from %s in %.2fs", len(flat), model_dir, time.perf_counter() - t0
    )
    state = nnx.from_flat_state([(p, v.replace(_lookup(restored, p))) for p, v in flat])
    return graphdef, state
