"""JAX side of KV offloading: numpy host slots, device <-> host block copies, disk files.

Bookkeeping lives in xlaserve.core.offload; this module moves bytes in the order the
SchedulerOutput documents (disk_out, copy_out, disk_in, copy_in; then the forward).

- host: one numpy array [slots, L, 2, S, Hkv, D] in the cache dtype (all KV heads: a sharded
  cache is gathered). A quantized cache (per layer (k codes, v codes, k scales, v scales)) has
  two "parts": codes [slots, L, 2, S, Hkv, D] int8 / fp8 and scales [slots, L, 2, S, Hkv]
  float32, copied together.
- copy-out: a jitted gather of the blocks -> [n, L, 2, S, Hkv, D], then `jax.device_get`.
- copy-in: `device_put` of the slots' data, then a jitted `.at[blocks].set()` whose cache
  argument is donated (updated in place), with the cache's sharding pinned on the output.
- n is padded to a power of two so each program compiles once per bucket (at first use);
  padded gather rows read block 0 and are discarded, padded scatter rows target block N
  (out of range) and are dropped (`mode="drop"`).
- disk: one raw-bytes .npy per block hash (the parts' bytes one after the other) in a private subdirectory of `kv_offload_dir`,
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

# Per layer (K, V) [N, S, Hkv, D]; quantized: (K codes, V codes, K scales, V scales [N, S, Hkv]).
KVCaches = list[tuple[jax.Array, ...]]


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _gather(caches: KVCaches, idx: jax.Array) -> tuple[jax.Array, ...]:
    """Per part (codes, then scales if quantized): [n, L, 2, S, Hkv(, D)] of the blocks idx [n]."""
    return tuple(
        jnp.stack([jnp.stack([kv[2 * p][idx], kv[2 * p + 1][idx]], 1) for kv in caches], 1)
        for p in range(len(caches[0]) // 2)
    )


def _scatter(caches: KVCaches, idx: jax.Array, data: tuple[jax.Array, ...]) -> KVCaches:
    """caches with blocks idx [n] set from data (per part [n, L, 2, ...]; out-of-range ids
    dropped)."""
    return [
        tuple(c.at[idx].set(data[j // 2][:, i, j % 2], mode="drop") for j, c in enumerate(kv))
        for i, kv in enumerate(caches)
    ]


class XlaKVOffload:
    """Host slots for the runner's paged KV cache (list of per-layer (K, V) jax arrays, or
    (K codes, V codes, K scales, V scales) for a quantized cache).

    kv_sharding: one sharding for every cache array, or a tuple with one per array of a layer's
    tuple (scales are 3-D, so a quantized cache needs the tuple)."""

    def __init__(
        self,
        caches: KVCaches,
        num_slots: int,
        block_bytes: int,
        kv_sharding: jax.sharding.Sharding | tuple[jax.sharding.Sharding, ...],
        disk_dir: str | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.num_blocks = caches[0][0].shape[0]
        # One host array per part: [slots, L, 2, S, Hkv, D] codes (or K/V), [slots, L, 2, S, Hkv]
        # scales.
        self.hosts = [
            np.zeros((num_slots, len(caches), 2, *c.shape[1:]), dtype=c.dtype)
            for c in caches[0][::2]
        ]
        self.host = self.hosts[0]
        out_shardings = kv_sharding
        if isinstance(kv_sharding, tuple):
            out_shardings = [kv_sharding] * len(caches)
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=(0,), out_shardings=out_shardings)
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
            raw = np.concatenate([h[slot].view(np.uint8).reshape(-1) for h in self.hosts])
            np.save(self._path(block_hash), raw)
        if copy_out:
            self.copy_out(caches, copy_out)
        for block_hash, slot in disk_in:
            raw = np.load(self._path(block_hash))
            off = 0
            for h in self.hosts:
                nbytes = h[slot].nbytes
                h[slot] = raw[off : off + nbytes].view(h.dtype).reshape(h.shape[1:])
                off += nbytes
        if copy_in:
            caches = self.copy_in(caches, copy_in)
        return caches

    def copy_out(self, caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> host slots. pairs: (device_block_id, host_slot)."""
        n = len(pairs)
        idx = np.zeros(_bucket(n), np.int32)
        idx[:n] = [b for b, _ in pairs]
        data = jax.device_get(self._gather(caches, jnp.asarray(idx)))
        for h, d in zip(self.hosts, data, strict=True):
            h[[s for _, s in pairs]] = d[:n]

    def copy_in(self, caches: KVCaches, pairs: list[tuple[int, int]]) -> KVCaches:
        """Host slots -> device blocks. pairs: (host_slot, device_block_id). Donates caches."""
        n = len(pairs)
        nb = _bucket(n)
        idx = np.full(nb, self.num_blocks, np.int32)  # padding rows: out of range, dropped
        idx[:n] = [b for _, b in pairs]
        data = []
        for h in self.hosts:
            d = np.zeros((nb, *h.shape[1:]), h.dtype)
            d[:n] = h[[s for s, _ in pairs]]
            data.append(d)
        return self._scatter(caches, jax.device_put(idx), jax.device_put(tuple(data)))

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
    block_bytes = runner.block_size * spec.kv_bytes_per_token(
        runner.dtype.itemsize, cache.kv_cache_dtype
    )
    return XlaKVOffload(
        runner.kv_caches,
        num_host_slots(cache, block_bytes),
        block_bytes,
        runner._kv_layer_shardings,
        cache.kv_offload_dir,
    )
