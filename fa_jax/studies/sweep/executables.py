"""The sweep's compiled programs, kept in memory for a run and on disk across runs.

Tracing and compiling a flash program takes about a second on a CPU, longer
than running it on a small grid, and JAX's own persistent cache still traces a
program before it can look it up.  :class:`Executables` stores each compiled
program (``jax.experimental.serialize_executable``) under a key that fixes
everything its code can depend on:

* the program and its static arguments (preset, format kind, variant, tiles,
  causal flag) and its inputs' shapes, dtypes and shardings;
* a fingerprint of fa_jax's source files, the jax and jaxlib versions, the
  process's devices (platform, kind, count), ``jax_enable_x64`` and
  ``XLA_FLAGS``; under ``jax.distributed`` with several processes also the
  process count, and, where a process has several devices, their ids (a
  serialized executable names the devices it runs on).

Under ``jax.distributed``, where each process has one device (one per CPU
host or per accelerator: the common layout), the processes also share their
compiles (:meth:`Executables.shared_with`): each program a process needs is
claimed by the first process to ask (:meth:`.cluster.Processes.claim`),
compiled by that process alone and published through the runtime's
key-value store; the others load it onto their own device.  A serialized
executable names its device by id (process 0's is not process 1's), so it is
pickled with its devices as positions among the process's local devices and
loaded with a device assignment of the loading process's device
(``compile_options`` of ``deserialize_executable``).  Who compiles a program
depends on timing; what it computes does not (the same program, the same
binary).  No public API does this: the pickler extends
``jax.experimental.serialize_executable``'s own, and ``CompileOptions`` and
``DeviceAssignment`` come from jaxlib (``jax._src.lib._jax``, jax 0.10.2).

A later run with the same key loads the executable instead of tracing and
compiling it: it is the same binary, so it computes the same bits (the sweep's
snapshot tests run with and without the cache).  An entry that cannot be
read is compiled again and rewritten; entries are written atomically.  Loading
unpickles, so the folder must be the user's own (it is, by default:
:func:`fa_jax.studies.cache.cache_dir`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.metadata
import io
import os
import pathlib
import pickle
import tempfile
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np
from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]
from jax.experimental import serialize_executable

from fa_jax.studies.profile import Profile
from fa_jax.studies.progress import status

__all__ = ["Executables", "device_label", "source_fingerprint", "usable_cores"]

_PACKAGE = pathlib.Path(__file__).resolve().parents[2]  # the fa_jax folder


@functools.cache
def source_fingerprint() -> str:
    """SHA-256 over fa_jax's Python sources (paths and bytes)."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _versions() -> tuple[str, str]:
    """jax's and jaxlib's versions (reading jaxlib's metadata takes a millisecond)."""
    return jax.__version__, importlib.metadata.version("jaxlib")


def usable_cores() -> int:
    """The CPU cores this process may run on (``os.cpu_count()`` counts the
    machine's, also under ``taskset``)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def device_label() -> str:
    """This process's devices and compile threads, as the planner keys its
    costs (:mod:`.planner`): platform, kind, device count, usable cores."""
    devices = jax.local_devices()
    return f"{devices[0].platform}:{devices[0].device_kind}:{len(devices)}:{usable_cores()}"


def _environment() -> tuple:
    devices = jax.local_devices()
    env = (
        source_fingerprint(),
        *_versions(),
        devices[0].platform,
        devices[0].device_kind,
        len(devices),
        bool(jax.config.read("jax_enable_x64")),
        os.environ.get("XLA_FLAGS", ""),
    )
    if jax.process_count() > 1:  # one process: the key of a run without jax.distributed
        env += (jax.process_count(),)
        if not _portable():
            env += (tuple(d.id for d in devices),)
    return env


def _portable() -> bool:
    """Whether this process's executables are stored device-neutral (module
    docstring): several processes, one device each."""
    return jax.process_count() > 1 and len(jax.local_devices()) == 1


class _Pickler(serialize_executable._JaxPjrtPickler):
    """Pickles a device as its position among the local devices."""

    def persistent_id(self, obj):
        if isinstance(obj, jax.Device):
            return ("local device", jax.local_devices().index(obj))
        return super().persistent_id(obj)


class _Unpickler(serialize_executable._JaxPjrtUnpickler):
    """Loads :class:`_Pickler`'s devices, and the executable onto this
    process's one device."""

    def persistent_load(self, pid):
        if pid[0] == "local device":
            return jax.local_devices()[pid[1]]
        if pid[0] == "exec":
            options = _jax.CompileOptions()
            ids = np.array([[d.id for d in self.execution_devices]])
            options.device_assignment = _jax.DeviceAssignment.create(ids)
            return self.backend.deserialize_executable(
                pid[1], executable_devices=self.execution_devices, compile_options=options
            )
        return super().persistent_load(pid)


