"""The reductions of :mod:`fa_jax.ops` (``sum``, ``matmul``) on float32 carriers.

Same signatures, models and bits as ``ops.sum`` / ``ops.matmul`` on float64
carriers, with no 64-bit type in the program (see :mod:`fa_jax.carrier32.elementwise` for what
XLA's CPU backend does to float32 and why every test here is on bits).

Exact sums in integers.  Every term is cut into *pieces* ``±m 2**l``, ``m`` a
24-bit integer: a float32 value is one piece (its significand), an exact
product ``a·b`` two (the high and low 24 bits of the 48-bit product of the
significands, :func:`fa_jax.carrier32.elementwise.exact_product`).  A fixed-point accumulator with
base ``2**B`` holds ``Σ pieces`` in int32 *limbs* of ``D = 23`` bits (limb ``k``
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

The models (:mod:`fa_jax.accumulation`) are the float64 path's, step by step:
"exact" rounds the exact sum once; "sequential" is ``ops32.add`` (sums) or
``ops32.fma`` (matmul) in index order; "chunked(k)" rounds the exact sum of the
accumulator and the next chunk; "tensor_core" truncates every piece below its
block's quantum (masking bits: truncation of a term is truncation of its
pieces, which are disjoint bit ranges of one magnitude), sums them exactly in
limbs and rounds in the normalisation mode (Fasi et al. 2021); "tree" follows
``accumulation.tree_schedule``, each node the exact sum of its children rounded once.
Zeros and non-finite terms follow the float64 path: an exact zero is +0 but
where that path's float64 arithmetic keeps -0 (a sum of one term, ``add`` of
two -0, a one-term dot); a non-finite term gives IEEE arithmetic on the terms
with finite nonzero ones replaced by ±1 (which NaN survives a reduction of
several follows XLA's order), rounded as that path rounds it.  The float64
matmul's "exact" and "chunked" dots are float64 dots, rounded: they can differ
from the exactly rounded sum given here where that dot's error straddles a
rounding boundary.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax._fallback import batch_all
from fa_jax._fusion import materialised
from fa_jax.accumulation import EXACT, Accumulation, Tree, get_accumulation, tree_schedule
from fa_jax.carrier32 import elementwise as ops32
from fa_jax.carrier32 import native as native32
from fa_jax.carrier32 import slices as slices32
from fa_jax.carrier32.elementwise import (
    as_format,
    check_carriers,
    pad_axis,
    pow2_bits,
    scan_steps,
    shift_bits,
)
from fa_jax.formats import Format
from fa_jax.rounding import RoundingMode, round_to

__all__ = ["matmul", "sum"]

_U32 = np.uint32
_I32 = np.int32
_D = 23  # bits a limb
_MASK = _U32((1 << _D) - 1)
_PER_STEP = 255  # pieces added between carry propagations: 256 * 2**23 = 2**31
_WINDOW_LIMBS = 4  # 3 limbs of pieces (69 bits) and a limb of carries
_UNROLL = 8  # limb loops this long are unrolled (the windows); longer ones (full range) loop
_NO_EXPONENT = -(1 << 20)  # below every piece: the exponent of an output with no piece
_VALUES = (-172, 128)  # last bit of a float32's 24-bit significand, first power above
_PRODUCTS = (-344, 256)  # the same for exact products of two float32
_FLT_MAX = _U32(0x7F7FFFFF)
_NEG_ZERO = _U32(0x80000000)


class _Pieces(NamedTuple):
    """Terms as ``±sig 2**lsb`` pieces along the first axis."""

    neg: jax.Array  # bool
    lsb: jax.Array  # int32
    sig: jax.Array  # uint32 < 2**24; 0 for zeros (and non-finite terms)


def _cat(*ps: _Pieces) -> _Pieces:
    return _Pieces(*(jnp.concatenate(parts) for parts in zip(*ps)))


def _value_pieces(x) -> _Pieces:
    """A float32 array as one piece a value."""
    p = ops32.unpack(x)
    sig = jnp.where(p.zero | ~p.finite, _U32(0), p.sig)
    return _Pieces(p.sign != _U32(0), p.exp - _I32(23), sig)


class _Operand(NamedTuple):
    """An unpacked float32 matmul operand; ``sig`` 0 for zeros and non-finite."""

    sign: jax.Array
    exp: jax.Array
    sig: jax.Array


def _operand(x) -> _Operand:
    p = ops32.unpack(x)
    nonzero = ~p.zero & p.finite
    return _Operand(
        p.sign,
        jnp.where(nonzero, p.exp, _I32(_NO_EXPONENT // 4)),
        jnp.where(nonzero, p.sig, _U32(0)),
    )


def _product_pieces(a: _Operand, b: _Operand) -> _Pieces:
    """The exact products a·b (broadcast) as two pieces each: (high, low) 24 bits."""
    high, low = ops32.exact_product(a.sig, b.sig)
    neg = (a.sign ^ b.sign) != _U32(0)
    lsb = a.exp + b.exp - _I32(46)
    return _Pieces(
        jnp.concatenate([neg, neg]),
        jnp.concatenate([lsb + _I32(24), lsb]),
        jnp.concatenate([high, low]),
    )


def _top_exponent(p: _Pieces) -> jax.Array:
    """An upper bound on the exponent of the largest piece (over the last axis)."""
    return jnp.max(jnp.where(p.sig != _U32(0), p.lsb + _I32(23), _I32(_NO_EXPONENT)), axis=0)


def _zeros(shape) -> jax.Array:
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


def _limbs_of(p: _Pieces, base, n_limbs: int) -> list[jax.Array]:
    """Σ over the pieces of the bits of ``m 2**(lsb - base)`` in each of the lower
    ``n_limbs - 1`` limbs, signed (int32; at most _PER_STEP pieces)."""
    s0 = p.lsb - base[None]

    def limb(_, k_d):
        v = (shift_bits(p.sig, s0 - k_d) & _MASK).astype(jnp.int32)
        return None, jnp.sum(jnp.where(p.neg, -v, v), axis=0, dtype=jnp.int32)

    return _over_limbs(limb, None, [_I32(k * _D) for k in range(n_limbs - 1)])[1]


def _lost(p: _Pieces, base) -> tuple[jax.Array, jax.Array]:
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


class _Sum(NamedTuple):
    limbs: list[jax.Array]
    lost_pos: jax.Array
    lost_neg: jax.Array


def _accumulate(steps, to_pieces: Callable, base, n_limbs: int, first: _Pieces | None) -> _Sum:
    """The limbs of Σ pieces over ``steps`` (a pytree with a leading step axis, each
    step ``to_pieces(step)`` of at most _PER_STEP pieces), ``first`` added first."""
    zero = jnp.zeros(base.shape, jnp.int32)

    def add(state: _Sum, p: _Pieces) -> _Sum:
        parts = _limbs_of(p, base, n_limbs)
        limbs = _carry([a + b for a, b in zip(state.limbs, [*parts, zero])])
        pos, neg = _lost(p, base)
        return _Sum(limbs, state.lost_pos + pos, state.lost_neg + neg)

    state = _Sum([zero] * n_limbs, zero, zero)
    if first is not None:
        state = add(state, first)
    n = jax.tree_util.tree_leaves(steps)[0].shape[0]
    if n == 1:
        return add(state, to_pieces(jax.tree_util.tree_map(lambda s: s[0], steps)))
    state, _ = scan_steps(lambda st, s: (add(st, to_pieces(s)), None), state, steps)
    return state


def _top_bit(u) -> jax.Array:
    """floor(log2 u) of a uint32 (int32; -1 for 0)."""
    return _I32(31) - jax.lax.clz(u).astype(jnp.int32)


class _Rounded(NamedTuple):
    value: jax.Array  # float32 (before round_to's overflow and specials)
    zero: jax.Array  # the sum is exactly zero
    safe: jax.Array  # the window decided the rounding


def _round_limbs(s: _Sum, base, bits, fmt: Format, mode: str) -> _Rounded:
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
                jnp.where(u != _U32(0), _I32(k * _D) + _top_bit(u), _I32(-1))
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
    return _Rounded(value, zero & (lost == _I32(0)), safe)


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
    top = _top_bit(mag)
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


def _exact(
    steps,
    to_pieces: Callable,
    e_top,
    n_pieces: int,
    full: tuple[int, int],
    fmt: Format,
    first: _Pieces | None = None,
) -> _Rounded:
    """The exact sum of the pieces rounded to nearest: the window, or where it cannot
    decide for some output, the full range for all (module docstring)."""
    base = jnp.maximum(e_top, _I32(full[0] + 3 * _D - 1)) + _I32(1 - 3 * _D)  # >= full[0]
    window = _round_limbs(
        _accumulate(steps, to_pieces, base, _WINDOW_LIMBS, first),
        base,
        int(n_pieces).bit_length(),
        fmt,
        "nearest_even",
    )

    def full_range(_):
        base0 = jnp.full(e_top.shape, full[0], jnp.int32)
        n_limbs = -(-(full[1] - full[0]) // _D) + 1
        r = _round_limbs(
            _accumulate(steps, to_pieces, base0, n_limbs, first), base0, 0, fmt, "nearest_even"
        )
        return r.value, r.zero

    value, zero = jax.lax.cond(
        batch_all(window.safe), lambda _: (window.value, window.zero), full_range, None
    )
    return _Rounded(value, zero, jnp.ones_like(zero))


def _split(p: _Pieces) -> tuple[_Pieces, int]:
    """Pieces (P, ...) as steps (q, c, ...) of at most _PER_STEP pieces (zero padded)."""
    n = p.sig.shape[0]
    q = max(1, -(-n // _PER_STEP))
    c = max(1, -(-n // q))
    pad = q * c - n

    def steps(x):
        x = pad_axis(x, 0, pad)
        return x.reshape(q, c, *x.shape[1:])

    return _Pieces(*(steps(x) for x in p)), n


def _exact_pieces(p: _Pieces, full: tuple[int, int], fmt: Format) -> _Rounded:
    """The exact sum of pieces (P, ...) over the first axis, rounded to nearest."""
    steps, n = _split(p)
    return _exact(steps, lambda s: _Pieces(*s), _top_exponent(p), n, full, fmt)


def _finish(r: _Rounded, zero_neg, special, fallback, fmt: Format) -> jax.Array:
    """``round_to`` of the rounded sum (an exact zero: -0 where ``zero_neg``, else
    +0), or of ``fallback`` where ``special``."""
    zero = ops32.float_of_bits(jnp.where(zero_neg, _NEG_ZERO, _U32(0)))
    value = jnp.where(r.zero, zero, r.value)
    return round_to(jnp.where(special, fallback, value), fmt)


def _is_neg_zero(x) -> jax.Array:
    return ops32.bits_of(x) == _NEG_ZERO


def _finite(x) -> jax.Array:
    return (ops32.bits_of(x) & ops32.ABS_MASK) < ops32.INF_BITS


def _stand_in_sum(x, axis=0) -> jax.Array:
    """IEEE Σ of the stand-ins (finite nonzero terms as ±1): what decides a sum with a
    non-finite term."""
    return jnp.sum(ops32.stand_in(x), axis=axis)


# -- sum -------------------------------------------------------------------------------


def _exact_sum(terms, fmt: Format) -> jax.Array:
    """The exact sum of ``terms`` (..., n) rounded once; as a float64 reduction, +0
    for an exact zero unless the one term is -0."""
    n = terms.shape[0]
    if n == 0:
        return jnp.zeros(terms.shape[1:], jnp.float32)
    accumulated = lambda _: _exact_pieces(_value_pieces(terms), _VALUES, fmt)  # noqa: E731
    if slices32.supports_sum(n):
        sliced = _rounded_slices(slices32.sliced_sum(_operand(jnp.moveaxis(terms, 0, -1))), fmt)
        r = jax.lax.cond(batch_all(sliced.safe), lambda _: sliced, accumulated, None)
    else:
        r = accumulated(None)
    zero_neg = _is_neg_zero(terms[0]) if n == 1 else jnp.zeros(terms.shape[1:], bool)
    special = ~jnp.all(_finite(terms), axis=0)
    return _finish(r, zero_neg, special, _stand_in_sum(terms), fmt)


def _add_exact(acc, p: _Pieces, zero_neg, special, fallback, fmt: Format) -> jax.Array:
    """fl(acc + Σ pieces): the accumulator joins the pieces, one rounding."""
    pieces = _cat(_value_pieces(acc[None]), p)
    return _finish(_exact_pieces(pieces, _PRODUCTS, fmt), zero_neg, special, fallback, fmt)


def _chunked_sum(x, fmt: Format, k: int, start) -> jax.Array:
    n = x.shape[0]
    pad = -n % k
    x = pad_axis(x, 0, pad)
    chunks = x.reshape((n + pad) // k, k, *x.shape[1:])

    def step(acc, chunk):
        # A float64 chunk sum (a reduction) of one -0 term is -0, of more +0; then add.
        chunk_neg = _is_neg_zero(chunk[0]) if k == 1 else jnp.zeros(acc.shape, bool)
        si = _stand_in_sum(chunk)
        fallback = ops32.first_nan(ops32.stand_in(acc) + si, acc, si)
        special = ~(_finite(acc) & jnp.all(_finite(chunk), axis=0))
        zero_neg = _is_neg_zero(acc) & chunk_neg
        return _add_exact(acc, _value_pieces(chunk), zero_neg, special, fallback, fmt), None

    acc, _ = scan_steps(step, start, chunks)
    return acc


def _sequential_sum(x, fmt: Format, start) -> jax.Array:
    acc, _ = scan_steps(lambda acc, t: (ops32.add(acc, t, fmt), None), start, x)
    return acc


def sum(
    x,
    fmt,
    *,
    axis: int = -1,
    accumulation: Accumulation | str = EXACT,
    initial=None,
) -> jax.Array:
    """fl_fmt(Σ x along ``axis``) under an accumulation model, on float32 carriers:
    the bits of ``fa_jax.ops.sum`` on float64 (its docstring has the models)."""
    check_carriers(x)
    fmt, model = as_format(fmt), get_accumulation(accumulation)
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    if initial is not None:
        check_carriers(initial)
        initial = jnp.broadcast_to(jnp.asarray(initial), x.shape[1:])
    if model.kind == "tree":
        terms = x if initial is None else jnp.concatenate([initial[None], x])
        return _tree_sum(_value_leaves(terms), terms.shape[1:], fmt, typing.cast(Tree, model.tree))
    start = _zeros(x.shape[1:]) if initial is None else initial
    if model.kind == "tensor_core":
        blocks = _value_blocks(x, typing.cast(int, model.chunk))
        return _tensor_core_support(
            fmt, model, lambda: _tensor_core_scan(start, blocks, fmt, model)
        )
    if model.kind == "exact":
        terms = x if initial is None else jnp.concatenate([initial[None], x])
        return _exact_sum(terms, fmt)
    if model.kind == "chunked":
        return _chunked_sum(x, fmt, typing.cast(int, model.chunk), start)
    return _sequential_sum(x, fmt, start)


# -- matmul ----------------------------------------------------------------------------

_OUT_TERMS = 1 << 18  # products a scan step of "exact" materialises (times 2 pieces)


def _k_steps(a, b, c: int):
    """a (..., n, K), b (..., K, m) zero padded and cut along K into (q, ...) steps of c."""
    k = a.shape[-1]
    pad = -k % c
    a = pad_axis(a, -1, pad)
    b = pad_axis(b, -2, pad)
    q = (k + pad) // c
    a_steps = jnp.moveaxis(a, -1, 0).reshape(q, c, *a.shape[:-1])  # (q, c, ..., n)
    b_steps = jnp.moveaxis(b, -2, 0).reshape(q, c, *b.shape[:-2], b.shape[-1])  # (q, c, ..., m)
    return a_steps, b_steps


def _pairs(a_s, b_s):
    """(c, ..., n, 1) and (c, ..., 1, m): a step's operands lined up per output."""
    return a_s[..., :, None], b_s[..., None, :]


