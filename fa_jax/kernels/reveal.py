"""Reveal the accumulation order of a black-box sum or dot product.

After FPRev (Xie et al., "Revealing Floating-Point Accumulation Orders in
Software/Hardware Implementations", USENIX ATC 2025).  A probe sums n terms
that are all 1 except a large ``M`` at term i and ``-M`` at term j.  Every 1
added into the partial sum holding ``M`` (or ``-M``) before the two meet is
absorbed; at the node where i and j meet, ``M - M`` cancels exactly and the
other terms are counted exactly.  So the probe returns
``n - |c_i| - |c_j|``, where ``c_i`` and ``c_j`` are the children of that node
holding i and j (for a binary node, the node's own size).

From one term p, the values for every other q sort the terms by the ancestor
of p where they join it: a binary ancestor adds one subtree of size
``z_k - z_{k-1}``; a fused node (several terms joined at once, rounded once)
adds several children, told apart by probes among them.  Each subtree is
rebuilt the same way (:func:`reveal_order`).  The result is a tree
:class:`~fa_jax.accumulation.Accumulation`, replaced by a builder
(``lanes(8)``, ...) when one gives the same tree (:func:`identify`), so the
model then serves any n.  For a dot product the probes' products are exact,
so how each product enters its chain (a fused multiply-add loop from zero,
exactly, or rounded by a multiply first) is chosen by emulating random
products with fa_jax (:func:`reveal_dot_order`, :func:`reveal_matmul_order`).

What the probes cannot see: a fused node with children of sizes that a
nesting of smaller nodes also explains (e.g. one node over (p, q, (r + s)) and
((p + q), r, s) give the same values); the reading with the most nesting is
returned.  A sum whose outputs fit no tree (not a sum, data-dependent or
non-deterministic orders, an accumulator that does not absorb the ones, such
as FP32 for FP16 inputs) raises ValueError.  Counts beyond the output format's
integers (more than 256 terms for a bfloat16 result) are measured in several
probes, each with ones on a subset of the terms and zeros elsewhere.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import jax
import ml_dtypes
import numpy as np

from fa_jax import ops
from fa_jax._checks import positive_int
from fa_jax._x64 import float64_enabled
from fa_jax.accumulation import (
    Accumulation,
    blocked,
    fma_chains,
    fused,
    halves,
    halving,
    lanes,
    pairwise,
    rounded_products,
    sequential,
    split_k,
    tree,
    tree_nodes,
    vector,
)
from fa_jax.formats import FP32, get_format

__all__ = [
    "PRODUCTS",
    "candidates",
    "identify",
    "predicted_probes",
    "product_variants",
    "reveal_dot_order",
    "reveal_matmul_order",
    "reveal_order",
    "same_tree",
]

_VERIFY = 256  # random pairs probed afresh to check the tree


class _Prober:
    """Runs probes on ``fn`` and caches s(i, j) = |c_i| + |c_j| = n - result."""

    def __init__(self, fn, n: int, dtype, out_dtype, batched: bool):
        self.fn, self.n, self.batched = fn, n, batched
        self.dtype = np.dtype(dtype)
        info = ml_dtypes.finfo(self.dtype)
        self.big = float(2.0 ** (int(info.maxexp) - 2))
        cap = 2 ** (int(ml_dtypes.finfo(np.dtype(out_dtype or dtype)).nmant) + 1)
        self.groups = [np.arange(n)[g : g + cap] for g in range(0, n, cap)]
        self.cache: dict[tuple[int, int], int] = {}
        self.calls = 0

    def _run(self, rows: np.ndarray) -> np.ndarray:
        self.calls += 1
        x = rows.astype(self.dtype)
        if self.batched:
            out = np.asarray(self.fn(x), np.float64).reshape(-1)
        else:
            out = np.array([float(np.asarray(self.fn(r), np.float64)) for r in x])
        if out.shape != (len(x),):
            raise ValueError(f"reveal: expected {len(x)} sums from fn, got shape {out.shape}")
        return out

    def measure(self, pairs: Sequence[tuple[int, int]]) -> np.ndarray:
        """s for each pair, run afresh."""
        pairs_arr = np.asarray(pairs, np.int64).reshape(-1, 2)
        total = np.zeros(len(pairs_arr))
        rows = np.arange(len(pairs_arr))
        for group in self.groups:
            x = np.zeros((len(pairs_arr), self.n))
            x[:, group] = 1.0
            x[rows, pairs_arr[:, 0]] = self.big
            x[rows, pairs_arr[:, 1]] = -self.big
            total += self._run(x)
        s = self.n - total
        if not np.all((s == np.round(s)) & (s >= 2) & (s <= self.n)):
            bad = int(np.argmax(~((s == np.round(s)) & (s >= 2) & (s <= self.n))))
            raise ValueError(
                f"reveal: the outputs fit no summation tree: terms {tuple(pairs_arr[bad])} "
                f"= (M, -M) among ones gave {self.n - s[bad]!r}, expected an integer count "
                f"in 0 .. {self.n - 2} (not a sum, or the accumulator does not absorb the ones)"
            )
        return s.astype(np.int64)

    def s(self, p: int, qs: Iterable[int]) -> dict[int, int]:
        """s(p, q) for each q (cached; the missing ones in one batch)."""
        qs = list(qs)
        missing = [q for q in qs if (min(p, q), max(p, q)) not in self.cache]
        if missing:
            for q, v in zip(missing, self.measure([(p, q) for q in missing])):
                self.cache[(min(p, q), max(p, q))] = int(v)
        return {q: self.cache[(min(p, q), max(p, q))] for q in qs}


def _inconsistent(what: str) -> ValueError:
    return ValueError(f"reveal: the outputs fit no summation tree: {what}")


def _build(prober: _Prober, leaves: list[int]):
    """The nested tree over ``leaves`` (one subtree's terms), from its first term up."""
    if len(leaves) == 1:
        return leaves[0]
    p, rest = leaves[0], leaves[1:]
    s = prober.s(p, rest)
    by_value = collections.defaultdict(list)
    for q in rest:
        by_value[s[q]].append(q)
    node, z = p, 1
    for v in sorted(by_value):
        group = by_value[v]
        w = v - z  # the size of each subtree joining p's side here
        if w < 1 or len(group) % w:
            raise _inconsistent(
                f"{len(group)} terms join term {p}'s subtree of {z} terms with s = {v}"
            )
        children = _partition(prober, group, w)
        node = (node, *(_build(prober, c) for c in children))
        z += len(group)
    return node


def _partition(prober: _Prober, group: list[int], w: int) -> list[list[int]]:
    """Split ``group`` into the subtrees of ``w`` terms it holds (same subtree:
    s <= w; different children of one node: s = 2 w)."""
    if w == 1:
        return [[q] for q in group]
    if len(group) == w:
        return [group]
    parts = []
    while group:
        q0, others = group[0], group[1:]
        s = prober.s(q0, others)
        part = [q0] + [q for q in others if s[q] <= w]
        if len(part) != w or any(s[q] not in range(2, w + 1) and s[q] != 2 * w for q in others):
            raise _inconsistent(f"term {q0}'s subtree should hold {w} terms, found {len(part)}")
        parts.append(part)
        group = [q for q in others if s[q] > w]
    return parts


def predicted_probes(model, n: int, pairs: Sequence[tuple[int, int]]) -> np.ndarray:
    """What the probe of each pair (i, j) returns under ``model``'s tree over n
    terms: n - |c_i| - |c_j| (module docstring)."""
    nodes = tree_nodes(model, n)
    parent = [-1] * (n + len(nodes))
    size = [1] * n + [0] * len(nodes)
    depth = [0] * (n + len(nodes))
    for k, node in enumerate(nodes):
        for c in node:
            parent[c] = n + k
            size[n + k] += size[c]
    for v in range(n + len(nodes) - 2, -1, -1):  # parents come after their children
        depth[v] = depth[parent[v]] + 1
    out = []
    for i, j in pairs:
        a, b = i, j
        while depth[a] > depth[b]:
            a = parent[a]
        while depth[b] > depth[a]:
            b = parent[b]
        while parent[a] != parent[b]:
            a, b = parent[a], parent[b]
        if a == b:
            raise ValueError(f"predicted_probes: expected two different terms, got {(i, j)}")
        out.append(n - size[a] - size[b])
    return np.asarray(out, np.int64)


def candidates(n: int) -> list[Accumulation]:
    """The builders :func:`identify` tries, simplest first."""
    found: list[Accumulation] = [sequential(), pairwise(), halving(), fused()]
    for k in (2, 4, 8, 16, 32):
        found.append(sequential(k))
    for width in (2, 4, 8, 16, 32, 64):
        if width < n:
            for combine in ("halving", "pairwise", "sequential"):
                found.append(lanes(width, combine))
                found.append(vector(width, combine))
    found.append(halves(128, vector(8, "pairwise"), align=8))  # NumPy's pairwise sum
    for parts in (2, 3, 4, 8):
        if parts < n:
            found.extend(split_k(parts, inner) for inner in ("sequential", "pairwise"))
    for size in (8, 16, 32, 64, 96, 128, 192, 256, 384, 512):
        if size < n:
            for inner in ("sequential", "pairwise"):
                found.append(blocked(size, inner))
            for width in (2, 4, 8, 16):
                if width < size:
                    found.extend(blocked(size, lanes(width, c)) for c in ("halving", "pairwise"))
    return found


def _shape(model, n: int) -> frozenset:
    """The tree up to the order of each node's children (additions commute): the
    set of nodes, each the sorted (first term, size) of its children."""
    nodes = tree_nodes(model, n)
    first, size = list(range(n)), [1] * n
    shape = set()
    for node in nodes:
        first.append(min(first[c] for c in node))
        size.append(sum(size[c] for c in node))
        shape.add(tuple(sorted((first[c], size[c]) for c in node)))
    return frozenset(shape)


def same_tree(a, b, n: int) -> bool:
    """Whether two models sum n terms by the same tree, up to the order of each
    node's children (fl(x + y) = fl(y + x); a fused node's sum is symmetric)."""
    return _shape(a, n) == _shape(b, n)


def identify(model, n: int, among: Iterable[Accumulation] | None = None) -> Accumulation | None:
    """The first of ``among`` (default :func:`candidates`) that sums n terms by
    ``model``'s tree (:func:`same_tree`), or None."""
    shape = _shape(model, n)
    for candidate in candidates(n) if among is None else among:
        if _shape(candidate, n) == shape:
            return candidate
    return None


def _sorted_children(nested):
    """``nested`` with each node's children ordered by their first term."""
    built: dict[int, tuple[int, object]] = {}
    stack: list[tuple[object, bool]] = [(nested, False)]
    while stack:
        item, done = stack.pop()
        if not isinstance(item, tuple):
            built[id(item)] = (cast(int, item), item)
        elif done:
            kids = sorted((built[id(c)] for c in item), key=lambda fk: fk[0])
            built[id(item)] = (kids[0][0], tuple(k for _, k in kids))
        else:
            stack.append((item, True))
            stack.extend((c, False) for c in item)
    return built[id(nested)][1]


def reveal_order(
    fn: Callable[[np.ndarray], object],
    n: int,
    *,
    dtype=np.float32,
    out_dtype=None,
    batched: bool = False,
    among: Iterable[Accumulation] | None = None,
) -> Accumulation:
    """The summation tree of ``fn``, a sum of n values (module docstring).

    Args:
      fn: takes a numpy array of n values of ``dtype`` and returns their sum (a
        scalar convertible to float); with ``batched``, takes (B, n) and returns
        the B sums of the rows, each summed in the same order.
      n: the number of terms (>= 2).
      dtype: the input values' dtype (numpy or ml_dtypes, e.g. ml_dtypes.bfloat16).
      out_dtype: the result's format, if narrower than ``dtype``'s (it bounds
        the counts one probe can return).
      among: builders to try before returning an explicit tree (:func:`identify`).

    Returns:
      A tree Accumulation: a builder if one gives the same tree for n, else
      :func:`fa_jax.accumulation.tree` of the revealed nested tuples.

    Raises:
      ValueError: the outputs fit no summation tree.
    """
    n = positive_int(n, "reveal_order: n")
    if n < 2:
        raise ValueError(f"reveal_order: n: expected at least 2 terms, got {n}")
    prober = _Prober(fn, n, dtype, out_dtype, batched)
    ones = np.ones((2, n))
    ones[1, 0] = prober.big
    total, absorbed = prober._run(ones)
    if n <= 2 ** (int(ml_dtypes.finfo(np.dtype(out_dtype or dtype)).nmant) + 1) and total != n:
        raise _inconsistent(f"the sum of {n} ones gave {total!r}")
    if absorbed != prober.big:
        raise ValueError(
            f"reveal: M = {prober.big!r} (the largest power of two the probes can use in "
            f"{prober.dtype}) does not absorb the other {n - 1} ones (their sum gave "
            f"{absorbed!r}): the accumulator is too wide for these probes"
        )
    model = tree(_sorted_children(_build(prober, list(range(n)))))
    _verify(prober, model, n)
    return identify(model, n, among) or model


def _verify(prober: _Prober, model: Accumulation, n: int) -> None:
    """Check the tree against cached probes and fresh random ones (run twice)."""
    rng = np.random.default_rng(0)
    cached = list(prober.cache.items())
    if len(cached) > 4 * _VERIFY:
        cached = [cached[i] for i in rng.choice(len(cached), 4 * _VERIFY, replace=False)]
    i = rng.integers(0, n, _VERIFY)
    j = (i + rng.integers(1, n, _VERIFY)) % n
    fresh = list(zip(i.tolist(), j.tolist()))
    first, again = prober.measure(fresh), prober.measure(fresh)
    if not np.array_equal(first, again):
        raise _inconsistent("the same probes gave different results (non-deterministic)")
    pairs = [p for p, _ in cached] + fresh
    seen = np.array([s for _, s in cached] + list(first), np.int64)
    want = n - predicted_probes(model, n, pairs)
    bad = np.flatnonzero(seen != want)
    if bad.size:
        k = int(bad[0])
        raise _inconsistent(
            f"the probe of terms {pairs[k]} gave s = {seen[k]}, the rebuilt tree {want[k]}"
        )


PRODUCTS = ("fma", "exact", "rounded")
_DRAWS = 8  # random products a revealed dot's variant is checked on


@functools.partial(jax.jit, static_argnums=(2, 3))
def _emulate(a, b, model: Accumulation, out):
    return ops.cast(ops.matmul(a, b, FP32, accumulation=model), out)


def product_variants(model: Accumulation) -> dict[str, Accumulation]:
    """How the products may enter a revealed dot's tree: "fma" (chains of fused
    multiply-adds from a zero accumulator: a chain's first product is rounded,
    the others join exactly; :func:`~fa_jax.accumulation.fma_chains`), "exact"
    (every product joins exactly) or "rounded" (every product rounded first: a
    multiply, then an add; :func:`~fa_jax.accumulation.rounded_products`).

    A mixture fits none: e.g. NumPy's float32 dot of fewer than 64 terms, whose
    32 lanes then hold one product each (rounded) beside an FMA tail."""
    return {"fma": fma_chains(model), "exact": model, "rounded": rounded_products(model)}


def _choose_products(model: Accumulation, products: str, a, b, real, out_dtype) -> Accumulation:
    """The product variant that reproduces ``real`` (rows of a @ b) bit for bit,
    emulated with an FP32 accumulator rounded to ``out_dtype``; or the one named."""
    variants = product_variants(model)
    if products != "auto":
        if products not in variants:
            raise ValueError(
                f"reveal: products: expected 'auto' or one of {PRODUCTS}, got {products!r}"
            )
        return variants[products]
    out = get_format(np.dtype(out_dtype).name)
    with float64_enabled():
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        for variant in variants.values():
            got = _emulate(a64, b64, variant, out)
            if np.array_equal(np.asarray(got), np.asarray(real, np.float64)):
                return variant
    raise ValueError(
        f"reveal: no way of entering the products ({', '.join(PRODUCTS)}) into {model} "
        "reproduces the dot on random inputs with an FP32 accumulator"
    )


def reveal_dot_order(
    fn: Callable[[np.ndarray, np.ndarray], object],
    n: int,
    *,
    dtype=np.float32,
    out_dtype=None,
    batched: bool = False,
    products: str = "auto",
    among: Iterable[Accumulation] | None = None,
) -> Accumulation:
    """The order in which ``fn(a, b)``, a dot product of two length-n vectors,
    adds its n products: the probe pattern in ``a``, ones in ``b`` (batched: a
    is (B, n), b (n,), fn returns the B dots).

    The probes' products are exact, so they cannot tell how a product enters
    the tree (:func:`product_variants`): with ``products="auto"`` the variant
    that reproduces ``fn`` on random inputs with an FP32 accumulator is
    returned (ValueError if none does); or name one.  Other arguments as
    :func:`reveal_order`."""
    ones = np.ones(n, np.dtype(dtype))
    model = reveal_order(
        lambda x: fn(x, ones),
        n,
        dtype=dtype,
        out_dtype=out_dtype,
        batched=batched,
        among=among,
    )
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((2 * _DRAWS, n)).astype(np.dtype(dtype)) for _ in range(2))
    if batched:
        real = np.concatenate([np.asarray(fn(x[None], y), np.float64) for x, y in zip(a, b)])
    else:
        real = np.array([float(np.asarray(fn(x, y), np.float64)) for x, y in zip(a, b)])
    return _choose_products(
        model, products, a[:, None, :], b[..., None], real[:, None, None], out_dtype or dtype
    )


