"""One generic decoder-only transformer built from a ModelSpec; every dense / MoE family is this
module with different spec fields, set by the adapters (model_loader/registry.py, families.py; the
README's models table lists them): norm kind / offset / placement (pre, sandwich, post-only), rope
(partial, local theta, NoPE layers, their temperature), learned positions or ALiBi, qkv / o / MLP / lm_head biases,
qk-norm, sliding windows, soft-caps, multipliers, parallel residual, FusedMoE in place of the MLP;
mla (DeepSeek) swaps in MLA attention (models/mla.py).

Parameter names are the canonical ones of `model_loader/spec.py` (layers/blocks.py builds the
projections). With Triton attention kernels, rotary and act-and-mul run in Triton too (see
`set_triton_ops`), rope + KV-cache write in one kernel on a float cache (fused_rope_kv).
"""

from __future__ import annotations

import torch
from torch import nn

from xlaserve.backends_torch.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchRefAttention,
)
from xlaserve.backends_torch.layers.blocks import (
    attention_heads,
    build_qkv,
    layer_rotary,
    layer_window,
    make_attention,
    make_mlp,
    pre_norm,
    project_qkv,
    spec_norm,
)
from xlaserve.backends_torch.layers.linear import VocabEmbedding, make_lm_head, make_vocab_embedding
from xlaserve.backends_torch.layers.moe import FusedMoE
from xlaserve.backends_torch.models.base import CausalLMBase, triton_ops_default
from xlaserve.config import KernelConfig, kernel_switch
from xlaserve.model_loader.spec import ModelSpec

__all__ = ["DecoderAttention", "DecoderForCausalLM", "DecoderLayer", "layer_window"]

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderAttention(nn.Module):
    """x [T, H] -> [T, H]: q/k/v projections, optional qk-norm, rope, paged attention, o_proj
    (the projections and this rank's heads from layers/blocks.py)."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: str,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        (self.hq, self.hkv), self.d = attention_heads(spec), spec.head_dim
        build_qkv(self, spec, layer, dtype, device, kernels)
        self.qk_norm = spec.layer_qk_norm(layer)
        self.full_qk_norm = self.qk_norm and spec.qk_norm_scope == "full"
        if self.qk_norm:
            qd, kd = (spec.q_size, spec.kv_size) if self.full_qk_norm else (self.d, self.d)
            self.q_norm = spec_norm(spec, qd, dtype, device)
            self.k_norm = spec_norm(spec, kd, dtype, device)
        self.rotary = layer_rotary(spec, layer, device)  # or Llama 4's NoPE-layer q temperature
        self.fuse_rope_kv = kernel_switch("fused_rope_kv", kernels)
        # sinks: gpt-oss attention sinks [Hq] (a parameter) or None
        self.attn, self.sinks = make_attention(spec, layer, (self.hq, self.hkv), backend, device)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv: KVCache, md: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = project_qkv(self, x)  # x may be a QuantAct (blocks.pre_norm): T from q
        if self.full_qk_norm:  # OLMo2: normalise the whole projection before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.hq, self.d)  # [T, Hq, D]
        k = k.view(-1, self.hkv, self.d)  # [T, Hkv, D]
        v = v.view(-1, self.hkv, self.d)
        if self.qk_norm and not self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            if self.fuse_rope_kv and self.rotary.triton_enabled and len(kv) == 2:
                # One kernel rotates q / k and writes k / v into the (float) paged cache.
                q = self.rotary.forward_write_kv(positions, q, k, v, kv[0], kv[1], md.slot_mapping)
                out = self.attn(q, None, None, kv, md, kv_written=True, sinks=self.sinks)
                return self.o_proj(out)
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv, md, sinks=self.sinks))


class DecoderLayer(nn.Module):
    """One block. forward returns (delta, residual): the layer's output is delta + residual (the
    residual stream is carried separately so a fused add + norm kernel can consume it)."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: str,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        h = spec.hidden_size
        self.pre_norms = spec.pre_norms
        self.sandwich = spec.sandwich_norms
        self.parallel = spec.parallel_residual
        self.rm = spec.residual_multiplier
        if spec.pre_norms:
            self.input_layernorm = spec_norm(spec, h, dtype, device)
            self.post_attention_layernorm = spec_norm(spec, h, dtype, device)
        if spec.family == "mla":
            from xlaserve.backends_torch.models.mla import MLAttention

            self.self_attn = MLAttention(spec, layer, backend, dtype, device, kernels)
        else:
            self.self_attn = DecoderAttention(spec, layer, backend, dtype, device, kernels)
        if spec.sandwich_norms:
            self.post_attn_out_norm = spec_norm(spec, h, dtype, device)
            self.post_mlp_out_norm = spec_norm(spec, h, dtype, device)
        if spec.is_moe_layer(layer):
            self.mlp = FusedMoE(spec, dtype, device, kernels=kernels)
        else:
            self.mlp = make_mlp(spec, layer, dtype, device, kernels)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv: KVCache,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.parallel:  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
            h, residual = self.input_layernorm.forward_residual(x, residual)
            a = self.self_attn(positions, h, kv, md)
            return a + self.mlp(self.post_attention_layernorm(residual)), residual
        if self.pre_norms:
            h, residual = pre_norm(self.input_layernorm, x, residual, self.self_attn)
        else:  # OLMo2: the block sees the raw residual stream
            residual = x if residual is None else x + residual
            h = residual
        h = self.self_attn(positions, h, kv, md)
        if self.sandwich:
            h = self.post_attn_out_norm(h)
        if self.rm != 1.0:
            h = h * self.rm
        if self.pre_norms:
            h, residual = pre_norm(self.post_attention_layernorm, h, residual, self.mlp)
        else:
            residual = h + residual
            h = residual
        h = self.mlp(h)
        if self.sandwich:
            h = self.post_mlp_out_norm(h)
        if self.rm != 1.0:
            h = h * self.rm
        return h, residual


