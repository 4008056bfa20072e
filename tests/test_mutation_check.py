"""experiments/mutation_check.py's plumbing: its mutant list stays applicable and
``--list`` shows every mutant.  No mutant is run here (that takes tens of minutes)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_experiment

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "mutation_check.py"


mc = load_experiment(SCRIPT)


@pytest.mark.parametrize("mutant", mc.MUTANTS, ids=lambda m: m.name)
def test_each_original_snippet_occurs_exactly_once(mutant):
    text = (REPO / mutant.module).read_text()
    assert text.count(mutant.original) == 1, mutant.original
    assert mutant.replacement != mutant.original
    assert mutant.tests, "a mutant names the tests that must kill it"
    for target in mutant.tests:
        assert (REPO / target.split("::")[0]).is_file(), target


def test_mutant_names_are_unique():
    names = [m.name for m in mc.MUTANTS]
    assert len(set(names)) == len(names)


def test_check_unique_rejects_a_snippet_that_is_absent_or_repeated():
    absent = mc.Mutant("fa_jax/ops.py", "no such snippet", "x", "absent", ("tests/x.py",))
    with pytest.raises(ValueError, match="found it 0 times"):
        mc.check_unique(absent)
    repeated = mc.Mutant("fa_jax/ops.py", "import", "x", "repeated", ("tests/x.py",))
    with pytest.raises(ValueError, match="expected the original snippet once"):
        mc.check_unique(repeated)


def test_list_shows_every_mutant_and_runs_none(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--list"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for m in mc.MUTANTS:
        assert m.name in proc.stdout
    assert "score:" not in proc.stdout  # no mutant was run
    assert list(tmp_path.iterdir()) == []


def test_summary_counts_equivalent_mutants_apart():
    live = mc.Mutant("fa_jax/ops.py", "a", "b", "live", ("t",))
    same = mc.Mutant("fa_jax/ops.py", "a", "b", "same", ("t",), equivalent="no change")
    line, ok = mc.summary([mc.Outcome(live, "killed", 1.0), mc.Outcome(same, "survived", 1.0)])
    assert ok and "1 / 1 killed (1 listed as equivalent)" in line
    _, ok = mc.summary([mc.Outcome(live, "timeout", 1.0)])
    assert not ok


@pytest.mark.parametrize("mutant", mc.MUTANTS, ids=lambda m: m.name)
def test_each_named_test_is_defined_in_its_file(mutant):
    """A renamed test would make pytest exit with a usage error (reported as an
    error, not a kill) only when the whole check runs: caught here by default."""
    for target in mutant.tests:
        path, _, node = target.partition("::")
        if node:
            name = node.split("::")[-1].split("[")[0]
            assert f"def {name}(" in (REPO / path).read_text(), target
