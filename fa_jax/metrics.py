"""Deviation metrics between a measured array ``a`` and a reference ``b``.

These are the statistics of Golden et al. 2024 ("Is Flash Attention Stable?",
arXiv 2405.02803): max / mean / std of the absolute difference (Figs 3-6), the
root-mean-square error of FlashAttention-3 (Shah et al. 2024, §4.3), the
relative difference, the distance in units in the last place of a
:class:`~fa_jax.Format`, and the 1-D Wasserstein-1 distance used for the weight
distributions of the training-drift experiment.

Conventions shared by every function:

* Inputs of any shape are flattened: a metric reduces over *all* axes and
  returns a 0-d array (except ``ulp_distance``, which is elementwise).  Use
  ``jax.vmap`` to get one value per leading slice.
* ``a`` and ``b`` of the elementwise metrics must have the same shape
  (no broadcasting: a shape mismatch is almost always a bug in an experiment).
* The computation dtype is the wider of the two input dtypes, and at least
  float32: bfloat16/float16/float8 inputs are widened exactly to float32 so
  that the metric itself is not computed in the format being measured.
  Nothing is narrowed: a float64 numpy input while ``jax_enable_x64`` is off
  raises ``TypeError`` instead of being silently truncated to float32.  For
  exact differences of float32 values, pass float64 arrays with x64 enabled.
* NaN in either input propagates to the result (``ulp_distance`` returns its
  sentinel instead).
* Sums run in one stated order, :func:`_tree_sum` (pairwise, Higham 2002
  §4.1), not XLA's reduce, whose order follows the thread count: a metric has
  the same bits on any core count, eager, jitted, vmapped or fused with the
  others (no square is contracted into an FMA, :func:`_squares`), and over
  padding (:func:`abs_diff_summary`'s ``length``).
* Everything is ``jax.jit`` / ``jax.vmap`` compatible; shapes are static.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax.formats import Format, get_format
from fa_jax.widening import widen

__all__ = [
    "abs_diff_summary",
    "max_abs_diff",
    "max_rel_diff",
    "mean_abs_diff",
    "rmse",
    "std_abs_diff",
    "summary",
    "ulp_distance",
    "wasserstein_1d",
]


# -- input handling ------------------------------------------------------------


def _as_float_array(x, name: str) -> jax.Array:
    """``x`` as a jnp array, refusing the silent float64 -> float32 truncation."""
    dtype = getattr(x, "dtype", None)
    if (
        dtype is not None
        and np.dtype(dtype) == np.float64
        and not jax.config.read("jax_enable_x64")
    ):
        raise TypeError(
            f"{name}: got a float64 array while jax_enable_x64 is off; it would be "
            "truncated to float32.  Enable x64 (jax.config.update('jax_enable_x64', "
            "True)) or cast it to float32 yourself"
        )
    x = jnp.asarray(x)
    if not (
        jnp.issubdtype(x.dtype, jnp.floating)
        or jnp.issubdtype(x.dtype, jnp.integer)
        or x.dtype == jnp.bool_
    ):
        raise TypeError(f"{name}: expected a real (float or integer) array, got {x.dtype}")
    return x


def _compute_dtype(*dtypes) -> np.dtype:
    """The wider of the input dtypes, at least float32 (never narrower than an input).

    Floats narrower than float32 (bfloat16, float16, float8/6/4) widen to float32
    first, exactly; JAX refuses to promote float8 implicitly."""

    def at_least_f32(d):
        d = np.dtype(d)
        return np.dtype(np.float32) if jnp.issubdtype(d, jnp.floating) and d.itemsize < 4 else d

    return np.dtype(jnp.result_type(*(at_least_f32(d) for d in dtypes), jnp.float32))


def _pair(a, b, fn: str) -> tuple[jax.Array, jax.Array]:
    """Flattened ``a``, ``b`` in the computation dtype; same shape, not empty."""
    a = _as_float_array(a, f"{fn}(a)")
    b = _as_float_array(b, f"{fn}(b)")
    if a.shape != b.shape:
        raise ValueError(f"{fn}: expected a and b of the same shape, got {a.shape} and {b.shape}")
    if a.size == 0:
        raise ValueError(f"{fn}: expected non-empty arrays, got shape {a.shape}")
    dt = _compute_dtype(a.dtype, b.dtype)
    return widen(a.reshape(-1), dt), widen(b.reshape(-1), dt)


def _abs_diff(a, b, fn: str) -> jax.Array:
    a, b = _pair(a, b, fn)
    return jnp.abs(a - b)


def _tree_sum(x) -> jax.Array:
    """The sum of 1-D ``x`` by pairwise summation in a fixed order: zeros appended
    up to a power of two, then ``x[:h] + x[h:]`` elementwise until one element
    is left (Higham 2002, §4.1; error bound ``log2(n) u`` per term)."""
    n = x.shape[-1]
    x = jnp.pad(x, (0, (1 << max(0, (n - 1).bit_length())) - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[:h] + x[h:]
    return x[0]


@jax.jit
def ordered_mean(x, length=None) -> jax.Array:
    """``(sum_i x_i) / N``, the sum by :func:`_tree_sum`, one correctly rounded
    division (NaN for no elements, as jnp.mean).  ``length``: N where ``x`` is
    padded (:func:`abs_diff_summary`), its elements from N on zeros.  XLA turns a
    division by a constant, or by a scalar that vmap broadcasts, into a product
    with its rounded reciprocal, which a later subtraction could also fuse into
    an FMA: so the divisor is computed from the sum (N, or N + 1 where the sum is
    NaN and the quotient NaN anyway), which XLA cannot fold."""
    total = _tree_sum(x)
    n = x.shape[-1] if length is None else length
    return total / jnp.where(jnp.isnan(total), n + 1, n).astype(total.dtype)


@jax.jit
def ordered_std(x, length=None) -> jax.Array:
    """Population standard deviation of 1-D ``x``, two-pass: ``sqrt(mean((x - mean)^2))``
    (``length`` as :func:`ordered_mean`'s: the padding is left out of the squares)."""
    centred = _live(x - ordered_mean(x, length), length)
    return jnp.sqrt(ordered_mean(_squares(centred), length))


def _live(x, length):
    """``x`` with its elements from ``length`` on (padding) zero; all of it for None."""
    if length is None:
        return x
    return jnp.where(jnp.arange(x.shape[-1]) < length, x, jnp.zeros_like(x))


def _squares(x):
    """``x**2``, each square rounded on its own, so that the sums' bits are the stated
    tree's wherever a metric is compiled: alone, fused with the others, padded or
    vmapped.  Fused into a sum's first additions, a plain square may be contracted
    with one of them into an FMA (one rounding instead of two; XLA's CPU compiler
    does so, and removes an ``optimization_barrier`` before fusing).  ``max(x², 0)``
    is the same value (a square is >= 0, and a NaN stays NaN) but puts a select
    between the product and the addition, which no compiler contracts."""
    return jnp.maximum(jnp.square(x), 0.0)


# -- absolute-difference statistics -------------------------------------------


def max_abs_diff(a, b) -> jax.Array:
    """``max_i |a_i - b_i|`` over all elements.

    The paper's headline statistic (Golden et al. 2024, Figs 3-5: "max
    difference").

    Args:
      a: measured values, any shape ``[...]``.
      b: reference values, the same shape.

    Returns:
      ``[]`` in the computation dtype (module docstring).
    """
    return jnp.max(_abs_diff(a, b, "max_abs_diff"))


def mean_abs_diff(a, b) -> jax.Array:
    """``(1/N) sum_i |a_i - b_i|`` over all ``N`` elements (Golden et al. 2024, Fig 5).

    Args:
      a: ``[...]`` measured.  b: ``[...]`` reference, same shape.

    Returns:
      ``[]`` in the computation dtype.
    """
    return ordered_mean(_abs_diff(a, b, "mean_abs_diff"))


def std_abs_diff(a, b) -> jax.Array:
    """Population standard deviation (ddof = 0) of ``|a_i - b_i|``.

    ``sqrt((1/N) sum_i (|a_i - b_i| - mean)^2)``: the spread that accompanies
    the mean in Golden et al. 2024, Fig 5.  Two-pass (mean first), so it does
    not suffer the cancellation of ``E[x^2] - E[x]^2``.

    Args:
      a: ``[...]`` measured.  b: ``[...]`` reference, same shape.

    Returns:
      ``[]`` in the computation dtype.
    """
    return ordered_std(_abs_diff(a, b, "std_abs_diff"))


def rmse(a, b) -> jax.Array:
    """Root-mean-square error ``sqrt((1/N) sum_i (a_i - b_i)^2)`` (Shah et al. 2024, §4.3).

    Computed as ``s * sqrt(mean((d/s)^2))`` with ``s = max|d|`` so that squaring
    neither overflows nor underflows (the scaling of LAPACK's ``xNRM2``); the
    result is 0 when ``a == b`` and inf when some difference is infinite.

    Args:
      a: ``[...]`` measured.  b: ``[...]`` reference, same shape.

    Returns:
      ``[]`` in the computation dtype.
    """
    d = _abs_diff(a, b, "rmse")
    return rmse_of_diff(d, jnp.max(d))


@jax.jit
def rmse_of_diff(d, s, length=None) -> jax.Array:
    """rmse from ``d = |a - b|`` and ``s = max d``, one program (the sweep's too);
    ``length`` as :func:`ordered_mean`'s."""
    scaled, safe = _rmse_scale(s)
    # Broadcast behind a barrier: XLA turns a division by a broadcast scalar into
    # a multiplication by its rounded reciprocal.
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(safe, d.shape))
    mean_square = ordered_mean(_squares(d / divisor), length)
    return _rmse_finish(s, scaled, safe, mean_square)


