"""Shared test configuration: bounded hypothesis profiles, x64 toggling, a
compilation cache of the test run's own (never the user's), the tests kept
out of the default run for its time (extended_for_time.txt), ``--until``: a
time after which no test starts (CI's later stages share one time budget), and
``--shuffle-files SEED``: the test files in an order drawn from SEED, so that
runs cut short by ``--until`` leave different files out (the seed is printed)."""

import atexit
import os
import pathlib
import random
import shutil
import tempfile
import time

import jax
import pytest
from helpers import x64_enabled
from hypothesis import HealthCheck, settings

# "ci" is derandomized (the same examples every run, so a CI failure reproduces);
# "dev" and "thorough" draw afresh.  Tests that need fewer or more examples than
# the profile scale settings.default.max_examples rather than fixing a number.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Sweeps cache compiled programs (fa_jax.studies.cache); the tests' go to a folder of
# this run, shared by its workers (they inherit the environment) and removed at exit.
if "FA_JAX_CACHE_DIR" not in os.environ:
    os.environ["FA_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="fa_jax_test_cache_")
    atexit.register(shutil.rmtree, os.environ["FA_JAX_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def x64():
    with x64_enabled():
        yield


@pytest.fixture(autouse=True)
def _x64_setting_does_not_leak():
    """Fail a test that leaves jax_enable_x64 changed: later tests would silently run
    under the other precision."""
    before = jax.config.read("jax_enable_x64")
    yield
    after = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", before)
    assert after == before, f"jax_enable_x64 left changed ({before} -> {after})"


_FOR_TIME = pathlib.Path(__file__).with_name("extended_for_time.txt")


def _for_time() -> set[str]:
    lines = _FOR_TIME.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark ``extended`` the tests listed in extended_for_time.txt, before ``-m``
    selects; a listed test of a collected file that is not collected fails the run
    (a stale entry would leave its test in the default run unnoticed)."""
    listed = _for_time()
    files = {item.nodeid.split("::")[0] for item in items}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.extended)
    collected = {item.nodeid for item in items}
    whole = not any("::" in str(arg) for arg in config.args)  # files, not picked tests
    stale = sorted(n for n in listed if n.split("::")[0] in files and n not in collected)
    if stale and whole:
        raise pytest.UsageError(f"{_FOR_TIME.name} names tests that are not collected: {stale}")
    seed = config.getoption("--shuffle-files")
    if seed is not None:
        order = sorted(files)
        random.Random(seed).shuffle(order)
        rank = {f: i for i, f in enumerate(order)}
        items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable within a file


def pytest_addoption(parser):
    parser.addoption(
        "--until",
        type=float,
        default=None,
        metavar="EPOCH_SECONDS",
        help="start no test after this time (seconds since the epoch): those left are "
        "skipped as not run, each saying so",
    )
    parser.addoption(
        "--shuffle-files",
        default=None,
        metavar="SEED",
        help="run the test files in an order drawn from SEED (tests keep their order "
        "within a file)",
    )


def pytest_report_header(config):
    seed = config.getoption("--shuffle-files")
    return None if seed is None else f"test files shuffled with seed {seed!r}"


_NOT_RUN = "not run: this stage's time budget (--until) was spent before it started"


def pytest_runtest_setup(item):
    until = item.config.getoption("--until")
    if until is not None and time.time() > until:
        pytest.skip(_NOT_RUN)


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("--until") is None:
        return
    skipped = terminalreporter.stats.get("skipped", [])
    left = sum(1 for r in skipped if _NOT_RUN in str(r.longrepr))
    terminalreporter.write_line(f"--until: {left} tests not run (the time budget ended)")
