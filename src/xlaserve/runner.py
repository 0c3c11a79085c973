"""The seam between the backend-neutral engine core and a backend (torch or xla).

Each step the scheduler builds one `SchedulerOutput`; the backend's `ModelRunner.execute` returns
one `RunnerOutput`. Only what changed is sent: the runner keeps per-request state (a persistent
batch) keyed by request id, from the step a request appears in `new_requests` until its id shows
up in `finished_req_ids` (finished, aborted or preempted). A preempted request that resumes comes
back in `new_requests` with all its tokens so far (prompt + output).

Runner-side token bookkeeping: the runner appends the tokens it samples to its own copy of the
request's tokens; the engine never sends sampled tokens back. With speculative decoding the
scheduler sends the draft tokens of the step in `spec_token_ids`; the runner appends only the
accepted ones (+ the bonus/recovered token) and returns them.

No torch or jax import here: backends are registered by name and imported lazily. The engine
reaches a backend only through this registry (`create_runner`, `get_capabilities`,
`backends_with`): it asks what a runner can do (`RunnerCapabilities`), never which backend it is.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from xlaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xlaserve.config import EngineConfig
    from xlaserve.model_loader.spec import ModelSpec


@dataclass
class NewRequestData:
    req_id: str
    # Prompt + output tokens so far (output non-empty only for a resumed, preempted request).
    token_ids: list[int]
    # How many of token_ids are prompt (penalties distinguish prompt from output tokens).
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # KV block ids of this request, in order; block j holds token positions
    # [j * block_size, (j + 1) * block_size).
    block_ids: list[int]
    # Tokens whose KV is already in the cache (prefix-cache hit); computation starts here.
    num_computed_tokens: int
    # Recurrent-state slot (core/cache_spec.py) of models with state-space / linear-attention
    # layers: index into each such layer's state tensors; -1 for attention-only models. A new
    # request (num_computed_tokens 0) starts from a zero state; the slot is the request's until
    # its id shows up in finished_req_ids.
    state_slot: int = -1
    # LoRA slot (xlaserve/lora): index into the runner's adapter slot table; -1 = base model.
    # Fixed until the request's id shows up in finished_req_ids.
    lora_slot: int = -1


@dataclass
class CachedRequestData:
    req_id: str
    # Blocks appended to the request's block table this step (may be empty).
    new_block_ids: list[int]
    # Tokens whose KV is in the cache before this step (the runner checks it against its state).
    num_computed_tokens: int
    # Tokens the engine appended to the request that the runner did not sample itself
    # (structured-output jump-forward: tokens the grammar forces), in order; the runner appends
    # them to its copy of the request's tokens before this step, after the tokens it sampled.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step (incl. draft tokens). Dict order = batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # req_id -> draft tokens to verify this step (speculative decoding); absent = none.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests the runner must forget before this step (finished, aborted or preempted).
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests that sample in this step while an earlier step is still in flight (async
    # scheduling; the scheduler's bookkeeping, runners may ignore it).
    pending_req_ids: set[str] = field(default_factory=set)
    # req_id -> allowed-token bitmask, numpy int32 [num_positions, ceil(vocab / 32)] (bit i of
    # word w allows token 32 * w + i); num_positions = 1 + number of drafts. Absent = unconstrained.
    grammar_bitmask: dict[str, Any] = field(default_factory=dict)
    # Async scheduling with grammars: requests whose bitmask rows are not in grammar_bitmask at
    # launch. The engine fills them once the previous step's tokens are processed, while this
    # step's forward runs, and hands them to `runner.apply_bitmasks(handle, masks)` before
    # `finish(handle)`; the runner samples this step only then. Empty: nothing comes late.
    late_bitmask_req_ids: set[str] = field(default_factory=set)
    # KV offloading (core/offload.py). The runner performs these copies BEFORE the forward pass,
    # in exactly this order: 1. kv_disk_out, 2. kv_copy_out, 3. kv_disk_in, 4. kv_copy_in,
    # 5. forward. Blocks evicted in this step are copied out before this step's forward
    # overwrites them; a host slot is used by at most one write per step and is never
    # overwritten after being read in the same step (the offload manager pins it).
    # (host_slot, device_block_id): host tier -> device block (host/disk prefix hits).
    kv_copy_in: list[tuple[int, int]] = field(default_factory=list)
    # (device_block_id, host_slot): device block -> host tier (evicted or swapped-out blocks).
    kv_copy_out: list[tuple[int, int]] = field(default_factory=list)
    # (host_slot, block_hash): write the host slot to the disk tier (file named by the hash).
    kv_disk_out: list[tuple[int, int]] = field(default_factory=list)
    # (block_hash, host_slot): read the block's disk file into the host slot.
    kv_disk_in: list[tuple[int, int]] = field(default_factory=list)
    # (slot, LoRAAdapter): write the adapter into the runner's LoRA slot table before this
    # step's forward (replacing what the slot held). The engine never replaces a slot that a
    # running request uses.
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)

    @property
    def has_kv_copies(self) -> bool:
        return bool(self.kv_copy_in or self.kv_copy_out or self.kv_disk_out or self.kv_disk_in)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner: no tokens and no KV copies (copies must never be dropped)."""
        return self.total_num_scheduled_tokens == 0 and not self.has_kv_copies


