"""Structured output through xgrammar: grammar compilation off the step loop, one matcher per
sequence, packed allowed-token bitmasks per step.

Life of a constrained sequence (driven by `LLMEngine`):
1. `prepare(params)` (synchronous, in `add_request`): parse the spec into an `xgrammar.Grammar`
   (cheap; raises ValueError with the reason for a malformed schema / regex / EBNF).
2. `add_request(req_id, prepared)`: a cache hit gets its matcher at once; a miss is compiled in a
   worker process (`compile_pool.CompilePool`, `compile_workers` of them; the tokenizer-dependent,
   expensive part). Until then `is_ready(req_id)` is False and the scheduler skips the request
   without blocking the others. A compile past `compile_timeout` is killed and fails its
   requests; `remove` of the last request waiting on a grammar kills its compile.
3. Each step `poll()` turns finished compilations into matchers (or per-request errors), then
   `fill_bitmasks` gives int32 [P, W] (P = 1 + drafts, W = ceil(V / 32)) for each sampling request
   (views of one buffer, filled by one xgrammar batch call).
4. `accept_tokens(req_id, tokens)` advances the matcher; a terminated matcher ends the request.

Under async scheduling (engine/core.py) step N+1 is launched before step N's tokens are known;
its rows are filled after step N's tokens were accepted (so the matchers are exactly at N+1's
position), while N+1's forward runs, and reach the runner through `apply_bitmasks`.

Limits (StructuredOutputConfig): grammar sources over `max_grammar_bytes` are refused in
`prepare` (ValueError) before parsing; the compiled-grammar LRU holds at most `cache_size`
entries and `cache_bytes` bytes (xgrammar's `memory_size_bytes`).

xgrammar (and with it torch) is imported lazily: only when the first constrained request arrives.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from xlaserve.config import StructuredOutputConfig, fill_threads
from xlaserve.sampling_params import StructuredOutputsParams
from xlaserve.structured.compile_pool import CompilePool
from xlaserve.structured.openai_compat import grammar_source_bytes

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Compact JSON (no free whitespace between tokens): with free whitespace a model can loop on
# spaces/newlines forever inside an object; the output is valid JSON either way.
JSON_ANY_WHITESPACE = False
# Constrained rows in a step from which the batch fill runs on `fill_threads` threads.
MIN_ROWS_THREADED_FILL = 32
# Fewest single-token accepts one thread of the split batch accept takes (`batch_accept`):
# below it a thread's hand-off costs more than its share of the accepts.
MIN_ROWS_PER_ACCEPT_THREAD = 32

GrammarKey = tuple[str, str]


def clean_xgrammar_error(e: BaseException) -> str:
    """Strip xgrammar's C++ location prefix ("[12:00:00] /project/cpp/x.cc:12: ")."""
    msg = str(e).strip()
    msg = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = msg.replace("Check failed: (error.empty()) is false: ", "")
    return msg.splitlines()[0] if msg else type(e).__name__


