"""Architectures added as data: a `LlamaLike` adapter (ModelSpec field overrides + a weight-name
map) per family, served by the generic decoder of both backends with no backend code.

A Llama-like family is ~10-30 lines here (see docs/adding_an_architecture.md):

    register_llama_like(
        ["HeliumForCausalLM"],
        LlamaLike(fields=lambda cfg, kw: dict(qkv_bias=cfg.get("attention_bias", False)),
                  interleaved_rope=True),
    )

What `LlamaLike.convert` does for every family, so adapters only declare what differs:
- drops rotary buffers, a tied lm_head and attention-mask buffers; strips `prefixes`;
- renames by `renames` (regex -> replacement, in order) into the canonical names of spec.py;
- splits fused projections: `qkv_proj` ([q; k; v] rows), `gate_up_proj` ([gate; up] rows), and
  the per-family layouts of `split_qkv` (per-head interleaved, Falcon grouped);
- stacks per-expert / transformers-v5 fused expert tensors (`_moe_names`), router -> mlp.router;
- `interleaved_rope`: GLM / Cohere / GPT-J style rope pairs (x0, x1), (x2, x3).. become the
  rotate-half layout both backends use by permuting q / k rows (and per-head qk-norm weights)
  inside each head; attention scores are unchanged (q and k get the same permutation);
- `norm_plus_one`: LayerNorm1P (Nemotron) stores w and applies (1 + w): +1 on load;
- `shared_norm`: one norm feeds attention and MLP of a parallel block (Cohere, Phi, GPT-J,
  Falcon): its weights are loaded as both input_layernorm and post_attention_layernorm.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from xlaserve.model_loader.registry import (
    ArchAdapter,
    _act,
    _deinterleave,
    _moe_names,
    _partial_rotary,
    _rope_params,
    _rope_scaling,
    base_spec_kwargs,
    register_architecture,
)
from xlaserve.model_loader.spec import ModelSpec

# (HF config dict, base ModelSpec kwargs) -> ModelSpec field overrides.
SpecFields = Callable[[dict, dict], dict]


def split_qkv(w: np.ndarray, spec: ModelSpec, layout: str) -> list[np.ndarray]:
    """A fused q/k/v tensor (rows first) -> [q, k, v]. layout: "concat" ([q; k; v]), "per_head"
    ([Hq, 3, D]: GPT-NeoX, Falcon-7B-style non-MQA), "grouped" ([Hkv, G + 2, D]: G query heads,
    then k, then v per KV group; Falcon new_decoder_architecture)."""
    tail = w.shape[1:]
    d, hq, hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    if layout == "concat":
        q, kv = spec.q_size, spec.kv_size
        return [w[:q], w[q : q + kv], w[q + kv :]]
    if layout == "per_head":
        w3 = w.reshape(hq, 3, d, *tail)
        return [np.ascontiguousarray(w3[:, i]).reshape(hq * d, *tail) for i in range(3)]
    if layout == "grouped":
        g = hq // hkv
        w4 = w.reshape(hkv, g + 2, d, *tail)
        return [
            np.ascontiguousarray(w4[:, :g]).reshape(hq * d, *tail),
            np.ascontiguousarray(w4[:, g]).reshape(hkv * d, *tail),
            np.ascontiguousarray(w4[:, g + 1]).reshape(hkv * d, *tail),
        ]
    raise ValueError(f"unknown fused qkv layout {layout!r}")


def _rope_row_perm(spec: ModelSpec) -> np.ndarray:
    """Per-head row order taking interleaved rope pairs over the first rotary_dim dims to the
    rotate-half layout (the pass-through dims keep their place)."""
    r, d = spec.rotary_dim, spec.head_dim
    return np.concatenate([_deinterleave(r), np.arange(r, d)])


def _deinterleave_heads(w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    d = spec.head_dim
    heads = w.shape[0] // d
    w3 = w.reshape(heads, d, *w.shape[1:])
    return np.ascontiguousarray(w3[:, _rope_row_perm(spec)]).reshape(w.shape)


_DROP = ("rotary_emb", ".attn.bias", ".attn.masked_bias", ".attention.masked_bias")
_QK = re.compile(r"\.self_attn\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")


@dataclass(frozen=True)
class LlamaLike:
    """A family served by the generic decoder: ModelSpec fields from config.json + a weight map.

    fields: overrides on top of `base_spec_kwargs` (family "llama" unless set there).
    renames: (regex, replacement) applied in order after the prefix strip.
    qkv_layout: how a fused `self_attn.qkv_proj` tensor is laid out (see `split_qkv`).
    """

    fields: SpecFields | None = None
    renames: tuple[tuple[str, str], ...] = ()
    prefixes: tuple[str, ...] = ("model.",)
    qkv_layout: str = "concat"
    interleaved_rope: bool = False
    norm_plus_one: bool = False
    shared_norm: bool = False
    family: str = "llama"

    def build_spec(self, cfg: dict, model_dir: str) -> ModelSpec:
        kw = base_spec_kwargs(cfg, model_dir)
        kw["family"] = self.family
        if self.fields is not None:
            kw.update(self.fields(cfg, kw))
        return ModelSpec(**kw)

    def convert(
        self, name: str, w: np.ndarray, spec: ModelSpec
    ) -> Iterable[tuple[str, np.ndarray]]:
        if any(s in name for s in _DROP) or (name == "lm_head.weight" and spec.tie_word_embeddings):
            return []
        for p in self.prefixes:
            if name.startswith(p):
                name = name[len(p) :]
                break
        for pat, rep in self.renames:
            name = re.sub(pat, rep, name)
        moe = _moe_names(name, w)
        if moe is not None:
            return moe
        if name.endswith(".mlp.gate.weight") and w.shape[0] == spec.num_experts:
            return [(name.replace(".mlp.gate.", ".mlp.router."), w)]
        out: list[tuple[str, np.ndarray]] = [(name, w)]
        if ".self_attn.qkv_proj." in name:
            base, kind = name.split(".self_attn.qkv_proj.")
            parts = split_qkv(w, spec, spec.extra.get("qkv_layout", self.qkv_layout))
            out = [
                (f"{base}.self_attn.{p}_proj.{kind}", a) for p, a in zip("qkv", parts, strict=True)
            ]
        elif ".mlp.gate_up_proj." in name and w.shape[0] == 2 * spec.intermediate_size:
            base, kind = name.split(".mlp.gate_up_proj.")
            i = spec.intermediate_size
            out = [(f"{base}.mlp.gate_proj.{kind}", w[:i]), (f"{base}.mlp.up_proj.{kind}", w[i:])]
        if self.interleaved_rope:
            out = [
                (
                    n,
                    _deinterleave_heads(a, spec)
                    if _QK.search(n) and a.shape[0] % spec.head_dim == 0
                    else a,
                )
                for n, a in out
            ]
        if self.norm_plus_one:
            out = [(n, a + 1 if "norm." in n and n.endswith("weight") else a) for n, a in out]
        if spec.extra.get("shared_norm", self.shared_norm):
            out += [
                (n.replace(".input_layernorm.", ".post_attention_layernorm."), a)
                for n, a in out
                if ".input_layernorm." in n
            ]
        return out


def register_llama_like(names: list[str], adapter: LlamaLike) -> None:
    register_architecture(
        names,
        ArchAdapter(family=adapter.family, build_spec=adapter.build_spec, convert=adapter.convert),
    )


def _unsupported(cfg: dict, **flags: object) -> None:
    """ValueError naming the first config flag set to a value we do not serve."""
    arch = cfg["architectures"][0]
    for key, bad in flags.items():
        if cfg.get(key) == bad or (bad is True and cfg.get(key)):
            raise ValueError(f"{arch} with {key}={cfg.get(key)!r} is not supported")


def _sliding(cfg: dict, kw: dict) -> dict:
    """sliding_window / layer_types as HF writes them (None when the model has no sliding layers)."""
    lt = list(cfg.get("layer_types") or []) or None
    sw = cfg.get("sliding_window")
    if not sw or (lt is not None and not any(t.startswith("sliding") for t in lt)):
        return {}
    return dict(sliding_window=sw, layer_types=lt)


def _layer_norm_plain_mlp(eps: float, bias: bool, norm_bias: bool = True) -> dict:
    """LayerNorm blocks with a plain (ungated) MLP: the fields GPT-style families share. `bias`:
    biases on the MLP and the q/k/v/o projections; norm_bias: the LayerNorms' own bias."""
    return dict(
        norm_kind="layer",
        norm_bias=norm_bias,
        norm_eps=eps,
        gated_mlp=False,
        mlp_bias=bias,
        qkv_bias=bias,
        o_bias=bias,
    )


