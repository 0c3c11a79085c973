"""The engine core's own process: `EngineCore` behind ZMQ sockets (ipc://), msgpack frames.

Sockets (all under one private temporary directory, mode 0700):
  `ipc://DIR/in`          the core's PULL socket; every front PUSHes [kind, front id, payload]
  `ipc://DIR/out-<front>` each front's PULL socket; the core connects one PUSH per front and
                          sends [kind, payload] there, so outputs reach the front that owns them
Front -> core kinds:
  H hello (payload: empty)                      the core answers R with the start-up facts
  A add (pickle: [front request id, [CoreRequest, ...]])   answered by K (batched)
  X abort (msgpack: [[core ids], stopped])
  Q stats, answered by T
  S shutdown
Core -> front kinds:
  R ready (msgpack: {"num_blocks", "block_size", "capacity_tokens", "pid"})
  K acks (msgpack: [[front request id, error kind or None, message], ...]); error kinds:
    "value" (bad request: 400), "full" (waiting queue full: 503 + Retry-After), "failed"
  O outputs of one step (msgpack: [core.encode_outputs(outputs), stats or None]: columns of
    request ids, token counts, flat new tokens, sparse extras)
  T stats (msgpack: the EngineStats fields as a list), sent to every front now and then

Per step the core sends ONE message per front with all its requests' new token ids, finish
reasons and logprobs (ids and floats); no strings per request. `SamplingParams` travel pickled
in A frames (a few per request, not per step; the socket directory is private to this user).

Lifetime: the process ignores SIGINT (Ctrl-C reaches the whole process group; the front shuts
the core down in order), exits on S, on SIGTERM, and when its parent dies (PR_SET_PDEATHSIG on
Linux, and a parent-pid check between steps), so it never outlives the server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
from typing import Any

import msgpack
import zmq

from xlaserve.config import EngineConfig
from xlaserve.engine.core import CoreOutput, EngineCore, EngineStats, encode_outputs

logger = logging.getLogger(__name__)

STATS_FIELDS = [f.name for f in dataclasses.fields(EngineStats)]
# Stats to every front at most this often while busy (each front's own outputs carry them too).
STATS_PERIOD_S = 0.1
PARENT_CHECK_S = 0.5


def pack(obj: Any) -> bytes:  # noqa: ANN401
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:  # noqa: ANN401
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


def stats_to_wire(s: EngineStats) -> list[Any]:
    return [getattr(s, f) for f in STATS_FIELDS]


def stats_from_wire(w: list[Any]) -> EngineStats:
    return EngineStats(*w)


def in_address(ipc_dir: str) -> str:
    return f"ipc://{ipc_dir}/in"


def out_address(ipc_dir: str, front_id: str) -> str:
    return f"ipc://{ipc_dir}/out-{front_id}"


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the thread that spawned it dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _on_sigterm(signum: int, frame: Any) -> None:  # noqa: ANN401
    # Once: a group-wide stop delivers SIGTERM again (from the server) while the core shuts
    # down, and a second SystemExit inside the cleanup would break it into tracebacks.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)


def run_engine_core(
    config: EngineConfig,
    ipc_dir: str,
    parent_pid: int,
    log_level: int,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of the core process (multiprocessing spawn target). `env`: variables set
    before anything imports torch / jax (a data-parallel rank's CUDA_VISIBLE_DEVICES)."""
    os.environ.update(env or {})
    # The core is a daemon of the server (it dies with it) but must start tensor-parallel
    # workers of its own, which multiprocessing refuses to daemons; they die with the core
    # (executor.py), so the flag is only cleared here, in the core itself.
    multiprocessing.current_process().daemon = False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _die_with_parent()
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s"
    )
    if os.getppid() != parent_pid:  # the parent died before we set the death signal
        return
    core = EngineCore(config)
    try:
        CoreServer(core, ipc_dir, parent_pid).run()
    finally:
        with contextlib.suppress(Exception):
            core.shutdown()


