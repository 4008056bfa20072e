"""An independent op-by-op simulation of emulated attention, forward and backward.

Used by tests/test_attention_sim.py to hold fa_jax.attention and fa_jax.backward
to the equations of their module docstrings, bit for bit, under policies whose
stages all have different formats (so rounding a value to the wrong stage shows).
It imports nothing from fa_jax's arithmetic (ops, rounding, softmax, attention,
backward): a policy is read through its stage fields, ``accumulation.kind`` and
``scale`` only, and every rounding is tests/oracle.py's exact ``round_exact``.

Every op forms its exact result as a ``Fraction`` and rounds it once to the
stage's format (round to nearest, ties to even):

* ``+ - * /``: the exact rational result;
* ``exp`` and the log-sum-exp ``m + log l``: 60-digit ``Decimal`` exp and ln
  (far closer than any format's midpoint spacing; exp of a nonzero value is
  never a midpoint);
* sums and dot products per the accumulation model, along the reduced axis in
  index order from 0: "exact" rounds the exact sum once; "sequential" rounds
  every partial sum ``acc_i = fl(acc_{i-1} + t_i)`` (a product ``t_i`` exact);
* ``max`` is exact; a maximum stored in ``stats`` is rounded to it.

The algorithms are those of Dao et al. 2022 (FlashAttention, Algorithm 1: fa1),
Dao 2023 (FlashAttention-2, Algorithms 1 and 2: fa2 and the backward) and the
one-pass "rowwise" variant, with the stages of fa_jax.policy, written out in
fa_jax/attention.py and fa_jax/backward.py.  Masked (query, key) pairs (causal:
key j > query i) have score ``-inf``, probability 0 and contribute exact zeros;
every query row keeps at least key 0 here (no length masks), so no row is fully
masked.  Arrays are float64 numpy arrays ``(..., rows, cols)`` holding values of
their formats exactly.

The features of fa_jax.heads, fa_jax.masking and fa_jax.score_mods ride along as
``mods`` (a :class:`Mods`): K and V with fewer heads, repeated after rounding and
their gradients summed over each group, fl_grads(Σ_g in d_acc); a bias rounded to
the ``bias`` stage and added to the scaled scores in it; a boolean mask and a
window (left, right), top-left aligned; flash visits only the key blocks left of
``N + right``; a softcap c tanh(S / c) of the scaled scores, before the bias.

Split-KV decoding (fa_jax/split_kv.py, FlashAttention-2's ``num_splits``):
``split_flash_forward`` runs the same block loop per split, split s over the key
blocks [s n_bps, min((s + 1) n_bps, n_b)) with n_bps = ceil(n_b / S), n_b the
key blocks of the whole key axis (a split past the visited blocks visits none),
and combines the splits' (L_s, Ō_s) in the ``combine`` stage: the log-sum-exp
rescale of FA2's combine kernel, with one fused multiply-add per split
``acc = fl(w_s Ō_s + acc)``.  Rows may keep no key of a split (L_s = -inf).
"""

from __future__ import annotations

import decimal
import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np
from oracle import round_exact

__all__ = [
    "Mods",
    "flash_backward",
    "flash_forward",
    "reference_backward",
    "reference_forward",
    "split_flash_forward",
]


class Mods(NamedTuple):
    """The features beyond causal: K/V groups G, a bias (..., N, M), a boolean
    mask (..., N, M) and a window (left, right), each optional."""

    groups: int = 1
    bias: np.ndarray | None = None
    mask: np.ndarray | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None


NO_MODS = Mods()


def _tanh(x: Fraction) -> Fraction:
    """tanh to 60 digits: (e^2x − 1) / (e^2x + 1)."""
    with decimal.localcontext() as ctx:
        ctx.prec = _DIGITS
        e = (2 * decimal.Decimal(float(x))).exp()
        return F((e - 1) / (e + 1))


def softcap(s, c: float, fmt):
    """(S', t): ĉ = fl(c), t = fl(tanh(fl(S / ĉ))), S' = fl(ĉ t), all in ``fmt``."""
    c_hat = fl(F(c), fmt)
    t = _map(lambda a: fl(_tanh(F(fl(a / F(c_hat), fmt))), fmt), s)
    return mul(c_hat, t, fmt), t


