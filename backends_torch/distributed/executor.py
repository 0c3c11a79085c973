"""Executors: the `ModelRunner` protocol over `tensor_parallel_size` ranks, one `TorchModelRunner`
shard per rank (per device), joined by torch.distributed (NCCL on CUDA, gloo on CPU).

Every rank runs the same `execute` on the same `SchedulerOutput`: row-parallel all-reduces make
the hidden states identical on every rank and the logits are all-gathered, so each rank holds the
full logits and samples the same tokens (same seeds, same generators): the runners' per-request
token lists stay in step without sending sampled tokens around. Only rank 0's `RunnerOutput` is
returned to the engine.

- `MultiprocExecutor` ("mp", one host): rank 0 is the engine process; ranks 1..tp-1 are spawned
  with torch.multiprocessing. Each call is broadcast (pickled, over a gloo group) to the workers,
  then run by rank 0 itself.
- `RayExecutor` ("ray", several hosts): every rank is a Ray actor (Ray places them on GPUs across
  the cluster); the engine process only sends each call to all actors and keeps rank 0's answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from xlaserve.backends_torch.distributed import parallel_state as ps
from xlaserve.config import EngineConfig
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.runner import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# Families whose torch model builds every layer through the TP-aware factories.
TP_FAMILIES = ("llama", "granite", "gemma", "gpt2", "gpt_neox", "starcoder2")


def check_tensor_parallel(config: EngineConfig, spec: ModelSpec) -> None:
    """Raise ValueError / NotImplementedError (clear message) when `spec` cannot be split
    `tensor_parallel_size` ways by the torch backend."""
    tp = config.parallel.tensor_parallel_size
    if spec.family not in TP_FAMILIES:
        raise NotImplementedError(
            f"torch tensor parallelism does not support model family {spec.family!r} yet "
            f"(supported: {', '.join(TP_FAMILIES)}); use tensor_parallel_size=1 or backend='xla'"
        )
    if spec.qk_norm and spec.qk_norm_scope == "full":
        raise NotImplementedError("torch tensor parallelism: full-projection qk-norm (OLMo2)")
    if config.model.quantization is not None:
        raise NotImplementedError("torch tensor parallelism with weight quantization")
    if config.cache.kv_offload_bytes:
        raise NotImplementedError("torch tensor parallelism with KV offloading")
    hq, hkv = spec.num_heads, spec.num_kv_heads
    if hq % tp:
        raise ValueError(
            f"num_attention_heads ({hq}) must be divisible by tensor_parallel_size ({tp})"
        )
    if (hkv >= tp and hkv % tp) or (hkv < tp and tp % hkv):
        raise ValueError(
            f"num_key_value_heads ({hkv}) and tensor_parallel_size ({tp}) must divide one another"
        )
    if spec.intermediate_size % tp:
        raise ValueError(
            f"intermediate_size ({spec.intermediate_size}) must be divisible by "
            f"tensor_parallel_size ({tp})"
        )
    if (
        torch.cuda.is_available()
        and torch.cuda.device_count() < tp
        and (config.parallel.distributed_executor_backend == "mp")
    ):
        raise ValueError(
            f"tensor_parallel_size {tp} needs {tp} GPUs on this host, found "
            f"{torch.cuda.device_count()} (use distributed_executor_backend='ray' across hosts)"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _dist_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _make_runner(config: EngineConfig, spec: ModelSpec) -> Any:  # noqa: ANN401
    from xlaserve.backends_torch.runner import TorchModelRunner

    return TorchModelRunner(config, spec)


def run_command(runner: Any, method: str, args: tuple) -> Any:  # noqa: ANN401
    """What every rank does for one call; the KV block count is the minimum over ranks."""
    if method == "determine_num_kv_blocks":
        n = torch.tensor([runner.determine_num_kv_blocks()], dtype=torch.int64)
        group = ps.get_tp_group()
        if group is not None:
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group.cpu_group)
        return int(n.item())
    return getattr(runner, method)(*args)


_READY = "xlaserve/ready/{}"


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    config: EngineConfig,
    spec: ModelSpec,
) -> None:
    """Ranks 1..tp-1 of the mp executor: receive each call from rank 0, run it, until shutdown.
    Any error ends the process (rank 0 then fails its next collective and reports it).

    Signals: a worker ignores SIGINT and SIGTERM, which a terminal's Ctrl-C or a service
    manager's stop sends to the whole process group: rank 0 stops it (the shutdown broadcast,
    then SIGKILL if it hangs), so the group's stop ends without a gloo "connection reset"
    traceback. It dies with rank 0 (PR_SET_PDEATHSIG, SIGKILL)."""
    _quiet_worker_signals()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:  # CPU ranks share the host's cores: do not oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        store.set(_READY.format(rank), "1")
        group = ps.init_tensor_parallel(rank, world_size, backend=backend, store=store)
        runner = _make_runner(config, spec)
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=group.cpu_group)
            method, args = box[0]
            if method == "shutdown":
                runner.shutdown()
                break
            run_command(runner, method, args)
    except BaseException as e:  # noqa: BLE001 - report, then die so rank 0 notices
        if _peer_gone(e):  # rank 0 exited first (it was killed): nothing to report
            logger.warning("tensor-parallel rank %d: rank 0 went away; exiting", rank)
            os._exit(1)
        traceback.print_exc()
        os._exit(1)
    ps.destroy_tensor_parallel()
    # Skip the interpreter's teardown (torch's atexit hooks, module GC): seconds on a loaded
    # host, and rank 0 gives a worker only STOP_GRACE_S before it kills it.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _quiet_worker_signals() -> None:
    """Ignore SIGINT/SIGTERM; SIGKILL this process when its parent (rank 0) dies (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PDEATHSIG


def _peer_gone(e: BaseException) -> bool:
    """A collective failed because the other end closed its connection (gloo / TCPStore)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        m in text for m in ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    )


# How long a worker gets to exit after the shutdown message before rank 0 kills it (a clean
# exit takes well under a second: destroy the group, os._exit).
STOP_GRACE_S = 5.0


def _join_all(procs: list[Any], timeout_s: float) -> None:
    """Join `procs` within one deadline of `timeout_s` for all of them (not one each)."""
    end = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))


class MultiprocExecutor:
    """`ModelRunner` over tp ranks on one host: rank 0 here, ranks 1..tp-1 spawned processes."""

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        check_tensor_parallel(config, spec)
        self.world_size = tp = config.parallel.tensor_parallel_size
        backend = _dist_backend()
        # Rank 0 hosts the rendezvous store; it waits for every worker to check in (and fails
        # fast if one dies while starting) before joining the process group.
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False)
        ctx = torch.multiprocessing.get_context("spawn")
        self.workers = [
            ctx.Process(
                target=_worker_main,
                args=(rank, tp, store.port, backend, config, spec),
                name=f"xlaserve-tp{rank}",
                daemon=True,
            )
            for rank in range(1, tp)
        ]
        for p in self.workers:
            p.start()
        self._broken = False
        try:
            if backend == "nccl":
                torch.cuda.set_device(0)
            self._wait_ready(store, float(os.environ.get("XLASERVE_TP_START_TIMEOUT", "600")))
            self.group = ps.init_tensor_parallel(0, tp, backend=backend, store=store)
            self.runner = _make_runner(config, spec)
        except BaseException:
            self._kill_workers()
            ps.destroy_tensor_parallel()
            raise
        logger.info("tensor parallel: %d ranks over %s (mp)", tp, backend)

    def _wait_ready(self, store: dist.TCPStore, timeout_s: float) -> None:
        keys = [_READY.format(r) for r in range(1, self.world_size)]
        end = time.monotonic() + timeout_s
        while not store.check(keys):
            self._check_workers()
            if time.monotonic() > end:
                raise TimeoutError(f"tensor-parallel workers did not start in {timeout_s:.0f} s")
            time.sleep(0.05)

    def _check_workers(self) -> None:
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.workers) if not p.is_alive()]
        if dead:
            self._broken = True
            raise RuntimeError(
                "tensor-parallel worker(s) exited: "
                + ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
                + "; see their traceback above (workers are spawned: a script that builds an "
                "engine must do it under `if __name__ == '__main__':`)"
            )

    def _call(self, method: str, *args: Any) -> Any:  # noqa: ANN401
        self._check_workers()
        try:
            dist.broadcast_object_list([(method, args)], src=0, group=self.group.cpu_group)
            return run_command(self.runner, method, args)
        except BaseException:
            self._broken = True
            raise

    # ---- ModelRunner -------------------------------------------------------------------------
    def load_model(self) -> None:
        self._call("load_model")

    def determine_num_kv_blocks(self) -> int:
        return self._call("determine_num_kv_blocks")

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call("init_kv_cache", num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self._call("execute", scheduler_output)

    def shutdown(self) -> None:
        """Stop the workers, bounded: the shutdown message and at most STOP_GRACE_S for them to
        exit, then SIGKILL. A broken executor (a call failed or was interrupted, e.g. SIGTERM's
        SystemExit in the middle of a forward) kills them at once: a worker then sits in a
        collective that rank 0 abandoned, which only the group timeout (30 min) would end.
        The kill runs even when this is interrupted, so the process never exits with live
        workers (multiprocessing's exit handler joins its children without a timeout)."""
        if not self.workers and ps.get_tp_group() is None:
            return
        try:
            # A dead worker leaves the others in a collective too: no clean stop then.
            clean = not self._broken and all(p.is_alive() for p in self.workers)
            if clean:
                try:
                    dist.broadcast_object_list(
                        [("shutdown", ())], src=0, group=self.group.cpu_group
                    )
                except Exception:  # noqa: BLE001 - a worker went away meanwhile
                    clean = False
                    logger.warning("tensor-parallel shutdown broadcast failed", exc_info=True)
            if clean:
                _join_all(self.workers, STOP_GRACE_S)
        finally:
            self._kill_workers()
        self.runner.shutdown()
        ps.destroy_tensor_parallel()

    def _kill_workers(self) -> None:
        """SIGKILL every live worker (they ignore SIGTERM, see _worker_main) and reap them."""
        for p in self.workers:
            if p.is_alive():
                p.kill()
        _join_all(self.workers, 5.0)
        self.workers = []


class _RayRank:
    """One rank as a Ray actor (its own process, with the GPU Ray assigned it)."""

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        self.config, self.spec, self.runner = config, spec, None

    def address(self) -> str:
        """tcp://<this node's IP>:<free port> (rank 0's actor hosts the rendezvous)."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"

    def init(self, rank: int, world_size: int, init_method: str, backend: str) -> None:
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        ps.init_tensor_parallel(rank, world_size, init_method, backend)
        self.runner = _make_runner(self.config, self.spec)

    def call(self, method: str, args: tuple) -> Any:  # noqa: ANN401
        return run_command(self.runner, method, args)

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
        ps.destroy_tensor_parallel()


def _import_ray() -> Any:  # noqa: ANN401
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install ray (on every host), then "
            "`ray start --head` on one host and `ray start --address=HEAD:6379` on the others"
        ) from e
    return ray


class RayExecutor:
    """`ModelRunner` over tp Ray actors (one per GPU, anywhere in the Ray cluster). Connects to
    a running cluster (`RAY_ADDRESS` or `ray.init(address="auto")`), else starts a local one."""

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        check_tensor_parallel(config, spec)
        ray = _import_ray()
        self._ray = ray
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
        self.world_size = tp = config.parallel.tensor_parallel_size
        backend = _dist_backend()
        gpus = 1 if backend == "nccl" else 0
        actor_cls = ray.remote(num_cpus=0 if gpus else 1, num_gpus=gpus)(_RayRank)
        self.actors = [actor_cls.remote(config, spec) for _ in range(tp)]
        init_method = ray.get(self.actors[0].address.remote())
        ray.get([a.init.remote(r, tp, init_method, backend) for r, a in enumerate(self.actors)])
        logger.info("tensor parallel: %d ranks over %s (ray, %s)", tp, backend, init_method)

    def _call(self, method: str, *args: Any) -> Any:  # noqa: ANN401
        ray = self._ray
        ref = ray.put(args)  # one copy in the object store, read by every rank
        return ray.get([a.call.remote(method, ref) for a in self.actors])[0]

    def load_model(self) -> None:
        self._call("load_model")

    def determine_num_kv_blocks(self) -> int:
        return self._call("determine_num_kv_blocks")

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call("init_kv_cache", num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self._call("execute", scheduler_output)

    def shutdown(self) -> None:
        ray = self._ray
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001
            logger.warning("ray tensor-parallel shutdown failed", exc_info=True)
        for a in self.actors:
            ray.kill(a)
        self.actors = []


def make_executor(config: EngineConfig, spec: ModelSpec) -> MultiprocExecutor | RayExecutor:
    """The executor `config.parallel.distributed_executor_backend` names."""
    if config.parallel.distributed_executor_backend == "ray":
        return RayExecutor(config, spec)
    return MultiprocExecutor(config, spec)