@jax.jit
def _rmse_scale(s):
    """Whether ``s`` can scale (finite, > 0), and the scale: ``s`` or 1."""
    scaled = (s > 0) & jnp.isfinite(s)
    return scaled, jnp.where(scaled, s, jnp.ones_like(s))


@jax.jit
def _rmse_finish(s, scaled, safe, mean_square):
    # s == 0 -> 0; s == inf -> inf; s NaN -> NaN (from max).
    return jnp.where(scaled, safe * jnp.sqrt(mean_square), s)


def abs_diff_summary(a, b, *, length=None) -> dict[str, jax.Array]:
    """``max_abs_diff``, ``mean_abs_diff``, ``std_abs_diff`` and ``rmse`` of ``a``
    against ``b``, each bit for bit the function of that name, from one ``|a - b|``
    (and one max) instead of four: what a sweep computes for every configuration.

    Args:
      a: ``[...]`` measured.  b: ``[...]`` reference, same shape.
      length: None, or the number N of leading elements of the flattened ``a``
        and ``b`` that count, the rest padding (an int, or a JAX integer that
        may be traced; a Python or numpy one must be in [1, a.size]).  The
        values are then bit for bit those of ``a[:N]`` against ``b[:N]``,
        whatever the padding holds: each sum's tree pads with zeros to a power
        of two anyway, and adding zeros is exact.  One program then serves
        every length up to the padded size.

    Returns:
      A dict of ``[]`` arrays in the computation dtype.
    """
    d = _abs_diff(a, b, "abs_diff_summary")
    if isinstance(length, (int, np.integer, np.ndarray)):  # concrete: checked here
        if not 1 <= int(length) <= d.size:
            raise ValueError(
                f"abs_diff_summary: expected a length in [1, {d.size}] (the elements of "
                f"a and b), got {length!r}"
            )
    d = _live(d, length)
    s = jnp.max(d)
    return {
        "max_abs_diff": s,
        "mean_abs_diff": ordered_mean(d, length),
        "std_abs_diff": ordered_std(d, length),
        "rmse": rmse_of_diff(d, s, length),
    }


