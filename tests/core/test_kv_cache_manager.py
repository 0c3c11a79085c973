"""Exact block ids, ref counts, free-queue order and hit counts of the KV cache manager."""

from __future__ import annotations

import os
import random
import subprocess
import sys

from xlaserve.core.kv_cache_manager import KVCacheManager, hash_block
from xlaserve.core.request import Request
from xlaserve.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), max_tokens=16, cache_salt=salt)


def refs(m: KVCacheManager, ids: list[int]) -> list[int]:
    return [m.pool.blocks[i].ref_cnt for i in ids]


def test_hash_block_chained_and_deterministic() -> None:
    h0 = hash_block(None, (1, 2, 3, 4))
    assert h0 == hash_block(None, [1, 2, 3, 4])
    assert h0 != hash_block(None, (1, 2, 3, 5))
    assert h0 != hash_block(None, (1, 2, 3, 4), ("salt",))
    h1 = hash_block(h0, (5, 6, 7, 8))
    assert h1 != hash_block(None, (5, 6, 7, 8))
    assert h1 != hash_block(h0 + 1, (5, 6, 7, 8))
    assert isinstance(h0, int) and h0 >= 0


# (parent, tokens, extra keys) cases for the cross-process check: ints, a salt string, a chain.
_HASH_CASES = "[(None, (1, 2, 3, 4), ()), (None, (7,), ('tenant',)), (12345, (9, 9), ())]"


def test_hash_block_is_stable_across_processes() -> None:
    """The host/disk offload tier keys on block hashes, so they must not depend on the process:
    two interpreters with different hash seeds (PYTHONHASHSEED salts str/bytes `hash()`) and
    this one agree on every value."""
    code = (
        "from xlaserve.core.kv_cache_manager import hash_block\n"
        f"print([hash_block(p, t, e) for p, t, e in {_HASH_CASES}])"
    )
    here = [hash_block(p, t, e) for p, t, e in eval(_HASH_CASES)]  # noqa: S307 - a literal
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert eval(out.stdout) == here, f"PYTHONHASHSEED={seed}"  # noqa: S307


def test_hash_block_is_wide_and_collision_free() -> None:
    """A collision serves another prompt's KV silently, so the hash must be wide (sha256, not a
    32/64-bit `hash()`): values use more than 64 bits, and 50k near-identical blocks (one token
    changed, chained on near-identical parents) never collide."""
    rng = random.Random(0)
    base = [rng.randrange(32000) for _ in range(16)]
    seen: dict[int, tuple] = {}
    parents = [None, hash_block(None, base)]
    for i in range(50_000):
        tokens = list(base)
        tokens[i % 16] = i // 16
        key = (parents[i % 2], tuple(tokens))
        h = hash_block(*key)
        assert seen.setdefault(h, key) == key, f"collision: {key} and {seen[h]}"
    assert max(h.bit_length() for h in seen) > 64
    assert len({h >> 192 for h in seen}) > 1000  # the top bits vary too (not a zero-padded int)


def test_fresh_pool_is_in_id_order() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4)
    assert m.pool.free_block_ids() == [0, 1, 2, 3, 4, 5]
    assert m.num_free_blocks == 6 and m.num_blocks == 6 and m.usage == 0.0


def test_prefill_share_free_and_revive() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    r0 = make_req("r0", list(range(10)))
    assert m.get_computed_blocks(r0) == ([], 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10, 0)
    assert m.allocate_slots(r0, 10) == [0, 1, 2]
    r0.num_computed_tokens = 10
    assert refs(m, [0, 1, 2]) == [1, 1, 1]
    assert m.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]
    # Only the two full blocks are registered; block 2 (tokens 8, 9) is partial.
    assert len(r0.block_hashes) == 2
    assert m.pool.cached == {
        r0.block_hashes[0]: m.pool.blocks[0],
        r0.block_hashes[1]: m.pool.blocks[1],
    }
    assert m.pool.blocks[2].block_hash is None
    assert m.usage == 0.3

    # Same first 8 tokens: both full blocks hit and are shared.
    r1 = make_req("r1", list(range(8)) + [20, 21, 22])
    blocks, n = m.get_computed_blocks(r1)
    assert [b.block_id for b in blocks] == [0, 1] and n == 8
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (21, 8)
    assert m.allocate_slots(r1, 3, blocks, n) == [3]
    assert m.get_block_ids("r1") == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert r1.block_hashes == r0.block_hashes

    # Free r0 tail first: only block 2 reaches 0; then r1's blocks in reverse.
    m.free(r0)
    assert refs(m, [0, 1, 2]) == [1, 1, 0]
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    m.free(r1)
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert m.usage == 0.0 and m.get_block_ids("r1") == []

    # A prefix hit on free cached blocks pulls them out of the free queue.
    r2 = make_req("r2", list(range(8)) + [30])
    blocks, n = m.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [0, 1] and n == 8
    assert m.allocate_slots(r2, 1, blocks, n) == [4]
    assert m.get_block_ids("r2") == [0, 1, 4]
    assert refs(m, [0, 1, 4]) == [1, 1, 1]
    assert m.pool.free_block_ids() == [5, 6, 7, 8, 9, 2, 3]
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (30, 16)


