"""Multi-LoRA in the scheduler (LoRAManager slots, adapter-keyed prefix cache), with exact
expectations per step, driven by a LoRA-aware fake runner that checks the runner contract:
slot writes come before the step that uses them, never over a slot a running request holds,
a request's slot keeps its adapter while it runs, and attended KV was computed with the same
adapter (a base block serving an adapter request, or the reverse, fails)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from core_fake_runner import FakeRunner  # noqa: E402

from xlaserve.config import CacheConfig, LoRAConfig, SchedulerConfig  # noqa: E402
from xlaserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from xlaserve.core.request import Request  # noqa: E402
from xlaserve.core.scheduler import Scheduler  # noqa: E402
from xlaserve.lora import LoRAAdapter, LoRARequest  # noqa: E402
from xlaserve.lora.manager import LoRAManager  # noqa: E402
from xlaserve.runner import RunnerOutput, SchedulerOutput  # noqa: E402
from xlaserve.sampling_params import SamplingParams  # noqa: E402

BS = 4


def fake_loader(req: LoRARequest, spec: object, max_rank: int) -> LoRAAdapter:
    """Scheduler tests need no weights: an adapter is its id (peft.py has its own tests)."""
    return LoRAAdapter(req.lora_name, req.lora_int_id, rank=1, scaling=1.0)


class LoRAFakeRunner(FakeRunner):
    """FakeRunner + a LoRA slot table; `expect[rid]` is the adapter id the request runs with."""

    def __init__(self, num_blocks: int, max_loras: int) -> None:
        super().__init__(num_blocks, BS)
        self.slots: list[int | None] = [None] * max_loras
        self.req_slot: dict[str, int] = {}
        self.expect: dict[str, int] = {}
        self.kv_lora: dict[tuple[int, int], int] = {}  # (block, offset) -> adapter id
        self.loads: list[list[tuple[int, int]]] = []  # per step: (slot, adapter id)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for rid in so.finished_req_ids:
            self.req_slot.pop(rid, None)
        for slot, ad in so.lora_loads:
            held = [r for r, s in self.req_slot.items() if s == slot]
            assert not held, f"slot {slot} overwritten while {held} use it"
            self.slots[slot] = ad.int_id
        self.loads.append([(s, a.int_id) for s, a in so.lora_loads])
        for nr in so.new_requests:
            self.req_slot[nr.req_id] = nr.lora_slot
        active = set()
        for rid, n in so.num_scheduled_tokens.items():
            slot = self.req_slot[rid]
            got = 0 if slot < 0 else self.slots[slot]
            assert got == self.expect[rid], f"{rid}: slot {slot} holds {got}"
            active.add(got)
            # The KV it attends to must have been computed with its adapter.
            if rid in self.state:
                st = self.state[rid]
                c, blocks = st.num_computed, st.block_ids
            else:
                nr = next(r for r in so.new_requests if r.req_id == rid)
                c, blocks = nr.num_computed_tokens, nr.block_ids
            blocks = blocks + next(
                (cr.new_block_ids for cr in so.cached_requests if cr.req_id == rid), []
            )
            for pos in range(c):
                key = (blocks[pos // BS], pos % BS)
                assert self.kv_lora[key] == got, (
                    f"{rid}: KV at {pos} from adapter {self.kv_lora[key]}"
                )
            for pos in range(c, c + n):
                self.kv_lora[(blocks[pos // BS], pos % BS)] = got
        assert len(active - {0}) <= len(self.slots)
        return super().execute(so)


def make(max_loras: int = 2, budget: int = 64, num_blocks: int = 64, max_len: int = 64):  # noqa: ANN201
    kv = KVCacheManager(num_blocks, BS, True)
    mgr = LoRAManager(LoRAConfig(enable_lora=True, max_loras=max_loras, max_cpu_loras=4),
                      spec=None, loader=fake_loader)  # fmt: skip
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget),
        CacheConfig(block_size=BS, num_kv_blocks=num_blocks),
        kv,
        max_len,
        lora_manager=mgr,
    )
    return sched, mgr, LoRAFakeRunner(num_blocks, max_loras)


def add(sched: Scheduler, mgr: LoRAManager, runner: LoRAFakeRunner, rid: str, prompt: list[int],
        lora: int = 0, max_tokens: int = 3) -> Request:  # fmt: skip
    lr = LoRARequest(f"ad{lora}", lora, f"/ad{lora}") if lora else None
    r = Request(rid, prompt, SamplingParams(), max_tokens=max_tokens, lora_request=lr,
                lora_adapter=mgr.load(lr) if lr else None)  # fmt: skip
    runner.expect[rid] = lora
    sched.add_request(r)
    return r


def step(sched: Scheduler, runner: LoRAFakeRunner) -> SchedulerOutput:
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    return so


def run_all(sched: Scheduler, runner: LoRAFakeRunner, limit: int = 100) -> None:
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("requests did not finish")


def test_slots_capped_and_others_go_by() -> None:
    """max_loras=2: adapters 1 and 2 take the slots; a request of adapter 3 waits while both are
    pinned, the base request and the adapter-1 request queued behind it still start; once
    adapter 1's requests finish, adapter 3 takes its (least recently used, idle) slot."""
    sched, mgr, runner = make(max_loras=2)
    add(sched, mgr, runner, "a1", list(range(1, 6)), lora=1, max_tokens=2)
    add(sched, mgr, runner, "a2", list(range(10, 15)), lora=2, max_tokens=6)
    add(sched, mgr, runner, "a3", list(range(20, 25)), lora=3, max_tokens=2)
    add(sched, mgr, runner, "base", list(range(30, 35)), max_tokens=2)
    add(sched, mgr, runner, "a1b", list(range(40, 45)), lora=1, max_tokens=1)
    so = step(sched, runner)
    assert [nr.req_id for nr in so.new_requests] == ["a1", "a2", "base", "a1b"]
    assert [nr.lora_slot for nr in so.new_requests] == [0, 1, -1, 0]
    assert runner.loads[-1] == [(0, 1), (1, 2)]
    assert [r.request_id for r in sched.waiting] == ["a3"]  # kept at the head
    assert mgr.refs == {1: 1, 2: 1}  # a1b finished in step 1 (1 token); a1 runs on
    so = step(sched, runner)  # both slots still pinned while scheduling: a3 waits
    assert so.new_requests == [] and mgr.refs == {1: 0, 2: 1}
    so = step(sched, runner)  # a1 finished in step 2: slot 0 idle -> adapter 3
    assert [(nr.req_id, nr.lora_slot) for nr in so.new_requests] == [("a3", 0)]
    assert runner.loads[-1] == [(0, 3)]
    assert mgr.slots == [3, 2] and mgr.slot_of == {3: 0, 2: 1}
    run_all(sched, runner)
    assert mgr.num_active == 0 and all(n == 0 for n in mgr.refs.values())


