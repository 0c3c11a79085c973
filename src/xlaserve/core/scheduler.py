"""Token-budget scheduler: no prefill/decode phases, only each request's num_computed_tokens
catching up with its num_tokens (+ draft tokens).

One step fills `max_num_batched_tokens`: running requests first (in order), then waiting ones
(prefix-cache hits skipped, long prompts chunked). When blocks run out the last running request
(the newest under fcfs, the lowest priority under "priority", where `running` is kept sorted) is
preempted by recompute: its blocks are freed and it goes back to the waiting queue.

Async scheduling (`schedule(lookahead=True)`): the engine schedules step N+1 before step N's
tokens are back. Each request that samples in a lookahead step gets one pending token
(`num_pending_tokens`), scheduled like a known one; `update_from_output` resolves it. A request
that turns out to have finished at step N was computed once more at N+1; that token is dropped.

Multi-LoRA (`lora_manager`): a request with an adapter pins one of `max_loras` device slots
while it runs, so the running requests never use more than `max_loras` distinct adapters. A
waiting request whose adapter has no slot to take (every slot held by a running request's
adapter) is skipped this step and keeps its place at the head of the queue; the requests
behind it still go if they fit (base requests, resident adapters). Preemption releases the
slot; a resumed request takes one again (maybe another: it comes back in new_requests).
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from xlaserve.config import CacheConfig, SchedulerConfig
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.request import Request, RequestStatus
from xlaserve.runner import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from xlaserve.lora.manager import LoRAManager


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


def _group(request: Request) -> str:
    """Fairness group: the client request a sequence belongs to."""
    return request.group_id or request.request_id


def _drop(counter: Counter, key: str) -> None:
    """One fewer of `key` (removed at zero, so len() counts the keys present)."""
    if counter[key] > 1:
        counter[key] -= 1
    else:
        counter.pop(key, None)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        lora_manager: LoRAManager | None = None,
    ) -> None:
        self.config = scheduler_config
        # Multi-LoRA slot bookkeeping (None: LoRA off; a request with an adapter is refused).
        self.lora_manager = lora_manager
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.by_priority = scheduler_config.policy == "priority"
        capacity = kv_cache_manager.num_blocks * kv_cache_manager.block_size
        if capacity < max_model_len:
            # A single max-length request could never fit: it would wait forever.
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({kv_cache_manager.num_blocks} blocks of "
                f"{kv_cache_manager.block_size}), fewer than max_model_len={max_model_len}; "
                "give it more blocks or lower max_model_len"
            )
        self.requests: dict[str, Request] = {}
        # fcfs: arrival order (preempted ones at the front); priority: sorted by _priority_key.
        self.waiting: deque[Request] = deque()
        # Batch order; under "priority" sorted by _priority_key so the last is the first victim.
        self.running: list[Request] = []
        # Ids the runner must forget at the next step (finished, aborted, preempted).
        self._finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        # Structured output hook (set by the engine): False while a request's grammar is still
        # compiling; such waiting requests are skipped without blocking the ones behind them.
        self.is_request_ready: Callable[[Request], bool] | None = None
        # Tokens a step may hold below max_num_batched_tokens (set by the engine while the
        # runner still compiles the programs of larger steps); None = no cap.
        self.token_cap: int | None = None

    # ----- queues -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if request.lora_request is not None and (
            self.lora_manager is None or request.lora_adapter is None
        ):
            raise ValueError("a LoRA request needs enable_lora and its loaded adapter")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._enqueue_waiting(request, front=False)

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        if self.by_priority:
            bisect.insort_right(self.waiting, request, key=_priority_key)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop its KV; it resumes from token 0 (prefix hits help)."""
        self.running.remove(request)
        self._release_lora(request)
        # "swap": its full blocks are copied out to the host tier, so resuming reloads them.
        self.kv_cache_manager.free(request, swap=self.config.preemption_mode == "swap")
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # its in-flight token is dropped; resumed from known ones
        request.num_unsent_tokens = 0  # NewRequestData carries every token on resume
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._finished_req_ids.add(request.request_id)
        self._enqueue_waiting(request, front=True)

    def _release_lora(self, request: Request) -> None:
        """A running request stops running (finished or preempted): unpin its adapter's slot."""
        if request.lora_slot >= 0:
            self.lora_manager.release(request.lora_int_id)
            request.lora_slot = -1

    # ----- fairness ---------------------------------------------------------------------------

    @property
    def group_cap(self) -> int:
        """Running sequences one group may hold while other groups wait (>= 1)."""
        return max(1, int(self.config.max_running_share * self.config.max_num_seqs))

    def _ready(self, req: Request) -> bool:
        return self.is_request_ready is None or self.is_request_ready(req)

    def _rebalance(self, running: Counter) -> None:
        """Fairness: when ready waiting requests of groups under the cap outnumber the free
        slots, preempt sequences of groups over the cap (the last in batch order first) until
        they fit or no group is over. Updates `running` (group -> running sequences)."""
        cap = self.group_cap
        want = 0
        best = None  # under "priority": never preempt for a less urgent request
        seen: Counter = Counter()
        for r in self.waiting:
            g = _group(r)
            if running[g] + seen[g] < cap and self._ready(r):
                seen[g] += 1
                want += 1
                best = r.priority if best is None else min(best, r.priority)
        free = self.config.max_num_seqs - len(self.running)
        while want > free:
            victim = next(
                (
                    r
                    for r in reversed(self.running)
                    if running[_group(r)] > cap
                    and (not self.by_priority or best is None or r.priority >= best)
                ),
                None,
            )
            if victim is None:
                return
            running[_group(victim)] -= 1
            self._preempt(victim)
            free += 1

    # ----- one step ---------------------------------------------------------------------------

    def schedule(self, lookahead: bool = False) -> SchedulerOutput:
        """One step. lookahead: the previous step's tokens are not back yet (async scheduling):
        every request that samples in this step gets a pending token."""
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        if self.token_cap is not None:  # the runner's programs for larger steps still compile
            budget = min(budget, self.token_cap)
        num_scheduled: dict[str, int] = {}
        spec_token_ids: dict[str, list[int]] = {}
        cached_reqs: list[CachedRequestData] = []
        new_reqs: list[Request] = []
        preempted = False
        # Fairness: running sequences per group, and the waiting groups, while others wait.
        fair = self.group_cap < self.config.max_num_seqs and bool(self.waiting)
        running_by_group: Counter = Counter(_group(r) for r in self.running) if fair else Counter()
        if fair:
            self._rebalance(running_by_group)

        # 1. Running requests, in order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = req.num_pending_tokens
            if pending and req.num_output_tokens + pending >= req.max_tokens:
                i += 1  # its last token is in flight: nothing more to compute
                continue
            num_new = req.num_tokens + pending + len(req.spec_token_ids) - req.num_computed_tokens
            # The token sampled after position max_model_len - 1 would not fit.
            num_new = min(num_new, budget, self.max_model_len - 1 - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            while (new_block_ids := kv.allocate_slots(req, num_new)) is None:
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if new_block_ids is None:
                # req itself was the last running request: nothing after it to schedule.
                break
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            num_drafts = req.num_computed_tokens + num_new - req.num_tokens
            if num_drafts > 0:
                spec_token_ids[req.request_id] = req.spec_token_ids[:num_drafts]
            cached = CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens)
            if req.num_unsent_tokens:  # jump-forward tokens the runner has not seen
                cached.new_token_ids = req.output_token_ids[-req.num_unsent_tokens :]
                req.num_unsent_tokens = 0
            cached_reqs.append(cached)
            i += 1

        # 2. Waiting requests (not in a step that had to preempt: blocks are short).
        not_ready: list[Request] = []  # grammar still compiling: skipped, put back in order
        # Fairness: waiting requests per group; a group at its cap is held back while another
        # group's request waits (held requests are put back in order like not_ready ones).
        waiting_by_group: Counter = (
            Counter(_group(r) for r in self.waiting if self._ready(r)) if fair else Counter()
        )
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if self.is_request_ready is not None and not self.is_request_ready(req):
                not_ready.append(self.waiting.popleft())
                continue
            if fair:
                g = _group(req)
                others = len(waiting_by_group) - (1 if waiting_by_group[g] else 0)
                if running_by_group[g] >= self.group_cap and others > 0:
                    not_ready.append(self.waiting.popleft())
                    _drop(waiting_by_group, g)
                    continue
            lora = self.lora_manager if req.lora_adapter is not None else None
            if lora is not None and not lora.can_acquire(req.lora_int_id):
                # Every slot is pinned by other adapters' running requests: it waits, those
                # behind it may still go.
                not_ready.append(self.waiting.popleft())
                continue
            computed_blocks, num_hit = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if kv.allocate_slots(req, num_new, computed_blocks, num_hit) is None:
                break
            self.waiting.popleft()
            if self.by_priority:
                bisect.insort_right(self.running, req, key=_priority_key)
            else:
                self.running.append(req)
            req.status = RequestStatus.RUNNING
            if lora is not None:
                req.lora_slot = lora.acquire(req.lora_adapter)
            if fair:
                g = _group(req)
                running_by_group[g] += 1
                _drop(waiting_by_group, g)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            new_reqs.append(req)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
        # Skipped requests were at the head of the queue: they go back there, same order.
        self.waiting.extendleft(reversed(not_ready))

        output = SchedulerOutput(
            new_requests=[
                NewRequestData(
                    req_id=r.request_id,
                    token_ids=r.all_token_ids,
                    num_prompt_tokens=r.num_prompt_tokens,
                    sampling_params=r.sampling_params,
                    block_ids=kv.get_block_ids(r.request_id),
                    num_computed_tokens=r.num_computed_tokens,
                    state_slot=kv.get_state_slot(r.request_id),
                    lora_slot=r.lora_slot,
                )
                for r in new_reqs
            ],
            cached_requests=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            spec_token_ids=spec_token_ids,
            finished_req_ids=self._finished_req_ids,
        )
        # Host/disk tier copies of this step (evictions, swap-outs, tier hits); see runner.py.
        ops = kv.take_offload_ops()
        output.kv_disk_out, output.kv_copy_out = ops.disk_out, ops.copy_out
        output.kv_disk_in, output.kv_copy_in = ops.disk_in, ops.copy_in
        if self.lora_manager is not None:
            output.lora_loads = self.lora_manager.take_loads()
        self._finished_req_ids = set()
        # Advance optimistically; update_from_output takes back rejected draft positions.
        for req_id, n in num_scheduled.items():
            req = self.requests[req_id]
            req.num_computed_tokens += n
            if lookahead and req.num_computed_tokens >= req.num_tokens + req.num_pending_tokens:
                req.num_pending_tokens += 1  # it samples: its token is in flight
                output.pending_req_ids.add(req_id)
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: RunnerOutput,
        scheduled: dict[str, Request] | None = None,
    ) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, apply stop conditions, free finished requests. `scheduled`
        (async scheduling): the step's Request objects, to skip a request id reused since.

        Returns (request, tokens appended this step) for each request that got tokens or
        finished. Tokens after a stop are dropped (also from multi-token spec-decode results).
        """
        results: list[tuple[Request, list[int]]] = []
        pending = scheduler_output.pending_req_ids
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted since schedule()
            if scheduled is not None and scheduled.get(req_id) is not req:
                continue  # the id was aborted and reused since this step was scheduled
            if req_id in pending:
                req.num_pending_tokens -= 1
            if req_id in runner_output.errors:
                req.error = runner_output.errors[req_id]
                self._finish(req, RequestStatus.FINISHED_ERROR)
                results.append((req, []))
                continue
            sampled = runner_output.sampled_token_ids.get(req_id, [])
            drafts = scheduler_output.spec_token_ids.get(req_id, [])
            if drafts and sampled:
                # Positions of rejected drafts hold wrong KV: recompute them (they get
                # overwritten; the blocks stay with the request, the runner's table too).
                req.num_computed_tokens -= len(drafts) + 1 - len(sampled)
            spec = runner_output.spec_token_ids.get(req_id)
            if spec or req.spec_token_ids:  # no new list per request per step without drafts
                req.spec_token_ids = list(spec) if spec else []
            new_tokens: list[int] = []
            for token in sampled:
                req.output_token_ids.append(token)
                new_tokens.append(token)
                if self._check_stop(req):
                    break
            if req.is_finished:
                self._release(req)
            if new_tokens or req.is_finished:
                results.append((req, new_tokens))
        return results

    def _check_stop(self, req: Request) -> bool:
        """Sets the finished status after the newest output token; stop wins over length."""
        params = req.sampling_params
        last = req.output_token_ids[-1]
        if params.is_stop_token(last) and req.num_output_tokens >= params.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = last
            return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # ----- finishing --------------------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish waiting or running requests (stop strings, aborts); unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self._release(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self._release_lora(req)
            # Only requests the runner holds state for (it saw them scheduled) are reported.
            self._finished_req_ids.add(req.request_id)
        else:
            self.waiting.remove(req)
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
