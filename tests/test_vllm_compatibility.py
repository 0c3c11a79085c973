"""docs/vllm_compatibility.md is checked against the code: a row's status must be true now."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re

import click
import pytest

from xlaserve.engine.llm import LLM
from xlaserve.entrypoints import cli
from xlaserve.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "vllm_compatibility.md")
STATUSES = {"same", "renamed", "different", "missing", "xlaserve-only"}
PRESENT = {"same", "renamed", "different", "xlaserve-only"}
# What issue 29 asked for: none of these may be "missing".
ISSUE_29 = {
    "serve flags": ["--chat-template", "--max-logprobs", "--config", "--disable-log-stats",
                    "--enable-log-requests", "--ssl-keyfile", "--ssl-certfile",
                    "--served-model-name"],
    "SamplingParams fields": ["bad_words", "allowed_token_ids", "truncate_prompt_tokens",
                              "logits_processors", "output_kind"],
    "LLM methods": ["beam_search", "chat(chat_template=)", "chat(continue_final_message=)",
                    "chat(tools=)", "chat(chat_template_kwargs=)", "get_default_sampling_params"],
}  # fmt: skip


def _tables() -> dict[str, list[tuple[str, str, str]]]:
    """Section title -> rows (vLLM name, xlaserve name, status), backticks stripped."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    section = None
    with open(DOC, encoding="utf-8") as f:
        for line in f:
            if line.startswith("## "):
                section = line[3:].strip()
                out[section] = []
            elif section and line.startswith("|") and not line.startswith(("| vLLM", "|---")):
                cells = [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]
                assert len(cells) == 4, line
                out[section].append((cells[0], cells[1], cells[2]))
    return out


TABLES = _tables()


def _checked(section: str) -> list[tuple[str, str, str]]:
    rows = TABLES[section]
    assert rows, section
    for row in rows:
        assert row[2] in STATUSES, row
    return rows


def _serve_flags() -> set[str]:
    return {
        o
        for p in cli.serve.params
        if isinstance(p, click.Option)
        for o in (*p.opts, *p.secondary_opts)
    }


def test_serve_flags() -> None:
    flags = _serve_flags() | {"model"}
    for vllm, ours, status in _checked("serve flags"):
        if status in PRESENT and ours.startswith("--"):
            assert ours in flags, f"{ours} is marked {status} but serve has no such flag"
        elif status in PRESENT:
            assert ours in ("model", "XLASERVE_LOGGING_LEVEL"), ours
        if status == "missing":
            assert ours == "—" and vllm not in flags, f"{vllm} exists now: update its row"


def test_sampling_params_fields() -> None:
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    rows = _checked("SamplingParams fields")
    for vllm, ours, status in rows:
        if status in PRESENT:
            assert ours in fields, f"SamplingParams has no field {ours}"
        if status == "missing":
            assert vllm not in fields, f"{vllm} exists now: update its row"
    listed = {ours for _, ours, _ in rows}
    assert fields - listed == set(), f"add rows for {sorted(fields - listed)}"


def _llm_names() -> set[str]:
    names = {n for n, _ in inspect.getmembers(LLM, inspect.isfunction) if not n.startswith("_")}
    for n in list(names):
        for p in inspect.signature(getattr(LLM, n)).parameters:
            names.add(f"{n}({p}=)")
    return names


def test_llm_methods() -> None:
    names = _llm_names()
    rows = _checked("LLM methods")
    for vllm, ours, status in rows:
        if status in PRESENT:
            assert ours in names, f"LLM has no {ours}"
        if status == "missing":
            assert vllm not in names, f"LLM.{vllm} exists now: update its row"
    listed = {ours for _, ours, _ in rows}
    public = {n for n in names if "(" not in n}
    assert public - listed == set(), f"add rows for {sorted(public - listed)}"


def _routes() -> set[str]:
    src = ""
    d = os.path.join(ROOT, "src", "xlaserve", "entrypoints", "openai")
    for name in ["api_server.py", *sorted(n for n in os.listdir(d) if n.startswith("serving_"))]:
        with open(os.path.join(d, name)) as f:
            src += f.read()
    routes = {
        f"{m.upper()} {path}"
        for m, path in re.findall(r'add_(get|post|put|delete)\(\s*"([^"]+)"', src)
    }
    # Paths registered in a loop: `for path in ("/a", "/b"): app.router.add_post(path, ...)`.
    for paths, m in re.findall(
        r"for path in \(([^)]*)\):\s*app\.router\.add_(get|post)\(path", src
    ):
        routes |= {f"{m.upper()} {p}" for p in re.findall(r'"([^"]+)"', paths)}
    # Paths registered from a table: `POOLING_PATHS: dict[str, str] = {"/path": handler, ...}`
    # (serving_pooling.py: `app.router.add_post(path, ...)` for each key).
    for table in re.findall(r"POOLING_PATHS: dict\[str, str\] = \{([^}]*)\}", src):
        routes |= {f"POST {p}" for p in re.findall(r'"([^"]+)":', table)}
    return routes


def test_endpoints() -> None:
    routes = _routes()
    assert "POST /v1/completions" in routes  # the parser sees the routes
    rows = _checked("Endpoints")
    for vllm, ours, status in rows:
        if status in PRESENT:
            assert ours in routes, f"no route {ours}"
        if status == "missing":
            assert vllm not in routes, f"{vllm} exists now: update its row"
    listed = {ours for _, ours, _ in rows}
    assert routes - listed == set(), f"add rows for {sorted(routes - listed)}"


def test_metrics() -> None:
    src = ""
    for path in ("src/xlaserve/metrics.py", "src/xlaserve/engine/dp.py"):
        with open(os.path.join(ROOT, path)) as f:
            src += f.read()
    for _vllm, ours, status in _checked("Metrics"):
        if status in PRESENT:
            # The per-phase histograms are made in a loop: f"xlaserve:request_{name}_time_seconds".
            phase = re.fullmatch(r"xlaserve:request_(\w+)_time_seconds", ours)
            made = phase is not None and '"xlaserve:request_{name}_time_seconds"' in src
            assert f'"{ours}"' in src or (made and f'("{phase[1]}",' in src), f"no metric {ours}"


@pytest.mark.parametrize("section", sorted(ISSUE_29))
def test_issue_29_items_are_not_missing(section: str) -> None:
    by_name = {vllm: status for vllm, _, status in TABLES[section]}
    for name in ISSUE_29[section]:
        assert by_name.get(name) not in (None, "missing"), (section, name)
