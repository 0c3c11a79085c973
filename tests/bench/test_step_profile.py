"""bench/step_profile.py on the CPU: both backends on the demo model (tiny run), the XLA row with
XLA:CPU's ops read from the trace (the thread-pool lines) and the engine's parts by name."""

from __future__ import annotations

import json

from xlaserve.bench.step_profile import main
from xlaserve.demo import demo_model_path


def test_cpu_run_reports_steps_parts_and_xla_ops(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "sp.json"
    main(["--model", str(demo_model_path()), "--batches", "2", "--steps", "3", "--warmup", "1",
          "--prompt-len", "4", "--max-model-len", "64", "--output-json", str(out)])  # fmt: skip
    res = json.loads(out.read_text())
    for backend in ("xla", "torch"):
        row = res[backend]["batch2"]
        assert row["steps"] == 3 and row["wall_ms_plain"] > 0 and row["tok_s"] > 0
        assert "schedule" in row["host_ms"]
    xla = res["xla"]["batch2"]
    assert "runner.forward_dispatch" in xla["host_ms"]
    ops = xla["kernel_ms"]  # XLA:CPU op names (fusions, dots), no runtime spans
    assert ops and not any(n.startswith(("ThunkExecutor", "SlinkyThreadPool")) for n in ops)
    assert xla["device_busy_ms"] > 0
