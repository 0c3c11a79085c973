"""xlaserve vs transformers `generate`, side by side in one run, on the same model and prompts.

Measured, alternating the two systems in every repeat so that load changes on a shared machine hit
both alike (medians of `repeats`):
- throughput: `num_prompts` prompts of `input_len` random tokens, `output_len` new tokens each
  (greedy; EOS does not stop either system), as one batch for both (HF pads nothing: equal lengths);
- batch-1 latency: one prompt, `output_len` new tokens.
Also reported: whether both produce the same greedy tokens on the batch-1 prompt.

Run: `xlaserve bench compare-hf --model DIR --output-json F` or `python -m xlaserve.bench.compare_hf`.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from datetime import date
from typing import Any

Echo = Callable[[str], None]


def _default_model() -> str:
    from xlaserve.demo import demo_model_path  # the shipped demo model

    return str(demo_model_path())


def run_compare_hf(
    model: str | None = None,
    num_prompts: int = 16,
    input_len: int = 64,
    output_len: int = 64,
    repeats: int = 3,
    seed: int = 0,
    dtype: str = "float32",
    backend: str = "torch",
    threads: int | None = 1,
    output_json: str | None = None,
    echo: Echo = print,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from xlaserve import LLM, SamplingParams

    model = model or _default_model()
    if threads:
        torch.set_num_threads(threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    llm = LLM(model=model, backend=backend, dtype=dtype, seed=seed)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()

    tok = llm.get_tokenizer()
    special = set(getattr(tok, "all_special_ids", ()) or ())
    pool = [i for i in range(tok.vocab_size) if i not in special]
    rng = random.Random(seed)
    prompts = [[rng.choice(pool) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    pad_id = tok.eos_token_id if tok.eos_token_id is not None else 0
    # The equivalent of ignore_eos: no EOS at all, so EOS may be generated and does not stop
    # (min_new_tokens would instead forbid EOS and change the greedy tokens).
    gen_cfg = copy.deepcopy(hf.generation_config)
    # generate() refills an unset eos_token_id from the model's config: use an id no model emits.
    gen_cfg.eos_token_id = hf.config.vocab_size + 7
    gen_cfg.pad_token_id = pad_id
    gen_cfg.do_sample = False
    gen_cfg.max_new_tokens = output_len
    gen_cfg.min_new_tokens = None
    for name in ("temperature", "top_p", "top_k"):  # sampling-only fields warn under greedy
        setattr(gen_cfg, name, None)

    def xl_run(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, [list(o.outputs[0].token_ids) for o in outs]

    def hf_run(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(batch, dtype=torch.long)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=gen_cfg,
            )
        dt = time.perf_counter() - t0
        new = out[:, ids.shape[1] :]
        assert new.shape[1] == output_len, new.shape
        return dt, new.tolist()

    # Warm-up: allocators, lazy init, any compilation.
    xl_run(prompts[:2])
    hf_run(prompts[:2])
    xl_tp, hf_tp, xl_b1, hf_b1 = [], [], [], []
    xl_tokens: list[list[int]] = []
    hf_tokens: list[list[int]] = []
    for r in range(repeats):
        echo(f"repeat {r + 1}/{repeats}")
        xl_tp.append(xl_run(prompts)[0])
        hf_tp.append(hf_run(prompts)[0])
        dt, xl_tokens = xl_run(prompts[:1])
        xl_b1.append(dt)
        dt, hf_tokens = hf_run(prompts[:1])
        hf_b1.append(dt)
    n_out = num_prompts * output_len
    match = 0
    for a, b in zip(xl_tokens[0], hf_tokens[0], strict=False):
        if a != b:
            break
        match += 1
    xl_tp_med, hf_tp_med = statistics.median(xl_tp), statistics.median(hf_tp)
    xl_b1_med, hf_b1_med = statistics.median(xl_b1), statistics.median(hf_b1)
    import transformers

    result = {
        "date": date.today().isoformat(),
        "model": model,
        "backend": backend,
        "dtype": dtype,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "repeats": repeats,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "xlaserve_throughput_s": xl_tp,
        "hf_throughput_s": hf_tp,
        "xlaserve_batch1_latency_s": xl_b1,
        "hf_batch1_latency_s": hf_b1,
        "xlaserve_output_tok_per_s": n_out / xl_tp_med,
        "hf_output_tok_per_s": n_out / hf_tp_med,
        "throughput_ratio": hf_tp_med / xl_tp_med,  # > 1: xlaserve faster
        "xlaserve_batch1_latency_median_s": xl_b1_med,
        "hf_batch1_latency_median_s": hf_b1_med,
        "xlaserve_batch1_tok_per_s": output_len / xl_b1_med,
        "hf_batch1_tok_per_s": output_len / hf_b1_med,
        "batch1_latency_ratio": hf_b1_med / xl_b1_med,  # > 1: xlaserve faster
        "greedy_matching_prefix_tokens": match,
        "greedy_tokens_compared": output_len,
    }
    echo(
        f"throughput ({num_prompts} x {input_len}+{output_len}): xlaserve "
        f"{result['xlaserve_output_tok_per_s']:.1f} tok/s, transformers "
        f"{result['hf_output_tok_per_s']:.1f} tok/s -> {result['throughput_ratio']:.2f}x\n"
        f"batch-1 latency ({input_len}+{output_len}): xlaserve {xl_b1_med * 1000:.1f} ms, "
        f"transformers {hf_b1_med * 1000:.1f} ms -> {result['batch1_latency_ratio']:.2f}x\n"
        f"greedy tokens equal for the first {match}/{output_len}"
    )
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    if output_json:
        with open(output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        echo(f"results written to {output_json}")
    return result


if __name__ == "__main__":
    from xlaserve.bench.cli import compare_hf_cmd

    compare_hf_cmd()
