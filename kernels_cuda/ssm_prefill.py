"""Prefill kernels of state-space layers (Mamba, Mamba2), Triton, with torch references (issue 25).

One request's T prompt tokens at a time, carrying the recurrent state in and out so that chunked
prefill (two calls over consecutive token ranges) equals one call over all of them:

- `causal_conv1d_prefill`: x [T, C], weight [C, K], bias [C] | None, state [C, K-1] (the last
  K-1 conv INPUTS, oldest first) -> (y [T, C] float32 before the activation, new state
  [C, K-1] float32). y[t] = sum_k w[:, k] * u[t - K + 1 + k] + bias where u is (state, x); the
  new state is the last K-1 entries of u (so partly the old state when T < K-1). Grid:
  (C blocks, T blocks); the first T block also writes the new state.
- `ssd_chunked_prefill`: Mamba2 SSD. x [T, Hs, P], dt [T, Hs] (already softplus'ed), A [Hs]
  (one scalar per head), B / C [T, G, N] (head h reads group h // (Hs / G)), D [Hs] | None,
  h0 [Hs, P, N] -> (y [T, Hs, P] float32, h_T [Hs, P, N] float32), with
  h_t = exp(dt_t A) h_{t-1} + dt_t x_t (x) B_t, y_t = h_t . C_t + D x_t. Grid: (Hs, P blocks);
  each program walks the chunks of CHUNK tokens in order: inside a chunk the output is the
  decay-masked (C B^T) matrix times dt x, plus the carried state's contribution; h is carried in
  registers to the next chunk. All math in float32; the dots at input_precision=DOT_PREC
  ("tf32x3" by default: tensor cores at ~fp32 accuracy).

Both are a plain, correct design (not tuned): tuning needs the GPU. The references are the model's
own ops (backends_torch/layers/ssm_ops.py), adapted to these argument shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, interpret_mode, next_pow2


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, ns_ptr, cu_ptr, slot_ptr, keep_ptr,
    C, stride_xt,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    cb = tl.program_id(0)
    seq = tl.program_id(1)
    # int64 token indices: T x row stride can pass 2^31 on long prompts.
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    sbase = s_ptr + tl.load(slot_ptr + seq).to(tl.int64) * C * (K - 1)
    # keep 0: a fresh request starts from zeros (tl.where, not a product: a stale NaN in its
    # slot never leaks in).
    carried = tl.load(keep_ptr + seq) != 0
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < end
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(K):
            j = t - start - (K - 1) + k  # index in the request; < 0 reads its state at K-1+j
            xin = tl.load(
                x_ptr + (start + j)[:, None] * stride_xt + c[None, :],
                mask=(tm & (j >= 0))[:, None] & cm[None, :],
                other=0.0,
            ).to(tl.float32)
            sin = tl.load(
                sbase + c[None, :] * (K - 1) + (K - 1 + j)[:, None],
                mask=(tm & (j < 0))[:, None] & cm[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)
            acc += (xin + tl.where(carried, sin, 0.0)) * w[None, :]
        tl.store(y_ptr + t[:, None] * C + c[None, :], acc, mask=tm[:, None] & cm[None, :])
    # New state (its own buffer: the old one is still being read): the last K-1 inputs of
    # (state, x). Own names: real Triton types a name once per scope; the interpreter does not
    # check this.
    for kk in tl.static_range(K - 1):
        jl = end - start - (K - 1) + kk + tl.zeros((BLOCK_C,), dtype=tl.int64)  # vector masks
        xlast = tl.load(x_ptr + (start + jl) * stride_xt + c, mask=cm & (jl >= 0), other=0.0)
        slast = tl.load(sbase + c * (K - 1) + (K - 1 + jl), mask=cm & (jl < 0), other=0.0)
        tl.store(
            ns_ptr + seq * C * (K - 1) + c * (K - 1) + kk,
            xlast.to(tl.float32) + tl.where(carried, slast.to(tl.float32), 0.0),
            mask=cm,
        )


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request of a step in one launch: x [T, C] (request i owns tokens [cu[i], cu[i+1])),
    weight [C, K], bias [C] | None, states [S, C, K-1] (the layer's slot cache, read only),
    cu_seqlens int32 [N+1], slots [N] (request i's slot), keep [N] float32 (0: a fresh request,
    zero state) -> (y [T, C] float32 before the activation, new states [N, C, K-1] float32 in
    request order: the caller writes them to their slots). Grid: (C blocks, requests); each
    program walks its request's tokens in blocks."""
    check_device("causal_conv1d_varlen", x, weight, states, cu_seqlens, slots, keep)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"causal_conv1d_varlen: x [T, C], weight [C, K]; got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}"
        )
    t, c = x.shape
    k = weight.shape[1]
    n = slots.shape[0]
    if k < 2 or states.dim() != 3 or tuple(states.shape[1:]) != (c, k - 1):
        raise ValueError(
            f"causal_conv1d_varlen: K >= 2 and states [S, C, K-1] with C={c}, K-1={k - 1}; "
            f"got K={k}, states {tuple(states.shape)}"
        )
    if tuple(cu_seqlens.shape) != (n + 1,) or tuple(keep.shape) != (n,):
        raise ValueError("causal_conv1d_varlen: cu_seqlens [N+1], slots [N], keep [N]")
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"causal_conv1d_varlen: bias [C]; got {tuple(bias.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    w, st = weight.contiguous(), states.contiguous()
    y = torch.empty((t, c), dtype=torch.float32, device=x.device)
    new_states = torch.empty((n, c, k - 1), dtype=torch.float32, device=x.device)
    block_c = min(next_pow2(c), 64)
    block_t = 32
    _conv_prefill_kernel[(triton.cdiv(c, block_c), n)](
        x, w, bias if bias is not None else w, st, y, new_states,
        cu_seqlens.to(torch.int32).contiguous(), slots.contiguous(), keep.float().contiguous(),
        c, x.stride(0),
        K=k, HAS_BIAS=bias is not None, BLOCK_C=block_c, BLOCK_T=block_t,
    )  # fmt: skip
    return y, new_states


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], weight [C, K], bias [C] | None, state [C, K-1] -> (y [T, C] float32 before the
    activation, new state [C, K-1] float32). Same contract as ssm_ops.causal_conv1d: one request
    through `causal_conv1d_varlen`."""
    if x.dim() != 2 or state.dim() != 2:
        raise ValueError(
            f"causal_conv1d_prefill: x [T, C], state [C, K-1]; got {tuple(x.shape)}, "
            f"{tuple(state.shape)}"
        )
    dev = x.device
    cu = torch.tensor([0, x.shape[0]], dtype=torch.int32, device=dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    y, new = causal_conv1d_varlen(
        x, weight, bias, state[None], cu, torch.zeros(1, dtype=torch.long, device=dev), one
    )
    return y, new[0]


def causal_conv1d_prefill_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `causal_conv1d_prefill` (the model's op)."""
    from xlaserve.backends_torch.layers.ssm_ops import causal_conv1d

    return causal_conv1d(x, weight, bias, state)


