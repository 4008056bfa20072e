"""XLA's attention kernel against fa_jax's model of it, bit for bit, and XLA's two
float32 exps (its own, and YNNPACK's inside a YNNPACK fusion) against their
models over the float32 inputs softmax feeds them."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import skip_unmodelled, x64_enabled
from host import amd

import fa_jax
from fa_jax import kernels
from fa_jax.exponential import CORRECTLY_ROUNDED, YNNPACK, ynnpack_exp
from fa_jax.formats import FP32
from fa_jax.kernels import xla
from fa_jax.kernels.x86 import cpu
from fa_jax.kernels.xla import calls, forward, hlo, orders, own_dots, probes


def _inputs(shape, fmt, seed):
    rng = np.random.default_rng(seed)
    with x64_enabled():
        return [np.asarray(fa_jax.round_to(rng.standard_normal(shape), fmt)) for _ in range(3)]


def _emulate(q, k, v, *, fmt, **kw):
    """``kernels.emulate("xla", ...)``; the test skipped with the model's refusal
    where it refuses this CPU (test_kernels_unmodelled checks the refusals)."""
    skip_unmodelled("xla", fmt)
    return kernels.emulate("xla", q, k, v, fmt=fmt, **kw)


def _golden(q, k, v, causal):
    with x64_enabled():
        return np.asarray(fa_jax.reference_attention(q, k, v, fa_jax.golden(), causal=causal))


@pytest.mark.parametrize(
    ("shape", "causal", "fmt"),
    [
        # 256 keys: the odd shapes below cover their concerns by default.
        pytest.param((1, 2, 256, 64), True, "bf16", marks=pytest.mark.slow),
        pytest.param((1, 2, 256, 64), True, "fp32", marks=pytest.mark.slow),
        # XLA's own exp under jit (small shapes); the fp16 case below runs it eagerly.
        pytest.param((1, 2, 32, 16), False, "bf16", marks=pytest.mark.slow),
        pytest.param((1, 1, 1024, 16), True, "bf16", marks=pytest.mark.slow),
        # Ragged rows (the softmax sum's padded last chunk), odd d (the bf16 pair
        # order's last term), fp32's tile_k chains with a rounded remainder, and
        # P V blocks that differ between queries ((1, 1, 335, 40) fp32 here).
        ((1, 1, 100, 35), True, "bf16"),
        # bf16 Q Kᵀ cut into blocks of 32 terms, and 16 (an AMX tile dot's order;
        # cut at 31, 99.988% here).
        ((2, 3, 333, 80), False, "bf16"),
        ((1, 1, 97, 35), False, "fp32"),
        pytest.param((1, 1, 335, 81), False, "bf16", marks=pytest.mark.slow),
        pytest.param((1, 1, 335, 40), True, "fp32", marks=pytest.mark.extended),  # 14 s
        ((1, 2, 77, 40), False, "fp16"),
        pytest.param((1, 3, 333, 80), False, "fp16", marks=pytest.mark.slow),
        pytest.param((1, 2, 1000, 64), True, "bf16", marks=pytest.mark.slow),
        pytest.param((1, 2, 1000, 64), True, "fp16", marks=pytest.mark.slow),
        # The same concerns again; test_xla_model_at_larger_shapes has 512 keys too.
        pytest.param((1, 2, 512, 64), False, "bf16", marks=pytest.mark.slow),
        pytest.param((1, 2, 512, 64), False, "fp32", marks=pytest.mark.slow),
        pytest.param((1, 1, 1024, 16), False, "fp32", marks=pytest.mark.slow),
    ],
)
def test_xla_is_bit_identical_to_its_model(shape, causal, fmt):
    """Every output bit for bit, jitted (bf16, fp32) and op by op (fp16): YNNPACK's
    exp from about 64 keys, XLA's own at 32 keys in bf16 (where XLA keeps the exp
    out of the YNNPACK fusions).  The dot orders, remainders and P V blocks are
    read by probes, so whatever this CPU's kernels choose, the model must match."""
    q, k, v = _inputs(shape, fa_jax.get_format(fmt), seed=0)
    real = kernels.real("xla", q, k, v, fmt=fmt, causal=causal)
    emulated = _emulate(q, k, v, fmt=fmt, causal=causal)
    c = kernels.compare(real, emulated, _golden(q, k, v, causal), fmt)
    assert c.identical_share == 1.0, c.summary()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape", [(1, 2, 512, 64), (2, 4, 1024, 128), (1, 1, 2048, 16), (1, 1, 4096, 64)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_xla_model_at_larger_shapes(shape, causal, fmt, seed):
    """Bit for bit where the P V dot runs in one chain (1024 keys, d = 128) and in
    blocks (4096 keys), and where the softmax sum adds several nodes per lane by
    compensated summation (2048 keys and more)."""
    q, k, v = _inputs(shape, fa_jax.get_format(fmt), seed)
    real = kernels.real("xla", q, k, v, fmt=fmt, causal=causal)
    emulated = _emulate(q, k, v, fmt=fmt, causal=causal)
    c = kernels.compare(real, emulated, _golden(q, k, v, causal), fmt)
    assert c.identical_share == 1.0, c.summary()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "causal", "fmt"),
    [
        ((2, 2, 2047, 128), True, "fp32"),  # a ragged 32nd chunk in the softmax sum
        ((1, 1, 3000, 64), True, "fp32"),
        ((1, 2, 2047, 96), False, "fp32"),
        ((1, 1, 2047, 64), True, "bf16"),
    ],
)
def test_xla_model_at_long_ragged_rows(shape, causal, fmt):
    """Bit for bit on rows of 1024 keys and more whose last chunk of the softmax sum
    is ragged (YNNPACK's remainder, which takes no compensated step of its own)."""
    q, k, v = _inputs(shape, fa_jax.get_format(fmt), seed=0)
    real = kernels.real("xla", q, k, v, fmt=fmt, causal=causal)
    emulated = _emulate(q, k, v, fmt=fmt, causal=causal)
    c = kernels.compare(real, emulated, _golden(q, k, v, causal), fmt)
    assert c.identical_share == 1.0, c.summary()


def test_pv_probes_count_the_terms_the_revealed_order_predicts():
    """For every query, the P V probes of keys in key 0's block count what the
    revealed order (tile_k chains folded pairwise) predicts, and the first key of
    the next block, where there is one, counts otherwise: the probes pin the
    order, whatever this CPU's blocks are."""
    shape = (1, 335, 40)
    n = shape[1]
    run = calls.real_call("float32", False, None)
    runs = probes.pv_order("float32", shape)
    assert runs[0][0] == 0 and runs[-1][1] == n
    p = probes.probe_p("float32", shape, False)
    for lo, hi, tile_k, block in runs:
        assert tile_k in probes.TILES_K and 2 <= block <= n and block % tile_k == 0
        inside = [1, 2, 3, 4, min(block, n - 1) - tile_k]
        want = probes.pv_predicted(n, inside, p, tile_k, n)
        got = probes.pv_probe_counts(run, shape, inside)[:, lo:hi]
        assert (got == want[:, None]).all()
        others = [t for t in probes.TILES_K if t != tile_k]
        assert all(
            not (got == probes.pv_predicted(n, inside, p, t, n)[:, None]).all() for t in others
        )
        if block < n - 1:
            got = probes.pv_probe_counts(run, shape, [block])[:, lo:hi]
            assert not (got == probes.pv_predicted(n, [block], p, tile_k, n)[:, None]).all()


