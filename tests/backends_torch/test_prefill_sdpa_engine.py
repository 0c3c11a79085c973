"""The engine with long prefill chunks through torch SDPA (KernelConfig.prefill_sdpa): the same
greedy tokens as the all-Triton attention, with chunked prefill (a chunk over a cached prefix),
a prefix-cache hit and other requests decoding in the same steps. CPU: the Triton kernels run
under TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

from xlaserve import LLM, SamplingParams
from xlaserve.backends_torch.attention_triton import TritonAttention


def test_engine_tokens_equal_with_and_without_sdpa(tiny_model_dir, monkeypatch) -> None:
    path = tiny_model_dir("llama")
    long_prompt = [(7 * i) % 250 + 3 for i in range(44)]
    prompts = [
        [5, 6, 7],  # decodes beside the long chunks
        long_prompt,  # 44 tokens: chunks of <= 20 (the step budget less the decodes)
        long_prompt[:30] + [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13, 14, 15, 16, 17, 18],
        [40, 41],
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) for _ in prompts]
    calls: list[int] = []
    real = TritonAttention._sdpa_split

    def spy(self, md, device):  # noqa: ANN001, ANN202
        split = real(self, md, device)
        calls.append(0 if split is None else len(split.long))
        return split

    monkeypatch.setattr(TritonAttention, "_sdpa_split", spy)
    got = {}
    for mode in ("off", "on"):
        calls.clear()
        llm = LLM(
            path, backend="torch", dtype="float32", block_size=4, max_model_len=64,
            max_num_seqs=4, max_num_batched_tokens=22, attention_backend="triton",
            prefill_sdpa=mode, prefill_sdpa_min_tokens=8,
        )  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[mode] = [o.outputs[0].token_ids for o in outs]
        assert any(calls) == (mode == "on")
    assert got["on"] == got["off"]
