"""fa_jax.studies.sweep.executables: compiled programs kept in memory and on disk."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax.studies.profile import Profile
from fa_jax.studies.sweep.executables import Executables, source_fingerprint


@functools.partial(jax.jit, static_argnames=("power",))
def _program(x, *, power):
    return jnp.sin(x) ** power


ARGS = (np.linspace(0.0, 3.0, 7, dtype=np.float32),)


def test_a_program_compiles_once_per_signature_and_runs_each_call():
    profile = Profile()
    ex = Executables(None, profile)
    a = ex.call(_program, ARGS, {"power": 2}, label="p2")
    b = ex.call(_program, ARGS, {"power": 2}, label="p2")
    c = ex.call(_program, ARGS, {"power": 3}, label="p3")
    np.testing.assert_array_equal(a, _program(*ARGS, power=2))
    np.testing.assert_array_equal(b, a)
    np.testing.assert_array_equal(c, _program(*ARGS, power=3))
    assert {p.label: (p.source, p.calls) for p in profile.programs.values()} == {
        "p2": ("compiled", 2),
        "p3": ("compiled", 1),
    }


def test_a_second_process_loads_the_same_executable_from_the_folder(tmp_path):
    first = Executables(tmp_path, Profile())
    want = first.call(_program, ARGS, {"power": 2}, label="p")
    assert len(list(tmp_path.glob("*.bin"))) == 1
    profile = Profile()
    got = Executables(tmp_path, profile).call(_program, ARGS, {"power": 2}, label="p")
    assert profile.programs["p"].source == "loaded"
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_other_shapes_get_their_own_entry(tmp_path):
    ex = Executables(tmp_path)
    ex.call(_program, ARGS, {"power": 2}, label="p")
    ex.call(_program, (np.zeros(3, np.float32),), {"power": 2}, label="p")
    assert len(list(tmp_path.glob("*.bin"))) == 2


def test_an_unreadable_entry_is_compiled_again_and_rewritten(tmp_path):
    Executables(tmp_path).call(_program, ARGS, {"power": 2}, label="p")
    (entry,) = tmp_path.glob("*.bin")
    entry.write_bytes(b"not an executable")
    profile = Profile()
    got = Executables(tmp_path, profile).call(_program, ARGS, {"power": 2}, label="p")
    assert profile.programs["p"].source == "compiled"
    np.testing.assert_array_equal(got, _program(*ARGS, power=2))
    assert entry.read_bytes() != b"not an executable"


def test_the_source_fingerprint_is_a_stable_hash():
    assert source_fingerprint() == source_fingerprint()
    assert len(source_fingerprint()) == 64