@dataclass
class TokenLogprobs:
    """Logprobs at one position: entry 0 is the sampled (or actual prompt) token, then the top-k
    tokens by probability. All from log_softmax of the raw logits."""

    token_ids: list[int]
    logprobs: list[float]
    # 1-based rank of token_ids[0] in the distribution.
    rank: int


@dataclass
class RunnerOutput:
    # req_id -> tokens sampled this step: [] for a partial prefill chunk, [t] for a decode or the
    # last prefill chunk, several with speculative decoding (accepted drafts + 1).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> one TokenLogprobs per sampled token (only when the request asked for logprobs).
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> TokenLogprobs for prompt positions whose *next* token was in this step's chunk
    # (position p holds log P(prompt[p] | prompt[:p]); position 0 has none).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for the next step (draft model / eagle run inside the runner).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> error message: that request failed (e.g. NaN logits); others are unaffected.
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunnerCapabilities:
    """What a backend's runner can do, declared on its class (`capabilities`). The engine checks
    a configuration against these before loading anything; a feature not listed is refused with
    the names of the backends that list it."""

    # tensor_parallel_size > 1.
    tensor_parallel: bool = False
    # data_parallel_size > 1 together with tensor_parallel_size > 1, replicas in one process.
    data_parallel_with_tensor_parallel: bool = False
    # enable_expert_parallel (MoE experts split over the tensor-parallel devices).
    expert_parallel: bool = False
    # nnodes > 1: one engine over several hosts (e.g. jax.distributed); torch spans hosts with
    # distributed_executor_backend="ray" instead (tensor_parallel).
    multi_host: bool = False
    # speculative_config.method values the runner verifies / proposes.
    speculative_methods: tuple[str, ...] = ()
    # Host / disk KV offload (SchedulerOutput.kv_copy_* / kv_disk_*).
    kv_offload: bool = False
    # Weight quantization methods (ModelConfig.quantization / checkpoint formats).
    quantization: tuple[str, ...] = ()
    # cache.kv_cache_dtype values.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    # Checkpoint formats it loads: "safetensors" (HF), "orbax" (xlaserve convert --to orbax).
    checkpoint_formats: tuple[str, ...] = ("safetensors",)
    # launch / finish (async scheduling); whether it is on by default is `async_by_default`.
    async_scheduling: bool = False
    # Multi-LoRA (config.lora.enable_lora; NewRequestData.lora_slot, SchedulerOutput.lora_loads).
    lora: bool = False


