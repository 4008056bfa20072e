"""Where a study's time goes: compile (or load) and run seconds per program.

A :class:`Profile` collects one :class:`ProgramTime` per compiled program as a
sweep runs (:class:`~fa_jax.studies.sweep.executables.Executables` records into
it), plus named phases such as the metrics; :meth:`Profile.table` renders them
for ``--profile``.  Times are wall-clock seconds from ``time.perf_counter``;
a program's run time includes copying its results to the host.

:class:`CallProfile` times whole calls instead (``fa-jax validate --profile``:
each real kernel and each model call), splitting each into JAX's tracing and
lowering, XLA's compiling (JAX's monitoring events
``/jax/core/compile/jaxpr_trace_duration``, ``.../jaxpr_to_mlir_module_duration``
and ``.../backend_compile_duration``) and the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import jax

__all__ = ["CallProfile", "CallTime", "Profile", "ProgramTime"]


@dataclasses.dataclass
class ProgramTime:
    """The programs of one label (a label can name several shapes): how many were
    compiled, how many loaded from the cache and how many received from another
    process of a multi-process sweep, and their seconds; the units of work its
    calls reported, and the (prepare, run) seconds a plan predicted for it
    (:mod:`fa_jax.studies.sweep.planner`)."""

    label: str
    compiled: int = 0
    loaded: int = 0
    received: int = 0
    prepare_s: float = 0.0
    run_s: float = 0.0
    calls: int = 0
    units: float = 0.0
    predicted: tuple[float, float] | None = None

    @property
    def source(self) -> str:
        """ "compiled", "loaded", "received", "mixed", or "memory" (prepared
        before this profile)."""
        counts = {"compiled": self.compiled, "loaded": self.loaded, "received": self.received}
        sources = [name for name, n in counts.items() if n]
        return "mixed" if len(sources) > 1 else sources[0] if sources else "memory"


@dataclasses.dataclass
class Profile:
    """Program and phase timings of one or more runs (module docstring)."""

    programs: dict[str, ProgramTime] = dataclasses.field(default_factory=dict)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    plans: list[str] = dataclasses.field(default_factory=list)

    def prepared(self, label: str, source: str, seconds: float) -> None:
        """One program of ``label`` obtained from ``source`` ("compiled",
        "loaded" or "received")."""
        entry = self.programs.setdefault(label, ProgramTime(label))
        if source not in ("compiled", "loaded", "received"):
            raise ValueError(
                f"Profile.prepared: expected 'compiled', 'loaded' or 'received', got {source!r}"
            )
        setattr(entry, source, getattr(entry, source) + 1)
        entry.prepare_s += seconds

    def ran(self, label: str, seconds: float, units: float = 0.0) -> None:
        """One call of ``label``'s program: its seconds and its ``units`` of work."""
        entry = self.programs.setdefault(label, ProgramTime(label))
        entry.run_s += seconds
        entry.calls += 1
        entry.units += units

    def predict(self, label: str, prepare_s: float, run_s: float) -> None:
        """A plan's prediction for ``label``'s programs (added to any earlier one)."""
        entry = self.programs.setdefault(label, ProgramTime(label))
        before = entry.predicted or (0.0, 0.0)
        entry.predicted = (before[0] + prepare_s, before[1] + run_s)

    def planned(self, line: str) -> None:
        """A line describing a plan, printed above the table."""
        self.plans.append(line)

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def table(self) -> str:
        """A plain-text table: the plans' lines, one line per program (with the
        plan's predicted seconds where there is one), then the phases and totals."""
        rows = sorted(self.programs.values(), key=lambda p: -(p.prepare_s + p.run_s))
        width = max([len(p.label) for p in rows] + [len(n) for n in self.phases] + [7])
        planned = any(p.predicted is not None for p in rows)

        def line(name, source="", calls="", prepare="", run="", predicted=("", "")):
            text = f"{name:<{width}}  {source:>8}  {calls:>5}  {prepare:>9}  {run:>7}"
            return text + (f"  {predicted[0]:>9}  {predicted[1]:>8}" if planned else "")

        def seconds(pair):
            return ("", "") if pair is None else tuple(f"{x:.2f}" for x in pair)

        lines = [f"plan: {text}" for text in self.plans]
        lines.append(
            line("program", "source", "calls", "prepare s", "run s", ("pred prep", "pred run"))
        )
        for p in rows:
            lines.append(
                line(
                    p.label,
                    p.source,
                    str(p.calls),
                    f"{p.prepare_s:.2f}",
                    f"{p.run_s:.2f}",
                    seconds(p.predicted),
                )
            )
        for name, secs in self.phases.items():
            lines.append(line(name, run=f"{secs:.2f}"))
        prepare = sum(p.prepare_s for p in rows)
        run = sum(p.run_s for p in rows) + sum(self.phases.values())
        compiled = sum(p.compiled for p in rows)
        loaded = sum(p.loaded for p in rows)
        received = sum(p.received for p in rows)
        guessed = [p.predicted for p in rows if p.predicted is not None]
        total = line(
            "total",
            prepare=f"{prepare:.2f}",
            run=f"{run:.2f}",
            predicted=seconds(tuple(map(sum, zip(*guessed))) if guessed else None),
        )
        counts = f"{compiled} compiled, {loaded} loaded"
        if received:
            counts += f", {received} from other processes"
        lines.append(f"{total}   ({counts})")
        return "\n".join(lines)


