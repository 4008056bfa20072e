"""The fa-jax command: output and error handling."""

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