def max_rel_diff(a, b, *, eps=None) -> jax.Array:
    """``max_i |a_i - b_i| / max(|b_i|, eps)``: the largest relative difference.

    The relative error of each component (the quantity bounded by
    :mod:`fa_jax.bounds`), with an absolute floor ``eps`` on the denominator so
    that ``b_i == 0`` is defined:

    * ``b_i == 0 and a_i == 0``: contributes 0;
    * ``b_i == 0 and a_i != 0``: contributes ``|a_i| / eps`` (huge, possibly inf:
      a non-zero result where the reference is zero has no finite relative error);
    * ``0 < |b_i| < eps``: measured relative to ``eps`` instead of ``|b_i|``.

    Args:
      a: ``[...]`` measured.  b: ``[...]`` reference, same shape.
      eps: the floor, a positive number.  Default: the smallest positive normal
        number of ``b``'s dtype (``jnp.finfo(b.dtype).tiny``; float32's tiny for
        integer ``b``), so every normal ``b_i`` is its own denominator.

    Returns:
      ``[]`` in the computation dtype.

    Raises:
      ValueError: ``eps`` is a concrete number that is not positive.
    """
    b_arr = _as_float_array(b, "max_rel_diff(b)")
    if eps is None:
        b_dt = b_arr.dtype if jnp.issubdtype(b_arr.dtype, jnp.floating) else jnp.float32
        eps = float(jnp.finfo(b_dt).tiny)
    elif isinstance(eps, (int, float, np.number)) and not eps > 0:
        raise ValueError(f"max_rel_diff: expected eps > 0, got {eps!r}")
    a, b = _pair(a, b_arr, "max_rel_diff")
    den = jnp.maximum(jnp.abs(b), jnp.asarray(eps, a.dtype))
    return jnp.max(jnp.abs(a - b) / den)


