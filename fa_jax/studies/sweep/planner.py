"""The sweep's planner: which lengths share one padded program, from measured costs.

Padding is exact (a configuration padded to a longer length computes its own
values bitwise, :mod:`.batch`), so every partition of a batch's sorted lengths
into contiguous buckets, one program per bucket and static signature padded
to the bucket's longest length N̂, writes the same CSV.  The planner takes the
partition of least predicted wall time

    T = Σ_programs prep(p) / W  +  Σ_calls units(c) · t(family(c))        (P)

where ``prep`` is the time to trace and compile a program (its family's,
measured), or to load it where the cache already holds it; ``W`` the compile
threads (:meth:`.executables.Executables.prepare` compiles on a thread per
usable core); a call's ``units`` its padded work (configurations × batch ×
heads × query rows × key columns visited × d, :meth:`.batch.FormatBatch.calls`)
and ``t`` its family's seconds per unit.  A *family* is a program's label
without its padded length (``"flash fa2 Bc=64"``).  The minimum of (P) over
contiguous partitions is a dynamic programme over the lengths
(:func:`best_buckets`, O(L²) buckets for L lengths), taken separately for the
reference programs and the flash programs, whose costs do not interact.

Costs (:class:`Costs`) are measured by every run from its
:class:`~fa_jax.studies.profile.Profile` (:func:`measured`) and kept in the
cache folder (:func:`load_costs`, :func:`save_costs`), one entry per device
(platform, kind, device count, usable cores), so a sweep plans from the last
sweep's figures on the same device.  A family not measured yet takes the
mean of measured families of its program (reference or flash), else the
platform's prior (:data:`PRIORS`): orders of magnitude, replaced by the first
measurement.  A plan never changes what is computed, only how it is batched:
the planner cannot make a sweep wrong, only slower than it could be.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence

from fa_jax._checks import non_negative_number, positive_int, positive_ints
from fa_jax.studies.results import write_json

__all__ = [
    "COSTS_FILE",
    "PRIORS",
    "Call",
    "Costs",
    "Prior",
    "best_buckets",
    "bucket_seconds",
    "family_of",
    "load_costs",
    "measured",
    "prior_of",
    "save_costs",
    "wall_seconds",
]

COSTS_FILE = "planner-costs.json"  # in the cache folder, beside the programs


@dataclasses.dataclass(frozen=True)
class Call:
    """One call a candidate bucket would make: its program's cache ``key`` and
    ``label``, its ``units`` of work, and whether the program is ``cached``
    (held in memory or on disk: loaded, not compiled)."""

    key: str
    label: str
    units: float
    cached: bool


@dataclasses.dataclass(frozen=True)
class Prior:
    """Starting guesses for a platform, before its first measurement: seconds to
    trace and compile a program, seconds per unit of work, seconds to load a
    cached program."""

    compile_s: float
    unit_s: float
    load_s: float


# Orders of magnitude only, replaced by a device's first measurement
# (docs/performance.md, "The sweep's planner").
PRIORS = {
    "cpu": Prior(compile_s=2.0, unit_s=1e-9, load_s=0.05),
    "accelerator": Prior(compile_s=4.0, unit_s=1e-11, load_s=0.05),
}


def prior_of(platform: str) -> Prior:
    """The prior of a JAX platform ("cpu"; any other is an accelerator's)."""
    return PRIORS["cpu" if platform == "cpu" else "accelerator"]


@dataclasses.dataclass(frozen=True)
class Costs:
    """A device's costs: seconds to trace and compile one program and seconds
    per unit of work, by family; seconds to load a cached program; its compile
    threads ``workers``; its ``platform``'s prior for families not measured yet
    (module docstring)."""

    compile_s: Mapping[str, float]
    unit_s: Mapping[str, float]
    load_s: float
    workers: int = 1
    platform: str = "cpu"

    def __post_init__(self):
        for name, table in (("compile_s", self.compile_s), ("unit_s", self.unit_s)):
            for family, seconds in table.items():
                non_negative_number(seconds, f"Costs.{name}[{family!r}] (seconds)")
        non_negative_number(self.load_s, "Costs.load_s (seconds)")
        positive_int(self.workers, "Costs.workers")

    @staticmethod
    def _of(table: Mapping[str, float], family: str, prior: float) -> float:
        if family in table:
            return table[family]
        kin = [s for f, s in table.items() if f.split()[:1] == family.split()[:1]]
        return sum(kin) / len(kin) if kin else prior

    def compile_of(self, family: str) -> float:
        """Seconds to trace and compile a program of ``family``."""
        return self._of(self.compile_s, family, prior_of(self.platform).compile_s)

    def unit_of(self, family: str) -> float:
        """Seconds per unit of work of a call of ``family``."""
        return self._of(self.unit_s, family, prior_of(self.platform).unit_s)

    def to_json(self) -> dict:
        return {
            "compile_s": dict(sorted(self.compile_s.items())),
            "unit_s": dict(sorted(self.unit_s.items())),
            "load_s": self.load_s,
        }


def family_of(label: str) -> str:
    """A program label without its padded length (``"flash fa2 Bc=64 N<=1024"``
    -> ``"flash fa2 Bc=64"``)."""
    head, sep, tail = label.rpartition(" N<=")
    return head if sep and tail.isdigit() else label


def bucket_seconds(calls: Sequence[Call], costs: Costs) -> tuple[float, float]:
    """(prepare, run) seconds of ``calls``: each distinct program prepared once
    (compiled, or loaded where cached), every call run."""
    programs = {c.key: c for c in calls}
    prepare = sum(
        costs.load_s if c.cached else costs.compile_of(family_of(c.label))
        for c in programs.values()
    )
    run = sum(c.units * costs.unit_of(family_of(c.label)) for c in calls)
    return prepare, run


def wall_seconds(calls: Sequence[Call], costs: Costs) -> float:
    """(P) for one bucket's ``calls``: its programs prepared on ``costs.workers``
    threads, then its calls run."""
    prepare, run = bucket_seconds(calls, costs)
    return prepare / costs.workers + run


def best_buckets(lengths: Sequence[int], cost: Callable[[tuple[int, ...]], float]) -> list:
    """The partition of the sorted distinct ``lengths`` into contiguous buckets
    that minimises Σ ``cost(bucket)`` (ties: the fewer buckets, then the
    earlier split), by dynamic programming over the end of the last bucket."""
    lens = sorted(set(positive_ints(lengths, "best_buckets: lengths")))
    # best[j]: (total, buckets, partition) of the first j lengths
    best: list[tuple[float, int, list]] = [(0.0, 0, [])]
    for j in range(1, len(lens) + 1):
        options = []
        for i in range(j):
            total, count, parts = best[i]
            bucket = tuple(lens[i:j])
            options.append((total + cost(bucket), count + 1, i, [*parts, bucket]))
        total, count, _, parts = min(options, key=lambda o: o[:3])
        best.append((total, count, parts))
    return best[-1][2]


# -- measured costs, kept with the cache ----------------------------------------------


def measured(profile, before: Costs) -> Costs:
    """``before`` updated with a run's ``profile``: each family's compile seconds
    (mean over the programs of its labels that were all compiled, none loaded),
    its seconds per unit (run seconds over the units of work its calls
    reported, :meth:`~fa_jax.studies.profile.Profile.ran`), and the load seconds
    (mean over labels whose programs were all loaded).  Labels without units of
    work (the metric programs) are not the planner's and are left out."""
    compile_s, unit_s = dict(before.compile_s), dict(before.unit_s)
    sums: dict[str, list[float]] = {}  # family -> [prepare s, compiled, run s, units]
    loaded = [0.0, 0]
    for label, p in profile.programs.items():
        if p.units <= 0:
            continue
        f = sums.setdefault(family_of(label), [0.0, 0, 0.0, 0.0])
        if p.source == "compiled":
            f[0], f[1] = f[0] + p.prepare_s, f[1] + p.compiled
        elif p.source == "loaded":
            loaded[0], loaded[1] = loaded[0] + p.prepare_s, loaded[1] + p.loaded
        f[2], f[3] = f[2] + p.run_s, f[3] + p.units
    for family, (prepare, compiled, run, units) in sums.items():
        if compiled:
            compile_s[family] = prepare / compiled
        unit_s[family] = run / units
    load_s = loaded[0] / loaded[1] if loaded[1] else before.load_s
    return dataclasses.replace(before, compile_s=compile_s, unit_s=unit_s, load_s=load_s)


def _read(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_costs(folder: pathlib.Path | None, device: str, platform: str, workers: int) -> Costs:
    """``device``'s costs from ``folder``'s costs file (the cache), with its
    ``platform`` and compile ``workers``; none measured (the priors) where the
    file has no entry for it or cannot be read."""
    fresh = Costs({}, {}, prior_of(platform).load_s, workers, platform)
    entry = {} if folder is None else _read(folder / COSTS_FILE).get(device)
    if not isinstance(entry, dict):
        return fresh
    try:
        return Costs(
            dict(entry.get("compile_s", {})),
            dict(entry.get("unit_s", {})),
            entry.get("load_s", fresh.load_s),
            workers,
            platform,
        )
    except (TypeError, ValueError):  # an entry that does not read: start afresh
        return fresh


def save_costs(folder: pathlib.Path | None, device: str, costs: Costs) -> None:
    """Write this device's ``costs`` into ``folder``'s costs file (atomically;
    other devices' entries kept; a folder that cannot be written is skipped)."""
    if folder is None:
        return
    path = folder / COSTS_FILE
    data = _read(path)
    data[device] = costs.to_json()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(path, data)
    except OSError:
        pass
