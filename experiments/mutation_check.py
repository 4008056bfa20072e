"""A targeted mutation check of the numerics: does the test suite notice a wrong bit?

Each mutant, read from experiments/mutants.toml (data, not code: its header says
the keys), changes one exact snippet of a module of fa_jax (a flipped comparison,
a rounding mode's branch, a stage swapped in a policy, a dropped rescale, an
off-by-one mask, ...) and names the tests that must fail on it.  For every
mutant the script copies fa_jax/, tests/ and pyproject.toml into a temporary
folder, applies the mutant there
(the original snippet must occur exactly once), and runs

    python -m pytest -x -q -rs -p no:cacheprovider -n 0 -m "not slow" <the mutant's tests>

in that folder with PYTHONPATH pointing at the copy (checked: the copy is the
fa_jax that is imported).  The working checkout is never modified.  A mutant is
killed when pytest fails, survives when it passes, and times out past
``--timeout`` seconds.  Mutants that cannot change any result carry an
``equivalent`` reason and are reported but not counted as survivors.  A mutant
whose tests pass with some of them skipped (a real kernel absent here, or a model
that refuses this CPU's code) is not judged on this host: it is reported with
the skips' reasons and counted neither as killed nor as a survivor, so that a
CPU which cannot run a check neither fails the run nor passes it for that check.
``--budget`` bounds the whole run's time: past it no mutant is started, and
those left are listed as not run (counted neither way), so that CI on a slow
host ends within its limit and says which mutants it did not judge; ``--shuffle
SEED`` runs them in an order drawn from SEED, so that budgeted runs of
successive commits judge different ones.

    python experiments/mutation_check.py [--list] [--only PATTERN] [--jobs N] [--timeout S]
                                         [--budget S] [--shuffle SEED]

Prints one line per mutant and the score (killed / counted); exits 0 when every
mutant is killed or listed as equivalent, else 1.  The last run's score and its
survivors: docs/mutation.md.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
COPIED = ("fa_jax", "tests", "pyproject.toml")


class Mutant(NamedTuple):
    """One change: ``original`` (occurring exactly once in ``module``) becomes ``replacement``."""

    module: str
    original: str
    replacement: str
    description: str
    tests: tuple[str, ...]
    equivalent: str | None = None

    @property
    def name(self) -> str:
        """``module:description``: a core module by its name, an engine's by its
        folder and name (``ggml_vec``; ``ggml`` for its __init__; kernels/x86/ as
        ``cpu``, ``mlas``, ``tile_dot``), a study's by its name."""
        parts = Path(self.module).with_suffix("").parts[1:]
        if parts[0] == "studies":
            parts = parts[-1:]
        kept = [p for p in parts if p not in ("kernels", "x86", "__init__")]
        if kept[0] == "carrier32":  # the float32 carrier's modules, as before its package
            kept = [_CARRIER32_NAMES[kept[-1]]]
        return f"{'_'.join(kept)}:{self.description}"


_CARRIER32_NAMES = {
    "elementwise": "ops32",
    "sums": "sum32",
    "lse": "lse32",
    "exp": "exp32",
    "slices": "slices32",
    "native": "native32",
}


MUTANTS_FILE = Path(__file__).with_name("mutants.toml")


def load_mutants(path: Path = MUTANTS_FILE) -> tuple[Mutant, ...]:
    """The mutants of ``path`` (experiments/mutants.toml: its header says the keys),
    in their order; ValueError naming a table with a key missing or unknown."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # pyright: ignore[reportMissingImports]
    keys = {"module", "description", "original", "replacement", "tests", "equivalent"}
    mutants = []
    for i, d in enumerate(tomllib.loads(path.read_text())["mutant"]):
        if not keys - {"equivalent"} <= set(d) <= keys:
            raise ValueError(
                f"{path.name}: mutant {i}: expected the keys {sorted(keys)} (equivalent "
                f"optional), got {sorted(d)}"
            )
        mutants.append(
            Mutant(
                f"fa_jax/{d['module']}.py",
                d["original"],
                d["replacement"],
                d["description"],
                tuple(d["tests"]),
                d.get("equivalent"),
            )
        )
    return tuple(mutants)


MUTANTS = load_mutants()


def check_unique(mutant: Mutant, root: Path = REPO) -> None:
    """Raise ValueError unless the mutant's original snippet occurs exactly once."""
    text = (root / mutant.module).read_text()
    count = text.count(mutant.original)
    if count != 1:
        raise ValueError(
            f"{mutant.name}: expected the original snippet once in {mutant.module}, "
            f"found it {count} times: {mutant.original!r}"
        )


class Outcome(NamedTuple):
    mutant: Mutant
    status: str  # killed, survived, skipped (not judged here), timeout, error
    seconds: float
    detail: str = ""


