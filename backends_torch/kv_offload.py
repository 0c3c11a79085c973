"""Torch side of KV offloading: host buffers, device <-> host copies, disk files.

The bookkeeping (which hash is in which slot, what to copy when) is in xlaserve.core.offload;
this module only moves bytes, in the order SchedulerOutput documents:
disk_out, copy_out, disk_in, copy_in (then the runner's forward).

Layout: one host buffer per cache group (the target model's caches, and the draft model's when
there is one; both are indexed by the same block ids) of shape [slots, L, 2, S, Hkv, D], pinned
on CUDA. A quantized cache group (layer tuples (K codes, V codes, K scales, V scales)) has two
host buffers: the codes [slots, L, 2, S, Hkv, D] and the scales [slots, L, 2, S, Hkv] float32;
`host` lists every buffer, group by group. On CUDA the copies run on a side stream: the forward waits (stream wait, not a host
sync) only for what it depends on; disk I/O synchronizes the side stream first. On CPU they are
plain copies. The disk tier stores one raw-bytes .npy per block hash (every group concatenated)
in a private subdirectory of `kv_offload_dir`, removed when the runner goes away: hashes carry
no model identity, so files are never shared between engines.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable

import numpy as np
import torch

from xlaserve.core.offload import num_host_slots, offload_enabled

# Per layer (K, V) [N, S, Hkv, D], or quantized (K codes, V codes, K scales, V scales [N, S, Hkv]).
KVCaches = list[tuple[torch.Tensor, ...]]


class TorchKVOffload:
    """Host slots for paged KV blocks of every cache group returned by `get_groups()`."""

    def __init__(
        self,
        get_groups: Callable[[], list[KVCaches]],
        kv_offload_bytes: int,
        block_bytes: int,
        disk_dir: str | None = None,
        num_slots: int | None = None,
    ) -> None:
        self.get_groups = get_groups
        self.block_bytes = block_bytes
        self.num_slots = num_slots if num_slots is not None else kv_offload_bytes // block_bytes
        groups = get_groups()
        self.device = groups[0][0][0].device
        self.on_cuda = self.device.type == "cuda"
        pin = self.on_cuda and torch.cuda.is_available()
        # host[i]: [slots, L, 2, S, Hkv, D] (or scales [slots, L, 2, S, Hkv]) holding the layer
        # tuples' entries 2p, 2p + 1 of group g, where (g, p) = self._parts[i].
        self.host: list[torch.Tensor] = []
        self._parts: list[tuple[int, int]] = []
        for g, caches in enumerate(groups):
            for p in range(len(caches[0]) // 2):
                k = caches[0][2 * p]
                shape = (self.num_slots, len(caches), 2, *k.shape[1:])
                self.host.append(torch.zeros(shape, dtype=k.dtype, pin_memory=pin))
                self._parts.append((g, p))
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.disk_dir: str | None = None
        if disk_dir:
            os.makedirs(disk_dir, exist_ok=True)
            self.disk_dir = tempfile.mkdtemp(prefix="xlaserve-kv-", dir=disk_dir)
            weakref.finalize(self, shutil.rmtree, self.disk_dir, True)
        # Bytes of one slot per group, for splitting disk files.
        self._slot_nbytes = [h[0].numel() * h.element_size() for h in self.host]

    # ----- the step's copies ------------------------------------------------------------------

    def apply(
        self,
        disk_out: list[tuple[int, int]],
        copy_out: list[tuple[int, int]],
        disk_in: list[tuple[int, int]],
        copy_in: list[tuple[int, int]],
    ) -> None:
        """All of one step's copies, in the contract's order; the forward may follow at once."""
        if disk_out:
            self._sync()
            for slot, block_hash in disk_out:
                self._write_file(slot, block_hash)
        if copy_out:
            self.copy_out(copy_out)
        if disk_in:
            self._sync()
            for block_hash, slot in disk_in:
                self._read_file(block_hash, slot)
        if copy_in:
            self.copy_in(copy_in)

    def copy_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> host slots. pairs: (device_block_id, host_slot).

        Gathers the blocks on the device into [n, L, 2, S, Hkv, D] (scales: [n, L, 2, S, Hkv]),
        then one copy per slot
        (advanced-index writes into the large host buffer are ~20x slower on CPU)."""
        blocks = [b for b, _ in pairs]
        main = torch.cuda.current_stream(self.device) if self.on_cuda else None
        if self.on_cuda:
            self.stream.wait_stream(main)  # the blocks' last writes (earlier forwards) are done
        with self._on_side_stream():
            idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
            groups = self.get_groups()
            for host, (g, p) in zip(self.host, self._parts, strict=True):
                gathered = torch.stack(
                    [torch.stack([t[2 * p].index_select(0, idx), t[2 * p + 1].index_select(0, idx)], 1)
                     for t in groups[g]],
                    1,
                )  # fmt: skip
                for i, (_, slot) in enumerate(pairs):
                    host[slot].copy_(gathered[i], non_blocking=self.on_cuda)
                if self.on_cuda:
                    gathered.record_stream(self.stream)
        if self.on_cuda:
            # The forward may overwrite these blocks only after the gather read them.
            main.wait_stream(self.stream)

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host slots -> device blocks. pairs: (host_slot, device_block_id)."""
        blocks = [b for _, b in pairs]
        main = torch.cuda.current_stream(self.device) if self.on_cuda else None
        if self.on_cuda:
            self.stream.wait_stream(main)  # target blocks are no longer read by earlier work
        with self._on_side_stream():
            idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
            groups = self.get_groups()
            for host, (g, p) in zip(self.host, self._parts, strict=True):
                staged = torch.empty(
                    (len(pairs), *host.shape[1:]), dtype=host.dtype, device=self.device
                )
                # Same stream as copy_out: a slot written this step is read after its D2H.
                for i, (slot, _) in enumerate(pairs):
                    staged[i].copy_(host[slot], non_blocking=self.on_cuda)
                raw = _bytes_view(staged)
                for layer, t in enumerate(groups[g]):
                    _bytes_view(t[2 * p]).index_copy_(0, idx, raw[:, layer, 0])
                    _bytes_view(t[2 * p + 1]).index_copy_(0, idx, raw[:, layer, 1])
                if self.on_cuda:
                    staged.record_stream(self.stream)
        if self.on_cuda:
            main.wait_stream(self.stream)  # the forward reads the copied-in blocks

    def _on_side_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.on_cuda else contextlib.nullcontext()

    # ----- disk -------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _path(self, block_hash: int) -> str:
        if self.disk_dir is None:
            raise RuntimeError("a disk op was scheduled but kv_offload_dir is not set")
        return os.path.join(self.disk_dir, f"{block_hash:064x}.npy")

    def _write_file(self, slot: int, block_hash: int) -> None:
        raw = [h[slot].contiguous().view(torch.uint8).reshape(-1).numpy() for h in self.host]
        np.save(self._path(block_hash), np.concatenate(raw), allow_pickle=False)

    def _read_file(self, block_hash: int, slot: int) -> None:
        data = np.load(self._path(block_hash), mmap_mode="r")
        off = 0
        for host, n in zip(self.host, self._slot_nbytes, strict=True):
            src = torch.from_numpy(np.array(data[off : off + n]))
            host[slot].view(torch.uint8).reshape(-1).copy_(src)
            off += n


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors as uint8 (index_copy_ has no float8 kernel on CPU); others unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def make_torch_kv_offload(runner: object) -> TorchKVOffload | None:
    """The runner's offload engine (None when kv_offload_bytes is 0). Call after init_kv_cache."""
    cache = runner.config.cache
    block_bytes = runner.kv_bytes_per_block()
    if not offload_enabled(cache):
        return None
    slots = num_host_slots(cache, block_bytes)

    def groups() -> list[KVCaches]:
        out = [runner.kv_caches]
        if runner.draft_kv_caches:
            out.append(runner.draft_kv_caches)
        return out

    return TorchKVOffload(groups, cache.kv_offload_bytes, block_bytes, cache.kv_offload_dir, slots)
