"""run_sweep resumed from every partial state its output folder can be left in.

One uninterrupted run gives the reference rows.  Each case below cuts that
output the way a kill, a crash or a user can leave it (no CSV yet, a header
only, a length bucket ("chunk") only partly written, a configuration missing
one row, rows of foreign or stray parts, a missing metadata.json, a stray
temporary file) and resumes.  The resumed CSV must hold every configuration's
rows exactly once, each value the uninterrupted run's; the rows of the
configurations that were complete are kept as they stood (they carry a
sentinel value here, which a recomputation would overwrite), and every row of
an incomplete configuration is computed again.
"""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter

import pytest

from fa_jax.attention import Blocks
from fa_jax.studies.sweep import COLUMNS, COMPARISONS, KEY_COLUMNS, METRICS, Grid, run_sweep

# test_sweep.py's grid with one tiling: the programs are the same ones.  One length
# bucket (16, 24) holds 2 formats x 2 lengths x 2 seeds = 8 configurations a group,
# and the two variants make two groups.
GRID = Grid(
    formats=("bf16", (5, 4)),
    seq_lens=(16, 24),
    blocks=(Blocks(8, 8),),
    variants=("fa2", "fa1"),
    seeds=(0, 1),
    d=8,
)
ROWS_PER_CONFIG = len(COMPARISONS) * len(METRICS)
SENTINEL = "-1.25"  # no metric of the grid takes this value


def key_of(row) -> tuple:
    return tuple(row[c] for c in KEY_COLUMNS)


