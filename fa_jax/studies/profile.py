"""Where a study's time goes: compile (or load) and run seconds per program.

A :class:`Profile` collects one :class:`ProgramTime` per compiled program as a
sweep runs (:class:`~fa_jax.studies.sweep.executables.Executables` records into
it), plus named phases such as the metrics; :meth:`Profile.table` renders them
for ``--profile``.  Times are wall-clock seconds from ``time.perf_counter``;
a program's run time includes copying its results to the host.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Profile", "ProgramTime"]


@dataclasses.dataclass
class ProgramTime:
    """The programs of one label (a label can name several shapes): how many were
    compiled and how many loaded from the cache, and their seconds."""

    label: str
    compiled: int = 0
    loaded: int = 0
    prepare_s: float = 0.0
    run_s: float = 0.0
    calls: int = 0

    @property
    def source(self) -> str:
        """ "compiled", "loaded", "mixed", or "memory" (prepared before this profile)."""
        if self.compiled and self.loaded:
            return "mixed"
        return "compiled" if self.compiled else "loaded" if self.loaded else "memory"


@dataclasses.dataclass
class Profile:
    """Program and phase timings of one or more runs (module docstring)."""

    programs: dict[str, ProgramTime] = dataclasses.field(default_factory=dict)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def prepared(self, label: str, source: str, seconds: float) -> None:
        """One program of ``label`` obtained from ``source`` ("compiled" or "loaded")."""
        entry = self.programs.setdefault(label, ProgramTime(label))
        if source == "compiled":
            entry.compiled += 1
        elif source == "loaded":
            entry.loaded += 1
        else:
            raise ValueError(f"Profile.prepared: expected 'compiled' or 'loaded', got {source!r}")
        entry.prepare_s += seconds

    def ran(self, label: str, seconds: float) -> None:
        entry = self.programs.setdefault(label, ProgramTime(label))
        entry.run_s += seconds
        entry.calls += 1

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def table(self) -> str:
        """A plain-text table: one line per program, then the phases and totals."""
        rows = sorted(self.programs.values(), key=lambda p: -(p.prepare_s + p.run_s))
        width = max([len(p.label) for p in rows] + [len(n) for n in self.phases] + [7])

        def line(name, source="", calls="", prepare="", run=""):
            return f"{name:<{width}}  {source:>8}  {calls:>5}  {prepare:>9}  {run:>7}"

        lines = [line("program", "source", "calls", "prepare s", "run s")]
        for p in rows:
            lines.append(
                line(p.label, p.source, str(p.calls), f"{p.prepare_s:.2f}", f"{p.run_s:.2f}")
            )
        for name, seconds in self.phases.items():
            lines.append(line(name, run=f"{seconds:.2f}"))
        prepare = sum(p.prepare_s for p in rows)
        run = sum(p.run_s for p in rows) + sum(self.phases.values())
        compiled = sum(p.compiled for p in rows)
        loaded = sum(p.loaded for p in rows)
        total = line("total", prepare=f"{prepare:.2f}", run=f"{run:.2f}")
        lines.append(f"{total}   ({compiled} compiled, {loaded} loaded)")
        return "\n".join(lines)
