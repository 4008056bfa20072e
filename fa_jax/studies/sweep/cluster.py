"""The processes of a multi-process sweep: JAX's multi-controller runtime.

A sweep on several hosts runs one process per host (or per accelerator), each
started with the same command after :func:`jax.distributed.initialize`
(:func:`connect`).  The processes never exchange arrays: each computes its
own share of the configurations (:mod:`.partition`) on its own devices and
writes its own part file (:mod:`fa_jax.studies.results`).  What they do share
goes through the distributed runtime's key-value store, served by process 0's
coordinator, as short strings:

* :meth:`Processes.agree`: every process publishes a description of its
  command (the grid, the output folder, the options) and compares all of them
  before any work, so processes started with different commands all refuse,
  with a message naming what differs;
* :meth:`Processes.wait_all`: a barrier (every process has reached a point);
* :meth:`Processes.publish` / :meth:`Processes.receive`: process 0's outcome
  (the merge) for the others;
* :meth:`Processes.claim`, :meth:`Processes.publish_bytes` /
  :meth:`Processes.receive_bytes`: a compiled program, claimed by the first
  process to ask and compiled by it alone, for the others to load
  (:mod:`.executables`);
* :meth:`Processes.add` / :meth:`Processes.count_of`: a shared counter (the
  progress of the whole job);
* :meth:`Processes.fail`: a process that stops on an error (or Ctrl-C) says
  so, and every process waiting on the others raises :class:`ProcessFailed`
  instead of waiting for it.

JAX has no public key-value API: this module reads the client of
``jax._src.distributed.global_state`` (``key_value_set``,
``blocking_key_value_get``, ``key_value_increment``, ``key_value_try_get``),
the store JAX's own multi-process code uses; the public collectives
(``jax.experimental.multihost_utils``) would need cross-process collectives,
which JAX's CPU backend does not run by default.  Waits poll in slices of
:data:`POLL_MS` (and honour a Ctrl-C, :mod:`fa_jax.studies.interrupt`, between
them) with no overall limit, since a process may compute for hours
before the others hear from it; a process killed outright (no chance to call
:meth:`~Processes.fail`) is noticed by the runtime's heartbeats, which end the
others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import socket
import time

import jax

from fa_jax.studies.interrupt import check_interrupt

__all__ = [
    "POLL_MS",
    "ProcessFailed",
    "Processes",
    "cluster_detected",
    "connect",
    "processes",
]

POLL_MS = 1_000  # one blocking read of the store; repeated until the key appears
COORDINATOR_WAIT_S = 60.0  # how long a process waits for process 0's port before JAX does
POLL_CONNECT_S = 0.01  # between two tries of that port
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_runs = itertools.count()  # sweeps started by this process: a namespace each


def cluster_detected() -> bool:
    """Whether :func:`jax.distributed.initialize` would find the processes by
    itself: ``JAX_COORDINATOR_ADDRESS`` is set, or one of the clusters JAX
    detects (SLURM, Open MPI, Cloud TPU pods, Kubernetes) is present.  Reads
    ``jax._src.clusters`` (no public API says so); detection reads environment
    variables and, on a Cloud TPU VM only, its metadata server."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:
        return False
    return any(
        not env.opt_in_only_method and env.is_env_present() for env in ClusterEnv._cluster_types
    )


def connect(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """:func:`jax.distributed.initialize` with these arguments (None: JAX detects
    them).  A coordinator on a loopback address binds to that address only, not
    to every interface.  Given a coordinator, a process other than 0 first waits
    until its port accepts connections (:func:`_wait_for`)."""
    bind = None
    if coordinator is not None and coordinator.rsplit(":", 1)[0] in _LOOPBACK:
        bind = coordinator
    if coordinator is not None and process_id not in (None, 0):
        _wait_for(coordinator)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=bind,
    )


def _wait_for(coordinator: str, limit_s: float = COORDINATOR_WAIT_S) -> None:
    """Return once ``coordinator`` (HOST:PORT) accepts connections, or after
    ``limit_s`` seconds (JAX then waits and reports as it would).  A process
    that asks JAX to connect before process 0's coordinator listens retries only
    after about a second, and every process then waits for it: started
    together, a run lost up to a second this way."""
    host, port = coordinator.rsplit(":", 1)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1):
                return
        except (OSError, ValueError):
            time.sleep(POLL_CONNECT_S)


def _client():
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError(
            "fa_jax.studies.sweep.cluster: expected jax.distributed.initialize() to have "
            f"been called, got {jax.process_count()} processes and no distributed client"
        )
    return global_state.client


