"""OutputProcessor: the front half of the engine (tokenized prompts in, RequestOutputs out).

It validates a request and turns it into core requests (`CoreRequest`, one per sequence: n > 1
becomes n children `{i}#{request_id}`), then turns each step's `CoreOutput`s (token ids) into
RequestOutputs: incremental detokenizing, stop strings, logprobs with their decoded tokens, n > 1
aggregation under the parent id, request metrics. A stop string found here finishes the sequence
at once; the caller aborts it in the core (`process` returns those ids), so any tokens the core
made past it are dropped.

It runs wherever the user-facing side runs: in `LLMEngine` (offline, in-process serving) and in
the server's front process when the engine core has its own process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from xlaserve.engine.core import CoreOutput, CoreRequest, ModelInfo, WireLogprobs
from xlaserve.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from xlaserve.sampling_params import RequestOutputKind, SamplingParams
from xlaserve.tokenizer import IncrementalDetokenizer
from xlaserve.tokenizer.detokenizer import NullDetokenizer

PromptType = str | list[int] | dict

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sequence:
    """Front-side state of one child sequence."""

    request_id: str  # the core's id
    index: int
    detok: IncrementalDetokenizer | NullDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # output_kind DELTA: characters, tokens and logprob positions already returned.
    sent_chars: int = 0
    sent_tokens: int = 0


@dataclass(eq=False)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


def child_id(parent_id: str, i: int) -> str:
    return f"{i}#{parent_id}"


class OutputProcessor:
    """Front-side request state (see the module docstring). Not thread-safe: one owner."""

    def __init__(self, info: ModelInfo, capacity_tokens: int) -> None:
        self.info = info
        self.tokenizer = info.tokenizer
        self.capacity_tokens = capacity_tokens
        self._parents: dict[str, _Parent] = {}
        self._seqs: dict[str, tuple[_Parent, _Sequence]] = {}
        self._token_text: dict[int, str] = {}  # decoded single tokens (logprobs), bounded

    # ------------------------------------------------------------------ requests
    def prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> list[CoreRequest]:
        """Validate and register one request; its core requests (n of them). Raises ValueError.
        If the core then refuses them, call `drop(request_id)`."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = (params or SamplingParams()).clone()
        params.eos_token_ids = list(self.info.eos_token_ids)
        text, ids = self.prompt_ids(prompt)
        # Fairness group: a prompt dict may name one (the server: all prompts of one request).
        group = prompt.get("group") if isinstance(prompt, dict) else None
        group_id = str(group) if group is not None else request_id
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.info.spec.vocab_size
        text, ids = self._token_constraints(params, text, ids, vocab)
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if params.logit_bias and any(t < 0 or t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        max_len = self.info.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(ids)
        if len(ids) + max_tokens > max_len or max_tokens < 1:
            raise ValueError(
                f"this model's maximum context length is {max_len} tokens; the prompt has "
                f"{len(ids)} tokens and {max_tokens} more were requested ({len(ids) + max_tokens} in total)"
            )
        if len(ids) + max_tokens > self.capacity_tokens:
            raise ValueError(
                f"prompt + max_tokens ({len(ids) + max_tokens}) exceeds the KV cache capacity "
                f"({self.capacity_tokens} tokens)"
            )
        now = arrival_time if arrival_time is not None else time.monotonic()
        parent = _Parent(request_id, text, ids, params, metrics=RequestMetrics(arrival_time=now))
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        core_reqs = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + i
            cid = child_id(request_id, i)
            core_reqs.append(
                CoreRequest(
                    cid,
                    ids,
                    child_params,
                    max_tokens,
                    now,
                    priority,
                    cache_salt,
                    group_id,
                    lora_request=lora_request,
                )  # fmt: skip
            )
            detok: IncrementalDetokenizer | NullDetokenizer = (
                IncrementalDetokenizer(
                    self.tokenizer,
                    ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
                if params.detokenize
                else NullDetokenizer()
            )
            seq = _Sequence(
                cid,
                i,
                detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            parent.seqs.append(seq)
            self._seqs[cid] = (parent, seq)
        self._parents[request_id] = parent
        return core_reqs

    def _token_constraints(
        self, params: SamplingParams, text: str | None, ids: list[int], vocab: int
    ) -> tuple[str | None, list[int]]:
        """Check and prepare truncate_prompt_tokens, max_logprobs, allowed_token_ids,
        bad_words (tokenized here) and logits_processors; the (text, ids) of the prompt."""
        k = params.truncate_prompt_tokens
        if k == -1:
            k = self.info.max_model_len
        if k is not None and len(ids) > k:
            ids = ids[-k:]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        limit = self.info.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > limit:
                raise ValueError(f"{name} must be at most {limit} (--max-logprobs), got {v}")
        if params.allowed_token_ids is not None and any(
            t >= vocab for t in params.allowed_token_ids
        ):
            raise ValueError(f"allowed_token_ids must be in [0, {vocab})")
        if params.bad_words:
            seqs: list[list[int]] = []
            for word in params.bad_words:
                for prefix in ("", " "):  # as the word starts the text, and inside it
                    seq = self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                    if seq and seq not in seqs:
                        seqs.append(seq)
            params.bad_words_token_ids = seqs
        if params.logits_processors and self.info.backend != "torch":
            raise ValueError(
                "logits_processors run on the torch backend only (the XLA sampler is one "
                "compiled program); use logit_bias, allowed_token_ids or bad_words there"
            )
        return text, ids

    def drop(self, request_id: str) -> list[str]:
        """Forget a request (abort or refused by the core); the core ids to abort."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        ids = [s.request_id for s in parent.seqs]
        for cid in ids:
            self._seqs.pop(cid, None)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    # ------------------------------------------------------------------ outputs
    def process(
        self, outs: list[CoreOutput], final_only: bool = False
    ) -> tuple[list[RequestOutput], list[str]]:
        """One step's CoreOutputs -> (RequestOutputs of the requests that changed, core ids
        that hit a stop string: abort them in the core with `stopped=True`). `final_only`:
        only the outputs of requests that finished (offline `generate` needs no others)."""
        now = time.monotonic()
        changed: dict[str, _Parent] = {}
        stopped: list[str] = []
        for co in outs:
            entry = self._seqs.get(co.request_id)
            if entry is None:
                continue  # aborted meanwhile, or finished by a stop string already
            parent, seq = entry
            if seq.finish_reason is not None:
                continue  # stopped by a stop string; the core's late tokens are dropped
            changed[parent.request_id] = parent
            try:
                self._apply(co, parent, seq, now, stopped)
            except Exception as e:  # noqa: BLE001 - one request's bug fails that request only
                logger.exception("output processing failed for %s", co.request_id)
                for s in parent.seqs:
                    if s.finish_reason is None:
                        s.finish_reason = "error"
                        stopped.append(s.request_id)  # aborted in the core
                parent.error = f"output processing failed: {type(e).__name__}: {e}"
        outputs: list[RequestOutput] = []
        for parent in changed.values():
            kind = parent.params.output_kind
            if (final_only or kind == RequestOutputKind.FINAL_ONLY) and not parent.finished:
                continue
            out = self._make_output(parent)
            outputs.append(out)
            if out.finished:
                self._finish_parent(parent, now)
        return outputs, stopped

    def _apply(
        self, co: CoreOutput, parent: _Parent, seq: _Sequence, now: float, stopped: list[str]
    ) -> None:
        """One CoreOutput into its sequence: metrics, tokens, logprobs, text, stop strings."""
        m = parent.metrics
        if co.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = co.first_scheduled_time
        if co.num_cached_tokens is not None:
            seq.num_cached_tokens = co.num_cached_tokens
        if co.num_preemptions is not None:
            seq.num_preemptions = co.num_preemptions
        m.spec_num_draft_tokens += co.spec_draft_tokens
        m.spec_num_accepted_tokens += co.spec_accepted_tokens
        if co.prompt_logprobs and seq.index == 0 and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(self._position(e) for e in co.prompt_logprobs)
        new_tokens = co.new_token_ids
        if new_tokens:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            seq.token_ids.extend(new_tokens)
            if seq.logprobs is not None and co.logprobs:
                for e in co.logprobs[: len(new_tokens)]:
                    seq.logprobs.append(self._position(e))
                    seq.cumulative_logprob += e[1][0]
            stop = seq.detok.add_tokens(new_tokens)
            if stop is not None and co.finish_reason is None:
                # The core's own finish (length, stop token) on the same token wins.
                seq.finish_reason, seq.stop_reason = "stop", stop
                stopped.append(seq.request_id)
        if co.finish_reason is not None and seq.finish_reason is None:
            seq.finish_reason = co.finish_reason
            seq.stop_reason = co.stop_reason
            if co.finish_reason == "error":
                parent.error = co.error
            seq.detok.flush()

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """Finish every open sequence of a request with an error (the core could not run it)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
                seq.detok.flush()
        parent.error = message
        out = self._make_output(parent)
        self._finish_parent(parent, time.monotonic())
        return out

    def _decode_one(self, tok: int) -> str:
        text = self._token_text.get(tok)
        if text is None:
            text = self.tokenizer.decode([tok], skip_special_tokens=False)
            if len(self._token_text) < 65536:
                self._token_text[tok] = text
        return text

    def _position(self, e: WireLogprobs) -> PositionLogprobs:
        token_ids, logprobs, rank = e[0], e[1], e[2]
        out: PositionLogprobs = {}
        tok = token_ids[0]
        out[tok] = Logprob(logprobs[0], rank, self._decode_one(tok))
        for r, (t, lp) in enumerate(zip(token_ids[1:], logprobs[1:], strict=False), start=1):
            if t not in out:
                out[t] = Logprob(lp, r, self._decode_one(t))
        return out

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs = []
        all_finished = True
        delta = parent.params.output_kind == RequestOutputKind.DELTA
        for seq in parent.seqs:
            finished = seq.finish_reason is not None
            all_finished = all_finished and finished
            t = seq.sent_tokens if delta else 0
            if delta:  # only what is new since this request's previous output
                text, seq.sent_chars = seq.detok.text_since(seq.sent_chars, finished)
                seq.sent_tokens = len(seq.token_ids)
            else:
                text = seq.detok.output_text(finished)
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=seq.token_ids[t:],
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=seq.logprobs[t:] if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=all_finished,  # == parent.finished
            prompt_logprobs=parent.prompt_logprobs,
            metrics=parent.metrics,
            num_cached_tokens=parent.seqs[0].num_cached_tokens,
            error=parent.error,
        )

    def _finish_parent(self, parent: _Parent, now: float) -> None:
        parent.metrics.finished_time = now
        parent.metrics.num_preemptions = sum(s.num_preemptions for s in parent.seqs)
        parent.metrics.num_cached_tokens = parent.seqs[0].num_cached_tokens
        self.drop(parent.request_id)