def test_compensated_step_corrects_what_plain_addition_loses():
    """Kahan: 1 + 2^-24 + 2^-24 is 1 added plainly, 1 + 2^-23 compensated."""
    with x64_enabled():
        tiny = jnp.asarray(2.0**-24)
        total, error = orders.kahan(jnp.asarray(1.0), jnp.asarray(0.0), jnp.asarray(0.0), FP32)
        total, error = orders.kahan(tiny, total, error, FP32)
        total, error = orders.kahan(tiny, total, error, FP32)
        assert float(total) - float(error) == 1.0 + 2 * float(tiny)


def _ynnpack_sum_float_k1(row: np.ndarray) -> np.float32:
    """YNNPACK's sum_float_k1 (ynnpack/kernels/reduce/sum.h) on 16 float32 lanes,
    written as its loops are: an oracle for the model's vectorised form."""
    f32 = np.float32
    acc0, acc1, acc2, error = (np.zeros(16, f32) for _ in range(4))

    def partial(chunk):
        x = np.zeros(64, f32)
        x[: len(chunk)] = chunk
        local = np.zeros(16, f32)
        for v in range(4):
            local = local + x[16 * v : 16 * v + 16]
        return local

    def accumulate(clock=0):
        nonlocal acc0, acc1, acc2, error
        if clock & 15 == 0:
            acc1, acc0 = acc1 + acc0, np.zeros(16, f32)
            if clock & 255 == 0:
                y = acc1 - error
                t = acc2 + y
                error, acc2, acc1 = (t - acc2) - y, t, np.zeros(16, f32)

    i, k, clock = 0, len(row), 0
    while k - i >= 256:
        for _ in range(4):
            acc0 = acc0 + partial(row[i : i + 64])
            i += 64
        clock += 64
        accumulate(clock)
    while k - i >= 64:
        acc0 = acc0 + partial(row[i : i + 64])
        i += 64
        clock += 16
        accumulate(clock)
    if k > i:
        acc0 = acc0 + partial(row[i:])
    accumulate()
    lanes = acc2
    while len(lanes) > 1:
        lanes = lanes[: len(lanes) // 2] + lanes[len(lanes) // 2 :]
    return lanes[0]


@pytest.mark.parametrize("m", [13, 333, 1100, 3000])
def test_softmax_sum_follows_ynnpacks_lanes_groups_and_kahan_steps(m):
    """The model's softmax sum against YNNPACK's loops on float32 terms spanning
    many binades (every order of additions gives other bits): ragged rows, the
    groups of four chunks while 256 terms remain, Kahan steps each 1024 terms."""
    rng = np.random.default_rng(m)
    e = np.exp2(rng.uniform(-30, 0, size=(3, m))).astype(np.float32)
    with x64_enabled():
        got = np.asarray(
            jax.jit(lambda x: orders.softmax_sum(x, FP32))(jnp.asarray(e, jnp.float64))
        )
    want = np.array([_ynnpack_sum_float_k1(row) for row in e], np.float64)
    assert np.array_equal(got, want)


def test_softmax_sum_ragged_last_chunk_takes_no_compensated_step():
    """At 2047 terms the ragged last chunk is the 32nd: YNNPACK's clock ticks in its
    loops over whole chunks only, so that chunk brings no compensated step of its
    own (one more, with the running error, moves the sum by an ulp on some rows:
    7 of these 256 when it was taken)."""
    m = 2047
    rng = np.random.default_rng(m)
    e = np.exp(-3 * np.abs(rng.standard_normal((256, m)))).astype(np.float32)
    with x64_enabled():
        got = np.asarray(
            jax.jit(lambda x: orders.softmax_sum(x, FP32))(jnp.asarray(e, jnp.float64))
        )
    want = np.array([_ynnpack_sum_float_k1(row) for row in e], np.float64)
    assert np.array_equal(got, want)


def _bf16_valued(rng, shape):
    import ml_dtypes

    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float32)


def _chains(terms, tile_k, block, joined=False):
    """A dot's order on float32 terms, written plainly: blocks of ``block`` terms
    (the last n mod tile_k a block of their own, one chain; ``joined``: the last
    terms short of a block in the block before), in each tile_k chains folded
    pairwise, the block sums added in order."""
    n = len(terms)
    rest = n % tile_k if n > tile_k else 0
    main, tail = terms[: n - rest], terms[n - rest :]
    starts = list(range(0, len(main), block))
    if joined and len(starts) > 1 and len(main) % block:
        starts.pop()
    sums = []
    for start, end in zip(starts, [*starts[1:], len(main)]):
        chains = [np.float32(0)] * tile_k
        for j, t in enumerate(main[start:end]):
            chains[j % tile_k] = np.float32(chains[j % tile_k] + t)
        while len(chains) > 1:
            chains = [np.float32(a + b) for a, b in zip(chains[0::2], chains[1::2])]
        sums.append(chains[0])
    if rest:
        tail_sum = np.float32(0)
        for t in tail:
            tail_sum = np.float32(tail_sum + t)
        sums.append(tail_sum)
    total = sums[0]
    for x in sums[1:]:
        total = np.float32(total + x)
    return total


@pytest.mark.parametrize(
    ("m", "tile_k", "block", "joined", "eager"),
    [
        (37, 2, 37, False, False),
        (67, 4, 32, False, False),
        (67, 1, 16, True, False),
        (40, 1, 16, True, True),
        (20, 1, 16, True, False),
    ],
)
def test_pv_follows_chains_folds_blocks_and_the_remainder(m, tile_k, block, joined, eager):
    """The model's P V against a plain loop over the same order, on bf16-valued
    inputs (products exact in float32, so each FMA is one float32 addition);
    jitted, and eagerly for one case of the last keys joined to the block before."""
    rng = np.random.default_rng(m)
    p, v = _bf16_valued(rng, (2, m)), _bf16_valued(rng, (m, 3))
    want = [[_chains(p[i] * v[:, c], tile_k, block, joined) for c in range(3)] for i in range(2)]
    with x64_enabled():
        args = (jnp.asarray(p, jnp.float64), jnp.asarray(v, jnp.float64), FP32, block, tile_k)
        pv = jax.jit(orders.pv_dot, static_argnums=(2, 3, 4, 5))
        assert np.array_equal(np.asarray(pv(*args, joined)), np.asarray(want, np.float64))
        if eager:
            assert np.array_equal(
                np.asarray(orders.pv_dot(*args, joined)), np.asarray(want, np.float64)
            )


def _chains_rest_fma(terms: np.ndarray, tile_k: int, block: int) -> np.float32:
    """:func:`_chains` with the last n mod tile_k terms added in order to the folded
    chains of the block they end (a block of their own where the ones before are
    whole), before that block is added: Eigen's left-over rows."""
    n = len(terms)
    rest = n % tile_k if n > tile_k else 0
    main = terms[: n - rest]
    sums = []
    for start in range(0, len(main), block):
        chains = [np.float32(0)] * tile_k
        for j, t in enumerate(main[start : start + block]):
            chains[j % tile_k] = np.float32(chains[j % tile_k] + t)
        while len(chains) > 1:
            chains = [np.float32(a + b) for a, b in zip(chains[0::2], chains[1::2])]
        sums.append(chains[0])
    if rest and len(main) % block == 0:
        sums.append(np.float32(0))
    for t in terms[n - rest :]:
        sums[-1] = np.float32(sums[-1] + t)
    total = sums[0]
    for x in sums[1:]:
        total = np.float32(total + x)
    return total


