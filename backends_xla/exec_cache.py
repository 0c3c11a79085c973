"""Serialized XLA executables, keyed by everything their tracing depends on (issue 33 start-up).

JAX's persistent compilation cache skips XLA's compile on a warm start, but every program is
still traced and lowered first (its key is the lowered HLO): on the Llama-3.1-8B shape that is
most of a warm start-up. This cache stores each compiled start-up program as a serialized
executable (`jax.experimental.serialize_executable`), so a warm start loads it without tracing.

Key = sha256 of a fingerprint of the runner (every .py file of the xlaserve packages that trace
programs, the jax / jaxlib versions, the platform and device kinds, the whole EngineConfig and
model spec, the KV / state cache geometry, the weights' shapes / dtypes / shardings) and the
program's (kind, bucket). Anything a trace can read is in the fingerprint or is an input of the
program; a change anywhere gives new keys (old files are left for the user to clear). A file
that cannot be read or loaded is a miss (logged, recompiled, rewritten), never an error.
Off with multi-host runs (each host must compile the same programs itself), enforce_eager, and by
default on the CPU (EngineConfig.xla_executable_cache None: XLA:CPU start-up takes seconds, and
an XLA:CPU executable loaded into a process that had run other programs failed once with a JIT'd
function missing: "Function wrapped_iota not found"; in a fresh process, as a restarted server
loads them, they ran).

Layout: <compilation_cache_dir>/xlaserve-executables/<key>.bin (pickle of the serialized
executable and its in / out trees; written to a temp file and renamed, so readers never see half
a file). Loading runs pickle: the directory must be as trusted as the code (it is the user's own
cache directory, like JAX's).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import pickle
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from xlaserve.backends_xla.utils import compilation_cache_path

if TYPE_CHECKING:
    from xlaserve.backends_xla.runner import XlaModelRunner

logger = logging.getLogger(__name__)

SUBDIR = "xlaserve-executables"
# Packages whose code a program's trace runs (their .py files are hashed into every key).
TRACED_PACKAGES = (
    "xlaserve", "xlaserve.backends_xla", "xlaserve.models_flax", "xlaserve.kernels_pallas",
)  # fmt: skip


@functools.cache
def code_digest() -> str:
    """sha256 over the path and bytes of every .py file under TRACED_PACKAGES (once a process)."""
    h = hashlib.sha256()
    roots = []
    for name in TRACED_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(spec.submodule_search_locations)
    for root in sorted(set(roots)):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.endswith(".py"):
                    path = os.path.join(dirpath, fn)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def runner_fingerprint(r: XlaModelRunner) -> str:
    """Everything outside a program's inputs that its trace reads, as one sha256."""
    import jaxlib

    devices = r.mesh.devices.flat
    parts: list[Any] = [
        code_digest(), jax.__version__, jaxlib.__version__, r.platform,
        os.environ.get("XLA_FLAGS", ""),  # the compiler's flags shape the executable too
        [(d.platform, d.device_kind) for d in devices], dict(r.mesh.shape),
        repr(r.config), repr(r.spec), r.num_kv_blocks, r.num_state_slots(),
        str(r.dtype), str(r.kv_dtype), r.token_buckets, r.seq_buckets,
        [(tuple(w.shape), str(w.dtype), str(w.sharding)) for w in r.weights],
        # Per layer (K, V), (conv, ssm), or both nested (hybrid parallel layers): every leaf.
        [(tuple(a.shape), str(a.dtype)) for a in jax.tree_util.tree_leaves(r.kv_caches or [])],
    ]  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@dataclass
class ExecutableCache:
    """Load / store serialized executables under `root` for one runner fingerprint."""

    root: str
    fingerprint: str
    hits: int = 0
    stores: int = 0
    _writer: threading.Thread | None = None

    def store_later(self, items: list[tuple[str, int, jax.stages.Compiled]]) -> None:
        """Store `items` on a background thread: serializing takes ~0.7 s a program on the
        8B shape (H200), which would otherwise sit in a cold start-up's critical path. `join`
        waits for it (the runner's shutdown)."""
        self.join()

        def write() -> None:
            for kind, n, compiled in items:
                self.store(kind, n, compiled)

        self._writer = threading.Thread(target=write, name="xla-exec-cache", daemon=True)
        self._writer.start()

    def join(self, timeout: float | None = None) -> None:
        if self._writer is not None:
            self._writer.join(timeout)
            self._writer = None

    def _path(self, kind: str, n: int) -> str:
        key = hashlib.sha256(f"{self.fingerprint}|{kind}|{n}".encode()).hexdigest()
        return os.path.join(self.root, f"{key}.bin")

    def load(self, kind: str, n: int) -> jax.stages.Compiled | None:
        """The executable stored for (kind, n), or None (absent or unreadable: a miss)."""
        from jax.experimental import serialize_executable as se

        path = self._path(kind, n)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = se.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - a bad entry is a miss, rewritten on store
            logger.warning("executable cache entry %s unusable (%r): recompiling", path, e)
            return None
        self.hits += 1
        return compiled

    def store(self, kind: str, n: int, compiled: jax.stages.Compiled) -> None:
        """Write (kind, n)'s executable (atomically); an executable that cannot be serialized
        (e.g. closed-over constants) is skipped with a debug line."""
        from jax.experimental import serialize_executable as se

        try:
            blob = pickle.dumps(se.serialize(compiled))
        except Exception as e:  # noqa: BLE001 - not serializable: this program is traced each start
            logger.debug("executable %s/%d not cached: %r", kind, n, e)
            return
        try:
            os.makedirs(self.root, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(kind, n))
            self.stores += 1
        except OSError as e:  # a read-only or full disk: start-up still works
            logger.warning("executable cache write failed (%r)", e)


def executable_cache(r: XlaModelRunner) -> ExecutableCache | None:
    """The runner's cache, or None where it is off (config.xla_executable_cache False, or None
    on the CPU; enforce_eager; multi-host)."""
    on = r.config.xla_executable_cache
    if on is None:
        on = r.platform != "cpu"
    if not on or r.config.enforce_eager or r.multihost is not None:
        return None
    # The directory this engine asked for (JAX keeps the first one a process set up).
    root = os.path.join(compilation_cache_path(r.config.compilation_cache_dir), SUBDIR)
    return ExecutableCache(root, runner_fingerprint(r))
