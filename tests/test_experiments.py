"""Every experiment script answers ``--help``, says how to run it, and does nothing
when imported.

The scripts are found by glob, so a new one is covered without editing this file.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import load_experiment

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "experiments").glob("*.py"))


def by_name(path: Path) -> str:
    return path.name


def test_scripts_are_found():
    assert len(SCRIPTS) > 0


@pytest.mark.parametrize("script", SCRIPTS, ids=by_name)
def test_help_runs(script, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout
    assert list(tmp_path.iterdir()) == [], "--help wrote files"


@pytest.mark.parametrize("script", SCRIPTS, ids=by_name)
def test_docstring_says_how_to_run_it_and_main_is_guarded(script):
    tree = ast.parse(script.read_text(), filename=str(script))
    doc = ast.get_docstring(tree)
    assert doc, "no module docstring saying what the script measures"
    assert f"python experiments/{script.name}" in doc, "the docstring does not say how to run it"
    guards = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
    ]
    assert guards, "no `if __name__ == '__main__':` guard"


@pytest.mark.parametrize("script", SCRIPTS, ids=by_name)
def test_import_does_nothing(script, capfd):
    """Importing a script defines things and runs nothing: no output, and jax's
    x64 setting unchanged (a script enables float64 in its main)."""
    x64 = jax.config.read("jax_enable_x64")
    try:
        load_experiment(script)
    finally:
        changed = jax.config.read("jax_enable_x64") != x64
        jax.config.update("jax_enable_x64", x64)
    assert not changed, "importing the script changed jax_enable_x64"
    assert capfd.readouterr().out == ""
