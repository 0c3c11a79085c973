"""Activations and the (gated) MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xlaserve.backends_torch.layers.linear import make_linear

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTS)}")
    return _ACTS[name]


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up; gate, up: [T, I] (the GPU path fuses this)."""
    return get_activation(act)(gate) * up


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)); plain: down(act(up(x))). x: [T, H] -> [T, H].

    Parameter names follow the canonical names: gate_proj, up_proj, down_proj.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        activation: str = "silu",
        gated: bool = True,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.activation = activation
        self.act = get_activation(activation)
        self.gated = gated
        if gated:
            self.gate_proj = make_linear(hidden, intermediate, bias, dtype, device, "column")
        self.up_proj = make_linear(hidden, intermediate, bias, dtype, device, "column")
        self.down_proj = make_linear(intermediate, hidden, bias, dtype, device, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(act_and_mul(self.gate_proj(x), self.up_proj(x), self.activation))
        return self.down_proj(self.act(self.up_proj(x)))
