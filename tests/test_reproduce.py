"""fa_jax.studies.figures (the paper's figures) and the `fa-jax sweep` / `reproduce` commands.

Every grid here has d=8 and a flat batch of 2 configurations padded to N=16, so the
jitted programs compile once and are reused across tests (the file stays well under
a minute on a 2-core CPU).
"""

import csv
import math
import subprocess
import sys

import pytest

from fa_jax.cli import main
from fa_jax.studies.figures import FIGURES, fig3, fig4, fig5, fig6
from fa_jax.studies.reproduce import reproduce
from fa_jax.studies.sweep import SramBlocks

POLICIES = ("paper_uniform", "fa2_kernel")
TINY = dict(d=8, seeds=(0,), blocks=(SramBlocks(256),))  # d=8, M=256: 8x8 tiles


def _check_files(res, fig):
    assert res["figure"] == fig
    with open(res["csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and {r["policy"] for r in rows} == set(POLICIES)
    with open(res["png"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert res["csv"].endswith(f"{fig}/results.csv") and res["png"].endswith(f"{fig}/{fig}.png")


def _finite_positive(*vals):
    for v in vals:
        assert math.isfinite(v) and v >= 0


@pytest.mark.extended  # 5 s: for the default run's time only
def test_fig3_formats_and_mantissa_sweep(tmp_path, capsys):
    res = fig3(
        tmp_path,
        quick=True,
        policies=POLICIES,
        grid_overrides=dict(TINY, formats=("bf16", (8, 3)), seq_lens=(16,)),
        quiet=True,
    )
    _check_files(res, "fig3")
    assert {(r["policy"], r["format"]) for r in res["rows"]} == {
        (p, f) for p in POLICIES for f in ("bfloat16", "e8m3")
    }
    for r in res["rows"]:
        assert set(r) >= {"man_bits", "flash_vs_golden", "baseline_vs_golden", "ratio"}
        _finite_positive(r["flash_vs_golden"], r["baseline_vs_golden"])
    by = {(r["policy"], r["man_bits"]): r["flash_vs_golden"] for r in res["rows"]}
    assert by[("paper_uniform", 3)] > by[("paper_uniform", 7)]  # fewer bits, more deviation
    assert "Fig 3" in capsys.readouterr().out


def test_fig4_ratio_per_format(tmp_path, capsys):
    res = fig4(
        tmp_path,
        quick=True,
        policies=POLICIES,
        grid_overrides=dict(TINY, formats=("bf16", "fp16"), seq_lens=(16,)),
        quiet=True,
    )
    _check_files(res, "fig4")
    assert len(res["rows"]) == 4
    for r in res["rows"]:
        assert set(r) >= {
            "policy",
            "format",
            "flash_vs_golden",
            "baseline_vs_golden",
            "flash_vs_baseline",
            "ratio",
        }
        assert r["ratio"] == pytest.approx(r["flash_vs_golden"] / r["baseline_vs_golden"])
    assert "ratio" in capsys.readouterr().out


def test_fig5_seq_len(tmp_path):
    res = fig5(
        tmp_path,
        quick=True,
        policies=POLICIES,
        grid_overrides=dict(TINY, seq_lens=(8, 16)),
        quiet=True,
    )
    _check_files(res, "fig5")
    assert [(r["policy"], r["seq_len"], r["kv_blocks"]) for r in res["rows"]] == [
        (p, n, n // 8) for p in POLICIES for n in (8, 16)
    ]
    for r in res["rows"]:
        _finite_positive(
            *(r[f"{w}_{m}"] for w in ("flash", "baseline") for m in ("max", "mean", "std"))
        )


# The default run checks padded against unpadded lengths in test_attention and test_sweep.
@pytest.mark.slow
def test_full_grids_split_into_per_length_sweeps_with_the_same_numbers(tmp_path):
    kw = dict(policies=("paper_uniform",), quiet=True, grid_overrides=dict(TINY, seq_lens=(8, 16)))
    quick = fig5(tmp_path / "q", quick=True, **kw)
    full = fig5(tmp_path / "f", quick=False, **kw)  # one run_sweep per length
    assert full["rows"] == quick["rows"]  # padded and unpadded runs agree bitwise
    assert (tmp_path / "f" / "fig5" / "grid.json").exists()


def test_fig6_blocks(tmp_path):
    blocks = (
        SramBlocks(512),
        SramBlocks(512, swap=True),
        SramBlocks(512, square=True),
        SramBlocks(256),
    )
    res = fig6(
        tmp_path,
        quick=True,
        policies=POLICIES,
        grid_overrides=dict(TINY, seq_lens=(16,), seeds=(0, 1), blocks=blocks),
        quiet=True,
    )
    _check_files(res, "fig6")
    got = [
        (r["blocks"], r["config"], r["br"], r["bc"], r["kv_blocks"])
        for r in res["rows"]
        if r["policy"] == "paper_uniform"
    ]
    assert got == [
        ("sram512", "default", 8, 16, 1),
        ("sram512_swap", "swap (6a)", 16, 8, 2),
        ("sram512_square", "square (6b)", 16, 16, 1),
        ("sram256", "default", 8, 8, 2),
    ]
    # FA2 rows are independent: only Bc (the number of rescalings) changes the output
    dev = {r["blocks"]: r["flash_vs_golden"] for r in res["rows"] if r["policy"] == "paper_uniform"}
    assert dev["sram512_swap"] == dev["sram256"] and dev["sram512"] == dev["sram512_square"]


def test_reproduce_rejects_unknown_figure(tmp_path):
    assert set(FIGURES) == {"fig3", "fig4", "fig5", "fig6"}
    with pytest.raises(ValueError, match="which"):
        reproduce("fig7", tmp_path, quick=True)


def test_cli_sweep_writes_results(tmp_path, capsys):
    out = tmp_path / "sw"
    assert (
        main(
            [
                "sweep",
                "--formats",
                "bf16,fp16",
                "--seq-lens",
                "16",
                "--blocks",
                "sram256",
                "--policies",
                "paper_uniform",
                "fa2_kernel",
                "--d",
                "8",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    assert "results.csv" in capsys.readouterr().out
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 * 2 * 3 * 4  # policies x formats x comparisons x metrics
    assert {r["blocks"] for r in rows} == {"sram256"} and {r["br"] for r in rows} == {"8"}
    assert (out / "metadata.json").exists()


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--formats", "bf17", "--seq-lens", "16", "--blocks", "8x8"], "--formats"),
        (["--formats", "bf16", "--seq-lens", "0", "--blocks", "8x8"], "--seq-lens"),
        (["--formats", "bf16", "--seq-lens", "16", "--blocks", "64x64"], "--blocks"),
        (["--formats", "--seq-lens", "16", "--blocks", "8x8"], "--formats"),
        (["--formats", "", "--seq-lens", "16", "--blocks", "8x8"], "--formats"),
        (["--formats", "bf16", "--seq-lens", "16", "--blocks", "8by8"], "--blocks"),
        (
            ["--formats", "bf16", "--seq-lens", "16", "--blocks", "8x8", "--policies", "nope"],
            "--policies",
        ),
        (["--formats", "bf16", "--seq-lens", "16", "--blocks", "8x8", "--d", "0"], "--d"),
    ],
)
def test_cli_sweep_bad_arguments(tmp_path, capsys, args, flag):
    assert main(["sweep", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fa-jax sweep: {flag}") and "\n" not in err
    assert not (tmp_path / "results.csv").exists()


def test_cli_bad_argument_exit_status_in_a_process(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fa_jax.cli",
            "sweep",
            "--formats",
            "bf16",
            "--seq-lens",
            "16",
            "--blocks",
            "64x64",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("fa-jax sweep: --blocks")


def test_cli_reproduce_bad_policy(tmp_path, capsys):
    assert main(["reproduce", "fig4", "--quick", "--out", str(tmp_path), "--policy", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fa-jax reproduce:") and "nope" in err and "\n" not in err


def test_reproduce_unknown_policy_names_the_flag(capsys):
    from fa_jax.cli import main

    assert main(["reproduce", "fig4", "--quick", "--policy", "fa3_kernel"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fa-jax reproduce: --policy: expected one of") and "fa3_kernel" in err
    assert "\n" not in err


def test_a_second_run_into_the_same_folder_reports_only_its_own_seeds(tmp_path):
    """A quick run into a folder holding other seeds' rows (e.g. a full run) averages
    only its own configurations: the same rows as the same grid run alone."""
    grid = dict(TINY, formats=("bf16", "fp16"), seq_lens=(16,))
    first = fig4(
        tmp_path / "shared", quick=True, policies=POLICIES, grid_overrides=grid, quiet=True
    )
    again = dict(grid, seeds=(1,))
    second = fig4(
        tmp_path / "shared", quick=True, policies=POLICIES, grid_overrides=again, quiet=True
    )
    alone = fig4(
        tmp_path / "alone", quick=True, policies=POLICIES, grid_overrides=again, quiet=True
    )
    with open(second["csv"], newline="") as fh:
        assert {r["seed"] for r in csv.DictReader(fh)} == {"0", "1"}  # both runs' rows are there
    assert second["rows"] == alone["rows"]
    assert second["rows"] != first["rows"]  # the seeds differ, so would a mixed mean