class CoreServer:
    """The core process's loop: drain input, step, send one output message per front."""

    def __init__(self, core: EngineCore, ipc_dir: str, parent_pid: int) -> None:
        self.core = core
        self.ipc_dir = ipc_dir
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.bind(in_address(ipc_dir))
        self.outs: dict[str, zmq.Socket] = {}  # front id -> PUSH
        self.owner: dict[str, str] = {}  # core request id -> front id
        self._last_stats = 0.0
        self._stats_dirty = True
        self._last_parent_check = time.monotonic()

    def run(self) -> None:
        core = self.core
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        try:
            while True:
                busy = core.has_unfinished_requests()
                if not busy:
                    if self._stats_dirty:  # idle: the fronts see the final state
                        self._broadcast_stats()
                    if not poller.poll(PARENT_CHECK_S * 1000) and not self._parent_alive():
                        logger.warning("the server process is gone; engine core exits")
                        return
                if not self._drain():
                    return
                if core.has_unfinished_requests():
                    self._send_outputs(core.step())
                    self._stats_dirty = True
                    now = time.monotonic()
                    if now - self._last_stats >= STATS_PERIOD_S:
                        self._broadcast_stats()
                    if now - self._last_parent_check >= PARENT_CHECK_S:
                        self._last_parent_check = now
                        if not self._parent_alive():
                            logger.warning("the server process is gone; engine core exits")
                            return
        finally:
            for s in [self.inp, *self.outs.values()]:
                s.close(linger=0)
            self.ctx.term()

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    # ------------------------------------------------------------------ input
    def _drain(self) -> bool:
        """Apply every queued message; False on shutdown."""
        acks: dict[str, list[list[Any]]] = {}
        core = self.core
        while True:
            try:
                kind, front, payload = self.inp.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            fid = front.decode()
            if kind == b"A":
                front_rid, reqs = pickle.loads(payload)
                acks.setdefault(fid, []).append([front_rid, *self._add(fid, reqs)])
            elif kind == b"X":
                ids, stopped = unpack(payload)
                core.abort_requests(ids, stopped=stopped)
                for rid in ids:
                    self.owner.pop(rid, None)
                self._stats_dirty = True
            elif kind == b"H":
                self._hello(fid)
            elif kind == b"Q":
                self._send(fid, b"T", pack(stats_to_wire(core.get_stats())))
            elif kind == b"W":  # block until background compiles are done, then answer
                core.wait_compiled()
                self._send(fid, b"W", b"")
            elif kind == b"S":
                logger.info("engine core: shutdown requested")
                return False
        for fid, items in acks.items():
            self._send(fid, b"K", pack(items))
        return True

    def _add(self, fid: str, reqs: list[Any]) -> tuple[str | None, str | None]:
        core = self.core
        limit = core.config.scheduler.max_num_waiting
        if limit is not None and core.scheduler.num_waiting >= limit:
            return "full", f"the waiting queue is full ({limit} requests); retry later"
        try:
            core.add_requests(reqs)
        except ValueError as e:
            return "value", str(e)
        except Exception as e:  # noqa: BLE001 - one bad request must not kill the core
            logger.exception("add_requests failed")
            with contextlib.suppress(Exception):  # undo whatever was half-added
                core.abort_requests([r.request_id for r in reqs])
            return "failed", f"the engine could not accept this request: {type(e).__name__}: {e}"
        for r in reqs:
            self.owner[r.request_id] = fid
        self._stats_dirty = True
        return None, None

    def _hello(self, fid: str) -> None:
        if fid not in self.outs:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(out_address(self.ipc_dir, fid))
            self.outs[fid] = s
        kv = self.core.kv_manager
        info = {
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "capacity_tokens": self.core.capacity_tokens,
            "pid": os.getpid(),
            "async_scheduling": self.core._async,
        }
        self._send(fid, b"T", pack(stats_to_wire(self.core.get_stats())))  # stats before R
        self._send(fid, b"R", pack(info))

    # ------------------------------------------------------------------ output
    def _send(self, fid: str, kind: bytes, payload: bytes) -> None:
        s = self.outs.get(fid)
        if s is not None:
            s.send_multipart([kind, payload], copy=False)

    def _send_outputs(self, outs: list[CoreOutput]) -> None:
        if not outs:
            return
        per: dict[str, list[CoreOutput]] = {}
        owner = self.owner
        for o in outs:
            fid = owner.get(o.request_id)
            if fid is None:
                continue
            if o.finish_reason is not None:
                del owner[o.request_id]
            per.setdefault(fid, []).append(o)
        stats = stats_to_wire(self.core.get_stats())
        for fid, items in per.items():
            self._send(fid, b"O", pack([encode_outputs(items), stats]))

    def _broadcast_stats(self) -> None:
        self._last_stats = time.monotonic()
        self._stats_dirty = False
        payload = pack(stats_to_wire(self.core.get_stats()))
        for fid in self.outs:
            self._send(fid, b"T", payload)
