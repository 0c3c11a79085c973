"""Exact bookkeeping of the host/disk offload tiers and of the KV cache manager on top of them:
slot ids, LRU order, tier moves, pins and the per-step op lists."""

from __future__ import annotations

import pytest

from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.offload import DISK, HOST, OffloadManager, OffloadOps
from xlaserve.core.request import Request
from xlaserve.sampling_params import SamplingParams


def test_copy_out_fills_free_slots_then_lru_drops_without_disk() -> None:
    m = OffloadManager(num_slots=2, block_bytes=100)
    assert m.offload_block(block_id=7, block_hash=70)
    assert m.offload_block(block_id=8, block_hash=80)
    assert m.end_step() == OffloadOps(copy_out=[(7, 0), (8, 1)])
    assert list(m.host.items()) == [(70, 0), (80, 1)] and m.free_slots == []
    # Re-offloading a hash already on the host copies nothing and refreshes its LRU position.
    assert m.offload_block(block_id=3, block_hash=70)
    assert list(m.host) == [80, 70]
    # A third block evicts the LRU entry (80, slot 1); no disk tier: it is dropped.
    assert m.offload_block(block_id=9, block_hash=90)
    assert m.end_step() == OffloadOps(copy_out=[(9, 1)])
    assert list(m.host.items()) == [(70, 0), (90, 1)]
    assert m.tier_of(80) is None and m.tier_of(90) == HOST
    assert (m.bytes_out, m.bytes_in) == (300, 0)


def test_spill_to_disk_and_load_back() -> None:
    m = OffloadManager(num_slots=2, block_bytes=10, use_disk=True)
    m.offload_block(0, 100)
    m.offload_block(1, 101)
    m.end_step()
    m.offload_block(2, 102)  # evicts 100 (slot 0): spilled first, then slot 0 reused
    assert m.end_step() == OffloadOps(disk_out=[(0, 100)], copy_out=[(2, 0)])
    assert m.tier_of(100) == DISK and list(m.disk) == [100]
    assert list(m.host.items()) == [(101, 1), (102, 0)]
    # Loading 100 back evicts LRU 101 (slot 1) to disk; 100's file stays (inclusive tiers).
    assert m.num_servable([100]) == 1
    slot = m.prepare_load(100)
    m.copy_in(slot, 5)
    assert slot == 1
    assert m.end_step() == OffloadOps(disk_out=[(1, 101)], disk_in=[(100, 1)], copy_in=[(1, 5)])
    assert list(m.host.items()) == [(102, 0), (100, 1)]
    assert list(m.disk) == [101, 100]
    # Evicting 102 spills it; evicting 100 later needs no second write (already on disk).
    m.offload_block(3, 103)
    assert m.end_step() == OffloadOps(disk_out=[(0, 102)], copy_out=[(3, 0)])
    m.offload_block(4, 104)
    assert m.end_step() == OffloadOps(copy_out=[(4, 1)])
    assert list(m.disk) == [101, 102, 100] and list(m.host) == [103, 104]
    assert (m.disk_bytes_out, m.disk_bytes_in, m.bytes_in) == (30, 10, 10)


def test_pinned_slots_are_not_reused_within_a_step() -> None:
    m = OffloadManager(num_slots=2, block_bytes=1, use_disk=True)
    m.offload_block(0, 10)
    m.offload_block(1, 11)
    # Both slots were written this step: a third block cannot take one (dropped, not spilled).
    assert not m.offload_block(2, 12)
    assert m.num_dropped == 1 and m.tier_of(12) is None
    m.end_step()
    # A slot read as a copy-in source is pinned too.
    slot = m.prepare_load(10)
    m.copy_in(slot, 4)
    assert m.offload_block(5, 15)  # takes slot 1 (11 spilled), never slot 0
    ops = m.end_step()
    assert ops == OffloadOps(disk_out=[(1, 11)], copy_out=[(5, 1)], copy_in=[(0, 4)])


