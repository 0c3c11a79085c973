"""Scheduler: exact SchedulerOutput contents per step, driven by a fake runner (core_fake_runner)."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from core_fake_runner import FakeRunner, mix_token, reference_output, script_fn, step  # noqa: E402

from xlaserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from xlaserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from xlaserve.core.request import Request, RequestStatus  # noqa: E402
from xlaserve.core.scheduler import Scheduler  # noqa: E402
from xlaserve.runner import CachedRequestData, NewRequestData  # noqa: E402
from xlaserve.sampling_params import SamplingParams  # noqa: E402

BS = 4


def make(
    num_blocks: int = 64,
    budget: int = 8,
    max_num_seqs: int = 16,
    chunked: bool = True,
    policy: str = "fcfs",
    prefix: bool = True,
    max_model_len: int = 64,
    token_fn=mix_token,  # noqa: ANN001
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, BS, prefix)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            policy=policy,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=BS, num_kv_blocks=num_blocks, enable_prefix_caching=prefix),
        kv,
        max_model_len,
    )
    return sched, FakeRunner(num_blocks, BS, token_fn)


def req(rid: str, prompt: list[int], max_tokens: int = 4, arrival: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(), max_tokens=max_tokens, arrival_time=arrival)


def prompt(start: int, n: int) -> list[int]:
    return [start + i for i in range(n)]


def assert_idle(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished_requests()
    assert kv.usage == 0.0 and kv.req_to_blocks == {}
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_chunked_prefill_then_decode() -> None:
    sched, runner = make(budget=8)
    a = req("a", prompt(100, 20), max_tokens=3)
    sched.add_request(a)
    sp = a.sampling_params
    ref = reference_output(a.prompt_token_ids, 3)

    so, res = step(sched, runner)
    assert so.new_requests == [NewRequestData("a", prompt(100, 20), 20, sp, [0, 1], 0)]
    assert so.cached_requests == [] and so.num_scheduled_tokens == {"a": 8}
    assert so.total_num_scheduled_tokens == 8 and so.finished_req_ids == set() and res == {}
    assert a.num_computed_tokens == 8 and a.num_cached_tokens == 0

    so, res = step(sched, runner)
    assert so.new_requests == [] and so.cached_requests == [CachedRequestData("a", [2, 3], 8)]
    assert so.num_scheduled_tokens == {"a": 8} and res == {}

    so, res = step(sched, runner)
    assert so.cached_requests == [CachedRequestData("a", [4], 16)]
    assert so.num_scheduled_tokens == {"a": 4} and res == {"a": ref[:1]}

    so, res = step(sched, runner)  # decode of position 20 opens block 5
    assert so.cached_requests == [CachedRequestData("a", [5], 20)]
    assert so.num_scheduled_tokens == {"a": 1} and res == {"a": ref[1:2]}

    so, res = step(sched, runner)
    assert so.cached_requests == [CachedRequestData("a", [], 21)] and res == {"a": ref[2:]}
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == ref
    assert_idle(sched)
    so = sched.schedule()
    assert so.is_empty and so.finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


def test_requests_share_the_budget_in_order() -> None:
    sched, runner = make(budget=10)
    reqs = [req(r, prompt(10 * (i + 1), 6), max_tokens=2) for i, r in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)

    so, res = step(sched, runner)
    assert [n.req_id for n in so.new_requests] == ["a", "b"]
    assert [n.block_ids for n in so.new_requests] == [[0, 1], [2]]
    assert so.num_scheduled_tokens == {"a": 6, "b": 4} and sched.num_waiting == 1
    assert list(res) == ["a"]

    so, res = step(sched, runner)
    assert so.cached_requests == [CachedRequestData("a", [], 6), CachedRequestData("b", [3], 4)]
    assert so.new_requests == [
        NewRequestData("c", prompt(30, 6), 6, reqs[2].sampling_params, [4, 5], 0)
    ]
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 2), ("c", 6)]
    assert reqs[0].is_finished and sched.num_running == 2

    so, res = step(sched, runner)
    assert so.finished_req_ids == {"a"}
    assert so.cached_requests == [CachedRequestData("b", [], 6), CachedRequestData("c", [], 6)]
    assert so.num_scheduled_tokens == {"b": 1, "c": 1}
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 2)
    assert_idle(sched)


def test_no_chunked_prefill_waits_for_budget() -> None:
    sched, runner = make(budget=10, chunked=False)
    for i, r in enumerate("abc"):
        sched.add_request(req(r, prompt(10 * (i + 1), 6), max_tokens=3))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 6}  # b (6) does not fit the 4 left; c waits behind it
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 6}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}


def test_max_num_seqs() -> None:
    sched, runner = make(budget=100, max_num_seqs=2)
    sched.add_request(req("a", prompt(1, 4), max_tokens=1))
    sched.add_request(req("b", prompt(10, 4), max_tokens=3))
    sched.add_request(req("c", prompt(20, 4), max_tokens=1))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 4, "b": 4} and sched.num_waiting == 1
    so, _ = step(sched, runner)  # a finished: c takes its seat
    assert so.num_scheduled_tokens == {"b": 1, "c": 4}


def _two_requests_out_of_blocks(prefix: bool, policy: str = "fcfs"):  # noqa: ANN202
    """5 blocks of 4; two 8-token prompts fill 4; the first decode takes the 5th."""
    sched, runner = make(num_blocks=5, budget=32, prefix=prefix, policy=policy, max_model_len=20)
    a = req("a", prompt(1, 8), max_tokens=6, arrival=0.0)
    b = req("b", prompt(50, 8), max_tokens=6, arrival=1.0)
    return sched, runner, a, b


def test_preemption_recompute_and_resume() -> None:
    sched, runner, a, b = _two_requests_out_of_blocks(prefix=False)
    sched.add_request(a)
    sched.add_request(b)
    so, _ = step(sched, runner)
    assert [n.block_ids for n in so.new_requests] == [[0, 1], [2, 3]]

    so, res = step(sched, runner)  # a takes block 4; b (the newest) is preempted
    assert so.num_scheduled_tokens == {"a": 1} and so.cached_requests == [
        CachedRequestData("a", [4], 8)
    ]
    assert so.finished_req_ids == {"b"} and so.new_requests == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert sched.kv_cache_manager.pool.free_block_ids() == [3, 2]
    assert list(res) == ["a"]

    for _ in range(3):  # b needs 3 blocks for its 9 tokens; only 2 are free
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens == {"a": 1} and so.new_requests == []
    so, res = step(sched, runner)
    assert so.cached_requests == [CachedRequestData("a", [3], 12)] and a.is_finished

    so, res = step(sched, runner)  # b resumes with all its tokens, recomputed from 0
    assert so.finished_req_ids == {"a"}
    assert so.new_requests == [
        NewRequestData(
            "b", prompt(50, 8) + b.output_token_ids[:1], 8, b.sampling_params, [2, 3, 4], 0
        )
    ]
    assert so.num_scheduled_tokens == {"b": 9}
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 6)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 6)
    assert b.num_cached_tokens == 0 and b.status == RequestStatus.FINISHED_LENGTH
    assert_idle(sched)


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    sched, runner, a, b = _two_requests_out_of_blocks(prefix=True)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    step(sched, runner)  # b preempted; its blocks 2, 3 keep their hashes (freed tail first)
    assert b.status == RequestStatus.PREEMPTED
    while not a.is_finished:
        step(sched, runner)  # a's 4th block came from the front of the queue: block 3 (b's tail)
    so, _ = step(sched, runner)
    assert so.new_requests[0].req_id == "b"
    assert so.new_requests[0].block_ids == [2, 3, 4] and so.new_requests[0].num_computed_tokens == 4
    assert so.num_scheduled_tokens == {"b": 5}
    assert b.num_cached_tokens == 0  # set once, at first scheduling
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 6)
    kv = sched.kv_cache_manager
    assert kv.prefix_cache_hits >= 4
    assert_idle(sched)


def test_preempted_request_goes_back_to_the_front_of_the_waiting_queue() -> None:
    """fcfs: a preempted request resumes before requests that arrived after it (no starvation)."""
    sched, runner = make(num_blocks=5, budget=32, max_num_seqs=2, prefix=False, max_model_len=20)
    a = req("a", prompt(1, 8), max_tokens=6, arrival=0.0)
    b = req("b", prompt(50, 8), max_tokens=6, arrival=1.0)
    c = req("c", prompt(70, 3), max_tokens=2, arrival=2.0)
    d = req("d", prompt(80, 3), max_tokens=2, arrival=3.0)
    for r in (a, b, c, d):
        sched.add_request(r)
    so, _ = step(sched, runner)  # a, b fill 4 of 5 blocks; c, d wait for a seat (max_num_seqs)
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    step(sched, runner)  # a takes the last block; b (the newest running) is preempted
    assert b.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"]
    # The seat b left is not given to c: a step that preempts admits nobody, and b (9 tokens,
    # 3 blocks) waits at the head until a frees its blocks; c and d queue behind it.
    admitted = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        admitted += [n.req_id for n in so.new_requests]
    assert admitted == ["b", "c", "d"]
    for r in (a, b, c, d):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens)
    assert_idle(sched)


def test_prefix_hit_needs_the_whole_prefix_not_just_the_block() -> None:
    """A = [X, U], C = [Z, T], then B = [X, T]: B may reuse X (same prefix) but not T, whose
    KV was computed after Z. The fake runner's KV is the whole prefix, so reusing T is caught."""
    sched, runner = make(num_blocks=32, budget=32)
    x, u, z, t = prompt(1, BS), prompt(10, BS), prompt(20, BS), prompt(30, BS)
    reqs = {
        "A": req("A", x + u + [90], max_tokens=3),
        "C": req("C", z + t + [91], max_tokens=3),
        "B": req("B", x + t + [92], max_tokens=3),
    }
    hits = {}
    for rid, r in reqs.items():  # one after another: every block stays cached
        sched.add_request(r)
        so, _ = step(sched, runner)
        hits[rid] = so.new_requests[0].num_computed_tokens
        while sched.has_unfinished_requests():
            step(sched, runner)
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 3), rid
    assert hits == {"A": 0, "C": 0, "B": BS}  # only X hits for B
    assert reqs["B"].block_hashes[0] == reqs["A"].block_hashes[0]
    assert reqs["B"].block_hashes[1] != reqs["C"].block_hashes[1]
    assert_idle(sched)