class ModelRunner(Protocol):
    """What a backend implements. Constructed as `cls(config, spec)`, or through the class's
    optional `create(config, spec)` (e.g. an executor over tensor-parallel ranks)."""

    # What this backend can do (read from the class, before any instance exists).
    capabilities: ClassVar[RunnerCapabilities]

    def load_model(self) -> None:
        """Load weights (or make dummy ones) onto the device(s)."""

    def determine_num_kv_blocks(self) -> int:
        """An explicit `cache.num_kv_blocks`, else what fits in memory after a peak forward."""

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache; compile/capture what needs the cache's shapes."""

    # Optional (models with recurrent-state layers, core/cache_spec.py):
    #   num_state_slots() -> int: state slots allocated by init_kv_cache (decided with the blocks
    #     in determine_num_kv_blocks); absent or 0 = an attention-only model.

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step."""

    # Optional (async scheduling; the engine uses it when a runner has both):
    #   launch(so) -> handle: issue the step without waiting for its tokens. A request may then
    #     be scheduled again before `finish`: its last token is the one this launch samples,
    #     and the runner feeds it to the next launch itself (e.g. on the device).
    #   finish(handle) -> RunnerOutput: wait for and return that step's output.
    # Handles are finished in launch order, at most one step ahead.
    #   apply_bitmasks(handle, masks) -> None (optional; with launch / finish): the late grammar
    #     bitmasks of a launched step (`SchedulerOutput.late_bitmask_req_ids`), req_id -> int32
    #     [1, W]; a listed request missing from masks samples unconstrained (it has finished).
    #     Called once per launch whose step lists late ids, after `launch` and before `finish`.
    #     Without it the engine turns async scheduling off while any grammar is live.
    #   late_bitmask_buffer(handle, req_ids) -> int32 [len(req_ids), W] array | None (optional):
    #     where those masks may be filled in place (row i for req_ids[i]: e.g. the runner's
    #     pinned upload buffer); called just before apply_bitmasks; None = no such buffer.
    #   ready_token_budget() -> int | None (optional): while the runner still compiles the
    #     programs of larger steps in the background, the most tokens a step may hold; None
    #     once it runs every step size (the engine then stops asking).

    def shutdown(self) -> None:
        """Free device memory and worker processes."""


# name -> "module:Class", imported only when asked for.
_BACKENDS: dict[str, str] = {
    "torch": "xlaserve.backends_torch.runner:TorchModelRunner",
    "xla": "xlaserve.backends_xla.runner:XlaModelRunner",
}


def register_backend(name: str, target: str) -> None:
    """Register a backend as "package.module:ClassName" (imported lazily); EngineConfig then
    accepts `backend=name`."""
    _BACKENDS[name] = target


def registered_backends() -> tuple[str, ...]:
    """Names `get_runner_class` knows: the built-in "torch" and "xla", then registered ones."""
    return tuple(_BACKENDS)


def get_runner_class(name: str) -> type:
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    module, _, cls = _BACKENDS[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"backend {name!r} needs packages that are not installed ({e}); "
            f"install them (see README) or pick another backend"
        ) from e
    return getattr(mod, cls)


def resolve_backend(name: str) -> str:
    """A configured backend name: "auto" -> the platform's default (platforms/)."""
    if name != "auto":
        return name
    from xlaserve.platforms import current_platform

    return current_platform.default_backend


def get_capabilities(name: str) -> RunnerCapabilities:
    """The capabilities a backend's runner class declares (imports that backend); a registered
    runner that declares none gets the defaults (plain single-device serving)."""
    return getattr(get_runner_class(name), "capabilities", RunnerCapabilities())


def backends_with(want: Callable[[RunnerCapabilities], bool]) -> list[str]:
    """Registered backends whose capabilities satisfy `want`, in registration order (for error
    messages and for picking a backend a checkpoint needs); backends that do not import here
    (packages missing) are left out."""
    names = []
    for name in _BACKENDS:
        try:
            caps = get_capabilities(name)
        except ImportError:
            continue
        if want(caps):
            names.append(name)
    return names


def backend_names(names: list[str]) -> str:
    """'a' or 'a' or 'b' (for messages)."""
    return " or ".join(repr(n) for n in names) if names else "(none installed)"


def checkpoint_converter(fmt: str) -> Callable[..., dict[str, Any]]:
    """`convert_checkpoint(model, out_dir, fmt, tensor_parallel_size, dtype) -> marker dict` of the
    first backend that lists checkpoint format `fmt` and writes it (`xlaserve convert`)."""
    for name in backends_with(lambda caps: fmt in caps.checkpoint_formats):
        convert = getattr(get_runner_class(name), "convert_checkpoint", None)
        if convert is not None:
            return convert
    raise ValueError(f"no installed backend writes {fmt!r} checkpoints")


def create_runner(config: EngineConfig, spec: ModelSpec, backend: str) -> ModelRunner:
    """The backend's runner: `cls.create(config, spec)` where the class has one, else
    `cls(config, spec)`."""
    cls = get_runner_class(backend)
    create = getattr(cls, "create", None)
    return create(config, spec) if create is not None else cls(config, spec)
