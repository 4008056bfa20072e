"""The fa-jax command: output and error handling."""

import subprocess
import sys


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
        f"{sys.executable} -m fa_jax.cli formats | head -1", shell=True, capture_output=True, text=True
    )
    assert proc.stdout.startswith("name") and "Traceback" not in proc.stderr


def test_round_leaves_the_x64_setting_alone(capsys):
    import jax

    before = jax.config.jax_enable_x64
    main(["round", "0.1", "-f", "fp16"])
    assert jax.config.jax_enable_x64 == before
