"""Every configuration dataclass of xlaserve.

Rules:
- Each field is typed and defaulted; `__post_init__` checks values and raises `ValueError` with a
  message naming the field.
- CLI flags map one to one onto these fields (`--max-num-seqs` -> `SchedulerConfig.max_num_seqs`),
  see `entrypoints/cli.py`.
- No torch or jax import here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "torch", "xla")
ASYNC_SCHEDULING = ("auto", "on", "off")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class ModelConfig:
    """What model to serve and how to run it numerically."""

    # Local HF-layout directory or hub id; None means the demo model shipped in the package.
    model: str | None = None
    # Tokenizer directory; None means the model directory.
    tokenizer: str | None = None
    # Weights/activation dtype; "auto" = config.json's torch_dtype (float32 on CPU for fp16/bf16
    # checkpoints is NOT applied automatically: the backend decides what the platform supports).
    dtype: str = "auto"
    # Longest prompt + output; None = the model's max_position_embeddings.
    max_model_len: int | None = None
    # Global seed for the engine's random state (per-request seeds override).
    seed: int = 0
    # Name the server reports and accepts as `model`; None = the model argument as given (vLLM).
    served_model_name: str | None = None
    # Hub revision, used only when downloading.
    revision: str | None = None
    # Refused: xlaserve never executes code shipped with a checkpoint.
    trust_remote_code: bool = False
    # Weight quantization: None, "int8" (weight-only), "int8_w8a8" (int8 weights and per-token
    # int8 activations, SmoothQuant-style), "int4", "fp8" (fp8 weights, per-token activations).
    quantization: str | None = None
    # Chat template (Jinja text, or the path of a file holding it) used instead of the
    # tokenizer's own; None = the tokenizer's.
    chat_template: str | None = None
    # Most logprobs (and prompt_logprobs) a request may ask for per position; at most 20 (the
    # top-k both samplers compute).
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(
            self.max_model_len is None or self.max_model_len > 0,
            f"max_model_len must be positive, got {self.max_model_len}",
        )
        _check(
            not self.trust_remote_code,
            "trust_remote_code is not supported: xlaserve never runs code shipped with a model",
        )
        _check(
            0 <= self.max_logprobs <= 20,
            f"max_logprobs must be in [0, 20], got {self.max_logprobs}",
        )
        _check(
            self.quantization in (None, "int8", "int8_w8a8", "int4", "fp8"),
            "quantization must be None, 'int8', 'int8_w8a8', 'int4' or 'fp8', got "
            f"{self.quantization!r}",
        )


@dataclass
class CacheConfig:
    """Paged KV cache."""

    # Tokens per KV block (page).
    block_size: int = 16
    # Explicit number of KV blocks; None = profile memory with gpu_memory_utilization.
    num_kv_blocks: int | None = None
    # Fraction of accelerator memory the engine may use (weights + KV + activations).
    gpu_memory_utilization: float = 0.9
    # Automatic prefix caching (chained block hashes, LRU eviction).
    enable_prefix_caching: bool = True
    # KV cache element type: "auto" (= model dtype), "fp8", "int8".
    kv_cache_dtype: str = "auto"
    # Host-memory offload tier size in bytes (0 = off).
    kv_offload_bytes: int = 0
    # Optional disk tier directory for offloaded blocks.
    kv_offload_dir: str | None = None
    # CPU backends: KV cache bytes when num_kv_blocks is None (no memory profiling on CPU).
    cpu_kv_cache_bytes: int = 512 * 1024 * 1024
    # Recurrent-state slots of state-space / hybrid models (Mamba, Bamba, ...: one per running
    # sequence, core/cache_spec.py); None = max_num_seqs, fewer when memory is short.
    num_state_slots: int | None = None

    def __post_init__(self) -> None:
        _check(self.block_size > 0, f"block_size must be positive, got {self.block_size}")
        _check(
            self.num_kv_blocks is None or self.num_kv_blocks > 0,
            f"num_kv_blocks must be positive, got {self.num_kv_blocks}",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(
            self.kv_cache_dtype in ("auto", "fp8", "int8"),
            f"kv_cache_dtype must be 'auto', 'fp8' or 'int8', got {self.kv_cache_dtype!r}",
        )
        _check(self.kv_offload_bytes >= 0, "kv_offload_bytes must be >= 0")
        _check(
            self.num_state_slots is None or self.num_state_slots > 0,
            f"num_state_slots must be positive, got {self.num_state_slots}",
        )


# Platform defaults of (max_num_seqs, max_num_batched_tokens), as vLLM sizes them by hardware:
# (GPUs with at least this much memory, offline `LLM`, server). Offline batches take a larger
# step budget (throughput); the server keeps a smaller one (a long prompt's chunk delays the
# running decodes less). H200 (2026-12-03, bench/RESULTS.md): offline 256 / 256 over 1000
# prompts measured 14,220 / 14,961 / 14,447 output tok/s at 256 / 512 / 1024 sequences.
GPU_BATCH_LIMITS: list[tuple[float, tuple[int, int], tuple[int, int]]] = [
    (70.0, (512, 16384), (512, 8192)),  # H100 / H200 class
    (0.0, (256, 8192), (256, 2048)),
]
# CPU and TPU (the XLA backend compiles a bucket per size up to these limits).
HOST_BATCH_LIMITS = (64, 2048)


def default_batch_limits(platform: Any, offline: bool, backend: str = "auto") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) where the user sets none: by GPU memory for the
    torch backend on CUDA / ROCm (GPU_BATCH_LIMITS), HOST_BATCH_LIMITS elsewhere (and for the
    XLA backend, which compiles a bucket per size). `platform`: an xlaserve.platforms.Platform
    (or its proxy); offline: the `LLM` class, else the server; backend: EngineConfig.backend."""
    if backend not in ("auto", "torch"):  # asks nothing of the platform: on an NVIDIA host
        return HOST_BATCH_LIMITS  # that means importing torch and a CUDA context (XLA start-up)
    if backend == "auto":
        backend = platform.default_backend
    if not platform.is_gpu() or backend != "torch":
        return HOST_BATCH_LIMITS
    for min_gib, off, server in GPU_BATCH_LIMITS:
        if platform.device_memory_gib >= min_gib:
            return off if offline else server
    return HOST_BATCH_LIMITS


