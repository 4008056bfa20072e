"""The files every study writes: tidy CSV, resume reading, ``metadata.json``, plots.

A study's results are *tidy* CSV rows (one measured value per row, the columns
that identify it first) written by :func:`write_csv`: the whole file is
rewritten atomically (:func:`atomic_write`: a temporary file beside the target,
flushed, fsynced and renamed over it), so a reader, or a resumed run after a
kill, sees the previous complete file or the new one, never a torn one.
:func:`read_complete` is the resume side: it keeps the rows of the
configurations whose every expected row is present and reports which those are,
so a re-run computes only what is missing.  Files are created with the
permissions ``0o666 & ~umask``, as ``open`` would create them.

:func:`check_out_dir` is what every study calls before it computes: the output
folder must be a folder (or creatable as one), writable, and any CSV already in
it must have the study's columns, so a wrong ``--out`` fails at once and
overwrites nothing.

Part files: a study run by several processes (:mod:`fa_jax.studies.sweep.cluster`)
keeps each process's rows in a part file of its own, ``part-NNNNN.csv`` in a
folder under ``OUT/parts/`` (:func:`part_path`), each with the study's columns
and rewritten atomically like any CSV, beside ``order.csv``, the key columns of
every configuration in the order a one-process run writes them.
:func:`read_parts` is their resume side, as :func:`read_complete` is the CSV's;
:func:`merge_parts` folds them into the results CSV in that order, so the merged
file is the one a single process would have written, byte for byte, and
removes the folder once no configuration is missing.

:func:`run_metadata` is the record of how a run was made (package versions,
backend, devices, the run's configuration, the command line, the start time),
written beside the results by :func:`write_json`.  :func:`pyplot` loads
matplotlib (the optional ``plot`` extra) for the figures.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import json
import os
import pathlib
import secrets
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import IO, Any

import numpy as np

__all__ = [
    "PARTS",
    "append_csv",
    "atomic_write",
    "check_out_dir",
    "merge_parts",
    "part_path",
    "pyplot",
    "read_complete",
    "read_csv",
    "read_parts",
    "run_metadata",
    "write_csv",
    "write_json",
]

PACKAGES = ("fa_jax", "jax", "jaxlib", "ml_dtypes", "numpy")
PARTS = "parts"  # the folder of part files in an output folder
ORDER = "order.csv"  # beside the part files: the configurations in one-process order


def _create(path: pathlib.Path) -> tuple[int, str]:
    """A new file beside ``path``, opened for writing with mode ``0o666 & ~umask``."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"atomic_write: no free temporary name beside {path}")


def atomic_write(path, write: Callable[[IO], Any], *, binary: bool = False) -> pathlib.Path:
    """Call ``write(fh)`` on a temporary file beside ``path``, flush and fsync it,
    then rename it over ``path``: readers see the old file or the new one, never a
    torn one.  On any error the temporary file is removed and ``path`` is unchanged."""
    path = pathlib.Path(path)
    fd, tmp = _create(path)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", newline="") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _writable(folder: pathlib.Path) -> bool:
    """``os.access`` says so and a probe file can be created (and is removed) there."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = _create(folder / "probe")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_out_dir(
    path, csv_columns: Mapping[str, Sequence[str]] | None = None, *, what: str = "output folder"
) -> pathlib.Path:
    """Check, before anything is computed or written, that ``path`` can hold a
    study's files; returns it as a Path.  Creates nothing.

    ValueError (naming ``what``) if ``path`` is an existing file, lies under a
    file, cannot be written (it or its nearest existing parent), or holds one of
    the CSVs named in ``csv_columns`` ({file name: columns}) with another header
    (a file this study did not write, which a run would overwrite)."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what}: expected a folder, got {str(path)!r}, which is a file")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise ValueError(
            f"{what}: expected a folder, got {str(path)!r}, which lies under the file {str(base)!r}"
        )
    if not _writable(base):
        raise ValueError(
            f"{what}: expected a writable folder, got {str(path)!r} ({base} is read-only)"
        )
    for name, columns in (csv_columns or {}).items():
        csv_path = path / name
        if not csv_path.exists():
            continue
        if not csv_path.is_file():
            raise ValueError(f"{what}: {str(csv_path)!r} is not a file")
        with open(csv_path, newline="") as fh:
            header = tuple(next(csv.reader(fh), ()))
        if header != tuple(columns):
            raise ValueError(
                f"{what}: {str(csv_path)!r} was not written by this study (expected the "
                f"columns {', '.join(columns)}; got {', '.join(header) or 'none'}); "
                "choose another folder or move the file"
            )
    return path