DOT_PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16")


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with float32 accumulation; PREC "bf16" rounds both operands to bfloat16 first (as
    mamba_ssm's kernels, whose operands are the model's bf16 activations), else tl.dot's
    input_precision."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_emulated":  # the interpreter's bf16 dot is wrong: round, then fp32
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _ssd_prefill_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, h0_ptr, y_ptr, h_ptr, cu_ptr, slot_ptr, keep_ptr,
    Hs, P, N, G, stride_xt, stride_bt,
    HAS_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    hd = tl.program_id(0)
    pb = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    # keep 0: a fresh request starts from zeros (tl.where: a stale NaN in its slot stays out).
    carried = tl.load(keep_ptr + seq) != 0
    state_size = Hs * P * N
    h0_base = h0_ptr + tl.load(slot_ptr + seq).to(tl.int64) * state_size
    g = hd // (Hs // G)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    li = tl.arange(0, CHUNK)
    pm, nm = p < P, n < N
    hmask = pm[:, None] & nm[None, :]
    hoff = hd * P * N + p[:, None] * N + n[None, :]
    h = tl.load(h0_base + hoff, mask=hmask, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    h = tl.where(carried, h, 0.0)
    a = tl.load(a_ptr + hd).to(tl.float32)
    if HAS_D:
        dd = tl.load(d_ptr + hd).to(tl.float32)
    causal = li[:, None] >= li[None, :]
    for s in range(start, end, CHUNK):
        t = s + li  # int64: T x Hs x P can pass 2^31 on long prompts
        tm = t < end
        # dt = 0 past the end: no decay, nothing added, so la[-1] is the last real step's.
        dt = tl.load(dt_ptr + t * Hs + hd, mask=tm, other=0.0).to(tl.float32)  # [L]
        xc = tl.load(
            x_ptr + t[:, None] * stride_xt + hd * P + p[None, :],
            mask=tm[:, None] & pm[None, :],
            other=0.0,
        ).to(tl.float32)  # [L, BLOCK_P]
        bcoff = t[:, None] * stride_bt + g * N + n[None, :]
        bcm = tm[:, None] & nm[None, :]
        bc = tl.load(b_ptr + bcoff, mask=bcm, other=0.0).to(tl.float32)  # [L, BLOCK_N]
        cc = tl.load(c_ptr + bcoff, mask=bcm, other=0.0).to(tl.float32)
        la = tl.cumsum(dt * a, axis=0)  # [L] log decay from the chunk start (inclusive)
        la_end = tl.sum(tl.where(li == CHUNK - 1, la, 0.0), axis=0)
        # decay[i, j] = exp(la_i - la_j) for j <= i: the factor from step j to step i.
        diff = tl.where(causal, la[:, None] - la[None, :], 0.0)
        cb = _dot(cc, tl.trans(bc), DOT_PREC)  # [L, L]
        w = tl.where(causal, cb * tl.exp(diff) * dt[None, :], 0.0)
        y = _dot(w, xc, DOT_PREC)  # [L, BLOCK_P]
        # The carried state: y_i += exp(la_i) * (h . C_i).
        y += tl.exp(la)[:, None] * _dot(cc, tl.trans(h), DOT_PREC)
        if HAS_D:
            y += dd * xc
        tl.store(y_ptr + (t[:, None] * Hs + hd) * P + p[None, :], y, mask=tm[:, None] & pm[None, :])
        # h at the chunk end = exp(la_end) h + sum_j exp(la_end - la_j) dt_j x_j (x) B_j.
        wend = tl.exp(la_end - la) * dt  # [L]
        h = tl.exp(la_end) * h + _dot(tl.trans(xc * wend[:, None]), bc, DOT_PREC)  # [BLOCK_P, N]
    tl.store(h_ptr + seq * state_size + hoff, h, mask=hmask)


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    chunk: int = 64,
    block_p: int | None = None,
    num_warps: int = 4,
    precision: str = "tf32x3",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request of a step in one launch: x [T, Hs, P], dt [T, Hs] (softplus'ed), A [Hs]
    (any shape of Hs elements, e.g. the model's [Hs, 1, 1]), B / C [T, G, N] with G dividing Hs,
    D [Hs] | None, states [S, Hs, P, N] (the layer's slot cache, read only), cu_seqlens int32
    [N+1] (request i owns tokens [cu[i], cu[i+1])), slots [N], keep [N] (0: fresh, zero state)
    -> (y [T, Hs, P] float32, final states [N, Hs, P, N] float32 in request order: the caller
    writes them to their slots). Grid: (Hs, P blocks, requests). `chunk`: tokens per inner step,
    a power of two >= 16 (tl.dot's minimum). Launch knobs (bench/gpu_probes/ssd_prefill_sweep.py):
    block_p (P rows per program, a power of two >= 16; default min(P, 32)), num_warps, precision
    of the dots ("ieee" = exact fp32 on CUDA cores, "tf32x3" = three tf32 tensor-core products,
    ~fp32 accuracy, "tf32" = one, "bf16" = operands rounded to bf16). x may be a token-strided
    view (stride(1) = P, stride(2) = 1) and B / C views of one stride (stride(1) = N): read in
    place, no copy. H200, Mamba2-2.7B layer, T = 256: ieee 5.24 ms (64, 4 warps) /
    2.35 ms (32, 8 warps), tf32x3 0.23 ms, tf32 0.11-0.14 ms against the torch reference's 2.6-4.3
    ms: the exact fp32 dots ran on CUDA cores and spilled."""
    check_device("ssd_varlen", x, dt, A, B, C, states, cu_seqlens, slots, keep)
    if x.dim() != 3 or B.dim() != 3 or C.shape != B.shape:
        raise ValueError("ssd_varlen: x [T, Hs, P], B and C [T, G, N] of one shape")
    t, hs, p = x.shape
    g, n = B.shape[1], B.shape[2]
    if tuple(dt.shape) != (t, hs) or A.numel() != hs or B.shape[0] != t:
        raise ValueError(
            f"ssd_varlen: dt [T, Hs] = ({t}, {hs}), A of {hs} scalars, B [T, G, N]; got "
            f"dt {tuple(dt.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}"
        )
    if g < 1 or hs % g or states.dim() != 4 or tuple(states.shape[1:]) != (hs, p, n):
        raise ValueError(
            f"ssd_varlen: G must divide Hs and states be [S, Hs, P, N] with ({hs}, {p}, {n}); "
            f"got G={g}, states {tuple(states.shape)}"
        )
    nseq = slots.shape[0]
    if tuple(cu_seqlens.shape) != (nseq + 1,) or tuple(keep.shape) != (nseq,):
        raise ValueError("ssd_varlen: cu_seqlens [N+1], slots [N], keep [N]")
    if D is not None and D.numel() != hs:
        raise ValueError(f"ssd_varlen: D [Hs]; got {tuple(D.shape)}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"ssd_varlen: chunk must be a power of two >= 16, got {chunk}")
    if precision not in DOT_PRECISIONS:
        raise ValueError(f"ssd_varlen: precision one of {DOT_PRECISIONS}, got {precision!r}")
    block_p = block_p or max(min(next_pow2(p), 32), 16)
    if block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"ssd_varlen: block_p a power of two >= 16, got {block_p}")
    # Token-strided views (the model's slices of one conv-output row) are read in place.
    if x.stride(2) != 1 or x.stride(1) != p:
        x = x.contiguous()
    if B.stride(2) != 1 or B.stride(1) != n or C.stride() != B.stride():
        B, C = B.contiguous(), C.contiguous()
    dt = dt.float().contiguous()
    a = A.float().reshape(hs).contiguous()
    y = torch.empty((t, hs, p), dtype=torch.float32, device=x.device)
    h = torch.empty((nseq, hs, p, n), dtype=torch.float32, device=x.device)
    block_n = max(next_pow2(n), 16)
    d = D.float().reshape(hs).contiguous() if D is not None else a
    _ssd_prefill_kernel[(hs, triton.cdiv(p, block_p), nseq)](
        x, dt, a, B, C, d, states.contiguous(), y, h,
        cu_seqlens.to(torch.int32).contiguous(), slots.contiguous(), keep.float().contiguous(),
        hs, p, n, g, x.stride(0), B.stride(0),
        HAS_D=D is not None, CHUNK=chunk, BLOCK_P=block_p, BLOCK_N=block_n,
        DOT_PREC="bf16_emulated" if precision == "bf16" and interpret_mode() else precision,
        num_warps=num_warps,
    )  # fmt: skip
    return y, h


def ssd_chunked_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    h0: torch.Tensor,
    chunk: int = 64,
    **knobs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: x [T, Hs, P], dt [T, Hs] (softplus'ed), A [Hs], B / C [T, G, N], D [Hs] |
    None, h0 [Hs, P, N] -> (y [T, Hs, P] float32, h_T [Hs, P, N] float32). Same maths as
    ssm_ops.ssd_chunked / selective_scan; `ssd_varlen` with one request (knobs: its block_p,
    num_warps, precision)."""
    if h0.dim() != 3:
        raise ValueError(f"ssd_chunked_prefill: h0 [Hs, P, N]; got {tuple(h0.shape)}")
    dev = x.device
    cu = torch.tensor([0, x.shape[0]], dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    y, h = ssd_varlen(x, dt, A, B, C, D, h0.float()[None], cu, zero, one, chunk, **knobs)  # type: ignore[arg-type]
    return y, h[0]


def ssd_chunked_prefill_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    h0: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `ssd_chunked_prefill`: the model's ssm_ops.ssd_chunked with the
    groups expanded to heads."""
    from xlaserve.backends_torch.layers.ssm_ops import ssd_chunked

    hs = x.shape[1]
    rep = hs // B.shape[1]
    Bh = B.float().repeat_interleave(rep, dim=1)
    Ch = C.float().repeat_interleave(rep, dim=1)
    return ssd_chunked(x, dt, A.float().reshape(hs, 1, 1), Bh, Ch, D, h0, chunk=chunk)
