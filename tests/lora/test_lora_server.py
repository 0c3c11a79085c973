"""LoRA on the server, end to end: `xlaserve serve --enable-lora --lora-modules ...` in a
subprocess (engine core in its own process), the official openai client: /v1/models lists the
adapters under the base, a completion picks one by `model` (tokens equal transformers with the
adapter merged), unknown names are 404, runtime load / unload (env-gated), a bad adapter is a
400 and the server keeps serving."""

from __future__ import annotations

import json

import openai
import pytest
import serve_proc
from ep_helpers import http
from lora_utils import ALL, ATTN, merge_into, write_peft
from tiny_models import hf_greedy

PROMPT = [5, 17, 33, 2, 90, 41]
NEW = 6


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-server")
    a1 = write_peft(str(root / "a1"), base, rank=4, alpha=8.0, targets=ALL, seed=11)
    a2 = write_peft(str(root / "a2"), base, rank=8, alpha=8.0, targets=ATTN, seed=12, std=0.5)
    a3 = write_peft(str(root / "a3"), base, rank=4, alpha=4.0, targets=ALL, seed=13)
    bad = write_peft(str(root / "bad"), base, rank=32)
    want = {
        "tiny": hf_greedy(base, [PROMPT], NEW)[0],
        "a1": hf_greedy(merge_into(base, a1, str(root / "m1")), [PROMPT], NEW)[0],
        "a3": hf_greedy(merge_into(base, a3, str(root / "m3")), [PROMPT], NEW)[0],
    }
    return base, a1, a2, a3, bad, want


@pytest.fixture(scope="module")
def server(setup):  # noqa: ANN001, ANN201
    base, a1, a2, *_ = setup
    mp = pytest.MonkeyPatch()
    mp.setenv("XLASERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    js = json.dumps({"name": "a2", "path": a2, "base_model_name": "tiny"})
    # vLLM's form: several modules after one flag (name=path and JSON).
    proc = serve_proc.start(base, "torch", "tiny", "--enable-lora", "--max-loras", "2",
                            "--max-lora-rank", "8", "--lora-modules", f"a1={a1}", js)  # fmt: skip
    mp.undo()
    yield proc
    proc.stop()


def _complete(server, model: str) -> list[int]:  # noqa: ANN001
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=0,
                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip
    assert r.usage.completion_tokens == NEW and r.model == model  # vLLM: the adapter's name
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_models_and_adapter_completions(server, setup) -> None:  # noqa: ANN001
    want = setup[-1]
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    models = {m.id: m for m in c.models.list().data}
    assert set(models) == {"tiny", "a1", "a2"}
    assert models["a1"].model_extra["parent"] == "tiny"
    assert models["a2"].model_extra["parent"] == "tiny"
    assert c.models.retrieve("a1").id == "a1"
    base_toks = _complete(server, "tiny")
    a1_toks = _complete(server, "a1")
    assert base_toks == want["tiny"]
    assert a1_toks == want["a1"] and a1_toks != base_toks
    chat = c.chat.completions.create(model="a2", max_tokens=4,
                                     messages=[{"role": "user", "content": "light"}])  # fmt: skip
    assert chat.choices[0].message.content is not None and chat.model == "a2"
    with pytest.raises(openai.NotFoundError):
        _complete(server, "nope")


def test_runtime_load_unload_and_bad_adapter(server, setup) -> None:  # noqa: ANN001
    _, a1, _, a3, bad, want = setup
    url = server.base_url + "/v1/load_lora_adapter"
    status, _, body = http("POST", url, {"lora_name": "bad", "lora_path": bad})
    assert (
        status == 400 and "rank 32 exceeds max_lora_rank 8" in json.loads(body)["error"]["message"]
    )
    status, _, body = http("POST", url, {"lora_name": "gone", "lora_path": "/no/such/dir"})
    assert status == 400 and "not a directory" in body.decode()
    assert _complete(server, "tiny") == want["tiny"]  # still serving
    status, _, _ = http("POST", url, {"lora_name": "a3", "lora_path": a3})
    assert status == 200
    assert _complete(server, "a3") == want["a3"]
    status, _, _ = http("POST", url, {"lora_name": "a3", "lora_path": a3})
    assert status == 400  # the name is taken
    unload = server.base_url + "/v1/unload_lora_adapter"
    assert http("POST", unload, {"lora_name": "a3"})[0] == 200
    assert http("POST", unload, {"lora_name": "a3"})[0] == 404
    with pytest.raises(openai.NotFoundError):
        _complete(server, "a3")
    # The name comes back with another adapter: a fresh id, so no prefix-cache block or host
    # cache entry of the old one is used.
    assert http("POST", url, {"lora_name": "a3", "lora_path": a1})[0] == 200
    assert _complete(server, "a3") == want["a1"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--lora-modules", "a=/x"], ["--lora-modules needs --enable-lora"]),
        (["--enable-lora", "--lora-modules", "just-a-name"], ["expected name=path"]),
    ],
)
def test_serve_lora_flag_errors(args: list[str], words: list[str]) -> None:
    """Bad LoRA flags stop `xlaserve serve` with one error line before anything loads."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "xlaserve.entrypoints.cli", "serve", *args],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.stderr
