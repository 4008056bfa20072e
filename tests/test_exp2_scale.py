"""Policy.scale "exp2" through reference attention and every flash variant (fa1,
fa2, rowwise), against an op-by-op simulation with exact rationals, bit for bit.

Under "exp2" (fa_jax/softmax.py's module docstring; the FlashAttention-2/3 CUDA
kernels' ``scale_apply_exp2``) S is unscaled and c = fl_exp(scale · log2 e)
(the product in float64) scales every exponent::

    e     = fl_exp(2^fl_exp(S c - fl_exp(m c)))          (one FMA)
    alpha = fl_exp(2^fl_exp(fl_exp(m_old - m_new) c))    (FA1's beta likewise)
    L     = fl_stats(m · scale + ln l)

Every stage has its own format (so a value rounded to the wrong stage shows),
and the keys come in four blocks whose row maxima rise from block to block, so
each rescale (alpha, and FA1's beta) multiplies by something other than 1 and
one computed without c changes the output.  The simulation imports nothing
from fa_jax's arithmetic; every op is its exact result rounded once
(tests/oracle.py), 2^t and ln l to 60 digits.
"""

from __future__ import annotations

import decimal
import math
from fractions import Fraction as F

import jax
import numpy as np
import pytest
from helpers import x64_enabled
from oracle import round_exact

from fa_jax import custom
from fa_jax.accumulation import get_accumulation
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.policy import STAGES, Policy


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


WIDTHS = {  # every stage its own format; exp, stats and o_acc narrow enough to show
    "inputs": (6, 8),
    "qk_acc": (8, 13),
    "scores": (7, 10),
    "stats": (8, 9),
    "exp": (7, 7),
    "p": (6, 6),
    "pv_acc": (8, 14),
    "o_acc": (7, 11),
    "out": (8, 12),
    "d_out": (7, 15),
    "d_acc": (8, 16),
    "d_p": (8, 4),
    "d_stats": (7, 17),
    "d_s": (8, 3),
    "grads": (7, 18),
}


def _policy(accumulation: str) -> Policy:
    assert len(set(WIDTHS.values())) == len(STAGES)
    return Policy(
        **{s: custom(*WIDTHS[s]) for s in STAGES},
        accumulation=get_accumulation(accumulation),
        scale="exp2",
        exp_model="exp2_correctly_rounded",
        name=f"exp2-{accumulation}",
    )


N, M, D, DV, BC = 5, 11, 3, 2, 3  # four key blocks, the last ragged


