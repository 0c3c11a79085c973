"""Multi-LoRA serving: the backend-neutral contract (no torch / jax import).

Flow: a request names an adapter (`LoRARequest` offline, the `model` field on the server). The
engine core loads the PEFT files into a `LoRAAdapter` (host memory, numpy; a host cache of
`max_cpu_loras` adapters), and gives it one of `max_loras` device slots (LRU over the slots whose
adapter no running request uses). A slot is written by `SchedulerOutput.lora_loads` before the
forward of the step that first needs it, and a request's slot (`NewRequestData.lora_slot`) stays
fixed until its id shows up in `finished_req_ids`. Slot -1 is the base model (no LoRA applied).

Runner contract (both backends): with `config.lora.enable_lora`, allocate per layer and per
module in `LORA_MODULES` that the model has, a zeroed slot table A [max_loras, max_lora_rank, in]
and B [max_loras, out, max_lora_rank]; write `lora_loads` into it (zero-padded to
max_lora_rank), and for each token t of a LoRA request with slot s add
`(x_t @ A[s].T) @ B[s].T` to the module's output (B is already multiplied by the scaling). The
programs / graphs are compiled once for the slot table, never per adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Module names adapters target, as PEFT names them on Llama-like models. A base that fuses
# projections (qkv_proj, gate_up_proj) applies the split adapters to its fused output's parts.
LORA_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's `LoRARequest`): a unique name, a unique positive
    integer id and the directory holding `adapter_config.json` + `adapter_model.safetensors`."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


@dataclass
class LoRAAdapter:
    """A PEFT adapter loaded into host memory and mapped onto the base model's layers.

    `weights[(layer, module)] = (A, B)`: float32 numpy arrays, A [rank, in_features] and
    B [out_features, rank], with B already multiplied by `scaling` (lora_alpha / rank, or
    lora_alpha / sqrt(rank) for rsLoRA). Modules are names from `LORA_MODULES`; a module the
    adapter does not target is absent (its delta is zero).
    """

    name: str
    int_id: int
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())
