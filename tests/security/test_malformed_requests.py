"""Attack class 6: malformed input and operator hygiene. A body that fails to decode is a 400 (a
body that inflates past the limit a 413), a malformed HTTP request logs one line (no traceback),
/v1/models shows no filesystem path, and API keys can stay out of `ps` (--api-key-file,
XLASERVE_API_KEY), several of them, each compared in constant time."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import zlib
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
from click.testing import CliRunner
from ep_helpers import MODEL_NAME, Server, http, serve, wait_until
from sec_helpers import KEY_A, KEY_B, error_of

from xlaserve import config as cfg
from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.entrypoints import cli

URL = "/v1/completions"
BODY = {"model": MODEL_NAME, "prompt": "And God said", "max_tokens": 1}


def _post_raw(server: Server, raw: bytes, encoding: str) -> tuple[int, bytes]:
    headers = {"Content-Encoding": encoding}
    status, _, body = http("POST", server.base_url + URL, raw=raw, headers=headers)
    return status, body


def test_body_that_fails_to_decode_is_400(sec_server: Server) -> None:
    good = gzip.compress(json.dumps(BODY).encode())
    assert _post_raw(sec_server, good, "gzip")[0] == 200
    for raw, enc in [
        (b"\x1f\x8b\x08\x00garbage-not-deflate", "gzip"),
        (good[:-12], "gzip"),  # truncated stream
        (b"not gzip at all", "gzip"),
        (b"\x78\x9cgarbage", "deflate"),
    ]:
        status, body = _post_raw(sec_server, raw, enc)
        assert status == 400, (enc, raw[:12], body)
        assert error_of(body)["code"] == "bad_encoding"
    status, body = _post_raw(sec_server, zlib.compress(json.dumps(BODY).encode()), "deflate")
    assert status == 200, body
    status, body = _post_raw(sec_server, good, "br")
    assert status == 415 and error_of(body)["code"] == "bad_encoding"


def test_gzip_bomb_is_413(sec_server: Server) -> None:
    # 5 MB of spaces after the JSON object: ~5 KB compressed, over the 4 MB inflated limit.
    bomb = gzip.compress(json.dumps(BODY).encode() + b" " * (5 * 1024 * 1024))
    assert len(bomb) < 64 * 1024
    status, body = _post_raw(sec_server, bomb, "gzip")
    assert status == 413 and error_of(body)["code"] == "request_too_large"


def test_malformed_http_request_logs_one_line(
    sec_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    u = urlparse(sec_server.base_url)
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        # A valid method, then a header line with no colon: aiohttp's parser refuses it.
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nthis is not a header\r\n\r\n")
        reply = s.recv(4096)
    assert reply.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    assert wait_until(lambda: any(r.name == "aiohttp.server" for r in caplog.records), 10)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 1
    assert records[0].exc_info is None and "\n" not in records[0].getMessage()
    assert "BadHttpMessage" in records[0].getMessage()


def test_models_endpoint_shows_no_filesystem_path(sec_server: Server, sec_engine: AsyncLLM) -> None:
    status, _, raw = http("GET", sec_server.base_url + "/v1/models")
    assert status == 200
    text = raw.decode()
    path = sec_engine.config.model.model
    assert path and path not in text and "/tmp" not in text
    assert json.loads(raw)["data"][0]["root"] == MODEL_NAME


@pytest.fixture(scope="module")
def two_key_server(
    sec_engine: AsyncLLM, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# tenants\n{KEY_A}\n\n{KEY_B}\n")
    yield from serve(sec_engine, cfg.ServerConfig(api_key_file=str(key_file)))


def test_api_key_file_holds_several_keys(two_key_server: Server) -> None:
    url = two_key_server.base_url + URL
    for key in (KEY_A, KEY_B):
        assert http("POST", url, BODY, {"Authorization": f"Bearer {key}"})[0] == 200
    for bad in ("", "Bearer sk-tenant-", f"Bearer {KEY_A}x", "Bearer # tenants"):
        status, _, raw = http("POST", url, BODY, {"Authorization": bad} if bad else {})
        assert status == 401 and error_of(raw)["code"] == "invalid_api_key"
    assert http("GET", two_key_server.base_url + "/health")[0] == 200  # probes stay open


def test_cli_takes_keys_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    got: dict = {}

    def fake_run(engine_config: cfg.EngineConfig, server_config: cfg.ServerConfig) -> None:
        got["server"] = server_config

    monkeypatch.setattr("xlaserve.entrypoints.openai.api_server.run_server", fake_run)
    key_file = tmp_path / "k"
    key_file.write_text("sk-from-file\n")
    res = CliRunner().invoke(cli.main, ["serve", "--api-key-file", str(key_file)])
    assert res.exit_code == 0, res.output
    assert got["server"].api_keys() == ["sk-from-file"]
    res = CliRunner().invoke(cli.main, ["serve"], env={"XLASERVE_API_KEY": "sk-env-1 sk-env-2"})
    assert res.exit_code == 0, res.output
    assert got["server"].api_keys() == ["sk-env-1", "sk-env-2"]
    res = CliRunner().invoke(cli.main, ["serve", "--api-key", "a", "--api-key", "b"])
    assert got["server"].api_keys() == ["a", "b"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    res = CliRunner().invoke(cli.main, ["serve", "--api-key-file", str(empty)])
    assert res.exit_code != 0 and "holds no key" in res.output
    help_text = CliRunner().invoke(cli.main, ["serve", "--help"]).output
    assert "--api-key-file" in help_text and "XLASERVE_API_KEY" in help_text
