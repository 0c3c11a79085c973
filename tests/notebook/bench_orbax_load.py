"""Load time of the XLA backend's weights: orbax checkpoint vs safetensors (not a test).

    .venv/bin/python tests/notebook/bench_orbax_load.py [--runs 5] [--big]

For each model: a fresh process per run (so neither path profits from the other's jit caches),
timing `models_flax.loader.load_model` up to every array being ready on the mesh. The files are in
the page cache after the first run (warm-cache numbers; both formats alike). `--big` also builds a
~250M-parameter Llama (random bf16 weights, safetensors via transformers) and its orbax conversion.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import json, sys, time
import jax
from xlaserve.backends_xla.utils import make_mesh, resolve_dtype
from xlaserve.model_loader.registry import build_spec
from xlaserve.models_flax.loader import load_model
d, tp = sys.argv[1], int(sys.argv[2])
mesh = make_mesh(tp)
jax.block_until_ready(jax.numpy.zeros(8) + 1)  # backend start-up outside the timing
spec = build_spec(d)
dtype = resolve_dtype("auto", spec.checkpoint_dtype, jax.default_backend())
t0 = time.perf_counter()
_, state = load_model(spec, dtype, mesh)
jax.block_until_ready(jax.tree.leaves(state))
print("LOAD", json.dumps({"s": time.perf_counter() - t0}))
"""


def _time_load(model_dir: str, tp: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model_dir, str(tp)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("LOAD "))
    return json.loads(line[5:])["s"]


def _big_model(path: str) -> str:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    from xlaserve.demo import demo_model_path

    for f in ("tokenizer.json", "tokenizer_config.json"):  # any tokenizer: only weights are timed
        with (
            open(os.path.join(demo_model_path(), f)) as src,
            open(os.path.join(path, f), "w") as dst,
        ):
            dst.write(src.read())
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    from xlaserve.backends_xla.orbax_io import convert_to_orbax
    from xlaserve.demo import demo_model_path

    tmp = tempfile.mkdtemp(prefix="orbax-bench-")
    models = [("demo-kjv (1.9M, f32)", demo_model_path())]
    if args.big:
        models.append(("llama-254M (bf16)", _big_model(os.path.join(tmp, "big"))))
    for label, src in models:
        dst = os.path.join(tmp, os.path.basename(src) + "-orbax")
        marker = convert_to_orbax(src, dst, args.tp)
        row = {"model": label, "params": marker["num_parameters"]}
        for fmt, d in (("safetensors", src), ("orbax", dst)):
            times = [_time_load(d, args.tp) for _ in range(args.runs)]
            row[fmt] = {"median_s": statistics.median(times), "runs": [round(t, 3) for t in times]}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
