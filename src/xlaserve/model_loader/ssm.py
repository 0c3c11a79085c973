"""State-space architectures (Mamba, Mamba2): HF config -> ModelSpec, weight names, cache layout.

Spec fields (ModelSpec.extra):
    layer_kinds: list[str]      per layer "mamba" | "mamba2" | "attention" | "shortconv" (LFM2)
                                | "parallel" (Falcon-H1: attention + Mamba2) | "mlp" (Nemotron-H)
    ssm: dict                   kind ("mamba"|"mamba2"), d_inner (I), n_heads (Hs; Mamba: I),
                                head_dim (P; Mamba: 1), state_size (N), n_groups (G; Mamba: 1),
                                conv_kernel (K), conv_bias, proj_bias, dt_rank (Mamba),
                                dt_limit (lo, hi), residual_in_fp32, chunk_size

Canonical weights of a Mamba2 layer i (HF names without `backbone.`):
    layers.{i}.norm.weight [H]
    layers.{i}.mixer.in_proj.weight [I + (I + 2GN) + Hs, H]   (gate z | conv input xBC | dt)
    layers.{i}.mixer.conv1d.weight [I + 2GN, K], conv1d.bias [I + 2GN]
    layers.{i}.mixer.{dt_bias, A_log, D} [Hs], norm.weight [I], out_proj.weight [H, I]
Mamba layer i:
    layers.{i}.mixer.in_proj.weight [2I, H] (x | z), conv1d.weight [I, K], conv1d.bias [I]
    layers.{i}.mixer.x_proj.weight [R + 2N, I], dt_proj.{weight [I, R], bias [I]}
    layers.{i}.mixer.A_log [I, N], D [I], out_proj.weight [H, I]
Model: embed_tokens.weight [V, H], norm.weight [H], lm_head.weight [V, H] (absent when tied).

State per request and Mamba/Mamba2 layer (core/cache_spec.py): conv window [C, K-1] (C = the conv
channels) and SSM state [Hs, P, N], both float32.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from xlaserve.core.cache_spec import CacheLayout, PagedAttentionSpec, RecurrentStateSpec
from xlaserve.model_loader.registry import (
    ArchAdapter,
    _eos_ids,
    _moe_names,
    base_spec_kwargs,
    register_architecture,
)
from xlaserve.model_loader.spec import ModelSpec

if TYPE_CHECKING:
    from xlaserve.config import EngineConfig

logger = logging.getLogger(__name__)

STATE_KINDS = ("mamba", "mamba2")
# Issue 25 part B (model_loader/ssm_hybrids.py): "shortconv" (LFM2: conv state only, an empty SSM
# state), "parallel" (Falcon-H1: attention + Mamba2 in one layer: K/V and a state), "mlp"
# (Nemotron-H: no cache).
STATE_KINDS += ("shortconv", "parallel")
KV_KINDS = ("attention", "parallel")
STATE_KINDS += ("gdn",)  # Qwen3-Next gated delta-net layers (model_loader/qwen3_next.py)


def is_state_model(spec: ModelSpec) -> bool:
    """Whether any layer keeps a recurrent state (needs state slots)."""
    return any(k in STATE_KINDS for k in spec.extra.get("layer_kinds", ()))


def check_state_model_config(config: EngineConfig, spec: ModelSpec) -> None:
    """Raise ValueError for features these models do not support (before loading anything)."""
    if not is_state_model(spec):
        return
    arch = spec.architecture
    if config.speculative is not None:
        raise ValueError(
            f"{arch} keeps a recurrent state per request: speculative decoding is not supported "
            "for it (a rejected draft token would need the state rewound); drop "
            "speculative_config"
        )
    if config.cache.kv_offload_bytes:
        raise ValueError(f"{arch}: KV offload is not supported for recurrent-state models")
    if config.cache.kv_cache_dtype != "auto":
        raise ValueError(f"{arch}: kv_cache_dtype must be 'auto' for recurrent-state models")
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(f"{arch}: tensor parallelism is not supported for recurrent-state models")


def conv_channels(ssm: dict) -> int:
    if "conv_dim" in ssm:  # given by the spec (Qwen3-Next: q | k | v channels)
        return ssm["conv_dim"]
    if ssm["kind"] == "mamba2":
        return ssm["d_inner"] + 2 * ssm["n_groups"] * ssm["state_size"]
    return ssm["d_inner"]


def state_shapes(spec: ModelSpec) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One state layer's (conv state [C, K-1], ssm state [Hs, P, N]) shapes."""
    s = spec.extra["ssm"]
    return (conv_channels(s), s["conv_kernel"] - 1), (s["n_heads"], s["head_dim"], s["state_size"])