# -- ULP distance ------------------------------------------------------------


# carrier dtype -> (unsigned int of its width, stored mantissa bits M_c, exponent bias)
_CARRIER_BITS = {
    np.dtype(np.float32): (np.uint32, 23, 127),
    np.dtype(np.float64): (np.uint64, 52, 1023),
}


def _value_index(x: jax.Array, fmt: Format):
    """(sign, index, valid) of carrier values ``x`` as values of ``fmt``.

    ``index`` is the number of values of ``fmt`` in ``[0, |x|)`` (so +0 and -0
    are both 0, the smallest positive value is 1, and inf is one past max).
    From the carrier bits, ``|x| = sig * 2**(E - M_c)`` with ``sig`` normalised
    to ``[2**M_c, 2**(M_c+1))`` (carrier subnormals are normalised with a
    count of leading zeros, so formats whose range reaches below the
    carrier's normal range are handled).  The format's quantum in binade
    ``E`` is ``2**(max(E, emin) - man_bits)``, i.e. ``shift = M_c - man_bits +
    max(0, emin - E)`` low bits of ``sig``, and

        index = (max(E, emin) - emin) * 2**man_bits + (sig >> shift),

    which is ``(E - emin + 1) * 2**m + frac`` for normals and the subnormal
    count ``k`` (``x = k * 2**(emin - m)``) below ``tiny``.  Without
    subnormals, ``2**m - 1`` unused positions are removed from normal indices.
    ``valid`` is False for NaN, for inf in formats without infinities, and for
    finite values that are not values of ``fmt`` (dropped bits not zero, below
    the smallest positive value, above max).
    """
    U, M, bias_c = _CARRIER_BITS[np.dtype(x.dtype)]
    width = np.dtype(x.dtype).itemsize * 8
    m, emin = fmt.man_bits, fmt.emin

    bits = jax.lax.bitcast_convert_type(x, U)
    neg = (bits >> U(width - 1)) != 0
    a = bits & U((1 << (width - 1)) - 1)
    Ef = (a >> U(M)).astype(jnp.int32)
    is_inf = Ef == (2 * bias_c + 1)
    is_nan = is_inf & ((a & U((1 << M) - 1)) != 0)
    is_inf = is_inf & ~is_nan
    is_zero = a == 0

    # Normalise: carrier subnormals (Ef == 0) have M + 1 - bit_length(a)
    # leading zeros in the (M+1)-bit significand.
    lead = jnp.where(Ef > 0, 0, jax.lax.clz(a).astype(jnp.int32) - (width - M - 1))
    lead = jnp.where(is_zero, 0, lead)
    E = jnp.maximum(Ef, 1) - bias_c - lead
    sig = jnp.where(Ef > 0, (a & U((1 << M) - 1)) | U(1 << M), a << lead.astype(U))
    shift = (M - m) + jnp.maximum(emin - E, 0)
    # sig < 2**(M+1): clipping the shift at M + 1 keeps the result (0) and the
    # exactness test (only sig == 0 survives) right far below the format.
    shift_c = jnp.clip(shift, 0, M + 1).astype(U)
    kept = sig >> shift_c
    exact = (kept << shift_c) == sig
    index = (jnp.maximum(E, emin) - emin).astype(U) * U(1 << m) + kept

    if not fmt.subnormals:
        gap = U((1 << m) - 1)
        exact = exact & (is_zero | (E >= emin))
        index = index - gap
    index = jnp.where(is_zero, U(0), index)

    top = _max_index(fmt)
    finite_ok = exact & (index <= U(top)) & ~is_inf & ~is_nan
    index = jnp.where(is_inf, U(top + 1), index)
    valid = finite_ok | (is_inf & fmt.has_inf)
    return neg, index, valid


