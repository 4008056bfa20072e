"""The emulated op layer: every attention algorithm computes through these functions.

Each op takes float64 *carrier* arrays holding values of some formats, and
returns ``fl_fmt(exact result)``: the exact result rounded once to ``fmt``
(round to nearest, ties to even).

How each op achieves a single correct rounding from a float64 computation:

* ``mul``: the product of two values with at most 26 significand bits each (any
  format up to FP32) is exact in float64; for wider operands (a stage raised to
  FP64 feeding a narrower one) Dekker's product gives the sign of the float64
  product's error, and round-to-odd, as for ``add``, keeps the rounding single.
* ``add``/``sub``: float64 addition of values of different magnitudes can
  round, and a float64 result sitting on a midpoint of ``fmt`` would then be
  rounded a second time the wrong way.  TwoSum (Knuth) gives the exact error
  ``e`` of ``s = a + b``; ``s`` is moved to the odd neighbour toward ``e``
  (round-to-odd) and then rounded to ``fmt``, which is correct whenever
  float64 has at least two more bits than ``fmt`` (Boldo & Melquiond 2008,
  "Emulation of FMA and correctly rounded sums: proved algorithms using
  rounding to odd").
* ``div``: the float64 quotient ``q`` rounds correctly to ``fmt`` unless ``q``
  is exactly a midpoint of ``fmt``; then the sign of ``a - q b``, computed exactly
  with Dekker's product on the significands (any float64 ``a``, ``b``), says which
  way the true quotient lies; skipped where b's stated format proves q never is
  one unless the exact quotient is (:func:`_quotient_rounds_once`).
* ``exp``, ``exp2``: float64 ``exp`` / ``exp2`` (XLA's, within a few ulps of
  float64) rounded to ``fmt``.  Correctly rounded unless the result lies within
  that error of a rounding boundary of ``fmt`` (never observed; exp of a
  nonzero representable number is never exactly a midpoint, and 2^x is exact
  for integers x).
* ``tanh``: float64 ``tanh`` (XLA's, within 6 float64 ulps on CPU as measured)
  rounded to ``fmt``, the argument of ``exp``: correctly rounded unless tanh lies
  within that error of a rounding boundary of a format of at most 26 significand
  bits (tanh of a nonzero representable number is transcendental, never a
  midpoint; checked on every FP16 and BF16 input and on random FP32 ones).
  Float64 carriers only.
* ``fma``: ``fl(a b + c)`` with one rounding; the product is exact for
  operands of at most 26 significand bits, and TwoSum plus round-to-odd, as
  for ``add``, rounds the sum once.
* ``maximum``: exact.

The elementwise ops round correctly for any float64 operands (for formats with at
most 10 exponent bits, whose values never reach float64's subnormals).  ``matmul``
needs operands of at most 26 significand bits (FP32 or narrower), so that its
products are exact.  With ``fmt`` FP64 every op is plain float64 arithmetic (the
golden policy).  The float64 path needs ``jax_enable_x64``.  Every op also takes
float32 carriers (all operands float32; a mix raises), for formats that fit
float32, with no 64-bit type in the program: :mod:`fa_jax.carrier32` (elementwise,
exp, sum and matmul, ``log_sum``).  ``carrier`` and ``carrier_dtype`` choose one.

Reductions (``sum``, ``matmul``) take an :class:`~fa_jax.accumulation.Accumulation`
model; its docstring says how exact each one is.  ``matmul`` passes ``precision=HIGHEST`` and
``preferred_element_type=float64`` explicitly, so no TF32 or bf16 passes
happen on GPU/TPU.  The "tensor_core" model (Fasi et al. 2021) is bit-exact:
its products are exact float64 multiplications, its alignment is integer bit
masking and its aligned block sums are exact in float64 (the accumulator
format must satisfy ``Accumulation.sum_bits(man_bits) <= 53``, which FP32 and
narrower do; an FP64 accumulator is plain float64 arithmetic, the "exact"
model, as for every op here).
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from fa_jax._checks import one_of
from fa_jax.accumulation import EXACT, Accumulation, Tree, get_accumulation, tree_schedule
from fa_jax.carrier32 import elementwise as ops32
from fa_jax.carrier32 import exp as exp32
from fa_jax.carrier32 import lse as lse32
from fa_jax.carrier32 import native as native32
from fa_jax.carrier32 import sums as sum32
from fa_jax.formats import Format, get_format
from fa_jax.rounding import RoundingMode, round_to
from fa_jax.widening import widen

__all__ = [
    "CARRIERS",
    "add",
    "carrier",
    "carrier_dtype",
    "cast",
    "constant",
    "div",
    "exp",
    "exp2",
    "fma",
    "log_sum",
    "matmul",
    "maximum",
    "mul",
    "sub",
    "sum",
    "tanh",
]

_F64 = np.dtype(np.float64)
_VELTKAMP = 2.0**27 + 1.0
_BELOW_ULP = 2.0**-60  # a relative size well under half a float64 ulp
_FRACTION_MASK = np.uint64((1 << 52) - 1)
_EXPONENT_MASK = np.uint64(0x7FF << 52)
_EXPONENT_OF_ONE = np.uint64(1023 << 52)
_X64_HINT = (
    "fa_jax's emulated ops compute in float64 carriers: enable float64 with "
    "jax.config.update('jax_enable_x64', True) (or JAX_ENABLE_X64=1) before creating arrays"
)


_TPU_HINT = (
    "fa_jax's emulated ops compute on float64 carriers and their bit patterns, and XLA's "
    "TPU backend emulates float64 without bitcasts, so they cannot run on a TPU: run them "
    "on the host CPU, e.g. inside `with jax.default_device(jax.devices('cpu')[0]):`"
)


def _platform() -> str:
    """The platform computations go to: the default device's, else the default backend's."""
    device = getattr(jax.config, "jax_default_device", None)
    platform = getattr(device, "platform", device)
    return platform if isinstance(platform, str) else jax.default_backend()


def require_x64() -> None:
    """Raise a RuntimeError that says how to enable float64 if it is off, or that
    names the limitation on a backend that cannot bitcast float64 (TPU)."""
    if not jax.config.read("jax_enable_x64"):
        raise RuntimeError(_X64_HINT)
    if _platform() == "tpu":
        raise RuntimeError(_TPU_HINT)


CARRIERS = ("auto", "float64", "float32")


def carrier_dtype(kind: str = "auto") -> np.dtype:
    """The carrier dtype of ``kind``: "float64", "float32", or "auto" (float64 when
    ``jax_enable_x64`` is on, else float32).  "float64" needs x64 (RuntimeError)."""
    one_of(kind, CARRIERS, "carrier")
    if kind == "auto":
        kind = "float64" if jax.config.read("jax_enable_x64") else "float32"
    if kind == "float64":
        require_x64()
    return np.dtype(kind)


def carrier(x, dtype=None) -> jax.Array:
    """``x`` as a carrier array of ``dtype`` (default: ``carrier_dtype("auto")``),
    exactly (subnormals included; see widening).  A float64 ``x`` on a float32
    carrier must hold float32 values: narrowing would round, and raises."""
    dtype = carrier_dtype() if dtype is None else np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"carrier: expected dtype float32 or float64, got {dtype}")
    if dtype == np.float64:
        require_x64()
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"carrier: expected a floating-point array, got {x.dtype}")
    if dtype == np.float32 and np.dtype(x.dtype) == np.float64:
        return _narrowed(x)
    return widen(jnp.asarray(x), dtype)


def _narrowed(x) -> jax.Array:
    """A float64 array of float32 values as float32; a value that float32 does not
    hold raises, and so does a traced array (it cannot be checked, and XLA's
    conversion would flush float32 subnormals)."""
    if isinstance(x, Tracer):
        raise TypeError(
            "carrier: expected float32 values for a float32 carrier, got a traced float64 "
            "array; pass float32 arrays (or host float64 values, checked here)"
        )
    a = np.asarray(x)
    with np.errstate(over="ignore"):
        narrow = a.astype(np.float32)
    lost = ~((narrow.astype(np.float64) == a) | np.isnan(a))
    if lost.any():
        raise ValueError(
            "carrier: expected values that float32 holds exactly for a float32 carrier, "
            f"got float64 values such as {a[lost].flat[0]!r}; round them first "
            "(fa_jax.round_to(np.float64 values, fmt) rounds once), or use a float64 carrier"
        )
    return jnp.asarray(narrow)


def constant(value: float, fmt, dtype) -> jax.Array:
    """fl_fmt(value) for a host number ``value`` (rounded once, from its float64), as a
    0-d carrier of ``dtype``; ``fmt`` may be traced.  On a float32 carrier it is
    rounded from the nearest float32 and the sign of the rest (ops32)."""
    fmt, dtype = get_format(fmt), np.dtype(dtype)
    v = np.float64(value)
    if dtype == np.float64:
        return round_to(jnp.asarray(v, jnp.float64), fmt)
    if v == 0 or not np.isfinite(v):
        return round_to(jnp.asarray(v.astype(np.float32)), fmt)  # exact in float32
    m, e = np.frexp(v)  # v = m 2^e, 0.5 <= |m| < 1
    s = m.astype(np.float32)  # nearest, a normal float32
    rest = np.sign(abs(m) - abs(np.float64(s)))  # the sign of |v| - |s| 2^e
    return round_to(
        ops32.round_sum(
            jnp.asarray(s), jnp.asarray(rest, jnp.int32), jnp.asarray(e, jnp.int32), fmt
        ),
        fmt,
    )


def _check(*xs) -> None:
    require_x64()
    for x in xs:
        if jnp.asarray(x).dtype != _F64:
            raise TypeError(
                "fa_jax.ops: expected float64 or float32 carrier arrays (use ops.carrier), "
                f"got {jnp.asarray(x).dtype}"
            )


def _float32(*xs) -> bool:
    """Whether every operand is a float32 carrier, which :mod:`fa_jax.carrier32` computes
    (the same bits, no float64 needed); a float32 operand beside others raises."""
    dtypes = [np.dtype(jnp.result_type(x)) for x in xs]  # no device copy of host operands
    if all(d == np.float32 for d in dtypes):
        return True
    if any(d == np.float32 for d in dtypes):
        raise TypeError(
            "fa_jax.ops: expected operands of one carrier, all float32 or all float64, "
            f"got {[d.name for d in dtypes]}"
        )
    return False


def _is_fp64(fmt: Format):
    """FP64 rounds nothing in a float64 carrier (a bool, or a traced bool)."""
    if fmt.is_concrete:
        return fmt.man_bits == 52 and fmt.exp_bits == 11 and fmt.specials == "ieee"
    return (fmt.man_bits == 52) & (fmt.exp_bits == 11)


def cast(x, fmt) -> jax.Array:
    """Round a carrier array to ``fmt`` (a stage's storage format)."""
    if _float32(x):
        return ops32.cast(x, fmt)
    _check(x)
    return round_to(x, get_format(fmt))


def _round_to_odd_then(s, e, fmt: Format, *, normalised: bool = False):
    """Correctly round the value ``s + e`` (a float64 pair) to ``fmt``: renormalise so
    that s = fl(s + e) and e is the exact remainder (unless the pair is
    ``normalised`` so already, as TwoSum's is), move an inexact s to its odd
    neighbour toward e (round-to-odd), then round to nearest."""
    inexact = jnp.isfinite(s) & (e != 0)  # e == 0: s is exact (and keeps a -0 sign)
    if not normalised:
        s_n, e_n = _two_sum(s, jnp.where(inexact, e, 0.0))
        s = jnp.where(inexact, s_n, s)
    e = jnp.where(inexact, e_n if not normalised else e, 0.0)
    bits = jax.lax.bitcast_convert_type(s, jnp.uint64)
    inexact_even = (e != 0) & ((bits & np.uint64(1)) == 0)
    grow = (e > 0) == (s > 0)  # moving toward e grows |s|
    odd = jnp.where(inexact_even, jnp.where(grow, bits + np.uint64(1), bits - np.uint64(1)), bits)
    s_odd = jax.lax.bitcast_convert_type(odd, jnp.float64)
    return round_to(jnp.where(_is_fp64(fmt), s, s_odd), fmt)


def _two_sum(a, b):
    """s = fl(a + b) and its exact error e = (a + b) - s (Knuth's TwoSum)."""
    s = a + b
    bp = s - a
    ap = s - bp
    return s, (a - ap) + (b - bp)


def add(a, b, fmt) -> jax.Array:
    """fl_fmt(a + b), correctly rounded."""
    if _float32(a, b):
        return ops32.add(a, b, fmt)
    _check(a, b)
    fmt = get_format(fmt)
    a, b = jnp.broadcast_arrays(a, b)
    s, e = _two_sum(a, b)
    return _round_to_odd_then(s, e, fmt, normalised=True)


def sub(a, b, fmt) -> jax.Array:
    """fl_fmt(a - b), correctly rounded."""
    return add(a, -jnp.asarray(b), fmt)


def mul(a, b, fmt) -> jax.Array:
    """fl_fmt(a * b), correctly rounded: the float64 product p is moved to its odd
    neighbour toward the exact product (round-to-odd) before rounding to ``fmt``."""
    if _float32(a, b):
        return ops32.mul(a, b, fmt)
    _check(a, b)
    fmt = get_format(fmt)
    a, b = jnp.broadcast_arrays(a, b)
    p = a * b
    return _round_to_odd_then(p, _product_error_stand_in(a, b, p), fmt)


def fma(a, b, c, fmt) -> jax.Array:
    """fl_fmt(a * b + c) with a single rounding: a fused multiply-add.

    Correctly rounded when the product a·b is exact in float64, i.e. a and b have
    at most 26 significand bits together with room to spare (every format up to
    FP32, as for ``matmul``): TwoSum of the exact product and c, then round-to-odd.
    With ``fmt`` FP64 it is plain float64 arithmetic, fl(fl(a·b) + c).
    """
    if _float32(a, b, c):
        return ops32.fma(a, b, c, fmt)
    _check(a, b, c)
    fmt = get_format(fmt)
    a, b, c = jnp.broadcast_arrays(a, b, c)
    s, e = _two_sum(a * b, c)
    return _round_to_odd_then(s, e, fmt)


def _product_error_stand_in(a, b, p):
    """A value with the sign of a·b - p (p = fl(a·b)), zero exactly when p is exact,
    and far below p's ulp, which is all round-to-odd needs.

    With |a| = m_a 2^e_a and |b| = m_b 2^e_b, m in [1, 2) read from the bits (no
    overflow in Veltkamp's split), |p| = 2^(e_a+e_b) fl(m_a m_b) whenever p is a
    normal float64, so the sign is sign(p) times that of Dekker's error of m_a m_b.  Where p is
    subnormal in float64 the stand-in underflows to 0, and a float64-subnormal
    operand counts as exact: no format with at most 10 exponent bits has a value
    within a float64 ulp of those products.
    """
    _, l = _two_product(_significand(a), _significand(b))
    normal = (_exponent_field(a) != 0) & (_exponent_field(b) != 0)
    return jnp.where(normal, jnp.sign(l), 0.0) * p * _BELOW_ULP  # sign(p) restores the signs


def _exponent_field(x):
    """The exponent field of a float64 (0: zero or subnormal)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint64) & _EXPONENT_MASK


def _significand(x):
    """|x| / 2^floor(log2 |x|) in [1, 2) for a normal float64 x (its fraction bits
    under the exponent of 1)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint64) & _FRACTION_MASK
    return jax.lax.bitcast_convert_type(bits | _EXPONENT_OF_ONE, jnp.float64)


