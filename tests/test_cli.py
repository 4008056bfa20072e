"""The fa-jax command: output and error handling."""

import re
import subprocess
import sys

import pytest

from fa_jax.cli import main


def test_formats_table(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["name", "bits", "e", "m"]
    assert "float8_e4m3fn" in out and "448" in out


def test_round_shows_value_bits_and_error(capsys):
    assert main(["round", "0.1", "--format", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "rounded    0.10009765625" in out
    assert "0 01111011 1001101  (0x3DCD" in out
    assert "= 0.25 u" in out


def test_round_overflow_note(capsys):
    assert main(["round", "500", "-f", "e4m3fn"]) == 0
    assert "overflows to nan (it has no infinity)" in capsys.readouterr().out


def test_bad_format_is_one_line_and_nonzero(capsys):
    assert main(["round", "0.1", "-f", "bf17"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fa-jax round: unknown format 'bf17'") and "\n" not in err


def test_unparsable_value_is_an_error(capsys):
    assert main(["round", "abc", "-f", "bf16"]) == 2
    assert "could not convert" in capsys.readouterr().err


def test_console_script_survives_a_closed_pipe():
    proc = subprocess.run(
        f"{sys.executable} -m fa_jax.cli formats | head -1",
        shell=True,
        capture_output=True,
        text=True,
    )
    assert proc.stdout.startswith("name") and "Traceback" not in proc.stderr


def test_round_leaves_the_x64_setting_alone(capsys):
    import jax

    before = jax.config.jax_enable_x64
    main(["round", "0.1", "-f", "fp16"])
    assert jax.config.jax_enable_x64 == before


def test_version_flag(capsys):
    import fa_jax

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"fa-jax {fa_jax.__version__}"


def test_python_dash_m_fa_jax_help_and_version():
    import fa_jax

    help_ = subprocess.run(
        [sys.executable, "-m", "fa_jax", "--help"], capture_output=True, text=True, check=True
    )
    assert help_.stdout.startswith("usage: fa-jax") and "reproduce" in help_.stdout
    version = subprocess.run(
        [sys.executable, "-m", "fa_jax", "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip() == f"fa-jax {fa_jax.__version__}"


def test_formats_table_columns_line_up(capsys):
    assert main(["formats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, first = lines[0], lines[1]
    at = header.index("bits")  # cells start under their headers
    assert first[at - 2 : at] == "  " and first[at] != " "
    assert all(line == line.rstrip() for line in lines)


# -- output locations are checked before anything is computed or written ------------

SWEEP = ["sweep", "--formats", "bf16", "--seq-lens", "16", "--blocks", "8x8", "--d", "8"]


def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(prefix) and "\n" not in err, err
    return err


def _no_run(monkeypatch):
    """Make any computation fail loudly: the checks must come before it."""
    from fa_jax.studies import attribution, figure_runs
    from fa_jax.studies.sweep import engine

    def boom(*args, **kwargs):
        raise AssertionError("computed before checking --out")

    monkeypatch.setattr(engine, "_sweep", boom)
    monkeypatch.setattr(attribution, "attribute", boom)
    monkeypatch.setattr(figure_runs, "run_sweep", boom)


@pytest.mark.parametrize("cmd", ["sweep", "attribute", "reproduce"])
@pytest.mark.parametrize("where", ["file", "under_file"])
def test_out_that_is_or_lies_under_a_file_is_refused_before_computing(
    tmp_path, capsys, monkeypatch, cmd, where
):
    _no_run(monkeypatch)
    (tmp_path / "f").write_text("keep")
    out = tmp_path / "f" if where == "file" else tmp_path / "f" / "sub"
    argv = {
        "sweep": [*SWEEP, "--quiet"],
        "attribute": ["attribute", "--n", "16", "--bc", "8", "--d", "8", "--no-plot"],
        "reproduce": ["reproduce", "fig4", "--quick"],
    }[cmd]
    assert main([*argv, "--out", str(out)]) == 2
    err = _one_line(capsys, f"fa-jax {cmd}: --out: expected a folder")
    assert ("which is a file" if where == "file" else "lies under the file") in err
    assert (tmp_path / "f").read_text() == "keep" and sorted(tmp_path.iterdir()) == [tmp_path / "f"]


def test_sweep_into_a_foreign_results_csv_overwrites_nothing(tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    (tmp_path / "results.csv").write_text("name,score\nx,1\n")
    (tmp_path / "metadata.json").write_text('{"mine": true}')
    assert main([*SWEEP, "--quiet", "--out", str(tmp_path)]) == 2
    err = _one_line(capsys, "fa-jax sweep: --out: ")
    assert "results.csv" in err and "was not written by this study" in err
    assert (tmp_path / "results.csv").read_text() == "name,score\nx,1\n"
    assert (tmp_path / "metadata.json").read_text() == '{"mine": true}'


def test_reproduce_into_a_foreign_figure_csv_overwrites_nothing(tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    (tmp_path / "fig4").mkdir()
    (tmp_path / "fig4" / "results.csv").write_text("a\n1\n")
    assert main(["reproduce", "fig4", "--quick", "--out", str(tmp_path)]) == 2
    err = _one_line(capsys, "fa-jax reproduce: output folder: ")
    assert "fig4" in err and "was not written by this study" in err
    assert sorted(p.name for p in (tmp_path / "fig4").iterdir()) == ["results.csv"]


def test_attribute_into_a_foreign_csv_is_refused_before_computing(tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    (tmp_path / "attribution.csv").write_text("a\n1\n")
    argv = ["attribute", "--n", "16", "--bc", "8", "--d", "8", "--no-plot", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "was not written by this study" in _one_line(capsys, "fa-jax attribute: --out: ")


# -- argument checks --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "flag", "got"),
    [
        (["--bc", "32"], "--bc", "br=32, bc=32"),
        (["--bc", "8", "--br", "32"], "--br", "br=32, bc=8"),
    ],
)
def test_attribute_refuses_tiles_larger_than_n(tmp_path, capsys, monkeypatch, extra, flag, got):
    _no_run(monkeypatch)
    assert main(["attribute", "--n", "16", "--d", "8", *extra, "--out", str(tmp_path)]) == 2
    err = _one_line(capsys, f"fa-jax attribute: {flag}: Blocks(")
    assert f"gives {got}; expected both <= the seq_len 16" in err


@pytest.mark.parametrize("seed", [str(2**70), str(2**63), "-1"])
@pytest.mark.parametrize("cmd", ["round", "sweep", "attribute"])
def test_out_of_range_seeds_are_one_line(tmp_path, capsys, monkeypatch, cmd, seed):
    _no_run(monkeypatch)
    argv = {
        "round": ["round", "0.1", "-f", "bf16", "--mode", "stochastic", "--seed", seed],
        "sweep": [*SWEEP, "--out", str(tmp_path), "--seeds", seed],
        "attribute": [
            "attribute",
            "--n",
            "16",
            "--bc",
            "8",
            "--out",
            str(tmp_path),
            "--seeds",
            seed,
        ],
    }[cmd]
    assert main(argv) == 2
    flag = "--seed" if cmd == "round" else "--seeds"
    err = _one_line(capsys, f"fa-jax {cmd}: {flag}: ")
    assert "0 .. 2**63 - 1" in err and seed in err
    assert list(tmp_path.iterdir()) == []


def test_largest_seed_is_accepted(capsys):
    argv = ["round", "0.1", "-f", "bf16", "--mode", "stochastic", "--seed", str(2**63 - 1)]
    assert main(argv) == 0


def test_fig8_without_optax_gives_an_install_hint_and_leaves_no_folder(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "optax", None)  # import optax raises ImportError
    out = tmp_path / "out"
    assert main(["reproduce", "fig8", "--quick", "--out", str(out)]) == 2
    err = _one_line(capsys, "fa-jax reproduce: ")
    assert "optax" in err and "pip install 'fa-jax[train]'" in err
    assert not out.exists()


# -- round: negative values, saturation, underflow ----------------------------------------


def test_round_help_documents_the_negative_value_forms_that_work(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens; keep one line
    with pytest.raises(SystemExit):
        main(["round", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    for form in ("fa-jax round --format bf16 -- -1.5", "fa-jax round -1.5 -f bf16"):
        assert form in help_
        assert main(form.split()[1:]) == 0
        assert "input      -1.5" in capsys.readouterr().out
    assert main(["round", "--format", "bf16", "--", "-1e3"]) == 0
    assert "rounded    -1000.0" in capsys.readouterr().out
    assert "'fa-jax round -- -1.5 --format bf16' fails" in help_
    with pytest.raises(SystemExit) as exc:  # as the help says
        main(["round", "--", "-1.5", "--format", "bf16"])
    assert exc.value.code == 2


def _round_lines(capsys, *argv) -> dict:
    assert main(["round", *argv]) == 0
    return {line[:10].strip(): line[11:] for line in capsys.readouterr().out.splitlines()}


@pytest.mark.parametrize(("mode", "value"), [("toward_zero", "1e5"), ("down", "1e5")])
def test_round_flags_saturation_in_directed_modes(capsys, mode, value):
    lines = _round_lines(capsys, "-f", "e4m3fn", "--mode", mode, "--", value)
    assert lines["rounded"] == "448.0"
    assert lines["saturated"].startswith("|x| > max = 448.0;") and mode in lines["saturated"]
    assert "overflow" not in lines


def test_round_does_not_flag_saturation_where_it_overflows_or_fits(capsys):
    lines = _round_lines(capsys, "-f", "bf16", "--", "1e39")
    assert "overflow" in lines and "saturated" not in lines
    lines = _round_lines(capsys, "-f", "e4m3fn", "--mode", "toward_zero", "--", "448")
    assert "saturated" not in lines and "underflow" not in lines


def test_round_flags_underflow_to_zero_and_to_a_subnormal(capsys):
    lines = _round_lines(capsys, "-f", "bf16", "--", "-1e-45")
    assert lines["rounded"] == "-0.0"
    assert lines["underflow"].startswith("nonzero x rounds to -0.0")
    lines = _round_lines(capsys, "-f", "fp16", "--", "1e-6")
    assert lines["underflow"].startswith("x rounds to a subnormal")
    for value in ("0", "0.1", "6.103515625e-05"):  # zero, normal, fp16's tiny: no flag
        assert "underflow" not in _round_lines(capsys, "-f", "fp16", "--", value)


@pytest.mark.extended  # 4 s: for the default run's time only
def test_sweep_profile_and_no_cache(capsys, tmp_path, monkeypatch):
    """--profile prints one line per program to stderr; --no-cache stores nothing, and
    the default stores every program, which a second run loads."""
    monkeypatch.setenv("FA_JAX_CACHE_DIR", str(tmp_path / "cache"))
    cmd = ["sweep", "--formats", "bf16", "--seq-lens", "12", "--blocks", "4x8", "--d", "8"]
    assert main([*cmd, "--out", str(tmp_path / "a"), "--no-cache", "--profile", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert not (tmp_path / "cache").exists()
    # golden and baseline share one reference program (one policy shape); the metrics
    # are one program (every comparison and statistic of a configuration)
    assert "(3 compiled, 0 loaded)" in err and "flash fa2 Bc=8" in err
    assert re.search(r"^reference N<=12 +compiled +2 ", err, re.M)
    assert re.search(r"^metrics +compiled ", err, re.M)
    for run in ("b", "c"):
        assert main([*cmd, "--out", str(tmp_path / run), "--profile", "--quiet"]) == 0
    assert "(0 compiled, 3 loaded)" in capsys.readouterr().err
    assert (tmp_path / "a" / "results.csv").read_bytes() == (
        tmp_path / "c" / "results.csv"
    ).read_bytes()
