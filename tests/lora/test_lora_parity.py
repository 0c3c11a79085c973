"""Multi-LoRA parity: greedy tokens of a MIXED batch (two adapters + the base, one generate
call, mixed prompt lengths) equal transformers running the base with each adapter merged
(W + scaling * B @ A). Adapters: rank 4 (alpha 8) on every projection, rank 8 rsLoRA on
attention only; tiny Llama and Qwen3 (qk-norm, head_dim != hidden / heads)."""

from __future__ import annotations

import pytest
from lora_utils import ALL, ATTN, merge_into, write_peft
from tiny_models import hf_greedy

from xlaserve import LLM, SamplingParams
from xlaserve.lora import LoRARequest

PROMPTS = [
    [5, 17, 33, 2, 90],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40],
    [100, 3],
    [64, 65, 66, 67],
]
NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    """kind -> (base dir, [(adapter dir, merged dir)] for the two adapters)."""
    cache = {}

    def get(kind: str):  # noqa: ANN202
        if kind not in cache:
            base = tiny_model_dir(kind)
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            a1 = write_peft(str(root / "a1"), base, rank=4, alpha=8.0, targets=ALL, seed=1)
            a2 = write_peft(str(root / "a2"), base, rank=8, alpha=4.0, targets=ATTN,
                            rslora=True, seed=2, std=0.5)  # fmt: skip
            cache[kind] = (base, [(a, merge_into(base, a, str(root / f"m{i}")))
                                  for i, a in enumerate((a1, a2))])  # fmt: skip
        return cache[kind]

    return get


@pytest.mark.parametrize("backend", ["torch", "xla"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_mixed_batch_matches_merged_transformers(adapters, kind: str, backend: str) -> None:  # noqa: ANN001
    base, ads = adapters(kind)
    reqs = [LoRARequest("a1", 1, ads[0][0]), LoRARequest("a2", 2, ads[1][0])]
    # Per prompt: adapter 1, base, adapter 2, adapter 1 (then each prompt once more, rotated).
    plan = [reqs[0], None, reqs[1], reqs[0], None, reqs[1], reqs[0], None]
    prompts = PROMPTS + PROMPTS[1:] + PROMPTS[:1]
    want_by_model = {
        None: hf_greedy(base, PROMPTS, NEW),
        1: hf_greedy(ads[0][1], PROMPTS, NEW),
        2: hf_greedy(ads[1][1], PROMPTS, NEW),
    }
    llm = LLM(model=base, backend=backend, enable_lora=True, max_loras=2, max_lora_rank=8,
              max_num_seqs=8, max_model_len=64, enforce_eager=True)  # fmt: skip
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0,
                            ignore_eos=True), use_tqdm=False, lora_request=plan)  # fmt: skip
    finally:
        llm.llm_engine.shutdown()
    for i, (out, lr) in enumerate(zip(outs, plan, strict=True)):
        key = lr.lora_int_id if lr is not None else None
        want = want_by_model[key][PROMPTS.index(prompts[i])]
        assert out.outputs[0].token_ids == want, f"prompt {i} adapter {key}"
    # The adapters really change the output (else the test could not fail).
    assert want_by_model[None] != want_by_model[1] and want_by_model[None] != want_by_model[2]


