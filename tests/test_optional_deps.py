"""optional_deps: a missing package skips, an installed package that fails to import fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run(code: str, extra_path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([extra_path, _HERE])}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def broken_pkg(tmp_path) -> str:  # noqa: ANN001
    """A package `xls_broken_dep` that is installed (on the path) but raises on import, like a
    jax whose jaxlib does not match."""
    pkg = tmp_path / "xls_broken_dep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libfoo.so: cannot open shared object')\n")
    return str(tmp_path)


def test_missing_package_skips(broken_pkg: str) -> None:
    code = (
        "import pytest, optional_deps\n"
        "try:\n"
        "    optional_deps.import_or_skip('xls_not_installed_dep')\n"
        "except pytest.skip.Exception as e:\n"
        "    print('SKIPPED', e)\n"
    )
    out = _run(code, broken_pkg)
    assert out.returncode == 0 and "SKIPPED xls_not_installed_dep is not installed" in out.stdout


def test_installed_but_broken_package_fails(broken_pkg: str) -> None:
    out = _run("import optional_deps; optional_deps.import_or_skip('xls_broken_dep')", broken_pkg)
    assert out.returncode != 0 and "libfoo.so: cannot open shared object" in out.stderr
    assert "Skipped" not in out.stderr


def test_broken_jax_fails_xla_backend_detection(tmp_path) -> None:  # noqa: ANN001
    """The XLA cases of the structured-output and server tests come from backend_available:
    with a jax that is installed but does not import, it raises instead of returning False."""
    fake = tmp_path / "jax"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('jaxlib version mismatch')\n")
    out = _run("import optional_deps; print(optional_deps.backend_available('xla'))", str(tmp_path))
    assert out.returncode != 0 and "jaxlib version mismatch" in out.stderr
