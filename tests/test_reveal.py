"""fa_jax.kernels.reveal: FPRev's probes rebuild known trees, say when outputs fit
none, and the orders they reveal in NumPy, XLA and PyTorch emulate bit for bit."""

import functools
import importlib.metadata
from fractions import Fraction

import host
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


def rowwise_gemm(models, k):
    """A black-box float32 GEMM whose row r adds its k products by ``models[r % len]``'s
    tree (:func:`tree_sum`), as a kernel whose rows differ does."""
    sums = [tree_sum(model, k) for model in models]

    def matmul(a, b):
        products = a[:, None, :] * b.T[None, :, :]  # float32 products, (m, p, k)
        rows = [[sums[r % len(sums)](col) for col in row] for r, row in enumerate(products)]
        return np.asarray(rows, np.float32)

    return matmul


def test_row_batched_probes_of_a_gemm_whose_rows_differ_raise():
    gemm = rowwise_gemm([acc.sequential(), acc.lanes(2, "sequential")], 16)
    with pytest.raises(ValueError, match="fit no summation tree"):
        reveal_matmul_order(gemm, 16, m=4, p=2, row=None)
    # Probed one row at a time, each row's own order comes back, its products rounded.
    found = [str(reveal_matmul_order(gemm, 16, m=4, p=2, row=row)) for row in (0, 1)]
    assert found == ["tree(rounded(sequential))", "tree(rounded(lanes(2)))"]


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

# The orders of real kernels are facts of one CPU and one library build: each table
# says where it was measured, and a test asserts it only where it detects that host
# (tests/host.py).  On every host the revealed orders reproduce the kernel bit for bit.

# OpenBLAS's sgemm on a 16 x 16 product of k <= 128 terms, by the core it picked.
# Haswell's kernels (Zen's are the same): two FMA lanes on some rows, one on the
# others (AMD EPYC, AVX2).  SkylakeX's: one FMA chain on every row (AMD EPYC, AVX-512).
_TWO_LANES = "tree(lanes(2, inner=sequential(from_zero)))"
_ONE_CHAIN = "tree(sequential(from_zero))"
OPENBLAS_SGEMM = {
    "Haswell": {_TWO_LANES, _ONE_CHAIN},
    "Zen": {_TWO_LANES, _ONE_CHAIN},
    "SkylakeX": {_ONE_CHAIN},
}
# XLA's CPU float32 dot under jit (jaxlib 0.10), by ISA: one order for every row;
# in index order (with or without FMA by shape) on AVX2, four FMA lanes (every
# fourth product) combined pairwise on AVX-512 (both on AMD EPYC).
XLA_DOT = {
    ("0.10", "avx2"): {_ONE_CHAIN, "tree(rounded(sequential))"},
    ("0.10", "avx512"): {"tree(lanes(4, inner=sequential(from_zero), combine=pairwise))"},
}


@functools.cache
def numpy_matmul_orders(k):
    return check_matmul(lambda a, b: a @ b, k, np.float32, FP32, m=16, p=16)


@functools.cache
def xla_dot_orders(k):
    dot = jax.jit(jnp.dot)

    def matmul(a, b):
        return np.asarray(dot(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)))

    return check_matmul(matmul, k, np.float32, FP32, m=4)


@pytest.mark.parametrize("k", KS)
def test_numpy_matmul_float32_emulates_bit_for_bit(k):
    assert numpy_matmul_orders(k)  # each row's revealed order reproduces it (check_matmul)


def test_numpy_matmul_float32_orders_of_this_openblas_core():
    core = host.openblas_core()
    if core not in OPENBLAS_SGEMM:
        pytest.skip(
            f"sgemm orders measured for OpenBLAS cores {sorted(OPENBLAS_SGEMM)}, not {core}"
        )
    assert set(numpy_matmul_orders(32)) == OPENBLAS_SGEMM[core]


@pytest.mark.parametrize("k", KS)
def test_jnp_dot_float32_under_jit_emulates_bit_for_bit(k):
    assert xla_dot_orders(k)


def test_jnp_dot_float32_orders_of_this_isa():
    jaxlib = ".".join(importlib.metadata.version("jaxlib").split(".")[:2])
    key = (jaxlib, host.isa())
    if key not in XLA_DOT:
        pytest.skip(f"XLA's dot orders measured for (jaxlib, ISA) {sorted(XLA_DOT)}, not {key}")
    orders = xla_dot_orders(32)
    assert len(orders) == 1 and set(orders) <= XLA_DOT[key]


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


# PyTorch's CPU matmuls on one thread (torch 2.13), at k = 32, by (torch, ISA, CPU
# vendor).  On AMD EPYCs (AVX2 and AVX-512): float32 a multiply, then an add, in
# index order (no FMA); bfloat16 four lanes (every fourth product), each an FMA
# chain in FP32, added in order.  Past 32 terms the bfloat16 order differs between
# the two CPUs (AVX-512's has pairs).  On an Intel Xeon with AVX-512 and AMX, MKL's
# float32 GEMM is one FMA chain in index order; bfloat16 as on the EPYCs.
_BF16_LANES = "tree(lanes(4, inner=sequential(from_zero), combine=sequential(from_zero)))"
TORCH_MATMUL = {
    ("2.13", "avx2", "AuthenticAMD"): {
        "float32": "tree(rounded(sequential))",
        "bfloat16": _BF16_LANES,
    },
    ("2.13", "avx512", "AuthenticAMD"): {
        "float32": "tree(rounded(sequential))",
        "bfloat16": _BF16_LANES,
    },
    ("2.13", "avx512", "GenuineIntel"): {
        "float32": "tree(sequential(from_zero))",
        "bfloat16": _BF16_LANES,
    },
}


def torch_matmul_orders(torch, k, dtype):
    if dtype == "float32":

        def matmul(a, b):
            return (torch.from_numpy(np.ascontiguousarray(a)) @ torch.from_numpy(b)).numpy()

        return check_matmul(matmul, k, np.float32, FP32, m=4)

    def matmul_bf16(a, b):
        ta, tb = (torch.from_numpy(np.asarray(v, np.float32)).bfloat16() for v in (a, b))
        return (ta @ tb).float().numpy()

    return check_matmul(matmul_bf16, k, ml_dtypes.bfloat16, BF16, m=4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", KS)
def test_torch_matmul_emulates_bit_for_bit(torch_one_thread, k, dtype):
    orders = torch_matmul_orders(torch_one_thread, k, dtype)
    assert sorted(r for rows in orders.values() for r in rows) == list(range(4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_matmul_orders_of_this_host(torch_one_thread, dtype):
    torch = torch_one_thread
    key = (".".join(torch.__version__.split(".")[:2]), host.isa(), host.vendor())
    if key not in TORCH_MATMUL:
        pytest.skip(f"torch's matmul orders measured for {sorted(TORCH_MATMUL)}, not {key}")
    assert torch_matmul_orders(torch, 32, dtype) == {TORCH_MATMUL[key][dtype]: list(range(4))}