def test_resident_adapter_reused_without_load() -> None:
    """An adapter already in a slot is not written again; LRU picks the idle slot used least
    recently."""
    sched, mgr, runner = make(max_loras=2)
    add(sched, mgr, runner, "x", [1, 2, 3], lora=1, max_tokens=1)
    add(sched, mgr, runner, "y", [4, 5, 6], lora=2, max_tokens=1)
    run_all(sched, runner)
    add(sched, mgr, runner, "z", [7, 8, 9], lora=1, max_tokens=1)
    so = step(sched, runner)
    assert so.lora_loads == [] and so.new_requests[0].lora_slot == 0
    add(sched, mgr, runner, "w", [7, 8, 9], lora=3, max_tokens=1)
    so = step(sched, runner)  # slot 1 (adapter 2) is the LRU idle one: adapter 1 was used later
    assert [(s, a.int_id) for s, a in so.lora_loads] == [(1, 3)]


def test_prefix_cache_keyed_by_adapter() -> None:
    """Same prompt: base, adapter 1, adapter 2, then each again. Only a request with the same
    adapter hits; the fake runner checks every attended position's adapter."""
    sched, mgr, runner = make(max_loras=2)
    p = list(range(1, 14))  # 3 full blocks of 4
    hits = {}
    for rid, lora in [("b0", 0), ("l1", 1), ("l2", 2), ("b1", 0), ("l1b", 1), ("l2b", 2)]:
        r = add(sched, mgr, runner, rid, p, lora=lora, max_tokens=1)
        run_all(sched, runner)
        hits[rid] = r.num_cached_tokens
    assert hits == {"b0": 0, "l1": 0, "l2": 0, "b1": 12, "l1b": 12, "l2b": 12}


