"""Backend-neutral weight reading: safetensors (single or sharded, memory-mapped), dummy weights.

Tensors come out as numpy arrays that view the memory-mapped file (no copy); bfloat16 uses
`ml_dtypes.bfloat16`. Backends cast/copy them onto their device one tensor at a time, so a
checkpoint is never held twice in host memory.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator

import numpy as np

try:  # ml_dtypes ships with jax; without it bf16 checkpoints cannot be read as numpy.
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
    _FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:  # pragma: no cover
    ml_dtypes = None
    _BF16 = None
    _FP8_E4M3 = None

_ST_DTYPES: dict[str, np.dtype | None] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": _BF16,
    "F8_E4M3": _FP8_E4M3,
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsFile:
    """A memory-mapped safetensors file: `keys()`, `get(name) -> np.ndarray` (a view)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata = header.pop("__metadata__", None) or {}
        self._header = header
        self._offset = 8 + n

    def keys(self) -> list[str]:
        return list(self._header)

    def get(self, name: str) -> np.ndarray:
        info = self._header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        buf = memoryview(self._mm)[self._offset + start : self._offset + end]
        return np.frombuffer(buf, dtype=dtype).reshape(info["shape"])


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files (sharded index or single file); clear error if none."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [p for p in files if not os.path.exists(os.path.join(model_dir, p))]
        if missing:
            raise FileNotFoundError(
                f"{model_dir}: shards listed in the index are missing: {missing}"
            )
        return [os.path.join(model_dir, p) for p in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    others = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
    if others:
        return [os.path.join(model_dir, p) for p in others]
    pickles = [p for p in os.listdir(model_dir) if p.endswith((".bin", ".pt", ".pth"))]
    hint = (
        f" (found pickle files {pickles}: pass load_format='pt' and allow_pickle=True to read them)"
        if pickles
        else ""
    )
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or safetensors index{hint}")


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array view) for every tensor of the checkpoint."""
    for path in safetensors_files(model_dir):
        f = SafetensorsFile(path)
        for name in f.keys():
            yield name, f.get(name)


def iter_pickle(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    """Pickle checkpoints (`pytorch_model*.bin`), read with `torch.load(weights_only=True)`."""
    import torch

    paths = sorted(
        os.path.join(model_dir, p)
        for p in os.listdir(model_dir)
        if p.endswith((".bin", ".pt", ".pth"))
    )
    if not paths:
        raise FileNotFoundError(f"{model_dir}: no .bin/.pt checkpoint files")
    for path in paths:
        state = torch.load(path, map_location="cpu", weights_only=True)
        for name, t in state.items():
            if t.dtype == torch.bfloat16:
                yield name, t.view(torch.uint16).numpy().view(_BF16)
            else:
                yield name, t.numpy()
