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


_THREE_DEVICES = """
import pathlib, sys, jax, numpy as np
sys.path.insert(0, {tests!r})
from test_executables import ARGS, _program
from fa_jax.studies.profile import Profile
from fa_jax.studies.sweep.batch import shard
from fa_jax.studies.sweep.executables import Executables
folder = pathlib.Path({folder!r})
spread = shard((np.linspace(0.0, 1.0, 12, dtype=np.float32).reshape(3, 4),), 3)
calls = [(ARGS, "one device"), (spread, "three devices")]
first, profile = Executables(folder), Profile()
want = [np.asarray(first.call(_program, a, {{"power": 2}}, label=l)) for a, l in calls]
again = Executables(folder, profile)
got = [np.asarray(again.call(_program, a, {{"power": 2}}, label=l)) for a, l in calls]
assert {{p.source for p in profile.programs.values()}} == {{"loaded"}}, profile.table()
assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
print(len(jax.devices()))
"""


def test_a_loaded_program_runs_on_the_devices_it_was_compiled_for(tmp_path):
    """In a process of three devices, a program of host arguments (one device: the
    sweep's metric programs) and one sharded over the three, each loaded from the
    folder: each runs where it was compiled to (loaded onto all three, the first
    raised that it expected three shards)."""
    import os
    import pathlib
    import subprocess
    import sys

    tests = str(pathlib.Path(__file__).parent)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3"
    done = subprocess.run(
        [sys.executable, "-c", _THREE_DEVICES.format(tests=tests, folder=str(tmp_path))],
        env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "3"
