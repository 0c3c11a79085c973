"""Flax NNX models: family name (ModelSpec.family) -> model class, imported lazily."""

from __future__ import annotations

import importlib

# family -> "module:Class" under xlaserve.models_flax.
_FAMILIES: dict[str, str] = {
    "llama": "llama:LlamaForCausalLM",
    # The generic decoder serves every family below through ModelSpec fields (see decoder.py).
    "granite": "decoder:DecoderForCausalLM",
    "gemma": "decoder:DecoderForCausalLM",
    "olmo2": "decoder:DecoderForCausalLM",
    "gpt2": "decoder:DecoderForCausalLM",
    "gpt_neox": "decoder:DecoderForCausalLM",
    "starcoder2": "decoder:DecoderForCausalLM",
    "moe": "decoder:DecoderForCausalLM",
    "mla": "decoder:DecoderForCausalLM",  # + MLAttention (mla.py)
    # State-space models (issue 25): recurrent state slots beside / instead of paged K/V.
    "mamba": "mamba:MambaForCausalLM",
    "mamba2": "mamba:MambaForCausalLM",
    "hybrid": "mamba:HybridForCausalLM",
    # Qwen3-Next: gated delta-net linear attention + gated attention + MoE (issue 25 part A).
    "qwen3_next": "qwen3_next:Qwen3NextForCausalLM",
}


def supported_families() -> list[str]:
    return sorted(_FAMILIES)


def get_model_class(family: str) -> type:
    """The Flax model class serving `family`; ValueError naming the supported ones otherwise."""
    if family not in _FAMILIES:
        raise ValueError(
            f"model family {family!r} has no Flax implementation (backend 'xla'); "
            f"supported: {', '.join(supported_families())}. Try backend='torch'."
        )
    module, _, cls = _FAMILIES[family].partition(":")
    return getattr(importlib.import_module(f"xlaserve.models_flax.{module}"), cls)
