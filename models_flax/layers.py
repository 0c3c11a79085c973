"""Flax NNX layers shared by the model families.

Linear weights keep the checkpoint's torch layout [out, in], so canonical weight names map onto
parameter paths one to one and loading needs no transpose. A parameter's `tp_axis` metadata says
which axis tensor parallelism splits ("col" linears: the output axis 0; "row" linears: the input
axis 1); the loader turns it into a NamedSharding. Parameters are created as zeros: models are
built under `nnx.eval_shape` and filled by the loader, so no initializer ever runs.

Axis letters: T tokens, H hidden, I intermediate, V vocab, Hq/Hkv heads, D head_dim, R rotary dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.quantization.scheme import QuantScheme

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # Nemotron, Arcee
}


def _param(shape: tuple[int, ...], dtype: jnp.dtype, tp_axis: int | None = None) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), tp_axis=tp_axis)


@functools.partial(jax.jit, static_argnums=0)
def _apply_block(graphdef: nnx.GraphDef, state: nnx.State, *args: Any) -> Any:  # noqa: ANN401
    return nnx.merge(graphdef, state)(*args)


def call_block(block: nnx.Module, *args: Any) -> Any:  # noqa: ANN401
    """block(*args) as a nested jit keyed by the block's graph (its structure and static
    attributes): inside a program's trace, blocks of one graph and the same argument shapes are
    traced once and lowered to one MLIR function that every call site calls (XLA inlines the
    calls when it compiles, so the program is the same). The 32 identical decoder layers of an
    8B model were traced and lowered 32 times per program: most of a cold start-up. The block
    must not mutate its own variables (a nested jit returns only what the call returns)."""
    graphdef, state = nnx.split(block)
    return _apply_block(graphdef, state, *args)


def clear_block_traces() -> None:
    """Forget every `call_block` trace. They are shared by all models of the process, keyed by
    what a block's trace depends on (its graph, the argument shapes and static fields); a test
    that patches a module function a block calls while tracing clears them before and after."""
    _apply_block.clear_cache()


class Embed(nnx.Module):
    """Token embedding weight [V, H]; `attend` is the tied LM head."""

    def __init__(self, vocab: int, hidden: int, dtype: jnp.dtype) -> None:
        self.weight = _param((vocab, hidden), dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:  # ids [T] -> [T, H]
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, V]
        return jnp.einsum("th,vh->tv", x, self.weight[...])


class Linear(nnx.Module):
    """y = x W^T (+ b), W [out, in]. tp: "col" splits out, "row" splits in, None replicates.

    `decode_gemv` (static; `set_decode_gemv`, from KernelConfig.xla_decode_gemv): "off" = XLA's
    dot; "tuned" / "all" = the Pallas decode GEMV (kernels_pallas/gemv.py) for the base weight
    when the token count T is a decode bucket (<= gemv.MAX_M) and the shape / dtype qualify
    (`gemv.decode_gemv_config`), XLA's dot otherwise. Decided at trace time: each compiled
    bucket holds one or the other."""

    def __init__(
        self, d_in: int, d_out: int, dtype: jnp.dtype, bias: bool = False, tp: str | None = None
    ) -> None:
        if tp not in (None, "col", "row"):
            raise ValueError(f"tp must be None, 'col' or 'row', got {tp!r}")
        self.weight = _param((d_out, d_in), dtype, {"col": 0, "row": 1}.get(tp))
        self.bias = _param((d_out,), dtype, 0 if tp == "col" else None) if bias else None
        self.decode_gemv = "off"

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, in] -> [T, out]
        w = self.weight[...]
        y = None
        if self.decode_gemv != "off" and x.ndim == 2:
            from xlaserve.kernels_pallas import gemv as g

            (m, k), n = x.shape, w.shape[0]
            cfg = g.decode_gemv_config(self.decode_gemv, m, n, k, x.dtype, w.dtype)
            if cfg is not None:
                y = g.gemv(x, w, cfg)
        if y is None:
            y = jnp.einsum("ti,oi->to", x, w)
        return y if self.bias is None else y + self.bias[...]


def _gemv_plain(mods: tuple[nnx.Module, ...], x: jax.Array, lora: LoRAStep | None) -> bool:
    """Sibling projections may share one GEMV launch: all plain float `Linear`s with one policy
    other than "off", no bias, no LoRA delta this step, x [T, in]."""
    return (
        x.ndim == 2
        and all(type(mod) is Linear and mod.bias is None for mod in mods)
        and len({mod.decode_gemv for mod in mods}) == 1
        and mods[0].decode_gemv != "off"
        and (lora is None or all(getattr(mod, "lora_a", None) is None for mod in mods))
    )


def sibling_linears(
    mods: tuple[nnx.Module, ...], x: jax.Array, lora: LoRAStep | None = None
) -> tuple[jax.Array, ...]:
    """(lora_linear(mod, x, lora) for mod in mods), the weights read by ONE Pallas launch
    (`gemv.gemv_multi`) where the decode-GEMV policy takes every shape (q / k / v: XLA merges
    such sibling dots into one fusion; separate GEMVs lost to it). Same trace-time decision as
    `Linear`; else each projection on its own path. x [T, in] -> ([T, out_i], ...)."""
    if _gemv_plain(mods, x, lora):
        from xlaserve.kernels_pallas import gemv as g

        ws = tuple(mod.weight[...] for mod in mods)
        (m, k), ns = x.shape, tuple(w.shape[0] for w in ws)
        cfg = g.multi_gemv_config(mods[0].decode_gemv, m, ns, k, x.dtype, ws[0].dtype)
        if cfg is not None and len({w.dtype for w in ws}) == 1:
            return g.gemv_multi(x, ws, cfg)
    return tuple(lora_linear(mod, x, lora) for mod in mods)


def gated_linears(
    gate: nnx.Module, up: nnx.Module, act: Any, x: jax.Array, lora: LoRAStep | None = None
) -> jax.Array:
    """act(gate(x)) * up(x) [T, inter], both weights and the activation in ONE Pallas launch
    (`gemv.gemv_gated`) where the decode-GEMV policy takes the shape; else the plain path."""
    if _gemv_plain((gate, up), x, lora):
        from xlaserve.kernels_pallas import gemv as g

        wg, wu = gate.weight[...], up.weight[...]
        (m, k), n = x.shape, wg.shape[0]
        cfg = g.gated_gemv_config(gate.decode_gemv, m, n, k, x.dtype, wg.dtype)
        if cfg is not None and wu.shape == wg.shape and wu.dtype == wg.dtype:
            return g.gemv_gated(x, wg, wu, act, cfg)
    return act(lora_linear(gate, x, lora)) * lora_linear(up, x, lora)


def set_decode_gemv(model: nnx.Module, policy: str) -> int:
    """Set every float `Linear` of `model` (in place) to decode-GEMV `policy` ("off" | "tuned" |
    "all": `kernels_pallas.gemv.resolve_decode_gemv`). QuantLinears keep their own matmuls.
    Returns how many layers were set."""
    if policy not in ("off", "tuned", "all"):
        raise ValueError(f"decode GEMV policy must be 'off', 'tuned' or 'all', got {policy!r}")
    count = 0
    for _, mod in nnx.iter_graph(model):
        if type(mod) is Linear:
            mod.decode_gemv = policy
            count += 1
    return count


# ---- multi-LoRA (xlaserve/lora) --------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["seg"], meta_fields=["impl"])
@dataclass(frozen=True)
class LoRAStep:
    """One program's LoRA inputs: seg = kernels_pallas.lora.LoRASegments (each token's slot,
    grouped; computed once per forward), impl = the shrink / expand implementation (static)."""

    seg: Any
    impl: str = "auto"


def lora_targets(model: nnx.Module, modules: tuple[str, ...]) -> dict[tuple[int, str], nnx.Module]:
    """(layer, module name) -> the `Linear` / `QuantLinear` a LoRA adapter of that module name
    applies to: `layers[i].self_attn.<name>` or `layers[i].mlp.<name>`, when the layer has one
    (MLA attention and MoE experts have none: an adapter for them is refused)."""
    out: dict[tuple[int, str], nnx.Module] = {}
    for i, layer in enumerate(getattr(model, "layers", [])):
        for part in ("self_attn", "mlp"):
            parent = getattr(layer, part, None)
            for name in modules:
                mod = getattr(parent, name, None)
                if type(mod) in (Linear, QuantLinear):
                    out[(i, name)] = mod
    return out


def linear_dims(mod: nnx.Module) -> tuple[int, int]:
    """(in_features, out_features) of a `Linear` or `QuantLinear`."""
    if isinstance(mod, QuantLinear):
        return mod.d_in, mod.d_out
    out_f, in_f = mod.weight.get_value().shape
    return in_f, out_f


def add_lora_tables(
    model: nnx.Module, modules: tuple[str, ...], num_slots: int, rank: int, dtype: jnp.dtype,
    sharding: Any = None,
) -> dict[tuple[int, str], nnx.Module]:  # fmt: skip
    """Give every LoRA target of `model` zeroed slot tables (in place): `lora_a` [S, R, in] and
    `lora_b` [S, out, R] in `dtype` (placed with `sharding` when given). Returns the targets."""
    targets = lora_targets(model, modules)
    for mod in targets.values():
        d_in, d_out = linear_dims(mod)
        a, b = jnp.zeros((num_slots, rank, d_in), dtype), jnp.zeros((num_slots, d_out, rank), dtype)
        if sharding is not None:
            a, b = jax.device_put(a, sharding), jax.device_put(b, sharding)
        mod.lora_a, mod.lora_b = nnx.Param(a), nnx.Param(b)
    return targets


def lora_linear(mod: nnx.Module, x: jax.Array, lora: LoRAStep | None) -> jax.Array:
    """mod(x) [T, out] plus, for each token with an adapter slot, B[slot] @ (A[slot] @ x_t),
    when the step carries LoRA inputs and `mod` has slot tables (`add_lora_tables`)."""
    y = mod(x)
    a = getattr(mod, "lora_a", None)
    if lora is None or a is None:
        return y
    from xlaserve.kernels_pallas.lora import lora_expand, lora_shrink

    s = lora_shrink(x, a[...], lora.seg, lora.impl)
    return lora_expand(y, s, mod.lora_b[...], lora.seg, 0, lora.impl)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * (offset + w), computed in float32 (offset 1 for Gemma-style weights)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, offset: float = 0.0) -> None:
        self.weight = _param((dim,), dtype)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class LayerNorm(nnx.Module):
    """Standard LayerNorm over the last dim (optional bias), computed in float32."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, bias: bool = True) -> None:
        self.weight = _param((dim,), dtype)
        self.bias = _param((dim,), dtype) if bias else None
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim]
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps) * self.weight[...].astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def make_norm(
    kind: str, dim: int, eps: float, dtype: jnp.dtype, offset: float = 0.0, bias: bool = False
) -> RMSNorm | LayerNorm:
    """ "rms" -> RMSNorm (weight offset), "layer" -> LayerNorm (optional bias)."""
    if kind == "rms":
        return RMSNorm(dim, eps, dtype, offset)
    if kind == "layer":
        return LayerNorm(dim, eps, dtype, bias)
    raise ValueError(f"unknown norm kind {kind!r} (expected 'rms' or 'layer')")


