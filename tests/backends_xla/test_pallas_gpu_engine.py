"""The XLA backend end to end with the Pallas GPU attention kernel (run by Pallas' interpreter on
the CPU): the same greedy tokens as with the jnp reference, over chunked prefill, mixed
prefill + decode steps and padded batches, with a float cache and with int8 / fp8 codes (the
kernel dequantizes in registers, the reference the gathered pages)."""

from __future__ import annotations

import pytest
from optional_deps import import_or_skip

import_or_skip("jax")


def _generate(impl: str, model_dir: str, monkeypatch, kv: str = "auto") -> list[list[int]]:  # noqa: ANN001
    from xlaserve import LLM, SamplingParams

    monkeypatch.setenv("XLASERVE_RPA_IMPL", impl)
    llm = LLM(
        model=model_dir, backend="xla", load_format="dummy", dtype="float32", max_num_seqs=4,
        max_num_batched_tokens=32, block_size=8, seed=0, kv_cache_dtype=kv,
    )  # fmt: skip
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # 40 tokens > the 32-token budget: a chunked prefill; 4 prompts of different lengths.
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40, 9)]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_xla_engine_pallas_gpu_matches_reference(kv: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import importlib

    from xlaserve.bench.gpu_bench import write_model_dir

    rpa = importlib.import_module("xlaserve.kernels_pallas.ragged_paged_attention")
    traced: list[int] = []
    kernel = rpa.ragged_paged_attention_gpu

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        traced.append(1)
        return kernel(*a, **k)

    from xlaserve.models_flax.layers import clear_block_traces

    monkeypatch.setattr(rpa, "ragged_paged_attention_gpu", spy)
    d = write_model_dir(str(tmp_path / "m"), num_layers=2, tiny=True)  # head_dim 16
    ref = _generate("reference", d, monkeypatch, kv)
    assert not traced
    clear_block_traces()  # layer traces are shared in the process: the spy must be traced
    try:
        got = _generate("pallas_gpu", d, monkeypatch, kv)
    finally:
        clear_block_traces()  # none of them may keep calling the spy
    assert traced  # the kernel really ran (traced into the model's programs)
    assert all(len(t) == 8 for t in ref)
    assert got == ref
