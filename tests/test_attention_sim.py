"""fa_jax.attention and fa_jax.backward against the op-by-op simulation, bit for bit.

tests/attention_sim.py computes every op of the forward and backward passes
exactly and rounds it once to its stage's format.  The policies here give every
one of the fifteen stages its own format, so a value rounded to the wrong stage
(the FA2 output update in pv_acc instead of o_acc, D's products in d_acc instead
of d_stats, the scaled scores in qk_acc instead of scores) changes some bit.
The shapes are small enough for the Fraction arithmetic: N = 7 queries in
Br = 3 row tiles (3 tiles, the last ragged), M = 10 keys in Bc = 3 column tiles
(4 tiles, the last ragged), d = 3, d_v = 2, two heads.  Compile time dominates
(seconds per jitted program), so the default run takes four programs that between
them cover every variant, both backward passes, causal and not, both scale
placements and both accumulation models; the slow tests (``-m slow``) run the
whole matrix and op-by-op eager execution.  One more case builds a division whose
float64 quotient is exactly a midpoint of the target format while the true
quotient is not, which only a correct midpoint resolution in ops.div rounds right.
"""

import decimal
import math
import zlib
from fractions import Fraction

import jax
import numpy as np
import pytest
from attention_sim import (
    Mods,
    flash_backward,
    flash_forward,
    reference_backward,
    reference_forward,
    split_flash_forward,
)
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


def _policy(widths: dict, accumulation: str, scale: str) -> Policy:
    """A policy with stage -> (exp_bits, man_bits); every stage a different format."""
    assert set(widths) == set(STAGES)
    assert len({widths[s] for s in STAGES}) == len(STAGES)
    return Policy(
        **{s: custom(*widths[s]) for s in STAGES},
        accumulation=get_accumulation(accumulation),
        scale=scale,
        name=f"mixed-{accumulation}-{scale}",
    )


# Formats widening along the computation, so that a rounding early on reaches the result.
WIDENING = {
    "inputs": (6, 3),
    "d_out": (6, 4),
    "scores": (7, 5),
    "d_p": (7, 6),
    "p": (7, 7),
    "exp": (8, 8),
    "qk_acc": (8, 9),
    "pv_acc": (8, 10),
    "o_acc": (8, 11),
    "stats": (8, 12),
    "d_acc": (8, 13),
    "d_stats": (8, 14),
    "d_s": (8, 15),
    "out": (8, 16),
    "grads": (8, 17),
}
# No order: accumulators narrower than what they accumulate, statistics wider than
# the scores, a narrow output fed by a wide accumulator.
SCRAMBLED = {
    "inputs": (6, 8),
    "qk_acc": (7, 5),
    "scores": (7, 10),
    "stats": (8, 7),
    "exp": (7, 12),
    "p": (6, 9),
    "pv_acc": (8, 14),
    "o_acc": (7, 6),
    "out": (8, 13),
    "d_out": (7, 11),
    "d_acc": (8, 16),
    "d_p": (8, 4),
    "d_stats": (7, 15),
    "d_s": (8, 3),
    "grads": (7, 17),
}
POLICIES = {
    f"{kind}-{accumulation}-{scale}": _policy(widths, accumulation, scale)
    for kind, widths in (("widening", WIDENING), ("scrambled", SCRAMBLED))
    for accumulation in ("exact", "sequential")
    for scale in ("scores", "q")
}
BLOCKS = Blocks(3, 3)
N, M, D, DV = 7, 10, 3, 2


def _problem(seed: int):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((2, x, D)) * 1.5 for x in (N, M))
    v = rng.standard_normal((2, M, DV))
    return q, k, v, rng.standard_normal((2, N, DV)), rng.standard_normal((2, N))


def _attention(kind: str, variant: str | None, causal: bool, policy: Policy):
    """(q, k, v) -> (O, L) of fa_jax."""
    if kind == "reference":
        return lambda q, k, v: reference_attention(q, k, v, policy, causal=causal, return_lse=True)
    return lambda q, k, v: flash_attention(
        q, k, v, policy, BLOCKS, variant=variant or "fa2", causal=causal
    )


def _forward_backward(fn, q, k, v, d_o, d_lse):
    (o, lse), vjp = jax.vjp(fn, q, k, v)
    return (o, lse, *vjp((d_o, d_lse)))


