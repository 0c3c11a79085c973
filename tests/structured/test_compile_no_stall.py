"""Grammar compilation never stalls the other requests: a large new schema arriving while other
streams run compiles off the step loop (a worker process) while they keep producing tokens; a
schema seen before (as a dict or as text, any key order) is served from the compiled-grammar
cache without a compile."""

from __future__ import annotations

import json

import jsonschema

from xlaserve import LLM, SamplingParams
from xlaserve.bench.structured_bench import nested_schema
from xlaserve.sampling_params import StructuredOutputsParams as SO


def test_large_schema_compiles_while_others_stream(tiny_model_dir) -> None:  # noqa: ANN001
    llm = LLM(
        tiny_model_dir("llama"),
        backend="torch",
        dtype="float32",
        block_size=4,
        num_kv_blocks=400,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    eng = llm.llm_engine
    try:
        plain = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
        for i in range(3):
            eng.add_request(f"p{i}", {"prompt_token_ids": [3 + i, 17, 29, 40]}, plain)
        for _ in range(3):
            eng.step()
        big = nested_schema(2048)  # ~2 KB, nested: many rules to compile
        assert len(json.dumps(big)) >= 2048
        sp = SamplingParams(temperature=0.0, max_tokens=250, structured_outputs=SO(json=big))
        eng.add_request("big", {"prompt_token_ids": [5, 6, 7]}, sp)
        mgr = eng.core._structured
        (core_id,) = mgr._waiting  # the engine core's id of "big" (n = 1: one sequence)
        (compile_job,) = mgr._inflight.values()  # the compile, running in a worker process
        assert not compile_job.done() and not mgr.is_ready(core_id)  # add_request did not wait
        during = 0  # steps with plain tokens that ended with the compile still running
        for _ in range(100_000):
            if mgr.is_ready(core_id):
                assert mgr.has_matcher(core_id)
                break
            outs = eng.step()
            if not compile_job.done():
                during += any(o.request_id != "big" and o.outputs[0].token_ids for o in outs)
        else:
            raise AssertionError("the grammar never compiled")
        print(f"steps with plain tokens during the compile: {during}")
        assert during > 0
        out = None
        for _ in range(2000):
            if not eng.has_unfinished_requests():
                break
            for o in eng.step():
                if o.request_id == "big" and o.finished:
                    out = o.outputs[0]
        # Every token obeyed the grammar (a violation finishes with "error"); a random model
        # may not close a schema this large within max_tokens.
        assert out is not None and out.finish_reason in ("stop", "length"), out
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), big)
        compiled = mgr.num_compiled
        # The same schema as text with its keys in another order: a cache hit, no compile.
        text_schema = json.dumps(dict(reversed(list(big.items()))))
        eng.add_request("again", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(
            temperature=0.0, max_tokens=250, structured_outputs=SO(json=text_schema)
        ))  # fmt: skip
        (again_id,) = (r for r in mgr._matchers if r.endswith("again"))
        assert mgr.is_ready(again_id) and not mgr.has_pending()
        assert mgr.num_compiled == compiled
    finally:
        eng.shutdown()
