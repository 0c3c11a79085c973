"""Multi-LoRA on the XLA runner: the slot tables inside the model weights, and their writes.

With `config.lora.enable_lora`, every LoRA target of the Flax model (`layers[i].self_attn.
{q,k,v,o}_proj`, `layers[i].mlp.{gate,up,down}_proj`, see models_flax/layers.lora_targets) gets
zeroed tables `lora_a` [S, R, in] and `lora_b` [S, out, R] (S = max_loras, R = max_lora_rank,
the model dtype, replicated) as nnx Params, so they are leaves of `runner.weights` like any
weight and every compiled program takes them: program shapes depend on S and R only, never on
which adapters are loaded.

`SchedulerOutput.lora_loads` [(slot, LoRAAdapter)] are written before the step's forward by one
jitted program over all tables (compiled once, at start-up: the slot is a traced scalar), which
sets row `slot` of each table: the adapter's A / B zero-padded to R, zeros for the modules it
does not target. The state's Variables get the new arrays and `sync_weights()` refreshes the
flat leaf list, so `state` and `weights` always agree.

Per token, the forward reads its slot from the packed step buffer (`StepBatch.lora_slots`,
filled from each request's `NewRequestData.lora_slot`; -1 = base) and groups the tokens by slot
once (kernels_pallas/lora.make_segments); each target adds B[slot] @ (A[slot] @ x).

Implementation (kernels_pallas/lora.py): `KernelConfig.lora_impl` (`--lora-impl`; environment
override XLASERVE_LORA_IMPL, read by KernelConfig.from_env only; default "auto": the Mosaic
grouped matmul on TPU, the Triton-lowered Pallas kernel on GPU, the one-hot einsum form on CPU:
plain dots XLA fuses, no per-token weight gather, fine at the CPU's sizes). Under tensor
parallelism "xla" always (GSPMD partitions einsums, not pallas_calls).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from xlaserve.lora import LORA_MODULES
from xlaserve.models_flax.layers import add_lora_tables, linear_dims

if TYPE_CHECKING:
    from xlaserve.backends_xla.runner import XlaModelRunner

logger = logging.getLogger(__name__)


class XlaLoRATables:
    """The runner's LoRA slot tables (module docstring). `attach` before the programs are built,
    `write` for each step's `lora_loads`."""

    def __init__(self, runner: XlaModelRunner) -> None:
        cfg = runner.config.lora
        if runner.state_model:
            raise NotImplementedError(
                "multi-LoRA is not supported for state-space models on backend 'xla'"
            )
        self.runner = runner
        self.num_slots, self.rank = cfg.max_loras, cfg.max_lora_rank
        impl = runner.config.kernels.lora_impl  # validated by KernelConfig
        self.impl = "xla" if runner.mesh.shape["model"] > 1 else impl
        self.dims: dict[tuple[int, str], tuple[int, int]] = {}  # (layer, module) -> (in, out)
        self._paths: dict[tuple[int, str], tuple[Any, ...]] = {}  # state path of the module
        self._write_fn: Any = None

    @property
    def program_args(self) -> tuple[int, str]:
        """make_jitted's `lora` argument: (slots, impl)."""
        return self.num_slots, self.impl

    def attach(self, graphdef: nnx.GraphDef, state: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
        """Add the zeroed tables to the loaded model; returns the new (graphdef, state)."""
        model = nnx.merge(graphdef, state)
        rep = self.runner._replicated
        targets = add_lora_tables(model, LORA_MODULES, self.num_slots, self.rank,
                                  self.runner.dtype, rep)  # fmt: skip
        if not targets:
            raise NotImplementedError(
                f"model family {self.runner.spec.family!r} has no LoRA target modules "
                f"({', '.join(LORA_MODULES)}) on backend 'xla'"
            )
        parts = {id(m): p for p, m in nnx.iter_modules(model)}
        for key, mod in targets.items():
            self.dims[key] = linear_dims(mod)
            self._paths[key] = tuple(parts[id(mod)])
        graphdef, state = nnx.split(model)
        logger.info(
            "LoRA: %d slots x rank %d over %d projections (impl %s)",
            self.num_slots, self.rank, len(targets), self.impl,
        )  # fmt: skip
        return graphdef, state

    def _variables(self) -> list[Any]:
        """The table Variables of `runner.state`, in `self.dims` order (A, B, A, B, ...)."""
        out = []
        for key in self.dims:
            node = self.runner.state
            for p in self._paths[key]:
                node = node[p]
            out += [node["lora_a"], node["lora_b"]]
        return out

    def warm_up(self) -> None:
        """Compile the write program now (a zero write of slot 0), not while serving."""
        self._write(0, self._host_tables(None))

    def check(self, slot: int, adapter: Any) -> None:
        """ValueError unless `adapter` fits slot `slot` of these tables."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} out of range [0, {self.num_slots})")
        if adapter.rank > self.rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r}: rank {adapter.rank} > max_lora_rank {self.rank}"
            )
        for key, (a, b) in adapter.weights.items():
            if key not in self.dims:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} targets layer {key[0]} {key[1]}, which this "
                    f"model has no LoRA table for on backend 'xla' (MoE experts and MLA "
                    f"attention take no adapters)"
                )
            d_in, d_out = self.dims[key]
            r = np.shape(a)[0]
            if np.shape(a) != (r, d_in) or np.shape(b) != (d_out, r) or r > self.rank:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} layer {key[0]} {key[1]}: A {np.shape(a)} / "
                    f"B {np.shape(b)} do not fit [r <= {self.rank}, {d_in}] / [{d_out}, r]"
                )

    def _host_tables(self, adapter: Any) -> list[np.ndarray]:
        """One slot's rows of every table (float32, zero-padded to R; zeros where the adapter
        has no weights or is None)."""
        rows = []
        weights = {} if adapter is None else adapter.weights
        for key, (d_in, d_out) in self.dims.items():
            a_row = np.zeros((self.rank, d_in), np.float32)
            b_row = np.zeros((d_out, self.rank), np.float32)
            if key in weights:
                a, b = weights[key]
                r = np.shape(a)[0]
                a_row[:r], b_row[:, :r] = a, b
            rows += [a_row, b_row]
        return rows

    def _write(self, slot: int, rows: list[np.ndarray]) -> None:
        if self._write_fn is None:

            def write(tables, slot, rows):  # noqa: ANN001, ANN202
                return [
                    t.at[slot].set(v.astype(t.dtype)) for t, v in zip(tables, rows, strict=True)
                ]

            self._write_fn = jax.jit(write)
        variables = self._variables()
        r = self.runner
        new = self._write_fn(
            [v.get_value() for v in variables], r._put(np.int32(slot)), r._put(rows)
        )
        for var, arr in zip(variables, new, strict=True):
            var.set_value(arr)

    def write(self, loads: list[tuple[int, Any]]) -> None:
        """Write each (slot, LoRAAdapter) of `loads` (all checked first: a bad one writes
        nothing), then refresh the runner's flat weights."""
        for slot, adapter in loads:
            self.check(slot, adapter)
        for slot, adapter in loads:
            self._write(slot, self._host_tables(adapter))
        self.runner.sync_weights()

    def write_cache_size(self) -> int:
        """Compiled variants of the write program (1 after warm-up; tests check it stays)."""
        return 0 if self._write_fn is None else self._write_fn._cache_size()


def lora_slot_of(runner: XlaModelRunner, slot: int) -> int:
    """Validate a request's `NewRequestData.lora_slot` against the runner's tables."""
    if slot == -1:
        return -1
    tables = runner.lora_tables
    if tables is None:
        raise ValueError(f"request has LoRA slot {slot} but enable_lora is off")
    if not 0 <= slot < tables.num_slots:
        raise ValueError(f"LoRA slot {slot} out of range [0, {tables.num_slots})")
    return slot


def fill_token_slots(out: np.ndarray, slots: list[int], query_start_loc: np.ndarray) -> None:
    """out[:T] = each token's request slot (tokens of request i: [qsl[i], qsl[i+1]))."""
    counts = np.diff(query_start_loc[: len(slots) + 1])
    out[: int(query_start_loc[len(slots)])] = np.repeat(np.asarray(slots, np.int32), counts)