def test_num_servable_counts_slots_for_disk_loads() -> None:
    m = OffloadManager(num_slots=2, block_bytes=1, use_disk=True)
    for b, h in enumerate([1, 2, 3, 4]):
        m.offload_block(b, h)
        m.end_step()
    assert list(m.host) == [3, 4] and list(m.disk) == [1, 2]
    # Host hits 3, 4 pin both slots: no slot is left to load 1 from disk.
    assert m.num_servable([3, 4, 1]) == 2
    # Each disk hit and each unpinned host hit takes one of the 2 slots.
    assert m.num_servable([1, 2]) == 2
    assert m.num_servable([1, 2, 3]) == 2
    assert m.num_servable([1, 3, 4]) == 2
    assert m.num_servable([9, 1]) == 0
    # prepare_loads pins host hits before loading: 1 then evicts 4 (unpinned), never 3.
    assert m.prepare_loads([1, 3]) == [1, 0]
    assert m.end_step() == OffloadOps(disk_out=[(1, 4)], disk_in=[(1, 1)])
    assert list(m.host.items()) == [(1, 1), (3, 0)] and list(m.disk) == [2, 4, 1]
    m.reset()
    assert m.tier_of(3) is None and m.free_slots == [0, 1] and not m.disk


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        OffloadManager(0, 1)
    m = OffloadManager(1, 1)
    with pytest.raises(KeyError):
        m.prepare_load(5)


# ----- KVCacheManager with a host tier --------------------------------------------------------


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(), max_tokens=4)


def _run(m: KVCacheManager, r: Request) -> list[int]:
    """Schedule the whole prompt of r as the scheduler does; returns its block ids."""
    blocks, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, blocks, n) is not None
    r.num_computed_tokens = r.num_tokens
    return m.get_block_ids(r.request_id)


def test_evicted_blocks_copy_out_and_prefix_hits_copy_in() -> None:
    off = OffloadManager(num_slots=8, block_bytes=64)
    m = KVCacheManager(num_blocks=4, block_size=2, offload=off)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 token
    assert _run(m, a) == [0, 1, 2, 3]
    m.free(a)  # free queue: tail first -> [3, 2, 1, 0]
    assert m.pool.free_block_ids() == [3, 2, 1, 0]
    assert m.take_offload_ops() == OffloadOps()
    # b (different tokens) takes all 4 blocks: the 3 hashed ones are copied out, in eviction order.
    b = _req("b", [9, 9, 9, 9, 9, 9, 9])
    assert _run(m, b) == [3, 2, 1, 0]
    h = a.block_hashes
    assert m.take_offload_ops() == OffloadOps(copy_out=[(2, 0), (1, 1), (0, 2)])
    assert list(off.host.items()) == [(h[2], 0), (h[1], 1), (h[0], 2)]
    m.free(b)  # free queue [0, 1, 2, 3]; b's blocks 3, 2, 1 are hashed
    # c shares a's first 3 blocks: all three come from the host tier (no device hit).
    c = _req("c", [1, 2, 3, 4, 5, 6, 8])
    blocks, n = m.get_computed_blocks(c)
    assert blocks == [] and n == 6
    assert m.allocate_slots(c, 1, blocks, n) == [0, 1, 2, 3]
    ops = m.take_offload_ops()
    # Evicting b's hashed blocks 1, 2, 3 (block 0 holds b's partial tail, unhashed) copies them
    # out first; slots 2, 1, 0 are pinned as copy-in sources, so they go to slots 3, 4, 5.
    assert ops.copy_out == [(1, 3), (2, 4), (3, 5)]
    assert ops.copy_in == [(2, 0), (1, 1), (0, 2)]
    assert m.offload_host_hits == 6 and m.offload_disk_hits == 0
    assert m.prefix_cache_hits == 6
    # The reloaded blocks are registered on the device again: d hits them there.
    m.free(c)
    d = _req("d", [1, 2, 3, 4, 5])
    blocks, n = m.get_computed_blocks(d)
    assert [x.block_id for x in blocks] == [0, 1] and n == 4
    assert off.bytes_out == 6 * 64 and off.bytes_in == 3 * 64


def test_swap_free_copies_out_full_blocks_only() -> None:
    off = OffloadManager(num_slots=8, block_bytes=1)
    m = KVCacheManager(num_blocks=8, block_size=2, offload=off)
    r = _req("r", [1, 2, 3, 4, 5])
    _run(m, r)
    assert m.get_block_ids("r") == [0, 1, 2]
    m.free(r, swap=True)
    # Blocks 0, 1 are full and registered; block 2 (token 5) is recomputed on resume.
    assert m.take_offload_ops() == OffloadOps(copy_out=[(0, 0), (1, 1)])
    # Still on the device too: resuming hits there first (no copy-in needed).
    blocks, n = m.get_computed_blocks(r)
    assert [b.block_id for b in blocks] == [0, 1] and n == 4
    # Plain free does not copy.
    r2 = _req("r2", [7, 8, 9])
    _run(m, r2)
    m.free(r2)
    assert m.take_offload_ops() == OffloadOps()
