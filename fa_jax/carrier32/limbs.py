"""Exact sums in integers: float32 terms cut into pieces, summed in int32 limbs, rounded once.

Every term is cut into *pieces* ``±m 2**l``, ``m`` a
24-bit integer: a float32 value is one piece (its significand), an exact
product ``a·b`` two (the high and low 24 bits of the 48-bit product of the
significands, :func:`fa_jax.carrier32.elementwise.exact_product`).  A fixed-point accumulator with
base ``2**B`` holds ``Σ pieces`` in int32 *limbs* of ``D = 23`` bits (``LIMB_BITS``) (limb ``k``
weighs ``2**(B + kD)``); a piece adds the bits of ``m 2**(l - B)`` that fall in
each limb, with its sign.  After at most 255 pieces a limb holds less than
``256 · 2**23 = 2**31`` in magnitude, so carries are propagated (floor division
by ``2**D``) every 255 pieces; the top limb only takes carries.  The
accumulator's value is then exactly the sum of the bits at or above ``2**B``.

* Full range: ``B`` below every piece (``2**-344``, the last bit of a product
  of two float32 subnormals; ``2**-172`` for values) and limbs up to ``2**256``
  (products) lose nothing: the value is the exact sum.  Its 15 or 28 limbs are
  visited by a loop (one copy of the code in the program), the windows' unrolled.
* Window (the fast path): ``B = e + 1 - 69`` for ``e`` the exponent of the
  output's largest piece, 4 limbs.  A piece reaching below ``B`` loses less than
  ``2**B``; with ``c`` such pieces, ``|lost| < c 2**B <= 2**(G + B)``
  (``G = bit_length(pieces)``), and the lost part of a piece has its sign.
  With ``V`` the window sum and ``t`` the weight of the bit below the 25 that
  rounding reads (the 24 kept and a guard bit), if the bits of ``|V|`` between
  ``2**G`` and ``2**t`` are neither all zero (where a lost piece has the
  opposite sign: for those only, ``|V|`` is first lowered by one unit) nor all
  one (where one has the same sign), the exact sum lies strictly inside the same
  cell ``(j 2**t, (j + 1) 2**t)`` as ``V`` (or ``|V| - 1``): the same 25 bits,
  and bits below them.  Otherwise (heavy cancellation) the full range is
  computed (one ``lax.cond`` for the whole array).

Rounding: the 25 top bits ``g`` of the magnitude and a sticky bit give the
24-bit nearest value and the sign of the rest (``ops32.nearest_rounded``), which
:func:`fa_jax.carrier32.elementwise.round_parts` rounds to the format, exactly as the
elementwise ops do; the directed modes of the tensor-core model drop bits from
the truncated 24 bits and go up where a dropped or sticky bit is set.

:mod:`fa_jax.carrier32.sums` runs the accumulation models on it; the digit
slices of :mod:`fa_jax.carrier32.slices` are summed in these limbs too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax._fallback import batch_all
from fa_jax.carrier32 import elementwise as ops32
from fa_jax.carrier32.elementwise import pad_axis, pow2_bits, scan_steps, shift_bits
from fa_jax.formats import Format
from fa_jax.rounding import round_to

_U32 = np.uint32
_I32 = np.int32
LIMB_BITS = 23  # bits a limb (D)
_D = LIMB_BITS
_MASK = _U32((1 << _D) - 1)
PER_STEP = 255  # pieces added between carry propagations: 256 * 2**23 = 2**31
_WINDOW_LIMBS = 4  # 3 limbs of pieces (69 bits) and a limb of carries
_UNROLL = 8  # limb loops this long are unrolled (the windows); longer ones (full range) loop
NO_EXPONENT = -(1 << 20)  # below every piece: the exponent of an output with no piece
VALUES = (-172, 128)  # last bit of a float32's 24-bit significand, first power above
PRODUCTS = (-344, 256)  # the same for exact products of two float32
_FLT_MAX = _U32(0x7F7FFFFF)
NEG_ZERO = _U32(0x80000000)


class Pieces(NamedTuple):
    """Terms as ``±sig 2**lsb`` pieces along the first axis."""

    neg: jax.Array  # bool
    lsb: jax.Array  # int32
    sig: jax.Array  # uint32 < 2**24; 0 for zeros (and non-finite terms)


def cat(*ps: Pieces) -> Pieces:
    return Pieces(*(jnp.concatenate(parts) for parts in zip(*ps)))


def value_pieces(x) -> Pieces:
    """A float32 array as one piece a value."""
    p = ops32.unpack(x)
    sig = jnp.where(p.zero | ~p.finite, _U32(0), p.sig)
    return Pieces(p.sign != _U32(0), p.exp - _I32(23), sig)


class Operand(NamedTuple):
    """An unpacked float32 matmul operand; ``sig`` 0 for zeros and non-finite."""

    sign: jax.Array
    exp: jax.Array
    sig: jax.Array


def operand(x) -> Operand:
    p = ops32.unpack(x)
    nonzero = ~p.zero & p.finite
    return Operand(
        p.sign,
        jnp.where(nonzero, p.exp, _I32(NO_EXPONENT // 4)),
        jnp.where(nonzero, p.sig, _U32(0)),
    )


def product_pieces(a: Operand, b: Operand) -> Pieces:
    """The exact products a·b (broadcast) as two pieces each: (high, low) 24 bits."""
    high, low = ops32.exact_product(a.sig, b.sig)
    neg = (a.sign ^ b.sign) != _U32(0)
    lsb = a.exp + b.exp - _I32(46)
    return Pieces(
        jnp.concatenate([neg, neg]),
        jnp.concatenate([lsb + _I32(24), lsb]),
        jnp.concatenate([high, low]),
    )


def top_exponent(p: Pieces) -> jax.Array:
    """An upper bound on the exponent of the largest piece (over the last axis)."""
    return jnp.max(jnp.where(p.sig != _U32(0), p.lsb + _I32(23), _I32(NO_EXPONENT)), axis=0)


def zeros(shape) -> jax.Array:
    """+0 accumulators, hidden from XLA's simplifier, which folds ``0 + x`` to ``x``
    (-0 where x is -0: IEEE gives +0)."""
    return jax.lax.optimization_barrier(jnp.zeros(shape, jnp.float32))


# -- the limb accumulator ------------------------------------------------------------


def _over_limbs(step: Callable, carry, xs: list) -> tuple:
    """``(carry, ys)``: ``carry, y = step(carry, x)`` for each limb's ``x`` in order,
    the ``y`` in a list.  Unrolled for at most _UNROLL limbs (the windows: the fast
    paths); else one int32-counted loop (``scan_steps``) over the stacked ``xs``, so that
    the full range's 15 or 28 limbs are one copy of ``step`` in the program."""
    if len(xs) <= _UNROLL:
        ys = []
        for x in xs:
            carry, y = step(carry, x)
            ys.append(y)
        return carry, ys
    n = len(xs)
    stacked = jax.tree_util.tree_map(lambda *v: jnp.stack([jnp.asarray(e) for e in v]), *xs)
    y0 = jax.eval_shape(lambda c, x: step(c, x)[1], carry, xs[0])

    def body(state, kx):  # y_k written into the stacked outputs, carried along
        carry, ys = state
        k, x = kx
        carry, y = step(carry, x)
        return (
            carry,
            None if ys is None else jax.lax.dynamic_update_index_in_dim(ys, y, k, 0),
        ), None

    ys = None if y0 is None else jnp.zeros((n, *y0.shape), y0.dtype)
    (carry, ys), _ = scan_steps(body, (carry, ys), (np.arange(n, dtype=_I32), stacked))
    return carry, [None if ys is None else ys[k] for k in range(n)]


