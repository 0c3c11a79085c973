"""Start-up checks the CLI runs before it loads anything (no torch, no jax, no weights read).

Each check raises `StartupError` with one line a user can act on; the CLI prints it as
`Error: <line>` on stderr and exits non-zero (exit 2 for a bad argument, 1 otherwise), with no
traceback unless `XLASERVE_LOGGING_LEVEL=DEBUG` asks for one.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

from xlaserve.config import EngineConfig, ServerConfig


class StartupError(Exception):
    """A start-up failure reported as one line. `exit_code` 2 = bad argument, 1 = other."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class ModelCheck:
    """What the model check found: the resolved directory and its architecture."""

    model_dir: str
    architecture: str


def check_port(host: str, port: int, reuse_port: bool = False) -> None:
    """`port` is in 1..65535 and `host:port` can be bound now (nobody listens there).

    The socket is closed again at once: aiohttp binds for real after the model loaded. With
    `reuse_port` (several front processes share the port) the probe sets SO_REUSEPORT too, as the
    fronts do, so it finds the same conflicts they would."""
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise StartupError(f"--port must be in 1..65535, got {port}", exit_code=2)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"--host {host!r} cannot be resolved: {e.strerror}", 2) from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # aiohttp sets SO_REUSEADDR too: a port in TIME_WAIT is usable, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port and hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartupError(
                    f"port {port} on {host} is already in use; pass a free --port"
                ) from None
            if e.errno == errno.EACCES:
                raise StartupError(
                    f"no permission to bind {host}:{port} (ports below 1024 need root)"
                ) from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise StartupError(f"--host {host} is not an address of this machine", 2) from None
            raise StartupError(f"cannot bind {host}:{port}: {e.strerror or e}") from None


def check_model(config: EngineConfig) -> ModelCheck:
    """The model argument names an HF-layout directory (or a hub id this machine can fetch)
    with a config.json of a known architecture and weights to load."""
    from xlaserve.model_loader.registry import get_adapter, read_hf_config
    from xlaserve.model_loader.resolve import is_orbax_dir, resolve_model_dir

    mc = config.model
    try:
        model_dir = resolve_model_dir(mc.model, mc.revision, config.load.download_dir)
    except (FileNotFoundError, ValueError) as e:
        raise StartupError(str(e), exit_code=2) from None
    try:
        hf = read_hf_config(model_dir)
        arch = hf["architectures"][0]
        get_adapter(arch)
    except (FileNotFoundError, ValueError, KeyError, IndexError) as e:
        raise StartupError(str(e), exit_code=2) from None
    except OSError as e:  # unreadable, or config.json is not JSON (JSONDecodeError is ValueError)
        raise StartupError(f"{model_dir}: cannot read config.json: {e}", 2) from None
    if mc.tokenizer is not None and not os.path.isdir(os.path.expanduser(mc.tokenizer)):
        raise StartupError(f"--tokenizer {mc.tokenizer!r} is not a directory", exit_code=2)
    _check_weights(model_dir, config.load.load_format, is_orbax_dir(model_dir))
    return ModelCheck(model_dir, arch)


def _check_weights(model_dir: str, load_format: str, orbax: bool) -> None:
    """Weights the load format will read exist in `model_dir` ("dummy" needs none)."""
    if load_format == "dummy" or orbax or load_format == "orbax":
        return  # orbax: the checkpoint reader reports its own layout errors
    names = os.listdir(model_dir)
    if load_format == "pt":
        if not any(n.endswith((".bin", ".pt", ".pth")) for n in names):
            raise StartupError(f"{model_dir}: no .bin/.pt checkpoint files", exit_code=2)
        return
    from xlaserve.model_loader.weights import safetensors_files

    try:
        safetensors_files(model_dir)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise StartupError(f"no weights to load: {e}", exit_code=2) from None


def check_serve(engine_config: EngineConfig, server_config: ServerConfig) -> ModelCheck:
    """Every check `xlaserve serve` runs before loading: TLS files, the port, then the model."""
    try:
        server_config.ssl_context()
    except ValueError as e:
        raise StartupError(str(e), exit_code=2) from None
    check_port(
        server_config.host,
        server_config.port,
        reuse_port=(server_config.api_server_count or 1) > 1,
    )
    return check_model(engine_config)
