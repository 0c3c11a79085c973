"""XLA multi-host: one engine on host 0, every host running each model step.

JAX on a multi-host TPU slice is multi-controller: each host runs the same program and every
compiled step must be launched on every host, with the same inputs, in the same order. xlaserve
keeps ONE engine core (scheduler, block manager, detokenizer, HTTP server) on host 0 and makes
the other hosts ("followers") mirror its runner:

1. `init_multihost(parallel_config)` (called by XlaModelRunner before any JAX backend starts)
   joins `jax.distributed` (coordinator = host 0 at master_addr:master_port, or, with no
   master_addr, JAX's cluster auto-detection, e.g. Cloud TPU metadata), so `jax.devices()` lists
   every chip of every host and the runner's mesh spans them all.
2. Host 0 opens a TCP listener; its address, port and a random token are broadcast once to the
   other hosts (`multihost_utils.broadcast_one_to_all`, start-up only) and each follower connects.
3. Every host loads the model, sizes the KV cache (the minimum over hosts) and compiles the same
   programs. Then followers enter `follower_loop`: receive each SchedulerOutput that host 0's
   runner is about to execute (pickled, length-prefixed), execute it on their runner (same
   per-request state, same seeds, same collectives), drop the output. Host 0 alone returns
   RunnerOutputs to its engine. On host 0's `runner.shutdown()` or process exit, a STOP message
   ends the loop and the follower process exits (`SystemExit(0)`): on follower hosts `LLM(...)`
   / `xlaserve serve` never return, they serve host 0 until it stops.

Why a TCP channel and not a device collective per step (`broadcast_one_to_all` of the pickled
bytes): a serving engine idles for long stretches, and a follower would sit inside a device
collective the whole time (collective timeouts on gloo/NCCL, and every step would pay two device
round trips plus a compile per message-size bucket). One TCP stream per follower is ordered,
costs ~tens of microseconds per step on the host, never touches the accelerator, and an idle
follower simply blocks in `recv`. The start-up rendezvous does use a collective: all hosts are
there at that moment anyway.
"""

from __future__ import annotations

import atexit
import hmac
import logging
import os
import pickle
import secrets
import socket
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from xlaserve.config import EngineConfig
    from xlaserve.runner import SchedulerOutput

logger = logging.getLogger(__name__)

EXECUTE, STOP = "execute", "stop"
_HEADER = struct.Struct("!Q")  # payload length
_HELLO = struct.Struct("!32sI")  # token (32 ascii hex chars), follower process id
_RENDEZVOUS_BYTES = 512  # fixed size of the broadcast "host port token" record
CONNECT_TIMEOUT_S = float(os.environ.get("XLASERVE_MULTIHOST_TIMEOUT", "300"))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("host 0 closed the step channel")
        buf += chunk
    return bytes(buf)


