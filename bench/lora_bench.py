"""Multi-LoRA serving cost (issue 27), in ONE command: the same offline workload with no LoRA,
and with N rank-R dummy adapters (requests round-robin over them), side by side.

Rows (medians over --repeats; output tokens per second, EOS ignored):
  offline/no_lora        engine without --enable-lora: P prompts of input-len random tokens,
                         output-len tokens each
  offline/lora_base      engine with LoRA on (N slots), every request on the base model (the
                         price of the LoRA path when no adapter is used)
  offline/lora_adapters  same engine, requests round-robin over the N adapters
  batch1/<same three>    one request, batch1-output-len tokens (prefill included)
Ratios: offline/lora_adapters over offline/no_lora (the issue's goal: >= 0.85) and the same for
batch 1. Adapters: PEFT directories with random A / B (float16) on q/k/v/o/gate/up/down of every
layer, written under a temporary directory.

  # H200, Llama-3.1-8B shape, dummy bf16, 8 rank-16 adapters (torch backend):
  python bench/lora_bench.py --llama8b --output-json lora_bench.json
  # CPU, the demo model:
  python bench/lora_bench.py --num-prompts 8 --input-len 16 --output-len 8 \
      --batch1-output-len 8 --num-adapters 2 --rank 4 --output-json /tmp/lora.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from typing import Any

from xlaserve.bench.common import (
    add_model_args,
    model_engine_kwargs,
    random_prompts,
    resolve_model_dir,
)

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_dummy_adapter(path: str, model_dir: str, rank: int, seed: int) -> str:
    """A PEFT adapter dir with random A / B for every projection of every layer."""
    import numpy as np
    from safetensors.numpy import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    h, inter = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for m in MODULES:
            fan_in, fan_out = dims[m]
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            a = rng.standard_normal((rank, fan_in), dtype=np.float32) / math.sqrt(fan_in)
            b = rng.standard_normal((fan_out, rank), dtype=np.float32) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float16)
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(MODULES), "bias": "none"}, f)  # fmt: skip
    return path


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_model_len": args.input_len + max(args.output_len,
                          args.batch1_output_len) + 16}  # fmt: skip
    kw.update(model_engine_kwargs(args))
    return kw


def _timed(llm: Any, prompts: list, sp: Any, loras: list | None) -> tuple[float, int]:  # noqa: ANN401
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def _measure(llm: Any, args: argparse.Namespace, loras: list | None, rows: dict, tag: str) -> None:  # noqa: ANN401
    from xlaserve import SamplingParams

    vocab = llm.llm_engine.spec.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    per = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    # Warm-up: every adapter loaded into its slot, kernels compiled.
    warm = prompts[: max(len(loras or []), 2)]
    _timed(llm, warm, SamplingParams(max_tokens=2, ignore_eos=True),
           per[: len(warm)] if per else None)  # fmt: skip
    rates = []
    for _ in range(args.repeats):
        dt, n = _timed(llm, prompts, sp, per)
        rates.append(n / dt)
    rows[f"offline/{tag}"] = {"output_tok_s": statistics.median(rates), "runs": rates}
    sp1 = SamplingParams(max_tokens=args.batch1_output_len, temperature=0.0, ignore_eos=True)
    one = prompts[:1]
    rates = []
    for _ in range(args.repeats):
        dt, n = _timed(llm, one, sp1, per[:1] if per else None)
        rates.append(n / dt)
    rows[f"batch1/{tag}"] = {"output_tok_s": statistics.median(rates), "runs": rates}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from xlaserve import LLM
    from xlaserve.lora import LoRARequest

    kw = _engine_kwargs(args)
    rows: dict[str, Any] = {}
    llm = LLM(model=args.model_dir, **kw)
    try:
        _measure(llm, args, None, rows, "no_lora")
    finally:
        llm.llm_engine.shutdown()
        del llm
    work = tempfile.mkdtemp(prefix="lora-bench-")
    loras = [
        LoRARequest(
            f"ad{i}",
            i + 1,
            write_dummy_adapter(os.path.join(work, f"ad{i}"), args.model_dir, args.rank, seed=i),
        )  # fmt: skip
        for i in range(args.num_adapters)
    ]
    n = args.num_adapters
    llm = LLM(model=args.model_dir, enable_lora=True, max_loras=n, max_lora_rank=args.rank,
              max_cpu_loras=n, **kw)  # fmt: skip
    try:
        _measure(llm, args, None, rows, "lora_base")
        _measure(llm, args, loras, rows, "lora_adapters")
    finally:
        llm.llm_engine.shutdown()
    ratio = {
        k: rows[f"{k}/lora_adapters"]["output_tok_s"] / rows[f"{k}/no_lora"]["output_tok_s"]
        for k in ("offline", "batch1")
    }
    return {
        "config": {k: v for k, v in vars(args).items()},
        "rows": rows,
        "ratio_adapters_vs_no_lora": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output-json", default="lora_bench.json")
    add_model_args(ap)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch1-output-len", type=int, default=256)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.model_dir = resolve_model_dir(args, "lora-bench-model-")
    report = run(args)
    with open(args.output_json, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"rows": {k: round(v["output_tok_s"], 1) for k, v in report["rows"].items()},
                      "ratio": report["ratio_adapters_vs_no_lora"]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
