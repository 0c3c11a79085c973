"""FusedMoE: router top-k + stacked experts (+ optional shared expert) behind one layer.

Parameters follow the canonical names (`model_loader/spec.py`) under the layer's `mlp.` prefix:
router.weight [E, H] (+ router.bias [E], a selection-only bias), experts.w_gate / w_up [E, I, H],
experts.w_down [E, H, I], shared_expert.{gate,up,down}_proj, shared_expert_gate.weight [1, H].

Experts run as grouped matmuls: the T*K (token, choice) rows are sorted by expert, pushed through
`kernels_pallas.gmm` (the Pallas kernel on TPU, `ragged_dot` elsewhere) three times, un-sorted and
summed with the router weights. The gmm implementation is KernelConfig.gmm_impl ("auto"; load_model sets it).

Under tensor parallelism the expert weights are replicated, unless expert parallelism is on
(`enable_expert_parallel`, set by the loader through `enable_expert_parallel(model, mesh)`): then
w_gate/w_up/w_down are sharded on E over the mesh axis "model" (E / N experts per device) and
`fused_experts_ep` runs under `shard_map`. The tokens are already replicated over "model" (the
attention's row-parallel output is all-reduced), so no all-to-all dispatch is needed: each device
routes every (token, choice) row whose expert is local through its own experts (the Pallas gmm
kernel on TPU, on local shapes), zeroes the others, and one `psum` (an all-reduce of [T, H], the
same traffic as a row-parallel MLP) adds the partial outputs. All-to-all dispatch only pays once
tokens are sharded too (data-parallel attention), which xlaserve does not do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlaserve.config import kernel_switch
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
    group_topn: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int32).

    softmax: top-k of softmax(logits). sigmoid (DeepSeek-V3): scores = sigmoid(logits); experts
    are chosen on scores + score_bias within the best `topk_groups` of `num_groups` groups (a
    group's score is the sum of its top `group_topn`: 2 for V3, 1 = max for V2); weights are the
    unbiased scores. Then optional
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
        group_scores = jax.lax.top_k(grouped, min(group_topn, e // num_groups))[0].sum(-1)
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


def _expert_rows(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    ids: jax.Array,
    activation: str,
    impl: str,
) -> jax.Array:
    """Per-(token, choice) expert outputs: float32 [T, K, H].

    x [T, H]; w_gate/w_up [G, I, H]; w_down [G, H, I]; ids int32 [T, K] in [0, G], where G (one
    past the last group) marks a row no expert here computes: those rows sort last, lie beyond
    sum(group sizes) and come out as zeros.
    """
    t, k = ids.shape
    g = w_gate.shape[0]
    flat = ids.reshape(-1)  # [T*K]
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert, skipped rows last
    sizes = jnp.bincount(flat, length=g + 1)[:g].astype(jnp.int32)  # [G]
    xs = jnp.take(x, order // k, axis=0)  # [T*K, H]
    act = get_activation(activation)
    h = act(gmm(xs, w_gate, sizes, True, impl)) * gmm(xs, w_up, sizes, True, impl)  # [T*K, I]
    y = gmm(h, w_down, sizes, True, impl)  # [T*K, H]
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return jnp.take(y, inv, axis=0).reshape(t, k, -1).astype(jnp.float32)


def expert_glu(gate: jax.Array, up: jax.Array, glu: tuple) -> jax.Array:
    """The experts' gated activation (ModelSpec.moe_glu): glu = ("act", activation) ->
    act(gate) * up; ("swiglu_clamp", alpha, limit) -> gpt-oss's clamped SwiGLU."""
    if glu[0] == "swiglu_clamp":
        _, alpha, lim = glu
        g = jnp.minimum(gate, lim)
        return g * jax.nn.sigmoid(g * alpha) * (jnp.clip(up, -lim, lim) + 1)
    return get_activation(glu[1])(gate) * up


def fused_experts_biased(
    x: jax.Array,
    w: tuple[jax.Array, ...],
    b: tuple[jax.Array | None, ...],
    weights: jax.Array,
    ids: jax.Array,
    glu: tuple,
    impl: str = "auto",
) -> jax.Array:
    """`fused_experts` with expert biases b = (b_gate [E, I], b_up [E, I], b_down [E, H]) and
    `expert_glu` (gpt-oss): x [T, H] -> [T, H]. Rows sorted by expert, three grouped matmuls."""
    w_gate, w_up, w_down = w
    t, k = ids.shape
    e = w_gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)  # [T*K, H]
    row_e = jnp.take(flat, order)  # expert of each sorted row

    def bias(y: jax.Array, bb: jax.Array | None) -> jax.Array:
        return y if bb is None else y + jnp.take(bb, row_e, axis=0).astype(y.dtype)

    gate = bias(gmm(xs, w_gate, sizes, True, impl), b[0])
    up = bias(gmm(xs, w_up, sizes, True, impl), b[1])
    y = bias(gmm(expert_glu(gate, up, glu), w_down, sizes, True, impl), b[2])  # [T*K, H]
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = jnp.take(y, inv, axis=0).reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y, weights).astype(x.dtype)


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
    y = _expert_rows(x, w_gate, w_up, w_down, ids, activation, impl)
    return jnp.einsum("tkh,tk->th", y, weights).astype(x.dtype)


