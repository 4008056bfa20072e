"""compare(): bit-identical counts, ulp distances (checked against ml_dtypes' own
ordering of the format's values) and the errors against the FP64 golden."""

import ml_dtypes
import numpy as np
import pytest

from fa_jax.kernels import compare
from fa_jax.kernels.compare import BINS


def _positions(x: np.ndarray, dtype) -> np.ndarray:
    """Each value's position in the format's ordered set (+0 and -0 both 0), from
    ml_dtypes' bit patterns."""
    width = np.dtype(dtype).itemsize * 8
    bits = x.astype(dtype).view(f"uint{width}").astype(np.int64)
    sign = 1 << (width - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16), ("e4m3fn", ml_dtypes.float8_e4m3fn)],
)
def test_ulp_histogram_matches_ml_dtypes_ordering(fmt, dtype):
    rng = np.random.default_rng(0)
    finfo = ml_dtypes.finfo(dtype)
    a = rng.standard_normal(4000).astype(dtype)
    steps = rng.choice([0, 0, 0, 1, -1, 2, 5, -9, 40], size=a.size)
    pos = np.clip(
        _positions(a, dtype) + steps, -int(_positions(np.array([finfo.max]), dtype)[0]), None
    )
    width = np.dtype(dtype).itemsize * 8
    sign = 1 << (width - 1)
    bits = np.where(pos < 0, (-pos) | sign, pos).astype(f"uint{width}")
    b = bits.view(dtype)
    golden = a.astype(np.float64)
    c = compare(a.astype(np.float64), b.astype(np.float64), golden, fmt, exact_histogram=True)
    expected = np.abs(_positions(a, dtype) - _positions(b, dtype))
    values, counts = np.unique(expected, return_counts=True)
    assert c.ulp_histogram == dict(zip(values.tolist(), counts.tolist()))
    assert c.max_ulp == expected.max()
    same_bits = a.astype(np.float64).view(np.uint64) == b.astype(np.float64).view(np.uint64)
    assert c.identical == np.count_nonzero(same_bits)
    assert c.elements == a.size and c.unrepresentable == 0


def test_binned_histogram_and_errors():
    real = np.array([1.0, 1.0, -0.0, 2.0, 4.0])
    emulated = np.array([1.0, 1.0078125, 0.0, 2.0 + 3 * 2**-6, 4.0 + 20 * 2**-5])  # bf16 steps
    golden = np.array([1.0, 1.0, 0.0, 2.0, 4.0])
    c = compare(real, emulated, golden, "bf16")
    # 0 ulp twice (1.0, and -0.0 against 0.0), then 1, 3 and 20 steps of bf16
    assert c.ulp_histogram == dict(zip((b[0] for b in BINS), [2, 1, 0, 1, 1]))
    assert c.max_ulp == 20
    assert c.identical == 1  # -0.0 and 0.0 are 0 ulp apart but not the same bits
    assert c.real_max_abs == 0.0 and c.real_rel_frobenius == 0.0
    diff = emulated - golden
    assert c.emulated_max_abs == np.abs(diff).max()
    assert c.emulated_rel_frobenius == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(golden))


def test_values_outside_the_format_are_counted_apart():
    c = compare(np.array([1.0, np.nan]), np.array([1.0 + 2**-20, np.nan]), np.ones(2), "bf16")
    assert c.unrepresentable == 2 and c.max_ulp == 0


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="one shape"):
        compare(np.zeros(3), np.zeros(3), np.zeros(2), "bf16")