def _simulated(kind, variant, causal, policy, q, k, v, d_o, d_lse):
    """(O, L, dQ, dK, dV) of the simulation."""
    if kind == "reference":
        o, lse, p, prepared = reference_forward(q, k, v, policy, causal)
        return (o, lse, *reference_backward(prepared, p, d_o, d_lse, policy))
    o, lse, prepared = flash_forward(q, k, v, policy, BLOCKS.bc, variant, causal)
    return (o, lse, *flash_backward(prepared, o, lse, d_o, d_lse, policy, BLOCKS.bc, causal))


def _assert_bitwise(got, want, what: str):
    for name, g, w in zip(("O", "L", "dQ", "dK", "dV"), got, want):
        g = np.asarray(g)
        assert g.dtype == np.float64 and g.shape == w.shape, (what, name, g.dtype, g.shape)
        bad = np.flatnonzero(g != w)
        assert not bad.size, (
            f"{what}: {name} differs at {bad.size} of {g.size} entries, e.g. flat index "
            f"{bad[0]}: fa_jax {g.flat[bad[0]]!r}, simulation {w.flat[bad[0]]!r}"
        )


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


# Every variant, causal and not, both scale placements, both accumulation models, both
# policies and both backward passes in four compiled programs (each costs seconds to
# compile); the backward does not depend on the forward's variant, so fa1 and
# rowwise run forward only here.  The slow tests run every combination.
CASES = [  # (kind, variant, causal, policy name, with the backward)
    ("reference", None, False, "scrambled-sequential-scores", True),
    ("flash", "fa2", True, "widening-exact-q", True),
    ("flash", "fa1", True, "scrambled-exact-scores", False),
    ("flash", "rowwise", False, "widening-sequential-q", False),
]
MATRIX_POLICIES = (
    "widening-exact-scores",
    "widening-sequential-q",
    "scrambled-exact-q",
    "scrambled-sequential-scores",
)
ALL_CASES = [
    (kind, variant, causal, name)
    for kind, variant in [
        ("reference", None),
        ("flash", "fa1"),
        ("flash", "fa2"),
        ("flash", "rowwise"),
    ]
    for causal in (False, True)
    for name in MATRIX_POLICIES
]


def _check_jitted(kind, variant, causal, name, backward=True):
    policy = POLICIES[name]
    args = _problem(_seed(kind, variant, causal, name))
    fn = _attention(kind, variant, causal, policy)
    if backward:
        got = jax.jit(lambda *a: _forward_backward(fn, *a))(*args)
    else:
        got = jax.jit(fn)(*args[:3])
    want = _simulated(kind, variant, causal, policy, *args)[: len(got)]
    _assert_bitwise(got, want, f"jitted {kind} {variant} causal={causal} {name}")


@pytest.mark.parametrize("kind, variant, causal, name, backward", CASES)
def test_jitted_forward_and_backward_equal_the_simulation(kind, variant, causal, name, backward):
    """O and L (and dQ, dK, dV) of one jitted program equal the simulation's bits."""
    _check_jitted(kind, variant, causal, name, backward)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, variant, causal, name", [c for c in ALL_CASES if (*c, True) not in CASES]
)
def test_every_case_jitted_equals_the_simulation(kind, variant, causal, name):
    """The rest of variant x causal x policy (a minute or more of compiling)."""
    _check_jitted(kind, variant, causal, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, variant, causal, name",
    [
        ("flash", "fa2", True, "widening-exact-scores"),
        ("reference", None, True, "scrambled-exact-q"),
    ],
)
def test_eager_forward_and_backward_equal_the_simulation(kind, variant, causal, name):
    """Op by op (jax.disable_jit: every primitive compiled on its own, no fusion) the
    bits are the simulation's too.  Eager mode compiles each primitive for each
    shape it meets: tens of seconds, hence slow."""
    policy = POLICIES[name]
    args = _problem(_seed(kind, variant, causal, name))
    fn = _attention(kind, variant, causal, policy)
    with jax.disable_jit():
        got = _forward_backward(fn, *args)
    want = _simulated(kind, variant, causal, policy, *args)
    _assert_bitwise(got, want, f"eager {kind} {variant} causal={causal} {name}")


# GQA (4 query heads on 2 K/V heads), a bias in a stage of its own, a boolean mask and
# a window (3, 1) whose right edge leaves the last key block unvisited (N + 1 = 8 of
# M = 10 keys), and in flash a softcap c = 2.5; every row keeps its diagonal key, so no
# row is fully masked.
MODS_CASES = [  # (kind, variant, causal, policy name, with the backward)
    # The reference shares the features' code with flash (masking, score_mods, heads).
    pytest.param(
        "reference", None, False, "widening-sequential-scores", True, marks=pytest.mark.slow
    ),
    ("flash", "fa2", True, "widening-exact-q", True),
    pytest.param("flash", "fa1", False, "scrambled-exact-scores", False, marks=pytest.mark.slow),
]


