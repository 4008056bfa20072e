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
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

__all__ = ["Accumulation", "EXACT", "SEQUENTIAL", "chunked", "get_accumulation"]


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """An accumulation model (module docstring); build with EXACT, SEQUENTIAL or chunked(k)."""

    kind: Literal["exact", "sequential", "chunked"]
    chunk: int | None = None

    def __post_init__(self):
        if self.kind not in ("exact", "sequential", "chunked"):
            raise ValueError(
                f"Accumulation.kind: expected 'exact', 'sequential' or 'chunked', got {self.kind!r}"
            )
        if self.kind == "chunked":
            if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 1:
                raise ValueError(
                    f"Accumulation.chunk: expected a positive integer for 'chunked', got {self.chunk!r}"
                )
        elif self.chunk is not None:
            raise ValueError(f"Accumulation.chunk: only 'chunked' takes a chunk, got {self.chunk!r}")

    def __str__(self) -> str:
        return f"chunked({self.chunk})" if self.kind == "chunked" else self.kind


EXACT = Accumulation("exact")
SEQUENTIAL = Accumulation("sequential")


def chunked(k: int = 16) -> Accumulation:
    """Exact within chunks of ``k`` terms, sequential across chunks."""
    return Accumulation("chunked", k)


def get_accumulation(spec) -> Accumulation:
    """An Accumulation from itself or a name: "exact", "sequential", "chunked", "chunked(8)"."""
    if isinstance(spec, Accumulation):
        return spec
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s in ("exact", "sequential"):
            return Accumulation(s)
        m = re.fullmatch(r"chunked(?:\((\d+)\))?", s)
        if m:
            return chunked(int(m.group(1)) if m.group(1) else 16)
    raise ValueError(
        f"accumulation: expected 'exact', 'sequential', 'chunked' or 'chunked(k)', got {spec!r}"
    )