def div(a, b, fmt, *, divisor=None) -> jax.Array:
    """fl_fmt(a / b), correctly rounded (a midpoint quotient is resolved exactly).

    ``divisor``: the format whose values ``b`` holds, if the caller knows it (a
    :class:`Format` or name; None: any float64).  Where it proves the float64
    quotient rounds once (:func:`_quotient_rounds_once`), the midpoint check is
    skipped: it is about four fifths of the op's cost."""
    if _float32(a, b):
        return ops32.div(a, b, fmt)
    _check(a, b)
    fmt = get_format(fmt)
    # XLA rewrites a / broadcast(b) as a * broadcast(1/b) (inexact), for scalar and
    # row-broadcast divisors alike; full-shape operands behind a barrier divide exactly.
    a, b = jax.lax.optimization_barrier(jnp.broadcast_arrays(a, b))
    q = a / b
    nearest = round_to(q, fmt)
    if divisor is not None and _quotient_rounds_once(fmt, get_format(divisor)):
        return nearest
    lo, hi = round_to(q, fmt, "down"), round_to(q, fmt, "up")
    midpoint = (lo != hi) & (q - lo == hi - q) & ~_is_fp64(fmt)
    residual = _sign_of_residual(a, b, q) * jnp.sign(b)  # sign of (a/b - q)
    fixed = jnp.where(residual > 0, hi, jnp.where(residual < 0, lo, nearest))
    return jnp.where(midpoint, fixed, nearest)


