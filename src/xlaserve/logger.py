"""Logging set-up shared by the CLI and offline use (`LLM`).

`XLASERVE_LOGGING_LEVEL` (DEBUG, INFO, WARNING, ERROR; default INFO) sets the level of every
`xlaserve.*` logger, for `xlaserve serve` and for `LLM(...)` in a script or notebook alike
(vLLM's `VLLM_LOGGING_LEVEL`). `XLASERVE_CONFIGURE_LOGGING=0` leaves logging to the application.
At DEBUG, start-up failures of the CLI also print their traceback.
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "XLASERVE_LOGGING_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def logging_level(default: str = "INFO") -> int:
    """The level `XLASERVE_LOGGING_LEVEL` names (`default` when unset). ValueError when unknown."""
    raw = os.environ.get(LEVEL_ENV, default).strip().upper() or default
    if raw not in _LEVELS:
        raise ValueError(f"{LEVEL_ENV} must be one of {', '.join(_LEVELS)}, got {raw!r}")
    return getattr(logging, raw)


def debug_enabled() -> bool:
    """True when `XLASERVE_LOGGING_LEVEL=DEBUG` (tracebacks on start-up errors)."""
    try:
        return logging_level() <= logging.DEBUG
    except ValueError:
        return False


def configure_logging(root: bool = False, default: str = "INFO") -> int:
    """Apply `XLASERVE_LOGGING_LEVEL` (`default` when unset); returns the level.

    `root=True` (the CLI, which owns the process): the root logger gets the handler, so aiohttp's
    access log shows too. `root=False` (offline `LLM`): only the `xlaserve` logger gets a stderr
    handler, and only when neither it nor the root logger has one (an application that set up
    logging keeps its own)."""
    if os.environ.get("XLASERVE_CONFIGURE_LOGGING", "1") == "0":
        return logging.getLogger("xlaserve").getEffectiveLevel()
    level = logging_level(default)
    pkg = logging.getLogger("xlaserve")
    pkg.setLevel(level)
    if root:
        logging.basicConfig(level=level, format=FORMAT, stream=sys.stderr)
        logging.getLogger().setLevel(level)
    elif not pkg.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        pkg.addHandler(handler)
    return level
