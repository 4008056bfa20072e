"""fa_jax.studies.interrupt: SIGINT inside deferred_interrupts is a request honoured at the
next check; `fa-jax sweep` stops on Ctrl-C with one line and status 130 and resumes to the
CSV of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import csv_has_rows

from fa_jax.cli import INTERRUPTED
from fa_jax.studies.interrupt import check_interrupt, deferred_interrupts, interrupt_requested

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _deliver_sigint():
    """SIGINT to this process, and time for Python to run its handler."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100):
        time.sleep(0.001)


# -- the flag ---------------------------------------------------------------------


def test_sigint_is_raised_at_the_next_check_not_before():
    before = signal.getsignal(signal.SIGINT)
    reached = False
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            check_interrupt()  # nothing requested yet
            _deliver_sigint()
            reached = True
            assert interrupt_requested()
            check_interrupt()
            pytest.fail("check_interrupt did not raise")
    assert reached
    assert not interrupt_requested()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_request_pending_at_the_end_of_the_block_raises_there():
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            _deliver_sigint()
    with deferred_interrupts():  # a fresh block starts without a request
        check_interrupt()


def test_without_the_block_sigint_raises_at_once_and_checks_do_nothing():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own
    try:
        check_interrupt()
        with pytest.raises(KeyboardInterrupt):
            _deliver_sigint()
            pytest.fail("SIGINT did not raise")
        assert not interrupt_requested()
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_second_sigint_exits_at_once_with_the_message():
    script = (
        "import os, signal, time\n"
        "from fa_jax.studies.interrupt import deferred_interrupts\n"
        "with deferred_interrupts('stopped now'):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.1)\n"
        "    print('first only requested', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "print('not reached')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        130,
        "first only requested\n",
        "stopped now\n",
    )


# -- fa-jax sweep -------------------------------------------------------------------

# Three groups (one per key tile width), so a Ctrl-C during the second leaves the third.
# Programs are compiled before the first group runs; 48 configurations a group (their
# metrics computed one by one) keep each group long enough for the signal to land
# between groups rather than after the last one.
SWEEP = (
    "sweep --formats bf16 --seq-lens 8 16 --seeds "
    + " ".join(map(str, range(24)))
    + " --blocks 8x8 4x4 2x2 --d 4 --quiet --out"
).split()


OUTS = ("out", "reference")
RESUME_THEN_REFERENCE = (
    "import sys\n"
    "from fa_jax.cli import main\n"
    "*command, out, reference = sys.argv[1:]\n"
    "sys.exit(main([*command, out]) or main([*command, reference]))\n"
)


@pytest.mark.extended  # 12 s: two processes
def test_ctrl_c_stops_a_sweep_with_one_line_and_it_resumes_exactly(tmp_path):
    # The runs share a compilation cache in tmp_path: a program is compiled once.
    env = _env(
        FA_JAX_CACHE_DIR=str(tmp_path / "cache"),
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    csv_path = tmp_path / "out" / "results.csv"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fa_jax", *SWEEP, str(tmp_path / "out")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not csv_has_rows(csv_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.splitlines()[-1] == INTERRUPTED, err
    assert err.count("\n") == 1, err
    partial = csv_path.read_bytes()

    # The same command again (resume), then into a fresh folder (uninterrupted), both by
    # fa_jax.cli.main, which `python -m fa_jax` runs, in one process: the second run
    # reuses the programs the first one compiled.
    done = subprocess.run(
        [sys.executable, "-c", RESUME_THEN_REFERENCE, *SWEEP, *(str(tmp_path / o) for o in OUTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert [line.split()[1] for line in done.stdout.splitlines()] == [
        str(tmp_path / o / "results.csv") for o in OUTS
    ]
    full = (tmp_path / "reference" / "results.csv").read_bytes()
    assert csv_path.read_bytes() == full
    assert partial.count(b"\n") > 1
    assert len(partial) < len(full) and full.startswith(partial), "stopped between groups"