def _workspace() -> Path:
    """A fresh copy of the package, the tests and pyproject.toml; checks that Python
    imports fa_jax from it."""
    root = Path(tempfile.mkdtemp(prefix="fa_jax_mutant_"))
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, root / name)
    probe = subprocess.run(
        [sys.executable, "-c", "import fa_jax; print(fa_jax.__file__)"],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    imported = Path(probe.stdout.strip()).resolve()
    if probe.returncode != 0 or root.resolve() not in imported.parents:
        raise RuntimeError(f"the copy in {root} is not the fa_jax imported: {probe.stdout}")
    return root


def _env(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FA_JAX_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def run_mutant(mutant: Mutant, root: Path, timeout: float) -> Outcome:
    """Apply ``mutant`` in the copy at ``root``, run its tests, restore the file."""
    path = root / mutant.module
    original = path.read_text()
    check_unique(mutant, root)
    path.write_text(original.replace(mutant.original, mutant.replacement, 1))
    start = time.perf_counter()
    # -m "not slow": the named tests run whichever tier the default run keeps them in.
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0"]
    cmd += ["-m", "not slow"]
    try:
        proc = subprocess.Popen(
            [*cmd, *mutant.tests],
            cwd=root,
            env=_env(root),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return Outcome(mutant, "timeout", time.perf_counter() - start)
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - start
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if proc.returncode == 0:
        skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
        if skips:  # passed with checks this host cannot run: not judged here
            return Outcome(mutant, "skipped", seconds, f"{last}; {skips[0]}")
        return Outcome(mutant, "survived", seconds, last)
    if proc.returncode in (1, 2):  # failures, or errors the mutant caused at collection
        return Outcome(mutant, "killed", seconds, last)
    return Outcome(mutant, "error", seconds, f"pytest exit {proc.returncode}: {last}")


def run_all(
    mutants, jobs: int, timeout: float, report=print, budget: float | None = None
) -> list[Outcome]:
    """Run the mutants on ``jobs`` workers, each with a copy of its own; past
    ``budget`` seconds none is started any more (each left is "not run")."""
    end = None if budget is None else time.perf_counter() + budget
    spaces: queue.Queue[Path] = queue.Queue()
    roots = [_workspace() for _ in range(min(jobs, len(mutants)))]
    for root in roots:
        spaces.put(root)
    lock = threading.Lock()

    def one(mutant: Mutant) -> Outcome:
        root = spaces.get()
        try:
            if end is not None and time.perf_counter() > end:
                outcome = Outcome(mutant, "not run", 0.0, f"the {budget:.0f} s budget was spent")
            else:
                outcome = run_mutant(mutant, root, timeout)
        finally:
            spaces.put(root)
        with lock:
            report(_line(outcome))
        return outcome

    try:
        with ThreadPoolExecutor(max_workers=len(roots)) as pool:
            return list(pool.map(one, mutants))
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def _line(o: Outcome) -> str:
    status = o.status if o.mutant.equivalent is None or o.status == "killed" else "equivalent"
    return f"{status:10s} {o.seconds:7.1f}s  {o.mutant.name}  {o.detail}"


def summary(outcomes: list[Outcome]) -> tuple[str, bool]:
    """(the score line, whether every mutant is killed or listed as equivalent)."""
    unrun = [o for o in outcomes if o.status == "not run"]
    unjudged = [
        o for o in outcomes if (o.status == "skipped" and o.mutant.equivalent is None) or o in unrun
    ]
    counted = [o for o in outcomes if o.mutant.equivalent is None and o not in unjudged]
    killed = sum(o.status == "killed" for o in counted)
    equivalent = sum(o.mutant.equivalent is not None for o in outcomes)
    bad = [o for o in counted if o.status != "killed"]
    line = f"score: {killed} / {len(counted)} killed ({equivalent} listed as equivalent"
    if len(unjudged) > len(unrun):
        line += f"; {len(unjudged) - len(unrun)} not judged on this host: their tests skip here"
    if unrun:
        line += f"; {len(unrun)} not run: the time budget was spent"
    return line + ")", not bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", metavar="PATTERN", help="run mutants whose name matches (regex)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds after which no mutant is started (those left are listed as not run)",
    )
    parser.add_argument(
        "--shuffle", metavar="SEED", help="run the mutants in an order drawn from SEED"
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs: expected a positive integer, got {args.jobs}")
    if args.timeout <= 0:
        parser.error(f"--timeout: expected a positive number, got {args.timeout}")
    mutants = [m for m in MUTANTS if args.only is None or re.search(args.only, m.name)]
    for m in mutants:
        check_unique(m)
    if args.list:
        for m in mutants:
            eq = "  [equivalent]" if m.equivalent else ""
            print(f"{m.name}{eq}\n    tests: {' '.join(m.tests)}")
        return 0
    if not mutants:
        print(f"no mutant matches {args.only!r}", file=sys.stderr)
        return 1
    if args.shuffle is not None:
        random.Random(args.shuffle).shuffle(mutants)
        print(f"mutants shuffled with seed {args.shuffle!r}")
    start = time.perf_counter()
    outcomes = run_all(mutants, args.jobs, args.timeout, budget=args.budget)
    line, ok = summary(outcomes)
    print(line)
    for o in outcomes:
        if o.mutant.equivalent is not None and o.status != "killed":
            print(f"equivalent: {o.mutant.name}: {o.mutant.equivalent}")
        elif o.status == "skipped":
            print(f"not judged here: {o.mutant.name}: {o.detail}")
        elif o.status == "not run":
            print(f"not run: {o.mutant.name}: {o.detail}")
        elif o.status != "killed":
            print(f"{o.status}: {o.mutant.name} (tests: {' '.join(o.mutant.tests)})")
    print(f"wall time: {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
