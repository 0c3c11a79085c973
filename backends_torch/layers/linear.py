"""Linear layers. Weights use the torch Linear layout [out, in] (the canonical checkpoint layout).

Quantized variants (`QuantLinear`, below) live here too, so model files never change for them;
tensor-parallel ones come through the `make_*` factories (backends_torch/distributed/layers.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from xlaserve.config import KernelConfig, kernel_switch
from xlaserve.kernels_cuda.quant_act import QuantAct
from xlaserve.quantization import QuantScheme, quantize_weight, resolve_scheme
from xlaserve.quantization.numpy_quant import FP8_E4M3, FP8_MAX
from xlaserve.quantization.scheme import check_fp8_support


class Linear(nn.Module):
    """y = x @ W.T (+ b). x: [..., in] -> [..., out]. `kernels` (set by the model's
    `use_kernels`; None = defaults + environment) picks the batch-1 dense GEMV."""

    kernels: KernelConfig | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)


_GEMV_DTYPES = (torch.float16, torch.bfloat16)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """F.linear (x [..., K] @ weight [N, K]^T + bias), except one-row float16 / bfloat16 inputs
    (batch-1 decode) on CUDA, or on CPU under TRITON_INTERPRET=1, that the Triton dense GEMV
    serves (`kernels_cuda.dense_gemv.use_dense_gemv`: every shape on CUDA by default, the
    DENSE_GEMV_SHAPES table, or KernelConfig.dense_gemv on / off). The cheap checks here mirror
    use_dense_gemv's so that other calls never import Triton."""
    k = x.shape[-1]
    if (
        x.numel() == k
        and x.dtype in _GEMV_DTYPES
        and weight.dtype == x.dtype
        and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    ):
        from xlaserve.kernels_cuda.dense_gemv import dense_gemv, use_dense_gemv

        n = weight.shape[0]
        if use_dense_gemv(1, n, k, x.dtype, x.device, kernels):
            y = dense_gemv(x.reshape(1, k).contiguous(), weight, bias, kernels=kernels)
            return y.reshape(*x.shape[:-1], n)
    return F.linear(x, weight, bias)


