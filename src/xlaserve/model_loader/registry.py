"""HF `architectures` name -> adapter (ModelSpec builder + weight-name map), one table both
backends use. Adding an architecture = one `ArchAdapter` here, or for a variation of an existing
family one `LlamaLike` in `families.py` (no backend code; docs/adding_an_architecture.md), + (if
it needs a new block structure) one model file per backend."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from xlaserve.model_loader.spec import ModelSpec

# (hf_name, array, spec) -> canonical (name, array) pairs; [] drops the tensor.
WeightConverter = Callable[[str, np.ndarray, ModelSpec], Iterable[tuple[str, np.ndarray]]]


@dataclass(frozen=True)
class ArchAdapter:
    family: str
    build_spec: Callable[[dict, str], ModelSpec]
    convert: WeightConverter


_ADAPTERS: dict[str, ArchAdapter] = {}


def register_architecture(names: list[str], adapter: ArchAdapter) -> None:
    for name in names:
        _ADAPTERS[name] = adapter


def supported_architectures() -> list[str]:
    return sorted(_ADAPTERS)


def get_adapter(architecture: str) -> ArchAdapter:
    if architecture not in _ADAPTERS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    return _ADAPTERS[architecture]


def _eos_ids(cfg: dict, model_dir: str) -> list[int]:
    ids: list[int] = []
    gen = os.path.join(model_dir, "generation_config.json") if model_dir else ""
    sources = [cfg]
    if gen and os.path.exists(gen):
        with open(gen) as f:
            sources.insert(0, json.load(f))
    for src in sources:
        v = src.get("eos_token_id")
        if v is None:
            continue
        for t in v if isinstance(v, list) else [v]:
            if t not in ids:
                ids.append(int(t))
    return ids


def base_spec_kwargs(cfg: dict, model_dir: str) -> dict:
    """Fields common to most HF decoder configs."""
    n_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    return dict(
        architecture=cfg["architectures"][0],
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", 4 * hidden),
        num_layers=cfg["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or hidden // n_heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        model_dir=model_dir,
        checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6)),
        rope_theta=float(
            cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        ),
        rope_scaling=_rope_scaling(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg, model_dir),
        activation=_act(cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))),
    )


def _rope_scaling(cfg: dict) -> dict | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    rs = dict(rs)
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    rs["rope_type"] = kind
    return rs


def _act(name: str) -> str:
    return {
        "silu": "silu",
        "swish": "silu",
        "gelu": "gelu",
        "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_fast": "gelu_tanh",
        "relu": "relu",
    }.get(name, name)


_LAYER_RE = re.compile(r"^model\.")


def llama_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    """Llama-layout checkpoints: canonical name = HF name without the `model.` prefix."""
    if "rotary_emb" in name:
        return []
    if name == "lm_head.weight" and spec.tie_word_embeddings:
        return []
    return [(_LAYER_RE.sub("", name), w)]


def llama_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    arch = kw["architecture"]
    kw.update(
        family="llama",
        qkv_bias=bool(cfg.get("attention_bias", arch.startswith("Qwen2"))),
        o_bias=bool(cfg.get("attention_bias", False)) and not arch.startswith("Qwen2"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch.startswith("Qwen3"),
    )
    sw = cfg.get("sliding_window")
    if sw and (cfg.get("use_sliding_window", True) or arch.startswith("Mistral")):
        if arch.startswith(("Qwen2", "Qwen3")):
            # Qwen: sliding only in layers >= max_window_layers, and only when enabled.
            if cfg.get("use_sliding_window", False):
                mwl = cfg.get("max_window_layers", kw["num_layers"])
                kw["sliding_window"] = sw
                kw["layer_types"] = cfg.get("layer_types") or [
                    "sliding" if i >= mwl else "full" for i in range(kw["num_layers"])
                ]
        else:
            kw["sliding_window"] = sw
    return ModelSpec(**kw)


register_architecture(
    ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"],
    ArchAdapter(family="llama", build_spec=llama_spec, convert=llama_convert),
)


# ---- helpers shared by the adapters below -------------------------------------------------------

# A converter may emit one expert's slice of a stacked canonical tensor as "name@j" (expert j);
# `iter_canonical_weights` stacks the E slices into "name" [E, ...] once all have arrived.
EXPERT_SEP = "@"


def _rope_params(cfg: dict) -> dict:
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})


def _partial_rotary(cfg: dict, default: float = 1.0) -> float:
    v = cfg.get("partial_rotary_factor", _rope_params(cfg).get("partial_rotary_factor"))
    return float(default if v is None else v)


def _strip(name: str, *prefixes: str) -> str:
    for p in prefixes:
        if name.startswith(p):
            return name[len(p) :]
    return name


def _rename(name: str, table: list[tuple[str, str]]) -> str:
    for a, b in table:
        name = name.replace(a, b)
    return name


def _tied_or_rotary(name: str, spec: ModelSpec) -> bool:
    """True for tensors every converter drops: rotary buffers, a tied lm_head."""
    return "rotary_emb" in name or (name == "lm_head.weight" and spec.tie_word_embeddings)


_EXPERT_RE = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_NAMES = {
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
    "w1": "w_gate",
    "w3": "w_up",
    "w2": "w_down",
}


def _moe_names(name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """Per-expert HF tensors -> stacked canonical slices; also transformers-v5 fused 3-D experts.
    None when `name` is not an expert/router tensor."""
    m = _EXPERT_RE.match(name)
    if m:
        base, j, kind = m.groups()
        return [(f"{base}.experts.{_EXPERT_NAMES[kind]}{EXPERT_SEP}{j}", w)]
    if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H] (gate first)
        base = name[: -len(".gate_up_proj")]
        half = w.shape[1] // 2
        return [(f"{base}.w_gate", w[:, :half]), (f"{base}.w_up", w[:, half:])]
    if name.endswith(".experts.down_proj"):  # [E, H, I]
        return [(name[: -len("down_proj")] + "w_down", w)]
    return None


# ---- Gemma, Gemma2, Gemma3 (text) ----------------------------------------------------------------

_GEMMA_NORMS = [
    # HF sandwich names -> canonical (the order matters: post_attention first).
    (".post_attention_layernorm.", ".post_attn_out_norm."),
    (".pre_feedforward_layernorm.", ".post_attention_layernorm."),
    (".post_feedforward_layernorm.", ".post_mlp_out_norm."),
]


def gemma_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    if _tied_or_rotary(name, spec):
        return []
    name = _strip(name, "model.language_model.", "model.")
    if spec.sandwich_norms:
        name = _rename(name, _GEMMA_NORMS)
    return [(name, w)]


def gemma_spec(cfg: dict, model_dir: str) -> ModelSpec:
    """Gemma (1): offset norms, sqrt(H) embedding scale, gelu_tanh. Gemma2: + sandwich norms,
    attention/final soft-caps, alternating sliding windows, query_pre_attn_scalar. Gemma3 text:
    + qk-norm, per-layer-type rope (local theta on sliding layers), no soft-caps by default."""
    kw = base_spec_kwargs(cfg, model_dir)
    arch = kw["architecture"]
    kw.update(
        family="gemma",
        norm_weight_offset=1.0,
        embedding_multiplier=float(kw["hidden_size"]) ** 0.5,
        activation=_act(
            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        ),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
    )
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        kw.update(
            sandwich_norms=True,
            attn_scale=float(cfg.get("query_pre_attn_scalar") or kw["head_dim"]) ** -0.5,
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            sliding_window=cfg.get("sliding_window"),
            layer_types=cfg.get("layer_types")
            or ["sliding" if i % 2 == 0 else "full" for i in range(kw["num_layers"])],
        )
    if arch == "Gemma3ForCausalLM":
        kw["qk_norm"] = True
        rp = _rope_params(cfg)
        if "full_attention" in rp:  # transformers v5: rope parameters per layer type
            full, local = rp["full_attention"], rp.get("sliding_attention", {})
            kw["rope_theta"] = float(full.get("rope_theta", 1e6))
            kw["rope_scaling"] = _rope_scaling({"rope_parameters": full})
            kw["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
        else:
            kw["rope_theta"] = float(cfg.get("rope_theta", 1e6))
            kw["rope_local_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
    return ModelSpec(**kw)


register_architecture(
    ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"],
    ArchAdapter(family="gemma", build_spec=gemma_spec, convert=gemma_convert),
)


# ---- Phi3 (fused qkv_proj / gate_up_proj, split here) -------------------------------------------


def phi3_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    if _tied_or_rotary(name, spec):
        return []
    name = _strip(name, "model.")
    if name.endswith("self_attn.qkv_proj.weight"):
        base = name[: -len("qkv_proj.weight")]
        q, kv = spec.q_size, spec.kv_size
        return [
            (base + "q_proj.weight", w[:q]),
            (base + "k_proj.weight", w[q : q + kv]),
            (base + "v_proj.weight", w[q + kv :]),
        ]
    if name.endswith("mlp.gate_up_proj.weight"):
        base = name[: -len("gate_up_proj.weight")]
        i = spec.intermediate_size
        return [(base + "gate_proj.weight", w[:i]), (base + "up_proj.weight", w[i:])]
    return [(name, w)]


def phi3_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    kw.update(family="llama", partial_rotary_factor=_partial_rotary(cfg))
    if cfg.get("sliding_window"):
        kw["sliding_window"] = cfg["sliding_window"]
    return ModelSpec(**kw)


register_architecture(
    ["Phi3ForCausalLM"], ArchAdapter(family="llama", build_spec=phi3_spec, convert=phi3_convert)
)


# ---- Granite (embedding / residual / attention multipliers, logits scaling) ---------------------


def granite_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    kw.update(
        family="granite",
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        attn_scale=float(cfg.get("attention_multiplier", kw["head_dim"] ** -0.5)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
    )
    return ModelSpec(**kw)


register_architecture(
    ["GraniteForCausalLM"],
    ArchAdapter(family="granite", build_spec=granite_spec, convert=llama_convert),
)


# ---- OLMo2 (post-norms only, qk-norm over the whole projection) ---------------------------------


def olmo2_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    if _tied_or_rotary(name, spec):
        return []
    name = _strip(name, "model.")
    name = _rename(
        name,
        [
            (".post_attention_layernorm.", ".post_attn_out_norm."),
            (".post_feedforward_layernorm.", ".post_mlp_out_norm."),
        ],
    )
    return [(name, w)]


def olmo2_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    kw.update(
        family="olmo2",
        pre_norms=False,
        sandwich_norms=True,
        qk_norm=True,
        qk_norm_scope="full",
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
    )
    return ModelSpec(**kw)


register_architecture(
    ["Olmo2ForCausalLM"],
    ArchAdapter(family="olmo2", build_spec=olmo2_spec, convert=olmo2_convert),
)


# ---- GPT-2 (learned positions, Conv1D weights [in, out], fused c_attn) --------------------------

_GPT2_NAMES = [
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".attn.c_proj.", ".self_attn.o_proj."),
    (".mlp.c_fc.", ".mlp.up_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
]


def gpt2_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    name = _strip(name, "transformer.")
    if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
        return []  # tied head; old checkpoints carry the causal-mask buffers
    if name == "wte.weight":
        return [("embed_tokens.weight", w)]
    if name == "wpe.weight":
        return [("embed_positions.weight", w)]
    if name.startswith("ln_f."):
        return [("norm." + name[len("ln_f.") :], w)]
    name = "layers." + _strip(name, "h.")
    if name.endswith("weight") and w.ndim == 2:
        w = np.ascontiguousarray(w.T)  # Conv1D stores [in, out]
    if ".attn.c_attn." in name:
        base, kind = name.split(".attn.c_attn.")
        q = spec.q_size
        return [
            (f"{base}.self_attn.{p}_proj.{kind}", w[i * q : (i + 1) * q])
            for i, p in enumerate("qkv")
        ]
    return [(_rename(name, _GPT2_NAMES), w)]


def gpt2_spec(cfg: dict, model_dir: str) -> ModelSpec:
    h, n = cfg["n_embd"], cfg["n_head"]
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
        raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx are not supported")
    return ModelSpec(
        architecture=cfg["architectures"][0],
        family="gpt2",
        vocab_size=cfg["vocab_size"],
        hidden_size=h,
        intermediate_size=cfg.get("n_inner") or 4 * h,
        num_layers=cfg["n_layer"],
        num_heads=n,
        num_kv_heads=n,
        head_dim=h // n,
        max_position_embeddings=cfg.get("n_positions", 1024),
        model_dir=model_dir,
        checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        norm_kind="layer",
        norm_bias=True,
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        activation=_act(cfg.get("activation_function", "gelu_new")),
        gated_mlp=False,
        position_embedding="learned",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        attn_scale=None if cfg.get("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=True,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg, model_dir),
    )


register_architecture(
    ["GPT2LMHeadModel"], ArchAdapter(family="gpt2", build_spec=gpt2_spec, convert=gpt2_convert)
)


# ---- GPT-NeoX (parallel residual, partial rotary, per-head interleaved query_key_value) ---------

_NEOX_NAMES = [
    (".attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
]


def neox_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    name = _strip(name, "gpt_neox.")
    if "rotary_emb" in name or name.endswith((".attention.bias", ".attention.masked_bias")):
        return []
    if name == "embed_in.weight":
        return [("embed_tokens.weight", w)]
    if name == "embed_out.weight":
        return [] if spec.tie_word_embeddings else [("lm_head.weight", w)]
    if name.startswith("final_layer_norm."):
        return [("norm." + name[len("final_layer_norm.") :], w)]
    if ".attention.query_key_value." in name:
        # Rows are laid out per head as [Hq, 3 (q, k, v), D].
        base, kind = name.split(".attention.query_key_value.")
        hq, d = spec.num_heads, spec.head_dim
        w3 = w.reshape(hq, 3, d, *w.shape[1:])
        return [
            (
                f"{base}.self_attn.{p}_proj.{kind}",
                np.ascontiguousarray(w3[:, i]).reshape(hq * d, *w.shape[1:]),
            )
            for i, p in enumerate("qkv")
        ]
    return [(_rename(name, _NEOX_NAMES), w)]


def neox_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    bias = bool(cfg.get("attention_bias", True))
    kw.update(
        family="gpt_neox",
        num_kv_heads=cfg["num_attention_heads"],
        norm_kind="layer",
        norm_bias=True,
        norm_eps=cfg.get("layer_norm_eps", 1e-5),
        gated_mlp=False,
        partial_rotary_factor=_partial_rotary(cfg, cfg.get("rotary_pct", 0.25)),
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=True,
    )
    return ModelSpec(**kw)


register_architecture(
    ["GPTNeoXForCausalLM"],
    ArchAdapter(family="gpt_neox", build_spec=neox_spec, convert=neox_convert),
)


# ---- StarCoder2 (LayerNorm with bias, plain GELU MLP c_fc/c_proj, sliding window) ---------------


def starcoder2_convert(
    name: str, w: np.ndarray, spec: ModelSpec
) -> Iterable[tuple[str, np.ndarray]]:
    if _tied_or_rotary(name, spec):
        return []
    name = _rename(
        _strip(name, "model."),
        [(".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj.")],
    )
    return [(name, w)]


def starcoder2_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    bias = bool(cfg.get("use_bias", True))
    kw.update(
        family="starcoder2",
        norm_kind="layer",
        norm_bias=True,
        norm_eps=cfg.get("norm_epsilon", 1e-5),
        gated_mlp=False,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        sliding_window=cfg.get("sliding_window") or None,
    )
    return ModelSpec(**kw)


register_architecture(
    ["Starcoder2ForCausalLM"],
    ArchAdapter(family="starcoder2", build_spec=starcoder2_spec, convert=starcoder2_convert),
)


# ---- Mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE ------------------------------------------


def moe_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    if _tied_or_rotary(name, spec):
        return []
    name = _strip(name, "model.").replace(".block_sparse_moe.", ".mlp.")
    moe = _moe_names(name, w)
    if moe is not None:
        return moe
    if name.endswith(".mlp.gate.weight") and w.shape[0] == spec.num_experts:
        return [(name.replace(".mlp.gate.", ".mlp.router."), w)]
    return [(name, w)]


def moe_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = llama_spec(cfg, model_dir).__dict__.copy()
    arch = kw["architecture"]
    n_layers = kw["num_layers"]
    if arch == "MixtralForCausalLM":
        kw.update(
            num_experts=cfg["num_local_experts"],
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,  # Mixtral always renormalises the top-k softmax weights
        )
    else:  # Qwen2-MoE / Qwen3-MoE
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        kw.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
            moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_mlp_layers=[i for i in range(n_layers) if i in only or (i + 1) % step != 0],
        )
        if arch == "Qwen2MoeForCausalLM":
            kw.update(
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                shared_expert_gate=True,
            )
    kw.update(family="moe", num_experts_per_tok=cfg["num_experts_per_tok"])
    return ModelSpec(**kw)


register_architecture(
    ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"],
    ArchAdapter(family="moe", build_spec=moe_spec, convert=moe_convert),
)


# ---- DeepSeek-V3 (multi-head latent attention + sigmoid group-limited MoE) ----------------------

_MLA_NAMES = [
    (".self_attn.q_a_layernorm.", ".self_attn.q_a_norm."),
    (".self_attn.kv_a_layernorm.", ".self_attn.kv_a_norm."),
    (".self_attn.kv_a_proj_with_mqa.", ".self_attn.kv_a_proj."),
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.gate.e_score_correction_bias", ".mlp.router.bias"),
    (".mlp.gate.weight", ".mlp.router.weight"),
]


def _deinterleave(n: int) -> np.ndarray:
    """Row order taking interleaved rope pairs (x0, x1), (x2, x3).. to neox halves (x0, x2.., x1, x3..)."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def mla_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    if _tied_or_rotary(name, spec):
        return []
    name = _strip(name, "model.")
    if re.match(r"^layers\.(\d+)\.", name) and int(name.split(".")[1]) >= spec.num_layers:
        return []  # multi-token-prediction layers (num_nextn_predict_layers) are not served
    moe = _moe_names(name, w)
    if moe is not None:
        return moe
    name = _rename(name, _MLA_NAMES)
    ex = spec.extra
    dn, dr = ex["qk_nope_head_dim"], ex["qk_rope_head_dim"]
    if ex.get("rope_interleave", True) and name.endswith(
        ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")
    ):
        # Per head rows [Dn nope | Dr rope]: de-interleave the rope rows (HF rope_interleave).
        hq = spec.num_heads
        w3 = w.reshape(hq, dn + dr, -1)
        perm = np.concatenate([np.arange(dn), dn + _deinterleave(dr)])
        w = np.ascontiguousarray(w3[:, perm]).reshape(w.shape)
    elif ex.get("rope_interleave", True) and name.endswith("self_attn.kv_a_proj.weight"):
        r = ex["kv_lora_rank"]
        w = np.ascontiguousarray(w[np.concatenate([np.arange(r), r + _deinterleave(dr)])])
    return [(name, w)]


