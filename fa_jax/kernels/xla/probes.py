"""The order probes: the orders of XLA's dots read from the real program.

YNNPACK picks a dot kernel by the shape (google/XNNPACK,
``ynnpack/kernels/dot/generator/``: tile_k, how many FMA chains each output's
lanes keep), blocks the reduction over keys by a size it derives at run time
from the CPU's L2 cache, and cuts a dot of few rows into tasks over its columns
and blocks over its terms (``choose_split_factors``, ``ynnpack/subgraph/dot.cc``;
:func:`qk_split`), so neither XLA's program nor the shape alone gives them.  The
probes are FPRev-style: ±M pairs among small terms, whose counts in the output
tell which terms share an FMA chain or a block, checked against a simulation of
each candidate order (:func:`simulated_dot`, :func:`simulated_qk`), as the model
adds them (:mod:`~fa_jax.kernels.xla.orders`).

* Q Kᵀ (:func:`qk_order`): per key and task of keys, (pairs, tile_k, block);
  YNNPACK's reference kernel's rounded products told apart
  (:func:`_qk_rounded`); the last query rows checked (:func:`check_last_rows`);
* P V (:func:`pv_order`): tile_k and the block of keys per query, fp16 beyond
  2^14 keys with a mask (:func:`pv_sparse_probe_counts`);
* the keys whose S·scale - m fp32's causal program fuses into one FMA
  (:func:`fused_keys`), where the HLO shows a select between them
  (:func:`fma_step`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math

import jax.numpy as jnp
import numpy as np

from fa_jax.kernels.xla import calls, hlo
from fa_jax.kernels.xla.orders import permuted

__all__ = [
    "TILES_K",
    "check_last_rows",
    "fma_step",
    "fused_keys",
    "fused_probe_scores",
    "probe_p",
    "pv_order",
    "pv_predicted",
    "pv_probe_counts",
    "pv_sparse_probe_counts",
    "qk_candidates",
    "qk_order",
    "qk_probe_counts",
    "qk_runs",
    "qk_split",
    "simulated_dot",
    "simulated_qk",
]


_PROBE_BIG = 2.0**15  # M of a probe, exact in every format
_PROBE_SMALL = 2.0**-10  # the small terms: 2^-25 M, absorbed by ±M in float32
_PROBE_TERMS = 8  # small terms counted after the -M of a probe column
_PROBE_MAX_FP16_KEYS = 2**14  # beyond, fp16 outputs cannot count a uniform P's small terms


def pv_probe_counts(
    run, shape: tuple[int, ...], tests: list[int], m: int | None = None
) -> np.ndarray:
    """For each key j of ``tests`` and each query, the small terms counted by a P V
    probe: q = k = 0, so P is uniform (``run`` is the program without a mask), and
    V's column holds M at key 0, -M at key j and small terms on the next keys.
    All of them are counted where key j's product joins key 0's in one FMA chain
    (M - M cancels, then they add); fewer where the keys sit in different chains
    or blocks (those after j in j's chain are absorbed by -M).  ``m`` keys (N by
    default).  Returns (len(tests), N)."""
    bh, n, d = shape
    m = n if m is None else m
    zeros = np.zeros(shape, np.float32)
    kv_zeros = np.zeros((bh, m, d), np.float32)
    counts = np.zeros((len(tests), n), int)
    for start in range(0, len(tests), d):
        chunk = tests[start : start + d]
        v = np.zeros((bh, m, d), np.float32)
        for col, j in enumerate(chunk):
            v[:, 0, col] = _PROBE_BIG
            v[:, j, col] = -_PROBE_BIG
            v[:, j + 1 : j + 1 + _PROBE_TERMS, col] = _PROBE_SMALL
        out = np.asarray(run(zeros, kv_zeros, v), dtype=np.float64)
        counts[start : start + len(chunk)] = np.round(out[0, :, : len(chunk)].T * m / _PROBE_SMALL)
    return counts


_SPARSE_KEYS = 1024  # the keys a sparse P V probe keeps: P = 2^-10 on each


def pv_sparse_probe_counts(run, shape: tuple[int, ...], tests: list[int], m: int) -> np.ndarray:
    """:func:`pv_probe_counts` for fp16 beyond 2^14 keys, where a uniform P is too small
    for fp16's outputs to count the small terms: ``run``
    (:func:`~fa_jax.kernels.xla.calls.masked_grouped_call`) keeps only 1024 keys, the
    probe's and the first others (V zero there), so P is 2^-10 on them and 0 elsewhere;
    the dot's order is the same, its other products zero.  Returns (len(tests), N)."""
    bh, n, d = shape
    zeros = np.zeros(shape, np.float32)
    kv_zeros = np.zeros((bh, m, d), np.float32)
    counts = np.zeros((len(tests), n), int)
    width = min(d, (_SPARSE_KEYS - 1) // (1 + _PROBE_TERMS))
    for start in range(0, len(tests), width):
        chunk = tests[start : start + width]
        v = np.zeros((bh, m, d), np.float32)
        active = np.zeros(m, bool)
        active[0] = True
        for col, j in enumerate(chunk):
            v[:, 0, col] = _PROBE_BIG
            v[:, j, col] = -_PROBE_BIG
            v[:, j + 1 : j + 1 + _PROBE_TERMS, col] = _PROBE_SMALL
            active[j : j + 1 + _PROBE_TERMS] = True
        active[np.flatnonzero(~active)[: _SPARSE_KEYS - int(active.sum())]] = True
        keep = np.broadcast_to(active, (bh, n, m))
        out = np.asarray(run(zeros, kv_zeros, v, keep), dtype=np.float64)
        scaled = out[0, :, : len(chunk)].T * _SPARSE_KEYS / _PROBE_SMALL
        counts[start : start + len(chunk)] = np.round(scaled)
    return counts


TILES_K = (1, 2, 4, 8)  # the tile_k of YNNPACK's dot kernels (one, or lanes folded pairwise)


def simulated_dot(terms: np.ndarray, tile_k: int, block: int) -> np.ndarray:
    """The sums of the rows of ``terms`` (exact products, float32) in a dot's order:
    blocks of ``block`` terms, in each ``tile_k`` chains from zero folded pairwise,
    the block sums added in order, the last n mod tile_k terms one more chain
    added last; float32 arithmetic, as the kernel's."""
    rows, n = terms.shape
    rest = n % tile_k if n > tile_k else 0
    if rest:
        main = simulated_dot(terms[:, : n - rest], tile_k, block)
        return main + simulated_dot(terms[:, n - rest :], 1, rest)
    block = min(block, n)
    nb, steps = -(-n // block), -(-block // tile_k)
    x = np.zeros((rows, nb * steps * tile_k), np.float32)
    x[:, :n] = terms
    x = x.reshape(rows, nb, steps, tile_k)
    chains = np.zeros((rows, nb, tile_k), np.float32)
    for step in range(steps):
        chains = chains + x[:, :, step]
    while chains.shape[-1] > 1:
        chains = chains[..., 0::2] + chains[..., 1::2]
    total = chains[:, 0, 0]
    for b in range(1, nb):
        total = total + chains[:, b, 0]
    return total


def _pv_probe_terms(n: int, tests: list[int], p: float) -> np.ndarray:
    """The P V probes' products p·V (float32, exact), p the probes' uniform P."""
    terms = np.zeros((len(tests), n), np.float32)
    for row, j in enumerate(tests):
        terms[row, 0] = p * _PROBE_BIG
        terms[row, j] = -p * _PROBE_BIG
        terms[row, j + 1 : j + 1 + _PROBE_TERMS] = p * _PROBE_SMALL
    return terms


def pv_predicted(n: int, tests: list[int], p: float, tile_k: int, block: int) -> np.ndarray:
    """The counts :func:`pv_probe_counts` reads where the dot runs in this order."""
    sums = simulated_dot(_pv_probe_terms(n, tests, p), tile_k, block).astype(np.float64)
    return np.round(sums / (p * _PROBE_SMALL)).astype(int)


def probe_p(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: calls.Layout | None = None
) -> float:
    """The probes' uniform P: fl32(1 / M) (q = k = 0, every exp 1, the sum exact), and
    rounded to ``dtype`` where XLA keeps P's rounding (in ``layout``'s plain call)."""
    m = shape[1] if layout is None else layout.m
    p = np.float32(1.0) / np.float32(m)
    if hlo.p_rounded(dtype, shape, causal, None if layout is None else layout.plain()):
        p = np.asarray(p).astype(jnp.dtype(dtype)).astype(np.float32)
    return float(p)


@functools.cache
def pv_order(
    dtype: str, shape: tuple[int, ...], layout: calls.Layout | None = None
) -> tuple[tuple[int, int, int, int], ...]:
    """(tile_k, block) of the P V dot for (B·H, N, d) inputs, read from the real
    program with order-revealing probes (:func:`pv_probe_counts`).

    YNNPACK picks a dot kernel by the shape (tile_k: how many FMA chains each
    output's vector lanes keep, folded pairwise at the end) and blocks the
    reduction over keys by a size it derives at run time from the CPU's L2 cache
    and the kernel's tile, so neither XLA's program nor the shape alone gives
    them.  tile_k is the candidate whose simulated probes (:func:`simulated_dot`)
    match the real counts of keys 1 .. 8 against key 0; the block, a search over
    multiples of tile_k for the first key whose probe, with the one tile_k before
    it, no longer matches one block's prediction (a key alone can be the last of a
    block).  One block of N keys where N < 4.  With ``layout``, the grouped view's
    (B·H_kv, G·N, d) queries against its M keys, in its plain call.  fp16 beyond
    2^14 keys is probed with a mask (:func:`pv_sparse_probe_counts`), the 3-D
    call as the 4-D one it is (jax adds the batch axis)."""
    bh, n, d = shape
    m = n if layout is None else layout.m
    if m < 4:
        return ((0, n, 1, m),)
    if dtype == "float16" and m > _PROBE_MAX_FP16_KEYS:
        grouped = calls.Layout(1, bh, 1, n, n) if layout is None else layout
        probe = functools.partial(pv_sparse_probe_counts, calls.masked_grouped_call(grouped))
        p = 1.0 / _SPARSE_KEYS
    else:
        # The same dot as the causal (or masked) program's.
        plain = layout is None
        run = (
            calls.real_call(dtype, False, None)
            if plain
            else calls.grouped_call(dtype, layout.plain())
        )
        probe = functools.partial(pv_probe_counts, run)
        p = probe_p(dtype, shape, False, layout)
    first = list(range(1, min(m - 1, 9)))
    counts = probe(shape, first, m)
    predicted = {t: pv_predicted(m, first, p, t, m) for t in TILES_K}
    tiles = []
    for query in range(n):
        found = [t for t in TILES_K if np.array_equal(predicted[t], counts[:, query])]
        if not found:
            raise ValueError(
                f"xla: the P V probes of {shape} ({dtype}) at query {query} fit no modelled "
                f"dot order (tile_k in {TILES_K}): counts {counts[:, query].tolist()}"
            )
        tiles.append(found[0])
    # Per query: lo·tile_k is in key 0's block, hi·tile_k is not (or hi past the end).
    bounds = {query: (1, -(-(m - 1) // t)) for query, t in enumerate(tiles)}
    closed = {query: False for query in range(n)}
    while True:
        open_rows = [r for r in range(n) if bounds[r][1] - bounds[r][0] > 1]
        groups = sorted({(tiles[r], *bounds[r]) for r in open_rows})
        if not groups:
            break
        per_group = max(1, (d // 2) // len(groups))
        tests: list[int] = []
        plan = []  # (group, point, index of its first test)
        for t, lo, hi in groups:
            span = np.linspace(lo + 1, hi - 1, num=min(per_group, hi - lo - 1))
            for j in sorted({int(x) for x in span}):
                plan.append(((t, lo, hi), j, len(tests)))
                tests += [min((j - 1) * t, m - 1), min(j * t, m - 1)]
        got = probe(shape, tests, m)
        want = {t: pv_predicted(m, tests, p, t, m) for t, _, _ in groups}
        for query in range(n):
            t, lo, hi = tiles[query], *bounds[query]
            if hi - lo <= 1:
                continue
            mine = (t, lo, hi)  # the query's group; lo rises as its points match
            for group, j, at in plan:
                if group != mine or not lo < j < hi:
                    continue
                same = got[at : at + 2, query] == want[t][at : at + 2]
                if same.all():
                    lo = j
                else:
                    hi, closed[query] = j, True
                    break
            bounds[query] = (lo, hi)
    blocks = [bounds[r][1] * tiles[r] if closed[r] else m for r in range(n)]
    runs: list[tuple[int, int, int, int]] = []
    for query, (t, block) in enumerate(zip(tiles, blocks)):
        if runs and runs[-1][2:] == (t, block):
            runs[-1] = (runs[-1][0], query + 1, t, block)
        else:
            runs.append((query, query + 1, t, block))
    return tuple(runs)


_QK_UNIT = 2.0**-10  # q's unit terms; a probe key's row is 2^8, so each product is 1/4
_QK_KEY = 2.0**8


def qk_probe_counts(
    run,
    shape: tuple[int, ...],
    pairs: list[tuple[int, int]],
    keys: list[int],
    m: int | None = None,
    *,
    last: bool = False,
) -> np.ndarray:
    """For each (a, b) and each key of ``keys``, the count a Q Kᵀ probe reads: a
    query row holds M at term a, -M at term b and a unit elsewhere, each probe
    key's row is 2^8 everywhere, so S[i, key] is a quarter of the number of unit
    products not absorbed by ±M; the other keys are zero.  V sends each probe key
    to an output column of its own and one zero key (``_zero_key``) to another, so
    the ratio of the two is exp(S[i, key] · scale).  ``m`` keys (N by default).
    The probes fill the query rows from the first, or with ``last`` from the
    last one back.  Returns (len(pairs), len(keys))."""
    bh, n, d = shape
    m = n if m is None else m
    zero = _zero_key(m, keys)
    slots = [(b, i) for b in range(bh) for i in range(n)]
    if last:
        slots.reverse()
    scale = float(np.float32(1.0 / math.sqrt(d)))
    counts = np.zeros((len(pairs), len(keys)), int)
    for start in range(0, len(pairs), len(slots)):
        chunk = pairs[start : start + len(slots)]
        q = np.zeros(shape, np.float32)
        k = np.zeros((bh, m, d), np.float32)
        v = np.zeros((bh, m, d), np.float32)
        k[:, keys, :] = _QK_KEY
        v[:, zero, 0] = 1.0
        for col, key in enumerate(keys):
            v[:, key, col + 1] = 1.0
        for (b, i), (a, c) in zip(slots, chunk):
            q[b, i, :] = _QK_UNIT
            q[b, i, a] = _PROBE_BIG
            q[b, i, c] = -_PROBE_BIG
        out = np.asarray(run(q, k, v), dtype=np.float64)
        for row, ((b, i), _) in enumerate(zip(slots, chunk)):
            ratio = np.log(out[b, i, 1 : len(keys) + 1] / out[b, i, 0]) / scale
            counts[start + row] = np.round(ratio * 4)
    return counts


def _zero_key(n: int, keys: list[int]) -> int:
    """A key outside ``keys`` (its S is zero in a Q Kᵀ probe), as early as possible."""
    return min(set(range(n)) - set(keys))


_QK_TAIL = 64  # the last keys probed one by one: a dot kernel's column remainder


def qk_split(rows: int, m: int, d: int) -> int:
    """The keys of each task YNNPACK cuts a dot of ``rows`` rows, ``m`` columns
    (keys) and ``d`` terms into (``choose_split_factors``, ynnpack/subgraph/dot.cc:
    a tile grown from 16 rows by one column block, doubled, until its cost (rows +
    columns) · min(d, 1024) reaches 64 Ki or its area 64 Ki; the block's width, a
    power of two, does not change the result).  Each task runs the dot kernel on its
    own columns, so the last task, narrower where m is no multiple of the width,
    gets an order of its own (:func:`qk_order`)."""
    k = min(d, 1024)
    least = max(min(rows, 64) * min(m, 64), 256)
    cols, tile_rows = min(m, 16), min(rows, 16)
    while True:
        if cols * tile_rows >= least and (
            (tile_rows + cols) * k >= 1024 * 64 or tile_rows * cols >= 256 * 256
        ):
            break
        if (4 * cols <= tile_rows or tile_rows >= rows) and cols < m:
            cols *= 2
        elif (tile_rows <= 4 * cols or cols >= m) and tile_rows < rows:
            tile_rows *= 2
        else:
            break
    return min(cols, 65536)


_QK_ROUNDING = (2.0**20, -(2.0**20) * (1 + 2.0**-12), 2.0**5)  # q's first three terms
_QK_ROUNDING_KEY = (1.0, 1 + 2.0**-12, 2.0**4)  # a probe key's


def _qk_rounded(run, shape: tuple[int, ...], keys: list[int], m: int) -> np.ndarray:
    """For each key of ``keys``, whether its Q Kᵀ products are rounded before they
    are added (in order) rather than fused into the sum: the three products 2^20,
    -2^20 (1 + 2^-11 + 2^-24) and 2^9 sum to -2^-4 with FMAs; rounded, the second
    is a tie that goes to -2^20 (1 + 2^-11), and the sum is 0 (Higham 2002, §2.6).
    The other keys and terms are zero; V reads S as :func:`qk_probe_counts` does."""
    bh, _, d = shape
    zero = _zero_key(m, keys)
    q = np.zeros(shape, np.float32)
    k = np.zeros((bh, m, d), np.float32)
    v = np.zeros((bh, m, d), np.float32)
    q[..., :3] = _QK_ROUNDING
    k[:, keys, :3] = _QK_ROUNDING_KEY
    v[:, zero, 0] = 1.0
    for col, key in enumerate(keys):
        v[:, key, col + 1] = 1.0
    out = np.asarray(run(q, k, v), dtype=np.float64)
    scale = float(np.float32(1.0 / math.sqrt(d)))
    s = np.log(out[..., 1 : len(keys) + 1] / out[..., :1]) / scale
    return np.asarray((np.abs(s) < 2.0**-5).all(axis=(0, 1)))


def qk_candidates(dtype: str, d: int, pairs, counts: np.ndarray) -> list[tuple[bool, int, int]]:
    """The (pairs, tile_k, block) orders whose simulated probes give ``counts``: one
    block of d terms first; where none fits, the reduction cut into blocks of the
    smallest size that fits.  Keys that read alike share the search."""
    read = tuple(int(c) for c in counts)
    return list(_qk_candidates_of(dtype, d, tuple(map(tuple, pairs)), read))


@functools.cache
def _qk_candidates_of(
    dtype: str, d: int, pairs: tuple, counts: tuple[int, ...]
) -> tuple[tuple[bool, int, int], ...]:
    terms = np.full((len(pairs), d), 0.25, np.float32)
    big = np.float32(_PROBE_BIG * _QK_KEY)
    for row, (a, b) in enumerate(pairs):
        terms[row, a], terms[row, b] = big, -big

    def fits(swap: bool, t: int, block: int) -> bool:
        return np.array_equal(4 * simulated_qk(terms, (swap, t, block)), np.asarray(counts))

    swaps = (dtype == "bfloat16", dtype != "bfloat16")
    whole = [(swap, t, d) for swap in swaps for t in TILES_K if fits(swap, t, d)]
    if whole:
        return tuple(whole)
    for block in range(1, d):
        found = [
            (swap, t, block)
            for swap in swaps
            for t in TILES_K
            if t <= block and fits(swap, t, block)
        ]
        if found:
            return tuple(found)
    return ()


def simulated_qk(terms: np.ndarray, order: tuple[bool, int, int]) -> np.ndarray:
    """The sums of the rows of ``terms`` (exact products, float32) in the Q Kᵀ order
    (pairs, tile_k, block) as :func:`~fa_jax.kernels.xla.orders.qk_dot` adds them: the
    terms permuted, the last d mod tile_k added last, the rest cut into blocks of
    ``block`` terms, each a dot of its own (:func:`simulated_dot`, its own remainder
    where tile_k does not divide the block), the block sums added in order."""
    swap, tile_k, block = order
    n = terms.shape[1]
    terms = terms[:, permuted(n, swap)]
    rest = n % tile_k if n > tile_k else 0
    main = terms[:, : n - rest]
    parts = [
        simulated_dot(main[:, lo : lo + block], tile_k, block) for lo in range(0, n - rest, block)
    ]
    if rest:
        parts.append(simulated_dot(terms[:, n - rest :], 1, rest))
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


@functools.cache
def qk_order(
    dtype: str, shape: tuple[int, ...], layout: calls.Layout | None = None
) -> tuple[tuple[bool, int, int], ...]:
    """The order of each key's Q Kᵀ dots for (B·H, N, d) inputs, one (pairs, tile_k,
    block) per key, read from the real program with order-revealing probes
    (:func:`qk_probe_counts`): for key 0 and each of the last keys, the
    candidate (terms in pairs, odd first, as AVX-512 BF16's dot instruction adds
    them, or in order; tile_k chains folded pairwise) whose simulated probes match
    the real counts of every pair among the first 16 terms and the last ones.
    YNNPACK runs the last columns of a dot (the keys past its last full tile)
    with a kernel of a narrower tile, whose tile_k can differ; the probes find
    them without knowing the tile.  Where a dot has few rows (decoding shapes)
    YNNPACK also cuts the reduction over d into blocks, each summed from zero and
    the block sums added in order, by a size its schedule picks (at 16 queries and
    d = 128: 64 terms at key 0, 66 at the last keys); pairs of term 0 with every
    other find them.  With ``layout``, the grouped view's M keys, in its plain
    call."""
    _, n, d = shape
    m = n if layout is None else layout.m
    if d < 2 or m < 3 or n < 2:
        return ((dtype == "bfloat16", 1, d),) * m
    # The same dot as the causal (or masked) program's.
    run = (
        calls.real_call(dtype, False, None)
        if layout is None
        else calls.grouped_call(dtype, layout.plain())
    )
    head = range(min(d, 16))
    tail = range(max(0, d - 5), d)
    pairs = sorted({(a, b) for a in (*head, *tail) for b in (*head, *tail) if a < b})
    # Term 0 against every other: where the reduction is cut into blocks.
    pairs = sorted({*pairs, *((0, b) for b in range(1, d))})
    # Key 0, the first of the last task (:func:`qk_split`), and the last keys.
    last = (m - 1) // qk_split(n, m, d) * qk_split(n, m, d)
    probed = sorted({0, last, *range(max(2, m - _QK_TAIL), m)} - {1})  # 1: the zero key
    width = max(1, min(d - 1, m // 2))
    orders: dict[int, tuple[bool, int, int]] = {}
    read: dict[int, np.ndarray] = {}
    for start in range(0, len(probed), width):
        keys = probed[start : start + width]
        counts = qk_probe_counts(run, shape, pairs, keys, m)
        for col, key in enumerate(keys):
            read[key] = counts[:, col]
            found = qk_candidates(dtype, d, pairs, counts[:, col])
            if not found:
                raise ValueError(
                    f"xla: the Q Kᵀ probes of {shape} ({dtype}) at key {key} fit no "
                    f"modelled dot order: counts {counts[:, col].tolist()} for pairs {pairs}"
                )
            orders[key] = found[0]
    check_last_rows(run, shape, dtype, pairs, read, m)
    # One float32 chain over all d terms may be YNNPACK's reference kernel, whose
    # products are rounded (a task narrower than a column block): told apart here.
    whole = [key for key in probed if orders[key] == (False, 1, d)]
    if dtype == "float32" and d >= 3:
        for start in range(0, len(whole), width):
            keys = whole[start : start + width]
            for key, rounded in zip(keys, _qk_rounded(run, shape, keys, m)):
                if rounded:
                    orders[key] = (False, 0, d)
    first = max(2, m - _QK_TAIL)  # the last keys, probed one by one
    if dtype == "float16":
        orders.update(_qk_interior(run, shape, pairs, m, first, orders[0]))
    known = sorted(orders)  # each key takes the order of the nearest key probed below it
    return tuple(orders[known[bisect.bisect_right(known, j) - 1]] for j in range(m))


def check_last_rows(
    run, shape: tuple[int, ...], dtype: str, pairs: list, read: dict[int, np.ndarray], m: int
) -> None:
    """A ValueError where the dot's last query rows, which the probes of
    :func:`qk_order` (filling the rows from the first) did not reach, read
    another order than the first rows at key 0 and the last key probed: YNNPACK
    can run a remainder of rows with another kernel (on a Xeon with AMX, the last
    2 of 175 rows, d = 35, with AVX-512 BF16's pairs), and the model gives every
    row of a key one order."""
    bh, n, _ = shape
    if bh * n <= len(pairs):
        return
    ends = sorted({0, max(read)})
    tail = qk_probe_counts(run, shape, pairs, ends, m, last=True)
    for col, key in enumerate(ends):
        if not np.array_equal(tail[:, col], read[key]):
            raise ValueError(
                f"xla: the last query rows of {shape} ({dtype}) add Q Kᵀ in another order "
                f"than the first at key {key} (YNNPACK runs a remainder of rows with "
                "another kernel), which the model does not follow"
            )


_QK_STRIDE = 64  # the keys sampled between key 0 and the last ones (fp16)


def _qk_interior(
    run, shape: tuple[int, ...], pairs: list, m: int, first: int, order0: tuple[bool, int, int]
) -> dict[int, tuple[bool, int, int]]:
    """The orders of fp16's Q Kᵀ keys between key 0 and ``first`` (the last keys,
    probed one by one), where they differ from key 0's ``order0``: YNNPACK splits a
    dot of few rows over its columns too, and cuts the reduction of each part by a
    size of its own (at 24 rows, d = 64 and 3000 keys: blocks of 32 terms for
    keys 0 to 2047, 34 from 2048).  Every 64th key is read with the pairs of term
    0 and every other (which pin the cut and tile_k); between two that read
    differently every key is, and so are those after the last 64th key; one key
    of each reading that differs from key 0's is then probed with all of
    ``pairs`` (:func:`qk_order`).  Keys map to their order where it changes (the
    keys above take it)."""
    _, _, d = shape
    cut = [(0, b) for b in range(1, d)]
    width = max(1, min(d - 1, m // 2))

    def read(keys: list[int]) -> dict[int, tuple[int, ...]]:
        got = {}
        for start in range(0, len(keys), width):
            group = keys[start : start + width]
            counts = qk_probe_counts(run, shape, cut, group, m)
            got.update({key: tuple(counts[:, col]) for col, key in enumerate(group)})
        return got

    samples = list(range(_QK_STRIDE, first, _QK_STRIDE))
    if not samples:
        return {}
    seen = read([0, *samples])
    bounds = [0, *samples]
    for lo, hi in itertools.pairwise(bounds):
        if seen[lo] != seen[hi]:
            seen.update(read([j for j in range(lo + 1, hi) if j != 1]))
    # The keys up to the last ones, whose orders are not read so.
    seen.update(read(list(range(samples[-1] + 1, first))))
    classes = {seen[0]: order0}
    reps = sorted({sig: key for key, sig in sorted(seen.items(), reverse=True)}.items())
    reps = [(sig, key) for sig, key in reps if sig not in classes]
    for start in range(0, len(reps), width):
        group = reps[start : start + width]
        counts = qk_probe_counts(run, shape, pairs, [key for _, key in group], m)
        for col, (sig, key) in enumerate(group):
            found = qk_candidates("float16", d, pairs, counts[:, col])
            if not found:
                raise ValueError(
                    f"xla: the Q Kᵀ probes of {shape} (float16) at key {key} fit no "
                    f"modelled dot order: counts {counts[:, col].tolist()} for pairs {pairs}"
                )
            classes[sig] = found[0]
    keys = sorted(seen)
    return {
        key: classes[seen[key]]
        for prev, key in zip([None, *keys], keys)
        if prev is None or classes[seen[key]] != classes[seen[prev]]
    }


@functools.cache
def fma_step(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: calls.Layout | None = None
) -> str | tuple[int, ...] | None:
    """:func:`~fa_jax.kernels.xla.hlo.contracted` for the program of (B·H, N, d) inputs (or
    ``layout``'s call), a select resolved to the keys where it is folded
    (:func:`fused_keys`; a causal mask's alone: the others' conditions are data); None
    for fp16, whose steps run eagerly, each a program of its own."""
    if dtype == "float16":
        return None
    step = hlo.contracted(hlo.program_text(dtype, shape, causal, layout))
    if step != "select":
        return step
    causal_only = layout is None or layout == layout.plain()
    # bf16's outputs are too coarse to read the shift; its softmax runs the same
    # float32 loop fusion as fp32's, which the probe reads instead.
    keys = fused_keys(shape, layout) if causal and causal_only else ()
    m = shape[-2] if layout is None else layout.m
    # The probe reads every key but the last (its maximum): all of them fused is all.
    return "subtract" if len(keys) == m - 1 > 0 else keys or None


_FUSED_SCORE = 2.0**10  # about the largest scaled score of :func:`fused_keys`' probe


def fused_probe_scores(scale: float) -> tuple[float, float, float, float]:
    """(S, S', d_rounded, d_fused) of :func:`fused_keys`' probe: S' = 2^k with S'·scale
    (exact) near 2^10, and S = S' - t·ulp (t > 0, a float32) whose S·scale has the
    largest rounding error r; the shift fl(S·scale) - S'·scale (rounded) and
    S·scale - S'·scale (fused, to within r's own rounding)."""
    top = 2.0 ** round(math.log2(_FUSED_SCORE / scale))
    exact = top * scale
    below = top * 2.0**-24  # float32's spacing just below top
    best = (0.0, 0.0, 0.0)
    for t in range(1, 64):
        x = top - t * below
        rounded = float(np.float32(x * scale)) - exact
        if abs(x * scale - exact - rounded) > abs(best[2]):
            best = (x, rounded, x * scale - exact - rounded)
    x, rounded, error = best
    return x, top, rounded, rounded + error


def fused_keys(shape: tuple[int, ...], layout: calls.Layout | None) -> tuple[int, ...]:
    """The keys whose S·scale - m fp32's real causal program computes with one rounding
    (an FMA), read from the last query row: LLVM folds the causal select where it
    proves a key kept (key 0 of a loop it unrolls: i >= 0), then fuses.

    The probe (:func:`fused_probe_scores`): the last key's score S'·scale is the
    row's maximum m, exact; every other key's S·scale is not, so its shift
    fl(S·scale) - m and the fused S·scale - m differ by the product's rounding
    error.  V sends each key to a column of its own (the last key to column d - 1),
    so P_j / P_last = exp(shift_j) tells which shift key j took."""
    bh, n, d = shape
    m = n if layout is None else layout.m
    scale = float(np.float32(1.0 / math.sqrt(d)))
    x, top, rounded, fused = fused_probe_scores(scale)
    run = (
        calls.real_call("float32", True, None)
        if layout is None
        else calls.grouped_call("float32", layout, True)
    )
    found = []
    width = d - 1
    for lo in range(0, m - 1, width):
        keys = np.arange(lo, min(lo + width, m - 1))
        q = np.zeros(shape, np.float32)
        q[..., 0], q[..., 1] = x, top
        k = np.zeros((bh, m, d), np.float32)
        k[:, :, 0] = 1.0
        k[:, m - 1] = 0.0
        k[:, m - 1, 1] = 1.0
        v = np.zeros((bh, m, d), np.float32)
        v[:, keys, keys - lo] = 1.0
        v[:, m - 1, d - 1] = 1.0
        out = np.asarray(run(q, k, v), dtype=np.float64)[0, -1]
        shift = np.log(out[: len(keys)] / out[d - 1])
        found += [int(j) for j, s in zip(keys, shift) if abs(s - fused) < abs(s - rounded)]
    return tuple(found)


def qk_runs(dtype: str, shape: tuple[int, ...], layout: calls.Layout | None = None):
    """:func:`qk_order` as runs (:func:`_runs`)."""
    return _runs(qk_order(dtype, shape, layout))


def _runs(orders) -> tuple[tuple[int, int, bool, int, int], ...]:
    """Per-key orders as runs (first key, key past the last, pairs, tile_k, block)."""
    runs: list[tuple[int, int, bool, int, int]] = []
    for j, order in enumerate(orders):
        if runs and runs[-1][2:] == tuple(order):
            runs[-1] = (runs[-1][0], j + 1, *order)
        else:
            runs.append((j, j + 1, *order))
    return tuple(runs)