def fused_experts_ep(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    mesh: Mesh,
    activation: str = "silu",
    impl: str = "auto",
    axis: str = "model",
) -> jax.Array:
    """`fused_experts` with the experts sharded on E over mesh axis `axis` (expert parallelism).

    Same shapes and result as `fused_experts`; x, weights and ids are replicated over `axis`,
    w_* are split on E (device d holds experts [d * E/N, (d + 1) * E/N)). Each device computes the
    rows routed to its experts; a psum over `axis` adds the partial [T, H] sums (in float32).
    ValueError when N does not divide E.
    """
    n, e = mesh.shape[axis], w_gate.shape[0]
    if e % n:
        raise ValueError(f"expert parallelism: {n} devices must divide num_experts ({e})")
    el = e // n

    def local(x, wg, wu, wd, weights, ids):  # noqa: ANN001, ANN202 - per-device shards
        lid = ids - jax.lax.axis_index(axis) * el  # local expert id, valid in [0, el)
        mine = (lid >= 0) & (lid < el)
        y = _expert_rows(x, wg, wu, wd, jnp.where(mine, lid, el), activation, impl)
        y = jnp.where(mine[..., None], y, 0.0)  # [T, K, H]: only this device's experts
        return jax.lax.psum(jnp.einsum("tkh,tk->th", y, weights), axis)

    rep, split = P(), P(axis)
    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rep, split, split, split, rep, rep),
        out_specs=rep,
        check_vma=False,
    )(x, w_gate, w_up, w_down, weights.astype(jnp.float32), ids)
    return out.astype(x.dtype)


class Router(nnx.Module):
    """weight [E, H] -> float32 logits [T, E]; `bias` [E] only biases expert selection."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        self.weight = _param((spec.num_experts, spec.hidden_size), dtype)
        with_bias = spec.moe_router_bias or spec.moe_router_logit_bias
        self.bias = _param((spec.num_experts,), dtype) if with_bias else None
        self.logit_bias = spec.moe_router_logit_bias  # gpt-oss: the bias is part of the logits

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...].astype(jnp.float32)
        logits = jnp.einsum("th,eh->te", x.astype(jnp.float32), w)
        return logits + self.bias[...].astype(jnp.float32) if self.logit_bias else logits


class Experts(nnx.Module):
    """Stacked expert weights: w_gate, w_up [E, I, H]; w_down [E, H, I]. `ep_axis` metadata: the
    axis expert parallelism splits (the loader shards it only when expert parallelism is on)."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
        self.w_gate, self.w_up, self.w_down = (
            nnx.Param(jnp.zeros(shape, dtype), ep_axis=0)
            for shape in ((e, i, h), (e, i, h), (e, h, i))
        )
        # gpt-oss expert biases (each attribute assigned once: nnx fixes an attribute's kind)
        biases = (
            [nnx.Param(jnp.zeros(shape, dtype), ep_axis=0) for shape in ((e, i), (e, i), (e, h))]
            if spec.moe_expert_bias
            else [None, None, None]
        )
        self.b_gate, self.b_up, self.b_down = biases


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
            spec.moe_group_topn,
        )
        self.activation = spec.activation
        self.scale_input = spec.moe_scale_input  # Llama 4: expert_e(w * x)
        self.biased = spec.moe_expert_bias or spec.moe_glu != "act"
        self.glu = (
            ("swiglu_clamp", float(spec.extra["swiglu_alpha"]), float(spec.extra["swiglu_limit"]))
            if spec.moe_glu == "swiglu_clamp"
            else ("act", spec.activation)
        )
        self.impl = impl or kernel_switch("gmm_impl")  # load_model sets KernelConfig.gmm_impl
        self.ep_mesh: Mesh | None = None  # static: set by enable_expert_parallel
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
        k, renorm, scoring, groups, topk_groups, scaling, topn = self.routing
        bias = None if self.router.bias is None or self.router.logit_bias else self.router.bias[...]
        weights, ids = select_experts(
            self.router(x), k, renorm, scoring, bias, groups, topk_groups, scaling, topn
        )
        ex = self.experts
        w = (ex.w_gate[...], ex.w_up[...], ex.w_down[...])
        x_in, k = x, weights.shape[1]
        if self.scale_input:  # one row w[t, k] * x[t] per (token, choice), unit weight
            x = (x[:, None, :] * weights[:, :, None].astype(x.dtype)).reshape(-1, x.shape[-1])
            weights, ids = jnp.ones((x.shape[0], 1), jnp.float32), ids.reshape(-1, 1)
        if self.biased:
            if self.ep_mesh is not None:
                raise ValueError("expert biases (gpt-oss) do not run expert-parallel yet")
            b = tuple(None if p is None else p[...] for p in (ex.b_gate, ex.b_up, ex.b_down))
            out = fused_experts_biased(x, w, b, weights, ids, self.glu, self.impl)
        elif self.ep_mesh is not None:
            out = fused_experts_ep(x, *w, weights, ids, self.ep_mesh, self.activation, self.impl)
        else:
            out = fused_experts(x, *w, weights, ids, self.activation, self.impl)
        if self.scale_input:  # each token's K rows summed back to [T, H]
            x = x_in
            out = out.reshape(x.shape[0], k, -1).sum(axis=1)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def check_expert_parallel(spec: ModelSpec, n: int) -> None:
    """ValueError when `n` devices cannot split the experts of an MoE spec evenly."""
    if spec.num_experts and spec.num_experts % n:
        raise ValueError(
            f"enable_expert_parallel: tensor_parallel_size {n} must divide num_experts "
            f"({spec.num_experts}); use a tensor_parallel_size that divides it or turn expert "
            "parallelism off (experts are then replicated)"
        )


def enable_expert_parallel(model: nnx.Module, mesh: Mesh) -> int:
    """Make every FusedMoE of `model` run expert-parallel over `mesh` (axis "model"); returns how
    many layers changed. Call before `nnx.split` (the mesh is static graph data); a 1-device mesh
    leaves the model as it is."""
    if mesh.shape["model"] == 1:
        return 0
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, FusedMoE)]
    for m in layers:
        m.ep_mesh = mesh
    return len(layers)
