"""Flax NNX layers shared by the model families.

Linear weights keep the checkpoint's torch layout [out, in], so canonical weight names map onto
parameter paths one to one and loading needs no transpose. A parameter's `tp_axis` metadata says
which axis tensor parallelism splits ("col" linears: the output axis 0; "row" linears: the input
axis 1); the loader turns it into a NamedSharding. Parameters are created as zeros: models are
built under `nnx.eval_shape` and filled by the loader, so no initializer ever runs.

Axis letters: T tokens, H hidden, I intermediate, V vocab, Hq/Hkv heads, D head_dim, R rotary dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def _param(shape: tuple[int, ...], dtype: jnp.dtype, tp_axis: int | None = None) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), tp_axis=tp_axis)


class Embed(nnx.Module):
    """Token embedding weight [V, H]; `attend` is the tied LM head."""

    def __init__(self, vocab: int, hidden: int, dtype: jnp.dtype) -> None:
        self.weight = _param((vocab, hidden), dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:  # ids [T] -> [T, H]
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, V]
        return jnp.einsum("th,vh->tv", x, self.weight[...])


class Linear(nnx.Module):
    """y = x W^T (+ b), W [out, in]. tp: "col" splits out, "row" splits in, None replicates."""

    def __init__(
        self, d_in: int, d_out: int, dtype: jnp.dtype, bias: bool = False, tp: str | None = None
    ) -> None:
        if tp not in (None, "col", "row"):
            raise ValueError(f"tp must be None, 'col' or 'row', got {tp!r}")
        self.weight = _param((d_out, d_in), dtype, {"col": 0, "row": 1}.get(tp))
        self.bias = _param((d_out,), dtype, 0 if tp == "col" else None) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, in] -> [T, out]
        y = jnp.einsum("ti,oi->to", x, self.weight[...])
        return y if self.bias is None else y + self.bias[...]


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

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(get_activation(self.activation)(self.up_proj(x)))


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

    def __call__(self, x: jax.Array) -> jax.Array:
        act = _ACTIVATIONS[self.activation]
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


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