@dataclass
class SchedulerConfig:
    """Token-budget continuous batching."""

    # Most requests running at once (default: by platform, see `default_batch_limits`).
    max_num_seqs: int | None = None
    # Token budget of one step, prefill chunks + decodes (default: by platform).
    max_num_batched_tokens: int | None = None
    # "fcfs" or "priority" (lower value first, then arrival).
    policy: str = "fcfs"
    # Split long prompts over several steps.
    enable_chunked_prefill: bool = True
    # Bound on the waiting queue in sequences (None = unbounded); the server answers 503 with
    # Retry-After when full. Bounded by default so a flood queues no unbounded work.
    max_num_waiting: int | None = 1024
    # What preemption does with a request's blocks: "recompute" or "swap" (host tier).
    preemption_mode: str = "recompute"
    # Schedule step N+1 while step N runs on the device: "on", "off", "auto" (on for the XLA
    # backend on one host and for torch on CUDA; off for torch on the CPU). Not with
    # speculative decoding or KV offload; synchronous while a structured-output request runs.
    async_scheduling: str = "auto"
    # Fairness: while requests of other groups wait, the sequences of one request (its n
    # samples and, from the server, all prompts of one HTTP request) hold at most this share of
    # max_num_seqs (at least one slot); sequences over it are preempted newest first. 1.0 = off.
    max_running_share: float = 0.5

    def __post_init__(self) -> None:
        # None: left to EngineConfig, which knows the platform and backend.
        _check(
            self.max_num_seqs is None or self.max_num_seqs > 0,
            f"max_num_seqs must be positive, got {self.max_num_seqs}",
        )
        _check(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens > 0,
            f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}",
        )
        _check(
            self.policy in ("fcfs", "priority"),
            f"policy must be fcfs|priority, got {self.policy!r}",
        )
        _check(
            self.preemption_mode in ("recompute", "swap"),
            f"preemption_mode must be recompute|swap, got {self.preemption_mode!r}",
        )
        _check(
            self.async_scheduling in ASYNC_SCHEDULING,
            f"async_scheduling must be one of {ASYNC_SCHEDULING}, got {self.async_scheduling!r}",
        )
        _check(
            self.max_num_waiting is None or self.max_num_waiting > 0,
            "max_num_waiting must be positive",
        )
        _check(
            0.0 < self.max_running_share <= 1.0,
            f"max_running_share must be in (0, 1], got {self.max_running_share}",
        )

    def fill_limits(self, seqs: int, tokens: int) -> None:
        """Set max_num_seqs / max_num_batched_tokens where they are None."""
        if self.max_num_seqs is None:
            self.max_num_seqs = seqs
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = tokens


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Torch backend: "mp" (one host) or "ray" (several hosts).
    distributed_executor_backend: str = "mp"
    # MoE: shard the experts over the tensor-parallel devices (each holds num_experts / TP
    # experts) instead of replicating them. XLA backend.
    enable_expert_parallel: bool = False
    # XLA multi-host (jax.distributed): number of hosts (processes); > 1 turns it on. Host 0 runs
    # the engine; the others run its steps (backends_xla/multihost.py).
    nnodes: int = 1
    # XLA multi-host: this host's index (0 = the engine host); None = from the environment
    # (Cloud TPU metadata).
    node_rank: int | None = None
    # XLA multi-host: address of host 0 (the jax.distributed coordinator); None = from the
    # environment (Cloud TPU metadata).
    master_addr: str | None = None
    # XLA multi-host: coordinator port on host 0.
    master_port: int = 8476

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        _check(self.data_parallel_size >= 1, "data_parallel_size must be >= 1")
        _check(
            self.distributed_executor_backend in ("mp", "ray"),
            "distributed_executor_backend must be mp|ray",
        )
        _check(
            isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel must be a bool"
        )
        _check(self.nnodes >= 1, "nnodes must be >= 1")
        _check(
            self.node_rank is None or 0 <= self.node_rank < self.nnodes,
            f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}",
        )
        _check(0 < self.master_port < 65536, "master_port must be in (0, 65536)")
        _check(
            self.nnodes == 1 or self.data_parallel_size == 1,
            "nnodes > 1 (XLA multi-host) cannot be combined with data_parallel_size > 1",
        )


@dataclass
class LoadConfig:
    # "auto" (safetensors, or orbax when the directory is an orbax checkpoint), "safetensors",
    # "dummy" (random weights of the right shapes), "orbax", "pt" (pickle; needs allow_pickle).
    load_format: str = "auto"
    # Hub download cache directory.
    download_dir: str | None = None
    # Allow pickle-based .bin/.pt checkpoints (loaded with weights_only=True).
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        formats = ("auto", "safetensors", "dummy", "orbax", "pt")
        _check(self.load_format in formats, f"load_format must be one of {formats}")
        _check(
            self.load_format != "pt" or self.allow_pickle,
            "load_format='pt' reads pickle files: pass allow_pickle=True to accept that risk",
        )


