"""The reductions of :mod:`fa_jax.ops` (``sum``, ``matmul``) on float32 carriers.

Same signatures, models and bits as ``ops.sum`` / ``ops.matmul`` on float64
carriers, with no 64-bit type in the program (see :mod:`fa_jax.carrier32.elementwise` for what
XLA's CPU backend does to float32 and why every test here is on bits).

The exact sums are :mod:`fa_jax.carrier32.limbs`'s (pieces summed in int32
limbs, a window then the full range, rounded from the top 25 bits).

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
from fa_jax.accumulation import EXACT, Accumulation, get_accumulation
from fa_jax.accumulation_trees import Tree, tree_schedule
from fa_jax.carrier32 import elementwise as ops32
from fa_jax.carrier32 import native as native32
from fa_jax.carrier32 import slices as slices32
from fa_jax.carrier32.elementwise import (
    as_format,
    check_carriers,
    pad_axis,
    scan_steps,
)
from fa_jax.carrier32.limbs import (
    LIMB_BITS,
    NEG_ZERO,
    NO_EXPONENT,
    PER_STEP,
    PRODUCTS,
    VALUES,
    LimbSum,
    Operand,
    Pieces,
    Rounded,
    accumulate,
    cat,
    finish,
    limbs_of,
    operand,
    product_pieces,
    round_limbs,
    rounded_exact,
    rounded_pieces,
    top_bit,
    top_exponent,
    value_pieces,
    zeros,
)
from fa_jax.formats import Format
from fa_jax.rounding import RoundingMode, round_to

__all__ = ["matmul", "sum"]

_U32 = np.uint32
_I32 = np.int32


def _is_neg_zero(x) -> jax.Array:
    return ops32.bits_of(x) == NEG_ZERO


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
    accumulated = lambda _: rounded_pieces(value_pieces(terms), VALUES, fmt)  # noqa: E731
    if slices32.supports_sum(n):
        sliced = _rounded_slices(slices32.sliced_sum(operand(jnp.moveaxis(terms, 0, -1))), fmt)
        r = jax.lax.cond(batch_all(sliced.safe), lambda _: sliced, accumulated, None)
    else:
        r = accumulated(None)
    zero_neg = _is_neg_zero(terms[0]) if n == 1 else jnp.zeros(terms.shape[1:], bool)
    special = ~jnp.all(_finite(terms), axis=0)
    return finish(r, zero_neg, special, _stand_in_sum(terms), fmt)


def _add_exact(acc, p: Pieces, zero_neg, special, fallback, fmt: Format) -> jax.Array:
    """fl(acc + Σ pieces): the accumulator joins the pieces, one rounding."""
    pieces = cat(value_pieces(acc[None]), p)
    return finish(rounded_pieces(pieces, PRODUCTS, fmt), zero_neg, special, fallback, fmt)


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
        return _add_exact(acc, value_pieces(chunk), zero_neg, special, fallback, fmt), None

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
    start = zeros(x.shape[1:]) if initial is None else initial
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


def _products_of(step) -> Pieces:
    """A step's exact products as pieces (..., n, m, 2c): the high pieces, then the low."""
    a_s, b_s = step
    pa, pb = zip(*(_pairs(x, y) for x, y in zip(operand(a_s), operand(b_s))))
    return product_pieces(Operand(*pa), Operand(*pb))


def _stand_in_dot(a, b) -> jax.Array:
    """IEEE a @ b of the stand-ins (finite nonzero as ±1; exact small integers)."""
    return jnp.matmul(ops32.stand_in(a), ops32.stand_in(b), precision=jax.lax.Precision.HIGHEST)


def _sliced_matmul(a, b, fmt: Format) -> Rounded:
    """a @ b rounded to nearest from :func:`fa_jax.carrier32.slices.sliced_dot`'s pieces."""
    a, b = materialised(a), materialised(b)  # each read by every digit: computed once
    return _rounded_slices(slices32.sliced_dot(operand(a), operand(b)), fmt)


