"""Llama family (Llama, Mistral, Qwen2, Qwen3, Phi3): the generic decoder (`decoder.py`) with the
Llama-style spec fields (RMS pre-norms, rope, gated MLP; qkv bias, qk-norm, sliding windows, tied
embeddings); kept as its own name so the family registry reads naturally."""

from __future__ import annotations

from xlaserve.models_flax.decoder import DecoderForCausalLM
from xlaserve.models_flax.decoder import DecoderLayer as LlamaDecoderLayer

__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM"]


class LlamaForCausalLM(DecoderForCausalLM):
    """See DecoderForCausalLM."""
