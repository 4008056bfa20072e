"""An independent numpy simulation of the softmax op sequences, one rounding per op.

Shared by tests/test_bounds.py (are the bounds valid for these op sequences?) and
tests/test_softmax.py (does fa_jax.softmax compute exactly these op sequences, bit
for bit?).  It imports nothing from fa_jax: formats are read through their fields
``emin``, ``man_bits`` and ``max`` only, and accumulation models through ``kind``
and ``chunk`` (or a name: "exact", "sequential", "chunked(8)").

Every op returns its exact result rounded once to the format (round to nearest,
ties to even), the contract of fa_jax.ops:

* :func:`rnd` rounds a float64 to the format, correctly (the quantum of binade E is
  ``2**(max(E, emin) - man_bits)``; scaling by a power of two is exact and
  ``np.round`` ties to even).
* +, -, *, / and the sums first form a float64 approximation that is the
  *correctly rounded* float64 value of the exact result (an IEEE float64 op, or
  ``math.fsum``), then round it.  That double rounding can go wrong only if the
  exact result and its float64 approximation lie on different sides of a rounding
  boundary (a midpoint between neighbours) of the format; they are less than one
  float64 ulp apart, so wherever the approximation lies within one float64 ulp of
  a midpoint the result is recomputed from the exact rational (``Fraction``) and
  rounded exactly.  So every op is correctly rounded, with no appeal to theorems
  about innocuous double rounding.
* ``exp`` is float64 ``np.exp`` rounded once (the op's definition in fa_jax.ops;
  float64 exp itself is within an ulp of exp).

The accumulation models (fa_jax/accumulation.py), along the last axis, from an
accumulator ``acc_0 = 0``:

* exact:       ``fl(x_1 + ... + x_n)``, the exact sum rounded once;
* sequential:  ``acc_i = fl(acc_{i-1} + x_i)``;
* chunked(k):  ``acc_j = fl(acc_{j-1} + c_j)``, ``c_j`` the exact sum of the j-th
  chunk of k consecutive terms (the last one zero-padded), not rounded.

The algorithms (fa_jax/softmax.py, fa_jax/bounds.py), with every stage in one
format ``fmt`` (the paper_uniform policy); rows are the last axis of ``X``, whose
entries are values of ``fmt`` (``-inf`` entries are masked)::

    SAFE:    m = max x;  e_j = fl(exp(fl(x_j - m)));  d = SUM_j e_j;  y_j = fl(e_j / d)
    ONLINE:  m_0 = -inf, d_0 = 0; for blocks B_k of `block` entries (the last
             padded with -inf):
               m_k = max(m_{k-1}, max_{B_k} x);  alpha_k = fl(exp(fl(m_{k-1} - m_k)))
               s_k = SUM_{j in B_k} fl(exp(fl(x_j - m_k)))
               d_k = fl(fl(d_{k-1} alpha_k) + s_k)
             y_j = fl(fl(exp(fl(x_j - m_K))) / d_K)

``x - m`` uses a shift of 0 where ``m = -inf`` (fully masked rows) and a quotient
with ``d = 0`` is 0, as fa_jax.softmax defines them.
"""

from __future__ import annotations

import math
import operator
import re
from fractions import Fraction

import numpy as np

__all__ = [
    "add",
    "div",
    "exact_softmax",
    "exp",
    "model_of",
    "mul",
    "online_softmax",
    "rnd",
    "round_fraction",
    "safe_softmax",
    "sub",
    "sums",
]


# -- rounding ----------------------------------------------------------------------


def _quantum_exponent(a, fmt):
    """The exponent q of the format's quantum 2**q in the binade of |a| (a > 0)."""
    _, e = np.frexp(a)  # a = f 2**e, 0.5 <= f < 1: binade e - 1
    return np.maximum(e - 1, fmt.emin) - fmt.man_bits


def rnd(v, fmt):
    """Round float64 ``v`` to the nearest value of ``fmt`` (ties to even), as float64.

    ±inf and NaN pass through; a finite value rounding past ``fmt.max`` is an error
    (the simulated computations never overflow).
    """
    v = np.asarray(v, np.float64)
    finite = np.isfinite(v)
    all_finite = finite.all()
    w = v if all_finite else np.where(finite, v, 0.0)
    q = _quantum_exponent(w, fmt)
    out = np.ldexp(np.round(np.ldexp(w, -q)), q)
    assert not (np.abs(out) > fmt.max).any(), "overflow in the simulation"
    return out if all_finite else np.where(finite, out, v)


def round_fraction(v: Fraction, fmt) -> float:
    """The exact rational ``v`` rounded to the nearest value of ``fmt`` (ties to even)."""
    if v == 0:
        return 0.0
    a = abs(v)
    num, den = a.numerator, a.denominator
    E = num.bit_length() - den.bit_length()  # 2**(E-1) < a < 2**(E+1)
    if a < Fraction(2) ** E:
        E -= 1
    q = max(E, fmt.emin) - fmt.man_bits
    if q >= 0:
        N, r = divmod(num, den << q)
        half = den << q
    else:
        N, r = divmod(num << -q, den)
        half = den
    if 2 * r > half or (2 * r == half and N & 1):
        N += 1
    out = math.ldexp(float(N), q)  # N < 2**(man_bits + 2): exact
    assert out <= fmt.max, "overflow in the simulation"
    return out if v > 0 else -out


