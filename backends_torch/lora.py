"""The torch runner's multi-LoRA side (contract: xlaserve/lora/__init__.py).

`TorchLoRA.attach(model)` finds, per layer, the projections of the Llama-like decoder
(decoder.py; every family it serves) and gives each a slot table in the model dtype:
A [max_loras, P * max_lora_rank, in] (the A of the P parts of a fused qkv / gate_up layer
stacked along the rank) and one B [max_loras, out_p, max_lora_rank] per part, zeroed. A forward
hook on the layer adds the step's deltas to its output in place:
`y[t, off_p : off_p + out_p] += B_p[slot_t] @ (A_p[slot_t] @ x[t])` for tokens with a slot.

- CUDA: the Triton kernels (kernels_cuda/lora.py: one shrink per layer, one expand per part).
  The token groups live in static device buffers (one pinned upload per step), so the decode
  CUDA graphs capture the LoRA path once and every replay reads the step's slots: no graph per
  adapter.
- A step whose tokens all use the base model (decided on the host from the step's slots, no
  device sync) launches no LoRA kernel in eager mode: the hooks return at once, and the groups
  are not even re-uploaded while the device copy already says "no tokens". CUDA graphs keep the
  kernels inside (one graph per batch size serves base-only and LoRA steps alike): a base-only
  replay runs them with zero counts and every program exits at once, with no launch cost on
  the host. Capturing base-only graphs apart would save those empty programs at the price of
  twice the capture time and graph memory.
- CPU: the plain torch reference, per slot present in the step (XLASERVE_LORA_TRITON=1 runs the
  Triton kernels instead, under TRITON_INTERPRET=1: tests).

Refused with a clear error at load: MoE expert weights (attention LoRA on MoE models works),
MLA and recurrent-state models, tensor parallelism.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from xlaserve.config import EngineConfig
from xlaserve.lora import LoRAAdapter
from xlaserve.lora.peft import lora_module_shapes
from xlaserve.model_loader.spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass
class _LoRALayer:
    """One hooked linear: its parts (LORA_MODULES name, output column offset, width)."""

    layer: int
    parts: list[tuple[str, int, int]]
    a: torch.Tensor  # [L, P * R, in]
    b: list[torch.Tensor] = field(default_factory=list)  # per part [L, out_p, R]


def check_lora_support(config: EngineConfig, spec: ModelSpec) -> None:
    """Raise ValueError for setups the torch LoRA path does not serve."""
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported yet")
    if spec.family in ("mla", "mamba", "mamba2", "hybrid") or spec.extra.get("layer_kinds"):
        raise ValueError(f"enable_lora is not supported for the {spec.family!r} family")


class TorchLoRA:
    """Slot tables, forward hooks and the per-step token groups (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        use_triton: bool | None = None,
    ) -> None:
        check_lora_support(config, spec)
        lc = config.lora
        self.num_slots, self.rank = lc.max_loras, lc.max_lora_rank
        self.device, self.dtype = device, dtype
        if use_triton is None:
            use_triton = device.type == "cuda" or os.environ.get("XLASERVE_LORA_TRITON") == "1"
        self.use_triton = use_triton
        self.layers: list[_LoRALayer] = []
        self._hooks = []
        # Step state: whether any token has a slot (eager forwards skip the hooks otherwise).
        # With the Triton path it starts on, so the warm-up forwards before graph capture
        # compile the kernels (every count is 0 then: they exit at once).
        self.active = self.use_triton
        # Whether the device groups hold a LoRA step's counts (else all zero: a base-only step
        # need not upload anything).
        self._counts_live = False
        self._buf = None  # CUDA: the pinned host / device pair of the groups (cuda_graphs._Packed)
        self._cpu_groups: list[tuple[int, torch.Tensor]] = []
        t_max = max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
        self._t_max = t_max
        if self.use_triton:
            n = -(-(t_max + 2 * self.num_slots) // 16) * 16
            if device.type == "cuda":
                from xlaserve.backends_torch.cuda_graphs import _Packed

                self._buf = _Packed(n, device)
                dev = self._buf.dev
            else:  # Triton interpreter on CPU (tests)
                dev = torch.zeros(n, dtype=torch.int32)
            dev.zero_()
            self._idx = dev[:t_max]
            self._starts = dev[t_max : t_max + self.num_slots]
            self._counts = dev[t_max + self.num_slots : t_max + 2 * self.num_slots]
            self._dev = dev
        self._attach(model, spec)

    # ---- setup ---------------------------------------------------------------------------

    def _attach(self, model: nn.Module, spec: ModelSpec) -> None:
        layers = getattr(model, "layers", None)
        if layers is None:
            raise ValueError(f"enable_lora: model {type(model).__name__} has no decoder layers")
        for i, block in enumerate(layers):
            shapes = lora_module_shapes(spec, i)
            attn, mlp = block.self_attn, block.mlp
            targets: list[tuple[nn.Module, list[tuple[str, int, int]]]] = []
            if "q_proj" in shapes:
                if hasattr(attn, "qkv_proj"):
                    targets.append((attn.qkv_proj, _fused_parts(attn.qkv_proj)))
                else:
                    targets += [(getattr(attn, m), [(m, 0, shapes[m][1])]) for m in
                                ("q_proj", "k_proj", "v_proj")]  # fmt: skip
                targets.append((attn.o_proj, [("o_proj", 0, shapes["o_proj"][1])]))
            if "down_proj" in shapes:
                mlp.lora_attached = True  # no gate-act GEMV that skips gate_up's module call
                if hasattr(mlp, "gate_up_proj"):
                    targets.append((mlp.gate_up_proj, _fused_parts(mlp.gate_up_proj)))
                else:
                    targets += [(getattr(mlp, m), [(m, 0, shapes[m][1])]) for m in
                                ("gate_proj", "up_proj") if m in shapes]  # fmt: skip
                targets.append((mlp.down_proj, [("down_proj", 0, shapes["down_proj"][1])]))
            for mod, parts in targets:
                fan_in = shapes[parts[0][0]][0]
                for name, _, n in parts:
                    if shapes[name][1] != n:
                        raise ValueError(f"layer {i} {name}: {n} output rows, expected "
                                         f"{shapes[name][1]} (a sharded layer?)")  # fmt: skip
                L, R = self.num_slots, self.rank
                a = torch.zeros((L, len(parts) * R, fan_in), dtype=self.dtype, device=self.device)
                bs = [torch.zeros((L, n, R), dtype=self.dtype, device=self.device)
                      for _, _, n in parts]  # fmt: skip
                entry = _LoRALayer(i, parts, a, bs)
                self.layers.append(entry)
                self._hooks.append(mod.register_forward_hook(self._make_hook(entry)))

    @property
    def nbytes(self) -> int:
        return sum(e.a.nbytes + sum(b.nbytes for b in e.b) for e in self.layers)

    # ---- slots ---------------------------------------------------------------------------

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write an adapter into a slot (zero-padded to max_lora_rank; modules it does not
        target are zeroed)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} out of range (max_loras {self.num_slots})")
        if adapter.rank > self.rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.rank}")
        R = self.rank
        for e in self.layers:
            e.a[slot].zero_()
            for p, (name, _, _) in enumerate(e.parts):
                e.b[p][slot].zero_()
                w = adapter.weights.get((e.layer, name))
                if w is None:
                    continue
                a, b = w
                r = a.shape[0]
                e.a[slot, p * R : p * R + r].copy_(torch.from_numpy(np.asarray(a)))
                e.b[p][slot, :, :r].copy_(torch.from_numpy(np.asarray(b)))

    def prepare(self, token_slots: np.ndarray) -> None:
        """The step's slot per token (int [T], -1 = base), before the forward."""
        slots = np.asarray(token_slots, dtype=np.int64)
        self.active = bool(slots.size) and int(slots.max()) >= 0
        if not self.use_triton:
            self._cpu_groups = (
                [
                    (s, torch.from_numpy(np.flatnonzero(slots == s)).to(self.device))
                    for s in np.unique(slots[slots >= 0]).tolist()
                ]  # fmt: skip
                if self.active
                else []
            )
            return
        if not self.active and not self._counts_live:
            return  # base-only, and graph replays already read zero counts
        from xlaserve.kernels_cuda.lora import lora_token_groups_np

        t = slots.shape[0]
        if t > self._t_max:
            raise ValueError(f"{t} tokens exceed the LoRA index buffer ({self._t_max})")
        packed = lora_token_groups_np(slots, self.num_slots)
        L, tm = self.num_slots, self._t_max
        if self._buf is not None:  # CUDA: one pinned upload, stream-ordered (graphs read it)
            h = self._buf.host_view()
            h[:t] = packed[:t]
            h[tm : tm + 2 * L] = packed[t:]
            self._buf.upload(tm + 2 * L)
        else:
            self._dev[:t] = torch.from_numpy(packed[:t])
            self._dev[tm : tm + 2 * L] = torch.from_numpy(packed[t:])
        self._counts_live = self.active

    # ---- forward -------------------------------------------------------------------------

    def _make_hook(self, e: _LoRALayer):  # noqa: ANN202
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            # A CUDA graph always records the kernels (its replays serve LoRA steps too).
            if self.active or (self._buf is not None and torch.cuda.is_current_stream_capturing()):
                self._apply(e, inputs[0], output)
            return output

        return hook

    def _apply(self, e: _LoRALayer, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += the LoRA deltas of x [T, in] (in place)."""
        R = self.rank
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self.use_triton:
            from xlaserve.kernels_cuda.lora import LoRAGroups, lora_expand, lora_shrink

            g = LoRAGroups(self._idx, self._starts, self._counts, x.shape[0])
            s = lora_shrink(x, e.a, g)
            for p, (_, off, _) in enumerate(e.parts):
                lora_expand(s, e.b[p], y, g, s_offset=p * R, y_offset=off)
            return
        for slot, rows in self._cpu_groups:
            s = x[rows].float() @ e.a[slot].float().T  # [n, P * R]
            for p, (_, off, n) in enumerate(e.parts):
                d = s[:, p * R : (p + 1) * R] @ e.b[p][slot].float().T
                y[:, off : off + n].index_add_(0, rows, d.to(y.dtype))


def _fused_parts(mod: nn.Module) -> list[tuple[str, int, int]]:
    """(member name, column offset, rows) of a fused layer (MergedLinear's part_names)."""
    out, off = [], 0
    for name, n in zip(mod.part_names, mod.part_sizes, strict=True):
        out.append((name, off, n))
        off += n
    return out
