"""Tiny random HF models with a real (locally trained) BPE tokenizer, saved in HF layout.

Used by the engine/parity tests: `make_tiny_model(kind, dir)` writes config.json,
model.safetensors, generation_config.json, tokenizer.json and tokenizer_config.json.
"""

from __future__ import annotations

import json
import os

# Public-domain text for the tokenizer (Genesis 1:1-5, KJV) plus ASCII/UTF-8 variety.
CORPUS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And the Spirit of God moved upon the face of the waters.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
    "And God called the light Day, and the darkness he called Night.",
    "The quick brown fox jumps over the lazy dog 0123456789 !?.,;:-+*/=()[]{}<>\"'",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 日本語のテキスト 🙂",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 384
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(path: str, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "model_max_length": 256,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)


def _config(kind: str):  # noqa: ANN202 - a transformers config
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return tf.LlamaConfig(**common)
    if kind == "llama3":
        return tf.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "mistral":
        return tf.MistralConfig(**common, sliding_window=12)
    if kind == "qwen2":
        return tf.Qwen2Config(**{**common, "tie_word_embeddings": True})
    if kind == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    raise ValueError(kind)


def make_tiny_model(kind: str, path: str, seed: int = 0, std: float = 0.15) -> str:
    """Random weights ~N(0, std) (large enough that greedy output does not repeat one token)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _config(kind)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std if p.dim() > 1 else 0.05)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    write_tokenizer(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding effects)."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


def hf_logprobs(path: str, prompt: list[int], continuation: list[int]) -> list[float]:
    """log P(continuation[i] | prompt + continuation[:i]) under transformers."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(continuation)]
