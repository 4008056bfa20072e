"""experiments/gpu_check.py on the CPU: both sides are the CPU, so every case must
be bit-identical and the table must name every preset and attention variant; and
a single differing bit is reported and makes the exit status 1."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import load_experiment

from fa_jax.attention import VARIANTS
from fa_jax.presets import PRESETS

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    return load_experiment(SCRIPT)


@pytest.mark.extended  # 16 s
def test_quick_run_on_cpu_is_bit_identical_and_lists_every_case(gpu_check, capsys):
    x64 = jax.config.read("jax_enable_x64")
    status = gpu_check.main(["--quick", "--skip-timing", "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert jax.config.read("jax_enable_x64") == x64, "main did not restore jax_enable_x64"
    assert "command: python experiments/gpu_check.py --quick --skip-timing --device cpu" in out
    rows = [line for line in out.splitlines() if line.startswith(("round_to ", *PRESETS, "golden"))]
    for name in (*PRESETS, "golden"):
        assert any(row.startswith(name) for row in rows), f"no row for preset {name}"
    for name in ("reference", *(f"flash/{v}" for v in VARIANTS)):
        assert any(f" {name} " in row for row in rows), f"no row for {name}"
    for output in ("O", "lse", "dQ", "dK", "dV"):
        assert any(row.split()[3:4] == [output] for row in rows if "round_to" not in row)
    for mode in ("nearest_even", "toward_zero", "up", "down", "stochastic"):
        assert any(row.startswith("round_to ") and f" {mode} " in row for row in rows)
    assert all(row.split()[-2] == "100" for row in rows), out
    assert "bit identity: all" in out


def test_one_differing_bit_is_reported(gpu_check, capsys):
    a = np.array([1.0, -2.5, np.inf, 0.0])
    b = a.copy()
    b.view(np.uint64)[1] ^= np.uint64(1)  # the last significand bit of -2.5
    c = gpu_check.compare("one bit", a, b)
    assert (c.elements, c.identical, c.ok) == (4, 3, False)
    assert c.identical_pct == 75.0
    assert c.max_abs_diff == 2.0**-51
    assert gpu_check.verdict([gpu_check.compare("same", a, a), c]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 cases NOT identical" in out and "one bit: 75.0000% identical" in out


def test_signed_zero_and_nan_differences_count(gpu_check):
    signed = gpu_check.compare("zero", np.array([0.0]), np.array([-0.0]))
    assert (signed.identical, signed.max_abs_diff) == (0, 0.0)
    nan = gpu_check.compare("nan", np.array([np.nan, 1.0]), np.array([1.0, 1.0]))
    assert (nan.identical, nan.max_abs_diff) == (1, np.inf)
    assert gpu_check.verdict([gpu_check.compare("same", np.ones(3), np.ones(3))]) == 0


def test_compare_rejects_different_shapes(gpu_check):
    with pytest.raises(ValueError, match="expected equal shapes"):
        gpu_check.compare("shapes", np.zeros(2), np.zeros(3))