def get_activation(name: str):  # noqa: ANN201 - a jnp elementwise function
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class MLP(nnx.Module):
    """Plain MLP down(act(up(x))) (GPT-2, NeoX, StarCoder2): [T, H] -> [T, H]."""

    def __init__(
        self, hidden: int, inter: int, activation: str, dtype: jnp.dtype, bias: bool = False
    ) -> None:
        get_activation(activation)  # fail early on an unknown name
        self.activation = activation
        self.up_proj = Linear(hidden, inter, dtype, bias, tp="col")
        self.down_proj = Linear(inter, hidden, dtype, bias, tp="row")

    def __call__(self, x: jax.Array, lora: LoRAStep | None = None) -> jax.Array:
        h = get_activation(self.activation)(lora_linear(self.up_proj, x, lora))
        return lora_linear(self.down_proj, h, lora)


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): [T, H] -> [T, H]."""

    def __init__(
        self, hidden: int, inter: int, activation: str, dtype: jnp.dtype, bias: bool = False
    ) -> None:
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported activation {activation!r}; known: {sorted(_ACTIVATIONS)}"
            )
        self.gate_proj = Linear(hidden, inter, dtype, bias, tp="col")
        self.up_proj = Linear(hidden, inter, dtype, bias, tp="col")
        self.down_proj = Linear(inter, hidden, dtype, bias, tp="row")
        self.activation = activation

    def __call__(self, x: jax.Array, lora: LoRAStep | None = None) -> jax.Array:
        act = _ACTIVATIONS[self.activation]
        h = gated_linears(self.gate_proj, self.up_proj, act, x, lora)
        return lora_linear(self.down_proj, h, lora)


class Rotary(nnx.Module):
    """Rotary embedding (HF "neox" rotate-half) with frequencies from `model_loader.rope`.

    Frequencies are kept as a tuple (static, not a parameter) so they never enter the state.
    """

    def __init__(self, inv_freq: np.ndarray, attention_factor: float = 1.0) -> None:
        self.inv_freq = tuple(float(f) for f in np.asarray(inv_freq, np.float32))
        self.attention_factor = float(attention_factor)

    def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [T] -> cos, sin [T, R/2] float32 (scaled by the attention factor)."""
        inv = jnp.asarray(self.inv_freq, jnp.float32)
        freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]
        return jnp.cos(freqs) * self.attention_factor, jnp.sin(freqs) * self.attention_factor


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first R dims of each head: x [T, h, D], cos/sin [T, R/2]; dims >= R pass."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    x1, x2 = rot[..., :half].astype(jnp.float32), rot[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


