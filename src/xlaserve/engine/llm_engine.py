"""LLMEngine: the synchronous step loop over scheduler, backend runner and detokenizer.

One `step()`: schedule -> runner.execute -> scheduler.update_from_output -> detokenize, check
stop strings -> RequestOutputs of the requests that changed. A request with n > 1 is fanned out
into n child sequences (ids `{i}#{request_id}`) whose outputs are aggregated under the parent id.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.request import Request, RequestStatus
from xlaserve.core.scheduler import Scheduler
from xlaserve.model_loader.registry import build_spec
from xlaserve.model_loader.resolve import is_orbax_dir, resolve_model_dir
from xlaserve.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from xlaserve.runner import (
    ModelRunner,
    RunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
    backend_names,
    backends_with,
    create_runner,
    get_capabilities,
    resolve_backend,
)
from xlaserve.sampling_params import SamplingParams
from xlaserve.spec_decode import NgramProposer, check_speculative_config
from xlaserve.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from xlaserve.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_total_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # (request, step) verifications that had at least one draft.
    spec_num_drafts: int = 0
    # KV offload (host/disk tier): prompt tokens reloaded instead of recomputed, bytes copied.
    kv_offload_host_hits: int = 0
    kv_offload_disk_hits: int = 0
    kv_offload_bytes_out: int = 0
    kv_offload_bytes_in: int = 0


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one child sequence."""

    request: Request
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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


