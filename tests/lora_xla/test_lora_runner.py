"""Multi-LoRA on the XLA runner, driven by hand-built SchedulerOutputs: a mixed batch of two
adapters and the base model gives transformers' greedy tokens of the base with each adapter
merged (W + B @ A), per request; rewriting a slot mid-run changes only the requests that use it
afterwards, and compiles nothing."""

from __future__ import annotations

import jax
import pytest
from lora_helpers import BUDGET, PROMPTS, drive_lora, hf_merged_greedy, make_adapter
from xla_helpers import make_runner  # tests/backends_xla/xla_helpers.py

from xlaserve.lora import LORA_MODULES, LoRAAdapter
from xlaserve.runner import NewRequestData, SchedulerOutput
from xlaserve.sampling_params import SamplingParams

LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_events: dict[str, int] = {}
MAX_LORAS, MAX_RANK = 2, 8


def _listener(event: str, duration: float, **kwargs: object) -> None:
    if event in (LOWERING_EVENT, BACKEND_COMPILE_EVENT):
        _events[event] = _events.get(event, 0) + 1


@pytest.fixture(scope="module")
def lora_runner(tiny_model_dir, jax_cache_dir):  # noqa: ANN001, ANN201
    jax.monitoring.register_event_duration_secs_listener(_listener)
    path = tiny_model_dir("llama")
    runner = make_runner(
        path, jax_cache_dir, max_num_batched_tokens=BUDGET, max_num_seqs=4,
        enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK,
    )  # fmt: skip
    spec = runner.spec
    adapters = {
        "a1": make_adapter(spec, "a1", 1, 4, ("q_proj", "v_proj", "o_proj", "down_proj"), seed=1),
        "a2": make_adapter(spec, "a2", 2, MAX_RANK, LORA_MODULES, seed=2),
        "a3": make_adapter(spec, "a3", 3, 6, ("k_proj", "gate_proj", "up_proj"), seed=3),
    }
    yield path, runner, adapters
    runner.shutdown()


def test_mixed_batch_matches_merged_transformers(lora_runner) -> None:  # noqa: ANN001
    path, runner, ad = lora_runner
    assert runner.capabilities.lora
    # requests: a1, base, a2, a1 (two requests share a slot; mixed prompt lengths, chunked)
    slots = [0, -1, 1, 0]
    got = drive_lora(runner, PROMPTS, slots, [(0, ad["a1"]), (1, ad["a2"])], "m")
    by_slot = {0: ad["a1"], 1: ad["a2"], -1: None}
    want = [hf_merged_greedy(path, by_slot[s], p) for s, p in zip(slots, PROMPTS, strict=True)]
    assert got == want
    # The adapters matter: the base model's tokens differ for the adapter requests.
    base = [hf_merged_greedy(path, None, p) for p in PROMPTS]
    assert all(got[i] != base[i] for i in (0, 2, 3)) and got[1] == base[1]


def test_slot_rewrite_changes_only_its_requests_and_compiles_nothing(lora_runner) -> None:  # noqa: ANN001
    path, runner, ad = lora_runner
    drive_lora(runner, PROMPTS[:2], [0, 1], [(0, ad["a1"]), (1, ad["a2"])], "w")  # warm every shape
    programs, lazy = set(runner.programs), list(runner.lazy_compiles)
    writes = runner.lora_tables.write_cache_size()
    before = dict(_events)
    # slot 1: a2 -> a3 (rank 6, other modules: a2's rows must be gone); slot 0 keeps a1.
    slots = [0, 1, -1, 1]
    got = drive_lora(runner, PROMPTS, slots, [(1, ad["a3"])], "r")
    by_slot = {0: ad["a1"], 1: ad["a3"], -1: None}
    want = [hf_merged_greedy(path, by_slot[s], p) for s, p in zip(slots, PROMPTS, strict=True)]
    assert got == want
    assert set(runner.programs) == programs and runner.lazy_compiles == lazy
    assert runner.lora_tables.write_cache_size() == writes == 1
    for ev in (LOWERING_EVENT, BACKEND_COMPILE_EVENT):
        assert _events.get(ev, 0) == before.get(ev, 0), f"{ev}: compiled while serving"


