"""Build ggml's CPU libraries (libggml-base, libggml-cpu, libggml) for the ``ggml`` kernel.

Downloads the llama-cpp-python source distribution with pip (``pip download
llama-cpp-python==VERSION --no-binary :all: --no-deps``), unpacks it, and builds only
``vendor/llama.cpp/ggml`` with CMake (shared libraries, ``-march=native``, no OpenMP,
no tests or examples) into a cache folder; the libraries go to ``<cache>/lib``, where
:mod:`fa_jax.kernels.ggml_lib` finds them (or point ``FA_JAX_GGML_LIB`` at them).

    python experiments/build_ggml.py [--version 0.3.36] [--cache DIR] [--jobs 2]

The sdist lacks ggml's ``ggml.pc.in`` (a pkg-config template a standalone build
configures); a minimal one is written in its place.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"
LIBS = ("libggml-base.so", "libggml-cpu.so", "libggml.so")


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fa_jax" / "ggml"


def _run(cmd: list[str], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"build_ggml: {' '.join(cmd)} failed (see {log})")


def build(version: str, cache: Path, jobs: int) -> Path:
    """Download, unpack and build; returns the folder holding the libraries."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        _run(
            [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
             "--no-binary", ":all:", "--no-deps", "-d", str(cache)],
            cache / "download.log",
        )  # fmt: skip
    src = cache / f"llama_cpp_python-{version}"
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    ggml = src / "vendor" / "llama.cpp" / "ggml"
    pc = ggml / "ggml.pc.in"
    if not pc.exists():
        pc.write_text("prefix=@CMAKE_INSTALL_PREFIX@\nName: ggml\nVersion: @GGML_VERSION@\n")
    build_dir = cache / "build"
    shutil.rmtree(build_dir, ignore_errors=True)
    _run(
        ["cmake", "-S", str(ggml), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
         "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=OFF",
         "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF", "-DGGML_CCACHE=OFF"],
        cache / "configure.log",
    )  # fmt: skip
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs)], cache / "build.log")
    lib = cache / "lib"
    lib.mkdir(exist_ok=True)
    for path in (build_dir / "src").glob("libggml*.so*"):
        shutil.copy2(path, lib / path.name, follow_symlinks=True)
    missing = [name for name in LIBS if not (lib / name).exists()]
    if missing:
        sys.exit(f"build_ggml: the build made no {missing} (see {cache / 'build.log'})")
    return lib


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", default=VERSION, help="llama-cpp-python version")
    parser.add_argument("--cache", type=Path, default=default_cache(), help="cache folder")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    lib = build(args.version, args.cache, args.jobs)
    print(f"ggml libraries in {lib} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
