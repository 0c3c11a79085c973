"""Decode throughput with and without a JSON schema on the same workload (CPU, torch backend).

    .venv/bin/python tests/structured/bench_overhead.py [MODEL_DIR]

Without MODEL_DIR a tiny random Llama is built in a temp dir. Both runs generate exactly the
same number of tokens (ignore_eos; the schema run uses a schema whose strings never end early,
so the grammar does not stop it first); the ratio is structured / plain tokens per second.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from xlaserve import LLM, SamplingParams  # noqa: E402
from xlaserve.sampling_params import StructuredOutputsParams  # noqa: E402

# An array of objects with free-text fields: the grammar stays open for the whole run.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"verse": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["verse", "n"],
    },
    "minItems": 1,  # else the model may close "[]" at once
}


def run(llm: LLM, prompts: list[str], max_tokens: int, structured: bool) -> tuple[float, int]:
    so = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(
        temperature=0.8, seed=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so
    )
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from tiny_models import make_tiny_model

        path = make_tiny_model("llama", tempfile.mkdtemp())
    llm = LLM(path, backend="torch", dtype="float32", max_model_len=256, num_kv_blocks=256)
    engine = llm.llm_engine
    # Time spent in the structured-output hooks (bitmask fill + matcher advance), engine side.
    hook_s = [0.0]
    core = engine.core
    for name in ("_attach_bitmasks", "_send_late_bitmasks", "_grammar_result"):
        fn = getattr(core, name)

        def timed(*a, _fn=fn):  # noqa: ANN002, ANN202
            t = time.perf_counter()
            r = _fn(*a)
            hook_s[0] += time.perf_counter() - t
            return r

        setattr(core, name, timed)
    prompts = [f"And God said, let there be light {i}" for i in range(8)]
    run(llm, prompts[:2], 8, True)  # warm up: xgrammar import, first compilation
    run(llm, prompts[:2], 8, False)
    for batch in (1, 8):
        res: dict[bool, list[float]] = {}
        hook_s[0], steps = 0.0, 0
        for structured in (False, True) * 3:  # interleaved: the machine's load drifts
            dt, n = run(llm, prompts[:batch], 128, structured)
            res.setdefault(structured, []).append(n / dt)
            steps += 128 if structured else 0
        plain, so = max(res[False]), max(res[True])
        print(
            f"batch {batch}: plain {plain:.1f} tok/s, json schema {so:.1f} tok/s, "
            f"ratio {so / plain:.3f}; engine-side grammar hooks "
            f"{1e3 * hook_s[0] / steps:.2f} ms/step ({1e3 * hook_s[0] / steps / batch:.3f} ms/seq)"
        )


if __name__ == "__main__":
    main()