def _quotient_rounds_once(fmt: Format, divisor: Format) -> bool:
    """Whether ``fl_fmt(fl64(a / b)) = fl_fmt(a / b)`` for every float64 ``a`` and every
    value ``b`` of ``divisor``: true where both formats are concrete, have at most
    10 exponent bits (so b is a normal float64 and the quotient's rounding
    boundaries lie far above float64's underflow) and precisions P = man_bits + 1
    with ``P_fmt + P_divisor <= 53``.

    Proof.  A rounding boundary of ``fmt`` (a midpoint M, or the overflow or
    flush threshold, each an odd multiple of 2^g with g = e_M - P_fmt, e_M the
    exponent of M) is the only place a second rounding can err: fl64 must land on
    M, or cross it.  With b = B·2^β (B < 2^P_divisor an integer) and a = A·2^α,
    a - M·b is a multiple of 2^min(α, g + β).  If a/b ≠ M: where the minimum is
    g + β, |a/b - M| ≥ 2^(g+β) / b > 2^(g - P_divisor) ≥ 2^(e_M - 53); where it is
    α, |a/b - M| ≥ 2^α / b > (a/b)·2^-53 (A < 2^53).  Either way a/b is farther
    from M than half a float64 ulp, so fl64(a/b) neither reaches M nor crosses it;
    and if a/b = M, M has at most 53 bits and fl64 keeps it."""
    return (
        fmt.is_concrete
        and divisor.is_concrete
        and fmt.exp_bits <= 10
        and divisor.exp_bits <= 10
        and (fmt.man_bits + 1) + (divisor.man_bits + 1) <= 53
    )