# ---- Llama-like: RMS pre-norms, rope, gated MLP ------------------------------------------------

register_llama_like(  # Helium (Kyutai): interleaved rope, qkv bias
    ["HeliumForCausalLM"],
    LlamaLike(
        fields=lambda cfg, kw: dict(
            qkv_bias=bool(cfg.get("attention_bias")), mlp_bias=bool(cfg.get("mlp_bias"))
        ),
        interleaved_rope=True,
    ),
)

register_llama_like(  # Seed-OSS (ByteDance): qkv bias, separate o_proj bias flag
    ["SeedOssForCausalLM"],
    LlamaLike(
        fields=lambda cfg, kw: dict(
            qkv_bias=bool(cfg.get("attention_bias", True)),
            o_bias=bool(cfg.get("attention_out_bias")),
            mlp_bias=bool(cfg.get("mlp_bias")),
        )
    ),
)

register_llama_like(  # ERNIE 4.5 (Baidu): interleaved rope, one bias flag for every projection
    ["Ernie4_5ForCausalLM"],
    LlamaLike(
        fields=lambda cfg, kw: dict(
            qkv_bias=bool(cfg.get("use_bias")),
            o_bias=bool(cfg.get("use_bias")),
            mlp_bias=bool(cfg.get("use_bias")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        ),
        interleaved_rope=True,
    ),
)

register_llama_like(  # Arcee (AFM): plain relu^2 MLP (up / down, no gate)
    ["ArceeForCausalLM"],
    LlamaLike(fields=lambda cfg, kw: dict(gated_mlp=False, mlp_bias=bool(cfg.get("mlp_bias")))),
)

register_llama_like(  # Ministral, CWM (Code World Model): per-layer sliding / full attention
    ["MinistralForCausalLM", "CwmForCausalLM"],
    LlamaLike(fields=lambda cfg, kw: _sliding(cfg, kw)),
)


def _smollm3(cfg: dict, kw: dict) -> dict:
    n = kw["num_layers"]
    use = cfg.get("no_rope_layers") or [
        int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0) for i in range(n)
    ]
    out = dict(nope_layers=[i for i in range(n) if not use[i]], mlp_bias=bool(cfg.get("mlp_bias")))
    out["qkv_bias"] = out["o_bias"] = bool(cfg.get("attention_bias"))
    if cfg.get("use_sliding_window"):
        out.update(_sliding(cfg, kw))
    return out


register_llama_like(  # SmolLM3: every 4th layer has no rope (NoPE)
    ["SmolLM3ForCausalLM"],
    LlamaLike(fields=_smollm3),
)


def _glm(cfg: dict, kw: dict) -> dict:
    return dict(
        qkv_bias=bool(cfg.get("attention_bias", True)),
        partial_rotary_factor=_partial_rotary(cfg, 0.5),
    )


