"""Fixtures of the speculative-decoding tests: a second tiny model (draft) and a tiny-vocabulary
model for the statistical tests."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import make_tiny_model

torch.set_num_threads(1)

SMALL_VOCAB = 24


def make_small_vocab_model(path: str, seed: int = 0, std: float = 0.25) -> str:
    """Llama with a 24-token word-level vocabulary ("t0".."t23"): distributions over few tokens,
    so sampled frequencies can be compared with exact probabilities."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=SMALL_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
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
    vocab = {f"t{i}": i for i in range(SMALL_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t0"}, f)
    return path


@pytest.fixture(scope="session")
def draft_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same architecture and vocabulary as tiny_model_dir('llama'), other random weights."""
    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-llama-draft")), seed=1)


@pytest.fixture(scope="session")
def small_vocab_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(target, draft) tiny-vocabulary models."""
    t = make_small_vocab_model(str(tmp_path_factory.mktemp("small-vocab-target")), seed=0)
    d = make_small_vocab_model(str(tmp_path_factory.mktemp("small-vocab-draft")), seed=3)
    return t, d
