"""Mamba (`MambaForCausalLM`) and Mamba2 (`Mamba2ForCausalLM`) on the torch backend, and the
hybrids (HybridForCausalLM: Bamba, Jamba, Granite 4, LFM2's short convolutions, Nemotron-H,
Falcon-H1's parallel layers; per layer the cache of its kind, backends_torch/state.py).

forward(input_ids [T], positions [T], caches, md) -> hidden [T, H]: caches holds, per layer, the
(conv state [S, C, K-1], ssm state [S, Hs, P, N]) float32 tensors of S state slots
(model_loader/ssm.py for the shapes). The step's per-request slots and whether each request
starts from a zero state come in `md.derived["state_slots"]` / `["state_fresh"]` (host lists, in
batch order; the runner sets them, backends_torch/state.py).

A step whose requests all compute one token (decode) runs the single-step update over the batch
(gather the slots' states, update, scatter back); any other step runs each request's chunk with
the conv + scan reference (layers/ssm_ops.py), carrying the state across chunks exactly; with
KernelConfig.ssm_prefill_triton on, the conv and Mamba2's chunked scan of that per-request loop
run as the Triton kernels of kernels_cuda/ssm_prefill.py instead (same contract).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlaserve.backends_torch.layers.attention import AttentionBackend, AttentionMetadata
from xlaserve.backends_torch.layers.linear import Linear, VocabEmbedding
from xlaserve.backends_torch.layers.ssm_ops import (
    causal_conv1d,
    causal_conv1d_update,
    gated_rms_norm,
    selective_scan,
    selective_state_update,
    ssd_chunked,
)
from xlaserve.backends_torch.models.base import CausalLMBase
from xlaserve.config import KernelConfig
from xlaserve.model_loader.spec import ModelSpec

StateCache = tuple[torch.Tensor, torch.Tensor]


class SimpleRMSNorm(nn.Module):
    """HF Mamba RMSNorm: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)."""

    def __init__(self, n: int, eps: float, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.dtype == self.weight.dtype:
            from xlaserve.kernels_cuda.norm import rms_norm

            # One launch instead of six (rounds once where HF rounds twice: <= 1 ulp apart).
            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(self.weight.dtype)


def _step_state(md: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's state slots [B] int64 and keep flags [B] float32 (0 = fresh request), built
    once per step and shared by every layer (md.derived). A decode CUDA graph sets them itself,
    from its static buffers (cuda_graphs.py): host lists cannot be read inside a capture."""
    got = md.derived.get("state_tensors")
    if got is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("state slots must come as md.derived['state_tensors'] in a graph")
        slots = torch.tensor(md.derived["state_slots"], dtype=torch.long)
        keep = torch.tensor([0.0 if f else 1.0 for f in md.derived["state_fresh"]])
        got = md.derived["state_tensors"] = (slots.to(device), keep.to(device))
    return got


def use_ssm_kernels(device: str | torch.device, kernels: KernelConfig | None) -> bool:
    """Decode steps through the Triton kernels (kernels_cuda/ssm.py): KernelConfig.triton_ops
    "on" / "off" forces it (on needs CUDA or TRITON_INTERPRET=1), "auto" = on CUDA."""
    from xlaserve.config import kernel_switch

    mode = kernel_switch("triton_ops", kernels)
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


