"""Shared test configuration: bounded hypothesis profiles, x64 toggling, and a
compilation cache of the test run's own (never the user's)."""

import atexit
import os
import shutil
import tempfile

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
