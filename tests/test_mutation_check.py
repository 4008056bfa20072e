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


def test_a_mutants_table_with_a_key_missing_or_unknown_is_refused(tmp_path):
    good = "module = 'ops'\ndescription = 'd'\noriginal = 'a'\nreplacement = 'b'\ntests = ['t']\n"
    path = tmp_path / "mutants.toml"
    path.write_text(f"[[mutant]]\n{good}equivalent = 'why'\n")
    (m,) = mc.load_mutants(path)
    assert m == mc.Mutant("fa_jax/ops.py", "a", "b", "d", ("t",), "why")
    for bad in (good.replace("tests = ['t']\n", ""), good + "test = ['t']\n"):
        path.write_text(f"[[mutant]]\n{bad}")
        with pytest.raises(ValueError, match=r"mutants.toml: mutant 0: expected the keys"):
            mc.load_mutants(path)


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


def test_a_mutant_whose_tests_skip_here_is_neither_killed_nor_a_survivor():
    """Its checks did not run on this host: reported apart, and the run's verdict
    rests on the mutants judged."""
    live = mc.Mutant("fa_jax/ops.py", "a", "b", "live", ("t",))
    unrun = mc.Mutant("fa_jax/ops.py", "a", "b", "unrun", ("t",))
    line, ok = mc.summary([mc.Outcome(live, "killed", 1.0), mc.Outcome(unrun, "skipped", 1.0)])
    assert ok and "1 / 1 killed" in line and "1 not judged on this host" in line
    line, ok = mc.summary([mc.Outcome(live, "survived", 1.0), mc.Outcome(unrun, "skipped", 1.0)])
    assert not ok and "0 / 1 killed" in line


def test_mutants_left_when_the_budget_is_spent_are_listed_not_counted():
    live = mc.Mutant("fa_jax/ops.py", "a", "b", "live", ("t",))
    late = mc.Mutant("fa_jax/ops.py", "a", "b", "late", ("t",))
    line, ok = mc.summary([mc.Outcome(live, "killed", 1.0), mc.Outcome(late, "not run", 0.0)])
    assert ok and "1 / 1 killed" in line and "1 not run: the time budget was spent" in line
    assert "not judged" not in line
    outcomes = mc.run_all([late], jobs=1, timeout=60, budget=-1.0)  # spent before it starts
    assert [o.status for o in outcomes] == ["not run"]


def test_run_mutant_tells_skipped_checks_from_passed_ones(tmp_path):
    """pytest passing with a skip is "skipped" (not judged), passing without one is
    "survived", failing is "killed"."""
    (tmp_path / "fa_jax").mkdir()
    (tmp_path / "fa_jax" / "m.py").write_text("X = 1\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_m.py").write_text(
        "import pytest\n"
        "def test_runs():\n    assert True\n"
        "def test_skips():\n    pytest.skip('no such CPU here')\n"
        "def test_fails_on_the_mutant():\n    import fa_jax.m\n    assert fa_jax.m.X == 1\n"
    )
    (tmp_path / "pyproject.toml").write_text("")
    cases = {
        ("tests/test_m.py::test_runs", "tests/test_m.py::test_skips"): "skipped",
        ("tests/test_m.py::test_runs",): "survived",
        ("tests/test_m.py::test_fails_on_the_mutant",): "killed",
    }
    for tests_, status in cases.items():
        mutant = mc.Mutant("fa_jax/m.py", "X = 1", "X = 2", "x", tests_)
        outcome = mc.run_mutant(mutant, tmp_path, timeout=120)
        assert outcome.status == status, outcome
    assert (
        "no such CPU here"
        in mc.run_mutant(
            mc.Mutant("fa_jax/m.py", "X = 1", "X = 2", "x", ("tests/test_m.py::test_skips",)),
            tmp_path,
            timeout=120,
        ).detail
    )


@pytest.mark.parametrize("mutant", mc.MUTANTS, ids=lambda m: m.name)
def test_each_named_test_is_defined_in_its_file(mutant):
    """A renamed test would make pytest exit with a usage error (reported as an
    error, not a kill) only when the whole check runs: caught here by default."""
    for target in mutant.tests:
        path, _, node = target.partition("::")
        if node:
            name = node.split("::")[-1].split("[")[0]
            assert f"def {name}(" in (REPO / path).read_text(), target