def _max_index(fmt: Format) -> int:
    """Index of ``fmt.max`` (number of format values in ``[0, max)``)."""
    E = fmt.emax
    frac = (1 << fmt.man_bits) - (2 if fmt.specials == "fn" else 1)
    idx = (E - fmt.emin + 1) * (1 << fmt.man_bits) + frac
    return idx - ((1 << fmt.man_bits) - 1 if not fmt.subnormals else 0)


def ulp_distance(a, b, fmt) -> jax.Array:
    """Distance between values of ``fmt`` counted in steps of the format's grid.

    ``|index(a_i) - index(b_i)|`` elementwise, where ``index`` numbers the
    values of ``fmt`` in increasing order (the finite values, and ±inf one
    step beyond ±max in formats that have infinities), with +0 and -0 sharing
    one position.  So neighbouring values are 1 apart, ``x`` and ``-x`` are
    ``2 * index(|x|)`` apart, and the distance is the number of format values
    in the half-open interval between the two.  The ordering is computed
    exactly with integer operations on the carrier bits (see
    ``_value_index``), no floating point.

    Args:
      a, b: ``[...]`` values of ``fmt`` (round them with
        :func:`~fa_jax.round_to` first), same shape.  Any float dtype; they
        are carried in float32 when ``fmt`` fits it, else float64 (which needs
        ``jax_enable_x64``).
      fmt: a :class:`~fa_jax.Format` or format name; must be concrete.

    Returns:
      ``[...]`` distances, uint32 (float32 carrier) or uint64 (float64
      carrier); unsigned because a distance across the whole float32 range,
      up to ``2 * 2139095040``, does not fit int32.  Elementwise, unlike the
      other metrics: reduce it yourself (``jnp.max``).  Where ``a_i`` or
      ``b_i`` is NaN, is an infinity of a format without infinities, or is not
      a value of ``fmt`` at all, the result is the sentinel
      ``jnp.iinfo(dtype).max`` (all ones), larger than any real distance, so
      it survives ``jnp.max`` the way NaN would.

    Raises:
      ValueError: a and b of different shapes; a format that does not fit a
        float64 carrier or a float64 carrier without x64.
    """
    fmt = get_format(fmt)
    fmt.require_concrete("ulp_distance")
    a = _as_float_array(a, "ulp_distance(a)")
    b = _as_float_array(b, "ulp_distance(b)")
    if a.shape != b.shape:
        raise ValueError(
            f"ulp_distance: expected a and b of the same shape, got {a.shape} and {b.shape}"
        )
    carrier = np.dtype(np.float32) if fmt.fits(np.float32) else np.dtype(np.float64)
    wide = _compute_dtype(a.dtype, b.dtype)
    if wide == np.float64:
        carrier = np.dtype(np.float64)
    if carrier == np.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"ulp_distance: format {fmt.name!r} (or a float64 input) needs a float64 "
            "carrier; enable it with jax.config.update('jax_enable_x64', True)"
        )
    return _ulp_distance(widen(a, carrier), widen(b, carrier), fmt)


