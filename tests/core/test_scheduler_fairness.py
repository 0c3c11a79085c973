"""Scheduler fairness (scheduler.max_running_share): exact batch contents per step when one
request's sequences (one group) would hold the whole batch while another request waits."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from core_fake_runner import FakeRunner, step  # noqa: E402

from xlaserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from xlaserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from xlaserve.core.request import Request, RequestStatus  # noqa: E402
from xlaserve.core.scheduler import Scheduler  # noqa: E402
from xlaserve.sampling_params import SamplingParams  # noqa: E402

BS = 4


def make(max_num_seqs: int = 4, share: float = 0.5, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(128, BS, False)
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_running_share=share,
        ),
        CacheConfig(block_size=BS, num_kv_blocks=128, enable_prefix_caching=False),
        kv,
        256,
    )


def seq(rid: str, group: str | None, start: int, max_tokens: int = 50) -> Request:
    prompt = [start + i for i in range(4)]
    return Request(
        rid, prompt, SamplingParams(), max_tokens=max_tokens, arrival_time=0.0, group_id=group
    )


def ids(reqs: list[Request]) -> list[str]:
    return [r.request_id for r in reqs]


def test_one_group_takes_the_whole_batch_when_nobody_waits() -> None:
    sched, runner = make(), FakeRunner(128, BS)
    for i in range(6):
        sched.add_request(seq(f"{i}#big", "big", 10 * i))
    so, _ = step(sched, runner)
    assert sorted(so.num_scheduled_tokens) == ["0#big", "1#big", "2#big", "3#big"]
    assert ids(sched.running) == ["0#big", "1#big", "2#big", "3#big"]
    assert ids(sched.waiting) == ["4#big", "5#big"]
    assert sched.num_preemptions_total == 0


def test_waiting_request_preempts_the_group_over_its_share() -> None:
    sched, runner = make(), FakeRunner(128, BS)
    for i in range(4):
        sched.add_request(seq(f"{i}#big", "big", 10 * i))
    step(sched, runner)
    assert ids(sched.running) == ["0#big", "1#big", "2#big", "3#big"]
    small = seq("0#small", "small", 100, max_tokens=2)
    sched.add_request(small)
    so, _ = step(sched, runner)
    # cap = 0.5 * 4 = 2 while another group waits: one big sequence (the newest) makes room.
    assert sched.num_preemptions_total == 1
    assert sched.requests["3#big"].status == RequestStatus.PREEMPTED
    assert "0#small" in so.num_scheduled_tokens and small.status == RequestStatus.RUNNING
    assert ids(sched.running) == ["0#big", "1#big", "2#big", "0#small"]
    # The preempted big sequence is held back (its group is over the cap) but stays queued.
    assert ids(sched.waiting) == ["3#big"]
    assert "3#big" in so.finished_req_ids


def test_group_is_held_at_its_cap_while_another_group_waits() -> None:
    sched, runner = make(max_num_seqs=4), FakeRunner(128, BS)
    for i in range(4):
        sched.add_request(seq(f"{i}#a", "a", 10 * i))
    sched.add_request(seq("0#b", "b", 200))
    sched.add_request(seq("1#b", "b", 210))
    so, _ = step(sched, runner)
    # a's first two admit (under its cap), a's others wait behind b's, which are admitted.
    assert sorted(so.num_scheduled_tokens) == ["0#a", "0#b", "1#a", "1#b"]
    assert ids(sched.waiting) == ["2#a", "3#a"]
    assert sched.num_preemptions_total == 0


def test_share_one_turns_fairness_off() -> None:
    sched, runner = make(share=1.0), FakeRunner(128, BS)
    for i in range(4):
        sched.add_request(seq(f"{i}#big", "big", 10 * i))
    step(sched, runner)
    sched.add_request(seq("0#small", "small", 100))
    so, _ = step(sched, runner)
    assert sched.num_preemptions_total == 0
    assert "0#small" not in so.num_scheduled_tokens
    assert ids(sched.waiting) == ["0#small"]


def test_requests_without_group_are_their_own_group() -> None:
    sched, runner = make(max_num_seqs=2), FakeRunner(128, BS)
    sched.add_request(seq("x", None, 0))
    sched.add_request(seq("y", None, 40))
    sched.add_request(seq("z", None, 80))
    so, _ = step(sched, runner)
    # Each is its own group with cap 1: plain fcfs, nobody preempted.
    assert sorted(so.num_scheduled_tokens) == ["x", "y"]
    assert sched.num_preemptions_total == 0
    step(sched, runner)
    assert sched.num_preemptions_total == 0 and ids(sched.waiting) == ["z"]


def test_finished_group_frees_its_slots_for_the_held_sequences() -> None:
    sched, runner = make(), FakeRunner(128, BS)
    for i in range(4):
        sched.add_request(seq(f"{i}#big", "big", 10 * i, max_tokens=30))
    step(sched, runner)
    sched.add_request(seq("0#small", "small", 100, max_tokens=2))
    for _ in range(4):  # small runs 2 tokens and leaves
        step(sched, runner)
    assert "0#small" not in sched.requests
    step(sched, runner)
    # Nobody else waits: the held big sequence runs again.
    assert ids(sched.running) == ["0#big", "1#big", "2#big", "3#big"]
    assert not sched.waiting


def test_priority_policy_never_preempts_for_a_less_urgent_request() -> None:
    kv = KVCacheManager(128, BS, False)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, policy="priority", max_running_share=0.5
        ),
        CacheConfig(block_size=BS, num_kv_blocks=128, enable_prefix_caching=False),
        kv,
        256,
    )
    runner = FakeRunner(128, BS)
    for i in range(4):
        sched.add_request(seq(f"{i}#big", "big", 10 * i))  # priority 0 (most urgent)
    step(sched, runner)
    low = seq("0#low", "low", 100)
    low.priority = 5
    sched.add_request(low)
    step(sched, runner)
    assert sched.num_preemptions_total == 0 and ids(sched.waiting) == ["0#low"]
