"""Build a Flax model from a ModelSpec and fill it with (sharded) weights.

The model is built abstractly (`nnx.eval_shape`: no parameter memory), split into (graphdef,
abstract state), and each parameter is then filled from the checkpoint one tensor at a time:
`jax.device_put(view.astype(dtype), sharding)` straight from the memory-mapped numpy view, so the
checkpoint is never held twice in host memory.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.config import KernelConfig, kernel_switch
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax import get_model_class
from xlaserve.models_flax.layers import fp8_supported, quantize_linears, set_decode_gemv
from xlaserve.models_flax.moe import FusedMoE, check_expert_parallel, enable_expert_parallel
from xlaserve.quantization import QuantScheme, quantize_weight, resolve_scheme
from xlaserve.quantization.scheme import check_fp8_support

logger = logging.getLogger(__name__)

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


def param_sharding(
    name: str, var: nnx.Variable, spec: ModelSpec, mesh: Mesh, expert_parallel: bool = False
) -> NamedSharding:
    """A parameter's sharding: its `tp_axis` split over "model" (KV projections only when the KV
    heads divide); stacked experts (`ep_axis`) split on E only under `expert_parallel`."""
    ep_axis = var.get_metadata().get("ep_axis")
    axis = ep_axis if expert_parallel and ep_axis is not None else var.get_metadata().get("tp_axis")
    if (
        axis is None
        or mesh.shape["model"] == 1
        or (any(k in name for k in _KV_PROJ) and not kv_heads_sharded(spec, mesh))
    ):
        return NamedSharding(mesh, P())
    shape = var.get_value().shape
    if shape[axis] % mesh.shape["model"]:  # e.g. int4 groups fewer than devices: replicate
        return NamedSharding(mesh, P())
    parts = [None] * len(shape)
    parts[axis] = "model"
    return NamedSharding(mesh, P(*parts))


def _dummy_weights(
    flat: dict[str, nnx.Variable],
    spec: ModelSpec,
    seed: int,
    quant: QuantScheme | None = None,
    qlayers: dict[str, tuple[int, int]] | None = None,
) -> Iterator[tuple[str, np.ndarray | _DeviceNormal]]:
    """Random weights of the right shapes (norm weights 1 - offset, biases 0, matrices N(0, 0.02));
    quantized layers get a random float [N, K] weight quantized like a checkpoint's."""
    rng = np.random.default_rng(seed)
    qlayers = qlayers or {}
    for name, var in flat.items():
        shape = var.get_value().shape
        prefix, _, part = name.rpartition(".")
        if prefix in qlayers and part != "bias":
            if part == "qweight":
                w = rng.normal(0.0, 0.02, qlayers[prefix]).astype(np.float32)
                yield from _quantize_pairs(prefix, w, quant)
                if prefix + ".perm" in flat:
                    yield prefix + ".perm", np.arange(qlayers[prefix][1], dtype=np.int32)
            continue
        if "norm" in name:
            yield name, np.full(shape, 1.0 - spec.norm_weight_offset, np.float32)
        elif name.endswith(".bias"):
            yield name, np.zeros(shape, np.float32)
        else:  # drawn on the device: host numpy draws kept an 8B start-up past 150 s
            yield name, _DeviceNormal(shape, int(rng.integers(0, 2**31 - 1)))


@dataclass(frozen=True)
class _DeviceNormal:
    """A dummy weight N(0, 0.02) of `shape`, drawn by jax.random on the devices of its sharding
    (no host array, no host-to-device copy)."""

    shape: tuple[int, ...]
    seed: int

    def materialize(self, dtype: np.dtype, sharding: NamedSharding) -> jax.Array:
        return _normal_fn(self.shape, np.dtype(dtype), sharding)(jax.random.key(self.seed))


@functools.cache
def _normal_fn(
    shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding
) -> Callable[[jax.Array], jax.Array]:
    """One compiled sampler per (shape, dtype, sharding): a model has a handful of shapes."""

    def draw(key: jax.Array) -> jax.Array:
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)


def xla_quant_scheme(
    requested: str | None, spec: ModelSpec, kernels: KernelConfig | None = None
) -> QuantScheme | None:
    """The scheme the XLA backend serves `spec` with: the checkpoint's own (GPTQ / AWQ /
    compressed-tensors, detected from config.json), else `requested` ("int8" | "int4" | "fp8")
    applied at load time, else None. fp8 needs a GPU with fp8 matmuls (compute capability >= 8.9):
    elsewhere runtime fp8 raises (unless KernelConfig.fp8_emulation, tests) and an fp8 checkpoint
    is emulated with a warning, as on the torch backend."""
    scheme = resolve_scheme(requested, spec.model_dir)
    where = f"this platform: {jax.default_backend()}"
    emulate = None if kernels is None else kernels.fp8_emulation
    return check_fp8_support(scheme, fp8_supported, where, emulate)


def _quantize_pairs(
    prefix: str, w: np.ndarray, scheme: QuantScheme
) -> list[tuple[str, np.ndarray]]:
    """Float W [N, K] of layer `prefix` -> its canonical quantized tensors (numpy_quant)."""
    return [
        (f"{prefix}.{k}", v)
        for k, v in quantize_weight(scheme.method, w, scheme.group_size).items()
    ]