_GLM4_NORMS = (
    (r"\.post_self_attn_layernorm\.", ".post_attn_out_norm."),
    (r"\.post_mlp_layernorm\.", ".post_mlp_out_norm."),
)
register_llama_like(  # GLM (ChatGLM-4 on transformers): fused gate_up, interleaved partial rope
    ["GlmForCausalLM"],
    LlamaLike(fields=_glm, interleaved_rope=True),
)
register_llama_like(  # GLM-4 (0414): + sandwich norms after attention and after the MLP
    ["Glm4ForCausalLM"],
    LlamaLike(
        fields=lambda cfg, kw: {**_glm(cfg, kw), "sandwich_norms": True},
        renames=_GLM4_NORMS,
        interleaved_rope=True,
    ),
)


def _nemotron(cfg: dict, kw: dict) -> dict:
    out = _layer_norm_plain_mlp(cfg.get("norm_eps", 1e-5), bool(cfg.get("attention_bias")))
    out.update(mlp_bias=bool(cfg.get("mlp_bias")), partial_rotary_factor=_partial_rotary(cfg, 0.5))
    return out


register_llama_like(  # Nemotron (NVIDIA, Minitron): LayerNorm1P, relu^2 MLP, partial rope
    ["NemotronForCausalLM"],
    LlamaLike(fields=_nemotron, norm_plus_one=True),
)


def _stablelm(cfg: dict, kw: dict) -> dict:
    _unsupported(cfg, qk_layernorm=True)
    return dict(
        norm_kind="layer",
        norm_bias=True,
        norm_eps=cfg.get("layer_norm_eps", 1e-5),
        qkv_bias=bool(cfg.get("use_qkv_bias")),
        partial_rotary_factor=_partial_rotary(cfg, 0.25),
        parallel_residual=bool(cfg.get("use_parallel_residual")),
    )


register_llama_like(  # StableLM (2, Zephyr): LayerNorm, partial rope, optional parallel block
    ["StableLmForCausalLM"],
    LlamaLike(fields=_stablelm, shared_norm=True),
)


def _cohere(cfg: dict, kw: dict) -> dict:
    _unsupported(cfg, use_qk_norm=True)
    out = dict(
        norm_kind="layer",
        norm_eps=cfg.get("layer_norm_eps", 1e-5),
        parallel_residual=True,
        qkv_bias=bool(cfg.get("attention_bias")),
        o_bias=bool(cfg.get("attention_bias")),
        logits_scaling=1.0 / float(cfg.get("logit_scale") or 1.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )
    if cfg["architectures"][0] == "Cohere2ForCausalLM":  # rope on sliding layers only
        out.update(_sliding(cfg, kw), nope_layers=_full_layers(cfg, kw["num_layers"]))
    return out


register_llama_like(  # Cohere Command-R / Command-R7B: parallel block with one LayerNorm (no
    # bias), interleaved rope, logit scale; Cohere2 + sliding layers, NoPE full layers
    ["CohereForCausalLM", "Cohere2ForCausalLM"],
    LlamaLike(fields=_cohere, interleaved_rope=True, shared_norm=True),
)


# ---- post-norm (OLMo2-like) families -----------------------------------------------------------

_POST_NORMS = (
    (r"\.post_attention_layernorm\.", ".post_attn_out_norm."),
    (r"\.post_feedforward_layernorm\.", ".post_mlp_out_norm."),
)


def _olmo3(cfg: dict, kw: dict) -> dict:
    out = dict(pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_scope="full")
    out.update(_sliding(cfg, kw))
    rp = _rope_params(cfg)
    if "full_attention" in rp:  # rope parameters per layer type
        full, local = rp["full_attention"], rp.get("sliding_attention") or {}
        out["rope_theta"] = float(full.get("rope_theta", kw["rope_theta"]))
        out["rope_scaling"] = _rope_scaling({"rope_parameters": full})
        if out.get("sliding_window"):
            out["rope_local_theta"] = float(local.get("rope_theta", out["rope_theta"]))
    return out


register_llama_like(  # OLMo 3: OLMo2 + sliding layers (3 of 4), full layers may scale rope
    ["Olmo3ForCausalLM"],
    LlamaLike(fields=_olmo3, renames=_POST_NORMS, family="olmo2"),
)


def _full_layers(cfg: dict, n: int) -> list[int]:
    """Layers that are not sliding-window layers by config.layer_types (all when it is absent)."""
    lt = cfg.get("layer_types") or ["full_attention"] * n
    return [i for i, t in enumerate(lt) if not t.startswith("sliding")]


def _exaone4(cfg: dict, kw: dict) -> dict:
    out = dict(pre_norms=False, sandwich_norms=True, qk_norm=True, **_sliding(cfg, kw))
    if cfg.get("sliding_window"):  # hybrid: full-attention layers use no rope
        out["nope_layers"] = _full_layers(cfg, kw["num_layers"])
    return out


register_llama_like(  # EXAONE 4.0 (LG): post-norms, per-head qk-norm, NoPE full layers
    ["Exaone4ForCausalLM"],
    LlamaLike(fields=_exaone4, renames=_POST_NORMS, family="olmo2"),
)


# ---- MoE families ------------------------------------------------------------------------------


def _olmoe(cfg: dict, kw: dict) -> dict:
    _unsupported(cfg, clip_qkv=True)
    return dict(
        qk_norm=True,
        qk_norm_scope="full",
        num_experts=cfg["num_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob")),
        qkv_bias=bool(cfg.get("attention_bias")),
        o_bias=bool(cfg.get("attention_bias")),
    )


register_llama_like(  # OLMoE: softmax top-k MoE, qk-norm over the whole projection
    ["OlmoeForCausalLM"],
    LlamaLike(fields=_olmoe, family="moe"),
)