# ---- quantized linear (int8 / int4 weight-only, fp8) ---------------------------------------------
#
# Model files never change for quantization: the loader builds the float model, then
# `quantize_linears` swaps every eligible `Linear` for a `QuantLinear` (same attribute, so the
# canonical names become X.qweight / X.scales / X.qzeros / X.perm / X.bias). MoE experts (stacked
# parameters, not `Linear`s) stay float.

FP8_MAX = 448.0


def fp8_supported() -> bool:
    """fp8 matmuls need an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper and later)."""
    if jax.default_backend() != "gpu":
        return False
    for d in jax.devices():
        cc = str(getattr(d, "compute_capability", "0.0"))
        major, _, minor = cc.partition(".")
        if (int(major or 0), int(minor or 0)) < (8, 9):
            return False
    return True


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [N, K]^T -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _per_token_quotient(xf: jax.Array, qmax: float) -> tuple[jax.Array, jax.Array]:
    """xf f32 [M, K] -> (v = xf / xs [M, K], xs f32 [M, 1] = max(amax, 1e-12) / qmax), the two
    divisions of the torch backend's `quant_rows_ref` (kernels_cuda/scaled_mm.py). XLA's
    algebraic simplifier rewrites both into multiplications by a reciprocal (amax * f32(1 / 448);
    since jaxlib 0.10.1 also x / broadcast(xs) -> x * broadcast(1 / xs)), 1 ulp off the quotient
    for about half the scales and a quarter of the x / xs: a value at an e4m3 / int8 rounding tie
    then rounds the other way than on the torch backend. On the CPU (the fp8 emulation, whose
    codes the tests hold to the torch backend's bit for bit) the divisors go through an
    optimization barrier, so XLA sees neither a constant nor a broadcast and keeps the divisions
    (no measurable cost there). Accelerators keep the reciprocals: the barrier would add an
    [M, K] float32 write and read to a memory-bound step, and a TPU's divide is not IEEE anyway."""
    amax = jnp.maximum(jnp.abs(xf).max(axis=-1, keepdims=True), 1e-12)
    if jax.default_backend() != "cpu":
        xs = amax / qmax
        return xf / xs, xs
    barrier = jax.lax.optimization_barrier
    xs = amax / barrier(jnp.full_like(amax, qmax))
    return xf / barrier(jnp.broadcast_to(xs, xf.shape)), xs


