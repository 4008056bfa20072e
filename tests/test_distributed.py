"""Multi-process sweeps on this machine: 2 or 3 local processes over loopback
(JAX's CPU multi-process runtime, coordinator on 127.0.0.1), each running the
same ``fa-jax sweep`` command.

The grid is test_sweep_snapshot.py's causal grid, whose one-process CSV is
stored in tests/data: a merged ``results.csv`` must equal it byte for byte,
after a clean run, and after a run with a killed process resumed with another
process count.  Every subprocess has a timeout; all are killed on failure.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

DATA = os.path.join(os.path.dirname(__file__), "data")
SNAPSHOT = os.path.join(DATA, "sweep_causal_snapshot.csv")
# test_sweep_snapshot.CAUSAL_GRID as flags
GRID = (
    "--formats bf16 e5m2 --seq-lens 12 20 --blocks 4x8 --variants fa2 "
    "--policies fa2_kernel torch_math --seeds 3 --d 8 --heads 2 --causal --quiet"
).split()
TIMEOUT = 240  # seconds for one process

# The command, and for the victim (FA_JAX_TEST_DIE_AFTER_PART set) a process that
# dies at once after writing its first part file, as a kill would leave it.
SCRIPT = """
import os, sys
if os.environ.get("FA_JAX_TEST_DIE_AFTER_PART"):
    import fa_jax.studies.sweep.engine as engine
    write = engine._write_part
    def die(path, rows):
        write(path, rows)
        os._exit(9)
    engine._write_part = die
from fa_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, count, *, grids=None, victim=None, cache=None):
    """Start ``count`` processes of the sweep into ``out``; ``grids`` (one flag
    list per process) replaces the grid flags; process ``victim`` dies after its
    first part file; ``cache`` (a folder) replaces the test run's cache."""
    port = free_port()
    procs = []
    logs = out.parent / "logs"  # files, not pipes: a full pipe would stall a process
    logs.mkdir(exist_ok=True)
    for i in range(count):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("FA_JAX_TEST_DIE_AFTER_PART", None)
        if cache is not None:
            env["FA_JAX_CACHE_DIR"] = str(cache)
        if i == victim:
            env["FA_JAX_TEST_DIE_AFTER_PART"] = "1"
        args = [*(GRID if grids is None else grids[i]), "--out", str(out)]
        args += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(count)]
        args += ["--process-id", str(i)]
        stamp = f"{time.monotonic_ns()}-{i}"
        with open(logs / f"{stamp}.out", "w") as fo, open(logs / f"{stamp}.err", "w") as fe:
            proc = subprocess.Popen(
                [sys.executable, "-c", SCRIPT, "sweep", *args], env=env, stdout=fo, stderr=fe
            )
        proc.logs = (logs / f"{stamp}.out", logs / f"{stamp}.err")
        procs.append(proc)
    return procs


def finish(procs, timeout=TIMEOUT):
    """(exit status, stdout, stderr) of each process; all are killed, and the
    test fails with their standard errors, if one runs past ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    late = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in late:
        procs[i].kill()
    for p in procs:
        p.wait()
    results = [(p.returncode, *(f.read_text() for f in p.logs)) for p in procs]
    if late:
        errs = "\n".join(f"process {i}: {err[-1500:]}" for i, (_, _, err) in enumerate(results))
        raise AssertionError(f"processes {late} ran past {timeout} s\n{errs}")
    return results


def run(out, count, **kw):
    results = finish(launch(out, count, **kw))
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    return results


def _counts(err: str) -> tuple[int, int, int]:
    """(compiled, loaded, received) of a process's ``--profile`` table."""
    m = re.search(r"\((\d+) compiled, (\d+) loaded(?:, (\d+) from other processes)?\)", err)
    assert m, err[-2000:]
    return int(m[1]), int(m[2]), int(m[3] or 0)


