"""fa_jax.studies.validation and ``fa-jax validate`` / ``fa-jax kernels``: a real
kernel judged against fa_jax's model and the generic presets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import skip_unmodelled

from fa_jax import BF16, kernels
from fa_jax.cli import main
from fa_jax.studies.validation import Shape, format_validation, validate, validation_inputs

SMALL = Shape(1, 1, 64, 32)


def test_inputs_are_values_of_the_format():
    q, k, v = validation_inputs(BF16, SMALL, 3)
    for t in (q, k, v):
        assert t.shape == (1, 1, 64, 32)
        np.testing.assert_array_equal(t, t.astype(BF16.carrier).astype(np.float64))


@pytest.mark.extended  # 11 s
def test_validate_rows_match_direct_calls():
    """The model's row is the registry's emulate against real, over both seeds."""
    skip_unmodelled("xla", BF16)
    v = validate("xla", "bf16", shape=SMALL, seeds=(0, 1), presets=("paper_uniform",))
    labels = [label for label, _ in v.rows]
    assert labels == ["xla model", "paper_uniform reference", "paper_uniform flash"]
    direct = []
    for seed in (0, 1):
        q, k, v_ = validation_inputs(BF16, SMALL, seed)
        r = kernels.real("xla", q, k, v_, fmt=BF16)
        e = kernels.emulate("xla", q, k, v_, fmt=BF16)
        direct.append(np.count_nonzero(r.view(np.uint64) == e.view(np.uint64)))
    model = v.rows[0][1]
    assert model.elements == 2 * 64 * 32
    assert model.identical == sum(direct)
    assert v.platform and v.seeds == (0, 1)
    text = format_validation(v)
    assert "xla model" in text and "platform:" in text


def test_validate_errors():
    with pytest.raises(ValueError, match="unknown kernel"):
        validate("nope", "bf16", shape=SMALL)
    with pytest.raises(ValueError, match="seeds"):
        validate("xla", "bf16", shape=SMALL, seeds=())
    with pytest.raises(ValueError, match="presets"):
        validate("xla", "bf16", shape=SMALL, presets=("nope",))
    with pytest.raises(ValueError, match=r"Shape\.n"):
        Shape(1, 1, 0, 32)


@pytest.mark.extended  # about 10 s
def test_cli_validate_json(capsys):
    """The command on the shape of the test above (its compiled model is reused)."""
    skip_unmodelled("xla", BF16)
    argv = ["validate", "--kernel", "xla", "--n", "64", "--d", "32", "--heads", "1"]
    assert main([*argv, "--no-presets", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kernel"] == "xla" and data["shape"] == {"batch": 1, "heads": 1, "n": 64, "d": 32}
    (row,) = data["rows"]
    assert row["emulation"] == "xla model" and row["elements"] == 64 * 32


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kernel", "nope"], "--kernel: expected one of"),
        (["--kernel", "cudnn"], "--kernel: "),
        (["--kernel", "xla", "--n", "0"], "--n: expected a positive integer"),
        (["--kernel", "xla", "--format", "bogus"], "--format: "),
        (["--kernel", "xla", "--seeds", "x"], "--seeds: expected integers"),
    ],
)
def test_cli_validate_errors_are_one_line(argv, message, capsys):
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_validate_reports_a_model_refusing_the_shape(monkeypatch, capsys):
    """A model that does not cover a shape (NotImplementedError) ends the command
    with its reason on one line and exit status 2, not a traceback."""

    def refuse(*args, **kwargs):
        raise NotImplementedError("xla: this shape is not modelled")

    monkeypatch.setattr(kernels, "emulate", refuse)
    argv = ["validate", "--kernel", "xla", "--n", "8", "--d", "4", "--heads", "1"]
    assert main([*argv, "--no-presets"]) == 2
    err = capsys.readouterr().err
    assert err == "fa-jax validate: xla: this shape is not modelled\n"


def test_cli_kernels_lists_every_kernel(capsys):
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    for name in kernels.names():
        assert name in out
    assert "xla" in kernels.available()
