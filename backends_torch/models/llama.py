"""Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (qk-norm), Phi3 (fused checkpoint
tensors: the adapter's canonical q/k/v and gate/up slices are written back into the fused
qkv_proj / gate_up_proj rows); sliding windows, tied embeddings. The generic decoder
(`decoder.py`) with the Llama-style spec fields; kept as its own name so the family registry
reads naturally."""

from __future__ import annotations

from xlaserve.backends_torch.models.decoder import (
    DecoderAttention as LlamaAttention,
)
from xlaserve.backends_torch.models.decoder import (
    DecoderForCausalLM,
    layer_window,
)
from xlaserve.backends_torch.models.decoder import (
    DecoderLayer as LlamaDecoderLayer,
)

__all__ = ["LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "layer_window"]


class LlamaForCausalLM(DecoderForCausalLM):
    """See DecoderForCausalLM."""
