"""Sweeps under a real kernel's numerics: a grid's policy "kernel:NAME" is the
policy of fa_jax's model of that kernel, in any format (fa_jax.studies.sweep.grid)."""

from __future__ import annotations

import pytest
from helpers import x64_enabled

from fa_jax import BF16, kernels, metrics
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.cli import main
from fa_jax.formats import custom
from fa_jax.inputs import make_inputs
from fa_jax.presets import golden
from fa_jax.rounding import round_to
from fa_jax.studies.results import read_csv as read_rows
from fa_jax.studies.sweep import COMPARISONS, METRICS, Grid, run_sweep
from fa_jax.studies.sweep.grid import policy_for


def test_policy_for_is_the_models_policy_in_any_format():
    e5m7 = custom(5, 7)
    assert policy_for("kernel:xla", BF16, 64, 32) == kernels.model("xla", BF16, 64, 32).policy
    carried = policy_for("kernel:xla", e5m7, 64, 32)
    assert carried.inputs == carried.p == carried.out == e5m7
    with pytest.raises(ValueError, match="natively"):
        kernels.model("xla", e5m7, 64, 32)  # the registry's model: native formats only


@pytest.mark.parametrize(
    "policy, message",
    [("kernel:nope", "kernel"), ("kernel:cudnn", "no CUDA GPU"), ("nope", "kernel:NAME")],
)
def test_grid_rejects_unknown_or_unavailable_kernels(policy, message):
    with pytest.raises(ValueError, match=message):
        Grid(formats=("bf16",), seq_lens=(16,), blocks=(Blocks(8, 8),), policies=(policy,))


# One grid for the direct check and the command line, so that the command's sweep
# loads the programs the first one compiled (the executables cache).
GRID = dict(formats=("e5m7",), seq_lens=(16,), blocks=(Blocks(8, 8),), seeds=(1,), d=4)


@pytest.mark.extended  # 13 s
def test_kernel_sweep_equals_direct_calls_bitwise(tmp_path):
    """A format the real kernel does not run (e5m7): the sweep carries the model's
    policy to it, and every row equals the direct calls."""
    e5m7 = custom(5, 7)
    rows = read_rows(run_sweep(Grid(**GRID, policies=("kernel:xla",)), tmp_path, quiet=True))
    assert {r["policy"] for r in rows} == {"kernel:xla"}
    with x64_enabled():
        q, k, v = make_inputs(1, 16, d=4)
        pol = kernels.get("xla").model(e5m7, 16, 4).policy
        outs = {
            "flash": flash_attention(q, k, v, pol, Blocks(8, 8))[0],  # pyright: ignore[reportIndexIssue]
            "baseline": reference_attention(q, k, v, pol),
            "golden": reference_attention(*(round_to(t, e5m7) for t in (q, k, v)), golden()),
        }
        want = {
            (c, m): float(getattr(metrics, m)(outs[c.split("_vs_")[0]], outs[c.split("_vs_")[1]]))
            for c in COMPARISONS
            for m in METRICS
        }
    got = {(r["comparison"], r["metric"]): float(r["value"]) for r in rows}
    assert got == want


def test_cli_sweep_kernel_flag(tmp_path, capsys):
    out = tmp_path / "s"
    argv = ["sweep", "--formats", "e5m7", "--seq-lens", "16", "--blocks", "8x8", "--d", "4"]
    argv += ["--seeds", "1"]
    assert main([*argv, "--kernel", "xla", "--out", str(out), "--quiet"]) == 0
    assert {r["policy"] for r in read_rows(out / "results.csv")} == {"kernel:xla"}
    assert main([*argv, "--kernel", "nope", "--out", str(tmp_path / "t")]) == 2
    assert "--kernel: expected one of" in capsys.readouterr().err
    assert main(["reproduce", "fig8", "--kernel", "xla", "--out", str(tmp_path / "r")]) == 2