@pytest.mark.extended  # 8 s: for the default run's time only
def test_two_processes_merge_to_the_one_process_csv(tmp_path):
    cache, profiled = tmp_path / "cache", [[*GRID, "--profile"]] * 2
    results = run(tmp_path / "out", 2, grids=profiled, cache=cache)
    assert (tmp_path / "out" / "results.csv").read_bytes() == open(SNAPSHOT, "rb").read()
    assert sorted(os.listdir(tmp_path / "out")) == ["metadata.json", "results.csv"]
    assert all("(96 rows)" in out for _, out, _ in results)
    # Each program was compiled by one process only, the other loading it.
    counts = [_counts(err) for _, _, err in results]
    stored = len(list((cache / "programs").glob("*.bin")))
    assert sum(c for c, _, _ in counts) == stored > 0, counts
    assert all(c + r >= 1 for c, _, r in counts), counts
    # A second run loads every program the first stored (on each process's own
    # device: a loaded program takes the arrays of the one before it).
    warm = run(tmp_path / "warm", 2, grids=profiled, cache=cache)
    assert (tmp_path / "warm" / "results.csv").read_bytes() == open(SNAPSHOT, "rb").read()
    assert all(_counts(err)[0] == 0 for _, _, err in warm), [e[-2000:] for _, _, e in warm]


def test_different_grids_are_refused_before_any_work(tmp_path):
    other = [f if f != "20" else "16" for f in GRID]  # --seq-lens 12 16
    results = finish(launch(tmp_path / "out", 2, grids=[GRID, other]), timeout=120)
    for rc, _, err in results:
        assert rc == 2, err[-3000:]
        assert "expected the same command on every process" in err
        assert "Grid.seq_lens: [12, 16] (process 0: [12, 20])" in err
    assert not (tmp_path / "out").exists()


def _killed_run(out):
    """A 2-process run whose process 1 dies after its first part file; process 0
    is then stopped with Ctrl-C (it cannot finish: it waits for process 1) and
    killed once it says so.  (Killed at an arbitrary moment, it could tear an
    entry JAX's persistent compilation cache was writing, which JAX writes in
    place.)"""
    procs = launch(out, 2, victim=1)
    try:
        procs[1].wait(timeout=TIMEOUT)
        procs[0].send_signal(signal.SIGINT)
        deadline = time.monotonic() + TIMEOUT
        # it stops (130), or JAX's runtime ends it on losing process 1 (SIGABRT)
        while procs[0].poll() is None and "interrupted" not in procs[0].logs[1].read_text():
            assert time.monotonic() < deadline, "process 0 did not stop"
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        finish(procs)
    assert procs[1].returncode == 9
    parts = out / "parts"
    (folder,) = parts.iterdir()
    assert (folder / "part-00001.csv").exists()
    assert not (out / "results.csv").exists()


@pytest.mark.slow
@pytest.mark.parametrize("rerun", [3, 1])
def test_a_killed_process_is_resumed_with_another_process_count(tmp_path, rerun):
    out = tmp_path / "out"
    _killed_run(out)
    if rerun == 1:  # no jax.distributed: the one-process command finds the parts
        done = subprocess.run(
            [sys.executable, "-m", "fa_jax", "sweep", *GRID, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        run(out, rerun)
    assert (out / "results.csv").read_bytes() == open(SNAPSHOT, "rb").read()
    assert sorted(os.listdir(out)) == ["metadata.json", "results.csv"]


@pytest.mark.slow
def test_three_processes_merge_to_the_one_process_csv(tmp_path):
    run(tmp_path / "out", 3)
    assert (tmp_path / "out" / "results.csv").read_bytes() == open(SNAPSHOT, "rb").read()


@pytest.mark.slow
def test_merge_command_after_a_kill_keeps_the_parts_until_complete(tmp_path):
    out = tmp_path / "out"
    _killed_run(out)
    done = subprocess.run(
        [sys.executable, "-m", "fa_jax", "merge", str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 1, done.stderr
    assert "configurations missing" in done.stdout
    assert (out / "parts").is_dir() and (out / "results.csv").exists()
    run(out, 2)
    assert (out / "results.csv").read_bytes() == open(SNAPSHOT, "rb").read()
