"""The demo models shipped in src/xlaserve/assets (made by tools/train_demo.py).

Checks that HF transformers loads both directories unchanged and offline, that the tokenizer and
chat template behave, that the weights are trained (low loss on held-out KJV text, English greedy
output), and that the files stay small.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from optional_deps import import_or_skip

from xlaserve.demo import (
    DEMO_DRAFT_DIR,
    DEMO_MODEL_DIR,
    demo_draft_model_path,
    demo_model_path,
)

torch = import_or_skip("torch")
transformers = import_or_skip("transformers")

DIRS = {"main": DEMO_MODEL_DIR, "draft": DEMO_DRAFT_DIR}
HF_FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "README.md",
]
MAX_FILE_BYTES = 8_000_000
KJV_WORDS = {"the", "and", "unto", "god", "lord", "of", "he", "shall", "that", "said"}
# Genesis 50:1-4: chapter 50 of the Bible (index 49) is in the held-out set (every 50th chapter).
HELD_OUT_TEXT = (
    "And Joseph fell upon his father's face, and wept upon him, and kissed him.\n"
    "And Joseph commanded his servants the physicians to embalm his father: and the physicians "
    "embalmed Israel.\n"
    "And forty days were fulfilled for him; for so are fulfilled the days of those which are "
    "embalmed: and the Egyptians mourned for him threescore and ten days.\n"
    "And when the days of his mourning were past, Joseph spake unto the house of Pharaoh, saying, "
    "If now I have found grace in your eyes, speak, I pray you, in the ears of Pharaoh, saying,\n"
)


@pytest.fixture(scope="module", autouse=True)
def _offline() -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def models() -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    out = {}
    for k, d in DIRS.items():
        m = AutoModelForCausalLM.from_pretrained(d)
        m.eval()
        out[k] = m
    return out


def _greedy(model, tokenizer, prompt: str, n: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=False)


def _words(text: str) -> list[str]:
    return [w.strip(".,;:!?'()").lower() for w in text.split()]


# ----------------------------------------------------------------------------- layout


def test_paths_and_files() -> None:
    assert demo_model_path() == DEMO_MODEL_DIR
    assert demo_draft_model_path() == DEMO_DRAFT_DIR
    for d in DIRS.values():
        for name in HF_FILES:
            path = os.path.join(d, name)
            assert os.path.isfile(path), path
            assert os.path.getsize(path) < MAX_FILE_BYTES, (path, os.path.getsize(path))
            # Package data must stay readable by any user after `pip install`.
            assert os.stat(path).st_mode & 0o444 == 0o444, path


def test_demo_module_imports_no_backend() -> None:
    code = (
        "import sys, xlaserve.demo; assert 'torch' not in sys.modules and 'jax' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_configs() -> None:
    cfgs = {k: json.load(open(os.path.join(d, "config.json"))) for k, d in DIRS.items()}
    for cfg in cfgs.values():
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["torch_dtype"] in ("float32", "bfloat16")
        assert cfg["tie_word_embeddings"] is True
        assert cfg["max_position_embeddings"] == 512
        assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
        assert cfg["vocab_size"] == cfgs["main"]["vocab_size"]
    assert cfgs["draft"]["hidden_size"] < cfgs["main"]["hidden_size"]
    assert cfgs["draft"]["num_hidden_layers"] < cfgs["main"]["num_hidden_layers"]
    # One tokenizer for both, so the draft model can propose tokens for the main one.
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        a = open(os.path.join(DEMO_MODEL_DIR, name), "rb").read()
        assert a == open(os.path.join(DEMO_DRAFT_DIR, name), "rb").read(), name


def test_generation_config() -> None:
    from transformers import GenerationConfig

    for d in DIRS.values():
        gc = GenerationConfig.from_pretrained(d)
        gc.validate(strict=True)
        assert gc.eos_token_id == [0, 2]
        assert gc.temperature == pytest.approx(0.8) and gc.top_p == pytest.approx(0.95)


def test_xlaserve_spec_reads_demo() -> None:
    from xlaserve.model_loader.registry import build_spec

    spec = build_spec(DEMO_MODEL_DIR)
    assert spec.eos_token_ids == [0, 2]
    assert (
        spec.num_layers
        == json.load(open(os.path.join(DEMO_MODEL_DIR, "config.json")))["num_hidden_layers"]
    )


# ----------------------------------------------------------------------------- tokenizer


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert tokenizer.model_max_length == 512
    assert tokenizer.encode("And God said") == tokenizer.encode(
        "And God said", add_special_tokens=False
    )
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[-1] == 2


def test_tokenizer_round_trip(tokenizer) -> None:
    texts = [
        "In the beginning God created the heaven and the earth.",
        "  leading spaces, trailing\n\n\ttabs\t",
        "Héllo wörld — naïve café, 你好，世界, Привет, مرحبا, 🙂👍🏽 ∑x²",
        "",
        "\x00\x7f control",
    ]
    rng = random.Random(0)
    alphabet = [chr(c) for c in (*range(32, 127), *range(0xA0, 0x250), 0x4E2D, 0x1F600, 0x10FFFF)]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(50)]
    for t in texts:
        ids = tokenizer.encode(t)
        assert all(0 <= i < len(tokenizer) for i in ids)
        assert tokenizer.decode(ids) == t, t


def test_common_words_are_single_tokens(tokenizer) -> None:
    # Trained on KJV text: its frequent words are one token each.
    for w in [" the", " and", " unto", " God", " LORD", " said"]:
        assert len(tokenizer.encode(w)) == 1, w


def test_chat_template(tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Recite John 3:16."},
    ]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nRecite John 3:16.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2


# ----------------------------------------------------------------------------- weights


def test_parameter_counts(models) -> None:
    n_main = sum(p.numel() for p in models["main"].parameters())
    n_draft = sum(p.numel() for p in models["draft"].parameters())
    assert 1_000_000 <= n_main <= 5_000_000, n_main
    assert n_draft * 5 <= n_main, (n_draft, n_main)
    card = open(os.path.join(DEMO_MODEL_DIR, "README.md")).read()
    assert f"{n_main:,}" in card and f"{n_draft:,}" in card


@pytest.mark.parametrize("which,max_loss", [("main", 4.0), ("draft", 5.0)])
def test_held_out_loss(models, tokenizer, which: str, max_loss: float) -> None:
    # An untrained model scores ~ln(vocab) = 7.6 nats/token; unigram statistics alone ~5.5.
    ids = torch.tensor([tokenizer.encode(HELD_OUT_TEXT)])
    with torch.no_grad():
        loss = models[which](input_ids=ids, labels=ids).loss.item()
    assert loss < max_loss, loss


def test_greedy_writes_kjv_english(models, tokenizer) -> None:
    text = _greedy(models["main"], tokenizer, "And God said", 32)
    words = _words(text)
    alpha = [w for w in words if w.isalpha()]
    assert len(alpha) >= 3 and len(alpha) >= 0.7 * len(words), text
    assert KJV_WORDS & set(alpha), text


def test_draft_greedy_writes_english(models, tokenizer) -> None:
    text = _greedy(models["draft"], tokenizer, "And God said", 24)
    alpha = [w for w in _words(text) if w.isalpha()]
    assert len(alpha) >= 3, text
    assert KJV_WORDS & set(alpha), text


def test_chat_answer_ends_with_im_end(models, tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Recite Genesis 1:1."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = models["main"].generate(**ids, max_new_tokens=96, do_sample=False, pad_token_id=0)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    # generation_config stops on <|endoftext|> or <|im_end|>: the answer is a verse, then <|im_end|>.
    assert new[-1] == 2, tokenizer.decode(new)
    answer = tokenizer.decode(new[:-1])
    assert len([w for w in _words(answer) if w.isalpha()]) >= 3, answer
    assert "<|im_start|>" not in answer


def test_card_reports_measurements() -> None:
    # Each card lists both models' held-out numbers, as recorded by the training runs.
    metas = [json.load(open(os.path.join(d, "training_meta.json"))) for d in DIRS.values()]
    for d in DIRS.values():
        card = open(os.path.join(d, "README.md")).read()
        for m in metas:
            r = m["result"]
            assert f"{r['val_loss']:.3f}" in card and f"{r['val_ppl']:.1f}" in card
            assert m["command"] in card
        assert "tools/train_demo.py" in card and "public domain" in card