def _near_midpoint(approx, fmt):
    """Where the float64 ``approx`` lies within one float64 ulp of a midpoint of fmt."""
    a = np.abs(approx)
    finite = np.isfinite(a) & (a > 0)
    a = np.where(finite, a, 1.0)
    q = _quantum_exponent(a, fmt)
    y = np.ldexp(a, -q)  # the format's grid is the integers here; exact
    dist = np.abs(y - np.floor(y) - 0.5)  # to the nearest midpoint; exact
    return finite & (dist <= np.ldexp(np.spacing(a), -q))


def _fl(approx, exact, fmt, residual=None):
    """Round the exact result to fmt, given ``approx``, its correctly rounded float64
    value, and ``exact(i) -> Fraction``, the exact result at flat index ``i``, for
    where ``approx`` is not enough.

    ``residual(idx)``, if given, returns for the flat indices ``idx`` a float64 array
    that is 0 exactly where ``approx`` *is* the exact result (an error-free
    transformation); there rounding ``approx`` is right and no Fraction is needed
    (exact ties, e.g. ``x - m`` landing on a midpoint, are common)."""
    approx = np.asarray(approx, np.float64)
    out = np.array(rnd(approx, fmt), np.float64)  # an array (not a numpy scalar)
    if fmt.man_bits >= 52:  # float64 itself: approx is the correctly rounded result
        return out
    near = np.flatnonzero(_near_midpoint(approx, fmt))
    if near.size and residual is not None:
        near = near[residual(near) != 0]
    if near.size:
        flat = out.reshape(-1)  # a view: out is a fresh contiguous ndarray
        for i in near:
            flat[i] = round_fraction(exact(i), fmt)
    return out


def _two_sum_error(a, b):
    """(a + b) - fl(a + b), exactly (Knuth's TwoSum; finite a, b)."""
    s = a + b
    bp = s - a
    ap = s - bp
    return (a - ap) + (b - bp)


def _split(a):
    """Veltkamp's split a = hi + lo, each of at most 26 significant bits."""
    c = a * 134217729.0  # 2**27 + 1
    hi = c - (c - a)
    return hi, a - hi