# -- kernel calls: trace, compile and the rest ---------------------------------------

_TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CallTime:
    """The calls of one label (e.g. "xla model"): their wall-clock seconds, of which
    JAX spent ``trace_s`` tracing and lowering programs and ``compile_s`` in XLA's
    compiler (or loading from its cache); the rest runs programs and the host's
    work between them (for a model: the probes of the real kernel too)."""

    label: str
    calls: int = 0
    trace_s: float = 0.0
    compile_s: float = 0.0
    total_s: float = 0.0

    @property
    def rest_s(self) -> float:
        return max(0.0, self.total_s - self.trace_s - self.compile_s)


@dataclasses.dataclass
class CallProfile:
    """Trace, compile and other seconds per labelled call (:meth:`call`), read from
    JAX's monitoring events; :meth:`table` renders them for ``validate --profile``."""

    calls: dict[str, CallTime] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def call(self, label: str) -> Iterator[None]:
        """Time the block as one call of ``label``."""
        entry = self.calls.setdefault(label, CallTime(label))

        def listen(event: str, duration_secs: float, **_: str | int) -> None:
            if event in _TRACE_EVENTS:
                entry.trace_s += duration_secs
            elif event == _COMPILE_EVENT:
                entry.compile_s += duration_secs

        jax.monitoring.register_event_duration_secs_listener(listen)
        start = time.perf_counter()
        try:
            yield
        finally:
            entry.total_s += time.perf_counter() - start
            entry.calls += 1
            jax.monitoring.unregister_event_duration_listener(listen)

    def table(self, total_s: float | None = None) -> str:
        """One line per label, then (given the command's ``total_s``) the time
        outside every call: inputs, the FP64 golden, presets, comparisons."""
        rows = list(self.calls.values())
        width = max([len(r.label) for r in rows] + [len("outside the calls")])

        def line(name, calls="", trace="", compile_="", rest="", total=""):
            return f"{name:<{width}}  {calls:>5}  {trace:>7}  {compile_:>9}  {rest:>6}  {total:>7}"

        lines = [line("call", "calls", "trace s", "compile s", "rest s", "total s")]
        for r in rows:
            lines.append(
                line(
                    r.label,
                    str(r.calls),
                    f"{r.trace_s:.2f}",
                    f"{r.compile_s:.2f}",
                    f"{r.rest_s:.2f}",
                    f"{r.total_s:.2f}",
                )
            )
        if total_s is not None:
            inside = sum(r.total_s for r in rows)
            lines.append(line("outside the calls", total=f"{max(0.0, total_s - inside):.2f}"))
            lines.append(line("total", total=f"{total_s:.2f}"))
        return "\n".join(lines)
