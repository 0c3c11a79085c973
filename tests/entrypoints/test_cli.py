"""The click CLI: flags generated from the config dataclasses, env vars, generate and chat."""

from __future__ import annotations

import dataclasses
import json

import pytest
import serve_proc
from click.testing import CliRunner
from ep_helpers import MODEL_NAME

from xlaserve import config as cfg
from xlaserve.entrypoints import cli

SMALL = ["--backend", "torch", "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "64"]


def test_serve_help_lists_every_config_field_grouped() -> None:
    res = CliRunner().invoke(cli.main, ["serve", "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    out = res.output
    for title in (
        "Model options",
        "KV cache options",
        "Scheduler options",
        "Server options",
        "Engine options",
    ):
        assert title in out
    for flag in (
        "--host", "--port", "--backend", "--served-model-name", "--api-key", "--max-model-len",
        "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--num-kv-blocks", "--dtype",
        "--seed", "--enable-prefix-caching / --no-enable-prefix-caching", "--gpu-memory-utilization",
        "--tensor-parallel-size", "--load-format", "--enforce-eager", "--max-num-waiting",
        "--speculative-config", "--max-request-bytes",
    ):  # fmt: skip
        assert flag in out, flag
    assert "Tokens per KV block (page)." in out  # help from the field's comment in config.py
    assert "XLASERVE_" in out
    # every field of every flag section has exactly one flag
    seen = {(p.section, p.field_name) for p in cli.serve.params if isinstance(p, cli._ConfigOption)}
    for section, klass, _ in cli._SECTIONS:
        for f in dataclasses.fields(klass):
            if (section, f.name) not in cli._SKIP:
                assert (section, f.name) in seen, (section, f.name)


def test_serve_flags_and_env_map_onto_config(
    monkeypatch: pytest.MonkeyPatch, model_path: str
) -> None:
    got: dict = {}

    def fake_run(engine_config: cfg.EngineConfig, server_config: cfg.ServerConfig) -> None:
        got["engine"], got["server"] = engine_config, server_config

    # serve's last step is run_server; capture its arguments instead of binding a port
    monkeypatch.setattr("xlaserve.entrypoints.openai.api_server.run_server", fake_run)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    port = serve_proc._free_port()  # serve checks the port is free before anything loads
    args = ["serve", model_path, "--max-num-seqs", "7", "--no-enable-prefix-caching", "--port", str(port),
            "--speculative-config", spec, "--api-key", "k", "--max-num-waiting", "3"]  # fmt: skip
    env = {
        "XLASERVE_BLOCK_SIZE": "32",
        "XLASERVE_SERVED_MODEL_NAME": "m",
        "XLASERVE_MAX_NUM_SEQS": "99",
    }
    res = CliRunner().invoke(cli.main, args, env=env)
    assert res.exit_code == 0, res.output
    e, s = got["engine"], got["server"]
    assert e.model.model == model_path and e.model.served_model_name == "m"
    assert e.scheduler.max_num_seqs == 7  # the flag beats the env var
    assert e.cache.block_size == 32 and e.cache.enable_prefix_caching is False
    assert e.scheduler.max_num_waiting == 3
    assert e.speculative == cfg.SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert (s.port, s.api_keys(), s.host) == (port, ["k"], "127.0.0.1")
    res = CliRunner().invoke(cli.main, ["serve", "--port", str(port)])
    assert res.exit_code == 0 and got["engine"].model.model is None  # no MODEL: the demo model
    res = CliRunner().invoke(cli.main, ["serve", "--max-num-seqs", "0"])
    assert res.exit_code == 2 and res.output == "Error: max_num_seqs must be positive, got 0\n"
    res = CliRunner().invoke(cli.main, ["serve", "--dtype", "int3"])
    assert res.exit_code == 2


def test_generate_streams_greedy_text(model_path: str, server) -> None:  # noqa: ANN001
    import openai

    prompt = "In the beginning"
    args = [
        "generate",
        prompt,
        "--model",
        model_path,
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        *SMALL,
    ]
    res = CliRunner().invoke(cli.main, args)
    assert res.exit_code == 0, res.output
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    want = (
        c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
        .choices[0]
        .text
    )
    assert res.output == prompt + want + "\n"


def test_chat_repl(model_path: str) -> None:
    args = [
        "chat",
        model_path,
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--system",
        "Be brief.",
        *SMALL,
    ]
    res = CliRunner().invoke(cli.main, args, input="Hello\n/reset\nAgain\n/exit\n")
    assert res.exit_code == 0, res.output
    assert res.output.count(">>> ") == 4  # Hello, /reset, Again, /exit
    assert "(history cleared)" in res.output


def test_main_lists_subcommands() -> None:
    res = CliRunner().invoke(cli.main, ["--help"])
    assert res.exit_code == 0
    for name in ("serve", "generate", "chat"):
        assert name in res.output
