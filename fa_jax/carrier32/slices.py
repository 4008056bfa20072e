"""Exact dot products of float32 operands from float32 dots of digit slices.

The fast path of :func:`fa_jax.carrier32.sums.matmul`'s "exact" model: ``a @ b`` as a
few exact integer dots, in the manner of Ozaki et al. (2012), "Error-free
transformations of matrix multiplication by using fast routines of matrix
multiplication and its applications".

* **Slices.**  Each row of ``a`` (each column of ``b``) is put on the
  fixed-point grid ``2**g``, ``g = e + 1 - W`` for ``e`` the exponent of its
  largest element, and truncated there: ``a_ik = 2**g_i Σ_t A_t[i, k] 2**(β(S-1-t))
  + r_ik``, ``S`` signed digits of ``β`` bits (``W = Sβ >= 36``) and a residual
  ``0 <= |r_ik| < 2**g_i``, zero unless ``a_ik`` has bits below the grid.
* **Exact dots.**  A digit product has at most ``2β`` bits and a dot of ``c``
  of them stays below ``c 2**(2β) <= 2**24`` (``β = 9`` for ``K <= 64``, 8 up
  to 256): every partial sum of a float32 dot of digit matrices is an integer a
  float32 holds, in any order, with or without fused multiply-adds, and far
  from subnormals.  ``K`` beyond 256 is cut into chunks of ``c = 256`` whose
  dots are summed in int32 (``K`` up to 6605).  The digit products with
  ``t + u <= S`` are computed (13 of 16 for ``S = 4``, 19 of 25 for 5); those
  of one diagonal ``t + u`` share a weight and are summed in int32.  The result
  is a few *pieces* ``±mag 2**lsb`` per output, whose sum is ``Σ_k A_ik B_kj
  2**(g_i + h_j)`` but for the products left out.
* **What is lost.**  ``a_k b_k - A_k B_k 2**(g + h) = a_k ρ_k + r_k B_k 2**h``
  (``ρ`` the residuals of ``b``), so in units of ``2**(g_i + h_j)`` the pieces
  miss less than ``2**W (R_i + P_j)``, with ``R_i = Σ_k |r_ik| 2**-g_i`` (and
  ``P_j`` likewise).  ``R`` is summed in float32 from residuals rounded up to at
  least ``2**-100`` grid units (no subnormal, so no flush); its rounding error
  is covered by a factor of 2.  The products left out weigh at most
  ``2**(β(S - 3))`` and are bounded statically, ``K (2**β - 1)**2 Σ 2**(β(2S -
  2 - t - u))``; they are nonzero only where a row's last nonzero digit ``t``
  and a column's ``u`` have ``t + u > S``.  Two bounds ``2**x`` and ``2**y``
  together are below ``2**(max(x, y) + 1)``.  An output with neither is exact.
* **Sums** (:func:`sliced_sum`) are dots with ones: digits of ``β = 24 -
  log2 c`` bits (16 for ``c = 256``), summed in float32 then int32, and a loss
  below ``R 2**g``.

:func:`fa_jax.carrier32.sums` accumulates the pieces in int32 limbs and rounds them; where
the loss bound cannot decide a rounding (cancellation of more than a few bits
below the largest product), it falls back to its own exact accumulator.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax.carrier32 import elementwise as ops32
from fa_jax.carrier32.elementwise import clamp_int, pad_axis, pow2_bits, shift_bits

__all__ = ["Sliced", "sliced_dot", "sliced_sum", "supports", "supports_sum"]

_U32 = np.uint32
_I32 = np.int32
_W = 36  # grid bits a row or column keeps at least (S digits of β bits)
_CHUNK = 256  # contraction terms a float32 dot of digits sums (β = 8 digits)
_INT32 = 1 << 31
_MIN_RESIDUAL = -100  # a residual is rounded up to at least 2**-100 grid units
_NONE = -(1 << 20)  # the exponent of a row or column with no nonzero element


class Sliced(NamedTuple):
    """``Σ pieces`` approximating ``a @ b``: pieces ``(-1)**neg mag 2**lsb`` on a
    leading axis; ``|a @ b - Σ pieces| < 2**(base + lost)`` where ``inexact``, and 0
    elsewhere; every piece's bits lie in ``[2**base, 2**(base + width))``."""

    neg: jax.Array  # bool (P, ..., n, m)
    lsb: jax.Array  # int32 (P, ..., n, m)
    mag: jax.Array  # uint32 (P, ..., n, m), below 2**31
    base: jax.Array  # int32 (..., n, m)
    lost: jax.Array  # int32 (..., n, m)
    inexact: jax.Array  # bool (..., n, m)
    width: int


