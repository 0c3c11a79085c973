"""ModelSpec: one architecture-neutral description of a decoder-only transformer.

Built from HF `config.json` by a per-architecture adapter (`model_loader/registry.py`); both
backends build their model from it, so an architecture added once is served by both.

Canonical weight names (what backends' models expect; adapters rename/split HF tensors into these):
    embed_tokens.weight                       [V, H]
    embed_positions.weight                    [P, H]        (learned positions only)
    embed_layernorm.{weight,bias}             [H]           (embed_norm only)
    layers.{i}.input_layernorm.{weight,bias}  [H]
    layers.{i}.self_attn.q_proj.{weight,bias} [Hq*D, H] / [Hq*D]   (torch Linear layout: [out, in])
    layers.{i}.self_attn.k_proj.{weight,bias} [Hkv*D, H]
    layers.{i}.self_attn.v_proj.{weight,bias} [Hkv*D, H]
    layers.{i}.self_attn.o_proj.{weight,bias} [H, Hq*D]
    layers.{i}.self_attn.q_norm.weight        [D]           (qk-norm; [Hq*D] when qk_norm_scope="full")
    layers.{i}.self_attn.k_norm.weight        [D]           ([Hkv*D] when qk_norm_scope="full")
    layers.{i}.post_attention_layernorm.{weight,bias} [H]   (norm before the MLP)
    layers.{i}.post_attn_out_norm.weight      [H]           (sandwich norm after attention, Gemma2/3, OLMo2)
    layers.{i}.post_mlp_out_norm.weight       [H]           (sandwich norm after the MLP)
    layers.{i}.mlp.gate_proj.weight           [I, H]        (gated MLP)
    layers.{i}.mlp.up_proj.{weight,bias}      [I, H]
    layers.{i}.mlp.down_proj.{weight,bias}    [H, I]
    layers.{i}.mlp.router.weight              [E, H]        (MoE; I = moe_intermediate_size)
    layers.{i}.mlp.router.bias                [E]           (moe_router_bias: selection-only bias)
    layers.{i}.mlp.experts.w_gate             [E, I, H]
    layers.{i}.mlp.experts.w_up               [E, I, H]
    layers.{i}.mlp.experts.w_down             [E, H, I]
    layers.{i}.mlp.experts.b_gate / b_up      [E, I]; b_down [E, H]   (moe_expert_bias)
    layers.{i}.self_attn.sinks                [Hq]          (attn_sinks)
    layers.{i}.mlp.shared_expert.{gate_proj,up_proj,down_proj}.weight  (Is = shared_expert_intermediate_size)
    layers.{i}.mlp.shared_expert_gate.weight  [1, H]        (shared_expert_gate: sigmoid gate)
  MLA (family "mla"; Dn/Dr/Dv/Rq/Rkv from spec.extra, see ModelSpec.extra):
    layers.{i}.self_attn.q_proj.weight        [Hq*(Dn+Dr), H]   (when q_lora_rank is None) or
    layers.{i}.self_attn.q_a_proj.weight      [Rq, H], q_a_norm.weight [Rq], q_b_proj.weight [Hq*(Dn+Dr), Rq]
    layers.{i}.self_attn.kv_a_proj.weight     [Rkv + Dr, H]
    layers.{i}.self_attn.kv_a_norm.weight     [Rkv]
    layers.{i}.self_attn.kv_b_proj.weight     [Hq*(Dn+Dv), Rkv]
    layers.{i}.self_attn.o_proj.weight        [H, Hq*Dv]
    Rope dims are stored de-interleaved (neox rotate_half layout) by the converter.
    norm.{weight,bias}                        [H]
    lm_head.weight                            [V, H]        (absent when tie_word_embeddings)
    lm_head.bias                              [V]           (lm_head_bias only)
Axis letters: T tokens, B requests, H hidden, Hq/Hkv heads, D head_dim, I intermediate, V vocab,
E experts, P positions, N blocks, S block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelSpec:
    architecture: str  # HF architectures[0], e.g. "LlamaForCausalLM"
    family: str  # backend model file that serves it, e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    # Directory holding config.json / weights / tokenizer (None for synthetic specs in tests).
    model_dir: str | None = None
    # Checkpoint dtype from config.json ("float32", "bfloat16", "float16").
    checkpoint_dtype: str = "float32"
    # --- norms ---
    norm_kind: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-6
    norm_weight_offset: float = 0.0  # Gemma: y = x_normed * (1 + w)
    sandwich_norms: bool = False  # post_attn_out_norm / post_mlp_out_norm present
    pre_norms: bool = True  # OLMo2 has only post (sandwich) norms -> False
    qk_norm: bool = False
    # "head": q_norm/k_norm over each head's D dims (Qwen3, Gemma3); "full": over the whole
    # q / k projection [Hq*D] / [Hkv*D] before the head split (OLMo2).
    qk_norm_scope: str = "head"
    # LayerNorm has a bias (norm_kind "layer": GPT-2, GPT-NeoX, StarCoder2); norms incl. the final.
    norm_bias: bool = False
    # --- mlp ---
    activation: str = "silu"  # "silu" | "gelu" | "gelu_tanh" | "relu" | "relu2" (relu squared)
    gated_mlp: bool = True
    # --- attention / positions ---
    position_embedding: str = "rope"  # "rope" | "learned" | "alibi"
    # ALiBi (position_embedding "alibi"): per query head h, logits += alibi_slopes[h] * key
    # position (Bloom, MPT; the per-query constant of -slope * query position cancels in softmax).
    alibi_slopes: list[float] | None = None
    embed_norm: bool = False  # a norm right after the token embedding (Bloom: embed_layernorm)
    # Attention sinks (gpt-oss): a learned logit per query head (layers.{i}.self_attn.sinks [Hq])
    # joins every softmax denominator: it takes probability mass and attends to nothing.
    attn_sinks: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict (type/rope_type, factor, ...)
    partial_rotary_factor: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # Per layer "full" or "sliding" (None = all full, or all sliding when sliding_window set);
    # "chunked" (HF "chunked_attention") layers attend within their attention_chunk_size chunk.
    layer_types: list[str] | None = None
    # Chunked attention (Llama 4): a query at position p on a "chunked" layer sees keys k <= p
    # with k // C == p // C (chunks aligned to position 0). None = no chunked layers.
    attention_chunk_size: int | None = None
    # Attention scale = attn_scale if set, else head_dim ** -0.5.
    attn_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    # Layers that apply no rope at all (NoPE: SmolLM3, Cohere2 / EXAONE 4 full-attention layers).
    nope_layers: list[int] = field(default_factory=list)
    # Attention temperature tuning on NoPE layers (Llama 4): (floor_scale F, scale a); q at
    # position p is multiplied by 1 + a * log1p(floor((p + 1) / F)). None = off.
    nope_attn_temperature: tuple[float, float] | None = None
    # Layers with qk-norm when qk_norm is set (None = every layer; Llama 4: rope layers only).
    qk_norm_layers: list[int] | None = None
    # Local rope theta for sliding layers (Gemma3). Sliding layers then use plain (unscaled) rope
    # with this theta; rope_scaling applies to full-attention layers only.
    rope_local_theta: float | None = None
    # --- multipliers (Gemma, Granite) ---
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False  # lm_head.bias [V] (Phi, GPT-J)
    # --- MoE ---
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Router: "softmax" -> softmax(logits) then top-k (Mixtral, Qwen-MoE); "sigmoid" -> sigmoid
    # scores, top-k chosen on scores + router.bias within the best moe_topk_groups of
    # moe_num_groups groups (group score = sum of its top-2), weights = unbiased scores (DeepSeek-V3).
    moe_scoring: str = "softmax"
    moe_router_bias: bool = False
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    # A group's score = sum of its best moe_group_topn expert scores (2: DeepSeek-V3; 1 = the
    # group's max: DeepSeek-V2 group_limited_greedy).
    moe_group_topn: int = 2
    # router.bias [E] is part of the router logits, so of the weights too (gpt-oss), not only
    # of the selection (moe_router_bias).
    moe_router_logit_bias: bool = False
    # Expert biases experts.b_gate / b_up [E, I], b_down [E, H] (gpt-oss).
    moe_expert_bias: bool = False
    # The experts' gate: "act" = act(gate) * up; "swiglu_clamp" (gpt-oss) = g * sigmoid(alpha *
    # g) * (clamp(up, -L, L) + 1) with g = min(gate, L); alpha, L = extra["swiglu_alpha"],
    # extra["swiglu_limit"].
    moe_glu: str = "act"
    # Routed expert output multiplied by this (DeepSeek-V3 routed_scaling_factor).
    moe_routed_scaling: float = 1.0
    # The routing weight scales each expert's INPUT instead of its output (Llama 4):
    # sum_k expert_e(w[t,k] * x_t) rather than sum_k w[t,k] * expert_e(x_t).
    moe_scale_input: bool = False
    # Shared expert output multiplied by sigmoid(shared_expert_gate(x)) (Qwen2-MoE).
    shared_expert_gate: bool = False
    # Layers with a dense MLP (intermediate_size) in a MoE model (DeepSeek first_k_dense_replace,
    # Qwen-MoE mlp_only_layers / decoder_sparse_step).
    dense_mlp_layers: list[int] = field(default_factory=list)
    # --- tokens ---
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Extra per-family fields that do not deserve a top-level field. MLA (family "mla"):
    # q_lora_rank (Rq, None = plain q_proj), kv_lora_rank (Rkv), qk_nope_head_dim (Dn),
    # qk_rope_head_dim (Dr), v_head_dim (Dv). For MLA head_dim = Dn + Dr and num_kv_heads =
    # num_heads: the paged cache stores the expanded per-head K and V (V zero-padded to Dn + Dr).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of one layer (None = full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        # HF writes "sliding_attention"/"full_attention"; adapters may write "sliding"/"full".
        return self.sliding_window if self.layer_types[layer].startswith("sliding") else None

    def layer_chunk_size(self, layer: int) -> int | None:
        """The attention chunk of one layer (None = not a chunked-attention layer)."""
        if self.attention_chunk_size is None or self.layer_types is None:
            return None
        return self.attention_chunk_size if self.layer_types[layer].startswith("chunked") else None

    def layer_qk_norm(self, layer: int) -> bool:
        """Whether `layer` applies qk-norm (qk_norm, restricted to qk_norm_layers when set)."""
        return self.qk_norm and (self.qk_norm_layers is None or layer in self.qk_norm_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def kv_bytes_per_token(self, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """KV cache bytes of one token over all layers. `dtype_bytes`: the model dtype's size,
        used when kv_cache_dtype is "auto"; a quantized cache ("int8"/"fp8") stores one byte per
        element plus one float32 scale per (token, KV head) for K and for V (see
        xlaserve.quantization.kv_quant)."""
        from xlaserve.quantization.kv_quant import kv_elem_bytes

        per_head = self.head_dim * dtype_bytes
        if kv_cache_dtype != "auto":
            per_head = self.head_dim * kv_elem_bytes(kv_cache_dtype) + 4
        return 2 * self.num_layers * self.num_kv_heads * per_head
