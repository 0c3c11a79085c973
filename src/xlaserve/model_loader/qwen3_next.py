"""Qwen3-Next (`Qwen3NextForCausalLM`): HF config -> ModelSpec and weight names (issue 25).

Layers by `layer_types` (default: full attention every `full_attention_interval`, else linear):
- "gdn" (Gated DeltaNet linear attention): in-projections, causal depthwise conv1d (no bias) with
  state + silu, l2-normalised q / k (q scaled by dk^-0.5), beta = sigmoid(b),
  g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule with a per-request state
  [Hv, dk, dv], per-head RMSNorm of the output times silu(z), out_proj.
- "attention": gated attention: q_proj gives [q | gate] per head, qk-norm, partial rotary, output
  * sigmoid(gate) before o_proj.
Every norm but the GDN output norm is zero-centred: x_normed * (1 + w) (norm_weight_offset=1).
MLP: softmax top-k MoE + a shared expert with a sigmoid gate (Qwen2-MoE layout), a dense gated MLP
on `mlp_only_layers` / off `decoder_sparse_step`.

spec.extra:
    layer_kinds: list[str]   per layer "gdn" | "attention"
    ssm: dict                kind "gdn", n_k_heads (Hk), n_heads (Hv), head_dim (dk),
                             state_size (dv), conv_kernel (K), conv_dim (C = 2 Hk dk + Hv dv)
So the per-request state of a gdn layer is conv window [C, K-1] + recurrent state
[Hv, dk, dv] (model_loader/ssm.state_shapes: (Hs, P, N) = (Hv, dk, dv)), float32.

Canonical weights of a gdn layer i (HF names without `model.`; HF's per-k-head interleaving of
qkvz / ba is undone here so both backends split contiguous blocks):
    layers.{i}.linear_attn.in_proj_qkvz.weight [2 Hk dk + 2 Hv dv, H]   rows: q | k | v | z
    layers.{i}.linear_attn.in_proj_ba.weight [2 Hv, H]                  rows: b | a
    layers.{i}.linear_attn.conv1d.weight [C, K]   (channels q | k | v)
    layers.{i}.linear_attn.{dt_bias, A_log} [Hv], norm.weight [dv], out_proj.weight [H, Hv dv]
Attention layer i: self_attn.q_proj.weight [Hq D, H] (the q rows of HF's q_proj),
    self_attn.o_gate_proj.weight [Hq D, H] (its gate rows), k_proj / v_proj / o_proj,
    q_norm / k_norm [D].
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from xlaserve.model_loader.registry import (
    ArchAdapter,
    _moe_names,
    base_spec_kwargs,
    register_architecture,
)
from xlaserve.model_loader.spec import ModelSpec


def qwen3_next_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    n_layers = kw["num_layers"]
    types = cfg.get("layer_types")
    if not types:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n_layers)]  # fmt: skip
    hk, hv = cfg.get("linear_num_key_heads", 16), cfg.get("linear_num_value_heads", 32)
    dk, dv = cfg.get("linear_key_head_dim", 128), cfg.get("linear_value_head_dim", 128)
    if hv % hk:
        raise ValueError(f"Qwen3-Next: linear_num_value_heads {hv} is not a multiple of {hk}")
    ssm = dict(
        kind="gdn",
        n_k_heads=hk,
        n_heads=hv,
        head_dim=dk,
        state_size=dv,
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        conv_dim=2 * hk * dk + hv * dv,
    )
    rope = cfg.get("rope_parameters") or {}
    prf = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    experts = int(cfg.get("num_experts") or 0)
    bias = bool(cfg.get("attention_bias", False))
    kw.update(
        family="qwen3_next",
        norm_weight_offset=1.0,
        qk_norm=True,
        partial_rotary_factor=float(prf),
        qkv_bias=bias,
        o_bias=bias,
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)) if experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)) if experts else 0,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0))
        if experts
        else 0,
        shared_expert_gate=bool(experts),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        dense_mlp_layers=[i for i in range(n_layers) if i in only or (i + 1) % step != 0]
        if experts
        else [],
        extra={
            "ssm": ssm,
            "layer_kinds": ["attention" if t == "full_attention" else "gdn" for t in types],
        },
    )
    return ModelSpec(**kw)


def _split_rows(w: np.ndarray, groups: int, sizes: list[int]) -> list[np.ndarray]:
    """Rows grouped per k-head [groups * sum(sizes), ...] -> one contiguous block per part."""
    g = w.reshape(groups, sum(sizes), *w.shape[1:])
    out, lo = [], 0
    for s in sizes:
        out.append(g[:, lo : lo + s].reshape(groups * s, *w.shape[1:]))
        lo += s
    return out


def qwen3_next_convert(
    name: str, w: np.ndarray, spec: ModelSpec
) -> Iterable[tuple[str, np.ndarray]]:
    """model.X -> X; qkvz / ba de-interleaved (q | k | v | z, b | a); q_proj [Hq*2D] ->
    q_proj + o_gate_proj; conv1d [C, 1, K] -> [C, K]; experts / router as Qwen2-MoE; the
    multi-token-prediction head (mtp.*) dropped."""
    if "rotary_emb" in name or name.startswith("mtp."):
        return []
    if name == "lm_head.weight" and spec.tie_word_embeddings:
        return []
    name = name.removeprefix("model.")
    s = spec.extra["ssm"]
    hk, rep = s["n_k_heads"], s["n_heads"] // s["n_k_heads"]
    dk, dv = s["head_dim"], s["state_size"]
    if name.endswith("linear_attn.in_proj_qkvz.weight"):
        q, k, v, z = _split_rows(w, hk, [dk, dk, rep * dv, rep * dv])
        return [(name, np.concatenate([q, k, v, z]))]
    if name.endswith("linear_attn.in_proj_ba.weight"):
        b, a = _split_rows(w, hk, [rep, rep])
        return [(name, np.concatenate([b, a]))]
    if name.endswith("conv1d.weight") and w.ndim == 3:
        return [(name, w[:, 0, :])]
    if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
        q, gate = _split_rows(w, spec.num_heads, [spec.head_dim, spec.head_dim])
        return [(name, q), (name.replace(".q_proj.", ".o_gate_proj."), gate)]
    moe = _moe_names(name, w)
    if moe is not None:
        return moe
    if name.endswith(".mlp.gate.weight") and w.shape[0] == spec.num_experts:
        return [(name.replace(".mlp.gate.", ".mlp.router."), w)]
    return [(name, w)]


register_architecture(
    ["Qwen3NextForCausalLM"],
    ArchAdapter(family="qwen3_next", build_spec=qwen3_next_spec, convert=qwen3_next_convert),
)