def read(path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def write(path, rows, columns=COLUMNS) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    rows = read(run_sweep(GRID, tmp_path_factory.mktemp("full"), quiet=True))
    configs = list(dict.fromkeys(key_of(r) for r in rows))
    assert len(configs) == 16 and len(rows) == 16 * ROWS_PER_CONFIG
    assert all(r["value"] != SENTINEL for r in rows)
    return rows, configs


def _by_config(rows):
    out: dict = {}
    for r in rows:
        out.setdefault(key_of(r), []).append(r)
    return out


def resume(tmp_path, rows, *, metadata=True, kept=()):
    """Write ``rows`` (the configurations in ``kept`` with sentinel values) as the
    output of an interrupted run, resume, and return the resumed rows."""
    out = tmp_path / "out"
    out.mkdir()
    if rows is not None:
        marked = [{**r, "value": SENTINEL} if key_of(r) in kept else r for r in rows]
        write(out / "results.csv", marked)
    if metadata:
        (out / "metadata.json").write_text(json.dumps({"config": {}}))
    run_sweep(GRID, out, quiet=True)
    assert json.loads((out / "metadata.json").read_text())["config"] == GRID.to_json()
    return read(out / "results.csv")


def check(resumed, full, kept=()):
    """Every configuration once, all its rows; kept ones untouched, the rest recomputed."""
    rows, _ = full
    want = {(key_of(r), r["comparison"], r["metric"]): r["value"] for r in rows}
    got = Counter((key_of(r), r["comparison"], r["metric"]) for r in resumed)
    assert set(got) >= set(want), f"missing rows: {len(set(want) - set(got))}"
    assert max(got.values()) == 1, "a row written twice"
    for r in resumed:
        where = (key_of(r), r["comparison"], r["metric"])
        if where not in want:
            continue  # a foreign configuration's row (kept as found)
        expected = SENTINEL if key_of(r) in kept else want[where]
        assert r["value"] == expected, (where, r["value"], expected)


def test_no_csv_yet(tmp_path, full):
    check(resume(tmp_path, None), full)


def test_a_header_only(tmp_path, full):
    check(resume(tmp_path, []), full)


def test_the_first_group_written_the_second_not(tmp_path, full):
    rows, configs = full
    first = set(configs[:8])
    check(resume(tmp_path, [r for r in rows if key_of(r) in first], kept=first), full, first)


@pytest.mark.parametrize("done", [1, 3, 7])
def test_a_chunk_partly_written(tmp_path, full, done):
    """The first ``done`` configurations of the second group's one chunk complete."""
    rows, configs = full
    kept = set(configs[: 8 + done])
    check(resume(tmp_path, [r for r in rows if key_of(r) in kept], kept=kept), full, kept)


@pytest.mark.parametrize("where", ["first", "last"])
def test_one_configuration_missing_one_row(tmp_path, full, where):
    """Every configuration complete but one, which lacks a row: it alone is
    computed again (in a chunk whose other seven are done)."""
    rows, configs = full
    lacking = configs[0] if where == "first" else configs[-1]
    dropped = next(i for i, r in enumerate(rows) if key_of(r) == lacking)
    kept = set(configs) - {lacking}
    partial = rows[:dropped] + rows[dropped + 1 :]
    check(resume(tmp_path, partial, kept=kept), full, kept)


def test_every_configuration_missing_a_different_row(tmp_path, full):
    rows, configs = full
    groups = _by_config(rows)
    partial = [r for i, c in enumerate(configs) for j, r in enumerate(groups[c]) if j != i % 12]
    check(resume(tmp_path, partial), full)


def test_a_configuration_with_a_foreign_part(tmp_path, full):
    """A row whose (comparison, metric) is not the study's makes its configuration
    incomplete: it is computed again and the stray row dropped."""
    rows, configs = full
    stray = {**rows[0], "metric": "median_abs_diff"}
    kept = set(configs) - {configs[0]}
    resumed = resume(tmp_path, [*rows, stray], kept=kept)
    assert all(r["metric"] in METRICS for r in resumed)
    check(resumed, full, kept)


def test_rows_of_another_grid_are_kept(tmp_path, full):
    rows, configs = full
    other = [{**r, "d": "16"} for r in _by_config(rows)[configs[0]]]  # complete, not ours
    half = set(configs[:4])
    resumed = resume(tmp_path, other + [r for r in rows if key_of(r) in half], kept=half)
    assert [r for r in resumed if r["d"] == "16"] == other
    check(resumed, full, half)


def test_metadata_missing(tmp_path, full):
    rows, configs = full
    check(resume(tmp_path, rows, metadata=False, kept=set(configs)), full, set(configs))


def test_a_stray_temporary_file_is_ignored(tmp_path, full):
    rows, configs = full
    out = tmp_path / "out"
    out.mkdir()
    (out / ".results.csv.0123abcd.tmp").write_text(",".join(COLUMNS) + "\ngarbage\n")
    first = set(configs[:8])
    write(out / "results.csv", [{**r, "value": SENTINEL} for r in rows if key_of(r) in first])
    run_sweep(GRID, out, quiet=True)
    check(read(out / "results.csv"), full, first)


def test_a_complete_csv_is_left_byte_for_byte(tmp_path, full):
    rows = full[0]
    out = tmp_path / "out"
    out.mkdir()
    write(out / "results.csv", rows)
    before = (out / "results.csv").read_bytes()
    run_sweep(GRID, out, quiet=True)
    assert (out / "results.csv").read_bytes() == before
    shutil.rmtree(out)


def test_a_later_group_complete_an_earlier_one_partly(tmp_path, full):
    """Groups are resumed each on its own, whichever order they were left in."""
    rows, configs = full
    kept = set(configs[2:])
    check(resume(tmp_path, [r for r in rows if key_of(r) in kept], kept=kept), full, kept)


def test_a_torn_last_row(tmp_path, full):
    """A CSV whose last line was cut short (copied while written, or by another
    tool): that configuration is incomplete and computed again; the torn row goes."""
    rows, configs = full
    last = configs[-1]
    out = tmp_path / "out"
    out.mkdir()
    kept = set(configs) - {last}
    write(out / "results.csv", [{**r, "value": SENTINEL} if key_of(r) in kept else r for r in rows])
    text = (out / "results.csv").read_text()
    (out / "results.csv").write_text(text[: text.rstrip("\n").rfind(",flash_vs_baseline")])
    run_sweep(GRID, out, quiet=True)
    check(read(out / "results.csv"), full, kept)
