"""EngineCore: the scheduler, KV cache manager and runner step loop, in token ids only.

The core takes requests as token ids + SamplingParams (`CoreRequest`, one per sequence: a
request with n > 1 arrives as n core requests) and returns, per step, one `CoreOutput` per
request that changed: new token ids, finish reason, logprobs as ids + floats, cached-token and
preemption counts. It does no per-request string work: detokenizing, stop strings, n > 1
aggregation and RequestOutput building live in the front (`engine/output_processor.py`), which
aborts a request here when it finds a stop string.

The same class runs in-process (`LLMEngine`, `LLM`, `AsyncLLM` in-process) and inside the engine
core process (`engine/core_proc.py`).
"""

from __future__ import annotations

import bisect
import gc
import logging
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.request import Request, RequestStatus
from xlaserve.core.scheduler import Scheduler
from xlaserve.model_loader.registry import build_spec
from xlaserve.model_loader.resolve import is_orbax_dir, resolve_model_dir
from xlaserve.runner import (
    ModelRunner,
    RunnerOutput,
    SchedulerOutput,
    backend_names,
    backends_with,
    create_runner,
    get_capabilities,
    resolve_backend,
)
from xlaserve.sampling_params import SamplingParams
from xlaserve.spec_decode import NgramProposer, check_speculative_config
from xlaserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from xlaserve.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# The fill thread's job takes the GIL twice (to start, and to hand its masks back) while this
# thread runs Python. At CPython's default switch interval (5 ms) it waits until this thread
# blocks, i.e. it runs after the work it should overlap. While a fill is in flight the interval
# is this. Measured (`structured_bench.py --llama8b --tiny --backend torch --batches 256
# --repeats 5 --output-len 4 --input-len 8`, `fill` row, 2-core dev host, 2026-12-05): 256 rows
# of a 128k vocabulary (a 0.8 ms fill) beside 3 ms of Python were filled 3.88 ms after the
# submit at 5 ms (the engine thread then waited 0.94 ms for them), 1.43 ms after it at 0.2 ms
# (no wait). `structured_bench --fill-thread ab` measures the engine.
FILL_SWITCH_INTERVAL_S = 2e-4

# One position's logprobs on the wire: (token ids, logprobs, rank of token_ids[0]); entry 0 is
# the sampled (or actual prompt) token, then the top-k.
WireLogprobs = tuple[list[int], list[float], int]


# Upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total buckets).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class BucketCounts(tuple):
    """Per-bucket counts of a histogram (last entry: above every bound); adds element-wise so
    that summing snapshots (data-parallel replicas) sums the histograms."""

    def __add__(self, other: Any) -> BucketCounts:  # noqa: ANN401
        if isinstance(other, int) and other == 0:
            return self
        return BucketCounts(a + b for a, b in zip(self, other, strict=True))

    __radd__ = __add__


def empty_buckets() -> BucketCounts:
    return BucketCounts([0] * (len(ITERATION_TOKEN_BUCKETS) + 1))


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
    # Tokens computed per engine step: counts per ITERATION_TOKEN_BUCKETS bucket, and their sum.
    iteration_tokens_buckets: BucketCounts = field(default_factory=empty_buckets)
    iteration_tokens_sum: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.iteration_tokens_buckets, BucketCounts):  # a list off the wire
            self.iteration_tokens_buckets = BucketCounts(self.iteration_tokens_buckets)


@dataclass
class ModelInfo:
    """What both sides know about the model without loading weights (config.json, tokenizer)."""

    model_dir: str
    spec: Any  # ModelSpec
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    eos_token_ids: list[int]
    backend: str
    # Most logprobs a request may ask for per position (ModelConfig.max_logprobs).
    max_logprobs: int = 20


