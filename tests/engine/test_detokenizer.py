"""Incremental detokenizer: equals full decode, multi-byte UTF-8 split across tokens, stop strings."""

from __future__ import annotations

import pytest

from xlaserve.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from tiny_models import write_tokenizer

    d = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(d)
    return Tokenizer.from_dir(d)


TEXTS = [
    "And God said, Let there be light: and there was light.",
    "Zwölf Boxkämpfer jagen 日本語のテキスト 🙂 done",
    "emoji 🙂🙃 and ☃ snowman, ñ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("In the beginning")
    ids = tok.encode(text, add_special_tokens=False)
    # Multi-byte characters must really be split across byte-level tokens for this to mean anything.
    if any(ord(c) > 127 for c in text):
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    d = IncrementalDetokenizer(tok, prompt)
    seen = []
    for i in ids:
        d.add_tokens([i])
        shown = d.output_text(finished=False)
        assert "\ufffd" not in shown  # never shows half a character
        seen.append(shown)
    assert d.output_text(finished=True) == tok.decode(ids) == text
    assert all(seen[i].startswith(seen[i - 1]) for i in range(1, len(seen)))  # append-only


def test_stop_string_truncates_and_holds_back(tok: Tokenizer) -> None:
    ids = tok.encode("And God said, Let there be light", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["Let there"])
    stop = None
    for i in ids:
        # while running, a partial "Let the" is never shown
        assert "Let the" not in d.output_text(finished=False)
        stop = d.add_tokens([i]) or stop
        if stop:
            break
    assert stop == "Let there"
    assert d.output_text(finished=True) == "And God said, "


def test_stop_string_included(tok: Tokenizer) -> None:
    ids = tok.encode("And God said, Let there be light", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["said", "light"], include_stop_str_in_output=True)
    assert d.add_tokens(ids) == "said"
    assert d.output_text(finished=True) == "And God said"


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.chat_prompt_ids(msgs)
    assert ids[0] == tok._tok.token_to_id("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=False) == text