def test_priority_policy_order_and_victim() -> None:
    sched, runner = make(budget=100, max_num_seqs=1, policy="priority")
    sched.add_request(
        Request("low", prompt(1, 4), SamplingParams(), 1, arrival_time=0.0, priority=2)
    )
    sched.add_request(
        Request("hi", prompt(9, 4), SamplingParams(), 1, arrival_time=1.0, priority=0)
    )
    sched.add_request(
        Request("mid", prompt(5, 4), SamplingParams(), 1, arrival_time=2.0, priority=1)
    )
    sched.add_request(
        Request("mid2", prompt(7, 4), SamplingParams(), 1, arrival_time=3.0, priority=1)
    )
    order = [next(iter(step(sched, runner)[0].num_scheduled_tokens)) for _ in range(4)]
    assert order == ["hi", "mid", "mid2", "low"]
    assert_idle(sched)

    # Out of blocks: the lowest priority running request is the victim, though it came first.
    sched, runner = make(num_blocks=5, budget=32, policy="priority", max_model_len=20)
    a = Request("a", prompt(1, 8), SamplingParams(), 6, arrival_time=0.0, priority=1)
    b = Request("b", prompt(50, 8), SamplingParams(), 6, arrival_time=1.0, priority=0)
    sched.add_request(a)
    sched.add_request(b)
    so, _ = step(sched, runner)
    assert [n.req_id for n in so.new_requests] == ["b", "a"] and sched.running == [b, a]
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"b": 1} and so.finished_req_ids == {"a"}
    assert a.status == RequestStatus.PREEMPTED and list(sched.waiting) == [a]
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 6)
    assert_idle(sched)


