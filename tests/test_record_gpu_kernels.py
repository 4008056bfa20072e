"""experiments/record_gpu_kernels.py on a CPU: its cases, the inputs it draws again from
a case, the units it stores ex2.approx's results in, and a dry run (fa_jax's models in
the kernels' place) writing what a loader will read."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import load_experiment

from fa_jax import kernels

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "record_gpu_kernels.py"


@pytest.fixture(scope="module")
def rec():
    return load_experiment(SCRIPT)


def test_cases_are_named_once_and_causal_ones_square(rec):
    cases = rec.cases()
    assert len({c.name for c in cases}) == len(cases)
    assert all(c.n == c.m for c in cases if c.causal)
    assert {c.d for c in cases} == set(rec.HEAD_DIMS)
    assert {c.kind for c in cases} == {"random", "wide", "equal_scores", "one_key"}
    assert any(c.n % 2 and c.m % 2 for c in cases) and any(c.n < c.m for c in cases)


@pytest.mark.parametrize("quick", [True, False])
def test_inputs_are_exact_in_the_format_and_drawn_again_alike(rec, quick):
    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    for case in rec.cases(quick)[:: 1 if quick else 9]:
        q, k, v = rec.inputs(case)
        assert q.shape == (1, case.n, case.d) and k.shape == v.shape == (1, case.m, case.d)
        for t in (q, k, v):
            assert np.array_equal(t.astype(dtypes[case.fmt]).astype(np.float64), t), case.name
        rec.inputs.cache_clear()
        assert rec.digest(rec.inputs(case)) == rec.digest((q, k, v)), case.name
        if case.kind == "equal_scores":
            assert (k == k[:, :1]).all(), case.name


def test_ex2_results_in_units_from_the_rounded_power(rec):
    x = np.array([-1.0, -0.75, -0.5000001, -3.25, -125.5], np.float32)
    rn = np.exp2(x.astype(np.float64)).astype(np.float32)
    ulps, near = rec.ulps_from_rounded(x, rn)
    assert ulps.dtype == np.int8 and not ulps.any() and not near.any()
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
    cases = {c.name: c for c in rec.cases(quick=True)}
    assert set(meta["cases"]) == set(cases) and meta["versions"]["dry_run"] is True
    stored = np.load(out / "cudnn.npz")
    assert {name.removesuffix(".refused") for name in stored.files} == set(cases)
    case = next(c for c in cases.values() if c.kind == "random" and c.causal)
    q, k, v = rec.inputs(case)
    want = kernels.emulate("cudnn", q, k, v, fmt=case.fmt, causal=True)
    got = stored[case.name].view(ml_dtypes.bfloat16 if case.fmt == "bfloat16" else np.float16)
    assert np.array_equal(got.astype(np.float64), want)
    assert meta["cases"][case.name]["inputs_sha256"] == rec.digest((q, k, v))
