"""Start-up failures of every CLI command, run as users run them (a subprocess): one
`Error: ...` line on stderr, a non-zero exit, no traceback, and nothing loaded first; "serving on"
only once the port is bound; the served model name is the model argument as given."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request

import pytest
import serve_proc

CLI = [sys.executable, "-m", "xlaserve.entrypoints.cli"]
TIMEOUT_S = 120


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "XLASERVE_LOGGING_LEVEL"}
    full_env.update(PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=full_env
    )


def _one_error_line(res: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The run failed with `code` and said why in exactly one `Error:` line on stderr."""
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error: ")]
    assert len(errors) == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert "serving" not in res.stderr, res.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


@pytest.fixture()
def broken_models(tmp_path, model_path: str) -> dict[str, str]:  # noqa: ANN001
    """Directories that fail the model check: no config.json, unknown architecture, no weights."""
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    unknown = tmp_path / "unknown_arch"
    shutil.copytree(model_path, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["NoSuchForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    for name in os.listdir(model_path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_path, name), no_weights / name)
    return {"no_config": str(no_config), "unknown": str(unknown), "no_weights": str(no_weights)}


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_missing_model_is_one_line(command: str) -> None:
    res = _run(command, "/nonexistent/model", "--port" if command == "serve" else "--system",
               str(serve_proc._free_port()) if command == "serve" else "x")  # fmt: skip
    _one_error_line(res, 2, "/nonexistent/model", "does not exist")


def test_generate_missing_model_is_one_line() -> None:
    res = _run("generate", "hi", "--model", "/nonexistent/model")
    _one_error_line(res, 2, "does not exist")


def test_broken_model_dirs_are_one_line(broken_models: dict[str, str]) -> None:
    port = str(serve_proc._free_port())
    _one_error_line(_run("serve", broken_models["no_config"], "--port", port), 2, "config.json")
    _one_error_line(
        _run("serve", broken_models["unknown"], "--port", port),
        2,
        "unsupported architecture 'NoSuchForCausalLM'",
    )
    _one_error_line(
        _run("generate", "x", "--model", broken_models["no_weights"]), 2, "no weights to load"
    )


def test_bad_port_is_found_before_the_model(model_path: str) -> None:
    # /nonexistent would fail too: the port is checked first, so its error is the one shown.
    _one_error_line(_run("serve", "/nonexistent", "--port", "80000"), 2, "port", "80000")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _run("serve", model_path, "--port", str(port))
    _one_error_line(res, 1, f"port {port}", "already in use")
    assert "engine core" not in res.stderr  # nothing started


def test_bad_sampling_values_stop_before_loading() -> None:
    # The model does not exist: the sampling error coming first shows nothing was loaded.
    res = _run("chat", "/nonexistent", "--temperature", "-1")
    _one_error_line(res, 2, "temperature must be >= 0")
    res = _run("generate", "x", "--model", "/nonexistent", "--top-p", "0")
    _one_error_line(res, 2, "top_p")


def test_bad_config_value_and_log_level_are_one_line() -> None:
    _one_error_line(_run("serve", "--max-num-seqs", "0"), 2, "max_num_seqs must be positive")
    res = _run("generate", "x", env={"XLASERVE_LOGGING_LEVEL": "LOUD"})
    _one_error_line(res, 2, "XLASERVE_LOGGING_LEVEL")


def test_debug_level_prints_the_traceback() -> None:
    res = _run("generate", "x", "--model", "/nonexistent", env={"XLASERVE_LOGGING_LEVEL": "DEBUG"})
    assert res.returncode == 2
    assert "Traceback" in res.stderr and "Error: " in res.stderr


def test_serve_names_the_model_as_given_and_logs_after_bind(model_path: str) -> None:
    port = serve_proc._free_port()
    cmd = [*CLI, "serve", model_path, "--backend", "torch", "--dtype", "float32",
           "--block-size", "4", "--num-kv-blocks", "64", "--no-engine-process",
           "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--port", str(port),
           "--log-stats-interval", "0.2", "--enable-log-requests"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + TIMEOUT_S
        models = None
        while time.monotonic() < end and proc.poll() is None:
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                    models = json.load(r)
                    break
            except OSError:
                time.sleep(0.2)
        assert models is not None, "server did not come up"
        assert [m["id"] for m in models["data"]] == [model_path]
        body = json.dumps({"model": model_path, "prompt": "a b", "max_tokens": 3}).encode()
        req = urllib.request.Request(
            base + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        time.sleep(1.0)  # a few stats intervals pass (the line is checked, not its timing)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"serving {model_path} on http://127.0.0.1:{port}" in out
    assert "Traceback" not in out
    assert "Avg prompt throughput:" in out and "Prefix cache hit rate:" in out
    assert '"POST /v1/completions HTTP/1.1" 200' in out  # the access log (--enable-log-requests)


def test_config_file_errors_are_one_line(tmp_path) -> None:  # noqa: ANN001
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("max-num-seqs: 4\nno-such-flag: 1\n")
    _one_error_line(_run("serve", "--config", str(bad_key)), 2, "unknown option", "no-such-flag")
    bad_yaml = tmp_path / "b.yaml"
    bad_yaml.write_text("port: [1,\n")
    _one_error_line(_run("serve", "--config", str(bad_yaml)), 2, "not valid YAML")
    _one_error_line(_run("serve", "--config", str(tmp_path / "none.yaml")), 2, "--config")
    bad_value = tmp_path / "c.yaml"
    bad_value.write_text("max-num-seqs: 0\n")
    _one_error_line(_run("serve", "--config", str(bad_value)), 2, "max_num_seqs must be positive")


def _self_signed(tmp_path) -> tuple[str, str]:  # noqa: ANN001
    """(key, cert) PEM files of a throwaway certificate for 127.0.0.1 (openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
         cert, "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return key, cert


def test_ssl_from_a_config_file(model_path: str, tmp_path) -> None:  # noqa: ANN001
    key, cert = _self_signed(tmp_path)
    # A certificate is no private key: refused before anything loads.
    _one_error_line(_run("serve", "--ssl-keyfile", cert, "--ssl-certfile", cert), 2, "TLS")
    _one_error_line(_run("serve", "--ssl-certfile", cert), 2, "ssl_keyfile and ssl_certfile")
    port = serve_proc._free_port()
    conf = tmp_path / "serve.yaml"
    conf.write_text(
        f"model: {model_path}\nport: {port}\nssl-keyfile: {key}\nssl-certfile: {cert}\n"
        "served-model-name: from-yaml\nbackend: torch\ndtype: float32\nblock-size: 4\n"
        "num-kv-blocks: 64\nengine-process: false\nmax-num-seqs: 4\n"
        "max-num-batched-tokens: 64\n"
    )
    proc = subprocess.Popen(
        [*CLI, "serve", "--config", str(conf)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    ctx = ssl.create_default_context(cafile=cert)
    try:
        end = time.monotonic() + TIMEOUT_S
        models = None
        while time.monotonic() < end and proc.poll() is None:
            try:
                url = f"https://127.0.0.1:{port}/v1/models"
                with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
                    models = json.load(r)
                    break
            except OSError:
                time.sleep(0.2)
        assert models is not None, "server did not come up"
        assert [m["id"] for m in models["data"]] == ["from-yaml"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"serving from-yaml on https://127.0.0.1:{port}" in out