def choice_to_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: EBNF string literals take JSON escapes, so json.dumps escapes them."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.9 writes length-bounded JSON strings (minLength/maxLength) with the character
# class below, which lets raw control characters (e.g. TAB) into strings: invalid JSON for strict
# parsers. Its unbounded-string rule excludes \0-\x1f; we patch the bounded one to match.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _forbid_control_chars(grammar: xgr.Grammar) -> xgr.Grammar:
    import xgrammar as xgr

    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR))
    except Exception:  # the printed grammar did not parse back: keep xgrammar's own
        logger.debug("could not patch string rule of a JSON schema grammar", exc_info=True)
        return grammar


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """Parse a spec into an xgrammar Grammar (no tokenizer needed). ValueError with the reason."""
    import xgrammar as xgr

    try:
        if params.json is not None:
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(
                    f"a JSON schema must be an object, got {type(schema).__name__}"
                ) from None
            grammar = xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=JSON_ANY_WHITESPACE
            )
            return _forbid_control_chars(grammar)
        if params.json_object:
            # Any JSON object (the builtin JSON grammar would also admit a top-level array).
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=JSON_ANY_WHITESPACE, strict_mode=False
            )
        if params.regex is not None:
            return xgr.Grammar.from_regex(params.regex)
        if params.choice is not None:
            return xgr.Grammar.from_ebnf(choice_to_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar or "")
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError with the parser's message
        kind = params.key()[0]
        raise ValueError(f"invalid structured output {kind}: {clean_xgrammar_error(e)}") from None


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, sized to the model's lm_head (V may exceed the
    tokenizer's vocab: the extra ids get "" and are never allowed).

    `tokenizer`: xlaserve's Tokenizer (wrapping a `tokenizers.Tokenizer`) or a raw
    `tokenizers.Tokenizer`. Special tokens other than the stop tokens are blanked so a grammar
    can never spell text with them (they would vanish from the detokenized output).
    """
    import xgrammar as xgr

    raw = getattr(tokenizer, "_tok", tokenizer)  # the `tokenizers.Tokenizer` inside
    vocab: dict[str, int] = raw.get_vocab(with_added_tokens=True)
    encoded: list[str] = [""] * vocab_size
    for tok, i in vocab.items():
        if i < vocab_size:
            encoded[i] = tok
    stops = sorted({t for t in stop_token_ids if 0 <= t < vocab_size})
    for i in getattr(tokenizer, "all_special_ids", set()) or set():
        if 0 <= i < vocab_size and i not in stops:
            encoded[i] = ""
    try:
        # Detects byte-level / byte-fallback / raw vocab and add_prefix_space from tokenizer.json,
        # without needing transformers.
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(raw.to_str())
    except Exception:  # private helper moved: let transformers' wrapper detect it
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=raw)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=stops or None
        )
        meta = {"vocab_type": info.vocab_type, "add_prefix_space": info.add_prefix_space}
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stops or None,
        add_prefix_space=meta["add_prefix_space"],
    )


@dataclass
class PreparedGrammar:
    """What `prepare` returns: the cache key and (on a cache miss) the parsed grammar."""

    key: GrammarKey
    grammar: Any = None  # xgr.Grammar | None (None when already compiled and cached)


def _verdict(m: Any, token: int, accepted: bool) -> tuple[bool, str | None] | None:  # noqa: ANN401
    """After matcher m took `token` (accepted or not): (terminated, error) when the request's
    grammar is done with — ended (a token past the end is ignored) or violated — else None."""
    if m.is_terminated():
        return True, None
    if not accepted:
        return False, f"token {token} violates the structured output grammar"
    return None


class StructuredOutputManager:
    """Compiled-grammar LRU cache + per-sequence GrammarMatchers. Not thread-safe: every method
    runs on the engine's thread; only `GrammarCompiler.compile_grammar` runs on the worker, and
    the call `fill_job` returns may run on the engine's fill thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int] | None = None,
        config: StructuredOutputConfig | None = None,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        from xgrammar.base import _core

        self._core = _core  # the C++ bindings (accept_step calls the batch accept directly)
        self.config = config or StructuredOutputConfig()
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32  # W
        stops = list(stop_token_ids or [])
        if not stops and getattr(tokenizer, "eos_token_id", None) is not None:
            stops = [tokenizer.eos_token_id]
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stops)
        # The matchers' stop tokens (terminate_without_stop_token=False): a matcher can only
        # become terminated by accepting one of these, so accept_step asks is_terminated only
        # for them (and for rejected tokens), not for every request every step.
        self._stop_ids = frozenset(int(t) for t in self.tokenizer_info.stop_token_ids)
        # Our own LRU replaces xgrammar's cache (bounded by count and bytes, as configured).
        self._cache: OrderedDict[GrammarKey, Any] = OrderedDict()  # key -> CompiledGrammar
        self._cache_sizes: dict[GrammarKey, int] = {}
        self.cache_bytes_used = 0
        cfg = self.config
        self._pool: CompilePool | None = None
        self._executor: cf.ThreadPoolExecutor | None = None
        # In-process compiler: compile_workers=0 uses it on a thread (not cancellable).
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=2, cache_enabled=False
        )
        if cfg.compile_workers > 0:
            # Killable worker processes (see compile_pool.py): a compile can be cancelled.
            # Measured on the 2-core dev host (demo tokenizer): a worker starts in 10-20 s
            # (importing xgrammar imports torch), so workers start now and stay warm; a
            # round trip adds ~10 ms plus deserialisation (27 ms for a 2,000-entry choice
            # that compiles in 450 ms); a timed-out compile is killed within 20 ms of its
            # deadline and shutdown kills every worker in ~0.3 s.
            self._pool = CompilePool(self.tokenizer_info.serialize_json(), cfg.compile_workers)
        else:
            self._executor = cf.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="xlaserve-grammar"
            )
        self._inflight: dict[GrammarKey, cf.Future] = {}
        self._waiting: dict[str, GrammarKey] = {}  # req_id -> key still compiling
        self._matchers: dict[str, Any] = {}  # req_id -> GrammarMatcher
        # StructuredOutputConfig.bitmask_fill_threads (measured: see its comment): the
        # threaded fill for large steps, one thread for small ones (thread start-up costs more
        # than it saves there).
        self.fill_threads = fill_threads(cfg.bitmask_fill_threads, os.cpu_count())
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._batch_mt = (
            xgr.BatchGrammarMatcher(max_threads=self.fill_threads)
            if self.fill_threads > 1
            else self._batch
        )
        self._jump_row = np.empty((1, self.num_words), dtype=np.int32)  # forced_tokens' mask
        self.num_compiled = 0
        # StructuredOutputConfig.accept_threads: the batch accept split over this many threads
        # (the caller's and accept_threads - 1 workers, started on first use).
        self.accept_threads = fill_threads(cfg.accept_threads, os.cpu_count())
        self._accept_pool: cf.ThreadPoolExecutor | None = None

    # ----- requests ---------------------------------------------------------------------------

    def prepare(self, params: StructuredOutputsParams) -> PreparedGrammar:
        """Validate synchronously (ValueError with the reason); cheap on a cache hit."""
        size, limit = grammar_source_bytes(params), self.config.max_grammar_bytes
        if size > limit:
            raise ValueError(
                f"structured output grammar is {size} bytes; the limit is {limit} "
                "(max_grammar_bytes)"
            )
        key = params.key()
        if key in self._cache or key in self._inflight:
            return PreparedGrammar(key)
        return PreparedGrammar(key, build_grammar(params))

    def add_request(self, req_id: str, prepared: PreparedGrammar) -> None:
        """Attach a sequence to its grammar: a matcher now (cache hit) or after compilation."""
        key = prepared.key
        if key in self._cache:
            self._cache.move_to_end(key)
            self._matchers[req_id] = self._new_matcher(self._cache[key])
            return
        if key not in self._inflight:
            if prepared.grammar is None:
                raise ValueError("grammar evicted before compilation; prepare it again")
            if self._pool is not None:
                self._inflight[key] = self._pool.submit(
                    prepared.grammar.serialize_json(), self.config.compile_timeout
                )
            else:
                assert self._executor is not None
                self._inflight[key] = self._executor.submit(
                    self._compiler.compile_grammar, prepared.grammar
                )
        self._waiting[req_id] = key

    def remove(self, req_id: str) -> None:
        """Forget a sequence; when it was the last one waiting on a compile, the compile is
        cancelled (its worker process killed)."""
        self._matchers.pop(req_id, None)
        key = self._waiting.pop(req_id, None)
        if key is not None and key not in self._waiting.values():
            fut = self._inflight.pop(key, None)
            if fut is not None and self._pool is not None:
                self._pool.cancel(fut)

    def is_constrained(self, req_id: str) -> bool:
        return req_id in self._matchers or req_id in self._waiting

    def has_matcher(self, req_id: str) -> bool:
        return req_id in self._matchers

    @property
    def num_matchers(self) -> int:
        """Sequences with a live matcher (0: no step needs a bitmask)."""
        return len(self._matchers)

    def is_ready(self, req_id: str) -> bool:
        """False while the request's grammar is compiling (or failed and not yet reported)."""
        return req_id not in self._waiting

    def has_pending(self) -> bool:
        return bool(self._waiting)

    def wait_pending(self, timeout: float) -> None:
        """Block until some compilation finishes (or timeout): lets an idle engine yield the CPU
        to the compile thread instead of spinning."""
        futures = [self._inflight[k] for k in set(self._waiting.values()) if k in self._inflight]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def poll(self) -> dict[str, str]:
        """Collect finished compilations. Returns req_id -> error for sequences whose grammar
        failed to compile (the caller fails them); the others get their matchers."""
        errors: dict[str, str] = {}
        for key, fut in list(self._inflight.items()):
            if not fut.done():
                continue
            del self._inflight[key]
            ids = [rid for rid, k in self._waiting.items() if k == key]
            try:
                compiled = fut.result()
                if isinstance(compiled, str):  # from a worker process: xgrammar's JSON
                    compiled = self._xgr.CompiledGrammar.deserialize_json(
                        compiled, self.tokenizer_info
                    )
            except Exception as e:
                msg = f"structured output grammar failed to compile: {clean_xgrammar_error(e)}"
                for rid in ids:
                    errors[rid] = msg
                    del self._waiting[rid]
                continue
            self.num_compiled += 1
            self._cache_put(key, compiled)
            for rid in ids:
                self._matchers[rid] = self._new_matcher(compiled)
                del self._waiting[rid]
        return errors

    def _cache_put(self, key: GrammarKey, compiled: Any) -> None:
        """LRU insert, then evict the oldest until both bounds hold; a grammar larger than
        `cache_bytes` by itself is not kept (its matchers hold it while they live)."""
        size = int(getattr(compiled, "memory_size_bytes", 0) or 0)
        cfg = self.config
        if size > cfg.cache_bytes or cfg.cache_size == 0:
            return
        self._cache[key] = compiled
        self._cache_sizes[key] = size
        self.cache_bytes_used += size
        while len(self._cache) > cfg.cache_size or self.cache_bytes_used > cfg.cache_bytes:
            old, _ = self._cache.popitem(last=False)
            self.cache_bytes_used -= self._cache_sizes.pop(old)

    def _new_matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    # ----- per step ---------------------------------------------------------------------------

    def fill_bitmask(self, req_id: str, drafts: list[int] | None = None) -> np.ndarray:
        """Allowed tokens at the request's next 1 + len(drafts) positions: int32 [P, W].

        Row i is the mask after drafts[:i] were accepted; the matcher is rolled back after.
        Rows after a draft the grammar rejects allow everything (the runner's verification
        stops at that draft, since its own row masks it out).
        """
        drafts = drafts or []
        out = np.full((1 + len(drafts), self.num_words), -1, dtype=np.int32)
        self._fill_rows(self._matchers[req_id], out, 0, drafts)
        return out

    def _fill_rows(self, m: Any, out: np.ndarray, row: int, drafts: list[int]) -> None:
        """Rows out[row : row + 1 + len(drafts)] for one matcher (rows past a rejected draft
        are left as they are)."""
        accepted = 0
        for i in range(1 + len(drafts)):
            m.fill_next_token_bitmask(out, row + i)
            if i == len(drafts) or not m.accept_token(drafts[i]):
                break
            accepted += 1
        if accepted:
            m.rollback(accepted)

    def fill_bitmasks(
        self, req_ids: list[str], drafts: dict[str, list[int]] | None = None
    ) -> dict[str, np.ndarray]:
        """`fill_bitmask` for a whole step: req_id -> int32 [P, W], views of ONE buffer
        [sum P, W]. The rows of requests without drafts are filled by one xgrammar batch call
        (measured on 2 CPU cores, 8 rows: 25 us vs 37 us for a loop of single fills); rows with
        drafts need accept / rollback between fills, one request at a time. Requests without
        a matcher are left out."""
        drafts = drafts or {}
        if not any(drafts.get(rid) for rid in req_ids):  # one row each: one batch fill
            return self.fill_job(req_ids)()
        live = [(rid, drafts.get(rid) or []) for rid in req_ids if rid in self._matchers]
        if not live:
            return {}
        shape = (sum(1 + len(d) for _, d in live), self.num_words)
        # Every row is written in full by a fill, except rows past a rejected draft, which must
        # allow everything: -1 first.
        out = np.full(shape, -1, dtype=np.int32)
        masks: dict[str, np.ndarray] = {}
        plain: list[Any] = []  # matchers whose single row the batch call fills
        rows: list[int] = []
        row = 0
        for rid, ds in live:
            m = self._matchers[rid]
            if ds:
                self._fill_rows(m, out, row, ds)
            else:
                plain.append(m)
                rows.append(row)
            masks[rid] = out[row : row + 1 + len(ds)]
            row += 1 + len(ds)
        self._batch_fill(plain, out, rows)
        return masks

    def fill_job(
        self, req_ids: list[str], out: np.ndarray | None = None
    ) -> Callable[[], dict[str, np.ndarray]]:
        """`fill_bitmasks(req_ids)` for rows without drafts, in two halves: the matchers and
        the buffer are taken now, on the caller's thread (later `remove` calls do not touch
        them); the returned call does the fill, which xgrammar runs with the GIL released
        (`structured_bench`'s fill row: Python progress 0.95 beside a fill thread), so a worker
        thread can run it while the engine thread goes on.

        `out` (int32 [len(req_ids), W], e.g. a runner's pinned upload buffer): the buffer, row
        i for req_ids[i], used only when every request has a matcher (it is then filled
        whole); else a buffer of the manager's own."""
        live = [(rid, self._matchers[rid]) for rid in req_ids if rid in self._matchers]
        if not live:
            return lambda: {}
        shape = (len(live), self.num_words)
        if out is None or len(live) != len(req_ids) or out.shape != shape or out.dtype != np.int32:
            # Every row is written in full by the fill: no memset (4 MB at 256 rows of a 128k
            # vocabulary, on the step's critical path).
            out = np.empty(shape, np.int32)
        plain = [m for _, m in live]
        rows = list(range(len(live)))
        masks = {rid: out[i : i + 1] for i, (rid, _) in enumerate(live)}

        def run() -> dict[str, np.ndarray]:
            self._batch_fill(plain, out, rows)
            return masks

        return run

    def _batch_fill(self, plain: list[Any], out: np.ndarray, rows: list[int]) -> None:
        """Fill row rows[i] of out from plain[i]'s matcher: one xgrammar batch call."""
        if len(plain) == 1:
            plain[0].fill_next_token_bitmask(out, rows[0])
        elif plain:
            batch = self._batch_mt if len(plain) >= MIN_ROWS_THREADED_FILL else self._batch
            batch.batch_fill_next_token_bitmask(plain, out, rows)

    def forced_tokens(
        self, req_id: str, limit: int, is_stop: Callable[[int], bool] = lambda t: False
    ) -> list[int]:
        """Jump-forward: the tokens the grammar forces next, accepted into the matcher; at most
        `limit` of them. `is_stop(token)`: the request's stop tokens, never jumped over.

        Rule (exact for every sampler, not just greedy): a token is forced when the grammar's
        bitmask at that position admits exactly ONE token id of the vocabulary. The sampler then
        has no choice (every other logit is -inf), so appending it without a forward step gives
        the very token sequence that decoding token by token gives. No retokenization is
        involved: a forced byte string (xgrammar's `find_jump_forward_string`) often has several
        tokenizations the mask admits (`"`, `"n`, `"na`, ... ), and which one a model picks is
        only known from its logits, so such spans are left to the model; tokenizing the string
        ourselves would change the output. `find_jump_forward_string` is used as a cheap filter:
        an empty string means no token is forced (a single admitted non-stop token would force
        its first byte). A forced stop token is not taken (the normal path ends the request)."""
        m = self._matchers.get(req_id)
        if m is None or limit <= 0 or m.is_terminated() or not m.find_jump_forward_string():
            return []
        row = self._jump_row
        out: list[int] = []
        while len(out) < limit:
            m.fill_next_token_bitmask(row, 0)
            words = row[0].view(np.uint32)
            nz = np.flatnonzero(words)
            if len(nz) != 1:
                break
            w = int(words[nz[0]])
            if w & (w - 1):  # more than one bit in the word
                break
            tok = 32 * int(nz[0]) + w.bit_length() - 1
            if is_stop(tok) or not m.accept_token(tok):
                break
            out.append(tok)
            if m.is_terminated():
                break
        return out

    def accept_step(
        self, updates: list[tuple[str, list[int]]]
    ) -> dict[str, tuple[bool, str | None]]:
        """`accept_tokens` for a step's requests that have a matcher; the verdicts only:
        req_id -> (terminated, error) for the requests whose grammar ended or was violated
        (a request that goes on gets no entry: the caller's per-request work is for these).
        Requests with one new token (every decode step without drafts) go through ONE
        xgrammar batch call; others one by one."""
        res: dict[str, tuple[bool, str | None]] = {}
        singles: list[tuple[str, Any, int]] = []
        for rid, tokens in updates:
            m = self._matchers.get(rid)
            if m is None or not tokens:
                continue
            if len(tokens) == 1:
                singles.append((rid, m, tokens[0]))
            else:
                verdict = self.accept_tokens(rid, tokens)
                if verdict != (False, None):
                    res[rid] = verdict
        if len(singles) > 1:
            ok = self.batch_accept([m for _, m, _ in singles], [t for _, _, t in singles])
        else:
            ok = [m.accept_token(t) for _, m, t in singles]
        stops = self._stop_ids
        for (rid, m, t), accepted in zip(singles, ok, strict=True):
            # Accepted and not a stop token: the matcher cannot have terminated (it only ends
            # on accepting a stop token, and a terminated matcher rejects every token).
            if accepted and t not in stops:
                continue
            verdict = _verdict(m, t, bool(accepted))
            if verdict is not None:
                res[rid] = verdict
        return res

    def batch_accept(self, matchers: list[Any], tokens: list[int]) -> list[int]:
        """matchers[i] accepts tokens[i] (one token each, distinct matchers): 1 / 0 per row.

        xgrammar's batch accept is one C++ call, minus its wrapper's per-item Python (the call
        takes the handles, and its tvm_ffi Array result converts in one list()). tvm_ffi drops
        the GIL inside the call, so with `accept_threads` > 1 the rows are split into contiguous
        slices, at least MIN_ROWS_PER_ACCEPT_THREAD each, accepted side by side: the caller's
        thread takes the first, pool workers the rest. Each matcher is touched by one thread,
        and the result is in row order whatever the split."""
        accept = self._core.BatchGrammarMatcher.batch_accept_token
        handles = [m._handle for m in matchers]
        n = len(handles)
        k = min(self.accept_threads, n // MIN_ROWS_PER_ACCEPT_THREAD)
        if k <= 1:
            return list(accept(handles, tokens, False))
        if self._accept_pool is None:
            self._accept_pool = cf.ThreadPoolExecutor(
                max_workers=self.accept_threads - 1, thread_name_prefix="xlaserve-accept"
            )
        cuts = [n * i // k for i in range(k + 1)]
        futs = [
            self._accept_pool.submit(accept, handles[a:b], tokens[a:b], False)
            for a, b in zip(cuts[1:-1], cuts[2:], strict=True)
        ]
        ok = list(accept(handles[: cuts[1]], tokens[: cuts[1]], False))
        for f in futs:
            ok.extend(f.result())
        return ok

    def accept_tokens(self, req_id: str, tokens: list[int]) -> tuple[bool, str | None]:
        """Advance the matcher with the tokens the request got. Returns (terminated, error);
        error is set when a token violates the grammar (the sampler did not apply the mask)."""
        m = self._matchers.get(req_id)
        if m is None:
            return False, None
        # Two matcher calls per token in the common case (accept, then is it over).
        for t in tokens:
            verdict = _verdict(m, t, m.accept_token(t))
            if verdict is not None:
                return verdict
        return False, None

    def shutdown(self) -> None:
        """Stop compiling now: worker processes are killed, nothing waits on a compile."""
        if self._pool is not None:
            self._pool.shutdown()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._accept_pool is not None:
            self._accept_pool.shutdown(wait=False)
