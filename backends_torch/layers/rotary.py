"""Rotary position embedding (HF "neox" style: rotate_half over first/second halves).

Frequencies come from the backend-neutral `xlaserve.model_loader.rope.rope_inv_freq`, so the Torch
and XLA backends use identical tables.
"""

from __future__ import annotations

import torch
from torch import nn

from xlaserve.config import KernelConfig
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


def rope_table_len(spec: ModelSpec) -> int:
    """Positions the Triton path's cos/sin table covers: max_position_embeddings, or more when
    rope scaling extends the context (the engine allows max_model_len past
    max_position_embeddings only then): original length (or max_position_embeddings) * factor."""
    n = spec.max_position_embeddings
    rs = spec.rope_scaling or {}
    factor = float(rs.get("factor", 1.0) or 1.0)
    if factor > 1.0:
        base = int(rs.get("original_max_position_embeddings") or spec.max_position_embeddings)
        n = max(n, int(base * factor))
    return n


class RotaryEmbedding(nn.Module):
    """cos/sin computed from positions on the fly (no max-length table): cheap and graph-safe.

    `enable_triton(table)`: rotate with the in-place Triton kernel (kernels_cuda/rotary.py) and a
    [P, R] = [cos | sin] table instead (one launch for q and k; CUDA, or CPU under
    TRITON_INTERPRET=1); `cos_sin_table` builds it, shared by every layer with the same rope.
    `kernels`: the Triton kernels' launch switches (set by the model's `use_kernels`).
    """

    kernels: KernelConfig | None = None

    def __init__(
        self, spec: ModelSpec, device: torch.device | str = "cpu", theta: float | None = None
    ) -> None:
        super().__init__()
        if theta is not None and theta != spec.rope_theta:
            from dataclasses import replace

            spec = replace(spec, rope_theta=theta)
        inv_freq, self.attention_factor = rope_inv_freq(spec)
        self.register_buffer("inv_freq", torch.from_numpy(inv_freq).to(device), persistent=False)
        self.table_len = rope_table_len(spec)
        self.cos_sin_cache: torch.Tensor | None = None

    def table_key(self) -> tuple:
        """Rotaries with equal keys share one cos/sin table."""
        return (tuple(self.inv_freq.tolist()), self.attention_factor, self.table_len)

    def cos_sin_table(self) -> torch.Tensor:
        """[P, R] float32 = [cos | sin] of every position < table_len (attention factor in)."""
        from xlaserve.kernels_cuda import compute_cos_sin_cache

        table = compute_cos_sin_cache(self.inv_freq, self.table_len)
        return table * self.attention_factor if self.attention_factor != 1.0 else table

    def enable_triton(self, table: torch.Tensor | None) -> None:
        """Use the Triton kernel with `table` (from `cos_sin_table`); None: back to torch ops."""
        self.cos_sin_cache = table

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> cos, sin [T, R/2] float32 (scaled by the attention factor)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    @property
    def triton_enabled(self) -> bool:
        """Whether the Triton kernels rotate (`enable_triton` was given a table)."""
        return self.cos_sin_cache is not None

    def forward_write_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Triton path only: rotate q [T, Hq, D] and k [T, Hkv, D] in place and write the rotated
        k and v [T, Hkv, D] into the float paged caches [N, S, Hkv, D] at slot_mapping [T]
        (slots < 0 skipped), one launch (kernels_cuda.rotary_embedding_write_kv). Returns q."""
        if self.cos_sin_cache is None:
            raise RuntimeError("forward_write_kv needs the Triton rotary (enable_triton)")
        from xlaserve.kernels_cuda import rotary_embedding_write_kv

        rotary_embedding_write_kv(
            q, k, v, positions, self.cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=True,
            kernels=self.kernels,
        )  # fmt: skip
        return q

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated q, k. The Triton path rotates q and k in place
        (they may be strided views of a fused qkv output) and returns them; positions must be
        < table_len there (no bounds check: no host sync inside CUDA graphs)."""
        if self.cos_sin_cache is not None:
            from xlaserve.kernels_cuda import rotary_embedding

            rotary_embedding(
                q, k, positions, self.cos_sin_cache, is_neox=True, kernels=self.kernels
            )
            return q, k
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