def test_lru_eviction_drops_tail_blocks_first() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    r0 = make_req("r0", list(range(9)))
    assert m.allocate_slots(r0, 9) == [0, 1, 2]
    h0, h1 = r0.block_hashes
    m.free(r0)
    assert m.pool.free_block_ids() == [3, 2, 1, 0]
    # Another prompt takes 3 blocks from the front: 3, 2 (unhashed), then 1 (evicts h1).
    r1 = make_req("r1", [100 + i for i in range(12)])
    assert m.get_computed_blocks(r1) == ([], 0)
    assert m.allocate_slots(r1, 12) == [3, 2, 1]
    assert h1 not in m.pool.cached and m.pool.cached[h0] is m.pool.blocks[0]
    assert m.pool.blocks[1].block_hash == r1.block_hashes[2]
    assert m.pool.free_block_ids() == [0]
    # r0's prompt again: block 0 survived, block 1's content is gone.
    r2 = make_req("r2", list(range(9)))
    blocks, n = m.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [0] and n == 4


def test_never_hits_the_whole_prompt() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    r0 = make_req("r0", list(range(8)))
    m.allocate_slots(r0, 8)
    assert len(m.pool.cached) == 2
    r1 = make_req("r1", list(range(8)))
    blocks, n = m.get_computed_blocks(r1)
    assert [b.block_id for b in blocks] == [0] and n == 4  # 1 token must stay to compute
    assert m.allocate_slots(r1, 4, blocks, n) == [2]
    # Block 2 holds the same tokens as block 1: block 1 stays canonical, block 2 plain.
    assert m.pool.cached[r0.block_hashes[1]] is m.pool.blocks[1]
    assert m.pool.blocks[2].block_hash is None


def test_allocate_failure_changes_nothing() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    r0 = make_req("r0", list(range(9)))
    assert m.allocate_slots(r0, 9) == [0, 1, 2]
    r1 = make_req("r1", [50] * 5)
    assert m.allocate_slots(r1, 5) is None
    assert m.get_block_ids("r1") == [] and m.pool.free_block_ids() == [3]
    m.free(r0)
    # Hitting 2 free cached blocks removes them from the free queue: 4 - 2 < 3 new needed.
    r2 = make_req("r2", list(range(8)) + [7] * 12)
    blocks, n = m.get_computed_blocks(r2)
    assert n == 8
    assert m.allocate_slots(r2, 12, blocks, n) is None
    assert m.pool.free_block_ids() == [3, 2, 1, 0] and refs(m, [0, 1]) == [0, 0]
    assert m.allocate_slots(r2, 8, blocks, n) == [3, 2]  # 16 tokens fit in 4 blocks
    assert m.get_block_ids("r2") == [0, 1, 3, 2] and m.num_free_blocks == 0


def test_decode_registers_blocks_when_full_and_skips_drafts() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    r = make_req("r", [1, 2, 3])
    assert m.allocate_slots(r, 3) == [0]
    r.num_computed_tokens = 3
    r.append_output_token_ids([4])
    assert m.pool.blocks[0].block_hash is None
    # Position 3 is computed by this step: block 0 becomes full and is registered now.
    assert m.allocate_slots(r, 1) == []
    assert m.pool.blocks[0].block_hash == r.block_hashes[0]
    r.num_computed_tokens = 4
    r.append_output_token_ids([5, 6])  # 6 tokens, 4 computed; 2 drafts on top
    assert m.allocate_slots(r, 2 + 2) == [1]
    # Positions 6, 7 are drafts (not in all_token_ids): block 1 must not be registered.
    assert m.pool.blocks[1].block_hash is None
    assert len(m.pool.cached) == 1
    # Lookahead slots allocate blocks but never make them "full".
    r2 = make_req("r2", [9] * 6)
    assert m.allocate_slots(r2, 6, num_lookahead_tokens=3) == [2, 3, 4]
    assert m.pool.blocks[2].block_hash is not None and m.pool.blocks[3].block_hash is None


def test_cache_salt_isolates() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    a = make_req("a", tokens, salt="tenant-a")
    m.allocate_slots(a, 9)
    b = make_req("b", tokens, salt="tenant-b")
    assert m.get_computed_blocks(b) == ([], 0)
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes, strict=True))  # chained
    assert m.get_computed_blocks(make_req("n", tokens)) == ([], 0)
    blocks, n = m.get_computed_blocks(make_req("a2", tokens, salt="tenant-a"))
    assert [blk.block_id for blk in blocks] == [0, 1] and n == 8


def test_prefix_caching_off() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    r0 = make_req("r0", list(range(9)))
    assert m.get_computed_blocks(r0) == ([], 0)
    assert m.allocate_slots(r0, 9) == [0, 1, 2]
    assert r0.block_hashes == [] and m.pool.cached == {}
    m.free(r0)
    assert m.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    r1 = make_req("r1", list(range(9)))
    assert m.get_computed_blocks(r1) == ([], 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (0, 0)
    assert m.allocate_slots(r1, 9) == [3, 4, 5]


def test_reset_prefix_cache() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4)
    r0 = make_req("r0", list(range(9)))
    m.allocate_slots(r0, 9)
    assert not m.reset_prefix_cache()
    assert len(m.pool.cached) == 2
    m.free(r0)
    assert m.reset_prefix_cache()
    assert m.pool.cached == {} and all(b.block_hash is None for b in m.pool.blocks)
    assert m.get_computed_blocks(make_req("r1", list(range(9)))) == ([], 0)
    assert m.usage == 0.0