def _serialize(compiled) -> bytes | None:
    """``compiled`` as bytes, or None where the backend cannot serialize it."""
    try:
        if not _portable():
            local = jax.local_devices()
            runs_on = [local.index(d) for d in compiled._executable.xla_executable.local_devices()]
            return pickle.dumps((*serialize_executable.serialize(compiled), runs_on))
        unloaded = compiled._executable._unloaded_executable
        if unloaded is None or compiled._params.const_args:
            return None
        flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
        with io.BytesIO() as fh:
            _Pickler(fh).dump((unloaded, flat, compiled._no_kwargs))
            return pickle.dumps((fh.getvalue(), in_tree, compiled.out_tree))
    except (ValueError, NotImplementedError, AttributeError, pickle.PicklingError):
        return None


def _deserialize(data: bytes):
    """The compiled program of :func:`_serialize`'s ``data`` on this process's
    devices, or None where it cannot be loaded (compile it again)."""
    try:
        if not _portable():
            # On the devices it was compiled for, as positions among this process's
            # (by default it would be every process's device, which an argument
            # already on this process's device does not match; and all of this
            # process's, which a one-device program does not run on).
            payload, in_tree, out_tree, runs_on = pickle.loads(data)
            devices = [jax.local_devices()[i] for i in runs_on]
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=devices
            )
        payload, in_tree, out_tree = pickle.loads(data)
        backend = jax.local_devices()[0].client
        unloaded, flat, no_kwargs = _Unpickler(
            io.BytesIO(payload), backend, jax.local_devices()
        ).load()
        return jax.stages.Compiled(
            unloaded.load(), [], in_tree.unflatten(flat), out_tree, no_kwargs=no_kwargs
        )
    except Exception:  # unreadable or incompatible entry: compile it again
        return None


def _signature(x) -> tuple:
    return (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))