def limbs_of(p: Pieces, base, n_limbs: int) -> list[jax.Array]:
    """Σ over the pieces of the bits of ``m 2**(lsb - base)`` in each of the lower
    ``n_limbs - 1`` limbs, signed (int32; at most PER_STEP pieces)."""
    s0 = p.lsb - base[None]

    def limb(_, k_d):
        v = (shift_bits(p.sig, s0 - k_d) & _MASK).astype(jnp.int32)
        return None, jnp.sum(jnp.where(p.neg, -v, v), axis=0, dtype=jnp.int32)

    return _over_limbs(limb, None, [_I32(k * _D) for k in range(n_limbs - 1)])[1]


def _lost(p: Pieces, base) -> tuple[jax.Array, jax.Array]:
    """How many positive and negative pieces have bits below ``2**base``."""
    d = ops32.clamp_int(base[None] - p.lsb, 0, 31).astype(jnp.uint32)
    lost = (p.sig & ((_U32(1) << d) - _U32(1))) != _U32(0)
    count = lambda m: jnp.sum(m, axis=0, dtype=jnp.int32)  # noqa: E731
    return count(lost & ~p.neg), count(lost & p.neg)


def _carry(limbs: list[jax.Array]) -> list[jax.Array]:
    """Carries propagated: every limb but the top one in [0, 2**D)."""

    def step(carry, limb):
        v = limb + carry
        return v >> _I32(_D), v & _I32((1 << _D) - 1)  # floor division (arithmetic shift)

    carry, out = _over_limbs(step, jnp.zeros_like(limbs[0]), limbs[:-1])
    return [*out, limbs[-1] + carry]


