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

The tensor-core model is defined step by step in :func:`tensor_core_model`;
:class:`Tree`, the nodes of a tree over n terms, its text and its evaluation
schedule are :mod:`fa_jax.accumulation_trees`'s, the builders here wrap them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal, TypeAlias, cast

from fa_jax._checks import non_negative_int, positive_int
from fa_jax.accumulation_trees import (
    COMPOSITE_ORDERS,
    LEAF_ORDERS,
    Tree,
    build_nodes,
    explicit_tree,
    fma_chain_tree,
    parse_tree,
)
from fa_jax.accumulation_trees import tree_schedule as tree_schedule  # fa_jax.ops runs trees by it

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
            return _tree_model(parse_tree(m.group(1)))
        if s.startswith((*COMPOSITE_ORDERS, *LEAF_ORDERS[1:], "halves", "rounded", "(")):
            return _tree_model(parse_tree(s))
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
        return parse_tree(spec)
    raise ValueError(f"{what}: expected a summation tree or one of {LEAF_ORDERS}, got {spec!r}")


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
    return _tree_model(explicit_tree(nested))


def fma_chains(model: TreeLike) -> Accumulation:
    """``model`` with its chains started from a zero accumulator, as loops of fused
    multiply-adds are: the first product of each chain is rounded on entry
    (fl(0 + a_0 b_0)), the others join exactly.  A builder gets
    ``sequential(from_zero)`` for each of its one-term-a-step sequential parts;
    an explicit tree rounds the lower-index term of each node of two terms."""
    return _tree_model(fma_chain_tree(_as_tree(model, "fma_chains")))


def rounded_products(model: TreeLike) -> Accumulation:
    """``model`` over its terms each first rounded to the accumulator format: a dot
    product that multiplies (rounding the product) and then adds."""
    return _tree_model(Tree("rounded", inner=_as_tree(model, "rounded_products")))


def tree_nodes(model, n: int) -> tuple[tuple[int, ...], ...]:
    """The internal nodes of ``model``'s summation tree over ``n`` terms, in an
    order where children come first, each the tuple of its children's ids
    (terms are 0 .. n-1, node k is n + k; the root is the last node, or term 0
    when n == 1).  ``model``: a tree Accumulation, a Tree or its str()."""
    t = _as_tree(get_accumulation(model) if isinstance(model, str) else model, "tree_nodes")
    return build_nodes(t, positive_int(n, "tree_nodes: n"))


def nested(model, n: int):
    """``model``'s tree over ``n`` terms as nested tuples (the form :func:`tree`
    takes); a term index when n == 1."""
    nodes = tree_nodes(model, n)
    built: list = list(range(n))
    for node in nodes:
        built.append(tuple(built[c] for c in node))
    return built[-1]


def tree_roundings(model, n: int) -> int:
    """The most roundings a term of an ``n``-term sum goes through under a tree
    model: the most nodes on a path from a leaf to the root."""
    nodes = tree_nodes(model, n)
    depth = [0] * n
    for node in nodes:
        depth.append(1 + max(depth[c] for c in node))
    return max(depth)
