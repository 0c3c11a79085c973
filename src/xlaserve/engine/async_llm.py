"""AsyncLLM: the asyncio front of one LLMEngine, for the server.

The engine is not thread-safe, so exactly one background thread owns it: it drains a command
queue (add / abort / stop), runs `engine.step()` while work is pending, and hands each request's
outputs to that request's asyncio queue with `loop.call_soon_threadsafe` (one call per event
loop per step). Callers never touch the engine; they `await generate(...)` and iterate.

Failure model:
- `add_request` errors (bad prompt, context too long) raise `ValueError` in the caller; any
  other exception while adding fails only that request (`RequestFailedError`); a full waiting
  queue (`scheduler.max_num_waiting`) raises `EngineQueueFullError`.
- A consumer that stops iterating (client disconnect -> CancelledError / GeneratorExit) aborts
  its request, which frees its KV blocks at the top of the next loop iteration.
- If the loop thread crashes, the AsyncLLM becomes `errored`: every pending and future request
  fails promptly with `EngineDeadError` (the server's /health answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xlaserve.metrics import RequestRecord
from xlaserve.outputs import RequestOutput
from xlaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xlaserve.config import EngineConfig
    from xlaserve.engine.llm_engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (crashed or shut down)."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (the engine itself keeps running)."""


class EngineQueueFullError(RuntimeError):
    """The waiting queue is at `scheduler.max_num_waiting`; retry later."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class _Stream:
    """Per-request channel from the loop thread to one asyncio consumer."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | BaseException
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None  # stamped by the loop thread
    finished_time: float | None = None
    # Seconds between successive outputs carrying new tokens, as the consumer saw them
    # (inter_token_latency_seconds); filled by `iterate`.
    itl: list[float] = field(default_factory=list)
    last_token_seen: float | None = None  # when the consumer last got new tokens


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: _Stream
    done: asyncio.Future  # resolved with None or an exception
    lora_request: Any = None  # xlaserve.lora.LoRARequest (None: the base model)


@dataclass
class _Abort:
    request_id: str


_STOP = object()


