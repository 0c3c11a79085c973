"""Paged attention behind a small backend interface.

The KV cache of one layer is a pair of tensors K, V: [N, S, Hkv, D] (N blocks of S tokens), or,
with a quantized cache (kv_cache_dtype "int8" / "fp8", see xlaserve.quantization.kv_quant), the
4-tuple (K codes, V codes, K scales, V scales): codes [N, S, Hkv, D] int8 / float8_e4m3fn, scales
[N, S, Hkv] float32 (one per token and KV head). Backends quantize on write and dequantize on
read when given the scales (k_scale / v_scale arguments). Token slot `s` lives at block `s // S`, offset `s % S`. A batch is ragged: request b owns query
rows `query_start_loc[b]:query_start_loc[b+1]`, and those queries are the LAST q_len tokens of its
`seq_lens[b]`-token context (so mixed prefill chunks and decodes share one call).

Backends are registered by name and imported lazily: "torch_ref" (plain torch ops, any device)
now; the Triton backend registers "triton" from kernels_cuda later.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from xlaserve.config import KernelConfig
from xlaserve.kernels_cuda.kv_quant import dequantize_kv, gather_context, quantize_kv


@dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch (same for every layer)."""

    # [B + 1] int32: prefix sums of query lengths (query rows of request b: [qsl[b], qsl[b+1])).
    query_start_loc: torch.Tensor
    # [B] int32: context length of each request INCLUDING this step's new tokens.
    seq_lens: torch.Tensor
    # [B, max_blocks] int32: block ids of each request (padded with 0).
    block_tables: torch.Tensor
    # [T] int64: cache slot (block * S + offset) of each new token; < 0 = padding, not written.
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies (python lists) so CPU-side loops need no device sync.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # Per-step values a backend derives once and reuses in every layer (e.g. gather indices).
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend:
    """The torch attention-backend contract: writes new K/V into the paged cache and attends over
    it; stateless between steps. Chosen by name (KernelConfig.attention_backend) through the
    registry below (`get_attention_backend`), never by a string test elsewhere.

    - Metadata hook `build_metadata`: the step's ragged-batch tensors -> this backend's metadata
      struct (`metadata_cls`: AttentionMetadata or a subclass with its launch knobs), built once
      per step by the runner and handed whole to every layer and to the kernels.
    - Graph-capture hook `graph_metadata` (backends with `cuda_graphs`): the metadata a decode
      CUDA graph is captured with, its launch knobs fixed at capture.
    - Kernels: `write_kv` and `forward`.
    - Capabilities: `cuda_graphs`, `triton_kernels` (below); `kernels` carries the launch
      switches (KernelConfig).
    """

    name: str = "base"
    # Kernel launch switches (KernelConfig.pdl, ...); set by `get_attention_backend`.
    kernels: KernelConfig | None = None
    # Capabilities (what the runner and the model ask, never the backend's name):
    # decode steps may be captured in CUDA graphs: forward reads the metadata's device tensors
    # only (no host sync, no host-dependent shapes), so a replay with new values is exact.
    cuda_graphs: bool = False
    # runs Triton kernels: the model's rotary and gated activation take Triton too (triton_ops
    # "auto"), and a float8 KV cache needs compute capability >= 8.9 for their fp8 loads.
    triton_kernels: bool = False
    # The metadata struct this backend's kernels read.
    metadata_cls: type[AttentionMetadata] = AttentionMetadata

    def build_metadata(
        self,
        *,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
        query_start_loc_host: list[int],
        seq_lens_host: list[int],
    ) -> AttentionMetadata:
        """Metadata hook: one step's batch (shapes as in AttentionMetadata; device tensors, host
        lists) -> this backend's metadata struct."""
        return self.metadata_cls(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc_host=query_start_loc_host,
            seq_lens_host=seq_lens_host,
        )

    def graph_metadata(self, md: AttentionMetadata, num_kv_splits: int) -> AttentionMetadata:
        """Graph-capture hook: `md` (over a decode graph's static buffers) with the launch knobs
        the graph fixes at capture (num_kv_splits: the split-KV factor of its bucket)."""
        raise NotImplementedError(
            f"attention backend {self.name!r} cannot be captured in CUDA graphs (cuda_graphs=False)"
        )

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
        """k, v: [T, Hkv, D] -> caches [N, S, Hkv, D] at slot_mapping [T] (negative slots skipped).
        With k_scale / v_scale [N, S, Hkv] float32 the caches hold int8 / fp8 codes: each
        (token, head) vector is quantized on write and its scale stored at the same slot."""
        raise NotImplementedError

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
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> out [T, Hq, D] (causal over each request's cached context).
        k_scale / v_scale [N, S, Hkv]: the caches hold codes, dequantized on read."""
        raise NotImplementedError


class TorchRefAttention(AttentionBackend):
    """Reference backend from plain torch ops: per request, gather its blocks and run masked
    attention in float32. Exact enough for parity tests; any device. Takes ALiBi slopes
    (`alibi_slopes` [Hq] float32: logits += slope * key position)."""

    name = "torch_ref"
    supports_alibi = True
    supports_sinks = True  # `sinks` [Hq] float32: one more logit in each softmax (gpt-oss)
    supports_chunked = True  # `chunk_size` C: keys k <= q with k // C == q // C (Llama 4)

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
        n, s, hkv, d = k_cache.shape
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
        if k_scale is None:
            k_cache.view(n * s, hkv, d)[slot_mapping] = k.to(k_cache.dtype)
            v_cache.view(n * s, hkv, d)[slot_mapping] = v.to(v_cache.dtype)
            return
        for x, codes, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            xq, xs = quantize_kv(x, codes.dtype)
            codes.view(n * s, hkv, d)[slot_mapping] = xq
            scales.view(n * s, hkv)[slot_mapping] = xs

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
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        hkv = k_cache.shape[2]
        hq = q.shape[1]
        group = hq // hkv
        out = torch.empty_like(q)
        qsl = md.query_start_loc_host
        for b, kv_len in enumerate(md.seq_lens_host):
            q0, q1 = qsl[b], qsl[b + 1]
            q_len = q1 - q0
            if q_len == 0:
                continue
            # k, v: [kv_len, Hkv, D] float32 (a quantized cache: codes * per-(token, head)
            # scale) -> [Hq, kv_len, D] (GQA: query head h reads kv head h // group)
            k = gather_context(k_cache, k_scale, md.block_tables[b], kv_len, torch.float32)
            v = gather_context(v_cache, v_scale, md.block_tables[b], kv_len, torch.float32)
            k = k.transpose(0, 1).repeat_interleave(group, dim=0)
            v = v.transpose(0, 1).repeat_interleave(group, dim=0)
            qb = q[q0:q1].float().transpose(0, 1)  # [Hq, q_len, D]
            scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hq, q_len, kv_len]
            if logit_softcap:
                scores = torch.tanh(scores / logit_softcap) * logit_softcap
            qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            kpos = torch.arange(kv_len, device=q.device)[None, :]
            if alibi_slopes is not None:
                scores = scores + alibi_slopes[:, None, None] * kpos.float()
            allowed = kpos <= qpos
            if sliding_window is not None:
                # Same convention as HF: a query sees itself and the previous window - 1 tokens.
                allowed = allowed & (kpos > qpos - sliding_window)
            if chunk_size is not None:  # Llama 4: only keys of the query's own chunk
                allowed = allowed & (kpos // chunk_size == qpos // chunk_size)
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:  # the sink's column takes mass in the softmax, then drops
                sink = sinks.float()[:, None, None].expand(hq, q_len, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            out[q0:q1] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
        return out


class TorchBatchedAttention(TorchRefAttention):
    """The CPU default: one padded, batched attention over all requests of the step instead of a
    Python loop per request. Requests are padded to [B, max_q] queries and [B, max_kv] keys
    gathered from the paged cache; a mask removes padding, the future and out-of-window keys.
    Float32 math like the reference (same results up to summation order)."""

    name = "torch_batched"

    @staticmethod
    def _layout(
        md: AttentionMetadata, block_size: int, num_tokens: int, device: torch.device
    ) -> dict:
        key = ("batched", block_size)
        if key in md.derived:
            return md.derived[key]
        qsl, seq = md.query_start_loc_host, md.seq_lens_host
        nb = len(seq)
        q_lens = [qsl[b + 1] - qsl[b] for b in range(nb)]
        max_q, max_kv = max(q_lens), max(seq)
        # q_index[b, i] = flat query row of request b's i-th query (num_tokens = a zero pad row).
        # Rows are laid out request after request, so the valid cells in row-major order are
        # the rows qsl[0] .. qsl[B] - 1 (one assignment, no per-request loop).
        q_index = torch.full((nb, max_q), num_tokens, dtype=torch.long)
        ql = torch.tensor(q_lens)
        q_index[torch.arange(max_q)[None, :] < ql[:, None]] = torch.arange(qsl[0], qsl[nb])
        nblk = math.ceil(max_kv / block_size)
        blocks = md.block_tables[:, :nblk].long().cpu()
        slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).reshape(nb, -1)[
            :, :max_kv
        ]
        seq_t = torch.tensor(seq)[:, None, None]
        ql_t = ql[:, None, None]
        qpos = seq_t - ql_t + torch.arange(max_q)[None, :, None]  # [B, Mq, 1] absolute positions
        kpos = torch.arange(max_kv)[None, None, :]  # [1, 1, Mkv]
        valid_q = q_index < num_tokens
        causal = (kpos <= qpos) & valid_q[:, :, None]
        out = dict(
            q_index=q_index.to(device),
            slots=slots.to(device),
            qpos=qpos.to(device),
            kpos=kpos.to(device),
            causal=causal.to(device),
            rows=valid_q.nonzero(as_tuple=True),
            flat_rows=q_index[valid_q].to(device),
        )
        md.derived[key] = out
        return out

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
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        n, block_size, hkv, d = k_cache.shape
        t, hq, _ = q.shape
        group = hq // hkv
        lay = self._layout(md, block_size, t, q.device)
        b, mq = lay["q_index"].shape
        # q: [T + 1, Hq, D] (zero pad row) -> [B, Hkv, G * Mq, D]; k/v: [B, Hkv, Mkv, D]
        qp = torch.cat([q.float(), q.new_zeros(1, hq, d, dtype=torch.float32)])[lay["q_index"]]
        qp = qp.view(b, mq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * mq, d)
        k = k_cache.view(n * block_size, hkv, d)[lay["slots"]].float()
        v = v_cache.view(n * block_size, hkv, d)[lay["slots"]].float()
        if k_scale is not None:  # quantized cache: codes * per-(token, head) scale
            k = dequantize_kv(k, k_scale.view(n * block_size, hkv)[lay["slots"]])
            v = dequantize_kv(v, v_scale.view(n * block_size, hkv)[lay["slots"]])
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        allowed = lay["causal"]
        if sliding_window is not None:
            allowed = allowed & (lay["kpos"] > lay["qpos"] - sliding_window)
        if chunk_size is not None:  # Llama 4: only keys of the query's own chunk
            allowed = allowed & (lay["kpos"] // chunk_size == lay["qpos"] // chunk_size)
        mask = (
            allowed[:, None, None, :, :].expand(b, 1, group, mq, -1).reshape(b, 1, group * mq, -1)
        )
        # Padding query rows are fully masked: they come out NaN or garbage and are dropped below.
        if logit_softcap or alibi_slopes is not None or sinks is not None:
            scores = torch.matmul(qp, k.transpose(2, 3)) * scale  # [B, Hkv, G * Mq, Mkv]
            if logit_softcap:
                scores = torch.tanh(scores / logit_softcap) * logit_softcap
            if alibi_slopes is not None:  # per query head (rows h = kv * G + g), key position
                sl = alibi_slopes.view(1, hkv, group, 1, 1).expand(1, hkv, group, mq, 1)
                kp = lay["kpos"].float()[:, None, None, :, :]  # [1, 1, 1, 1, Mkv]
                scores = scores + (sl * kp).reshape(1, hkv, group * mq, -1)
            scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is not None:  # [Hq] -> one extra column per query row, dropped after
                sink = sinks.float().view(1, hkv, group, 1, 1).expand(b, hkv, group, mq, 1)
                scores = torch.cat([scores, sink.reshape(b, hkv, group * mq, 1)], dim=-1)
                probs = torch.softmax(scores, dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs, v)  # [B, Hkv, G * Mq, D]
        else:  # the fused kernel: no [.., Mq, Mkv] score tensor kept around
            o = torch.nn.functional.scaled_dot_product_attention(
                qp, k, v, attn_mask=mask, scale=scale
            )
        o = o.view(b, hkv, group, mq, d).permute(0, 3, 1, 2, 4).reshape(b, mq, hq, d)
        out = torch.zeros_like(q)
        out[lay["flat_rows"]] = o[lay["rows"]].to(q.dtype)
        return out


# name -> "module:Class", imported on first use.
_BACKENDS: dict[str, str] = {
    "torch_ref": "xlaserve.backends_torch.layers.attention:TorchRefAttention",
    "torch_batched": "xlaserve.backends_torch.layers.attention:TorchBatchedAttention",
    # kernels_cuda.unified_attention + write_kv; the default on CUDA (runner.py).
    "triton": "xlaserve.backends_torch.attention_triton:TritonAttention",
}


def register_attention_backend(name: str, target: str) -> None:
    """Register an attention backend as "package.module:ClassName" (imported lazily)."""
    _BACKENDS[name] = target


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


# Backends that read and write the quantized cache (kv_cache_dtype "int8" / "fp8").
QUANT_KV_BACKENDS = ("torch_ref", "torch_batched", "triton")


def check_kv_cache_dtype(
    kv_cache_dtype: str,
    backend_name: str,
    device: torch.device,
    backend: AttentionBackend | None = None,
) -> torch.dtype | None:
    """The cache code dtype for `kv_cache_dtype` (None for "auto"); a clear ValueError at start-up
    for combinations that are not implemented (rather than wrong results later). backend: the
    instance registered as `backend_name` (None: made here), for its capabilities."""
    from xlaserve.kernels_cuda.kv_quant import kv_code_dtype

    code = kv_code_dtype(kv_cache_dtype)
    if code is None:
        return None
    if backend_name not in QUANT_KV_BACKENDS:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported by attention backend "
            f"{backend_name!r} (supported: {', '.join(QUANT_KV_BACKENDS)})"
        )
    if (
        code == torch.float8_e4m3fn
        and device.type == "cuda"
        and (backend or get_attention_backend(backend_name)).triton_kernels
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ValueError(
            "kv_cache_dtype='fp8' needs an NVIDIA GPU with compute capability >= 8.9 for the "
            "Triton kernels' float8_e4m3fn loads/stores; use kv_cache_dtype='int8'"
        )
    return code


def get_attention_backend(name: str, kernels: KernelConfig | None = None) -> AttentionBackend:
    """A new backend of the registered `name`, launching its kernels by `kernels` (None: the
    KernelConfig defaults and their environment overrides, read at launch)."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {', '.join(available_attention_backends())}"
        )
    module, _, cls = _BACKENDS[name].partition(":")
    backend = getattr(importlib.import_module(module), cls)()
    backend.kernels = kernels
    return backend


