"""The one plain-text table printer of the studies and the ``fa-jax`` command.

:func:`format_table` lays rows out in columns two spaces apart, each as wide as
its widest cell; floats are written with one format (``.3g`` unless told),
everything else with ``str``.  Columns are left-aligned unless named in
``right``.  :func:`print_table` prints it, after a blank line and the title.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["format_table", "print_table"]


def _cell(v: Any, float_format: str) -> str:
    if isinstance(v, float):
        return format(v, float_format)
    return str(v)


def format_table(
    columns: Sequence[str],
    rows: Iterable[Sequence | Mapping],
    *,
    title: str | None = None,
    right: Collection[str] = (),
    float_format: str = ".3g",
) -> str:
    """``rows`` (sequences in column order, or mappings keyed by column) as text:
    the title line if given, the header, one line per row; no trailing spaces."""
    columns = list(columns)
    body = []
    for r in rows:
        if not isinstance(r, Mapping) and len(r) != len(columns):
            raise ValueError(f"format_table: expected {len(columns)} cells, got {list(r)!r}")
        body.append(
            [
                _cell(r[c] if isinstance(r, Mapping) else r[i], float_format)
                for i, c in enumerate(columns)
            ]
        )
    widths = [max([len(c), *(len(b[i]) for b in body)]) for i, c in enumerate(columns)]
    unknown = set(right) - set(columns)
    if unknown:
        raise ValueError(
            f"format_table: right: expected names from {columns}, got {sorted(unknown)}"
        )

    def line(cells):
        return "  ".join(
            v.rjust(w) if c in right else v.ljust(w) for v, w, c in zip(cells, widths, columns)
        ).rstrip()

    lines = [] if title is None else [title]
    return "\n".join([*lines, line(columns), *(line(b) for b in body)])


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence | Mapping],
    *,
    title: str | None = None,
    right: Collection[str] = (),
    float_format: str = ".3g",
) -> None:
    """Print :func:`format_table`'s text, after a blank line when there is a title."""
    if title is not None:
        print()
    print(format_table(columns, rows, title=title, right=right, float_format=float_format))