def _products_of(step) -> _Pieces:
    """A step's exact products as pieces (..., n, m, 2c): the high pieces, then the low."""
    a_s, b_s = step
    pa, pb = zip(*(_pairs(x, y) for x, y in zip(_operand(a_s), _operand(b_s))))
    return _product_pieces(_Operand(*pa), _Operand(*pb))


def _stand_in_dot(a, b) -> jax.Array:
    """IEEE a @ b of the stand-ins (finite nonzero as ±1; exact small integers)."""
    return jnp.matmul(ops32.stand_in(a), ops32.stand_in(b), precision=jax.lax.Precision.HIGHEST)


def _sliced_matmul(a, b, fmt: Format) -> _Rounded:
    """a @ b rounded to nearest from :func:`fa_jax.carrier32.slices.sliced_dot`'s pieces."""
    a, b = materialised(a), materialised(b)  # each read by every digit: computed once
    return _rounded_slices(slices32.sliced_dot(_operand(a), _operand(b)), fmt)


def _rounded_slices(s: slices32.Sliced, fmt: Format) -> _Rounded:
    """The pieces of :mod:`fa_jax.carrier32.slices` summed in limbs and rounded to nearest;
    ``safe`` where their loss bound decides the rounding."""
    n_limbs = -(-s.width // _D) + 1
    limbs = _limbs_of(_Pieces(s.neg, s.lsb, s.mag), s.base, n_limbs)
    lost = s.inexact.astype(jnp.int32)  # of either sign
    zero = jnp.zeros(s.base.shape, jnp.int32)
    return _round_limbs(_Sum([*limbs, zero], lost, lost), s.base, s.lost, fmt, "nearest_even")


def _accumulated_matmul(a, b, fmt: Format, initial) -> _Rounded:
    """a @ b (+ initial) rounded to nearest by the limb accumulator (window, then
    the full range where needed)."""
    k = a.shape[-1]
    out_shape = (*a.shape[:-1], b.shape[-1])
    c = max(1, min(k, _PER_STEP // 2, _OUT_TERMS // max(int(np.prod(out_shape)), 1)))
    steps = _k_steps(a, b, c)

    def top(e_top, step):
        a_s, b_s = step
        ea, eb = _pairs(_operand(a_s).exp, _operand(b_s).exp)
        return jnp.maximum(e_top, jnp.max(ea + eb + _I32(1), axis=0)), None

    e_top = jnp.full(out_shape, _NO_EXPONENT, jnp.int32)
    e_top, _ = scan_steps(top, e_top, steps)
    first = None
    if initial is not None:
        first = _value_pieces(initial[None])
        e_top = jnp.maximum(e_top, _top_exponent(first))
    return _exact(steps, _products_of, e_top, 2 * k + 1, _PRODUCTS, fmt, first)


_FALLBACK_OUTPUTS = 1 << 9  # outputs the fallback accumulates at once


def _in_row_blocks(f: Callable[..., _Rounded], a, b) -> _Rounded:
    """``f(a, b)`` computed over blocks of ``a``'s rows of about _FALLBACK_OUTPUTS
    outputs, one after another: a fallback inside a ``lax.cond`` whose temporaries
    are not allocated whole at every call (XLA's CPU runtime made an untaken
    fallback over all outputs cost more than the fast path it guards)."""
    *batch, n, k = a.shape
    m = b.shape[-1]
    r = max(1, min(n, _FALLBACK_OUTPUTS // max(int(np.prod(batch)) * m, 1)))
    q = -(-n // r)
    if q == 1:
        return f(a, b)
    a = pad_axis(a, -2, q * r - n)
    blocks = jnp.moveaxis(a.reshape(*batch, q, r, k), -3, 0)  # (q, ..., r, k)
    init = _Rounded(*(jnp.zeros((q, *batch, r, m), t) for t in (jnp.float32, bool, bool)))

    def body(i, out):
        got = f(jax.lax.dynamic_index_in_dim(blocks, i, keepdims=False), b)
        return jax.tree_util.tree_map(
            lambda o, g: jax.lax.dynamic_update_index_in_dim(o, g, i, 0), out, got
        )

    out = jax.lax.fori_loop(_I32(0), _I32(q), body, init)
    return jax.tree_util.tree_map(
        lambda x: jnp.moveaxis(x, 0, -3).reshape(*batch, q * r, m)[..., :n, :], out
    )


def _exact_matmul(a, b, fmt: Format, initial, out_shape) -> jax.Array:
    k = a.shape[-1]
    if initial is None and slices32.supports(k):
        sliced = _sliced_matmul(a, b, fmt)
        r = jax.lax.cond(
            batch_all(sliced.safe),
            lambda _: sliced,
            lambda _: _in_row_blocks(lambda x, y: _accumulated_matmul(x, y, fmt, None), a, b),
            None,
        )
    else:
        r = _accumulated_matmul(a, b, fmt, initial)
    si = _stand_in_dot(a, b)
    special = ~_finite(si)
    if initial is not None:
        special = special | ~_finite(initial)
        si = ops32.first_nan(si + ops32.stand_in(initial), si, initial)
    # A float64 dot of one product keeps its -0 (a multiply), of more is +0.
    zero_neg = jnp.zeros(out_shape, bool)
    if k == 1:
        zero_neg = _is_neg_zero(ops32.stand_in(a)[..., 0:1] * ops32.stand_in(b)[..., 0:1, :])
    if initial is not None:
        zero_neg = zero_neg & _is_neg_zero(initial)
    return _finish(r, zero_neg, special, si, fmt)


def _chunked_matmul(a, b, fmt: Format, c: int, start) -> jax.Array:
    steps = _k_steps(a, b, c)

    def step(acc, ab):
        a_s, b_s = ab
        sa, sb = _pairs(ops32.stand_in(a_s), ops32.stand_in(b_s))
        si = jnp.sum(sa * sb, axis=0)
        special = ~(_finite(acc) & _finite(si))
        fallback = ops32.first_nan(ops32.stand_in(acc) + si, acc, si)
        zero = jnp.zeros(acc.shape, bool)  # a float64 dot of c >= 2 products: +0
        return _add_exact(acc, _products_of(ab), zero, special, fallback, fmt), None

    acc, _ = scan_steps(step, start, steps)
    return acc


def _sequential_matmul(a, b, fmt: Format, start) -> jax.Array:
    a_steps, b_steps = _k_steps(a, b, 1)

    def step(acc, ab):
        a_t, b_t = _pairs(ab[0][0], ab[1][0])  # (..., n, 1), (..., 1, m)
        return ops32.fma(a_t, b_t, acc, fmt), None

    def emulated():
        return scan_steps(step, start, (a_steps, b_steps))[0]

    if native32.is_binary32(fmt):
        return native32.sequential_matmul(a, b, start, emulated)
    return emulated()


def matmul(a, b, fmt, *, accumulation: Accumulation | str = EXACT, initial=None) -> jax.Array:
    """fl_fmt(a @ b) for a (..., n, k) and b (..., k, m) under an accumulation model,
    on float32 carriers: the bits of ``fa_jax.ops.matmul`` on float64 (its
    docstring has the models; "exact" and "chunked" round the exact sums)."""
    check_carriers(a, b)
    fmt, model = as_format(fmt), get_accumulation(accumulation)
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: contraction sizes differ: a is {a.shape}, b is {b.shape}")
    out_shape = (*jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    batch = out_shape[:-2]
    a = jnp.broadcast_to(a, (*batch, *a.shape[-2:]))
    b = jnp.broadcast_to(b, (*batch, *b.shape[-2:]))
    if initial is not None:
        check_carriers(initial)
        initial = jnp.broadcast_to(jnp.asarray(initial), out_shape)
    if model.kind == "tree":
        pa = _Operand(*(jnp.moveaxis(x, -1, 0)[..., :, None, None] for x in _operand(a)))
        pb = _Operand(*(jnp.moveaxis(x, -2, 0)[..., None, :, None] for x in _operand(b)))
        p = _product_pieces(pa, pb)  # (2K, ..., n, m, 1): the high pieces, then the low
        k = a.shape[-1]
        pieces = _Pieces(*(jnp.concatenate([x[:k], x[k:]], axis=-1) for x in p))
        sa = jnp.moveaxis(ops32.stand_in(a), -1, 0)[..., :, None]
        sb = jnp.moveaxis(ops32.stand_in(b), -2, 0)[..., None, :]
        leaves = _Leaves(pieces, sa * sb)  # (K, ..., n, m, 2), (K, ..., n, m)
        if initial is not None:
            init = _value_leaves(initial[None])
            leaves = _Leaves(
                _Pieces(*(jnp.concatenate([x, y]) for x, y in zip(init.pieces, leaves.pieces))),
                jnp.concatenate([init.si, leaves.si]),
            )
        return _tree_sum(leaves, out_shape, fmt, typing.cast(Tree, model.tree))
    start = _zeros(out_shape) if initial is None else initial
    if model.kind == "tensor_core":
        blocks = _k_steps(a, b, typing.cast(int, model.chunk))
        return _tensor_core_support(
            fmt, model, lambda: _tensor_core_scan(start, blocks, fmt, model)
        )
    if model.kind == "exact":
        return _exact_matmul(a, b, fmt, initial, out_shape)
    if model.kind == "sequential" or model.chunk == 1:
        return _sequential_matmul(a, b, fmt, start)
    return _chunked_matmul(a, b, fmt, typing.cast(int, model.chunk), start)


# -- the tensor-core block FMA (fa_jax.accumulation, Fasi et al. 2021) -----------------


def _tensor_core_support(fmt: Format, model: Accumulation, tensor_core: Callable) -> jax.Array:
    """``tensor_core()`` where the aligned block sums fit 53 bits (the float64 path's
    limit, kept for the same semantics); a concrete format beyond raises, a traced
    one gives NaN."""
    if fmt.is_concrete:
        if model.sum_bits(fmt.man_bits) > 53:
            raise ValueError(
                f"accumulation {model}: the aligned block sums of a {fmt.name!r} accumulator "
                f"span man_bits + extra_bits + 1 + ceil(log2(terms)) = "
                f"{model.sum_bits(fmt.man_bits)} bits, expected <= 53 (exact in float64)"
            )
        return tensor_core()
    extra = typing.cast(int, model.extra_bits)
    fits = ops32.int32_of(fmt.man_bits) + _I32(
        extra + 1 + math.ceil(math.log2(model.block_terms))
    ) <= _I32(53)
    return jnp.where(fits, tensor_core(), jnp.float32(jnp.nan))


def _value_blocks(x, k: int) -> jax.Array:
    """x (n, ...) zero padded and cut into (q, k, ...) blocks."""
    n = x.shape[0]
    pad = -n % k
    x = pad_axis(x, 0, pad)
    return x.reshape((n + pad) // k, k, *x.shape[1:])


def _block_terms(block) -> tuple[_Pieces, _Pieces, jax.Array]:
    """A block's terms as (high pieces, low pieces, stand-ins), each (..., k)."""
    if isinstance(block, tuple):  # (a (..., n, k), b (..., k, m)): products
        p = _products_of(block)
        k = block[0].shape[0]
        hi = _Pieces(*(x[:k] for x in p))
        lo = _Pieces(*(x[k:] for x in p))
        sa, sb = _pairs(ops32.stand_in(block[0]), ops32.stand_in(block[1]))
        return hi, lo, sa * sb
    hi = _value_pieces(block)
    return hi, _Pieces(hi.neg, hi.lsb, jnp.zeros_like(hi.sig)), ops32.stand_in(block)


def _tensor_core_block(hi: _Pieces, lo: _Pieces, si, fmt: Format, model: Accumulation):
    """One block FMA on terms ``hi + lo`` (..., T): the largest exponent E = max(floor(
    log2 |x|), emin), every term truncated to a multiple of 2**(E - man_bits -
    extra_bits), the exact sum normalised in the model's mode; with a non-finite
    term, the IEEE sum of the terms (not rounded, as the float64 path)."""
    emin = _I32(1) - ops32.int32_of(fmt.bias)
    m = ops32.int32_of(fmt.man_bits)
    extra = typing.cast(int, model.extra_bits)
    nonzero = hi.sig != _U32(0)
    e = jnp.maximum(hi.lsb + _top_bit(hi.sig), emin)
    e_max = jnp.max(jnp.where(nonzero, e, _I32(_NO_EXPONENT)), axis=0)
    q = e_max - m - _I32(extra)

    def truncated(p: _Pieces) -> _Pieces:
        d = ops32.clamp_int(q[None] - p.lsb, 0, 31).astype(jnp.uint32)
        return _Pieces(p.neg, p.lsb, p.sig & ~((_U32(1) << d) - _U32(1)))

    pieces = _cat(truncated(hi), truncated(lo))
    man_max = fmt.man_bits if fmt.is_concrete else 23
    n_limbs = (int(man_max) + extra) // _D + 2
    total = _accumulate(
        _Pieces(*(x[None] for x in pieces)), lambda s: _Pieces(*s), q, n_limbs, None
    )
    mode = typing.cast(RoundingMode, model.normalization)
    r = _round_limbs(total, q, 0, fmt, mode)
    value = jnp.where(r.zero, jnp.float32(0.0), r.value)  # an exact zero sum is +0
    out = round_to(value, fmt, mode)
    finite = jnp.all(_finite(si), axis=0)
    return jnp.where(finite, out, jnp.sum(si, axis=0))


def _tensor_core_scan(c, blocks, fmt: Format, model: Accumulation) -> jax.Array:
    def step(c, block):
        hi, lo, si = _block_terms(block)
        if model.fused_accumulator:
            ch = _value_pieces(c[None])
            zero = _Pieces(ch.neg, ch.lsb, jnp.zeros_like(ch.sig))
            hi, lo = _cat(ch, hi), _cat(zero, lo)
            si = jnp.concatenate([ops32.stand_in(c)[None], si])
            return _tensor_core_block(hi, lo, si, fmt, model), None
        d = _tensor_core_block(hi, lo, si, fmt, model)
        return ops32.add(c, d, fmt), None

    c, _ = scan_steps(step, c, blocks)
    return c


# -- summation trees (fa_jax.accumulation, "Summation trees") --------------------------


class _Leaves(NamedTuple):
    """A tree's terms, one slot each on the leading axis: pieces (n, ..., 2) (high
    and low 24 bits; a value's low piece is zero) and stand-ins (n, ...)."""

    pieces: _Pieces
    si: jax.Array


def _value_leaves(x) -> _Leaves:
    """Values (n, ...) as leaves."""
    p = _value_pieces(x[..., None])
    pieces = _Pieces(
        jnp.concatenate([p.neg, p.neg], axis=-1),
        jnp.concatenate([p.lsb, p.lsb - _I32(24)], axis=-1),
        jnp.concatenate([p.sig, jnp.zeros_like(p.sig)], axis=-1),
    )
    return _Leaves(pieces, ops32.stand_in(x))


def _tree_sum(leaves: _Leaves, out_shape, fmt: Format, t: Tree) -> jax.Array:
    """Σ of the leaves as ``t`` gives (``ops._tree_sum``'s schedule): each node the
    exact sum of its children rounded once; where it is zero, a node of two
    children (or one and the -0 pad) is -0 if both are, as ``add``; a fused node
    of more is +0, as a float64 reduction."""
    n = leaves.si.shape[0]
    if n == 0:
        return jnp.zeros(out_shape, jnp.float32)
    if n == 1:  # round_to(x[0]): x[0] + -0
        return _node(_with_pad(leaves, 1, [[0, 1]]), fmt)[0]
    segments, size, root = tree_schedule(t, n)
    buf = (*_with_pad(leaves, size - n, None), jnp.zeros((size, *out_shape), jnp.float32))

    def level(buf, idx):
        children, outputs = idx
        pieces, si, values = buf
        c = (_Pieces(*(x[children] for x in pieces)), si[children])  # (width, arity, ...)
        value = _node(c, fmt)
        node = _value_leaves(value)
        pieces = _Pieces(*(x.at[outputs].set(y) for x, y in zip(pieces, node.pieces)))
        return (pieces, si.at[outputs].set(node.si), values.at[outputs].set(value)), None

    for children, outputs in segments:
        if children.shape[0] == 1:
            buf, _ = level(buf, (children[0], outputs[0]))
        else:
            buf, _ = scan_steps(level, buf, (jnp.asarray(children), jnp.asarray(outputs)))
    return buf[2][root]


def _with_pad(leaves: _Leaves, extra: int, children):
    """The leaves and ``extra`` more slots: zeros, and a -0 second to last (the
    schedule's pad); gathered by ``children`` when given."""
    p, si = leaves
    shape = si.shape[1:]
    signs = np.zeros((extra,) + (1,) * len(shape), np.float32)
    signs[max(extra - 2, 0)] = -0.0
    pad_si = jnp.broadcast_to(jnp.asarray(signs), (extra, *shape))
    pad = _value_leaves(pad_si)
    pieces = _Pieces(*(jnp.concatenate([x, y]) for x, y in zip(p, pad.pieces)))
    si = jnp.concatenate([si, pad_si])
    if children is None:
        return pieces, si
    idx = np.asarray(children, np.int32)
    return _Pieces(*(x[idx] for x in pieces)), si[idx]


def _node(c, fmt: Format) -> jax.Array:
    """The rounded sum of each node's children ``c`` = (pieces (w, arity, ..., 2),
    stand-ins (w, arity, ...))."""
    p, si = c
    arity = si.shape[1]

    def flat(x):  # (w, arity, ..., 2) -> (2 arity, w, ...)
        y = jnp.moveaxis(jnp.moveaxis(x, -1, 0), 2, 1)
        return y.reshape(2 * arity, *y.shape[2:])

    r = _exact_pieces(_Pieces(*(flat(x) for x in p)), _PRODUCTS, fmt)
    special = ~jnp.all(_finite(si), axis=1)
    if arity == 2:
        s0, s1 = si[:, 0], si[:, 1]
        fallback = ops32.first_nan(s0 + s1, s0, s1)
        zero_neg = _is_neg_zero(s0) & _is_neg_zero(s1)
    else:
        fallback = jnp.sum(si, axis=1)
        zero_neg = jnp.zeros(fallback.shape, bool)
    return _finish(r, zero_neg, special, fallback, fmt)