@dataclass
class SpeculativeConfig:
    # "ngram", "draft_model" or "eagle".
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # Draft or EAGLE model directory.
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        _check(
            self.method in ("ngram", "draft_model", "eagle"),
            f"speculative method must be ngram|draft_model|eagle, got {self.method!r}",
        )
        _check(self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1")
        _check(
            self.method == "ngram" or self.model is not None,
            f"speculative method {self.method!r} needs a model path",
        )
        _check(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "need 1 <= prompt_lookup_min <= prompt_lookup_max",
        )

    @classmethod
    def from_any(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """Accept a config, a dict or a JSON string (the CLI's `--speculative-config`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        return cls(**value)


@dataclass
class StructuredOutputConfig:
    # Grammar engine; only xgrammar is supported.
    backend: str = "xgrammar"
    # Compiled grammars kept per (spec, tokenizer), at most this many ...
    cache_size: int = 256
    # ... and at most this many bytes (xgrammar's own size estimate of each compiled grammar).
    cache_bytes: int = 256 * 1024 * 1024
    # Longest grammar source accepted, in bytes (JSON schema text, regex, choice list, EBNF);
    # longer ones are refused (400) before anything is parsed or compiled.
    max_grammar_bytes: int = 64 * 1024
    # Seconds one grammar compilation may take; past it the compile worker is killed and the
    # requests waiting on it fail. Aborting every such request kills it too.
    compile_timeout: float = 30.0
    # Grammar compile worker processes (killable, so a runaway compile never outlives its
    # request or blocks shutdown); 0 compiles on a thread in-process (not cancellable).
    compile_workers: int = 2
    # Threads of xgrammar's batch bitmask fill (one call per step fills every constrained row);
    # 0 = auto: cpu_count // 4, between 1 and 4, for steps of >= 32 constrained rows, one
    # thread below (`fill_threads`). Measured (bench/structured_bench.py, `fill` row; 128k
    # vocab): 2-core dev host, 256 rows: 1 thread 1.05 ms, 2 or 4 threads 2.2 ms; 16-core H200
    # host, 256 rows: 1 / 2 / 4 / 8 / 16 threads 1.75 / 1.29 / 0.90 / 1.00 / 1.78 ms, one row:
    # 4.5 us on one thread, 100+ us on more.
    bitmask_fill_threads: int = 0
    # Threads of the grammars' batch accept of a step's tokens (xgrammar releases the GIL
    # inside it): 0 = auto, the fill's rule (`fill_threads`); each thread takes >= 32 rows
    # (StructuredOutputManager.batch_accept). Measured on the H100 host (bench/RESULTS.md,
    # twentieth session): no gain shown. Alone, 256 rows: 1 / 4 / 16 threads 0.51 / 0.67 /
    # 0.48 ms; in one engine at batch 256 (`--accept-ab 4`), constrained / plain 0.946 with 4
    # against 0.940 with 1 (noise). Left at auto because the goal runs (0.967-0.980) used it.
    accept_threads: int = 0
    # Async steps with late masks: the fill of the next step's masks runs on a worker thread
    # as soon as the grammars took this step's tokens (xgrammar's fill releases the GIL) and
    # goes to that step right before the next launch, so it overlaps the rest of the step's
    # outputs, the output processing and the next schedule; False = on the engine thread
    # after the outputs. On: with the switch interval shortened while a fill is in flight
    # (engine/core.py, FILL_SWITCH_INTERVAL_S), batch 256 constrained / plain pair-ratio median
    # 0.938 with it against 0.911 without, alternating in one engine (H100, 2026-12-05,
    # `structured_bench --llama8b --batches 256 --repeats 4 --fill-thread ab`).
    fill_thread: bool = True
    # Jump-forward decoding: where the grammar admits exactly one token at the next positions,
    # append those tokens without a forward step each (exact: the sampler could pick nothing
    # else). Off by default: it turns async scheduling off while a grammar is live (the forced
    # tokens follow the previous step's token, which async scheduling has not read when it
    # launches the next step); see bench/structured_bench.py's `jump` row.
    jump_forward: bool = False
    # Most tokens one jump appends (bounds the host work per step).
    jump_forward_max_tokens: int = 64

    def __post_init__(self) -> None:
        _check(self.backend == "xgrammar", "structured output backend must be 'xgrammar'")
        _check(self.jump_forward_max_tokens >= 1, "jump_forward_max_tokens must be >= 1")
        _check(self.bitmask_fill_threads >= 0, "bitmask_fill_threads must be >= 0 (0: auto)")
        _check(self.accept_threads >= 0, "accept_threads must be >= 0 (0: auto)")
        _check(self.cache_size >= 0, "structured_output_cache_size must be >= 0")
        _check(self.cache_bytes >= 0, "grammar_cache_bytes must be >= 0")
        _check(self.max_grammar_bytes > 0, "max_grammar_bytes must be positive")
        _check(self.compile_timeout > 0, "grammar_compile_timeout must be positive")
        _check(self.compile_workers >= 0, "grammar_compile_workers must be >= 0")


def fill_threads(configured: int, cpu_count: int | None) -> int:
    """Threads of the batch bitmask fill and accept (StructuredOutputConfig.bitmask_fill_threads,
    .accept_threads; 0 = auto: a quarter of the host's cores, 1 to 4)."""
    if configured > 0:
        return configured
    return max(1, min(4, (cpu_count or 1) // 4))


TRISTATE = ("auto", "on", "off")
# KernelConfig.lora_impl values (kernels_pallas/lora.py re-exports them as its LORA_IMPLS).
LORA_IMPLS = ("auto", "reference", "xla", "pallas_tpu", "pallas_gpu")
# KernelConfig fields that take TRISTATE values.
TRISTATE_SWITCHES = (
    "triton_ops", "dense_gemv", "fused_greedy", "xla_triton_gemm", "xla_decode_gemv",
    "ssm_prefill_triton", "xla_dispatch_thread", "prefill_sdpa",
)  # fmt: skip


@dataclass(frozen=True)
class KernelConfig:
    """Every kernel, fusion and graph switch of both backends, with its default.

    The engine builds one (`EngineConfig.kernels`) and hands it to the runner, which passes it to
    the model builder, the layers and the kernel launchers; nothing below reads the environment.
    `XLASERVE_<FIELD>` environment variables (e.g. XLASERVE_PDL=0) override the defaults in
    exactly one place, `KernelConfig.from_env` (and `kernel_switch` for a call that was given no
    config: a kernel or layer used on its own, in tests and benchmarks). Tri-state fields are
    "auto" | "on" | "off"; the environment also accepts "1" / "0" for on / off.
    """

    # Torch attention backend by name (backends_torch/layers/attention.py registry): "auto" =
    # "triton" on CUDA (paged, graph-capturable), "torch_batched" elsewhere.
    attention_backend: str = "auto"
    # Torch: rotary and the gated activation as Triton kernels; "auto" = on exactly with CUDA and
    # the Triton attention backend ("on" elsewhere needs TRITON_INTERPRET=1).
    triton_ops: str = "auto"
    # Torch Mamba / Mamba2 prefill through the Triton kernels of kernels_cuda/ssm_prefill.py
    # (Mamba2: every request of the step in one varlen conv + one SSD launch; Mamba: the conv
    # per request, the sequential torch scan) instead of the torch references. "auto" = on CUDA
    # (H200, Bamba-9B shape, 1000 x 256/256 offline: 4,336 tok/s vs 3,340 with the per-request
    # kernels; GPU tests pass), "on" on the CPU needs TRITON_INTERPRET=1 (tests).
    ssm_prefill_triton: str = "auto"
    # Operand precision of the varlen Mamba2 SSD prefill kernel's dots: "auto" = "bf16" for
    # bf16 / fp16 models (as mamba_ssm: the operands in the activation dtype) with 32-token
    # chunks and 64-row P blocks, "tf32x3" (~fp32) for float32 models; or force "tf32x3",
    # "tf32", "bf16", "ieee". H200, Mamba2-2.7B layer, 64 x 256-token prefill step: tf32x3
    # 8.85 ms, tf32 2.39 ms, bf16 0.97 ms (relative error 3.3e-3; bench/RESULTS.md).
    ssd_precision: str = "auto"
    # Torch: rope + KV-cache write in one kernel where the Triton rotary runs and the cache holds
    # floats (a quantized cache keeps the two kernels).
    fused_rope_kv: bool = True
    # Torch: q/k/v and a gated MLP's gate/up as one fused linear each (one GEMM instead of 2-3);
    # off builds the separate layers (A/B measurements).
    fuse_projections: bool = True
    # Torch fused MoE implementation ("triton", "torch_ref", or a registered one); "auto" =
    # "triton" on CUDA, "torch_ref" elsewhere.
    moe_impl: str = "auto"
    # Torch: batch-1 (one-row) fp16 / bf16 linears through the Triton dense GEMV instead of
    # cuBLAS; "auto" = the shapes of kernels_cuda.dense_gemv.DENSE_GEMV_SHAPES (None: every
    # shape on CUDA), "on" = every shape, "off" = none.
    dense_gemv: str = "auto"
    # Dense GEMV: load the first weight tile before the PDL wait (H200 batch-1 graph replay
    # 3.952 -> 3.888 ms).
    gemv_prefetch: bool = True
    # Gated MLP batch-1 decode: act(gate) * up in the gate_up GEMV's epilogue (one kernel fewer
    # per layer; a tie with the prefetch on, H200).
    gate_act_gemv: bool = True
    # Programmatic dependent launch on Hopper+ (each kernel's launch overlaps the previous one's
    # tail; ~0.65 us per kernel boundary of a batch-1 decode graph, H200).
    pdl: bool = True
    # Torch greedy fast path through the fused argmax kernel; "auto" = on CUDA only ("on" on the
    # CPU needs TRITON_INTERPRET=1: tests).
    fused_greedy: str = "auto"
    # Largest split-KV factor a torch decode CUDA graph is captured with (a power of 2).
    graph_max_kv_splits: int = 16
    # Torch "triton" attention backend: sequences whose prefill chunk has at least
    # prefill_sdpa_min_tokens queries attend through cuDNN's fused attention over their context
    # gathered from the paged cache (kernels_cuda/prefill_sdpa.py: a fresh prompt as one causal
    # call, a chunk over a cached prefix as two calls merged by log-sum-exp); the rest of the
    # step keeps the Triton kernel. Layers with a sliding window, soft-cap or attention chunk
    # always keep it. "auto" = on CUDA. H100 (2026-12-05, twentieth session, bench/RESULTS.md):
    # the 30k prompt's second chunk (13,616 queries over 30,000 keys) 8.27 ms split against
    # 12.20 padded to a square call (`chunk_attention.py`); the 30k prefill's attention 426 ms of
    # GPU time against 592 for the Triton kernel (`prefill_profile.py`); 30k TTFT 1.101 s against
    # 1.234 s off and transformers' 1.228 s (`long_context --stages hf,bf16,nosdpa`).
    prefill_sdpa: str = "auto"
    # 4096, not 1024: with 1024 the offline run of 1024-token prompts (16 SDPA sequences a step,
    # a gather and a call each per layer) ran at 0.98x / 0.99x the Triton kernel's (the same
    # calls); chunks this long are where the fused calls gain (the 30k prompt's are 13-16k).
    prefill_sdpa_min_tokens: int = 4096
    # fp8 weights emulated (dequantized matmul) where the device has no fp8 GEMM; otherwise
    # runtime fp8 raises there (a pre-quantized fp8 checkpoint is emulated with a warning).
    fp8_emulation: bool = False
    # XLA ragged paged attention implementation (kernels_pallas): "auto" picks by platform;
    # "reference", "pallas_gpu", ... force one (A/B benchmarks).
    rpa_impl: str = "auto"
    # XLA MoE grouped matmul implementation (kernels_pallas.gmm): "auto" picks by platform.
    gmm_impl: str = "auto"
    # XLA multi-LoRA shrink / expand implementation (kernels_pallas/lora.py, one of LORA_IMPLS):
    # "auto" = the Mosaic grouped matmul on TPU, the Triton-lowered Pallas kernel on GPU, the
    # one-hot einsum form ("xla") on CPU; "reference" / "xla" / "pallas_gpu" / "pallas_tpu" force
    # one (A/B benchmarks). Under tensor parallelism "xla" always (GSPMD partitions einsums, not
    # pallas_calls). Environment override: XLASERVE_LORA_IMPL.
    lora_impl: str = "auto"
    # XLA on CUDA: command buffers (XLA's CUDA graphs) for these thunk kinds, a comma list of
    # XLA's names (FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, CONDITIONAL, WHILE); "auto" =
    # backends_xla.utils.XLA_GPU_COMMAND_BUFFER (measured), "off" = XLA's own default. Applied
    # through XLA_FLAGS before JAX starts its GPU backend (a flag already there wins).
    xla_command_buffer: str = "auto"
    # XLA on CUDA: Triton GEMM fusions ("off" = cuBLAS for every dot); "auto" = the measured
    # default of backends_xla.utils.XLA_GPU_TRITON_GEMM.
    xla_triton_gemm: str = "auto"
    # XLA on CUDA: XLA's autotuning level for its GEMM fusions and convolutions
    # (--xla_gpu_autotune_level, 0-4); -1 = XLA's own default (no flag). Level 0 halves a cold
    # start-up (H200, 8B shape: 42.1 -> 21.9 s to ready, the decode steps at batch 1 and 256
    # unchanged) but its untuned GEMMs make prefill steps of 4096-8192 tokens crawl (1000 x 256
    # prompts at max_num_batched_tokens 8192 did not finish in a minute, 22 s tuned;
    # bench/RESULTS.md): a choice for small token budgets, not a default.
    xla_gpu_autotune_level: int = -1
    # XLA: autotune the GEMMs of programs whose matmuls have at most UNTUNED_MAX_ROWS (16)
    # rows: the forwards and prompt-logprob programs of <= 16 tokens, the samplers / verifiers
    # of <= 16 rows (batch 1-16, whose projections take the Pallas decode GEMV). False (default)
    # = those compile with autotuning off (a per-program compile option; the larger programs
    # keep it; only XLA's GPU compiler reads it). H200, 8B shape (2026-12-05, bench/RESULTS.md):
    # cold start-up 25.0 s to ready, warm 5.7 s; offline 1000 x 256/256 11,816 tok/s against
    # 11,832 with every program tuned (same call).
    # (The bound was 256 first: its untuned batch-256 decode GEMMs took 203 ms a step.)
    xla_autotune_small_programs: bool = False
    # XLA: the smallest token bucket (a power of 2): the decode step of a small batch is padded
    # to it, so it sets the M of every projection's matmul at batch 1. 0 = auto: on the CPU a
    # bucket of 1 token before the powers of two from 16 (batch-1 decode at M = 1: demo model,
    # 2-core host, 518-613 vs 209-292 tok/s with 16, bench/RESULTS.md; one compile more, not
    # four), 16 elsewhere (GPU / TPU matrix units want M >= 16).
    xla_min_token_bucket: int = 0
    # XLA: the smallest request bucket of the sampler programs (a power of 2) after the 1-request
    # one. 0 = auto: every power of 2 on the CPU (sampling work grows with the rows), 1 then the
    # powers from 16 elsewhere: the sampler's lm_head reads its whole weight at any row count up
    # to 16, and each request bucket is two more programs to compile at start-up (the general
    # sampler took 7-16 s each for the 8B shape on the H200, bench/RESULTS.md). A value > 0:
    # powers of 2 from it.
    xla_min_seq_bucket: int = 0
    # XLA: the largest forward token bucket compiled before the engine is ready (a power of 2);
    # larger ones compile in a background thread while the engine serves, the step's token
    # budget held at the largest ready bucket meanwhile (chunked prefill splits long prompts;
    # nothing waits for a compile). 0 = auto: 256 on GPU / TPU (cold start-up), every bucket on
    # the CPU; -1 = every bucket (no deferral). Single host, not enforce_eager, no draft model.
    xla_startup_token_bucket: int = 0
    # XLA: the dense bf16 / f16 linears (q/k/v/o, gate/up/down, lm_head; not quantized ones, not
    # LoRA deltas) through the Pallas decode GEMV (kernels_pallas/gemv.py, Triton lowering) when
    # the program's token bucket is <= 16 (batch-1 decode); "on" = every shape it tiles, "auto" =
    # kernels_pallas.gemv.AUTO_ON_GPU (the shapes of its TUNED table on GPUs: on, measured 1.09x),
    # "off" = XLA's dot. Never on TPU (no Mosaic lowering) nor with tensor_parallel_size > 1.
    xla_decode_gemv: str = "auto"
    # XLA: the forward and SAMPLE programs of an async step are called from a dispatch thread of
    # the runner's own, so the engine's Python for the next step (outputs, scheduling, inputs)
    # runs while XLA launches this step's kernels (it holds no GIL then; on a GPU the launches
    # of an 8B forward take ~4-7 ms of host time). Steps that read device state on the engine
    # thread (drafts, late grammar masks, prompt logprobs, KV offload, LoRA loads) wait for the
    # thread to drain first. "auto" = on for GPU / TPU (H200, 8B, batch 256: 14.0 -> 12.2-12.7
    # ms a step), off on the CPU (no gain measured there; bench/RESULTS.md).
    xla_dispatch_thread: str = "auto"
    # With the dispatch thread: the interpreter's GIL switch interval while it runs, in
    # microseconds (0 = leave Python's 5 ms). The thread holds the GIL only briefly around each
    # XLA call, but a thread that wants the GIL waits up to the switch interval while the
    # engine thread runs Python: at 5 ms that wait lands on the step's critical path (H200,
    # 8B, batch 256: 16.7 -> 14.1 ms a step at 500 us on a slow host, 12.7 -> 12.2 / 12.7 ms on
    # a faster one; bench/RESULTS.md). Lowered only, and restored when the runner shuts down.
    xla_dispatch_switch_interval_us: int = 500
    # Torch w8a8 (kernels_cuda/scaled_mm.py): per-token activation quantization by the fused
    # Triton kernel ("auto" / "triton") or by torch ops ("torch"; A/B measurements).
    act_quant: str = "auto"
    # Torch w8a8 (int8 / fp8) with act_quant on the Triton kernel: the producers of three of a
    # decoder layer's four linear inputs emit them quantized per token (kernels_cuda/
    # fused_act_quant.py): the gated MLP's SiLU-and-mul for down_proj, the two pre-norms (fused
    # add + RMSNorm) for the fused qkv_proj and gate_up_proj (layers/blocks.pre_norm). The same
    # math as the separate quant_rows kernel (a code step apart on a few elements, compiled),
    # one launch and one activation pass fewer per linear. Measured on the H100 (2026-12-05,
    # quant_bench, two calls): offline fp8 +1.3% / +2.0%, int8_w8a8 +4.5% / +4.2%. A/B: the
    # quant_bench rows fp8_unfused / int8_w8a8_unfused (XLASERVE_FUSE_ACT_QUANT=0).
    fuse_act_quant: bool = True
    # Torch int8 w8a8 GEMM: "int_mm" = torch._int_mm (cuBLASLt) + a Triton scale epilogue,
    # "triton" = the Triton int8 tl.dot GEMM with the scales in its epilogue; "auto" = int_mm
    # where its shape rules hold (M > 16, K and N multiples of 8), else triton.
    int8_w8a8_gemm: str = "auto"
    # Torch fp8 w8a8 GEMM (per-channel weights) at M above the GEMV: "scaled_mm" =
    # torch._scaled_mm with row-wise scales, "triton" = the Triton fp8 tl.dot GEMM; "auto" =
    # the per-M table (kernels_cuda.scaled_mm.AUTO_LIBRARY).
    # Block-wise fp8 checkpoints always take the Triton block-scaled GEMM.
    fp8_gemm: str = "auto"
    # Torch int8 weight-only on CUDA at M above the GEMV: "triton" = the Triton tl.dot kernel
    # (kernels_cuda/quant_matmul.py), "cutlass" = CUTLASS 3's Hopper mixed-input GEMM
    # (kernels_cuda/cutlass_w8a16.py: the converted weight feeds wgmma from registers; sm_90,
    # bf16 activations, nvcc and the nvidia-cutlass headers, built once per machine), with the
    # Triton kernel wherever it cannot run. Not timed yet (the quant_bench row int8_cutlass).
    int8_gemm: str = "triton"
    # Torch int8 weight-only on CUDA: M at or above which the weight is dequantized to the
    # activation dtype and multiplied by cuBLAS instead of the fused Triton dequant GEMM (0 =
    # never; an A/B switch for the largest prefill steps, where the dequant pass is cheap).
    int8_dequant_min_m: int = 0

    def __post_init__(self) -> None:
        for name in TRISTATE_SWITCHES:
            value = {"1": "on", "0": "off"}.get(getattr(self, name), getattr(self, name))
            object.__setattr__(self, name, value)  # "1" / "0" (the environment's spelling)
            _check(value in TRISTATE, f"{name} must be one of {TRISTATE}, got {value!r}")
        for name in ("attention_backend", "moe_impl", "rpa_impl", "gmm_impl"):
            _check(bool(getattr(self, name)), f"{name} must be a non-empty name")
        for name, allowed in (
            ("act_quant", ("auto", "triton", "torch")),
            ("int8_w8a8_gemm", ("auto", "int_mm", "triton")),
            ("int8_gemm", ("triton", "cutlass")),
            ("fp8_gemm", ("auto", "scaled_mm", "triton")),
            ("ssd_precision", ("auto", "tf32x3", "tf32", "bf16", "ieee")),
            ("lora_impl", LORA_IMPLS),
        ):
            value = getattr(self, name)
            _check(value in allowed, f"{name} must be one of {allowed}, got {value!r}")
        m = self.prefill_sdpa_min_tokens
        _check(
            isinstance(m, int) and m >= 1,
            f"prefill_sdpa_min_tokens must be an int >= 1, got {m!r}",
        )
        s = self.graph_max_kv_splits
        _check(
            isinstance(s, int) and s >= 1 and s & (s - 1) == 0,
            f"graph_max_kv_splits must be a power of 2 >= 1, got {s!r}",
        )
        lv = self.xla_gpu_autotune_level
        _check(
            isinstance(lv, int) and -1 <= lv <= 4,
            f"xla_gpu_autotune_level must be -1 (XLA's default) or 0-4, got {lv!r}",
        )
        si = self.xla_dispatch_switch_interval_us
        _check(
            isinstance(si, int) and si >= 0,
            f"xla_dispatch_switch_interval_us must be an int >= 0, got {si!r}",
        )
        t = self.xla_startup_token_bucket
        _check(
            isinstance(t, int) and (t in (0, -1) or (t > 0 and t & (t - 1) == 0)),
            f"xla_startup_token_bucket must be 0 (auto), -1 (all) or a power of 2, got {t!r}",
        )
        for name in ("xla_min_token_bucket", "xla_min_seq_bucket"):
            b = getattr(self, name)
            _check(
                isinstance(b, int) and b >= 0 and b & (b - 1) == 0,
                f"{name} must be 0 (auto) or a power of 2 >= 1, got {b!r}",
            )

    @staticmethod
    def env_name(name: str) -> str:
        """The environment variable that overrides field `name` (XLASERVE_<NAME>)."""
        return f"XLASERVE_{name.upper()}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> KernelConfig:
        """Defaults, then `XLASERVE_<FIELD>` variables of `environ` (default os.environ), then
        `overrides` (explicit arguments win). The only reader of these variables."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(cls.env_name(f.name))
            if raw is not None and raw != "":
                values[f.name] = _parse_switch(f.name, raw)
        values.update(overrides)
        return cls(**values)


_KERNEL_FIELDS: dict[str, Any] = {}


def _parse_switch(name: str, raw: str) -> Any:
    """An environment value for KernelConfig field `name`, as the field's type."""
    if not _KERNEL_FIELDS:
        _KERNEL_FIELDS.update({f.name: f.default for f in fields(KernelConfig)})
    default = _KERNEL_FIELDS[name]
    env = KernelConfig.env_name(name)
    low = raw.strip().lower()
    if isinstance(default, bool):
        if low in ("1", "true", "on", "yes"):
            return True
        if low in ("0", "false", "off", "no"):
            return False
        raise ValueError(f"{env} must be 1 or 0, got {raw!r}")
    if isinstance(default, int):
        try:
            return int(low)
        except ValueError:
            raise ValueError(f"{env} must be an integer, got {raw!r}") from None
    if name in TRISTATE_SWITCHES:
        value = {"1": "on", "0": "off"}.get(low, low)
        if value not in TRISTATE:
            raise ValueError(f"{env} must be one of {TRISTATE} (or 1 / 0), got {raw!r}")
        return value
    return raw.strip()


def kernel_switch(name: str, kernels: KernelConfig | None = None) -> Any:
    """Field `name` of `kernels`; with no config (a kernel or layer called on its own), the
    field's default overridden by its environment variable, read here at call time."""
    if kernels is not None:
        return getattr(kernels, name)
    raw = os.environ.get(KernelConfig.env_name(name))
    if raw is None or raw == "":
        if not _KERNEL_FIELDS:
            _KERNEL_FIELDS.update({f.name: f.default for f in fields(KernelConfig)})
        if name not in _KERNEL_FIELDS:
            raise AttributeError(f"KernelConfig has no field {name!r}")
        return _KERNEL_FIELDS[name]
    return _parse_switch(name, raw)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # One or more accepted API keys (the flag repeats). On the command line a key is visible in
    # `ps`: prefer api_key_file or the XLASERVE_API_KEY environment variable.
    api_key: str | list[str] | None = None
    # File holding accepted API keys, one per line (blank lines and '#' comments ignored).
    api_key_file: str | None = None
    # With several API keys each key gets its own prefix-cache salt (no client learns from
    # cache hits what another key sent); True lets all keys share cached prefixes.
    share_prefix_cache_across_keys: bool = False
    # Report usage.prompt_tokens_details.cached_tokens (off by default: prefix-cache hits tell
    # a client whether someone else sent the same prefix recently).
    enable_prompt_tokens_details: bool = False
    # Request bodies above this many bytes are refused (413), compressed or inflated.
    max_request_bytes: int = 4 * 1024 * 1024
    # Per-request timeout in seconds (None = none).
    request_timeout: float | None = None
    log_requests: bool = False
    # TLS: serve HTTPS with this private key and certificate (PEM files); both or neither.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # CA certificates (PEM): clients must then present a certificate signed by one of them.
    ssl_ca_certs: str | None = None
    # No periodic stats line (throughput, running/waiting, KV cache usage, prefix-cache hits).
    disable_log_stats: bool = False
    # Seconds between two stats lines (only intervals with work log one).
    log_stats_interval: float = 10.0
    # Most sequences one request may start: prompts x n (400 beyond).
    max_sequences_per_request: int = 256
    # Most logprobs one response may carry per position: prompts x n x (top) logprobs.
    max_logprobs_per_response: int = 512
    # Most stop strings per request, and the longest one in characters.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    # Chat content is plain text: special-token text in a message (e.g. "<|im_start|>system")
    # is tokenized as text, never as control tokens. True lets content spell control tokens.
    allow_special_tokens_in_content: bool = False
    # Worker threads for CPU-heavy request work kept off the event loop (decompression, JSON
    # parsing of large bodies, chat templating, tokenization).
    cpu_workers: int = 2
    # Run the engine core (scheduler, KV cache, model) in its own process, fed over ZMQ; off:
    # in the server's process on a thread (--no-engine-process).
    engine_process: bool = True
    # aiohttp front processes on the one port (SO_REUSEPORT), all clients of the one engine
    # core process (needs --engine-process). None = auto (`resolve_api_server_count`): 2 on a
    # CUDA host with >= 8 CPU cores and one data-parallel rank, else 1 (bench/RESULTS.md: on
    # the H200 two fronts stream without bunching, mean ITL 1.09x TPOT against 3.1x with one;
    # on a 2-core CPU a second front loses).
    api_server_count: int | None = None
    # Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser.
    enable_auto_tool_choice: bool = False
    # Tool-call format of the model's output: hermes, qwen3, qwen3_coder, llama3_json, mistral,
    # pythonic, deepseek_v3, deepseek_v31.
    tool_call_parser: str | None = None
    # CORS: origins allowed to call the API from a browser; the flag repeats (or takes vLLM's
    # JSON list). None (not given) = "*", any origin, as vLLM.
    allowed_origins: str | list[str] | None = None
    # Accept a per-request `chat_template` (rendered in the same sandbox as the model's).
    trust_request_chat_template: bool = False
    # Sampling defaults for fields a request leaves out: "auto" = the model's
    # generation_config.json, "vllm" = none (temperature 1.0, ...), or a directory holding a
    # generation_config.json.
    generation_config: str = "auto"
    # "generate" (text generation) or "pooling": /v1/embeddings, /pooling, /score, /rerank
    # from the model's final hidden states (generation endpoints off; torch or xla backend;
    # the engine runs in the server's process).
    runner: str = "generate"
    # Pooling: "LAST" (last token, decoder embedding models), "MEAN" (mean over tokens) or
    # "CLS" (first token); the pooled vector is L2-normalised unless --no-pooling-normalize.
    pooling_type: str = "LAST"
    pooling_normalize: bool = True
    # LoRA adapters served by name (needs --enable-lora): name=path, or vLLM's JSON
    # '{"name": ..., "path": ..., "base_model_name": ...}'; several after one flag, or repeated.
    lora_modules: str | list[str] | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            from xlaserve.entrypoints.openai.tools.parsers import TOOL_PARSERS

            _check(
                self.tool_call_parser in TOOL_PARSERS,
                f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}",
            )
        _check(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "enable_auto_tool_choice needs tool_call_parser",
        )
        _check(self.runner in ("generate", "pooling"), "runner must be 'generate' or 'pooling'")
        self.pooling_type = self.pooling_type.upper()
        _check(
            self.pooling_type in ("LAST", "MEAN", "CLS"),
            "pooling_type must be 'LAST', 'MEAN' or 'CLS'",
        )
        for name in (
            "max_request_bytes",
            "max_sequences_per_request",
            "max_logprobs_per_response",
            "max_stop_strings",
            "max_stop_string_chars",
            "cpu_workers",
        ):
            _check(getattr(self, name) > 0, f"{name} must be positive")
        _check(self.log_stats_interval > 0, "log_stats_interval must be positive")
        _check(
            (self.ssl_keyfile is None) == (self.ssl_certfile is None),
            "ssl_keyfile and ssl_certfile go together (give both for HTTPS)",
        )
        _check(
            self.ssl_ca_certs is None or self.ssl_certfile is not None,
            "ssl_ca_certs needs ssl_keyfile and ssl_certfile",
        )
        _check(1 <= self.port <= 65535, f"port must be in 1..65535, got {self.port}")
        n = self.api_server_count
        _check(n is None or n >= 1, "api_server_count must be >= 1")
        _check(
            n is None or n == 1 or self.engine_process,
            "api_server_count > 1 needs the engine core in its own process (--engine-process)",
        )

    def ssl_context(self) -> Any:  # noqa: ANN401 - ssl.SSLContext or None
        """The server's TLS context (None without ssl_certfile). ValueError when a file is
        missing or the key does not match the certificate."""
        if self.ssl_certfile is None:
            return None
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs:
                ctx.load_verify_locations(self.ssl_ca_certs)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"TLS set-up failed (--ssl-keyfile/--ssl-certfile): {e}") from None
        return ctx

    def api_keys(self) -> list[str]:
        """Every accepted key: api_key (one or a list) plus api_key_file's lines. Raises
        ValueError when the file cannot be read or holds no key."""
        keys: list[str] = []
        if isinstance(self.api_key, str):
            keys += self.api_key.split()
        elif self.api_key:
            for k in self.api_key:
                keys += k.split()
        if self.api_key_file:
            try:
                with open(self.api_key_file, encoding="utf-8") as f:
                    lines = [ln.strip() for ln in f]
            except OSError as e:
                raise ValueError(f"api_key_file: cannot read {self.api_key_file}: {e}") from None
            file_keys = [ln for ln in lines if ln and not ln.startswith("#")]
            if not file_keys:
                raise ValueError(f"api_key_file: {self.api_key_file} holds no key")
            keys += file_keys
        return list(dict.fromkeys(keys))  # dedup, order kept


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (xlaserve/lora). Off by default; vLLM's names."""

    enable_lora: bool = False
    # Adapters resident on the device at once (slots); also the most distinct adapters per step.
    max_loras: int = 1
    # Largest adapter rank accepted; the slot tables are sized for it.
    max_lora_rank: int = 16
    # Adapters kept loaded in host memory (LRU); None = max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _check(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _check(
            self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )


@dataclass
class EngineConfig:
    """Everything the engine needs; built by `LLM(...)` or the CLI."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    speculative: SpeculativeConfig | None = None
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # Kernel / fusion / graph switches (defaults overridden by XLASERVE_<FIELD> variables).
    kernels: KernelConfig = field(default_factory=KernelConfig.from_env)
    # "auto" picks current_platform's default backend.
    backend: str = "auto"
    # Torch GPU: no CUDA graphs. XLA: compile buckets lazily instead of at start-up.
    enforce_eager: bool = False
    # XLA persistent compilation cache directory (None = ~/.cache/xlaserve/jax).
    compilation_cache_dir: str | None = None
    # XLA: start-up programs also stored as serialized executables under the compilation cache
    # directory (backends_xla/exec_cache.py), so a warm start loads them without tracing. None
    # (auto) = on GPU / TPU, off on the CPU (start-up there is seconds; an XLA:CPU executable
    # loaded into a process that already ran other programs could miss a JIT'd function).
    xla_executable_cache: bool | None = None

    def __post_init__(self) -> None:
        from xlaserve.runner import registered_backends  # no torch/jax: names only

        names = tuple(dict.fromkeys(BACKENDS + registered_backends()))
        _check(self.backend in names, f"backend must be one of {names}, got {self.backend!r}")
        sc = self.scheduler
        if sc.max_num_seqs is None or sc.max_num_batched_tokens is None:
            from xlaserve.platforms import current_platform

            sc.fill_limits(*default_batch_limits(current_platform, False, self.backend))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (`LLM(model=..., block_size=...)`).

        Each key must name exactly one field of one sub-config or of EngineConfig itself;
        unknown keys raise a ValueError listing them.
        """
        groups: dict[str, type] = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "parallel": ParallelConfig,
            "load": LoadConfig,
            "structured": StructuredOutputConfig,
            "lora": LoRAConfig,
            "kernels": KernelConfig,
        }
        parts: dict[str, dict[str, Any]] = {g: {} for g in groups}
        top: dict[str, Any] = {}
        top_names = {"backend", "enforce_eager", "compilation_cache_dir", "xla_executable_cache"}
        owners = {f.name: g for g, c in groups.items() for f in fields(c)}
        unknown = []
        for key, value in kwargs.items():
            if key == "speculative_config":
                top["speculative"] = SpeculativeConfig.from_any(value)
            elif key in top_names:
                top[key] = value
            elif key in owners:
                parts[owners[key]][key] = value
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        kernels = KernelConfig.from_env(**parts.pop("kernels"))
        return cls(**{g: groups[g](**parts[g]) for g in parts}, kernels=kernels, **top)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
