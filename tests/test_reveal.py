"""fa_jax.kernels.reveal: FPRev's probes rebuild known trees, say when outputs fit
none, and the orders they reveal in NumPy, XLA and PyTorch emulate bit for bit."""

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled
from oracle import round_exact

from fa_jax import BF16, FP32, ops
from fa_jax import accumulation as acc
from fa_jax.kernels.reveal import (
    identify,
    predicted_probes,
    reveal_dot_order,
    reveal_matmul_order,
    reveal_order,
    same_tree,
)

NUMPY_SUM = acc.halves(128, acc.vector(8, "pairwise"), align=8)


def tree_sum(model, n):
    """A black-box float32 sum walking ``model``'s tree: numpy binary32 additions,
    fused nodes exactly summed and rounded once."""
    nodes = acc.tree_nodes(model, n)

    def fn(x):
        vals = [np.float32(v) for v in x]
        for node in nodes:
            if len(node) == 2:
                vals.append(np.float32(vals[node[0]] + vals[node[1]]))
            else:
                exact = sum((Fraction(float(vals[c])) for c in node), Fraction(0))
                vals.append(np.float32(round_exact(exact, FP32)))
        return vals[-1]

    return fn


SYNTHETIC = [
    acc.sequential(),
    acc.pairwise(),
    acc.halving(),
    acc.lanes(4, "pairwise"),
    acc.vector(8, "halving"),
    acc.split_k(3, "pairwise", "halving"),
    acc.sequential(4),  # fused nodes of the accumulator and 4 terms
    acc.blocked(4, "fused", "pairwise"),
    acc.fused(),
]


@pytest.mark.parametrize("model", SYNTHETIC, ids=str)
@pytest.mark.parametrize("n", [2, 5, 16, 37])
def test_probes_rebuild_known_trees(model, n):
    found = reveal_order(tree_sum(model, n), n)
    assert same_tree(found, model, n), (str(found), str(model))
    assert found.kind == "tree"


def test_an_explicit_tree_comes_back_when_no_builder_matches():
    model = acc.tree(((3, (0, 5)), ((1, 4), 2)))
    found = reveal_order(tree_sum(model, 6), 6)
    assert str(found) == "tree((((0, 5), 3), ((1, 4), 2)))" and same_tree(found, model, 6)
    assert identify(model, 6) is None


def test_predicted_probes_are_what_the_probes_see():
    model = acc.blocked(3, "fused")
    pairs = [(0, 1), (0, 4), (3, 5), (6, 2)]
    fn = tree_sum(model, 7)
    seen = []
    for i, j in pairs:
        x = np.ones(7, np.float32)
        x[i], x[j] = 2.0**100, -(2.0**100)
        seen.append(fn(x))
    assert list(predicted_probes(model, 7, pairs)) == seen == [5.0, 1.0, 5.0, 0.0]


def test_counts_beyond_the_output_format_are_split_over_probes():
    # A bfloat16 result holds integers up to 256: 300 terms need two groups of ones.
    def fn(x):
        return np.float32(np.sum(x.astype(np.float32))).astype(ml_dtypes.bfloat16)

    found = reveal_order(fn, 300, dtype=ml_dtypes.bfloat16, out_dtype=ml_dtypes.bfloat16)
    assert same_tree(found, NUMPY_SUM, 300)


@pytest.mark.parametrize(
    "fn, dtype, message",
    [
        (np.max, np.float32, r"fit no summation tree: the sum of 16 ones gave"),
        (lambda x: np.sum(x[np.random.default_rng().permutation(16)]), np.float32, "fit no"),
        (lambda x: np.sum(x.astype(np.float32)), np.float16, r"does not absorb the other 15"),
        (lambda x: np.sum(x) + np.float32(0.5), np.float32, r"the sum of 16 ones gave"),
    ],
    ids=["max", "random-order", "fp16-in-fp32", "not-a-count"],
)
def test_outputs_that_fit_no_tree_raise(fn, dtype, message):
    with pytest.raises(ValueError, match=message):
        reveal_order(fn, 16, dtype=dtype)


def test_row_batched_probes_of_a_gemm_whose_rows_differ_raise():
    # OpenBLAS's sgemm sums some rows of a 16x16 block in another order.
    with pytest.raises(ValueError, match="fit no summation tree"):
        reveal_matmul_order(lambda a, b: a @ b, 16, m=16, p=16, row=None)


# -- real implementations ------------------------------------------------------


