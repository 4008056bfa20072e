"""Analytic forward error bounds for softmax in a floating-point format.

Every bound here is a Python float computed from scalars: the unit roundoff
``u`` of the format (or the :class:`~fa_jax.Format` itself), the row length
``n``, the spread of the scores ``R = x_max - x_min`` and the accumulation
model of the sums: anything :func:`fa_jax.accumulation.get_accumulation`
accepts (an :class:`~fa_jax.accumulation.Accumulation` such as ``EXACT``,
``SEQUENTIAL``, ``chunked(8)`` or ``tensor_core("a100")``, or a name:
``"exact"``, ``"sequential"``, ``"chunked"`` (chunks of 16), ``"chunked(8)"``,
``"tensor_core(a100)"``).  The default everywhere is
``EXACT``, the default of the precision policies.  Two kinds, named so that
the plain name is always safe to assert against:

* ``softmax_bound`` and ``online_softmax_bound`` are **rigorous**: for the op
  sequences written out below, ``max_j |y_hat_j - y_j| / y_j`` is at most the
  returned value, with every second-order term kept (no ``O(u^2)``).
* ``softmax_bound_first_order`` and ``online_softmax_bound_first_order`` are
  the leading terms of the same expansions; ``softmax_bound_first_order`` with
  ``accumulation="sequential"`` (not the default) and ``exp_error=0`` is
  Blanchard, Higham & Higham's ``(n + 2 + 2(x_max - x_min)) u`` (2021,
  "Accurately computing the log-sum-exp and softmax functions", IMA J. Numer.
  Anal. 41(4)).  They are estimates of the bound's size, not bounds: the
  ``O(u^2)`` they drop is positive.

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §2.2):
every ``fl(.)`` rounds to nearest in one format with unit roundoff ``u``, so
``fl(a op b) = (a op b)(1 + delta)``, ``|delta| <= u``, while no result
underflows or overflows.  The scores ``x`` are values of the format, so
``max`` is exact.  ``exp`` is evaluated in a wider carrier with relative
error at most ``exp_error`` (``eta``) and then rounded, so
``fl(exp(t)) = exp(t)(1 + theta)(1 + delta)``, ``|theta| <= eta``, and
``exp(0) = 1`` exactly.  When a :class:`~fa_jax.Format` is passed instead of
``u``, its exponent range is used to check this model (below); with a bare
``u`` the exponent range is assumed unbounded, as in Blanchard et al.

The op sequences
----------------
SAFE (3 passes)::

    m = max_j x_j;  t_j = fl(x_j - m);  e_j = fl(exp(t_j));
    d = SUM_j e_j  (per accumulation model);  y_j = fl(e_j / d)

ONLINE (Milakov & Gimelshein 2018, arXiv 1805.02867), blocks ``B_1..B_K`` of
``b`` consecutive indices, ``K = ceil(n / b)``::

    m_0 = -inf, d_0 = 0
    for k = 1..K:
        m_k = max(m_{k-1}, max_{j in B_k} x_j)
        alpha_k = fl(exp(fl(m_{k-1} - m_k)))   (alpha_1 unused; 1 if m_k == m_{k-1})
        s_k = SUM_{j in B_k} fl(exp(fl(x_j - m_k)))   (per accumulation model)
        d_k = fl(fl(d_{k-1} * alpha_k) + s_k)          (d_1 = s_1 exactly)
    y_j = fl(fl(exp(fl(x_j - m_K))) / d_K)

SAFE is ONLINE with a single block, and the bounds agree there.

Derivation (rigorous)
---------------------
Work with ratios computed/exact.  All terms are positive, so a sum of terms
whose ratios lie in ``[lo, hi]`` has its ratio in ``[lo, hi]``, and a rounding
multiplies a ratio by a factor in ``[1 - u, 1 + u]``.

1. *Exponentials.*  With ``tau = x_j - m <= 0``, ``fl(tau) = tau(1 + delta)``,
   so ``exp(fl(tau)) = exp(tau) exp(tau delta)``: the argument error is
   amplified into a relative error factor ``exp(+-u|tau|)``.  Hence
   ``fl(exp(fl(tau))) / exp(tau)`` lies in
   ``[e^{-u|tau|}(1 - eta)(1 - u), e^{u|tau|}(1 + eta)(1 + u)]``, and
   ``|tau| <= R``.
2. *Sums.*  A sum of ``N`` non-negative terms that sees ``r`` roundings per
   term has ratio in ``[(1 - u)^r, (1 + u)^r]`` (Higham eq. (4.3); ``(1 + u)^r -
   1 <= gamma_r``, Lemma 3.1).  ``r`` is :func:`summation_roundings`:
   sequential ``N - 1``; exact-then-round ``1``; chunked ``ceil(N / k)``;
   tensor_core ``ceil(N / k)`` blocks of ``j`` roundings each, ``j`` from
   the block's one-sided truncation (:func:`summation_roundings`).
   These counts are for sums formed as the models of
   :mod:`fa_jax.accumulation` describe them, with "exact" sums (and chunk
   sums) exact.  :func:`fa_jax.ops.sum` forms those in float64, which adds a
   relative error of at most about ``(N - 1) 2**-53`` (``(k - 1) 2**-53`` per
   chunk) that the bounds do not count: far below ``u``, and below the
   default ``exp_error`` slack for formats of at most 11 significand bits,
   but not below FP32's default ``exp_error`` (``2**-50``) for long rows.
3. *Rescaling telescopes.*  A term ``j`` of block ``i`` enters ``d_K`` as
   ``fl(exp(fl(x_j - m_i)))`` times every later ``alpha_k``.  Its argument
   errors add up to at most ``u(m_i - x_j) + u sum_{k>i} (m_k - m_{k-1}) =
   u(m_K - x_j) <= uR``: the exp-argument errors of the rescalings do *not*
   grow with the number of blocks.  What does grow is the number of
   roundings: each later block ``k`` applies ``alpha_k`` (``eta`` and ``u``),
   the product ``d * alpha`` (``u``) and the addition (``u``).  A term of
   block 1 (the worst) therefore sees ``1 + r_b + 3(K - 1)`` roundings of size
   ``u`` and ``K`` carrier exp errors, where ``r_b`` is the roundings of one
   block sum.  So ``d_K`` has ratio in ``[D_lo, D_hi]``::

       D_hi = e^{uR} (1 + eta)^K (1 + u)^{N_u},   N_u = 1 + r_b + 3(K - 1)
       D_lo = e^{-uR} (1 - eta)^K (1 - u)^{N_u}

   (SAFE: ``K = 1``, ``N_u = 1 + r``, ``r`` the sum's roundings.)
4. *Quotient.*  ``y_hat_j / y_j`` lies in ``[lo, hi]`` with::

       hi = e^{uR}(1 + eta)(1 + u) (1 + u) / D_lo
       lo = e^{-uR}(1 - eta)(1 - u) (1 - u) / D_hi

   and the bound is ``max(hi - 1, 1 - lo)``.  In closed form (Higham Lemma
   3.3: a product of ``k`` factors ``(1 +- u)^{+-1}`` is ``1 + theta_k``,
   ``|theta_k| <= gamma_k``)::

       SAFE:   eps <= (1 + gamma_{r+3})        e^{2uR} (1+eta)/(1-eta)     - 1
       ONLINE: eps <= (1 + gamma_{r_b+3K})     e^{2uR} (1+eta)/(1-eta)^K   - 1

   with first-order parts ``(r + 3 + 2R) u + 2 eta`` and
   ``(r_b + 3K + 2R) u + (K + 1) eta``.  (The functions evaluate the products,
   which stay finite, and valid, even where ``gamma`` is undefined.)

Exponent range (only when a Format is given)
--------------------------------------------
With ``fmt``: (a) if ``exp(-(1 + u)R)(1 - eta) < fmt.tiny`` an exponential
(of a score or of a rescaling factor) may underflow and lose all relative
accuracy, and the bound returned is ``inf`` (no finite relative bound holds:
fp16 with ``R > 9.69``).  Otherwise every ``e_j``, ``alpha_k`` and
``d_{k-1} alpha_k`` is normal (``d_k >= 1`` since the block holding the
running max contributes ``exp(0) = 1``).  (b) The final quotients ``e_j / d``
can still fall below ``tiny``; their rounding error is at most ``max(u q,
sigma/2)`` for a quotient ``q`` and smallest positive value ``sigma``, so the
final ``u`` becomes ``max(u, sigma / (2 q_min))`` with ``q_min =
e^{-R}(lo-factors) / (n D_hi)``.  (c) If ``n D_hi`` (which bounds every sum)
or ``hi`` exceeds ``fmt.max``, the result is ``inf``.  (d) A format without
subnormals may round a difference ``x_j - m`` with an absolute error
``tiny/2``; this adds ``K tiny/2`` to the exponent errors.

The bound values are computed in float64 (through ``log1p``/``expm1``); their
own rounding error, a few float64 ulps, is far below the slack of the bound.
"""