def _note_tokens(stream: _Stream, prev: RequestOutput | None, out: RequestOutput) -> None:
    """Record the gap since the last output that brought tokens, when this one brings more
    (after the first token): the request's inter-token latencies."""
    n = sum(len(o.token_ids) for o in out.outputs)
    n_prev = sum(len(o.token_ids) for o in prev.outputs) if prev is not None else 0
    if n <= n_prev:
        return
    now = time.monotonic()
    if stream.last_token_seen is not None:
        stream.itl.append(now - stream.last_token_seen)
    stream.last_token_seen = now


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class AsyncLLM:
    """Async serving front of an `LLMEngine` (which it owns: `shutdown()` shuts it down)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._cmd_lock = threading.Lock()  # orders "is it dead?" checks with the crash handler
        self._streams: dict[str, _Stream] = {}  # touched only by the loop thread
        self._dead: EngineDeadError | None = None
        self._finish_listeners: list[Callable[[RequestRecord], None]] = []
        self.stats: EngineStats = engine.get_stats()  # latest snapshot, replaced each iteration
        self._thread = threading.Thread(target=self._run, name="xlaserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        from xlaserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config))

    # ------------------------------------------------------------------ read-only views
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer  # encode/decode are safe from any thread

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def add_finish_listener(self, fn: Callable[[RequestRecord], None]) -> None:
        """`fn(record)` runs on the consumer's event loop once per request that ends."""
        self._finish_listeners.append(fn)

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> _Stream:
        """Queue a request and wait until the engine accepted it (raises ValueError etc.)."""
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop)
        done = loop.create_future()
        with self._cmd_lock:
            if self._dead is not None:
                raise self._dead
            self._commands.put(
                _Add(request_id, prompt, params, priority, cache_salt, stream, done, lora_request)
            )
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until one has `finished=True`.

        Outputs that pile up while the consumer is busy are coalesced (each is cumulative, so the
        latest supersedes the rest). Leaving the loop early aborts the request: wrap it in
        `contextlib.aclosing(...)` (or call `aclose()`) so the abort happens right away rather
        than when the generator is garbage-collected. Raises ValueError (rejected request),
        EngineQueueFullError, EngineDeadError.
        """
        stream = await self.add_request(
            request_id, prompt, params, priority, cache_salt, lora_request=lora_request
        )
        async with contextlib.aclosing(self.iterate(stream)) as outputs:
            async for out in outputs:
                yield out

    async def iterate(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """Outputs of a request added with `add_request` (see `generate`); closing it aborts."""
        finished = False
        last: RequestOutput | None = None
        try:
            while True:
                item = await stream.queue.get()
                while not isinstance(item, BaseException) and not stream.queue.empty():
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                _note_tokens(stream, last, item)
                last = item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(stream.request_id)
            self._record(stream, last, finished)

    def _record(self, stream: _Stream, last: RequestOutput | None, finished: bool) -> None:
        if not self._finish_listeners:
            return
        if finished and last is not None:
            reasons = [o.finish_reason for o in last.outputs]
            reason = "error" if last.error else (reasons[0] or "stop")
        else:
            reason = "error" if self._dead is not None else "abort"
        n_prompt = len(last.prompt_token_ids) if last is not None else 0
        n_gen = sum(len(o.token_ids) for o in last.outputs) if last is not None else 0
        m = last.metrics if last is not None else None
        rec = RequestRecord(
            arrival_time=stream.arrival_time,
            first_token_time=stream.first_token_time,
            finished_time=stream.finished_time or time.monotonic(),
            num_prompt_tokens=n_prompt,
            num_generation_tokens=n_gen,
            finish_reason=reason,
            first_scheduled_time=m.first_scheduled_time if m is not None else None,
            last_token_time=m.last_token_time if m is not None else None,
            engine_first_token_time=m.first_token_time if m is not None else None,
            n=len(last.outputs) if last is not None else 1,
            inter_token_latencies=stream.itl,
        )
        for fn in self._finish_listeners:
            try:
                fn(rec)
            except Exception:  # a metrics bug must not break serving
                logger.exception("finish listener failed")

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent; unknown ids are ignored)."""
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop thread, fail pending requests, shut the engine down."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                cmds = [self._commands.get()] if idle else []
                while True:
                    try:
                        cmds.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if any(c is _STOP for c in cmds):
                    self._fail_all(EngineDeadError("the engine was shut down"), cmds)
                    return
                for c in cmds:
                    self._apply(c)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        self._dispatch(outputs)
                self.stats = engine.get_stats()
        except BaseException as e:  # noqa: BLE001 - any crash kills the loop; tell everyone
            logger.exception("engine loop crashed")
            self._fail_all(EngineDeadError(f"engine loop crashed: {type(e).__name__}: {e}"), [])

    def _apply(self, cmd: Any) -> None:
        engine = self.engine
        if isinstance(cmd, _Abort):
            stream = self._streams.pop(cmd.request_id, None)
            if stream is not None:
                engine.abort_request([cmd.request_id])
            return
        assert isinstance(cmd, _Add)
        err: BaseException | None = None
        limit = engine.config.scheduler.max_num_waiting
        if limit is not None and engine.get_stats().num_waiting >= limit:
            err = EngineQueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        else:
            try:
                engine.add_request(
                    cmd.request_id,
                    cmd.prompt,
                    cmd.params,
                    priority=cmd.priority,
                    cache_salt=cmd.cache_salt,
                    lora_request=cmd.lora_request,
                )
                self._streams[cmd.request_id] = cmd.stream
            except ValueError as e:
                err = e
            except Exception as e:  # noqa: BLE001 - one bad request must not kill the loop
                logger.exception("add_request %s failed", cmd.request_id)
                with contextlib.suppress(Exception):  # undo whatever was half-added
                    engine.abort_request([cmd.request_id])
                err = RequestFailedError(
                    f"the engine could not accept this request: {type(e).__name__}: {e}"
                )
        self._call(cmd.stream.loop, _resolve, cmd.done, err)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
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
            self._call(loop, _deliver, items)

    def _fail_all(self, err: EngineDeadError, cmds: list[Any]) -> None:
        with self._cmd_lock:
            self._dead = err
        while True:  # nothing new can be queued past the lock: drain what is there
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for c in cmds:
            if isinstance(c, _Add):
                self._call(c.stream.loop, _resolve, c.done, err)
        for stream in self._streams.values():
            self._call(stream.loop, _deliver, [(stream.queue, err)])
        self._streams.clear()

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that event loop is closed; nobody is listening
            pass


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