def _granitemoe(cfg: dict, kw: dict) -> dict:
    return dict(
        qkv_bias=bool(cfg.get("attention_bias")),
        o_bias=bool(cfg.get("attention_bias")),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        attn_scale=float(cfg.get("attention_multiplier", kw["head_dim"] ** -0.5)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        num_experts=cfg["num_local_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,  # softmax over the top-k logits == renormalised top-k softmax
        shared_expert_intermediate_size=int(cfg.get("shared_intermediate_size") or 0),
    )


_GRANITE_MOE_NAMES = (
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"\.mlp\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
    (r"\.mlp\.output_linear\.weight$", ".mlp.experts.down_proj"),
    (r"\.mlp\.router\.layer\.weight$", ".mlp.router.weight"),
    (r"\.shared_mlp\.input_linear\.", ".mlp.shared_expert.gate_up_proj."),
    (r"\.shared_mlp\.output_linear\.", ".mlp.shared_expert.down_proj."),
)
_GRANITE_MOE = LlamaLike(fields=_granitemoe, renames=_GRANITE_MOE_NAMES, family="moe")


def _granitemoe_convert(
    name: str, w: np.ndarray, spec: ModelSpec
) -> Iterable[tuple[str, np.ndarray]]:
    out = []
    for n, a in _GRANITE_MOE.convert(name, w, spec):
        if ".mlp.shared_expert.gate_up_proj." in n:  # [2 Is, H]: gate rows, then up rows
            half = a.shape[0] // 2
            out += [
                (n.replace(".gate_up_proj.", ".gate_proj."), a[:half]),
                (n.replace(".gate_up_proj.", ".up_proj."), a[half:]),
            ]
        else:
            out.append((n, a))
    return out


register_architecture(  # Granite-MoE (3.0 / 3.1 MoE), + a shared expert (GraniteMoeShared)
    ["GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"],
    ArchAdapter(family="moe", build_spec=_GRANITE_MOE.build_spec, convert=_granitemoe_convert),
)


# ---- GPT-style families (LayerNorm, plain MLP) -------------------------------------------------


def _gpt_base(cfg: dict, kw: dict, *, h: str, n: str, inner: str, eps: str) -> dict:
    hidden, heads = cfg[h], cfg[n]
    return dict(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=cfg.get(inner) or 4 * hidden,
        norm_kind="layer",
        norm_bias=True,
        norm_eps=cfg.get(eps, 1e-5),
        gated_mlp=False,
        mlp_bias=True,
    )


def _kw_gpt(cfg: dict) -> dict:
    """Config keys GPT-2-style configs name differently, mapped for base_spec_kwargs."""
    return {
        **cfg,
        "hidden_size": cfg.get("n_embd", cfg.get("hidden_size")),
        "num_attention_heads": cfg.get("n_head", cfg.get("num_attention_heads")),
        "num_hidden_layers": cfg.get("n_layer", cfg.get("num_hidden_layers")),
        "max_position_embeddings": cfg.get("n_positions", cfg.get("max_position_embeddings")),
    }


class _GptLike(LlamaLike):
    def build_spec(self, cfg: dict, model_dir: str) -> ModelSpec:
        return super().build_spec(_kw_gpt(cfg), model_dir)


def _gptj(cfg: dict, kw: dict) -> dict:
    out = _gpt_base(cfg, kw, h="n_embd", n="n_head", inner="n_inner", eps="layer_norm_epsilon")
    d = out["head_dim"]
    out.update(
        activation=_act(cfg.get("activation_function", "gelu_new")),
        partial_rotary_factor=(cfg.get("rotary_dim") or d) / d,
        parallel_residual=True,
        lm_head_bias=True,
    )
    return out


register_llama_like(  # GPT-J: parallel block (one LayerNorm), interleaved partial rope
    ["GPTJForCausalLM"],
    _GptLike(
        fields=_gptj,
        prefixes=("transformer.",),
        renames=(
            (r"^wte\.", "embed_tokens."),
            (r"^ln_f\.", "norm."),
            (r"^h\.", "layers."),
            (r"\.ln_1\.", ".input_layernorm."),
            (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
            (r"\.attn\.", ".self_attn."),
            (r"\.mlp\.fc_in\.", ".mlp.up_proj."),
            (r"\.mlp\.fc_out\.", ".mlp.down_proj."),
        ),
        interleaved_rope=True,
        shared_norm=True,
        family="gpt_neox",
    ),
)


def _phi(cfg: dict, kw: dict) -> dict:
    _unsupported(cfg, qk_layernorm=True)
    return dict(
        **_layer_norm_plain_mlp(cfg.get("layer_norm_eps", 1e-5), True),
        partial_rotary_factor=_partial_rotary(cfg, 0.5),
        parallel_residual=True,
        lm_head_bias=True,
        activation=_act(cfg.get("hidden_act", "gelu_new")),
    )


register_llama_like(  # Phi-1 / 1.5 / 2: parallel block (one LayerNorm), partial rope, lm_head bias
    ["PhiForCausalLM"],
    LlamaLike(
        fields=_phi,
        renames=(
            (r"^final_layernorm\.", "norm."),
            (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
            (r"\.mlp\.fc1\.", ".mlp.up_proj."),
            (r"\.mlp\.fc2\.", ".mlp.down_proj."),
        ),
        shared_norm=True,
        family="gpt_neox",
    ),
)


def _opt(cfg: dict, kw: dict) -> dict:
    arch = cfg["architectures"][0]
    if not cfg.get("do_layer_norm_before", True):
        raise ValueError(
            f"{arch} with do_layer_norm_before=False (post-LN, OPT-350m) is not supported"
        )
    wpd = cfg.get("word_embed_proj_dim")
    if wpd and wpd != cfg["hidden_size"]:
        raise ValueError(
            f"{arch} with word_embed_proj_dim != hidden_size (project_in/out) is not supported"
        )
    _unsupported(cfg, layer_norm_elementwise_affine=False, _remove_final_layer_norm=True)
    return dict(
        **_layer_norm_plain_mlp(1e-5, bool(cfg.get("enable_bias", True))),
        intermediate_size=cfg["ffn_dim"],
        position_embedding="learned",
        activation=_act(cfg.get("activation_function", "relu")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


_OPT = LlamaLike(
    family="gpt2",
    fields=_opt,
    prefixes=("model.decoder.", "decoder."),
    renames=(
        (r"^final_layer_norm\.", "norm."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.self_attn_layer_norm\.", ".input_layernorm."),
        (r"\.final_layer_norm\.", ".post_attention_layernorm."),
        (r"\.fc1\.", ".mlp.up_proj."),
        (r"\.fc2\.", ".mlp.down_proj."),
    ),
)


def _opt_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    out = list(_OPT.convert(name, w, spec))
    # OPT's learned positions start at row 2 (an offset kept from fairseq).
    return [(n, a[2:] if n == "embed_positions.weight" else a) for n, a in out]


register_architecture(  # OPT: learned positions (offset 2), LayerNorm, ReLU MLP
    ["OPTForCausalLM"], ArchAdapter(family="gpt2", build_spec=_OPT.build_spec, convert=_opt_convert)
)


def _bigcode(cfg: dict, kw: dict) -> dict:
    out = _gpt_base(cfg, kw, h="n_embd", n="n_head", inner="n_inner", eps="layer_norm_epsilon")
    out.update(
        num_kv_heads=1 if cfg.get("multi_query", True) else out["num_heads"],
        activation=_act(cfg.get("activation_function", "gelu_pytorch_tanh")),
        position_embedding="learned",
        qkv_bias=True,
        o_bias=True,
        attn_scale=None if cfg.get("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        extra=dict(qkv_layout="concat" if cfg.get("multi_query", True) else "per_head"),
    )
    return out


register_llama_like(  # StarCoder 1 / SantaCoder (GPTBigCode): GPT-2 with multi-query attention
    ["GPTBigCodeForCausalLM"],
    _GptLike(
        fields=_bigcode,
        prefixes=("transformer.",),
        renames=(
            (r"^wte\.", "embed_tokens."),
            (r"^wpe\.", "embed_positions."),
            (r"^ln_f\.", "norm."),
            (r"^h\.", "layers."),
            (r"\.ln_1\.", ".input_layernorm."),
            (r"\.ln_2\.", ".post_attention_layernorm."),
            (r"\.attn\.c_attn\.", ".self_attn.qkv_proj."),
            (r"\.attn\.c_proj\.", ".self_attn.o_proj."),
            (r"\.mlp\.c_fc\.", ".mlp.up_proj."),
            (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
        ),
        family="gpt2",
    ),
)


def _falcon(cfg: dict, kw: dict) -> dict:
    _unsupported(cfg, alibi=True)
    heads = cfg["num_attention_heads"]
    new = bool(cfg.get("new_decoder_architecture"))
    if new:
        kv = cfg.get("num_kv_heads") or heads
    else:
        kv = 1 if cfg.get("multi_query", True) else heads
    bias = bool(cfg.get("bias"))
    parallel = new or bool(cfg.get("parallel_attn", True))
    # new_decoder_architecture with num_ln_in_parallel_attn 2 (its default) has ln_attn + ln_mlp;
    # other parallel blocks have one input_layernorm feeding both.
    two_norms = new and (cfg.get("num_ln_in_parallel_attn") or 2) == 2
    return dict(
        num_kv_heads=kv,
        intermediate_size=cfg.get("ffn_hidden_size") or 4 * cfg["hidden_size"],
        **_layer_norm_plain_mlp(cfg.get("layer_norm_epsilon", 1e-5), bias),
        activation=_act(cfg.get("activation") or "gelu"),
        parallel_residual=parallel,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        extra=dict(
            qkv_layout="grouped" if new else ("concat" if kv == 1 else "per_head"),
            shared_norm=parallel and not two_norms,
        ),
    )


# Bloom's block tensor names, which Falcon kept: fused qkv, dense out, 4h MLP.
_BLOOM_BLOCK_NAMES = (
    (r"^ln_f\.", "norm."),
    (r"^h\.", "layers."),
    (r"\.self_attention\.query_key_value\.", ".self_attn.qkv_proj."),
    (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
)

register_llama_like(  # Falcon (7B / 40B / 180B, Falcon 2 / 3 dense): parallel block, MQA / GQA
    ["FalconForCausalLM"],
    LlamaLike(
        fields=_falcon,
        prefixes=("transformer.",),
        renames=(
            (r"^word_embeddings\.", "embed_tokens."),
            (r"\.ln_attn\.", ".input_layernorm."),
            (r"\.ln_mlp\.", ".post_attention_layernorm."),
            *_BLOOM_BLOCK_NAMES,
        ),
        family="gpt_neox",
    ),
)


# ---- DeepSeek-style MoE (shared experts, first dense layers, biased group routing) -------------

_DS_MOE_NAMES = (
    (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.router.bias"),
    (r"\.mlp\.(gate\.)?moe_statics\.e_score_correction_bias$", ".mlp.router.bias"),
)


def _ds_moe(cfg: dict, kw: dict) -> dict:
    """DeepSeek-V3-style routing (sigmoid, e_score_correction_bias, group-limited top-k) with
    shared experts and first_k_dense_replace dense layers (GLM-4.5 MoE, dots.llm1)."""
    n = kw["num_layers"]
    mi = cfg["moe_intermediate_size"]
    return dict(
        num_experts=cfg["n_routed_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=mi,
        shared_expert_intermediate_size=mi * int(cfg.get("n_shared_experts") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_scoring="sigmoid",
        moe_router_bias=True,
        moe_num_groups=int(cfg.get("n_group") or 1),
        moe_topk_groups=int(cfg.get("topk_group") or 1),
        moe_routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
        dense_mlp_layers=list(range(min(int(cfg.get("first_k_dense_replace") or 0), n))),
    )


def _glm4_moe(cfg: dict, kw: dict) -> dict:
    return dict(
        **_ds_moe(cfg, kw),
        qkv_bias=bool(cfg.get("attention_bias")),
        qk_norm=bool(cfg.get("use_qk_norm")),
        partial_rotary_factor=_partial_rotary(cfg, 0.5),
    )


register_llama_like(  # GLM-4.5 / 4.6 (MoE): GQA, partial rope, optional qk-norm + V3 routing
    ["Glm4MoeForCausalLM"],
    LlamaLike(fields=_glm4_moe, renames=_DS_MOE_NAMES, family="moe"),
)

register_llama_like(  # dots.llm1 (rednote): Qwen3-style attention (qk-norm) + V3 routing
    ["Dots1ForCausalLM"],
    LlamaLike(
        fields=lambda cfg, kw: dict(**_ds_moe(cfg, kw), **_sliding(cfg, kw), qk_norm=True),
        renames=_DS_MOE_NAMES,
        family="moe",
    ),
)


def _ernie_moe(cfg: dict, kw: dict) -> dict:
    n = kw["num_layers"]
    start = int(cfg.get("moe_layer_start_index", 0))
    end = cfg.get("moe_layer_end_index")
    end = n - 1 if end is None or end < 0 else int(end)
    step = int(cfg.get("moe_layer_interval", 1))
    mi = cfg["moe_intermediate_size"]
    _unsupported(cfg, use_bias=True)  # biased shared experts (the released models have none)
    return dict(
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        num_experts=cfg["moe_num_experts"] if "moe_num_experts" in cfg else cfg["num_experts"],
        num_experts_per_tok=cfg.get("moe_k") or cfg["num_experts_per_tok"],
        moe_intermediate_size=mi,
        shared_expert_intermediate_size=mi * int(cfg.get("moe_num_shared_experts") or 0),
        norm_topk_prob=True,
        moe_router_bias=True,  # selection on softmax + e_score_correction_bias
        dense_mlp_layers=[i for i in range(n) if not ((i + 1) % step == 0 and start <= i <= end)],
    )


def _ernie_moe_convert(
    name: str, w: np.ndarray, spec: ModelSpec
) -> Iterable[tuple[str, np.ndarray]]:
    out = _ERNIE_MOE.convert(name, w, spec)
    return [(n, a.reshape(-1) if n.endswith(".mlp.router.bias") else a) for n, a in out]


_ERNIE_MOE = LlamaLike(
    fields=_ernie_moe, renames=_DS_MOE_NAMES, interleaved_rope=True, family="moe"
)
register_architecture(  # ERNIE 4.5 MoE (A3B / A47B text): softmax routing with a selection bias
    ["Ernie4_5_MoeForCausalLM"],
    ArchAdapter(family="moe", build_spec=_ERNIE_MOE.build_spec, convert=_ernie_moe_convert),
)


def _deepseek_v2_spec(cfg: dict, model_dir: str) -> ModelSpec:
    """DeepSeek-V2 / V2-Lite / V2.5: MLA like V3, softmax routing without renormalisation
    (greedy, or group_limited_greedy with a group's max as its score), shared experts."""
    from xlaserve.model_loader.registry import mla_spec

    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepseekV2ForCausalLM with topk_method={method!r} is not supported")
    spec = mla_spec({**cfg, "scoring_func": "softmax", "topk_method": method}, model_dir)
    spec.norm_topk_prob = False  # V2 scales the raw top-k softmax weights
    spec.moe_router_bias = False
    grouped = method == "group_limited_greedy"
    spec.moe_num_groups = int(cfg.get("n_group") or 1) if grouped else 1
    spec.moe_topk_groups = int(cfg.get("topk_group") or 1) if grouped else 1
    spec.moe_group_topn = 1
    return spec


def _deepseek_v2_convert(
    name: str, w: np.ndarray, spec: ModelSpec
) -> Iterable[tuple[str, np.ndarray]]:
    from xlaserve.model_loader.registry import mla_convert

    return mla_convert(name, w, spec)


register_architecture(
    ["DeepseekV2ForCausalLM"],
    ArchAdapter(family="mla", build_spec=_deepseek_v2_spec, convert=_deepseek_v2_convert),
)


# ---- ALiBi families (no rope: a per-head linear bias on key positions) -------------------------


def bloom_alibi_slopes(n: int) -> list[float]:
    """Bloom's ALiBi slopes for n heads: 2^(-8 i / n') for the largest power of two n' <= n,
    then the odd powers of the next power's base for the remaining heads."""
    p = 2 ** math.floor(math.log2(n))
    base = 2.0 ** (-(2.0 ** -(math.log2(p) - 3)))
    slopes = [base**i for i in range(1, p + 1)]
    if p != n:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * p) - 3)))
        slopes += [extra**i for i in range(1, 1 + 2 * min(p, n - p), 2)]
    return slopes


def mpt_alibi_slopes(n: int, bias_max: float = 8.0) -> list[float]:
    """MPT's slopes: 1 / 2^(i * bias_max / n') over the next power of two n' >= n, odd-indexed
    first when n is not a power of two."""
    p = 2 ** math.ceil(math.log2(n))
    slopes = [1.0 / 2.0 ** (i * bias_max / p) for i in range(1, p + 1)]
    if p != n:
        slopes = (slopes[1::2] + slopes[::2])[:n]
    return slopes


def _bloom(cfg: dict, kw: dict) -> dict:
    hidden, heads = cfg.get("hidden_size") or cfg["n_embed"], cfg["n_head"]
    return dict(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=4 * hidden,
        num_layers=cfg.get("n_layer") or cfg["num_hidden_layers"],
        **_layer_norm_plain_mlp(cfg.get("layer_norm_epsilon", 1e-5), True),
        activation="gelu_tanh",
        position_embedding="alibi",
        alibi_slopes=bloom_alibi_slopes(heads),
        embed_norm=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        extra=dict(qkv_layout="per_head"),
    )


class _BloomLike(LlamaLike):
    def build_spec(self, cfg: dict, model_dir: str) -> ModelSpec:
        heads = cfg.get("n_head") or cfg.get("n_heads") or cfg.get("num_attention_heads")
        hidden = cfg.get("hidden_size") or cfg.get("n_embed") or cfg.get("d_model")
        layers = cfg.get("n_layer") or cfg.get("n_layers") or cfg.get("num_hidden_layers")
        full = {
            **cfg,
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_hidden_layers": layers,
            # ALiBi has no table: the trained length (MPT max_seq_len, Bloom seq_length if set).
            "max_position_embeddings": cfg.get("max_seq_len") or cfg.get("seq_length") or 2048,
        }
        return super().build_spec(full, model_dir)


register_llama_like(  # BLOOM: ALiBi, embedding LayerNorm, per-head fused qkv, GELU (tanh)
    ["BloomForCausalLM"],
    _BloomLike(
        fields=_bloom,
        prefixes=("transformer.",),
        renames=(
            (r"^word_embeddings_layernorm\.", "embed_layernorm."),
            (r"^word_embeddings\.", "embed_tokens."),
            *_BLOOM_BLOCK_NAMES,
        ),
        family="gpt2",
    ),
)


def _mpt(cfg: dict, kw: dict) -> dict:
    att = cfg.get("attn_config") or {}
    arch = cfg["architectures"][0]
    for key, bad in (("clip_qkv", True), ("qk_ln", True), ("prefix_lm", True)):
        if att.get(key) if bad is True else att.get(key) == bad:
            raise ValueError(f"{arch} with attn_config.{key}={att.get(key)!r} is not supported")
    if att.get("attn_type", "multihead_attention") != "multihead_attention":
        raise ValueError(
            f"{arch} with attn_config.attn_type={att.get('attn_type')!r} is not supported"
        )
    if not att.get("alibi", True):
        raise ValueError(f"{arch} without ALiBi (learned_pos_emb only) is not supported")
    if cfg.get("logit_scale") not in (None, 1, 1.0):
        raise ValueError(f"{arch} with logit_scale={cfg.get('logit_scale')!r} is not supported")
    heads, hidden = kw["num_heads"], kw["hidden_size"]
    bias = not cfg.get("no_bias", True)
    return dict(
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(cfg.get("expansion_ratio", 4) * hidden),
        **_layer_norm_plain_mlp(cfg.get("layer_norm_epsilon", 1e-5), bias, norm_bias=bias),
        activation="gelu",
        position_embedding="alibi",
        alibi_slopes=mpt_alibi_slopes(heads, float(att.get("alibi_bias_max", 8))),
        attn_scale=att.get("softmax_scale"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


register_llama_like(  # MPT (MosaicML): ALiBi, bias-free LayerNorm and projections
    ["MptForCausalLM"],
    _BloomLike(
        fields=_mpt,
        prefixes=("transformer.",),
        renames=(
            (r"^wte\.", "embed_tokens."),
            (r"^norm_f\.", "norm."),
            (r"^blocks\.", "layers."),
            (r"\.norm_1\.", ".input_layernorm."),
            (r"\.norm_2\.", ".post_attention_layernorm."),
            (r"\.attn\.Wqkv\.", ".self_attn.qkv_proj."),
            (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
            (r"\.ffn\.up_proj\.", ".mlp.up_proj."),
            (r"\.ffn\.down_proj\.", ".mlp.down_proj."),
        ),
        family="gpt2",
    ),
)


# ---- gpt-oss (attention sinks, sliding / full layers, biased clamped-SwiGLU MoE) --------------


def _gpt_oss(cfg: dict, kw: dict) -> dict:
    return dict(
        **_sliding(cfg, kw),
        qkv_bias=bool(cfg.get("attention_bias", True)),
        o_bias=bool(cfg.get("attention_bias", True)),
        attn_sinks=True,
        num_experts=cfg["num_local_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,  # softmax over the top-k logits == renormalised top-k softmax
        moe_router_logit_bias=True,
        moe_expert_bias=True,
        moe_glu="swiglu_clamp",
        extra=dict(
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        ),
    )


_GPT_OSS = LlamaLike(fields=_gpt_oss, family="moe")


def _gpt_oss_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    """Experts ship as gate_up_proj [E, H, 2I] with gate / up interleaved on the last axis (and
    its bias [E, 2I]), down_proj [E, I, H] (+ bias [E, H]): transposed and split here."""
    if name.endswith(("_blocks", "_scales")):
        raise ValueError(
            f"{name}: MXFP4-quantized gpt-oss experts are not supported; load a bf16 checkpoint"
        )
    base = name[len("model.") :] if name.startswith("model.") else name
    if base.endswith(".mlp.experts.gate_up_proj"):
        head = base[: -len("gate_up_proj")]
        t = np.swapaxes(w, 1, 2)  # [E, 2I, H]
        return [
            (head + "w_gate", np.ascontiguousarray(t[:, ::2])),
            (head + "w_up", np.ascontiguousarray(t[:, 1::2])),
        ]
    if base.endswith(".mlp.experts.gate_up_proj_bias"):
        head = base[: -len("gate_up_proj_bias")]
        return [
            (head + "b_gate", np.ascontiguousarray(w[:, ::2])),
            (head + "b_up", np.ascontiguousarray(w[:, 1::2])),
        ]
    if base.endswith(".mlp.experts.down_proj"):
        return [(base[: -len("down_proj")] + "w_down", np.ascontiguousarray(np.swapaxes(w, 1, 2)))]
    if base.endswith(".mlp.experts.down_proj_bias"):
        return [(base[: -len("down_proj_bias")] + "b_down", w)]
    return _GPT_OSS.convert(name, w, spec)


register_architecture(  # gpt-oss (OpenAI): sinks, alternating sliding / full, biased clamped MoE
    ["GptOssForCausalLM"],
    ArchAdapter(family="moe", build_spec=_GPT_OSS.build_spec, convert=_gpt_oss_convert),
)


# ---- Llama 4 text (interleaved MoE, NoPE layers, chunked attention) ---------------------------


def _llama4(cfg: dict, kw: dict) -> dict:
    """Llama4TextConfig -> spec. no_rope_layers[i] is 1 where layer i USES rope (HF's naming);
    rope layers attend in chunks of attention_chunk_size and L2-normalise q / k (use_qk_norm:
    a weightless RMS norm, loaded as ones); NoPE layers see all keys, with temperature tuning."""
    n = kw["num_layers"]
    interval = int(cfg.get("no_rope_layer_interval", 4))
    use_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    step = int(cfg.get("interleave_moe_layer_step", 1))
    moe = cfg.get("moe_layers")
    moe = list(range(step - 1, n, step)) if moe is None else list(moe)
    chunk = cfg.get("attention_chunk_size")
    types = cfg.get("layer_types") or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in use_rope
    ]
    rope_layers = [i for i in range(n) if use_rope[i]]
    bias = bool(cfg.get("attention_bias"))
    out = dict(
        intermediate_size=cfg.get("intermediate_size_mlp") or kw["intermediate_size"],
        qkv_bias=bias,
        o_bias=bias,
        nope_layers=[i for i in range(n) if not use_rope[i]],
        qk_norm=bool(cfg.get("use_qk_norm", True)),
        qk_norm_layers=rope_layers,
        num_experts=cfg["num_local_experts"],
        num_experts_per_tok=cfg.get("num_experts_per_tok", 1),
        moe_intermediate_size=kw["intermediate_size"],
        shared_expert_intermediate_size=kw["intermediate_size"],
        moe_scoring="sigmoid",  # top-k of sigmoid == top-k of the logits; weights = sigmoid
        norm_topk_prob=False,
        moe_scale_input=True,
        dense_mlp_layers=[i for i in range(n) if i not in moe],
    )
    if chunk is not None and any(t.startswith("chunked") for t in types):
        out.update(attention_chunk_size=int(chunk), layer_types=list(types))
    if cfg.get("attn_temperature_tuning", True):
        out["nope_attn_temperature"] = (
            float(cfg.get("floor_scale", 8192)),
            float(cfg.get("attn_scale", 0.1)),
        )
    return out


_LLAMA4 = LlamaLike(
    fields=_llama4, renames=((r"\.feed_forward\.", ".mlp."),), interleaved_rope=True, family="moe"
)


def _llama4_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    """Experts ship fused as gate_up_proj [E, H, 2I] (gate half first) and down_proj [E, I, H]:
    transposed to the canonical [E, I, H] / [E, H, I]. Rope layers' weightless qk L2-norm gets
    ones as its q_norm / k_norm weights. Llama4ForConditionalGeneration: the text model's
    tensors sit under `language_model.`; the vision tower and projector are dropped."""
    if name.startswith(("vision_model.", "multi_modal_projector.")):
        return []
    if name.startswith("language_model."):
        name = name[len("language_model.") :]
    base = name[len("model.") :] if name.startswith("model.") else name
    base = base.replace(".feed_forward.", ".mlp.")
    if base.endswith(".mlp.experts.gate_up_proj"):
        head, i = base[: -len("gate_up_proj")], w.shape[2] // 2
        t = np.swapaxes(w, 1, 2)  # [E, 2I, H]
        return [
            (head + "w_gate", np.ascontiguousarray(t[:, :i])),
            (head + "w_up", np.ascontiguousarray(t[:, i:])),
        ]
    if base.endswith(".mlp.experts.down_proj"):
        return [(base[: -len("down_proj")] + "w_down", np.ascontiguousarray(np.swapaxes(w, 1, 2)))]
    out = list(_LLAMA4.convert(name, w, spec))
    m = re.match(r"^layers\.(\d+)\.self_attn\.q_proj\.weight$", base)
    if m and spec.layer_qk_norm(int(m.group(1))):
        ones = np.ones(spec.head_dim, dtype=w.dtype)
        out += [(base.replace("q_proj", p), ones) for p in ("q_norm", "k_norm")]
    return out


def _llama4_mm_spec(cfg: dict, model_dir: str) -> ModelSpec:
    """Llama4ForConditionalGeneration: the text model's spec from text_config (text only)."""
    text = {**cfg["text_config"], "architectures": cfg["architectures"]}
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return _LLAMA4.build_spec(text, model_dir)


register_architecture(  # Llama 4 text (Scout / Maverick): MoE + NoPE + chunked attention
    ["Llama4ForCausalLM"],
    ArchAdapter(family="moe", build_spec=_LLAMA4.build_spec, convert=_llama4_convert),
)
register_architecture(  # Llama 4 multimodal checkpoints, served text-only
    ["Llama4ForConditionalGeneration"],
    ArchAdapter(family="moe", build_spec=_llama4_mm_spec, convert=_llama4_convert),
)
