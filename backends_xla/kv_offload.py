"""JAX side of KV offloading: numpy host slots, device <-> host block copies, disk files.

Bookkeeping lives in xlaserve.core.offload; this module moves bytes in the order the
SchedulerOutput documents (disk_out, copy_out, disk_in, copy_in; then the forward).

- host: one numpy array [slots, L, 2, S, Hkv, D] in the cache dtype (all KV heads: a sharded
  cache is gathered).
- copy-out: a jitted gather of the blocks -> [n, L, 2, S, Hkv, D], then `jax.device_get`.
- copy-in: `device_put` of the slots' data, then a jitted `.at[blocks].set()` whose cache
  argument is donated (updated in place), with the cache's sharding pinned on the output.
- n is padded to a power of two so each program compiles once per bucket (at first use);
  padded gather rows read block 0 and are discarded, padded scatter rows target block N
  (out of range) and are dropped (`mode="drop"`).
- disk: one raw-bytes .npy per block hash in a private subdirectory of `kv_offload_dir`,
  removed when this object goes away (hashes carry no model identity).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.core.offload import num_host_slots, offload_enabled

KVCaches = list[tuple[jax.Array, jax.Array]]  # per layer (K, V) [N, S, Hkv, D]


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _gather(caches: KVCaches, idx: jax.Array) -> jax.Array:
    """[n, L, 2, S, Hkv, D] of the blocks idx [n]."""
    return jnp.stack([jnp.stack([k[idx], v[idx]], 1) for k, v in caches], 1)


def _scatter(caches: KVCaches, idx: jax.Array, data: jax.Array) -> KVCaches:
    """caches with blocks idx [n] set from data [n, L, 2, S, Hkv, D] (out-of-range ids dropped)."""
    return [
        (k.at[idx].set(data[:, i, 0], mode="drop"), v.at[idx].set(data[:, i, 1], mode="drop"))
        for i, (k, v) in enumerate(caches)
    ]


class XlaKVOffload:
    """Host slots for the runner's paged KV cache (list of per-layer (K, V) jax arrays)."""

    def __init__(
        self,
        caches: KVCaches,
        num_slots: int,
        block_bytes: int,
        kv_sharding: jax.sharding.Sharding,
        disk_dir: str | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        k = caches[0][0]
        self.num_blocks = k.shape[0]
        self.host = np.zeros((num_slots, len(caches), 2, *k.shape[1:]), dtype=k.dtype)
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=(0,), out_shardings=kv_sharding)
        self.disk_dir: str | None = None
        if disk_dir:
            os.makedirs(disk_dir, exist_ok=True)
            self.disk_dir = tempfile.mkdtemp(prefix="xlaserve-kv-", dir=disk_dir)
            weakref.finalize(self, shutil.rmtree, self.disk_dir, True)

    def apply(
        self,
        caches: KVCaches,
        disk_out: list[tuple[int, int]],
        copy_out: list[tuple[int, int]],
        disk_in: list[tuple[int, int]],
        copy_in: list[tuple[int, int]],
    ) -> KVCaches:
        """One step's copies in the contract's order; returns the (new, donated) caches."""
        for slot, block_hash in disk_out:
            np.save(self._path(block_hash), self.host[slot].view(np.uint8).reshape(-1))
        if copy_out:
            self.copy_out(caches, copy_out)
        for block_hash, slot in disk_in:
            raw = np.load(self._path(block_hash))
            self.host[slot] = raw.view(self.host.dtype).reshape(self.host.shape[1:])
        if copy_in:
            caches = self.copy_in(caches, copy_in)
        return caches

    def copy_out(self, caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> host slots. pairs: (device_block_id, host_slot)."""
        n = len(pairs)
        idx = np.zeros(_bucket(n), np.int32)
        idx[:n] = [b for b, _ in pairs]
        data = jax.device_get(self._gather(caches, jnp.asarray(idx)))
        self.host[[s for _, s in pairs]] = data[:n]

    def copy_in(self, caches: KVCaches, pairs: list[tuple[int, int]]) -> KVCaches:
        """Host slots -> device blocks. pairs: (host_slot, device_block_id). Donates caches."""
        n = len(pairs)
        nb = _bucket(n)
        idx = np.full(nb, self.num_blocks, np.int32)  # padding rows: out of range, dropped
        idx[:n] = [b for _, b in pairs]
        data = np.zeros((nb, *self.host.shape[1:]), self.host.dtype)
        data[:n] = self.host[[s for s, _ in pairs]]
        return self._scatter(caches, jax.device_put(idx), jax.device_put(data))

    def _path(self, block_hash: int) -> str:
        if self.disk_dir is None:
            raise RuntimeError("a disk op was scheduled but kv_offload_dir is not set")
        return os.path.join(self.disk_dir, f"{block_hash:064x}.npy")


def make_xla_kv_offload(runner: object) -> XlaKVOffload | None:
    """The runner's offload engine (None when off). Call after init_kv_cache."""
    cache = runner.config.cache
    if not offload_enabled(cache):
        return None
    spec = runner.spec
    block_bytes = runner.block_size * spec.kv_bytes_per_token(runner.dtype.itemsize)
    return XlaKVOffload(
        runner.kv_caches,
        num_host_slots(cache, block_bytes),
        block_bytes,
        runner._kv_sharding,
        cache.kv_offload_dir,
    )
