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


def _stop_at(tok: Tokenizer, text: str, stop: list[str], include: bool = False) -> tuple:
    """(stop string matched, finished text) feeding `text`'s tokens one call at a time."""
    d = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    for i in tok.encode(text, add_special_tokens=False):
        if d.add_tokens([i]):
            break
    return d.stop_reason, d.output_text(finished=True)


def test_stop_precedence_earliest_in_text_not_first_listed(tok: Tokenizer) -> None:
    """Two stop strings completed by the same token: the one starting earlier in the text wins,
    whatever the list order (SamplingParams docstring)."""
    text = "And God said, Let there be light"
    for stop in (["there", "Let there"], ["Let there", "there"]):
        assert _stop_at(tok, text, stop) == ("Let there", "And God said, ")
        assert _stop_at(tok, text, stop, include=True) == ("Let there", "And God said, Let there")
    # All tokens in one call (a multi-token step, e.g. speculative decoding): the same.
    d = IncrementalDetokenizer(tok, [], stop=["there", "Let there"])
    assert d.add_tokens(tok.encode(text, add_special_tokens=False)) == "Let there"
    # A stop string completed by an earlier token wins even though a later one starts earlier.
    assert _stop_at(tok, text, ["said, Let there", "God"]) == ("God", "And ")


def test_stop_precedence_tie_goes_to_the_first_listed(tok: Tokenizer) -> None:
    text = "And God said, Let there be light"
    ids = tok.encode(text, add_special_tokens=False)
    # Precondition: one token holds all of "there", so "the" and "there" complete together.
    assert any("there" in tok.decode([i]) for i in ids)
    assert _stop_at(tok, text, ["there", "the"], include=True) == (
        "there",
        "And God said, Let there",
    )
    assert _stop_at(tok, text, ["the", "there"], include=True) == ("the", "And God said, Let the")


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