def test_triton_kernel_path_in_the_runner(adapters, monkeypatch) -> None:  # noqa: ANN001
    """The runner's Triton path (CUDA's; here under the interpreter): same tokens as the merged
    models for a mixed batch, base tokens between adapter tokens."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("covered on the GPU by the CUDA path itself")
    monkeypatch.setenv("XLASERVE_LORA_TRITON", "1")
    base, ads = adapters("llama")
    plan = [LoRARequest("a1", 1, ads[0][0]), None, LoRARequest("a2", 2, ads[1][0])]
    prompts = PROMPTS[:3]
    want = [
        hf_greedy(d, [p], 4)[0] for d, p in zip([ads[0][1], base, ads[1][1]], prompts, strict=True)
    ]
    llm = LLM(model=base, backend="torch", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=64)  # fmt: skip
    try:
        assert llm.llm_engine.core.runner.lora.use_triton
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0,
                            ignore_eos=True), use_tqdm=False, lora_request=plan)  # fmt: skip
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want


def test_base_only_steps_launch_no_lora_kernel(adapters, monkeypatch) -> None:  # noqa: ANN001
    """LoRA enabled, Triton path (CUDA's; here under the interpreter), eager: a batch with no
    adapter request gives the base model's tokens and launches no shrink / expand at all (the
    host decides from the step's slots); a mixed batch afterwards still applies its adapters."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter on the CPU")
    import xlaserve.kernels_cuda.lora as klora

    calls = {"lora_shrink": 0, "lora_expand": 0}
    for name in calls:
        real = getattr(klora, name)

        def counted(*args, _real=real, _name=name, **kw):  # noqa: ANN002, ANN003, ANN202
            calls[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(klora, name, counted)  # the runner imports them at call time
    monkeypatch.setenv("XLASERVE_LORA_TRITON", "1")
    base, ads = adapters("llama")
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(model=base, backend="torch", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=64, enforce_eager=True)  # fmt: skip
    try:
        assert llm.llm_engine.core.runner.lora.use_triton
        base_outs = llm.generate(prompts, params, use_tqdm=False)
        assert calls == {"lora_shrink": 0, "lora_expand": 0}
        plan = [LoRARequest("a1", 1, ads[0][0]), None, None]
        mixed = llm.generate(prompts, params, use_tqdm=False, lora_request=plan)
        assert calls["lora_shrink"] > 0 and calls["lora_expand"] > 0
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in base_outs] == hf_greedy(base, prompts, 4)
    assert mixed[0].outputs[0].token_ids == hf_greedy(ads[0][1], prompts[:1], 4)[0]
    assert [o.outputs[0].token_ids for o in mixed[1:]] == hf_greedy(base, prompts[1:], 4)


def test_bad_adapter_is_a_clear_error_and_engine_keeps_going(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    base = tiny_model_dir("llama")
    bad = write_peft(str(tmp_path / "big"), base, rank=32)
    llm = LLM(model=base, backend="torch", enable_lora=True, max_loras=1, max_lora_rank=8,
              max_model_len=64)  # fmt: skip
    try:
        with pytest.raises(ValueError, match="rank 32 exceeds max_lora_rank 8"):
            llm.generate([[1, 2, 3]], lora_request=LoRARequest("big", 1, bad), use_tqdm=False)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.llm_engine.shutdown()


def test_lora_request_without_enable_lora(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    base = tiny_model_dir("llama")
    ad = write_peft(str(tmp_path / "a"), base)
    llm = LLM(model=base, backend="torch", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.generate([[1, 2]], lora_request=LoRARequest("a", 1, ad), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.gpu
def test_cuda_graphs_mixed_batch(adapters) -> None:  # noqa: ANN001
    """On CUDA with decode CUDA graphs (the LoRA kernels captured once, slots read from static
    buffers): a mixed batch of two adapters and the base still equals the merged models, and
    decode steps were graph replays."""
    base, ads = adapters("llama")
    reqs = [LoRARequest("a1", 1, ads[0][0]), LoRARequest("a2", 2, ads[1][0])]
    plan = [reqs[0], None, reqs[1], reqs[0]]
    want_by_model = {
        None: hf_greedy(base, PROMPTS, NEW),
        1: hf_greedy(ads[0][1], PROMPTS, NEW),
        2: hf_greedy(ads[1][1], PROMPTS, NEW),
    }
    llm = LLM(model=base, backend="torch", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_num_seqs=8, max_model_len=64, async_scheduling="off")  # fmt: skip
    try:
        runner = llm.llm_engine.core.runner
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0,
                            ignore_eos=True), use_tqdm=False, lora_request=plan)  # fmt: skip
        assert runner.cuda_step is not None and runner.cuda_step.num_replays > 0
    finally:
        llm.llm_engine.shutdown()
    for i, (out, lr) in enumerate(zip(outs, plan, strict=True)):
        key = lr.lora_int_id if lr is not None else None
        assert out.outputs[0].token_ids == want_by_model[key][i], f"prompt {i} adapter {key}"


def test_moe_attention_lora_and_expert_lora_refused(tmp_path) -> None:  # noqa: ANN001
    """Mixtral (MoE): an attention-only adapter serves (mixed with the base, equal to the merged
    model); an adapter on the MLP projections is refused with a clear error."""
    from arch_zoo import make_arch_model

    base = make_arch_model("mixtral", str(tmp_path / "mixtral"))
    att = write_peft(str(tmp_path / "att"), base, rank=4, alpha=8.0, targets=ATTN, seed=5, std=0.5)
    mlp = write_peft(str(tmp_path / "mlp"), base, rank=4, targets=("q_proj", "down_proj"))
    merged = merge_into(base, att, str(tmp_path / "merged"))
    want = [hf_greedy(merged, PROMPTS[:1], NEW)[0], hf_greedy(base, PROMPTS[1:2], NEW)[0]]
    assert want[0] != hf_greedy(base, PROMPTS[:1], NEW)[0]  # the adapter changes the output
    llm = LLM(model=base, backend="torch", enable_lora=True, max_loras=1, max_lora_rank=8,
              max_model_len=64)  # fmt: skip
    try:
        sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS[:2], sp, use_tqdm=False,
                            lora_request=[LoRARequest("att", 1, att), None])  # fmt: skip
        assert [o.outputs[0].token_ids for o in outs] == want
        with pytest.raises(ValueError, match="no down_proj in layer 0"):
            llm.generate(PROMPTS[:1], sp, use_tqdm=False, lora_request=LoRARequest("m", 2, mlp))
    finally:
        llm.llm_engine.shutdown()


def test_engine_process_offline(adapters, tmp_path) -> None:  # noqa: ANN001
    """The engine core in its own process: the LoRARequest crosses the process boundary, a bad
    adapter is a ValueError here (the core's answer), and the engine goes on."""
    base, ads = adapters("llama")
    bad = write_peft(str(tmp_path / "big"), base, rank=32)
    want = hf_greedy(ads[0][1], PROMPTS[:1], NEW)[0]
    llm = LLM(model=base, backend="torch", engine_process=True, enable_lora=True, max_loras=1,
              max_lora_rank=8, max_model_len=64)  # fmt: skip
    try:
        sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        with pytest.raises(ValueError, match="rank 32 exceeds max_lora_rank 8"):
            llm.generate(PROMPTS[:1], sp, use_tqdm=False, lora_request=LoRARequest("b", 9, bad))
        out = llm.generate(PROMPTS[:1], sp, use_tqdm=False,
                           lora_request=LoRARequest("a1", 1, ads[0][0]))  # fmt: skip
        assert out[0].outputs[0].token_ids == want
    finally:
        llm.llm_engine.shutdown()