def write_csv(path, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> pathlib.Path:
    """``rows`` (dicts keyed by ``columns``) as a CSV with a header, written atomically."""

    def write(fh):
        w = csv.DictWriter(fh, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)

    return atomic_write(path, write)


def read_csv(path, columns: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The rows of a CSV as str dicts; ``[]`` if it does not exist.  With ``columns``,
    a file whose header differs is an error (it belongs to another study)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        header = tuple(reader.fieldnames or ())
    if columns is not None and header != tuple(columns):
        raise ValueError(f"{path}: expected the columns {tuple(columns)}, got {header}")
    return rows


def append_csv(
    path, columns: Sequence[str], old: list, new: Iterable[Mapping[str, Any]]
) -> pathlib.Path:
    """Extend ``old`` (the rows already in ``path``) by ``new`` and rewrite the file
    atomically: an append that a kill cannot tear."""
    old.extend(new)
    return write_csv(path, columns, old)


def read_complete(
    path,
    columns: Sequence[str],
    key: Sequence[str],
    part: Sequence[str],
    expected: Collection[tuple] | Callable[[tuple], Collection[tuple] | None],
) -> tuple[list[dict[str, str]], set[tuple]]:
    """Resume reading of a tidy CSV: ``(rows, done)``.

    A configuration is the tuple of its ``key`` columns' values; a row within it is
    named by its ``part`` columns.  ``done`` holds the configurations whose parts are
    exactly ``expected`` (as str tuples), or ``expected(config)`` where the parts
    differ by configuration (None: not a configuration of this run); ``rows`` are
    their rows, in file order.  Rows of incomplete configurations are dropped, to
    be computed again.
    """
    rows = read_csv(path, columns)

    def wanted(config: tuple) -> set | None:
        parts = expected(config) if callable(expected) else expected
        return None if parts is None else {tuple(str(v) for v in p) for p in parts}

    parts: dict[tuple, set] = {}
    for r in rows:
        parts.setdefault(tuple(r[c] for c in key), set()).add(tuple(r[c] for c in part))
    done = set()
    for k, got in parts.items():
        want = wanted(k)
        if want is not None and got == want:
            done.add(k)
    return [r for r in rows if tuple(r[c] for c in key) in done], done


def part_path(folder, index: int) -> pathlib.Path:
    """Process ``index``'s part file in ``folder`` (a folder under ``OUT/parts/``)."""
    return pathlib.Path(folder) / f"part-{index:05d}.csv"


def read_parts(
    folder,
    columns: Sequence[str],
    key: Sequence[str],
    part: Sequence[str],
    expected: Collection[tuple],
) -> tuple[list[dict[str, str]], set[tuple]]:
    """:func:`read_complete` over every part file in ``folder`` (by name): the rows
    of complete configurations, each configuration once (from the first file that
    holds it), and the set of those configurations."""
    rows: list[dict[str, str]] = []
    done: set[tuple] = set()
    for path in sorted(pathlib.Path(folder).glob("part-*.csv")):
        got, complete = read_complete(path, columns, key, part, expected)
        new = complete - done
        rows += [r for r in got if tuple(r[c] for c in key) in new]
        done |= new
    return rows, done


def merge_parts(
    csv_path,
    folder,
    columns: Sequence[str],
    key: Sequence[str],
    part: Sequence[str],
    expected: Collection[tuple],
) -> tuple[int, int]:
    """Fold the part files of ``folder`` into the CSV at ``csv_path``, atomically;
    returns (configurations taken from the parts, configurations of ``order.csv``
    still missing).

    The configurations of ``order.csv`` (from the CSV and the parts, the CSV's
    copy where both hold one) are written in that order, where the first of them
    stood in the CSV (at its end if none did); the CSV's other rows keep their
    places.  ``folder/metadata.json``, if any, is copied beside the CSV.  When
    nothing is missing the folder is removed (and ``parts/`` if it is then empty);
    otherwise the parts stay, as the resume record of the next run."""
    csv_path, folder = pathlib.Path(csv_path), pathlib.Path(folder)
    key = tuple(key)
    order = [tuple(r[c] for c in key) for r in read_csv(folder / ORDER, key)]
    index = {k: i for i, k in enumerate(order)}
    rows, done = read_complete(csv_path, columns, key, part, expected)
    part_rows, part_done = read_parts(folder, columns, key, part, expected)

    def key_of(r):
        return tuple(r[c] for c in key)

    ours: dict[tuple, list] = {}
    for r in rows:
        if key_of(r) in index:
            ours.setdefault(key_of(r), []).append(r)
    for r in part_rows:
        if key_of(r) not in done:
            ours.setdefault(key_of(r), []).append(r)
    at = next((i for i, r in enumerate(rows) if key_of(r) in index), len(rows))
    seq = {k: i for i, k in enumerate(ours)}  # a part's stray configurations: last, as read
    ordered = sorted(ours, key=lambda k: (index.get(k, len(index)), seq[k]))
    merged = rows[:at] + [r for k in ordered for r in ours[k]]
    merged += [r for r in rows[at:] if key_of(r) not in index]
    write_csv(csv_path, columns, merged)
    meta = folder / "metadata.json"
    if meta.exists():
        text = meta.read_text()
        atomic_write(csv_path.parent / "metadata.json", lambda fh: fh.write(text))
    missing = sum(1 for k in order if k not in ours)
    if not missing:
        for path in sorted(folder.iterdir(), key=lambda p: p.name == ORDER):  # order.csv last
            path.unlink()
        folder.rmdir()
        with contextlib.suppress(OSError):  # other runs' parts may remain
            folder.parent.rmdir()
    return len(part_done - done), missing


def run_metadata(config: Mapping, *, packages: Sequence[str] = (), **extra) -> dict:
    """How a run was made: versions of fa_jax, jax, jaxlib, ml_dtypes, numpy (and
    ``packages``), backend, device kind and count, ``config``, the command line, the
    start time (UTC, ISO 8601), then ``extra``."""
    import importlib

    import jax

    versions = {}
    for name in (*PACKAGES, *packages):
        versions[name] = getattr(importlib.import_module(name), "__version__", None)
    devices = jax.devices()
    return {
        **versions,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "command": list(sys.argv),
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "config": dict(config),
        **extra,
    }


def write_json(path, obj) -> pathlib.Path:
    """``obj`` as indented JSON, written atomically."""
    return atomic_write(path, lambda fh: json.dump(obj, fh, indent=2))


def pyplot(purpose: str):
    """``matplotlib.pyplot`` on the non-interactive Agg backend; without matplotlib,
    an ImportError that names ``purpose`` and the ``plot`` extra."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            f"{purpose} needs matplotlib; install it with pip install 'fa-jax[plot]'"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mean_over_seeds(rows, key_fields, value_fields) -> list[dict]:
    """Rows grouped by ``key_fields`` (first-seen order), each of ``value_fields``
    averaged over the group, with ``seeds`` the group's size."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[f] for f in key_fields), []).append(r)
    out = []
    for key, rs in groups.items():
        row = dict(zip(key_fields, key))
        for f in value_fields:
            row[f] = float(np.mean([float(r[f]) for r in rs]))
        row["seeds"] = len(rs)
        out.append(row)
    return out