@functools.partial(jax.jit, static_argnames="fmt")
def _ulp_distance(a, b, fmt: Format):
    sa, ia, va = _value_index(a, fmt)
    sb, ib, vb = _value_index(b, fmt)
    same_side = (sa == sb) | (ia == 0) | (ib == 0)
    dist = jnp.where(same_side, jnp.where(ia >= ib, ia - ib, ib - ia), ia + ib)
    sentinel = jnp.iinfo(dist.dtype).max
    return jnp.where(va & vb, dist, jnp.asarray(sentinel, dist.dtype))


# -- distributions -------------------------------------------------------------


def wasserstein_1d(a, b) -> jax.Array:
    """Wasserstein-1 distance between the empirical distributions of two samples.

    ``W1 = integral |F_a(t) - F_b(t)| dt`` with ``F`` the empirical CDFs (equal
    weights ``1/len``), evaluated exactly as ``scipy.stats.wasserstein_distance``
    does (``scipy.stats._stats_py._cdf_distance`` with p = 1): sort the merged
    samples ``z``, take the gaps ``z[k+1] - z[k]``, and sum ``|F_a(z[k]) -
    F_b(z[k])| * gap`` where ``F(z[k]) = #{x <= z[k]} / len`` comes from
    ``searchsorted(..., side="right")`` in the sorted sample.  Ties are
    handled by the zero gaps.  The CDF difference is formed from the integer
    counts (exact where ``len(a) * len(b)`` fits the integer dtype), so
    identical samples give exactly 0.  Every shape is static, so it jits.

    Args:
      a: ``[...]`` one sample (flattened), at least one element.
      b: ``[...]`` the other sample, any size >= 1 (need not match ``a``).

    Returns:
      ``[]`` in the computation dtype; NaN if either sample holds NaN.
    """
    a = _as_float_array(a, "wasserstein_1d(a)")
    b = _as_float_array(b, "wasserstein_1d(b)")
    if a.size == 0 or b.size == 0:
        raise ValueError(
            f"wasserstein_1d: expected non-empty samples, got shapes {a.shape} and {b.shape}"
        )
    dt = _compute_dtype(a.dtype, b.dtype)
    return _wasserstein_sorted(widen(a.reshape(-1), dt), widen(b.reshape(-1), dt))


@jax.jit
def _wasserstein_sorted(a, b):
    dt = a.dtype
    a = jnp.sort(a)
    b = jnp.sort(b)
    z = jnp.sort(jnp.concatenate([a, b]))
    gaps = jnp.diff(z)
    left = z[:-1]
    ca = jnp.searchsorted(a, left, side="right")
    cb = jnp.searchsorted(b, left, side="right")
    return _tree_sum(_cdf_gap(ca, cb, a.size, b.size, dt) * gaps)


def _cdf_gap(ca, cb, na: int, nb: int, dt) -> jax.Array:
    """``|ca/na - cb/nb|`` with the numerator formed in integers where it fits, so
    equal CDFs give exactly 0 (``ca/na - cb/nb`` in floats does not: XLA on CPU
    contracts it into a fused multiply-add, leaving the rounding error of one
    quotient)."""
    if na == nb:
        return jnp.abs(ca - cb).astype(dt) / na
    if na * nb <= jnp.iinfo(ca.dtype).max:
        return jnp.abs(ca * nb - cb * na).astype(dt) / (na * nb)
    return jnp.abs(ca.astype(dt) / na - cb.astype(dt) / nb)


# -- all at once ---------------------------------------------------------------


def summary(a, b) -> dict[str, jax.Array]:
    """The elementwise statistics of ``a`` against ``b`` in one dict.

    Keys: ``max_abs_diff``, ``mean_abs_diff``, ``std_abs_diff``, ``rmse``,
    ``max_rel_diff`` (default ``eps``); each a ``[]`` array as returned by the
    function of that name.  A dict of arrays is a pytree, so ``summary`` jits
    and vmaps.
    """
    return {**abs_diff_summary(a, b), "max_rel_diff": max_rel_diff(a, b)}