def use_ssm_prefill_kernels(device: str | torch.device, kernels: KernelConfig | None) -> bool:
    """Prefill through kernels_cuda/ssm_prefill.py: KernelConfig.ssm_prefill_triton "on" forces
    it (needs CUDA or TRITON_INTERPRET=1), "auto" (the default) = on CUDA, "off" = the torch
    references."""
    from xlaserve.config import kernel_switch

    mode = kernel_switch("ssm_prefill_triton", kernels)
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class SSMMixer(nn.Module):
    """One Mamba or Mamba2 mixer: x [T, H] -> [T, H], reading / writing its layer's state."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: str | torch.device,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        s = spec.extra["ssm"]
        self.kind = s["kind"]
        self.triton = use_ssm_kernels(device, kernels)
        self.prefill_triton = use_ssm_prefill_kernels(device, kernels)
        h, i, n, g = spec.hidden_size, s["d_inner"], s["state_size"], s["n_groups"]
        self.d_inner, self.n, self.groups = i, n, g
        self.hs, self.p, self.k = s["n_heads"], s["head_dim"], s["conv_kernel"]
        self.dt_limit = tuple(s["dt_limit"])
        self.chunk = s.get("chunk_size", 256)
        self.eps = spec.norm_eps
        # Output gate of Mamba2: "gated" norm(y * silu(z)); Falcon-H1 also "norm_gate"
        # (norm(y) * silu(z)) and "none" (y * silu(z), no norm weight).
        self.gate_norm = s.get("gate_norm", "gated")
        if self.kind == "mamba2":
            self.conv_dim = i + 2 * g * n
            self.in_proj = Linear(h, i + self.conv_dim + self.hs, s["proj_bias"], dtype, device)
            self.dt_bias = _param((self.hs,), dtype, device)
            self.A_log = _param((self.hs,), dtype, device)
            if self.gate_norm != "none":
                self.norm = SimpleRMSNorm(i, self.eps, dtype, device)
        else:
            self.conv_dim = i
            self.rank = s["dt_rank"]
            self.in_proj = Linear(h, 2 * i, s["proj_bias"], dtype, device)
            self.x_proj = Linear(i, self.rank + 2 * n, False, dtype, device)
            self.dt_proj = Linear(self.rank, i, True, dtype, device)
            self.A_log = _param((i, n), dtype, device)
            if s.get("bc_norms"):  # Jamba: RMS norms on dt (rank R), B and C (N)
                self.dt_layernorm = SimpleRMSNorm(self.rank, self.eps, dtype, device)
                self.b_layernorm = SimpleRMSNorm(n, self.eps, dtype, device)
                self.c_layernorm = SimpleRMSNorm(n, self.eps, dtype, device)
        self.bc_norms = bool(s.get("bc_norms"))
        # Operand precision of the varlen SSD kernel's dots (kernels_cuda/ssm_prefill.py).
        from xlaserve.config import kernel_switch

        prec = kernel_switch("ssd_precision", kernels)
        if prec == "auto":
            prec = "bf16" if dtype in (torch.bfloat16, torch.float16) else "tf32x3"
        self.ssd_precision = prec
        # Launch shape per precision (bench/gpu_probes/ssd_prefill_sweep.py --varlen 64x256):
        # bf16 operands leave registers for 64 P rows and want 32-token chunks.
        p_rows = max(16, 1 << (self.p - 1).bit_length())  # P as a power of two >= 16
        self.ssd_chunk, self.ssd_block_p = (32, min(64, p_rows)) if prec == "bf16" else (64, None)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param((self.conv_dim, self.k), dtype, device)
        self.conv1d.bias = _param((self.conv_dim,), dtype, device) if s["conv_bias"] else None
        self.D = _param((self.hs,), dtype, device)
        self.out_proj = Linear(i, h, s.get("out_bias", s["proj_bias"]), dtype, device)

    def _A(self) -> torch.Tensor:
        """[Hs, 1, 1] (Mamba2) or [Hs, 1, N] (Mamba), float32."""
        a = -torch.exp(self.A_log.float())
        return a[:, None, None] if self.kind == "mamba2" else a[:, None, :]

    def _dt(self, dt_raw: torch.Tensor) -> torch.Tensor:
        """Mamba2's step sizes: softplus(dt_raw + dt_bias) in float32, clamped to dt_limit
        where it is set. [R, Hs] -> [R, Hs]."""
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        lo, hi = self.dt_limit
        return dt.clamp(lo, hi) if lo > 0.0 or hi != float("inf") else dt

    def _ssm_inputs(
        self, xc: torch.Tensor, dt_raw: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated conv output xc [R, C] (+ Mamba2's raw dt [R, Hs]) -> x [R, Hs, P],
        dt [R, Hs] (softplus'd, clamped), B / C [R, Hs|1, N]; all float32."""
        r = xc.shape[0]
        if self.kind == "mamba2":
            i, gn = self.d_inner, self.groups * self.n
            x, B, C = xc.split([i, gn, gn], dim=-1)
            rep = self.hs // self.groups
            B = B.reshape(r, self.groups, self.n).repeat_interleave(rep, dim=1)
            C = C.reshape(r, self.groups, self.n).repeat_interleave(rep, dim=1)
            return x.reshape(r, self.hs, self.p), self._dt(dt_raw), B, C
        x = xc
        dbc = self.x_proj(x.to(self.x_proj.weight.dtype))
        dtr, B, C = dbc.split([self.rank, self.n, self.n], dim=-1)
        if self.bc_norms:
            dtr, B, C = self.dt_layernorm(dtr), self.b_layernorm(B), self.c_layernorm(C)
        dtr, B, C = dtr.float(), B.float(), C.float()
        dt = dtr @ self.dt_proj.weight.float().t() + self.dt_proj.bias.float()
        return x[:, :, None], F.softplus(dt), B[:, None, :], C[:, None, :]

    def _finish(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Scan output y [R, Hs, P] float32 + gate [R, I] -> [R, H]."""
        y = y.reshape(y.shape[0], self.d_inner)
        if self.kind == "mamba2" and self.gate_norm == "gated" and self.triton:
            from xlaserve.kernels_cuda.ssm import gated_rms_norm as gated_rms_norm_kernel

            y = gated_rms_norm_kernel(y, gate, self.norm.weight, self.groups, self.eps)
        elif self.kind == "mamba2" and self.gate_norm == "gated":
            y = gated_rms_norm(y, gate, self.norm.weight, self.groups, self.eps)
        elif self.gate_norm == "norm_gate":  # Falcon-H1 mamba_norm_before_gate
            yg = y.float().reshape(y.shape[0], self.groups, -1)
            yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
            y = self.norm.weight.float() * yg.reshape(y.shape) * F.silu(gate.float())
        else:
            y = y * F.silu(gate.float())
        return self.out_proj(y.to(dtype))

    def _split(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """in_proj output -> (gate z, conv input, raw dt | None)."""
        if self.kind == "mamba2":
            z, xbc, dt = proj.split([self.d_inner, self.conv_dim, self.hs], dim=-1)
            return z, xbc, dt
        xs, z = proj.split([self.d_inner, self.d_inner], dim=-1)
        return z, xs, None

    def forward(self, x: torch.Tensor, cache: StateCache, md: AttentionMetadata) -> torch.Tensor:
        conv_s, ssm_s = cache
        slots: list[int] = md.derived["state_slots"]
        fresh: list[bool] = md.derived["state_fresh"]
        qsl = md.query_start_loc_host
        z, xbc, dt_raw = self._split(self.in_proj(x))
        w, b = self.conv1d.weight, self.conv1d.bias
        if x.shape[0] == len(slots) and self.triton:  # decode, in place in the slot caches
            from xlaserve.kernels_cuda.ssm import conv_state_update, ssm_state_update

            idx, keep = _step_state(md, x.device)
            xc = conv_state_update(xbc, w, b, conv_s, idx, keep)
            if self.kind == "mamba2":  # SiLU, dt, A and the update in one launch
                from xlaserve.kernels_cuda.ssm import mamba2_state_update

                y = mamba2_state_update(
                    ssm_s, idx, keep, xc, dt_raw, self.dt_bias, self.A_log, self.D,
                    self.groups, self.dt_limit,
                )  # fmt: skip
                return self._finish(y, z, x.dtype)
            xs, dt, B, C = self._ssm_inputs(F.silu(xc), dt_raw)
            a = self._A().expand(self.hs, 1, self.n).reshape(self.hs, self.n)
            B, C = B.expand(-1, self.hs, -1), C.expand(-1, self.hs, -1)  # one group per head
            y = ssm_state_update(ssm_s, idx, keep, xs, dt, a, B, C, self.D)
            return self._finish(y, z, x.dtype)
        if self.prefill_triton and self.kind == "mamba2" and x.shape[0] != len(slots):
            return self._prefill_varlen(z, xbc, dt_raw, conv_s, ssm_s, md)  # one launch each
        A = self._A()
        if x.shape[0] == len(slots):  # decode: one token per request, batched single step
            idx, keep = _step_state(md, x.device)
            cs = conv_s[idx] * keep[:, None, None]
            hs = ssm_s[idx] * keep[:, None, None, None]
            xc, cs = causal_conv1d_update(xbc, w, b, cs)
            xs, dt, B, C = self._ssm_inputs(F.silu(xc), dt_raw)
            y, hs = selective_state_update(hs, xs, dt, A, B, C, self.D)
            conv_s[idx] = cs
            ssm_s[idx] = hs
            return self._finish(y, z, x.dtype)
        conv_fn, ssd_fn = causal_conv1d, None
        if self.prefill_triton:
            from xlaserve.kernels_cuda.ssm_prefill import causal_conv1d_prefill, ssd_chunked_prefill

            conv_fn, ssd_fn = causal_conv1d_prefill, ssd_chunked_prefill
        ys = []
        for r, slot in enumerate(slots):
            lo, hi = qsl[r], qsl[r + 1]
            cs, hs = conv_s[slot], ssm_s[slot]
            if fresh[r]:
                cs, hs = torch.zeros_like(cs), torch.zeros_like(hs)
            xc, cs = conv_fn(xbc[lo:hi], w, b, cs)
            dr = dt_raw[lo:hi] if dt_raw is not None else None
            xs, dt, B, C = self._ssm_inputs(F.silu(xc), dr)
            if self.kind == "mamba2" and ssd_fn is not None:  # B / C per head: G = Hs
                y, hs = ssd_fn(xs, dt, A, B, C, self.D, hs, chunk=64)
            elif self.kind == "mamba2" and hi - lo > 1:
                y, hs = ssd_chunked(xs, dt, A, B, C, self.D, hs, chunk=min(self.chunk, 64))
            else:
                y, hs = selective_scan(xs, dt, A, B, C, self.D, hs)
            conv_s[slot] = cs
            ssm_s[slot] = hs
            ys.append(y)
        return self._finish(torch.cat(ys), z, x.dtype)

    def _prefill_varlen(
        self,
        z: torch.Tensor,
        xbc: torch.Tensor,
        dt_raw: torch.Tensor,
        conv_s: torch.Tensor,
        ssm_s: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Mamba2 prefill (any mix of request lengths) through the varlen Triton kernels: one
        conv launch and one SSD launch for the whole step, then the new states written to
        their slots in one index_copy each."""
        from xlaserve.kernels_cuda.ssm_prefill import causal_conv1d_varlen, ssd_varlen

        idx, keep = _step_state(md, xbc.device)
        cu = md.derived.get("state_cu")
        if cu is None:  # once per step, shared by the layers; from the host offsets, which
            # every attention backend's metadata carries alike (GPU-verified with this form)
            host = md.query_start_loc_host[: idx.shape[0] + 1]
            cu = md.derived["state_cu"] = torch.tensor(host, dtype=torch.int32).to(xbc.device)
        w, b = self.conv1d.weight, self.conv1d.bias
        xc, conv_new = causal_conv1d_varlen(xbc, w, b, conv_s, cu, idx, keep)
        # x / B / C as views of the activated conv row (no per-head copies of B and C: every
        # head of a group reads its group's rows, which stay in L2).
        t, i, gn = xc.shape[0], self.d_inner, self.groups * self.n
        act = F.silu(xc)
        xs = act[:, :i].view(t, self.hs, self.p)
        B = act[:, i : i + gn].view(t, self.groups, self.n)
        C = act[:, i + gn :].view(t, self.groups, self.n)
        y, ssm_new = ssd_varlen(
            xs, self._dt(dt_raw), self._A(), B, C, self.D, ssm_s, cu, idx, keep, chunk=self.ssd_chunk,
            block_p=self.ssd_block_p,
            precision=self.ssd_precision,
        )  # fmt: skip
        conv_s.index_copy_(0, idx, conv_new.to(conv_s.dtype))
        ssm_s.index_copy_(0, idx, ssm_new.to(ssm_s.dtype))
        return self._finish(y, z, xbc.dtype)


class SSMLayer(nn.Module):
    """residual + mixer(norm(x)); the residual stream in float32 when residual_in_fp32."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: str | torch.device,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        self.norm = SimpleRMSNorm(spec.hidden_size, spec.norm_eps, dtype, device)
        self.mixer = SSMMixer(spec, dtype, device, kernels)
        self.fp32 = spec.extra["ssm"]["residual_in_fp32"]

    def forward(self, x: torch.Tensor, cache: StateCache, md: AttentionMetadata) -> torch.Tensor:
        h = self.mixer(self.norm(x.to(self.norm.weight.dtype)), cache, md)
        return (x.float() if self.fp32 else x) + h


class MambaForCausalLM(CausalLMBase):
    """Mamba / Mamba2: embeddings, SSM layers, final RMSNorm, lm_head (tied for Mamba)."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: AttentionBackend | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            SSMLayer(spec, dtype, device, kernels) for _ in range(spec.num_layers)
        )
        self.norm = SimpleRMSNorm(spec.hidden_size, spec.norm_eps, dtype, device)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)
        if kernels is not None:
            self.use_kernels(kernels)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[StateCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cache, attn_metadata)
        return self.norm(x.to(self.norm.weight.dtype))

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.spec.tie_word_embeddings:
            return self.embed_tokens.as_lm_head(hidden)
        return self.lm_head(hidden)

    @torch.inference_mode()
    def compute_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self._lm_head(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(hidden).float()

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random matrices; A_log = log(1..), D = 1, dt_bias / conv at small values, norms 1."""
        super().init_dummy_weights(seed, std)
        with torch.no_grad():
            for layer in self.layers:
                m = layer.mixer
                n_a = m.A_log.shape[-1] if m.kind == "mamba" else m.A_log.shape[0]
                a = torch.arange(1, n_a + 1, dtype=torch.float32).log()
                m.A_log.copy_(a.expand_as(m.A_log))
                m.D.fill_(1.0)


class ShortConvMixer(nn.Module):
    """LFM2's gated short convolution: x [T, H] -> [T, H]. B, C, x = in_proj(x) (thirds);
    y = C * conv(B * x) (causal depthwise conv of K taps, no activation; the conv window of the
    request's slot carries the last K - 1 inputs B * x); out_proj(y). cache = (conv [S, H, K-1],
    an empty SSM state)."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: str | torch.device,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        s, h = spec.extra["ssm"], spec.hidden_size
        self.triton = use_ssm_kernels(device, kernels)
        self.in_proj = Linear(h, 3 * h, s["proj_bias"], dtype, device)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param((h, s["conv_kernel"]), dtype, device)
        self.conv1d.bias = _param((h,), dtype, device) if s["conv_bias"] else None
        self.out_proj = Linear(h, h, s["proj_bias"], dtype, device)

    def forward(self, x: torch.Tensor, cache: StateCache, md: AttentionMetadata) -> torch.Tensor:
        conv_s = cache[0]
        slots: list[int] = md.derived["state_slots"]
        fresh: list[bool] = md.derived["state_fresh"]
        b_gate, c_gate, xs = self.in_proj(x).chunk(3, dim=-1)
        bx = b_gate * xs
        w, b = self.conv1d.weight, self.conv1d.bias
        if x.shape[0] == len(slots):  # decode: one token per request
            idx, keep = _step_state(md, x.device)
            if self.triton:
                from xlaserve.kernels_cuda.ssm import conv_state_update

                y = conv_state_update(bx, w, b, conv_s, idx, keep)
            else:
                y, cs = causal_conv1d_update(bx, w, b, conv_s[idx] * keep[:, None, None])
                conv_s[idx] = cs
        else:
            ys, qsl = [], md.query_start_loc_host
            for r, slot in enumerate(slots):
                cs = torch.zeros_like(conv_s[slot]) if fresh[r] else conv_s[slot]
                yr, cs = causal_conv1d(bx[qsl[r] : qsl[r + 1]], w, b, cs)
                conv_s[slot] = cs
                ys.append(yr)
            y = torch.cat(ys)
        return self.out_proj(c_gate * y.to(x.dtype))


class HybridLayer(nn.Module):
    """One hybrid block, by spec.extra["layer_kinds"][layer]:
    - "attention" / "mamba" / "mamba2" / "shortconv": x + mixer(norm(x)), then + mlp(norm(x))
      (Bamba, Jamba, Granite 4, LFM2); the mixer is paged attention (DecoderAttention), an SSM
      mixer or LFM2's short convolution;
    - "parallel" (Falcon-H1): x + ssm(n) + attention(n) with n = norm(x), then + mlp(norm(x));
    - spec.extra["single_mixer"] (Nemotron-H): x + mixer(norm(x)) only, the mixer attention,
      Mamba2 or (kind "mlp") the MLP.
    cache: (K, V) for attention, (conv, ssm) for state layers, ((K, V), (conv, ssm)) for
    parallel ones, two empty tensors for "mlp" layers (backends_torch/state.py)."""

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
        from xlaserve.backends_torch.models.decoder import DecoderAttention

        h = spec.hidden_size
        self.kind = kind = spec.extra["layer_kinds"][layer]
        self.single = bool(spec.extra.get("single_mixer"))
        self.attention = kind in ("attention", "parallel")
        self.input_layernorm = spec_norm(spec, h, dtype, device)
        if not self.single:
            self.post_attention_layernorm = spec_norm(spec, h, dtype, device)
        if self.attention:
            self.self_attn = DecoderAttention(spec, layer, backend, dtype, device, kernels)
        if kind in ("mamba", "mamba2", "parallel"):
            self.mixer = SSMMixer(spec, dtype, device, kernels)
        elif kind == "shortconv":
            self.mixer = ShortConvMixer(spec, dtype, device, kernels)
        if self.single and kind != "mlp":  # Nemotron-H: the layer's one mixer is not an MLP
            self.mlp = None
        elif spec.is_moe_layer(layer):  # GraniteMoeHybrid: MoE + the shared MLP as shared expert
            from xlaserve.backends_torch.layers.moe import FusedMoE

            self.mlp = FusedMoE(spec, dtype, device, kernels=kernels)
        else:
            self.mlp = make_mlp(spec, layer, dtype, device, kernels)
        self.rm = spec.residual_multiplier

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cache: tuple,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == "mlp":
            h = self.mlp(h)
        elif self.kind == "parallel":  # Falcon-H1 (multipliers folded into the weights)
            kv, state = cache
            h = self.mixer(h, state, md) + self.self_attn(positions, h, kv, md)
        elif self.attention:
            h = self.self_attn(positions, h, cache, md)
        else:
            h = self.mixer(h, cache, md)
        x = x + (h * self.rm if self.rm != 1.0 else h)
        if self.single:
            return x
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h * self.rm if self.rm != 1.0 else h)


