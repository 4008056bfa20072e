"""fa_jax.studies.recorded: a model against a recording, case by case, from the CLI too."""

from __future__ import annotations

import json

import numpy as np
from test_kernels_recording import SMALL, write

from fa_jax import kernels
from fa_jax.cli import main
from fa_jax.kernels import recording
from fa_jax.kernels.compare import Comparison
from fa_jax.studies.recorded import format_recorded, validate_recording


def test_the_model_is_judged_per_case_and_over_all(tmp_path, capsys):
    """The recording holds the model's own output, one element moved by one unit in
    the last place, and a refusal: 23 of 24 elements identical, the refusal listed."""
    case = SMALL[0]
    q, k, v = recording.inputs(case)
    model = np.asarray(kernels.emulate("cudnn", q, k, v, fmt=case.fmt, causal=False))
    real = recording.from_bits(recording.to_bits(model, case.fmt), case.fmt)
    bits = recording.to_bits(real, case.fmt)
    bits[0, 1, 2] += 1
    write(tmp_path, {case: recording.from_bits(bits, case.fmt), SMALL[1]: "RuntimeError: no"})
    v = validate_recording("cudnn", tmp_path)
    (first, judged), (second, refused) = v.rows
    assert first == case and isinstance(judged, Comparison)
    assert judged.identical_share == 23 / 24 and judged.max_ulp == 1
    assert second == SMALL[1] and refused == "the real kernel refused: RuntimeError: no"
    assert v.identical_share() == 23 / 24
    assert v.platform == {"gpu": "a test's", "backend": "none"}
    report = format_recorded(v)
    assert "1 of 2 cases judged: 95.8333% of their elements bit-identical" in report
    assert main(["validate", "--kernel", "cudnn", "--recording", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == report
    assert main(["validate", "--kernel", "cudnn", "--recording", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["identical_share"] == 23 / 24 and data["platform"] == v.platform
    assert data["cases"][0]["case"] == case.name and data["cases"][0]["max_ulp"] == 1
    assert data["cases"][1] == {"case": SMALL[1].name, "not_judged": refused}