def test_bad_adapters_and_slots_are_clear_errors(lora_runner) -> None:  # noqa: ANN001
    _, runner, ad = lora_runner
    spec = runner.spec
    big = make_adapter(spec, "big", 9, MAX_RANK + 1, ("q_proj",), seed=4)
    with pytest.raises(ValueError, match="max_lora_rank"):
        runner.execute(SchedulerOutput(lora_loads=[(0, big)]))
    wrong = make_adapter(spec, "wrong", 9, 2, ("q_proj",), seed=4)
    a, b = wrong.weights[(0, "q_proj")]
    wrong.weights[(0, "q_proj")] = (a[:, :-1], b)
    with pytest.raises(ValueError, match="do not fit"):
        runner.execute(SchedulerOutput(lora_loads=[(0, wrong)]))
    missing = LoRAAdapter("x", 9, 2, 1.0, {(spec.num_layers, "q_proj"): (a, b)})
    with pytest.raises(ValueError, match="no LoRA table"):
        runner.execute(SchedulerOutput(lora_loads=[(0, missing)]))
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(SchedulerOutput(lora_loads=[(MAX_LORAS, ad["a1"])]))
    nr = NewRequestData(
        "bad", [1, 2], 2, SamplingParams(temperature=0.0), [0], 0, lora_slot=MAX_LORAS
    )
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(SchedulerOutput(new_requests=[nr], num_scheduled_tokens={"bad": 2},
                                       total_num_scheduled_tokens=2))  # fmt: skip
    runner.requests.pop("bad", None)


def test_qk_norm_family_mixed_batch_matches_merged_transformers(
    tiny_model_dir, jax_cache_dir
) -> None:  # noqa: ANN001
    """Qwen3 (qk-norm after the projections): the deltas land before the norms, as merged."""
    path = tiny_model_dir("qwen3")
    runner = make_runner(
        path, jax_cache_dir, max_num_batched_tokens=BUDGET, max_num_seqs=4,
        enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK,
    )  # fmt: skip
    try:
        a1 = make_adapter(runner.spec, "a1", 1, MAX_RANK, LORA_MODULES, seed=5)
        a2 = make_adapter(runner.spec, "a2", 2, 2, ("q_proj", "k_proj", "up_proj"), seed=6)
        slots = [1, 0, -1, 0]
        got = drive_lora(runner, PROMPTS, slots, [(0, a1), (1, a2)], "q")
    finally:
        runner.shutdown()
    by_slot = {0: a1, 1: a2, -1: None}
    want = [hf_merged_greedy(path, by_slot[s], p) for s, p in zip(slots, PROMPTS, strict=True)]
    assert got == want
    assert got[1] != hf_merged_greedy(path, None, PROMPTS[1])


def test_lora_impl_is_a_kernel_config_field(tiny_model_dir, jax_cache_dir, monkeypatch) -> None:  # noqa: ANN001
    """KernelConfig.lora_impl (not a process-wide variable) picks the runner's shrink / expand
    implementation; XLASERVE_LORA_IMPL is only KernelConfig.from_env's override; a bad name is a
    clear error."""
    from xlaserve.config import EngineConfig, KernelConfig

    monkeypatch.delenv("XLASERVE_LORA_IMPL", raising=False)
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="lora_impl must be one of"):
        EngineConfig.from_kwargs(model=path, lora_impl="gather")
    env = {"XLASERVE_LORA_IMPL": "reference"}
    assert KernelConfig.from_env({}).lora_impl == "auto"
    assert KernelConfig.from_env(env).lora_impl == "reference"
    assert KernelConfig.from_env(env, lora_impl="xla").lora_impl == "xla"  # explicit wins
    runner = make_runner(
        path, jax_cache_dir, max_num_batched_tokens=BUDGET, max_num_seqs=4,
        enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, lora_impl="reference",
    )  # fmt: skip
    try:
        assert runner.lora_tables.impl == "reference"  # "auto" would be "xla" on the CPU
        ad = make_adapter(runner.spec, "a2", 2, MAX_RANK, LORA_MODULES, seed=2)
        got = drive_lora(runner, PROMPTS[:2], [0, -1], [(0, ad)], "i")
        assert got == [
            hf_merged_greedy(path, ad, PROMPTS[0]),
            hf_merged_greedy(path, None, PROMPTS[1]),
        ]
    finally:
        runner.shutdown()