def _sign_of_residual(a, b, q):
    """sign(a - q·b), exactly, for finite nonzero float64 a, b and q = fl(a / b).

    On significands a = m_a 2^e_a, b = m_b 2^e_b, q = m_q 2^e_q (m in [0.5, 1)):
    a - q b = 2^(e_q + e_b) (m_a 2^k - m_q m_b) with k = e_a - e_q - e_b in [-1, 2].
    Dekker's product gives m_q m_b = h + l exactly (no overflow on significands),
    m_a 2^k - h is exact (Sterbenz: the two lie within a factor 2, q being the
    rounded quotient), and one last subtraction of l keeps the sign.
    """
    m_a, e_a = jnp.frexp(a)
    m_b, e_b = jnp.frexp(b)
    m_q, e_q = jnp.frexp(q)
    h, l = _two_product(m_q, m_b)
    k = (e_a - e_q - e_b).astype(a.dtype)
    return jnp.sign((m_a * 2.0**k - h) - l)


def _split(x):
    """Veltkamp's split x = hi + lo, each half of float64's 53 bits fitting 26 bits."""
    c = _VELTKAMP * x
    hi = c - (c - x)
    return hi, x - hi


def _two_product(a, b):
    """p = fl(a · b) and its exact error l = a · b - p (Dekker 1971), for |a|, |b| < 2^995
    and a product far from float64's underflow (here: significands in [0.25, 1))."""
    p = a * b
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    l = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo
    return p, l


