"""The runner's greedy fast path through the fused argmax kernel (kernels_cuda.sampling), forced
on the CPU (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU): the same tokens as the
torch path, synchronous and deferred (launch / finish, async engine), NONFINITE_ERROR for a
request whose logits hold NaN, and the float32 path kept for scaled / soft-capped logits."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from test_torch_runner import MiniScheduler, _runner, nan_prefix_step

from xlaserve.backends_torch.runner import ENV_FUSED_GREEDY, NONFINITE_ERROR
from xlaserve.kernels_cuda import sampling
from xlaserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[int, ...]]:
    """Shapes of the logits greedy_argmax_packed was called on."""
    calls: list[tuple[int, ...]] = []
    real = sampling.greedy_argmax_packed

    def spy(logits: torch.Tensor, **kw) -> torch.Tensor:
        calls.append(tuple(logits.shape))
        return real(logits, **kw)

    monkeypatch.setattr(sampling, "greedy_argmax_packed", spy)
    return calls


def _generate(runner, deferred: bool, fused: bool) -> dict[str, list[int]]:
    runner.fused_greedy = fused
    if deferred:  # launch (tokens left PENDING) then finish, as the async engine does
        runner.execute = lambda so: runner.finish(runner.launch(so))
    sched = MiniScheduler(runner, budget=16)
    g = torch.Generator().manual_seed(4)
    for i, n in enumerate((5, 13, 22, 9)):
        prompt = torch.randint(3, runner.spec.vocab_size, (n,), generator=g).tolist()
        sched.add(f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens=6)
    sched.run()
    return {rid: r.output for rid, r in sched.done.items()}


@pytest.mark.parametrize("name", ["llama", "llama_bf16", "qwen3"])
@pytest.mark.parametrize("deferred", [False, True])
def test_same_tokens_as_torch_path(name: str, deferred: bool, hf_model_dir, kernel_calls) -> None:
    d = hf_model_dir(name)
    dtype = "bfloat16" if name.endswith("_bf16") else "float32"
    want = _generate(_runner(d, dtype=dtype), deferred, fused=False)
    assert kernel_calls == []
    runner = _runner(d, dtype=dtype)
    got = _generate(runner, deferred, fused=True)
    assert got == want
    assert len({tuple(t) for t in got.values()}) > 1  # not degenerate
    assert kernel_calls and all(v == runner.spec.vocab_size for _, v in kernel_calls)
    assert (runner.num_deferred_steps > 0) == deferred


@pytest.mark.parametrize("deferred", [False, True])
def test_nan_logits_fail_only_that_request(deferred: bool, hf_model_dir, kernel_calls) -> None:
    runner = _runner(hf_model_dir("llama"))
    runner.fused_greedy = True
    if deferred:
        runner.execute = lambda so: runner.finish(runner.launch(so))
    sched, out = nan_prefix_step(runner)
    assert kernel_calls
    assert out.errors["bad"] == NONFINITE_ERROR
    assert out.sampled_token_ids["bad"] == []
    assert "ok" not in out.errors and len(out.sampled_token_ids["ok"]) == 1
    sched.run()
    assert len(sched.done["ok"].output) == 3


def test_scaled_logits_keep_the_float32_path(hf_model_dir, kernel_calls) -> None:
    d = hf_model_dir("llama")
    want = _generate(_runner(d), deferred=False, fused=False)
    runner = _runner(d)
    model = runner.model
    h = torch.randn(3, runner.spec.hidden_size)
    assert torch.equal(model.compute_logits_raw(h).float(), model.compute_logits(h))
    base = model.spec
    for spec in (
        dataclasses.replace(base, logits_scaling=2.0),
        dataclasses.replace(base, final_logit_softcap=30.0),
    ):
        model.spec = spec
        assert model.compute_logits_raw(h) is None
    model.spec = dataclasses.replace(base, logits_scaling=0.5)  # monotone: same argmax here
    got = _generate(runner, deferred=False, fused=True)
    assert kernel_calls == []
    assert got == want


def test_env_switch(monkeypatch, hf_model_dir) -> None:
    d = hf_model_dir("llama")
    for value, want in (("1", True), ("0", False), ("auto", torch.cuda.is_available())):
        monkeypatch.setenv(ENV_FUSED_GREEDY, value)
        assert _runner(d).fused_greedy is want


def test_async_engine_same_tokens(monkeypatch, kernel_calls) -> None:
    """The async engine (PENDING tokens fed on the device from the kernel's token rows)."""
    from xlaserve import LLM
    from xlaserve.demo import DEMO_MODEL_DIR

    prompts = ["In the beginning", "And God said", "The LORD is my shepherd"] * 2
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * i) for i in range(len(prompts))]
    kw = dict(max_num_batched_tokens=24, num_kv_blocks=40, block_size=4, max_model_len=128)
    got = {}
    for mode, fused in (("off", "0"), ("on", "1")):
        monkeypatch.setenv(ENV_FUSED_GREEDY, fused)
        llm = LLM(model=DEMO_MODEL_DIR, async_scheduling=mode, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[mode] = [o.outputs[0].token_ids for o in outs]
        if mode == "on":
            assert llm.llm_engine.num_overlapped_steps > 0
            assert llm.llm_engine.runner.num_deferred_steps > 0
    assert kernel_calls
    assert got["on"] == got["off"]
