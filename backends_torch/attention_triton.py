"""The "triton" attention backend: kernels_cuda.write_kv + kernels_cuda.unified_attention.

One launch per layer for the whole ragged batch (prefill chunks and decodes mixed), no
device->host sync inside: the metadata (device tensors + host ints) is built once per step by the
runner, so a decode step can be captured in a CUDA graph. `TritonAttentionMetadata` adds the
split-KV factor a graph must fix at capture time (None = the kernel's own heuristic). With
KernelConfig.prefill_sdpa on, long prefill chunks attend through torch SDPA instead and the
rest of the step is one launch of its own (kernels_cuda/prefill_sdpa.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from xlaserve.backends_torch.layers.attention import AttentionBackend, AttentionMetadata
from xlaserve.config import KernelConfig, kernel_switch

if TYPE_CHECKING:
    from xlaserve.kernels_cuda.prefill_sdpa import SdpaSplit


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """AttentionMetadata + launch knobs of the Triton kernel (same for every layer of a step)."""

    # Split-KV factor (power of 2 <= 64); fixed per captured CUDA graph, None = kernel heuristic.
    num_kv_splits: int | None = None


def prefill_sdpa_on(kernels: KernelConfig | None, device: torch.device) -> bool:
    """KernelConfig.prefill_sdpa for a device: "on", or "auto" on CUDA."""
    mode = kernel_switch("prefill_sdpa", kernels)
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class TritonAttention(AttentionBackend):
    """Paged attention through the Triton kernels (CUDA tensors, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    supports_chunked = True  # chunk_size: Llama 4 chunked attention, in the kernel's mask
    cuda_graphs = True  # metadata from device tensors only; split-KV fixed per captured graph
    triton_kernels = True
    metadata_cls = TritonAttentionMetadata

    def __init__(self) -> None:
        from xlaserve.kernels_cuda import write_kv
        from xlaserve.kernels_cuda.paged_attention import paged_attention
        from xlaserve.kernels_cuda.prefill_sdpa import plan_sdpa_split, sdpa_prefill

        self._write_kv = write_kv
        self._attend = paged_attention
        self._sdpa = sdpa_prefill
        self._plan_sdpa = plan_sdpa_split

    def graph_metadata(self, md: AttentionMetadata, num_kv_splits: int) -> AttentionMetadata:
        """`md` with the split-KV factor a captured decode graph replays with."""
        return replace(md, num_kv_splits=num_kv_splits, derived={})

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """k, v: [T, Hkv, D] -> caches [N, S, Hkv, D] at slot_mapping [T] (negative slots skipped);
        with k_scale / v_scale [N, S, Hkv] the kernel quantizes each (token, head) vector."""
        if slot_mapping.dtype != torch.int32:  # the runner builds int32 already; others may not
            slot_mapping = slot_mapping.to(torch.int32)
        self._write_kv(
            k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale,
            kernels=self.kernels,
        )  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> out [T, Hq, D]; rows past query_start_loc[B] (padding) are zeros.
        chunk_size: chunked attention (Llama 4), keys of the query's own chunk only.
        Long prefill chunks take torch SDPA when KernelConfig.prefill_sdpa is on (`_sdpa_split`)."""
        split = None
        if sliding_window is None and logit_softcap is None and chunk_size is None:
            split = self._sdpa_split(md, q.device)
        if split is None:
            return self._attend(
                q, k_cache, v_cache, md, scale,
                sliding_window=sliding_window, soft_cap=logit_softcap, chunk_size=chunk_size,
                k_scale=k_scale, v_scale=v_scale, kernels=self.kernels,
            )  # fmt: skip
        out = torch.empty_like(q)
        rest = split.rest
        if rest is not None:
            rest_out = self._attend(
                q.index_select(0, rest.rows), k_cache, v_cache, rest, scale,
                k_scale=k_scale, v_scale=v_scale, kernels=self.kernels,
            )  # fmt: skip
            out.index_copy_(0, rest.rows, rest_out)
        self._sdpa(q, k_cache, v_cache, md.block_tables, split.long, scale, out, k_scale, v_scale)
        if split.num_tokens < q.shape[0]:
            out[split.num_tokens :].zero_()
        return out

    def _sdpa_split(self, md: AttentionMetadata, device: torch.device) -> SdpaSplit | None:
        """The step's SDPA / Triton split (kernels_cuda.prefill_sdpa), built once per step and
        kept in md.derived for the other layers; None when the switch is off or no sequence has
        prefill_sdpa_min_tokens queries (the whole step is one Triton launch)."""
        if not prefill_sdpa_on(self.kernels, device):
            return None
        min_tokens = kernel_switch("prefill_sdpa_min_tokens", self.kernels)
        if md.max_query_len < min_tokens:
            return None
        key = ("prefill_sdpa", min_tokens)
        if key not in md.derived:
            md.derived[key] = self._plan_sdpa(md, min_tokens)
        return md.derived[key]