class LimbSum(NamedTuple):
    limbs: list[jax.Array]
    lost_pos: jax.Array
    lost_neg: jax.Array


def accumulate(steps, to_pieces: Callable, base, n_limbs: int, first: Pieces | None) -> LimbSum:
    """The limbs of Σ pieces over ``steps`` (a pytree with a leading step axis, each
    step ``to_pieces(step)`` of at most PER_STEP pieces), ``first`` added first."""
    zero = jnp.zeros(base.shape, jnp.int32)

    def add(state: LimbSum, p: Pieces) -> LimbSum:
        parts = limbs_of(p, base, n_limbs)
        limbs = _carry([a + b for a, b in zip(state.limbs, [*parts, zero])])
        pos, neg = _lost(p, base)
        return LimbSum(limbs, state.lost_pos + pos, state.lost_neg + neg)

    state = LimbSum([zero] * n_limbs, zero, zero)
    if first is not None:
        state = add(state, first)
    n = jax.tree_util.tree_leaves(steps)[0].shape[0]
    if n == 1:
        return add(state, to_pieces(jax.tree_util.tree_map(lambda s: s[0], steps)))
    state, _ = scan_steps(lambda st, s: (add(st, to_pieces(s)), None), state, steps)
    return state


def top_bit(u) -> jax.Array:
    """floor(log2 u) of a uint32 (int32; -1 for 0)."""
    return _I32(31) - jax.lax.clz(u).astype(jnp.int32)


class Rounded(NamedTuple):
    value: jax.Array  # float32 (before round_to's overflow and specials)
    zero: jax.Array  # the sum is exactly zero
    safe: jax.Array  # the window decided the rounding