def softcap_factor(t, fmt):
    """fl(1 − fl(t²)) in ``fmt`` (d_stats)."""
    return sub(1.0, mul(t, t, fmt), fmt)


_DIGITS = 60
F = Fraction


# -- one rounding per op ---------------------------------------------------------------


def fl(x: Fraction, fmt) -> float:
    """The exact ``x`` rounded once to ``fmt`` (no overflow in these computations)."""
    out = round_exact(x, fmt)
    assert math.isfinite(out), f"overflow in the simulation: {float(x)} in {fmt.name}"
    return out


def _map(f, *arrays) -> np.ndarray:
    """``f`` of the Fractions of the broadcast elements, as a float64 array."""
    arrays = np.broadcast_arrays(*(np.asarray(a, np.float64) for a in arrays))
    out = np.empty(arrays[0].shape)
    for i in np.ndindex(out.shape):
        out[i] = f(*(F(float(a[i])) for a in arrays))
    return out


def cast(x, fmt):
    """fl(x); -inf (a mask) kept."""
    return _map(lambda a: fl(a, fmt), np.where(np.isneginf(x), 0.0, x)) + np.where(
        np.isneginf(x), -np.inf, 0.0
    )


def add(a, b, fmt):
    return _map(lambda x, y: fl(x + y, fmt), a, b)


def sub(a, b, fmt):
    return _map(lambda x, y: fl(x - y, fmt), a, b)


def mul(a, b, fmt):
    return _map(lambda x, y: fl(x * y, fmt), a, b)


def div(a, b, fmt):
    """fl(a / b), 0 where b = 0 (a fully masked row)."""
    return _map(lambda x, y: fl(x / y, fmt) if y else 0.0, a, b)


def fma(a, b, c, fmt):
    """fl(a b + c), one rounding."""
    return _map(lambda x, y, z: fl(x * y + z, fmt), a, b, c)


def _exp(x: Fraction) -> Fraction:
    with decimal.localcontext() as ctx:
        ctx.prec = _DIGITS
        return F(decimal.Decimal(float(x)).exp())


def shifted_exp(x, m, fmt):
    """fl(exp(fl(x - m))); 0 where x = -inf (masked), a shift of 0 where m = -inf."""
    x, m = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(m, np.float64))
    masked = np.isneginf(x)
    shift = np.where(np.isfinite(m), m, 0.0)
    e = _map(lambda a, b: fl(_exp(F(fl(a - b, fmt))), fmt), np.where(masked, 0.0, x), shift)
    return np.where(masked, 0.0, e)


def log_sum_exp(m, l, fmt):
    """fl(m + log l) with 60-digit ln; -inf where l = 0."""

    def one(mi: Fraction, li: Fraction) -> float:
        with decimal.localcontext() as ctx:
            ctx.prec = _DIGITS
            return fl(mi + F(decimal.Decimal(float(li)).ln()), fmt)

    live = l > 0
    out = _map(one, np.where(live, m, 0.0), np.where(live, l, 1.0))
    return np.where(live, out, -np.inf)


def _total(terms, fmt, kind: str) -> float:
    """Σ terms (Fractions) per the accumulation model."""
    if kind == "exact":
        return fl(sum(terms, F(0)), fmt)
    assert kind == "sequential", f"accumulation: expected exact or sequential, got {kind}"
    acc = F(0)
    for t in terms:
        acc = F(fl(acc + t, fmt))
    return float(acc)


def row_sum(x, fmt, kind: str):
    """Σ along the last axis."""
    x = np.asarray(x, np.float64)
    out = np.empty(x.shape[:-1])
    for i in np.ndindex(out.shape):
        out[i] = _total([F(float(t)) for t in x[i]], fmt, kind)
    return out