def quantized_weight_stream(
    pairs: Iterable[tuple[str, np.ndarray]],
    scheme: QuantScheme,
    qlayers: dict[str, tuple[int, int]],
) -> Iterator[tuple[str, np.ndarray]]:
    """Canonical checkpoint pairs -> the pairs a model with `qlayers` quantized expects: the float
    weight of each such layer is quantized here, one tensor at a time (straight from the mmap'd
    view: no second float copy of the checkpoint). Pre-quantized checkpoints arrive already in
    the canonical layout (`iter_canonical_weights`), so a float weight there is an error."""
    for name, arr in pairs:
        prefix, _, part = name.rpartition(".")
        if prefix not in qlayers or part != "weight":
            yield name, arr
            continue
        if scheme.prequantized:
            raise ValueError(
                f"{prefix}: float weight in a {scheme.source} checkpoint where a quantized "
                "layer was expected (is it listed in the checkpoint's ignore list?)"
            )
        yield from _quantize_pairs(prefix, arr, scheme)


def load_model(
    spec: ModelSpec,
    dtype: jnp.dtype,
    mesh: Mesh,
    load_format: str = "auto",
    seed: int = 0,
    quant: QuantScheme | None = None,
    expert_parallel: bool = False,
    kernels: KernelConfig | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of `spec`'s model with every parameter on the mesh.

    `expert_parallel`: MoE experts split on E over "model" (models_flax/moe.py); ValueError when
    the mesh size does not divide num_experts.

    `kernels`: the MoE layers' grouped matmul (KernelConfig.gmm_impl; None = default + env) and
    the float linears' decode GEMV (KernelConfig.xla_decode_gemv, resolved for this platform and
    the mesh's tensor parallelism by `kernels_pallas.gemv.resolve_decode_gemv`).

    `quant` (see `xla_quant_scheme`): its eligible linears are `QuantLinear`s, filled from a
    pre-quantized checkpoint or quantized here from the float one. Raises ValueError for a
    checkpoint tensor with no parameter, a shape mismatch or a missing parameter (so a wrong
    weight-name map fails loudly instead of serving zeros).
    """
    check_tensor_parallel(spec, mesh.shape["model"])
    from xlaserve.kernels_pallas.gemv import resolve_decode_gemv

    gemv_policy = resolve_decode_gemv(
        kernel_switch("xla_decode_gemv", kernels), jax.default_backend(), mesh.shape["model"]
    )
    if gemv_policy != "off":
        logger.info("decode GEMV (Pallas) for the float linears: policy %r", gemv_policy)
    if expert_parallel:
        check_expert_parallel(spec, mesh.shape["model"])
    from xlaserve.model_loader.resolve import is_orbax_dir

    if load_format == "orbax" or (
        load_format == "auto" and spec.model_dir and is_orbax_dir(spec.model_dir)
    ):
        if quant is not None:
            raise ValueError(
                f"quantization {quant.method!r} cannot be applied to an orbax checkpoint (it "
                "holds float parameters only): serve the HF safetensors directory instead"
            )
        if expert_parallel and spec.num_experts and mesh.shape["model"] > 1:
            raise ValueError(
                "enable_expert_parallel is not supported with an orbax checkpoint yet: serve "
                "the HF safetensors directory instead"
            )
        # `xlaserve convert --to orbax` output: restored straight into the mesh's shardings.
        from xlaserve.models_flax.orbax_io import restore_state

        graphdef, state = restore_state(spec, dtype, mesh)
        if gemv_policy == "off":
            return graphdef, state
        model = nnx.merge(graphdef, state)  # references the restored arrays, copies nothing
        set_decode_gemv(model, gemv_policy)
        return nnx.split(model)
    cls = get_model_class(spec.family)
    qlayers: dict[str, tuple[int, int]] = {}
    # Pallas calls are not partitioned by GSPMD: under tensor parallelism the XLA path runs.
    impl = "auto" if mesh.shape["model"] == 1 else "xla"

    def build() -> nnx.Module:
        model = cls(spec, dtype)
        gmm_impl = kernel_switch("gmm_impl", kernels)
        for _, m in nnx.iter_graph(model):
            if isinstance(m, FusedMoE):
                m.impl = gmm_impl
        if expert_parallel:
            enable_expert_parallel(model, mesh)
        set_decode_gemv(model, gemv_policy)  # before quantization: QuantLinears replace some
        if quant is not None:
            qlayers.update(quantize_linears(model, quant, impl))
        return model

    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    flat = {_name(path): var for path, var in nnx.to_flat_state(abstract)}
    if load_format == "dummy":
        source = _dummy_weights(flat, spec, seed, quant, qlayers)
    else:
        from xlaserve.model_loader.registry import iter_canonical_weights

        source = iter_canonical_weights(spec, "pt" if load_format == "pt" else "auto")
        if quant is not None:
            source = quantized_weight_stream(source, quant, qlayers)
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
        # Each parameter's own dtype: the model dtype, or a quantized layer's int / f32 / fp8.
        dt = np.dtype(var.get_value().dtype)
        sharding = param_sharding(name, var, spec, mesh, expert_parallel)
        if isinstance(arr, _DeviceNormal):
            loaded[name] = arr.materialize(dt, sharding)
        else:
            loaded[name] = jax.device_put(arr.astype(dt, copy=False), sharding)
    missing = sorted(set(flat) - set(loaded))
    if missing:
        raise ValueError(
            f"checkpoint of {spec.architecture} lacks parameters: {', '.join(missing[:10])}"
        )
    state = nnx.from_flat_state(
        [(path, var.replace(loaded[_name(path)])) for path, var in nnx.to_flat_state(abstract)]
    )
    return graphdef, state
