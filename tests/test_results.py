"""fa_jax.studies.results: atomic writes with the user's umask, resume reading, metadata."""

import csv
import json
import os
import stat
import sys

import jax
import pytest

import fa_jax
from fa_jax.studies import results
from fa_jax.studies.results import (
    append_csv,
    atomic_write,
    read_complete,
    read_csv,
    run_metadata,
    write_csv,
    write_json,
)

COLUMNS = ("cfg", "part", "value")


@pytest.fixture
def umask():
    def set_umask(mask):
        old = os.umask(mask)
        restore.append(old)

    restore = []
    yield set_umask
    for old in reversed(restore):
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_files_get_the_users_umask(tmp_path, umask, mask):
    umask(mask)
    for path in (
        write_csv(tmp_path / "a.csv", COLUMNS, []),
        write_json(tmp_path / "m.json", {"x": 1}),
        atomic_write(tmp_path / "b.bin", lambda fh: fh.write(b"\x00"), binary=True),
    ):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path):
    path = write_csv(tmp_path / "r.csv", COLUMNS, [{"cfg": "a", "part": "x", "value": "1"}])
    before = path.read_bytes()

    def fail(fh):
        fh.write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "new.csv", lambda fh: (_ for _ in ()).throw(KeyboardInterrupt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]


def test_csv_round_trip_and_append(tmp_path):
    path = tmp_path / "r.csv"
    rows = [{"cfg": "a", "part": "x", "value": repr(0.1)}]
    write_csv(path, COLUMNS, rows)
    append_csv(path, COLUMNS, rows, [{"cfg": "b", "part": "x", "value": repr(1 / 3)}])
    assert [r["cfg"] for r in rows] == ["a", "b"]
    got = read_csv(path, COLUMNS)
    assert got == [
        {"cfg": "a", "part": "x", "value": "0.1"},
        {"cfg": "b", "part": "x", "value": "0.3333333333333333"},
    ]
    assert float(got[1]["value"]) == 1 / 3
    assert path.read_text().splitlines()[0] == "cfg,part,value"
    assert read_csv(tmp_path / "missing.csv", COLUMNS) == []
    with pytest.raises(ValueError, match=r"expected the columns \('a', 'b'\), got \('cfg'"):
        read_csv(path, ("a", "b"))


def test_resume_keeps_only_complete_configurations(tmp_path):
    path = tmp_path / "r.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        w.writerows(
            [
                ("a", "x", "1"),
                ("b", "x", "2"),
                ("a", "y", "3"),  # a complete
                ("b", "z", "4"),  # b: y missing
                ("c", "x", "5"),
                ("c", "y", "6"),
                ("c", "q", "7"),
            ]
        )  # c: an extra part
    rows, done = read_complete(path, COLUMNS, ("cfg",), ("part",), [("x",), ("y",)])
    assert done == {("a",)}
    assert [(r["cfg"], r["part"]) for r in rows] == [("a", "x"), ("a", "y")]  # file order
    assert read_complete(tmp_path / "none.csv", COLUMNS, ("cfg",), ("part",), [("x",)]) == (
        [],
        set(),
    )


def test_resume_compares_parts_as_strings(tmp_path):
    path = write_csv(
        tmp_path / "r.csv", ("step", "metric", "value"), [{"step": 0, "metric": 1, "value": 0.5}]
    )
    _, done = read_complete(path, ("step", "metric", "value"), ("step",), ("metric",), [(1,)])
    assert done == {("0",)}


def test_run_metadata_fields(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fa-jax", "sweep", "--quiet"])
    meta = run_metadata({"seq_lens": [16]}, packages=("scipy",), note="x")
    import jaxlib
    import ml_dtypes
    import numpy
    import scipy

    assert meta["fa_jax"] == fa_jax.__version__ and meta["jax"] == jax.__version__
    assert meta["jaxlib"] == jaxlib.__version__ and meta["ml_dtypes"] == ml_dtypes.__version__
    assert meta["numpy"] == numpy.__version__ and meta["scipy"] == scipy.__version__
    assert meta["backend"] == jax.default_backend()
    assert meta["device_kind"] == jax.devices()[0].device_kind
    assert meta["device_count"] == len(jax.devices())
    assert meta["config"] == {"seq_lens": [16]} and meta["note"] == "x"
    assert meta["command"] == ["fa-jax", "sweep", "--quiet"]
    assert meta["start_time"].endswith("+00:00")
    json.dumps(meta)


def test_pyplot_names_the_extra_when_matplotlib_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"the chart needs matplotlib.*fa-jax\[plot\]"):
        results.pyplot("the chart")


# -- check_out_dir: a wrong output location fails before anything is written --------


def test_check_out_dir_accepts_a_new_or_empty_folder_and_creates_nothing(tmp_path):
    assert results.check_out_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert results.check_out_dir(tmp_path) == tmp_path
    assert list(tmp_path.iterdir()) == []  # the probe file is gone, no folder was made


def test_check_out_dir_refuses_an_existing_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"^--out: expected a folder, got .*, which is a file$"):
        results.check_out_dir(tmp_path / "f", what="--out")


def test_check_out_dir_refuses_a_path_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="which lies under the file"):
        results.check_out_dir(tmp_path / "f" / "a" / "b")
    assert (tmp_path / "f").read_text() == "x"


def test_check_out_dir_refuses_a_folder_os_access_calls_read_only(tmp_path, monkeypatch):
    monkeypatch.setattr(results.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="expected a writable folder"):
        results.check_out_dir(tmp_path / "sub")


def test_check_out_dir_refuses_a_folder_where_no_file_can_be_created(tmp_path, monkeypatch):
    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(results, "_create", refuse)  # as a read-only folder would, even as root
    with pytest.raises(ValueError, match="expected a writable folder"):
        results.check_out_dir(tmp_path)


def test_check_out_dir_refuses_a_csv_with_other_columns(tmp_path):
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="was not written by this study"):
        results.check_out_dir(tmp_path, {"results.csv": COLUMNS})
    write_csv(tmp_path / "results.csv", COLUMNS, [])  # its own columns: accepted
    results.check_out_dir(tmp_path, {"results.csv": COLUMNS})


def test_check_out_dir_agrees_with_a_read_only_folder(tmp_path):
    """chmod 0o500: refused exactly when a file really cannot be created there
    (always for a normal user; root may write anyway, and then it is accepted)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        try:
            (ro / "try").write_text("")
            (ro / "try").unlink()
            writable = True
        except PermissionError:
            writable = False
        if writable:
            assert results.check_out_dir(ro / "sub") == ro / "sub"
        else:
            with pytest.raises(ValueError, match="expected a writable folder"):
                results.check_out_dir(ro / "sub")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)
