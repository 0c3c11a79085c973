"""runner_core.py (the backend-neutral runner half) and the capability seam of runner.py, without
a device: the persistent batch, step validation, ragged numpy inputs, PENDING / finish, and the
registry's capability queries."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from xlaserve.runner import (
    CachedRequestData,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    backend_names,
)
from xlaserve.runner_core import (
    NONFINITE_ERROR,
    PENDING,
    LaunchedStep,
    ReqState,
    RunnerCore,
    draft_quota,
    ragged_inputs,
)
from xlaserve.sampling_params import SamplingParams

BS = 4


class _Core(RunnerCore):
    """The core with host-only hooks: tokens of a launch are given by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.block_size = BS
        self.host_tokens: list[int] = []
        self.bad_rows: set[int] = set()

    def _new_state(self, nr: NewRequestData) -> ReqState:
        return ReqState(list(nr.token_ids), nr.num_prompt_tokens, nr.sampling_params,
                        list(nr.block_ids), nr.num_computed_tokens)  # fmt: skip

    def _read_pending(self, launched: LaunchedStep) -> tuple[list[int], set[int]]:
        return self.host_tokens, self.bad_rows


def _new(rid: str, tokens: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(rid, tokens, len(tokens), SamplingParams(max_tokens=8), blocks, computed)


def test_ragged_inputs_match_a_per_token_reference() -> None:
    chunks = [([5, 6, 7], 0, [3, 9]), ([8], 5, [1, 2]), ([1, 2, 3, 4, 5], 2, [4, 6, 0])]
    x = ragged_inputs(chunks, BS)
    ids, pos, slots = [], [], []
    for toks, start, table in chunks:
        for j, t in enumerate(toks):
            p = start + j
            ids.append(t)
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
    assert x.input_ids.tolist() == ids and x.positions.tolist() == pos
    assert x.slot_mapping.tolist() == slots
    assert x.query_start_loc.tolist() == [0, 3, 4, 9]
    assert x.seq_lens.tolist() == [3, 6, 7] and x.max_query_len == 5
    assert x.block_tables.tolist() == [[3, 9, 0], [1, 2, 0], [4, 6, 0]]
    assert x.input_ids.dtype == np.int64 and x.block_tables.dtype == np.int32


def test_persistent_batch_plan_and_outputs() -> None:
    core = _Core()
    so = SchedulerOutput(
        new_requests=[_new("a", [1, 2, 3], [0]), _new("b", [4, 5, 6, 7, 8], [1, 2])],
        num_scheduled_tokens={"a": 3, "b": 2},
        total_num_scheduled_tokens=5,
    )
    core._update_states(so)
    plan = core._plan_step(so)
    assert plan.req_ids == ["a", "b"] and plan.tokens == [[1, 2, 3], [4, 5]]
    assert plan.sampling == [True, False] and plan.starts == [0, 0]
    out = RunnerOutput()
    core._accept(out, "a", core.requests["a"], [42])
    assert core.requests["a"].token_ids == [1, 2, 3, 42]
    assert core.requests["a"].num_computed_tokens == 3 and out.sampled_token_ids["a"] == [42]
    core._fail(out, "b")
    assert out.errors["b"] == NONFINITE_ERROR and "NaN" in NONFINITE_ERROR
    # A cached request extends its table; the scheduler's num_computed wins.
    core._update_states(
        SchedulerOutput(cached_requests=[CachedRequestData("b", [7], 2)], finished_req_ids={"a"})
    )
    assert "a" not in core.requests and core.requests["b"].block_ids == [1, 2, 7]
    with pytest.raises(KeyError, match="unknown to the runner"):
        core._update_states(SchedulerOutput(cached_requests=[CachedRequestData("zz", [], 0)]))


def test_plan_rejects_bad_steps() -> None:
    core = _Core()
    core._update_states(SchedulerOutput(new_requests=[_new("a", [1, 2, 3, 4, 5], [0])]))

    def plan(n: int, drafts: list[int] | None = None, **kw: int) -> None:
        spec = {"a": drafts} if drafts else {}
        core._plan_step(SchedulerOutput(num_scheduled_tokens={"a": n}, spec_token_ids=spec), **kw)

    with pytest.raises(ValueError, match="only 5 tokens are known"):
        plan(6)
    with pytest.raises(ValueError, match="blocks cannot hold 5 tokens"):
        plan(5)  # one block of 4
    core.requests["a"].block_ids.append(1)
    plan(5)
    with pytest.raises(ValueError, match="2 drafts exceed num_speculative_tokens 1"):
        plan(5, [7, 8], max_drafts=1)
    with pytest.raises(ValueError, match="drafts scheduled but the chunk ends at 4"):
        plan(4, [7])
    with pytest.raises(ValueError, match="exceed max_num_seqs 0"):
        plan(5, max_seqs=0)
    with pytest.raises(ValueError, match="not scheduled this step"):
        core._check_drafts(SchedulerOutput(spec_token_ids={"x": [1]}))


def test_pending_tokens_are_fed_and_filled_by_finish() -> None:
    core = _Core()
    so = SchedulerOutput(
        new_requests=[_new("a", [1, 2], [0]), _new("b", [3], [1])],
        num_scheduled_tokens={"a": 2, "b": 1},
        total_num_scheduled_tokens=3,
    )
    core._update_states(so)
    launched = LaunchedStep(RunnerOutput())
    core._defer_token(launched, "a", core.requests["a"], 0)
    core._defer_token(launched, "b", core.requests["b"], 1)
    assert core.requests["a"].token_ids == [1, 2, PENDING]
    # The next step schedules "a" again before finish: its PENDING input is fed on the device.
    plan = core._plan_step(SchedulerOutput(num_scheduled_tokens={"b": 0 + 1, "a": 1}))
    assert plan.feed_dst == [0, 1] and plan.feed_src == [1, 0]
    core.host_tokens, core.bad_rows = [9, 8], {1}
    out = core.finish(launched)
    assert out.sampled_token_ids == {"a": [9]} and out.errors == {"b": NONFINITE_ERROR}
    assert core.requests["a"].token_ids == [1, 2, 9] and launched.pending == []


def test_draft_quota_stops_at_max_tokens_and_model_len() -> None:
    st = ReqState([1, 2, 3, 4], 2, SamplingParams(max_tokens=5), [0], 3)
    assert draft_quota(st, 4, 100) == 2  # 2 outputs, 3 left, the bonus token counts
    assert draft_quota(st, 4, 6) == 1  # max_model_len 6: 2 positions left
    assert draft_quota(st, 0, 100) == 0


def test_core_imports_neither_torch_nor_jax() -> None:
    code = (
        "import sys, xlaserve.runner_core, xlaserve.runner\n"
        "print(any(m in sys.modules for m in ('torch', 'jax')))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_backend_names_message() -> None:
    assert backend_names(["xla"]) == "'xla'"
    assert backend_names(["torch", "xla"]) == "'torch' or 'xla'"
    assert backend_names([]) == "(none installed)"


def test_capabilities_through_the_registry() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    from xlaserve.runner import backends_with, checkpoint_converter, get_capabilities

    torch_caps, xla_caps = get_capabilities("torch"), get_capabilities("xla")
    assert "eagle" in torch_caps.speculative_methods
    assert "eagle" not in xla_caps.speculative_methods
    assert backends_with(lambda c: c.expert_parallel and c.multi_host) == ["xla"]
    assert backends_with(lambda c: "orbax" in c.checkpoint_formats) == ["xla"]
    assert backends_with(lambda c: c.tensor_parallel) == ["torch", "xla"]
    assert callable(checkpoint_converter("orbax"))
    with pytest.raises(ValueError, match="no installed backend writes 'gguf'"):
        checkpoint_converter("gguf")
