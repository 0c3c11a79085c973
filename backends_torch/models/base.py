"""What every Torch model shares: weight loading (canonical names), dummy init, dtype helpers."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

_NP_TO_TORCH = {
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
}


def numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    """A host tensor viewing (or, for read-only mmaps, copying) `a`; bf16 via its uint16 bits."""
    if a.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16).copy()).view(torch.bfloat16)
    if a.dtype not in _NP_TO_TORCH:
        raise ValueError(f"unsupported weight dtype {a.dtype}")
    # np.array copies read-only memory-mapped views (torch.from_numpy wants writable memory).
    return torch.from_numpy(np.array(a, copy=True) if not a.flags.writeable else a)


class CausalLMBase(nn.Module):
    """Parameters are named by the canonical names of `model_loader/spec.py`."""

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        """Copy (canonical name, array) pairs onto the parameters one tensor at a time, casting to
        the parameter's dtype. Unknown names, shape mismatches and missing weights raise."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, arr in weights:
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}"
                )
            p = params[name]
            if tuple(arr.shape) != tuple(p.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(arr.shape)} != model shape {tuple(p.shape)}"
                )
            with torch.no_grad():
                p.copy_(numpy_to_torch(arr).to(device=p.device, dtype=p.dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"weights missing from the checkpoint: {', '.join(missing[:8])}"
                + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            )

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random normal(0, std) for matrices and biases; norm weights stay at their init (ones)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(0.0 if getattr(self, "_norm_offset", 0.0) else 1.0)
                    continue
                if p.is_cuda:  # 8B parameters: seconds on the GPU, minutes on the host
                    if g.device != p.device:
                        g = torch.Generator(device=p.device).manual_seed(seed)
                    p.normal_(0.0, std, generator=g)
                    continue
                w = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
                p.copy_(w.to(device=p.device, dtype=p.dtype))