def round_limbs(s: LimbSum, base, bits, fmt: Format, mode: str) -> Rounded:
    """Round ``Σ limbs 2**(base + kD)`` (plus less than ``2**(base + bits)`` lost, see
    the module docstring) to ``fmt`` in ``mode``."""
    bits = jnp.asarray(bits, jnp.int32)
    limbs = _carry(s.limbs)
    neg = limbs[-1] < _I32(0)
    negated = _carry([-limb for limb in limbs])
    mag = [jnp.where(neg, m, limb) for m, limb in zip(negated, limbs)]
    lost = s.lost_pos + s.lost_neg
    same = jnp.where(neg, s.lost_neg, s.lost_pos)
    opp = jnp.where(neg, s.lost_pos, s.lost_neg)
    lower = ((opp > _I32(0)) & (same == _I32(0))).astype(jnp.int32)
    mag = _carry([mag[0] - lower, *mag[1:]])
    umag = [m.astype(jnp.uint32) for m in mag]
    top = jnp.max(
        jnp.stack(
            [
                jnp.where(u != _U32(0), _I32(k * _D) + top_bit(u), _I32(-1))
                for k, u in enumerate(umag)
            ]
        ),
        axis=0,
    )
    t = top - _I32(24)  # the guard bit's position

    def read(state, limb):
        """A limb's bits into g (the guard bit and above) and sticky (below it), and
        whether its bits between 2**bits and 2**t are all zero, all one."""
        g, sticky, all_zero, all_one = state
        u, k_d, width = limb
        shift = k_d - t
        below = (_U32(1) << ops32.clamp_int(-shift, 0, 31).astype(jnp.uint32)) - _U32(1)
        lo = jnp.minimum(ops32.clamp_int(bits - k_d, 0, 31), width).astype(jnp.uint32)
        hi = jnp.minimum(ops32.clamp_int(t - k_d, 0, 31), width).astype(jnp.uint32)
        mask = ((_U32(1) << hi) - _U32(1)) & ~((_U32(1) << lo) - _U32(1))
        return (
            g + shift_bits(u, shift),
            sticky | ((u & below) != _U32(0)),
            all_zero & ((u & mask) == _U32(0)),
            all_one & ((u & mask) == mask),
        ), None

    ones = jnp.ones(top.shape, bool)
    limbs_in = [
        (u, _I32(k * _D), _I32(31 if k == len(umag) - 1 else _D)) for k, u in enumerate(umag)
    ]
    state = (jnp.zeros_like(umag[0]), lost > _I32(0), ones, ones)
    (g, sticky, all_zero, all_one), _ = _over_limbs(read, state, limbs_in)
    safe = (lost == _I32(0)) | (
        (t > bits) & ((opp == _I32(0)) | ~all_zero) & ((same == _I32(0)) | ~all_one)
    )
    zero = top < _I32(0)
    sign = jnp.where(neg, ops32.SIGN_MASK, _U32(0))
    exp = top + base
    kept, dropped = g >> _U32(1), g & _U32(1)
    if mode == "nearest_even":
        sig, rest = ops32.nearest_rounded(kept, dropped, _U32(1), sticky)
        sig, exp = ops32.normalise_parts(sig, exp)
        value = ops32.round_parts(sign, exp, sig, zero, rest, fmt)
    else:
        value = _round_directed(sign, exp, kept, (dropped != _U32(0)) | sticky, zero, fmt, mode)
    return Rounded(value, zero & (lost == _I32(0)), safe)