@pytest.mark.parametrize(
    ("script", "sp", "max_tokens", "output", "status", "stop_reason"),
    [
        ([1, 5, 2, 2], {"stop_token_ids": [5]}, 4, [1, 5], RequestStatus.FINISHED_STOPPED, 5),
        (
            [9, 9, 3],
            {"eos_token_ids": [9], "min_tokens": 2},
            3,
            [9, 9],
            RequestStatus.FINISHED_STOPPED,
            9,
        ),
        (
            [9, 9, 9],
            {"eos_token_ids": [9], "ignore_eos": True},
            3,
            [9, 9, 9],
            RequestStatus.FINISHED_LENGTH,
            None,
        ),
        ([1, 2, 3, 4], {}, 3, [1, 2, 3], RequestStatus.FINISHED_LENGTH, None),
        ([1, 5], {"stop_token_ids": [5]}, 2, [1, 5], RequestStatus.FINISHED_STOPPED, 5),
    ],
)
def test_stop_conditions(script, sp, max_tokens, output, status, stop_reason) -> None:  # noqa: ANN001
    sched, runner = make(token_fn=script_fn({"a": script}))
    a = Request("a", prompt(1, 5), SamplingParams(**sp), max_tokens)
    sched.add_request(a)
    got = []
    while sched.has_unfinished_requests():
        got += step(sched, runner)[1].get("a", [])
    assert got == output == a.output_token_ids
    assert a.status == status and a.stop_reason == stop_reason
    assert_idle(sched)


