"""Paged KV cache bookkeeping with automatic prefix caching (no torch/jax: ids and counters only).

A request's KV lives in fixed-size blocks of `block_size` (S) token slots; block j of a request
holds token positions [j * S, (j + 1) * S). The pool has N blocks with ids 0..N-1.

Prefix caching: every *full* block of a request's tokens gets a chained hash
(parent block's hash, the block's S token ids, extra keys such as the cache salt and the LoRA
adapter id). A block whose
hash is registered can be shared by any later request with the same prefix. Blocks nobody
references sit in an LRU free queue; a free block still carrying a hash keeps its KV until it is
handed out again (then its hash is evicted), so a later request can revive it.

Offload (core/offload.py): with a host tier, a hashed block whose hash is evicted is copied out
to a host slot first (the copy precedes the forward of the step that reuses the block), and a
prefix lookup that misses on the device continues in the host tier, then on disk: those hits get
fresh device blocks filled by a copy-in before the forward, and count as computed tokens.

Recurrent state (core/cache_spec.py): with `num_state_slots` > 0 the model also has recurrent
layers, and every request holds one state slot beside its blocks. `allocate_slots` takes the
request's slot with its first blocks (or nothing: None when either is short, so the scheduler
preempts for both alike), `free` returns both. Prefix caching is off for such models.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from xlaserve.core.offload import OffloadManager, OffloadOps
from xlaserve.core.request import Request

logger = logging.getLogger(__name__)


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Chained hash of one full block: sha256 over the repr of (parent, tokens, extra keys).

    sha256 (not Python's `hash`) so that values are stable across processes and Python runs
    (a host/disk offload tier can key on them) and collisions, which would serve wrong KV
    silently, are out of reach. The repr of ints, strs, None and tuples is deterministic.
    """
    payload = repr((parent_hash, tuple(token_ids), tuple(extra_keys))).encode()
    return int.from_bytes(hashlib.sha256(payload).digest(), "little")


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    # Requests holding this block; 0 means it sits in the free queue.
    ref_cnt: int = 0
    # Chained hash while the block is registered in the prefix cache, else None.
    block_hash: int | None = None


