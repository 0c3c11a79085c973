"""Structured output under async scheduling: step N+1 is launched before step N's tokens are
known, its grammar bitmasks are filled once they are (while N+1's forward runs) and handed to the
runner late (`apply_bitmasks`). The grammar must advance exactly as in the synchronous path.

The threaded fake runner (tests/core/core_fake_runner.py) runs each step on a worker thread
after a delay, so launches really overlap the engine; its sampling waits for the late masks as a
device's would. The tiny random Llama (torch, CPU) checks the same bookkeeping on a real model.
"""

from __future__ import annotations

import json
import os
import re
import sys

import jsonschema
import pytest
import torch
from optional_deps import backend_available

from xlaserve import LLM, SamplingParams
from xlaserve.engine.core import FILL_SWITCH_INTERVAL_S
from xlaserve.engine.llm_engine import LLMEngine
from xlaserve.sampling_params import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["text", "n"],
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["light", "darkness", "firmament"]
BACKENDS = ["torch"] + (["xla"] if backend_available("xla") else [])


def _params() -> list[SamplingParams]:
    """Constrained (schema, regex, choice) and plain greedy requests, mixed. One choice request
    ignores EOS: only its grammar's end (accepting EOS) finishes it."""
    cons = [SO(json=SCHEMA), SO(regex=REGEX), SO(choice=CHOICES), None]
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=40 if cons[i % 4] is not None else 20 + 2 * i,
            ignore_eos=cons[i % 4] is None or i == 2,
            structured_outputs=cons[i % 4],
        )
        for i in range(12)
    ]


def _check(params: list[SamplingParams], outs: list) -> None:  # noqa: ANN001 - RequestOutputs
    for p, o in zip(params, outs, strict=True):
        c = o.outputs[0]
        so = p.structured_outputs
        if so is None:
            assert c.finish_reason == "length" and len(c.token_ids) == p.max_tokens
            continue
        assert c.finish_reason == "stop", c  # every grammar here terminates
        if so.json is not None:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        elif so.regex is not None:
            assert re.fullmatch(REGEX, c.text), c.text
        else:
            assert c.text in CHOICES, c.text


def _fake_llm(tiny_model_dir, mode: str, fill_thread: bool = False) -> LLM:  # noqa: ANN001
    from xlaserve.runner import register_backend

    register_backend("threaded-fake", "core_fake_runner:ThreadedFakeRunner")
    return LLM(
        model=tiny_model_dir("llama"),
        backend="threaded-fake",
        async_scheduling=mode,
        fill_thread=fill_thread,
        block_size=4,
        max_model_len=64,
        max_num_seqs=8,
        num_kv_blocks=20,
        max_num_batched_tokens=24,
        compile_workers=0,  # compile on a thread: no worker process start-up per engine
    )


def _generate(llm: LLM, prompts: list, params: list[SamplingParams]) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs


@pytest.mark.parametrize("fill_thread", [False, True], ids=["fill_inline", "fill_thread"])
def test_fake_runner_async_grammar_equals_sync(tiny_model_dir, fill_thread: bool) -> None:  # noqa: ANN001
    """Constrained and plain requests under real overlap (chunked prefill, preemption): the same
    tokens as the synchronous path, valid under their grammars; async stayed on the whole time
    (every step after the first overlapped) and the masks came late, after launch; with the
    masks filled on the engine thread or on the fill thread."""
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 90 + 3 for j in range(3 + i)]} for i in range(12)
    ]
    params = _params()
    got = {}
    engines: dict[str, LLMEngine] = {}
    pending_on_return = []  # steps that returned with a fill still running on the fill thread
    default_switch = sys.getswitchinterval()
    for mode in ("off", "on"):
        llm = _fake_llm(tiny_model_dir, mode, fill_thread)
        core = llm.llm_engine.core
        step = core.step

        def watched(step=step, core=core) -> list:  # noqa: ANN001
            outs = step()
            pending_on_return.append(core._late_fill is not None)
            # A fill in flight runs at the short switch interval (its GIL hand-offs), and only
            # then.
            short = abs(sys.getswitchinterval() - FILL_SWITCH_INTERVAL_S) < 1e-6
            assert short == pending_on_return[-1], (short, pending_on_return[-1])
            return outs

        core.step = watched
        outs = _generate(llm, prompts, params)
        _check(params, outs)
        got[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        engines[mode] = llm.llm_engine
    assert got["on"] == got["off"]
    eng = engines["on"]
    runner = eng.runner
    assert eng.num_overlapped_steps > 20 and runner.num_overlapped_launches > 20
    assert runner.num_late_masks > 50  # bitmask rows handed over after their step's launch
    assert eng.scheduler.num_preemptions_total > 0
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    assert engines["off"].runner.num_late_masks == 0
    # The fill thread's masks go to their step at the next launch (or that step's finish): a
    # step returns while they are filled, so the fill overlaps the caller's time too.
    assert (sum(pending_on_return) > 20) == fill_thread
    assert sys.getswitchinterval() == default_switch  # given back once the fills ended


def test_fake_runner_async_grammar_abort_mid_flight(tiny_model_dir) -> None:  # noqa: ANN001
    """A constrained request aborted while a step holding it is in flight (its late mask row is
    left out): the others finish valid and equal to a run without the abort."""
    params = _params()[:4]
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i]} for i in range(4)]
    ref = _generate(_fake_llm(tiny_model_dir, "on"), prompts, params)
    llm = _fake_llm(tiny_model_dir, "on")
    eng = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None
    eng.abort_request(["r1"])
    done = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert sorted(done) == ["r0", "r2", "r3"]
    keep = [0, 2, 3]
    _check([params[i] for i in keep], [done[f"r{i}"] for i in keep])
    for i in keep:
        assert done[f"r{i}"].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_runner_async_grammar_equals_sync(tiny_model_dir, backend: str) -> None:  # noqa: ANN001
    """A real runner on a tiny random Llama: async scheduling with grammars gives the
    synchronous path's greedy tokens (late masks applied on the device: the torch runner's
    deferred sampler, the XLA runner's SAMPLE program) and valid output, with chunked
    prefill."""
    prompts = ["In the beginning", "And God said", "the waters", "Let there be light"] * 3
    params = _params()
    got = {}
    for mode in ("off", "on"):
        llm = LLM(
            tiny_model_dir("llama"),
            backend=backend,
            dtype="float32",
            async_scheduling=mode,
            block_size=4,
            num_kv_blocks=256,
            max_model_len=128,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            compile_workers=0,
        )
        outs = _generate(llm, prompts, params)
        _check(params, outs)
        got[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        eng = llm.llm_engine
        assert (eng.num_overlapped_steps > 20) == (mode == "on")
        eng.shutdown()
    assert got["on"] == got["off"]


def test_torch_late_masks_filled_in_place(tiny_model_dir, monkeypatch) -> None:  # noqa: ANN001
    """When every sampling request of a late-mask step is constrained, the engine fills the
    masks straight into the torch runner's upload buffer (`late_bitmask_buffer`, no pack copy):
    the same tokens as with the copy, as the synchronous path and with the fill on the engine
    thread instead of the fill thread (StructuredOutputConfig.fill_thread)."""
    from xlaserve.backends_torch.runner import TorchModelRunner

    prompts = ["In the beginning", "And God said", "the waters", "Let there be light"] * 2
    cons = [SO(regex=REGEX), SO(choice=CHOICES)]  # (they end well within max_tokens)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=cons[i % 2])
        for i in range(len(prompts))
    ]
    kw = dict(backend="torch", dtype="float32", block_size=4, num_kv_blocks=256,
              max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
              compile_workers=0)  # fmt: skip
    got, in_place, threaded = {}, {}, {}
    runs = (("sync", "off", True), ("copy", "on", True), ("in_place", "on", True),
            ("in_place_no_thread", "on", False))  # fmt: skip
    for name, mode, fill_thread in runs:
        if name == "copy":
            monkeypatch.setattr(TorchModelRunner, "late_bitmask_buffer", lambda *a: None)
        else:
            monkeypatch.undo()
        llm = LLM(tiny_model_dir("llama"), async_scheduling=mode, fill_thread=fill_thread, **kw)
        outs = _generate(llm, prompts, params)
        _check(params, outs)
        got[name] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        in_place[name] = llm.llm_engine.runner.num_masks_in_place
        threaded[name] = llm.llm_engine.core._fill_pool is not None
        llm.llm_engine.shutdown()
    assert got["in_place"] == got["copy"] == got["sync"] == got["in_place_no_thread"]
    assert in_place["sync"] == in_place["copy"] == 0
    # (How many steps have only constrained rows depends on when each grammar's compile
    # lands, a thread's timing: 10 or 11 in the runs seen.)
    assert in_place["in_place"] > 3 and in_place["in_place_no_thread"] > 3
    # The fill ran on the fill thread (StructuredOutputConfig.fill_thread) only where asked.
    assert threaded == {"sync": False, "copy": True, "in_place": True, "in_place_no_thread": False}


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)
@pytest.mark.parametrize("mode", ["off", "on"])
def test_torch_grammar_masks_in_the_fused_greedy_kernel(tiny_model_dir, monkeypatch, mode) -> None:  # noqa: ANN001
    """Greedy constrained steps take the argmax of the allowed tokens inside the fused greedy
    kernel (its bitmask input): the tokens of the unfused path (float32 logits, unpacked mask,
    masked_fill, argmax), synchronous and async (late masks, in place or copied), with
    constrained and plain rows mixed in one step."""
    from xlaserve.backends_torch.runner import ENV_FUSED_GREEDY
    from xlaserve.kernels_cuda import sampling

    masked_calls: list[int] = []
    real = sampling.greedy_argmax_packed

    def spy(logits, **kw):  # noqa: ANN001, ANN202
        if kw.get("bitmask") is not None:
            masked_calls.append(logits.shape[0])
        return real(logits, **kw)

    monkeypatch.setattr(sampling, "greedy_argmax_packed", spy)
    prompts = ["In the beginning", "And God said", "the waters", "Let there be light"] * 3
    params = _params()
    kw = dict(backend="torch", dtype="float32", block_size=4, num_kv_blocks=256,
              max_model_len=128, max_num_seqs=12, max_num_batched_tokens=32,
              compile_workers=0, async_scheduling=mode)  # fmt: skip
    got = {}
    for fused in ("0", "1"):
        monkeypatch.setenv(ENV_FUSED_GREEDY, fused)
        llm = LLM(tiny_model_dir("llama"), **kw)
        assert llm.llm_engine.runner.fused_greedy is (fused == "1")
        outs = _generate(llm, prompts, params)
        _check(params, outs)
        got[fused] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        llm.llm_engine.shutdown()
        if fused == "0":
            assert masked_calls == []
    assert got["1"] == got["0"]
    # Steps with grammar rows went through the kernel with their masks (row counts vary with
    # when each grammar's compile lands; some steps mix constrained and plain rows).
    assert len(masked_calls) > 5, masked_calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_torch_grammar_masks_side_stream_and_fused(tiny_model_dir, monkeypatch) -> None:  # noqa: ANN001
    """On CUDA: the masks' upload on its own stream and the argmax inside the fused kernel give
    the tokens of the synchronous unfused path (float32, so the two paths' argmax ties agree),
    with the masks filled in place and through the copy."""
    from xlaserve.backends_torch.runner import ENV_FUSED_GREEDY, TorchModelRunner

    prompts = ["In the beginning", "And God said", "the waters", "Let there be light"] * 3
    params = _params()
    kw = dict(backend="torch", dtype="float32", block_size=16, max_model_len=256,
              max_num_seqs=12, max_num_batched_tokens=64, compile_workers=0)  # fmt: skip
    got = {}
    for name, mode, fused, copy in (("sync_unfused", "off", "0", False), ("async_fused", "on", "1", False),
                                    ("async_fused_copy", "on", "1", True), ("async_unfused", "on", "0", False)):  # fmt: skip
        monkeypatch.setenv(ENV_FUSED_GREEDY, fused)
        if copy:
            monkeypatch.setattr(TorchModelRunner, "late_bitmask_buffer", lambda *a: None)
        llm = LLM(tiny_model_dir("llama"), async_scheduling=mode, **kw)
        outs = _generate(llm, prompts, params)
        _check(params, outs)
        got[name] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        llm.llm_engine.shutdown()
        monkeypatch.undo()
    assert (
        got["async_fused"] == got["sync_unfused"] == got["async_fused_copy"] == got["async_unfused"]
    )