def quant_rows(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token quantization, the torch backend's `quant_rows_ref`: x [M, K] ->
    (xq [M, K] float8_e4m3fn ("fp8": clip to +-448, the RTNE e4m3 cast) or int8 ("int8": round
    half away from zero, clip to +-127), xs f32 [M, 1] = max(|x[m]|, 1e-12) / QMAX)."""
    if fmt not in ("int8", "fp8"):
        raise ValueError(f"format must be 'int8' or 'fp8', got {fmt!r}")
    xf = x.astype(jnp.float32)
    if fmt == "fp8":
        v, xs = _per_token_quotient(xf, FP8_MAX)
        return jnp.clip(v, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), xs
    v, xs = _per_token_quotient(xf, 127.0)
    return jnp.clip(jnp.trunc(v + 0.5 * jnp.sign(v)), -127, 127).astype(jnp.int8), xs


def fp8_matmul(x: jax.Array, w8: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [M, K] quantized per token to e4m3 (dynamic scale amax/448), w8 float8_e4m3fn [N, K]
    with per-channel scales [N] -> [M, N] in x's dtype. The fp8 dot itself runs on GPUs that have
    it (XLA lowers an f8 x f8 dot to cuBLASLt); elsewhere it is emulated in float32 (the same
    roundings as the torch backend's `fp8_linear_ref`)."""
    xq, xs = quant_rows(x, "fp8")
    if fp8_supported():
        y = _dot_t(xq, w8)
    else:
        y = _dot_t(xq.astype(jnp.float32), w8.astype(jnp.float32))
    return (y * xs * w_scale.astype(jnp.float32)[None, :]).astype(x.dtype)


def fp8_block_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """Block-wise fp8 weights (dequantized in the jitted forward: `w` f32 [N, K] = codes times
    their block's scale) with x rounded per token to e4m3, as the torch backend does; f32 math
    -> [M, N] in x's dtype."""
    xq, xs = quant_rows(x, "fp8")
    return (_dot_t(xq.astype(jnp.float32), w) * xs).astype(x.dtype)


def int8_w8a8_matmul(x: jax.Array, q: jax.Array, s: jax.Array) -> jax.Array:
    """int8 w8a8: x [M, K] quantized per token to int8 (scale amax / 127, round half away from
    zero: the torch kernels' rounding), q int8 [N, K], s f32 [N]; an int8 x int8 -> int32 dot
    (the MXU's int8 rate on TPU v5e / v6e, cuBLAS int8 on GPU) -> [M, N] in x's dtype."""
    xq, xs = quant_rows(x, "int8")
    acc = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * xs * s.astype(jnp.float32)[None, :]).astype(x.dtype)


