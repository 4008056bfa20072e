"""experiments/record_gpu_kernels.py on a CPU: the units it stores ex2.approx's results
in, its refusal without the kernels, and a dry run (fa_jax's models in the kernels'
place) writing what fa_jax.kernels.recording reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import load_experiment

from fa_jax import kernels
from fa_jax.kernels import recording

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "record_gpu_kernels.py"


@pytest.fixture(scope="module")
def rec():
    return load_experiment(SCRIPT)


def test_ex2_results_in_units_from_the_rounded_power(rec):
    x = np.array([-1.0, -0.75, -0.5000001, -3.25, -125.5], np.float32)
    rn = np.exp2(x.astype(np.float64)).astype(np.float32)
    ulps, near = rec.ulps_from_rounded(x, rn)
    assert not ulps.any() and not near.any()
    bumped = (rn.view(np.int32) + np.array([1, -1, 0, 2, -3], np.int32)).view(np.float32)
    assert rec.ulps_from_rounded(x, bumped)[0].tolist() == [1, -1, 0, 2, -3]
    binade, sample = rec.ex2_inputs()
    assert binade.size == 1 << 23 and binade.min() > -1.0 and binade.max() == -0.5
    assert np.unique(np.frexp(binade)[1]).tolist() == [0]  # one binade: |x| in [1/2, 1)
    assert sample.size == rec.EX2_SAMPLE and ((sample > -126) & (sample <= 0)).all()


def test_without_the_kernels_it_refuses_unless_dry(rec, tmp_path, capsys):
    if "cudnn" in kernels.available():
        pytest.skip("cudnn runs here: this test is of a machine without a CUDA GPU")
    assert rec.main(["--kernels", "cudnn", "--no-ex2", "--out", str(tmp_path / "r")]) == 2
    said = capsys.readouterr().out
    assert said.startswith("record: cannot run: kernel 'cudnn'") and "no CUDA GPU" in said
    assert not (tmp_path / "r").exists()


@pytest.mark.extended  # 12 s: the models' programs compile for nine cases
def test_a_dry_run_writes_each_case_or_its_refusal(rec, tmp_path, capsys):
    out = tmp_path / "rec"
    assert (
        rec.main(["--dry-run", "--quick", "--kernels", "cudnn", "--no-ex2", "--out", str(out)]) == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["cudnn.npz", "recording.json"]
    meta = json.loads((out / "recording.json").read_text())
    cases = {c.name: c for c in recording.cases(quick=True)}
    assert set(meta["cases"]) == set(cases) and meta["versions"]["dry_run"] is True
    stored = np.load(out / "cudnn.npz")
    assert {name.removesuffix(".refused") for name in stored.files} == set(cases)
    case = next(c for c in cases.values() if c.kind == "random" and c.causal)
    q, k, v = recording.inputs(case)
    want = kernels.emulate("cudnn", q, k, v, fmt=case.fmt, causal=True)
    assert np.array_equal(recording.from_bits(stored[case.name], case.fmt), want)
    assert meta["cases"][case.name]["inputs_sha256"] == recording.digest((q, k, v))
    assert recording.load(out).outputs("cudnn")[case].tobytes() == want.tobytes()


def test_ex2_results_too_far_for_int8_are_kept_apart(rec):
    """A flushed result (0 where RN(2^x) is a normal) is 2^23 and more units away: its
    index and result are kept, its int8 distance is 0, nothing is refused."""

    def flushing(x):
        y = rec._rounded_ex2(x)
        y[3] = 0.0
        return y

    out = rec.record_ex2(flushing)
    for name in ("binade", "sample"):
        assert out[f"{name}_ulps"].dtype == np.int8
        assert out[f"{name}_far"].tolist() == [3] and out[f"{name}_far_y"].tolist() == [0.0]
        assert not out[f"{name}_ulps"].any()  # the stand-in is RN(2^x) elsewhere
