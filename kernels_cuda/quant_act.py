"""`QuantAct`: a per-token quantized activation (torch only, no triton import, so the torch
layers can test for it at any time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantAct:
    """A pre-quantized activation, handed to a w8a8 matmul in place of its float input (the
    producer, e.g. `fused_act_quant.rms_norm_quant`, already ran `quant_rows`' math).

    q [M, K] int8 or float8_e4m3fn; scale float32 [M, 1] (per token); dtype: the float dtype of
    the activation it stands for (the matmul's output dtype).
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def fmt(self) -> str:
        return "int8" if self.q.dtype == torch.int8 else "fp8"
