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
SMALL_FFN = {**COMMON, "intermediate_size": 32}  # MoE experts' size where it is intermediate_size
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.15, logits_scaling=2.0
)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# DeepSeek-style routing (V3 and the families that copied it) and MLA sizes (V2, V3).
DS_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
# The parity tests' mixed-length batch (both backends): prompts across the window / chunk (8).
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],  # longer than the sliding window (8)
    [40, 41, 42],
    list(range(100, 123)),  # several blocks, well past the window
    [200],
]
MAX_NEW = 6  # greedy tokens compared
S = 4  # block size


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
        return tf.GraniteConfig(**c, **GRANITE_MULTIPLIERS)
    if name == "mixtral":
        return tf.MixtralConfig(
            **{**c, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2
        )
    if name == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **c, **QWEN_MOE, shared_expert_intermediate_size=64, norm_topk_prob=False
        )
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**c, head_dim=16, **QWEN_MOE, norm_topk_prob=True)
    if name == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**c, "num_key_value_heads": 4}, **DS_MOE, q_lora_rank=32, **MLA
        )
    cfg = _config_more(name)
    if cfg is None:
        raise ValueError(name)
    return cfg


def _config_more(name: str):  # noqa: ANN202, PLR0911, PLR0912 - a transformers config or None
    """Families declared as data in model_loader/families.py (issue 26)."""
    import transformers as tf

    c = COMMON
    no_kv = {k: v for k, v in c.items() if k != "num_key_value_heads"}
    gpt = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, **TOKENS)
    sliding = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    if name == "helium":
        return tf.HeliumConfig(**c, head_dim=16, attention_bias=True)
    if name == "seed_oss":
        return tf.SeedOssConfig(**c, head_dim=16, attention_bias=True, attention_out_bias=True)
    if name == "ernie4_5":
        return tf.Ernie4_5Config(**c, head_dim=16, use_bias=True)
    if name == "arcee":
        return tf.ArceeConfig(**c)
    if name == "ministral":
        return tf.MinistralConfig(**c, head_dim=16, **sliding)
    if name == "smollm3":
        return tf.SmolLM3Config(**c, no_rope_layers=[1, 0])
    if name == "glm":
        return tf.GlmConfig(**{**c, "intermediate_size": 96}, head_dim=16)
    if name == "glm4":
        return tf.Glm4Config(**{**c, "intermediate_size": 96}, head_dim=16)
    if name == "nemotron":
        return tf.NemotronConfig(**c, head_dim=16)
    if name == "stablelm":
        return tf.StableLmConfig(**c, use_qkv_bias=True)
    if name == "stablelm_par":
        return tf.StableLmConfig(**c, use_parallel_residual=True)
    if name == "cohere":
        return tf.CohereConfig(**c, logit_scale=0.5)
    if name == "cohere2":
        return tf.Cohere2Config(**c, logit_scale=0.5, **sliding)
    if name == "olmo3":
        return tf.Olmo3Config(**c, **sliding)
    if name == "exaone4":
        return tf.Exaone4Config(**c, **sliding)
    if name == "olmoe":
        return tf.OlmoeConfig(**SMALL_FFN, num_experts=4, num_experts_per_tok=2)
    if name == "granitemoe":
        return tf.GraniteMoeConfig(
            **SMALL_FFN, num_local_experts=4, num_experts_per_tok=2, **GRANITE_MULTIPLIERS
        )
    if name == "granitemoeshared":
        return tf.GraniteMoeSharedConfig(
            **SMALL_FFN,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
        )
    if name == "cwm":
        return tf.CwmConfig(**c, head_dim=16, **sliding)
    if name == "gptj":
        return tf.GPTJConfig(**gpt, rotary_dim=8)
    if name == "phi":
        return tf.PhiConfig(**no_kv)
    if name == "opt":
        return tf.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            **TOKENS,
        )
    if name == "gpt_bigcode":
        return tf.GPTBigCodeConfig(**gpt)
    if name == "falcon":  # Falcon-40B/180B layout: grouped qkv, ln_attn + ln_mlp
        # eos 383: HF generate(min_new_tokens) masks eos, and these weights pick token 0 once.
        return tf.FalconConfig(
            **{**no_kv, "tie_word_embeddings": True, "eos_token_id": VOCAB - 1},
            new_decoder_architecture=True,
            num_kv_heads=2,
        )
    if name == "falcon_mqa":  # Falcon-7B layout: multi-query, one norm for a parallel block
        return tf.FalconConfig(**no_kv, multi_query=True, parallel_attn=True)
    if name == "bloom":  # 6 heads: the non-power-of-two slope rule
        return tf.BloomConfig(
            vocab_size=VOCAB, hidden_size=96, n_layer=2, n_head=6, seq_length=256, **TOKENS
        )
    if name == "mpt":
        return tf.MptConfig(
            vocab_size=VOCAB, d_model=96, n_layers=2, n_heads=6, max_seq_len=256, **TOKENS
        )
    if name == "gpt_oss":
        return tf.GptOssConfig(
            **SMALL_FFN,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=1.0,  # small so that the clamps bite at these weight scales
            **sliding,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 64,
                "truncate": False,
            },
        )
    if name == "llama4":  # rope layers: chunked (8), qk L2-norm; NoPE layer: temperature
        return tf.Llama4TextConfig(
            **SMALL_FFN,
            intermediate_size_mlp=128,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,  # layer 0 dense, layer 1 MoE (+ shared expert)
            no_rope_layers=[1, 0],  # HF: 1 = rope; layer 1 is NoPE
            attention_chunk_size=WINDOW,
            floor_scale=4,  # small so that the temperature changes within the test prompts
            attn_scale=0.5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if name == "llama4_topk":  # top-2 input-scaled routing, every layer MoE, qk-norm off
        return tf.Llama4TextConfig(
            **SMALL_FFN,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            no_rope_layers=[0, 1],
            use_qk_norm=False,
            attention_chunk_size=WINDOW,
            floor_scale=4,
        )
    if name == "glm4_moe":
        return tf.Glm4MoeConfig(**c, head_dim=16, use_qk_norm=True, **DS_MOE)
    if name == "dots1":
        return tf.Dots1Config(**c, head_dim=16, **DS_MOE)
    if name == "ernie4_5_moe":
        return tf.Ernie4_5_MoeConfig(
            **c,
            head_dim=16,
            moe_intermediate_size=32,
            moe_k=2,
            moe_num_experts=4,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        )
    if name == "deepseek_v2":  # V2 routing: group_limited_greedy (a group's max), no renorm
        return tf.DeepseekV2Config(
            **{**c, "num_key_value_heads": 4},
            **{**DS_MOE, "routed_scaling_factor": 2.0, "norm_topk_prob": False},  # V2 defaults
            topk_method="group_limited_greedy",
            q_lora_rank=None,  # V2-Lite: plain q_proj
            **MLA,
        )
    return None


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
    # issue 26: families declared as data (model_loader/families.py)
    "helium": "HeliumForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "arcee": "ArceeForCausalLM",
    "ministral": "MinistralForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "stablelm_par": "StableLmForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "cwm": "CwmForCausalLM",
    "gptj": "GPTJForCausalLM",
    "phi": "PhiForCausalLM",
    "opt": "OPTForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "falcon": "FalconForCausalLM",
    "falcon_mqa": "FalconForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "bloom": "BloomForCausalLM",
    "mpt": "MptForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "llama4_topk": "Llama4ForCausalLM",
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