class Attention(nn.Module):
    """One layer's attention core: writes this step's K/V to the layer's cache, then attends.

    q [T, Hq, D], k/v [T, Hkv, D] (already rotated/normed) -> [T, Hq * D]. `kv_written=True`
    says a fused kernel (rope + KV write) has already put this step's K/V into the cache at
    md.slot_mapping; the write is skipped and k / v may be None.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if chunk_size is not None and not getattr(backend, "supports_chunked", False):
            raise ValueError(
                f"chunked attention (Llama 4) needs an attention backend that implements it "
                f"(torch_ref, torch_batched, triton); "
                f"{getattr(backend, 'name', type(backend).__name__)!r} does not"
            )
        # Chunked attention (Llama 4): keys of the query's own chunk only (positions // C).
        self.chunk_size = chunk_size
        if alibi_slopes is not None and not getattr(backend, "supports_alibi", False):
            raise ValueError(
                f"ALiBi (Bloom, MPT) needs an attention backend that implements it (torch_ref, "
                f"torch_batched); {getattr(backend, 'name', type(backend).__name__)!r} does not"
            )
        self.alibi_slopes = alibi_slopes  # float32 [Hq] or None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    def _alibi(self) -> dict[str, torch.Tensor]:
        """The backend kwargs only when set (ALiBi slopes, attention chunk): backends without
        them keep their signature."""
        extra: dict = {} if self.alibi_slopes is None else {"alibi_slopes": self.alibi_slopes}
        if self.chunk_size is not None:
            extra["chunk_size"] = self.chunk_size
        return extra

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, ...],
        md: AttentionMetadata,
        kv_written: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """kv_cache: (k, v) or, quantized, (k codes, v codes, k scales, v scales).
        kv_written: K/V of this step are already in the cache (see the class doc).
        sinks: attention-sink logits [Hq] (gpt-oss), for backends with `supports_sinks`."""
        extra = self._alibi()
        if sinks is not None:
            if not getattr(self.backend, "supports_sinks", False):
                raise ValueError(
                    "attention sinks (gpt-oss) need an attention backend that implements them "
                    f"(torch_ref, torch_batched); {getattr(self.backend, 'name', '?')!r} does not"
                )
            extra["sinks"] = sinks
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if not kv_written and (k is None or v is None):
            raise ValueError("Attention: k and v are needed unless kv_written")
        if len(kv_cache) == 4:
            ks, vs = kv_cache[2], kv_cache[3]
            if not kv_written:
                self.backend.write_kv(
                    k, v, k_cache, v_cache, md.slot_mapping, k_scale=ks, v_scale=vs
                )
            out = self.backend.forward(
                q, k_cache, v_cache, md, self.scale, self.sliding_window, self.logit_softcap,
                k_scale=ks, v_scale=vs, **extra,
            )  # fmt: skip
        else:
            if not kv_written:
                self.backend.write_kv(k, v, k_cache, v_cache, md.slot_mapping)
            out = self.backend.forward(
                q, k_cache, v_cache, md, self.scale, self.sliding_window, self.logit_softcap,
                **extra,
            )  # fmt: skip
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
