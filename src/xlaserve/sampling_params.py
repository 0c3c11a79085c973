"""Sampling parameters of one request (vLLM-compatible names and semantics).

Order of logits processing, identical in every backend's sampler:
1. logit_bias (added), min_tokens (EOS/stop_token_ids masked while fewer outputs than min_tokens),
   structured-output bitmask (disallowed -> -inf),
2. repetition_penalty (prompt + output tokens: positive logits divided, negative multiplied),
   frequency_penalty (minus count in output), presence_penalty (minus once if in output),
3. greedy (temperature == 0): argmax; else divide by temperature, then top_k, top_p, min_p
   filtering, then sample with the request's generator (seeded when `seed` is set).
   Token constraints go with step 1, after logit_bias: bad_words (a word's last token -> -inf
   when the output ends with the word's other tokens), allowed_token_ids (every other token ->
   -inf), then logits_processors (callables, in list order; torch backend).
Logprobs are of the raw model distribution (log_softmax of the unprocessed logits).
"""

from __future__ import annotations

import copy
import enum
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """Exactly one field set: the constraint on the generated text."""

    json: dict[str, Any] | str | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar / GBNF dialect)

    def __post_init__(self) -> None:
        n = sum(
            [
                self.json is not None,
                bool(self.json_object),
                self.regex is not None,
                self.choice is not None,
                self.grammar is not None,
            ]
        )
        if n != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar"
                f" (got {n})"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    def key(self) -> tuple[str, str]:
        """Hashable (kind, spec) used to cache compiled grammars."""
        import json as _json

        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):  # as text: one key with the same schema as a dict
                try:
                    schema = _json.loads(schema)
                except ValueError:  # not JSON: `prepare` reports it
                    return ("json", schema)
            return ("json", _json.dumps(schema, sort_keys=True))
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", _json.dumps(self.choice))
        return ("grammar", self.grammar or "")


@dataclass
class BeamSearchParams:
    """`LLM.beam_search` parameters (vLLM's names). Beams are ranked by
    cum_logprob / generated_len ** length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's enum, same names)."""

    CUMULATIVE = 0  # the whole output so far, every time
    DELTA = 1  # only what is new since the previous RequestOutput of the request
    FINAL_ONLY = 2  # one RequestOutput, when the request finishes


# A logits processor: fn(output_ids, logits) or fn(prompt_ids, output_ids, logits) -> logits,
# logits a 1-D tensor [V] of the backend's framework (torch); returns it or a new one.
LogitsProcessor = Callable[..., Any]


@dataclass
class SamplingParams:
    """Stop strings (`stop`): checked after every generated token (also with speculative
    decoding, where one step appends several). Among the stop strings found complete in the text
    at that point, the one that STARTS EARLIEST in the text wins, whatever the list order; on a
    tie (same start, e.g. "the" and "there" completed by one token) the first listed wins. The
    text is cut before the winner (after it with `include_stop_str_in_output`) and the winner is
    the output's `stop_reason`. A stop string completed by an earlier token always wins over one
    completed later. (vLLM takes the first LISTED stop string found in the newly added text; the
    two differ only when one token completes several stop strings.)"""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per output token (0 = sampled only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: outputs carry token ids only (text ""), no per-token detokenization; stop strings
    # need the text, so they are refused then (logprob entries still decode their token).
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Words never generated: each is tokenized with and without a leading space; the word's last
    # token is masked whenever the output ends with its other tokens.
    bad_words: list[str] | None = None
    # Only these token ids may be generated (None = any).
    allowed_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (left truncation); None = all, -1 = max_model_len.
    truncate_prompt_tokens: int | None = None
    # Callables applied to each step's logits row (see LogitsProcessor); must be picklable when
    # the engine core runs in its own process. Torch backend only.
    logits_processors: list[LogitsProcessor] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine from the tokenizer / generation_config (not by users).
    eos_token_ids: list[int] = field(default_factory=list)
    # Filled by the engine: bad_words as token id sequences.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.output_kind, int) and not isinstance(
            self.output_kind, RequestOutputKind
        ):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(
                    f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"
                ) from None
        self._disallowed: Any = None  # cached allowed_token_ids mask (see disallowed_mask)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError("logit_bias must map token ids to numbers") from e
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.logit_bias and not all(math.isfinite(b) for b in self.logit_bias.values()):
            bad("logit_bias values must be finite numbers")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or v > 20):
                bad(f"{name} must be an integer in [0, 20], got {v}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if self.stop and not self.detokenize:
            bad("stop strings need the output text: set detokenize=True to use stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            bad("bad_words must be a list of non-empty strings")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids must be a non-empty list of non-negative token ids")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or (t < 1 and t != -1)):
            bad(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {t!r}")
        if self.logits_processors is not None and any(
            not callable(f) for f in self.logits_processors
        ):
            bad("logits_processors must be a list of callables")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        """A deep copy (logits processors are shared, not copied: they may hold models)."""
        procs = self.logits_processors
        self.logits_processors = None
        try:
            out = copy.deepcopy(self)
        finally:
            self.logits_processors = procs
        out.logits_processors = list(procs) if procs is not None else None
        return out

    @property
    def has_token_constraints(self) -> bool:
        """bad_words, allowed_token_ids or logits_processors: per-step work on the logits."""
        return bool(
            self.bad_words_token_ids or self.allowed_token_ids is not None or self.logits_processors
        )

    def banned_token_ids(self, output_ids: Sequence[int]) -> list[int]:
        """Tokens bad_words forbid next, after `output_ids`: a one-token word always; a longer
        word's last token when the output ends with the word's other tokens."""
        out = []
        for seq in self.bad_words_token_ids:
            head = seq[:-1]
            if not head or (
                len(output_ids) >= len(head)
                and list(output_ids[len(output_ids) - len(head) :]) == head
            ):
                out.append(seq[-1])
        return out

    def disallowed_mask(self, vocab: int) -> Any:  # noqa: ANN401 - numpy bool [vocab] or None
        """numpy bool [vocab], True for tokens allowed_token_ids leaves out (None: no limit).
        Built once per request."""
        if self.allowed_token_ids is None:
            return None
        if self._disallowed is None or len(self._disallowed) != vocab:
            import numpy as np

            mask = np.ones(vocab, dtype=bool)
            ids = [t for t in self.allowed_token_ids if 0 <= t < vocab]
            mask[ids] = False
            self._disallowed = mask
        return self._disallowed

    def run_logits_processors(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: Any
    ) -> Any:  # noqa: ANN401 - a framework tensor [V]
        """Apply logits_processors in order to one row; each takes (output_ids, logits) or
        (prompt_ids, output_ids, logits) (vLLM's two forms, told apart by arity)."""
        for fn in self.logits_processors or ():
            args = (list(output_ids), logits)
            if _arity(fn) >= 3:
                args = (list(prompt_ids), list(output_ids), logits)
            logits = fn(*args)
        return logits

    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end generation (EOS unless ignore_eos, plus stop_token_ids)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    def masks_stop_tokens(self, num_output: int) -> bool:
        """True while min_tokens masks the stop tokens: fewer than min_tokens tokens generated
        (`num_output`) and some stop token to mask."""
        return num_output < self.min_tokens and bool(self.all_stop_token_ids())

    def is_stop_token(self, token_id: int) -> bool:
        """`token_id in all_stop_token_ids()`, without building the set (called per token)."""
        return token_id in self.stop_token_ids or (
            not self.ignore_eos and token_id in self.eos_token_ids
        )


def _arity(fn: Callable[..., Any]) -> int:
    """Positional parameters of `fn` (2 when they cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds)