def test_max_model_len_caps_length() -> None:
    sched, runner = make(max_model_len=12)
    a = req("a", prompt(1, 8), max_tokens=100)
    sched.add_request(a)
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert a.num_tokens == 12 and a.status == RequestStatus.FINISHED_LENGTH


def test_spec_decode_rejection_accounting() -> None:
    sched, runner = make(budget=16)
    a = req("a", prompt(1, 6), max_tokens=10)
    sched.add_request(a)
    ref = reference_output(a.prompt_token_ids, 10)
    step(sched, runner)
    assert a.output_token_ids == ref[:1] and a.num_computed_tokens == 6

    a.spec_token_ids = [ref[1], ref[2], ref[3] % 97 + 1]  # third draft is wrong
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.spec_token_ids == {"a": a.spec_token_ids}
    res = {r.request_id: t for r, t in sched.update_from_output(so, runner.execute(so))}
    assert so.cached_requests == [CachedRequestData("a", [2], 6)]  # positions 6..9
    assert res == {"a": ref[1:4]}  # 2 accepted + the recovered target token
    assert a.num_computed_tokens == 9 == a.num_tokens - 1 and a.spec_token_ids == []

    so, res = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1} and so.spec_token_ids == {}
    assert so.cached_requests == [CachedRequestData("a", [], 9)]

    a.spec_token_ids = [ref[5], ref[6]]  # all accepted: 2 + bonus
    so, res = step(sched, runner)
    assert so.cached_requests == [CachedRequestData("a", [3], 10)]
    assert res == {"a": ref[5:8]} and a.num_computed_tokens == 13 == a.num_tokens - 1

    a.spec_token_ids = [ref[8], ref[9], 77, 77]  # max_tokens cuts the accepted run
    so, res = step(sched, runner)
    assert res == {"a": ref[8:10]} and a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == ref
    assert_idle(sched)


def test_spec_drafts_trimmed_to_budget_and_stop_inside_drafts() -> None:
    sched, runner = make(budget=3, token_fn=script_fn({"a": [1, 2, 5, 3, 4]}))
    a = Request("a", prompt(10, 3), SamplingParams(stop_token_ids=[5]), 5)
    sched.add_request(a)
    step(sched, runner)
    a.spec_token_ids = [2, 5, 3]
    so, res = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 3} and so.spec_token_ids == {"a": [2, 5]}
    # Runner samples [2, 5, 3] (both drafts accepted + bonus); the stop token ends it at 5.
    assert res == {"a": [2, 5]} and a.output_token_ids == [1, 2, 5]
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 5
    assert_idle(sched)