@pytest.mark.parametrize(("m", "tile_k", "block"), [(37, 2, 16), (33, 2, 16), (71, 4, 32)])
def test_pv_fmas_the_remainder_onto_its_block_where_asked(m, tile_k, block):
    """``rest_fma``: the last m mod tile_k keys onto the block they end (37 and 71
    keys), or a block of their own (33), not rounded products added last; the two
    orders give other sums on the 37 keys' inputs."""
    rng = np.random.default_rng(m)
    p, v = _bf16_valued(rng, (4, m)), _bf16_valued(rng, (m, 8))
    want = np.asarray(
        [[_chains_rest_fma(p[i] * v[:, c], tile_k, block) for c in range(8)] for i in range(4)],
        np.float64,
    )
    other = np.asarray(
        [[_chains(p[i] * v[:, c], tile_k, block, False) for c in range(8)] for i in range(4)],
        np.float64,
    )
    with x64_enabled():
        args = (jnp.asarray(p, jnp.float64), jnp.asarray(v, jnp.float64), FP32, block, tile_k)
        pv = jax.jit(orders.pv_dot, static_argnums=(2, 3, 4, 5, 6))
        assert np.array_equal(np.asarray(pv(*args, False, True)), want)
        assert np.array_equal(np.asarray(pv(*args, False, False)), other)
    if m == 37:  # (at 33 one key alone is a rounded product either way)
        assert not np.array_equal(want, other)


def _model_qk(q, k, order, *, jit: bool) -> np.ndarray:
    """The model's fl32(Q Kᵀ) of float32-valued ``q`` and ``k`` in ``order`` (pairs,
    tile_k, block), jitted or op by op, as float64."""
    pairs, tile_k, block = order
    qk = (
        jax.jit(orders.qk_dot, static_argnames=("pairs", "acc", "tile_k", "block"))
        if jit
        else orders.qk_dot
    )
    with x64_enabled():
        args = (jnp.asarray(q, jnp.float64), jnp.asarray(k, jnp.float64))
        return np.asarray(qk(*args, pairs=pairs, acc=FP32, tile_k=tile_k, block=block))


@pytest.mark.parametrize(
    ("d", "pairs", "tile_k", "block"),
    [
        (35, True, 1, 35),
        (35, False, 4, 35),
        (64, False, 1, 32),
        pytest.param(128, False, 1, 66, marks=pytest.mark.slow),
        pytest.param(35, False, 2, 8, marks=pytest.mark.slow),
    ],
)
def test_qk_follows_the_pair_order_chains_and_the_remainder(d, pairs, tile_k, block):
    """The model's Q Kᵀ against a plain loop: terms in the order 1, 0, 3, 2, ...
    (an odd last term last) with pairs, tile_k chains folded pairwise, the last
    d mod tile_k terms a chain of their own added last; with a block below d (the
    cut reduction of a dot of few rows), each block summed so from zero and the
    block sums added in order."""
    rng = np.random.default_rng(d)
    q, k = _bf16_valued(rng, (3, d)), _bf16_valued(rng, (2, d))
    got = _model_qk(q, k, (pairs, tile_k, block), jit=True)
    order = (
        [j for t in range(0, d - 1, 2) for j in (t + 1, t)] + [d - 1] if pairs else list(range(d))
    )
    if pairs and d % 2 == 0:
        order = order[:-1]
    want = [[_chains((q[i] * k[j])[order], tile_k, block) for j in range(2)] for i in range(3)]
    assert np.array_equal(got, np.asarray(want, np.float64))


@pytest.mark.parametrize(
    "order",
    [(True, 2, 31), (False, 2, 32), (True, 1, 35), (False, 4, 30), (False, 8, 13), (True, 8, 12)],
)
def test_simulated_probes_add_as_the_model_does(order):
    """The probes' float32 simulation of a Q Kᵀ order adds what the model's Q Kᵀ
    adds, bit for bit, where tile_k does not divide the block and the last block
    is short (each block its own dot, with its own remainder): a simulation that
    padded blocks to whole chains read blocks of 31 as 32 on a Xeon with AMX, and
    the model then cut them at 31."""
    d, block = 77, order[2]
    rng = np.random.default_rng(block)
    q, k = _bf16_valued(rng, (5, d)), _bf16_valued(rng, (1, d))
    want = probes.simulated_qk(q * k, order).astype(np.float64)  # bf16 products, exact in f32
    assert np.array_equal(_model_qk(q, k, order, jit=False)[:, 0], want)
    assert np.array_equal(_model_qk(q, k, order, jit=True)[:, 0], want)


def test_qk_candidates_tell_blocks_of_31_from_32():
    """A bf16 Q Kᵀ cut into blocks of 32 terms, two chains each (a Xeon's AMX tile
    dot: the even terms in one chain, the odd in the other), d = 64: the probes'
    counts fit blocks of 32 only, pairs or not (the same sums with two chains)."""
    d = 64
    pairs = [(0, b) for b in range(1, d)] + [(a, b) for a in range(16) for b in range(a + 1, 16)]
    terms = np.full((len(pairs), d), 0.25, np.float32)
    for row, (a, b) in enumerate(pairs):
        terms[row, a], terms[row, b] = 2.0**23, -(2.0**23)
    counts = 4 * probes.simulated_qk(terms, (False, 2, 32))
    assert probes.qk_candidates("bfloat16", d, pairs, counts) == [(True, 2, 32), (False, 2, 32)]


def _dot_of_two_kernels(tail_rows: int, first: tuple, last: tuple):
    """A stand-in for the real call (float64 softmax and P V) whose Q Kᵀ adds the
    last ``tail_rows`` query rows in order ``last`` and the others in ``first``
    (the probes' simulation of each)."""

    def run(q, k, v):
        bh, n, d = q.shape
        s = np.zeros((bh, n, k.shape[1]))
        for b in range(bh):
            for j in np.flatnonzero(np.any(k[b] != 0, axis=-1)):
                terms = (q[b] * k[b, j]).astype(np.float32)
                s[b, :, j] = probes.simulated_qk(terms, first)
                s[b, n - tail_rows :, j] = probes.simulated_qk(terms[n - tail_rows :], last)
        s = s * float(np.float32(1 / np.sqrt(d)))
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        return (p / p.sum(axis=-1, keepdims=True)) @ v

    return run


@pytest.mark.parametrize("tail_rows", [0, 2])
def test_last_rows_of_another_kernel_are_refused(tail_rows):
    """Where the dot's last query rows, past those the order's probes reach, add
    Q Kᵀ in another order (YNNPACK's row remainder in AVX-512 BF16's pairs beside
    AMX's tile dot, as at 258 rows, d = 35, over 381 keys on a Xeon), the check
    of the last rows refuses; where every row adds alike, it passes."""
    d, m = 35, 40
    shape = (1, 300, d)
    run = _dot_of_two_kernels(tail_rows, (True, 2, 32), (True, 1, d))
    pairs = sorted(
        {(a, b) for a in range(16) for b in range(a + 1, 16)} | {(0, b) for b in range(1, d)}
    )
    keys = [0, m - 1]
    counts = probes.qk_probe_counts(run, shape, pairs, keys, m)
    read = {key: counts[:, col] for col, key in enumerate(keys)}
    assert probes.qk_candidates("bfloat16", d, pairs, read[0])[0] == (True, 2, 32)
    if tail_rows:
        with pytest.raises(ValueError, match="last query rows"):
            probes.check_last_rows(run, shape, "bfloat16", pairs, read, m)
    else:
        probes.check_last_rows(run, shape, "bfloat16", pairs, read, m)


def test_qk_candidates_find_a_cut_reduction():
    """Probe counts simulated for a reduction cut into blocks of 66 of 128 terms (as
    at the last keys of 16 queries against 1000 keys, d = 128, fp32) fit no single
    block and exactly that cut."""
    d = 128
    pairs = [(0, b) for b in range(1, d)] + [(a, b) for a in range(16) for b in range(a + 1, 16)]
    terms = np.full((len(pairs), d), 0.25, np.float32)
    for row, (a, b) in enumerate(pairs):
        terms[row, a], terms[row, b] = 2.0**23, -(2.0**23)
    counts = 4 * probes.simulated_dot(terms, 1, 66)
    assert probes.qk_candidates("float32", d, pairs, counts) == [(False, 1, 66)]


