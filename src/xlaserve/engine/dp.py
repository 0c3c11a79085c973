"""Data parallelism: N independent engine replicas behind one server, with a prefix-aware load
balancer.

`DataParallelAsyncLLM` has the surface of `AsyncLLM` the server uses (add_request / iterate /
generate / abort / stats / errored / ...), so the aiohttp app serves it unchanged. Each replica
is an `AsyncLLM` over its own `LLMEngine` (own weights, KV cache, scheduler and loop thread).

Routing (`PrefixAwareBalancer`): a request's prefix key is the hash of its first
`prefix_blocks` full KV blocks of prompt tokens (+ cache salt). The replica that last served that
key holds those blocks in its prefix cache, so it is preferred, unless it is full (waiting queue
at `scheduler.max_num_waiting`), dead, or busier than the least-loaded replica by more than
`max_imbalance` requests. Otherwise the least-loaded live replica (fewest requests in flight)
gets it. A replica that answers "queue full" is skipped and the next candidate tried; only when
every live replica is full does the caller get `EngineQueueFullError` (the server: 503 with
Retry-After). One dead replica does not take the server down: the others keep serving.

Replicas are engine core processes behind this front when the server runs the core in its own
process (the `xlaserve serve` default; `MPAsyncLLM` each, rank i on its own GPU(s) when the host
has them), or threads of this process (`--no-engine-process`). The torch backend's tensor
parallelism uses one process group per process, so DP x TP on torch is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from xlaserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineQueueFullError
from xlaserve.runner import backend_names, backends_with, get_capabilities, resolve_backend

if TYPE_CHECKING:
    from xlaserve.config import EngineConfig
    from xlaserve.engine.llm_engine import EngineStats
    from xlaserve.metrics import RequestRecord
    from xlaserve.outputs import RequestOutput
    from xlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PrefixAwareBalancer:
    """Picks replica candidates for a request, best first. Pure bookkeeping (no engine calls):
    the caller reports placements (`placed`) and completions (`released`)."""

    def __init__(self, num_replicas: int, max_imbalance: int = 8, max_keys: int = 100_000) -> None:
        self.num_replicas = num_replicas
        self.max_imbalance = max_imbalance
        self.max_keys = max_keys
        self.in_flight = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests placed, per replica (lifetime)
        self.prefix_routed = [0] * num_replicas  # of those, placed by prefix affinity
        self._owner_of_key: OrderedDict[bytes, int] = OrderedDict()  # LRU

    def candidates(self, key: bytes | None, usable: list[bool]) -> list[int]:
        """Usable replicas in the order to try: the prefix's replica first (if not too busy),
        then by in-flight count (ties: lower index)."""
        order = sorted((i for i in range(self.num_replicas) if usable[i]), key=self._load_key)
        if not order or key is None:
            return order
        owner = self._owner_of_key.get(key)
        if owner is not None and usable[owner]:
            least = self.in_flight[order[0]]
            if self.in_flight[owner] - least <= self.max_imbalance:
                order.remove(owner)
                order.insert(0, owner)
        return order

    def _load_key(self, i: int) -> tuple[int, int]:
        return self.in_flight[i], i

    def placed(self, replica: int, key: bytes | None) -> None:
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        if key is not None:
            if self._owner_of_key.get(key) == replica:
                self.prefix_routed[replica] += 1
            self._owner_of_key[key] = replica
            self._owner_of_key.move_to_end(key)
            while len(self._owner_of_key) > self.max_keys:
                self._owner_of_key.popitem(last=False)

    def released(self, replica: int) -> None:
        self.in_flight[replica] -= 1


def prefix_key(
    token_ids: list[int], block_size: int, prefix_blocks: int, salt: str | None
) -> bytes | None:
    """Hash of the first `prefix_blocks` full blocks (fewer if the prompt is shorter); None when
    the prompt has no full block (nothing reusable to route by)."""
    n = min(len(token_ids) // block_size, prefix_blocks) * block_size
    if n == 0:
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update((salt or "").encode())
    h.update(b"\0" + ",".join(map(str, token_ids[:n])).encode())
    return h.digest()


class DataParallelAsyncLLM:
    """N `AsyncLLM` replicas behind the `AsyncLLM` surface (see the module docstring)."""

    def __init__(self, replicas: list[AsyncLLM], prefix_blocks: int = 1) -> None:
        if not replicas:
            raise ValueError("need at least one replica")
        self.replicas = replicas
        self.prefix_blocks = prefix_blocks
        sc = replicas[0].config.scheduler
        self.balancer = PrefixAwareBalancer(len(replicas), max_imbalance=sc.max_num_seqs)
        self.rejected = [0] * len(replicas)  # "queue full" answers, per replica
        self._owner: dict[str, int] = {}  # request id -> replica (while in flight)

    @classmethod
    def from_config(
        cls, config: EngineConfig, engine_process: bool = False
    ) -> DataParallelAsyncLLM:
        """`engine_process`: each replica is an engine core process (started together, loading
        in parallel) behind this front; on NVIDIA GPUs rank i gets its own device(s)."""
        n = config.parallel.data_parallel_size
        if n > 1 and config.parallel.tensor_parallel_size > 1:
            backend = resolve_backend(config.backend)
            if not get_capabilities(backend).data_parallel_with_tensor_parallel:
                able = backends_with(lambda caps: caps.data_parallel_with_tensor_parallel)
                raise NotImplementedError(
                    f"data_parallel_size > 1 with backend {backend!r}'s tensor parallelism in one "
                    "process; run one server per TP group behind a load balancer, or use "
                    f"backend={backend_names(able)}"
                )
        one = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1)
        )
        if engine_process:
            return cls(_core_process_replicas(one, n))
        replicas: list[AsyncLLM] = []
        try:
            for i in range(n):
                logger.info("starting data-parallel replica %d/%d", i + 1, n)
                replicas.append(AsyncLLM.from_config(one))
        except BaseException:
            for r in replicas:
                r.shutdown()
            raise
        return cls(replicas)

    # ------------------------------------------------------------------ views (replica 0)
    @property
    def engine(self) -> Any:  # noqa: ANN401 - the LLMEngine of replica 0 (spec, tokenizer)
        return self.replicas[0].engine

    @property
    def tokenizer(self) -> Any:  # noqa: ANN401
        return self.replicas[0].tokenizer

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def config(self) -> EngineConfig:
        return self.replicas[0].config

    @property
    def errored(self) -> bool:
        """Only when every replica is dead (one dead replica leaves the others serving)."""
        return all(r.errored for r in self.replicas)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.replicas[0].dead_error if self.errored else None

    @property
    def stats(self) -> EngineStats:
        """Sum over replicas (kv_cache_usage: the mean)."""
        snaps = [r.stats for r in self.replicas]
        vals: dict[str, Any] = {}
        for f in dataclasses.fields(snaps[0]):
            xs = [getattr(s, f.name) for s in snaps]
            vals[f.name] = sum(xs) / len(xs) if f.name == "kv_cache_usage" else sum(xs)
        return type(snaps[0])(**vals)

    def add_finish_listener(self, fn: Callable[[RequestRecord], None]) -> None:
        for r in self.replicas:
            r.add_finish_listener(fn)

    # ------------------------------------------------------------------ routing
    def _prompt_ids(self, prompt: str | list[int] | dict) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _has_room(self, i: int) -> bool:
        limit = self.replicas[i].config.scheduler.max_num_waiting
        return limit is None or self.replicas[i].stats.num_waiting < limit

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> Any:  # noqa: ANN401 - the owning replica's stream
        """Place the request on the best replica that accepts it (see the module docstring)."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in flight")
        block = self.config.cache.block_size
        key = prefix_key(self._prompt_ids(prompt), block, self.prefix_blocks, cache_salt)
        alive = [not r.errored for r in self.replicas]
        if not any(alive):
            raise self.replicas[0].dead_error or EngineDeadError("every replica is down")
        usable = [alive[i] and self._has_room(i) for i in range(len(self.replicas))]
        full: EngineQueueFullError | None = None
        b = self.balancer
        for i in b.candidates(key, usable):
            # Count it in flight while the replica answers, so concurrent requests placed
            # meanwhile see the load (a core process answers after its current step).
            b.in_flight[i] += 1
            try:
                stream = await self.replicas[i].add_request(
                    request_id, prompt, params, priority, cache_salt, lora_request=lora_request
                )
            except EngineQueueFullError as e:  # raced with the snapshot: try the next one
                self.rejected[i] += 1
                full = e
                continue
            except EngineDeadError:
                continue
            finally:
                b.in_flight[i] -= 1
            b.placed(i, key)
            self._owner[request_id] = i
            return stream
        for i, ok in enumerate(usable):
            if alive[i] and not ok:
                self.rejected[i] += 1
        raise EngineQueueFullError(
            f"every data-parallel replica's waiting queue is full ({full or 'all at the limit'}); "
            "retry later"
        )

    def _release(self, request_id: str) -> None:
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.balancer.released(i)

    async def iterate(self, stream: Any) -> AsyncIterator[RequestOutput]:  # noqa: ANN401
        """Outputs of a request added with `add_request`; closing it aborts (see AsyncLLM)."""
        rid = stream.request_id
        i = self._owner.get(rid)
        if i is None:
            raise KeyError(f"request {rid!r} was not added through this front")
        try:
            async with contextlib.aclosing(self.replicas[i].iterate(stream)) as outs:
                async for out in outs:
                    yield out
        finally:
            self._release(rid)

    # add_request (placed on a replica), then iterate: AsyncLLM's generator over this class's.
    generate = AsyncLLM.generate

    def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)
            self._release(request_id)

    def shutdown(self, timeout: float = 30.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    # ------------------------------------------------------------------ metrics
    def metrics_collector(self) -> Any:  # noqa: ANN401 - a prometheus_client Collector
        """Per-replica series with a `replica` label, for the server's registry."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from prometheus_client.registry import Collector

        front = self

        class _ReplicaCollector(Collector):
            def collect(self) -> Iterator[Any]:
                labels = ["model_name", "replica"]
                fams = [
                    CounterMetricFamily(
                        "xlaserve:dp_requests_routed",
                        "Requests the load balancer placed on each replica.",
                        labels=labels,
                    ),
                    CounterMetricFamily(
                        "xlaserve:dp_requests_prefix_routed",
                        "Requests placed on the replica that last served their prefix.",
                        labels=labels,
                    ),
                    CounterMetricFamily(
                        "xlaserve:dp_requests_rejected_full",
                        "Times a replica was skipped because its waiting queue was full.",
                        labels=labels,
                    ),
                    GaugeMetricFamily(
                        "xlaserve:dp_requests_in_flight",
                        "Requests in flight per replica.",
                        labels=labels,
                    ),
                    GaugeMetricFamily(
                        "xlaserve:dp_replica_num_requests_running",
                        "Sequences running per replica.",
                        labels=labels,
                    ),
                    GaugeMetricFamily(
                        "xlaserve:dp_replica_num_requests_waiting",
                        "Sequences waiting per replica.",
                        labels=labels,
                    ),
                    GaugeMetricFamily(
                        "xlaserve:dp_replica_up",
                        "1 while the replica's engine runs.",
                        labels=labels,
                    ),
                ]
                b = front.balancer
                for i, r in enumerate(front.replicas):
                    lv = [front.model_name, str(i)]
                    s = r.stats
                    values = [
                        b.routed[i],
                        b.prefix_routed[i],
                        front.rejected[i],
                        b.in_flight[i],
                        s.num_running,
                        s.num_waiting,
                        0 if r.errored else 1,
                    ]
                    for fam, v in zip(fams, values, strict=True):
                        fam.add_metric(lv, v)
                yield from fams

        return _ReplicaCollector()


def _rank_env(rank: int, per_rank: int) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for data-parallel rank `rank` (devices rank*per_rank onwards) when
    this host has enough NVIDIA GPUs (read from /proc: torch is not imported here); else {}."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devs = [d for d in visible.split(",") if d.strip()]
    else:
        gpus = "/proc/driver/nvidia/gpus"
        devs = [str(i) for i in range(len(os.listdir(gpus)))] if os.path.isdir(gpus) else []
    mine = devs[rank * per_rank : (rank + 1) * per_rank]
    if len(mine) < per_rank:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def _core_process_replicas(config: EngineConfig, n: int) -> list[Any]:
    """n MPAsyncLLMs, each over its own engine core process (all started before any waits)."""
    from xlaserve.engine.core_client import CoreProcess, MPAsyncLLM

    tp = config.parallel.tensor_parallel_size
    cores = []
    replicas: list[Any] = []
    try:
        for i in range(n):
            cores.append(CoreProcess(config, _rank_env(i, tp), name=f"engine core (DP rank {i})"))
        for c in cores:
            replicas.append(MPAsyncLLM(config, core=c))
    except BaseException:
        for r in replicas:
            r.shutdown(5.0)
        for c in cores[len(replicas) :]:
            c.proc.terminate()
            c.stop(5.0)
        raise
    return replicas


def build_async_engine(
    config: EngineConfig, engine_process: bool = False
) -> AsyncLLM | DataParallelAsyncLLM | Any:  # noqa: ANN401
    """What the server runs: one AsyncLLM, or the data-parallel front when data_parallel_size > 1.
    `engine_process`: the engine core runs in its own process (`MPAsyncLLM`, same surface)."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelAsyncLLM.from_config(config, engine_process)
    if engine_process:
        from xlaserve.engine.core_client import MPAsyncLLM

        return MPAsyncLLM.from_config(config)
    return AsyncLLM.from_config(config)