def mla_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    n_heads = cfg["num_attention_heads"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    scale = (dn + dr) ** -0.5
    rs = kw["rope_scaling"] or {}
    if rs and rs.get("mscale_all_dim"):
        from xlaserve.model_loader.rope import _yarn_mscale

        m = _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale = scale * m * m
    kw.update(
        family="mla",
        num_kv_heads=n_heads,
        head_dim=dn + dr,
        attn_scale=scale,
        num_experts=cfg.get("n_routed_experts") or 0,
        num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
        shared_expert_intermediate_size=(cfg.get("moe_intermediate_size") or 0)
        * (cfg.get("n_shared_experts") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_scoring="sigmoid" if cfg.get("scoring_func", "sigmoid") == "sigmoid" else "softmax",
        moe_router_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc",
        moe_num_groups=int(cfg.get("n_group") or 1),
        moe_topk_groups=int(cfg.get("topk_group") or 1),
        moe_routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
        dense_mlp_layers=list(
            range(min(int(cfg.get("first_k_dense_replace") or 0), cfg["num_hidden_layers"]))
        ),
        extra=dict(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=dn,
            qk_rope_head_dim=dr,
            v_head_dim=dv,
            rope_interleave=bool(cfg.get("rope_interleave", True)),
        ),
    )
    if cfg.get("attention_bias"):
        raise ValueError("DeepSeek-V3 with attention_bias=True is not supported")
    return ModelSpec(**kw)


register_architecture(
    ["DeepseekV3ForCausalLM"],
    ArchAdapter(family="mla", build_spec=mla_spec, convert=mla_convert),
)


def _stack_experts(
    pairs: Iterable[tuple[str, np.ndarray]], spec: ModelSpec
) -> Iterator[tuple[str, np.ndarray]]:
    """Passes pairs through, stacking "name@j" expert slices into "name" [E, ...] once complete."""
    pending: dict[str, dict[int, np.ndarray]] = {}
    for name, w in pairs:
        if EXPERT_SEP not in name:
            yield name, w
            continue
        base, _, j = name.rpartition(EXPERT_SEP)
        slot = pending.setdefault(base, {})
        slot[int(j)] = w
        if len(slot) == spec.num_experts:
            yield base, np.stack([slot[e] for e in range(spec.num_experts)])
            del pending[base]
    if pending:
        name, got = next(iter(pending.items()))
        raise ValueError(
            f"checkpoint has {len(got)} of {spec.num_experts} experts for {name} "
            f"(+{len(pending) - 1} more incomplete expert tensors)"
        )


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{model_dir}: config.json not found (expected an HF-layout model directory)"
        )
    with open(path) as f:
        cfg = json.load(f)
    if not cfg.get("architectures"):
        raise ValueError(f"{path}: no 'architectures' field")
    return cfg


def build_spec(model_dir: str) -> ModelSpec:
    cfg = read_hf_config(model_dir)
    adapter = get_adapter(cfg["architectures"][0])
    return adapter.build_spec(cfg, model_dir)


def iter_canonical_weights(
    spec: ModelSpec, load_format: str = "auto"
) -> Iterator[tuple[str, np.ndarray]]:
    """Canonical (name, array) pairs for `spec`'s checkpoint, converted by its adapter."""
    from xlaserve.model_loader.weights import iter_pickle, iter_safetensors

    if spec.model_dir is None:
        raise ValueError("spec has no model_dir to read weights from")
    adapter = get_adapter(spec.architecture)
    source = (
        iter_pickle(spec.model_dir) if load_format == "pt" else iter_safetensors(spec.model_dir)
    )
    converted = (pair for name, w in source for pair in adapter.convert(name, w, spec))
    # Pre-quantized checkpoints (GPTQ/AWQ/compressed-tensors): per-layer tensors -> canonical
    # X.qweight/X.scales/X.qzeros layouts; a no-op for float checkpoints.
    from xlaserve.quantization.hf_formats import prequantized_stream

    yield from prequantized_stream(_stack_experts(converted, spec), spec.model_dir)


# Families declared as data (LlamaLike adapters: no backend code); registers on import.
from xlaserve.model_loader import families as _families  # noqa: E402, F401

# Qwen3-Next (gated delta-net linear attention + gated attention + MoE; issue 25 part A).
from xlaserve.model_loader import qwen3_next as _qwen3_next  # noqa: E402,F401

# State-space architectures (Mamba, Mamba2) register themselves in their own module.
from xlaserve.model_loader import ssm as _ssm  # noqa: E402,F401
