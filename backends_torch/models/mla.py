"""DeepSeek-V3-style multi-head latent attention (MLA) + FusedMoE (family "mla").

First version: the latent (kv_lora_rank) is expanded to per-head K [Hq, Dn + Dr] and V [Hq, Dv]
before the cache, so the paged cache stores full per-head K and V (V zero-padded to Dn + Dr) and
the ordinary attention backends serve it. Caching the compressed latent (and absorbing kv_b_proj
into q / o_proj) is a later optimisation. The adapter stores rope rows de-interleaved, so the
plain neox rotation here equals HF's interleaved rope.

Sizes (spec.extra): Rq q_lora_rank (None = plain q_proj), Rkv kv_lora_rank, Dn qk_nope_head_dim,
Dr qk_rope_head_dim, Dv v_head_dim; spec.head_dim = Dn + Dr, spec.num_kv_heads = Hq.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from xlaserve.backends_torch.layers.attention import Attention, AttentionBackend, AttentionMetadata
from xlaserve.backends_torch.layers.linear import Linear, MergedLinear, can_fuse
from xlaserve.backends_torch.layers.norm import RMSNorm
from xlaserve.backends_torch.layers.rotary import RotaryEmbedding
from xlaserve.backends_torch.models.decoder import DecoderForCausalLM, layer_window
from xlaserve.config import KernelConfig
from xlaserve.model_loader.spec import ModelSpec

KVCache = tuple[torch.Tensor, torch.Tensor]
# HF's DeepSeek latent norms use their default eps, not rms_norm_eps.
_LATENT_EPS = 1e-6


class MLAttention(nn.Module):
    """x [T, H] -> [T, H].

    The two projections of x (q_a_proj or q_proj, and kv_a_proj) are one `fused_qkv_a_proj`
    [Rq (or Hq*(Dn+Dr)) + Rkv + Dr, H] split into views, unless `can_fuse` says no.
    """

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: str,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        ex = spec.extra
        h, hq = spec.hidden_size, spec.num_heads
        self.hq = hq
        self.dn, self.dr, self.dv = ex["qk_nope_head_dim"], ex["qk_rope_head_dim"], ex["v_head_dim"]
        self.rkv = ex["kv_lora_rank"]
        dq = self.dn + self.dr
        rq = ex.get("q_lora_rank")
        self.q_lora = rq is not None
        q_name, q_out = ("q_a_proj", rq) if self.q_lora else ("q_proj", hq * dq)
        kv_out = self.rkv + self.dr
        self.fused = can_fuse(
            spec.model_dir,
            [f"layers.{layer}.self_attn.{n}" for n in (q_name, "kv_a_proj")],
            kernels,
        )
        if self.fused:
            self.fused_qkv_a_proj = MergedLinear(
                h, [q_name, "kv_a_proj"], [q_out, kv_out], False, dtype, device
            )
            self.fused_sizes = (q_out, kv_out)
        else:
            setattr(self, q_name, Linear(h, q_out, False, dtype, device))
            self.kv_a_proj = Linear(h, kv_out, False, dtype, device)
        if self.q_lora:
            self.q_a_norm = RMSNorm(rq, _LATENT_EPS, dtype=dtype, device=device)
            self.q_b_proj = Linear(rq, hq * dq, False, dtype, device)
        self.kv_a_norm = RMSNorm(self.rkv, _LATENT_EPS, dtype=dtype, device=device)
        self.kv_b_proj = Linear(self.rkv, hq * (self.dn + self.dv), False, dtype, device)
        self.o_proj = Linear(hq * self.dv, h, False, dtype, device)
        rope_spec = replace(spec, head_dim=self.dr, partial_rotary_factor=1.0)
        self.rotary = RotaryEmbedding(rope_spec, device)
        scale = spec.attn_scale if spec.attn_scale is not None else dq**-0.5
        self.attn = Attention(hq, hq, dq, scale, backend, layer_window(spec, layer), None)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv: KVCache, md: AttentionMetadata
    ) -> torch.Tensor:
        t, hq, dn, dr, dv = x.shape[0], self.hq, self.dn, self.dr, self.dv
        if self.fused:  # views of one [T, q + Rkv + Dr] output
            q, kv_a = self.fused_qkv_a_proj(x).split(self.fused_sizes, dim=-1)
        else:
            q = self.q_a_proj(x) if self.q_lora else self.q_proj(x)
            kv_a = self.kv_a_proj(x)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_norm(q))
        q = q.view(t, hq, dn + dr)
        latent, k_rot = kv_a.split([self.rkv, dr], dim=-1)
        kv_nope = self.kv_b_proj(self.kv_a_norm(latent)).view(t, hq, dn + dv)
        k_nope, v = kv_nope.split([dn, dv], dim=-1)
        # Triton path: rotated in place (views of q / kv_a); torch path: new tensors.
        q_rot, k_rot = self.rotary(positions, q[..., dn:], k_rot.view(t, 1, dr))
        k_rot = k_rot.expand(t, hq, dr)
        q = torch.cat([q[..., :dn], q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        v = F.pad(v, (0, dn + dr - dv))  # the cache holds D = Dn + Dr for K and V
        out = self.attn(q, k, v, kv, md).view(t, hq, dn + dr)[..., :dv]
        return self.o_proj(out.reshape(t, hq * dv))


class MLAForCausalLM(DecoderForCausalLM):
    """The generic decoder; DecoderLayer picks MLAttention for family "mla"."""