def _round_directed(sign, exp, sig, inexact, zero, fmt: Format, mode: str) -> jax.Array:
    """``x = ±(sig + ρ) 2**(exp - 23)`` (``sig`` in [2**23, 2**24), ``ρ`` in [0, 1),
    ``inexact``: ρ > 0) rounded to ``fmt`` toward zero, up or down: the value on
    ``fmt``'s grid (extended past its max) that ``round_to(x, fmt, mode)`` starts
    from; past float32's range ±FLT_MAX where the mode rounds toward zero there,
    else ±inf, which ``round_to`` maps to the format's max or overflow."""
    emin = _I32(1) - ops32.int32_of(fmt.bias)
    m = ops32.int32_of(fmt.man_bits)
    if fmt.subnormals:
        q_exp = jnp.maximum(exp, emin) - m
    else:
        q_exp = jnp.where(exp >= emin, exp - m, emin)
    d = q_exp - (exp - _I32(23))
    neg = sign != _U32(0)
    away = {"toward_zero": jnp.zeros_like(neg), "up": ~neg, "down": neg}[mode]
    dd = ops32.clamp_int(d, 0, 24).astype(jnp.uint32)
    kept = sig >> dd
    dropped = (sig & ((_U32(1) << dd) - _U32(1))) != _U32(0)
    up = away & (dropped | inexact)
    mag = (kept + up.astype(jnp.uint32)) << dd  # 0 or in [2**23, 2**24]
    top = top_bit(mag)
    e = exp + top - _I32(23)
    field = (ops32.clamp_int(e, -126, 127) + _I32(127)).astype(jnp.uint32) << _U32(23)
    normal = field | (
        (mag >> ops32.clamp_int(top - _I32(23), 0, 1).astype(jnp.uint32)) & ops32.FRACTION_MASK
    )
    subnormal = mag >> ops32.clamp_int(_I32(-126) - exp, 0, 31).astype(jnp.uint32)
    out = jnp.where(e >= _I32(-126), normal, subnormal)
    out = jnp.where(e > _I32(127), jnp.where(away, ops32.INF_BITS, _FLT_MAX), out)
    out = jnp.where(d > _I32(24), jnp.where(up, pow2_bits(q_exp), _U32(0)), out)
    out = jnp.where(zero | (mag == _U32(0)) & (d <= _I32(24)), _U32(0), out)
    return ops32.float_of_bits(sign | out)


def rounded_exact(
    steps,
    to_pieces: Callable,
    e_top,
    n_pieces: int,
    full: tuple[int, int],
    fmt: Format,
    first: Pieces | None = None,
) -> Rounded:
    """The exact sum of the pieces rounded to nearest: the window, or where it cannot
    decide for some output, the full range for all (module docstring)."""
    base = jnp.maximum(e_top, _I32(full[0] + 3 * _D - 1)) + _I32(1 - 3 * _D)  # >= full[0]
    window = round_limbs(
        accumulate(steps, to_pieces, base, _WINDOW_LIMBS, first),
        base,
        int(n_pieces).bit_length(),
        fmt,
        "nearest_even",
    )

    def full_range(_):
        base0 = jnp.full(e_top.shape, full[0], jnp.int32)
        n_limbs = -(-(full[1] - full[0]) // _D) + 1
        r = round_limbs(
            accumulate(steps, to_pieces, base0, n_limbs, first), base0, 0, fmt, "nearest_even"
        )
        return r.value, r.zero

    value, zero = jax.lax.cond(
        batch_all(window.safe), lambda _: (window.value, window.zero), full_range, None
    )
    return Rounded(value, zero, jnp.ones_like(zero))


def _split(p: Pieces) -> tuple[Pieces, int]:
    """Pieces (P, ...) as steps (q, c, ...) of at most PER_STEP pieces (zero padded)."""
    n = p.sig.shape[0]
    q = max(1, -(-n // PER_STEP))
    c = max(1, -(-n // q))
    pad = q * c - n

    def steps(x):
        x = pad_axis(x, 0, pad)
        return x.reshape(q, c, *x.shape[1:])

    return Pieces(*(steps(x) for x in p)), n


def rounded_pieces(p: Pieces, full: tuple[int, int], fmt: Format) -> Rounded:
    """The exact sum of pieces (P, ...) over the first axis, rounded to nearest."""
    steps, n = _split(p)
    return rounded_exact(steps, lambda s: Pieces(*s), top_exponent(p), n, full, fmt)


def finish(r: Rounded, zero_neg, special, fallback, fmt: Format) -> jax.Array:
    """``round_to`` of the rounded sum (an exact zero: -0 where ``zero_neg``, else
    +0), or of ``fallback`` where ``special``."""
    zero = ops32.float_of_bits(jnp.where(zero_neg, NEG_ZERO, _U32(0)))
    value = jnp.where(r.zero, zero, r.value)
    return round_to(jnp.where(special, fallback, value), fmt)