def _rounded_slices(s: slices32.Sliced, fmt: Format) -> Rounded:
    """The pieces of :mod:`fa_jax.carrier32.slices` summed in limbs and rounded to nearest;
    ``safe`` where their loss bound decides the rounding."""
    n_limbs = -(-s.width // LIMB_BITS) + 1
    limbs = limbs_of(Pieces(s.neg, s.lsb, s.mag), s.base, n_limbs)
    lost = s.inexact.astype(jnp.int32)  # of either sign
    zero = jnp.zeros(s.base.shape, jnp.int32)
    return round_limbs(LimbSum([*limbs, zero], lost, lost), s.base, s.lost, fmt, "nearest_even")


def _accumulated_matmul(a, b, fmt: Format, initial) -> Rounded:
    """a @ b (+ initial) rounded to nearest by the limb accumulator (window, then
    the full range where needed)."""
    k = a.shape[-1]
    out_shape = (*a.shape[:-1], b.shape[-1])
    c = max(1, min(k, PER_STEP // 2, _OUT_TERMS // max(int(np.prod(out_shape)), 1)))
    steps = _k_steps(a, b, c)

    def top(e_top, step):
        a_s, b_s = step
        ea, eb = _pairs(operand(a_s).exp, operand(b_s).exp)
        return jnp.maximum(e_top, jnp.max(ea + eb + _I32(1), axis=0)), None

    e_top = jnp.full(out_shape, NO_EXPONENT, jnp.int32)
    e_top, _ = scan_steps(top, e_top, steps)
    first = None
    if initial is not None:
        first = value_pieces(initial[None])
        e_top = jnp.maximum(e_top, top_exponent(first))
    return rounded_exact(steps, _products_of, e_top, 2 * k + 1, PRODUCTS, fmt, first)


_FALLBACK_OUTPUTS = 1 << 9  # outputs the fallback accumulates at once


def _in_row_blocks(f: Callable[..., Rounded], a, b) -> Rounded:
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
    init = Rounded(*(jnp.zeros((q, *batch, r, m), t) for t in (jnp.float32, bool, bool)))

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
    return finish(r, zero_neg, special, si, fmt)


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
        pa = Operand(*(jnp.moveaxis(x, -1, 0)[..., :, None, None] for x in operand(a)))
        pb = Operand(*(jnp.moveaxis(x, -2, 0)[..., None, :, None] for x in operand(b)))
        p = product_pieces(pa, pb)  # (2K, ..., n, m, 1): the high pieces, then the low
        k = a.shape[-1]
        pieces = Pieces(*(jnp.concatenate([x[:k], x[k:]], axis=-1) for x in p))
        sa = jnp.moveaxis(ops32.stand_in(a), -1, 0)[..., :, None]
        sb = jnp.moveaxis(ops32.stand_in(b), -2, 0)[..., None, :]
        leaves = _Leaves(pieces, sa * sb)  # (K, ..., n, m, 2), (K, ..., n, m)
        if initial is not None:
            init = _value_leaves(initial[None])
            leaves = _Leaves(
                Pieces(*(jnp.concatenate([x, y]) for x, y in zip(init.pieces, leaves.pieces))),
                jnp.concatenate([init.si, leaves.si]),
            )
        return _tree_sum(leaves, out_shape, fmt, typing.cast(Tree, model.tree))
    start = zeros(out_shape) if initial is None else initial
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


def _block_terms(block) -> tuple[Pieces, Pieces, jax.Array]:
    """A block's terms as (high pieces, low pieces, stand-ins), each (..., k)."""
    if isinstance(block, tuple):  # (a (..., n, k), b (..., k, m)): products
        p = _products_of(block)
        k = block[0].shape[0]
        hi = Pieces(*(x[:k] for x in p))
        lo = Pieces(*(x[k:] for x in p))
        sa, sb = _pairs(ops32.stand_in(block[0]), ops32.stand_in(block[1]))
        return hi, lo, sa * sb
    hi = value_pieces(block)
    return hi, Pieces(hi.neg, hi.lsb, jnp.zeros_like(hi.sig)), ops32.stand_in(block)


def _tensor_core_block(hi: Pieces, lo: Pieces, si, fmt: Format, model: Accumulation):
    """One block FMA on terms ``hi + lo`` (..., T): the largest exponent E = max(floor(
    log2 |x|), emin), every term truncated to a multiple of 2**(E - man_bits -
    extra_bits), the exact sum normalised in the model's mode; with a non-finite
    term, the IEEE sum of the terms (not rounded, as the float64 path)."""
    emin = _I32(1) - ops32.int32_of(fmt.bias)
    m = ops32.int32_of(fmt.man_bits)
    extra = typing.cast(int, model.extra_bits)
    nonzero = hi.sig != _U32(0)
    e = jnp.maximum(hi.lsb + top_bit(hi.sig), emin)
    e_max = jnp.max(jnp.where(nonzero, e, _I32(NO_EXPONENT)), axis=0)
    q = e_max - m - _I32(extra)

    def truncated(p: Pieces) -> Pieces:
        d = ops32.clamp_int(q[None] - p.lsb, 0, 31).astype(jnp.uint32)
        return Pieces(p.neg, p.lsb, p.sig & ~((_U32(1) << d) - _U32(1)))

    pieces = cat(truncated(hi), truncated(lo))
    man_max = fmt.man_bits if fmt.is_concrete else 23
    n_limbs = (int(man_max) + extra) // LIMB_BITS + 2
    total = accumulate(Pieces(*(x[None] for x in pieces)), lambda s: Pieces(*s), q, n_limbs, None)
    mode = typing.cast(RoundingMode, model.normalization)
    r = round_limbs(total, q, 0, fmt, mode)
    value = jnp.where(r.zero, jnp.float32(0.0), r.value)  # an exact zero sum is +0
    out = round_to(value, fmt, mode)
    finite = jnp.all(_finite(si), axis=0)
    return jnp.where(finite, out, jnp.sum(si, axis=0))


def _tensor_core_scan(c, blocks, fmt: Format, model: Accumulation) -> jax.Array:
    def step(c, block):
        hi, lo, si = _block_terms(block)
        if model.fused_accumulator:
            ch = value_pieces(c[None])
            zero = Pieces(ch.neg, ch.lsb, jnp.zeros_like(ch.sig))
            hi, lo = cat(ch, hi), cat(zero, lo)
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

    pieces: Pieces
    si: jax.Array


def _value_leaves(x) -> _Leaves:
    """Values (n, ...) as leaves."""
    p = value_pieces(x[..., None])
    pieces = Pieces(
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
        c = (Pieces(*(x[children] for x in pieces)), si[children])  # (width, arity, ...)
        value = _node(c, fmt)
        node = _value_leaves(value)
        pieces = Pieces(*(x.at[outputs].set(y) for x, y in zip(pieces, node.pieces)))
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
    pieces = Pieces(*(jnp.concatenate([x, y]) for x, y in zip(p, pad.pieces)))
    si = jnp.concatenate([si, pad_si])
    if children is None:
        return pieces, si
    idx = np.asarray(children, np.int32)
    return Pieces(*(x[idx] for x in pieces)), si[idx]


def _node(c, fmt: Format) -> jax.Array:
    """The rounded sum of each node's children ``c`` = (pieces (w, arity, ..., 2),
    stand-ins (w, arity, ...))."""
    p, si = c
    arity = si.shape[1]

    def flat(x):  # (w, arity, ..., 2) -> (2 arity, w, ...)
        y = jnp.moveaxis(jnp.moveaxis(x, -1, 0), 2, 1)
        return y.reshape(2 * arity, *y.shape[2:])

    r = rounded_pieces(Pieces(*(flat(x) for x in p)), PRODUCTS, fmt)
    special = ~jnp.all(_finite(si), axis=1)
    if arity == 2:
        s0, s1 = si[:, 0], si[:, 1]
        fallback = ops32.first_nan(s0 + s1, s0, s1)
        zero_neg = _is_neg_zero(s0) & _is_neg_zero(s1)
    else:
        fallback = jnp.sum(si, axis=1)
        zero_neg = jnp.zeros(fallback.shape, bool)
    return finish(r, zero_neg, special, fallback, fmt)