def _decoding_inputs(fmt, shape, kv_heads, m, seed=0):
    rng = np.random.default_rng(seed)
    b, d = shape[0], shape[-1]
    f = fa_jax.get_format(fmt)
    with x64_enabled():
        q = np.asarray(fa_jax.round_to(rng.standard_normal(shape), f))
        k, v = (
            np.asarray(fa_jax.round_to(rng.standard_normal((b, kv_heads, m, d)), f))
            for _ in range(2)
        )
    return q, k, v


def _assert_fp32_decoding_exact(shape, kv_heads, m):
    """The model bit for bit the real kernel on :func:`_decoding_inputs` in fp32."""
    q, k, v = _decoding_inputs("fp32", shape, kv_heads, m)
    real = kernels.real("xla", q, k, v, fmt="fp32")
    emulated = _emulate(q, k, v, fmt="fp32")
    c = kernels.compare(real, emulated, real, "fp32")
    assert c.identical_share == 1.0, c.summary()


@pytest.mark.parametrize(
    ("shape", "kv_heads", "m"),
    [
        # 4 query rows: XLA's own exp, the sum's windows in a loop fusion of XLA's.
        pytest.param((1, 4, 1, 64), 1, 1000, marks=pytest.mark.extended),
        # 32 rows: the windows in a YNNPACK fusion; 16: exp and sum in YNNPACK's.
        pytest.param((1, 4, 16, 64), 2, 700, marks=pytest.mark.slow),
        pytest.param((1, 16, 1, 64), 1, 1000, marks=pytest.mark.slow),
    ],
)
def test_fp32_decoding_is_bit_identical(shape, kv_heads, m):
    """Few queries against many keys in fp32: Q Kᵀ's reduction cut into blocks (read
    by the probes), the softmax sum as XLA's tree-reduction rewrite where the HLO
    has it (a reduce-window of 32 keys, then a reduce), the exp the HLO names."""
    _assert_fp32_decoding_exact(shape, kv_heads, m)


def test_windowed_sum_adds_padded_windows_then_their_sums():
    """XLA's tree-reduction rewrite of the softmax sum against a plain loop: windows
    of 32 with 12 zeros before 1000 terms, each summed left to right (or by
    YNNPACK's sum), then the window sums left to right."""
    rng = np.random.default_rng(3)
    e = np.exp(-3 * np.abs(rng.standard_normal((4, 1000)))).astype(np.float32)
    padded = np.zeros((4, 1024), np.float32)
    padded[:, 12:1012] = e
    windows = padded.reshape(4, 32, 32)
    plain = np.zeros((4, 32), np.float32)
    for t in range(32):
        plain = plain + windows[:, :, t]
    ynn = np.array([[_ynnpack_sum_float_k1(w) for w in row] for row in windows])
    with x64_enabled():
        for fused, sums in ((False, plain), (True, ynn)):
            got = np.asarray(
                jax.jit(lambda x, fused=fused: orders.windowed_sum(x, ((32, 12, fused),), FP32))(
                    jnp.asarray(e, jnp.float64)
                )
            )
            want = np.zeros(4, np.float32)
            for j in range(32):
                want = want + sums[:, j].astype(np.float32)
            assert np.array_equal(got, want.astype(np.float64))
        # The window sums reduced in the windows' YNNPACK fusion: YNNPACK's sum again.
        got = jax.jit(lambda x: orders.windowed_sum(x, ((32, 12, True),), FP32, ynn_total=True))(
            jnp.asarray(e, jnp.float64)
        )
        want = [_ynnpack_sum_float_k1(row.astype(np.float32)) for row in ynn]
        assert np.array_equal(np.asarray(got), np.asarray(want, np.float64))


def test_window_read_from_a_pad_less_reduce_window_and_its_reduce():
    """A reduce-window with no ``pad=`` (pad 0) whose window sums are reduced in the
    same YNNPACK fusion (32 grouped rows over 2048 keys here): the second item."""
    fusion = """%fused_computation.1 (param_0.3: f32[2,16,2048]) -> f32[2,16] {
  %param_0.3 = f32[2,16,2048]{2,1,0} parameter(0)
  %constant.1 = f32[] constant(0)
  %reduce-window.1 = f32[2,16,64]{2,1,0} reduce-window(%param_0.3, %constant.1), \
window={size=1x1x32 stride=1x1x32}, to_apply=%region_1.2
  ROOT %reduce_sum.6 = f32[2,16]{1,0} reduce(%reduce-window.1, %constant.1), \
dimensions={2}, to_apply=%region_1.2.clone
}

%region_1.2 (a: f32[], b: f32[]) -> f32[] {
  ROOT %add.0 = f32[] add(%a, %b)
}

ENTRY %main (x: f32[2,16,2048]) -> f32[2,16] {
  ROOT %ynn_fusion.1 = f32[2,16]{1,0} fusion(%x), kind=kCustom, \
calls=%fused_computation.1, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
}""".replace("\\\n", "")
    assert hlo.window_in(fusion, (2, 16, 64), "float32") == (((32, 0, True),), True)
    alone = fusion.replace("reduce(%reduce-window.1,", "reduce(%other,")
    assert hlo.window_in(alone, (2, 16, 64), "float32") == (((32, 0, True),), False)