def load_model_info(config: EngineConfig) -> ModelInfo:
    """Resolve the model directory, spec, tokenizer, limits and backend (no weights, no torch)."""
    mc = config.model
    model_dir = resolve_model_dir(mc.model, mc.revision, config.load.download_dir)
    spec = build_spec(model_dir)
    tokenizer = Tokenizer.from_dir(mc.tokenizer or model_dir)
    # vLLM's rule: the model argument as the user gave it (a hub id stays "org/name").
    model_name = mc.served_model_name or mc.model or "demo-kjv"
    max_model_len = mc.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings and spec.rope_scaling is None:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}"
        )
    eos = list(spec.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    backend = resolve_backend(config.backend)
    if is_orbax_dir(model_dir) or config.load.load_format == "orbax":
        # Orbax checkpoints hold the Flax parameter tree: only a runner that lists the format
        # reads them (auto picks one).
        if "orbax" not in get_capabilities(backend).checkpoint_formats:
            able = backends_with(lambda caps: "orbax" in caps.checkpoint_formats)
            if config.backend != "auto" or not able:
                raise ValueError(
                    f"{model_dir} is an orbax checkpoint (xlaserve convert --to orbax), "
                    f"which only backend {backend_names(able)} can load; pass "
                    f"backend={backend_names(able)} or the safetensors directory"
                )
            backend = able[0]
    if mc.chat_template is not None:
        tokenizer.set_chat_template(mc.chat_template)
    return ModelInfo(
        model_dir, spec, tokenizer, model_name, max_model_len, eos, backend, mc.max_logprobs
    )


@dataclass
class CoreRequest:
    """One sequence for the core. `params.n == 1`, `params.eos_token_ids` filled by the front;
    `max_tokens` already clipped to the context (the front validated lengths and ids)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    group_id: str | None = None  # fairness group (scheduler.max_running_share); None: own id
    lora_request: Any = None  # xlaserve.lora.LoRARequest (None: the base model)


@dataclass
class CoreOutput:
    """One request's changes in one step (ids and floats only).

    `logprobs`: one entry per new token (when asked); `prompt_logprobs`: entries for the prompt
    positions computed this step. `finish_reason` "stop" | "length" | "error" | "abort" (None
    while running); `stop_reason` the stop token id. `first_scheduled_time` is set on the first
    output of a request (monotonic clock, shared by processes on one host);
    `num_cached_tokens` / `num_preemptions` on the first and the last output (None: unchanged)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    logprobs: list[WireLogprobs] | None = None
    prompt_logprobs: list[WireLogprobs] | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int | None = None
    first_scheduled_time: float | None = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def extras(self) -> list[Any] | None:
        """Everything but the id and tokens, or None when all of it is unset (most steps)."""
        if (
            self.finish_reason is None
            and self.num_cached_tokens is None
            and self.logprobs is None
            and self.prompt_logprobs is None
            and not self.spec_draft_tokens
        ):
            return None
        return [
            self.finish_reason,
            self.stop_reason,
            self.error,
            self.logprobs,
            self.prompt_logprobs,
            self.num_cached_tokens,
            self.num_preemptions,
            self.first_scheduled_time,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
        ]


def encode_outputs(outs: list[CoreOutput]) -> list[Any]:
    """One step's outputs in columns, for the wire: [request ids, token counts, all new tokens
    flat, sparse extras as [row, *CoreOutput.extras()]]. Flat columns pack ~4x faster than a
    list per request (bench/RESULTS.md, transport)."""
    rids: list[str] = []
    counts: list[int] = []
    tokens: list[int] = []
    extras: list[list[Any]] = []
    for i, o in enumerate(outs):
        rids.append(o.request_id)
        counts.append(len(o.new_token_ids))
        tokens.extend(o.new_token_ids)
        x = o.extras()
        if x is not None:
            extras.append([i, *x])
    return [rids, counts, tokens, extras]


def decode_outputs(cols: list[Any]) -> list[CoreOutput]:
    """The inverse of `encode_outputs`."""
    rids, counts, tokens, extras = cols
    outs = []
    pos = 0
    for rid, n in zip(rids, counts, strict=True):
        outs.append(CoreOutput(rid, tokens[pos : pos + n]))
        pos += n
    for row in extras:
        o = outs[row[0]]
        (
            o.finish_reason,
            o.stop_reason,
            o.error,
            o.logprobs,
            o.prompt_logprobs,
            o.num_cached_tokens,
            o.num_preemptions,
            o.first_scheduled_time,
            o.spec_draft_tokens,
            o.spec_accepted_tokens,
        ) = row[1:]
    return outs


@dataclass
class _Counters:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_drafts: int = 0
    iteration_tokens_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    )
    iteration_tokens_sum: int = 0

    def observe_step(self, tokens: int) -> None:
        self.iteration_tokens_buckets[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self.iteration_tokens_sum += tokens


class EngineCore:
    """Scheduler + KV cache manager + runner; `step()` -> list[CoreOutput] (see module doc)."""

    def __init__(self, config: EngineConfig, info: ModelInfo | None = None) -> None:
        self.config = config
        info = info or load_model_info(config)
        self.info = info
        self.model_dir, self.spec, self.tokenizer = info.model_dir, info.spec, info.tokenizer
        self.max_model_len = info.max_model_len
        self.eos_token_ids = info.eos_token_ids
        self.backend = info.backend
        check_speculative_config(config.speculative, self.backend)  # before loading anything
        # Jump-forward appends forced tokens between steps; a draft model inside the runner has
        # its own KV and drafts that would not see them (n-gram drafts are proposed here, after
        # the jump, so they do).
        self._jump_forward = config.structured.jump_forward
        if self._jump_forward and config.speculative is not None:
            if config.speculative.method != "ngram":
                raise ValueError(
                    "structured jump-forward works with speculative method 'ngram' only, not "
                    f"{config.speculative.method!r}; turn one of them off"
                )
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
        self.lora_manager = self._make_lora_manager(caps)  # before loading anything
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
            num_state_slots=self._num_state_slots(),
        )
        self.scheduler = Scheduler(
            config.scheduler, cc, self.kv_manager, self.max_model_len, self.lora_manager
        )
        self._live: set[str] = set()  # request ids added and not finished
        self._first_sched: dict[str, float] = {}  # first scheduled, not reported yet
        self._pending_finished: set[str] = set()
        self.counters = _Counters()
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
        # The runner can take a launched step's grammar bitmasks after its forward is queued
        # (`apply_bitmasks`): grammars then keep async scheduling on (see `_can_overlap`).
        self._late_bitmasks = callable(getattr(self.runner, "apply_bitmasks", None))
        # The grammar-fill thread (StructuredOutputConfig.fill_thread) and its job in flight:
        # (the launched step's handle, the masks' Future).
        self._fill_pool: ThreadPoolExecutor | None = None
        # CPython's switch interval while a fill is in flight is FILL_SWITCH_INTERVAL_S; the
        # process's own value, to restore (None: not changed now).
        self._saved_switch: float | None = None
        self._late_fill: tuple[Any, Future] | None = None
        # A runner still compiling the programs of larger steps in the background caps the step's
        # tokens at what it can run (`ready_token_budget`: an int, None once all are compiled).
        self._ready_tokens = getattr(self.runner, "ready_token_budget", None)
        # Async scheduling: the launched step whose output is not read yet (scheduler output,
        # runner handle, its Request objects).
        self._inflight: tuple[SchedulerOutput, Any, dict[str, Request]] | None = None
        self.num_overlapped_steps = 0  # steps launched while the previous one was in flight
        self.num_jump_forward_tokens = 0  # tokens appended by jump-forward (no forward each)
        logger.info(
            "engine ready: model=%s backend=%s blocks=%d x %d tokens, max_model_len=%d",
            self.model_dir,
            self.backend,
            num_blocks,
            cc.block_size,
            self.max_model_len,
        )
        # Everything built so far (model, tokenizer, compiled programs) lives as long as the
        # engine: out of the collector's sight, a full collection during serving scans only
        # what the steps allocate (each pause otherwise walks millions of start-up objects).
        gc.collect()
        gc.freeze()

    def _num_state_slots(self) -> int:
        """Recurrent-state slots of the runner (0: an attention-only model; runner.py)."""
        fn = getattr(self.runner, "num_state_slots", None)
        return int(fn()) if fn is not None else 0

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

    def _make_lora_manager(self, caps: Any) -> Any:  # noqa: ANN401
        """The LoRAManager with enable_lora (the runner must declare `capabilities.lora`)."""
        lc = self.config.lora
        if not lc.enable_lora:
            return None
        if not caps.lora:
            able = backends_with(lambda c: c.lora)
            raise ValueError(
                f"enable_lora is not supported by backend {self.backend!r}; use backend "
                f"{backend_names(able)}"
            )
        from xlaserve.lora.manager import LoRAManager

        return LoRAManager(lc, self.spec)

    def load_lora(self, lora_request: Any) -> Any:  # noqa: ANN401
        """Load (or find in the host cache) an adapter: ValueError when LoRA is off or the
        adapter is bad (the engine keeps serving)."""
        if self.lora_manager is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is not enabled "
                "(enable_lora=True / --enable-lora)"
            )
        return self.lora_manager.load(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host cache (running requests keep theirs)."""
        return self.lora_manager is not None and self.lora_manager.remove(lora_int_id)

    @property
    def capacity_tokens(self) -> int:
        return self.kv_manager.num_blocks * self.kv_manager.block_size

    # ------------------------------------------------------------------ requests
    def add_requests(self, reqs: list[CoreRequest]) -> None:
        """Queue the sequences of one front request (all or none). Raises ValueError (a bad
        structured-output spec). The front has validated ids and lengths."""
        if not reqs:
            return
        for r in reqs:
            if r.request_id in self._live:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        so = reqs[0].params.structured_outputs
        # Structured output: validate the spec now (ValueError -> HTTP 400); compile async.
        grammar = self._structured_manager().prepare(so) if so is not None else None
        # LoRA: load each adapter now (ValueError -> HTTP 400 before anything is queued).
        adapters = [self.load_lora(r.lora_request) if r.lora_request else None for r in reqs]
        for r, adapter in zip(reqs, adapters, strict=True):
            req = Request(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.params,
                max_tokens=r.max_tokens,
                arrival_time=r.arrival_time,
                priority=r.priority,
                cache_salt=r.cache_salt,
                group_id=r.group_id,
                lora_request=r.lora_request,
                lora_adapter=adapter,
            )
            if grammar is not None:
                self._structured.add_request(r.request_id, grammar)
            self._live.add(r.request_id)
            self.scheduler.add_request(req)

    def abort_requests(self, request_ids: Iterable[str], stopped: bool = False) -> None:
        """Finish these sequences now and free their blocks. `stopped`: the front found a stop
        string (counted as a finished request); else a client abort. Unknown ids are ignored."""
        ids = [r for r in request_ids if r in self._live]
        if not ids:
            return
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        reqs = self.scheduler.requests
        counted = {r: len(reqs[r].prompt_token_ids) if stopped and r in reqs else 0 for r in ids}
        self.scheduler.finish_requests(ids, status)
        for rid in ids:
            self._end(rid, counted[rid])

    def _end(self, rid: str, prompt_tokens: int) -> None:
        """Forget a finished sequence; `prompt_tokens` count into prompt_tokens_total (0 for an
        aborted one, as before the split: aborted requests never counted)."""
        self._live.discard(rid)
        self._first_sched.pop(rid, None)
        self.counters.prompt_tokens_total += prompt_tokens
        if self._structured is not None:
            self._structured.remove(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def get_num_unfinished_requests(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[CoreOutput]:
        """One engine step: the CoreOutputs of the sequences that changed.

        Async scheduling: step N+1 is scheduled and launched before step N's tokens are read,
        so the host work of a step (scheduling, inputs, outputs) overlaps the device's previous
        step; each call then returns the outputs of the previous launch."""
        # Structured output: requests whose grammar failed to compile finish with an error.
        failed = self._fail_bad_grammars() if self._structured is not None else []
        overlap = self._async and self._can_overlap()
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            if overlap:  # launch the next step first: the device stays busy while we wait
                so = self._schedule(lookahead=True)
                if so is not None:
                    # prev's masks, filled on the fill thread since the last call, go to its
                    # sampling now: the new step's inputs read prev's tokens on the device.
                    self._apply_late_fill()
                    self._inflight = self._launch(so)
                    self.num_overlapped_steps += 1
            self._apply_late_fill()  # (no launch this call: prev samples before it finishes)
            outputs = failed + self._finish_step(prev, self._start_late_fill)
            if self._late_fill is None and self._inflight is not None:
                # No fill thread: the grammars now hold step N's tokens, fill here.
                self._send_late_bitmasks(self._inflight[0], self._inflight[1])
            if self._inflight is not None and not self._live:
                # Nothing left to report: the step in flight holds only dropped extra tokens.
                last, self._inflight = self._inflight, None
                self._apply_late_fill()
                self._finish_step(last)
            return outputs
        so = self._schedule(lookahead=overlap)
        if so is None:
            return failed
        if overlap:
            self._inflight = self._launch(so)
            self._send_late_bitmasks(so, self._inflight[1])  # filled while the forward runs
            return failed
        ro = self.runner.execute(so)
        return failed + self._process(so, ro)

    def _can_overlap(self) -> bool:
        """Async scheduling needs every token's consumer off the step's critical path. Grammar
        bitmasks read the previous step's token: a runner with `apply_bitmasks` takes them
        after the next step's forward is queued (`_send_late_bitmasks`), so grammars keep
        async on; with other runners no grammar may be running or compiling. Speculative
        decoding, which reads the token too, turns async off at start-up
        (`_use_async_scheduling`)."""
        st = self._structured
        if st is not None and self._jump_forward and st.num_matchers:
            # A jump follows the previous step's token: the next step is scheduled after it.
            return False
        return st is None or self._late_bitmasks or (st.num_matchers == 0 and not st.has_pending())

    def _schedule(self, lookahead: bool) -> SchedulerOutput | None:
        """The next step's SchedulerOutput, or None when there is nothing for the runner."""
        if self._ready_tokens is not None:  # programs of larger steps still compiling
            cap = self.scheduler.token_cap = self._ready_tokens()
            if cap is None:
                self._ready_tokens = None  # all compiled: no more asking
        so = self.scheduler.schedule(lookahead=lookahead)
        # Finished ids reach the runner with the next non-empty step (runners never see empty ones).
        so.finished_req_ids |= self._pending_finished
        if so.is_empty:
            self._pending_finished = set(so.finished_req_ids)
            if self._structured is not None and self._structured.has_pending():
                self._structured.wait_pending(timeout=0.05)  # idle: let the compile thread run
            return None
        if self._structured is not None:
            self._attach_bitmasks(so, late=lookahead and self._late_bitmasks)
        self._pending_finished = set()
        now = time.monotonic()
        # A request is first scheduled in new_requests (resumed ones come back there too).
        reqs = self.scheduler.requests
        for nr in so.new_requests:
            req = reqs.get(nr.req_id)
            if req is not None and req.num_preemptions == 0 and nr.req_id in self._live:
                self._first_sched.setdefault(nr.req_id, now)
        return so

    def _launch(self, so: SchedulerOutput) -> tuple[SchedulerOutput, Any, dict[str, Request]]:
        reqs = self.scheduler.requests
        scheduled = {rid: reqs[rid] for rid in so.num_scheduled_tokens}
        return so, self.runner.launch(so), scheduled

    def _finish_step(
        self,
        launched: tuple[SchedulerOutput, Any, dict[str, Request]],
        grammars_advanced: Callable[[Iterable[str]], None] | None = None,
    ) -> list[CoreOutput]:
        so, handle, scheduled = launched
        return self._process(so, self.runner.finish(handle), scheduled, grammars_advanced)

    def _process(
        self,
        so: SchedulerOutput,
        ro: RunnerOutput,
        scheduled: dict[str, Request] | None = None,
        grammars_advanced: Callable[[Iterable[str]], None] | None = None,
    ) -> list[CoreOutput]:
        """Apply one step's RunnerOutput: tokens, stops, grammars, drafts -> CoreOutputs.
        `grammars_advanced(ended)`: called once the grammars hold this step's tokens (the next
        step's late mask fill may start then), with the requests whose grammar ended or failed
        on them (they finish in this call: no mask)."""
        updates = self.scheduler.update_from_output(so, ro, scheduled)
        if so.total_num_scheduled_tokens:
            self.counters.observe_step(so.total_num_scheduled_tokens)
        spec = self._count_spec(so, ro) if so.spec_token_ids else {}
        outs: dict[str, CoreOutput] = {}
        for rid, entries in ro.prompt_logprobs.items():
            if rid in self._live:
                out = outs.setdefault(rid, CoreOutput(rid, []))
                out.prompt_logprobs = [(e.token_ids, e.logprobs, e.rank) for e in entries]
        c = self.counters
        by_id: dict[str, Request] = {}
        mgr = self._structured
        # Grammars advance for the whole step in one batch call (StructuredOutputManager.accept_step);
        # its verdicts (a grammar ended or violated) are the only per-request work left here.
        grammars_on = mgr is not None and mgr.num_matchers > 0
        grammar = (
            mgr.accept_step(
                [(r.request_id, t) for r, t in updates if t and r.request_id in self._live]
            )
            if grammars_on
            else {}
        )
        jump = self._jump_forward and grammars_on
        if grammars_on and grammars_advanced is not None:
            grammars_advanced(grammar.keys())
        for req, new_tokens in updates:
            rid = req.request_id
            if rid not in self._live:
                continue  # aborted (or stopped by the front) meanwhile
            by_id[rid] = req
            out = outs.get(rid)
            if out is None:
                out = outs[rid] = CoreOutput(rid, [])
            if new_tokens:
                c.generation_tokens_total += len(new_tokens)
                out.new_token_ids = list(new_tokens)
                if req.sampling_params.logprobs is not None:
                    entries = ro.logprobs.get(rid, [])[: len(new_tokens)]
                    out.logprobs = [(e.token_ids, e.logprobs, e.rank) for e in entries]
                if rid in grammar:
                    self._grammar_result(req, new_tokens, *grammar[rid])
                if jump and not req.is_finished and mgr.has_matcher(rid):
                    forced = self._jump(req)
                    out.new_token_ids.extend(forced)
                    c.generation_tokens_total += len(forced)
            if req.is_finished:
                out.finish_reason = req.status.finish_reason
                out.stop_reason = req.stop_reason
                if req.status == RequestStatus.FINISHED_ERROR:
                    out.error = req.error
        if self._ngram is not None:
            self._propose_ngram(updates)
        for rid, out in outs.items():
            req = by_id.get(rid) or self.scheduler.requests.get(rid)
            out.first_scheduled_time = self._first_sched.pop(rid, None)
            if req is not None and (
                out.first_scheduled_time is not None or out.finish_reason is not None
            ):  # first and last output only: nothing to send per step
                out.num_cached_tokens = max(req.num_cached_tokens, 0)
                out.num_preemptions = req.num_preemptions
            if rid in spec:
                out.spec_draft_tokens, out.spec_accepted_tokens = spec[rid]
            if out.finish_reason is not None:
                n = len(req.prompt_token_ids) if req is not None else 0
                self._end(rid, n if out.finish_reason != "abort" else 0)
        return list(outs.values())

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

    def _fail_bad_grammars(self) -> list[CoreOutput]:
        outputs = []
        for rid, msg in self._structured.poll().items():
            if rid not in self._live:
                continue
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.error = msg
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
            outputs.append(CoreOutput(rid, [], "error", error=msg))
            self._end(rid, len(req.prompt_token_ids) if req is not None else 0)
        return outputs

    def _attach_bitmasks(self, so: SchedulerOutput, late: bool = False) -> None:
        """Bitmasks for constrained requests that sample this step (the chunk reaches the end of
        the known tokens; schedule() already advanced num_computed_tokens).

        late (async scheduling, a runner with `apply_bitmasks`): the previous step's tokens
        are not known yet, so the grammars are one token behind; only the ids are recorded
        (`so.late_bitmask_req_ids`) and `_send_late_bitmasks` fills the rows once that step is
        processed, while this step's forward runs on the device."""
        mgr = self._structured
        if not mgr.num_matchers:  # no constrained request running: nothing to do this step
            return
        reqs = self.scheduler.requests
        rids = [
            rid
            for rid in so.num_scheduled_tokens
            if mgr.has_matcher(rid) and reqs[rid].num_computed_tokens >= reqs[rid].num_tokens
        ]
        if rids and late:
            so.late_bitmask_req_ids = set(rids)
        elif rids:  # the whole batch in one pass into one buffer
            so.grammar_bitmask.update(mgr.fill_bitmasks(rids, so.spec_token_ids))

    def _late_fill_job(
        self, so: SchedulerOutput, handle: Any, ended: Iterable[str] = ()
    ) -> Callable[[], dict] | None:
        """The fill of a launched step's late masks (`so.late_bitmask_req_ids`, taken), or None
        when it has none. The matchers and buffer are taken now; the call fills. `ended`:
        requests whose grammar just ended or failed (they finish: no row). Requests that
        finished meanwhile (their matcher is gone) get no row either: the runner samples them
        unconstrained and the scheduler drops that extra token, as for any request that ends
        while a step is in flight. A runner may hand out its upload buffer
        (`late_bitmask_buffer`): the masks are then filled where the device copy reads them."""
        if not so.late_bitmask_req_ids:
            return None
        late, so.late_bitmask_req_ids = so.late_bitmask_req_ids.difference(ended), set()
        mgr = self._structured
        if mgr is None:
            return lambda: {}
        rids = [r for r in so.num_scheduled_tokens if r in late]
        target = getattr(self.runner, "late_bitmask_buffer", None)
        return mgr.fill_job(rids, out=target(handle, rids) if target is not None else None)

    def _start_late_fill(self, ended: Iterable[str] = ()) -> None:
        """The step in flight's late masks filled on the fill thread, from now (the grammars
        hold every earlier token) while this thread goes on: through the rest of this step's
        outputs, the front's output processing and the next step's scheduling. The step's
        sampling gets them in `_apply_late_fill`, as late as it can: right before the next
        launch (whose inputs read the step's tokens) or the step's own finish. Without the
        thread: nothing (`_send_late_bitmasks` fills them on the engine thread after the
        outputs)."""
        inflight, mgr = self._inflight, self._structured
        if inflight is None or mgr is None or not mgr.config.fill_thread:
            return
        job = self._late_fill_job(inflight[0], inflight[1], ended)
        if job is None:
            return
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="xlaserve-grammar-fill")
        self._late_fill = (inflight[1], self._fill_pool.submit(job))
        if self._saved_switch is None:
            self._saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(min(self._saved_switch, FILL_SWITCH_INTERVAL_S))

    def _apply_late_fill(self) -> None:
        """Hand the fill thread's masks to the step they are for (its sampling runs now); a
        no-op when no fill is pending."""
        if self._late_fill is None:
            return
        (handle, fut), self._late_fill = self._late_fill, None
        try:
            masks = fut.result()
        finally:
            self._restore_switch()
        self.runner.apply_bitmasks(handle, masks)

    def _restore_switch(self) -> None:
        if self._saved_switch is not None:
            sys.setswitchinterval(self._saved_switch)
            self._saved_switch = None

    def _send_late_bitmasks(self, so: SchedulerOutput, handle: Any) -> None:
        """Fill (on this thread) and hand over the masks of a launched step whose sampling
        waits for them; the grammars now hold every earlier token (`_late_fill_job`)."""
        job = self._late_fill_job(so, handle)
        if job is not None:
            self.runner.apply_bitmasks(handle, job())

    def _grammar_result(
        self, req: Request, new_tokens: list[int], terminated: bool, error: str | None
    ) -> None:
        """A request's grammar after this step's tokens (accept_step): an error finishes it
        with that error, the grammar's end with its stop token."""
        if req.is_finished:
            return
        if error is not None:
            req.error = error
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
        elif terminated:  # the grammar accepted its stop token (e.g. with ignore_eos)
            req.stop_reason = new_tokens[-1]
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)

    def _jump(self, req: Request) -> list[int]:
        """Jump-forward: append the tokens the grammar forces after the request's newest token
        (`StructuredOutputManager.forced_tokens`); the next step computes them as a chunk with
        the sampled token and samples after them. Synchronous steps only (`_can_overlap`).

        Left out (they decode token by token): requests that ask for logprobs (a forced token's
        logprobs would need the forward it skips), and requests whose own token constraints
        (allowed_token_ids, bad_words, logits processors) could disagree with the grammar.
        At least one token is always left to sample: a jump never reaches max_tokens or
        max_model_len."""
        p = req.sampling_params
        if (
            p.logprobs is not None
            or p.allowed_token_ids is not None
            or p.bad_words_token_ids
            or p.logits_processors
        ):
            return []
        limit = min(
            self.config.structured.jump_forward_max_tokens,
            req.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - 1 - req.num_tokens,
        )
        forced = self._structured.forced_tokens(req.request_id, limit, p.is_stop_token)
        if forced:
            req.output_token_ids.extend(forced)
            req.num_unsent_tokens += len(forced)
            req.spec_token_ids = []  # proposed after the sampled token, not after the jump
            self.num_jump_forward_tokens += len(forced)
        return forced

    # ------------------------------------------------------------------ misc
    def _count_spec(self, so: SchedulerOutput, ro: RunnerOutput) -> dict[str, tuple[int, int]]:
        """Draft / accepted token counters (engine-wide); per request (drafts, accepted)."""
        per: dict[str, tuple[int, int]] = {}
        c = self.counters
        for rid, drafts in so.spec_token_ids.items():
            sampled = ro.sampled_token_ids.get(rid)
            if not drafts or not sampled or rid in ro.errors:
                continue
            accepted = min(len(sampled) - 1, len(drafts))
            c.spec_num_drafts += 1
            c.spec_num_draft_tokens += len(drafts)
            c.spec_num_accepted_tokens += accepted
            per[rid] = (len(drafts), accepted)
        return per

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

    def wait_compiled(self) -> None:
        """Block until the runner's background compiles are done (XLA: the token buckets compiled
        after ready and the sampler specializations asked for so far); at once for runners
        without any. Benchmarks call it so that timed steps run at steady state."""
        for name in ("wait_compiled", "join_sample_variants"):
            fn = getattr(self.runner, name, None)
            if callable(fn):
                fn()

    def get_stats(self) -> EngineStats:
        kv = self.kv_manager
        c = self.counters
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_total_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            spec_num_draft_tokens=c.spec_num_draft_tokens,
            spec_num_accepted_tokens=c.spec_num_accepted_tokens,
            spec_num_drafts=c.spec_num_drafts,
            kv_offload_host_hits=kv.offload_host_hits,
            kv_offload_disk_hits=kv.offload_disk_hits,
            kv_offload_bytes_out=kv.offload.bytes_out if kv.offload is not None else 0,
            kv_offload_bytes_in=kv.offload.bytes_in if kv.offload is not None else 0,
            iteration_tokens_buckets=BucketCounts(c.iteration_tokens_buckets),
            iteration_tokens_sum=c.iteration_tokens_sum,
        )

    def shutdown(self) -> None:
        if self._fill_pool is not None:  # a fill still writing a mask buffer ends first
            self._fill_pool.shutdown(wait=True)
            self._late_fill = None
            self._restore_switch()
        if self._inflight is not None:  # let the device finish before its memory goes
            self.runner.finish(self._inflight[1])
            self._inflight = None
        if self._structured is not None:
            self._structured.shutdown()
        self.runner.shutdown()
        # Frozen objects are never collected: give this engine's cycles back to the collector
        # (another engine in the process only loses the freeze's speed-up).
        gc.unfreeze()