def test_abort_and_runner_error_free_blocks() -> None:
    sched, runner = make(budget=100, max_num_seqs=2)
    for r in "abc":
        sched.add_request(req(r, prompt(ord(r), 6), max_tokens=8))
    step(sched, runner)
    assert sched.num_running == 2 and sched.num_waiting == 1
    sched.finish_requests(["a", "c", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_block_ids("a") == [] and sched.num_waiting == 0
    runner.fail["b"] = "nan logits"
    so, res = step(sched, runner)
    assert so.finished_req_ids == {"a"}  # c never reached the runner
    assert res == {"b": []} and sched.requests == {}
    assert_idle(sched)

    # Aborted between schedule() and update_from_output(): the step's tokens are dropped.
    sched.add_request(d := req("d", prompt(1, 6)))
    so = sched.schedule()
    assert so.finished_req_ids == {"b"} and so.num_scheduled_tokens == {"d": 6}
    ro = runner.execute(so)
    sched.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(so, ro) == [] and d.output_token_ids == []
    assert d.status == RequestStatus.FINISHED_ABORTED
    assert sched.schedule().finished_req_ids == {"d"}
    assert_idle(sched)


def test_scheduler_refuses_a_cache_smaller_than_max_model_len() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        make(num_blocks=3, max_model_len=20)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_matches_reference(seed: int) -> None:
    """Shared prefixes, tight blocks, drafts, aborts, both policies: every surviving request
    produces exactly the unbatched reference output and all blocks come back."""
    rng = random.Random(seed)
    policy = "priority" if seed % 2 else "fcfs"
    max_model_len = 40
    sched, runner = make(
        num_blocks=14, budget=rng.choice([6, 16]), max_num_seqs=5, policy=policy,
        prefix=seed % 3 != 2, max_model_len=max_model_len,
    )  # fmt: skip
    bases = [[rng.randrange(1, 98) for _ in range(12)] for _ in range(3)]
    reqs, expected = [], {}
    for i in range(16):
        p = rng.choice(bases)[: rng.randint(1, 12)] + [
            rng.randrange(1, 98) for _ in range(rng.randint(0, 10))
        ]
        stop = {rng.randrange(1, 98)} if rng.random() < 0.3 else set()
        r = Request(f"r{i}", p, SamplingParams(stop_token_ids=list(stop)), rng.randint(1, max_model_len - len(p)),
                    arrival_time=float(i), priority=rng.randint(0, 2))  # fmt: skip
        reqs.append(r)
        expected[r.request_id] = reference_output(p, r.max_tokens, stop)
    pending, aborted, num_drafts = list(reqs), set(), 0
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        if sched.running and rng.random() < 0.03:
            victim = rng.choice(sched.running + list(sched.waiting)).request_id
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        so, _ = step(sched, runner)
        num_drafts += sum(map(len, so.spec_token_ids.values()))
        assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert sched.num_running <= 5
        for r in sched.running:  # scheduler and runner agree on every block table
            assert runner.state[r.request_id].block_ids == sched.kv_cache_manager.get_block_ids(
                r.request_id
            )
            if rng.random() < 0.5:  # propose drafts, some wrong
                cont = reference_output(r.all_token_ids, 3)
                r.spec_token_ids = [
                    t if rng.random() < 0.7 else 98 for t in cont[: rng.randint(1, 3)]
                ]
    assert not pending and not sched.has_unfinished_requests()
    for r in reqs:
        if r.request_id not in aborted:
            assert r.output_token_ids == expected[r.request_id], r.request_id
    # The workload really exercised preemption, drafts and (when on) prefix hits.
    assert sched.num_preemptions_total > 0 and num_drafts > 0
    assert sched.kv_cache_manager.prefix_cache_hits > 0 or seed % 3 == 2
    assert_idle(sched)
