"""fa_jax.accumulation's summation trees against trees built here, independently,
from the builders' documented definitions, and their values against an exact
rational oracle (tests/oracle.py): every node of one child rounds it, of two
rounds their sum, of more rounds their exact sum once.

The shapes are compared for every n up to 33 (every remainder of the lanes,
blocks and parts used); the values of ops.sum and ops.matmul, jitted and
eager, on terms of widely spread magnitudes (so that a different tree, or a
leaf rounded or not, gives another result), bit for bit.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import numpy as np
import pytest
from oracle import round_exact

from fa_jax import BF16, FP32, ops
from fa_jax import accumulation as acc

# -- the trees, from the docstrings ---------------------------------------------------
# A builder maps the list of ids it sums to a nested tuple; a single id is its own
# sum except for a chain from zero (its term rounded on entry).


def seq(k=1, from_zero=False):
    def build(ids):
        if len(ids) == 1 and not from_zero:
            return ids[0]
        if from_zero:
            node = (ids[0],)
            rest = ids[1:]
        elif k == 1:
            node, rest = ids[0], ids[1:]
        else:
            node = tuple(ids[:k]) if len(ids) > 1 else ids[0]
            rest = ids[k:]
        if k == 1:
            for i in rest:
                node = (node, i)
        else:
            for j in range(0, len(rest), k):
                node = (node, *rest[j : j + k])
        return node

    return build


def pairwise():
    def build(ids):
        level = list(ids)
        while len(level) > 1:
            pairs = [(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
            level = pairs + ([level[-1]] if len(level) % 2 else [])
        return level[0]

    return build


def halving():
    def build(ids):
        level = list(ids)
        while len(level) > 1:
            m = len(level)
            h = (m + 1) // 2
            level = [(level[i], level[i + h]) for i in range(m - h)] + level[m - h : h]
        return level[0]

    return build


def fused():
    return lambda ids: ids[0] if len(ids) == 1 else tuple(ids)


def _composite(groups_of, inner, outer):
    def build(ids):
        if len(ids) == 1:
            return ids[0]
        return outer([inner(g) for g in groups_of(ids)])

    return build


def lanes(n, outer=None, inner=None):
    return _composite(
        lambda ids: [ids[i::n] for i in range(min(n, len(ids)))], inner or seq(), outer or halving()
    )


def blocked(size, inner=None, outer=None):
    return _composite(
        lambda ids: [ids[i : i + size] for i in range(0, len(ids), size)],
        inner or seq(),
        outer or seq(),
    )


def split_k(parts, inner=None, outer=None):
    def groups(ids):
        step = -(-len(ids) // parts)
        return [ids[i : i + step] for i in range(0, len(ids), step)]

    return _composite(groups, inner or seq(), outer or seq())


def vector(n, outer=None, inner=None):
    def build(ids):
        if len(ids) == 1:
            return ids[0]
        main = len(ids) - len(ids) % n
        if not main:
            return seq()(ids)
        node = lanes(n, outer, inner)(ids[:main])
        for i in ids[main:]:
            node = (node, i)
        return node

    return build


def halves(block, inner=None, align=1):
    inner = inner or seq()

    def build(ids):
        if len(ids) == 1:
            return ids[0]
        h = len(ids) // 2
        h -= h % align
        if len(ids) <= block or h == 0:
            return inner(ids)
        return (build(ids[:h]), build(ids[h:]))

    return build


def rounded(inner):
    return lambda ids: inner([(i,) for i in ids])


def fma_explicit(t):
    """An explicit tree's FMA chains: each node whose two children are terms
    rounds the lower-index one on entry."""
    if not isinstance(t, tuple):
        return t
    if len(t) == 2 and all(not isinstance(c, tuple) for c in t):
        return ((min(t),), max(t))
    return tuple(fma_explicit(c) for c in t)


def explicit(t):
    return lambda ids: _relabel(t, ids)


def _relabel(t, ids):
    return tuple(_relabel(c, ids) for c in t) if isinstance(t, tuple) else ids[t]


CHAIN0 = seq(from_zero=True)
EXPLICIT = (((0, 4), (1, (2, 3, 5)), 6), ((2, 0), (1, 3)), (((0,), 1), 2), ((0, 1), (2, 3, 4)))

# (fa_jax model, the tree built here, sizes): None = every n from 1 to 33.
CASES = [
    (acc.sequential(), seq(), None),
    (acc.sequential(3), seq(3), None),
    (acc.sequential(from_zero=True), CHAIN0, None),
    (acc.pairwise(), pairwise(), None),
    (acc.halving(), halving(), None),
    (acc.fused(), fused(), None),
    (acc.lanes(4), lanes(4), None),
    (acc.lanes(3, "pairwise", inner="pairwise"), lanes(3, pairwise(), pairwise()), None),
    (acc.lanes(8, "sequential", inner=acc.sequential(2)), lanes(8, seq(), seq(2)), None),
    (acc.vector(4), vector(4), None),
    (
        acc.vector(8, "pairwise", inner=acc.sequential(from_zero=True)),
        vector(8, pairwise(), CHAIN0),
        None,
    ),
    (acc.halves(4, "pairwise", align=2), halves(4, pairwise(), 2), None),
    (acc.halves(5), halves(5), None),
    (acc.blocked(3, "fused"), blocked(3, fused()), None),
    (acc.blocked(4, "pairwise", "halving"), blocked(4, pairwise(), halving()), None),
    (acc.split_k(3, "halving", "pairwise"), split_k(3, halving(), pairwise()), None),
    (acc.split_k(4), split_k(4), None),
    (acc.rounded_products(acc.pairwise()), rounded(pairwise()), None),
    (acc.rounded_products(acc.split_k(2)), rounded(split_k(2)), None),
    (acc.fma_chains(acc.lanes(4)), lanes(4, inner=CHAIN0), None),
    (acc.fma_chains(acc.blocked(3)), blocked(3, CHAIN0, CHAIN0), None),
    (acc.fma_chains(acc.vector(4, "sequential")), vector(4, CHAIN0, CHAIN0), None),
    (acc.fma_chains(acc.split_k(2, "pairwise")), split_k(2, pairwise(), CHAIN0), None),
    # FMA chains change only the one-term-a-step chains: sequential(2) keeps its fused steps.
    (acc.fma_chains(acc.blocked(4, acc.sequential(2))), blocked(4, seq(2), CHAIN0), None),
    *[(acc.tree(t), explicit(t), (_n,)) for t, _n in zip(EXPLICIT, (7, 4, 3, 5))],
    *[
        (acc.fma_chains(acc.tree(t)), explicit(fma_explicit(t)), (_n,))
        for t, _n in zip(EXPLICIT, (7, 4, 3, 5))
    ],
]
IDS = [str(m) for m, _, _ in CASES]


def _sizes(sizes):
    return range(1, 34) if sizes is None else sizes


@pytest.mark.parametrize("model, build, sizes", CASES, ids=IDS)
def test_tree_shapes_follow_the_builders_definitions(model, build, sizes):
    for n in _sizes(sizes):
        want = build(list(range(n)))
        if n == 1 and isinstance(want, tuple):
            continue  # a lone term: rounded or not, its sum is the term rounded once
        assert acc.nested(model, n) == want, (str(model), n)


# -- the values -----------------------------------------------------------------------


def evaluate(t, leaves, fmt) -> float:
    """The tree's value: each internal node rounds the exact sum of its children."""
    if not isinstance(t, tuple):
        return leaves[t]
    return Fraction(round_exact(sum((evaluate(c, leaves, fmt) for c in t), Fraction(0)), fmt))


