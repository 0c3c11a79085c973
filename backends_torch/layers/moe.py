"""FusedMoE: router top-k + stacked experts (+ optional shared expert) behind one layer.

Parameters follow the canonical names (`model_loader/spec.py`) under the layer's `mlp.` prefix:
router.weight [E, H] (+ router.bias [E], a selection-only bias), experts.w_gate / w_up [E, I, H],
experts.w_down [E, H, I], shared_expert.{gate,up,down}_proj, shared_expert_gate.weight [1, H].

The expert computation is chosen by name (`moe_impl`), like attention backends: "torch_ref" (plain
torch ops, loops over the experts that received tokens; any device) and "triton"
(kernels_cuda/fused_moe.py: expert-sorted row blocks x expert weight tiles, no host sync;
registered below via `register_moe_impl`; CPU tensors only under TRITON_INTERPRET=1). Every impl
has the signature of `fused_experts_ref`. The default: the `moe_impl` argument, else
KernelConfig.moe_impl, "auto" = "triton" on CUDA and "torch_ref" elsewhere (`default_moe_impl`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xlaserve.backends_torch.layers.activation import MLP, get_activation
from xlaserve.backends_torch.layers.linear import Linear
from xlaserve.config import KernelConfig, kernel_switch
from xlaserve.model_loader.spec import ModelSpec

ExpertsFn = Callable[..., torch.Tensor]


def select_experts(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    score_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling: float = 1.0,
    group_topn: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int64).

    softmax: top-k of softmax(logits). sigmoid (DeepSeek-V3): scores = sigmoid(logits); experts are
    chosen on scores + score_bias, restricted to the best `topk_groups` of `num_groups` groups (a
    group's score is the sum of its top `group_topn`, 2 for V3, 1 = max for V2); weights are the
    unbiased scores of the chosen experts.
    Then optional renormalisation to sum 1, then * routed_scaling.
    """
    logits = logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
        choice = scores if score_bias is None else scores + score_bias.float()
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if score_bias is None else scores + score_bias.float()
    else:
        raise ValueError(f"unknown MoE scoring {scoring!r} (expected 'softmax' or 'sigmoid')")
    if num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, num_groups, e // num_groups)
        group_scores = grouped.topk(min(group_topn, e // num_groups), dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1)[1], True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), -torch.inf)
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        denom = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denom + 1e-20) if scoring == "sigmoid" else weights / denom
    if routed_scaling != 1.0:
        weights = weights * routed_scaling
    return weights, ids


def fused_experts_ref(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """sum_k w[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t,k].

    x [T, H]; w_gate/w_up [E, I, H]; w_down [E, H, I]; topk_weights/ids [T, K] -> [T, H].
    Loops over the experts that received tokens (cheap on CPU for tiny models, correct anywhere).
    """
    act = get_activation(activation)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        xe = x[tok]
        h = act(F.linear(xe, w_gate[e])) * F.linear(xe, w_up[e])
        y = F.linear(h, w_down[e])
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


def expert_glu(gate: torch.Tensor, up: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """The experts' gated activation [.., I] (ModelSpec.moe_glu): act(gate) * up, or gpt-oss's
    clamped SwiGLU g * sigmoid(alpha * g) * (clamp(up, -L, L) + 1), g = min(gate, L)."""
    if spec.moe_glu == "swiglu_clamp":
        lim, alpha = float(spec.extra["swiglu_limit"]), float(spec.extra["swiglu_alpha"])
        g = gate.clamp(max=lim)
        return g * torch.sigmoid(g * alpha) * (up.clamp(-lim, lim) + 1)
    if spec.moe_glu != "act":
        raise ValueError(f"unknown moe_glu {spec.moe_glu!r} (expected 'act' or 'swiglu_clamp')")
    return get_activation(spec.activation)(gate) * up


def fused_experts_biased_ref(
    x: torch.Tensor,
    experts: nn.Module,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    spec: ModelSpec,
) -> torch.Tensor:
    """`fused_experts_ref` with expert biases and `expert_glu` (gpt-oss): x [T, H] -> [T, H].
    The Triton MoE kernel takes neither, so such models run this loop on every device."""
    e_ = experts
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        xe = x[tok]
        gate = F.linear(xe, e_.w_gate[e], None if e_.b_gate is None else e_.b_gate[e])
        up = F.linear(xe, e_.w_up[e], None if e_.b_up is None else e_.b_up[e])
        y = F.linear(
            expert_glu(gate, up, spec), e_.w_down[e], None if e_.b_down is None else e_.b_down[e]
        )
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


def scale_expert_inputs(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Input-scaled routing (Llama 4): x [T, H], weights / ids [T, K] -> (rows [T*K, H] with
    row t*K + k = weights[t, k] * x[t] in x's dtype, unit weights [T*K, 1], ids [T*K, 1], K). Any
    experts impl then computes expert_e(w * x) per row; summing each token's K rows gives
    sum_k expert_e(w[t,k] * x_t)."""
    t, k = ids.shape
    rows = (x.unsqueeze(1) * weights.unsqueeze(-1).to(x.dtype)).reshape(t * k, -1)
    ones = torch.ones(t * k, 1, dtype=weights.dtype, device=weights.device)
    return rows, ones, ids.reshape(t * k, 1), k


# name -> "module:function", imported on first use.
_MOE_IMPLS: dict[str, str] = {
    "torch_ref": "xlaserve.backends_torch.layers.moe:fused_experts_ref",
}


def register_moe_impl(name: str, target: str) -> None:
    """Register an experts implementation as "package.module:function" (imported lazily)."""
    _MOE_IMPLS[name] = target


def available_moe_impls() -> list[str]:
    return sorted(_MOE_IMPLS)


# The Triton fused MoE (imported on first use, so CPU-only installs never import triton).
register_moe_impl("triton", "xlaserve.kernels_cuda.fused_moe:fused_experts")


def default_moe_impl(device: torch.device | str, kernels: KernelConfig | None = None) -> str:
    """KernelConfig.moe_impl unless "auto"; "auto" = "triton" on CUDA (as the runner picks
    attention), else "torch_ref". kernels None: the default and its environment override."""
    name = kernel_switch("moe_impl", kernels)
    if name != "auto":
        return name
    return "triton" if torch.device(device).type == "cuda" else "torch_ref"


def get_moe_impl(name: str) -> ExpertsFn:
    if name not in _MOE_IMPLS:
        raise ValueError(f"unknown moe_impl {name!r}; known: {', '.join(available_moe_impls())}")
    module, _, fn = _MOE_IMPLS[name].partition(":")
    return getattr(importlib.import_module(module), fn)


class Router(nn.Module):
    """weight [E, H] -> logits [T, E] (float32); `bias` [E] only biases expert selection."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        e, h = spec.num_experts, spec.hidden_size
        self.weight = nn.Parameter(
            torch.empty(e, h, dtype=dtype, device=device), requires_grad=False
        )
        # The selection bias is kept in float32 whatever the model dtype (as checkpoints ship it).
        self.bias = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32, device=device), requires_grad=False)
            if spec.moe_router_bias or spec.moe_router_logit_bias
            else None
        )
        self.logit_bias = spec.moe_router_logit_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.weight.float())
        return logits + self.bias if self.logit_bias else logits


class Experts(nn.Module):
    """Stacked expert weights: w_gate, w_up [E, I, H]; w_down [E, H, I]."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(
                torch.empty(*shape, dtype=dtype, device=device), requires_grad=False
            )

        self.w_gate, self.w_up, self.w_down = p(e, i, h), p(e, i, h), p(e, h, i)
        self.b_gate = self.b_up = self.b_down = None
        if spec.moe_expert_bias:  # gpt-oss
            self.b_gate, self.b_up, self.b_down = p(e, i), p(e, i), p(e, h)


class FusedMoE(nn.Module):
    """x [T, H] -> [T, H]: routed experts (+ shared expert, optionally sigmoid-gated)."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        moe_impl: str | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.moe_impl = moe_impl or default_moe_impl(device, kernels)
        self._experts_fn = get_moe_impl(self.moe_impl)
        self.router = Router(spec, dtype, device)
        self.experts = Experts(spec, dtype, device)
        self.shared_expert = (
            MLP(
                spec.hidden_size,
                spec.shared_expert_intermediate_size,
                spec.activation,
                True,
                False,
                dtype,
                device,
            )
            if spec.shared_expert_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            Linear(spec.hidden_size, 1, False, dtype, device)
            if self.shared_expert is not None and spec.shared_expert_gate
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        weights, ids = select_experts(
            self.router(x),
            s.num_experts_per_tok,
            s.norm_topk_prob,
            s.moe_scoring,
            None if s.moe_router_logit_bias else self.router.bias,
            s.moe_num_groups,
            s.moe_topk_groups,
            s.moe_routed_scaling,
            s.moe_group_topn,
        )
        e = self.experts
        rows, k = x, 1
        if s.moe_scale_input:  # Llama 4: expert_e(w * x); one row per (token, choice), weight 1
            rows, weights, ids, k = scale_expert_inputs(x, weights, ids)
        if s.moe_expert_bias or s.moe_glu != "act":
            out = fused_experts_biased_ref(rows, e, weights, ids, s)
        else:
            out = self._experts_fn(rows, e.w_gate, e.w_up, e.w_down, weights, ids, s.activation)
        if k > 1:  # input-scaled routing: each token's K rows summed back to [T, H]
            out = out.view(-1, k, out.shape[-1]).sum(dim=1)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
