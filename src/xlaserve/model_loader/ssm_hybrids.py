"""LFM2, Nemotron-H and Falcon-H1 (issue 25 part B): HF config -> ModelSpec, weight names.

All three are served by the hybrid models (backends_torch/models/mamba.py, models_flax/mamba.py),
per layer by spec.extra["layer_kinds"] (model_loader/ssm.py for the cache of each kind):

- LFM2 (`Lfm2ForCausalLM`): "shortconv" layers (in_proj -> B, C, x; y = C * conv(B * x) with a
  causal depthwise conv of L_cache taps and no activation; out_proj) and "attention" layers
  (GQA, qk-norm, rope), each followed by a SwiGLU MLP. State: the conv window [H, L_cache - 1]
  (an empty SSM state).
- Nemotron-H (`NemotronHForCausalLM`): ONE mixer per layer (spec.extra["single_mixer"]):
  x + mixer(norm(x)), the mixer a Mamba2 ("mamba2"), attention without positions
  ("attention") or a relu^2 MLP ("mlp", no cache). MoE layers ("E") are refused.
- Falcon-H1 (`FalconH1ForCausalLM`): "parallel" layers, x + mamba2(n) + attention(n) with
  n = norm(x), then a SwiGLU MLP. Its muP multipliers are folded into the weights here (every one
  scales a linear map's input or output): ssm_in_multiplier and the five ssm_multipliers (z | x |
  B | C | dt rows of in_proj), ssm_out_multiplier (out_proj), attention_in_multiplier (q/k/v),
  key_multiplier (k), attention_out_multiplier (o_proj), mlp_multipliers (gate_proj, down_proj);
  embedding_multiplier and lm_head_multiplier stay spec fields (embedding_multiplier,
  logits_scaling = 1 / lm_head_multiplier).

Canonical names beyond model_loader/ssm.py's: a shortconv layer's
    layers.{i}.mixer.in_proj.weight [3H, H] (B | C | x), conv1d.weight [H, K], conv1d.bias [H],
    out_proj.weight [H, H] (biases with conv_bias)
and a Nemotron-H "mlp" layer's layers.{i}.mlp.{up_proj,down_proj}.weight.
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
from xlaserve.model_loader.ssm import _dt_limit, _float, hybrid_convert


def _squeeze_conv(name: str, w: np.ndarray) -> np.ndarray:
    """conv1d [C, 1, K] -> [C, K]."""
    return w[:, 0, :] if name.endswith("conv1d.weight") and w.ndim == 3 else w


# ---- LFM2 -------------------------------------------------------------------------------------


def _lfm2_ffn_dim(cfg: dict) -> int:
    """Lfm2MLP's width: block_auto_adjust_ff_dim takes 2/3 of intermediate_size, times
    block_ffn_dim_multiplier, rounded up to block_multiple_of."""
    inter = int(cfg.get("intermediate_size") or cfg.get("block_ff_dim"))
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return inter
    inter = int(2 * inter / 3)
    mult = cfg.get("block_ffn_dim_multiplier", 1.0)
    if mult is not None:
        of = int(cfg.get("block_multiple_of", 256))
        inter = int(mult * inter)
        inter = of * ((inter + of - 1) // of)
    return inter


def lfm2_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:
        attn = cfg.get("full_attn_idxs")
        attn = set(range(n_layers) if attn is None else attn)
        types = ["full_attention" if i in attn else "conv" for i in range(n_layers)]
    bias = bool(cfg.get("conv_bias", False))
    ssm = dict(
        kind="shortconv",
        d_inner=h,
        n_heads=1,
        head_dim=1,
        state_size=0,  # no SSM state: only the conv window
        n_groups=1,
        conv_kernel=int(cfg.get("conv_L_cache", 3)),
        conv_bias=bias,
        proj_bias=bias,
        dt_limit=(0.0, float("inf")),
        residual_in_fp32=False,
        chunk_size=256,
    )
    kw.update(
        family="hybrid",
        norm_eps=float(cfg.get("norm_eps", 1e-5)),
        qk_norm=True,
        intermediate_size=_lfm2_ffn_dim(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
        extra={
            "ssm": ssm,
            "layer_kinds": ["shortconv" if t == "conv" else "attention" for t in types],
        },
    )
    return ModelSpec(**kw)


def lfm2_moe_spec(cfg: dict, model_dir: str) -> ModelSpec:
    """LFM2-MoE: LFM2 layers whose feed-forward is, after the first num_dense_layers (a SwiGLU
    of intermediate_size, not adjusted), a sigmoid-routed MoE: top-k on sigmoid(logits) +
    expert_bias (selection only), weights the unbiased scores, renormalised, * routed_scaling."""
    spec = lfm2_spec({**cfg, "block_auto_adjust_ff_dim": False}, model_dir)
    experts = int(cfg.get("num_experts", 32))
    spec.num_experts = experts
    spec.num_experts_per_tok = int(cfg.get("num_experts_per_tok", 4))
    spec.moe_intermediate_size = int(cfg["moe_intermediate_size"])
    spec.moe_scoring = "sigmoid"
    spec.moe_router_bias = bool(cfg.get("use_expert_bias", True))
    spec.moe_routed_scaling = float(cfg.get("routed_scaling_factor", 1.0))
    spec.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
    spec.dense_mlp_layers = list(range(int(cfg.get("num_dense_layers", 2))))
    return spec


_LFM2_NAMES = [
    (".conv.conv.", ".mixer.conv1d."),
    (".conv.in_proj.", ".mixer.in_proj."),
    (".conv.out_proj.", ".mixer.out_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    # LFM2-MoE: router gate / expert_bias -> router weight / bias; experts by _moe_names
    (".feed_forward.gate.", ".mlp.router."),
    (".feed_forward.expert_bias", ".mlp.router.bias"),
    (".feed_forward.", ".mlp."),
]


def lfm2_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    """model.X -> X; embedding_norm (the final norm) -> norm; conv.conv -> mixer.conv1d [H, K],
    conv.{in,out}_proj -> mixer.*; attention out_proj / q_layernorm / k_layernorm -> o_proj /
    q_norm / k_norm; feed_forward w1 / w3 / w2 -> mlp gate / up / down; operator_norm /
    ffn_norm -> input_layernorm / post_attention_layernorm."""
    if "rotary_emb" in name or (name == "lm_head.weight" and spec.tie_word_embeddings):
        return []
    name = name.removeprefix("model.")
    if name.startswith("embedding_norm."):
        name = "norm." + name.removeprefix("embedding_norm.")
    for old, new in _LFM2_NAMES:
        name = name.replace(old, new)
    moe = _moe_names(name, w) if ".mlp.experts." in name else None
    return moe if moe is not None else [(name, _squeeze_conv(name, w))]


# ---- Nemotron-H -------------------------------------------------------------------------------

_NEMOTRON_KINDS = {
    "M": "mamba2", "mamba": "mamba2", "linear_attention": "mamba2",
    "*": "attention", "attention": "attention", "full_attention": "attention",
    "-": "mlp", "mlp": "mlp",
    "E": "moe", "moe": "moe",
}  # fmt: skip


def _nemotron_layer_kinds(cfg: dict) -> list[str]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types:
        pattern = cfg.get("hybrid_override_pattern")
        if not pattern:
            raise ValueError("NemotronH: config has no layers_block_type / hybrid_override_pattern")
        types = list(pattern)
    unknown = sorted({t for t in types if t not in _NEMOTRON_KINDS})
    if unknown:
        raise ValueError(f"NemotronH: unknown layer types {unknown}")
    kinds = [_NEMOTRON_KINDS[t] for t in types]
    if "moe" in kinds:
        raise ValueError(
            "NemotronH: MoE layers ('E' / 'moe', Nemotron 3) are not supported yet; "
            "Mamba2 ('M'), attention ('*') and MLP ('-') layers are"
        )
    return kinds


def nemotron_h_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kinds = _nemotron_layer_kinds(cfg)
    cfg = {**cfg, "num_hidden_layers": len(kinds)}
    kw = base_spec_kwargs(cfg, model_dir)
    n_heads, d_head = int(cfg.get("mamba_num_heads", 128)), int(cfg.get("mamba_head_dim", 64))
    ssm = dict(
        kind="mamba2",
        d_inner=n_heads * d_head,
        n_heads=n_heads,
        head_dim=d_head,
        state_size=int(cfg.get("ssm_state_size", 128)),
        n_groups=int(cfg.get("n_groups", cfg.get("mamba_n_groups", 8))),
        conv_kernel=int(cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))),
        conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
        proj_bias=bool(cfg.get("use_bias", False)),
        # transformers' mixer clamps dt to (time_step_min, inf) (its prefill form; kept for
        # decode too: softplus(dt) rarely falls below it).
        dt_limit=(_float(cfg.get("time_step_min", cfg.get("mamba_dt_min", 0.001))), float("inf")),
        residual_in_fp32=False,
        chunk_size=int(cfg.get("chunk_size", cfg.get("mamba_chunk_size", 128))),
    )
    kw.update(
        family="hybrid",
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        position_embedding="none",  # NemotronHAttention has no rope
        activation=cfg.get("mlp_hidden_act", "relu2"),
        gated_mlp=False,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        extra={"ssm": ssm, "layer_kinds": kinds, "single_mixer": True},
    )
    return ModelSpec(**kw)


def nemotron_h_convert(
    name: str, w: np.ndarray, spec: ModelSpec
) -> Iterable[tuple[str, np.ndarray]]:
    """backbone. / model. prefix dropped; embeddings -> embed_tokens, norm_f -> norm;
    layers.{i}.norm -> input_layernorm; layers.{i}.mixer.X -> self_attn.X (attention layers),
    mlp.X (MLP layers), mixer.X (Mamba2, conv1d -> [C, K])."""
    if "rotary_emb" in name or (name == "lm_head.weight" and spec.tie_word_embeddings):
        return []
    if name.startswith("mtp."):  # multi-token-prediction heads: unused
        return []
    name = name.removeprefix("backbone.").removeprefix("model.")
    if name == "embeddings.weight":
        return [("embed_tokens.weight", w)]
    if name.startswith("norm_f."):
        return [("norm." + name.removeprefix("norm_f."), w)]
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 3:
        kind = spec.extra["layer_kinds"][int(parts[1])]
        if parts[2] == "norm":
            parts[2] = "input_layernorm"
        elif parts[2] == "mixer" and kind != "mamba2":
            parts[2] = "self_attn" if kind == "attention" else "mlp"
        name = ".".join(parts)
    return [(name, _squeeze_conv(name, w))]


# ---- Falcon-H1 --------------------------------------------------------------------------------


def falcon_h1_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d_inner = cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2) * h)
    n_heads = int(cfg.get("mamba_n_heads", 128))
    d_head = cfg.get("mamba_d_head", "auto")
    rms = bool(cfg.get("mamba_rms_norm", False))
    ssm = dict(
        kind="mamba2",
        d_inner=int(d_inner),
        n_heads=n_heads,
        head_dim=int(d_inner) // n_heads if d_head in ("auto", None) else int(d_head),
        state_size=int(cfg.get("mamba_d_state", 256)),
        n_groups=int(cfg.get("mamba_n_groups", 1)),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        out_bias=bool(cfg.get("projectors_bias", False)),
        dt_limit=_dt_limit(cfg),
        residual_in_fp32=False,
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        # "gated": norm(y * silu(z)) (Mamba2); "norm_gate": norm(y) * silu(z); "none": y * silu(z)
        gate_norm=("norm_gate" if cfg.get("mamba_norm_before_gate", True) else "gated")
        if rms
        else "none",
    )
    if ssm["n_heads"] * ssm["head_dim"] != ssm["d_inner"]:
        raise ValueError("FalconH1: mamba_n_heads * mamba_d_head != the Mamba intermediate size")
    bias = bool(cfg.get("attention_bias", False))
    mup = dict(
        ssm_in=float(cfg.get("ssm_in_multiplier", 1.0)),
        ssm=[float(v) for v in (cfg.get("ssm_multipliers") or [1.0] * 5)],
        ssm_out=float(cfg.get("ssm_out_multiplier", 1.0)),
        attention_in=float(cfg.get("attention_in_multiplier", 1.0)),
        attention_out=float(cfg.get("attention_out_multiplier", 1.0)),
        key=float(cfg.get("key_multiplier", 1.0)),
        mlp=[float(v) for v in (cfg.get("mlp_multipliers") or [1.0, 1.0])],
    )
    kw.update(
        family="hybrid",
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        logits_scaling=1.0 / float(cfg.get("lm_head_multiplier", 1.0)),
        extra={"ssm": ssm, "layer_kinds": ["parallel"] * n_layers, "mup": mup},
    )
    return ModelSpec(**kw)


def _mup_rows(spec: ModelSpec) -> np.ndarray:
    """Falcon-H1's per-row in_proj multipliers [I + (I + 2GN) + Hs] (z | x | B | C | dt)."""
    s, m = spec.extra["ssm"], spec.extra["mup"]["ssm"]
    i, gn = s["d_inner"], s["n_groups"] * s["state_size"]
    sizes = [i, i, gn, gn, s["n_heads"]]
    return np.concatenate([np.full(n, v, np.float32) for n, v in zip(sizes, m, strict=True)])


