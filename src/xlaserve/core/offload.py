"""KV offload tiers below the device cache: host memory (slots) and, optionally, disk.

Pure bookkeeping (no torch/jax): which block hash lives in which host slot, LRU order, which
hashes were written to disk, and the copies the runner must perform this step. The runner owns
the bytes (pinned host buffers [slots, L, 2, S, Hkv, D], files named by block hash).

Tiers are inclusive: a block copied back to the device keeps its host copy, a host block spilled
to disk leaves the host (its slot is reused), and a disk block loaded back into a host slot
keeps its file. Lookups prefer the device, then host, then disk.

Per step the manager collects four op lists, drained into the SchedulerOutput; the runner
performs them in this order, before the forward pass:
  1. disk_out  (host_slot, block_hash):  write host slot to disk (frees the slot for reuse)
  2. copy_out  (device_block, host_slot): device -> host (blocks evicted or swapped this step)
  3. disk_in   (block_hash, host_slot):  read disk file into host slot
  4. copy_in   (host_slot, device_block): host -> device (prefix hits in the host/disk tier)
A slot written or read in a step is pinned until `end_step()`, so no slot is overwritten after
an earlier op of the same step has used it (pinning is what makes the fixed order correct).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xlaserve.config import CacheConfig, EngineConfig

logger = logging.getLogger(__name__)

HOST, DISK = "host", "disk"


def offload_enabled(cache: CacheConfig) -> bool:
    """The host tier needs block hashes, so it is on only with prefix caching."""
    return cache.kv_offload_bytes > 0 and cache.enable_prefix_caching


def num_host_slots(cache: CacheConfig, block_bytes: int) -> int:
    """Host slots for one device block each (block_bytes: every layer's K and V of one block)."""
    if not offload_enabled(cache):
        return 0
    return cache.kv_offload_bytes // block_bytes


@dataclass
class OffloadOps:
    """Copies of one step, in the order the runner performs them (see module docstring)."""

    disk_out: list[tuple[int, int]] = field(default_factory=list)  # (host_slot, block_hash)
    copy_out: list[tuple[int, int]] = field(default_factory=list)  # (device_block, host_slot)
    disk_in: list[tuple[int, int]] = field(default_factory=list)  # (block_hash, host_slot)
    copy_in: list[tuple[int, int]] = field(default_factory=list)  # (host_slot, device_block)

    def __bool__(self) -> bool:
        return bool(self.disk_out or self.copy_out or self.disk_in or self.copy_in)


class OffloadManager:
    """Host slots 0..num_slots-1 with LRU eviction, and an optional (unbounded) disk tier."""

    def __init__(self, num_slots: int, block_bytes: int, use_disk: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.use_disk = use_disk
        # block hash -> host slot, least recently used first.
        self.host: OrderedDict[int, int] = OrderedDict()
        # Slots holding nothing, lowest first.
        self.free_slots: list[int] = list(range(num_slots))
        # Hashes with a file on disk, least recently used first (value unused).
        self.disk: OrderedDict[int, None] = OrderedDict()
        # Slots used by an op this step: never evicted or overwritten before end_step().
        self.pinned: set[int] = set()
        self.ops = OffloadOps()
        # Stats: tokens are counted by the KV cache manager; bytes here (device <-> host).
        self.bytes_out = 0
        self.bytes_in = 0
        self.disk_bytes_out = 0
        self.disk_bytes_in = 0
        self.num_dropped = 0  # blocks that could not be offloaded (every slot pinned)

    # ----- queries ----------------------------------------------------------------------------

    def tier_of(self, block_hash: int) -> str | None:
        if block_hash in self.host:
            return HOST
        if block_hash in self.disk:
            return DISK
        return None

    def num_servable(self, hashes: list[int]) -> int:
        """How many leading hashes can be brought to the device this step: each must be in a
        tier, and the slots they pin (host hits' own slots, one per disk load) must fit
        beside the slots already pinned this step."""
        spare = self.num_slots - len(self.pinned)
        n = 0
        for h in hashes:
            slot = self.host.get(h)
            if slot is not None and slot in self.pinned:
                pass
            elif (slot is not None or h in self.disk) and spare > 0:
                spare -= 1
            else:
                break
            n += 1
        return n

    # ----- slots ------------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used unpinned one (spilled to disk first when
        the disk tier is on and the block is not there yet). None when every slot is pinned."""
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next((h for h, s in self.host.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self.host.pop(victim)
            if self.use_disk:
                if victim not in self.disk:
                    self.ops.disk_out.append((slot, victim))
                    self.disk_bytes_out += self.block_bytes
                self.disk[victim] = None
                self.disk.move_to_end(victim)
        self.pinned.add(slot)
        return slot

    def offload_block(self, block_id: int, block_hash: int) -> bool:
        """A hashed device block leaves the device tier (evicted or swapped out): copy it out
        unless a lower tier already holds it. Returns False when it had to be dropped."""
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
            return True
        if block_hash in self.disk:
            self.disk.move_to_end(block_hash)
            return True
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return False
        self.host[block_hash] = slot
        self.ops.copy_out.append((block_id, slot))
        self.bytes_out += self.block_bytes
        return True

    def prepare_loads(self, hashes: list[int]) -> list[int]:
        """Host slots (copy-in sources) for hashes that passed `num_servable`: host hits are
        pinned first, so that disk loads evict only slots nobody reads this step."""
        for h in hashes:
            if h in self.host:
                self.prepare_load(h)
        return [self.prepare_load(h) for h in hashes]

    def prepare_load(self, block_hash: int) -> int:
        """Pin the host slot holding block_hash, loading it from disk first if needed (the
        caller checked `num_servable`). Returns the slot (source of a copy-in)."""
        slot = self.host.get(block_hash)
        if slot is not None:
            self.host.move_to_end(block_hash)
            self.pinned.add(slot)
            return slot
        if block_hash not in self.disk:
            raise KeyError(f"block hash {block_hash:x} is in no offload tier")
        slot = self._take_slot()
        if slot is None:
            raise RuntimeError("no host slot left for a disk load (num_servable not checked)")
        self.disk.move_to_end(block_hash)
        self.host[block_hash] = slot
        self.ops.disk_in.append((block_hash, slot))
        self.disk_bytes_in += self.block_bytes
        return slot

    def copy_in(self, host_slot: int, block_id: int) -> None:
        self.ops.copy_in.append((host_slot, block_id))
        self.bytes_in += self.block_bytes

    # ----- per step ---------------------------------------------------------------------------

    def end_step(self) -> OffloadOps:
        """This step's ops (for the SchedulerOutput); unpins every slot."""
        ops, self.ops = self.ops, OffloadOps()
        self.pinned.clear()
        return ops

    def reset(self) -> None:
        """Forget every offloaded block (files on disk become unreachable)."""
        self.host.clear()
        self.disk.clear()
        self.free_slots = list(range(self.num_slots))


def build_offload_manager(config: EngineConfig, runner: Any) -> OffloadManager | None:
    """The offload manager for an engine whose runner ran init_kv_cache, or None when off.

    The runner exposes `kv_offload` (its copy engine, with `num_slots` and `block_bytes`) when
    `cache.kv_offload_bytes > 0`; the two sides agree on the slot count this way."""
    cache, sched = config.cache, config.scheduler
    if sched.preemption_mode == "swap" and not offload_enabled(cache):
        raise ValueError(
            "preemption_mode='swap' needs a host tier: set kv_offload_bytes > 0 "
            "(and keep prefix caching on)"
        )
    if cache.kv_offload_bytes > 0 and not cache.enable_prefix_caching:
        logger.warning("kv_offload_bytes is ignored: the host tier needs prefix caching")
        return None
    if not offload_enabled(cache):
        return None
    engine = getattr(runner, "kv_offload", None)
    if engine is None:
        raise ValueError(f"backend {type(runner).__name__} does not support KV offloading")
    if engine.num_slots <= 0:
        raise ValueError(
            f"kv_offload_bytes={cache.kv_offload_bytes} holds no block "
            f"({engine.block_bytes} bytes each)"
        )
    logger.info(
        "KV offload: %d host slots of %d bytes%s",
        engine.num_slots,
        engine.block_bytes,
        f", disk tier in {cache.kv_offload_dir}" if cache.kv_offload_dir else "",
    )
    return OffloadManager(engine.num_slots, engine.block_bytes, use_disk=bool(cache.kv_offload_dir))
