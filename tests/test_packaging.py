"""The wheel ships the whole package.

The wheel is built from a copy of the source tree (so that no ``build/`` left in
the checkout can add or hide files), installed without dependencies into a fresh
virtual environment, and every module of the source tree's ``fa_jax/`` is
imported from there, out of the checkout: a subpackage that setuptools does not
find is missing from the wheel and fails here.  The fresh environment sees this
environment's dependencies (jax, numpy, ...) through a ``.pth`` file listing
their directories, after its own site-packages; ``.pth`` files in those
directories (such as an editable install's finder) are not processed, so
``fa_jax`` can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fa_jax"
# What setuptools reads to build the wheel.
BUILD_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE")
OPTIONAL_DEPENDENCIES = ("matplotlib", "optax", "tqdm")


def source_modules() -> list[str]:
    """Dotted names of every module under fa_jax/ in the source tree."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def run(*cmd, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure, fail the test with its output."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def dependency_paths() -> list[str]:
    """This interpreter's site-packages directories, less any that holds an fa_jax
    package (a path-style editable install)."""
    return [
        p
        for p in sys.path
        if Path(p).name in ("site-packages", "dist-packages") and not (Path(p) / "fa_jax").exists()
    ]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    source.mkdir()
    for name in BUILD_FILES:
        if (REPO / name).exists():
            shutil.copy2(REPO / name, source / name)
    shutil.copytree(PACKAGE, source / "fa_jax", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    pip_wheel = (sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index")
    run(*pip_wheel, "--no-build-isolation", "--wheel-dir", dist, source, cwd=tmp)
    (found,) = dist.glob("fa_jax-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (no dependencies), seeing
    this environment's site-packages after its own."""
    root = tmp_path_factory.mktemp("venv").resolve() / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", root)
    python = root / "bin" / "python"
    pip_install = (sys.executable, "-m", "pip", "--python", python, "install", "--quiet")
    run(*pip_install, "--no-deps", "--no-index", wheel)
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    Path(site.stdout.strip(), "dependencies.pth").write_text("\n".join(dependency_paths()) + "\n")
    return root


def venv_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_wheel_holds_every_source_module_and_the_type_marker(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py")}
    assert sources - names == set(), "source modules missing from the wheel"
    assert "fa_jax/py.typed" in names


def test_every_module_imports_from_the_installed_wheel(venv, tmp_path):
    modules = [m for m in source_modules() if m != "fa_jax.__main__"]  # runs the CLI
    script = (
        "import importlib, json, sys\n"
        # the optional dependencies are absent: every module must import without them
        f"for name in {OPTIONAL_DEPENDENCIES!r}:\n"
        "    sys.modules[name] = None\n"
        f"print(json.dumps({{m: importlib.import_module(m).__file__ for m in {modules!r}}}))\n"
    )
    proc = run(venv / "bin" / "python", "-c", script, cwd=tmp_path, env=venv_env())
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(files) == sorted(modules)
    outside = {m: f for m, f in files.items() if not Path(f).resolve().is_relative_to(venv)}
    assert outside == {}, "modules imported from outside the fresh environment"


def test_console_script_and_module_entry_point_run_from_the_wheel(venv, tmp_path):
    script = venv / "bin" / "fa-jax"
    assert script.is_file(), "the fa-jax console script is not installed"
    version = run(script, "--version", cwd=tmp_path, env=venv_env()).stdout.strip()
    assert version.startswith("fa-jax ")
    python = venv / "bin" / "python"
    module = run(python, "-m", "fa_jax", "--version", cwd=tmp_path, env=venv_env())
    assert module.stdout.strip() == version
