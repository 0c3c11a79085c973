"""Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (qk-norm); sliding windows, tied
embeddings. Built from a ModelSpec; parameter names are the canonical names."""

from __future__ import annotations

import torch
from torch import nn
from xlaserve.backends_torch.layers.activation import MLP
from xlaserve.backends_torch.layers.attention import Attention, AttentionBackend, AttentionMetadata
from xlaserve.backends_torch.layers.linear import Linear, VocabEmbedding
from xlaserve.backends_torch.layers.norm import make_norm
from xlaserve.backends_torch.layers.rotary import RotaryEmbedding
from xlaserve.backends_torch.models.base import CausalLMBase

from xlaserve.model_loader.spec import ModelSpec

KVCache = tuple[torch.Tensor, torch.Tensor]


def layer_window(spec: ModelSpec, i: int) -> int | None:
    """Sliding window of layer i; accepts HF's "sliding_attention" as well as "sliding"."""
    if spec.sliding_window is None:
        return None
    if spec.layer_types is None:
        return spec.sliding_window
    return spec.sliding_window if "sliding" in spec.layer_types[i] else None


class LlamaAttention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        h = spec.hidden_size
        self.q_proj = Linear(h, spec.q_size, spec.qkv_bias, dtype, device)
        self.k_proj = Linear(h, spec.kv_size, spec.qkv_bias, dtype, device)
        self.v_proj = Linear(h, spec.kv_size, spec.qkv_bias, dtype, device)
        self.o_proj = Linear(spec.q_size, h, spec.o_bias, dtype, device)
        if spec.qk_norm:
            self.q_norm = make_norm(
                spec.norm_kind,
                self.d,
                spec.norm_eps,
                spec.norm_weight_offset,
                dtype=dtype,
                device=device,
            )
            self.k_norm = make_norm(
                spec.norm_kind,
                self.d,
                spec.norm_eps,
                spec.norm_weight_offset,
                dtype=dtype,
                device=device,
            )
        self.qk_norm = spec.qk_norm
        window = layer_window(spec, layer)
        theta = spec.rope_local_theta if (window is not None and spec.rope_local_theta) else None
        self.rotary = RotaryEmbedding(spec, device, theta=theta)
        scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim**-0.5
        self.attn = Attention(
            self.hq, self.hkv, self.d, scale, backend, window, spec.attn_logit_softcap
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv: KVCache, md: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.hq, self.d)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.hkv, self.d)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv, md))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        super().__init__()
        norm = dict(dtype=dtype, device=device)
        self.input_layernorm = make_norm(
            spec.norm_kind, spec.hidden_size, spec.norm_eps, spec.norm_weight_offset, **norm
        )
        self.self_attn = LlamaAttention(spec, layer, backend, dtype, device)
        self.post_attention_layernorm = make_norm(
            spec.norm_kind, spec.hidden_size, spec.norm_eps, spec.norm_weight_offset, **norm
        )
        self.mlp = MLP(
            spec.hidden_size,
            spec.intermediate_size,
            spec.activation,
            spec.gated_mlp,
            spec.mlp_bias,
            dtype,
            device,
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv: KVCache,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual stream before it); the sum is the layer's output."""
        h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.self_attn(positions, h, kv, md)
        h, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(CausalLMBase):
    """forward(input_ids [T], positions [T], kv_caches, md) -> hidden [T, H] (after the final norm);
    compute_logits(hidden [B, H]) -> [B, V] float32."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        if attn_backend is None:
            from xlaserve.backends_torch.layers.attention import TorchRefAttention

            attn_backend = TorchRefAttention()
        self.spec = spec
        self._norm_offset = spec.norm_weight_offset
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, i, attn_backend, dtype, device) for i in range(spec.num_layers)
        )
        self.norm = make_norm(
            spec.norm_kind,
            spec.hidden_size,
            spec.norm_eps,
            spec.norm_weight_offset,
            dtype=dtype,
            device=device,
        )
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)

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
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv, attn_metadata)
        x, _ = self.norm.forward_residual(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden, w).float()
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        if self.spec.final_logit_softcap:
            cap = self.spec.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
