"""Family name (ModelSpec.family) -> Torch model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

# family -> "module:Class"
_FAMILIES: dict[str, str] = {
    "llama": "xlaserve.backends_torch.models.llama:LlamaForCausalLM",
    # The generic decoder serves every family below through ModelSpec fields (see decoder.py).
    "granite": "xlaserve.backends_torch.models.decoder:DecoderForCausalLM",
    "gemma": "xlaserve.backends_torch.models.decoder:DecoderForCausalLM",
    "olmo2": "xlaserve.backends_torch.models.decoder:DecoderForCausalLM",
    "gpt2": "xlaserve.backends_torch.models.decoder:DecoderForCausalLM",
    "gpt_neox": "xlaserve.backends_torch.models.decoder:DecoderForCausalLM",
    "starcoder2": "xlaserve.backends_torch.models.decoder:DecoderForCausalLM",
    "moe": "xlaserve.backends_torch.models.decoder:DecoderForCausalLM",
    "mla": "xlaserve.backends_torch.models.mla:MLAForCausalLM",
    # State-space models (issue 25): recurrent state slots beside / instead of paged K/V.
    "mamba": "xlaserve.backends_torch.models.mamba:MambaForCausalLM",
    "mamba2": "xlaserve.backends_torch.models.mamba:MambaForCausalLM",
    "hybrid": "xlaserve.backends_torch.models.mamba:HybridForCausalLM",
    # Qwen3-Next: gated delta-net linear attention + gated attention + MoE (issue 25 part A).
    "qwen3_next": "xlaserve.backends_torch.models.qwen3_next:Qwen3NextForCausalLM",
}


def register_model_family(family: str, target: str) -> None:
    _FAMILIES[family] = target


def supported_families() -> list[str]:
    return sorted(_FAMILIES)


def get_model_class(family: str) -> type[nn.Module]:
    if family not in _FAMILIES:
        raise ValueError(
            f"the torch backend has no model for family {family!r}; "
            f"supported families: {', '.join(supported_families())}"
        )
    module, _, cls = _FAMILIES[family].partition(":")
    return getattr(importlib.import_module(module), cls)