def cache_layout(spec: ModelSpec, dtype_bytes: int, block_size: int) -> CacheLayout:
    """The model's cache groups: paged K/V of its attention layers, state of its SSM layers."""
    kinds = spec.extra.get("layer_kinds") or ["attention"] * spec.num_layers
    attn = tuple(i for i, k in enumerate(kinds) if k in KV_KINDS)
    state = tuple(i for i, k in enumerate(kinds) if k in STATE_KINDS)
    groups: list = []
    if attn:
        per_block = 2 * block_size * spec.num_kv_heads * spec.head_dim * dtype_bytes * len(attn)
        groups.append(PagedAttentionSpec(attn, per_block))
    if state:
        (c, k1), (hs, p, n) = state_shapes(spec)
        groups.append(RecurrentStateSpec(state, 4 * (c * k1 + hs * p * n) * len(state)))
    return CacheLayout(tuple(groups))


def plan_state_cache(
    spec: ModelSpec,
    config: EngineConfig,
    dtype_bytes: int,
    block_size: int,
    max_model_len: int,
    budget_bytes: int | None,
) -> tuple[int, int]:
    """(num KV blocks, num state slots). An explicit num_kv_blocks keeps its blocks and takes
    num_state_slots (default max_num_seqs) slots beside them; else the one budget is split
    (CacheLayout.split). An explicit num_state_slots always wins."""
    cc, sc = config.cache, config.scheduler
    layout = cache_layout(spec, dtype_bytes, block_size)
    if cc.num_kv_blocks is not None:
        return cc.num_kv_blocks, cc.num_state_slots or sc.max_num_seqs
    blocks, slots = layout.split(budget_bytes, block_size, sc.max_num_seqs, max_model_len)
    if cc.num_state_slots is not None:
        freed = (slots - cc.num_state_slots) * layout.bytes_per_slot
        if layout.bytes_per_block:
            blocks += freed // layout.bytes_per_block
        slots = cc.num_state_slots
    logger.info(
        "cache kinds %s: %d KV blocks, %d state slots (%d B each)",
        "+".join(layout.kinds), blocks, slots, layout.bytes_per_slot,
    )  # fmt: skip
    return int(blocks), int(slots)


def _common(cfg: dict, model_dir: str, kind: str) -> dict:
    h = cfg["hidden_size"]
    return dict(
        architecture=cfg["architectures"][0],
        family=kind,
        vocab_size=cfg["vocab_size"],
        hidden_size=h,
        num_layers=cfg["num_hidden_layers"],
        # No attention: one placeholder head (the spec's attention fields are unused).
        num_heads=1,
        num_kv_heads=1,
        head_dim=h,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),  # no limit in HF
        model_dir=model_dir,
        checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        position_embedding="none",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", kind == "mamba")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg, model_dir),
    )


