"""Part files and their merge (fa_jax.studies.results), the partition of a
multi-process sweep (fa_jax.studies.sweep.partition) and the one-process sweep
that finds the part files of a killed multi-process run."""

import pathlib
import shutil

import pytest

from fa_jax.attention import Blocks
from fa_jax.cli import main
from fa_jax.studies.results import (
    merge_parts,
    part_path,
    read_csv,
    read_parts,
    write_csv,
)
from fa_jax.studies.sweep import (
    COLUMNS,
    KEY_COLUMNS,
    Grid,
    canonical_keys,
    merge_sweep,
    parts_folder,
    run_sweep,
)
from fa_jax.studies.sweep.partition import partition, unit_cost, unit_of

DATA = pathlib.Path(__file__).parent / "data"
KEY = ("cfg",)
PART = ("part",)
COLS = ("cfg", "part", "value")
EXPECTED = [("a",), ("b",)]


def rows_of(*cfgs):
    return [{"cfg": c, "part": p, "value": f"{c}{p}"} for c in cfgs for p in ("a", "b")]


def folder_with(tmp_path, order, parts):
    folder = tmp_path / "out" / "parts" / "g"
    folder.mkdir(parents=True)
    write_csv(folder / "order.csv", KEY, [{"cfg": c} for c in order])
    for i, rows in parts.items():
        write_csv(part_path(folder, i), COLS, rows)
    return folder


def test_merge_writes_the_order_of_order_csv_and_removes_the_parts(tmp_path):
    folder = folder_with(tmp_path, "1234", {0: rows_of("3", "1"), 2: rows_of("4", "2")})
    csv_path = tmp_path / "out" / "results.csv"
    assert merge_parts(csv_path, folder, COLS, KEY, PART, EXPECTED) == (4, 0)
    assert read_csv(csv_path, COLS) == rows_of("1", "2", "3", "4")
    assert not (tmp_path / "out" / "parts").exists()


def test_merge_keeps_other_rows_in_place_and_the_csv_copy_of_a_duplicate(tmp_path):
    folder = folder_with(tmp_path, "123", {0: rows_of("3", "1"), 1: rows_of("1")})
    csv_path = tmp_path / "out" / "results.csv"
    old = rows_of("x") + rows_of("2") + rows_of("y")
    old[2]["value"] = "the csv's"  # config 2's first row: the CSV's copy is kept
    write_csv(csv_path, COLS, old)
    assert merge_parts(csv_path, folder, COLS, KEY, PART, EXPECTED) == (2, 0)
    want = rows_of("x") + rows_of("1", "2", "3") + rows_of("y")
    want[4]["value"] = "the csv's"
    assert read_csv(csv_path, COLS) == want


def test_an_incomplete_merge_keeps_the_parts_and_drops_torn_configurations(tmp_path):
    torn = rows_of("2")[:1]
    folder = folder_with(tmp_path, "123", {1: rows_of("3") + torn})
    csv_path = tmp_path / "out" / "results.csv"
    assert merge_parts(csv_path, folder, COLS, KEY, PART, EXPECTED) == (1, 2)
    assert read_csv(csv_path, COLS) == rows_of("3")
    assert read_parts(folder, COLS, KEY, PART, EXPECTED) == (rows_of("3"), {("3",)})
    assert folder.is_dir()


def test_merge_copies_the_runs_metadata(tmp_path):
    folder = folder_with(tmp_path, "1", {0: rows_of("1")})
    (folder / "metadata.json").write_text('{"processes": 2}')
    merge_parts(tmp_path / "out" / "results.csv", folder, COLS, KEY, PART, EXPECTED)
    assert (tmp_path / "out" / "metadata.json").read_text() == '{"processes": 2}'


GRID = Grid(
    formats=("bf16", "fp16"),
    seq_lens=(128, 256, 512, 1024),
    blocks=(Blocks(32, 64), Blocks(64, 32), Blocks(64, 128)),
    seeds=(0, 1, 2),
)


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_partition_covers_every_unit_once_and_balances_the_cost(count):
    units = list(dict.fromkeys(unit_of(k) for k in canonical_keys(GRID)))
    cost = unit_cost(GRID, True)
    shares = partition(units, cost, count)
    assert shares == partition(units, cost, count)  # no timing in the rule
    assert sorted(u for s in shares for u in s) == sorted(units)
    loads = [sum(cost[n] for _, n, _ in s) for s in shares]
    assert max(loads) - min(loads) <= max(cost.values())  # within one unit's cost
    if count == 2:  # 6 units of each length: 3 each
        for n in GRID.seq_lens:
            assert [sum(1 for u in s if u[1] == n) for s in shares] == [3, 3]


