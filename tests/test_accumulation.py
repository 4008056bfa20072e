"""Accumulation models: construction, parsing, errors; the tensor-core model
against the test vectors of Fasi, Higham, Mikaitis & Pranesh (2021) and its
error bounds."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa_jax import BF16, FP16, FP32, bounds, ops
from fa_jax import accumulation as acc
from fa_jax.accumulation import (
    EXACT,
    SEQUENTIAL,
    TENSOR_CORE_PRESETS,
    Accumulation,
    chunked,
    get_accumulation,
    nested,
    tensor_core,
    tensor_core_model,
    tree_nodes,
    tree_roundings,
)
from fa_jax.presets import fa2_kernel, paper_uniform
from fa_jax.softmax import online_softmax, safe_softmax


def test_parse_and_print():
    assert get_accumulation("exact") is not None and get_accumulation("exact") == EXACT
    assert get_accumulation(" Sequential ") == SEQUENTIAL
    assert get_accumulation("chunked") == chunked(16)
    assert get_accumulation("chunked(4)") == Accumulation("chunked", 4)
    assert str(chunked(8)) == "chunked(8)" and str(EXACT) == "exact"
    assert get_accumulation(chunked(3)) == chunked(3)


def test_tensor_core_presets_and_names():
    v100, a100 = tensor_core("v100"), tensor_core("A100")
    assert (v100.kind, v100.chunk, v100.extra_bits, v100.normalization, v100.fused_accumulator) == (
        "tensor_core",
        4,
        0,
        "toward_zero",
        True,
    )
    assert (a100.chunk, a100.extra_bits) == (8, 1)
    assert (tensor_core("a100-tf32").chunk, tensor_core("a100_tf32").extra_bits) == (4, 1)
    assert tensor_core("t4") == v100 and str(tensor_core("t4")) == "tensor_core(v100)"
    assert tensor_core_model(8, extra_bits=1) == a100
    generic = tensor_core_model(
        5, extra_bits=2, normalization="nearest_even", fused_accumulator=False
    )
    assert str(generic) == (
        "tensor_core(k=5, extra_bits=2, normalization=nearest_even, fused_accumulator=false)"
    )
    # str() of every model parses back to an equal model.
    for model in (
        *TENSOR_CORE_PRESETS.values(),
        generic,
        tensor_core_model(2),
        EXACT,
        SEQUENTIAL,
        chunked(7),
    ):
        assert get_accumulation(str(model)) == model
    assert get_accumulation("tensor_core(k=4,extra_bits=0)") == v100
    assert get_accumulation("Tensor_Core(A100)") == a100


def test_tensor_core_is_selectable_in_a_policy():
    pol = paper_uniform(BF16, accumulation="tensor_core(a100)")
    assert pol.accumulation == tensor_core("a100")
    assert "accumulation tensor_core(a100)" in pol.describe()
    tc = fa2_kernel(FP16, accumulation=tensor_core("v100"))
    assert tc != fa2_kernel(FP16) and isinstance(hash(tc), int)  # a static jit argument


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: get_accumulation("kahan"),
            (
                r"accumulation: expected 'exact', 'sequential', 'chunked', 'chunked\(k\)', "
                r"'tensor_core\(PRESET\)' .* got 'kahan'"
            ),
        ),
        (
            lambda: chunked(0),
            r"Accumulation.chunk of 'chunked': expected a positive integer, got 0",
        ),
        (lambda: Accumulation("exact", 4), r"only 'chunked' and 'tensor_core' take a chunk, got 4"),
        (lambda: Accumulation("pairwise"), r"Accumulation.kind: expected"),
        (lambda: get_accumulation("tensor_core"), r"accumulation: expected .* got 'tensor_core'"),
        (
            lambda: tensor_core("h100"),
            r"expected a preset among \['a100', 'a100_tf32', 't4', 'v100'\], got 'h100'",
        ),
        (
            lambda: get_accumulation("tensor_core(k=4, alignment=3)"),
            r"unknown tensor_core options \['alignment'\]",
        ),
        (lambda: get_accumulation("tensor_core(k=four)"), r"accumulation: expected"),
        (lambda: get_accumulation("tensor_core(extra_bits=3)"), r"accumulation: expected"),
        (lambda: tensor_core_model(0), r"chunk of 'tensor_core': expected a positive integer"),
        (
            lambda: tensor_core_model(4, extra_bits=-1),
            r"Accumulation.extra_bits: expected a non-negative integer, got -1",
        ),
        (
            lambda: tensor_core_model(4, normalization="stochastic"),
            r"normalization: expected one of \('toward_zero', .*\), got 'stochastic'",
        ),
        (
            lambda: Accumulation("chunked", 4, extra_bits=2),
            r"only 'tensor_core' takes .* got extra_bits=2 for kind 'chunked'",
        ),
    ],
)
def test_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_type_errors():
    with pytest.raises(TypeError, match=r"fused_accumulator: expected True or False, got 'yes'"):
        tensor_core_model(4, fused_accumulator="yes")


# -- the paper's test vectors ---------------------------------------------------
#
# The test suite of Fasi et al. (github.com/north-numerical-computing/
# tensor-cores-numerical-behavior, binary32 mode) computes d = c + a1 b1 + .. +
# a4 b4 in one tensor-core FMA.  block_fma feeds c through a first block of its
# own (c alone, exact) so that the second block is {c, a1 b1, .., a4 b4}.

U = 2.0**-24  # 1 - U is the largest binary32 value below 1; fp16's smallest subnormal


_matmul = jax.jit(ops.matmul, static_argnames=("fmt", "accumulation"))


def block_fma(c, a, b, model):
    k = model.chunk
    a = np.array([c] + [0.0] * (k - 1) + list(a) + [0.0] * (k - len(a)))
    b = np.array([1.0] + [0.0] * (k - 1) + list(b) + [0.0] * (k - len(b)))
    return float(_matmul(a[None, :], b[:, None], fmt=FP32, accumulation=model)[0, 0])


ONES, HALVES = [1.0] * 4, [0.5] * 4
# (name, c, a, b, d): the binary32-mode vectors and the results the suite expects.
V100_VECTORS = [
    (
        "products are exact",
        0.0,
        [1 - 2.0**-11] * 4,
        [1 - 2.0**-11] * 4,
        4 * (1 - 2.0**-10 + 2.0**-22),
    ),
    ("fp16 subnormal input", 0.0, [U], [4.0], 2.0**-22),
    ("binary32 subnormal accumulator", 2.0**-149, [], [], 2.0**-149),
    ("accumulated in binary32", 1.0, ONES, [U] * 4, 1.0),
    ("largest term first", U, ONES, [1.0, U, U, U], 1.0),
    ("round-down, positive", 0.0, ONES, [2.0, 3 * U, 0.0, 0.0], 2.0),
    ("round-up, negative", 0.0, ONES, [-2.0, -3 * U, 0.0, 0.0], -2.0),
    ("no extra alignment bits", -(1 - U), [1.0], [1.0], 2.0**-23),
    ("no normalisation in addition", 1 - U, ONES, [U] * 4, 1 + 2.0**-23),
    ("no normalisation in subtraction", -1 + U, [1.0, 1.0], [1.0, -U], 2.0**-23),
    ("carry out", 1 + 2.0**-22 + 2.0**-23, ONES, [1.0, 1.0, 1.0, 2.0**-23], 4 + 2.0**-21),
    ("third carry bit", 1.875, ONES, [1.0, 1.5, 1.75, 1.875], 8.0),
    ("round-down in normalisation", 1 + 2.0**-22 + 2.0**-23, ONES, ONES, 5.0),
    ("round-up in normalisation", -1 - 2.0**-22 - 2.0**-23, ONES, [-1.0] * 4, -5.0),
]
# The A100 files (binary16, bfloat16, tf32) halve the small products: 2**-25 is
# lost next to 1 with one extra bit (it would survive with two or more).
A100_VECTORS = [
    ("products are exact", 0.0, [1 - 2.0**-8] * 4, [1 - 2.0**-8] * 4, 4 * (1 - 2.0**-7 + 2.0**-16)),
    ("bf16 subnormal input", 0.0, [2.0**-133], [2.0**7], 2.0**-126),
    ("binary32 subnormal output", 0.0, [2.0**-126], [0.5], 2.0**-127),
    ("binary32 subnormal output, c", -(2.0**-127), [2.0**-126], [1.0], 2.0**-127),
    ("accumulated in binary32", 1.0, HALVES, [U] * 4, 1.0),
    *[
        (
            "largest term first",
            U,
            [0.5] * j + [1.0] + [0.5] * (3 - j),
            [U] * j + [1.0] + [U] * (3 - j),
            1.0,
        )
        for j in range(4)
    ],
    ("round-down, positive", 0.0, ONES, [2.0, 3 * U, 0.0, 0.0], 2.0),
    ("round-up, negative", 0.0, ONES, [-2.0, -3 * U, 0.0, 0.0], -2.0),
    ("one extra alignment bit", -(1 - U), [1.0], [1.0], 2.0**-24),
    ("no normalisation in addition", 1 - U, ONES, [U] * 4, 1 + 2.0**-23),
    ("normalisation in subtraction", -1 + U, [1.0, 1.0], [1.0, -U], 0.0),
    ("carry out", 1 + 2.0**-22 + 2.0**-23, ONES, [1.0, 1.0, 1.0, 2.0**-23], 4 + 2.0**-21),
    ("third carry bit", 1.875, ONES, [1.0, 1.5, 1.75, 1.875], 8.0),
    ("round-down in normalisation", 1 + 2.0**-22 + 2.0**-23, ONES, ONES, 5.0),
    ("round-up in normalisation", -1 - 2.0**-22 - 2.0**-23, ONES, [-1.0] * 4, -5.0),
]


@pytest.mark.parametrize(
    "presets,vectors",
    [(("v100", "t4"), V100_VECTORS), (("a100", "a100_tf32"), A100_VECTORS)],
    ids=["v100", "a100"],
)
def test_the_papers_test_vectors(x64, presets, vectors):
    for preset in presets:
        for name, c, a, b, want in vectors:
            got = block_fma(c, a, b, tensor_core(preset))
            assert got == want and math.copysign(1, got) == math.copysign(1, want), (preset, name)


def test_the_papers_non_monotonicity(x64):
    """c = 1 - 2**-24 plus small products gives 1 + 2**-23, but the larger c = 1
    gives 1: without normalisation between additions the sum is not monotonic."""
    v100, a100 = tensor_core("v100"), tensor_core("a100")
    assert block_fma(1.0, ONES, [U] * 4, v100) == 1.0
    assert block_fma(1 - U, ONES, [U] * 4, v100) == 1 + 2.0**-23
    small = [U, U, U, 3 * U]
    assert block_fma(1.0, HALVES, small, a100) == 1.0
    assert block_fma(1 - U, HALVES, small, a100) == 1 + 2.0**-23


def test_extra_bits_are_visible(x64):
    """1 - (2**-3 + 2**-26): aligned to 1, the 2**-26 needs three extra bits."""
    c = -(2.0**-3 + 2.0**-26)
    got = {e: block_fma(c, [1.0], [1.0], tensor_core_model(4, extra_bits=e)) for e in range(5)}
    assert got == {0: 0.875, 1: 0.875, 2: 0.875, 3: 0.875 - 2.0**-24, 4: 0.875 - 2.0**-24}


# -- error bounds -----------------------------------------------------------------


def test_tensor_core_bounds_need_u_and_count_blocks():
    with pytest.raises(ValueError, match=r"needs the accumulator.s unit roundoff"):
        bounds.summation_roundings(10, "tensor_core(v100)")
    assert bounds.tensor_core_block_roundings("tensor_core(v100)", FP32.unit_roundoff) == 13
    assert bounds.tensor_core_block_roundings("tensor_core(a100)", FP32.unit_roundoff) == 12
    assert bounds.summation_roundings(1, tensor_core("v100"), u=2.0**-24) == 0
    assert bounds.summation_roundings(9, tensor_core("v100"), u=2.0**-24) == 3 * 13
    with pytest.raises(ValueError, match=r"a\*u = .* >= 1"):
        bounds.tensor_core_block_roundings(tensor_core("v100"), 2.0**-3)
    with pytest.raises(ValueError, match="expected a tensor_core model"):
        bounds.tensor_core_block_roundings(EXACT, 2.0**-24)


@pytest.mark.parametrize(
    "model,fmt",
    [
        (tensor_core("v100"), BF16),
        (tensor_core("a100"), FP16),
        (tensor_core_model(4, normalization="nearest_even", fused_accumulator=False), BF16),
    ],
    ids=str,
)
def test_tensor_core_summation_bound_holds(x64, model, fmt):
    """|s_hat - s| <= summation_bound * Σ|x| for mixed signs, and the ratio s_hat / s
    of positive sums lies in [(1 - u)^r, (1 + u)^r]."""
    rng = np.random.default_rng(5)
    n = 64
    x = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((200, n)) * 4), fmt))
    got = np.asarray(ops.sum(np.concatenate([x, np.abs(x)]), fmt, accumulation=model))
    bound = bounds.summation_bound(n, fmt, model)
    r = bounds.summation_roundings(n, model, u=fmt.unit_roundoff)
    worst = worst_ratio = 0.0
    for row, s, s_pos in zip(x.tolist(), got[:200], got[200:]):
        err = abs(s - math.fsum(row)) / math.fsum(map(abs, row))
        assert err <= bound
        ratio = s_pos / math.fsum(map(abs, row))
        assert (1 - fmt.unit_roundoff) ** r <= ratio <= (1 + fmt.unit_roundoff) ** r
        worst, worst_ratio = max(worst, err), max(worst_ratio, abs(1 - ratio))
    assert worst > 0 and worst_ratio > 0  # the sums do round: the checks can fail


def test_tensor_core_softmax_bounds_hold(x64):
    """Safe and online softmax in BF16 with tensor-core sums, under their bounds."""
    rng = np.random.default_rng(6)
    x = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((50, 96)) * 2), BF16))
    exact = np.exp(x - x.max(-1, keepdims=True))
    exact /= exact.sum(-1, keepdims=True)
    R = float((x.max(-1) - x.min(-1)).max())
    v100, a100 = tensor_core("v100"), tensor_core("a100")
    err = np.abs(np.asarray(safe_softmax(x, paper_uniform(BF16, accumulation=v100))) / exact - 1)
    assert 0 < err.max() <= bounds.softmax_bound(96, R, BF16, accumulation=v100)
    err = np.abs(
        np.asarray(online_softmax(x, paper_uniform(BF16, accumulation=a100), block=32)) / exact - 1
    )
    assert 0 < err.max() <= bounds.online_softmax_bound(96, R, BF16, block=32, accumulation=a100)


# -- summation trees ------------------------------------------------------------


def test_tree_builders_give_the_documented_trees():
    assert nested(acc.sequential(), 4) == (((0, 1), 2), 3)
    assert nested(acc.sequential(3), 8) == (((0, 1, 2), 3, 4, 5), 6, 7)
    assert nested(acc.pairwise(), 5) == (((0, 1), (2, 3)), 4)
    assert nested(acc.halving(), 8) == (((0, 4), (2, 6)), ((1, 5), (3, 7)))
    assert nested(acc.halving(), 5) == (((0, 3), 2), (1, 4))
    assert nested(acc.fused(), 4) == (0, 1, 2, 3)
    # lanes: lane l sums l, l+L, ... in order; here 10 terms in 4 lanes, halved.
    assert nested(acc.lanes(4), 10) == ((((0, 4), 8), (2, 6)), (((1, 5), 9), (3, 7)))
    assert nested(acc.lanes(4, "sequential"), 3) == ((0, 1), 2)  # empty lanes drop out
    assert nested(acc.lanes(2, "pairwise", inner="pairwise"), 6) == (((0, 2), 4), ((1, 3), 5))
    assert nested(acc.blocked(3, "fused"), 7) == (((0, 1, 2), (3, 4, 5)), 6)
    assert nested(acc.split_k(2, "pairwise", "sequential"), 5) == (((0, 1), 2), (3, 4))
    assert nested(acc.tree((2, (0, 1))), 3) == (2, (0, 1))
    assert nested(acc.pairwise(), 1) == 0
    assert tree_nodes(acc.sequential(), 3) == ((0, 1), (3, 2))
    assert tree_roundings(acc.sequential(), 9) == 8 and tree_roundings(acc.pairwise(), 9) == 4
    assert tree_roundings(acc.lanes(8), 64) == 7 + 3


TREE_MODELS = [
    acc.sequential(),
    acc.sequential(4),
    acc.pairwise(),
    acc.halving(),
    acc.fused(),
    acc.lanes(8),
    acc.lanes(16, "pairwise", inner="pairwise"),
    acc.lanes(4, acc.blocked(2, "fused")),
    acc.blocked(256),
    acc.split_k(4, inner="halving", outer="pairwise"),
    acc.tree(((0, 1), (2, (3, 4, 5)))),
]


@pytest.mark.parametrize("model", TREE_MODELS, ids=str)
def test_tree_models_print_parse_and_hash(model):
    assert get_accumulation(str(model)) == model
    assert get_accumulation(str(model).upper()) == model
    assert hash(get_accumulation(str(model))) == hash(model)  # a static jit argument
    pol = paper_uniform(BF16, accumulation=str(model))
    assert pol.accumulation == model and isinstance(hash(pol), int)


def test_tree_spellings():
    assert get_accumulation("lanes(8)") == acc.lanes(8, "halving", inner="sequential")
    assert get_accumulation("tree(lanes(8, pairwise))") == acc.lanes(8, "pairwise")
    assert get_accumulation("tree(lanes(8, combine = sequential))") == acc.lanes(8, "sequential")
    assert get_accumulation("tree(blocked(4, fused, pairwise))") == acc.blocked(
        4, "fused", "pairwise"
    )
    assert get_accumulation("tree(sequential(1))") == acc.sequential()
    assert get_accumulation("tree((0, (1, 2),))") == acc.tree((0, (1, 2)))
    assert acc.lanes(8, acc.pairwise()) == acc.lanes(8, "pairwise")
    assert str(acc.split_k(2)) == "tree(split_k(2))"


def test_deep_explicit_trees_round_trip():
    # A chain of 3000 terms: deeper than Python's recursion limit and its parser's nesting.
    model = acc.tree(nested(acc.sequential(), 3000))
    assert tree_nodes(model, 3000) == tree_nodes(acc.sequential(), 3000)
    assert get_accumulation(str(model)) == model


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: acc.tree((0, 2)), r"tree: expected the leaves 0 \.\. 1 once each, got \[0, 2\]"),
        (lambda: acc.tree((0, ())), r"expected nodes of at least one child, got \(\)"),
        (lambda: acc.tree((0, "1")), r"expected nested tuples of term indices, got '1'"),
        (lambda: acc.tree(0), r"expected at least one node of two terms, got 0"),
        (lambda: acc.lanes(0), r"Tree.size of lanes: expected a positive integer, got 0"),
        (lambda: acc.lanes(4, "kahan"), r"summation tree: expected one of"),
        (lambda: acc.lanes(4, 3), r"lanes: combine: expected a summation tree"),
        (lambda: nested(acc.tree((0, 1)), 3), r"made for 2 terms, got 3"),
        (lambda: get_accumulation("tree(lanes(4, inner=fused, inner=fused))"), r"once each"),
        (lambda: get_accumulation("tree(lanes(4) x)"), r"expected the end"),
        (lambda: get_accumulation("tree(sequential(x))"), r"expected '\)'"),
        (lambda: acc.Tree("sequential", 2, from_zero=True), r"only 'sequential' of one term"),
        (lambda: acc.Tree("pairwise", 3), r"'pairwise' takes no size, got 3"),
        (lambda: Accumulation("tree"), r"expected a Tree for kind 'tree'"),
        (lambda: tree_nodes(acc.pairwise(), 0), r"tree_nodes: n: expected a positive integer"),
    ],
)
def test_tree_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()
