"""Qwen3-Next (`Qwen3NextForCausalLM`) on the torch backend: Gated DeltaNet linear-attention
layers and gated full-attention layers (model_loader/qwen3_next.py for the math and the weight
names), each followed by a MoE with a sigmoid-gated shared expert (layers/moe.py) or a gated MLP.

forward(input_ids [T], positions [T], caches, md) -> hidden [T, H]. caches per layer: (K, V)
paged blocks for attention layers, (conv state [S, C, K-1], recurrent state [S, Hv, dk, dv])
float32 over S state slots for gdn layers (backends_torch/state.py allocates both). The step's
slots / fresh flags come in md.derived (models/mamba.py's contract).

Decode steps (one token per request) run the batched single-step update, through the Triton
kernels of kernels_cuda/gdn.py (+ ssm.conv_state_update) on CUDA (in place in the slot caches),
else gather / update / scatter with the torch reference; prefill chunks run per request: conv with
state, then the chunked gated delta rule (Triton on CUDA, the torch reference elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlaserve.backends_torch.layers.attention import AttentionBackend, AttentionMetadata
from xlaserve.backends_torch.layers.gdn_ops import (
    gated_delta_rule_chunked,
    gated_delta_rule_step,
    gdn_gated_norm,
    gdn_gates,
    gdn_qkv,
)
from xlaserve.backends_torch.layers.linear import Linear, VocabEmbedding
from xlaserve.backends_torch.layers.ssm_ops import causal_conv1d, causal_conv1d_update
from xlaserve.backends_torch.models.base import CausalLMBase
from xlaserve.backends_torch.models.decoder import DecoderAttention
from xlaserve.backends_torch.models.mamba import (
    MambaForCausalLM,
    _param,
    _step_state,
    use_ssm_kernels,
)
from xlaserve.config import KernelConfig
from xlaserve.model_loader.spec import ModelSpec

StateCache = tuple[torch.Tensor, torch.Tensor]
PREFILL_CHUNK = 64  # tokens per chunk of the chunked gated delta rule


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet mixer: x [T, H] -> [T, H], reading / writing its layer's state."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: str | torch.device,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        s = spec.extra["ssm"]
        h = spec.hidden_size
        self.hk, self.hv, self.dk, self.dv = (
            s["n_k_heads"],
            s["n_heads"],
            s["head_dim"],
            s["state_size"],
        )
        self.conv_dim, self.k = s["conv_dim"], s["conv_kernel"]
        self.eps = spec.norm_eps
        self.triton = use_ssm_kernels(device, kernels)
        vd = self.hv * self.dv
        self.in_proj_qkvz = Linear(h, self.conv_dim + vd, False, dtype, device)
        self.in_proj_ba = Linear(h, 2 * self.hv, False, dtype, device)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param((self.conv_dim, self.k), dtype, device)
        self.dt_bias = _param((self.hv,), dtype, device)
        self.A_log = _param((self.hv,), dtype, device)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv, dtype=dtype, device=device),
                                        requires_grad=False)  # fmt: skip
        self.out_proj = Linear(vd, h, False, dtype, device)

    def _core_inputs(
        self, xc: torch.Tensor, ba: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output xc [R, C] (pre-activation) and ba [R, 2 Hv] -> q, k, v, g, beta."""
        q, k, v = gdn_qkv(F.silu(xc), self.hk, self.hv, self.dk, self.dv)
        b, a = ba.split([self.hv, self.hv], dim=-1)
        g, beta = gdn_gates(b, a, self.A_log, self.dt_bias)
        return q, k, v, g, beta

    def forward(self, x: torch.Tensor, cache: StateCache, md: AttentionMetadata) -> torch.Tensor:
        conv_s, rec_s = cache
        slots: list[int] = md.derived["state_slots"]
        fresh: list[bool] = md.derived["state_fresh"]
        qsl = md.query_start_loc_host
        proj = self.in_proj_qkvz(x)
        xbc, z = proj[:, : self.conv_dim], proj[:, self.conv_dim :]
        ba = self.in_proj_ba(x)
        w = self.conv1d.weight
        if x.shape[0] == len(slots) and self.triton:  # decode, in place in the slot caches
            from xlaserve.kernels_cuda.gdn import gdn_decode_update
            from xlaserve.kernels_cuda.ssm import conv_state_update

            idx, keep = _step_state(md, x.device)
            xc = conv_state_update(xbc, w, None, conv_s, idx, keep)
            q, k, v, g, beta = self._core_inputs(xc, ba)
            y = gdn_decode_update(rec_s, idx, keep, q, k, v, g, beta)
        elif x.shape[0] == len(slots):  # decode: batched single step (gather / scatter)
            idx, keep = _step_state(md, x.device)
            cs = conv_s[idx] * keep[:, None, None]
            hs = rec_s[idx] * keep[:, None, None, None]
            xc, cs = causal_conv1d_update(xbc, w, None, cs)
            q, k, v, g, beta = self._core_inputs(xc, ba)
            y, hs = gated_delta_rule_step(hs, q, k, v, g, beta)
            conv_s[idx] = cs
            rec_s[idx] = hs
        else:
            ys = []
            for r, slot in enumerate(slots):
                lo, hi = qsl[r], qsl[r + 1]
                cs, hs = conv_s[slot], rec_s[slot]
                if fresh[r]:
                    cs, hs = torch.zeros_like(cs), torch.zeros_like(hs)
                xc, cs = causal_conv1d(xbc[lo:hi], w, None, cs)
                q, k, v, g, beta = self._core_inputs(xc, ba[lo:hi])
                if self.triton:
                    from xlaserve.kernels_cuda.gdn import gdn_chunked_prefill

                    yr, hs = gdn_chunked_prefill(q, k, v, g, beta, hs)
                else:
                    yr, hs = gated_delta_rule_chunked(q, k, v, g, beta, hs, PREFILL_CHUNK)
                conv_s[slot] = cs
                rec_s[slot] = hs
                ys.append(yr)
            y = torch.cat(ys)
        t = x.shape[0]
        out = gdn_gated_norm(y, z.reshape(t, self.hv, self.dv), self.norm.weight, self.eps, x.dtype)
        return self.out_proj(out.reshape(t, self.hv * self.dv))