def _terms(rows: int, n: int, seed: int) -> np.ndarray:
    """FP32 values spread over 2^-4 .. 2^4, both signs: every rounding shows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)) * np.exp2(rng.integers(-4, 5, (rows, n)))
    return x.astype(np.float32).astype(np.float64)


# The explicit trees, plain and as FMA chains, and builders whose nodes round a
# single term (the other builders' values: tests/test_ops.py, on these shapes).
VALUE_CASES = [c for c in CASES if c[2] is not None] + [
    c
    for c in CASES
    if str(c[0])
    in {
        "tree(lanes(4, inner=sequential(from_zero)))",
        "tree(rounded(pairwise))",
        "tree(vector(8, inner=sequential(from_zero), combine=pairwise))",
    }
]


def test_tree_sums_and_dots_equal_the_exact_oracle(x64):
    """ops.sum over terms and ops.matmul over exact products (a dot's leaves), in
    BF16, and the explicit trees in FP32 too; the rounding of each node and of
    each leaf a chain starts with shows."""
    cases = VALUE_CASES
    # An explicit tree's chains change a dot rarely (a few in a hundred): more rows.
    x = {i: _terms(64 if c[2] else 8, c[2][0] if c[2] else 13, i) for i, c in enumerate(cases)}
    b = {i: _terms(1, x[i].shape[1], 100 + i)[0] for i in x}

    @jax.jit
    def run(x, b, fmt):
        out = {}
        for i in x:
            model = cases[i][0]
            out[i] = (
                ops.sum(x[i], fmt, accumulation=model),
                ops.matmul(x[i], b[i][:, None], fmt, accumulation=model)[:, 0],
            )
        return out

    explicit = {i for i, c in enumerate(cases) if c[2] is not None}
    for fmt, which in ((BF16, set(x)), (FP32, explicit)):
        got = run({i: x[i] for i in which}, {i: b[i] for i in which}, fmt)
        for i in which:
            model, build, _ = cases[i]
            t = build(list(range(x[i].shape[1])))
            for r in range(x[i].shape[0]):
                leaves = [Fraction(float(v)) for v in x[i][r]]
                products = [Fraction(float(v)) * Fraction(float(w)) for v, w in zip(x[i][r], b[i])]
                where = (str(model), fmt.name, r)
                assert float(got[i][0][r]) == float(evaluate(t, leaves, fmt)), (*where, "sum")
                assert float(got[i][1][r]) == float(evaluate(t, products, fmt)), (*where, "dot")


def test_the_oracle_tells_the_trees_apart(x64):
    """The inputs discriminate: on each explicit tree, rounding the chains' first
    terms changes some dot; sequential, pairwise and fused sums differ."""
    trees = [t for t in EXPLICIT if t != (((0,), 1), 2)]  # its chain starts rounded
    data = [(_terms(64, n, 1), _terms(1, n, 2)[0][:, None]) for t, n in zip(EXPLICIT, (7, 4, 3, 5))]

    def run(data, x):
        dots = [
            [
                ops.matmul(a, b, FP32, accumulation=m)
                for m in (acc.tree(t), acc.fma_chains(acc.tree(t)))
            ]
            for t, (a, b) in zip(trees, data)
        ]
        models = (acc.sequential(), acc.pairwise(), acc.fused())
        return dots, [ops.sum(x, BF16, accumulation=m) for m in models]

    data = [d for t, d in zip(EXPLICIT, data) if t in trees]
    dots, sums = jax.jit(run)(data, _terms(16, 13, 3))
    for t, (plain, chained) in zip(trees, dots):
        assert not np.array_equal(np.asarray(plain), np.asarray(chained)), t
    assert len({np.asarray(s).tobytes() for s in sums}) == 3
