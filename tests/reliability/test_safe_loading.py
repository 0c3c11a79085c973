"""Safe loading: safetensors by default; pickle checkpoints only when asked for explicitly, and then
through `torch.load(weights_only=True)`; no code shipped with a checkpoint is ever run; the model a
server serves (name and path) is fixed at start-up and never taken from a request."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from ep_helpers import MODEL_NAME
from rel_helpers import Client, check_error_body

from xlaserve import LLM, SamplingParams
from xlaserve.entrypoints import cli

PROMPTS = ["In the beginning", "And God said"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LLM_KW = dict(backend="torch", dtype="float32", block_size=4, num_kv_blocks=64)


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def pickle_only_dir(rel_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with its weights as pytorch_model.bin (a pickle) and no safetensors."""
    import torch
    from safetensors.torch import load_file

    d = str(tmp_path_factory.mktemp("pickle-only"))
    for name in os.listdir(rel_model_path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(rel_model_path, name), d)
    state = load_file(os.path.join(rel_model_path, "model.safetensors"))
    torch.save(state, os.path.join(d, "pytorch_model.bin"))
    return d


def test_pickle_needs_explicit_opt_in(pickle_only_dir: str, rel_model_path: str) -> None:
    with pytest.raises(FileNotFoundError, match="allow_pickle=True"):
        LLM(model=pickle_only_dir, **LLM_KW)
    with pytest.raises(ValueError, match="allow_pickle=True"):
        LLM(model=pickle_only_dir, load_format="pt", **LLM_KW)
    ref = LLM(model=rel_model_path, **LLM_KW)
    want = _greedy(ref)
    ref.llm_engine.shutdown()
    llm = LLM(model=pickle_only_dir, load_format="pt", allow_pickle=True, **LLM_KW)
    try:
        assert _greedy(llm) == want
        assert all(len(t) == 8 for t in want)
    finally:
        llm.llm_engine.shutdown()


class _Payload:
    """Unpickling this runs `open(marker, "w")`: a stand-in for arbitrary code execution."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def test_malicious_pickle_is_refused(pickle_only_dir: str, tmp_path) -> None:  # noqa: ANN001
    import torch

    evil = tmp_path / "evil"
    shutil.copytree(pickle_only_dir, evil)
    marker = tmp_path / "pwned"
    with open(evil / "pytorch_model.bin", "wb") as f:
        # A real torch zip checkpoint whose pickle calls open() when loaded without weights_only.
        torch.save({"model.embed_tokens.weight": _Payload(str(marker))}, f)
    # The payload is live: the same kind of checkpoint, loaded unsafely (weights_only=False) in
    # a child process, does create its marker file.
    probe = tmp_path / "probe-marker"
    torch.save({"model.embed_tokens.weight": _Payload(str(probe))}, tmp_path / "probe.bin")
    unsafe = f"import torch; torch.load({str(tmp_path / 'probe.bin')!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", unsafe], check=False, timeout=120)
    assert probe.exists(), "the payload should run under an unsafe load"
    # xlaserve loads it with weights_only=True: refused, and nothing was written.
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|global"):
        LLM(model=str(evil), load_format="pt", allow_pickle=True, **LLM_KW)
    assert not marker.exists()


def test_trust_remote_code_refused(rel_model_path: str) -> None:
    with pytest.raises(ValueError, match="trust_remote_code is not supported"):
        LLM(model=rel_model_path, trust_remote_code=True, **LLM_KW)
    res = CliRunner().invoke(cli.main, ["serve", rel_model_path, "--trust-remote-code"])
    assert res.exit_code != 0
    assert "trust_remote_code is not supported" in res.output
    res = CliRunner().invoke(
        cli.main, ["generate", "--model", rel_model_path, "--trust-remote-code", "hi"]
    )
    assert res.exit_code != 0 and "trust_remote_code is not supported" in res.output


@pytest.mark.parametrize(
    "route", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
)
def test_model_path_in_request_is_not_loaded(
    fuzz_client: Client,
    fuzz_server,
    rel_model_path: str,
    pickle_only_dir: str,
    route: str,  # noqa: ANN001
) -> None:
    base = {
        "/v1/completions": {"prompt": "x", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        "/tokenize": {"prompt": "x"},
        "/detokenize": {"tokens": [1]},
    }[route]
    for model in (
        rel_model_path,
        pickle_only_dir,
        "/etc/passwd",
        "../" * 8 + "tmp",
        "hf-internal/x",
    ):
        r = fuzz_client.send("POST", route, {**base, "model": model})
        assert r.status == 404, (model, r.body)
        err = check_error_body(r)
        assert err["code"] == "model_not_found" and err["param"] == "model"
    assert fuzz_server.engine.model_name == MODEL_NAME
    assert fuzz_client.send("POST", route, {**base, "model": MODEL_NAME}).status == 200
