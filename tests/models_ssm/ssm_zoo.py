"""Tiny random HF checkpoints of the state-space architectures (Mamba, Mamba2; hybrids later),
built with transformers config classes and saved with save_pretrained, plus the BPE tokenizer
of tests/tiny_models.py."""

from __future__ import annotations

VOCAB = 384  # tests/tiny_models.py's tokenizer size

# Oldest transformers whose reference we trust per architecture: transformers 5.17 (seen in the
# GPU machine's image) normalizes GraniteMoeHybrid's gated output norm over all groups at once,
# 5.24 (the Makefile's pin, as the engine) over each of n_groups (2 in these tiny models);
# versions between were not checked.
REFERENCE_MIN = {"granitemoehybrid": (5, 24)}
TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)

# name -> HF architecture
SSM_ARCHS = {
    "mamba": "MambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "jamba": "JambaForCausalLM",
    # issue 25 part B
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "falcon_h1_norm": "FalconH1ForCausalLM",
}
# Built by make_ssm_model too, tested in their own files (test_qwen3_next.py).
EXTRA_ARCHS = {"qwen3_next": "Qwen3NextForCausalLM"}


def _config(name: str):  # noqa: ANN202 - a transformers config
    import transformers as tf

    if name == "mamba":
        return tf.MambaConfig(
            vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
            conv_kernel=4, tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    if name == "mamba2":
        return tf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
            n_groups=2, expand=2, conv_kernel=4, num_hidden_layers=2, chunk_size=8,
            tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    if name == "bamba":  # attention at layers 1 and 3 of 4
        return tf.BambaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
            tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    if name == "granitemoehybrid":  # MoE + shared MLP, multipliers, rope, attention at 1 and 3
        return tf.GraniteMoeHybridConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["mamba", "attention", "mamba", "attention"],
            position_embedding_type="rope", embedding_multiplier=2.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=2.0, mamba_n_heads=8, mamba_d_head=16,
            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=8, tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    if name == "jamba":  # attention at layers 1 and 3, MoE at layers 1 and 3, Mamba v1 elsewhere
        return tf.JambaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
            attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    if name == "qwen3_next":  # gdn layers 0, 2 (Hv = 2 Hk), gated attention 1, 3; MoE at 1, 3
        return tf.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, full_attention_interval=2, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=2,
            tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    return _config_b(name)


def _config_b(name: str):  # noqa: ANN202 - issue 25 part B: LFM2, Nemotron-H, Falcon-H1
    import transformers as tf

    if name == "lfm2":  # short convolutions at 0 and 2, attention (qk-norm) at 1 and 3
        return tf.Lfm2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=192, block_multiple_of=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, conv_L_cache=3,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    if name == "lfm2_moe":  # dense SwiGLU at layer 0, sigmoid-routed MoE (expert bias) after
        return tf.Lfm2MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=1.5,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, conv_L_cache=3,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    if name == "nemotron_h":  # pattern M*-M-: Mamba2, attention (no rope), relu^2 MLP
        return tf.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention",
                               "mlp"],
            mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
            chunk_size=8, tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    if name in ("falcon_h1", "falcon_h1_norm"):  # parallel attention + Mamba2, muP multipliers
        norm = name == "falcon_h1_norm"  # the gated RMS norm (norm before gate)
        return tf.FalconH1Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            mamba_d_ssm=128, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
            mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=norm, mamba_norm_before_gate=norm,
            embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.5,
            attention_in_multiplier=1.5, attention_out_multiplier=0.75, ssm_in_multiplier=1.25,
            ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0], ssm_out_multiplier=0.8,
            mlp_multipliers=[0.75, 1.5], tie_word_embeddings=False, **TOKENS,
        )  # fmt: skip
    raise ValueError(name)


def make_ssm_model(name: str, path: str, seed: int = 0, std: float = 0.15) -> str:
    """Random weights ~N(0, std) for matrices, N(0, 0.05) for vectors, norms ~1."""
    import torch
    import transformers as tf
    from tiny_models import write_tokenizer

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(_config(name))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std if p.dim() > 1 else 0.05)
        for bname, b in model.named_buffers():
            if bname.endswith("expert_bias"):  # LFM2-MoE: a selection-only router bias
                b.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    write_tokenizer(path)
    return path


def reference_greedy(name: str, path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens for architecture `name` (tests/tiny_models.hf_greedy); skips
    the test where the installed transformers predates a fix the engine follows."""
    import pytest
    import transformers
    from tiny_models import hf_greedy

    need = REFERENCE_MIN.get(name)
    have = tuple(int(v) for v in transformers.__version__.split(".")[:2])
    if need is not None and have < need:
        pytest.skip(f"transformers {transformers.__version__} < {need}: its {name} reference "
                    "differs (REFERENCE_MIN)")  # fmt: skip
    return hf_greedy(path, prompts, n)
