"""Multi-LoRA with KernelConfig.xla_decode_gemv="on" (CPU, the GEMV under Pallas' interpreter):
the base weight's matmul goes through the decode GEMV, the adapters' shrink / expand keep their
own path, and a mixed batch still gives transformers' greedy tokens with each adapter merged."""

from __future__ import annotations

import jax
from flax import nnx
from lora_helpers import BUDGET, PROMPTS, drive_lora, hf_merged_greedy, make_adapter
from xla_helpers import make_runner  # tests/backends_xla/xla_helpers.py

from xlaserve.lora import LORA_MODULES
from xlaserve.models_flax.layers import Linear


def test_lora_deltas_on_top_of_the_gemv_base_match_merged_transformers(
    tiny_model_dir,
    jax_cache_dir,  # noqa: ANN001
) -> None:
    path = tiny_model_dir("llama")
    runner = make_runner(
        path, jax_cache_dir, max_num_batched_tokens=BUDGET, max_num_seqs=4, enable_lora=True,
        max_loras=1, max_lora_rank=8, xla_decode_gemv="on",
    )  # fmt: skip
    try:
        model = nnx.merge(runner.graphdef, runner.state)
        lins = [m for _, m in nnx.iter_graph(model) if type(m) is Linear]
        assert lins and {m.decode_gemv for m in lins} == {"all"}
        # the GEMV really is in a decode-bucket forward of a LoRA target (q_proj of layer 0)
        q = model.layers[0].self_attn.q_proj
        x = jax.numpy.zeros((BUDGET, q.weight.get_value().shape[1]), jax.numpy.float32)
        assert "pallas_call" in str(jax.make_jaxpr(lambda x: q(x))(x))
        adapter = make_adapter(runner.spec, "a", 1, 8, LORA_MODULES, seed=2)
        slots = [0, -1, 0, -1]
        got = drive_lora(runner, PROMPTS, slots, [(0, adapter)], "g")
        want = [hf_merged_greedy(path, adapter if s == 0 else None, p) for s, p in zip(slots, PROMPTS, strict=True)]  # fmt: skip
        assert got == want
        assert got[0] != hf_merged_greedy(path, None, PROMPTS[0])  # the adapter matters
    finally:
        runner.shutdown()