class StepSender:
    """Host 0's end: a listener that accepts one connection per follower, then sends each
    message to all of them in order."""

    def __init__(self, num_followers: int, bind: str = "") -> None:
        self.num_followers = num_followers
        self.token = secrets.token_hex(16)  # 32 hex chars; followers must present it
        self._server = socket.create_server((bind, 0))
        self.port: int = self._server.getsockname()[1]
        self._conns: dict[int, socket.socket] = {}

    def accept(self, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Wait for every follower (a wrong token is dropped, not fatal). TimeoutError after
        `timeout` seconds with followers missing."""
        self._server.settimeout(timeout)
        try:
            while len(self._conns) < self.num_followers:
                try:
                    conn, _ = self._server.accept()
                except TimeoutError:
                    raise TimeoutError(
                        f"multi-host: {len(self._conns)} of {self.num_followers} follower hosts "
                        f"connected to the step channel within {timeout:.0f}s"
                    ) from None
                conn.settimeout(timeout)
                try:
                    token, pid = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
                except (ConnectionError, TimeoutError, OSError):
                    conn.close()
                    continue
                if not hmac.compare_digest(token, self.token.encode()):
                    logger.warning("multi-host: dropped a step-channel connection with a bad token")
                    conn.close()
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._conns[pid] = conn
        finally:
            self._server.close()

    def send(self, kind: str, payload: Any = None) -> None:
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        msg = _HEADER.pack(len(data)) + data
        for pid, conn in self._conns.items():
            try:
                conn.sendall(msg)
            except OSError as e:
                raise ConnectionError(f"multi-host: follower process {pid} is gone ({e})") from e

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._server.close()


class StepReceiver:
    """A follower's end: connects to host 0 and yields its messages in order."""

    def __init__(
        self, host: str, port: int, token: str, process_id: int, timeout: float = CONNECT_TIMEOUT_S
    ) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.sendall(_HELLO.pack(token.encode(), process_id))
        self._sock.settimeout(None)  # an idle engine sends nothing for a long time

    def recv(self) -> tuple[str, Any]:
        """(kind, payload). ConnectionError when host 0 went away without a STOP."""
        (n,) = _HEADER.unpack(_recv_exact(self._sock, _HEADER.size))
        return pickle.loads(_recv_exact(self._sock, n))  # noqa: S301 - host 0 of our own job

    def close(self) -> None:
        self._sock.close()


def follower_loop(runner: Any, channel: StepReceiver) -> int:
    """Execute each SchedulerOutput host 0 sends until STOP; returns the number of steps run.

    An exception in a step is logged and the loop goes on: host 0 runs the same step on the same
    state, hits the same error and reports it to its engine."""
    steps = 0
    while True:
        kind, payload = channel.recv()
        if kind == STOP:
            return steps
        if kind != EXECUTE:
            raise ValueError(f"multi-host: unknown step-channel message {kind!r}")
        try:
            runner.execute(payload)
        except Exception:  # noqa: BLE001 - mirrored on host 0, which reports it
            logger.exception("multi-host follower: step %d failed", steps)
        steps += 1


def _leader_address(master_addr: str | None) -> str:
    """The address followers reach host 0 at: master_addr, else the jax.distributed
    coordinator's host (auto-detected on Cloud TPU), else this host's name."""
    if master_addr:
        return master_addr
    try:
        from jax._src import distributed

        coord = distributed.global_state.coordinator_address
        if coord:
            return coord.rsplit(":", 1)[0].strip("[]")
    except (ImportError, AttributeError):
        pass
    return socket.gethostbyname(socket.gethostname())


def _broadcast_record(record: str | None) -> str:
    """Host 0's `record` on every host (a collective: every process must call it)."""
    from jax.experimental import multihost_utils

    buf = np.zeros(_RENDEZVOUS_BYTES, np.uint8)
    if record is not None:
        raw = record.encode()
        if len(raw) > _RENDEZVOUS_BYTES:
            raise ValueError(f"multi-host rendezvous record too long ({len(raw)} bytes)")
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return out.astype(np.uint8).tobytes().rstrip(b"\0").decode()


@dataclass
class MultiHost:
    """This process's part in a multi-host XLA engine (see the module docstring)."""

    process_id: int
    num_processes: int
    sender: StepSender | None = None  # host 0
    receiver: StepReceiver | None = None  # followers
    stopped: bool = False
    steps: int = field(default=0)

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def connect(self, master_addr: str | None) -> None:
        """Open the step channel (every host must call this at the same point)."""
        if self.is_leader:
            self.sender = StepSender(self.num_processes - 1)
            record = f"{_leader_address(master_addr)} {self.sender.port} {self.sender.token}"
            _broadcast_record(record)
            self.sender.accept()
            atexit.register(self.stop)
        else:
            host, port, token = _broadcast_record(None).split()
            self.receiver = StepReceiver(host, int(port), token, self.process_id)

    # ---------------------------------------------------------------- runner hooks
    def before_execute(self, so: SchedulerOutput) -> None:
        """Host 0: send the step to the followers before running it itself."""
        if self.sender is not None and not self.stopped:
            self.sender.send(EXECUTE, so)

    def min_over_hosts(self, n: int) -> int:
        """The minimum of `n` over all hosts (KV blocks: every host must allocate the same)."""
        from jax.experimental import multihost_utils

        return int(np.min(multihost_utils.process_allgather(np.asarray(n, np.int64))))

    def serve_if_follower(self, runner: Any) -> None:
        """Followers: run host 0's steps until it stops, then end the process (SystemExit);
        host 0: return at once."""
        if self.receiver is None:
            return
        logger.info("multi-host follower %d: running host 0's steps", self.process_id)
        try:
            self.steps = follower_loop(runner, self.receiver)
        except ConnectionError as e:
            logger.error("multi-host follower %d: %s; exiting", self.process_id, e)
            raise SystemExit(1) from e
        finally:
            self.receiver.close()
        runner.shutdown()
        logger.info("multi-host follower %d: ran %d steps; exiting", self.process_id, self.steps)
        raise SystemExit(0)

    def stop(self) -> None:
        """Host 0: tell the followers to finish (runner shutdown or process exit); idempotent."""
        if self.stopped:
            return
        self.stopped = True
        if self.sender is not None:
            try:
                self.sender.send(STOP)
            except ConnectionError:
                logger.warning("multi-host: a follower was already gone at shutdown")
            self.sender.close()


def init_multihost(config: EngineConfig) -> MultiHost | None:
    """Join jax.distributed when `parallel.nnodes > 1` (or when the caller already joined a
    multi-process job); None on a single host. Must run before any JAX backend starts.

    Checks: process count == nnodes, tensor_parallel_size == every device of every host, no KV
    offload (its copies read whole KV blocks on one host).
    """
    import jax

    pc = config.parallel
    if pc.nnodes == 1 and not jax.distributed.is_initialized():
        return None
    if config.cache.kv_offload_bytes:
        raise ValueError("multi-host XLA does not support KV offload (kv_offload_bytes) yet")
    if not jax.distributed.is_initialized():
        from xlaserve.platforms import current_platform

        if current_platform.name == "cpu":  # CPU collectives across processes (tests)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if pc.master_addr:
            if pc.node_rank is None:
                raise ValueError("nnodes > 1 with master_addr needs node_rank (this host's index)")
            jax.distributed.initialize(
                coordinator_address=f"{pc.master_addr}:{pc.master_port}",
                num_processes=pc.nnodes,
                process_id=pc.node_rank,
                initialization_timeout=int(CONNECT_TIMEOUT_S),
            )
        else:  # Cloud TPU (and other clusters JAX detects): everything from the environment
            jax.distributed.initialize()
    n, pid = jax.process_count(), jax.process_index()
    if n == 1:
        return None
    if pc.nnodes not in (1, n):
        raise ValueError(f"nnodes is {pc.nnodes} but jax.distributed joined {n} processes")
    if pc.node_rank is not None and pc.node_rank != pid:
        raise ValueError(f"node_rank is {pc.node_rank} but jax.distributed says {pid}")
    if pc.tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"multi-host XLA: tensor_parallel_size must be the number of devices of all hosts "
            f"({jax.device_count()} = {n} hosts x {jax.local_device_count()}), got "
            f"{pc.tensor_parallel_size}"
        )
    mh = MultiHost(pid, n)
    mh.connect(pc.master_addr)
    logger.info("multi-host XLA: process %d of %d, %d devices", pid, n, jax.device_count())
    return mh
