"""Rotary position embedding frequencies, backend-neutral (numpy only).

Both backends build their rotary tables from `rope_inv_freq`, so they agree bit for bit on the
frequencies. Semantics follow HF transformers' `ROPE_INIT_FUNCTIONS` (`modeling_rope_utils.py`):

- "default" / None: inv_freq[i] = 1 / theta ** (2i / dim)
- "linear":  inv_freq / factor
- "dynamic": NTK-aware base rescaling. HF recomputes it when a sequence grows past
  max_position_embeddings; here it is evaluated statically at `seq_len` (default:
  max_position_embeddings, where it equals "default"), which matches HF at init time and for every
  sequence up to max_position_embeddings.
- "llama3":  per-band wavelength scaling with smooth interpolation (Llama 3.1).
- "yarn":    interpolation/extrapolation ramp between dims + attention factor (mscale).
- "longrope": short_factor (or long_factor when `seq_len` > original_max_position_embeddings).

HF style rotation ("neox", rotate_half over first/second halves); with a partial rotary factor only
the first `rotary_dim` dims of each head rotate. cos/sin are multiplied by the returned attention
factor (HF's `attention_scaling`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from xlaserve.model_loader.spec import ModelSpec

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The rope_type of an HF rope_scaling / rope_parameters dict ("default" when absent)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _base_inv_freq(base: float, dim: int) -> np.ndarray:
    """[dim / 2] float64: 1 / base ** (2i / dim)."""
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rs: dict[str, Any], base: float, dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    orig = int(rs.get("original_max_position_embeddings") or max_pos)
    factor = rs.get("factor")
    if factor is None:
        factor = max_pos / orig
    factor = float(factor)
    attn = rs.get("attention_factor")
    if attn is None:
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn = _yarn_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(n_rot: float) -> float:
        # The dim whose wavelength completes n_rot rotations over the original context.
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrap = 1.0 - ramp  # 1 = keep original frequency (high-frequency dims)
    inv = _base_inv_freq(base, dim)
    inv = (inv / factor) * (1.0 - extrap) + inv * extrap
    return inv, float(attn)


def _llama3(rs: dict[str, Any], base: float, dim: int, max_pos: int) -> np.ndarray:
    inv = _base_inv_freq(base, dim)
    factor = float(rs["factor"])
    low_ff = float(rs.get("low_freq_factor", 1.0))
    high_ff = float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings") or max_pos)
    low_wl, high_wl = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(medium, smoothed, scaled)


def rope_inv_freq(spec: ModelSpec, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """inv_freq [rotary_dim / 2] float32 and the attention factor that scales cos/sin.

    `seq_len` only matters for "dynamic" and "longrope" (see the module docstring).
    """
    dim = spec.rotary_dim
    base = float(spec.rope_theta)
    rs = dict(spec.rope_scaling or {})
    kind = rope_type(rs)
    max_pos = spec.max_position_embeddings
    attn = 1.0
    if kind == "default":
        inv = _base_inv_freq(base, dim)
    elif kind == "linear":
        inv = _base_inv_freq(base, dim) / float(rs["factor"])
    elif kind == "dynamic":
        factor = float(rs["factor"])
        sl = max(seq_len or max_pos, max_pos)
        base = base * ((factor * sl / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        inv = _base_inv_freq(base, dim)
    elif kind == "llama3":
        inv = _llama3(rs, base, dim, max_pos)
    elif kind == "yarn":
        inv, attn = _yarn(rs, base, dim, max_pos)
    elif kind == "longrope":
        orig = int(rs.get("original_max_position_embeddings") or max_pos)
        factor = rs.get("factor")
        factor = float(max_pos / orig if factor is None else factor)
        attn = rs.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = rs["long_factor"] if seq_len and seq_len > orig else rs["short_factor"]
        inv = 1.0 / (np.asarray(ext, dtype=np.float64) * base ** (np.arange(0, dim, 2) / dim))
    else:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    return inv.astype(np.float32), float(attn)


def rope_cos_sin(
    inv_freq: np.ndarray, positions: np.ndarray, attention_factor: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rotary_dim / 2] float32 for integer positions [T] (reference helper)."""
    freqs = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    return (np.cos(freqs) * attention_factor).astype(np.float32), (
        np.sin(freqs) * attention_factor
    ).astype(np.float32)


def apply_rope_np(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Reference neox rotation of x [T, heads, D] with cos/sin [T, R/2]; dims >= R pass through."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    x1, x2 = rot[..., :half], rot[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return np.concatenate([out, rest], axis=-1).astype(x.dtype)
