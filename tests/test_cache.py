"""fa_jax.studies.cache: where the compilation cache lives, and JAX's settings restored."""

import pathlib

import jax
import pytest

from fa_jax.studies.cache import CACHE_ENV, cache_dir, compilation_cache


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "fa_jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == pathlib.Path.home() / ".cache" / "fa_jax"


def test_settings_hold_inside_and_are_restored_after(tmp_path):
    before = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    with compilation_cache(tmp_path / "c") as used:
        assert used == tmp_path / "c" and used.is_dir()
        assert jax.config.jax_compilation_cache_dir == str(used / "xla")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    after = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    assert after == before


def test_off_changes_nothing():
    before = jax.config.jax_compilation_cache_dir
    with compilation_cache(False) as used:
        assert used is None and jax.config.jax_compilation_cache_dir == before


def test_a_folder_that_cannot_be_made_warns_and_runs_without(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.warns(UserWarning, match="running without it"):
        with compilation_cache(tmp_path / "file" / "sub") as used:
            assert used is None


def test_a_wrong_type_is_refused():
    with pytest.raises(TypeError, match="True, False or a folder"):
        with compilation_cache(3):
            pass
