"""Packaging: `pip install .` maps every folder into the one import package; imports stay light."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBPACKAGES = [
    "backends_torch",
    "backends_xla",
    "models_flax",
    "kernels_pallas",
    "kernels_cuda",
    "bench",
    "engine",
    "core",
    "entrypoints",
]


def test_regular_install_maps_all_folders(tmp_path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            ROOT,
        ],
        check=True,
        capture_output=True,
    )
    code = (
        "import importlib, xlaserve, os;"
        f"mods = {SUBPACKAGES!r};"
        "[importlib.util.find_spec('xlaserve.' + m) or exit('missing ' + m) for m in mods];"
        "print(os.path.dirname(xlaserve.__file__))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(target)},
        cwd=str(tmp_path),
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip().startswith(str(target))
    # the demo model ships as package data, and the CUTLASS kernel's source (built on use)
    assert (target / "xlaserve" / "assets" / "demo-kjv" / "config.json").exists()
    assert (target / "xlaserve" / "kernels_cuda" / "csrc" / "w8a16_gemm_sm90.cu").exists()


def test_editable_install_points_at_the_tree() -> None:
    import xlaserve
    import xlaserve.backends_torch

    assert xlaserve.__file__.startswith(os.path.join(ROOT, "src", "xlaserve"))
    assert xlaserve.backends_torch.__file__.startswith(os.path.join(ROOT, "backends_torch"))


def test_import_is_light() -> None:
    code = (
        "import sys, xlaserve, xlaserve.config, xlaserve.runner, xlaserve.engine.llm_engine;"
        "from xlaserve import SamplingParams;"
        "bad = [m for m in ('torch', 'jax', 'transformers') if m in sys.modules];"
        "print(bad); exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_package_folder_is_listed() -> None:
    """Each folder with an __init__.py must be in pyproject's `packages` (else `pip install .` drops it)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["tool"]["setuptools"]
    listed = set(proj["packages"])
    roots = {v: k for k, v in proj["package-dir"].items()}
    found = set()
    for folder, pkg in roots.items():
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                found.add(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    assert found - listed == set(), f"add to pyproject packages: {sorted(found - listed)}"


def test_build_has_no_setuptools_warnings(tmp_path) -> None:
    """No deprecation (license table) or packaging (a data folder missing from `packages`)
    warnings while building the wheel."""
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), ROOT],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = r.stdout + r.stderr
    for marker in ("DeprecationWarning", "BuildBackendWarning", "is absent from the `packages`"):
        assert marker not in log, [ln for ln in log.splitlines() if marker in ln][:5]