def _two_product_error(a, b):
    """(a * b) - fl(a * b), exactly (Dekker's TwoProduct; no over/underflow)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _residual(op, a, b):
    """A function of flat indices: 0 exactly where op(a, b) is exact in float64."""

    def res(idx):
        x, y = a[idx], b[idx]
        with np.errstate(all="ignore"):
            if op is operator.add:
                r = _two_sum_error(x, y)
            elif op is operator.mul:
                r = _two_product_error(x, y)
            else:  # a - q b, with q b = P + e exactly and a - P exact (Sterbenz)
                q = x / y
                r = (x - q * y) - _two_product_error(q, y)
        return np.where(np.isfinite(r), r, 1.0)  # unsure: use the Fraction

    return res


def _binary(a, b, fmt, op):
    """fl(op(a, b)) elementwise; op on float64 is correctly rounded (IEEE)."""
    a, b = np.broadcast_arrays(np.asarray(a, np.float64), np.asarray(b, np.float64))
    fa, fb = a.reshape(-1), b.reshape(-1)
    return _fl(op(a, b), lambda i: op(Fraction(fa[i]), Fraction(fb[i])), fmt, _residual(op, fa, fb))


# -- the ops -------------------------------------------------------------------------


def add(a, b, fmt):
    """fl(a + b), correctly rounded (inf operands: IEEE)."""
    return _binary(a, b, fmt, operator.add)


def sub(a, b, fmt):
    """fl(a - b), correctly rounded."""
    return add(a, -np.asarray(b, np.float64), fmt)


def mul(a, b, fmt):
    """fl(a * b), correctly rounded."""
    return _binary(a, b, fmt, operator.mul)


def div(a, b, fmt):
    """fl(a / b), correctly rounded."""
    return _binary(a, b, fmt, operator.truediv)


def exp(t, fmt):
    """fl(exp(t)) from float64 exp (fa_jax.ops.exp's definition)."""
    return rnd(np.exp(np.asarray(t, np.float64)), fmt)


def _row_sums(T, fmt):
    """fl(exact sum of each row of T [..., m]), correctly rounded (T finite)."""
    flat = np.asarray(T, np.float64).reshape(-1, T.shape[-1])
    rows = flat.tolist()
    approx = np.array([math.fsum(r) for r in rows])  # correctly rounded float64

    def residual(idx):  # fsum(terms - approx) is 0 exactly where approx is exact
        return np.array([math.fsum(rows[i] + [-approx[i]]) for i in idx])

    out = _fl(approx, lambda i: sum(map(Fraction, rows[i]), Fraction(0)), fmt, residual)
    return out.reshape(T.shape[:-1])


def model_of(accumulation):
    """(kind, chunk) of an accumulation model: an object with ``kind``/``chunk``
    (fa_jax.accumulation.Accumulation) or a name "exact", "sequential",
    "chunked(k)"."""
    if isinstance(accumulation, str):
        m = re.fullmatch(r"(exact|sequential)|chunked\((\d+)\)", accumulation.strip())
        if not m:
            raise ValueError(f"unknown accumulation {accumulation!r}")
        return (m.group(1), None) if m.group(1) else ("chunked", int(m.group(2)))
    return accumulation.kind, accumulation.chunk


def sums(E, fmt, accumulation):
    """Sum along the last axis per accumulation model (module docstring)."""
    kind, k = model_of(accumulation)
    E = np.asarray(E, np.float64)
    assert (rnd(E, fmt) == E).all(), "sums: the terms must be values of the format"
    if kind == "exact":
        return _row_sums(E, fmt)
    n = E.shape[-1]
    if n == 1:  # fl(0 + x) = x for a value x of the format, under every model
        return E[..., 0].copy()
    acc = np.zeros(E.shape[:-1])
    if kind == "sequential" or k == 1:
        for i in range(n):
            acc = add(acc, E[..., i], fmt)
        return acc
    C = -(-n // k)
    E = np.concatenate([E, np.zeros((*E.shape[:-1], C * k - n))], axis=-1)
    chunks = E.reshape((*E.shape[:-1], C, k))
    for j in range(C):
        # fl(acc + c_j) with c_j the exact (unrounded) chunk sum.
        acc = _row_sums(np.concatenate([acc[..., None], chunks[..., j, :]], axis=-1), fmt)
    return acc


# -- the algorithms ------------------------------------------------------------------


def _shifted_exp(x, m, fmt):
    """fl(exp(fl(x - m))), with a shift of 0 where m = -inf (then x = -inf too)."""
    return exp(sub(x, np.where(np.isfinite(m), m, 0.0), fmt), fmt)


def _normalise(e, d, fmt):
    """fl(e / d); 0 where d = 0 (fully masked rows)."""
    return np.where(d == 0, 0.0, div(e, np.where(d == 0, 1.0, d), fmt))


def safe_softmax(X, fmt, accumulation):
    """SAFE along the last axis of X (module docstring)."""
    X = np.asarray(X, np.float64)
    m = X.max(axis=-1, keepdims=True)
    e = _shifted_exp(X, m, fmt)
    d = sums(e, fmt, accumulation)[..., None]
    return _normalise(e, d, fmt)


def online_softmax(X, fmt, accumulation, block):
    """ONLINE with blocks of ``block`` along the last axis of X (module docstring)."""
    X = np.asarray(X, np.float64)
    n = X.shape[-1]
    K = -(-n // block)
    Xp = np.concatenate([X, np.full((*X.shape[:-1], K * block - n), -np.inf)], axis=-1)
    Xp = Xp.reshape((*X.shape[:-1], K, block))
    m = np.full(X.shape[:-1], -np.inf)
    d = np.zeros(X.shape[:-1])
    for k in range(K):
        xb = Xp[..., k, :]
        m_new = np.maximum(m, xb.max(axis=-1))
        alpha = _shifted_exp(m, m_new, fmt)  # 0 for k = 1; exactly 1 if unchanged
        s = sums(_shifted_exp(xb, m_new[..., None], fmt), fmt, accumulation)
        d = add(mul(d, alpha, fmt), s, fmt)
        m = m_new
    e = _shifted_exp(X, m[..., None], fmt)
    return _normalise(e, d[..., None], fmt)


def exact_softmax(X):
    """Softmax of the float64 rows of X [rows, n] (finite), computed in float64
    with an exactly rounded sum: relative error a few float64 ulps."""
    X = np.asarray(X, np.float64)
    z = np.exp(X - X.max(axis=-1, keepdims=True))
    den = np.array([math.fsum(r) for r in z.reshape(-1, z.shape[-1]).tolist()])
    return z / den.reshape((*z.shape[:-1], 1))


def row_shapes(rng, kind: str, rows: int, n: int):
    """[rows, n] values in [0, 1] whose order exercises the recurrence: "uniform",
    "normal" (clipped), "ascending" (the running max changes in every block),
    "descending", "ties" (repeated values and maxima), "outlier" (one large
    score among small ones)."""
    if kind == "uniform":
        return rng.uniform(size=(rows, n))
    if kind == "normal":
        return np.clip(0.5 + rng.standard_normal((rows, n)) / 6, 0.0, 1.0)
    if kind == "ascending":
        return np.sort(rng.uniform(size=(rows, n)), axis=1)
    if kind == "descending":
        return -np.sort(-rng.uniform(size=(rows, n)), axis=1)
    if kind == "ties":
        return rng.integers(0, 4, size=(rows, n)) / 3.0
    if kind == "outlier":
        Z = rng.uniform(0, 0.05, size=(rows, n))
        Z[np.arange(rows), rng.integers(0, n, size=rows)] = 1.0
        return Z
    raise ValueError(f"row_shapes: unknown kind {kind!r}")
