"""Build a Flax model from a ModelSpec and fill it with (sharded) weights.

The model is built abstractly (`nnx.eval_shape`: no parameter memory), split into (graphdef,
abstract state), and each parameter is then filled from the checkpoint one tensor at a time:
`jax.device_put(view.astype(dtype), sharding)` straight from the memory-mapped numpy view, so the
checkpoint is never held twice in host memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax import get_model_class

_KV_PROJ = (".self_attn.k_proj.", ".self_attn.v_proj.")


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """ValueError when the model cannot be split over `tp` devices."""
    for what, n in (("num_heads", spec.num_heads), ("intermediate_size", spec.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide {what} ({n})")


def kv_heads_sharded(spec: ModelSpec, mesh: Mesh) -> bool:
    """KV heads (k/v projections and the cache) split over "model" only when they divide evenly;
    otherwise they are replicated (each device keeps every KV head)."""
    return spec.num_kv_heads % mesh.shape["model"] == 0


def param_sharding(name: str, var: nnx.Variable, spec: ModelSpec, mesh: Mesh) -> NamedSharding:
    axis = var.get_metadata().get("tp_axis")
    if (
        axis is None
        or mesh.shape["model"] == 1
        or (any(k in name for k in _KV_PROJ) and not kv_heads_sharded(spec, mesh))
    ):
        return NamedSharding(mesh, P())
    parts = [None] * len(var.get_value().shape)
    parts[axis] = "model"
    return NamedSharding(mesh, P(*parts))


def _dummy_weights(
    flat: dict[str, nnx.Variable], spec: ModelSpec, seed: int
) -> Iterator[tuple[str, np.ndarray]]:
    """Random weights of the right shapes (norm weights 1 - offset, biases 0, matrices N(0, 0.02))."""
    rng = np.random.default_rng(seed)
    for name, var in flat.items():
        shape = var.get_value().shape
        if "norm" in name:
            yield name, np.full(shape, 1.0 - spec.norm_weight_offset, np.float32)
        elif name.endswith(".bias"):
            yield name, np.zeros(shape, np.float32)
        else:
            yield name, rng.normal(0.0, 0.02, shape).astype(np.float32)


def load_model(
    spec: ModelSpec, dtype: jnp.dtype, mesh: Mesh, load_format: str = "auto", seed: int = 0
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of `spec`'s model with every parameter on the mesh.

    Raises ValueError for a checkpoint tensor with no parameter, a shape mismatch or a missing
    parameter (so a wrong weight-name map fails loudly instead of serving zeros).
    """
    check_tensor_parallel(spec, mesh.shape["model"])
    from xlaserve.model_loader.resolve import is_orbax_dir

    if load_format == "orbax" or (
        load_format == "auto" and spec.model_dir and is_orbax_dir(spec.model_dir)
    ):
        # `xlaserve convert --to orbax` output: restored straight into the mesh's shardings.
        from xlaserve.backends_xla.orbax_io import restore_state

        return restore_state(spec, dtype, mesh)
    cls = get_model_class(spec.family)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(spec, dtype)))
    flat = {_name(path): var for path, var in nnx.to_flat_state(abstract)}
    np_dtype = np.dtype(dtype)
    if load_format == "dummy":
        source = _dummy_weights(flat, spec, seed)
    else:
        from xlaserve.model_loader.registry import iter_canonical_weights

        source = iter_canonical_weights(spec, "pt" if load_format == "pt" else "auto")
    loaded: dict[str, jax.Array] = {}
    for name, arr in source:
        var = flat.get(name)
        if var is None:
            raise ValueError(
                f"checkpoint tensor {name!r} {tuple(arr.shape)} has no parameter in {cls.__name__}"
            )
        want = tuple(var.get_value().shape)
        if tuple(arr.shape) != want:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, model expects {want}"
            )
        loaded[name] = jax.device_put(
            arr.astype(np_dtype, copy=False), param_sharding(name, var, spec, mesh)
        )
    missing = sorted(set(flat) - set(loaded))
    if missing:
        raise ValueError(
            f"checkpoint of {spec.architecture} lacks parameters: {', '.join(missing[:10])}"
        )
    state = nnx.from_flat_state(
        [(path, var.replace(loaded[_name(path)])) for path, var in nnx.to_flat_state(abstract)]
    )
    return graphdef, state