def _scaled(w: np.ndarray, scale: float | np.ndarray) -> np.ndarray:
    """w * scale in float32, back in w's dtype (scale per row when an array)."""
    if isinstance(scale, np.ndarray) and w.ndim == 2:
        scale = scale[:, None]
    return (w.astype(np.float32) * scale).astype(w.dtype)


def falcon_h1_convert(
    name: str, w: np.ndarray, spec: ModelSpec
) -> Iterable[tuple[str, np.ndarray]]:
    """Bamba names (hybrid_convert: mamba -> mixer, feed_forward -> mlp, pre_ff_layernorm ->
    post_attention_layernorm, final_layernorm -> norm) with the muP multipliers folded in
    (module docstring)."""
    pairs = list(hybrid_convert(name, w, spec))
    if not pairs:
        return []
    name, w = pairs[0]
    m = spec.extra["mup"]
    leaf = name.rsplit(".", 2)
    mod, kind = (leaf[-2], leaf[-1]) if len(leaf) == 3 else ("", "")
    one = 1.0
    # (weight scale, bias scale) of the linear maps the multipliers touch.
    scales: tuple[float | np.ndarray, float | np.ndarray] = (one, one)
    if ".mixer." in name and mod == "in_proj":
        rows = _mup_rows(spec)
        scales = (rows * m["ssm_in"], rows)
    elif ".mixer." in name and mod == "out_proj":
        scales = (m["ssm_out"], m["ssm_out"])
    elif ".self_attn." in name and mod in ("q_proj", "v_proj"):
        scales = (m["attention_in"], one)
    elif ".self_attn." in name and mod == "k_proj":
        scales = (m["key"] * m["attention_in"], m["key"])
    elif ".self_attn." in name and mod == "o_proj":
        scales = (m["attention_out"], m["attention_out"])
    elif ".mlp." in name and mod == "gate_proj":
        scales = (m["mlp"][0], m["mlp"][0])
    elif ".mlp." in name and mod == "down_proj":
        scales = (m["mlp"][1], m["mlp"][1])
    if kind == "bias":
        scale = scales[1]
    elif kind == "weight" and w.dtype.kind not in "iub":
        scale = scales[0]
    elif np.any(np.asarray(scales[0]) != 1.0):  # packed / integer codes (GPTQ, AWQ, ...)
        raise ValueError(
            f"FalconH1: cannot fold its muP multipliers into the quantized tensor {name!r}"
            " (only float checkpoints are supported)"
        )
    else:
        scale = one
    if isinstance(scale, np.ndarray) or scale != 1.0:
        w = _scaled(w, scale)
    return [(name, w)]


register_architecture(
    ["Lfm2ForCausalLM"], ArchAdapter(family="hybrid", build_spec=lfm2_spec, convert=lfm2_convert)
)
register_architecture(
    ["Lfm2MoeForCausalLM"],
    ArchAdapter(family="hybrid", build_spec=lfm2_moe_spec, convert=lfm2_convert),
)
register_architecture(
    ["NemotronHForCausalLM"],
    ArchAdapter(family="hybrid", build_spec=nemotron_h_spec, convert=nemotron_h_convert),
)
register_architecture(
    ["FalconH1ForCausalLM"],
    ArchAdapter(family="hybrid", build_spec=falcon_h1_spec, convert=falcon_h1_convert),
)
