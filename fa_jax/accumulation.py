"""Accumulation models: how a sum or dot product rounds on its way to the accumulator.

``EXACT``        sum exactly and round once to the accumulator format (an ideal
                 fused dot).  ``ops.sum`` carries TwoSum error terms, so its
                 result is the exact sum rounded once (to within ~n * 2**-106
                 relative).  ``ops.matmul`` accumulates the (exact) products in
                 an XLA float64 dot: it can differ from the exactly rounded sum
                 only when that dot's own error (<= k * 2**-53 * Σ|a_i b_i|)
                 straddles a rounding boundary of the accumulator format.
``SEQUENTIAL``   round to the accumulator format after every addition, in index
                 order, starting from 0: ``acc_k = fl(acc_{k-1} + a_k b_k)`` with
                 the product exact (a scalar FMA loop).
``chunked(k)``   exact within consecutive chunks of ``k`` terms, then sequential
                 across chunks: acc = fl(acc + chunk) (a tensor-core MMA of depth
                 ``k``; 16 by default).  The same float64 caveat applies to
                 matmul's chunk dots.
``tensor_core``  the block fused multiply-add that Fasi, Higham, Mikaitis &
                 Pranesh measured on NVIDIA tensor cores ("Numerical behavior
                 of NVIDIA tensor cores", PeerJ Comput. Sci. 7:e330, 2021):
                 exact products, aligned to the largest exponent and truncated,
                 summed, normalised with round toward zero.  Presets
                 :func:`tensor_core` ``("v100")``, ``("t4")``, ``("a100")``,
                 ``("a100_tf32")``; any other parameters with
                 :func:`tensor_core_model`.  Bit-exact (below).
``tree``         a summation tree (Higham 2002, §4.1): every node rounds once,
                 fl(left + right), or for a fused node the exact sum of its
                 children (a k-term fused dot).  Builders give the tree for any
                 n: :func:`sequential` (k terms a step), :func:`pairwise`,
                 :func:`halving` (a SIMD reduction), :func:`fused`,
                 :func:`lanes` (L lanes each summing every L-th term, then
                 combined), :func:`vector` (lanes and a scalar tail),
                 :func:`halves` (recursive halving), :func:`blocked` and
                 :func:`split_k` (GEMMs that cut the inner dimension);
                 :func:`tree` takes explicit nested tuples.  :func:`tree_nodes`
                 and :func:`nested` show the tree for a given n; str() parses
                 back, e.g. ``tree(lanes(8, combine=pairwise))``.

The tensor-core model is defined step by step in :func:`tensor_core_model`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Literal, NoReturn, TypeAlias, cast

import numpy as np

from fa_jax._checks import non_negative_int, positive_int

__all__ = [
    "EXACT",
    "SEQUENTIAL",
    "TENSOR_CORE_PRESETS",
    "Accumulation",
    "Tree",
    "blocked",
    "chunked",
    "fma_chains",
    "fused",
    "get_accumulation",
    "halves",
    "halving",
    "lanes",
    "nested",
    "pairwise",
    "rounded_products",
    "sequential",
    "split_k",
    "tensor_core",
    "tensor_core_model",
    "tree",
    "tree_nodes",
    "tree_roundings",
    "vector",
]

_KINDS = ("exact", "sequential", "chunked", "tensor_core", "tree")
NORMALIZATIONS = ("toward_zero", "nearest_even", "up", "down")
_TC_DEFAULTS = {"extra_bits": 0, "normalization": "toward_zero", "fused_accumulator": True}


_TREE_NAMES = (
    "sequential",
    "fused",
    "pairwise",
    "halving",
    "lanes",
    "vector",
    "blocked",
    "split_k",
    "halves",
    "rounded",
    "tree",
)
_COMPOSITE = ("lanes", "vector", "blocked", "split_k")
_LEAF_ORDERS = ("sequential", "fused", "pairwise", "halving")


@dataclasses.dataclass(frozen=True)
class Tree:
    """How a summation tree is built for any number of terms (module docstring,
    "Summation trees"); build with the functions :func:`lanes`, :func:`split_k`,
    :func:`blocked`, :func:`pairwise`, :func:`halving`, :func:`vector`,
    :func:`halves`, :func:`sequential`, :func:`fused`, :func:`tree`.

    Args:
      order: "sequential", "fused", "pairwise", "halving", "lanes", "vector",
        "blocked", "split_k", "halves" or "tree" (an explicit tree).
      size: terms a step ("sequential", None for 1), lanes ("lanes", "vector"),
        terms per block ("blocked"), parts ("split_k"), the most terms of a leaf
        block ("halves"), terms ("tree"); None for the others.
      inner: how each lane, block or part is summed (composite orders, "halves");
        the tree over the rounded terms ("rounded": every term is first rounded
        to the accumulator format, as products are by a multiply before an add).
      outer: how the lane, block or part sums are combined (composite orders).
      align: "halves" only: the first half's length is a multiple of it.
      nodes: "tree" only: the internal nodes in post-order, each the tuple of its
        children's ids (terms are 0 .. size-1, node k is size + k); a node of
        one child rounds it.
      from_zero: "sequential" of one term a step only: the chain starts from a
        zero accumulator, so its first term is rounded on entry (a loop of
        fused multiply-adds, whose first product is rounded).
    """

    order: str
    size: int | None = None
    inner: Tree | None = None
    outer: Tree | None = None
    nodes: tuple[tuple[int, ...], ...] | None = None
    align: int | None = None
    from_zero: bool = False

    def __post_init__(self):
        if self.order not in _TREE_NAMES:
            raise ValueError(f"Tree.order: expected one of {_TREE_NAMES}, got {self.order!r}")
        composite = self.order in _COMPOSITE
        if composite or self.order in ("tree", "halves"):
            object.__setattr__(self, "size", positive_int(self.size, f"Tree.size of {self.order}"))
        elif self.order == "sequential" and self.size is not None:
            size = positive_int(self.size, "Tree.size of sequential")
            object.__setattr__(self, "size", None if size == 1 else size)
        elif self.size is not None:
            raise ValueError(f"Tree.size: {self.order!r} takes no size, got {self.size!r}")
        for name in ("inner", "outer"):
            value = getattr(self, name)
            needed = composite or (name == "inner" and self.order in ("halves", "rounded"))
            if needed and not isinstance(value, Tree):
                raise TypeError(f"Tree.{name} of {self.order}: expected a Tree, got {value!r}")
            if not needed and value is not None:
                raise ValueError(f"Tree.{name}: {self.order!r} takes none, got {value!r}")
        if self.order == "halves":
            align = positive_int(1 if self.align is None else self.align, "Tree.align of halves")
            object.__setattr__(self, "align", align)
        elif self.align is not None:
            raise ValueError(f"Tree.align: only 'halves' takes one, got {self.align!r}")
        if (self.order == "tree") != (self.nodes is not None):
            raise ValueError(f"Tree.nodes: only 'tree' takes (and needs) nodes, got {self.nodes!r}")
        if self.from_zero not in (True, False):
            raise TypeError(f"Tree.from_zero: expected True or False, got {self.from_zero!r}")
        if self.from_zero and (self.order != "sequential" or self.size is not None):
            raise ValueError(
                "Tree.from_zero: only 'sequential' of one term a step starts from zero "
                f"(a fused step rounds once anyway), got {self.order!r} of size {self.size!r}"
            )

    def __str__(self) -> str:
        if self.order == "sequential" and self.size is not None:
            return f"sequential({self.size})"
        if self.from_zero:
            return "sequential(from_zero)"
        if self.order in _LEAF_ORDERS:
            return self.order
        if self.order == "tree":
            return _nested_str(self)
        if self.order == "rounded":
            return f"rounded({self.inner})"
        args = [str(self.size)]
        for name, default in _DEFAULTS[self.order].items():
            value = str(getattr(self, name))
            if value != str(default):
                label = "combine" if name == "outer" and self.order in _LANES else name
                args.append(f"{label}={value}")
        return f"{self.order}({', '.join(args)})"


_LANES = ("lanes", "vector")
_DEFAULTS: dict[str, dict[str, str | int]] = {
    "lanes": {"inner": "sequential", "outer": "halving"},
    "vector": {"inner": "sequential", "outer": "halving"},
    "blocked": {"inner": "sequential", "outer": "sequential"},
    "split_k": {"inner": "sequential", "outer": "sequential"},
    "halves": {"inner": "sequential", "align": 1},
}


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """An accumulation model (module docstring); build with EXACT, SEQUENTIAL,
    chunked(k), tensor_core(preset), tensor_core_model(k, ...) or a tree builder
    (lanes(L), split_k(s), pairwise(), tree(nested), ...).

    Args:
      kind: "exact", "sequential", "chunked", "tensor_core" or "tree".
      chunk: terms per chunk ("chunked") or per block fused multiply-add, the
        paper's k ("tensor_core"); None for the others.
      extra_bits: "tensor_core" only: bits kept beyond the accumulator's
        precision when the terms are aligned to the largest exponent (>= 0).
      normalization: "tensor_core" only: the rounding mode of the block sum to
        the accumulator format: "toward_zero" (the tensor cores), "nearest_even",
        "up" or "down".
      fused_accumulator: "tensor_core" only: whether the accumulator joins the
        aligned sum (True on the tensor cores) or is added afterwards with an
        IEEE round-to-nearest addition.
      tree: "tree" only: the :class:`Tree` that builds the summation tree for
        any number of terms.
    """

    kind: Literal["exact", "sequential", "chunked", "tensor_core", "tree"]
    chunk: int | None = None
    extra_bits: int | None = None
    normalization: str | None = None
    fused_accumulator: bool | None = None
    tree: Tree | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"Accumulation.kind: expected one of {_KINDS}, got {self.kind!r}")
        if (self.kind == "tree") != isinstance(self.tree, Tree):
            raise ValueError(
                f"Accumulation.tree: expected a Tree for kind 'tree' (and only then), "
                f"got {self.tree!r} for kind {self.kind!r}"
            )
        tc_fields = ("extra_bits", "normalization", "fused_accumulator")
        if self.kind == "tensor_core":
            for name, default in _TC_DEFAULTS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
            self._validate_tensor_core()
        else:
            given = [f"{n}={getattr(self, n)!r}" for n in tc_fields if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"Accumulation: only 'tensor_core' takes {', '.join(tc_fields)}; "
                    f"got {', '.join(given)} for kind {self.kind!r}"
                )
        if self.kind in ("chunked", "tensor_core"):
            chunk = positive_int(self.chunk, f"Accumulation.chunk of {self.kind!r}")
            object.__setattr__(self, "chunk", chunk)
        elif self.chunk is not None:
            raise ValueError(
                f"Accumulation.chunk: only 'chunked' and 'tensor_core' take a chunk, "
                f"got {self.chunk!r}"
            )

    def _validate_tensor_core(self) -> None:
        extra_bits = non_negative_int(self.extra_bits, "Accumulation.extra_bits")
        object.__setattr__(self, "extra_bits", extra_bits)
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"Accumulation.normalization: expected one of {NORMALIZATIONS}, "
                f"got {self.normalization!r}"
            )
        if not isinstance(self.fused_accumulator, bool):
            raise TypeError(
                "Accumulation.fused_accumulator: expected True or False, "
                f"got {self.fused_accumulator!r}"
            )

    @property
    def block_terms(self) -> int:
        """Terms a tensor-core block adds at once: k, plus the accumulator if fused."""
        if self.kind != "tensor_core":
            raise ValueError(f"Accumulation.block_terms: only for 'tensor_core', not {self.kind!r}")
        return cast(int, self.chunk) + (1 if self.fused_accumulator else 0)

    def sum_bits(self, man_bits: int) -> int:
        """Bits an aligned tensor-core block sum spans for an accumulator with
        ``man_bits``: man_bits + extra_bits + 1 + ceil(log2(block_terms)).  The
        model is exact in a float64 carrier while this is <= 53."""
        return man_bits + cast(int, self.extra_bits) + 1 + math.ceil(math.log2(self.block_terms))

    def __str__(self) -> str:
        if self.kind == "tree":
            return f"tree({self.tree})"
        if self.kind == "chunked":
            return f"chunked({self.chunk})"
        if self.kind == "tensor_core":
            for name, preset in TENSOR_CORE_PRESETS.items():
                if preset == self:
                    return f"tensor_core({name})"
            opts = [f"k={self.chunk}", f"extra_bits={self.extra_bits}"]
            if self.normalization != _TC_DEFAULTS["normalization"]:
                opts.append(f"normalization={self.normalization}")
            if not self.fused_accumulator:
                opts.append("fused_accumulator=false")
            return f"tensor_core({', '.join(opts)})"
        return self.kind


EXACT = Accumulation("exact")
SEQUENTIAL = Accumulation("sequential")


def chunked(k: int = 16) -> Accumulation:
    """Exact within chunks of ``k`` terms, sequential across chunks."""
    return Accumulation("chunked", k)


def tensor_core_model(
    k: int,
    *,
    extra_bits: int = 0,
    normalization: str = "toward_zero",
    fused_accumulator: bool = True,
) -> Accumulation:
    """A tensor-core block FMA model with any parameters: blocks of ``k`` exact
    products, aligned to the largest exponent with ``extra_bits`` extra bits and
    truncated, summed exactly, normalised to the accumulator format in
    ``normalization`` mode.

    The terms ``t_1 .. t_n`` (the products ``a_i b_i`` of a dot, exact in
    float64, or the summands of a sum) are taken in index order, in blocks of
    ``k``.  The accumulator ``c`` starts at +0.  With ``fused_accumulator`` (the
    hardware's ``D = C + A B``), each block computes::

        T     = {c, t_1, .., t_k}                     (the block's terms, c included)
        E(x)  = max(floor(log2 |x|), emin)            (emin of the accumulator format)
        e_max = max E(x) over the nonzero x in T
        q     = 2**(e_max - man_bits - extra_bits)    (man_bits of the accumulator format)
        x'    = sign(x) * floor(|x| / q) * q          (alignment: truncation toward zero)
        S     = Σ_{x in T} x'                         (exact: no carry bit is lost)
        c     = round(S, accumulator format, normalization)

    that is, every significand is shifted right to the largest exponent keeping
    ``extra_bits`` bits beyond the accumulator's precision, the bits shifted out
    are dropped, the aligned significands are added exactly and the sum is
    normalised once (round toward zero on the tensor cores).  Without
    ``fused_accumulator`` the block is ``A B`` alone (``T`` without ``c``) and its
    normalised sum ``d`` is added to the accumulator by an IEEE round-to-nearest
    addition, ``c = fl(c + d)`` (an MMA with a zero C followed by an FP32 add).

    ``S`` is exact in float64 when ``man_bits + extra_bits + 1 + ceil(log2(|T|))
    <= 53`` (aligned terms are multiples of ``q`` below ``2**(man_bits +
    extra_bits + 1) q``); ``ops`` checks this for concrete formats.

    Special values follow IEEE 754 (NaN, or +inf with -inf, gives NaN; one
    infinity sign gives that infinity); an exact zero ``S`` gives +0, a nonzero
    ``S`` that rounds to zero keeps its sign; overflow follows ``normalization``.

    Not modelled: the hardware's limited carry-out bits; the alignment of a
    product of a subnormal input by its unnormalised exponent; the binary16-output
    mode; and the second extra bit of Khattak & Mikaitis's bit-accurate A100 model
    ("Accurate models of NVIDIA tensor cores", arXiv 2512.07004, 2025).
    """
    return Accumulation(
        "tensor_core",
        k,
        extra_bits=extra_bits,
        normalization=normalization,
        fused_accumulator=fused_accumulator,
    )


# Fasi, Higham, Mikaitis & Pranesh (2021), binary32 accumulation:
#   V100 (Volta) and T4 (Turing), binary16 inputs: 4 exact products plus c added
#     at once; significands aligned to the largest exponent with no extra bits,
#     the bits shifted out truncated; the sum normalised with round toward zero
#     (round-down for positive, round-up for negative results).
#   A100 (Ampere), binary16 and bfloat16 inputs: 8 products plus c per block,
#     one extra bit for the alignment, truncation, round toward zero.
#   A100, TensorFloat-32 inputs: 4 products plus c per block, otherwise as above.
# The extra bits are those for which the paper's test vectors (its test suite,
# github.com/north-numerical-computing/tensor-cores-numerical-behavior, and
# tests/test_accumulation.py here) give the results it reports; they agree with
# the V100 and A100 models of Khattak & Mikaitis (2025).
TENSOR_CORE_PRESETS = {
    "v100": tensor_core_model(4, extra_bits=0),
    "t4": tensor_core_model(4, extra_bits=0),
    "a100": tensor_core_model(8, extra_bits=1),
    "a100_tf32": tensor_core_model(4, extra_bits=1),
}


def tensor_core(preset: str) -> Accumulation:
    """A tensor-core model measured by Fasi, Higham, Mikaitis & Pranesh (2021),
    for an FP32 accumulator:

    ============  ===  ==========  ============  ===============================
    preset        k    extra bits  normalised    inputs
    ============  ===  ==========  ============  ===============================
    "v100", "t4"  4    0           toward zero   binary16 (Volta, Turing)
    "a100"        8    1           toward zero   binary16, bfloat16 (Ampere)
    "a100_tf32"   4    1           toward zero   TensorFloat-32 (Ampere)
    ============  ===  ==========  ============  ===============================

    Each block adds k exact products and the accumulator at once (module
    docstring).  "t4" is "v100" (the paper found the same behaviour), so it
    prints as ``tensor_core(v100)``.
    """
    key = preset.strip().lower().replace("-", "_") if isinstance(preset, str) else preset
    if key not in TENSOR_CORE_PRESETS:
        raise ValueError(
            f"tensor_core: expected a preset among {sorted(TENSOR_CORE_PRESETS)}, got {preset!r}"
        )
    return TENSOR_CORE_PRESETS[key]


_EXPECTED = (
    "'exact', 'sequential', 'chunked', 'chunked(k)', 'tensor_core(PRESET)' "
    f"(PRESET one of {', '.join(TENSOR_CORE_PRESETS)}) or "
    "'tensor_core(k=K, extra_bits=E[, normalization=MODE][, fused_accumulator=BOOL])' or "
    "'tree(TREE)' (TREE: sequential, fused, pairwise, halving, lanes(L[, combine=TREE]"
    "[, inner=TREE]), blocked(K[, inner=TREE][, outer=TREE]), split_k(S, ...) or nested "
    "tuples of term indices)"
)


def _parse_tensor_core(inner: str, spec) -> Accumulation:
    inner = inner.strip()
    if "=" not in inner:
        return tensor_core(inner)
    opts = {}
    for item in inner.split(","):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key in opts:
            raise ValueError(f"accumulation: expected {_EXPECTED}, got {spec!r}")
        opts[key] = value
    try:
        k = int(opts.pop("k"))
        extra = int(opts.pop("extra_bits", "0"))
        norm = opts.pop("normalization", "toward_zero")
        fused = {"true": True, "false": False}[opts.pop("fused_accumulator", "true")]
    except (KeyError, ValueError):
        raise ValueError(f"accumulation: expected {_EXPECTED}, got {spec!r}") from None
    if opts:
        raise ValueError(
            f"accumulation: unknown tensor_core options {sorted(opts)} in {spec!r}; "
            f"expected {_EXPECTED}"
        )
    return tensor_core_model(k, extra_bits=extra, normalization=norm, fused_accumulator=fused)


def get_accumulation(spec) -> Accumulation:
    """An Accumulation from itself or a name: "exact", "sequential", "chunked",
    "chunked(8)", "tensor_core(a100)", "tensor_core(k=8, extra_bits=1)" (str() of
    every model parses back to an equal model)."""
    if isinstance(spec, Accumulation):
        return spec
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s in ("exact", "sequential"):
            return Accumulation(s)
        m = re.fullmatch(r"chunked(?:\((\d+)\))?", s)
        if m:
            return chunked(int(m.group(1)) if m.group(1) else 16)
        m = re.fullmatch(r"tensor_core\((.*)\)", s)
        if m:
            return _parse_tensor_core(m.group(1), spec)
        m = re.fullmatch(r"tree\((.*)\)", s, re.DOTALL)
        if m:
            return _tree_model(_parse_tree(m.group(1)))
        if s.startswith((*_COMPOSITE, "halves", "rounded", "pairwise", "halving", "fused", "(")):
            return _tree_model(_parse_tree(s))
    raise ValueError(f"accumulation: expected {_EXPECTED}, got {spec!r}")


# -- summation trees ---------------------------------------------------------------


TreeLike: TypeAlias = "str | Tree | Accumulation"  # a tree, or its name or str()


def _as_tree(spec: TreeLike, what: str) -> Tree:
    """A Tree from a Tree, a tree Accumulation or a name/str() form."""
    if isinstance(spec, Tree):
        return spec
    if isinstance(spec, Accumulation) and spec.tree is not None:
        return spec.tree
    if isinstance(spec, str):
        return _parse_tree(spec)
    raise ValueError(f"{what}: expected a summation tree or one of {_LEAF_ORDERS}, got {spec!r}")


def _tree_model(t: Tree) -> Accumulation:
    return Accumulation("tree", tree=t)


def sequential(k: int = 1, *, from_zero: bool = False) -> Accumulation:
    """In index order, ``k`` terms a step: acc = fl(acc + x_i) for k = 1, and a fused
    node over the accumulator and the next k terms for k > 1 (a k-term fused dot
    unit that adds into its accumulator: ``chunked(k)`` as a tree).  With
    ``from_zero`` (k = 1) the chain starts from acc = 0, so its first term is
    rounded, fl(0 + x_0): a loop of fused multiply-adds in a dot product."""
    return _tree_model(Tree("sequential", k, from_zero=from_zero))


def pairwise() -> Accumulation:
    """Adjacent pairs, level by level: ((x0+x1)+(x2+x3))+...; an odd last value
    is carried up a level unchanged."""
    return _tree_model(Tree("pairwise"))


def halving() -> Accumulation:
    """A SIMD horizontal reduction: with m values and h = ceil(m/2), v_i + v_{i+h}
    for i < m - h, repeated until one is left (x0+x2, x1+x3, then the two)."""
    return _tree_model(Tree("halving"))


def fused() -> Accumulation:
    """One node over every term: the exact sum, rounded once."""
    return _tree_model(Tree("fused"))


def lanes(
    n_lanes: int, combine: TreeLike = "halving", *, inner: TreeLike = "sequential"
) -> Accumulation:
    """``n_lanes`` lanes, lane l summing terms l, l+L, l+2L, ... (``inner``, in
    index order), then the lane sums combined by ``combine`` ("halving" as SIMD
    reductions do, "pairwise", "sequential", "fused" or any tree)."""
    return _tree_model(
        Tree(
            "lanes",
            n_lanes,
            _as_tree(inner, "lanes: inner"),
            _as_tree(combine, "lanes: combine"),
        )
    )


def vector(
    n_lanes: int, combine: TreeLike = "halving", *, inner: TreeLike = "sequential"
) -> Accumulation:
    """A vectorised loop with a scalar tail: the first n - n % L terms in ``n_lanes``
    lanes as :func:`lanes`, combined by ``combine``, then the last n % L terms
    added one by one to that sum (all sequential when n < L)."""
    return _tree_model(
        Tree(
            "vector",
            n_lanes,
            _as_tree(inner, "vector: inner"),
            _as_tree(combine, "vector: combine"),
        )
    )


def halves(block: int, inner: TreeLike = "sequential", *, align: int = 1) -> Accumulation:
    """Recursive halving: a run of more than ``block`` terms is cut after its first
    h = n // 2 - (n // 2) % ``align`` terms and the two halves' sums added; a run
    of at most ``block`` terms is summed by ``inner``.  NumPy's pairwise
    summation (``np.add.reduce`` of a contiguous float array) is
    ``halves(128, vector(8, "pairwise"), align=8)``."""
    return _tree_model(Tree("halves", block, _as_tree(inner, "halves: inner"), align=align))


def blocked(
    size: int, inner: TreeLike = "sequential", outer: TreeLike = "sequential"
) -> Accumulation:
    """Consecutive blocks of ``size`` terms (the last may be shorter), each summed
    by ``inner``, the block sums combined by ``outer``.  ``blocked(k, "fused")``
    is ``chunked(k)``; a GEMM that blocks its inner dimension by ``size``."""
    return _tree_model(
        Tree("blocked", size, _as_tree(inner, "blocked: inner"), _as_tree(outer, "blocked: outer"))
    )


def split_k(
    parts: int, inner: TreeLike = "sequential", outer: TreeLike = "sequential"
) -> Accumulation:
    """A split-k GEMM: the terms cut into ``parts`` consecutive parts of
    ceil(n / parts) terms (the last shorter), each summed by ``inner``, the part
    sums combined by ``outer``."""
    return _tree_model(
        Tree("split_k", parts, _as_tree(inner, "split_k: inner"), _as_tree(outer, "split_k: outer"))
    )


def tree(nested) -> Accumulation:
    """An explicit tree over n terms from nested tuples: a leaf is a term's index,
    a tuple of two is fl(left + right), a tuple of more is a fused node (their
    exact sum rounded once).  The leaves are 0 .. n-1, each once."""
    return _tree_model(_explicit(nested))


def _explicit(nested) -> Tree:
    """Flatten nested tuples (iteratively: deep chains are fine) into post-order nodes."""
    leaves: list[int] = []
    ids: dict[int, int] = {}  # id(tuple) -> node number
    order: list[tuple] = []
    stack: list[tuple[object, bool]] = [(nested, False)]
    while stack:
        item, done = stack.pop()
        if isinstance(item, tuple):
            if not item:
                raise ValueError("tree: expected nodes of at least one child, got () in the tree")
            if done:
                order.append(item)
            else:
                stack.append((item, True))
                stack.extend((c, False) for c in reversed(item))
        elif isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            leaves.append(int(item))
        else:
            raise ValueError(f"tree: expected nested tuples of term indices, got {item!r}")
    n = len(leaves)
    if sorted(leaves) != list(range(n)):
        raise ValueError(
            f"tree: expected the leaves 0 .. {n - 1} once each, got {sorted(leaves)!r}"
        )
    if not order:
        raise ValueError(f"tree: expected at least one node of two terms, got {nested!r}")
    for k, node in enumerate(order):
        ids[id(node)] = n + k
    nodes = tuple(
        tuple(ids[id(c)] if isinstance(c, tuple) else int(c) for c in node) for node in order
    )
    return Tree("tree", n, nodes=nodes)


def _nested_str(t: Tree) -> str:
    """The nested-tuple form of an explicit tree (built bottom-up, no recursion)."""
    n, nodes = cast(int, t.size), cast(tuple, t.nodes)
    text = [str(i) for i in range(n)]
    for node in nodes:
        text.append("(" + ", ".join(text[c] for c in node) + ("," if len(node) == 1 else "") + ")")
    return text[-1]


def fma_chains(model: TreeLike) -> Accumulation:
    """``model`` with its chains started from a zero accumulator, as loops of fused
    multiply-adds are: the first product of each chain is rounded on entry
    (fl(0 + a_0 b_0)), the others join exactly.  A builder gets
    ``sequential(from_zero)`` for each of its one-term-a-step sequential parts;
    an explicit tree rounds the lower-index term of each node of two terms."""
    return _tree_model(_fma_chains(_as_tree(model, "fma_chains")))


def rounded_products(model: TreeLike) -> Accumulation:
    """``model`` over its terms each first rounded to the accumulator format: a dot
    product that multiplies (rounding the product) and then adds."""
    return _tree_model(Tree("rounded", inner=_as_tree(model, "rounded_products")))


def _fma_chains(t: Tree) -> Tree:
    if t.order == "sequential" and t.size is None:
        return Tree("sequential", from_zero=True)
    if t.order == "tree":
        n, new_nodes, ids = cast(int, t.size), [], list(range(cast(int, t.size)))
        for node in cast(tuple, t.nodes):
            node = tuple(ids[c] for c in node)
            if len(node) == 2 and max(node) < n:
                new_nodes.append((min(node),))
                node = (n + len(new_nodes) - 1, max(node))
            new_nodes.append(node)
            ids.append(n + len(new_nodes) - 1)
        return Tree("tree", n, nodes=tuple(new_nodes))
    inner = None if t.inner is None else _fma_chains(t.inner)
    outer = None if t.outer is None else _fma_chains(t.outer)
    return dataclasses.replace(t, inner=inner, outer=outer)


def tree_nodes(model, n: int) -> tuple[tuple[int, ...], ...]:
    """The internal nodes of ``model``'s summation tree over ``n`` terms, in an
    order where children come first, each the tuple of its children's ids
    (terms are 0 .. n-1, node k is n + k; the root is the last node, or term 0
    when n == 1).  ``model``: a tree Accumulation, a Tree or its str()."""
    t = _as_tree(get_accumulation(model) if isinstance(model, str) else model, "tree_nodes")
    return _nodes_for(t, positive_int(n, "tree_nodes: n"))


def nested(model, n: int):
    """``model``'s tree over ``n`` terms as nested tuples (the form :func:`tree`
    takes); a term index when n == 1."""
    nodes = tree_nodes(model, n)
    built: list = list(range(n))
    for node in nodes:
        built.append(tuple(built[c] for c in node))
    return built[-1]


@functools.lru_cache(maxsize=256)
def _nodes_for(t: Tree, n: int) -> tuple[tuple[int, ...], ...]:
    nodes: list[tuple[int, ...]] = []
    _build(t, list(range(n)), nodes, n)
    return tuple(nodes)


def _build(t: Tree, ids: list[int], nodes: list, n: int) -> int:
    """Append the nodes summing ``ids`` under ``t``; return the root's id."""

    def new(*children: int) -> int:
        nodes.append(children)
        return n + len(nodes) - 1

    if len(ids) == 1 and t.order not in ("tree", "rounded") and not t.from_zero:
        return ids[0]
    if t.order == "sequential":
        k = t.size or 1
        acc = new(ids[0]) if t.from_zero else ids[0] if k == 1 or len(ids) == 1 else new(*ids[:k])
        for j in range(1 if k == 1 else k, len(ids), k):
            acc = new(acc, *ids[j : j + k])
        return acc
    if t.order == "fused":
        return new(*ids)
    if t.order == "pairwise":
        level = ids
        while len(level) > 1:
            pairs = [new(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
            level = pairs + level[len(level) - len(level) % 2 :]
        return level[0]
    if t.order == "halving":
        level = ids
        while len(level) > 1:
            m, h = len(level), (len(level) + 1) // 2
            level = [new(level[i], level[i + h]) for i in range(m - h)] + level[m - h : h]
        return level[0]
    inner, outer, size = cast(Tree, t.inner), cast(Tree, t.outer), cast(int, t.size)
    if t.order == "rounded":
        return _build(inner, [new(i) for i in ids], nodes, n)
    if t.order == "halves":
        if len(ids) <= size:
            return _build(inner, ids, nodes, n)
        h = len(ids) // 2
        h -= h % cast(int, t.align)
        if h == 0:
            return _build(inner, ids, nodes, n)
        return new(_build(t, ids[:h], nodes, n), _build(t, ids[h:], nodes, n))
    if t.order == "vector":
        main = len(ids) - len(ids) % size
        acc = ids[0]
        if main:
            acc = _build(Tree("lanes", size, inner, outer), ids[:main], nodes, n)
        for i in ids[main:] if main else ids[1:]:
            acc = new(acc, i)
        return acc
    if t.order == "lanes":
        groups = [ids[lane::size] for lane in range(min(size, len(ids)))]
    elif t.order in ("blocked", "split_k"):
        step = size if t.order == "blocked" else -(-len(ids) // size)
        groups = [ids[i : i + step] for i in range(0, len(ids), step)]
    else:  # an explicit tree
        if len(ids) != size:
            raise ValueError(f"tree {_nested_str(t)}: made for {size} terms, got {len(ids)}")
        mapped = list(ids)
        for node in cast(tuple, t.nodes):
            mapped.append(new(*(mapped[c] for c in node)))
        return mapped[-1]
    roots = [_build(inner, g, nodes, n) for g in groups]
    return _build(outer, roots, nodes, n)


def tree_roundings(model, n: int) -> int:
    """The most roundings a term of an ``n``-term sum goes through under a tree
    model: the most nodes on a path from a leaf to the root."""
    nodes = tree_nodes(model, n)
    depth = [0] * n
    for node in nodes:
        depth.append(1 + max(depth[c] for c in node))
    return max(depth)


# -- parsing str() of a tree -------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|([a-z_]+)|(.))")


def _tokens(text: str) -> list[str]:
    out = []
    for m in _TOKEN.finditer(text):
        tok = m.group(1) or m.group(2) or m.group(3)
        if tok and not tok.isspace():
            out.append(tok)
    return out


def _parse_tree(text: str) -> Tree:
    toks = _tokens(text.strip().lower())
    pos = [0]

    def fail(what: str) -> NoReturn:
        raise ValueError(f"summation tree: expected {what} at token {pos[0]} of {text!r}")

    def peek() -> str | None:
        return toks[pos[0]] if pos[0] < len(toks) else None

    def take(expected: str | None = None) -> str:
        tok = peek()
        if tok is None or (expected is not None and tok != expected):
            fail(repr(expected) if expected else "more")
        pos[0] += 1
        return tok

    def nested_tuple():  # iterative: deep sequential chains exceed Python's recursion
        stack: list[list] = []
        while True:
            tok = take()
            if tok == "(":
                stack.append([])
                continue
            if not tok.isdigit():
                fail("a term index or '('")
            value: object = int(tok)
            while True:
                stack[-1].append(value)
                sep = take()
                if sep == ",":
                    if peek() == ")":
                        take()
                    else:
                        break
                elif sep != ")":
                    fail("',' or ')'")
                value = tuple(stack.pop())
                if not stack:
                    return value

    def expr() -> Tree:
        tok = peek()
        if tok == "(":
            return _explicit(nested_tuple())
        name = take()
        if name == "sequential" and peek() == "(":
            take("(")
            size, zero = 1, False
            if peek() is not None and cast(str, peek()).isdigit():
                size = int(take())
                if peek() == ",":
                    take()
            if peek() == "from_zero":
                zero = bool(take())
            take(")")
            return Tree(name, size, from_zero=zero)
        if name in _LEAF_ORDERS:
            return Tree(name)
        if name == "rounded":
            take("(")
            inner = expr()
            take(")")
            return Tree(name, inner=inner)
        if name not in _DEFAULTS:
            fail(f"one of {_TREE_NAMES[:-1]} or nested tuples")
        take("(")
        size = take()
        if not size.isdigit():
            fail("a positive integer")
        defaults = _DEFAULTS[name]
        positional = [k for k in ("outer", "inner") if k in defaults] if name in _LANES else []
        positional = positional or [k for k in ("inner", "outer") if k in defaults]
        parsed: dict[str, object] = {}
        while peek() == ",":
            take()
            if pos[0] + 1 < len(toks) and toks[pos[0] + 1] == "=":
                key = take()
                take("=")
                key = "outer" if key == "combine" and name in _LANES else key
                if key not in defaults or key in parsed:
                    fail(f"one of {sorted(defaults)} once each")
            elif positional:
                key = positional[0]
            else:
                fail("')'")
            if key in positional:
                positional.remove(key)
            if key == "align":
                value = take()
                if not value.isdigit():
                    fail("a positive integer")
                parsed[key] = int(value)
            else:
                parsed[key] = expr()
        take(")")
        values: dict[str, object] = {
            k: Tree(v) if isinstance(v, str) else v for k, v in defaults.items()
        }
        values.update(parsed)
        return Tree(
            name,
            int(size),
            inner=cast(Tree, values["inner"]),
            outer=cast("Tree | None", values.get("outer")),
            align=cast("int | None", values.get("align")),
        )

    result = expr()
    if peek() is not None:
        fail("the end")
    return result


# -- evaluation schedules of summation trees (fa_jax.ops, fa_jax.carrier32.sums) --------------

_FREE_PADDING = 4096  # padded node evaluations a segment may add before a new one starts


@functools.lru_cache(maxsize=256)
def tree_schedule(t: Tree, n: int):
    """The nodes of ``t`` over ``n`` leaves as padded levels to evaluate in order.

    A node's level is one more than its deepest child's.  Consecutive levels of
    the same kind (at most two children, or some fused) form a segment as long
    as padding them to its widest level costs at most twice their nodes plus
    ``_FREE_PADDING`` (each segment is one more compiled scan); a segment is
    evaluated by one scan over its levels, each level gathering its nodes'
    children from a buffer of every value (leaves, then nodes, then a -0 pad and
    a slot that absorbs the pads' writes) and scattering the results.
    Returns (segments, buffer size, root id); a segment is (children (levels,
    width, arity) int32, outputs (levels, width) int32).
    """
    nodes = tree_nodes(t, n)
    size = n + len(nodes) + 2
    zero, dump = size - 2, size - 1
    depth = [0] * n
    levels: list[list[int]] = []
    for k, node in enumerate(nodes):
        d = 1 + max(depth[c] for c in node)
        depth.append(d)
        if d > len(levels):
            levels.append([])
        levels[d - 1].append(n + k)
    groups: list[list[list[int]]] = []
    for level in levels:
        binary = max(len(nodes[i - n]) for i in level) <= 2
        last = groups[-1] if groups else None
        if last is not None and (max(len(nodes[i - n]) for i in last[0]) <= 2) == binary:
            width = max(len(level), *(len(x) for x in last))
            real = len(level) + sum(len(x) for x in last)
            if (len(last) + 1) * width <= 2 * real + _FREE_PADDING:
                last.append(level)
                continue
        groups.append([level])
    segments = []
    for group in groups:
        width = max(len(level) for level in group)
        arity = max(2, *(len(nodes[i - n]) for level in group for i in level))
        children = np.full((len(group), width, arity), zero, np.int32)
        outputs = np.full((len(group), width), dump, np.int32)
        for j, level in enumerate(group):
            for w, i in enumerate(level):
                node = nodes[i - n]
                children[j, w, : len(node)] = node
                outputs[j, w] = i
        segments.append((children, outputs))
    return tuple(segments), size, (n + len(nodes) - 1 if nodes else 0)