class _Plan(NamedTuple):
    c: int  # contraction terms a dot of digits sums
    q: int  # chunks of c
    beta: int  # bits a digit
    s: int  # digits a value


def _plan(k: int) -> _Plan:
    """How a contraction of ``k`` terms is cut: ``c (2**β - 1)**2 < 2**24``."""
    c = min(k, _CHUNK)
    beta = min(12, (24 - max(c - 1, 1).bit_length()) // 2)
    return _Plan(c, -(-k // c), beta, -(-_W // beta))


def _diagonal_bound(k: int) -> int:
    """A bound on |Σ| of one diagonal's digit products (int32 it must fit)."""
    p = _plan(k)
    return p.s * k * ((1 << p.beta) - 1) ** 2


def _dropped_bound(k: int) -> int:
    """A bound on |Σ| of the digit products left out (``t + u > s``), in grid units."""
    _, _, beta, s = _plan(k)
    top = k * ((1 << beta) - 1) ** 2
    return sum(top << (beta * (2 * s - 2 - t - u)) for t in range(s) for u in range(s) if t + u > s)


def supports(k: int) -> bool:
    """Whether a contraction of ``k`` terms fits the int32 sums of this scheme."""
    return 1 <= k and _diagonal_bound(k) < _INT32


def _sum_plan(n: int) -> _Plan:
    """How a sum of ``n`` terms is cut: ``c (2**β - 1) < 2**24``."""
    c = min(n, _CHUNK)
    beta = 24 - (c - 1).bit_length()
    return _Plan(c, -(-n // c), beta, -(-_W // beta))


def supports_sum(n: int) -> bool:
    """Whether a sum of ``n`` terms fits the int32 sums of this scheme."""
    p = _sum_plan(max(n, 1))
    return 1 <= n and p.q * p.c * ((1 << p.beta) - 1) < _INT32


class _Digits(NamedTuple):
    digits: list[jax.Array]  # S float32 arrays of signed β-bit integers, most significant first
    grid: jax.Array  # int32 g, the contraction axis dropped
    residual: jax.Array  # float32 Σ |r| 2**-g over the contraction axis (an upper bound)
    last: jax.Array  # int32: the last digit nonzero somewhere along the axis (-1: none)


def _digits(sign, exp, sig, axis: int, beta: int, s: int) -> _Digits:
    """An operand (``±sig 2**(exp - 23)``, ``sig`` 0 for zeros) as ``s`` digits on
    its grid along the contraction ``axis``."""
    w = s * beta
    e = jnp.max(jnp.where(sig != _U32(0), exp, _I32(_NONE)), axis=axis, keepdims=True)
    g = e + _I32(1 - w)
    shift = exp - _I32(23) - g  # where sig's bit 0 lies on the grid
    neg = sign != _U32(0)
    mask = _U32((1 << beta) - 1)
    digits = []
    for t in range(s):
        d = (shift_bits(sig, shift - _I32(beta * (s - 1 - t))) & mask).astype(jnp.int32)
        digits.append(jnp.where(neg, -d, d).astype(jnp.float32))
    below = (_U32(1) << clamp_int(-shift, 0, 31).astype(jnp.uint32)) - _U32(1)
    rest = jnp.where(shift < _I32(0), sig & below, _U32(0))  # < 2**24
    r = rest.astype(jnp.float32) * ops32.float_of_bits(
        pow2_bits(clamp_int(shift, _MIN_RESIDUAL, 0))
    )
    grid = jnp.squeeze(g, axis)
    last = jnp.full(grid.shape, -1, jnp.int32)
    for t, d in enumerate(digits):
        last = jnp.where(jnp.any(d != np.float32(0), axis=axis), _I32(t), last)
    return _Digits(digits, grid, jnp.sum(r, axis=axis), last)


def _dot(x, y, c: int, q: int) -> jax.Array:
    """The exact integer ``x @ y`` (int32) of digit matrices, in chunks of ``c``."""
    if q == 1:
        p = jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)
        return p.astype(jnp.int32)
    pad = q * c - x.shape[-1]
    x, y = pad_axis(x, -1, pad), pad_axis(y, -2, pad)
    xs = x.reshape(*x.shape[:-1], q, c)
    ys = y.reshape(*y.shape[:-2], q, c, y.shape[-1])
    p = jnp.einsum("...nqc,...qcm->...qnm", xs, ys, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(p.astype(jnp.int32), axis=-3, dtype=jnp.int32)


def _chunk_sum(x, c: int, q: int) -> jax.Array:
    """The exact integer Σ of digits ``x`` (..., n) over the last axis (int32)."""
    x = pad_axis(x, -1, q * c - x.shape[-1])
    p = jnp.sum(x.reshape(*x.shape[:-1], q, c), axis=-1)
    return jnp.sum(p.astype(jnp.int32), axis=-1, dtype=jnp.int32)


def _floor_log2(x) -> jax.Array:
    """floor(log2 x) of a positive normal float32 (int32)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return (bits >> _U32(23)).astype(jnp.int32) - _I32(127)


def _below_grid(residual, w: int) -> tuple[jax.Array, jax.Array]:
    """(where the digits miss something, ``x``): they miss less than ``2**(w + x)``
    grid units given ``residual`` (grid units, summed in float32 from upper bounds:
    ``2**(floor(log2 R) + 2)`` covers R and its rounding)."""
    below = residual > np.float32(0)
    return below, _I32(w + 2) + _floor_log2(jnp.where(below, residual, np.float32(1)))


def _sliced(sums: list, weights: list[int], base, lost, inexact, width: int) -> Sliced:
    """The int32 ``sums`` (each weighing ``2**(base + weight)``) as :class:`Sliced` pieces."""
    v = jnp.stack(sums)
    lsb = base[None] + jnp.asarray(weights, jnp.int32).reshape(-1, *(1,) * base.ndim)
    return Sliced(v < _I32(0), lsb, jnp.abs(v).astype(jnp.uint32), base, lost, inexact, width)


def sliced_dot(a, b) -> Sliced:
    """``a @ b`` as pieces: ``a = (sign, exp, sig)`` arrays (..., n, k), ``b`` (..., k, m),
    each value ``±sig 2**(exp - 23)`` (``sig`` a uint32 below 2**24, 0 for zeros)."""
    k = a[2].shape[-1]
    if not supports(k):
        raise ValueError(f"sliced_dot: 1..{_longest(supports)} contraction terms expected, got {k}")
    c, q, beta, s = _plan(k)
    da, db = (_digits(*x, axis=axis, beta=beta, s=s) for x, axis in ((a, -1), (b, -2)))
    base = da.grid[..., :, None] + db.grid[..., None, :]
    products: list[list[jax.Array]] = [[] for _ in range(s + 1)]
    for t in range(s):
        for u in range(min(s, s + 1 - t)):
            products[t + u].append(_dot(da.digits[t], db.digits[u], c, q))
    # diagonal t + u weighs 2**(β(2s - 2 - t - u))
    sums = [functools.reduce(jnp.add, ps) for ps in products]
    residual = da.residual[..., :, None] + db.residual[..., None, :]
    below, lost_below = _below_grid(residual, s * beta)
    dropped = da.last[..., :, None] + db.last[..., None, :] > _I32(s)
    lost_dropped = _I32(_dropped_bound(k).bit_length())
    lost = jnp.where(
        below & dropped,
        jnp.maximum(lost_below, lost_dropped) + _I32(1),
        jnp.where(below, lost_below, lost_dropped),
    )
    width = beta * (2 * s - 2) + _diagonal_bound(k).bit_length()
    weights = [beta * (2 * s - 2 - i) for i in range(s + 1)]
    return _sliced(sums, weights, base, lost, below | dropped, width)


def _longest(fits) -> int:
    """The largest ``n`` with ``fits(n)`` (which holds for 1..n and no more)."""
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def sliced_sum(x) -> Sliced:
    """``Σ x`` over the last axis as pieces: ``x = (sign, exp, sig)`` arrays (..., n),
    as for :func:`sliced_dot` (a sum is a dot with ones: one digit each, no product;
    the last axis, where XLA's CPU reductions run several times faster)."""
    n = x[2].shape[-1]
    if not supports_sum(n):
        raise ValueError(f"sliced_sum: 1..{_longest(supports_sum)} terms expected, got {n}")
    c, q, beta, s = _sum_plan(n)
    d = _digits(*x, axis=-1, beta=beta, s=s)
    sums = [_chunk_sum(digit, c, q) for digit in d.digits]
    below, lost = _below_grid(d.residual, 0)
    width = beta * (s - 1) + (q * c * ((1 << beta) - 1)).bit_length()
    weights = [beta * (s - 1 - t) for t in range(s)]
    return _sliced(sums, weights, d.grid, lost, below, width)
