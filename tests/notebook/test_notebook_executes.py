"""examples/batch_inference.ipynb runs top to bottom on CPU (nbclient, a fresh ipykernel)."""

from __future__ import annotations

import os
import sys

import pytest
from optional_deps import import_or_skip

nbformat = import_or_skip("nbformat")
nbclient = import_or_skip("nbclient")
import_or_skip("ipykernel")
import_or_skip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "examples", "batch_inference.ipynb")


def _text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.timeout(900)
def test_batch_inference_notebook_executes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel runs this interpreter (the venv's ipykernel) on the CPU, in a scratch directory.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert code_cells and all(c.get("execution_count") for c in code_cells)
    errors = [o for c in code_cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    text = "\n".join(_text(c) for c in code_cells)
    assert "backend: xla" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("throughput: 48 prompts"))
    assert "input" in line and "output" in line and "tok/s" in line
    out_tok_s = float(line.split("output ")[1].split(" tok/s")[0])
    assert out_tok_s > 0
    images = [
        o
        for c in code_cells
        for o in c.get("outputs", [])
        if o.output_type == "display_data" and "image/png" in o.get("data", {})
    ]
    assert len(images) == 1 and len(images[0]["data"]["image/png"]) > 1000
    assert "same greedy tokens from orbax as from safetensors: True" in text
    assert text.count("batch ") >= 6  # tokens/s per batch size