class MergedLinear(Linear):
    """Linears over the same input fused along the output dim: W = [W_a; W_b; ...] of shape
    [sum(part_sizes), in]. One GEMM (a GEMV at decode) instead of one per member; the caller
    splits the output with `y.split(part_sizes, -1)` (views, no copies).

    `part_names` are the members' canonical names (what the checkpoint calls them, e.g.
    ("q_proj", "k_proj", "v_proj")), `part_sizes` the rows each holds here. Loaders write each
    member's tensors into its row range (`fused_members`); a tensor named after this module
    itself (a fused checkpoint) loads whole. Every per-row tensor (weight, bias, quantized
    qweight/scales/qzeros) concatenates the same way, so `QuantLinear` keeps the fusion.
    """

    def __init__(
        self,
        in_features: int,
        part_names: Sequence[str],
        part_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if len(part_names) != len(part_sizes) or not part_names:
            raise ValueError(f"part_names {part_names} and part_sizes {part_sizes} disagree")
        super().__init__(in_features, sum(part_sizes), bias, dtype, device)
        self.part_names = tuple(part_names)
        self.part_sizes = tuple(int(n) for n in part_sizes)


class FusedSlot(NamedTuple):
    """Where a member of a fused layer lives: rows [start, start + rows) of `module`'s per-row
    tensors; `prefix` is the fused module's name, `index` the member's position in it."""

    prefix: str
    module: nn.Module
    index: int
    start: int
    rows: int


def fused_members(model: nn.Module) -> dict[str, FusedSlot]:
    """Canonical member prefix (e.g. "layers.0.self_attn.k_proj") -> its `FusedSlot`, for every
    fused layer of `model` (modules with `part_names`: MergedLinear, its TP variant, and the
    QuantLinear that replaced one)."""
    out: dict[str, FusedSlot] = {}
    for name, mod in model.named_modules():
        names = getattr(mod, "part_names", None)
        if not names:
            continue
        parent = name.rpartition(".")[0]
        start = 0
        for i, (part, rows) in enumerate(zip(names, mod.part_sizes, strict=True)):
            out[f"{parent}.{part}" if parent else part] = FusedSlot(name, mod, i, start, rows)
            start += rows
    return out


def fuse_projections_enabled(kernels: KernelConfig | None = None) -> bool:
    """KernelConfig.fuse_projections (default on): off builds separate q/k/v and gate/up layers
    (the unfused layout, for A/B measurements)."""
    return bool(kernel_switch("fuse_projections", kernels))


def _checkpoint_scheme(model_dir: str | None) -> QuantScheme | None:
    from xlaserve.quantization.scheme import read_quantization_config, scheme_from_hf_config

    qc = read_quantization_config(model_dir)
    if qc is None:
        return None
    try:
        return scheme_from_hf_config(qc)
    except NotImplementedError:
        return None  # the runner reports the unsupported format itself


def can_fuse(
    model_dir: str | None, member_prefixes: Sequence[str], kernels: KernelConfig | None = None
) -> bool:
    """Whether the linears `member_prefixes` (canonical, one input) may be built fused: always
    for float checkpoints and runtime quantization (every format is per output row); for a
    pre-quantized checkpoint not with GPTQ act-order (each member has its own input permutation)
    nor when its ignore list keeps some members float and quantizes others. Also off with
    KernelConfig.fuse_projections off."""
    if not fuse_projections_enabled(kernels):
        return False
    scheme = _checkpoint_scheme(model_dir)
    if scheme is None:
        return True
    if scheme.act_order or scheme.weight_block is not None:
        return False  # per-member permutations / block scales do not concatenate by rows
    return len({scheme.skips(p) for p in member_prefixes}) == 1


class VocabEmbedding(nn.Module):
    """Token embedding table weight [V, H]; ids [T] -> [T, H]."""

    kernels: KernelConfig | None = None  # the tied lm_head's dense GEMV (see Linear)

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied embeddings: hidden [B, H] -> logits [B, V]."""
        return linear(hidden, self.weight, kernels=self.kernels)


# ---- factories: the plain layer, or its tensor-parallel variant inside a TP worker ------------
# Models build their layers through these, so they carry no TP logic (backends_torch/distributed).


def _tp_active() -> bool:
    from xlaserve.backends_torch.distributed.parallel_state import tp_world_size

    return tp_world_size() > 1


def make_linear(
    in_features: int,
    out_features: int,
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    parallel: str | None = None,
    replicas: int = 1,
) -> Linear:
    """`Linear`, or with a TP group: parallel="column" (output split) / "row" (input split,
    all-reduced). `replicas`: ranks sharing one column shard (KV heads fewer than ranks)."""
    if parallel is None or not _tp_active():
        return Linear(in_features, out_features, bias, dtype, device)
    from xlaserve.backends_torch.distributed import layers as tpl

    if parallel == "column":
        return tpl.ColumnParallelLinear(in_features, out_features, bias, dtype, device, replicas)
    if parallel == "row":
        return tpl.RowParallelLinear(in_features, out_features, bias, dtype, device)
    raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")


def make_merged_linear(
    in_features: int,
    parts: Sequence[tuple[str, int, int]],
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> MergedLinear:
    """A fused column layer: parts = (canonical name, full out_features, replicas) per member
    (replicas as in `make_linear`). With a TP group each rank holds its own shard of every member,
    concatenated (`MergedColumnParallelLinear`), so the local output splits the same way."""
    if not _tp_active():
        return MergedLinear(
            in_features, [p[0] for p in parts], [p[1] for p in parts], bias, dtype, device
        )
    from xlaserve.backends_torch.distributed.layers import MergedColumnParallelLinear

    return MergedColumnParallelLinear(in_features, parts, bias, dtype, device)


def make_vocab_embedding(
    num_embeddings: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Token embedding [V, H] (vocab-parallel with a TP group); has `as_lm_head` for tying."""
    if not _tp_active():
        return VocabEmbedding(num_embeddings, dim, dtype, device)
    from xlaserve.backends_torch.distributed.layers import VocabParallelEmbedding

    return VocabParallelEmbedding(num_embeddings, dim, dtype, device)


def make_lm_head(
    hidden: int,
    vocab: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    bias: bool = False,
) -> nn.Module:
    """Untied lm head: hidden [B, H] -> logits [B, V] (vocab-split and all-gathered with TP).
    bias: an lm_head.bias [V] (Phi, GPT-J; single device only)."""
    if not _tp_active():
        return Linear(hidden, vocab, bias, dtype, device)
    if bias:
        raise ValueError("an lm_head with a bias is not supported with tensor parallelism")
    from xlaserve.backends_torch.distributed.layers import ParallelLMHead

    return ParallelLMHead(vocab, hidden, dtype, device)


# ---- quantized linear (int8 / int4 weight-only, fp8 w8a8) ------------------------------------------
#
# Canonical tensors per layer X (see xlaserve/quantization/numpy_quant.py): X.qweight, X.scales,
# X.qzeros (int4), X.perm (GPTQ act-order), X.bias. Model files are unchanged: after a model is
# built, `quantize_linears` swaps its eligible `Linear`s for `QuantLinear`s, and
# `quantized_weight_stream` turns float checkpoint weights into the quantized tensors on the fly.


def _cutlass_int8(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor | None:
    """KernelConfig.int8_gemm = "cutlass": y = (x @ qweight^T) * scales by the CUTLASS mixed-input
    GEMM where it runs (M >= cw.MIN_M, bf16 x, an sm_90 GPU, the library built: the first call
    builds it), else None (the caller's Triton kernels)."""
    from xlaserve.kernels_cuda import cutlass_w8a16 as cw
    from xlaserve.kernels_cuda.quant_matmul import use_gemv

    if x.shape[0] < cw.MIN_M or use_gemv("int8", x.shape[0]):
        return None
    if not cw.available(x.device.index or 0):
        return None
    try:  # its operand checks run before any work (scales: QuantLinear's float32 param)
        return cw.w8a16_gemm(x.contiguous(), qweight, scales)
    except ValueError:  # a shape, dtype or alignment the kernel does not take
        return None


def fp8_supported(device: torch.device | str) -> bool:
    """torch._scaled_mm fp8 needs CUDA compute capability >= 8.9 (Ada, Hopper and later)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm")


def _quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token fp8: x [M, K] -> (xq float8_e4m3fn [M, K], scale float32 [M, 1])."""
    xs = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (x.float() / xs).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), xs


def fp8_linear_ref(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Reference/emulation of the fp8 path: x [M, K] quantized per token, w8 float8 [N, K] with
    per-channel w_scale [N]; fp32 math -> [M, N] x.dtype."""
    xq, xs = _quantize_rows_fp8(x)
    y = (xq.float() @ w8.float().t()) * xs * w_scale.float()[None, :]
    return y.to(x.dtype)


def fp8_linear_scaled_mm(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """CUDA cc >= 8.9: torch._scaled_mm with row-wise scales (x per token, w per channel)."""
    m = x.shape[0]
    xq, xs = _quantize_rows_fp8(x)
    pad = (-m) % 16  # cuBLASLt fp8 wants every dim a multiple of 16
    if pad:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)
        xs = torch.nn.functional.pad(xs, (0, 0, 0, pad), value=1.0)
    y = torch._scaled_mm(
        xq, w8.t(), scale_a=xs, scale_b=w_scale.float().view(1, -1), out_dtype=torch.bfloat16
    )
    return y[:m].to(x.dtype)


class QuantLinear(nn.Module):
    """Drop-in for `Linear` with quantized weights. x: [..., in] -> [..., out].

    int8 / int8_w8a8: qweight int8 [N, K], scales f32 [N]; int4: qweight uint8 [N, K/2], scales
    f32 [N, G], qzeros uint8 [N, G] (+ perm int32 [K] for GPTQ act-order); fp8: qweight uint8
    [N, K] holding float8_e4m3fn bits, scales f32 [N], or block-wise (scheme.weight_block =
    (bn, bk)) f32 [ceil(N / bn), ceil(K / bk)]. CPU: dequantize-on-the-fly matmul (fp8 and
    int8_w8a8: emulated, activations rounded per token as on the GPU).
    int8_w8a8 on CUDA: M == 1 takes the int8 weight-only GEMV (bandwidth-bound; x stays
    float), larger M per-token int8 activations and an int8 GEMM (kernels_cuda/scaled_mm.py,
    KernelConfig.int8_w8a8_gemm). Block-wise fp8: the Triton block-scaled GEMM at every M.
    CUDA: Triton dequant-matmul (int8/int4; a GEMV kernel for decode-sized M, see
    `quant_matmul.use_gemv`). fp8 (cc >= 8.9): M == 1 (decode) runs weight-only through the
    Triton fp8 GEMV (x not quantized: at least as accurate, and bandwidth- rather than
    launch-bound); larger M uses
    torch._scaled_mm with per-token activation quantization.
    A fused layer (`MergedLinear`) keeps its `part_names` / `part_sizes` when quantized.
    """

    part_names: tuple[str, ...] | None = None
    part_sizes: tuple[int, ...] | None = None
    kernels: KernelConfig | None = None  # the GEMV launch switches (model.use_kernels)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = scheme.method
        self.scheme = scheme
        n, k = out_features, in_features

        def param(shape: tuple[int, ...], dt: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)

        self.perm = None
        self.qzeros = None
        self.block = scheme.weight_block
        if self.method in ("int8", "int8_w8a8"):
            self.qweight = param((n, k), torch.int8)
            self.scales = param((n,), torch.float32)
        elif self.method == "int4":
            self.group = scheme.layer_group(k)
            if k % self.group or self.group % 2:
                raise ValueError(f"int4: in_features {k} and group {self.group} do not fit")
            self.qweight = param((n, k // 2), torch.uint8)
            self.scales = param((n, k // self.group), torch.float32)
            self.qzeros = param((n, k // self.group), torch.uint8)
            if scheme.act_order:
                self.perm = param((k,), torch.int32)
        elif self.method == "fp8":
            self.qweight = param((n, k), torch.uint8)
            if self.block is None:
                self.scales = param((n,), torch.float32)
            else:
                from xlaserve.kernels_cuda.scaled_mm import block_scale_shape

                self.scales = param(block_scale_shape(n, k, self.block), torch.float32)
        else:
            raise ValueError(f"unknown quantization method {self.method!r}")
        self.bias = param((n,), dtype) if bias else None

    @classmethod
    def from_float(cls, linear: Linear, scheme: QuantScheme) -> QuantLinear:
        """Quantize an initialised float `Linear` (dummy weights, tests)."""
        w = linear.weight
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme,
                w.dtype, w.device)  # fmt: skip
        with torch.no_grad():  # on the weight's device: no host round trip of every weight
            if scheme.weight_block is not None:
                tensors = quantize_fp8_block_torch(w.detach().float(), scheme.weight_block)
            else:
                tensors = quantize_weight_torch(
                    scheme.method, w.detach().float(), getattr(q, "group", 0)
                )
            for name, t in tensors.items():
                getattr(q, name).copy_(t)
            if linear.bias is not None:
                q.bias.copy_(linear.bias)
        return q

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] (in the input-channel order x is fed in after `perm`)."""
        from xlaserve.kernels_cuda.quant_matmul import dequant_int4_torch

        if self.method in ("int8", "int8_w8a8"):
            return (self.qweight.float() * self.scales[:, None]).to(dtype)
        if self.method == "int4":
            return dequant_int4_torch(self.qweight, self.scales, self.qzeros, dtype)
        if self.block is not None:
            from xlaserve.kernels_cuda.scaled_mm import dequant_w8

            return dequant_w8(self.qweight, self.scales, self.block).to(dtype)
        w = self.qweight.view(torch.float8_e4m3fn).float()
        return (w * self.scales[:, None]).to(dtype)

    def quant_act_fmt(self, x: torch.Tensor) -> str | None:
        """ "int8" / "fp8" when forward(x) (x [M, in]) would quantize x per token with the Triton
        `quant_rows` kernel and KernelConfig.fuse_act_quant is on: the producer of x may then
        hand a `QuantAct` of that format instead (same bits). None otherwise (CPU, the decode
        GEMV that keeps x float, act-order perm, act_quant="torch", fusion off)."""
        if not x.is_cuda or self.perm is not None or x.dim() != 2:
            return None
        if not kernel_switch("fuse_act_quant", self.kernels):
            return None
        if kernel_switch("act_quant", self.kernels) == "torch":
            return None
        from xlaserve.kernels_cuda import quant_matmul as qm

        if self.method == "int8_w8a8":
            return None if qm.use_gemv("int8", x.shape[0]) else "int8"
        if self.method == "fp8" and fp8_supported(x.device):
            if self.block is None and qm.use_gemv("fp8", x.shape[0]):
                return None
            return "fp8"
        return None

    def forward(self, x: torch.Tensor | QuantAct) -> torch.Tensor:
        if isinstance(x, QuantAct):  # pre-quantized by its producer (see quant_act_fmt)
            return self._forward_quant_act(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm.long())
        y = self._matmul(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _forward_quant_act(self, a: QuantAct) -> torch.Tensor:
        """x already quantized per token (a.q [M, in]): the w8a8 GEMM only -> [M, out]."""
        from xlaserve.kernels_cuda.scaled_mm import fp8_w8a8_matmul, int8_w8a8_matmul

        if a.q.shape[-1] != self.in_features:
            raise ValueError(f"QuantAct q {tuple(a.q.shape)} != [M, {self.in_features}]")
        if self.method == "int8_w8a8":
            y = int8_w8a8_matmul(a, self.qweight, self.scales, kernels=self.kernels)
        elif self.method == "fp8":
            w8 = self.qweight.view(torch.float8_e4m3fn)
            y = fp8_w8a8_matmul(a, w8, self.scales, block=self.block, kernels=self.kernels)
        else:
            raise ValueError(f"a QuantAct input needs a w8a8 layer, not method {self.method!r}")
        return y + self.bias if self.bias is not None else y

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        on_cuda = x.is_cuda
        if self.method == "int8":
            if on_cuda:
                from xlaserve.kernels_cuda.quant_matmul import int8_matmul

                cut = kernel_switch("int8_dequant_min_m", self.kernels)
                if 0 < cut <= x.shape[0]:  # A/B: dequantize, then cuBLAS
                    return F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
                if kernel_switch("int8_gemm", self.kernels) == "cutlass":
                    y = _cutlass_int8(x, self.qweight, self.scales)
                    if y is not None:
                        return y
                return int8_matmul(x.contiguous(), self.qweight, self.scales, kernels=self.kernels)
            return F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        if self.method == "int8_w8a8":
            if on_cuda:
                from xlaserve.kernels_cuda import quant_matmul as qm

                if qm.use_gemv("int8", x.shape[0]):  # decode: weight-only GEMV, x not rounded
                    return qm.int8_matmul(
                        x.contiguous(), self.qweight, self.scales, kernels=self.kernels
                    )
                from xlaserve.kernels_cuda.scaled_mm import int8_w8a8_matmul

                return int8_w8a8_matmul(
                    x.contiguous(), self.qweight, self.scales, kernels=self.kernels
                )
            from xlaserve.kernels_cuda.scaled_mm import w8a8_matmul_ref

            return w8a8_matmul_ref(x, self.qweight, self.scales, "int8")
        if self.method == "int4":
            from xlaserve.kernels_cuda import quant_matmul as qm

            if on_cuda and qm.int4_block_k(self.group) is not None:
                return qm.int4_matmul(
                    x.contiguous(), self.qweight, self.scales, self.qzeros, kernels=self.kernels
                )
            return F.linear(
                x, qm.dequant_int4_torch(self.qweight, self.scales, self.qzeros, x.dtype)
            )
        w8 = self.qweight.view(torch.float8_e4m3fn)
        if on_cuda and fp8_supported(x.device):
            from xlaserve.kernels_cuda import quant_matmul as qm
            from xlaserve.kernels_cuda.scaled_mm import fp8_w8a8_matmul

            if self.block is not None:
                return fp8_w8a8_matmul(
                    x.contiguous(), w8, self.scales, block=self.block, kernels=self.kernels
                )
            if qm.use_gemv("fp8", x.shape[0]):  # decode: weight-only, no per-token quant
                return qm.fp8_weight_matmul(
                    x.contiguous(), self.qweight, self.scales, kernels=self.kernels
                )
            # Per-token quantization by one Triton kernel, then _scaled_mm or the Triton GEMM.
            return fp8_w8a8_matmul(x.contiguous(), w8, self.scales, kernels=self.kernels)
        if self.block is not None:
            from xlaserve.kernels_cuda.scaled_mm import w8a8_matmul_ref

            return w8a8_matmul_ref(x, w8, self.scales, "fp8", block=self.block, math=torch.float32)
        return fp8_linear_ref(x, w8, self.scales)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.method}"


def quantize_weight_torch(method: str, w: torch.Tensor, group: int = 0) -> dict[str, torch.Tensor]:
    """`xlaserve.quantization.quantize_weight` in torch, on w's device, with the same rounding
    (round half to even) and the same canonical layouts: W [N, K] float32 -> {"qweight",
    "scales"[, "qzeros"]}; fp8 codes as their uint8 bits. group: the int4 group size."""
    if method in ("int8", "int8_w8a8", "fp8"):
        top = FP8_MAX if method == "fp8" else 127.0
        amax = w.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        x = w / s[:, None]
        if method != "fp8":
            q = torch.round(x).clamp_(-127, 127).to(torch.int8)
        else:
            q = x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return {"qweight": q, "scales": s}
    if method == "int4":
        n, k = w.shape
        wg = w.reshape(n, k // group, group)
        lo = wg.amin(dim=2).clamp(max=0.0)
        hi = wg.amax(dim=2).clamp(min=0.0)
        s = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
        z = torch.round(-lo / s).clamp_(0, 15)
        q = (torch.round(wg / s[:, :, None]) + z[:, :, None]).clamp_(0, 15).to(torch.uint8)
        qg = q.reshape(n, k // group, 2, group // 2)  # group half-split packing (numpy_quant)
        packed = (qg[:, :, 0, :] | (qg[:, :, 1, :] << 4)).reshape(n, k // 2)
        return {"qweight": packed, "scales": s, "qzeros": z.to(torch.uint8)}
    raise ValueError(f"unknown quantization method {method!r}")


def quantize_fp8_block_torch(w: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """W [N, K] float32 -> block-wise fp8 {"qweight" uint8 [N, K] (e4m3 bits), "scales" f32
    [ceil(N / bn), ceil(K / bk)]}: one scale amax / 448 per (bn, bk) block (ragged edge blocks
    included), as `hf_formats.quantize_fp8_block` writes."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    wp = F.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    amax = wp.abs().reshape(gn, bn, gk, bk).amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return {"qweight": q, "scales": s}


def torch_quant_scheme(
    config: object, spec: object, device: torch.device | str
) -> QuantScheme | None:
    """The scheme the torch backend serves `spec` with (config: EngineConfig), checked against the
    device: fp8 on a device without fp8 matmuls raises, unless the checkpoint is pre-quantized
    fp8 (then emulated, with a warning) or KernelConfig.fp8_emulation is on (tests)."""
    scheme = resolve_scheme(config.model.quantization, spec.model_dir, config.cache.kv_cache_dtype)
    return check_fp8_support(
        scheme,
        lambda: fp8_supported(device),
        f"this device: {torch.device(device)}",
        emulate=config.kernels.fp8_emulation,
    )


def quantize_linears(
    model: nn.Module, scheme: QuantScheme, from_weights: bool = False
) -> list[str]:
    """Swap every eligible `Linear` of `model` for a `QuantLinear` (in place); returns the swapped
    names. `from_weights`: quantize the Linear's current float weight (dummy init); otherwise
    the new parameters are left empty for `load_weights`."""
    swapped: list[str] = []
    for name, mod in list(model.named_modules()):
        if type(mod) not in (Linear, MergedLinear):
            continue
        # A fused layer is quantized when its members would be (decided on their names).
        parent = name.rpartition(".")[0]
        members = [f"{parent}.{p}" if parent else p for p in getattr(mod, "part_names", ())]
        skips = {scheme.skips(n) for n in members or [name]}
        if len(skips) > 1:
            raise ValueError(
                f"{name}: the quantization scheme keeps some of {members} float and quantizes "
                "others; build the model unfused (see layers.linear.can_fuse)"
            )
        if skips.pop():
            continue
        if scheme.method == "int4" and mod.in_features % 2:
            continue
        if from_weights:
            new = QuantLinear.from_float(mod, scheme)
        else:
            w = mod.weight
            new = QuantLinear(mod.in_features, mod.out_features, mod.bias is not None, scheme,
                              w.dtype, w.device)  # fmt: skip
        if isinstance(mod, MergedLinear):
            new.part_names, new.part_sizes = mod.part_names, mod.part_sizes
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        swapped.append(name)
    return swapped


def quantized_weight_stream(
    model: nn.Module, scheme: QuantScheme, weights: Iterable[tuple[str, np.ndarray]]
) -> Iterator[tuple[str, np.ndarray]]:
    """Canonical (name, array) pairs -> pairs `model.load_weights` accepts once its linears are
    `QuantLinear`s: float weights of those layers are quantized here (runtime schemes); fp8
    arrays become their uint8 bits. A member of a fused layer (e.g. q_proj of qkv_proj) is
    quantized on its own rows under its own name (every format is per output row)."""
    qlayers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    for member, slot in fused_members(model).items():
        if isinstance(slot.module, QuantLinear):
            qlayers[member] = slot.module
    for name, arr in weights:
        prefix, _, part = name.rpartition(".")
        layer = qlayers.get(prefix)
        if layer is None:
            yield name, arr
            continue
        if part == "weight":
            if scheme.prequantized:
                raise ValueError(
                    f"{prefix}: float weight in a {scheme.source} checkpoint where a quantized "
                    "layer was expected (is it listed in the checkpoint's ignore list?)"
                )
            for k, v in quantize_weight(scheme.method, arr, scheme.group_size).items():
                yield f"{prefix}.{k}", v.view(np.uint8) if v.dtype == FP8_E4M3 else v
        elif arr.dtype == FP8_E4M3:
            yield name, arr.view(np.uint8)
        else:
            yield name, arr
