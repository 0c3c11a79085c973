"""Llama 4 specifics beyond the arch_zoo parity (which runs Llama4ForCausalLM on both backends):
a Llama4ForConditionalGeneration checkpoint (text_config, `language_model.` tensors, a vision
tower) is served text-only with the text model's logits; the adapter's spec fields."""

from __future__ import annotations

import json
import os

import torch
from arch_zoo import PROMPTS, _config_more, make_arch_model
from test_models_torch_parity import _ours, _ragged_last_logits

from xlaserve.model_loader.registry import build_spec


def _multimodal_checkpoint(text_dir: str, path: str) -> torch.nn.Module:
    """The tiny Llama 4 text model wrapped in a Llama4ForConditionalGeneration (a one-layer
    vision tower), saved at `path`; returns the HF text model for reference logits."""
    import transformers as tf

    text = tf.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).eval()
    vision = tf.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=32,
    )  # fmt: skip
    cfg = tf.Llama4Config(text_config=text.config.to_dict(), vision_config=vision.to_dict())
    mm = tf.Llama4ForConditionalGeneration(cfg)
    mm.language_model.load_state_dict(text.state_dict())
    mm.save_pretrained(path, safe_serialization=True)
    return text


def test_conditional_generation_checkpoint_serves_the_text_model(tmp_path) -> None:  # noqa: ANN001
    text_dir = make_arch_model("llama4", str(tmp_path / "text"))
    mm_dir = str(tmp_path / "mm")
    text = _multimodal_checkpoint(text_dir, mm_dir)
    with open(os.path.join(mm_dir, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Llama4ForConditionalGeneration"]
    spec = build_spec(mm_dir)
    want = build_spec(text_dir)
    for field in ("num_layers", "nope_layers", "qk_norm_layers", "dense_mlp_layers",
                  "attention_chunk_size", "layer_types", "nope_attn_temperature",
                  "intermediate_size", "moe_intermediate_size", "rope_scaling"):  # fmt: skip
        assert getattr(spec, field) == getattr(want, field), field
    _, model = _ours(mm_dir)  # loads: no vision tensor left over, no parameter missing
    ours = _ragged_last_logits(spec, model, PROMPTS)
    with torch.no_grad():
        ref = torch.stack([text(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)


def test_spec_reads_llama4_config() -> None:
    from xlaserve.model_loader.families import _llama4
    from xlaserve.model_loader.registry import base_spec_kwargs

    cfg = {**_config_more("llama4").to_dict(), "architectures": ["Llama4ForCausalLM"]}
    fields = _llama4(cfg, base_spec_kwargs(cfg, ""))
    assert fields["nope_layers"] == [1] and fields["qk_norm_layers"] == [0]
    assert fields["dense_mlp_layers"] == [0]  # interleave_moe_layer_step 2: layer 1 is MoE
    assert fields["layer_types"] == ["chunked_attention", "full_attention"]
    assert fields["attention_chunk_size"] == 8
    assert fields["nope_attn_temperature"] == (4.0, 0.5)
    assert fields["moe_scale_input"] and not fields["norm_topk_prob"]
    assert (fields["intermediate_size"], fields["moe_intermediate_size"]) == (128, 32)
    # attn_temperature_tuning off, no chunk size: neither field is set.
    off = _llama4({**cfg, "attn_temperature_tuning": False, "attention_chunk_size": None,
                   "layer_types": None}, base_spec_kwargs(cfg, ""))  # fmt: skip
    assert "nope_attn_temperature" not in off and "attention_chunk_size" not in off