def _float(v: object) -> float:
    """A JSON number; transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def _dt_limit(cfg: dict) -> tuple[float, float]:
    lo, hi = cfg.get("time_step_limit") or (0.0, float("inf"))
    return _float(lo), _float(hi)


def mamba2_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = _common(cfg, model_dir, "mamba2")
    d_inner = int(cfg.get("expand", 2) * cfg["hidden_size"])
    ssm = dict(
        kind="mamba2",
        d_inner=d_inner,
        n_heads=cfg["num_heads"],
        head_dim=cfg["head_dim"],
        state_size=cfg["state_size"],
        n_groups=cfg.get("n_groups", 1),
        conv_kernel=cfg.get("conv_kernel", 4),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        dt_limit=_dt_limit(cfg),
        residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
        chunk_size=cfg.get("chunk_size", 256),
    )
    if ssm["n_heads"] * ssm["head_dim"] != d_inner:
        raise ValueError(f"Mamba2: num_heads * head_dim != expand * hidden_size ({d_inner})")
    kw.update(
        intermediate_size=d_inner, extra={"ssm": ssm, "layer_kinds": ["mamba2"] * kw["num_layers"]}
    )
    return ModelSpec(**kw)


def mamba_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = _common(cfg, model_dir, "mamba")
    h = cfg["hidden_size"]
    d_inner = int(cfg.get("intermediate_size") or cfg.get("expand", 2) * h)
    rank = cfg.get("time_step_rank", "auto")
    ssm = dict(
        kind="mamba",
        d_inner=d_inner,
        n_heads=d_inner,
        head_dim=1,
        state_size=cfg["state_size"],
        n_groups=1,
        conv_kernel=cfg.get("conv_kernel", 4),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        dt_rank=math.ceil(h / 16) if rank == "auto" else int(rank),
        dt_limit=(0.0, float("inf")),
        residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
        chunk_size=256,
    )
    kw.update(
        intermediate_size=d_inner, extra={"ssm": ssm, "layer_kinds": ["mamba"] * kw["num_layers"]}
    )
    return ModelSpec(**kw)


def mamba_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    """backbone.X -> X; embeddings -> embed_tokens, norm_f -> norm; conv1d [C, 1, K] -> [C, K]."""
    if name == "lm_head.weight" and spec.tie_word_embeddings:
        return []
    name = name.removeprefix("backbone.")
    if name in ("embeddings.weight", "embedding.weight"):
        name = "embed_tokens.weight"
    elif name.startswith("norm_f."):
        name = "norm." + name.removeprefix("norm_f.")
    if name.endswith("conv1d.weight") and w.ndim == 3:
        w = w[:, 0, :]
    return [(name, w)]


def bamba_spec(cfg: dict, model_dir: str) -> ModelSpec:
    """Bamba: Mamba2 layers and (at attn_layer_indices) rope attention layers (partial rotary
    0.5), each followed by a gated MLP; family "hybrid"."""
    kw = base_spec_kwargs(cfg, model_dir)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d_inner = int(cfg.get("mamba_expand", 2) * h)
    attn = set(cfg.get("attn_layer_indices") or ())
    ssm = _hybrid_ssm(cfg, d_inner)
    bias = bool(cfg.get("attention_bias", False))
    kw.update(
        family="hybrid",
        partial_rotary_factor=float(cfg.get("partial_rotary_factor", 0.5)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        extra={
            "ssm": ssm,
            "layer_kinds": ["attention" if i in attn else "mamba2" for i in range(n_layers)],
        },
    )
    return ModelSpec(**kw)


_HYBRID_NAMES = [
    ("final_layernorm.", "norm."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    (".feed_forward.", ".mlp."),
    (".mamba.", ".mixer."),
]


def hybrid_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    """model.X -> X; Bamba's final_layernorm / pre_ff_layernorm / feed_forward / mamba -> the
    canonical norm / post_attention_layernorm / mlp / mixer; conv1d [C, 1, K] -> [C, K]."""
    if "rotary_emb" in name or (name == "lm_head.weight" and spec.tie_word_embeddings):
        return []
    name = name.removeprefix("model.")
    for old, new in _HYBRID_NAMES:
        if old in name or name.startswith(old):
            name = name.replace(old, new)
    if name.endswith("conv1d.weight") and w.ndim == 3:
        w = w[:, 0, :]
    return [(name, w)]


def _hybrid_ssm(cfg: dict, d_inner: int) -> dict:
    """The Mamba2 mixer fields of a Bamba / GraniteMoeHybrid config (mamba_* keys)."""
    n_heads = cfg.get("mamba_n_heads", 128)
    d_head = cfg.get("mamba_d_head", "auto")
    return dict(
        kind="mamba2",
        d_inner=d_inner,
        n_heads=n_heads,
        head_dim=d_inner // n_heads if d_head == "auto" else int(d_head),
        state_size=cfg.get("mamba_d_state", 256),
        n_groups=cfg.get("mamba_n_groups", 1),
        conv_kernel=cfg.get("mamba_d_conv", 4),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_limit=_dt_limit(cfg),
        residual_in_fp32=False,
        chunk_size=cfg.get("mamba_chunk_size", 256),
    )


_ATTENTION_TYPES = ("attention", "full_attention")


def granite_hybrid_spec(cfg: dict, model_dir: str) -> ModelSpec:
    """GraniteMoeHybrid (Granite 4): Mamba2 / attention layers by layer_types, each followed by
    the shared gated MLP (+ a softmax top-k MoE when num_local_experts > 0); Granite's embedding /
    residual / attention multipliers and logits scaling; rope or no positions ("nope")."""
    kw = base_spec_kwargs(cfg, model_dir)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n_layers
    experts = int(cfg.get("num_local_experts") or 0)
    shared = int(cfg.get("shared_intermediate_size", 1024))
    bias = bool(cfg.get("attention_bias", False))
    kw.update(
        family="hybrid",
        position_embedding="rope" if cfg.get("position_embedding_type") == "rope" else "none",
        qkv_bias=bias,
        o_bias=bias,
        attn_scale=float(cfg.get("attention_multiplier", 1.0)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        # Dense: the shared MLP is the layer's MLP; MoE: it is the MoE's shared expert.
        intermediate_size=shared if not experts else cfg["intermediate_size"],
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)) if experts else 0,
        moe_intermediate_size=cfg["intermediate_size"] if experts else 0,
        shared_expert_intermediate_size=shared if experts else 0,
        extra={
            "ssm": _hybrid_ssm(cfg, int(cfg.get("mamba_expand", 2) * h)),
            "layer_kinds": ["attention" if t in _ATTENTION_TYPES else "mamba2" for t in types],
        },
    )
    return ModelSpec(**kw)


def granite_hybrid_convert(
    name: str, w: np.ndarray, spec: ModelSpec
) -> Iterable[tuple[str, np.ndarray]]:
    """Bamba names + shared_mlp.input_linear [2Is, H] -> (shared_expert.)gate_proj / up_proj
    halves, output_linear -> down_proj; experts gate_up_proj [E, 2I, H] -> w_gate / w_up, down_proj
    [E, H, I] -> w_down (also the older block_sparse_moe.input_linear / output_linear names)."""
    pairs = list(hybrid_convert(name, w, spec))
    if not pairs:
        return []
    name, w = pairs[0]
    mlp = ".mlp.shared_expert." if spec.num_experts else ".mlp."
    if ".shared_mlp.input_linear." in name:
        pre = name.split(".shared_mlp.")[0]
        half = w.shape[0] // 2
        return [(f"{pre}{mlp}gate_proj.weight", w[:half]), (f"{pre}{mlp}up_proj.weight", w[half:])]
    if ".shared_mlp.output_linear." in name:
        return [(name.split(".shared_mlp.")[0] + f"{mlp}down_proj.weight", w)]
    if ".block_sparse_moe." in name:
        pre, rest = name.split(".block_sparse_moe.")
        if rest.startswith("router."):
            return [(f"{pre}.mlp.router.weight", w)]
        if rest in ("experts.gate_up_proj", "input_linear.weight"):
            half = w.shape[1] // 2
            return [
                (f"{pre}.mlp.experts.w_gate", w[:, :half]),
                (f"{pre}.mlp.experts.w_up", w[:, half:]),
            ]
        if rest in ("experts.down_proj", "output_linear.weight"):
            return [(f"{pre}.mlp.experts.w_down", w)]
    return [(name, w)]


def jamba_spec(cfg: dict, model_dir: str) -> ModelSpec:
    """Jamba: Mamba (v1, with RMS norms on dt / B / C) and attention layers (no positions) by
    attn_layer_period / offset; MoE (softmax, top-k weights not renormalised) every
    expert_layer_period layers, a gated MLP elsewhere; family "hybrid"."""
    kw = base_spec_kwargs(cfg, model_dir)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d_inner = int(cfg.get("mamba_expand", 2) * h)
    rank = cfg.get("mamba_dt_rank", "auto")
    ssm = dict(
        kind="mamba",
        d_inner=d_inner,
        n_heads=d_inner,
        head_dim=1,
        state_size=cfg.get("mamba_d_state", 16),
        n_groups=1,
        conv_kernel=cfg.get("mamba_d_conv", 4),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_rank=math.ceil(h / 16) if rank == "auto" else int(rank),
        dt_limit=(0.0, float("inf")),
        residual_in_fp32=False,
        chunk_size=256,
        bc_norms=True,
    )
    ap, ao = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
    ep, eo = cfg.get("expert_layer_period", 2), cfg.get("expert_layer_offset", 1)
    experts = int(cfg.get("num_experts", 16))
    kw.update(
        family="hybrid",
        position_embedding="none",
        num_experts=experts if experts > 1 else 0,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)) if experts > 1 else 0,
        moe_intermediate_size=cfg["intermediate_size"] if experts > 1 else 0,
        norm_topk_prob=False,
        dense_mlp_layers=[i for i in range(n_layers) if i % ep != eo],
        extra={
            "ssm": ssm,
            "layer_kinds": ["attention" if i % ap == ao else "mamba" for i in range(n_layers)],
        },
    )
    return ModelSpec(**kw)


def jamba_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    """Bamba names + MoE experts (per-expert tensors or fused gate_up_proj / down_proj) ->
    stacked w_gate / w_up / w_down (registry._moe_names)."""
    pairs = list(hybrid_convert(name, w, spec))
    if not pairs:
        return []
    name, w = pairs[0]
    moe = _moe_names(name, w)
    return moe if moe is not None else [(name, w)]


register_architecture(
    ["Mamba2ForCausalLM"],
    ArchAdapter(family="mamba2", build_spec=mamba2_spec, convert=mamba_convert),
)
register_architecture(
    ["MambaForCausalLM"], ArchAdapter(family="mamba", build_spec=mamba_spec, convert=mamba_convert)
)
register_architecture(
    ["BambaForCausalLM"],
    ArchAdapter(family="hybrid", build_spec=bamba_spec, convert=hybrid_convert),
)
register_architecture(
    ["GraniteMoeHybridForCausalLM"],
    ArchAdapter(family="hybrid", build_spec=granite_hybrid_spec, convert=granite_hybrid_convert),
)
register_architecture(
    ["JambaForCausalLM"], ArchAdapter(family="hybrid", build_spec=jamba_spec, convert=jamba_convert)
)


# LFM2, Nemotron-H, Falcon-H1 (issue 25 part B) register themselves there.
from xlaserve.model_loader import ssm_hybrids as _ssm_hybrids  # noqa: E402, F401
