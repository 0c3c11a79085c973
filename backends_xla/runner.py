"""XlaModelRunner: the JAX backend behind the ModelRunner protocol (src/xlaserve/runner.py).

One step = two compiled programs with static shapes, compiled apart so their counts add up
instead of multiplying:

- the forward, one per token bucket T: tokens padded to T; the per-request metadata (kv_lens,
  block tables, query offsets, last-token rows) padded to a FIXED R = max_num_seqs rows; the KV
  cache donated and updated in place. It returns the last tokens' hidden rows [R, H] (and [T, H]).
- "logits + sample", one per request bucket B: the first B of those rows -> logits [B, V] ->
  one sampler program that handles every SamplingParams feature with arrays (sampler.py).

With a speculative_config (n-gram drafts, K = num_speculative_tokens) the forward gathers
R * (1 + K) rows instead of R and one "logits + verify" program per request bucket B (compiled at
start-up) scores 1 + K rows per request and accepts / rejects on the device (sampler.verify);
steps without drafts keep using the sample program. With method "draft_model" (draft.py) a
second model proposes the drafts after each step: one catch-up program per token bucket and one
K-step proposal program per request bucket, also compiled at start-up.

Prompt logprobs (rare) use a third program per token bucket, compiled the first time a step asks
for them (`lazy_compiles` records it). Everything else is compiled ahead of time at
`init_kv_cache` (unless `enforce_eager`: then each program is compiled at first use), as
`jax.stages.Compiled` executables (programs.py), which cannot silently recompile while serving;
JAX's persistent compilation cache makes the next start-up fast. The persistent batch, step
validation, numpy step inputs and output bookkeeping are xlaserve/runner_core.py's (shared with
the torch runner); this file pads them into buckets and does the device work.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.backends_xla.multihost import init_multihost
from xlaserve.backends_xla.programs import (
    FORWARD,
    PROMPT_LOGPROBS,
    SAMPLE,
    SAMPLE_GREEDY,
    VERIFY,
    StepBatch,
    compile_program,
    compile_programs,
    dummy_batch,
    kv_layer_structs,
    lower_program,
    make_jitted,
    peak_activation_bytes,
    sample_kind,
)
from xlaserve.backends_xla.sampler import (
    DENSE_FIELDS,
    PARAM_ROWS,
    STEPS_ROW,
    SampleMode,
    SamplerOutput,
    SamplingTensors,
    VerifyOutput,
    neutral_extras,
    pack_params,
    packed_stops,
    param_words,
    row_flags,
    sampling_host,
    step_summary,
    verify_rows,
)
from xlaserve.backends_xla.utils import (
    SWITCH_INTERVAL,
    apply_xla_gpu_flags,
    dispatch_thread_on,
    make_mesh,
    pick_bucket,
    resolve_dtype,
    seq_buckets,
    setup_compilation_cache,
    token_buckets,
)
from xlaserve.config import EngineConfig
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.loader import kv_heads_sharded, load_model, xla_quant_scheme
from xlaserve.quantization.kv_quant import KV_CACHE_DTYPES
from xlaserve.quantization.scheme import METHODS as QUANT_METHODS
from xlaserve.runner import (
    NewRequestData,
    RunnerCapabilities,
    RunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from xlaserve.runner_core import (
    LaunchedStep,
    ReqState,
    RunnerCore,
    ragged_inputs,
    to_token_logprobs,
)

logger = logging.getLogger(__name__)


@dataclass
class _ReqState(ReqState):
    """The persistent batch's request (runner_core.ReqState) + the XLA sampler's state."""

    seed: int = 0  # uint32 sampling seed: the request's own or drawn once by the runner
    output_counts: np.ndarray | None = None  # i32 [V], kept only when penalties are on
    prompt_mask: np.ndarray | None = None  # bool [V], kept only when penalties are on
    param_words: np.ndarray | None = None  # i32 [PARAM_ROWS]: its packed sampler row (steps 0)
    # min_tokens' stop mask travels in param_words (sampler.stop_slots), not the dense bias.
    packed_stops: bool = False
    flags: int = 0  # sampler.row_flags: what its sampling asks of every step
    lora_slot: int = -1  # NewRequestData.lora_slot: its LoRA table slot, -1 = base model


@dataclass
class _Launched(LaunchedStep):
    """A launched step: for a deferred SAMPLE step, the results `finish` reads (pending rows:
    batch rows)."""

    # The dispatch thread's Future of them until `finish` takes its result.
    res: SamplerOutput | Future | None = None
    # The SAMPLE dispatch still to run (late grammar bitmasks, `apply_bitmasks`).
    resume: Any = None


# Longest a shutdown waits for the executable cache's background writes (exec_cache.py).
EXEC_CACHE_JOIN_S = 120.0


class XlaModelRunner(RunnerCore):
    """See the module docstring. Constructed as `XlaModelRunner(config, spec)`."""

    capabilities: ClassVar[RunnerCapabilities] = RunnerCapabilities(
        tensor_parallel=True, data_parallel_with_tensor_parallel=True, expert_parallel=True,
        multi_host=True, speculative_methods=("ngram", "draft_model"), kv_offload=True,
        quantization=QUANT_METHODS, kv_cache_dtypes=KV_CACHE_DTYPES,
        checkpoint_formats=("safetensors", "orbax"), async_scheduling=True, lora=True,
    )  # fmt: skip

    @staticmethod
    def convert_checkpoint(model: str | None, out: str, fmt: str, tp: int, dtype: str) -> dict:
        """`xlaserve convert --to orbax` through the runner registry (orbax_io.py)."""
        if fmt != "orbax":
            raise ValueError(f"backend 'xla' writes orbax checkpoints, not {fmt!r}")
        from xlaserve.backends_xla.orbax_io import convert_to_orbax

        return convert_to_orbax(model, out, tp, dtype)

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        super().__init__()  # the persistent batch: self.requests (runner_core.py)
        # Multi-host (nnodes > 1): join jax.distributed before any JAX backend starts (multihost.py).
        apply_xla_gpu_flags(config.kernels)  # XLA_FLAGS: before any JAX backend starts
        self.multihost = init_multihost(config)
        if self.multihost is not None:  # followers get each SchedulerOutput before launch,
            self.apply_bitmasks = None  # not late masks: the engine fills them before launch
        # Quantized KV cache (int8 / fp8 codes + a float32 scale per token and KV head).
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        # Weight quantization (None = float): the checkpoint's own format or `quantization`
        # applied at load time; raises early for fp8 without fp8 matmuls (models_flax/loader.py).
        self.quant_scheme = xla_quant_scheme(config.model.quantization, spec, config.kernels)
        sc = config.speculative
        if sc is not None and sc.method not in ("ngram", "draft_model"):
            raise NotImplementedError(
                f"speculative method {sc.method!r} is not supported by backend 'xla' "
                "(only 'ngram' and 'draft_model')"
            )
        # K: the verify programs score 1 + K rows per request (fixed shapes, compiled at start).
        self.num_spec_tokens = sc.num_speculative_tokens if sc is not None else 0
        self.config, self.spec = config, spec
        self.compilation_cache_dir = setup_compilation_cache(config.compilation_cache_dir)
        self.platform = jax.default_backend()
        self.dtype = resolve_dtype(config.model.dtype, spec.checkpoint_dtype, self.platform)
        # XLA:CPU upcasts a 16-bit gather/scatter operand to float32 as a whole (float
        # normalization), so a bf16/fp16 cache would be copied in full on every step (measured:
        # 18 vs 739 tok/s with 131k vs 1k blocks). On CPU the float cache is float32.
        self.kv_dtype = (
            jnp.dtype(jnp.float32)
            if self.platform == "cpu" and self.dtype.itemsize < 4
            else self.dtype
        )
        self.mesh = make_mesh(config.parallel.tensor_parallel_size)
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len or spec.max_position_embeddings
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.token_buckets = token_buckets(
            config.kernels.xla_min_token_bucket, sched.max_num_batched_tokens, self.platform
        )
        self.seq_buckets = seq_buckets(
            config.kernels.xla_min_seq_bucket, sched.max_num_seqs, self.platform
        )
        self.vocab = spec.vocab_size
        self.num_rows = self.max_num_seqs * (1 + self.num_spec_tokens)  # forward's gathered rows
        self._seed_rng = np.random.default_rng(config.model.seed)
        self._replicated = NamedSharding(self.mesh, P())
        # The last SAMPLE program's tokens, padded to max_num_seqs (async scheduling feeds them
        # to the next forward); zeros before the first step.
        self._last_tokens = jax.device_put(np.zeros(self.max_num_seqs, np.int32), self._replicated)
        kv_axis = "model" if kv_heads_sharded(spec, self.mesh) else None
        self._kv_sharding = NamedSharding(self.mesh, P(None, None, kv_axis, None))
        # One layer's cache tuple: (k, v), or (k codes, v codes, k scales, v scales) with the
        # [N, S, Hkv] scales split over KV heads like their codes.
        self._kv_layer_shardings = (self._kv_sharding,) * 2
        if self.kv_cache_dtype != "auto":
            scale_sharding = NamedSharding(self.mesh, P(None, None, kv_axis))
            self._kv_layer_shardings += (scale_sharding,) * 2
        # Recurrent-state models (Mamba, hybrids): state slots beside the KV blocks, their
        # (conv, ssm) caches replicated; unsupported features refused here (model_loader/ssm.py).
        from xlaserve.model_loader.ssm import check_state_model_config, is_state_model

        check_state_model_config(config, spec)
        self.state_model = is_state_model(spec)
        self._num_state_slots = 0
        if self.state_model:
            self._kv_layer_shardings = (self._replicated,) * 2
        self.graphdef: nnx.GraphDef | None = None
        self.state: nnx.State | None = None
        self.weights: list[jax.Array] = []  # the state's leaves, as the programs take them
        self.kv_caches: list[tuple[jax.Array, ...]] | None = None
        self.num_kv_blocks = 0
        self.kv_offload = None  # host/disk tier copy engine (kv_offload.py), set by init_kv_cache
        # (kind, bucket) -> compiled executable; kinds FORWARD (T), SAMPLE (B), PROMPT_LOGPROBS (T).
        self.programs: dict[tuple[str, int], jax.stages.Compiled] = {}
        self.lazy_compiles: list[tuple[str, int]] = []  # programs compiled after start-up
        self.exec_cache_loads = 0  # programs loaded from the executable cache (exec_cache.py)
        # (kind, bucket) -> seconds of XLA's compile of each program compiled at start-up
        self.compile_seconds: dict[tuple[str, int], float] = {}
        self._deferred: Future | None = None  # background compile of large buckets (compile_all)
        self.exec_cache_writers: list = []  # ExecutableCaches writing in the background
        # Sampler specializations compiled in the background the first time a step needs one
        # (`_sample_program`); the general SAMPLE program serves those steps meanwhile.
        self.sample_variants: dict[tuple[str, int], jax.stages.Compiled] = {}
        self.background_compiles: list[tuple[str, int]] = []  # variants compiled off-thread
        self._variant_jobs: dict[tuple[str, int], Future] = {}
        self._variant_pool: ThreadPoolExecutor | None = None
        self._neutral: dict[int, dict[str, jax.Array]] = {}  # B -> device-resident neutral extras
        self._hidden_dtype: jnp.dtype = self.dtype
        # Multi-LoRA slot tables (lora.py), None unless config.lora.enable_lora.
        self.lora_tables = None
        if config.lora.enable_lora:
            from xlaserve.backends_xla.lora import XlaLoRATables

            self.lora_tables = XlaLoRATables(self)
        # method "draft_model": the draft's weights, KV cache and programs (draft.py).
        self.draft = None
        if sc is not None and sc.method == "draft_model":
            from xlaserve.backends_xla.draft import XlaDraftModel

            self.draft = XlaDraftModel(self, sc.model)
        # KernelConfig.xla_dispatch_thread: the thread that calls an async step's programs and
        # the Future of the last step it was given (`_dispatch_step`, `_drain`).
        self._dispatcher: ThreadPoolExecutor | None = None
        self._dispatched: Future | None = None
        if self.multihost is None and dispatch_thread_on(
            config.kernels.xla_dispatch_thread, self.platform
        ):
            self._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="xla-dispatch")
            # A shorter GIL switch interval while this runner lives (counted across runners).
            SWITCH_INTERVAL.hold(self, config.kernels.xla_dispatch_switch_interval_us / 1e6)

    # ---------------------------------------------------------------- set-up
    def load_model(self) -> None:
        self.graphdef, self.state = load_model(
            self.spec, self.dtype, self.mesh, self.config.load.load_format, self.config.model.seed,
            quant=self.quant_scheme, expert_parallel=self.config.parallel.enable_expert_parallel,
            kernels=self.config.kernels,
        )  # fmt: skip
        lora = self.lora_tables
        if lora is not None:  # the zeroed slot tables join the weights (lora.py)
            self.graphdef, self.state = lora.attach(self.graphdef, self.state)
        treedef = self.sync_weights()
        dims = (self.max_num_seqs, self.max_blocks_per_seq, self.num_rows)
        md_static = {"mesh": self.mesh, "impl": self.config.kernels.rpa_impl}
        self._jitted = make_jitted(
            self.graphdef, treedef, self._kv_layer_shardings, self._replicated, dims,
            self.num_spec_tokens, md_static, None if lora is None else lora.program_args,
        )  # fmt: skip
        if lora is not None:
            lora.warm_up()
        if self.draft is not None:
            self.draft.load()

    def sync_weights(self) -> jax.tree_util.PyTreeDef:
        """Refresh `weights`, the flat leaf list the programs take (programs.make_jitted says
        why), from `state`; call it after changing `state` in place."""
        self.weights, treedef = jax.tree.flatten(self.state)
        return treedef

    def _kv_block_bytes(self) -> int:
        """Bytes one KV block takes on one device."""
        shards = self.mesh.shape["model"] if kv_heads_sharded(self.spec, self.mesh) else 1
        per_token = self.spec.kv_bytes_per_token(self.kv_dtype.itemsize, self.kv_cache_dtype)
        return self.block_size * per_token // shards

    def determine_num_kv_blocks(self) -> int:
        cache = self.config.cache
        if self.state_model:  # one budget -> KV blocks + state slots (model_loader/ssm.py)
            from xlaserve.model_loader.ssm import plan_state_cache

            budget = cache.cpu_kv_cache_bytes
            if self.platform != "cpu":
                budget = int(min(
                    d.memory_stats()["bytes_limit"] * cache.gpu_memory_utilization
                    - d.memory_stats()["bytes_in_use"] for d in self.mesh.local_devices
                ) - peak_activation_bytes(self))  # fmt: skip
            n, self._num_state_slots = plan_state_cache(
                self.spec, self.config, self.kv_dtype.itemsize, self.block_size,
                self.max_model_len, budget,
            )  # fmt: skip
            return n
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        draft_bytes = self.draft.kv_bytes_per_block() if self.draft is not None else 0
        block_bytes = (self._kv_block_bytes() + draft_bytes) * (
            self.mesh.shape["model"] if self.platform == "cpu" else 1
        )
        if self.platform == "cpu":
            n = cache.cpu_kv_cache_bytes // block_bytes
        else:
            free = min(
                d.memory_stats()["bytes_limit"] * cache.gpu_memory_utilization
                - d.memory_stats()["bytes_in_use"]
                for d in self.mesh.local_devices  # this host's (multi-host: the others' are remote)
            )
            n = int((free - peak_activation_bytes(self)) // block_bytes)
        if n < 1:
            raise ValueError(
                "no memory left for the KV cache: lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        return int(n) if self.multihost is None else self.multihost.min_over_hosts(int(n))

    def init_kv_cache(self, num_blocks: int) -> None:
        if self.state is None:
            raise RuntimeError("call load_model() before init_kv_cache()")
        structs = kv_layer_structs(self, num_blocks)
        layers = self.spec.num_layers
        alloc = jax.jit(
            lambda: [tuple(jnp.zeros(x.shape, x.dtype) for x in structs) for _ in range(layers)],
            out_shardings=[self._kv_layer_shardings] * layers,
        )
        if self.state_model:  # per layer K/V or (conv, ssm) states (models_flax/mamba.py)
            from xlaserve.models_flax.mamba import alloc_state_caches

            self._num_state_slots = max(self._num_state_slots, 1)
            alloc = functools.partial(alloc_state_caches, self, num_blocks, self._num_state_slots)
        self.kv_caches = alloc()
        self.num_kv_blocks = num_blocks
        if self.draft is not None:  # its own cache, same block ids (+ scratch blocks)
            self.draft.init_kv_cache(num_blocks)
        from xlaserve.backends_xla.kv_offload import make_xla_kv_offload

        self.kv_offload = make_xla_kv_offload(self)
        if not self.config.enforce_eager:
            self.compile_all()
        if self.multihost is not None:  # follower hosts serve host 0's steps here, then exit
            self.multihost.serve_if_follower(self)

    def num_state_slots(self) -> int:
        """State slots allocated beside the KV blocks (0: attention-only model; runner.py)."""
        return self._num_state_slots

    def startup_programs(self) -> list[tuple[str, int]]:
        """Programs compiled at start-up: (token buckets) + (request buckets), no product: the
        general sampler and its all-greedy specialization per request bucket; with speculation
        also one verify program per request bucket."""
        progs = [(FORWARD, t) for t in self.token_buckets]
        progs += [(kind, b) for kind in (SAMPLE, SAMPLE_GREEDY) for b in self.seq_buckets]
        if self.num_spec_tokens:
            progs += [(VERIFY, b) for b in self.seq_buckets]
        if self.draft is not None:  # + draft catch-up per token bucket, proposal per request bucket
            progs += self.draft.startup_programs()
        return progs

    def compile_all(self, programs: list[tuple[str, int]] | None = None) -> None:
        """Compile `programs` (default: every start-up program), programs.py. By default the
        `deferred_programs` compile in a background thread after this returns
        (`ready_token_budget` caps the steps meanwhile)."""
        if programs is not None:
            compile_programs(self, programs)
            return
        later = self.deferred_programs()
        compile_programs(self, [p for p in self.startup_programs() if p not in later])
        if later:
            pool = ThreadPoolExecutor(1, thread_name_prefix="xla-deferred")
            self._deferred = pool.submit(compile_programs, self, later, False)
            pool.shutdown(wait=False)

    def deferred_programs(self) -> list[tuple[str, int]]:
        """Start-up programs compiled after the engine is ready: the forwards of token buckets
        above KernelConfig.xla_startup_token_bucket (auto: 256 on GPU / TPU; none on the CPU).
        None with several hosts (each must hold the same programs), enforce_eager, or a draft
        model (its catch-up program per token bucket is not deferred with them)."""
        cap = self.config.kernels.xla_startup_token_bucket
        if cap == 0:
            cap = -1 if self.platform == "cpu" else 256
        single = self.multihost is None and self.draft is None and not self.config.enforce_eager
        if cap < 0 or not single:
            return []
        return [(FORWARD, t) for t in self.token_buckets if t > max(cap, self.token_buckets[0])]

    def ready_token_budget(self) -> int | None:
        """The largest token bucket whose forward (and every smaller one's) is compiled while
        background compiles run; None once every start-up program is (the engine's step cap)."""
        fut = self._deferred
        if fut is None:
            return None
        if fut.done():
            self._deferred = None
            if fut.exception() is not None:  # the steps compile what they need, as eager does
                logger.warning("background compile failed: %r", fut.exception())
            return None
        ready = self.token_buckets[0]
        for t in self.token_buckets:
            if (FORWARD, t) not in self.programs:
                break
            ready = t
        return ready

    def wait_compiled(self, timeout: float | None = None) -> None:
        """Block until the background compiles (if any) are done (benchmarks, tests, shutdown);
        a failure is logged (the steps then compile what they need, as enforce_eager does)."""
        fut = self._deferred
        if fut is not None:
            fut.exception(timeout)  # waits
            self.ready_token_budget()  # clears it; logs a failure

    def _program(self, kind: str, n: int) -> jax.stages.Compiled:
        prog = self.programs.get((kind, n))
        if prog is None:
            if kind != PROMPT_LOGPROBS and not self.config.enforce_eager:
                logger.warning("compiling %s program for bucket %d while serving", kind, n)
            self.lazy_compiles.append((kind, n))
            prog = self.programs[(kind, n)] = compile_program(
                self, lower_program(self, kind, n), kind, n
            )
        return prog

    def _sample_program(self, b: int, mode: SampleMode) -> jax.stages.Compiled:
        """The sampler for bucket b: `mode`'s specialization once compiled (all-greedy at
        start-up, the others in a background thread the first time a step needs them), else the
        general SAMPLE program, which computes the same tokens (sampler.sample_mode). Multi-host
        and enforce_eager runs use only start-up programs (every host must run the same one)."""
        key = (sample_kind(mode), b)
        prog = self.programs.get(key) or self.sample_variants.get(key)
        if prog is not None:
            return prog
        if self.multihost is None and not self.config.enforce_eager:
            self._compile_variant(key)
        return self._program(SAMPLE, b)

    def _compile_variant(self, key: tuple[str, int]) -> None:
        if key in self._variant_jobs:
            return
        if self._variant_pool is None:
            self._variant_pool = ThreadPoolExecutor(1, thread_name_prefix="xla-sampler")

        def job() -> None:
            self.sample_variants[key] = compile_program(self, lower_program(self, *key), *key)
            self.background_compiles.append(key)  # tests tell these from serving compiles

        def done(fut: Future) -> None:
            if fut.exception() is not None:  # the general program keeps serving
                logger.warning("sampler variant %s failed to compile: %r", key, fut.exception())

        self._variant_jobs[key] = self._variant_pool.submit(job)
        self._variant_jobs[key].add_done_callback(done)

    def join_sample_variants(self, timeout: float | None = None) -> None:
        """Wait for the background sampler compiles queued so far (tests, benchmarks: a
        compile counter must not catch one that a previous step started)."""
        for fut in list(self._variant_jobs.values()):
            try:
                fut.result(timeout)
            except Exception:  # noqa: BLE001 - a failed variant is logged; the general serves
                pass

    def shutdown(self) -> None:
        self._drain()
        if self._dispatcher is not None:
            self._dispatcher.shutdown(wait=True)
            self._dispatcher = None
        SWITCH_INTERVAL.release(self)
        self.wait_compiled()  # its compiles use the weights and the executable cache below
        for cache in self.exec_cache_writers:  # finish writing this start-up's executables
            cache.join(timeout=EXEC_CACHE_JOIN_S)
        self.exec_cache_writers.clear()
        if self.multihost is not None:
            self.multihost.stop()
        self.requests.clear()
        self.kv_caches = None
        self.state, self.weights = None, []
        if self._variant_pool is not None:
            self._variant_pool.shutdown(wait=True, cancel_futures=True)
            self._variant_pool = None
        self.programs.clear()
        self.sample_variants.clear()
        self._neutral.clear()
        if self.draft is not None:
            self.draft.shutdown()

    # ---------------------------------------------------------------- one step
    @property
    def async_by_default(self) -> bool:
        """async_scheduling="auto": on for a single host. JAX dispatch returns before the
        device is done, so the host work of the next step overlaps it (measured on the CPU:
        1.23x at batch 1, 1.13x at batch 8, `python -m xlaserve.bench.async_ab`)."""
        return self.multihost is None

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.finish(self._launch(scheduler_output, defer=False))

    def launch(self, scheduler_output: SchedulerOutput) -> _Launched:
        """Dispatch one step; a plain SAMPLE step's tokens are read by `finish` (runner.py)."""
        return self._launch(scheduler_output, defer=self.multihost is None)

    def apply_bitmasks(self, launched: _Launched, bitmasks: dict) -> None:
        """The late grammar bitmasks of a launched step (xlaserve.runner): its SAMPLE program,
        held back while the forward was dispatched, is dispatched now with them (the mask is
        applied inside the program)."""
        resume, launched.resume = launched.resume, None
        if resume is not None:
            resume(bitmasks)

    def finish(self, launched: _Launched) -> RunnerOutput:
        if launched.resume is not None:  # masks never came (an error in the engine): sample
            self.apply_bitmasks(launched, {})
        if isinstance(launched.res, Future):  # the dispatch thread's step: raise its error here,
            launched.res = launched.res.result()  # also when no row samples (nothing to read)
        return super().finish(launched)

    def _read_pending(self, launched: _Launched) -> tuple[list[int], set[int]]:
        """`finish` (runner_core.py): read a deferred step's results back to the host."""
        launched.res = res = jax.device_get(launched.res)
        return res.token_ids.tolist(), set(np.flatnonzero(res.has_nan).tolist())

    def _pending_logprobs(
        self, launched: _Launched, st: _ReqState, row: int
    ) -> list[TokenLogprobs] | None:
        if st.params.logprobs is None:
            return None
        return self._logprobs(launched.res, st, row, 1)

    def _launch(self, scheduler_output: SchedulerOutput, defer: bool) -> _Launched:
        so = scheduler_output
        if self.multihost is not None:  # host 0: the followers run this step too
            self.multihost.before_execute(so)
        self._check_drafts(so)
        if any(so.spec_token_ids.values()) and not self.num_spec_tokens:
            raise ValueError("speculative drafts scheduled but no speculative_config was set")
        if so.has_kv_copies or so.lora_loads:  # they replace device state the thread uses
            self._drain()
        if so.has_kv_copies:  # before the forward, in the order runner.py documents
            if self.kv_offload is None:
                raise RuntimeError("KV offload copies scheduled but kv_offload_bytes is 0")
            self.kv_caches = self.kv_offload.apply(
                self.kv_caches, so.kv_disk_out, so.kv_copy_out, so.kv_disk_in, so.kv_copy_in
            )
        if so.lora_loads:  # before the forward that first uses the slots
            if self.lora_tables is None:
                raise ValueError("LoRA adapters scheduled but enable_lora is off")
            self.lora_tables.write(so.lora_loads)
        self._update_states(so)
        out = RunnerOutput()
        launched = _Launched(out)
        if so.total_num_scheduled_tokens == 0 or not so.num_scheduled_tokens:
            return launched
        batch = self._prepare(so)
        if any(batch.drafts):
            self._drain()
            rows_h, hidden, _ = self._forward(batch)
            self._verify_step(so, batch, rows_h, hidden, out)
            self._propose_drafts(batch, out)
            return launched
        b = pick_bucket(self.seq_buckets, len(batch.req_ids))
        rows = [
            self.requests[r] if s else None
            for r, s in zip(batch.req_ids, batch.sampling, strict=True)
        ]
        rows += [None] * (b - len(rows))
        # The sampler's parameters travel in the forward's packed inputs (one copy per step);
        # with late grammar masks (engine/core.py) `use_extras` is set now, the masks come later.
        late = bool(so.late_bitmask_req_ids)
        dense, mode = self._sampling_params(rows, batch, b, so.grammar_bitmask, late)
        if defer and not late and self._dispatcher is not None and self._deferrable(rows):
            # Both programs are called on the dispatch thread; `finish` reads the Future.
            self._dispatched = self._dispatcher.submit(self._dispatch_step, batch, b, mode, dense)
            self._defer(batch, self._dispatched, launched)
            return launched
        self._drain()
        rows_h, hidden, params = self._forward(batch)

        def sample(late_masks: dict) -> None:
            d = dense
            if late_masks:  # host only: the dense fields again, now with this step's masks
                so.grammar_bitmask.update(late_masks)
                d, _ = self._sampling_params(rows, batch, b, so.grammar_bitmask, True)
            res = self._sample(rows_h, params, b, mode, d)
            if defer and self._deferrable(rows):
                self._defer(batch, res, launched)
                return
            res = jax.device_get(res)
            self._prompt_logprobs(batch, hidden, out)
            self._emit(batch, res, out, lambda i: [int(res.token_ids[i])], lambda i: i)
            self._propose_drafts(batch, out)

        if late:  # the forward is dispatched; SAMPLE waits for the masks
            launched.resume = sample
        else:
            sample({})
        return launched

    def _sample(
        self, rows_h: jax.Array, params: jax.Array, b: int, mode: SampleMode, dense: dict
    ) -> SamplerOutput:
        """Call the SAMPLE program of request bucket b on the forward's rows; its tokens (padded
        to R) become the next forward's `prev`. Returns the results, on the device."""
        res, self._last_tokens = self._sample_program(b, mode)(self.weights, rows_h, params, dense)
        return res

    def _dispatch_step(
        self, batch: StepBatch, b: int, mode: SampleMode, dense: dict
    ) -> SamplerOutput:
        """On the dispatch thread: one async step's forward and SAMPLE programs. It reads no
        engine state but its arguments and the device state the engine thread leaves to it
        until `_drain` (kv_caches, _last_tokens, weights)."""
        rows_h, _, params = self._forward(batch)
        return self._sample(rows_h, params, b, mode, dense)

    def _drain(self) -> None:
        """Wait until the dispatch thread has called every program it was given: the engine
        thread then calls programs or replaces device state itself. A failed dispatch's error
        is raised by `finish` of its step, not here."""
        fut, self._dispatched = self._dispatched, None
        if fut is not None:
            wait([fut])

    def _deferrable(self, rows: list[_ReqState | None]) -> bool:
        """Tokens may stay on the device: nothing this step reads them on the host (no draft
        model, no prompt logprobs, no penalties whose counts the host keeps, no bad_words)."""
        if self.draft is not None:
            return False
        for r in rows:
            if r is not None and (
                r.output_counts is not None
                or r.params.prompt_logprobs is not None
                or r.params.bad_words_token_ids  # the next step matches the real last tokens
            ):
                return False
        return True

    def _defer(self, batch: StepBatch, res: SamplerOutput, launched: _Launched) -> None:
        """Bookkeeping of `_emit` without the tokens: each sampling request gets a PENDING token
        (row i of this launch's tokens), fed to the next launch on the device."""
        launched.res = res
        for i, rid in enumerate(batch.req_ids):
            r = self.requests[rid]
            r.num_computed_tokens += batch.counts[i]
            if not batch.sampling[i]:
                launched.out.sampled_token_ids[rid] = []
                continue
            self._defer_token(launched, rid, r, i)

    def _propose_drafts(self, batch: StepBatch, out: RunnerOutput) -> None:
        """With a draft model: its catch-up and proposals for the next step (draft.py)."""
        if self.draft is not None:
            out.spec_token_ids = self.draft.propose(batch, out)

    def _new_state(self, nr: NewRequestData) -> _ReqState:
        p = nr.sampling_params
        seed = p.seed if p.seed is not None else int(self._seed_rng.integers(0, 2**32))
        r = _ReqState(list(nr.token_ids), nr.num_prompt_tokens, p, list(nr.block_ids),
                      nr.num_computed_tokens, seed=seed & 0xFFFFFFFF)  # fmt: skip
        r.param_words = param_words(p, r.seed)
        r.packed_stops = packed_stops(p)
        r.flags = row_flags(p, self.vocab)
        if nr.lora_slot != -1:
            from xlaserve.backends_xla.lora import lora_slot_of

            r.lora_slot = lora_slot_of(self, nr.lora_slot)
        if p.needs_penalties:
            n = r.num_prompt_tokens
            r.prompt_mask = np.zeros(self.vocab, bool)
            r.prompt_mask[[t for t in r.token_ids[:n] if t < self.vocab]] = True
            r.output_counts = np.bincount(
                [t for t in r.token_ids[n:] if t < self.vocab], minlength=self.vocab
            ).astype(np.int32)
        return r

    def _append_token(self, r: _ReqState, tok: int) -> None:
        r.token_ids.append(tok)
        if r.output_counts is not None and tok < self.vocab:
            r.output_counts[tok] += 1

    def _prepare(self, so: SchedulerOutput) -> StepBatch:
        """The step's validated chunks (runner_core.py) padded into the bucket's host arrays."""
        k, r = self.num_spec_tokens, self.max_num_seqs
        plan = self._plan_step(so, k, self.max_blocks_per_seq, r)
        x = ragged_inputs(plan.chunks(), self.block_size)
        t, b = len(x.input_ids), len(plan.req_ids)
        batch = self._dummy_batch(pick_bucket(self.token_buckets, t))
        batch.input_ids[:t], batch.positions[:t] = x.input_ids, x.positions
        batch.slot_mapping[:t] = x.slot_mapping
        batch.kv_lens[:b] = x.seq_lens
        batch.block_tables[:b, : x.block_tables.shape[1]] = x.block_tables
        batch.cu_q_lens[1 : b + 1], batch.cu_q_lens[b + 1 :] = x.query_start_loc[1:], t
        ends = x.query_start_loc[1:]
        batch.logits_indices[:b] = ends - 1
        for i, ds in enumerate(plan.drafts):  # draft position j < d scores row end-1-d+j;
            d = len(ds)  # padding: the last
            for j in range(k):
                batch.logits_indices[r + i * k + j] = ends[i] - 1 - d + min(j, d)
        nf = len(plan.feed_dst)  # PENDING inputs, fed from the previous launch's tokens
        batch.feed_dst[:nf], batch.feed_src[:nf] = plan.feed_dst, plan.feed_src
        batch.num_seqs[0] = b
        batch.req_ids, batch.starts, batch.counts = plan.req_ids, plan.starts, plan.counts
        batch.sampling, batch.drafts = plan.sampling, plan.drafts
        if self.state_model:  # padding rows keep slot S (dropped writes)
            batch.state_slots[:b] = [st.state_slot for st in plan.states]
        if self.lora_tables is not None:  # each token's LoRA slot (padding: -1)
            from xlaserve.backends_xla.lora import fill_token_slots

            fill_token_slots(batch.lora_slots, [st.lora_slot for st in plan.states],
                             x.query_start_loc)  # fmt: skip
        return batch

    def _dummy_batch(self, t: int) -> StepBatch:
        """An all-padding batch of token bucket t (programs.py)."""
        batch = dummy_batch(t, self.max_num_seqs, self.max_blocks_per_seq, self.num_rows)
        if self.state_model:
            batch.state_slots = np.full(self.max_num_seqs, self._num_state_slots, np.int32)
        return batch

    def _put(self, tree):  # noqa: ANN001, ANN202
        """Host arrays -> replicated device arrays (one sharding always, as compiled)."""
        return jax.device_put(tree, self._replicated)

    def _device_inputs(self, batch: StepBatch) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """The forward's inputs: the packed step (one copy), the last sampled tokens and, for
        state-space models, the rows' state slots (else None)."""
        slots = None if batch.state_slots is None else self._put(batch.state_slots)
        return self._put(batch.packed), self._last_tokens, slots

    def _forward(self, batch: StepBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run the model; keeps the (donated) cache; returns last-token rows [R, H], hidden
        [T, H] and the sampler's packed parameters (on the device)."""
        # The host arrays go to the compiled program as they are: it transfers them to its
        # input shardings itself, ~60 us a step less than a jax.device_put first (CPU, one
        # device). batch.packed is this step's own copy (dummy_batch), never reused.
        slots = batch.state_slots
        rows, hidden, self.kv_caches, params = self._program(FORWARD, len(batch.input_ids))(
            self.weights, self.kv_caches, batch.packed, self._last_tokens, slots
        )
        return rows, hidden, params

    # ---------------------------------------------------------------- sampling inputs
    def _sampling_params(
        self,
        rows: list[_ReqState | None],
        batch: StepBatch,
        b: int,
        bitmasks: dict,
        force_extras: bool = False,
    ) -> tuple[dict[str, jax.Array], SampleMode]:
        """Pack the SAMPLE program's per-row parameters into batch.sample_params; returns its
        dense [B, V] inputs (device-resident neutral ones unless a row needs them) and the
        sampler branches the rows need. force_extras: apply the dense fields even if no row
        needs them yet (late masks)."""
        extras, with_lp, rand, filt = step_summary(rows, batch.req_ids, bitmasks)
        extras = extras or force_extras
        mode = SampleMode(extras, rand, filt, with_lp)
        if extras or with_lp:
            h = sampling_host(rows, batch.req_ids, b, self.vocab, extras, with_lp, bitmasks)
            pack_params(h, batch.sample_params)
            return self._dense_extras(h, b), mode
        # Fast path: each request's parameter words are packed once (`_new_state`).
        grid = batch.sample_params[:-2].reshape(PARAM_ROWS, -1)
        live = [i for i, r in enumerate(rows) if r is not None]
        if live:
            grid[:, live] = np.stack([rows[i].param_words for i in live], axis=1)
            grid[STEPS_ROW, live] = [rows[i].num_output for i in live]
        return self._dense_extras({}, b), mode

    def _dense_extras(self, host: dict[str, np.ndarray], b: int) -> dict[str, jax.Array]:
        """The dense sampler fields: those in `host` copied, the rest device-resident neutral."""
        if b not in self._neutral:
            self._neutral[b] = self._put(neutral_extras(b, self.vocab))
        dense = {k: host[k] for k in DENSE_FIELDS if k in host}
        return {**self._neutral[b], **self._put(dense)} if dense else self._neutral[b]

    def _put_sampling(self, host: dict[str, np.ndarray], b: int) -> SamplingTensors:
        """Host fields -> SamplingTensors on the device; dense fields missing from `host` are
        the bucket's device-resident neutral ones (copied once)."""
        if b not in self._neutral:
            self._neutral[b] = self._put(neutral_extras(b, self.vocab))
        return SamplingTensors(**{**self._neutral[b], **self._put(host)})

    def _sampling_tensors(
        self,
        rows: list[_ReqState | None],
        req_ids: list[str],
        b: int,
        extras: bool,
        with_logprobs: bool,
        bitmasks: dict,
        positions: list[int] | None = None,
        prefixes: list[list[int]] | None = None,
    ) -> SamplingTensors:
        """Padded per-row parameters; rows that do not sample this step (None) are greedy.
        bitmasks: req_id -> i32 [positions, W] (row 0 is this step's). With speculation, row i
        scores position positions[i] after the drafts prefixes[i] (counts, steps, bitmask row)."""
        h = sampling_host(rows, req_ids, b, self.vocab, extras, with_logprobs, bitmasks,
                          positions, prefixes)  # fmt: skip
        return self._put_sampling(h, b)

    def _verify_step(
        self,
        so: SchedulerOutput,
        batch: StepBatch,
        rows_h: jax.Array,
        hidden: jax.Array,
        out: RunnerOutput,
    ) -> None:
        """A step with drafts: one verify program over 1 + K rows per request (padded)."""
        k = self.num_spec_tokens
        b = pick_bucket(self.seq_buckets, len(batch.req_ids))
        reqs = [
            self.requests[rid] if s else None
            for rid, s in zip(batch.req_ids, batch.sampling, strict=True)
        ]
        reqs, rids, positions, prefixes, drafts, num_drafts = verify_rows(
            reqs, batch.req_ids, batch.drafts, b, k
        )
        extras, with_lp, _, _ = step_summary(reqs, rids, so.grammar_bitmask)
        st = self._sampling_tensors(
            reqs, rids, len(reqs), extras, with_lp, so.grammar_bitmask, positions, prefixes
        )
        res = jax.device_get(
            self._program(VERIFY, b)(
                self.weights, rows_h, st, self._put(drafts), self._put(num_drafts)
            )
        )
        self._prompt_logprobs(batch, hidden, out)
        self._emit(
            batch,
            res,
            out,
            lambda i: [int(t) for t in res.token_ids[i, : int(res.num_tokens[i])]],
            lambda i: i * (k + 1),
        )

    def _emit(
        self,
        batch: StepBatch,
        res: SamplerOutput | VerifyOutput,
        out: RunnerOutput,
        tokens: Callable[[int], list[int]],
        first_row: Callable[[int], int],
    ) -> None:
        """Record a step's results (SAMPLE or VERIFY program output `res`) in `out`: request i of
        the batch gets `tokens(i)` (one sampled token, or the accepted drafts + one), whose
        logprobs sit in rows first_row(i), first_row(i) + 1, ... of `res`."""
        for i, rid in enumerate(batch.req_ids):
            r = self.requests[rid]
            r.num_computed_tokens += batch.counts[i]
            if not batch.sampling[i]:
                out.sampled_token_ids[rid] = []
                continue
            if res.has_nan[i]:
                self._fail(out, rid)
                continue
            toks = tokens(i)
            self._accept(out, rid, r, toks)
            if r.params.logprobs is not None:
                out.logprobs[rid] = self._logprobs(res, r, first_row(i), len(toks))

    @staticmethod
    def _logprobs(
        res: SamplerOutput | VerifyOutput, r: _ReqState, lo: int, n: int
    ) -> list[TokenLogprobs]:
        """The request's TokenLogprobs of result rows lo .. lo + n - 1 (host arrays)."""
        rows = range(lo, lo + n)
        return to_token_logprobs(res.logprob_ids, res.logprobs, res.ranks, rows, r.params.logprobs)

    def _prompt_logprobs(self, batch: StepBatch, hidden: jax.Array, out: RunnerOutput) -> None:
        """Logprobs of prompt tokens whose preceding position was computed this step."""
        # (rid, row of the chunk's first token in T, first position computed, target positions [lo, hi))
        wanted = []
        off = 0
        for rid, c, n in zip(batch.req_ids, batch.starts, batch.counts, strict=True):
            r = self.requests[rid]
            lo, hi = c + 1, min(c + n + 1, r.num_prompt_tokens)
            if r.params.prompt_logprobs is not None and hi > lo:
                wanted.append((rid, off - c, lo, hi))  # row of target position p: off - c + p - 1
            off += n
        if not wanted:
            return
        t = len(batch.input_ids)
        targets = np.zeros(t, np.int32)
        for rid, base, lo, hi in wanted:
            targets[base + lo - 1 : base + hi - 1] = self.requests[rid].token_ids[lo:hi]
        prog = self._program(PROMPT_LOGPROBS, t)
        lps, ids, ranks = jax.device_get(prog(self.weights, hidden, self._put(targets)))
        for rid, base, lo, hi in wanted:
            k = 1 + self.requests[rid].params.prompt_logprobs
            rows = range(base + lo - 1, base + hi - 1)
            out.prompt_logprobs[rid] = to_token_logprobs(ids, lps, ranks, rows, k - 1)
