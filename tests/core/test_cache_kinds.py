"""Cache kinds (core/cache_spec.py): KV blocks and recurrent state slots admitted, preempted and
freed together, driven by the fake runner with a simulated recurrent state per slot."""

from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from core_fake_runner import FakeRunner, reference_output  # noqa: E402

from xlaserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from xlaserve.core.cache_spec import (  # noqa: E402
    CacheLayout,
    PagedAttentionSpec,
    RecurrentStateSpec,
)
from xlaserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from xlaserve.core.request import Request  # noqa: E402
from xlaserve.core.scheduler import Scheduler  # noqa: E402
from xlaserve.runner import RunnerOutput, SchedulerOutput  # noqa: E402
from xlaserve.sampling_params import SamplingParams  # noqa: E402

BS = 4


class StateFakeRunner(FakeRunner):
    """FakeRunner + one simulated recurrent state per slot: the tokens it has consumed. A chunk
    must continue exactly the state its slot holds (a request starting at 0 gets a zeroed slot);
    two live requests never share a slot."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        super().__init__(num_blocks, BS)
        self.slot_state: list[tuple[int, ...] | None] = [None] * num_slots
        self.req_slot: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for rid in so.finished_req_ids:
            self.req_slot.pop(rid, None)
        for nr in so.new_requests:
            assert nr.state_slot >= 0, f"{nr.req_id} scheduled without a state slot"
            assert nr.state_slot not in self.req_slot.values(), "slot handed to two requests"
            assert nr.num_computed_tokens == 0, "prefix hit on a recurrent model"
            self.req_slot[nr.req_id] = nr.state_slot
            self.slot_state[nr.state_slot] = ()  # zero state
        # Consume each chunk on its slot's state (before the base class advances num_computed).
        chunks = {}
        for nr in so.new_requests:
            chunks[nr.req_id] = (list(nr.token_ids), nr.num_computed_tokens)
        for cr in so.cached_requests:
            st = self.state[cr.req_id]
            chunks[cr.req_id] = (st.tokens, st.num_computed)
        for rid, n in so.num_scheduled_tokens.items():
            tokens, c = chunks[rid]
            slot = self.req_slot[rid]
            assert self.slot_state[slot] == tuple(tokens[:c]), f"{rid}: state lost at {c}"
            self.slot_state[slot] = tuple(tokens[: c + n])
        return super().execute(so)


def make(
    num_blocks: int, num_slots: int, budget: int = 8, max_num_seqs: int = 8, max_len: int = 64
) -> tuple[Scheduler, StateFakeRunner]:
    kv = KVCacheManager(num_blocks, BS, True, num_state_slots=num_slots)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=BS, num_kv_blocks=num_blocks),
        kv,
        max_len,
    )
    return sched, StateFakeRunner(num_blocks, num_slots)


def req(rid: str, n: int, max_tokens: int) -> Request:
    return Request(rid, [10 + i for i in range(n)], SamplingParams(), max_tokens=max_tokens)


def run(sched: Scheduler, runner: StateFakeRunner, limit: int = 500) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return outs
        so = sched.schedule()
        ro = runner.execute(so)
        for r, toks in sched.update_from_output(so, ro):
            outs.setdefault(r.request_id, []).extend(toks)
    raise AssertionError("did not finish")


def assert_idle(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.req_to_state_slot == {} and len(kv.free_state_slots) == kv.num_state_slots
    assert kv.usage == 0.0 and kv.req_to_blocks == {}


def test_state_slot_with_first_blocks_and_freed_at_finish() -> None:
    sched, runner = make(num_blocks=32, num_slots=3)
    a, b = req("a", 10, 3), req("b", 3, 2)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    # a's first chunk (8 of 10 tokens) takes slot 0 with its blocks; b does not fit the budget.
    assert [(n.req_id, n.state_slot, n.block_ids) for n in so.new_requests] == [("a", 0, [0, 1])]
    assert sched.kv_cache_manager.usage == pytest.approx(1 / 3)
    runner.execute(so)  # (update_from_output not needed for a partial chunk)
    so = sched.schedule()
    assert [(n.req_id, n.state_slot) for n in so.new_requests] == [("b", 1)]
    first = {r.request_id: t for r, t in sched.update_from_output(so, runner.execute(so))}
    outs = run(sched, runner)
    assert first["a"] + outs["a"] == reference_output(a.prompt_token_ids, 3)
    assert first["b"] + outs["b"] == reference_output(b.prompt_token_ids, 2)
    assert_idle(sched)


def test_short_slots_preempt_and_resume_from_zero_state() -> None:
    """More sequences than slots: admission stops at the slots, running ones keep theirs, a
    request that cannot grow its blocks preempts the newest, whose slot goes with its blocks."""
    sched, runner = make(num_blocks=9, num_slots=2, budget=16, max_len=32)
    reqs = [req(f"r{i}", n, m) for i, (n, m) in enumerate([(9, 12), (3, 20), (6, 9), (13, 5)])]
    for r in reqs:
        sched.add_request(r)
    so = sched.schedule()
    assert [n.req_id for n in so.new_requests] == ["r0", "r1"]  # two slots
    first = {r.request_id: t for r, t in sched.update_from_output(so, runner.execute(so))}
    outs = run(sched, runner)
    for r in reqs:
        want = reference_output(r.prompt_token_ids, r.max_tokens)
        assert first.get(r.request_id, []) + outs[r.request_id] == want
    assert sched.num_preemptions_total > 0
    assert_idle(sched)


def test_blocks_and_slot_all_or_nothing() -> None:
    kv = KVCacheManager(4, BS, False, num_state_slots=1)
    a, b = req("a", 8, 1), req("b", 4, 1)
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 4) is None  # blocks free, no slot: nothing taken
    assert kv.num_free_blocks == 2 and kv.get_state_slot("b") == -1
    kv.free(a)
    c = req("c", 20, 1)
    assert kv.allocate_slots(c, 20) is None  # slot free, blocks short: slot not taken
    assert kv.free_state_slots == [0]
    assert kv.allocate_slots(b, 4) == [2] and kv.get_state_slot("b") == 0


def test_prefix_caching_disabled_for_state_models(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="xlaserve.core.kv_cache_manager"):
        kv = KVCacheManager(16, BS, True, num_state_slots=2)
    assert not kv.enable_prefix_caching
    assert "prefix caching is disabled" in caplog.text
    a = req("a", 12, 1)
    kv.allocate_slots(a, 12)
    kv.free(a)
    again = req("a2", 12, 1)
    assert kv.get_computed_blocks(again) == ([], 0)


def test_layout_split_one_budget() -> None:
    hybrid = CacheLayout(
        (PagedAttentionSpec((1, 3), bytes_per_block=100), RecurrentStateSpec((0, 2), 1000))
    )
    assert hybrid.kinds == ("attention", "recurrent_state")
    # 8 slots (max_num_seqs) first, then blocks: (20000 - 8000) // 100.
    assert hybrid.split(20_000, BS, max_num_seqs=8, max_model_len=64) == (120, 8)
    # Tight: slots shrink so one max-length request (16 blocks) still fits.
    assert hybrid.split(4_000, BS, max_num_seqs=8, max_model_len=64) == (20, 2)
    with pytest.raises(ValueError, match="cannot hold one request"):
        hybrid.split(2_000, BS, max_num_seqs=8, max_model_len=64)
    pure = CacheLayout((RecurrentStateSpec((0, 1), 500),))
    assert pure.split(10_000, BS, max_num_seqs=4, max_model_len=64) == (64, 4)
    with pytest.raises(ValueError, match="two cache groups"):
        CacheLayout((PagedAttentionSpec((0,), 1), PagedAttentionSpec((0, 1), 1)))
    with pytest.raises(ValueError, match="two cache groups"):
        CacheLayout((RecurrentStateSpec((1,), 1), RecurrentStateSpec((1,), 1)))
    # Falcon-H1: a parallel attention + Mamba2 layer holds K/V blocks and a state slot.
    both = CacheLayout((PagedAttentionSpec((0, 1), 10), RecurrentStateSpec((0, 1), 7)))
    assert (both.bytes_per_block, both.bytes_per_slot) == (10, 7)