def _timed_out(err: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(err) or "timed out" in str(err).lower()


class ProcessFailed(RuntimeError):
    """Another process of the run stopped on an error: this one stops too."""


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process (``index``) among ``count`` running the same sweep; ``prefix``
    names the sweep's keys in the store (one per sweep a process runs, in order)."""

    index: int
    count: int
    prefix: str

    def _get(self, key: str, *, raw: bool = False):
        client = _client()
        get = client.blocking_key_value_get_bytes if raw else client.blocking_key_value_get
        while True:
            try:
                return get(key, POLL_MS)
            except Exception as err:  # the runtime's own error type
                if not _timed_out(err):
                    raise
            check_interrupt()  # Ctrl-C while waiting: stop here (the others are told)
            try:
                why = client.key_value_try_get(f"{self.prefix}/failed")
            except Exception:  # not set: no one failed
                continue
            raise ProcessFailed(why)

    def fail(self, why: str) -> None:
        """Tell every process that this one stopped, and ``why``."""
        with contextlib.suppress(Exception):  # another process's word came first
            _client().key_value_set(
                f"{self.prefix}/failed", f"process {self.index} of {self.count} stopped: {why}"
            )

    def agree(self, what: str, values: dict, *, hint: str = "") -> None:
        """Publish ``values`` (JSON-able) and compare them with every process's;
        ValueError naming the first process that differs and the differing keys
        (the same message on every process, then ``hint``), before anyone goes on."""
        mine = json.dumps(values, sort_keys=True)
        _client().key_value_set(f"{self.prefix}/{what}/{self.index}", mine)
        every = [self._get(f"{self.prefix}/{what}/{i}") for i in range(self.count)]
        first = json.loads(every[0])
        for i, text in enumerate(every[1:], 1):
            other = json.loads(text)
            if other == first:
                continue
            diffs = [
                f"{k}: {_short(other.get(k))} (process 0: {_short(first.get(k))})"
                for k in sorted(set(first) | set(other))
                if first.get(k) != other.get(k)
            ]
            raise ValueError(
                f"expected the same {what} on every process; process {i} of {self.count} "
                "differs from process 0 in " + "; ".join(diffs) + (f" ({hint})" if hint else "")
            )

    def wait_all(self, point: str) -> None:
        """Return once every process has called ``wait_all(point)``."""
        _client().key_value_set(f"{self.prefix}/{point}/{self.index}", "1")
        for i in range(self.count):
            self._get(f"{self.prefix}/{point}/{i}")

    def publish(self, what: str, text: str) -> None:
        """Set ``what`` for every process (read with :meth:`receive`)."""
        _client().key_value_set(f"{self.prefix}/{what}", text)

    def receive(self, what: str) -> str:
        """What :meth:`publish` set, once it is set."""
        return self._get(f"{self.prefix}/{what}")

    def claim(self, what: str) -> bool:
        """Whether this process is the first to claim ``what`` (an atomic
        set-if-absent in the store: exactly one process gets True)."""
        try:
            _client().key_value_set(f"{self.prefix}/claim/{what}", str(self.index))
        except Exception as err:  # the runtime's own error type
            if "ALREADY_EXISTS" not in str(err):
                raise
            return False
        return True

    def publish_bytes(self, what: str, data: bytes) -> None:
        """Set ``what`` to ``data`` for every process (:meth:`receive_bytes`)."""
        _client().key_value_set_bytes(f"{self.prefix}/{what}", data)

    def receive_bytes(self, what: str) -> bytes:
        """What :meth:`publish_bytes` set, once it is set."""
        return self._get(f"{self.prefix}/{what}", raw=True)

    def add(self, counter: str, n: int) -> None:
        """Add ``n`` to the shared ``counter``."""
        _client().key_value_increment(f"{self.prefix}/{counter}", n)

    def count_of(self, counter: str) -> int:
        """The shared ``counter`` now (0 before anything is added)."""
        try:
            return int(_client().key_value_try_get(f"{self.prefix}/{counter}"))
        except Exception:  # not set yet
            return 0


def _short(v, limit: int = 120) -> str:
    text = json.dumps(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def processes() -> Processes | None:
    """This process's place among several under ``jax.distributed``, with a fresh
    key namespace for one sweep; None in a single process (the one-process
    sweep, unchanged)."""
    if jax.process_count() == 1:
        return None
    return Processes(jax.process_index(), jax.process_count(), f"fa_jax/sweep/{next(_runs)}")
