"""Grammar compilation in killable worker processes.

xgrammar's `compile_grammar` runs in C++ and cannot be interrupted: on a thread, a runaway
compile (a 4 MB regex, a 100k-entry choice list) keeps the CPU after its client left, queues every
later grammar behind it and holds shutdown. Here each compile runs in one of `workers` processes
(a fresh `python -m xlaserve.structured.compile_pool`: nothing of the engine's threads or
the caller's __main__ is inherited); a compile past its deadline, or
cancelled because every request waiting on it was aborted, gets its process killed (SIGKILL) and
a fresh one started for the next job. Results come back as xgrammar's JSON serialisation and are
deserialised against the engine's `TokenizerInfo`.

Rules:
- `submit(grammar_json, timeout)` returns a `concurrent.futures.Future` resolved with the
  compiled grammar's JSON text, or with `CompileTimeout` / `CompileCancelled` / `RuntimeError`
  (the worker's error message, e.g. a grammar xgrammar refuses).
- `cancel(future)` kills the compile (or drops it while queued); `shutdown()` kills every worker
  without waiting. Threads are daemons: nothing here can keep the process alive.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO

logger = logging.getLogger(__name__)

# How often a slot thread looks at its job's deadline / cancel flag while the worker compiles.
_POLL_S = 0.02
# A worker that has not said it is ready after this long is replaced.
_START_LIMIT_S = 120.0


class CompileTimeout(RuntimeError):
    """The compile ran past its deadline; its worker was killed."""


class CompileCancelled(RuntimeError):
    """Nobody waits for the grammar any more; its worker was killed."""


# Frames on the worker's stdin / stdout: 4-byte big-endian length, then UTF-8 text. Replies
# start with one kind letter: "R" ready, "O" compiled grammar JSON, "E" error message.


def _write_frame(f: IO[bytes], text: str) -> None:
    data = text.encode("utf-8")
    f.write(struct.pack(">I", len(data)) + data)
    f.flush()


def _read_exact(f: IO[bytes], n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise EOFError("worker pipe closed")
        buf += chunk
    return buf


def _read_frame(f: IO[bytes]) -> str:
    (n,) = struct.unpack(">I", _read_exact(f, 4))
    return _read_exact(f, n).decode("utf-8")


def _worker_main() -> None:  # pragma: no cover - runs in the child process
    """`python -m xlaserve.structured.compile_pool`: first frame the TokenizerInfo JSON, then
    one grammar JSON per frame; answers one frame per grammar."""
    import xgrammar as xgr

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    info = xgr.TokenizerInfo.deserialize_json(_read_frame(stdin))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write_frame(stdout, "R")
    while True:
        try:
            grammar_json = _read_frame(stdin)
        except EOFError:
            return
        try:
            compiled = compiler.compile_grammar(xgr.Grammar.deserialize_json(grammar_json))
            reply = "O" + compiled.serialize_json()
        except Exception as e:  # noqa: BLE001 - reported to the parent as the job's error
            reply = f"E{type(e).__name__}: {e}"
        _write_frame(stdout, reply)


@dataclass(eq=False)
class _Job:
    grammar_json: str
    timeout: float
    future: cf.Future = field(default_factory=cf.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)


class CompilePool:
    """`workers` compile processes, each driven by one daemon slot thread."""

    def __init__(self, tokenizer_info_json: str, workers: int) -> None:
        self._info = tokenizer_info_json
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen] = {}  # slot -> live process (for shutdown)
        # Compiles stopped by their deadline (worker killed) / cancelled by an abort or
        # shutdown (worker killed when it had started, else dropped from the queue).
        self.num_timeouts = 0
        self.num_cancels = 0
        self._by_future: dict[cf.Future, _Job] = {}
        self._threads = [
            threading.Thread(
                target=self._slot, args=(i,), name=f"xlaserve-grammar-{i}", daemon=True
            )
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    # ----- API --------------------------------------------------------------------------------

    def submit(self, grammar_json: str, timeout: float) -> cf.Future:
        job = _Job(grammar_json, timeout)
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the grammar compile pool is shut down")
            self._by_future[job.future] = job
        job.future.add_done_callback(self._forget)
        self._jobs.put(job)
        return job.future

    def cancel(self, future: cf.Future) -> None:
        """Stop the compile behind `future` (its worker is killed if it already started)."""
        with self._lock:
            job = self._by_future.get(future)
        if job is not None:
            job.cancelled.set()

    def shutdown(self) -> None:
        """Kill every worker now; queued jobs fail with CompileCancelled. Never waits on a
        compile."""
        with self._lock:
            self._stop.set()
            procs = list(self._procs.values())
            jobs = list(self._by_future.values())
        for job in jobs:
            job.cancelled.set()
        for p in procs:
            _kill(p)
        for _ in self._threads:
            self._jobs.put(None)

    @property
    def num_killed(self) -> int:
        return self.num_timeouts + self.num_cancels

    @property
    def num_workers(self) -> int:
        return len(self._threads)

    # ----- slot threads -----------------------------------------------------------------------

    def _forget(self, fut: cf.Future) -> None:
        with self._lock:
            self._by_future.pop(fut, None)

    def _start(self, slot: int) -> subprocess.Popen | None:
        """A fresh worker process, ready for jobs; None when the pool stops or it failed."""
        try:
            # A plain interpreter running this module: no multiprocessing start method, so the
            # parent's __main__ is never re-imported and no engine thread state is inherited.
            p = subprocess.Popen(
                [sys.executable, "-m", "xlaserve.structured.compile_pool"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        except OSError:
            logger.exception("could not start a grammar compile worker")
            return None
        with self._lock:
            if self._stop.is_set():
                _kill(p)
                return None
            self._procs[slot] = p
        try:
            _write_frame(p.stdin, self._info)  # type: ignore[arg-type]
            if _wait_readable(p, self._stop, _START_LIMIT_S) and _read_frame(p.stdout) == "R":  # type: ignore[arg-type]
                return p
        except (EOFError, OSError, ValueError):  # ValueError: pipe closed by shutdown
            pass
        if not self._stop.is_set():
            logger.error("a grammar compile worker failed to start (exit code %s)", p.poll())
        self._drop(slot, p)
        return None

    def _slot(self, slot: int) -> None:
        worker: subprocess.Popen | None = None
        try:
            while not self._stop.is_set():
                if worker is None:
                    worker = self._start(slot)  # a warm worker waits for the next job
                    if worker is None:
                        self._stop.wait(1.0)  # a worker that cannot start: do not spin
                        continue
                job = self._jobs.get()
                if job is None:
                    return
                if job.cancelled.is_set() or not job.future.set_running_or_notify_cancel():
                    self.num_cancels += 1
                    _fail(job, CompileCancelled("compile cancelled before it started"))
                    continue
                if not self._run(job, worker):
                    self._drop(slot, worker)
                    worker = None
        finally:
            if worker is not None:
                self._drop(slot, worker)

    def _run(self, job: _Job, proc: subprocess.Popen) -> bool:
        """Run one job on `proc`; False when the worker was killed (or died)."""
        deadline = time.monotonic() + job.timeout
        try:
            _write_frame(proc.stdin, job.grammar_json)  # type: ignore[arg-type]
            while not _wait_readable(proc, None, _POLL_S):
                if job.cancelled.is_set() or self._stop.is_set():
                    self.num_cancels += 1
                    _fail(job, CompileCancelled("grammar compile cancelled"))
                    return False
                if time.monotonic() > deadline:
                    self.num_timeouts += 1
                    _fail(
                        job,
                        CompileTimeout(
                            f"grammar compile took longer than {job.timeout:g} s "
                            "(grammar_compile_timeout)"
                        ),
                    )
                    return False
            reply = _read_frame(proc.stdout)  # type: ignore[arg-type]
        except (EOFError, OSError, ValueError):  # ValueError: pipe closed by shutdown
            _fail(job, RuntimeError("the grammar compile worker died"))
            return False
        if reply[:1] == "O":
            job.future.set_result(reply[1:])
        else:
            _fail(job, RuntimeError(reply[1:]))
        return True

    def _drop(self, slot: int, proc: subprocess.Popen) -> None:
        _kill(proc)
        with self._lock:
            if self._procs.get(slot) is proc:
                del self._procs[slot]


def _wait_readable(proc: subprocess.Popen, stop: threading.Event | None, limit: float) -> bool:
    """True once the worker's stdout has data (or EOF) within `limit` seconds."""
    end = time.monotonic() + limit
    fd = proc.stdout.fileno()  # type: ignore[union-attr]
    while True:
        left = end - time.monotonic()
        if left <= 0 or (stop is not None and stop.is_set()):
            return False
        ready, _, _ = select.select([fd], [], [], min(left, 0.05))
        if ready:
            return True


def _fail(job: _Job, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered yet
        pass


if __name__ == "__main__":  # pragma: no cover - the worker process
    _worker_main()