def matmul(a, b, fmt, kind: str):
    """a (..., n, k) @ b (..., k, m), each dot Σ_t a_t b_t with exact products."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out = np.empty((*a.shape[:-1], b.shape[-1]))
    for i in np.ndindex(out.shape):
        lead, r, c = i[:-2], i[-2], i[-1]
        terms = [
            F(float(x)) * F(float(y)) for x, y in zip(a[(*lead, r)], b[(*lead, slice(None), c)])
        ]
        out[i] = _total(terms, fmt, kind)
    return out


def _t(x):
    return np.swapaxes(x, -1, -2)


# -- forward ---------------------------------------------------------------------------


def prepare(q, k, v, policy, scale=None, groups: int = 1):
    """(Q, K, V, scale) as the passes use them: rounded to ``inputs`` (K and V
    repeated ``groups`` times along the heads axis), the scale (1/sqrt(d) in
    float64 by default) rounded to the stage it multiplies, and Q pre-scaled,
    fl_inputs(Q · scale), for scale="q"."""
    q, k, v = (cast(t, policy.inputs) for t in (q, k, v))
    if groups > 1:
        k, v = (np.repeat(t, groups, axis=-3) for t in (k, v))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    stage = policy.inputs if policy.scale == "q" else policy.scores
    scale = fl(F(float(scale)), stage)
    if policy.scale == "q":
        q = mul(q, scale, policy.inputs)
    return q, k, v, scale


def _cols(x, col0: int, width: int, fill):
    """Columns col0 .. col0 + width of x (..., N, M), ``fill`` past M."""
    x = np.asarray(x)
    part = x[..., col0 : col0 + width]
    pad = width - part.shape[-1]
    return np.concatenate([part, np.full((*x.shape[:-1], pad), fill, x.dtype)], axis=-1)


def scores(
    q,
    k,
    scale,
    policy,
    causal: bool,
    col0: int = 0,
    m_real: int | None = None,
    mods=NO_MODS,
    grad: bool = False,
):
    """S = fl_scores(fl_qk_acc(Q Kᵀ) · scale) (fl_scores(Q' Kᵀ) for scale="q") of Q
    against the keys ``k`` from column ``col0``, plus fl_bias(S + B̂) with a bias;
    -inf where masked (causal, window, mask, or a padding column at or past
    ``m_real``); softcapped first.  With ``grad``, (S, the softcap's factor or None)."""
    s = matmul(q, _t(k), policy.qk_acc, policy.accumulation.kind)
    s = mul(s, scale, policy.scores) if policy.scale == "scores" else cast(s, policy.scores)
    t = None
    if mods.softcap is not None:
        s, t = softcap(s, mods.softcap, policy.scores)
    width = k.shape[-2]
    if mods.bias is not None:
        b = cast(
            _cols(
                np.broadcast_to(mods.bias, (*s.shape[:-1], mods.bias.shape[-1])), col0, width, 0.0
            ),
            policy.bias,
        )
        s = add(s, b, policy.bias)
    i = np.arange(q.shape[-2])[:, None]
    j = col0 + np.arange(width)[None, :]
    keep = np.ones(s.shape[-2:], bool) if not causal else j <= i
    if mods.window is not None:
        left, right = mods.window
        if left >= 0:
            keep = keep & (j >= i - left)
        if right >= 0:
            keep = keep & (j <= i + right)
    if m_real is not None:
        keep = keep & (j < m_real)
    if mods.mask is not None:
        keep = keep & _cols(
            np.broadcast_to(mods.mask, (*s.shape[:-1], mods.mask.shape[-1])), col0, width, False
        )
    s = np.where(keep, s, -np.inf)
    if not grad:
        return s
    return s, None if t is None else softcap_factor(t, policy.d_stats)


def reference_forward(q, k, v, policy, causal: bool, scale=None, mods=NO_MODS):
    """(O, L, P, (Q, K, V, scale)) of materialised attention:
    S; m = fl_stats(max S); e = fl_exp(exp(fl_exp(S - m))); l = Σ_stats e;
    P = fl_p(e / l); O = fl_out(fl_pv_acc(P V)); L = fl_stats(m + log l)."""
    q, k, v, scale = prepare(q, k, v, policy, scale, mods.groups)
    s, d_cap = scores(q, k, scale, policy, causal, mods=mods, grad=True)
    m = cast(s.max(axis=-1), policy.stats)
    e = shifted_exp(s, m[..., None], policy.exp)
    l = row_sum(e, policy.stats, policy.accumulation.kind)
    p = div(e, l[..., None], policy.p)
    o = cast(matmul(p, v, policy.pv_acc, policy.accumulation.kind), policy.out)
    return o, log_sum_exp(m, l, policy.stats), p, (q, k, v, scale, d_cap)


def _key_blocks(k, v, bc: int):
    """K and V zero-padded to a multiple of Bc, as a list of (K_j, V_j, col0)."""
    mk = k.shape[-2]
    n_blocks = -(-mk // bc)
    pad = [(0, 0)] * (k.ndim - 2) + [(0, n_blocks * bc - mk), (0, 0)]
    k, v = np.pad(k, pad), np.pad(v, pad)
    return [
        (k[..., j * bc : (j + 1) * bc, :], v[..., j * bc : (j + 1) * bc, :], j * bc)
        for j in range(n_blocks)
    ]


def _online(m, l, s, policy):
    """FA2's statistics update: (m_new, l_new, P̃, α)."""
    kind = policy.accumulation.kind
    m_new = cast(np.maximum(m, s.max(axis=-1)), policy.stats)
    alpha = shifted_exp(m, m_new, policy.exp)
    e = shifted_exp(s, m_new[..., None], policy.exp)
    l_new = add(mul(l, alpha, policy.stats), row_sum(e, policy.stats, kind), policy.stats)
    return m_new, l_new, e, alpha


def _step(variant: str, m, l, o, s, v_j, policy):
    """One key block of the flash loop of ``variant``: the new (m, l, o)."""
    kind = policy.accumulation.kind
    if variant == "fa2":
        m, l, e, alpha = _online(m, l, s, policy)
        pv = matmul(cast(e, policy.p), v_j, policy.pv_acc, kind)
        o = add(mul(o, alpha[..., None], policy.o_acc), pv, policy.o_acc)
    elif variant == "fa1":
        m_blk = cast(s.max(axis=-1), policy.stats)
        e = shifted_exp(s, m_blk[..., None], policy.exp)
        l_blk = row_sum(e, policy.stats, kind)
        m_new = cast(np.maximum(m, m_blk), policy.stats)
        alpha = shifted_exp(m, m_new, policy.exp)
        beta = shifted_exp(m_blk, m_new, policy.exp)
        l_alpha = mul(l, alpha, policy.stats)
        l = add(l_alpha, mul(beta, l_blk, policy.stats), policy.stats)
        pv = matmul(cast(e, policy.p), v_j, policy.pv_acc, kind)
        num = add(
            mul(l_alpha[..., None], o, policy.o_acc),
            mul(beta[..., None], pv, policy.o_acc),
            policy.o_acc,
        )
        m, o = m_new, div(num, l[..., None], policy.o_acc)
    else:
        assert variant == "rowwise", f"variant: expected fa1, fa2 or rowwise, got {variant}"
        l_old = l
        m, l, e, alpha = _online(m, l, s, policy)
        ratio = div(mul(l_old, alpha, policy.stats), l, policy.o_acc)
        pv = matmul(div(e, l[..., None], policy.p), v_j, policy.pv_acc, kind)
        o = add(mul(ratio[..., None], o, policy.o_acc), pv, policy.o_acc)
    return m, l, o


def flash_forward(q, k, v, policy, bc: int, variant: str, causal: bool, mods=NO_MODS):
    """(O, L, (Q, K, V, scale)) of tiled attention over key blocks of ``bc``
    columns in order (fa_jax/attention.py's equations for ``variant``); keys
    right of every row's window are not visited."""
    q, k, v, scale = prepare(q, k, v, policy, groups=mods.groups)
    prepared = (q, k, v, scale)
    if mods.window is not None and mods.window[1] >= 0:
        hi = min(k.shape[-2], q.shape[-2] + mods.window[1])
        k, v = k[..., :hi, :], v[..., :hi, :]
    lead, n, mk, dv = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    m, l, o = np.full((*lead, n), -np.inf), np.zeros((*lead, n)), np.zeros((*lead, n, dv))
    for k_j, v_j, col0 in _key_blocks(k, v, bc):
        s = scores(q, k_j, scale, policy, causal, col0, mk, mods)
        m, l, o = _step(variant, m, l, o, s, v_j, policy)
    out = div(o, l[..., None], policy.out) if variant == "fa2" else cast(o, policy.out)
    return out, log_sum_exp(m, l, policy.stats), prepared


def split_flash_forward(
    q, k, v, policy, bc: int, variant: str, causal: bool, num_splits: int, mods=NO_MODS
):
    """(O, L, (Q, K, V, scale)) of split-KV flash attention (module docstring):
    per split the block loop of ``variant`` from m = -inf, l = 0, o = 0, then
    L_s = fl_combine(m_s + ln l_s), Ō_s = fl_o_acc(o_s / l_s) (fa2; under
    ``normalise="reciprocal"`` fl_o_acc(o_s · fl_stats(1 / l_s)); fa1 and rowwise
    keep o_s normalised), and the combine, every value in ``combine``::

        L_max = max_s L_s (0 if all -inf);  t_s = fl(exp(fl(L_s − L_max)));
        Σ = Σ_s t_s;  L = fl(fl(ln Σ) + L_max);  w_s = fl(exp(fl(L_s − L)));
        acc = fl(w_s Ō_s + acc) in split order;  O = fl_out(acc)."""
    fmt, kind = policy.combine, policy.accumulation.kind
    q, k, v, scale = prepare(q, k, v, policy, groups=mods.groups)
    prepared = (q, k, v, scale)
    n_blocks = -(-k.shape[-2] // bc)
    per_split = -(-n_blocks // num_splits)
    if mods.window is not None and mods.window[1] >= 0:
        hi = min(k.shape[-2], q.shape[-2] + mods.window[1])
        k, v = k[..., :hi, :], v[..., :hi, :]
    lead, n, mk, dv = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    blocks = _key_blocks(k, v, bc)
    lse_s, o_s = [], []
    for first in range(0, per_split * num_splits, per_split):
        m, l, o = np.full((*lead, n), -np.inf), np.zeros((*lead, n)), np.zeros((*lead, n, dv))
        for k_j, v_j, col0 in blocks[first : first + per_split]:
            s = scores(q, k_j, scale, policy, causal, col0, mk, mods)
            m, l, o = _step(variant, m, l, o, s, v_j, policy)
        lse_s.append(log_sum_exp(m, l, fmt))
        if variant != "fa2":
            o_s.append(o)
        elif policy.normalise == "reciprocal":
            o_s.append(mul(o, div(np.ones(l.shape), l, policy.stats)[..., None], policy.o_acc))
        else:
            o_s.append(div(o, l[..., None], policy.o_acc))
    lse_max = np.max(lse_s, axis=0)
    lse_max = np.where(lse_max == -np.inf, 0.0, lse_max)
    t = np.stack([shifted_exp(x, lse_max, fmt) for x in lse_s], axis=-1)
    total = row_sum(t, fmt, kind)
    live = total > 0
    log_total = log_sum_exp(np.zeros(total.shape), np.where(live, total, 1.0), fmt)
    lse = np.where(live, add(log_total, lse_max, fmt), -np.inf)
    acc = np.zeros(o_s[0].shape)
    for x, o in zip(lse_s, o_s):
        acc = fma(shifted_exp(x, lse, fmt)[..., None], o, acc, fmt)
    return cast(acc, policy.out), lse, prepared


# -- backward --------------------------------------------------------------------------


def _row_dot(a, b, policy):
    """fl_d_stats(Σ_c fl_d_stats(a ∘ b)) along the last axis."""
    return row_sum(mul(a, b, policy.d_stats), policy.d_stats, policy.accumulation.kind)


def _softmax_grad(p, d_p, d_row, policy, d_cap=None):
    """dS = fl_d_s(fl_d_stats(P ∘ fl_d_stats(dP − D))), times a softcap's factor in
    d_stats before the rounding to d_s."""
    ds = mul(p, sub(d_p, d_row[..., None], policy.d_stats), policy.d_stats)
    if d_cap is not None:
        ds = mul(ds, d_cap, policy.d_stats)
    return cast(ds, policy.d_s)


def _d_k(acc, scale, policy):
    """dK = fl_grads(fl_d_acc(acc · scale)), or fl_grads(acc) for scale="q"."""
    if policy.scale == "scores":
        return cast(mul(acc, scale, policy.d_acc), policy.grads)
    return cast(acc, policy.grads)


def sum_groups(d, groups: int, policy):
    """dK or dV (..., H, M, c) summed over each group of ``groups`` heads, in head
    order, in d_acc (accumulation model), then rounded to grads."""
    if groups == 1:
        return d
    lead, h = d.shape[:-3], d.shape[-3]
    grouped = np.moveaxis(d.reshape(*lead, h // groups, groups, *d.shape[-2:]), -3, -1)
    return cast(row_sum(grouped, policy.d_acc, policy.accumulation.kind), policy.grads)


def reference_backward(prepared, p, d_o, d_lse, policy, groups: int = 1):
    """(dQ, dK, dV) of materialised attention from the stored P (fa_jax/backward.py)."""
    q, k, v, scale, d_cap = prepared
    kind = policy.accumulation.kind
    d_o = cast(d_o, policy.d_out)
    d_v = cast(matmul(_t(p), d_o, policy.d_acc, kind), policy.grads)
    d_p = cast(matmul(d_o, _t(v), policy.d_acc, kind), policy.d_p)
    d_row = sub(_row_dot(p, d_p, policy), d_lse, policy.d_stats)
    d_s = _softmax_grad(p, d_p, d_row, policy, d_cap)
    d_q = cast(mul(matmul(d_s, k, policy.d_acc, kind), scale, policy.d_acc), policy.grads)
    d_k = _d_k(matmul(_t(d_s), q, policy.d_acc, kind), scale, policy)
    return d_q, sum_groups(d_k, groups, policy), sum_groups(d_v, groups, policy)


def flash_backward(prepared, o, lse, d_o, d_lse, policy, bc: int, causal: bool, mods=NO_MODS):
    """(dQ, dK, dV) of FlashAttention-2's backward (Dao 2023, Algorithm 2) over key
    blocks of ``bc`` columns, P recomputed from the log-sum-exp L."""
    q, k, v, scale = prepared
    kind = policy.accumulation.kind
    mk = k.shape[-2]
    d_o = cast(d_o, policy.d_out)
    d_row = sub(_row_dot(d_o, o, policy), d_lse, policy.d_stats)
    d_q = np.zeros(q.shape)
    d_ks, d_vs = [], []
    for k_j, v_j, col0 in _key_blocks(k, v, bc):
        s_j, d_cap = scores(q, k_j, scale, policy, causal, col0, mk, mods, grad=True)
        p_j = shifted_exp(s_j, lse[..., None], policy.exp)
        d_vs.append(cast(matmul(_t(cast(p_j, policy.p)), d_o, policy.d_acc, kind), policy.grads))
        d_p_j = cast(matmul(d_o, _t(v_j), policy.d_acc, kind), policy.d_p)
        d_s_j = _softmax_grad(p_j, d_p_j, d_row, policy, d_cap)
        d_q = add(d_q, matmul(d_s_j, k_j, policy.d_acc, kind), policy.d_acc)
        d_ks.append(_d_k(matmul(_t(d_s_j), q, policy.d_acc, kind), scale, policy))
    d_q = cast(mul(d_q, scale, policy.d_acc), policy.grads)
    d_k = np.concatenate(d_ks, axis=-2)[..., :mk, :]
    d_v = np.concatenate(d_vs, axis=-2)[..., :mk, :]
    return d_q, sum_groups(d_k, mods.groups, policy), sum_groups(d_v, mods.groups, policy)
