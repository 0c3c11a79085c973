"""Tiny random HF checkpoints of every supported architecture (2 layers, hidden 64), built with
transformers config classes and saved with save_pretrained, plus a real BPE tokenizer."""

from __future__ import annotations

import torch

VOCAB = 384  # tests/tiny_models.py's tokenizer size
TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)  # all inside the vocab (Phi3)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    **TOKENS,
)
WINDOW = 8  # sliding window small enough that the test prompts exceed it


def _config(name: str):  # noqa: ANN202, PLR0911 - a transformers config
    import transformers as tf

    c = COMMON
    if name == "llama":
        rs = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        }
        return tf.LlamaConfig(**c, rope_parameters=rs)
    if name == "mistral":
        return tf.MistralConfig(**c, sliding_window=WINDOW)
    if name == "qwen2":
        return tf.Qwen2Config(**{**c, "tie_word_embeddings": True})
    if name == "qwen3":
        return tf.Qwen3Config(**c, head_dim=32)
    if name == "gemma":
        return tf.GemmaConfig(**{**c, "tie_word_embeddings": True}, head_dim=16)
    if name == "gemma2":
        return tf.Gemma2Config(
            **{**c, "tie_word_embeddings": True},
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,  # small caps so that they change the result
            final_logit_softcapping=2.0,
        )
    if name == "gemma3":
        return tf.Gemma3TextConfig(
            **{**c, "tie_word_embeddings": True},
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        )
    if name == "phi3":
        return tf.Phi3Config(
            **c,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        )
    if name == "gpt2":
        return tf.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, **TOKENS
        )
    if name == "olmo2":
        return tf.Olmo2Config(**c)
    if name == "gpt_neox":
        kw = {k: v for k, v in c.items() if k != "num_key_value_heads"}
        return tf.GPTNeoXConfig(**kw)  # parallel residual, partial rotary 0.25
    if name == "gpt_neox_seq":
        kw = {k: v for k, v in c.items() if k != "num_key_value_heads"}
        return tf.GPTNeoXConfig(**kw, use_parallel_residual=False)
    if name == "starcoder2":
        return tf.Starcoder2Config(**c, sliding_window=WINDOW)
    if name == "granite":
        return tf.GraniteConfig(
            **c,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.15,
            logits_scaling=2.0,
        )
    if name == "mixtral":
        return tf.MixtralConfig(
            **{**c, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2
        )
    if name == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **c,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
        )
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **c,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    if name == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**c, "num_key_value_heads": 4},
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            routed_scaling_factor=2.5,
        )
    raise ValueError(name)


# name -> HF architectures[0] it produces
ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "olmo2": "Olmo2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gpt_neox_seq": "GPTNeoXForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def make_arch_model(name: str, path: str, seed: int = 0, std: float = 0.15) -> str:
    """Random weights ~N(0, std), norms ~1 + N(0, 0.1) (0 + .. for offset-1 Gemma norms), saved
    with save_pretrained + generation config + tokenizer."""
    import transformers as tf
    from tiny_models import write_tokenizer

    torch.manual_seed(seed)
    cfg = _config(name)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            is_norm = "norm" in pname or ".ln_" in pname or "ln_f." in pname
            if is_norm and pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif is_norm:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            elif "e_score_correction_bias" in pname:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std if p.dim() > 1 else 0.05)
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:  # a buffer in transformers: make it matter
                b.copy_(0.1 * torch.randn_like(b))
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    write_tokenizer(path)
    return path


def load_hf(path: str) -> torch.nn.Module:
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return m.eval()


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding effects)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs
