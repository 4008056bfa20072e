"""Scaled quantization to a narrow format, and incoherent processing (FlashAttention-3 §3.3).

FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608, §3.3 "Low-precision")
stores Q, K and V in FP8 (E4M3) with scale factors, and reduces the error of
that quantization in two ways:

* *block quantization*: one scale per Br × d block of Q and per Bc × d block
  of K and V (the tiles the kernel loads), instead of one per tensor;
* *incoherent processing*: Q and K are multiplied by M = D H / √d before
  quantizing, with D a random ±1 diagonal and H a Hadamard matrix.  M is
  orthogonal, so (Q M)(K M)ᵀ = Q M Mᵀ Kᵀ = Q Kᵀ in exact arithmetic, while
  an outlier coordinate is spread over all d coordinates.

Scales (amax scaling), in the arithmetic of a quantization kernel::

    s = fl_FP32(amax / fmt.max)         (s = 1 where that is 0: nothing to scale)
    x̂ = fl_fmt(fl_FP32(x / s))          quantize: values of fmt, float64 carrier
    x ≈ x̂ · s                           dequantize

``fmt`` is a floating-point :class:`~fa_jax.formats.Format` or an integer grid,
:class:`IntFormat` (:data:`INT8`: the integers -127 .. 127, symmetric, so that
-max is representable as max is), for which fl_fmt rounds to the nearest integer,
ties to even (``torch.round``, ``np.rint``), and clamps to ±max; a zero code is +0.

``amax`` is max |x| over the tensor (per tensor) or over each block of
``block`` consecutive rows of the sequence axis (-2) and all d columns of one
leading (batch, head) slice (per block).  Scales are FP32 values
(:data:`SCALE_FORMAT`), as kernels hold descale factors, and x / s is computed
in FP32 and then cast, as ``(x.float() / s).to(float8)`` does: for x of FP32
values (FP16 inputs included) x̂ equals numpy's float32 ``x / s`` cast by
ml_dtypes, bit for bit.  That is a double rounding: a quotient within 2^-24 of
a midpoint of ``fmt`` can round the other way than the exact x / s would.  The
divisions go through :func:`fa_jax.ops.div` (correctly rounded for operands of
at most 26 significand bits; a wider x is divided exactly, not first rounded
to FP32).  x̂ · s is exact in float64 (x̂ has man_bits + 1 significand bits,
s at most 24).

The element with |x| = amax maps to ±fmt.max exactly: s = (amax / max)(1 + δ)
with |δ| <= 2^-24, so x / s = max / (1 + δ) lies within 2^-23 relative of max,
which rounds to max in every format with fewer than 22 fraction bits; every
other element maps to at most max, so nothing overflows.  This needs s in
FP32's normal range (amax >= fmt.max · 2^-126); a smaller nonzero amax gives a
subnormal scale, or one that underflows to 0, which is replaced by 1 as for
amax = 0 (every |x| is then below fmt.max · 2^-149: x̂ is x rounded to fmt
unscaled, and no x / 0 makes a NaN).

A computation in float32 carriers (``dtype=np.float32`` where a function takes
it: FP32 values) gives the same values as in float64: the scale and the
quotient are FP32 values, rounded once by :func:`fa_jax.ops.div` in either.

Inputs must be finite: a concrete array with inf or NaN raises ValueError;
under ``jax.jit`` (where values are not known) a non-finite amax gives a NaN
scale, so the result is NaN rather than silently wrong.

Everything is ``jax.jit``/``jax.vmap`` compatible and needs ``jax_enable_x64``
(except in float32 carriers).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from numpy.typing import DTypeLike

from fa_jax import ops
from fa_jax._checks import is_int, positive_int
from fa_jax.formats import FP32, Format, get_format

__all__ = [
    "INT8",
    "SCALE_FORMAT",
    "IntFormat",
    "amax_scale",
    "dequantize",
    "expand_block_scales",
    "hadamard",
    "incoherent_matrix",
    "incoherent_transform",
    "per_block_scales",
    "per_tensor_scale",
    "quantize",
    "quantize_per_block",
    "quantize_per_tensor",
    "random_signs",
    "storage_format",
]

SCALE_FORMAT = FP32


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class IntFormat:
    """A symmetric signed integer grid: the integers -max .. max with
    max = 2^(bits - 1) - 1 (module docstring).  A pytree with no leaves: its
    width is static."""

    name: str
    bits: int

    def __post_init__(self):
        if not is_int(self.bits) or not 2 <= self.bits <= 24:
            raise ValueError(f"IntFormat.bits: expected an integer in 2..24, got {self.bits!r}")

    @property
    def max(self) -> float:
        return float(2 ** (self.bits - 1) - 1)

    @property
    def is_concrete(self) -> bool:
        return True

    def fits(self, dtype) -> bool:
        """Whether ``dtype`` (float32 or float64) holds every value: always (bits <= 24)."""
        return True

    def tree_flatten(self):
        return (), (self.name, self.bits)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux)


INT8 = IntFormat("int8", 8)
_INT_FORMATS = {"int8": INT8}


def storage_format(spec) -> Format | IntFormat:
    """A quantization target: an :class:`IntFormat` or its name ("int8"), else a
    floating-point Format by :func:`fa_jax.formats.get_format`."""
    if isinstance(spec, IntFormat):
        return spec
    if isinstance(spec, str) and spec.strip().lower() in _INT_FORMATS:
        return _INT_FORMATS[spec.strip().lower()]
    return get_format(spec)


# -- checks ---------------------------------------------------------------------


def _target(fmt, fn: str) -> Format | IntFormat:
    fmt = storage_format(fmt)
    if not fmt.is_concrete:
        raise TypeError(f"{fn}: expected a concrete Format, got traced widths in {fmt!r}")
    return fmt


def finite_input(x, fn: str, dtype: DTypeLike = np.float64) -> jax.Array:
    """``x`` as a carrier of ``dtype``; a concrete array must be finite."""
    x = ops.carrier(x, dtype)
    if not isinstance(x, Tracer):
        bad = int(np.sum(~np.isfinite(np.asarray(x))))
        if bad:
            raise ValueError(
                f"{fn}: expected finite values, got {bad} non-finite (inf or NaN) "
                f"of {x.size} entries"
            )
    return x


def _block_size(block, n: int, shape, fn: str) -> int:
    block = positive_int(block, f"{fn}: block")
    if n % block:
        raise ValueError(
            f"{fn}: block={block} does not divide the sequence length {n} "
            f"(axis -2 of shape {tuple(shape)})"
        )
    return block


def _matrix_input(x, fn: str) -> jax.Array:
    x = finite_input(x, fn)
    if x.ndim < 2:
        raise ValueError(f"{fn}: expected an array (..., N, d), got shape {x.shape}")
    return x


# -- scales ---------------------------------------------------------------------
# Each public function checks its arguments and calls one jitted core (the format
# and block size static), so eager calls compile once per shape, not once per op.


@functools.partial(jax.jit, static_argnames=("fmt",))
def _amax_scale(amax, fmt: Format | IntFormat):
    s = ops.div(amax, jnp.full_like(amax, fmt.max), SCALE_FORMAT)
    s = jnp.where(s == 0, 1.0, s)  # amax = 0, or amax / max below FP32's subnormals
    return jnp.where(jnp.isfinite(amax), s, jnp.nan)


@functools.partial(jax.jit, static_argnames=("fmt", "block"))
def _block_scales(x, fmt: Format | IntFormat, block):
    if block is None:
        return _amax_scale(jnp.max(jnp.abs(x)), fmt)
    n, d = x.shape[-2:]
    tiles = x.reshape(*x.shape[:-2], n // block, block * d)
    return _amax_scale(jnp.max(jnp.abs(tiles), axis=-1, keepdims=True), fmt)


@functools.partial(jax.jit, static_argnames=("fmt",))
def _quantize(x, scale, fmt: Format | IntFormat):
    y = ops.div(x, scale, SCALE_FORMAT)
    if isinstance(fmt, IntFormat):
        r = jnp.clip(jnp.round(y), -fmt.max, fmt.max)  # jnp.round: ties to even
        return jnp.where(r == 0, 0.0, r).astype(y.dtype)  # an integer has no -0
    return ops.cast(y, fmt)


def amax_scale(amax, fmt, *, dtype: DTypeLike = np.float64) -> jax.Array:
    """s = fl_FP32(amax / fmt.max) elementwise, in a carrier of ``dtype``; 1 where
    that is 0, NaN where amax is not finite (module docstring)."""
    return _amax_scale(ops.carrier(amax, dtype), _target(fmt, "amax_scale"))


def per_tensor_scale(x, fmt) -> jax.Array:
    """One scale for the whole array: amax_scale(max |x|), shape ()."""
    x = finite_input(x, "per_tensor_scale")
    return _block_scales(x, _target(fmt, "per_tensor_scale"), None)


def per_block_scales(x, fmt, block: int) -> jax.Array:
    """One scale per ``block`` × d block of rows of x (..., N, d): shape (..., N // block, 1).

    Raises ValueError if ``block`` does not divide N."""
    x = _matrix_input(x, "per_block_scales")
    block = _block_size(block, x.shape[-2], x.shape, "per_block_scales")
    return _block_scales(x, _target(fmt, "per_block_scales"), block)


def expand_block_scales(scales, block: int) -> jax.Array:
    """Per-block scales (..., N // block, 1) repeated to per-row scales (..., N, 1)."""
    block = positive_int(block, "expand_block_scales: block")
    return jnp.repeat(scales, block, axis=-2)


# -- quantize / dequantize --------------------------------------------------------


def quantize(x, scale, fmt, *, dtype: DTypeLike = np.float64) -> jax.Array:
    """x̂ = fl_fmt(fl_FP32(x / scale)) (module docstring), in a carrier of ``dtype``;
    ``scale`` broadcasts against x (a per-tensor scalar, or per-row scales (..., N, 1))."""
    fmt = _target(fmt, "quantize")
    x = finite_input(x, "quantize", dtype)
    return _quantize(x, ops.carrier(scale, dtype), fmt)


def dequantize(x_hat, scale) -> jax.Array:
    """x̂ · scale in float64 (exact for x̂ of <= 29 and scale of <= 24 significand bits)."""
    return ops.carrier(x_hat, np.float64) * ops.carrier(scale, np.float64)


def quantize_per_tensor(x, fmt) -> tuple[jax.Array, jax.Array]:
    """(x̂, s) with one amax scale for the whole array (the FP8 baseline's scaling)."""
    s = per_tensor_scale(x, fmt)
    return quantize(x, s, fmt), s


def quantize_per_block(x, fmt, block: int) -> tuple[jax.Array, jax.Array]:
    """(x̂, s) with one amax scale per ``block`` × d block (FlashAttention-3's block
    quantization); s has shape (..., N // block, 1): expand it with
    :func:`expand_block_scales` to dequantize."""
    s = per_block_scales(x, fmt, block)
    return quantize(x, expand_block_scales(s, block), fmt), s


# -- incoherent processing ---------------------------------------------------------


def _power_of_two(d, fn: str) -> int:
    if not is_int(d) or d < 1 or d & (d - 1):
        raise ValueError(f"{fn}: d: expected a power of 2 (Sylvester's construction), got {d!r}")
    return int(d)


def hadamard(d: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order d (a power of 2), float64 entries ±1:
    H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]; H Hᵀ = d I exactly."""
    d = _power_of_two(d, "hadamard")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def random_signs(key, d: int) -> jax.Array:
    """The diagonal of D: d independent ±1 values (float64) drawn from ``key``."""
    d = positive_int(d, "random_signs: d")
    ops.require_x64()
    return jax.random.rademacher(key, (d,), dtype=jnp.float64)


def incoherent_matrix(key, d: int) -> jax.Array:
    """M = D H / √d (d × d, float64): orthogonal, M Mᵀ = I (exactly when d is a
    power of 4, where 1/√d is a power of 2; to within float64 rounding otherwise)."""
    h = hadamard(d)
    return random_signs(key, d)[:, None] * jnp.asarray(h) * (1.0 / math.sqrt(d))


def incoherent_transform(q, k, key) -> tuple[jax.Array, jax.Array]:
    """(Q M, K M) with M = :func:`incoherent_matrix` (key, d): Q Kᵀ is unchanged in
    exact arithmetic; here it is computed in float64 (relative error of order 2^-53)."""
    q = _matrix_input(q, "incoherent_transform")
    k = _matrix_input(k, "incoherent_transform")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"incoherent_transform: expected q (..., N, d) and k (..., M, d) with the same d, "
            f"got {q.shape} and {k.shape}"
        )
    _power_of_two(q.shape[-1], "incoherent_transform")
    return _incoherent(q, k, key)


@jax.jit
def _incoherent(q, k, key):
    m = incoherent_matrix(key, q.shape[-1])

    def rotate(x):
        return jnp.matmul(
            x, m, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float64
        )

    return rotate(q), rotate(k)