class Executables:
    """Compiled programs by key (module docstring); ``folder`` None keeps them in
    memory only.  Each program's prepare and run seconds go to ``profile``."""

    def __init__(self, folder: pathlib.Path | None = None, profile: Profile | None = None):
        self.folder, self.profile = folder, profile
        self._loaded: dict[str, tuple[str, jax.stages.Compiled]] = {}
        self._peers = None

    @contextlib.contextmanager
    def shared_with(self, peers) -> Iterator[None]:
        """Within this block, share compiles with the other processes of
        ``peers`` (a :class:`.cluster.Processes`; None: no one), where each
        process has one device (module docstring)."""
        before = self._peers
        self._peers = peers if peers is not None and _portable() else None
        try:
            yield
        finally:
            self._peers = before

    def key(self, program, args, static: dict) -> str:
        """The key of ``program(*args, **static)`` (module docstring); ``args`` may
        be ``jax.ShapeDtypeStruct``."""
        leaves = jax.tree_util.tree_leaves(args)
        text = repr(
            (
                _environment(),
                program.__module__,
                program.__qualname__,
                sorted(static.items()),
                [_signature(x) for x in leaves],
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def prepare(self, calls) -> None:
        """Load or compile, ahead of their first call, the programs of ``calls``:
        ``(program, args, static, label)`` tuples (``args`` may be
        ``jax.ShapeDtypeStruct``).  Programs are traced one after another and
        compiled on a thread per CPU core this process may run on (its
        affinity: a process pinned to one core compiles on one thread), since
        XLA's compile releases the GIL and each compile runs on one core.
        Shared with other processes (:meth:`shared_with`), a process traces and
        compiles only the programs it claims, at most one per compile thread
        ahead of its compiles (so that claims follow each process's pace), and
        then loads the others' as they publish them."""
        wanted = {}
        for program, args, static, label in calls:
            key = self.key(program, args, static)
            if key not in self._loaded:
                wanted.setdefault(key, (program, args, static, label))
        todo = {}
        for key, compiled, seconds in self._load_all(list(wanted)):
            if compiled is not None:
                self._keep(key, wanted[key][3], compiled, "loaded", seconds)
            else:
                todo[key] = wanted[key]
        if not todo:
            return
        status(f"compiling {len(todo)} programs")
        peers, order = self._peers, list(todo)
        if peers is not None:  # start at a different place on each process
            cut = peers.index * len(order) // peers.count
            order = order[cut:] + order[:cut]
        workers = max(1, min(len(todo), usable_cores()))
        ahead = threading.Semaphore(workers + 1)

        def compile_one(key, label, lowered, seconds):
            try:
                start = time.perf_counter()
                compiled = lowered.compile()
                seconds += time.perf_counter() - start
                data = self._store(key, compiled)
                if peers is not None:  # empty: the others compile it themselves
                    peers.publish_bytes(f"program/{key}", data or b"")
                return key, label, compiled, seconds
            finally:
                ahead.release()

        theirs = []
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = []
            for key in order:
                ahead.acquire()
                if peers is not None and not peers.claim(f"program/{key}"):
                    ahead.release()
                    theirs.append(key)
                    continue
                program, args, static, label = todo[key]
                start = time.perf_counter()
                lowered = program.lower(*args, **static)
                futures.append(
                    pool.submit(compile_one, key, label, lowered, time.perf_counter() - start)
                )
            for future in futures:
                key, label, compiled, seconds = future.result()
                self._keep(key, label, compiled, "compiled", seconds)
        for key in theirs:
            assert peers is not None
            program, args, static, label = todo[key]
            start = time.perf_counter()
            data = peers.receive_bytes(f"program/{key}")
            compiled = _deserialize(data) if data else None
            if compiled is None:
                compiled = program.lower(*args, **static).compile()
                self._keep(key, label, compiled, "compiled", time.perf_counter() - start)
                self._store(key, compiled)
            else:
                self._keep(key, label, compiled, "received", time.perf_counter() - start)
                self._write(key, data)
        status("")

    def _load_all(self, keys: list[str]) -> list[tuple[str, object, float]]:
        """(key, executable or None, seconds) for each of ``keys`` from the folder,
        loaded on a thread per usable core (deserialising releases the GIL)."""

        def load(key):
            start = time.perf_counter()
            compiled = self._load(key)
            return key, compiled, time.perf_counter() - start

        if len(keys) < 2 or self.folder is None:
            return [load(key) for key in keys]
        workers = min(len(keys), usable_cores())
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return list(pool.map(load, keys))

    def _keep(self, key: str, label: str, compiled, source: str, seconds: float) -> None:
        self._loaded[key] = (label, compiled)
        if self.profile is not None:
            self.profile.prepared(label, source, seconds)

    def holds(self, key: str) -> bool:
        """Whether the program of ``key`` is in memory or in the folder (loaded,
        not compiled, when prepared)."""
        path = self._path(key)
        return key in self._loaded or (path is not None and path.exists())

    def call(self, program, args, static: dict, *, label: str, units: float = 0.0):
        """``program(*args, **static)`` from its compiled executable (prepared now
        if :meth:`prepare` did not); its seconds and ``units`` of work go to the
        profile."""
        key = self.key(program, args, static)
        if key not in self._loaded:
            self.prepare([(program, args, static, label)])
        label, compiled = self._loaded[key]
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        if self.profile is not None:
            self.profile.ran(label, time.perf_counter() - start, units)
        return out

    def _path(self, key: str) -> pathlib.Path | None:
        return None if self.folder is None else self.folder / f"{key}.bin"

    def _load(self, key: str):
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            data = path.read_bytes()
        except OSError:
            return None
        return _deserialize(data)

    def _store(self, key: str, compiled) -> bytes | None:
        """Write ``compiled`` to the folder; returns its bytes (None where the
        backend cannot serialize it)."""
        data = _serialize(compiled)
        if data is not None:
            self._write(key, data)
        return data

    def _write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError:
            pass  # a full disk: run uncached