class BlockPool:
    """N blocks, an O(1) LRU free queue (OrderedDict: front = evicted first) and the hash map."""

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        offload: OffloadManager | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order.
        self.free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        # block hash -> the one block registered under it (free or in use).
        self.cached: dict[int, KVCacheBlock] = {}
        # Host/disk tier: evicted hashed blocks are copied out there.
        self.offload = offload

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def free_block_ids(self) -> list[int]:
        """Free queue, first-evicted first (for tests and debugging)."""
        return list(self.free)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the front of the free queue (evicting their hashes); ref_cnt = 1."""
        if n > len(self.free):
            raise ValueError(f"asked for {n} blocks, only {len(self.free)} free")
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            if block.block_hash is not None:
                if self.offload is not None:
                    self.offload.offload_block(block.block_id, block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Register a full block. If another block already holds this content (two requests
        computed the same prefix concurrently) the first stays canonical; this one stays plain."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (possibly free) cached blocks: a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue's tail in this order."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if len(self.free) != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.offload is not None:
            self.offload.reset()
        return True


class KVCacheManager:
    """Per-request block tables on top of a BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        offload: OffloadManager | None = None,
        num_state_slots: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {num_state_slots}")
        if num_state_slots and enable_prefix_caching:
            # A slot holds the state after all of a request's tokens: it cannot be shared at a
            # block boundary without state snapshots, which are not implemented.
            logger.info("prefix caching is disabled: the model has recurrent-state layers")
            enable_prefix_caching = False
        self.block_size = block_size
        # Recurrent state slots (0 = attention-only model): free ids, lowest first.
        self.num_state_slots = num_state_slots
        self.free_state_slots: list[int] = list(range(num_state_slots - 1, -1, -1))
        # request_id -> its state slot.
        self.req_to_state_slot: dict[str, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, enable_prefix_caching, self.offload)
        # request_id -> its blocks in position order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many leading blocks of it are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache stats in tokens: asked for / found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # request_id -> hashes of the blocks after its device hits that the host/disk tier
        # serves (from get_computed_blocks, consumed by allocate_slots).
        self._tier_hits: dict[str, list[int]] = {}
        # Tokens brought back from the host tier / from disk (included in prefix_cache_hits).
        self.offload_host_hits = 0
        self.offload_disk_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free); with
        state slots, the larger of that and the fraction of slots in use."""
        blocks = (self.pool.num_blocks - self.pool.num_free_blocks) / self.pool.num_blocks
        if not self.num_state_slots:
            return blocks
        return max(blocks, len(self.req_to_state_slot) / self.num_state_slots)

    def get_state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot (-1: none, or an attention-only model)."""
        return self.req_to_state_slot.get(request_id, -1)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of request.all_token_ids."""
        hashes, size = request.block_hashes, self.block_size
        num_full = request.num_tokens // size
        if len(hashes) >= num_full:
            return
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            # The salt (and the LoRA adapter id) enter the first block only; chaining carries
            # them into every later hash, so an adapter's blocks never serve the base or
            # another adapter.
            extra: tuple = ()
            if i == 0:
                if request.cache_salt is not None:
                    extra = (request.cache_salt,)
                if request.lora_int_id:
                    extra = (*extra, ("lora", request.lora_int_id))
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks: (blocks, num_tokens they hold).

        At least one token is always left to compute (the model must produce logits), so at
        most (num_tokens - 1) // S blocks can hit. Does not take references (allocate_slots does).
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        if request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 0:
            # Prompt logprobs need every prompt position computed (its blocks still get cached).
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tier = 0
        if self.offload is not None:
            rest = request.block_hashes[len(blocks) : max_blocks]
            num_tier = self.offload.num_servable(rest)
            self._tier_hits[request.request_id] = rest[:num_tier]
        num_hit = (len(blocks) + num_tier) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit
        return blocks, num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        (+ lookahead) tokens. Returns the ids of the blocks newly taken from the free queue
        (prefix-hit blocks are not in it), or None, changing nothing, when too few are free.

        num_new_computed_tokens beyond the device hits (new_computed_blocks) are host/disk tier
        hits found by get_computed_blocks: they get new blocks and copy-ins this step."""
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is not None and not new_computed_blocks and not num_new_computed_tokens:
            # The steady decode step: a running request whose new tokens fit its blocks and
            # complete no block (15 of 16 steps at 16-token pages) changes nothing. What the
            # general path below would do in that case, minus its work (~256 calls a step).
            total = request.num_computed_tokens + num_new_tokens
            if (
                total + num_lookahead_tokens <= len(req_blocks) * self.block_size
                and (self.num_state_slots == 0 or rid in self.req_to_state_slot)
                and (
                    not self.enable_prefix_caching
                    or min(total, request.num_tokens) // self.block_size
                    <= self.num_cached_blocks.get(rid, 0)
                )
            ):
                return []
        computed_blocks = new_computed_blocks or []
        if req_blocks is None:
            req_blocks = []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens + num_lookahead_tokens
        num_needed = -(-total // self.block_size) - len(req_blocks) - len(computed_blocks)
        # Reviving a free cached block takes it out of the free queue too.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) > self.pool.num_free_blocks - num_revived:
            return None
        # Its state slot is admitted with its blocks (both or neither).
        needs_slot = self.num_state_slots > 0 and request.request_id not in self.req_to_state_slot
        if needs_slot and not self.free_state_slots:
            return None
        if needs_slot:
            self.req_to_state_slot[request.request_id] = self.free_state_slots.pop()

        self.pool.touch(computed_blocks)
        # Host/disk hits: pin their slots (loading from disk) before evictions could take them.
        num_tier = num_new_computed_tokens // self.block_size - len(computed_blocks)
        tier_slots = []
        if num_tier > 0:
            tier_hashes = self._tier_hits.pop(request.request_id)[:num_tier]
            assert len(tier_hashes) == num_tier, "allocate_slots without get_computed_blocks"
            num_host = sum(1 for h in tier_hashes if self.offload.tier_of(h) == "host")
            self.offload_host_hits += num_host * self.block_size
            self.offload_disk_hits += (num_tier - num_host) * self.block_size
            tier_slots = self.offload.prepare_loads(tier_hashes)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        # The first num_tier new blocks hold the tier hits (positions right after the device hits).
        for slot, block in zip(tier_slots, new_blocks, strict=False):
            self.offload.copy_in(slot, block.block_id)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        req_blocks.extend(computed_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_prefix_caching:
            # Register full blocks computed by the end of this step; draft/lookahead positions
            # (beyond all_token_ids) may be rejected, so they never make a block "full".
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            start = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > start:
                self._update_block_hashes(request)
                for i in range(start, num_full):
                    self.pool.cache_block(req_blocks[i], request.block_hashes[i])
                self.num_cached_blocks[request.request_id] = num_full
        return [b.block_id for b in new_blocks]

    def free(self, request: Request, swap: bool = False) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first.

        swap (preemption_mode="swap"): first copy its full, registered blocks out to the host
        tier, so a resume reloads them even after the device evicted them (a partial last
        block is recomputed)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        slot = self.req_to_state_slot.pop(request.request_id, None)
        if slot is not None:
            self.free_state_slots.append(slot)
            self.free_state_slots.sort(reverse=True)  # lowest id handed out next
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        self._tier_hits.pop(request.request_id, None)
        if swap and self.offload is not None:
            for block in blocks[:num_cached]:
                if block.block_hash is not None:
                    self.offload.offload_block(block.block_id, block.block_hash)
        self.pool.free_blocks(reversed(blocks))

    def take_offload_ops(self) -> OffloadOps:
        """The step's host/disk copies (drained once per schedule()); unpins host slots."""
        return self.offload.end_step() if self.offload is not None else OffloadOps()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
