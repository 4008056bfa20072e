"""fa_jax.studies.calibration and ``fa-jax calibrate``: ablation and knob search."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import skip_unmodelled

from fa_jax import BF16, kernels
from fa_jax.cli import main
from fa_jax.studies.calibration import calibrate, format_calibration, knobs_for
from fa_jax.studies.validation import Shape, validation_inputs

TINY = Shape(1, 1, 32, 16)


def test_knobs_apply_and_read_back():
    skip_unmodelled("xla", BF16)
    model = kernels.model("xla", BF16, 32, 16)
    for knob in knobs_for(model):
        for value in knob.values:
            assert knob.current(knob.apply(model, value)) == value, (knob.name, value)


@pytest.mark.slow  # test_cli_calibrate runs the ablation by default, on one knob
def test_ablation_and_search_measure_real_shares():
    """A knob that changes the numbers (scores stored in BF16 instead of FP32) costs
    share, measured on the real kernel; one that changes no bit says so."""
    skip_unmodelled("xla", BF16)
    c = calibrate("xla", "bf16", shape=TINY, knobs=("scores", "o_acc"), max_steps=1)
    model = kernels.model("xla", BF16, 32, 16)
    q, k, v = validation_inputs(BF16, TINY, 0)
    real = kernels.real("xla", q, k, v, fmt=BF16)
    changed = dataclasses.replace(model, policy=model.policy.replace(scores=BF16))
    want = float(np.mean(changed(q, k, v).view(np.uint64) == real.view(np.uint64)))
    rows = {r[0]: r[1:] for r in c.ablation}
    assert rows["scores"] == ("float32", "bfloat16", want, True)
    assert want < c.model_share
    assert rows["o_acc"][3] is False  # the reference algorithm has no o accumulator
    assert c.search[0][:3] == (0, "start", "fa2_kernel reference")
    assert [s for *_, s in c.search] == sorted(s for *_, s in c.search)
    assert "no output bit changed" in format_calibration(c)


def test_calibrate_errors():
    with pytest.raises(ValueError, match="seeds"):
        calibrate("xla", "bf16", shape=TINY, seeds=())
    skip_unmodelled("xla", BF16)  # the knobs are the model's
    with pytest.raises(ValueError, match="knobs"):
        calibrate("xla", "bf16", shape=TINY, knobs=("nope",))


@pytest.mark.extended  # 16 s; calibrate itself runs by default
def test_cli_calibrate(capsys):
    """The command over the same shape and a knob the ablation test already tried."""
    skip_unmodelled("xla", BF16)
    argv = ["calibrate", "--kernel", "xla", "--n", "32", "--d", "16", "--knobs", "o_acc"]
    assert main([*argv, "--max-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "o_acc" in out and "search from fa2_kernel" in out
    assert main(["calibrate", "--kernel", "xla", "--knobs", "nope"]) == 2
