"""LoRAManager: the engine core's adapter bookkeeping (no torch / jax; ids and counters only).

- Host cache: up to `max_cpu_loras` loaded adapters (LRU by use), keyed by `lora_int_id`. A
  request keeps a reference to its own `LoRAAdapter`, so an adapter evicted from the cache
  while requests wait for it is still at hand when they run (it is loaded again from disk only
  by a later request).
- Device slots: `max_loras` slots. A running request pins its adapter's slot (a reference count
  per adapter, kept by the scheduler: `acquire` when a request starts running, `release` when it
  finishes or is preempted). An adapter not resident takes an empty slot, else the least
  recently used slot whose adapter no running request uses; the writes go out with the step in
  `SchedulerOutput.lora_loads` (`take_loads`). So the running requests never use more than
  `max_loras` distinct adapters, and a slot in use is never overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from xlaserve.config import LoRAConfig
from xlaserve.lora import LoRAAdapter, LoRARequest

Loader = Callable[[LoRARequest, Any, int], LoRAAdapter]


class LoRAManager:
    """See the module docstring. `spec`: the base ModelSpec (the loader checks shapes)."""

    def __init__(self, config: LoRAConfig, spec: Any, loader: Loader | None = None) -> None:
        if loader is None:
            from xlaserve.lora.peft import load_peft_adapter

            loader = load_peft_adapter
        self.config = config
        self.spec = spec
        self._loader = loader
        self.max_loras = config.max_loras
        self.max_cpu_loras = int(config.max_cpu_loras or config.max_loras)
        # int id -> (request that loaded it, adapter); LRU order, last = most recent.
        self._host: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()
        # slot -> int id of the adapter it holds (None = empty).
        self.slots: list[int | None] = [None] * self.max_loras
        self.slot_of: dict[int, int] = {}
        # Running requests per resident adapter (int id); 0 = its slot may be reused.
        self.refs: dict[int, int] = {}
        # Slot use order (first = least recently acquired).
        self._slot_lru: OrderedDict[int, None] = OrderedDict(
            (s, None) for s in range(self.max_loras)
        )
        self._loads: list[tuple[int, LoRAAdapter]] = []

    # ---- host cache ----------------------------------------------------------------------

    def load(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of `req`, from the host cache or loaded now (ValueError on a bad one, or
        when `req.lora_int_id` is already taken by another name / path). The id is the
        adapter's identity (prefix-cache key): a name may come back with a new id and path."""
        hit = self._host.get(req.lora_int_id)
        if hit is not None:
            known, adapter = hit
            if (known.lora_name, known.lora_path) != (req.lora_name, req.lora_path):
                raise ValueError(
                    f"lora_int_id {req.lora_int_id} is already used by adapter "
                    f"{known.lora_name!r} ({known.lora_path}); give {req.lora_name!r} another id"
                )
            self._host.move_to_end(req.lora_int_id)
            return adapter
        adapter = self._loader(req, self.spec, self.config.max_lora_rank)
        self._host[req.lora_int_id] = (req, adapter)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter in the host cache (server unload); running requests keep theirs,
        its device slot is reused when needed. False when it was not cached."""
        return self._host.pop(lora_int_id, None) is not None

    @property
    def cached_ids(self) -> list[int]:
        """Host cache, least recently used first."""
        return list(self._host)

    # ---- device slots --------------------------------------------------------------------

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used slot no running request uses."""
        for s, held in enumerate(self.slots):
            if held is None:
                return s
        for s in self._slot_lru:
            held = self.slots[s]
            if held is None or self.refs.get(held, 0) == 0:
                return s
        return None

    def can_acquire(self, lora_int_id: int) -> bool:
        """Whether a request of this adapter can start running now."""
        return lora_int_id in self.slot_of or self._free_slot() is not None

    def acquire(self, adapter: LoRAAdapter) -> int:
        """Pin the adapter's slot for one more running request (loading it into a slot if it is
        not resident); returns the slot. Call `can_acquire` first."""
        aid = adapter.int_id
        slot = self.slot_of.get(aid)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                raise RuntimeError(f"no free LoRA slot for adapter {adapter.name!r}")
            old = self.slots[slot]
            if old is not None:
                del self.slot_of[old]
                self.refs.pop(old, None)
            self.slots[slot] = aid
            self.slot_of[aid] = slot
            self._loads = [(s, a) for s, a in self._loads if s != slot]
            self._loads.append((slot, adapter))
        self.refs[aid] = self.refs.get(aid, 0) + 1
        self._slot_lru.move_to_end(slot)
        return slot

    def release(self, lora_int_id: int) -> None:
        """One running request of this adapter finished or was preempted."""
        n = self.refs.get(lora_int_id, 0)
        if n <= 0:
            raise RuntimeError(f"LoRA adapter {lora_int_id} released more often than acquired")
        self.refs[lora_int_id] = n - 1

    @property
    def num_active(self) -> int:
        """Adapters some running request uses."""
        return sum(1 for n in self.refs.values() if n > 0)

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        """The slot writes of this step, in order (for `SchedulerOutput.lora_loads`)."""
        loads, self._loads = self._loads, []
        return loads