def exp(x, fmt) -> jax.Array:
    """fl_fmt(exp(x)) from float64 exp (see the module docstring)."""
    if _float32(x):
        return exp32.exp(x, fmt)
    _check(x)
    return round_to(jnp.exp(x), get_format(fmt))


def exp2(x, fmt) -> jax.Array:
    """fl_fmt(2^x) from float64 exp2 (as ``exp``: see the module docstring)."""
    if _float32(x):
        return exp32.exp2(x, fmt)
    _check(x)
    return round_to(jnp.exp2(x), get_format(fmt))


def tanh(x, fmt) -> jax.Array:
    """fl_fmt(tanh(x)) from float64 tanh (see the module docstring); float64 carriers."""
    if _float32(x):
        raise ValueError(
            "ops.tanh: expected a float64 carrier (a float32 carrier has no emulated tanh), "
            "got float32; enable jax_enable_x64 or use Policy(carrier='float64')"
        )
    _check(x)
    return round_to(jnp.tanh(x), get_format(fmt))


def log_sum(m, l, fmt, *, scale=None) -> jax.Array:
    """fl_fmt(m + ln l), or fl_fmt(m · scale + ln l): a log-sum-exp from its running
    max and sum (l > 0).  The float64 path rounds float64's m · scale (exact for
    values of at most 26 significand bits) + log l: not correctly rounded after a
    cancellation m ≈ -ln l, nor where m · scale is a midpoint that ln l breaks
    (ln l lost in float64).  Float32 carriers go to :mod:`fa_jax.carrier32.lse`, correctly
    rounded (the two can differ in those cases; it is not the float64 path's
    default because its program costs seconds to compile)."""
    operands = (m, l) if scale is None else (m, l, scale)
    if _float32(*operands):
        return lse32.lse(m, l, fmt, scale)
    _check(*operands)
    return round_to((m if scale is None else m * scale) + jnp.log(l), get_format(fmt))


def maximum(a, b, fmt) -> jax.Array:
    """fl_fmt(max(a, b)) (exact when a and b are values of fmt)."""
    if _float32(a, b):
        return ops32.maximum(a, b, fmt)
    _check(a, b)
    return round_to(jnp.maximum(a, b), get_format(fmt))


def _sequential(terms, fmt: Format, start):
    """acc_k = fl(acc_{k-1} + terms[k]) over the leading axis, from acc_0 = start."""

    def step(acc, t):
        return add(acc, t, fmt), None

    return ops32.scan_steps(step, start, terms)[0]