class QuantLinear(nnx.Module):
    """Quantized drop-in for `Linear`: x [T, in] -> [T, out] in x's dtype.

    Parameters, in the canonical layouts of `xlaserve.quantization.numpy_quant` (N = out,
    K = in, G = K / group):
        int8: qweight int8 [N, K], scales f32 [N]                      W = q * s[:, None]
        int4: qweight uint8 [N, K/2] (two nibbles a byte, group half-split order), scales f32
              [N, G], qzeros uint8 [N, G]; perm int32 [K] for GPTQ act-order checkpoints (the
              input is permuted first)                                  W = (q - z) * s
        fp8:  qweight float8_e4m3fn [N, K], scales f32 [N]; activations rounded per token
        bias [N] (model dtype) when the float layer had one.
    Tensor parallelism splits the same axis the float layer does ("col": N, "row": K; int4's
    packed bytes and groups are split along with K).

    Matmul (`impl`, static): "auto" = the Pallas dequant-matmul kernels
    (`kernels_pallas.quant_matmul`) on TPU, the XLA path elsewhere; "xla" = dequantize inside the
    jitted forward (XLA fuses the int -> float convert into the dot's operand; int8 scales are
    applied to the f32 accumulator); "pallas_tpu" = always the kernels (interpret mode on CPU).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        dtype: jnp.dtype,
        bias: bool,
        tp: str | None,
        method: str,
        group: int = 0,
        act_order: bool = False,
        impl: str = "auto",
        weight_block: tuple[int, int] | None = None,
    ) -> None:
        if tp not in (None, "col", "row"):
            raise ValueError(f"tp must be None, 'col' or 'row', got {tp!r}")
        if impl not in ("auto", "xla", "pallas_tpu"):
            raise ValueError(f"impl must be 'auto', 'xla' or 'pallas_tpu', got {impl!r}")
        n, k = d_out, d_in
        ax = {"col": 0, "row": 1}.get(tp)
        col = 0 if tp == "col" else None
        self.d_in, self.d_out, self.method, self.impl = d_in, d_out, method, impl
        self.group = 0
        self.block = None if weight_block is None else tuple(weight_block)
        perm = qzeros = None  # each attribute assigned once: nnx fixes its kind (data/static)
        if method in ("int8", "int8_w8a8"):
            self.qweight = _param((n, k), jnp.int8, ax)
            self.scales = _param((n,), jnp.float32, col)
        elif method == "int4":
            if group <= 0 or k % group or group % 2:
                raise ValueError(f"int4: in_features {k} and group {group} do not fit")
            self.group = group
            self.qweight = _param((n, k // 2), jnp.uint8, ax)
            self.scales = _param((n, k // group), jnp.float32, ax)
            qzeros = _param((n, k // group), jnp.uint8, ax)
            if act_order:
                perm = _param((k,), jnp.int32)
        elif method == "fp8":
            self.qweight = _param((n, k), jnp.float8_e4m3fn, ax)
            if self.block is None:
                self.scales = _param((n,), jnp.float32, col)
            else:  # block-wise: [ceil(N / bn), ceil(K / bk)], split like the weight
                gn, gk = -(-n // self.block[0]), -(-k // self.block[1])
                self.scales = _param((gn, gk), jnp.float32, ax)
        else:
            raise ValueError(f"unknown quantization method {method!r}")
        self.qzeros, self.perm = qzeros, perm
        self.bias = _param((n,), dtype, col) if bias else None

    def dequantized_weight(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """W [N, K] in `dtype` (input channels in the order x is fed in after `perm`)."""
        s = self.scales[...].astype(jnp.float32)
        if self.method == "int4":
            from xlaserve.kernels_pallas.quant_matmul import dequant_int4_ref

            return dequant_int4_ref(self.qweight[...], s, self.qzeros[...]).astype(dtype)
        if self.block is not None:  # block scales expanded to [N, K] (XLA fuses it into the dot)
            n, k = self.d_out, self.d_in
            s = jnp.repeat(jnp.repeat(s, self.block[0], 0)[:n], self.block[1], 1)[:, :k]
            return (self.qweight[...].astype(jnp.float32) * s).astype(dtype)
        return (self.qweight[...].astype(jnp.float32) * s[:, None]).astype(dtype)

    def _use_pallas(self) -> bool:
        from xlaserve.kernels_pallas import compat

        if self.method in ("fp8", "int8_w8a8") or self.impl == "xla":
            return False
        if self.impl == "pallas_tpu" or compat.is_interpret_forced():
            return True
        if jax.default_backend() != "tpu":
            return False
        # Mosaic blocks: a group's packed bytes (g/2 lanes) must fill whole 128-lane tiles
        # unless one group spans the row.
        return self.method == "int8" or self.group == self.d_in or (self.group // 2) % 128 == 0

    def _matmul(self, x: jax.Array) -> jax.Array:  # [M, K] -> [M, N] x.dtype
        q, s = self.qweight[...], self.scales[...]
        if self.method == "fp8" and self.block is not None:
            return fp8_block_matmul(x, self.dequantized_weight(jnp.float32))
        if self.method == "fp8":
            return fp8_matmul(x, q, s)
        if self.method == "int8_w8a8":
            return int8_w8a8_matmul(x, q, s)
        if self._use_pallas():
            from xlaserve.kernels_pallas import quant_matmul as qm

            if self.method == "int8":
                return qm.int8_matmul_pallas(x, q, s)
            return qm.int4_matmul_pallas(x, q, s, self.qzeros[...])
        if self.method == "int8":  # int8 values are exact in bf16/f32: scale the accumulator
            y = _dot_t(x, q.astype(x.dtype)) * s.astype(jnp.float32)[None, :]
            return y.astype(x.dtype)
        return _dot_t(x, self.dequantized_weight(x.dtype)).astype(x.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.d_in)
        if self.perm is not None:
            x2 = jnp.take(x2, self.perm[...], axis=1)
        y = self._matmul(x2)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y.reshape(*lead, self.d_out)


def quantize_linears(
    model: nnx.Module, scheme: QuantScheme, impl: str = "auto"
) -> dict[str, tuple[int, int]]:
    """Swap every eligible `Linear` of `model` for an empty `QuantLinear` (in place; call it under
    `nnx.eval_shape`, the loader fills the parameters). Skipped: layers the scheme ignores
    (lm_head, routers, ...) and, for int4, odd in_features (as the torch backend does).
    Returns {canonical layer name: (out_features, in_features)} of the swapped layers."""
    swapped: dict[str, tuple[int, int]] = {}
    for path, mod in list(nnx.iter_modules(model)):
        if type(mod) is not Linear or not path:
            continue
        name = ".".join(str(p) for p in path)
        w = mod.weight.get_value()
        n, k = w.shape
        if scheme.skips(name) or (scheme.method == "int4" and k % 2):
            continue
        tp = {0: "col", 1: "row"}.get(mod.weight.get_metadata().get("tp_axis"))
        new = QuantLinear(
            k,
            n,
            w.dtype,
            mod.bias is not None,
            tp,
            scheme.method,
            scheme.layer_group(k) if scheme.method == "int4" else 0,
            scheme.act_order,
            impl,
            scheme.weight_block,
        )
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) else getattr(parent, p)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
        swapped[name] = (n, k)
    return swapped
