"""fa_jax.studies.progress: a tqdm bar on a terminal only, never a failure."""

import io
import sys

import pytest

from fa_jax.studies.progress import track


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_quiet_or_not_a_terminal_shows_nothing(monkeypatch):
    items = [1, 2, 3]
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert track(items, desc="x") is items
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert track(items, desc="x", quiet=True) is items
    assert err.getvalue() == ""


def test_without_tqdm_shows_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    items = [1, 2]
    assert track(items, desc="x") is items
    assert term.getvalue() == ""


def test_a_terminal_gets_a_bar(monkeypatch):
    pytest.importorskip("tqdm")
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert list(track(iter(range(3)), desc="sweep", total=3, unit="group")) == [0, 1, 2]
    assert "sweep:" in term.getvalue() and "/3 [" in term.getvalue()
    assert list(track([], desc="empty")) == []


def test_follow_shows_a_count_read_from_elsewhere_on_a_terminal_only(monkeypatch):
    pytest.importorskip("tqdm")
    import threading

    from fa_jax.studies.progress import follow

    done = threading.Event()
    reads = []

    def count():
        reads.append(1)
        if len(reads) >= 2:
            done.set()
        return 5

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with follow("job", 8, count, unit="config"):
        pass
    assert reads == [] and sys.stderr.getvalue() == ""
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with follow("job", 8, count, unit="config", interval=0.01):
        assert done.wait(10)
    assert "job:" in term.getvalue() and "5/8" in term.getvalue()
