"""A fake backend for scheduler tests: deterministic tokens, a simulated paged KV cache.

It keeps per-request state from SchedulerOutput exactly as a real runner must (persistent batch,
new/cached requests, finished ids) and asserts the contract on every step: the state it holds
matches what the scheduler says, the block table covers every scheduled position, and every
position a step attends to holds the right KV in the (simulated) cache. A prefix-cache hit on a
wrong block, a block handed to two requests, or a lost block-table update fails loudly.

The simulated KV of position p is the whole prefix tokens[: p + 1], as a real model's K/V at p
depends on every token before it (causal attention): a block holding the right token ids but
computed after a different prefix (an unchained prefix-cache hash) is wrong KV, and is caught.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from xlaserve.core.scheduler import Scheduler
from xlaserve.runner import RunnerOutput, SchedulerOutput

# (request id, num prompt tokens, tokens so far) -> next token.
TokenFn = Callable[[str, int, list[int]], int]


def mix_token(req_id: str, num_prompt: int, tokens: list[int]) -> int:
    """The 'model': a deterministic function of the whole sequence (vocab 1..97)."""
    return (sum(tokens) * 31 + len(tokens) * 7 + tokens[-1] * 13) % 97 + 1


def script_fn(scripts: dict[str, list[int]]) -> TokenFn:
    """Emit scripts[req_id][i] as the i-th output token."""
    return lambda rid, num_prompt, tokens: scripts[rid][len(tokens) - num_prompt]


def reference_output(
    prompt: list[int], max_tokens: int, stop_ids: set[int] = frozenset(), min_tokens: int = 0
) -> list[int]:
    """What mix_token generates without any scheduling (no batching, no preemption)."""
    out: list[int] = []
    while True:
        out.append(mix_token("", len(prompt), prompt + out))
        if (len(out) >= min_tokens and out[-1] in stop_ids) or len(out) >= max_tokens:
            return out


def first_allowed(mask_row: object, token: int) -> int:
    """The grammar's pick for the fake 'model': `token` when the packed int32 [W] bitmask row
    allows it, else the next allowed id (cyclic over the mask's ids), so constrained output stays
    a deterministic function of the sequence and the mask."""
    import numpy as np

    bits = np.unpackbits(np.asarray(mask_row, "<i4").view(np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits)
    assert allowed.size, "a grammar bitmask row allows no token"
    later = allowed[allowed >= token]
    return int(later[0] if later.size else allowed[0])


@dataclass
class _ReqState:
    tokens: list[int]
    num_prompt: int
    block_ids: list[int]
    num_computed: int


@dataclass
class FakeRunner:
    num_blocks: int
    block_size: int
    token_fn: TokenFn = mix_token
    # req_id -> error message to report for it on its next step.
    fail: dict[str, str] = field(default_factory=dict)
    state: dict[str, _ReqState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # kv[block][slot] = the prefix (tokens[: p + 1]) whose "KV" at position p is stored there.
        self.kv: list[list[tuple[int, ...] | None]] = [
            [None] * self.block_size for _ in range(self.num_blocks)
        ]

    def _slot(self, st: _ReqState, pos: int) -> tuple[int, int]:
        return st.block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for rid in so.finished_req_ids:
            assert rid in self.state, f"runner told to forget unknown request {rid}"
            del self.state[rid]
        for nr in so.new_requests:
            assert nr.req_id not in self.state
            self.state[nr.req_id] = _ReqState(
                list(nr.token_ids), nr.num_prompt_tokens, list(nr.block_ids), nr.num_computed_tokens
            )
        for cr in so.cached_requests:
            st = self.state[cr.req_id]
            assert st.num_computed == cr.num_computed_tokens, (cr, st.num_computed)
            st.block_ids += cr.new_block_ids
        batch = [nr.req_id for nr in so.new_requests] + [cr.req_id for cr in so.cached_requests]
        assert sorted(batch) == sorted(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        out = RunnerOutput()
        for rid, n in so.num_scheduled_tokens.items():
            st = self.state[rid]
            if rid in self.fail:
                out.errors[rid] = self.fail.pop(rid)
                continue
            drafts = so.spec_token_ids.get(rid, [])
            seq = st.tokens + drafts
            c = st.num_computed
            assert n > 0 and c + n <= len(seq)
            assert not drafts or c + n == len(seq), "drafts scheduled but not all positions"
            assert len(st.block_ids) * self.block_size >= c + n, "block table too short"
            for pos in range(c):  # attended KV must be that of this request's prefix
                b, s = self._slot(st, pos)
                assert self.kv[b][s] == tuple(seq[: pos + 1]), f"{rid}: wrong KV at position {pos}"
            for pos in range(c, c + n):
                b, s = self._slot(st, pos)
                self.kv[b][s] = tuple(seq[: pos + 1])
            if c + n < len(st.tokens):  # partial prefill chunk
                st.num_computed = c + n
                out.sampled_token_ids[rid] = []
                continue
            sampled: list[int] = []
            mask = so.grammar_bitmask.get(rid)  # int32 [1 + drafts, W]: row i after drafts[:i]

            def pick(i: int) -> int:
                t = self.token_fn(rid, st.num_prompt, st.tokens + sampled)  # noqa: B023
                return t if mask is None else first_allowed(mask[i], t)  # noqa: B023

            for i, d in enumerate(drafts):  # greedy verification: accept while draft == target
                sampled.append(pick(i))
                if sampled[-1] != d:
                    break
            else:
                sampled.append(pick(len(drafts)))
            st.num_computed = c + n - (len(drafts) + 1 - len(sampled))
            st.tokens += sampled
            out.sampled_token_ids[rid] = sampled
        return out


def step(sched: Scheduler, runner: FakeRunner):  # noqa: ANN201
    """One engine step: (SchedulerOutput, {req_id: new tokens} of update_from_output)."""
    so = sched.schedule()
    ro = runner.execute(so)
    results = sched.update_from_output(so, ro)
    return so, {req.request_id: toks for req, toks in results}


class ThreadedFakeRunner:
    """A ModelRunner (the `xlaserve.runner` protocol) over FakeRunner whose steps really overlap
    the engine: `launch` queues the step on a worker thread (the "device", one step at a time,
    in launch order) that sleeps `LAUNCH_DELAY_S` and then runs it; `finish` waits for it. So the
    engine schedules and launches step N+1 while step N is still running, as on a GPU or TPU,
    and the worker reads each SchedulerOutput only when it runs the step.

    Tokens are `mix_token` of the sequence (ids 1..97: any tokenizer of >= 98 ids decodes them);
    register it with `register_backend(name, "core_fake_runner:ThreadedFakeRunner")`.
    """

    LAUNCH_DELAY_S = 0.005
    async_by_default = True

    def __init__(self, config, spec) -> None:  # noqa: ANN001 - EngineConfig, ModelSpec
        self.config = config
        self.fake: FakeRunner | None = None
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-device")
        self._last: Future | None = None  # the newest launched step
        self.num_launches = 0
        # Launches issued while the previous step was still running on the worker.
        self.num_overlapped_launches = 0
        self._late: dict[Future, Future] = {}  # launched step -> its late bitmasks
        self.num_late_masks = 0  # bitmask rows handed over after launch
        self.num_waits_for_masks = 0  # steps whose "forward" ended before their masks came

    def load_model(self) -> None:
        pass

    def determine_num_kv_blocks(self) -> int:
        return self.config.cache.num_kv_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        self.fake = FakeRunner(num_blocks, self.config.cache.block_size)

    def _run(self, so: SchedulerOutput, late: Future | None) -> RunnerOutput:
        time.sleep(self.LAUNCH_DELAY_S)  # the "forward"
        if late is not None:  # sampling waits for the late grammar bitmasks, as on a device
            if not late.done():
                self.num_waits_for_masks += 1
            so.grammar_bitmask.update(late.result(timeout=60))
        return self.fake.execute(so)

    def launch(self, so: SchedulerOutput) -> Future:
        if self._last is not None and not self._last.done():
            self.num_overlapped_launches += 1
        self.num_launches += 1
        late: Future | None = Future() if so.late_bitmask_req_ids else None
        self._last = self._device.submit(self._run, so, late)
        if late is not None:
            self._late[self._last] = late
        return self._last

    def apply_bitmasks(self, handle: Future, masks: dict) -> None:
        """The late grammar bitmasks of a launched step (xlaserve.runner protocol)."""
        self.num_late_masks += len(masks)
        self._late.pop(handle).set_result(masks)

    def finish(self, handle: Future) -> RunnerOutput:
        assert handle not in self._late, "finish before apply_bitmasks"
        return handle.result(timeout=60)  # a failed check on the worker raises here

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return self.finish(self.launch(so))

    def shutdown(self) -> None:
        self._device.shutdown(wait=True)
