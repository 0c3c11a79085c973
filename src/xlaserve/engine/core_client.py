"""The server's front when the engine core runs in its own process (the `xlaserve serve`
default): `MPAsyncLLM` has the `AsyncLLM` surface the HTTP handlers use.

Front side of one server process:
- callers (the aiohttp handlers, on their event loop) tokenize and validate the request in
  the front's `OutputProcessor`, then PUSH it to the core (`engine/core_proc.py`) and await the
  core's ack (a structured-output spec is checked there; a full waiting queue answers 503);
- one front thread owns the receiving socket: per core step it gets one message with every new
  token of this front's requests, runs the OutputProcessor (detokenize, stop strings, logprobs
  text, n > 1) and hands each request's RequestOutput to its asyncio queue (one
  `call_soon_threadsafe` per event loop per message). A stop string aborts the sequence in the
  core. The front thread also watches the core process: if it dies, every pending and future
  request fails at once with `EngineDeadError` (the server's /health answers 503 and the server
  exits non-zero, see api_server.run_server).

The OutputProcessor and the stream table are shared by callers and the front thread under one
lock (held for one add, one abort, or one step's outputs).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import zmq

from xlaserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineQueueFullError,
    RequestFailedError,
    _deliver,
    _resolve,
    _Stream,
)
from xlaserve.engine.core import CoreOutput, EngineStats, decode_outputs, load_model_info
from xlaserve.engine.core_proc import (
    in_address,
    out_address,
    pack,
    run_engine_core,
    stats_from_wire,
    unpack,
)
from xlaserve.engine.output_processor import OutputProcessor
from xlaserve.metrics import RequestRecord
from xlaserve.outputs import RequestOutput
from xlaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xlaserve.config import EngineConfig

logger = logging.getLogger(__name__)

# How long to wait for the core to load the model and answer hello.
START_TIMEOUT_S = float(os.environ.get("XLASERVE_CORE_START_TIMEOUT", "3600"))


class _SpecView:
    """What handlers read from `engine.engine` (the in-process LLMEngine): spec, tokenizer."""

    def __init__(self, info: Any) -> None:  # noqa: ANN401
        self.spec = info.spec
        self.tokenizer = info.tokenizer
        self.model_dir = info.model_dir
        self.backend = info.backend


class CoreProcess:
    """A spawned engine core process and its socket directory (this process owns it)."""

    owned = True

    def __init__(
        self, config: EngineConfig, env: dict[str, str] | None = None, name: str = "engine core"
    ) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="xlaserve-core-")  # mode 0700
        ctx = multiprocessing.get_context("spawn")  # torch / jax are loaded there: no fork
        level = logging.getLogger().getEffectiveLevel()
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config, self.ipc_dir, os.getpid(), level, env),
            name="xlaserve-" + name.replace(" ", "-"),
            daemon=True,
        )
        self.proc.start()
        logger.info(
            "%s process started (pid %d)%s", name, self.proc.pid, f" env {env}" if env else ""
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def sentinel(self) -> int:
        """An fd that becomes readable when the process ends."""
        return self.proc.sentinel

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        self.proc.join(0.5)
        return self.proc.exitcode

    def stop(self, timeout: float) -> None:
        """Wait for the core to exit (after S), then SIGTERM, then SIGKILL."""
        p = self.proc
        # join() can come back early while the core still runs (seen in CI: "did not exit in
        # 30 s" logged 1 s after the group SIGTERM): wait out the whole timeout.
        deadline = time.monotonic() + timeout
        while p.is_alive() and (left := deadline - time.monotonic()) > 0:
            p.join(min(left, 0.5))
            if p.is_alive():
                time.sleep(min(0.05, max(left, 0.0)))  # no busy loop if join returns at once
        if p.is_alive():
            logger.warning("engine core did not exit in %.0f s; terminating it", timeout)
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class AttachedCore:
    """An engine core another process started (`--api-server-count N`: each front process
    attaches to the one core its parent started). Watched through a pidfd (Linux) or a
    periodic liveness check; never stopped from here."""

    owned = False

    def __init__(self, ipc_dir: str, pid: int) -> None:
        self.ipc_dir = ipc_dir
        self.pid = pid
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(pid)
        r, w = os.pipe()  # without a pidfd: a never-ready fd (the poll timeout checks instead)
        self._dummy = (r, w)

    @property
    def sentinel(self) -> int:
        return self._pidfd if self._pidfd is not None else self._dummy[0]

    def is_alive(self) -> bool:
        try:
            import psutil

            p = psutil.Process(self.pid)
            return p.status() != psutil.STATUS_ZOMBIE
        except Exception:  # noqa: BLE001 - no such process (or psutil missing: os.kill)
            try:
                os.kill(self.pid, 0)
                return True
            except OSError:
                return False

    @property
    def exitcode(self) -> int | None:
        return None  # not our child: its parent reaps it

    def stop(self, timeout: float) -> None:
        for fd in (*self._dummy, self._pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


class MPAsyncLLM:
    """`AsyncLLM`'s surface over an engine core in another process (see the module doc)."""

    def __init__(
        self, config: EngineConfig, core: CoreProcess | AttachedCore | None = None
    ) -> None:
        self._config = config
        info = load_model_info(config)  # tokenizer, limits: no weights, no torch
        self.info = info
        self.engine = _SpecView(info)
        self.core = core or CoreProcess(config)
        self.front_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(out_address(self.core.ipc_dir, self.front_id))
        self._inp = self._ctx.socket(zmq.PUSH)
        self._inp.setsockopt(zmq.LINGER, 0)
        self._inp.connect(in_address(self.core.ipc_dir))
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._lock = threading.Lock()  # processor, streams, pending adds, dead
        self._streams: dict[str, _Stream] = {}
        self._pending: dict[str, tuple[_Stream, asyncio.Future]] = {}
        self._dead: EngineDeadError | None = None
        self._finish_listeners: list[Callable[[RequestRecord], None]] = []
        self._closing = False
        try:
            ready = self._handshake()
        except BaseException:
            self._close_sockets()
            self.core.stop(1.0)
            raise
        self.core_info = ready
        self.processor = OutputProcessor(info, ready["capacity_tokens"])
        self._thread = threading.Thread(target=self._run, name="xlaserve-front", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> MPAsyncLLM:
        return cls(config)

    def _handshake(self) -> dict[str, Any]:
        """Hello until the core answers R (it binds its socket after loading the model)."""
        self._send(b"H", b"")
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.core.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            events = dict(poller.poll(1000))
            if self._out in events:
                kind, payload = self._out.recv_multipart()
                if kind == b"R":
                    info = unpack(payload)
                    logger.info("engine core ready (pid %d)", info["pid"])
                    return info
                if kind == b"T":
                    self.stats = stats_from_wire(unpack(payload))
                continue
            if not self.core.is_alive():
                raise RuntimeError(
                    f"the engine core process failed to start (exit code "
                    f"{self.core.exitcode}); see its log above"
                )
        raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------------ read-only views
    stats: EngineStats | None = None

    @property
    def tokenizer(self) -> Any:  # noqa: ANN401
        return self.info.tokenizer

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def core_pid(self) -> int | None:
        return self.core.pid

    def add_finish_listener(self, fn: Callable[[RequestRecord], None]) -> None:
        """`fn(record)` runs on the consumer's event loop once per request that ends."""
        self._finish_listeners.append(fn)

    # ------------------------------------------------------------------ requests
    def _send(self, kind: bytes, payload: bytes) -> None:
        with self._send_lock:
            self._inp.send_multipart([kind, self.front_id.encode(), payload], copy=False)

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> _Stream:
        """Validate here, queue in the core, wait for its ack (raises ValueError etc.)."""
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop)
        done = loop.create_future()
        if self._dead is not None:
            raise self._dead
        # Tokenize outside the lock (the front thread needs it for every step's outputs).
        text, ids = self.processor.prompt_ids(prompt)
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if request_id in self._pending:
                raise ValueError(f"request id {request_id!r} is already in use")
            reqs = self.processor.add_request(
                request_id,
                {"prompt": text, "prompt_token_ids": ids},
                params,
                priority,
                stream.arrival_time,
                cache_salt,
                lora_request,
            )
            self._pending[request_id] = (stream, done)
            self._send(b"A", pickle.dumps((request_id, reqs), protocol=pickle.HIGHEST_PROTOCOL))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    # The consumer side is the in-process AsyncLLM's (add, then iterate; coalescing, abort on
    # close, records).
    generate = AsyncLLM.generate
    iterate = AsyncLLM.iterate
    _record = AsyncLLM._record

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent; unknown ids are ignored)."""
        with self._lock:
            self._streams.pop(request_id, None)
            self._pending.pop(request_id, None)
            ids = self.processor.drop(request_id)
            if ids and self._dead is None:
                self._send(b"X", pack([ids, False]))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core (S, then SIGTERM / SIGKILL past `timeout`) and the front thread."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(Exception):
            if self.core.owned and self.core.is_alive():
                self._send(b"S", b"")
        self.core.stop(timeout)
        self._thread.join(5)
        with self._lock:
            if self._dead is None:
                self._fail_all(EngineDeadError("the engine was shut down"))
        self._close_sockets()

    def _close_sockets(self) -> None:
        with contextlib.suppress(Exception):
            self._inp.close(linger=0)
            self._out.close(linger=0)
            self._ctx.term()

    # ------------------------------------------------------------------ the front thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        sentinel = self.core.sentinel
        poller.register(sentinel, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(200))
                if self._out in events:
                    while True:
                        try:
                            kind, payload = self._out.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(kind, payload)
                if self._closing and not self.core.owned:
                    return  # an attached core lives on (its owner stops it)
                # Liveness: the sentinel fires at once; a poll timeout re-checks (no pidfd).
                if sentinel in events or (not events and not self.core.is_alive()):
                    code = self.core.exitcode
                    if self._closing:
                        msg = "the engine was shut down"
                    elif code == 0:
                        # Exit 0 without our S: SIGTERM reached the core itself (a supervisor
                        # stopping the whole process group, which stops this server too, maybe
                        # only after its in-flight requests): a stop, not a crash.
                        msg = "the engine core process was shut down by a signal (SIGTERM)"
                        logger.info("%s; failing every request", msg)
                    else:
                        msg = f"the engine core process died (exit code {code})"
                        logger.error("%s; failing every request", msg)
                    with self._lock:
                        self._fail_all(EngineDeadError(msg))
                    return
        except BaseException as e:  # noqa: BLE001 - a front bug must not hang requests
            if self._closing:
                return
            logger.exception("engine front thread crashed")
            with self._lock:
                self._fail_all(EngineDeadError(f"engine front crashed: {type(e).__name__}: {e}"))

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == b"O":
            items, stats = unpack(payload)
            if stats is not None:
                self.stats = stats_from_wire(stats)
            self._outputs(decode_outputs(items))
        elif kind == b"K":
            self._acks(unpack(payload))
        elif kind == b"T":
            self.stats = stats_from_wire(unpack(payload))

    def _acks(self, acks: list[list[Any]]) -> None:
        with self._lock:
            for rid, kind, msg in acks:
                entry = self._pending.pop(rid, None)
                if entry is None:
                    continue  # aborted while the add was on its way
                stream, done = entry
                err: BaseException | None = None
                if kind is None:
                    self._streams[rid] = stream
                else:
                    self.processor.drop(rid)
                    err = {
                        "value": ValueError,
                        "full": EngineQueueFullError,
                        "failed": RequestFailedError,
                    }[kind](msg)
                AsyncLLM._call(stream.loop, _resolve, done, err)

    def _outputs(self, outs: list[CoreOutput]) -> None:
        now = time.monotonic()
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            outputs, stopped = self.processor.process(outs)
            if stopped:
                self._send(b"X", pack([stopped, True]))
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted meanwhile
                if stream.first_token_time is None and any(o.token_ids for o in out.outputs):
                    stream.first_token_time = now
                if out.finished:
                    stream.finished_time = now
                    del self._streams[out.request_id]
                per_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in per_loop.items():
            AsyncLLM._call(loop, _deliver, items)

    def _fail_all(self, err: EngineDeadError) -> None:
        """Under the lock: mark dead, fail every pending add and open stream."""
        self._dead = err
        for stream, done in self._pending.values():
            AsyncLLM._call(stream.loop, _resolve, done, err)
        self._pending.clear()
        for stream in self._streams.values():
            AsyncLLM._call(stream.loop, _deliver, [(stream.queue, err)])
        self._streams.clear()


class MPLLMEngine:
    """`LLMEngine`'s synchronous surface (add_request / step / abort_request / get_stats) over
    an engine core process: `LLM(..., engine_process=True)`. Adds are pipelined (no round trip
    per request) except for structured-output requests, whose spec the core checks; a late
    refusal by the core finishes that request with an error output."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        info = load_model_info(config)
        self.info = info
        self.model_dir, self.spec, self.tokenizer = info.model_dir, info.spec, info.tokenizer
        self.model_name, self.max_model_len = info.model_name, info.max_model_len
        self.eos_token_ids, self.backend = info.eos_token_ids, info.backend
        self.core = CoreProcess(config)
        self.front_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(out_address(self.core.ipc_dir, self.front_id))
        self._inp = self._ctx.socket(zmq.PUSH)
        self._inp.setsockopt(zmq.LINGER, 0)
        self._inp.connect(in_address(self.core.ipc_dir))
        self._poller = zmq.Poller()
        self._poller.register(self._out, zmq.POLLIN)
        self._poller.register(self.core.sentinel, zmq.POLLIN)
        self._stats: EngineStats | None = None
        self._acks: dict[str, tuple[str | None, str | None]] = {}
        self._backlog: list[CoreOutput] = []
        self._ids = itertools.count()
        self._closed = False
        self._send(b"H", b"")
        try:
            ready = self._wait(lambda: self._ready is not None, START_TIMEOUT_S)
        except BaseException:
            self.core.stop(1.0)
            raise
        del ready
        self.processor = OutputProcessor(info, self._ready["capacity_tokens"])

    _ready: dict[str, Any] | None = None
    _batch_acks: list[str] | None = None  # inside `batched_adds`: the ids whose acks it waits for
    _num_stats = 0  # T messages received
    _num_waits = 0  # W answers received

    def _send(self, kind: bytes, payload: bytes) -> None:
        self._inp.send_multipart([kind, self.front_id.encode(), payload], copy=False)

    def _pump(self, timeout_ms: int) -> bool:
        """Receive what is there (waiting up to timeout_ms for the first); False if nothing."""
        events = dict(self._poller.poll(timeout_ms))
        if self._out not in events:
            if self.core.sentinel in events or not self.core.is_alive():
                raise RuntimeError(f"the engine core process died (exit code {self.core.exitcode})")
            return False
        while True:
            try:
                kind, payload = self._out.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if kind == b"O":
                items, stats = unpack(payload)
                self._stats = stats_from_wire(stats) if stats is not None else self._stats
                self._backlog.extend(decode_outputs(items))
            elif kind == b"K":
                for rid, k, msg in unpack(payload):
                    self._acks[rid] = (k, msg)
            elif kind == b"T":
                self._stats = stats_from_wire(unpack(payload))
                self._num_stats += 1
            elif kind == b"R":
                self._ready = unpack(payload)
            elif kind == b"W":
                self._num_waits += 1

    def _wait(self, cond: Callable[[], bool], timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise RuntimeError("the engine core did not answer in time")
            self._pump(1000)
        return True

    # ------------------------------------------------------------------ LLMEngine surface
    def add_request(
        self,
        request_id: str,
        prompt: Any,  # noqa: ANN401
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> None:
        reqs = self.processor.add_request(
            request_id, prompt, params, priority, arrival_time, cache_salt, lora_request
        )
        self._send(b"A", pickle.dumps((request_id, reqs), protocol=pickle.HIGHEST_PROTOCOL))
        # The core validates a structured-output spec and loads a LoRA adapter: wait for it
        # (inside `batched_adds`: once, for the whole batch).
        if reqs[0].params.structured_outputs is not None or lora_request is not None:
            if self._batch_acks is not None:
                self._batch_acks.append(request_id)
            else:
                self._check_acks([request_id])

    @contextlib.contextmanager
    def batched_adds(self) -> Iterator[None]:
        """Adds inside wait for the core's acks together on exit (one round trip for the
        batch, not one per constrained request: the core answers between its steps, so
        per-request waits cost a step each once it runs). On exit a refused request is dropped
        and its error raised, as `add_request` raises it (the first one; every refused request
        is dropped). Left by an exception, nothing is waited for: late acks are read by
        `step`."""
        if self._batch_acks is not None:  # nested: the outer block waits
            yield
            return
        self._batch_acks = []
        try:
            yield
        except BaseException:
            self._batch_acks = None
            raise
        ids, self._batch_acks = self._batch_acks, None
        self._check_acks(ids)

    def _check_acks(self, request_ids: list[str]) -> None:
        """Wait for the acks of request_ids; drop the refused ones and raise the first error."""
        self._wait(lambda: all(rid in self._acks for rid in request_ids), 600)
        first: Exception | None = None
        for rid in request_ids:
            kind, msg = self._acks.pop(rid)
            if kind is not None:
                self.processor.drop(rid)
                if first is None:
                    first = ValueError(msg) if kind == "value" else RuntimeError(msg)
        if first is not None:
            raise first

    def abort_request(self, request_ids: Any) -> None:  # noqa: ANN401
        for rid in list(request_ids):
            ids = self.processor.drop(rid)
            if ids:
                self._send(b"X", pack([ids, False]))

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.processor.get_num_unfinished_requests()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """The outputs of whatever core steps arrived (waits for at least one message)."""
        if not self._backlog:
            self._pump(100)
        refused = []
        for rid, (kind, msg) in list(self._acks.items()):
            del self._acks[rid]
            if kind is not None:
                out = self.processor.fail(rid, msg or "refused by the engine core")
                if out is not None:
                    refused.append(out)
        outs, self._backlog = self._backlog, []
        outputs, stopped = self.processor.process(outs, final_only)
        if stopped:
            self._send(b"X", pack([stopped, True]))
        return refused + outputs

    def get_stats(self) -> EngineStats:
        """The core's latest stats; when idle, fresh ones (asked for and waited on)."""
        if not self.has_unfinished_requests() or self._stats is None:
            seen = self._num_stats
            self._send(b"Q", b"")
            self._wait(lambda: self._num_stats > seen, 60)
        assert self._stats is not None
        return self._stats

    def wait_compiled(self, timeout: float = 1800.0) -> None:
        """Block until the core's background compiles are done (`EngineCore.wait_compiled`);
        outputs that arrive meanwhile are kept for the next `step`."""
        seen = self._num_waits
        self._send(b"W", b"")
        self._wait(lambda: self._num_waits > seen, timeout)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            if self.core.is_alive():
                self._send(b"S", b"")
        self.core.stop(30.0)
        with contextlib.suppress(Exception):
            self._inp.close(linger=0)
            self._out.close(linger=0)
            self._ctx.term()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()
