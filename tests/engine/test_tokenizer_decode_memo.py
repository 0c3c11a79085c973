"""Tokenizer.decode memoises single-token decodes: same text as the HF tokenizer, both
skip_special_tokens values, cached or not; multi-token windows are never served from it."""

from __future__ import annotations

from xlaserve.tokenizer import Tokenizer


def test_single_token_memo_equals_hf_decode(tiny_model_dir) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir("llama"))
    hf = tok._tok
    assert tok.all_special_ids  # the skip flag matters for some ids
    for skip in (True, False):
        for _ in range(2):  # first call fills the memo, the second reads it
            for i in range(tok.vocab_size):
                assert tok.decode([i], skip_special_tokens=skip) == hf.decode(
                    [i], skip_special_tokens=skip
                )
    special = min(tok.all_special_ids)
    assert tok.decode([special], skip_special_tokens=True) != tok.decode(
        [special], skip_special_tokens=False
    )
    ids = hf.encode("And God saw the light").ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
