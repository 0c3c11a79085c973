#!/usr/bin/env python
"""Which fused attention runs a prefill chunk over a cached prefix at full speed (issue 24).

A 30k-token prompt prefills in two chunks at the offline budget (16,384 tokens a step); the
second chunk's queries (13,616) attend over all 30,000 keys, causal aligned to the last key.
`long_context --stages kernels` measured that call (`prefill_sdpa`'s `causal_lower_right` SDPA)
at ~350 TFLOP/s on the H100 against ~600 for the whole prompt's square causal call, so the
chunk, not the kernel family, loses. This probe times every route to the same output, each
checked against the first (max abs difference), one layer's shape (32 q / 8 kv heads, D 128):

- ``lower_right``: F.scaled_dot_product_attention with `causal_lower_right` (today's path),
  under the default dispatch and with each SDPA backend forced;
- ``padded_square``: the chunk's queries padded in front to a square causal call (top left =
  bottom right when square; pays the prefix's own triangle again);
- ``split_lse``: prefix keys without a mask plus the chunk's own square causal block, merged
  by their log-sum-exp (the private aten ops that return it: cuDNN with K / V repeated to the
  query heads or with their own heads, flash); ``split_engine``: the engine's route
  (`prefill_sdpa.split_attention`);
- ``flash_varlen``: aten._flash_attention_forward with is_causal on a non-square problem
  (FlashAttention-2 aligns causal to the bottom right there).
Also the square causal call of the whole prompt, the speed the chunk should reach.

    OUT=dir python bench/gpu_probes/chunk_attention.py            # H100 / H200: ~1 min
    python bench/gpu_probes/chunk_attention.py --tiny --out x.json  # CPU smoke (math SDPA)
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from xlaserve.bench.timing import event_time_us


def _routes(q: Any, k: Any, v: Any, scale: float) -> dict[str, Callable[[], Any]]:  # noqa: ANN401
    """name -> fn() giving the chunk's output [Lq, Hq, D]; q [Lq, Hq, D], k / v [L, Hkv, D]
    (the chunk's queries are the last Lq of the L positions)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    p = lk - lq
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D] views

    def lower_right() -> Any:  # noqa: ANN401
        o = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=causal_lower_right(lq, lk), scale=scale, enable_gqa=True
        )
        return o[0].transpose(0, 1)

    def forced(backend: Any) -> Callable[[], Any]:  # noqa: ANN401
        def fn() -> Any:  # noqa: ANN401
            with sdpa_kernel(backend):
                return lower_right()

        return fn

    def padded_square() -> Any:  # noqa: ANN401
        qp = torch.cat([q.new_zeros(p, hq, q.shape[2]), q]).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        return o[0, :, p:].transpose(0, 1)

    def bhl(lse: Any) -> Any:  # noqa: ANN401
        # The private ops' log-sum-exp layouts differ ([1, H, L], [1, L, H], a trailing 1).
        lse = lse.reshape(1, -1, lse.shape[-1] if lse.shape[-1] != 1 else lse.shape[-2])
        return lse if lse.shape[1] == hq else lse.reshape(1, lq, hq).transpose(1, 2)

    def merge(o1: Any, l1: Any, o2: Any, l2: Any) -> Any:  # noqa: ANN401
        # o [1, H, Lq, D], lse [1, H, Lq] (natural log) -> the softmax over both key sets.
        l1, l2 = bhl(l1), bhl(l2)
        lse = torch.logaddexp(l1, l2)
        w1, w2 = torch.exp(l1 - lse)[..., None], torch.exp(l2 - lse)[..., None]
        return (o1.float() * w1 + o2.float() * w2).to(q.dtype)[0].transpose(0, 1)

    def split_cudnn() -> Any:  # noqa: ANN401
        rep = hq // hkv
        kr, vr = (x.repeat_interleave(rep, dim=1) for x in (kb, vb))
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        o1, l1 = op(qb, kr[:, :, :p], vr[:, :, :p], None, True, 0.0, False, False, scale=scale)[:2]
        o2, l2 = op(qb, kr[:, :, p:], vr[:, :, p:], None, True, 0.0, True, False, scale=scale)[:2]
        return merge(o1, l1, o2, l2)

    def split_cudnn_gqa() -> Any:  # noqa: ANN401 - K / V with their own heads, no repeat
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        o1, l1 = op(qb, kb[:, :, :p], vb[:, :, :p], None, True, 0.0, False, False, scale=scale)[:2]
        o2, l2 = op(qb, kb[:, :, p:], vb[:, :, p:], None, True, 0.0, True, False, scale=scale)[:2]
        return merge(o1, l1, o2, l2)

    def split_engine() -> Any:  # noqa: ANN401 - the engine's route (prefill_sdpa.split_attention)
        from xlaserve.kernels_cuda.prefill_sdpa import split_attention

        out = torch.empty_like(q)
        split_attention(qb, kb, vb, scale, out)
        return out

    def split_flash() -> Any:  # noqa: ANN401
        op = torch.ops.aten._flash_attention_forward
        o1, l1 = op(q[None], k[None, :p], v[None, :p], None, None, lq, p, 0.0, False, False,
                    scale=scale)[:2]  # fmt: skip
        o2, l2 = op(q[None], k[None, p:], v[None, p:], None, None, lq, lq, 0.0, True, False,
                    scale=scale)[:2]  # fmt: skip
        # flash's outputs are [1, L, H, D]; its lse [1, H, L].
        return merge(o1.transpose(1, 2), l1, o2.transpose(1, 2), l2)

    def flash_varlen() -> Any:  # noqa: ANN401
        dev = q.device
        cq = torch.tensor([0, lq], dtype=torch.int32, device=dev)
        ck = torch.tensor([0, lk], dtype=torch.int32, device=dev)
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cq, ck, lq, lk, 0.0, True, False, scale=scale
        )[0]

    routes: dict[str, Callable[[], Any]] = {"lower_right": lower_right}
    if q.is_cuda:
        for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            routes[f"lower_right[{name.split('_')[0].lower()}]"] = forced(getattr(SDPBackend, name))
    routes["padded_square"] = padded_square
    if q.is_cuda:
        routes["split_lse_cudnn"] = split_cudnn
        routes["split_lse_cudnn_gqa"] = split_cudnn_gqa
        routes["split_engine"] = split_engine
        routes["split_lse_flash"] = split_flash
        routes["flash_varlen"] = flash_varlen
    return routes


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available() and not args.tiny
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    hq, hkv, d = (32, 8, 128) if cuda else (4, 2, 16)
    lk, lq = (args.context, args.chunk) if cuda else (96, 40)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(n, h, d, generator=g).to(dev, dt) for n, h in ((lq, hq), (lk, hkv), (lk, hkv))
    )
    scale = d**-0.5
    p = lk - lq
    flops = 4 * d * hq * (lq * p + lq * (lq + 1) / 2)
    rows: dict[str, Any] = {}
    first = None
    for name, fn in _routes(q, k, v, scale).items():
        try:
            out = fn().float()
            us = event_time_us(fn, args.reps, warmup=2, cuda=cuda)
        except Exception as e:  # noqa: BLE001 - a route that does not run is a result too
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{name}: {rows[name]['error']}", flush=True)
            continue
        first = out if first is None else first
        rows[name] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                      "max_abs_diff_vs_first": float((out - first).abs().max())}  # fmt: skip
        print(f"{name}: {us:.1f} us, {rows[name]['tflops']} TFLOP/s, "
              f"diff {rows[name]['max_abs_diff_vs_first']:.2e}", flush=True)  # fmt: skip
    # The whole prompt as one square causal call: the speed the chunk should reach.
    kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
    qf = torch.randn(lk, hq, d, generator=g).to(dev, dt).transpose(0, 1).unsqueeze(0)

    def square() -> Any:  # noqa: ANN401
        return F.scaled_dot_product_attention(
            qf, kb, vb, is_causal=True, scale=scale, enable_gqa=True
        )

    us = event_time_us(square, args.reps, warmup=2, cuda=cuda)
    sq_flops = 4 * d * hq * lk * (lk + 1) / 2
    rows["square_whole_prompt"] = {"us": round(us, 1), "tflops": round(sq_flops / us / 1e6, 1)}
    print(f"square_whole_prompt: {us:.1f} us, {rows['square_whole_prompt']['tflops']} TFLOP/s")
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "context": lk, "chunk": lq, "heads": [hq, hkv, d], "reps": args.reps, "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "chunk_attention.json")
    )
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke)")
    ap.add_argument("--context", type=int, default=30000)
    ap.add_argument(
        "--chunk", type=int, default=13616, help="the chunk's queries (last of context)"
    )
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    report = run(args)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