def _problem(seed: int):
    """Q, K, V whose keys grow block by block: each row's max moves in most blocks."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, N, D)) * 0.5
    q[..., 0] = np.abs(q[..., 0]) + 0.5
    k = rng.standard_normal((2, M, D)) * 0.5
    k[..., 0] = 1.0 + (np.arange(M) // BC) + 0.3 * np.abs(k[..., 0])  # rising block by block
    return q, k, rng.standard_normal((2, M, DV))


# -- the simulation -------------------------------------------------------------------


def fl(x, fmt) -> F:
    out = round_exact(F(x), fmt)
    assert math.isfinite(out), "overflow in the simulation"
    return F(out)


def pow2(t: F) -> F:
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        return F(decimal.Decimal(2) ** decimal.Decimal(float(t)))


def ln(x: F) -> F:
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        return F(decimal.Decimal(float(x)).ln())


MASKED = None  # a masked score


class Sim:
    def __init__(self, policy: Policy, d: int):
        self.pol = policy
        self.kind = policy.accumulation.kind
        self.scale = fl(F(1.0 / math.sqrt(d)), policy.scores)  # as attention resolves it
        self.c = fl(F(float(np.float64(float(self.scale)) * math.log2(math.e))), policy.exp)

    def total(self, terms, fmt):
        if self.kind == "exact":
            return fl(sum(terms, F(0)), fmt)
        acc = F(0)
        for t in terms:
            acc = fl(acc + t, fmt)
        return acc

    def scores(self, q, k, causal, col0):
        p = self.pol
        out = []
        for i, qi in enumerate(q):
            row = []
            for j, kj in enumerate(k):
                col = col0 + j
                if col >= M or (causal and col > i):
                    row.append(MASKED)
                else:
                    row.append(fl(self.total([a * b for a, b in zip(qi, kj)], p.qk_acc), p.scores))
            out.append(row)
        return out

    def exp2(self, x, m):
        """fl_exp(2^fl_exp(x c - fl_exp(m c))); 0 for a masked x."""
        if x is MASKED:
            return F(0)
        shift = fl(m * self.c, self.pol.exp) if m is not MASKED else F(0)
        return fl(pow2(fl(x * self.c - shift, self.pol.exp)), self.pol.exp)

    def rescale(self, m_old, m_new):
        if m_old is MASKED:
            return F(0)
        e = self.pol.exp
        return fl(pow2(fl(fl(m_old - m_new, e) * self.c, e)), e)

    @staticmethod
    def rowmax(row):
        live = [x for x in row if x is not MASKED]
        return max(live) if live else MASKED

    def maximum(self, a, b):
        if a is MASKED:
            return b
        return a if b is MASKED else max(a, b)

    def lse(self, m, l):
        return fl(m * self.scale + ln(l), self.pol.stats)

    def reference(self, q, k, v, causal):
        p = self.pol
        o, lse = [], []
        for s in self.scores(q, k, causal, 0):
            m = fl(self.rowmax(s), p.stats)
            e = [self.exp2(x, m) for x in s]
            l = self.total(e, p.stats)
            pr = [fl(x / l, p.p) for x in e]
            o.append(
                [
                    fl(self.total([a * vj[c] for a, vj in zip(pr, v)], p.pv_acc), p.out)
                    for c in range(DV)
                ]
            )
            lse.append(self.lse(m, l))
        return o, lse

    def flash(self, q, k, v, variant, causal):
        p = self.pol
        rows = []
        moved = 0  # rescales by a factor other than 0 and 1
        for i in range(len(q)):
            m, l, o = MASKED, F(0), [F(0)] * DV
            for col0 in range(0, M, BC):
                kb = [k[j] if j < M else [F(0)] * D for j in range(col0, col0 + BC)]
                vb = [v[j] if j < M else [F(0)] * DV for j in range(col0, col0 + BC)]
                s = self.scores([q[i]], kb, causal, col0)[0] if not causal else None
                if causal:
                    s = [
                        MASKED
                        if (col0 + j >= M or col0 + j > i)
                        else fl(
                            self.total([a * b for a, b in zip(q[i], kb[j])], p.qk_acc), p.scores
                        )
                        for j in range(BC)
                    ]

                def pv(weights, vb=vb):
                    return [
                        self.total([w * vj[c] for w, vj in zip(weights, vb)], p.pv_acc)
                        for c in range(DV)
                    ]

                m_blk = self.rowmax(s)
                m_blk = m_blk if m_blk is MASKED else fl(m_blk, p.stats)
                m_new = self.maximum(m, m_blk)
                if variant == "fa1":
                    e = [self.exp2(x, m_blk) for x in s]
                    l_blk = self.total(e, p.stats)
                    alpha = self.rescale(m, m_new)
                    beta = self.rescale(m_blk, m_new)
                    moved += alpha not in (0, 1) or beta not in (0, 1)
                    l_alpha = fl(l * alpha, p.stats)
                    l_new = fl(l_alpha + fl(beta * l_blk, p.stats), p.stats)
                    pv_blk = pv([fl(x, p.p) for x in e])
                    num = [
                        fl(fl(l_alpha * oc, p.o_acc) + fl(beta * pc, p.o_acc), p.o_acc)
                        for oc, pc in zip(o, pv_blk)
                    ]
                    o = [fl(x / l_new, p.o_acc) if l_new else F(0) for x in num]
                else:
                    alpha = self.rescale(m, m_new)
                    moved += alpha not in (0, 1)
                    e = [self.exp2(x, m_new) for x in s]
                    l_new = fl(fl(l * alpha, p.stats) + self.total(e, p.stats), p.stats)
                    if variant == "fa2":
                        pv_blk = pv([fl(x, p.p) for x in e])
                        o = [fl(fl(oc * alpha, p.o_acc) + pc, p.o_acc) for oc, pc in zip(o, pv_blk)]
                    else:  # rowwise
                        ratio = fl(fl(l * alpha, p.stats) / l_new, p.o_acc)
                        pv_blk = pv([fl(x / l_new, p.p) for x in e])
                        o = [fl(fl(ratio * oc, p.o_acc) + pc, p.o_acc) for oc, pc in zip(o, pv_blk)]
                m, l = m_new, l_new
            out = [fl(x / l, p.out) for x in o] if variant == "fa2" else [fl(x, p.out) for x in o]
            rows.append((out, self.lse(m, l)))
        return [r[0] for r in rows], [r[1] for r in rows], moved


def _fractions(policy, q, k, v):
    """Q, K, V rounded to the inputs format, as nested lists of Fractions."""
    return [[[fl(F(float(x)), policy.inputs) for x in row] for row in head] for head in (q, k, v)]


# -- the tests ------------------------------------------------------------------------

CASES = [
    ("fa2", False, "sequential", 1),
    ("fa1", False, "sequential", 2),
    ("rowwise", False, "exact", 3),
    pytest.param("fa1", True, "exact", 4, marks=pytest.mark.slow),
    pytest.param("fa2", True, "exact", 5, marks=pytest.mark.slow),
    pytest.param("rowwise", True, "sequential", 6, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("variant, causal, accumulation, seed", CASES)
def test_flash_with_the_exp2_scale_equals_the_simulation(variant, causal, accumulation, seed):
    policy = _policy(accumulation)
    q, k, v = _problem(seed)
    o, lse = jax.jit(
        lambda q, k, v: flash_attention(
            q, k, v, policy, Blocks(BC, BC), variant=variant, causal=causal
        )
    )(q, k, v)
    o, lse = np.asarray(o), np.asarray(lse)
    sim = Sim(policy, D)
    moved = 0
    for h in range(2):
        qh, kh, vh = _fractions(policy, q[h], k[h], v[h])
        want_o, want_lse, n = sim.flash(qh, kh, vh, variant, causal)
        moved += n
        np.testing.assert_array_equal(o[h], np.array(want_o, float), err_msg=f"O, head {h}")
        np.testing.assert_array_equal(lse[h], np.array(want_lse, float), err_msg=f"L, head {h}")
    # Causal: rows 0-2 see one block, rows 3-4 two.
    assert moved >= (1 if causal else 2 * N), "the row maxima should move from block to block"


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_reference_attention_with_the_exp2_scale_equals_the_simulation(causal):
    policy = _policy("sequential")
    q, k, v = _problem(7)
    o, lse = jax.jit(
        lambda q, k, v: reference_attention(q, k, v, policy, causal=causal, return_lse=True)
    )(q, k, v)
    sim = Sim(policy, D)
    for h in range(2):
        want_o, want_lse = sim.reference(*_fractions(policy, q[h], k[h], v[h]), causal)
        np.testing.assert_array_equal(np.asarray(o)[h], np.array(want_o, float))
        np.testing.assert_array_equal(np.asarray(lse)[h], np.array(want_lse, float))
