"""Analytic forward error bounds for softmax and attention in a floating-point format.

Every bound is a Python float (or, for :func:`attention_bound`, a numpy array)
computed from the unit roundoff ``u`` of the format (or the
:class:`~fa_jax.Format` itself), the row length ``n``, the spread of the
scores ``R = x_max - x_min`` and the accumulation model of the sums (anything
:func:`fa_jax.accumulation.get_accumulation` accepts; default ``EXACT``, the
default of the precision policies).  Two kinds, named so that the plain name is
always safe to assert against:

* ``softmax_bound``, ``online_softmax_bound`` and the attention bounds are
  **rigorous** for the op sequences their docstrings write out: every
  second-order term is kept (no ``O(u^2)``).
* ``softmax_bound_first_order`` and ``online_softmax_bound_first_order`` are
  the leading terms of the same expansions, estimates rather than bounds;
  with ``accumulation="sequential"`` and ``exp_error=0`` the first is
  Blanchard, Higham & Higham's ``(n + 2 + 2(x_max - x_min)) u`` (2021,
  "Accurately computing the log-sum-exp and softmax functions", IMA J. Numer.
  Anal. 41(4)).

Model (Higham 2002, *Accuracy and Stability of Numerical Algorithms*, §2.2):
``fl(a op b) = (a op b)(1 + delta)``, ``|delta| <= u``, round to nearest in one
format, no underflow or overflow (checked when a Format is given: the bound is
then ``inf`` where an exponential may underflow or a sum overflow, and
subnormal results are accounted for).  The scores are values of the format, so
``max`` is exact; ``exp`` is evaluated in a wider carrier with relative error
at most ``exp_error`` (``eta``) and then rounded.  Sums of ``N`` non-negative
terms that see ``r`` roundings per term have ratio computed/exact in
``[(1 - u)^r, (1 + u)^r]`` (Higham eq. (4.3), Lemma 3.1: ``(1 + u)^r - 1 <=
gamma_r``); ``r`` is :func:`summation_roundings`.  The "exact" sums of
:mod:`fa_jax.accumulation` are formed in float64 by :func:`fa_jax.ops.sum`;
their float64 error, at most about ``(N - 1) 2**-53``, is not counted by the
softmax bounds (it is far below ``u``).

The softmax bounds work with ratios computed/exact: an exponential's argument
error ``u |x_j - m|`` becomes a factor ``e^{+-u|x_j - m|}``; in the online
recurrence (Milakov & Gimelshein 2018, arXiv 1805.02867) the argument errors of
the rescalings telescope to ``u R``, while each later block costs a term three
roundings and one carrier exp error.  The attention bounds propagate these
through the scores ``S = Q K^T / sqrt(d)`` and the product ``P V``, whose
float64 dot products err by at most ``gamma_k`` of float64 (Higham eq. (3.5)).

The values are computed in float64 (through ``log1p``/``expm1``); their own
rounding error, a few float64 ulps, is far below the slack of the bounds.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from fa_jax._checks import non_negative_int, positive_int
from fa_jax.accumulation import EXACT, Accumulation, get_accumulation, tree_roundings
from fa_jax.formats import Format, get_format

__all__ = [
    "AttentionBound",
    "attention_bound",
    "attention_bound_factor",
    "default_exp_error",
    "gamma",
    "online_softmax_bound",
    "online_softmax_bound_first_order",
    "softmax_bound",
    "softmax_bound_first_order",
    "summation_bound",
    "summation_roundings",
    "tensor_core_block_roundings",
    "unit_roundoff",
]

UnitOrFormat = float | Format | str
AccumulationLike = Accumulation | str


# -- argument checks -------------------------------------------------------------


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _check_x_range(x_range, fn: str) -> float:
    if not _real(x_range) or not (0 <= x_range < math.inf):
        raise ValueError(
            f"{fn}: x_range: expected x_max - x_min, a finite number >= 0, got {x_range!r}"
        )
    return float(x_range)


def _resolve_u(u, fn: str) -> tuple[float, Format | None]:
    """(unit roundoff, the Format if one was given)."""
    if isinstance(u, (Format, str)):
        fmt = get_format(u)
        fmt.require_concrete(fn)
        return fmt.unit_roundoff, fmt
    if not _real(u) or not (0 < u < 1):
        raise ValueError(f"{fn}: u: expected a unit roundoff 0 < u < 1 or a Format, got {u!r}")
    return float(u), None


def _resolve_eta(exp_error, u: float, fn: str) -> float:
    if exp_error is None:
        return default_exp_error(u)
    if not _real(exp_error) or not (0 <= exp_error < 1):
        raise ValueError(
            f"{fn}: exp_error: expected a relative error 0 <= exp_error < 1, got {exp_error!r}"
        )
    return float(exp_error)


# -- building blocks ---------------------------------------------------------------


def unit_roundoff(fmt) -> float:
    """``u = 2**-(man_bits + 1)``, the relative error bound of round-to-nearest
    (Higham, Theorem 2.2) for a :class:`~fa_jax.Format` or format name."""
    fmt = get_format(fmt)
    return fmt.unit_roundoff


def gamma(n: int, u: float) -> float:
    """``gamma_n = n u / (1 - n u)`` (Higham, Accuracy and Stability, Lemma 3.1).

    If ``|delta_i| <= u`` then ``prod_{i=1}^n (1 + delta_i)^{+-1} = 1 + theta_n``
    with ``|theta_n| <= gamma_n``, provided ``n u < 1``.

    Raises:
      ValueError: ``n`` not an integer >= 0, ``u`` not in ``[0, 1)``, or
        ``n u >= 1`` (the lemma does not apply).
    """
    n = non_negative_int(n, "gamma: n")
    if not _real(u) or not (0 <= u < 1):
        raise ValueError(f"gamma: u: expected a unit roundoff 0 <= u < 1, got {u!r}")
    if n * u >= 1:
        raise ValueError(
            f"gamma: needs n*u < 1, got n={n}, u={u!r} (n*u={n * u!r}); "
            "use the product (1 + u)**n - 1 instead"
        )
    return n * u / (1 - n * u)


def default_exp_error(u: float) -> float:
    """The relative error assumed for ``exp`` evaluated in the carrier.

    Formats with at most 11 significand bits (``u >= 2**-11``: bf16, fp16,
    tf32, fp8, ...) evaluate ``exp`` in float32, others (fp32) in float64.
    The defaults are generous, eight carrier units of roundoff: ``2**-21`` for
    a float32 carrier and ``2**-50`` for float64.  (:func:`fa_jax.ops.exp`
    evaluates ``exp`` in float64 for every format, well within both.)
    """
    return 2.0**-21 if u >= 2.0**-11 else 2.0**-50


def summation_roundings(
    n: int, accumulation: AccumulationLike = EXACT, *, u: float | None = None
) -> int:
    """The most roundings any term of an ``n``-term sum goes through.

    ``accumulation`` is a model of :mod:`fa_jax.accumulation` (or a name
    :func:`~fa_jax.accumulation.get_accumulation` accepts); default ``EXACT``.
    ``u``, the accumulator's unit roundoff, is needed (only) by tensor_core
    models, whose truncation is counted in roundings of size ``u``.

    * ``SEQUENTIAL``: ``s_i = fl(s_{i-1} + x_i)`` in index order from ``s_0 =
      0``: ``n - 1`` (Higham §4.2; ``fl(0 + x_1) = x_1`` is exact, ``x_1``
      being a value of the format).
    * ``EXACT``: the exact sum, rounded once: ``1`` (``0`` for ``n = 1``).
    * ``chunked(k)``: the ``C = ceil(n / k)`` exact sums ``c_j`` of
      consecutive chunks of ``k`` terms are added to an accumulator with one
      rounding each, ``acc_j = fl(acc_{j-1} + c_j)`` from ``acc_0 = 0``, as
      :func:`fa_jax.ops.sum` does (a chunk sum is not rounded before it is
      added).  A term of the first chunk enters the accumulator through
      ``fl(0 + c_1)``, one rounding (``c_1`` is in general not a value of the
      format), and sees one more rounding per later chunk: ``1 + (C - 1) =
      C``; a term of chunk ``j`` sees ``C - j + 1 <= C``.  So ``ceil(n / k)``
      (also the count if each chunk sum were rounded before being added).
      ``k = 1`` is sequential (``c_1 = x_1`` is a value of the format, so
      ``fl(0 + c_1)`` is exact: ``n - 1``), ``k >= n`` is exact (``1``).
    * ``tensor_core`` (Fasi et al. 2021; fa_jax.accumulation): ``C = ceil(n /
      k)`` block FMAs, each of which a term of the first block goes through;
      ``C * j`` with ``j`` from :func:`tensor_core_block_roundings`.
    * ``tree``: the most nodes on a path from a leaf to the root
      (:func:`fa_jax.accumulation.tree_roundings`); every node is counted as a
      rounding, so a node that happens to be exact only loosens the bound.

    Raises:
      ValueError: an unknown model, ``n`` not a positive integer, or a
        tensor_core model without ``u`` (or one that no count bounds).
    """
    n = positive_int(n, "summation_roundings: n")
    model = get_accumulation(accumulation)
    if model.kind == "tensor_core":
        if u is None:
            raise ValueError(
                f"summation_roundings: u: the {model} model needs the accumulator's unit "
                "roundoff (its truncation is counted in roundings of size u), got None"
            )
        return 0 if n == 1 else _chunks(n, model) * tensor_core_block_roundings(model, u)
    if n == 1:
        return 0
    if model.kind == "sequential" or (model.kind == "chunked" and model.chunk == 1):
        return n - 1
    if model.kind == "exact":
        return 1
    if model.kind == "tree":
        return tree_roundings(model, n)
    return _chunks(n, model)


def _chunks(n: int, model: Accumulation) -> int:
    """ceil(n / k) for a chunked or tensor_core model of chunk k."""
    chunk = model.chunk
    assert chunk is not None, model  # chunked and tensor_core models always have one
    return -(-n // chunk)


def tensor_core_block_roundings(accumulation: AccumulationLike, u: float) -> int:
    """Roundings of size ``u`` that cover one tensor-core block FMA, rigorously.

    A block (fa_jax.accumulation) adds ``T`` terms (``k`` products, plus the
    accumulator if fused), each truncated toward zero to a multiple of ``q =
    2**(e_max - m - extra_bits) = 2u * 2**(e_max - extra_bits)``: each loses
    less than ``q`` and the largest is at least ``2**e_max`` (every term in the
    normal range, as the bounds assume), so the aligned sum ``S'`` of the exact
    sum ``S`` satisfies ``|S' - S| < a u max|t| <= a u SUM|t|``, ``a = T *
    2**(1 - extra_bits)``, and for non-negative terms ``S(1 - a u) < S' <= S``.
    The normalisation adds ``nu u |S'|``, ``nu = 1`` to nearest, ``2`` for
    directed rounding (toward zero: ``S'(1 - 2u) < c <= S'``).  So a block
    multiplies the sum of its terms by a factor in ``[(1 - a u)(1 - nu u),
    (1 + a u)(1 + nu u)]``, errs by at most ``((1 + a u)(1 + nu u) - 1) SUM|t|``
    for any signs, and ``j`` is the least integer with ``(1 - u)^j`` and
    ``(1 + u)^j`` outside that interval; a non-fused block adds ``1`` for its
    round-to-nearest addition ``fl(c + d)``.  (V100, ``u = 2**-24``: ``a = 10``,
    ``j = 13``; A100: ``a = 9``, ``j = 12``.)

    Raises:
      ValueError: not a tensor_core model, ``u`` not in (0, 1), or ``a u >= 1``
        (the truncation may lose the whole sum: no relative bound).
    """
    model = get_accumulation(accumulation)
    if model.kind != "tensor_core":
        raise ValueError(f"tensor_core_block_roundings: expected a tensor_core model, got {model}")
    uu, _ = _resolve_u(u, "tensor_core_block_roundings")
    a = model.block_terms * 2.0 ** (1 - (model.extra_bits or 0))
    nu = 1 if model.normalization == "nearest_even" else 2
    if a * uu >= 1 or nu * uu >= 1:
        raise ValueError(
            f"tensor_core_block_roundings: {model} truncates up to a*u = {a * uu!r} >= 1 of a "
            f"block sum at u={uu!r}: no relative error bound"
        )
    lo = math.log1p(-a * uu) + math.log1p(-nu * uu)
    hi = math.log1p(a * uu) + math.log1p(nu * uu)
    # The least j with j*log1p(-u) <= lo and j*log1p(u) >= hi; the 1e-12 margin makes
    # the float64 evaluation of the logs err only towards a larger (still sound) count.
    j = max(
        math.ceil(lo / math.log1p(-uu) * (1 + 1e-12)), math.ceil(hi / math.log1p(uu) * (1 + 1e-12))
    )
    return j + (0 if model.fused_accumulator else 1)


def summation_bound(n: int, u, accumulation: AccumulationLike = EXACT) -> float:
    """Relative error bound ``(1 + u)^r - 1`` of an ``n``-term sum (``r`` from
    :func:`summation_roundings`), rigorous and ``<= gamma_r`` (Higham Lemma 3.1).

    It bounds ``|s_hat - s| / sum_i |x_i|`` for any signs, hence
    ``|s_hat - s| / s`` for non-negative terms (Higham eq. (4.4)).
    Sequential: ``gamma_{n-1}``-like; exact (the default): ``u``.  ``u`` may
    be a Format.
    """
    uu, _ = _resolve_u(u, "summation_bound")
    r = summation_roundings(n, accumulation, u=uu)
    return _expm1_safe(r * math.log1p(uu))


def _expm1_safe(z: float) -> float:
    return math.inf if z > 700 else math.expm1(z)


# -- softmax bounds -------------------------------------------------------------------


def _blocks(n: int, block: int) -> tuple[int, int]:
    """(number of blocks K, length of the longest block)."""
    return -(-n // block), min(block, n)


def _first_order(u: float, R: float, eta: float, K: int, r_block: int) -> float:
    # (r_b + 3K + 2R) u + (K + 1) eta; K = 1, r_b = r gives (r + 3 + 2R) u + 2 eta.
    return (r_block + 3 * K + 2 * R) * u + (K + 1) * eta


def _rigorous(
    n: int, R: float, u: float, eta: float, K: int, r_block: int, fmt: Format | None
) -> float:
    """max(hi - 1, 1 - lo) of :func:`online_softmax_bound` (and the exponent range).

    ``arg_abs``: a format without subnormals may round a difference ``x_j - m``
    with an absolute error ``tiny / 2``, which adds ``K tiny / 2`` to the
    exponent errors.
    """
    arg_abs = 0.0 if fmt is None or fmt.subnormals else fmt.tiny / 2
    a_num = R * u + arg_abs  # exponent error of the numerator exp
    a_den = R * u + K * arg_abs  # telescoped exponent error of a denominator term
    n_u = 1 + r_block + 3 * (K - 1)
    lu_p, lu_m = math.log1p(u), math.log1p(-u)
    le_p, le_m = math.log1p(eta), math.log1p(-eta)
    log_num_hi = a_num + le_p + lu_p
    log_num_lo = -a_num + le_m + lu_m
    log_den_hi = a_den + K * le_p + n_u * lu_p
    log_den_lo = -a_den + K * le_m + n_u * lu_m

    div = u
    if fmt is not None:
        # (a) every exp result (and so d * alpha, with d >= 1) stays normal.
        if -(1 + u) * R - arg_abs + le_m < math.log(fmt.tiny):
            return math.inf
        # (c) no sum (<= n * D_hi) overflows.
        if math.log(n) + log_den_hi > math.log(fmt.max):
            return math.inf
        # (b) quotients below tiny: absolute error sigma / 2.
        log_q_min = log_num_lo - R - math.log(n) - log_den_hi
        div = max(u, fmt.smallest_subnormal / 2 * math.exp(min(-log_q_min, 700.0)))

    log_hi = log_num_hi + math.log1p(div) - log_den_lo
    hi_err = _expm1_safe(log_hi)
    lo_err = 1.0 if div >= 1 else -math.expm1(log_num_lo + math.log1p(-div) - log_den_hi)
    if fmt is not None and (hi_err == math.inf or 1 + hi_err > fmt.max):
        return math.inf
    return max(hi_err, lo_err)


def softmax_bound_first_order(
    n: int,
    x_range: float,
    u: UnitOrFormat,
    *,
    accumulation: AccumulationLike = EXACT,
    exp_error: float = 0.0,
) -> float:
    """First-order relative error of the SAFE (3-pass) softmax, not a bound.

    ``(r + 3 + 2R) u + 2 eta`` with ``r`` = :func:`summation_roundings` of the
    ``n``-term sum and ``R = x_range``.  With ``accumulation="sequential"``
    (``r = n - 1``) and ``exp_error=0`` this is Blanchard, Higham & Higham's
    ``(n + 2 + 2(x_max - x_min)) u`` (IMA J. Numer. Anal. 41(4), 2021) for the
    shifted softmax; it drops a positive ``O(u^2)``.  Use
    :func:`softmax_bound` for a guaranteed bound.

    Args:
      n: row length, >= 1.
      x_range: ``x_max - x_min`` of the scores, >= 0.
      u: unit roundoff, or a Format / format name.
      accumulation: the model of the sum (:func:`summation_roundings`);
        default ``EXACT``.
      exp_error: ``eta``, the carrier exp's relative error (default 0: a
        correctly rounded exp, Blanchard et al.'s model).
    """
    # The safe softmax is the online one with a single block (K = 1).
    R, uu, _, eta, K, r = _online_args(
        "softmax_bound_first_order", n, x_range, u, n, accumulation, exp_error
    )
    return _first_order(uu, R, eta, K, r)


def softmax_bound(
    n: int,
    x_range: float,
    u: UnitOrFormat,
    *,
    accumulation: AccumulationLike = EXACT,
    exp_error: float | None = None,
) -> float:
    """Rigorous bound on ``max_j |y_hat_j - y_j| / y_j`` for the SAFE softmax.

    ``m = max x; t = fl(x - m); e = fl(exp(t)); d = SUM e; y = fl(e / d)`` in
    one format; the online recurrence of :func:`online_softmax_bound` with a
    single block (``K = 1``)::

        eps = max(hi - 1, 1 - lo),
        hi  = e^{2uR} (1 + eta)/(1 - eta) (1 + u)^2 / (1 - u)^{r+1}
            <= (1 + gamma_{r+3}) e^{2uR} (1 + eta)/(1 - eta),

    ``r`` = :func:`summation_roundings` (sequential ``n - 1``: first order
    ``(n + 2 + 2R) u + 2 eta``, Blanchard-Higham-Higham's bound plus the
    carrier exp's error).

    Args:
      n: row length, >= 1.
      x_range: ``R = x_max - x_min`` of the scores (values of the format), >= 0.
      u: unit roundoff (unbounded exponent range assumed), or a Format /
        name, whose range is then checked: ``inf`` where an exponential may
        underflow or a sum overflow, and subnormal quotients accounted for
        (below).
      accumulation: the model of the sum (:func:`summation_roundings`);
        default ``EXACT``, as in the policies.
      exp_error: ``eta``; default :func:`default_exp_error` ``(u)``.

    Exponent range (only when a Format is given): the bound is ``inf`` if
    ``e^{-(1 + u)R}(1 - eta)`` is below ``fmt.tiny`` (an exponential may
    underflow and lose all relative accuracy: fp16 with ``R > 9.69``) or if a
    sum, at most ``n D_hi``, or ``hi`` may exceed ``fmt.max``; a quotient
    ``q`` below ``tiny`` errs by at most ``max(u q, sigma / 2)`` (``sigma`` the
    smallest positive value), so the final ``u`` becomes ``max(u, sigma / (2
    q_min))``.

    Returns:
      The bound, a float (possibly ``inf``).
    """
    R, uu, fmt, eta, K, r = _online_args("softmax_bound", n, x_range, u, n, accumulation, exp_error)
    return _rigorous(n, R, uu, eta, K, r, fmt)


def online_softmax_bound_first_order(
    n: int,
    x_range: float,
    u: UnitOrFormat,
    *,
    block: int = 1,
    accumulation: AccumulationLike = EXACT,
    exp_error: float = 0.0,
) -> float:
    """First-order part of :func:`online_softmax_bound`, not a bound:
    ``(r_b + 3K + 2R) u + (K + 1) eta`` with ``K = ceil(n / block)`` and ``r_b``
    the roundings of one block sum (block of ``min(block, n)`` terms).
    ``block >= n`` gives :func:`softmax_bound_first_order`.
    """
    R, uu, _, eta, K, r_b = _online_args(
        "online_softmax_bound_first_order", n, x_range, u, block, accumulation, exp_error
    )
    return _first_order(uu, R, eta, K, r_b)


def online_softmax_bound(
    n: int,
    x_range: float,
    u: UnitOrFormat,
    *,
    block: int = 1,
    accumulation: AccumulationLike = EXACT,
    exp_error: float | None = None,
) -> float:
    """Rigorous bound on ``max_j |y_hat_j - y_j| / y_j`` for the ONLINE softmax.

    The 2-pass recurrence of Milakov & Gimelshein (2018, arXiv 1805.02867,
    Algorithm 3) with blocks ``B_1..B_K`` of ``block`` consecutive scores,
    ``K = ceil(n / block)``::

        m_0 = -inf, d_0 = 0
        for k = 1..K:
            m_k = max(m_{k-1}, max_{j in B_k} x_j)
            alpha_k = fl(exp(fl(m_{k-1} - m_k)))          (1 if m_k == m_{k-1})
            s_k = SUM_{j in B_k} fl(exp(fl(x_j - m_k)))   (per accumulation model)
            d_k = fl(fl(d_{k-1} * alpha_k) + s_k)         (d_1 = s_1 exactly)
        y_j = fl(fl(exp(fl(x_j - m_K))) / d_K)

    With ``r_b`` roundings per block sum (:func:`summation_roundings`):

    * each rescaling ``d_{k-1} -> fl(fl(d_{k-1} alpha_k) + s_k)`` costs a term
      of an earlier block three roundings (``alpha_k``, the product, the sum)
      and one carrier exp error;
    * the exp-argument errors ``u|m_{k-1} - m_k|`` of the rescalings and
      ``u|x_j - m_i|`` of the term itself telescope to ``u(m_K - x_j) <= uR``;

    so ``d_K`` has ratio in ``[e^{-uR}(1-eta)^K(1-u)^{N_u},
    e^{uR}(1+eta)^K(1+u)^{N_u}]``, ``N_u = 1 + r_b + 3(K - 1)``, and::

        eps = max(hi - 1, 1 - lo),
        hi  = e^{2uR} (1 + eta)/(1 - eta)^K (1 + u)^2 / (1 - u)^{N_u}
            <= (1 + gamma_{r_b + 3K}) e^{2uR} (1 + eta)/(1 - eta)^K,

    first order ``(r_b + 3K + 2R) u + (K + 1) eta``.  Block size 1
    (element-wise online softmax): ``(3n + 2R) u``; ``block >= n``:
    :func:`softmax_bound`.

    Args:
      n: row length, >= 1.
      x_range: ``R = x_max - x_min``, >= 0.
      u: unit roundoff or a Format / name (exponent range checked as in
        :func:`softmax_bound`).
      block: block size ``b >= 1``.
      accumulation: the model of each block sum ``s_k``
        (:func:`summation_roundings`); default ``EXACT``, as in the policies.
      exp_error: ``eta``; default :func:`default_exp_error` ``(u)``.

    Returns:
      The bound, a float (possibly ``inf``).
    """
    R, uu, fmt, eta, K, r_b = _online_args(
        "online_softmax_bound", n, x_range, u, block, accumulation, exp_error
    )
    return _rigorous(n, R, uu, eta, K, r_b, fmt)


def _online_args(fn, n, x_range, u, block, accumulation, exp_error):
    """Checked arguments of the online bounds: (R, u, format or None, eta, K, r_b)."""
    n = positive_int(n, f"{fn}: n")
    block = positive_int(block, f"{fn}: block")
    R = _check_x_range(x_range, fn)
    uu, fmt = _resolve_u(u, fn)
    eta = _resolve_eta(exp_error, uu, fn)
    K, b = _blocks(n, block)
    return R, uu, fmt, eta, K, summation_roundings(b, accumulation, u=uu)


# -- attention bounds -----------------------------------------------------------------

U64 = 2.0**-53  # float64's unit roundoff: the carrier and the golden reference
_EXP_ERROR_64 = 2.0**-50  # default_exp_error of float64: eight float64 units


def _g64(k: int) -> float:
    """gamma_k of float64: the relative error bound of a k-term float64 dot product."""
    return k * U64 / (1 - k * U64)


def _attention_factor(n, R, delta, uu, fmt, eta, K, r_b, bc, v_max) -> tuple[float, float]:
    """(F, D_lo) of :func:`attention_bound_factor` with checked arguments; R is the
    spread of the computed scores (the exact spread + 2 delta)."""
    # The softmax of the computed scores: inf where an exponential may underflow or a
    # sum overflow (the range checks of the softmax bounds).
    eps = _rigorous(n, R, uu, eta, K, r_b, fmt)
    if math.isinf(eps):
        return math.inf, 0.0
    if bc is None:  # reference: P (within eps), the P V dot and two roundings
        hi = (1 + eps) * math.exp(2 * delta) * (1 + uu) ** 2 * (1 + _g64(n))
        lo = (1 - eps) * math.exp(-2 * delta) * (1 - uu) ** 2 * (1 - _g64(n))
        if fmt is not None and v_max * hi > fmt.max:
            return math.inf, 0.0
        return max(hi - 1, 1 - lo), 1.0
    arg = uu * R + (0.0 if fmt is None or fmt.subnormals else K * fmt.tiny / 2)
    n_u = 1 + r_b + 3 * (K - 1)  # l: exp, block sum, three per later block
    n_o = 3 * K + 1  # o: exp, cast to P, P V_j, add; three per later block
    lu_p, lu_m, le_p, le_m = (math.log1p(uu), math.log1p(-uu), math.log1p(eta), math.log1p(-eta))
    d_hi = math.exp(arg + K * le_p + n_u * lu_p)
    d_lo = math.exp(-arg + K * le_m + n_u * lu_m)
    t_hi = math.exp(arg + K * le_p + n_o * lu_p + math.log1p(_g64(bc)))
    t_lo = math.exp(-arg + K * le_m + n_o * lu_m + math.log1p(-_g64(bc)))
    if fmt is not None and n * d_hi * t_hi * v_max > fmt.max:
        return math.inf, d_lo  # o may overflow
    hi = t_hi * (1 + uu) * math.exp(2 * delta) / d_lo
    lo = t_lo * (1 - uu) * math.exp(-2 * delta) / d_hi
    return max(hi - 1, 1 - lo), d_lo


def _attention_args(fn, n, x_range, u, bc, score_error, v_max, exp_error):
    n = positive_int(n, f"{fn}: n")
    bc = None if bc is None else positive_int(bc, f"{fn}: bc")
    R = _check_x_range(x_range, fn)
    if not _real(score_error) or not (0 <= score_error < math.inf):
        raise ValueError(f"{fn}: score_error: expected a finite number >= 0, got {score_error!r}")
    if not _real(v_max) or not (0 <= v_max < math.inf):
        raise ValueError(f"{fn}: v_max: expected a finite number >= 0, got {v_max!r}")
    uu, fmt = _resolve_u(u, fn)
    eta = _resolve_eta(exp_error, uu, fn)
    K, b = _blocks(n, n if bc is None else bc)
    r_b = summation_roundings(b, EXACT)
    return n, bc, R + 2 * float(score_error), float(score_error), uu, fmt, eta, K, r_b


def attention_bound_factor(
    n: int,
    x_range: float,
    u: UnitOrFormat,
    *,
    bc: int | None = None,
    score_error: float = 0.0,
    v_max: float = 0.0,
    exp_error: float | None = None,
) -> float:
    """Relative factor ``F`` of the attention bound of one query row, rigorous:
    ``|O_hat_c - O_c| <= F W_c + Z`` with ``W_c = SUM_j p_j |v_jc|`` (``p`` the
    exact softmax of the exact scores) and ``Z`` the subnormal term of
    :func:`attention_bound`.

    The row's ``n`` scores, computed with absolute error at most ``delta =
    score_error``, go through the safe softmax (reference, ``bc=None``:
    :func:`fa_jax.reference_attention`) or FlashAttention-2's online recurrence
    over key blocks of ``bc`` columns (Dao 2023, Algorithm 1:
    :func:`fa_jax.flash_attention` with ``variant="fa2"``).  Every step rounds to
    nearest with unit roundoff ``u``; sums and dot products are EXACT (formed in
    float64 and rounded once, the policies' default).

    * Scores: ``softmax(S_hat)_j / softmax(S)_j`` lies in ``e^{+-2 delta}`` and
      ``S_hat`` has spread ``R' <= x_range + 2 delta``.
    * Reference: ``P_hat / softmax(S_hat)`` is within ``eps =``
      :func:`softmax_bound` ``(n, R', u)`` (Blanchard, Higham & Higham 2021,
      with the carrier's exp error); ``fl(P_hat V)`` is a float64 dot
      (``gamma_n``, Higham eq. (3.5)) rounded twice (P V, then the output)::

          hi = (1 + eps) e^{2 delta} (1 + u)^2 (1 + gamma_n),  F = max(hi - 1, 1 - lo)

      with ``lo`` the same product with every sign flipped.
    * Flash, ``K = ceil(n / bc)`` blocks: the accumulator is ``o_K = SUM_j
      theta_j e^{s_j - m_K} v_j`` exactly (a rounding of a sum of mixed signs
      is a factor ``1 + delta`` on all of its terms).  A term of the first
      block meets its exp (``u``, ``eta``), the cast to P (``u``), the P V_j dot
      (``u``, ``gamma_bc``), the add into o (``u``), and per later block
      ``alpha`` (``u``, ``eta``), ``o alpha`` (``u``) and the add (``u``); its
      exp-argument errors telescope to ``u R'`` as in
      :func:`online_softmax_bound`.  So ``theta`` lies in ``[T_lo, T_hi]``,
      ``T_hi = e^{uR'} (1 + eta)^K (1 + u)^{3K + 1} (1 + gamma_bc)``, the sum
      ``l_K`` has ratio in ``[D_lo, D_hi]`` (:func:`online_softmax_bound`,
      ``N_u = 1 + r_b + 3(K - 1)``) and ``O = fl(o_K / l_K)``::

          F = max(T_hi (1 + u) e^{2 delta} / D_lo - 1,  1 - T_lo (1 - u) e^{-2 delta} / D_hi)

    ``F`` is ``inf`` where the softmax bound is (with a Format: an exponential
    may underflow, a sum overflow) or where ``v_max`` times the largest
    possible ``|o|`` (``n D_hi T_hi v_max``, flash; ``hi v_max``, reference)
    exceeds ``fmt.max``.  The bound holds as well for policies whose every
    stage rounds to a format at least as precise and as wide as ``u``'s
    (``fa2_kernel(fmt)`` as well as ``paper_uniform(fmt)``).

    Args:
      n: keys per row, >= 1.
      x_range: ``max_j s_j - min_j s_j`` of the exact scores, >= 0.
      u: unit roundoff or a Format / name (exponent range checked).
      bc: flash attention's key block ``Bc``; ``None`` for the reference.
      score_error: ``delta``, a bound on ``|s_hat_j - s_j|``, >= 0.
      v_max: ``max |v|``, for the overflow check (only with a Format).
      exp_error: ``eta``; default :func:`default_exp_error` ``(u)``.

    Returns:
      ``F``, a float (possibly ``inf``); the bound is meaningful where ``F < 1``.
    """
    n, bc, R, delta, uu, fmt, eta, K, r_b = _attention_args(
        "attention_bound_factor", n, x_range, u, bc, score_error, v_max, exp_error
    )
    return _attention_factor(n, R, delta, uu, fmt, eta, K, r_b, bc, v_max)[0]


@dataclasses.dataclass(frozen=True)
class AttentionBound:
    """Per-entry bound of :func:`attention_bound`: ``bound = factor[:, None] *
    weights + absolute[:, None]``, shape (N, d_v).

    ``factor`` (N,) is :func:`attention_bound_factor` of each row plus the float64
    reference's own error; ``weights`` (N, d_v) is ``W = softmax(S) |V|``;
    ``absolute`` (N,) the subnormal term ``Z``; ``score_error`` (N,) the
    ``delta`` of each row and ``x_range`` (N,) its exact score spread.
    """

    bound: np.ndarray
    factor: np.ndarray
    absolute: np.ndarray
    weights: np.ndarray
    score_error: np.ndarray
    x_range: np.ndarray


def _scale_error(fmt: Format, c: float) -> float:
    """|fl_fmt(c) - c| / c for the softmax scale c (0 where c is a value of fmt)."""
    from fa_jax._x64 import float64_enabled
    from fa_jax.rounding import round_to

    with float64_enabled():
        rounded = float(round_to(np.float64(c), fmt))
    return abs(rounded - c) / c


def _values_of(x: np.ndarray, fmt: Format) -> bool:
    from fa_jax._x64 import float64_enabled
    from fa_jax.rounding import round_to

    with float64_enabled():
        return bool(np.array_equal(np.asarray(round_to(x, fmt)), x))


def attention_bound(
    q, k, v, fmt: Format | str, *, bc: int | None = None, exp_error: float | None = None
) -> AttentionBound:
    """Rigorous per-entry bound on ``|O_hat - O_golden|`` for one head of attention.

    ``O_hat`` is :func:`fa_jax.reference_attention` (``bc=None``) or
    :func:`fa_jax.flash_attention` with ``Blocks(br, bc)`` and ``variant="fa2"``
    of ``q, k, v`` under ``paper_uniform(fmt)`` or ``fa2_kernel(fmt)`` (no
    mask, the default scale ``1/sqrt(d)``, EXACT accumulation, the scale
    applied to the scores); ``O_golden`` is :func:`fa_jax.reference_attention`
    under ``golden()``.  Per entry ``(i, c)``::

        |O_hat_ic - O_golden_ic| <= F_i W_ic + Z_i,   W = softmax(S) |V|

    * Scores: ``S_hat = fl(fl(Q K^T) c_hat)`` with ``c_hat = c (1 + rho)`` the
      rounded scale; the float64 dots of the carrier and of the golden err by
      ``gamma_d A`` (``A = c |Q| |K|^T``), so with ``sigma`` the smallest
      positive value of ``fmt`` (two possibly subnormal roundings)::

          delta_i = max_j [((1+u)^2 (1+rho) - 1) |s_ij| + ((1+u)^2 (1+rho) + 1 + u_c) gamma_d A_ij
                           + u_c |s_ij|] + sigma

      (``u_c = 2**-53`` where the golden's product by ``c`` rounds, 0 where
      ``c`` is a power of two).
    * ``F_i`` = :func:`attention_bound_factor` ``(n, x_range_i, fmt, bc=bc,
      score_error=delta_i, v_max=max|V|)`` widened by the golden's own error
      ``G`` (:func:`softmax_bound` in float64 with sequential sums and
      ``eta = 2**-50``, and its P V dot) and by the float64 error of ``W``
      itself: ``(F + G) / ((1 - eps_64) e^{-2 delta_64} (1 - gamma_n))``.
    * ``Z_i``: reference ``sigma`` (the P V and output roundings); flash
      ``K sigma (1 + u)^{3K + 1} / D_lo + sigma / 2`` (a possibly subnormal
      P V_j and ``o alpha`` per block, carried through ``alpha <= 1`` and
      divided by ``l >= D_lo``, then the output's rounding).

    Args:
      q: (N, d) queries, values of ``fmt``.
      k: (M, d) keys, values of ``fmt``.
      v: (M, d_v) values, values of ``fmt``.
      fmt: the format (a :class:`~fa_jax.Format` or name, at most FP32's
        precision: the carrier's float64 products are then exact).
      bc: flash attention's key block ``Bc``; ``None`` for the reference.
      exp_error: ``eta``; default :func:`default_exp_error` ``(u)``.

    Returns:
      An :class:`AttentionBound`.

    Raises:
      ValueError: shapes that are not (N, d), (M, d), (M, d_v); inputs that are
        not finite values of ``fmt``; a format finer than FP32; a bad ``bc``.
    """
    fn = "attention_bound"
    f = get_format(fmt)
    f.require_concrete(fn)
    if f.man_bits > 23:
        raise ValueError(f"{fn}: fmt: expected a format of at most FP32's precision, got {f.name}")
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    if (
        q.ndim != 2
        or k.ndim != 2
        or v.ndim != 2
        or q.shape[1] != k.shape[1]
        or (k.shape[0] != v.shape[0])
        or 0 in q.shape + k.shape + v.shape
    ):
        raise ValueError(
            f"{fn}: q, k, v: expected shapes (N, d), (M, d), (M, d_v), "
            f"got {q.shape}, {k.shape}, {v.shape}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not np.isfinite(t).all() or not _values_of(t, f):
            raise ValueError(
                f"{fn}: {name}: expected finite values of {f.name} "
                "(round them with fa_jax.round_to first)"
            )
    d, n = q.shape[1], k.shape[0]
    uu = f.unit_roundoff
    sig = f.smallest_subnormal
    c = 1.0 / math.sqrt(d)  # the scale as the attention functions compute it
    rho = _scale_error(f, c)
    u_c = 0.0 if math.frexp(c)[0] == 0.5 else U64
    s = (q @ k.T) * c
    a = (np.abs(q) @ np.abs(k).T) * c
    rel = (1 + uu) ** 2 * (1 + rho)
    delta = ((rel - 1 + u_c) * np.abs(s) + (rel + 1 + u_c) * _g64(d) * a).max(axis=1) + sig
    delta_64 = (u_c * np.abs(s) + _g64(d) * a).max(axis=1)
    spread = s.max(axis=1) - s.min(axis=1)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    W = (p / p.sum(axis=1, keepdims=True)) @ np.abs(v)
    v_max = float(np.abs(v).max())
    factor, absolute = [], []
    for R_i, d_i, d64_i in zip(spread.tolist(), delta.tolist(), delta_64.tolist()):
        _, bc_, R, dlt, _, _, eta, K, r_b = _attention_args(
            fn, n, R_i, f, bc, d_i, v_max, exp_error
        )
        F, d_lo = _attention_factor(n, R, dlt, uu, f, eta, K, r_b, bc_, v_max)
        eps_64 = softmax_bound(n, R, U64, accumulation="sequential", exp_error=_EXP_ERROR_64)
        G = (1 + eps_64) * (1 + _g64(n)) - 1  # the golden's softmax and P V dot
        w_lo = (1 - eps_64) * math.exp(-2 * d64_i) * (1 - _g64(n))  # W's own error
        factor.append((F + G) / w_lo)
        absolute.append(
            sig
            if bc is None or math.isinf(F)
            else K * sig * (1 + uu) ** (3 * K + 1) / d_lo + sig / 2
        )
    factor_a, absolute_a = np.asarray(factor), np.asarray(absolute)
    return AttentionBound(
        bound=factor_a[:, None] * W + absolute_a[:, None],
        factor=factor_a,
        absolute=absolute_a,
        weights=W,
        score_error=delta,
        x_range=spread,
    )