def test_partition_takes_the_largest_first_and_breaks_ties_in_order():
    """Longest processing time first: the costliest unit first, each to the least
    loaded process; equal costs in the units' (canonical) order, equal loads to the
    lowest process index; a count of processes that is not positive is refused."""
    units = [("bf16", 128, 0), ("bf16", 128, 1), ("bf16", 256, 0), ("bf16", 128, 2)]
    shares = partition(units, {128: 1, 256: 4}, 2)
    assert shares == [{("bf16", 256, 0)}, {("bf16", 128, 0), ("bf16", 128, 1), ("bf16", 128, 2)}]
    even = partition(units, {128: 1, 256: 1}, 2)
    assert even == [{units[0], units[2]}, {units[1], units[3]}]
    assert partition(units, {128: 1, 256: 1}, 5)[4] == set()  # more processes than units
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"partition: processes: expected a positive"):
            partition(units, {128: 1, 256: 4}, bad)


def test_canonical_keys_are_every_configuration_once():
    keys = [tuple(k.values()) for k in canonical_keys(GRID)]
    assert len(keys) == len(set(keys)) == 2 * 4 * 3 * 3
    assert list(canonical_keys(GRID)[0]) == list(KEY_COLUMNS)


CAUSAL_GRID = Grid(  # test_sweep_snapshot.CAUSAL_GRID
    formats=("bf16", "e5m2"),
    seq_lens=(12, 20),
    blocks=(Blocks(4, 8),),
    variants=("fa2",),
    policies=("fa2_kernel", "torch_math"),
    seeds=(3,),
    d=8,
    heads=2,
    causal=True,
)


def test_one_process_completes_a_killed_multi_process_run_byte_for_byte(tmp_path, capsys):
    """The part folder of a run killed part-way (two processes' rows, one of them
    torn): the one-process sweep computes only what is missing and merges."""
    want = (DATA / "sweep_causal_snapshot.csv").read_bytes()
    snap = read_csv(DATA / "sweep_causal_snapshot.csv", COLUMNS)
    out = tmp_path / "out"
    folder = parts_folder(out, CAUSAL_GRID)
    folder.mkdir(parents=True)
    keys = canonical_keys(CAUSAL_GRID)
    write_csv(folder / "order.csv", KEY_COLUMNS, keys)

    def rows(i):
        return [r for r in snap if all(r[c] == keys[i][c] for c in KEY_COLUMNS)]

    write_csv(part_path(folder, 0), COLUMNS, rows(5) + rows(1))
    write_csv(part_path(folder, 1), COLUMNS, rows(6) + rows(2)[:5])  # 2 torn
    computed = []
    import fa_jax.studies.sweep.engine as engine

    real = engine._write_part

    def spy(path, all_rows):
        computed.append({tuple(r[c] for c in KEY_COLUMNS) for r in all_rows})
        real(path, all_rows)

    engine._write_part, restore = spy, engine._write_part
    try:
        csv_path = run_sweep(CAUSAL_GRID, out, quiet=True)
    finally:
        engine._write_part = restore
    assert csv_path.read_bytes() == want
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "results.csv"]
    # part 0 kept its rows (1, 5) and took the rest but part 1's complete one (6)
    assert computed[-1] == {tuple(k.values()) for i, k in enumerate(keys) if i != 6}


def test_merge_command(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["merge", str(out)]) == 0
    assert "no part files" in capsys.readouterr().out
    folder = parts_folder(out, CAUSAL_GRID)
    folder.mkdir(parents=True)
    keys = canonical_keys(CAUSAL_GRID)
    write_csv(folder / "order.csv", KEY_COLUMNS, keys)
    snap = read_csv(DATA / "sweep_causal_snapshot.csv", COLUMNS)
    write_csv(part_path(folder, 1), COLUMNS, snap[12:])
    assert main(["merge", str(out)]) == 1
    assert "1 configurations missing" in capsys.readouterr().out
    write_csv(part_path(folder, 0), COLUMNS, snap[:12])
    assert main(["merge", str(out)]) == 0
    assert (out / "results.csv").read_bytes() == (DATA / "sweep_causal_snapshot.csv").read_bytes()
    assert not (out / "parts").exists()
    assert merge_sweep(out) == []
    shutil.rmtree(out)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--process-id", "1"], "expected all three"),
        (["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "0 .. 1"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "0", "--process-id", "0"], "--num"),
    ],
)
def test_launch_flags_are_checked_before_connecting(tmp_path, capsys, flags, message):
    argv = ["sweep", "--formats", "bf16", "--seq-lens", "12", "--blocks", "4x8", "--d", "8"]
    assert main([*argv, "--out", str(tmp_path / "o"), *flags]) == 2
    assert message in capsys.readouterr().err