def _mods_problem(seed: int, softcap: float | None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((4, N, D)) * 1.5
    k = rng.standard_normal((2, M, D)) * 1.5
    v = rng.standard_normal((2, M, DV))
    bias = rng.standard_normal((4, N, M)) * 2.0
    mask = (rng.random((N, M)) < 0.7) | np.eye(N, M, dtype=bool)
    d_o, d_lse = rng.standard_normal((4, N, DV)), rng.standard_normal((4, N))
    return (q, k, v, d_o, d_lse), Mods(2, bias, mask, (3, 1), softcap)


@pytest.mark.parametrize("kind, variant, causal, name, backward", MODS_CASES)
def test_gqa_bias_mask_and_window_equal_the_simulation(kind, variant, causal, name, backward):
    """The features of fa_jax.heads, masking and score_mods, jitted, forward and
    backward, equal the simulation's bits (the bias in a stage of its own)."""
    # grads narrower than d_acc, so that the group sums of dK and dV round there
    policy = POLICIES[name].replace(bias=custom(8, 6), grads=custom(8, 9))
    softcap = 2.5 if kind == "flash" else None
    args, mods = _mods_problem(_seed("mods", kind, variant, causal, name), softcap)
    extra = dict(bias=mods.bias, mask=mods.mask, window=mods.window, softcap=mods.softcap)
    if kind == "reference":

        def fn(q, k, v):
            return reference_attention(q, k, v, policy, causal=causal, return_lse=True, **extra)
    else:

        def fn(q, k, v):
            return flash_attention(q, k, v, policy, BLOCKS, variant=variant, causal=causal, **extra)

    if backward:
        got = jax.jit(lambda *a: _forward_backward(fn, *a))(*args)
    else:
        got = jax.jit(fn)(*args[:3])
    q, k, v, d_o, d_lse = args
    if kind == "reference":
        o, lse, p, prepared = reference_forward(q, k, v, policy, causal, mods=mods)
        want = (o, lse, *reference_backward(prepared, p, d_o, d_lse, policy, mods.groups))
    else:
        o, lse, prepared = flash_forward(q, k, v, policy, BLOCKS.bc, variant, causal, mods)
        bwd = (
            ()
            if not backward
            else flash_backward(prepared, o, lse, d_o, d_lse, policy, BLOCKS.bc, causal, mods)
        )
        want = (o, lse, *bwd)
    _assert_bitwise(got, want[: len(got)], f"mods {kind} {variant} causal={causal} {name}")


# A probability whose float64 quotient 1 / l is exactly a midpoint of the p format
# while the true quotient is not: one query, keys with scores (t, 0) (q = k_0 = 1,
# k_1 = 0, the scale t), so l = 1 + X with X = fl_exp(exp(t)).  Choosing l = fl64(1/μ)
# for a midpoint μ of p makes 1 / l = μ (1 + η) with |η| <= 2**-53: float64 rounds it
# to μ, and only the sign of the residual says which neighbour of μ is right.
MIDPOINT = _policy(
    {
        "inputs": (6, 5),
        "qk_acc": (7, 20),
        "scores": (9, 51),
        "stats": (11, 52),
        "exp": (10, 50),
        "p": (6, 8),
        "pv_acc": (8, 21),
        "o_acc": (8, 22),
        "out": (8, 23),
        "d_out": (6, 6),
        "d_acc": (8, 24),
        "d_p": (7, 9),
        "d_stats": (8, 25),
        "d_s": (7, 10),
        "grads": (8, 26),
    },
    "exact",
    "scores",
)


def _midpoint_scales(policy: Policy):
    """Scales t (values of ``exp``) for which 1 / l is a float64 midpoint of ``p``
    whose correct rounding is not the tie-to-even one."""
    p, exp_fmt = policy.p, policy.exp
    out = []
    for k in range(1 << p.man_bits):  # midpoints μ in [1/2, 1) of p
        mu = (Fraction(1) + Fraction(2 * k + 1, 1 << (p.man_bits + 1))) / 2
        if not Fraction(2, 3) < mu <= Fraction(4, 5):
            continue
        l = Fraction(round_exact(1 / mu, policy.stats))  # in [1.25, 1.5)
        x = l - 1  # in [1/4, 1/2): on exp's grid of 2**-52
        if round_exact(x, exp_fmt) != x or float(1.0 / float(l)) != mu:
            continue
        if round_exact(1 / l, p) == round_exact(mu, p):  # tie to even happens to be right
            continue
        with decimal.localcontext() as ctx:
            ctx.prec = 60
            t0 = round_exact(Fraction(decimal.Decimal(float(x)).ln()), exp_fmt)
            ulp = math.ldexp(1.0, math.frexp(t0)[1] - 1 - exp_fmt.man_bits)
            for t in (t0 - ulp, t0, t0 + ulp):  # ln x's neighbours on exp's grid
                e = Fraction(decimal.Decimal(t).exp())
                if abs(e - x) < Fraction(1, 2**55):  # far from exp's rounding boundaries
                    out.append((t, float(mu), round_exact(1 / l, p)))
                    break
    return out


def test_a_float64_midpoint_quotient_rounds_by_its_residual():
    """P = fl_p(e / l) where the float64 quotient is exactly a midpoint of p: the
    correct neighbour (the simulation's, from the exact quotient) is not the one
    ties-to-even gives, so both a missing and an inverted midpoint resolution fail."""
    cases = _midpoint_scales(MIDPOINT)
    assert len(cases) >= 2, cases
    q, k, v = np.array([[1.0]]), np.array([[1.0], [0.0]]), np.array([[0.0], [1.0]])
    for t, mu, want_p in cases[:4]:
        got = jax.jit(
            lambda q, k, v, t: reference_attention(q, k, v, MIDPOINT, scale=t, return_lse=True)
        )(q, k, v, t)
        o, lse, p, _ = reference_forward(q, k, v, MIDPOINT, False, scale=t)
        assert p[0, 1] == want_p != mu
        _assert_bitwise(got, (o, lse), f"midpoint quotient {mu!r} (scale {t!r})")


# Split-KV decoding (fa_jax.split_kv): M = 10 keys in 4 blocks of Bc = 3.  S = 3 gives
# splits of 2, 2 and 0 blocks (the last visits none), S = 2 of 2 and 2; under causal
# masking rows 0-5 keep no key of the second split, so L_s = -inf meets the combine.  The combine
# stage gets a format of its own.  The backward is flash's, from the combined O and
# L (the default case above checks it); the slow cases run it from split-KV's.
SPLIT_CASES = [  # (variant, causal, policy name, S, with the backward)
    ("fa2", False, "scrambled-sequential-scores", 3, False),
    ("fa2", False, "scrambled-exact-scores", 2, False),  # splits of 2 and 2: n_bps = n_b / S
    pytest.param("fa2", True, "widening-exact-q", 3, True, marks=pytest.mark.slow),
    pytest.param("fa2", False, "widening-sequential-scores", 2, True, marks=pytest.mark.slow),
    pytest.param("fa2", False, "scrambled-exact-q+reciprocal", 4, False, marks=pytest.mark.slow),
    pytest.param("fa1", True, "scrambled-exact-q", 3, False, marks=pytest.mark.slow),
    pytest.param("rowwise", True, "widening-exact-scores", 4, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("variant, causal, name, splits, backward", SPLIT_CASES)
def test_split_kv_equals_the_simulation(variant, causal, name, splits, backward):
    """O and L of split-KV flash attention (and dQ, dK, dV of the FA2 backward from
    the combined O and L), jitted, equal the simulation's bits."""
    policy = POLICIES[name.removesuffix("+reciprocal")].replace(combine=custom(7, 13))
    if name.endswith("+reciprocal"):  # Ō_s = fl_o_acc(o_s · fl_stats(1 / l_s))
        policy = policy.replace(normalise="reciprocal")
    args = _problem(_seed("split", variant, causal, name, splits))

    def fn(q, k, v):
        return flash_attention(
            q, k, v, policy, BLOCKS, variant=variant, causal=causal, num_splits=splits
        )

    if backward:
        got = jax.jit(lambda *a: _forward_backward(fn, *a))(*args)
    else:
        got = jax.jit(fn)(*args[:3])
    q, k, v, d_o, d_lse = args
    o, lse, prepared = split_flash_forward(q, k, v, policy, BLOCKS.bc, variant, causal, splits)
    bwd = () if not backward else flash_backward(prepared, o, lse, d_o, d_lse, policy, 3, causal)
    _assert_bitwise(got, (o, lse, *bwd), f"split {variant} S={splits} causal={causal} {name}")
