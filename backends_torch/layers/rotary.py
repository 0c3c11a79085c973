"""Rotary position embedding (HF "neox" style: rotate_half over first/second halves).

Frequencies come from the backend-neutral `xlaserve.model_loader.rope.rope_inv_freq`, so the Torch
and XLA backends use identical tables.
"""

from __future__ import annotations

import torch
from torch import nn

from xlaserve.model_loader.rope import rope_inv_freq
from xlaserve.model_loader.spec import ModelSpec


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos/sin [T, R/2] (float32); dims >= R pass through unchanged.

    Computed in float32 and cast back to x's dtype.
    """
    half = cos.shape[-1]
    rot = x[..., : 2 * half].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    if 2 * half == x.shape[-1]:
        return out
    return torch.cat([out, x[..., 2 * half :]], dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin computed from positions on the fly (no max-length table): cheap and graph-safe."""

    def __init__(
        self, spec: ModelSpec, device: torch.device | str = "cpu", theta: float | None = None
    ) -> None:
        super().__init__()
        if theta is not None and theta != spec.rope_theta:
            from dataclasses import replace

            spec = replace(spec, rope_theta=theta)
        inv_freq, self.attention_factor = rope_inv_freq(spec)
        self.register_buffer("inv_freq", torch.from_numpy(inv_freq).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> cos, sin [T, R/2] float32 (scaled by the attention factor)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated q, k."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
