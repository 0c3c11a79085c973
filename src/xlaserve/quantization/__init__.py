"""Weight quantization, backend-neutral (numpy + ml_dtypes; no torch/jax import).

- `numpy_quant`: int8 per-channel, int4 group-wise (packed two per byte), fp8 e4m3 per-channel
  quantizers and their inverses; the canonical layouts every backend loads (see its docstring).
- `scheme`: `QuantScheme` and `resolve_scheme` (user `quantization=` + config.json detection).
- `hf_formats`: GPTQ / AWQ / compressed-tensors fp8 readers (and numpy writers for tests).

Backends: torch `backends_torch/layers/linear.py` (QuantLinear, Triton kernels on CUDA);
XLA `kernels_pallas/quant_matmul.py` (`quant_linear`, Pallas on TPU, jnp elsewhere).
"""

from xlaserve.quantization.numpy_quant import (
    FP8_E4M3,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    int4_group_size,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_weight,
    unpack_int4,
)
from xlaserve.quantization.scheme import QuantScheme, resolve_scheme, scheme_from_hf_config

__all__ = [
    "FP8_E4M3",
    "QuantScheme",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int8",
    "int4_group_size",
    "pack_int4",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "quantize_weight",
    "resolve_scheme",
    "scheme_from_hf_config",
    "unpack_int4",
]
