"""The judge of a kernel against its model: bit for bit, in ulps, and against FP64.

``compare(real, emulated, golden, fmt)`` reports how many of the real kernel's
outputs the emulation reproduces bit for bit, the distribution of the distance
between the two in units in the last place of ``fmt`` (the difference of the
values' positions in the format's ordered set of values,
:func:`fa_jax.metrics.ulp_distance`), and the error of each against the FP64
golden output: the largest absolute difference and the relative Frobenius
error ``||x - golden||_F / ||golden||_F`` (the statistics of Golden et al. 2024,
arXiv 2405.02803).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fa_jax import metrics
from fa_jax._x64 import float64_enabled
from fa_jax.formats import get_format

__all__ = ["BINS", "Comparison", "compare"]

# Histogram bins of the ulp distance: (label, lowest, highest) inclusive.
BINS = (("0", 0, 0), ("1", 1, 1), ("2", 2, 2), ("3-7", 3, 7), ("8+", 8, None))


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What :func:`compare` measured (module docstring).

    ``ulp_histogram`` maps a bin label of :data:`BINS` (or, with
    ``exact_histogram``, each distance that occurs) to its element count;
    ``unrepresentable`` counts elements where either output is NaN or not a
    value of the format (they are left out of the histogram and ``max_ulp``).
    """

    fmt: str
    elements: int
    identical: int
    identical_share: float
    ulp_histogram: dict
    max_ulp: int
    unrepresentable: int
    real_max_abs: float
    real_rel_frobenius: float
    emulated_max_abs: float
    emulated_rel_frobenius: float

    def summary(self) -> str:
        """One line: shares and errors."""
        hist = ", ".join(f"{k}: {v}" for k, v in self.ulp_histogram.items())
        return (
            f"{self.fmt}: {self.identical}/{self.elements} bit-identical "
            f"({100 * self.identical_share:.4f}%), max {self.max_ulp} ulp [{hist}]; "
            f"vs FP64 real {self.real_max_abs:.3e} / {self.real_rel_frobenius:.3e}, "
            f"emulated {self.emulated_max_abs:.3e} / {self.emulated_rel_frobenius:.3e}"
        )


def _float64(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"compare: {name}: expected a float array, got dtype {a.dtype}")
    return a.astype(np.float64)


def _errors(x: np.ndarray, golden: np.ndarray) -> tuple[float, float]:
    with float64_enabled():
        max_abs = float(metrics.max_abs_diff(x, golden))
    norm = float(np.linalg.norm(golden.ravel()))
    diff = float(np.linalg.norm((x - golden).ravel()))
    return max_abs, diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def _histogram(d: np.ndarray, exact: bool) -> dict:
    if exact:
        values, counts = np.unique(d, return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}
    out = {}
    for label, lo, hi in BINS:
        inside = d >= lo if hi is None else (d >= lo) & (d <= hi)
        out[label] = int(np.count_nonzero(inside))
    return out


def compare(real, emulated, golden, fmt, *, exact_histogram: bool = False) -> Comparison:
    """Judge ``emulated`` against ``real`` in ``fmt``, and both against ``golden``.

    ``real`` and ``emulated`` are values of ``fmt`` (any float dtype), ``golden``
    the FP64 reference, all of one shape.
    """
    f = get_format(fmt)
    r, e, g = (
        _float64(x, n) for x, n in ((real, "real"), (emulated, "emulated"), (golden, "golden"))
    )
    if not r.shape == e.shape == g.shape:
        raise ValueError(
            f"compare: expected real, emulated and golden of one shape, got "
            f"{r.shape}, {e.shape}, {g.shape}"
        )
    identical = int(np.count_nonzero(r.view(np.uint64) == e.view(np.uint64)))
    with float64_enabled():
        # float64 operands: a float64 carrier, uint64 distances, all ones for "no value"
        d = np.asarray(metrics.ulp_distance(r, e, f), dtype=np.uint64).ravel()
    bad = d == np.iinfo(np.uint64).max
    good = d[~bad]
    r_abs, r_fro = _errors(r, g)
    e_abs, e_fro = _errors(e, g)
    return Comparison(
        fmt=f.name,
        elements=r.size,
        identical=identical,
        identical_share=identical / r.size if r.size else 1.0,
        ulp_histogram=_histogram(good, exact_histogram),
        max_ulp=int(good.max()) if good.size else 0,
        unrepresentable=int(np.count_nonzero(bad)),
        real_max_abs=r_abs,
        real_rel_frobenius=r_fro,
        emulated_max_abs=e_abs,
        emulated_rel_frobenius=e_fro,
    )