def _child_id(parent_id: str, i: int) -> str:
    return f"{i}#{parent_id}"


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.model_dir = resolve_model_dir(mc.model, mc.revision, config.load.download_dir)
        self.spec = build_spec(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(mc.tokenizer or self.model_dir)
        self.model_name = mc.served_model_name or (
            mc.model.rstrip("/").split("/")[-1] if mc.model else "demo-kjv"
        )
        self.max_model_len = mc.max_model_len or self.spec.max_position_embeddings
        if (
            self.max_model_len > self.spec.max_position_embeddings
            and self.spec.rope_scaling is None
        ):
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.spec.max_position_embeddings}"
            )
        self.eos_token_ids = list(self.spec.eos_token_ids)
        if (
            self.tokenizer.eos_token_id is not None
            and self.tokenizer.eos_token_id not in self.eos_token_ids
        ):
            self.eos_token_ids.append(self.tokenizer.eos_token_id)
        self.backend = resolve_backend(config.backend)
        if is_orbax_dir(self.model_dir) or config.load.load_format == "orbax":
            # Orbax checkpoints hold the Flax parameter tree: only a runner that lists the format
            # reads them (auto picks one).
            if "orbax" not in get_capabilities(self.backend).checkpoint_formats:
                able = backends_with(lambda caps: "orbax" in caps.checkpoint_formats)
                if config.backend != "auto" or not able:
                    raise ValueError(
                        f"{self.model_dir} is an orbax checkpoint (xlaserve convert --to orbax), "
                        f"which only backend {backend_names(able)} can load; pass "
                        f"backend={backend_names(able)} or the safetensors directory"
                    )
                self.backend = able[0]
        check_speculative_config(config.speculative, self.backend)  # before loading anything
        par, caps = config.parallel, get_capabilities(self.backend)
        if (par.enable_expert_parallel and not caps.expert_parallel) or (
            par.nnodes > 1 and not caps.multi_host
        ):
            able = backends_with(lambda c: c.expert_parallel and c.multi_host)
            raise ValueError(
                f"enable_expert_parallel and nnodes > 1 need backend {backend_names(able)}; on "
                f"backend {self.backend!r} use tensor_parallel_size (distributed_executor_backend="
                "'ray' across hosts where the backend supports it)"
            )
        # The backend's runner, or its executor over tensor-parallel ranks (runner registry).
        self.runner: ModelRunner = create_runner(config, self.spec, self.backend)
        self.runner.load_model()
        num_blocks = self.runner.determine_num_kv_blocks()
        self.runner.init_kv_cache(num_blocks)
        cc = config.cache
        from xlaserve.core.offload import build_offload_manager

        self.kv_manager = KVCacheManager(
            num_blocks,
            cc.block_size,
            cc.enable_prefix_caching,
            offload=build_offload_manager(config, self.runner),
        )
        self.scheduler = Scheduler(config.scheduler, cc, self.kv_manager, self.max_model_len)
        self._parents: dict[str, _Parent] = {}
        self._seqs: dict[str, tuple[_Parent, _Sequence]] = {}
        self._ids = itertools.count()
        self._pending_finished: set[str] = set()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_drafts = 0
        sc = config.speculative
        # n-gram drafts are proposed here, after each step; draft models run in the runner.
        self._ngram = (
            NgramProposer(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)
            if sc is not None and sc.method == "ngram"
            else None
        )
        # Structured output: created with the first constrained request (imports xgrammar).
        self._structured: StructuredOutputManager | None = None
        self._async = self._use_async_scheduling()
        # Async scheduling: the launched step whose output is not read yet (scheduler output,
        # runner handle, its Request objects).
        self._inflight: tuple[SchedulerOutput, Any, dict[str, Request]] | None = None
        self.num_overlapped_steps = 0  # steps launched while the previous one was in flight
        logger.info(
            "engine ready: model=%s backend=%s blocks=%d x %d tokens, max_model_len=%d",
            self.model_dir,
            self.backend,
            num_blocks,
            cc.block_size,
            self.max_model_len,
        )

    def _use_async_scheduling(self) -> bool:
        """scheduler.async_scheduling: "on", "off" or "auto" = the runner's
        `async_by_default` (measured, bench/RESULTS.md: on for XLA, 1.13-1.23x on the CPU; on
        for torch on CUDA, 1.10-1.21x offline on the H200; off for torch on the CPU, ~1.0x)."""
        mode = self.config.scheduler.async_scheduling
        can = callable(getattr(self.runner, "launch", None))
        why = None
        if not can:
            why = f"backend {self.backend!r} (and this parallel setup) runs steps synchronously"
        elif self.config.speculative is not None:
            why = "speculative decoding reads each step's tokens before the next step"
        elif self.config.cache.kv_offload_bytes:
            why = "KV offload copies blocks between steps"
        if mode == "on" and why is not None:
            raise ValueError(f"async_scheduling='on' is not supported here: {why}")
        if mode == "auto":
            return why is None and bool(getattr(self.runner, "async_by_default", False))
        return mode == "on"

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
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
    ) -> None:
        """Validate and queue one request (n > 1 becomes n sequences). Raises ValueError."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = (params or SamplingParams()).clone()
        params.eos_token_ids = list(self.eos_token_ids)
        text, ids = self._prompt_ids(prompt)
        # Fairness group: a prompt dict may name one (the server: all prompts of one request).
        group = prompt.get("group") if isinstance(prompt, dict) else None
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.spec.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if params.logit_bias and any(t < 0 or t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        )
        if len(ids) + max_tokens > self.max_model_len or max_tokens < 1:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and {max_tokens} more were requested ({len(ids) + max_tokens} in total)"
            )
        capacity = self.kv_manager.num_blocks * self.kv_manager.block_size
        if len(ids) + max_tokens > capacity:
            raise ValueError(
                f"prompt + max_tokens ({len(ids) + max_tokens}) exceeds the KV cache capacity "
                f"({capacity} tokens)"
            )
        # Structured output: validate the spec now (ValueError -> HTTP 400); compile async.
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._structured_manager().prepare(params.structured_outputs)
        now = arrival_time if arrival_time is not None else time.monotonic()
        parent = _Parent(request_id, text, ids, params, metrics=RequestMetrics(arrival_time=now))
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + i
            req = Request(
                request_id=_child_id(request_id, i),
                prompt_token_ids=ids,
                sampling_params=child_params,
                max_tokens=max_tokens,
                arrival_time=now,
                priority=priority,
                cache_salt=cache_salt,
                group_id=str(group) if group is not None else request_id,
            )
            detok = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            seq = _Sequence(
                req,
                i,
                detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            parent.seqs.append(seq)
            self._seqs[req.request_id] = (parent, seq)
        self._parents[request_id] = parent
        for seq in parent.seqs:
            if grammar is not None:
                self._structured.add_request(seq.request.request_id, grammar)
            self.scheduler.add_request(seq.request)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for rid in list(request_ids):
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            ids = [s.request.request_id for s in parent.seqs]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for cid in ids:
                self._seqs.pop(cid, None)
                if self._structured is not None:
                    self._structured.remove(cid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; the RequestOutputs of the requests that changed. `final_only`: only
        those of requests that finished (offline `generate` needs no others; building a
        RequestOutput per running request and step is a large part of the host time).

        Async scheduling: step N+1 is scheduled and launched before step N's tokens are read,
        so the host work of a step (scheduling, inputs, detokenizing, outputs) overlaps the
        device's previous step; each call then returns the outputs of the previous launch."""
        # Structured output: requests whose grammar failed to compile finish with an error.
        failed = self._fail_bad_grammars() if self._structured is not None else []
        overlap = self._async and self._can_overlap()
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            if overlap:  # launch the next step first: the device stays busy while we wait
                so = self._schedule(lookahead=True)
                if so is not None:
                    self._inflight = self._launch(so)
                    self.num_overlapped_steps += 1
            outputs = failed + self._finish_step(prev, final_only)
            if self._inflight is not None and not self._parents:
                # Nothing left to report: the step in flight holds only dropped extra tokens.
                last, self._inflight = self._inflight, None
                self._finish_step(last, final_only)
            return outputs
        so = self._schedule(lookahead=overlap)
        if so is None:
            return failed
        if overlap:
            self._inflight = self._launch(so)
            return failed
        ro = self.runner.execute(so)
        return failed + self._process(so, ro, final_only)

    def _can_overlap(self) -> bool:
        """Async scheduling needs every token's consumer off the step's critical path: no
        grammar running or compiling (bitmasks read the previous token). Speculative decoding,
        which reads it too, turns async off at start-up (`_use_async_scheduling`)."""
        st = self._structured
        return st is None or (st.num_matchers == 0 and not st.has_pending())

    def _schedule(self, lookahead: bool) -> SchedulerOutput | None:
        """The next step's SchedulerOutput, or None when there is nothing for the runner."""
        so = self.scheduler.schedule(lookahead=lookahead)
        # Finished ids reach the runner with the next non-empty step (runners never see empty ones).
        so.finished_req_ids |= self._pending_finished
        if so.is_empty:
            self._pending_finished = set(so.finished_req_ids)
            if self._structured is not None and self._structured.has_pending():
                self._structured.wait_pending(timeout=0.05)  # idle: let the compile thread run
            return None
        if self._structured is not None:
            self._attach_bitmasks(so)
        self._pending_finished = set()
        now = time.monotonic()
        # A request is first scheduled in new_requests (resumed ones come back there too).
        for nr in so.new_requests:
            parent, _ = self._seqs.get(nr.req_id, (None, None))
            if parent is not None and parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now
        return so

    def _launch(self, so: SchedulerOutput) -> tuple[SchedulerOutput, Any, dict[str, Request]]:
        reqs = self.scheduler.requests
        scheduled = {rid: reqs[rid] for rid in so.num_scheduled_tokens}
        return so, self.runner.launch(so), scheduled

    def _finish_step(
        self, launched: tuple[SchedulerOutput, Any, dict[str, Request]], final_only: bool
    ) -> list[RequestOutput]:
        so, handle, scheduled = launched
        return self._process(so, self.runner.finish(handle), final_only, scheduled)

    def _process(
        self,
        so: SchedulerOutput,
        ro: RunnerOutput,
        final_only: bool,
        scheduled: dict[str, Request] | None = None,
    ) -> list[RequestOutput]:
        """Apply one step's RunnerOutput: tokens, stops, detokenizing, logprobs, outputs."""
        updates = self.scheduler.update_from_output(so, ro, scheduled)
        if so.spec_token_ids:
            self._count_spec(so, ro)
        now = time.monotonic()
        changed: dict[str, _Parent] = {}
        for rid, entries in ro.prompt_logprobs.items():
            if rid in self._seqs:
                parent, seq = self._seqs[rid]
                if seq.index == 0 and parent.prompt_logprobs is not None:
                    parent.prompt_logprobs.extend(self._to_position_logprobs(e) for e in entries)
        for req, new_tokens in updates:
            entry = self._seqs.get(req.request_id)
            if entry is None:
                continue
            parent, seq = entry
            changed[parent.request_id] = parent
            if new_tokens:
                self.generation_tokens_total += len(new_tokens)
                if parent.metrics.first_token_time is None:
                    parent.metrics.first_token_time = now
                parent.metrics.last_token_time = now
                if seq.logprobs is not None:
                    self._add_logprobs(seq, ro.logprobs.get(req.request_id, []), len(new_tokens))
                if self._structured is not None:
                    self._advance_grammar(req, new_tokens)
                stop = seq.detok.add_tokens(new_tokens)
                if stop is not None and not req.is_finished:
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                    seq.finish_reason, seq.stop_reason = "stop", stop
            if req.is_finished and seq.finish_reason is None:
                seq.finish_reason = req.status.finish_reason
                seq.stop_reason = req.stop_reason
                if req.status == RequestStatus.FINISHED_ERROR:
                    parent.error = req.error
                seq.detok.flush()
        if self._ngram is not None:
            self._propose_ngram(updates)
        outputs: list[RequestOutput] = []
        for parent in changed.values():
            if final_only and not parent.finished:
                continue
            out = self._make_output(parent)
            outputs.append(out)
            if out.finished:
                self._finish_parent(parent, now)
        return outputs

    # ------------------------------------------------------------------ structured output
    def _structured_manager(self) -> StructuredOutputManager:
        if self._structured is None:
            from xlaserve.structured.manager import StructuredOutputManager

            mgr = StructuredOutputManager(
                self.tokenizer, self.spec.vocab_size, self.eos_token_ids, self.config.structured
            )
            self._structured = mgr
            self.scheduler.is_request_ready = lambda r: mgr.is_ready(r.request_id)
        return self._structured

    def _fail_bad_grammars(self) -> list[RequestOutput]:
        outputs = []
        for rid, msg in self._structured.poll().items():
            entry = self._seqs.get(rid)
            if entry is None:
                continue
            parent, seq = entry
            seq.request.error = msg
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
            seq.finish_reason, parent.error = "error", msg
            seq.detok.flush()
            if parent.finished:
                outputs.append(self._make_output(parent))
                self._finish_parent(parent, time.monotonic())
        return outputs

    def _attach_bitmasks(self, so: SchedulerOutput) -> None:
        """Bitmasks for constrained requests that sample this step (the chunk reaches the end of
        the known tokens; schedule() already advanced num_computed_tokens)."""
        mgr = self._structured
        if not mgr.num_matchers:  # no constrained request running: nothing to do this step
            return
        reqs = self.scheduler.requests
        rids = [
            rid
            for rid in so.num_scheduled_tokens
            if mgr.has_matcher(rid) and reqs[rid].num_computed_tokens >= reqs[rid].num_tokens
        ]
        if rids:  # the whole batch in one pass into one buffer
            so.grammar_bitmask.update(mgr.fill_bitmasks(rids, so.spec_token_ids))

    def _advance_grammar(self, req: Request, new_tokens: list[int]) -> None:
        terminated, error = self._structured.accept_tokens(req.request_id, new_tokens)
        if req.is_finished:
            return
        if error is not None:
            req.error = error
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
        elif terminated:  # the grammar accepted its stop token (e.g. with ignore_eos)
            req.stop_reason = new_tokens[-1]
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)

    def _add_logprobs(self, seq: _Sequence, entries: list[TokenLogprobs], n: int) -> None:
        if seq.logprobs is None:
            return
        for e in entries[:n]:
            pos = self._to_position_logprobs(e)
            seq.logprobs.append(pos)
            seq.cumulative_logprob += e.logprobs[0]

    def _to_position_logprobs(self, e: TokenLogprobs) -> PositionLogprobs:
        out: PositionLogprobs = {}
        tok = e.token_ids[0]
        out[tok] = Logprob(
            e.logprobs[0], e.rank, self.tokenizer.decode([tok], skip_special_tokens=False)
        )
        for rank, (t, lp) in enumerate(zip(e.token_ids[1:], e.logprobs[1:], strict=False), start=1):
            if t not in out:
                out[t] = Logprob(lp, rank, self.tokenizer.decode([t], skip_special_tokens=False))
        return out

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs = []
        all_finished = True
        for seq in parent.seqs:
            finished = seq.finish_reason is not None
            all_finished = all_finished and finished
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detok.output_text(finished),
                    token_ids=list(seq.request.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = parent.seqs[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=all_finished,  # == parent.finished
            prompt_logprobs=parent.prompt_logprobs,
            metrics=parent.metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            error=parent.error,
        )

    def _finish_parent(self, parent: _Parent, now: float) -> None:
        parent.metrics.finished_time = now
        parent.metrics.num_preemptions = sum(s.request.num_preemptions for s in parent.seqs)
        parent.metrics.num_cached_tokens = max(parent.seqs[0].request.num_cached_tokens, 0)
        self.prompt_tokens_total += len(parent.prompt_token_ids) * len(parent.seqs)
        self._parents.pop(parent.request_id, None)
        for seq in parent.seqs:
            self._seqs.pop(seq.request.request_id, None)
            if self._structured is not None:
                self._structured.remove(seq.request.request_id)

    # ------------------------------------------------------------------ misc
    def _count_spec(self, so: SchedulerOutput, ro: RunnerOutput) -> None:
        """Draft / accepted token counters (engine-wide and per request)."""
        for rid, drafts in so.spec_token_ids.items():
            sampled = ro.sampled_token_ids.get(rid)
            if not drafts or not sampled or rid in ro.errors:
                continue
            accepted = min(len(sampled) - 1, len(drafts))
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += len(drafts)
            self.spec_num_accepted_tokens += accepted
            entry = self._seqs.get(rid)
            if entry is not None:
                entry[0].metrics.spec_num_draft_tokens += len(drafts)
                entry[0].metrics.spec_num_accepted_tokens += accepted

    def _propose_ngram(self, updates: list[tuple[Request, list[int]]]) -> None:
        """Drafts for each request that just got tokens and is decoding (KV complete up to its
        last token), never past max_tokens / max_model_len (the bonus token counts)."""
        for req, new_tokens in updates:
            if not new_tokens or req.is_finished or req.num_computed_tokens != req.num_tokens - 1:
                continue
            left = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
            req.spec_token_ids = (
                self._ngram.propose(req.all_token_ids, left - 1) if left > 1 else []
            )

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def get_stats(self) -> EngineStats:
        kv = self.kv_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_total_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_num_drafts=self.spec_num_drafts,
            kv_offload_host_hits=kv.offload_host_hits,
            kv_offload_disk_hits=kv.offload_disk_hits,
            kv_offload_bytes_out=kv.offload.bytes_out if kv.offload is not None else 0,
            kv_offload_bytes_in=kv.offload.bytes_in if kv.offload is not None else 0,
        )

    def shutdown(self) -> None:
        if self._inflight is not None:  # let the device finish before its memory goes
            self.runner.finish(self._inflight[1])
            self._inflight = None
        if self._structured is not None:
            self._structured.shutdown()
        self.runner.shutdown()