def reveal_matmul_order(
    matmul: Callable[[np.ndarray, np.ndarray], object],
    k: int,
    *,
    m: int = 1,
    p: int = 1,
    dtype=np.float32,
    out_dtype=None,
    row: int | None = 0,
    col: int = 0,
    products: str = "auto",
    among: Iterable[Accumulation] | None = None,
) -> Accumulation:
    """The order in which ``matmul(A, B)`` (A (m, k), B (k, p), returning (m, p))
    adds the k products of output element (row, col).

    B is all ones; the probe pattern goes in row ``row`` of A (the other rows
    ones), one matmul per probe.  With ``row=None`` every row of A carries a
    probe of its own and column ``col`` is read: m probes a call, for kernels
    whose rows all share one order (not so in OpenBLAS's sgemm, whose rows
    differ: the outputs then fit no tree and a ValueError says so).
    ``products`` as for :func:`reveal_dot_order`, checked on row ``row`` (0 if
    None) of a random product.
    """
    ones_b = np.ones((k, p), np.dtype(dtype))

    def batch(x: np.ndarray) -> np.ndarray:
        out = []
        step = m if row is None else 1
        for start in range(0, len(x), step):
            chunk = x[start : start + step]
            a = np.ones((m, k), np.dtype(dtype))
            if row is None:
                a[: len(chunk)] = chunk
                out.extend(np.asarray(matmul(a, ones_b), np.float64)[: len(chunk), col])
            else:
                a[row] = chunk[0]
                out.append(float(np.asarray(matmul(a, ones_b), np.float64)[row, col]))
        return np.asarray(out)

    model = reveal_order(batch, k, dtype=dtype, out_dtype=out_dtype, batched=True, among=among)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((_DRAWS, m, k)).astype(np.dtype(dtype))
    b = rng.standard_normal((_DRAWS, k, p)).astype(np.dtype(dtype))
    r = 0 if row is None else row
    real = np.stack([np.asarray(matmul(x, y), np.float64)[r : r + 1] for x, y in zip(a, b)])
    return _choose_products(model, products, a[:, r : r + 1], b, real, out_dtype or dtype)
