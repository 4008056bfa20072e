"""Summation trees: their shapes, their nodes for n terms, their text and their evaluation.

A summation tree (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd
ed., 2002, §4.1) sums n terms by internal nodes that each round once:
fl(left + right), or for a fused node the exact sum of its children rounded
once (a k-term fused dot).  :class:`Tree` says how the tree is built for any n
(its ``order``: sequential, fused, pairwise, halving, lanes, vector, halves,
blocked, split_k, rounded, or an explicit tree of nested tuples); this module
holds, knowing nothing of the other accumulation models,

- ``Tree`` and its checks; str() of a tree, and :func:`parse_tree`, its inverse;
- :func:`explicit_tree` (nested tuples to post-order nodes) and
  :func:`fma_chain_tree` (chains started from a zero accumulator, as loops of
  fused multiply-adds are);
- :func:`build_nodes`: the internal nodes of a tree over n terms, children
  first (term i is i, node k is n + k; the root last);
- :func:`tree_schedule`: the evaluation schedule :mod:`fa_jax.ops` and
  :mod:`fa_jax.carrier32.sums` run a tree by, its nodes as padded levels, one
  compiled scan per run of levels of the same kind.

:mod:`fa_jax.accumulation` wraps a tree in an ``Accumulation`` of kind "tree"
and holds the builders users call (``lanes(8)``, ``pairwise()``, ``tree(...)``,
``tree_nodes``, ``nested``, ``tree_roundings``); ``fa_jax.accumulation.Tree`` is
this module's ``Tree``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import NoReturn, cast

import numpy as np

from fa_jax._checks import positive_int

__all__ = [
    "COMPOSITE_ORDERS",
    "LEAF_ORDERS",
    "Tree",
    "build_nodes",
    "explicit_tree",
    "fma_chain_tree",
    "parse_tree",
    "tree_schedule",
]

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
COMPOSITE_ORDERS = ("lanes", "vector", "blocked", "split_k")
LEAF_ORDERS = ("sequential", "fused", "pairwise", "halving")


@dataclasses.dataclass(frozen=True)
class Tree:
    """How a summation tree is built for any number of terms (module docstring);
    build with :mod:`fa_jax.accumulation`'s :func:`lanes`, :func:`split_k`,
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
        composite = self.order in COMPOSITE_ORDERS
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
        if self.order in LEAF_ORDERS:
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


def explicit_tree(nested) -> Tree:
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


def fma_chain_tree(t: Tree) -> Tree:
    """``t`` with its chains started from a zero accumulator (``accumulation.fma_chains``):
    each one-term-a-step sequential part from zero; an explicit tree's node of
    two terms rounds its lower-index term first."""
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
    inner = None if t.inner is None else fma_chain_tree(t.inner)
    outer = None if t.outer is None else fma_chain_tree(t.outer)
    return dataclasses.replace(t, inner=inner, outer=outer)


@functools.lru_cache(maxsize=256)
def build_nodes(t: Tree, n: int) -> tuple[tuple[int, ...], ...]:
    """The internal nodes of ``t`` over ``n`` terms, children first (term i is i,
    node k is n + k; the root last); ``accumulation.tree_nodes`` checks ``n``."""
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


# -- str() of a tree, parsed back ------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|([a-z_]+)|(.))")


def _tokens(text: str) -> list[str]:
    out = []
    for m in _TOKEN.finditer(text):
        tok = m.group(1) or m.group(2) or m.group(3)
        if tok and not tok.isspace():
            out.append(tok)
    return out


def parse_tree(text: str) -> Tree:
    """The Tree that str() gives ``text`` for (a name, a builder's call or nested tuples)."""
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
            return explicit_tree(nested_tuple())
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
        if name in LEAF_ORDERS:
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
    nodes = build_nodes(t, positive_int(n, "tree_nodes: n"))
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
