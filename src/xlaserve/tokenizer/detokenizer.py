"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte UTF-8 characters and byte-level BPE merges, so text is
decoded over a sliding window: `decode(ids[prefix:])` minus `decode(ids[prefix:read])`; when the
new tail ends in U+FFFD (an incomplete character) it is held back until more tokens arrive.

Stop strings (precedence: the `SamplingParams` docstring): after each token, of the stop strings
complete in the text the one that starts earliest wins (ties: the first listed); the finished
text is cut before it (or after it when `include_stop_str_in_output`); while running, the last
`max(len(stop)) - 1` characters are held back from `output_text` because they may still become
part of a stop string. The stop search looks only at the held-back tail plus the new text.

The text is kept as a compacted head string plus the recent pieces (at most COMPACT_PIECES), so
appending a token's text copies nothing: a `text += new` per token copies the whole text every
step, quadratic in the output length (a 32k-token answer: ~10^9 character copies). `text_since`
returns a delta (what streaming needs) without building the whole text.

The per-token step runs in Rust where the tokenizer is a `tokenizers.Tokenizer` with
`decoders.DecodeStream` (the same prefix / read window algorithm, one call per token instead of
two decodes): it is used only when it starts from the same state, i.e. its first step over the
prompt context emits text (a context ending inside a character keeps the Python path);
tests/engine/test_detokenizer.py checks chunk-for-chunk equality on random and real sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xlaserve.tokenizer import Tokenizer

try:
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21: the Python window only
    _HFTokenizer = _DecodeStream = None  # type: ignore[assignment,misc]

# Tokens decoded before the first new one, so the BPE decoder sees the context (spaces etc).
_INITIAL_CONTEXT = 5
# Pieces of new text kept apart before they are joined into the head string: the head is copied
# once per COMPACT_PIECES tokens instead of once per token.
COMPACT_PIECES = 256


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        rust_stream: bool = True,
    ) -> None:
        """`rust_stream=False`: always the Python window (tests compare the two)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # Token window: the last few prompt tokens give context, output tokens follow.
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        # All output text decoded so far (may end before the last tokens) = head + pieces.
        self._head = ""
        self._pieces: list[str] = []
        self._len = 0
        self._tail = ""  # the text's last `_hold` characters (the stop search's look-back)
        self.stop_reason: str | None = None
        self._stream, self._raw = (
            self._fast_stream(tokenizer, skip_special_tokens) if rust_stream else (None, None)
        )

    def _fast_stream(self, tokenizer: Tokenizer, skip: bool) -> tuple[Any, Any]:
        """(DecodeStream primed with the context, the raw tokenizer), or (None, None) when the
        Rust stream is unavailable or would not start where the Python window starts."""
        raw = getattr(tokenizer, "backend_tokenizer", None)
        if _DecodeStream is None or not isinstance(raw, _HFTokenizer):
            return None, None
        try:
            stream = _DecodeStream(skip_special_tokens=skip)
            if self._ids and stream.step(raw, list(self._ids)) is None:
                return None, None  # the context ends inside a character (or is all skipped)
        except (TypeError, ValueError, OverflowError, RuntimeError):  # old or refusing build
            return None, None
        return stream, raw

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append output tokens; return the stop string matched (text is then truncated) or None."""
        if self._stream is not None:
            return self._add_fast(token_ids)
        for tok in token_ids:
            self._ids.append(tok)
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            full = self._decode(self._ids[self._prefix :])
            if (
                len(full) > len(prefix_text)
                and not full.endswith("\ufffd")
                and self._emit(full[len(prefix_text) :])
            ):
                return self.stop_reason
        return None

    @property
    def text(self) -> str:
        """All output text decoded so far (one join of the recent pieces into the head)."""
        if self._pieces:
            self._head += "".join(self._pieces)
            self._pieces.clear()
        return self._head

    def _append(self, new: str) -> None:
        self._pieces.append(new)
        self._len += len(new)
        if len(self._pieces) >= COMPACT_PIECES:
            self._head += "".join(self._pieces)
            self._pieces.clear()

    def _emit(self, new: str) -> bool:
        """New text for the tokens up to the last one: advance the window; True on a stop."""
        self._prefix = self._read
        self._read = len(self._ids)
        if not self.stop:
            self._append(new)
            return False
        # A stop string completed by this text starts in the held-back tail or in `new`.
        window = self._tail + new
        base = self._len - len(self._tail)  # the text index of window[0]
        self._append(new)
        self._tail = window[-self._hold :] if self._hold else ""
        return self._check_stop(window, base)

    def _add_fast(self, token_ids: list[int]) -> str | None:
        """`add_tokens` through the Rust stream; the window offsets kept in step for `flush`."""
        stream, raw = self._stream, self._raw
        for n, tok in enumerate(token_ids):
            try:
                new = stream.step(raw, tok)
            except Exception:  # noqa: BLE001 - e.g. "Invalid prefix" where the window's text
                # changes under a byte-fallback decoder: the Python window from here on
                self._stream = None
                return self.add_tokens(token_ids[n:])
            self._ids.append(tok)
            if new and self._emit(new):
                return self.stop_reason
        return None

    def flush(self) -> None:
        """At finish: emit tokens still held back for an incomplete character."""
        if self._read < len(self._ids) and self.stop_reason is None:
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            full = self._decode(self._ids[self._prefix :])
            self._append(full[len(prefix_text) :])
            self._prefix = self._read = len(self._ids)

    def _check_stop(self, window: str, base: int) -> bool:
        """The earliest stop string in `window` (the text from index `base` on): cut the text
        there and return True; else False."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = window.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        cut = base + i + (len(s) if self.include_stop else 0)
        self._head = self.text[:cut]
        self._len = len(self._head)
        self.stop_reason = s
        return True

    def _visible_len(self, finished: bool) -> int:
        if finished or not self._hold or self.stop_reason is not None:
            return self._len
        return max(0, self._len - self._hold)

    def output_text(self, finished: bool) -> str:
        """Text safe to show: everything when finished, else minus the held-back tail."""
        return self.text[: self._visible_len(finished)]

    def text_since(self, start: int, finished: bool) -> tuple[str, int]:
        """(output_text(finished)[start:], len(output_text(finished))), reading only the
        pieces that hold it: the delta of a streamed output since `start` characters."""
        end = self._visible_len(finished)
        if start >= end:
            return "", end
        pos, picked = self._len, []
        for piece in reversed(self._pieces):
            if pos <= start:
                break
            picked.append(piece)
            pos -= len(piece)
        if pos > start:  # it reaches into the head
            picked.append(self._head[start:])
            pos = start
        return "".join(reversed(picked))[start - pos : end - pos], end


class NullDetokenizer:
    """`SamplingParams(detokenize=False)`: the detokenizer's interface with no text at all."""

    text = ""
    stop_reason: str | None = None

    def text_since(self, start: int, finished: bool) -> tuple[str, int]:
        return "", 0

    def add_tokens(self, token_ids: list[int]) -> str | None:
        return None

    def flush(self) -> None:
        pass

    def output_text(self, finished: bool) -> str:
        return ""