from __future__ import annotations

import math
import numbers
from typing import Union

from fa_jax.accumulation import EXACT, Accumulation, get_accumulation
from fa_jax.formats import Format, get_format

__all__ = [
    "unit_roundoff",
    "gamma",
    "default_exp_error",
    "summation_roundings",
    "tensor_core_block_roundings",
    "summation_bound",
    "softmax_bound_first_order",
    "softmax_bound",
    "online_softmax_bound_first_order",
    "online_softmax_bound",
]

UnitOrFormat = Union[float, Format, str]
AccumulationLike = Union[Accumulation, str]


# -- argument checks -------------------------------------------------------------


def _check_int(v, name: str, fn: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{fn}: expected {name} to be an integer >= {lo}, got {v!r}")
    return int(v)


def _check_x_range(x_range, fn: str) -> float:
    if not isinstance(x_range, numbers.Real) or not (0 <= x_range < math.inf):
        raise ValueError(
            f"{fn}: expected x_range = x_max - x_min, a finite number >= 0, got {x_range!r}"
        )
    return float(x_range)


def _resolve_u(u, fn: str) -> tuple[float, Format | None]:
    """(unit roundoff, the Format if one was given)."""
    if isinstance(u, (Format, str)):
        fmt = get_format(u)
        fmt._require_concrete(fn)
        return fmt.unit_roundoff, fmt
    if isinstance(u, bool) or not isinstance(u, numbers.Real) or not (0 < u < 1):
        raise ValueError(
            f"{fn}: expected a unit roundoff 0 < u < 1 or a Format, got {u!r}"
        )
    return float(u), None


def _resolve_eta(exp_error, u: float, fn: str) -> float:
    if exp_error is None:
        return default_exp_error(u)
    if isinstance(exp_error, bool) or not isinstance(exp_error, numbers.Real) or not (
        0 <= exp_error < 1
    ):
        raise ValueError(
            f"{fn}: expected exp_error, a relative error 0 <= exp_error < 1, got {exp_error!r}"
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
    n = _check_int(n, "n", "gamma", 0)
    if isinstance(u, bool) or not isinstance(u, numbers.Real) or not (0 <= u < 1):
        raise ValueError(f"gamma: expected a unit roundoff 0 <= u < 1, got u={u!r}")
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


def summation_roundings(n: int, accumulation: AccumulationLike = EXACT, *,
                        u: float | None = None) -> int:
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

    Raises:
      ValueError: an unknown model, ``n`` not a positive integer, or a
        tensor_core model without ``u`` (or one that no count bounds).
    """
    n = _check_int(n, "n", "summation_roundings", 1)
    model = get_accumulation(accumulation)
    if model.kind == "tensor_core" and u is None:
        raise ValueError(
            f"summation_roundings: the {model} model needs u=, the accumulator's unit "
            "roundoff (its truncation is counted in roundings of size u)"
        )
    if n == 1:
        return 0
    if model.kind == "tensor_core":
        return -(-n // model.chunk) * tensor_core_block_roundings(model, u)
    if model.kind == "sequential" or (model.kind == "chunked" and model.chunk == 1):
        return n - 1
    if model.kind == "exact":
        return 1
    return -(-n // model.chunk)


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
    a = (model.chunk + (1 if model.fused_accumulator else 0)) * 2.0 ** (1 - model.extra_bits)
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
    j = max(math.ceil(lo / math.log1p(-uu) * (1 + 1e-12)),
            math.ceil(hi / math.log1p(uu) * (1 + 1e-12)))
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


def _rigorous(n: int, R: float, u: float, eta: float, K: int, r_block: int,
              fmt: Format | None) -> float:
    """max(hi - 1, 1 - lo) of the module docstring, steps 1-4 (+ exponent range)."""
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


def softmax_bound_first_order(n: int, x_range: float, u: UnitOrFormat, *,
                              accumulation: AccumulationLike = EXACT,
                              exp_error: float = 0.0) -> float:
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
        "softmax_bound_first_order", n, x_range, u, n, accumulation, exp_error)
    return _first_order(uu, R, eta, K, r)


def softmax_bound(n: int, x_range: float, u: UnitOrFormat, *,
                  accumulation: AccumulationLike = EXACT,
                  exp_error: float | None = None) -> float:
    """Rigorous bound on ``max_j |y_hat_j - y_j| / y_j`` for the SAFE softmax.

    ``m = max x; t = fl(x - m); e = fl(exp(t)); d = SUM e; y = fl(e / d)`` in
    one format (module docstring, derivation steps 1-4 with ``K = 1``)::

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
        (module docstring, "Exponent range").
      accumulation: the model of the sum (:func:`summation_roundings`);
        default ``EXACT``, as in the policies.
      exp_error: ``eta``; default :func:`default_exp_error` ``(u)``.

    Returns:
      The bound, a float (possibly ``inf``).
    """
    R, uu, fmt, eta, K, r = _online_args(
        "softmax_bound", n, x_range, u, n, accumulation, exp_error)
    return _rigorous(n, R, uu, eta, K, r, fmt)


def online_softmax_bound_first_order(n: int, x_range: float, u: UnitOrFormat, *,
                                     block: int = 1,
                                     accumulation: AccumulationLike = EXACT,
                                     exp_error: float = 0.0) -> float:
    """First-order part of :func:`online_softmax_bound`, not a bound:
    ``(r_b + 3K + 2R) u + (K + 1) eta`` with ``K = ceil(n / block)`` and ``r_b``
    the roundings of one block sum (block of ``min(block, n)`` terms).
    ``block >= n`` gives :func:`softmax_bound_first_order`.
    """
    R, uu, _, eta, K, r_b = _online_args(
        "online_softmax_bound_first_order", n, x_range, u, block, accumulation, exp_error)
    return _first_order(uu, R, eta, K, r_b)


def online_softmax_bound(n: int, x_range: float, u: UnitOrFormat, *,
                         block: int = 1,
                         accumulation: AccumulationLike = EXACT,
                         exp_error: float | None = None) -> float:
    """Rigorous bound on ``max_j |y_hat_j - y_j| / y_j`` for the ONLINE softmax.

    The 2-pass recurrence of Milakov & Gimelshein (2018, arXiv 1805.02867,
    Algorithm 3) with blocks of ``block`` scores, exactly as in the module
    docstring.  Derivation (module docstring, steps 1-4): with ``K =
    ceil(n / block)`` blocks and ``r_b`` roundings per block sum,

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
        "online_softmax_bound", n, x_range, u, block, accumulation, exp_error)
    return _rigorous(n, R, uu, eta, K, r_b, fmt)


def _online_args(fn, n, x_range, u, block, accumulation, exp_error):
    """Checked arguments of the online bounds: (R, u, format or None, eta, K, r_b)."""
    n = _check_int(n, "n", fn, 1)
    block = _check_int(block, "block", fn, 1)
    R = _check_x_range(x_range, fn)
    uu, fmt = _resolve_u(u, fn)
    eta = _resolve_eta(exp_error, uu, fn)
    K, b = _blocks(n, block)
    return R, uu, fmt, eta, K, summation_roundings(b, accumulation, u=uu)