class HybridForCausalLM(MambaForCausalLM):
    """Attention + state-space hybrids (Bamba, Jamba, Granite 4, LFM2, Nemotron-H, Falcon-H1):
    per layer the cache of its kind (HybridLayer; backends_torch/state.py allocates them)."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: AttentionBackend | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        from xlaserve.backends_torch.layers.attention import TorchRefAttention

        CausalLMBase.__init__(self)
        backend = attn_backend if attn_backend is not None else TorchRefAttention()
        self.spec = spec
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            HybridLayer(spec, i, backend, dtype, device, kernels) for i in range(spec.num_layers)
        )
        self.norm = SimpleRMSNorm(spec.hidden_size, spec.norm_eps, dtype, device)
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
        if self.spec.embedding_multiplier != 1.0:
            x = x * self.spec.embedding_multiplier
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(positions, x, cache, attn_metadata)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """None when logits are scaled (Granite): the float32 path keeps exact ties."""
        return None if self.spec.logits_scaling != 1.0 else self._lm_head(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(hidden).float() / self.spec.logits_scaling

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        CausalLMBase.init_dummy_weights(self, seed, std)
        with torch.no_grad():
            for layer in self.layers:
                m = getattr(layer, "mixer", None)
                if isinstance(m, SSMMixer):
                    m.A_log.copy_(torch.arange(1, m.A_log.shape[0] + 1, dtype=torch.float32).log())
                    m.D.fill_(1.0)
