"""Optional dependencies in tests: skip when a package is NOT INSTALLED, fail loudly when it is
installed but does not import (a broken install must never turn into silently skipped tests).

`pytest.importorskip` skips on any ImportError, so a jax whose import fails (a bad jaxlib, a
missing shared library) would look like "jax not installed"; these helpers tell the two apart.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest


def is_installed(package: str) -> bool:
    """Whether the top-level package of `package` (e.g. "jax" for "jax.export") is installed;
    looks it up without importing it."""
    return importlib.util.find_spec(package.partition(".")[0]) is not None


def import_or_skip(module: str, package: str | None = None) -> ModuleType:
    """Import `module`; skip (module level) only when `package` (default: the module's top-level
    package) is not installed. An installed package that fails to import raises its error."""
    package = package or module
    if not is_installed(package):
        pytest.skip(f"{package.partition('.')[0]} is not installed", allow_module_level=True)
    return importlib.import_module(module)


def backend_available(backend: str) -> bool:
    """Whether `backend`'s runner can run here: False only when its framework is not installed
    (torch for "torch", jax for "xla"); an installed framework whose runner does not import
    raises (the tests of that backend must fail, not vanish)."""
    framework = {"torch": "torch", "xla": "jax"}[backend]
    if not is_installed(framework):
        return False
    importlib.import_module(f"xlaserve.backends_{backend}.runner")
    return True