class DecoderForCausalLM(CausalLMBase):
    """forward(input_ids [T], positions [T], kv_caches, md) -> hidden [T, H] (after the final norm);
    compute_logits(hidden [B, H]) -> [B, V] float32; compute_logits_raw: the lm_head output in the
    model dtype, or None when scaling / soft-capping applies."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: AttentionBackend | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        # The runner passes the engine's switches; None (built on its own): defaults + env.
        kc = kernels if kernels is not None else KernelConfig.from_env()
        attn_backend = attn_backend if attn_backend is not None else TorchRefAttention()
        self.spec = spec
        self._norm_offset = spec.norm_weight_offset
        self.embed_tokens = make_vocab_embedding(spec.vocab_size, spec.hidden_size, dtype, device)
        if spec.position_embedding == "learned":
            self.embed_positions = VocabEmbedding(
                spec.max_position_embeddings, spec.hidden_size, dtype, device
            )
        elif spec.position_embedding not in ("rope", "alibi"):
            raise ValueError(f"unknown position_embedding {spec.position_embedding!r}")
        if spec.embed_norm:  # Bloom: a LayerNorm right after the embedding
            self.embed_layernorm = spec_norm(spec, spec.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, attn_backend, dtype, device, kc) for i in range(spec.num_layers)
        )
        self.norm = spec_norm(spec, spec.hidden_size, dtype, device)
        if not spec.tie_word_embeddings:
            self.lm_head = make_lm_head(
                spec.hidden_size, spec.vocab_size, dtype, device, bias=spec.lm_head_bias
            )
        if kernels is not None:
            self.use_kernels(kernels)
        if triton_ops_default(device, attn_backend, kc):
            self.set_triton_ops(True)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        if self.spec.embedding_multiplier != 1.0:
            x = x * self.spec.embedding_multiplier
        if self.spec.position_embedding == "learned":
            x = x + self.embed_positions(positions)
        if self.spec.embed_norm:
            x = self.embed_layernorm(x)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv, attn_metadata)
        x, _ = self.norm.forward_residual(x, residual)
        return x

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        tied = self.spec.tie_word_embeddings
        return self.embed_tokens.as_lm_head(hidden) if tied else self.lm_head(hidden)

    @torch.inference_mode()
    def compute_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The lm_head output [B, V] in the model dtype, without compute_logits' float32 copy,
        when compute_logits would only upcast it (logits_scaling 1, no final soft-cap): its
        argmax and non-finite rows are then exactly those of compute_logits. None otherwise (a
        monotone transform rounded in float32 can still merge or split ties). For the greedy
        fast path (kernels_cuda.sampling.greedy_argmax)."""
        if self.spec.logits_scaling != 1.0 or self.spec.final_logit_softcap:
            return None
        return self._lm_head(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(hidden).float()
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        if self.spec.final_logit_softcap:
            cap = self.spec.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