def test_block_hash_includes_adapter_id() -> None:
    kv = KVCacheManager(16, BS, True)
    base = Request("b", [1, 2, 3, 4, 5], SamplingParams(), max_tokens=1)
    lr = LoRARequest("a", 7, "/a")
    ad = Request("a", [1, 2, 3, 4, 5], SamplingParams(), max_tokens=1, lora_request=lr)
    kv._update_block_hashes(base)
    kv._update_block_hashes(ad)
    assert base.block_hashes[0] != ad.block_hashes[0]
    from xlaserve.core.kv_cache_manager import hash_block

    assert base.block_hashes == [hash_block(None, [1, 2, 3, 4])]  # base hashes unchanged
    assert ad.block_hashes == [hash_block(None, [1, 2, 3, 4], (("lora", 7),))]


def test_preemption_releases_and_resumes_slot() -> None:
    """Blocks run out: the newest running request (an adapter request) is preempted, its slot
    released (refs drop) and taken again on resume; outputs are complete."""
    sched, mgr, runner = make(max_loras=2, budget=64, num_blocks=6, max_len=24)
    a = add(sched, mgr, runner, "a", list(range(1, 9)), lora=1, max_tokens=8)
    b = add(sched, mgr, runner, "b", list(range(20, 28)), lora=2, max_tokens=8)
    seen_refs = []
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
        seen_refs.append(dict(mgr.refs))
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert {1: 1, 2: 0} in seen_refs  # b preempted: its slot unpinned while it waits
    assert len(a.output_token_ids) == 8 and len(b.output_token_ids) == 8
    assert mgr.refs == {1: 0, 2: 0}


def test_adapter_request_waits_for_slot_under_preemption_pressure() -> None:
    """Many adapters through one slot: each runs only when the slot is idle; all finish."""
    sched, mgr, runner = make(max_loras=1)
    for i in range(6):
        add(sched, mgr, runner, f"r{i}", [i + 1, i + 2, i + 3], lora=1 + i % 3, max_tokens=2)
    add(sched, mgr, runner, "base", [50, 51], max_tokens=2)
    run_all(sched, runner)
    assert len(runner.loads) > 1 and all(len(x) <= 1 for x in runner.loads)


def test_manager_host_cache_lru_and_conflicts() -> None:
    mgr = LoRAManager(LoRAConfig(enable_lora=True, max_loras=1, max_cpu_loras=2), None,
                      loader=fake_loader)  # fmt: skip
    for i in (1, 2, 1, 3):
        mgr.load(LoRARequest(f"ad{i}", i, f"/ad{i}"))
    assert mgr.cached_ids == [1, 3]  # 2 was least recently used
    with pytest.raises(ValueError, match="lora_int_id 1 is already used"):
        mgr.load(LoRARequest("other", 1, "/other"))
    mgr.load(LoRARequest("ad3", 9, "/elsewhere"))  # a name reloaded under a new id is fine
    assert mgr.cached_ids == [3, 9]
    with pytest.raises(RuntimeError, match="released more often"):
        mgr.release(1)


def test_lora_request_without_manager_refused() -> None:
    kv = KVCacheManager(16, BS, True)
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=BS, num_kv_blocks=16), kv, 64)
    r = Request("x", [1, 2], SamplingParams(), max_tokens=1,
                lora_request=LoRARequest("a", 1, "/a"))  # fmt: skip
    with pytest.raises(ValueError, match="enable_lora"):
        sched.add_request(r)
