"""Exhaustive checks of fa_jax.round_to, kept out of the default run (``slow``).

Run them with ``pytest -m slow tests/test_rounding_exhaustive.py``.  Every check
uses a float64 carrier (jax_enable_x64 on); the small-format checks use float32 too.

* Round to nearest even: all 2**32 float32 bit patterns -> bfloat16 and float16,
  bit for bit against ml_dtypes' cast (a single correct rounding from float32).
* Directed modes ("down", "up", "toward_zero"): a dense structured subset of the
  float32 patterns -> bfloat16 and float16: every value of the top 20 bits (sign,
  exponent, the format's fraction, its rounding bit and more), each with low 12
  bits from a set holding 0, 1, the half-way patterns and all-ones, and random
  ones.  It contains, for both formats, every representable value, its
  neighbours one float32 ulp away, every exact midpoint and both sides of it.
* Every fp16 and every bf16 code -> every float8, float6 and float4 format of the
  registry, in round to nearest even (against ml_dtypes) and in every directed mode.

The directed-mode oracle does not use fa_jax: it sorts the finite values of the
format (its ml_dtypes codes decoded) and takes the largest value <= x ("down"),
the smallest value >= x ("up"), or the one of them nearer zero ("toward_zero");
a result past ±max is ±inf, then NaN for formats without inf, or ±max where the
format saturates.  A zero result has x's sign (IEEE 754 §6.3), except in fnuz
formats, which have no -0.  NaN and ±inf inputs give what ml_dtypes' cast gives
(the mapping is the same in every mode).  NaNs compare by NaN-ness and sign:
round_to returns a quiet NaN and does not keep payloads.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import BF16, FP16, Format, round_to
from fa_jax.formats import registered_formats

pytestmark = pytest.mark.slow

CHUNK = 1 << 24
DIRECTED = ("down", "up", "toward_zero")
WIDE = [BF16, FP16]
NARROW = [f for f in registered_formats() if f.dtype is not None and f.bits <= 8]


def _decoded(fmt: Format) -> np.ndarray:
    """Every code of fmt decoded by ml_dtypes, as float64."""
    dtype = np.dtype(fmt.dtype)
    bits = ml_dtypes.finfo(dtype).bits
    codes = np.arange(1 << bits, dtype=np.uint16 if bits > 8 else np.uint8)
    return codes.view(dtype).astype(np.float64)


def _directed_oracle(x: np.ndarray, fmt: Format, mode: str) -> np.ndarray:
    """x (float64) rounded to fmt in a directed mode, from the sorted values of fmt."""
    dtype = np.dtype(fmt.dtype)
    values = np.unique(_decoded(fmt))  # sorted; -0 and +0 merge
    values = values[np.isfinite(values)]
    below = np.searchsorted(values, x, side="right") - 1  # largest value <= x
    above = np.searchsorted(values, x, side="left")  # smallest value >= x
    down = np.where(below >= 0, values[np.clip(below, 0, None)], -np.inf)
    up = np.where(above < values.size, values[np.clip(above, None, values.size - 1)], np.inf)
    want = {"down": down, "up": up, "toward_zero": np.where(x >= 0, down, up)}[mode]
    if fmt.overflow == "saturate":
        want = np.clip(want, -fmt.max, fmt.max)
    else:  # past max: ±inf, as the cast maps it (NaN where the format has no inf)
        with np.errstate(invalid="ignore"):
            past = np.array([-np.inf, np.inf]).astype(dtype).astype(np.float64)
        want = np.where(np.isinf(want), past[(want > 0).astype(int)], want)
    sign = np.ones_like(x) if fmt.specials == "fnuz" else np.copysign(1.0, x)
    want = np.where(want == 0, np.copysign(0.0, sign), want)
    special = ~np.isfinite(x)  # NaN and ±inf: the cast's mapping, the same in every mode
    with np.errstate(over="ignore", invalid="ignore"):
        want[special] = x[special].astype(dtype).astype(np.float64)
    return want


def _mismatches(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Where got and want (float64) differ: in bits, or for NaNs in NaN-ness or sign."""
    same = got.view(np.uint64) == want.view(np.uint64)
    both_nan = np.isnan(got) & np.isnan(want) & (np.signbit(got) == np.signbit(want))
    return ~(same | both_nan)


def _report(x, got, want, what):
    bad = _mismatches(got, want)
    if bad.any():
        i = np.flatnonzero(bad)[:5]
        pytest.fail(
            f"{what}: {int(bad.sum())} mismatches, e.g. x={x[i].tolist()} "
            f"round_to={got[i].tolist()} oracle={want[i].tolist()}"
        )


def _rounder(fmt: Format, mode: str):
    """A compiled round_to in a float64 carrier.  (Widening float32 inputs inside the
    program would flush their subnormals on CPU: widen them on the host.)"""
    return jax.jit(lambda x: round_to(x, fmt, mode))


@pytest.mark.parametrize("fmt", WIDE, ids=lambda f: f.name)
def test_every_float32_rounds_to_nearest_even_like_ml_dtypes(fmt):
    dtype = np.dtype(fmt.dtype)
    offsets = np.arange(CHUNK, dtype=np.uint32)
    with x64_enabled():
        rounder = _rounder(fmt, "nearest_even")
        for start in range(0, 1 << 32, CHUNK):
            x = (offsets + np.uint32(start)).view(np.float32)
            got = np.asarray(rounder(x.astype(np.float64)))
            with np.errstate(over="ignore", invalid="ignore"):
                want = x.astype(dtype).astype(np.float64)
            _report(x, got, want, f"{fmt.name} nearest_even, inputs {start:#x}+")


def _structured_float32() -> np.ndarray:
    """All 2**20 top-20-bit patterns, each with 16 low-12-bit tails."""
    tails = [0, 1, 2, 0x7FF, 0x800, 0x801, 0xFFE, 0xFFF]
    tails += np.random.default_rng(0).integers(3, 0x7FF, 8).tolist()
    top = np.arange(1 << 20, dtype=np.uint32) << np.uint32(12)
    return (top[:, None] | np.array(tails, np.uint32)[None, :]).ravel().view(np.float32)


@pytest.mark.parametrize("mode", DIRECTED)
@pytest.mark.parametrize("fmt", WIDE, ids=lambda f: f.name)
def test_structured_float32_round_in_directed_modes_like_the_oracle(fmt, mode):
    x = _structured_float32()
    assert x.size == CHUNK
    with x64_enabled():
        got = np.asarray(_rounder(fmt, mode)(x.astype(np.float64)))
    _report(x, got, _directed_oracle(x.astype(np.float64), fmt, mode), f"{fmt.name} {mode}")


def _every_code(source: Format) -> np.ndarray:
    """Every code of a 16-bit format, as float32 (exact)."""
    return np.arange(1 << 16, dtype=np.uint16).view(source.dtype).astype(np.float32)


@pytest.mark.parametrize("source", WIDE, ids=lambda f: f.name)
@pytest.mark.parametrize("fmt", NARROW, ids=lambda f: f.name)
def test_every_16_bit_code_rounds_to_every_small_format(fmt, source):
    dtype = np.dtype(fmt.dtype)
    x = _every_code(source)
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = x.astype(dtype).astype(np.float64)
    with x64_enabled():
        for mode in ("nearest_even", *DIRECTED):
            if mode == "nearest_even":
                want = nearest
            else:
                want = _directed_oracle(x.astype(np.float64), fmt, mode)
            for carrier in (np.float32, np.float64):
                got = np.asarray(round_to(jnp.asarray(x.astype(carrier)), fmt, mode), np.float64)
                _report(x, got, want, f"{source.name} -> {fmt.name} {mode} ({carrier.__name__})")
