"""The pieces a decoder block builds from a ModelSpec: norms, rotary, attention heads and
projections, the MLP. Tensor parallelism and weight fusion are decided here (and carried out by
linear.py's factories and backends_torch/distributed/), so model files mention neither:

- heads: `attention_heads` gives this rank's query / KV heads (TP splits heads; KV heads are
  replicated when there are fewer than ranks).
- fusion: q/k/v (and a gated MLP's gate/up) become one fused linear each (`qkv_proj`,
  `gate_up_proj`: one GEMM, output split into views) unless `can_fuse` says no (GPTQ act-order,
  partial ignore lists, KernelConfig.fuse_projections off); parameter names stay canonical.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from xlaserve.backends_torch.distributed.parallel_state import kv_heads_per_rank, tp_world_size
from xlaserve.backends_torch.layers.activation import MLP
from xlaserve.backends_torch.layers.attention import Attention, AttentionBackend
from xlaserve.backends_torch.layers.linear import can_fuse, make_linear, make_merged_linear
from xlaserve.backends_torch.layers.norm import make_norm, norm_residual_for
from xlaserve.backends_torch.layers.rotary import RotaryEmbedding
from xlaserve.config import KernelConfig
from xlaserve.kernels_cuda.quant_act import QuantAct
from xlaserve.model_loader.spec import ModelSpec


def layer_window(spec: ModelSpec, i: int) -> int | None:
    """Sliding window of layer i; accepts HF's "sliding_attention" as well as "sliding"."""
    return spec.layer_sliding_window(i)


def spec_norm(spec: ModelSpec, dim: int, dtype: torch.dtype, device: str) -> nn.Module:
    """The spec's norm kind over `dim` features."""
    return make_norm(
        spec.norm_kind,
        dim,
        spec.norm_eps,
        spec.norm_weight_offset,
        bias=spec.norm_bias,
        dtype=dtype,
        device=device,
    )


class NoPETemperature(nn.Module):
    """Llama 4's NoPE layers' position transform, in place of rope: q [T, Hq, D] times
    1 + a * log1p(floor((p + 1) / F)) at positions p [T] (float32 math); k unchanged."""

    triton_enabled = False  # no fused rope + KV-cache write: the attention writes k / v itself

    def __init__(self, floor_scale: float, scale: float) -> None:
        super().__init__()
        self.floor_scale, self.scale = floor_scale, scale

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.scale
        return (q * (t + 1.0)[:, None, None]).to(q.dtype), k


def layer_rotary(
    spec: ModelSpec, layer: int, device: str
) -> RotaryEmbedding | NoPETemperature | None:
    """Rope of one layer (None for learned positions and spec.nope_layers; a NoPETemperature
    for NoPE layers of a spec with nope_attn_temperature). Sliding layers of a spec with
    rope_local_theta use plain rope with that theta (Gemma3)."""
    if spec.position_embedding != "rope":
        return None
    if layer in spec.nope_layers:
        temp = spec.nope_attn_temperature
        return None if temp is None else NoPETemperature(*temp)
    if spec.rope_local_theta and layer_window(spec, layer) is not None:
        spec = replace(spec, rope_theta=spec.rope_local_theta, rope_scaling=None)
    return RotaryEmbedding(spec, device)


def make_attention(
    spec: ModelSpec,
    layer: int,
    heads: tuple[int, int],
    backend: AttentionBackend,
    device: str,
) -> tuple[Attention, nn.Parameter | None]:
    """The attention core of `layer` over this rank's (query, KV) heads (scale, sliding window,
    attention chunk, soft-cap and ALiBi slopes from the spec) and, for spec.attn_sinks (gpt-oss),
    the layer's sink logits float32 [Hq] (a parameter its attention module owns as `sinks`),
    else None."""
    scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim**-0.5
    window, cap = layer_window(spec, layer), spec.attn_logit_softcap
    attn = Attention(
        *heads, spec.head_dim, scale, backend, window, cap, alibi_heads(spec, device),
        chunk_size=spec.layer_chunk_size(layer),
    )  # fmt: skip
    if not spec.attn_sinks:
        return attn, None
    if tp_world_size() > 1:
        raise ValueError("attention sinks (gpt-oss) do not run with tensor parallelism yet")
    sinks = torch.zeros(heads[0], dtype=torch.float32, device=device)
    return attn, nn.Parameter(sinks, requires_grad=False)


