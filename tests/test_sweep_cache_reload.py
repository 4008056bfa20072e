"""A program the sweep stores must load and run in a later run even where JAX's
own persistent cache held the same program when it was compiled: an executable
JAX loaded from its cache serializes incompletely (a later load fails with
``NOT_FOUND: Function ... not found``), so the sweep keeps JAX's cache off
(``engine._own_cache_only``) around its own (``executables.Executables``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa_jax.studies.cache import compilation_cache
from fa_jax.studies.sweep import engine, executables


@jax.jit
def _fused(x):  # a program whose kernels XLA fuses (the failure names a fusion)
    y = jnp.exp(x[:, :7] * 2.0) + jnp.sum(x, axis=1, keepdims=True)
    return jnp.tanh(y).reshape(-1)[3:50]


def _one_run(cache, fingerprint, monkeypatch):
    """One sweep's use of the caches, in a fresh state: the program from the
    sweep's cache (``fingerprint`` stands for fa_jax's sources), or compiled."""
    monkeypatch.setattr(executables, "source_fingerprint", lambda: fingerprint)
    jax.clear_caches()  # as a new process: nothing compiled in memory
    x = np.linspace(-1, 1, 64 * 9).reshape(64, 9)
    with compilation_cache(cache), engine._own_cache_only():
        programs = executables.Executables(cache / "programs")
        return np.asarray(programs.call(_fused, (x,), {}, label="fused"))


@pytest.mark.extended  # 6 s: for the default run's time only
def test_programs_stored_after_an_edit_load_in_the_next_run(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = _one_run(cache, "before", monkeypatch)
    # An edit of fa_jax that leaves the program as it was: a new key in the
    # sweep's cache, the same program for JAX's; compiled, stored, then loaded.
    _one_run(cache, "edited", monkeypatch)
    np.testing.assert_array_equal(_one_run(cache, "edited", monkeypatch), first)
    assert len(list((cache / "programs").glob("*.bin"))) == 2
