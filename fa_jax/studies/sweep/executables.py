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
  process count and the ids of the process's devices, since a serialized
  executable names the devices it runs on (process 1's cannot run on
  process 0's device).

A later run with the same key loads the executable instead of tracing and
compiling it: it is the same binary, so it computes the same bits (the sweep's
snapshot tests run with and without the cache).  An entry that cannot be
read is compiled again and rewritten; entries are written atomically.  Loading
unpickles, so the folder must be the user's own (it is, by default:
:func:`fa_jax.studies.cache.cache_dir`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import pickle
import tempfile
import time

import jax
from jax.experimental import serialize_executable

from fa_jax.studies.profile import Profile
from fa_jax.studies.progress import status

__all__ = ["Executables", "source_fingerprint"]

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


def _usable_cores() -> int:
    """The CPU cores this process may run on (``os.cpu_count()`` counts the
    machine's, also under ``taskset``)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


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
        env += (jax.process_count(), tuple(d.id for d in devices))
    return env


def _signature(x) -> tuple:
    return (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))


class Executables:
    """Compiled programs by key (module docstring); ``folder`` None keeps them in
    memory only.  Each program's prepare and run seconds go to ``profile``."""

    def __init__(self, folder: pathlib.Path | None = None, profile: Profile | None = None):
        self.folder, self.profile = folder, profile
        self._loaded: dict[str, tuple[str, jax.stages.Compiled]] = {}

    def _key(self, program, args, static: dict) -> str:
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
        XLA's compile releases the GIL and each compile runs on one core."""
        todo = {}
        for program, args, static, label in calls:
            key = self._key(program, args, static)
            if key in self._loaded or key in todo:
                continue
            start = time.perf_counter()
            compiled = self._load(key)
            if compiled is not None:
                self._keep(key, label, compiled, "loaded", time.perf_counter() - start)
            else:
                todo[key] = (program, args, static, label)
        if not todo:
            return
        status(f"compiling {len(todo)} programs")

        def build(item):
            key, (program, args, static, label) = item
            start = time.perf_counter()
            lowered = program.lower(*args, **static)
            return key, label, lowered, time.perf_counter() - start

        def compile_one(key, label, lowered, seconds):
            start = time.perf_counter()
            return key, label, lowered.compile(), seconds + time.perf_counter() - start

        workers = max(1, min(len(todo), _usable_cores()))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(compile_one, *build(item)) for item in todo.items()]
            for future in futures:
                key, label, compiled, seconds = future.result()
                self._store(key, compiled)
                self._keep(key, label, compiled, "compiled", seconds)
        status("")

    def _keep(self, key: str, label: str, compiled, source: str, seconds: float) -> None:
        self._loaded[key] = (label, compiled)
        if self.profile is not None:
            self.profile.prepared(label, source, seconds)

    def call(self, program, args, static: dict, *, label: str):
        """``program(*args, **static)`` from its compiled executable (prepared now
        if :meth:`prepare` did not)."""
        key = self._key(program, args, static)
        if key not in self._loaded:
            self.prepare([(program, args, static, label)])
        label, compiled = self._loaded[key]
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        if self.profile is not None:
            self.profile.ran(label, time.perf_counter() - start)
        return out

    def _path(self, key: str) -> pathlib.Path | None:
        return None if self.folder is None else self.folder / f"{key}.bin"

    def _load(self, key: str):
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            # On this process's devices (by default: every process's, which an
            # argument already on this process's device does not match).
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=jax.local_devices()
            )
        except Exception:  # unreadable or incompatible entry: compile it again
            return None
        return compiled

    def _store(self, key: str, compiled) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except (OSError, ValueError, NotImplementedError):
            pass  # a backend without serialisation, or a full disk: run uncached