@pytest.mark.parametrize(
    "sizes",
    [(8, 17, 100, 129, 256), pytest.param(tuple(range(2, 257)), marks=pytest.mark.slow)],
    ids=["", "every-n"],
)
def test_numpy_sum_is_its_pairwise_summation(sizes):
    for n in sizes:
        found = reveal_order(lambda x: np.sum(x, axis=-1), n, batched=True)
        assert same_tree(found, NUMPY_SUM, n), (n, str(found))
        if n < 8:
            assert found == acc.sequential()


def test_numpy_sum_emulates_bit_for_bit():
    n = 200
    found = reveal_order(lambda x: np.sum(x, axis=-1), n, batched=True)
    x = np.random.default_rng(0).standard_normal((64, n)).astype(np.float32) * 100
    with x64_enabled():
        emulated = jax.jit(lambda v: ops.sum(v, FP32, accumulation=found))(x.astype(np.float64))
    assert np.array_equal(np.asarray(emulated), np.sum(x, axis=-1).astype(np.float64))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _emulate(a, b, model, out):
    return ops.cast(ops.matmul(a, b, FP32, accumulation=model), out)


def check_matmul(matmul, k, dtype, out, m=8, p=8, seed=0):
    """Reveal each row's order (column 0), emulate each row with it on random
    inputs and compare every element; returns {str(order): rows}."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, p)).astype(dtype)
    real = np.asarray(matmul(a, b), np.float64)
    orders: dict = {}
    for r in range(m):
        model = reveal_matmul_order(matmul, k, m=m, p=p, dtype=dtype, row=r)
        orders.setdefault(model, []).append(r)
    with x64_enabled():
        for model, rows in orders.items():
            a64, b64 = a[rows].astype(np.float64), b.astype(np.float64)
            emulated = np.asarray(_emulate(a64, b64, model, out))
            assert np.array_equal(emulated, real[rows]), (str(model), rows)
    return {str(model): rows for model, rows in orders.items()}


KS = [32, *(pytest.param(k, marks=pytest.mark.slow) for k in (64, 128, 512))]


@pytest.mark.parametrize("k", KS)
def test_numpy_matmul_float32(k):
    orders = check_matmul(lambda a, b: a @ b, k, np.float32, FP32, m=16, p=16)
    if k <= 128:  # OpenBLAS: two FMA lanes on some rows, one on the others
        assert set(orders) == {
            "tree(lanes(2, inner=sequential(from_zero)))",
            "tree(sequential(from_zero))",
        }


@pytest.mark.parametrize("k", KS)
def test_jnp_dot_float32_under_jit(k):
    dot = jax.jit(jnp.dot)

    def matmul(a, b):
        return np.asarray(dot(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)))

    orders = check_matmul(matmul, k, np.float32, FP32, m=4)
    # XLA's CPU dot: one order for every row, in index order (with or without FMA
    # depending on the shape).
    assert len(orders) == 1
    assert set(orders) <= {"tree(sequential(from_zero))", "tree(rounded(sequential))"}


def test_numpy_dot_of_vectors():
    # OpenBLAS's sdot: 32 FMA lanes (i mod 32) reduced as a tree, then a scalar tail.
    found = reveal_dot_order(lambda a, b: np.dot(a, b), 64)
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((5, 64)).astype(np.float32) for _ in range(2))
    with x64_enabled():
        emulated = _emulate(
            a[:, None, :].astype(np.float64), b[..., None].astype(np.float64), found, FP32
        )
    real = np.array([np.dot(x, y) for x, y in zip(a, b)], np.float64)
    assert np.array_equal(np.asarray(emulated)[:, 0, 0], real)


@pytest.fixture
def torch_one_thread():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


@pytest.mark.parametrize("k", KS)
def test_torch_matmul_float32(torch_one_thread, k):
    torch = torch_one_thread

    def matmul(a, b):
        return (torch.from_numpy(np.ascontiguousarray(a)) @ torch.from_numpy(b)).numpy()

    orders = check_matmul(matmul, k, np.float32, FP32, m=4)
    assert len(orders) == 1
    if k <= 128:  # at this size: a multiply, then an add, in index order (no FMA)
        assert orders == {"tree(rounded(sequential))": list(range(4))}


@pytest.mark.parametrize("k", KS)
def test_torch_matmul_bfloat16(torch_one_thread, k):
    torch = torch_one_thread

    def matmul(a, b):
        ta, tb = (torch.from_numpy(np.asarray(v, np.float32)).bfloat16() for v in (a, b))
        return (ta @ tb).float().numpy()

    orders = check_matmul(matmul, k, ml_dtypes.bfloat16, BF16, m=4)
    # Four lanes (every fourth product), each an FMA chain in FP32, added in order.
    assert orders == {
        "tree(lanes(4, inner=sequential(from_zero), combine=sequential(from_zero)))": list(range(4))
    }