def alibi_heads(spec: ModelSpec, device: str) -> torch.Tensor | None:
    """ALiBi slopes float32 [Hq] of this rank's query heads (None without ALiBi)."""
    if spec.alibi_slopes is None:
        return None
    if tp_world_size() > 1:
        raise ValueError("ALiBi models (Bloom, MPT) do not run with tensor parallelism yet")
    return torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=device)


def attention_heads(spec: ModelSpec) -> tuple[int, int]:
    """(query heads, KV heads) this rank holds."""
    return spec.num_heads // tp_world_size(), kv_heads_per_rank(spec.num_kv_heads)


def build_qkv(
    mod: nn.Module,
    spec: ModelSpec,
    layer: int,
    dtype: torch.dtype,
    device: str,
    kernels: KernelConfig | None = None,
) -> None:
    """Give attention module `mod` its input projections and o_proj under canonical names: one
    fused `qkv_proj` ([q; k; v] rows, this rank's heads of each; `mod.qkv_sizes` its q, k, v
    widths) or, where `can_fuse` says no, q_proj / k_proj / v_proj. Sets `mod.fused`."""
    kv_rep = max(1, tp_world_size() // spec.num_kv_heads)  # ranks sharing one KV head
    h, qkvb = spec.hidden_size, spec.qkv_bias
    members = [f"layers.{layer}.self_attn.{p}_proj" for p in "qkv"]
    mod.fused = can_fuse(spec.model_dir, members, kernels)
    if mod.fused:
        mod.qkv_proj = make_merged_linear(
            h, [("q_proj", spec.q_size, 1), ("k_proj", spec.kv_size, kv_rep),
                ("v_proj", spec.kv_size, kv_rep)], qkvb, dtype, device,
        )  # fmt: skip
        mod.qkv_sizes = mod.qkv_proj.part_sizes
    else:
        mod.q_proj = make_linear(h, spec.q_size, qkvb, dtype, device, "column")
        mod.k_proj = make_linear(h, spec.kv_size, qkvb, dtype, device, "column", kv_rep)
        mod.v_proj = make_linear(h, spec.kv_size, qkvb, dtype, device, "column", kv_rep)
    mod.o_proj = make_linear(spec.q_size, h, spec.o_bias, dtype, device, "row")


def project_qkv(mod: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> q [T, Hq*D], k, v [T, Hkv*D] of `mod` (built by `build_qkv`); fused: views of
    one GEMM's output."""
    if mod.fused:
        return mod.qkv_proj(x).split(mod.qkv_sizes, dim=-1)
    return mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)


def input_linear(mod: nn.Module) -> nn.Module | None:
    """The one linear that reads block `mod`'s input x [T, H], first and alone: the fused
    `qkv_proj` of an attention module built by `build_qkv`, or a fused MLP's `gate_up_proj`.
    None where several linears read x (unfused q / k / v or gate / up) or the block is another
    kind (MLA, MoE). The pre-norm before `mod` may hand that linear its input already quantized
    (layers.norm.norm_residual_for)."""
    if type(mod) is MLP:
        return mod.gate_up_proj if mod.fused else None
    if getattr(mod, "fused", False) and hasattr(mod, "qkv_sizes"):  # build_qkv's fused form
        return mod.qkv_proj
    return None


def pre_norm(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, block: nn.Module
) -> tuple[torch.Tensor | QuantAct, torch.Tensor]:
    """The pre-norm of `block`: (norm(x + residual), x + residual), the first handed to the
    block's `input_linear` already quantized where that linear would quantize it itself
    (`norm_residual_for`)."""
    return norm_residual_for(norm, x, residual, input_linear(block))


def make_mlp(
    spec: ModelSpec,
    layer: int,
    dtype: torch.dtype,
    device: str,
    kernels: KernelConfig | None = None,
) -> MLP:
    """The dense MLP of `layer` (gate/up fused where `can_fuse` allows)."""
    members = [f"layers.{layer}.mlp.{p}" for p in ("gate_proj", "up_proj")]
    return MLP(
        spec.hidden_size,
        spec.intermediate_size,
        spec.activation,
        spec.gated_mlp,
        spec.mlp_bias,
        dtype,
        device,
        fused=can_fuse(spec.model_dir, members, kernels),
    )
