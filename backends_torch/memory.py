"""The torch backend's memory: the model dtype, the paged KV cache (allocation, bytes per block)
and how many blocks fit on the GPU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from xlaserve.backends_torch.distributed.parallel_state import kv_heads_per_rank, tp_world_size
from xlaserve.model_loader.spec import ModelSpec

if TYPE_CHECKING:
    from xlaserve.backends_torch.runner import TorchModelRunner


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str) -> torch.dtype:
    """ "auto" -> the checkpoint dtype, except float16 on CPU -> float32 (slow/unsupported there)."""
    name = checkpoint_dtype.replace("torch.", "") if requested == "auto" else requested
    dtype = _DTYPES.get(name, torch.float32)
    if device == "cpu" and dtype == torch.float16:
        dtype = torch.float32
    return dtype


def alloc_kv_caches(
    num_blocks: int,
    block_size: int,
    spec: ModelSpec,
    dtype: torch.dtype,
    code_dtype: torch.dtype | None,
    device: torch.device,
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (K, V) [N, S, Hkv, D] in `dtype`, or with code_dtype (quantized cache) (K codes,
    V codes, K scales, V scales [N, S, Hkv] float32). Hkv of this rank: tensor parallelism splits
    the KV heads."""
    shape = (num_blocks, block_size, kv_heads_per_rank(spec.num_kv_heads), spec.head_dim)
    if code_dtype is not None:  # codes + float32 scales [N, S, Hkv]
        return [
            (
                torch.zeros(shape, dtype=code_dtype, device=device),
                torch.zeros(shape, dtype=code_dtype, device=device),
                torch.ones(shape[:3], dtype=torch.float32, device=device),
                torch.ones(shape[:3], dtype=torch.float32, device=device),
            )
            for _ in range(spec.num_layers)
        ]
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(spec.num_layers)
    ]


def kv_bytes_per_block(runner: TorchModelRunner) -> int:
    """Bytes of one block id: the target's KV plus, with a draft model, the draft's KV."""
    elem = runner.dtype.itemsize

    def rank_bytes(spec: ModelSpec) -> int:  # this rank's KV heads only (tensor parallel)
        h = spec.num_kv_heads
        return spec.kv_bytes_per_token(elem, runner.kv_cache_dtype) * kv_heads_per_rank(h) // h

    per_token = rank_bytes(runner.spec)
    if runner.draft_spec is not None:
        per_token += rank_bytes(runner.draft_spec)
    extra = (
        0 if runner.eagle is None else runner.eagle.bytes_per_block(rank_bytes(runner.eagle.spec))
    )
    return runner.block_size * per_token + extra


def _nbytes(caches: torch.Tensor | tuple | list) -> int:
    """Bytes of a (nested: Falcon-H1's ((K, V), (conv, ssm)) layers) cache structure."""
    if isinstance(caches, torch.Tensor):
        return caches.numel() * caches.element_size()
    return sum(_nbytes(c) for c in caches)


def sdpa_reserve(runner: TorchModelRunner) -> int:
    """Bytes the long-prefill SDPA path (KernelConfig.prefill_sdpa) may allocate at run time
    beyond what the profiling forward saw (kernels_cuda.prefill_sdpa.transient_bytes): 0 when
    the path is off for this runner, or when no step can hold a chunk long enough for it."""
    from xlaserve.backends_torch.attention_triton import prefill_sdpa_on
    from xlaserve.config import kernel_switch

    if runner.attn_backend_name != "triton" or not prefill_sdpa_on(runner.kernels, runner.device):
        return 0
    max_chunk = runner.config.scheduler.max_num_batched_tokens
    if max_chunk < kernel_switch("prefill_sdpa_min_tokens", runner.kernels):
        return 0
    from xlaserve.kernels_cuda.prefill_sdpa import split_supported, transient_bytes

    spec, elem = runner.spec, runner.dtype.itemsize
    hkv = kv_heads_per_rank(spec.num_kv_heads)
    hq = max(1, spec.num_heads // tp_world_size())  # this rank's query heads
    return transient_bytes(
        max_chunk, runner.max_model_len, hq, hkv, spec.head_dim, elem,
        runner.kv_code_dtype is not None,
        split_supported(runner.device, runner.dtype, spec.head_dim),
    )  # fmt: skip


def profile_cuda_blocks(runner: TorchModelRunner, per_block: int) -> int:
    """Blocks that fit in total * gpu_memory_utilization after weights and a peak forward."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    tokens = min(
        runner.config.scheduler.max_num_batched_tokens, runner.spec.max_position_embeddings
    )
    nblk = math.ceil(tokens / runner.block_size)
    caches = runner._alloc_caches(nblk)
    runner._dummy_forward(tokens, caches)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - _nbytes(caches) + sdpa_reserve(runner)
    del caches
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    others = total - free - torch.cuda.memory_reserved()  # other processes / CUDA context
    budget = total * runner.config.cache.gpu_memory_utilization - others - peak
    if budget < per_block:
        gib = 1 << 30
        raise RuntimeError(
            f"the model does not fit: weights + a peak forward of {tokens} tokens take "
            f"{peak / gib:.2f} GiB, other users/context {others / gib:.2f} GiB, of "
            f"{total / gib:.2f} GiB x gpu_memory_utilization "
            f"{runner.config.cache.gpu_memory_utilization}; nothing is left for the KV cache "
            f"({per_block} bytes per block). Raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or use a smaller model / dtype."
        )
    return int(budget // per_block)
