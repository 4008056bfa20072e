"""fa_jax.kernels.reveal on trees with a fused node over several subtrees of more
than one term: the probes from one term see the other children all at one
value, and telling them apart (which terms share a child) needs probes among
them.  A black-box float32 sum walks each tree (binary nodes in binary32, fused
nodes exact and rounded once) and the revealed tree must be it.  The children of
each fused node here have one size (a fused node over children of different
sizes, such as a ragged last block under a fused combine, is not revealed)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from oracle import round_exact

from fa_jax import FP32
from fa_jax import accumulation as acc
from fa_jax.kernels.reveal import reveal_order, same_tree


def black_box(model, n):
    nested = acc.nested(model, n)

    def value(t, x):
        if not isinstance(t, tuple):
            return np.float32(x[t])
        kids = [value(c, x) for c in t]
        if len(kids) == 2:
            return np.float32(kids[0] + kids[1])
        exact = sum((Fraction(float(k)) for k in kids), Fraction(0))
        return np.float32(round_exact(exact, FP32))

    return lambda x: value(nested, np.asarray(x, np.float32))


@pytest.mark.parametrize(
    "model, n",
    [
        (acc.tree(((0, 1), (2, 3), (4, 5))), 6),
        (acc.tree((((0, 1), 2), (3, (4, 5)), ((6, 7), 8))), 9),
        (acc.blocked(2, "sequential", "fused"), 8),
        (acc.split_k(3, "pairwise", "fused"), 9),
        (acc.lanes(3, "fused", inner="pairwise"), 12),
    ],
    ids=str,
)
def test_a_fused_node_over_subtrees_is_revealed(model, n):
    found = reveal_order(black_box(model, n), n)
    assert same_tree(found, model, n), (str(found), str(model))