def _sum_and_error(x, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """(s, e) with s + e = Σ x along ``axis`` to within about n * 2**-106 * Σ|x|:
    a variadic reduction whose combiner is TwoSum, so no partial sum's rounding
    error is lost whatever order XLA reduces in."""

    def combine(left, right):
        (s1, e1), (s2, e2) = left, right
        s, err = _two_sum(s1, s2)
        return s, (e1 + e2) + err

    zero = np.float64(0.0)
    s, e = jax.lax.reduce((x, jnp.zeros_like(x)), (zero, zero), combine, (axis,))
    return s, e


def sum(
    x,
    fmt,
    *,
    axis: int = -1,
    accumulation: Accumulation | str = EXACT,
    initial=None,
) -> jax.Array:
    """fl_fmt(Σ x along ``axis``) under an accumulation model.

    "exact" and the chunks of "chunked(k)" are summed with their error terms
    (:func:`_sum_and_error`) and rounded through round-to-odd, so a float64 sum
    that lands on a midpoint of ``fmt`` does not round the wrong way.
    "tensor_core" takes the terms in index order, k per block, each block
    aligned, truncated and normalised with the accumulator (the model of
    :mod:`fa_jax.accumulation`).  "tree" evaluates the model's summation tree
    level by level (each node ``add``, or a fused node's exact sum rounded once).

    ``initial`` (shape of ``x`` without ``axis``), if given, is the accumulator's
    starting value: the first term of "exact" and of a tree (leaf 0, before the
    terms), the value the sequential, chunked and tensor-core accumulators start
    from instead of 0 (a GEMM that adds into C).
    """
    if _float32(x, *(() if initial is None else (initial,))):
        return sum32.sum(x, fmt, axis=axis, accumulation=accumulation, initial=initial)
    _check(x)
    fmt, model = get_format(fmt), get_accumulation(accumulation)
    x = jnp.moveaxis(x, axis, 0)
    if initial is not None:
        _check(initial)
        initial = jnp.broadcast_to(initial, x.shape[1:])
    if model.kind == "tree":
        terms = x if initial is None else jnp.concatenate([initial[None], x])
        return _tree_sum(terms, fmt, typing.cast(Tree, model.tree))
    start = jnp.zeros(x.shape[1:], x.dtype) if initial is None else initial
    if model.kind == "tensor_core":
        return _with_tensor_core_support(
            fmt,
            model,
            lambda: _tensor_core_sum(x, fmt, model, start),
            lambda: _exact_sum(x, fmt, initial),
        )
    if model.kind == "exact":
        return _exact_sum(x, fmt, initial)
    if model.kind == "chunked":
        n, k = x.shape[0], typing.cast(int, model.chunk)
        pad = -n % k
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        chunks = _sum_and_error(x.reshape((n + pad) // k, k, *x.shape[1:]), axis=1)
        return _sequential_pairs(*chunks, fmt, start)
    return _sequential(x, fmt, start)


def _exact_sum(x, fmt: Format, initial):
    """The exact sum of ``x`` over its leading axis (and ``initial``), rounded once."""
    terms = x if initial is None else jnp.concatenate([initial[None], x])
    return _round_to_odd_then(*_sum_and_error(terms), fmt)


def _sequential_pairs(s, e, fmt: Format, start):
    """acc_k = fl(acc_{k-1} + (s_k + e_k)) over the leading axis, from acc_0 = start."""

    def step(acc, term):
        s_k, e_k = term
        total, err = _two_sum(acc, s_k)
        return _round_to_odd_then(total, err + e_k, fmt), None

    return ops32.scan_steps(step, start, (s, e))[0]


def matmul(a, b, fmt, *, accumulation: Accumulation | str = EXACT, initial=None) -> jax.Array:
    """fl_fmt(a @ b) for a (..., n, k) and b (..., k, m) under an accumulation model.

    "exact" rounds the float64 dot once; "sequential" rounds after each of the k
    fused multiply-adds in index order; "chunked(c)" takes exact float64 dots of
    c consecutive terms and adds them sequentially; "tensor_core" runs the
    block FMA of Fasi et al. (2021) on k consecutive products at a time (the
    model of :mod:`fa_jax.accumulation`), vectorised over the output elements;
    "tree" sums the k exact products of every output element by the model's
    summation tree (it holds all k products of every output: memory k times the
    output's).

    ``initial`` (broadcastable to the output), if given, is C of C + a @ b: the
    starting value of the sequential, chunked and tensor-core accumulators, a
    tree's leaf 0 before the k products, and for "exact" added to the float64
    dot before the one rounding.
    """
    if _float32(a, b, *(() if initial is None else (initial,))):
        return sum32.matmul(a, b, fmt, accumulation=accumulation, initial=initial)
    _check(a, b)
    fmt, model = get_format(fmt), get_accumulation(accumulation)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: contraction sizes differ: a is {a.shape}, b is {b.shape}")
    out_shape = (*jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    if initial is not None:
        _check(initial)
        initial = jnp.broadcast_to(initial, out_shape)
    dot = lambda x, y: jnp.matmul(  # noqa: E731
        x, y, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float64
    )

    def exact():
        if initial is None:
            return round_to(dot(a, b), fmt)
        return _round_to_odd_then(*_two_sum(dot(a, b), initial), fmt)

    if model.kind == "tree":
        products = _products(a, b)
        if initial is not None:
            products = jnp.concatenate([initial[None], products])
        return _tree_sum(products, fmt, typing.cast(Tree, model.tree))
    start = jnp.zeros(out_shape, jnp.float64) if initial is None else initial
    if model.kind == "tensor_core":
        return _with_tensor_core_support(
            fmt, model, lambda: _tensor_core_matmul(a, b, fmt, model, start), exact
        )
    if model.kind == "exact":
        return exact()
    k = a.shape[-1]
    c = 1 if model.kind == "sequential" else model.chunk
    pad = -k % c
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
    q = (k + pad) // c
    a_chunks = jnp.moveaxis(a.reshape(*a.shape[:-1], q, c), -2, 0)  # (q, ..., n, c)
    b_chunks = jnp.moveaxis(b.reshape(*b.shape[:-2], q, c, b.shape[-1]), -3, 0)  # (q, ..., c, m)

    def step(acc, ab):
        return add(acc, dot(*ab), fmt), None

    def emulated():
        return ops32.scan_steps(step, start, (a_chunks, b_chunks))[0]

    if c == 1 and native32.is_binary32(fmt):
        return native32.sequential_matmul(a, b, start, emulated)
    return emulated()


# -- the tensor-core block FMA (fa_jax.accumulation, Fasi et al. 2021) ----------------

_SIGN = np.uint64(1 << 63)
_NO_EXPONENT = -(1 << 20)  # below every exponent: zeros and non-finite terms


def _with_tensor_core_support(fmt: Format, model: Accumulation, tensor_core, fp64):
    """Run ``tensor_core()`` where the model is exact in float64, ``fp64()`` (plain
    float64, the "exact" model) for an FP64 accumulator.  A concrete format too
    wide for an exact aligned sum raises; a traced one gives NaN there."""
    if fmt.is_concrete:
        if _is_fp64(fmt):
            return fp64()
        if model.sum_bits(fmt.man_bits) > 53:
            raise ValueError(
                f"accumulation {model}: the aligned block sums of a {fmt.name!r} accumulator "
                f"span man_bits + extra_bits + 1 + ceil(log2(terms)) = "
                f"{model.sum_bits(fmt.man_bits)} bits, expected <= 53 (exact in float64)"
            )
        return tensor_core()
    fits = model.sum_bits(fmt.man_bits) <= 53
    return jnp.where(_is_fp64(fmt), fp64(), jnp.where(fits, tensor_core(), jnp.nan))


def _exponent(x):
    """floor(log2 |x|) of a normal float64 (int32); -1023 for zeros and subnormals."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint64)
    return ((bits >> np.uint64(52)) & np.uint64(0x7FF)).astype(jnp.int32) - 1023


def _truncate(x, q_exp):
    """``x`` rounded toward zero to a multiple of ``2**q_exp`` (int32), by masking
    the float64 significand bits below the quantum: exact, sign kept."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint64)
    field = ((bits >> np.uint64(52)) & np.uint64(0x7FF)).astype(jnp.int32)
    drop = q_exp - (jnp.maximum(field, 1) - 1075)  # quantum over the ulp of x, in bits
    mask = (np.uint64(1) << jnp.clip(drop, 0, 52).astype(jnp.uint64)) - np.uint64(1)
    kept = jnp.where(drop > 52, bits & _SIGN, bits & ~mask)  # |x| < quantum: a signed 0
    return jax.lax.bitcast_convert_type(kept, jnp.float64)


def _tensor_core_block(terms, fmt: Format, model: Accumulation):
    """One block FMA on ``terms`` (..., T): align to the largest exponent with
    ``extra_bits`` extra bits, truncate, add exactly, normalise in
    ``model.normalization`` (fa_jax.accumulation, "The tensor-core model")."""
    finite = jnp.isfinite(terms)
    emin = 1 - jnp.asarray(fmt.bias, jnp.int32)
    e = jnp.maximum(_exponent(terms), emin)  # E(x) = max(floor(log2 |x|), emin)
    e_max = jnp.max(jnp.where(finite & (terms != 0), e, _NO_EXPONENT), axis=-1)
    q_exp = e_max - jnp.asarray(fmt.man_bits, jnp.int32) - typing.cast(int, model.extra_bits)
    s = jnp.sum(_truncate(terms, q_exp[..., None]), axis=-1)  # exact (sum_bits <= 53)
    s = jnp.where(s == 0, 0.0, s)  # an exact zero sum is +0
    out = round_to(s, fmt, typing.cast(RoundingMode, model.normalization))
    return jnp.where(jnp.all(finite, axis=-1), out, jnp.sum(terms, axis=-1))  # inf/NaN: IEEE


def _tensor_core_scan(c, blocks, products, fmt: Format, model: Accumulation):
    """Run the block FMAs over the leading axis of ``blocks`` from accumulator ``c``;
    ``products(block)`` gives a block's terms (..., k)."""

    def step(c, block):
        p = products(block)
        if model.fused_accumulator:
            return _tensor_core_block(jnp.concatenate([c[..., None], p], axis=-1), fmt, model), None
        return add(c, _tensor_core_block(p, fmt, model), fmt), None

    return ops32.scan_steps(step, c, blocks)[0]


def _tensor_core_sum(x, fmt: Format, model: Accumulation, c):
    """Σ over the leading axis of ``x`` (n, ...) in blocks of k from accumulator ``c``
    (zero padded: a zero term changes nothing)."""
    n, k = x.shape[0], model.chunk
    pad = -n % k
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    blocks = jnp.moveaxis(x.reshape((n + pad) // k, k, *x.shape[1:]), 1, -1)  # (q, ..., k)
    return _tensor_core_scan(c, blocks, lambda p: p, fmt, model)


def _tensor_core_matmul(a, b, fmt: Format, model: Accumulation, c):
    """a (..., n, K) @ b (..., K, m) from accumulator ``c``: per K-block of k, the
    exact products a[i, t] b[t, j] of every output element (..., n, m, k), then a
    block FMA."""
    k_dim, k = a.shape[-1], model.chunk
    pad = -k_dim % k
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
    q = (k_dim + pad) // k
    a_blocks = jnp.moveaxis(a.reshape(*a.shape[:-1], q, k), -2, 0)  # (q, ..., n, k)
    b_blocks = jnp.moveaxis(b.reshape(*b.shape[:-2], q, k, b.shape[-1]), -3, 0)  # (q, ..., k, m)

    def products(block):
        a_j, b_j = block
        return a_j[..., :, None, :] * jnp.swapaxes(b_j, -1, -2)[..., None, :, :]  # exact

    return _tensor_core_scan(c, (a_blocks, b_blocks), products, fmt, model)


# -- summation trees (fa_jax.accumulation, "Summation trees") -------------------------


def _tree_sum(x, fmt: Format, t: Tree):
    """Σ over the leading axis of ``x`` (n, ...) as the tree ``t`` gives: each node
    is fl(left + right) (``add``), or a fused node's exact sum rounded once."""
    n = x.shape[0]
    if n == 0:
        return jnp.zeros(x.shape[1:], x.dtype)
    if n == 1:
        return round_to(x[0], fmt)
    segments, size, root = tree_schedule(t, n)
    rest = jnp.zeros((size - n, *x.shape[1:]), x.dtype)
    buf = jnp.concatenate([x, rest.at[-2].set(-0.0)])

    def level(buf, idx):
        children, outputs = idx
        c = buf[children]  # (width, arity, ...)
        if children.shape[-1] == 2:  # a node of one child: fl(x + -0) = fl(x)
            value = add(c[:, 0], c[:, 1], fmt)
        else:
            value = _round_to_odd_then(*_sum_and_error(c, axis=1), fmt)
        return buf.at[outputs].set(value), None

    for children, outputs in segments:
        if children.shape[0] == 1:
            buf, _ = level(buf, (children[0], outputs[0]))
        else:
            buf, _ = jax.lax.scan(level, buf, (jnp.asarray(children), jnp.asarray(outputs)))
    return buf[root]


def _products(a, b):
    """The exact products a[..., i, t] b[..., t, j] as (K, ..., n, m): the leaves of
    a tree matmul."""
    pa = jnp.moveaxis(a, -1, 0)[..., :, None]  # (K, ..., n, 1)
    pb = jnp.moveaxis(b, -2, 0)[..., None, :]  # (K, ..., 1, m)
    return pa * pb