class GatedAttention(DecoderAttention):
    """Qwen3-Next full attention: DecoderAttention (qk-norm, partial rotary, paged attention)
    with its output times sigmoid(o_gate_proj(x)) before o_proj."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: str,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__(spec, layer, backend, dtype, device, kernels)
        self.o_gate_proj = Linear(spec.hidden_size, spec.q_size, spec.qkv_bias, dtype, device)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv: tuple, md: AttentionMetadata
    ) -> torch.Tensor:
        from xlaserve.backends_torch.layers.blocks import project_qkv

        t = x.shape[0]
        q, k, v = project_qkv(self, x)
        q = self.q_norm(q.view(t, self.hq, self.d))
        k = self.k_norm(k.view(t, self.hkv, self.d))
        v = v.view(t, self.hkv, self.d)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv, md, sinks=self.sinks)
        gate = torch.sigmoid(self.o_gate_proj(x).float()).to(out.dtype)
        return self.o_proj(out * gate.reshape(out.shape))


class Qwen3NextLayer(nn.Module):
    """x + mixer(norm(x)), then + mlp(norm(x)); the mixer is gated attention or a GDN."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: str | torch.device,
        kernels: KernelConfig | None,
    ) -> None:
        super().__init__()
        from xlaserve.backends_torch.layers.blocks import make_mlp, spec_norm
        from xlaserve.backends_torch.layers.moe import FusedMoE

        h = spec.hidden_size
        self.attention = spec.extra["layer_kinds"][layer] == "attention"
        self.input_layernorm = spec_norm(spec, h, dtype, device)
        self.post_attention_layernorm = spec_norm(spec, h, dtype, device)
        if self.attention:
            self.self_attn = GatedAttention(spec, layer, backend, dtype, device, kernels)
        else:
            self.linear_attn = GatedDeltaNet(spec, dtype, device, kernels)
        if spec.is_moe_layer(layer):
            self.mlp = FusedMoE(spec, dtype, device, kernels=kernels)
        else:
            self.mlp = make_mlp(spec, layer, dtype, device, kernels)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, cache: tuple, md: AttentionMetadata
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attention:
            h = self.self_attn(positions, h, cache, md)
        else:
            h = self.linear_attn(h, cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextForCausalLM(MambaForCausalLM):
    """Embeddings, Qwen3-Next layers, final (1 + w) RMSNorm, lm_head."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: AttentionBackend | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        from xlaserve.backends_torch.layers.attention import TorchRefAttention
        from xlaserve.backends_torch.layers.blocks import spec_norm

        CausalLMBase.__init__(self)
        backend = attn_backend if attn_backend is not None else TorchRefAttention()
        self.spec = spec
        self._norm_offset = spec.norm_weight_offset
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            Qwen3NextLayer(spec, i, backend, dtype, device, kernels) for i in range(spec.num_layers)
        )
        self.norm = spec_norm(spec, spec.hidden_size, dtype, device)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)
        if kernels is not None:
            self.use_kernels(kernels)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(positions, x, cache, attn_metadata)
        return self.norm(x)

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random matrices; (1 + w) norms at w = 0; GDN: output norm 1, A_log = log(1..Hv),
        dt_bias 1."""
        CausalLMBase.init_dummy_weights(self, seed, std)
        with torch.no_grad():
            for layer in self.layers:
                if not layer.attention:
                    m = layer.linear_attn
                    m.norm.weight.fill_(1.0)
                    m.A_log.copy_(torch.arange(1, m.hv + 1, dtype=torch.float32).log())
                    m.dt_bias.fill_(1.0)
