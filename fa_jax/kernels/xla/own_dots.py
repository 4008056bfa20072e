"""XLA's own dots on the CPU: the dots of ``jax.nn.dot_product_attention`` that
XLA runs itself (a bare ``dot`` in the optimised HLO's entry) rather than in a
YNNPACK fusion.  Two implementations, each bit for bit:

* XLA's matrix-vector products (xla/service/cpu/tiled_dot_emitter.cc), which it
  emits through LLVM where a dot gives one row per batch (one grouped query
  row): y_r = Σ_t x_t A[r, t] over a matrix A.  Which one runs follows the
  layout of A (:func:`own_dots`), and either dot can take either:
  - row-major (``RowMajorMatrixVectorProductEmitter``; t minor in A): the
    outputs go in tiles of 8 (XLA's GEMV tiling factor); each keeps one vector
    of ``lanes`` FMA chains (term t in chain t mod lanes) and one scalar FMA
    chain over the last T mod lanes terms (the epilogue).  A tile's lanes are
    summed by AVX's pairwise ``hadd`` with 8 lanes and 8 outputs, ((c0 + c1) +
    (c2 + c3)) + ((c4 + c5) + (c6 + c7)); the last R mod 8 outputs (and any
    other width) by halving, ((c0 + c4) + (c2 + c6)) + ((c1 + c5) + (c3 + c7))
    (``VectorSupportLibrary::AddReduce``).  Then fl(lanes' sum + epilogue);
  - column-major (``ColumnMajorMatrixVectorProductEmitter``; r minor in A):
    each output one FMA chain over t, except one output left over alone (R mod
    lanes = 1, its epilogue), which adds its first tile of 8 terms as rounded
    products before the FMAs go on (LLVM contracts that epilogue's multiply-add
    only in later tiles; measured, every other remainder is all FMAs).
* Eigen's contraction sharded over the keys by its thread pool
  (``evalShardedByInnerDim``, unsupported/Eigen/src/Tensor/
  TensorContractionThreadPool.h): the shard sizes its ``blockSize`` can give
  (:func:`eigen_shards`), each shard's depth per GEMM block (:func:`eigen_kc`),
  and the sum of the shards' buffers (:func:`eigen_buffers_sum`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax.numpy as jnp

from fa_jax import ops
from fa_jax.formats import Format

__all__ = [
    "Gemv",
    "OwnDots",
    "eigen_buffers_sum",
    "eigen_kc",
    "eigen_kcs_giving",
    "eigen_shards",
    "fold",
    "gemv",
    "own_dots",
]

TILE = 8  # outputs (row-major) or terms (column-major) per tile: XLA's GEMV tiling factor
_AVX_LANES = 8  # float32 lanes of a 256-bit vector: the width AVX's hadd sums
_MAJORS = ("row", "column")


@dataclasses.dataclass(frozen=True)
class Gemv:
    """One of XLA's matrix-vector products: the matrix's layout and the lanes."""

    major: str  # "row": the summed index minor in the matrix; "column": the output's
    lanes: int

    def __post_init__(self):
        if self.major not in _MAJORS or self.lanes < 1 or self.lanes & (self.lanes - 1):
            raise ValueError(
                f"Gemv: expected a major in {_MAJORS} and a power-of-two lane count, "
                f"got {self.major!r} and {self.lanes}"
            )


@dataclasses.dataclass(frozen=True)
class OwnDots:
    """How XLA runs the dots it keeps as its own (None: the probed orders)."""

    qk: Gemv | None = None  # Q Kᵀ as XLA's GEMV
    pv: Gemv | None = None  # P V as XLA's GEMV
    pv_shard: int | None = None  # P V as Eigen's contraction: keys per shard
    pv_kc: int | None = None  # and the kc its shards are cut by (:func:`eigen_kc`)
    pv_joined: bool = False  # P V's last keys, under a block, joined to the block before
    # P V's last N mod tile_k keys FMA'd onto the last block's folded chains before
    # that block is added (Eigen's GEBP, rows its row-vectorised panels leave: even
    # and odd keys in two accumulators, C and D, added, then the odd last key
    # FMA'd; Eigen/src/Core/products/GeneralBlockPanelKernel.h,
    # ``lhs_process_one_packet``), rather than rounded products added last
    pv_rest_fma: bool = False


_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*\w+\[([\d,]*)\]\{([\d,]*)")
_DOT = re.compile(
    r"= \S+ dot\(%([^,\s]+), %([^,\s)]+)\).*?lhs_contracting_dims=\{(\d+)\}"
    r".*?rhs_contracting_dims=\{(\d+)\}"
)


def _major(line: str, shapes: dict[str, tuple[list[int], list[int]]]) -> str:
    """A bare dot's GEMV: "row" where its matrix (the operand with more elements)
    has the contracted dimension minor-most in its layout, else "column"."""
    found = _DOT.search(line)
    if not found:
        raise ValueError(f"own_dots: expected a dot with one contracted dimension, got {line!r}")
    lhs, rhs, lhs_dim, rhs_dim = found.groups()
    (dims_l, layout_l), (dims_r, layout_r) = shapes[lhs], shapes[rhs]
    layout, dim = (
        (layout_l, lhs_dim) if math.prod(dims_l) > math.prod(dims_r) else (layout_r, rhs_dim)
    )
    return "row" if layout and layout[0] == int(dim) else "column"


def own_dots(entry: str, computations: dict[str, str]) -> tuple[str | None, str | None]:
    """The entry's first two instructions that hold a dot, in its order, which puts
    Q Kᵀ before P V: for a bare ``dot`` (XLA's own) the major of its GEMV
    (:func:`_major`; what runs where the dot gives one row per batch), None for
    a dot inside a fusion the entry calls (YNNPACK's)."""
    shapes = {
        name: ([int(x) for x in dims.split(",") if x], [int(x) for x in layout.split(",") if x])
        for name, dims, layout in (m.groups() for m in map(_DEFINED.match, entry.splitlines()) if m)
    }
    found: list[str | None] = []
    for line in entry.splitlines():
        if re.search(r"= \S+ dot\(", line):
            found.append(_major(line, shapes))
        else:
            called = re.search(r"calls=%([^,\s]+)", line)
            if called and " dot(" in computations.get(called.group(1), ""):
                found.append(None)
    found += [None, None]
    return found[0], found[1]


def fold(chains, acc: Format, *, halving: bool = False):
    """Sum axis -3 of ``chains`` (a power of two) pairwise: adjacent pairs, ((c0 +
    c1) + (c2 + c3)), as AVX's ``hadd`` and YNNPACK's dot kernels fold their
    lanes, or halves, ((c0 + c2) + (c1 + c3))."""
    while chains.shape[-3] > 1:
        if halving:
            half = chains.shape[-3] // 2
            chains = ops.add(chains[..., :half, :, :], chains[..., half:, :, :], acc)
        else:
            chains = ops.add(chains[..., 0::2, :, :], chains[..., 1::2, :, :], acc)
    return chains[..., 0, :, :]


def _row_major(x, a, acc: Format, lanes: int):
    """x (..., N, T) against a (..., R, T): lanes of FMA chains over t, summed by
    AVX's ``hadd`` in whole tiles of 8 outputs of 8 lanes, by halving otherwise,
    plus the epilogue's FMA chain over the last T mod ``lanes`` terms."""
    t, r = x.shape[-1], a.shape[-2]
    main = t - t % lanes
    y = jnp.zeros((*x.shape[:-1], r), x.dtype)
    if main:
        steps = main // lanes
        # Chain c holds terms c, c + lanes, ...: (..., lanes, N, steps) @ (..., lanes, steps, R).
        xs = jnp.moveaxis(x[..., :main].reshape(*x.shape[:-1], steps, lanes), -1, -3)
        as_ = jnp.moveaxis(a[..., :main].reshape(*a.shape[:-1], steps, lanes), -1, -3)
        chains = ops.matmul(xs, jnp.swapaxes(as_, -1, -2), acc, accumulation="sequential")
        y = fold(chains, acc, halving=True)
        whole = r - r % TILE
        if lanes == _AVX_LANES == TILE and whole:
            y = jnp.concatenate([fold(chains[..., :whole], acc), y[..., whole:]], axis=-1)
    if main < t:
        tail = ops.matmul(
            x[..., main:], jnp.swapaxes(a[..., main:], -1, -2), acc, accumulation="sequential"
        )
        y = ops.add(y, tail, acc)
    return y


def _column_major(x, a, acc: Format, lanes: int):
    """x (..., N, T) against a (..., R, T): one FMA chain over t per output; an
    output left over alone (R mod ``lanes`` = 1) starts with its first tile's
    rounded products added in order."""
    t, r = x.shape[-1], a.shape[-2]
    y = ops.matmul(x, jnp.swapaxes(a, -1, -2), acc, accumulation="sequential")
    if r % lanes == 1:
        first = min(TILE, t)
        products = ops.mul(x[..., :first], a[..., -1, None, :first], acc)
        last = ops.sum(products, acc, axis=-1, accumulation="sequential")
        if first < t:
            last = ops.matmul(
                x[..., first:],
                a[..., -1, first:, None],
                acc,
                accumulation="sequential",
                initial=last[..., None],
            )[..., 0]
        y = jnp.concatenate([y[..., :-1], last[..., None]], axis=-1)
    return y


def gemv(x, a, acc: Format, how: Gemv):
    """fl32(x Aᵀ) for x (..., N, T) and a (..., R, T) as XLA's GEMV ``how`` computes
    each row of x (module docstring): Q Kᵀ as gemv(q, k), P V as gemv(p, vᵀ)."""
    if how.major == "row":
        return _row_major(x, a, acc, how.lanes)
    return _column_major(x, a, acc, how.lanes)


def eigen_shards(k: int) -> list[int]:
    """The shard sizes Eigen's contraction can pick for ``k`` keys (``blockSize``:
    ceil(k / threads) rounded up to a multiple of max(8, packet), at least 12
    packets), for an even number of threads up to twice this host's cores and a
    packet of 8 (AVX2) or 16 (AVX-512) floats; each smaller than ``k``."""
    sizes = set()
    for packet in (8, 16):
        multiple = max(8, packet)
        for threads in range(2, 2 * (os.cpu_count() or 1) + 1, 2):
            per_thread = -(-k // threads)
            target = -(-per_thread // multiple) * multiple
            sizes.add(min(k, max(12 * packet, target)))
    return sorted(size for size in sizes if size < k)


_SLICE_MULTIPLE = 8  # slices are a multiple of max(8, packet): 8 floats in XLA's AVX build
_EIGEN_KC_CAP = 320  # computeProductBlockingSizes' largest kc with threads (a shard's GEMM)


def eigen_kc(k: int, kc: int) -> int:
    """The depth per GEMM block of a contraction over ``k`` terms whose Eigen
    blocking gives ``kc`` (``computeProductBlockingSizes``, capped at 320): as
    TSL's contraction blocking (xla/tsl/framework/contraction/
    eigen_contraction_kernel.h) splits k "in roughly equal slices", ceil(k / kc)
    of them, each floor(k / slices) rounded up to a multiple of 8."""
    slices = max(1, -(-k // kc))
    return min(k, -(-(k // slices) // _SLICE_MULTIPLE) * _SLICE_MULTIPLE)


def eigen_kcs_giving(k: int, block: int, rest: int) -> list[int]:
    """The Eigen ``kc``s (multiples of 8 up to Eigen's threaded cap) under which
    :func:`eigen_kc` cuts ``k`` terms into blocks of ``block``: what one block read
    off a shard of ``k`` keys says of the others'.  A range of kcs can, and they
    can cut another shard of ``rest`` keys differently (docs/kernels.md): one kc
    per distinct cut of ``rest``, smallest first; none where no kc gives
    ``block``."""
    kcs: dict[int, int] = {}
    for kc in range(_SLICE_MULTIPLE, _EIGEN_KC_CAP + 1, _SLICE_MULTIPLE):
        if eigen_kc(k, kc) == block:
            kcs.setdefault(eigen_kc(rest, kc), kc)
    return sorted(kcs.values())


def eigen_buffers_sum(parts: list, acc: Format):
    """Eigen's sum of the shards' buffers: in ranges of 4, b0 = (b0 + b1) + (b2 + b3)
    (``addAllToBuffer``), a shorter last range added to its first in order
    (``addToBuffer``); then the ranges' sums into range 0's, three at a time
    (d = (d + r1) + (r2 + r3)) while three remain, the rest in order
    (``aggregateL0Blocks``)."""

    def add(a, b):
        return ops.add(a, b, acc)

    ranges = []
    for lo in range(0, len(parts), 4):
        rng = parts[lo : lo + 4]
        if len(rng) == 4:
            ranges.append(add(add(rng[0], rng[1]), add(rng[2], rng[3])))
        else:
            total = rng[0]
            for part in rng[1:]:
                total = add(total, part)
            ranges.append(total)
    total, i = ranges[0], 1
    while i + 2 < len(ranges):
        total = add(add(total, ranges[i]), add(ranges[i + 1], ranges[i + 2]))
        i += 3
    for part in ranges[i:]:
        total = add(total, part)
    return total
