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


def _chunks(d: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None, str]:
    """(text added per token, stop string, finished text) feeding `ids` one token at a time."""
    out, stop = [], None
    for i in ids:
        before = d.text
        stop = d.add_tokens([i])
        out.append(d.text[len(before) :])
        if stop:
            break
    d.flush()
    return out, stop, d.output_text(finished=True)


def _write_sentencepiece_style(path: str) -> None:
    """A Llama-2-style tokenizer.json: "▁" word marks, byte fallback, a decoder that strips the
    text's leading space, so a token's text depends on the tokens before it."""
    import json
    import os

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["▁", "▁And", "▁God", "▁said", "▁light", "▁the", "re", "▁be", ",", "ö", "lf"]:
        vocab[w] = len(vocab)
    hf = HFTokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece_style"])
def any_tok(
    request: pytest.FixtureRequest, tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Tokenizer:
    if request.param == "byte_level":
        return tok
    d = str(tmp_path_factory.mktemp("sptok"))
    _write_sentencepiece_style(d)
    sp = Tokenizer.from_dir(d)
    # Precondition: context changes a token's text ("▁" alone decodes to "", after a word " ").
    mark = sp.encode("a b", add_special_tokens=False)[2]
    assert sp.decode([mark]) == "" and sp.decode([mark, mark]) == " "
    return sp


@pytest.mark.parametrize("skip", [True, False])
def test_rust_stream_equals_python_window(any_tok: Tokenizer, skip: bool) -> None:
    """The DecodeStream path emits exactly the Python window's chunks, stop strings and flushed
    tail, over random ids (broken UTF-8, special tokens) and real multi-byte text, for a
    byte-level and a SentencePiece-style decoder."""
    import random

    tok = any_tok
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    fast_used = 0
    for trial in range(300):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 9))]
        if trial % 2:
            prompt = tok.encode(rng.choice(TEXTS))[: rng.randrange(1, 12)] if trial % 4 == 1 else []
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        if trial % 3 == 0:
            ids = tok.encode(rng.choice(TEXTS), add_special_tokens=False) + ids[:4]
        if special and trial % 5 == 0:
            ids.insert(rng.randrange(len(ids)), rng.choice(special))
        stop = ["ee", "light"] if trial % 7 == 0 else None
        fast = IncrementalDetokenizer(tok, prompt, skip, stop)
        slow = IncrementalDetokenizer(tok, prompt, skip, stop, rust_stream=False)
        assert slow._stream is None
        fast_used += fast._stream is not None
        assert _chunks(fast, ids) == _chunks(slow, ids), (prompt, ids)
    # Most cases must really take the Rust path (the rest: a context ending inside a character).
    assert fast_used > 150


def test_rust_stream_not_used_when_context_ends_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is split over byte-level tokens
    d = IncrementalDetokenizer(tok, ids[:1])
    assert d._stream is None
    assert IncrementalDetokenizer(tok, tok.encode("And God"))._stream is not None


def _naive_stop_text(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The stop rule on a whole text: the earliest-starting stop string (ties: first listed)."""
    best = min(((text.find(s), k, s) for k, s in enumerate(stops) if s in text), default=None)
    if best is None:
        return text, None
    i, _, s = best
    return (text[: i + len(s)] if include else text[:i]), s


@pytest.mark.parametrize(
    "stop,include", [(None, False), (["light", "ere"], False), (["ght."], True)]
)
def test_long_output_pieces_and_deltas(tok: Tokenizer, monkeypatch, stop, include) -> None:  # noqa: ANN001
    """A long output (past several compactions of the text's pieces): the deltas of
    `text_since` concatenate to output_text at every step, the pieces stay bounded, and the final
    text (and stop) is the whole decode cut by the stop rule."""
    from xlaserve.tokenizer import detokenizer as dt

    monkeypatch.setattr(dt, "COMPACT_PIECES", 8)  # compact often, so the head path is exercised
    ids = tok.encode(" ".join(TEXTS) * 6, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("In the beginning"), stop=stop,
                               include_stop_str_in_output=include)  # fmt: skip
    streamed, sent = "", 0
    for i in ids:
        hit = d.add_tokens([i])
        assert len(d._pieces) < 8
        delta, sent = d.text_since(sent, finished=hit is not None)
        streamed += delta
        assert streamed == d.output_text(finished=hit is not None)
        if hit:
            break
    d.flush()
    delta, sent = d.text_since(sent, finished=True)
    streamed += delta
    want, want_stop = _naive_stop_text(tok.decode(ids), stop or [], include)
    assert d.stop_reason == want_stop
    assert streamed == d.output_text(finished=True) == d.text == want
    assert d.text_since(len(want), finished=True) == ("", len(want))
