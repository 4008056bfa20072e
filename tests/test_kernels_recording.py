"""fa_jax.kernels.recording: the cases, their inputs drawn again alike, the outputs'
bits, and a recording read back (its digests checked)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fa_jax._x64 import float64_enabled
from fa_jax.kernels import recording
from fa_jax.kernels.recording import Case
from fa_jax.rounding import round_to


def test_cases_are_named_once_and_causal_ones_square():
    cases = recording.cases()
    assert len({c.name for c in cases}) == len(cases) == 120
    assert all(c.n == c.m for c in cases if c.causal)
    assert {c.d for c in cases} == set(recording.HEAD_DIMS)
    assert {c.kind for c in cases} == {"random", "wide", "equal_scores", "one_key"}
    assert any(c.n % 2 and c.m % 2 for c in cases) and any(c.n < c.m for c in cases)


@pytest.mark.parametrize("quick", [True, False])
def test_inputs_are_exact_in_the_format_and_drawn_again_alike(quick):
    for case in recording.cases(quick)[:: 1 if quick else 9]:
        q, k, v = recording.inputs(case)
        assert q.shape == (1, case.n, case.d) and k.shape == v.shape == (1, case.m, case.d)
        with float64_enabled():
            for t in (q, k, v):
                assert np.array_equal(np.asarray(round_to(t, case.fmt)), t), case.name
        recording.inputs.cache_clear()
        assert recording.digest(recording.inputs(case)) == recording.digest((q, k, v))
        if case.kind == "equal_scores":
            assert (k == k[:, :1]).all(), case.name


def test_bits_round_trip_and_refuse_inexact_values():
    x = np.array([0.5, -3.0, np.inf, 2.0**-133, 0.0])
    assert np.array_equal(recording.from_bits(recording.to_bits(x, "bfloat16"), "bfloat16"), x)
    assert recording.to_bits(x[:2], "float16").dtype == np.uint16
    with pytest.raises(ValueError, match="expected values exact in float16"):
        recording.to_bits(np.array([1.0 + 2.0**-12]), "float16")
    with pytest.raises(ValueError, match="expected a format stored in 16 bits, got float32"):
        recording.to_bits(x, "float32")


SMALL = (Case("random", "bfloat16", 3, 5, 8, False), Case("one_key", "float16", 2, 1, 8, False))


def write(folder, outputs: dict, cases=SMALL, digests=None) -> None:
    """A recording by hand: ``outputs`` per case (an array or a refusal's text)."""
    folder.mkdir(parents=True, exist_ok=True)
    meta_cases = {
        c.name: {
            "kind": c.kind,
            "fmt": c.fmt,
            "n": c.n,
            "m": c.m,
            "d": c.d,
            "causal": c.causal,
            "seed": c.seed,
            "inputs_sha256": (digests or {}).get(c.name, recording.digest(recording.inputs(c))),
        }
        for c in cases
    }
    meta = {"versions": {"gpu": "a test's", "cudnn": {"backend": "none"}}, "cases": meta_cases}
    (folder / "recording.json").write_text(json.dumps(meta))
    arrays = {
        (c.name if not isinstance(o, str) else f"{c.name}.refused"): (
            np.array(o) if isinstance(o, str) else recording.to_bits(o, c.fmt)
        )
        for c, o in outputs.items()
    }
    np.savez_compressed(folder / "cudnn.npz", **arrays)


def test_a_recording_reads_back_its_outputs_and_refusals(tmp_path):
    out = np.full((1, 3, 8), 0.25)
    write(tmp_path, {SMALL[0]: out, SMALL[1]: "RuntimeError: no"})
    rec = recording.load(tmp_path)
    assert rec.cases == SMALL and rec.versions["gpu"] == "a test's"
    got = rec.outputs("cudnn")
    assert np.array_equal(got[SMALL[0]], out) and got[SMALL[1]] == "RuntimeError: no"
    with pytest.raises(ValueError, match=r"expected torch-cuda-flash.npz, got \['cudnn'\]"):
        rec.outputs("torch-cuda-flash")


def test_inputs_drawn_otherwise_than_recorded_are_refused(tmp_path):
    write(tmp_path, {SMALL[0]: np.zeros((1, 3, 8))}, digests={SMALL[0].name: "0" * 64})
    with pytest.raises(ValueError, match=f"expected case {SMALL[0].name}'s inputs"):
        recording.load(tmp_path)
    with pytest.raises(ValueError, match=r"expected a readable recording\.json"):
        recording.load(tmp_path / "nothing")