def test_windowed_sum_reduces_level_after_level():
    """Two levels of windows (2000 keys: 63 windows of 32 after 8 zeros, then 2 of
    32 over those sums, 1 zero after), each left to right, then the last two sums,
    against a plain float32 loop."""
    rng = np.random.default_rng(4)
    e = np.exp(-3 * np.abs(rng.standard_normal((3, 2000)))).astype(np.float32)

    def windows(x, size, pad):
        n = -(-(pad + x.shape[-1]) // size)
        padded = np.zeros((x.shape[0], n * size), np.float32)
        padded[:, pad : pad + x.shape[-1]] = x
        sums = np.zeros((x.shape[0], n), np.float32)
        for t in range(size):
            sums = sums + padded.reshape(x.shape[0], n, size)[:, :, t]
        return sums

    last = windows(windows(e, 32, 8), 32, 0)
    want = np.float32(0) + last[:, 0] + last[:, 1]
    with x64_enabled():
        levels = ((32, 8, False), (32, 0, False))
        got = jax.jit(lambda x: orders.windowed_sum(x, levels, FP32))(jnp.asarray(e, jnp.float64))
    assert np.array_equal(np.asarray(got), want.astype(np.float64))


@pytest.mark.parametrize(
    ("shape", "kv_heads", "m"),
    [
        # XLA's own loop fusions: S·scale - m fused (an FMA), the sum left to right.
        ((1, 4, 1, 80), 1, 200),
        pytest.param((1, 4, 1, 128), 1, 1000, marks=pytest.mark.extended),
        pytest.param((1, 8, 2, 96), 2, 700, marks=pytest.mark.extended),
    ],
)
def test_fp32_grouped_heads_with_a_scale_off_a_power_of_two(shape, kv_heads, m):
    """d = 80, 96, 128 (1/sqrt(d) no power of two) with several query heads per K/V
    head: where XLA's own loop fusion computes S·scale - m, LLVM fuses the product
    into the subtraction (one rounding).  Rounding them apart was 14-33% identical."""
    _assert_fp32_decoding_exact(shape, kv_heads, m)


@pytest.mark.parametrize(
    ("shape", "causal", "feature", "fmt"),
    [
        ((1, 1, 8, 80), True, None, "fp32"),  # key 0 alone fused: LLVM proves i >= 0 kept
        pytest.param((1, 2, 16, 96), False, "bias", "fp32", marks=pytest.mark.extended),
        pytest.param((1, 2, 16, 96), False, None, "fp32", marks=pytest.mark.extended),
        pytest.param((1, 2, 12, 80), False, "mask", "fp32", marks=pytest.mark.extended),  # rounded
        pytest.param((1, 1, 8, 80), True, None, "bf16", marks=pytest.mark.extended),
        pytest.param((1, 2, 16, 96), False, "bias", "bf16", marks=pytest.mark.extended),
    ],
)
def test_small_shapes_in_xlas_own_loop_fusions(shape, causal, feature, fmt):
    """Below about 64 keys XLA runs the softmax in its own loop fusions: the sum a
    left-to-right loop, and the scale's product fused into the next addition
    (:func:`fa_jax.kernels.xla.hlo.contracted`).  Both were missed before (58% at
    (1, 1, 8, 64) fp32)."""
    q, k, v = _inputs(shape, fmt, 5)
    rng = np.random.default_rng(6)
    n = shape[-2]
    with x64_enabled():
        extra = {
            None: {},
            "bias": {"bias": np.asarray(fa_jax.round_to(rng.standard_normal((1, 2, n, n)), fmt))},
            "mask": {"mask": rng.random((1, 2, n, n)) < 0.7},
        }[feature]
    real = kernels.real("xla", q, k, v, fmt=fmt, causal=causal, **extra)
    emulated = _emulate(q, k, v, fmt=fmt, causal=causal, **extra)
    c = kernels.compare(real, emulated, real, fmt)
    assert c.identical_share == 1.0, c.summary()


def test_contracted_reads_which_step_the_scales_product_feeds():
    """The HLO reading behind the FMA steps, on XLA's programs for these shapes."""
    assert hlo.contracted(hlo.program_text("float32", (1, 8, 80), False, None)) == "subtract"
    assert hlo.contracted(hlo.program_text("float32", (1, 8, 80), True, None)) == "select"
    biased = calls.Layout(1, 1, 1, 8, 8, bias=(1, 1, 8, 8))
    assert hlo.contracted(hlo.program_text("float32", (1, 8, 80), False, biased)) == "add"
    masked = calls.Layout(1, 1, 1, 8, 8, mask=(1, 1, 8, 8))
    assert hlo.contracted(hlo.program_text("float32", (1, 8, 80), False, masked)) == "select"
    # A mask's select is data: never folded, every product rounded.
    assert probes.fma_step("float32", (1, 8, 80), False, masked) is None
    # Exp and sum in YNNPACK fusions: every product rounded.
    assert hlo.contracted(hlo.program_text("float32", (2, 512, 64), False, None)) is None


def test_fused_probe_scores_tell_the_two_shifts_apart():
    """The probe's inputs are exact in the format and its two shifts differ by far
    more than a float32 ulp of exp near 1 (so a ratio of outputs tells them apart)."""
    for d in (80, 96, 128, 33):
        scale = float(np.float32(1 / np.sqrt(d)))
        x, top, rounded, fused = probes.fused_probe_scores(scale)
        assert float(np.float32(x)) == x and float(np.float32(top)) == top and x < top
        assert float(np.float32(x * scale)) != x * scale
        assert abs(fused - rounded) > 2.0**-20


@pytest.mark.parametrize(
    ("shape", "kv_heads", "m", "features"),
    [
        # 4 rows: Q Kᵀ cut into blocks, the eager sum a reduce-window in XLA's loop
        # (14 s: extended for the default run's time only).
        pytest.param((1, 4, 1, 64), 1, 1000, {}, marks=pytest.mark.extended),
        # 16 rows: the sum one YNNPACK reduction; odd d; several queries per head.
        pytest.param((1, 16, 1, 64), 1, 1000, {}, marks=pytest.mark.extended),
        pytest.param((1, 2, 3, 96), 1, 1000, {}, marks=pytest.mark.extended),
        pytest.param((1, 4, 1, 80), 1, 1001, {}, marks=pytest.mark.extended),
        pytest.param((2, 4, 5, 64), 4, 333, {}, marks=pytest.mark.extended),
        # GQA 4 and 8, ragged key counts past 1024 (YNNPACK's compensated steps).
        pytest.param((1, 8, 16, 128), 2, 2048, {}, marks=pytest.mark.extended),
        pytest.param((1, 8, 2, 64), 1, 4097, {}, marks=pytest.mark.extended),
        # 24 rows: Q Kᵀ's columns split, keys from 2048 cut into blocks of their own.
        pytest.param((1, 2, 12, 64), 1, 3000, {}, marks=pytest.mark.extended),
        pytest.param((1, 4, 3, 81), 4, 2000, {}, marks=pytest.mark.extended),
        # Beyond 2^14 keys: P V probed with a mask (a uniform P is too small in fp16).
        pytest.param((1, 1, 1, 64), 1, 32768, {}, marks=pytest.mark.extended),
        pytest.param((1, 4, 3, 64), 2, 1000, {"bias": True}, marks=pytest.mark.extended),
    ],
)
def test_fp16_decoding_is_bit_identical(shape, kv_heads, m, features):
    """Few queries against many keys in fp16, which runs op by op: Q Kᵀ's reduction
    cut into blocks (the probes), the exp and the softmax sum each a program of
    its own (XLA's tree-reduction rewrite or YNNPACK's sum, read from that
    program's HLO), P V's tile_k and blocks probed; with a bias and a mask too."""
    q, k, v = _decoding_inputs("fp16", shape, kv_heads, m)
    extra = {}
    if features.get("bias"):
        rng = np.random.default_rng(1)
        b, h, n = shape[:3]
        with x64_enabled():
            bias = rng.standard_normal((b, h, n, m))
            extra["bias"] = np.asarray(fa_jax.round_to(bias, fa_jax.get_format("fp16")))
        extra["mask"] = rng.random((b, h, n, m)) < 0.8
    real = kernels.real("xla", q, k, v, fmt="fp16", **extra)
    emulated = _emulate(q, k, v, fmt="fp16", **extra)
    c = kernels.compare(real, emulated, real, "fp16")
    assert c.identical_share == 1.0, c.summary()


@pytest.mark.extended
def test_fp16_sparse_pv_probes_read_what_the_uniform_ones_read():
    """At 2^14 keys, where fp16's outputs still count a uniform P's small terms, the
    masked probes that keep 1024 keys (beyond 2^14 the only ones) read the same
    counts, scaled to their P, as the uniform ones, for every query."""
    m = 2**14
    layout = calls.Layout(1, 1, 4, 1, m)
    shape = (1, 4, 64)
    tests = [1, 2, 3, 4, 7, 8, 9, 4095, 4096, 8191, 8192, 8193, m - 10]
    uniform = probes.pv_probe_counts(calls.grouped_call("float16", layout), shape, tests, m)
    sparse = probes.pv_sparse_probe_counts(calls.masked_grouped_call(layout), shape, tests, m)
    assert np.array_equal(uniform, sparse)


def test_qk_probes_tell_the_candidate_orders_apart_and_fit_the_real_kernel():
    """The Q Kᵀ probes of the real kernel match the order the model reads and, where
    the dot is not cut into blocks, no other candidate (pairs or not, every tile_k):
    the probes pin the order."""
    shape = (1, 64, 35)
    pairs, tile_k, block = probes.qk_order("bfloat16", shape)[0]
    assert 0 < block <= 35  # the block is the host's (35 on an AMD EPYC, 32 on a Xeon with AMX)
    run = calls.real_call("bfloat16", False, None)
    head = range(16)
    tail = range(30, 35)
    probe_pairs = {(a, b) for a in (*head, *tail) for b in (*head, *tail) if a < b}
    probe_pairs = sorted({*probe_pairs, *((0, b) for b in range(1, 35))})  # the block's cut
    counts = probes.qk_probe_counts(run, shape, probe_pairs, [0])[:, 0]
    found = probes.qk_candidates("bfloat16", 35, probe_pairs, counts)
    assert found[0] == (pairs, tile_k, block)
    if block == 35:  # an uncut dot: the probes pin its order
        assert found == [(pairs, tile_k, block)]


def test_platform_names_versions_and_the_exp():
    facts = kernels.get("xla").platform()
    assert facts["jax"] == jax.__version__ and "jaxlib" in facts
    assert "xla_cpu_exp" in facts["exp_model"] and "ynnpack_exp" in facts["exp_model"]


def test_the_model_runs_the_exp_xlas_program_runs():
    """YNNPACK's where XLA puts the exp in a YNNPACK fusion, XLA's own elsewhere
    (eager fp16, small shapes); an exp chosen by hand is kept."""
    skip_unmodelled("xla")
    bf16 = xla.model(fa_jax.BF16, 512, 64).policy
    assert bf16.exp_model is YNNPACK
    assert forward.exp_model_for(bf16, (1, 64, 64), False) is YNNPACK
    assert forward.exp_model_for(bf16, (1, 16, 8), False) is xla.XLA_CPU_EXP
    fp16 = xla.model(fa_jax.FP16, 512, 64).policy
    assert forward.exp_model_for(fp16, (1, 512, 64), False) is xla.XLA_CPU_EXP
    chosen = bf16.replace(exp_model=CORRECTLY_ROUNDED)
    assert forward.exp_model_for(chosen, (1, 16, 8), False) is CORRECTLY_ROUNDED


def _exp_against_xla(x: np.ndarray) -> int:
    real = np.asarray(jax.jit(jnp.exp)(jnp.asarray(x, jnp.float32)))
    with x64_enabled():
        model = np.asarray(xla.xla_cpu_exp(jnp.asarray(x, jnp.float64)))
    assert np.array_equal(model.astype(np.float32).astype(np.float64), model)
    return int(np.count_nonzero(model.astype(np.float32) != real))


def _float32_range(lo: float, hi: float, stride: int) -> np.ndarray:
    """Every ``stride``-th float32 in [lo, hi] (lo < 0 <= hi), by bit pattern."""
    top = np.array([lo], np.float32).view(np.uint32)[0]
    bits = np.arange(0x80000000, top + 1, stride, dtype=np.uint64).astype(np.uint32)
    return bits.view(np.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's exp")
def test_xla_cpu_exp_is_bit_exact_on_a_strided_subset():
    assert _exp_against_xla(_float32_range(-104.0, 0.0, 997)) == 0


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's exp")
def test_xla_cpu_exp_is_bit_exact_on_every_float32_in_minus_104_to_0():
    x = _float32_range(-104.0, 0.0, 1)
    for start in range(0, x.size, 1 << 24):
        assert _exp_against_xla(x[start : start + (1 << 24)]) == 0


_EYE = np.eye(2, dtype=np.float32)
_FUSED_ROWS = 4096  # XLA keeps the exp below out of YNNPACK fusions for fewer rows


@functools.cache
def _shifted_exp(shift: str):
    def run(a, b):
        s = a @ b
        ref = s.max(-1, keepdims=True) if shift == "max" else s.min(-1, keepdims=True)
        return jnp.exp(s - ref)

    return jax.jit(run)


@functools.cache
def _exp_is_fused(shift: str, rows: int) -> bool:
    a = jax.ShapeDtypeStruct((rows, 2), np.float32)
    text = _shifted_exp(shift).lower(a, _EYE).compile().as_text() or ""
    bodies = hlo.computations(text)
    for line in bodies["ENTRY"].splitlines():
        called = re.search(r"calls=%([^,\s]+)", line)
        if called and "exponential(" in bodies.get(called.group(1), ""):
            return "__ynn_fusion" in line
    return False


def _ynnpack_exp_real(x: np.ndarray) -> np.ndarray:
    """exp(x) as XLA's CPU backend computes it inside a YNNPACK fusion: rows (x, 0)
    times the identity, shifted by the row's max (all x <= 0) or min (all x >= 0),
    so that the exp's input is x exactly."""
    shift = "max" if (x <= 0).all() else "min"
    assert shift == "max" or (x >= 0).all()
    a = np.zeros((max(x.size, _FUSED_ROWS), 2), np.float32)
    a[: x.size, 0] = x
    assert _exp_is_fused(shift, a.shape[0]), "XLA no longer fuses the exp with YNNPACK"
    return np.asarray(_shifted_exp(shift)(a, _EYE))[: x.size, 0]


def _ynnpack_mismatches(x: np.ndarray) -> int:
    real = _ynnpack_exp_real(x)
    with x64_enabled():
        model = np.asarray(jax.jit(ynnpack_exp)(jnp.asarray(x, jnp.float64)))
    assert np.array_equal(model.astype(np.float32).astype(np.float64), model)
    return int(np.count_nonzero(model.astype(np.float32) != real))


def _positive_float32s(hi: float, stride: int) -> np.ndarray:
    top = np.array([hi], np.float32).view(np.uint32)[0]
    return np.arange(0, top + 1, stride, dtype=np.uint32).view(np.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's YNNPACK fusions")
def test_ynnpack_exp_is_bit_exact_on_a_strided_subset():
    """Every 997th float32 in [-104, 0] and in [0, 89] (overflow to inf included)."""
    assert _ynnpack_mismatches(_float32_range(-104.0, 0.0, 997)) == 0
    assert _ynnpack_mismatches(_positive_float32s(89.0, 997)) == 0


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's YNNPACK fusions")
def test_ynnpack_exp_is_bit_exact_on_every_float32_in_minus_104_to_0():
    top = int(np.array([-104.0], np.float32).view(np.uint32)[0])
    for start in range(0x80000000, top + 1, 1 << 22):
        bits = np.arange(start, min(start + (1 << 22), top + 1), dtype=np.uint64)
        assert _ynnpack_mismatches(bits.astype(np.uint32).view(np.float32)) == 0, hex(start)


def test_xla_cpu_exp_as_an_exp_model():
    exponential = pytest.importorskip("fa_jax.exponential")
    m = xla.xla_cpu_exp_model()
    assert isinstance(m, exponential.ExpModel) and m.name == "xla_cpu"
    with x64_enabled():
        x = jnp.asarray([-1.5, -0.25, 0.0])
        assert np.array_equal(np.asarray(m.fn(x, fa_jax.FP32)), np.asarray(xla.xla_cpu_exp(x)))


def test_only_ps_conversion_counts_as_p_rounded():
    """P's bf16 conversion is a convert of a multiply (e · (1/l)); converts of the
    inputs (Q, K, V, parameters of the fusion) are not P's."""
    inputs_only = """
  %param_0 = f32[16,2048]{1,0} parameter(0)
  %convert.65 = bf16[16,2048]{1,0} convert(%param_0)
  ROOT %convert.64 = f32[16,2048]{1,0} convert(%convert.65)"""
    with_p = """
  %multiply.1 = f32[1,2,64,64]{3,2,1,0} multiply(%exp.0, %broadcast.9)
  %convert.72 = bf16[1,2,64,64]{3,2,1,0} convert(%multiply.1)
  ROOT %convert.71 = f32[1,2,64,64]{3,2,1,0} convert(%convert.72)"""
    assert not hlo.converts_product_to_bf16(inputs_only)
    assert hlo.converts_product_to_bf16(with_p)


@pytest.mark.parametrize(
    ("shape", "kv_heads", "m"),
    [
        # 3072 keys in tasks of 1024, then 8 keys on YNNPACK's reference kernel.
        pytest.param((1, 2, 3, 64), 2, 3080, marks=pytest.mark.extended),
        pytest.param((1, 2, 3, 64), 2, 4104, marks=pytest.mark.extended),
        pytest.param((1, 2, 3, 64), 2, 4400, marks=pytest.mark.extended),
        pytest.param((1, 2, 3, 64), 2, 5000, marks=pytest.mark.extended),
        pytest.param((1, 2, 3, 96), 2, 5000, marks=pytest.mark.extended),
        pytest.param((1, 2, 3, 64), 2, 4224, marks=pytest.mark.extended),
        # Tasks of 512 keys at d = 128, the last one key.
        pytest.param((1, 8, 2, 128), 8, 4097, marks=pytest.mark.extended),
        # 32 grouped rows: the window sums reduced by YNNPACK in the windows' fusion.
        pytest.param((1, 4, 16, 64), 2, 2048, marks=pytest.mark.extended),
        pytest.param((1, 8, 8, 64), 2, 2048, marks=pytest.mark.extended),
        # Two levels of windows (63 sums of 32 keys, then 2 of 32 sums), refused before.
        pytest.param((1, 4, 16, 64), 2, 2000, marks=pytest.mark.extended),
        pytest.param((1, 2, 8, 96), 1, 1500, marks=pytest.mark.extended),
    ],
)
def test_fp32_decoding_over_a_ragged_last_task_is_bit_identical(shape, kv_heads, m):
    """Few query rows over more than 1024 keys: YNNPACK cuts Q Kᵀ's columns into
    tasks (:func:`probes.qk_split`); the last, narrower task gets an order of its own
    (its first key probed), on the reference kernel's rounded products where it is
    narrower than a column block."""
    _assert_fp32_decoding_exact(shape, kv_heads, m)


def test_qk_split_follows_ynnpack_task_sizes():
    """choose_split_factors (ynnpack/subgraph/dot.cc): (rows + keys) · d reaches 64 Ki."""
    assert probes.qk_split(3, 5000, 64) == 1024
    assert probes.qk_split(2, 4097, 128) == 512
    assert probes.qk_split(3, 500, 64) >= 500  # one task


@pytest.mark.parametrize(
    ("shape", "kv_heads", "m"),
    [
        pytest.param(
            (2, 2, 5, 80),
            2,
            1500,
            marks=[
                pytest.mark.extended,
                # On an AVX2 EPYC no candidate fits (5 rows: Eigen's left-over rows
                # of 8-lane packets, with and without the last key FMA'd): refused.
                pytest.mark.xfail(
                    cpu.isa() == "AVX2", raises=ValueError, strict=True, reason="refused on AVX2"
                ),
            ],
        ),
    ],
)
def test_fp32_p_v_as_eigens_contraction_sharded_over_the_keys(shape, kv_heads, m):
    """4 groups of grouped rows over many keys: XLA runs P V as its own dot, and
    Eigen's contraction shards the keys over threads, each shard its own blocks
    of chains, the shards' buffers then summed (16.1% and 14.2% identical with the
    probed order alone)."""
    _assert_fp32_decoding_exact(shape, kv_heads, m)


@pytest.mark.parametrize(
    ("shape", "kv_heads", "m"),
    [
        pytest.param((2, 4, 1, 33), 4, 40, marks=pytest.mark.extended),  # P V's lone output
        pytest.param((2, 2, 1, 80), 2, 1500, marks=pytest.mark.extended),
        pytest.param((2, 8, 1, 128), 8, 512, marks=pytest.mark.extended),
        pytest.param((4, 4, 1, 84), 4, 1001, marks=pytest.mark.extended),
    ],
)
def test_fp32_one_row_per_group_as_xlas_own_gemv(shape, kv_heads, m):
    """One query row per group in several groups: XLA runs both dots as its own
    matrix-vector products, emitted through LLVM (Q Kᵀ's lanes summed by AVX's
    hadd, P V one FMA chain per output); 5.3% identical with the probed orders
    at (2,2,1,80)/1500, which was refused."""
    _assert_fp32_decoding_exact(shape, kv_heads, m)


def test_one_row_per_group_reads_as_xlas_own_gemvs():
    """(2,4,1,33)/40: both dots bare in fp32's program, Q Kᵀ over K's minor d
    (row-major), P V over V's major keys (column-major); bf16's the same."""
    layout = calls.Layout(2, 4, 1, 1, 40)
    for dtype in ("float32", "bfloat16"):
        assert hlo.own_dot_majors(dtype, (8, 1, 33), layout) == ("row", "column")


def _measured_on_an_epyc(raises: type[Exception], reason: str):
    """A check of an order measured on an AMD EPYC with AVX-512: elsewhere (an Intel
    Xeon, an AVX2 EPYC) an expected failure, of that kind only (a refusal expected
    must not turn into a wrong answer)."""
    elsewhere = not amd() or cpu.isa() != "AVX512"
    return pytest.mark.xfail(elsewhere, raises=raises, strict=False, reason=reason)


@pytest.mark.extended  # 20 s: the probes and the candidates
@_measured_on_an_epyc(
    ValueError,
    "the joined order's rule is unknown; on an Intel Xeon Eigen's blocks differ there, "
    "on an AVX2 EPYC its left-over rows too, and the model refuses the shape",
)
def test_fp32_last_keys_joined_to_the_block_before():
    """Four grouped rows in 3 groups over 4279 keys, d = 16: P V is Eigen's by the
    HLO, and a bare dot of its shape is 100% identical here as 20 blocks of 196
    keys then one of the last 359 (34% with the last 163 apart); the model offers
    that order among its candidates, and was refused before."""
    _assert_fp32_decoding_exact((2, 12, 1, 16), 3, 4279)


_REFUSED_ON_AVX2 = pytest.mark.xfail(
    cpu.isa() == "AVX2",
    raises=ValueError,
    strict=True,
    reason="on an AVX2 EPYC no candidate fits Eigen's own dot here (its left-over rows "
    "of 8-lane packets): the model refuses the shape",
)


@pytest.mark.parametrize(
    ("shape", "m"),
    [((2, 4, 1, 96), 2001), pytest.param((4, 8, 1, 128), 4481, marks=_REFUSED_ON_AVX2)],
)
@pytest.mark.extended  # 30 s each: the probes and the shard candidates
def test_fp32_eigens_shards_each_blocked_by_its_own_size(shape, m):
    """Grouped rows in groups of 2 K/V heads: P V is Eigen's, sharded over the keys,
    each shard cut in blocks by TSL's slices of its own size.  Over 2001 keys (2
    rows per group, d = 96) shards of 1008 and 993 keys here, in blocks of 256 and
    248; at 2500 keys every shard given the first one's probed blocks was 14.2%
    identical, refused.  Over 4481 keys (4 rows, d = 128) 2248 and 2233, in 288 and
    320: Eigen's kc, 320, is one of several that cut 2248 keys in 288 (the
    smallest, 288, cuts 2233 in 280, refused)."""
    _assert_fp32_decoding_exact(shape, 2, m)


@pytest.mark.slow  # 13 min on a 2-core AVX2 EPYC under load: the probes and Eigen's candidates
@pytest.mark.xfail(
    cpu.isa() != "AVX2",
    raises=ValueError,
    strict=False,
    reason="measured on an AVX2 CPU; Eigen's packets and row panels differ on "
    "AVX-512 and the model may refuse the shape there",
)
def test_fp32_eigens_left_over_rows_fma_the_last_key():
    """2997 grouped rows (6 query heads on 2 K/V heads) over 999 keys, d = 96: P V is
    Eigen's (XLA's own dot), whose last 5 rows (2997 mod 8) keep even and odd keys
    in two chains per block of 256 and FMA the odd last key onto the last block's
    sum; with the key as a rounded product added last nothing fitted (refused)."""
    q, k, v = _decoding_inputs("fp32", (2, 6, 999, 96), 2, 999)
    real = kernels.real("xla", q, k, v, fmt="fp32")
    emulated = _emulate(q, k, v, fmt="fp32")
    c = kernels.compare(real, emulated, real, "fp32")
    assert c.identical_share == 1.0, c.summary()


@pytest.mark.extended  # 25 s: fp32's check and bf16's probes
@_REFUSED_ON_AVX2
def test_bf16_takes_xlas_own_dots_from_fp32():
    """bf16's own dots run on float32 operands, the kernels fp32's do; its output is
    too coarse for the check to see Eigen's shards (unsharded fitted random inputs
    at (2,4,3,64)/3078, 99.93% identical on these), so bf16 takes fp32's."""
    q, k, v = _decoding_inputs("bf16", (2, 4, 3, 64), 4, 3078, seed=5)
    real = kernels.real("xla", q, k, v, fmt="bf16")
    emulated = _emulate(q, k, v, fmt="bf16")
    c = kernels.compare(real, emulated, real, "bf16")
    assert c.identical_share == 1.0, c.summary()


@pytest.mark.extended  # 20 s: the probes and the candidates
def test_fp32_where_nothing_fits_xlas_own_dot_is_refused(monkeypatch):
    """The check refuses where no candidate reproduces the real program: at
    (2,2,5,80)/1500, which needs Eigen's shards of 752 keys, it is offered only
    1000 (and none)."""
    monkeypatch.setattr(own_dots, "eigen_shards", lambda k: [1000])
    forward.fitted_own_dots.cache_clear()
    q = np.zeros((2, 2, 5, 80))
    k = np.zeros((2, 2, 1500, 80))
    try:
        with pytest.raises(ValueError, match="XLA runs its own dot here"):
            _emulate(q, k, k, fmt="fp32")
    finally:
        forward.fitted_own_dots.cache_clear()


def test_fp32_with_d_1_is_refused():
    """With d = 1 XLA rewrites P V as products summed in reduce-windows: refused."""
    q = np.zeros((1, 2, 33, 1))
    with pytest.raises(ValueError, match="d = 1"):
        _emulate(q, q, q, fmt="fp32")


@pytest.mark.extended
def test_own_dots_reads_xlas_gemv_and_skips_ynnpack_programs():
    """One row over 1000 keys: both dots XLA's own GEMVs, of a width XLA can take;
    a YNNPACK program: the probed orders, with no check."""
    skip_unmodelled("xla", "fp32")  # the check runs the model
    code = xla.vector_code("fp32")  # this CPU's
    with x64_enabled():
        own = forward.fitted_own_dots("float32", (1, 1, 128), calls.Layout(1, 1, 1, 1, 1000), code)
        assert own is not None and own.qk is not None and own.pv is not None
        assert {own.qk.lanes, own.pv.lanes} <= set(code.gemv_lanes) and own.pv_shard is None
        layout = calls.Layout(1, 2, 1, 512, 512)
        assert forward.fitted_own_dots("float32", (2, 512, 64), layout) == forward.PROBED


def test_the_isa_names_the_vector_code_modelled():
    """``isa`` picks the model of that code on any host (AVX2's GEMV on 8 lanes only),
    checked; None is this CPU's code, refused where it is not modelled."""
    assert xla.vector_code(isa="AVX2") is xla.AVX2 and xla.AVX2.gemv_lanes == (8,)
    assert xla.vector_code(isa="AVX512") is xla.AVX512 and xla.AVX512.gemv_lanes == (8, 16)
    for bad in ("avx2", "SSE", 2):
        with pytest.raises(ValueError, match=r"xla: isa: expected one of \('AVX512', 'AVX2'\)"):
            xla.model(fa_jax.FP32, 8, 16, isa=bad)  # pyright: ignore[reportArgumentType]
    model = xla.model(fa_jax.BF16, 8, 16, isa="AVX2")
    assert model.forward is not None and model.forward.keywords["code"] is xla.AVX2
    skip_unmodelled("xla")
    here = xla.model(fa_jax.BF16, 8, 16).forward
    assert here is not None and here.keywords["code"].name == cpu.isa()


_LAB_CHILD = """
import json, sys
import numpy as np
from fa_jax import get_format, kernels
from fa_jax.kernels import xla
from fa_jax.kernels.x86 import cpu
out = {"isa": np.array(cpu.isa()), "refusal": np.array(xla.unmodelled() or "")}
with np.load(sys.argv[2]) as f:
    for i, (fmt, causal) in enumerate(json.loads(sys.argv[1])):
        q, k, v = (f[f"{t}{i}"] for t in "qkv")
        out[f"real{i}"] = kernels.real("xla", q, k, v, fmt=fmt, causal=causal)
        model = xla.model(get_format(fmt), q.shape[-2], q.shape[-1], isa="AVX2")
        out[f"model{i}"] = model(q, k, v, causal=causal)
np.savez(sys.argv[3], **out)
"""


@pytest.mark.extended  # 60 s natively on an AVX2 host: each shape's probes and compiles
def test_the_avx2_code_is_modelled_as_an_avx2_cpu_runs_it(tmp_path):
    """XLA run as an AVX2 CPU (natively, or under qemu-user on an AVX-512 host,
    tests/lab.py), against ``model(..., isa="AVX2")`` in the same process: the
    model reads its dot orders from the program the CPU runs, so it runs where
    the AVX2 code does.  fp32 causal at an odd length, bf16 with 6 query heads on
    2 K/V heads (d = 96), fp16 op by op, and one query row per group over 300
    keys (XLA's own GEMVs, 8 lanes on AVX2).  A cap of ``--xla_cpu_max_isa`` on an
    AVX-512 host is no substitute: YNNPACK would still run its AVX-512 kernels."""
    from lab import run_as_avx2

    # (format, causal, q shape (B, H, N, d), K/V heads, M)
    cases = [
        ("fp32", True, (1, 2, 201, 40), 2, 201),
        ("bf16", True, (1, 6, 67, 96), 2, 67),
        ("fp16", False, (1, 2, 77, 40), 2, 77),
        ("fp32", False, (1, 8, 1, 64), 2, 300),
    ]
    arrays = {}
    for i, (fmt, _, shape, kv, m) in enumerate(cases):
        q = _inputs(shape, fa_jax.get_format(fmt), seed=i)[0]
        k, v = _inputs((shape[0], kv, m, shape[-1]), fa_jax.get_format(fmt), seed=10 + i)[:2]
        arrays.update({f"q{i}": q, f"k{i}": k, f"v{i}": v})
    np.savez(tmp_path / "in.npz", **arrays)
    spec = json.dumps([[fmt, causal] for fmt, causal, *_ in cases])
    out = tmp_path / "out.npz"
    run_as_avx2(_LAB_CHILD, spec, str(tmp_path / "in.npz"), str(out))
    with np.load(out) as got:
        assert str(got["isa"]) == "AVX2" and str(got["refusal"]) == ""
        for i, case in enumerate(cases):
            real, model = got[f"real{i}"], got[f"model{i}"]
            assert real.shape == model.shape == arrays[f"q{i}"].shape
            c = kernels.compare(real, model, real, case[0])
            assert c.identical_share == 1.0, f"{case}: {c.summary()}"
