"""FusedMoE: router top-k + stacked experts (+ optional shared expert) behind one layer.

Parameters follow the canonical names (`model_loader/spec.py`) under the layer's `mlp.` prefix:
router.weight [E, H] (+ router.bias [E], a selection-only bias), experts.w_gate / w_up [E, I, H],
experts.w_down [E, H, I], shared_expert.{gate,up,down}_proj, shared_expert_gate.weight [1, H].

Experts run as grouped matmuls: the T*K (token, choice) rows are sorted by expert, pushed through
`kernels_pallas.gmm` (the Pallas kernel on TPU, `ragged_dot` elsewhere) three times, un-sorted and
summed with the router weights. The gmm implementation comes from $XLASERVE_GMM_IMPL ("auto").
Expert weights are replicated under tensor parallelism (expert parallelism is a later step).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.kernels_pallas.gmm import gmm
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.layers import GatedMLP, Linear, _param, get_activation


def select_experts(
    logits: jax.Array,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    score_bias: jax.Array | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int32).

    softmax: top-k of softmax(logits). sigmoid (DeepSeek-V3): scores = sigmoid(logits); experts
    are chosen on scores + score_bias within the best `topk_groups` of `num_groups` groups (a
    group's score is the sum of its top-2); weights are the unbiased scores. Then optional
    renormalisation to sum 1, then * routed_scaling.
    """
    logits = logits.astype(jnp.float32)
    if scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"unknown MoE scoring {scoring!r} (expected 'softmax' or 'sigmoid')")
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    if num_groups > 1:
        t, e = choice.shape
        grouped = choice.reshape(t, num_groups, e // num_groups)
        group_scores = jax.lax.top_k(grouped, min(2, e // num_groups))[0].sum(-1)  # [T, G]
        best = jax.lax.top_k(group_scores, topk_groups)[1]  # [T, topk_groups]
        keep = jnp.any(best[:, :, None] == jnp.arange(num_groups)[None, None, :], axis=1)
        choice = jnp.where(jnp.repeat(keep, e // num_groups, axis=1), choice, -jnp.inf)
    ids = jax.lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if renormalize:
        denom = weights.sum(-1, keepdims=True)
        weights = weights / (denom + 1e-20) if scoring == "sigmoid" else weights / denom
    if routed_scaling != 1.0:
        weights = weights * routed_scaling
    return weights, ids.astype(jnp.int32)


def fused_experts(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    activation: str = "silu",
    impl: str = "auto",
) -> jax.Array:
    """sum_k weights[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t,k].

    x [T, H]; w_gate/w_up [E, I, H]; w_down [E, H, I]; weights/ids [T, K] -> [T, H] (x dtype).
    """
    t, k = ids.shape
    e = w_gate.shape[0]
    flat = ids.reshape(-1)  # [T*K]
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E]
    xs = jnp.take(x, order // k, axis=0)  # [T*K, H]
    act = get_activation(activation)
    h = act(gmm(xs, w_gate, sizes, True, impl)) * gmm(xs, w_up, sizes, True, impl)  # [T*K, I]
    y = gmm(h, w_down, sizes, True, impl)  # [T*K, H]
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = jnp.take(y, inv, axis=0).reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y, weights).astype(x.dtype)


class Router(nnx.Module):
    """weight [E, H] -> float32 logits [T, E]; `bias` [E] only biases expert selection."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        self.weight = _param((spec.num_experts, spec.hidden_size), dtype)
        self.bias = _param((spec.num_experts,), dtype) if spec.moe_router_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...].astype(jnp.float32)
        return jnp.einsum("th,eh->te", x.astype(jnp.float32), w)


class Experts(nnx.Module):
    """Stacked expert weights: w_gate, w_up [E, I, H]; w_down [E, H, I]."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
        self.w_gate, self.w_up, self.w_down = (
            _param((e, i, h), dtype),
            _param((e, i, h), dtype),
            _param((e, h, i), dtype),
        )


class FusedMoE(nnx.Module):
    """x [T, H] -> [T, H]: routed experts (+ shared expert, optionally sigmoid-gated)."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, impl: str | None = None) -> None:
        # Static routing settings (a ModelSpec is unhashable, so it is not kept on the module).
        self.routing = (
            spec.num_experts_per_tok,
            spec.norm_topk_prob,
            spec.moe_scoring,
            spec.moe_num_groups,
            spec.moe_topk_groups,
            spec.moe_routed_scaling,
        )
        self.activation = spec.activation
        self.impl = impl or os.environ.get("XLASERVE_GMM_IMPL", "auto")
        self.router = Router(spec, dtype)
        self.experts = Experts(spec, dtype)
        si = spec.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(spec.hidden_size, si, spec.activation, dtype) if si else None
        self.shared_expert_gate = (
            Linear(spec.hidden_size, 1, dtype)
            if self.shared_expert is not None and spec.shared_expert_gate
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        k, renorm, scoring, groups, topk_groups, scaling = self.routing
        bias = None if self.router.bias is None else self.router.bias[...]
        weights, ids = select_experts(
            self.router(x), k, renorm, scoring, bias, groups, topk_groups, scaling
        )
        ex = self.experts
        out = fused_experts(
            x,
            ex.w_gate[...],
            ex.w_up[...],
            ex.w_down[...],
            weights,
            ids,
            self.activation,
            self.impl,
        )
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
