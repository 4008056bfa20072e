"""Build ggml's CPU libraries (libggml-base, libggml-cpu, libggml) for the ``ggml`` kernel.

Downloads the llama-cpp-python source distribution with pip (``pip download
llama-cpp-python==VERSION --no-binary :all: --no-deps``), unpacks it, and builds only
``vendor/llama.cpp/ggml`` with CMake (shared libraries, no OpenMP, no tests or
examples) into a cache folder.  ``--variant native`` (the default) builds for this
CPU (``GGML_NATIVE``, ``-march=native``) into ``<cache>/lib``, where
:mod:`fa_jax.kernels.ggml.lib` finds them (or point ``FA_JAX_GGML_LIB`` at them);
``--variant avx2`` builds ggml's AVX2 code (``GGML_NATIVE=OFF`` with AVX, AVX2,
BMI2, FMA and F16C: what a Haswell runs) into ``<cache>/avx2/lib``, for the lab that
runs it as an AVX2 CPU on any host (tests/lab.py).  A variant whose libraries were
built from the same version is reused, not built again.

    python experiments/build_ggml.py [--variant native|avx2] [--version 0.3.36]
                                     [--cache DIR] [--jobs 2]

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
# Each variant's CMake options beyond the common ones, and its folder in the cache.
VARIANTS = {
    "native": (["-DGGML_NATIVE=ON"], ""),
    "avx2": (
        [
            "-DGGML_NATIVE=OFF",
            "-DGGML_AVX=ON",
            "-DGGML_AVX2=ON",
            "-DGGML_BMI2=ON",
            "-DGGML_FMA=ON",
            "-DGGML_F16C=ON",
        ],
        "avx2",
    ),
}


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fa_jax" / "ggml"


def lib_dir(cache: Path, variant: str = "native") -> Path:
    """The folder a variant's libraries go to."""
    return cache / VARIANTS[variant][1] / "lib"


def _run(cmd: list[str], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"build_ggml: {' '.join(cmd)} failed (see {log})")


def build(version: str, cache: Path, jobs: int, variant: str = "native") -> Path:
    """Download, unpack and build ``variant`` (reused where its libraries of this
    version are there); returns the folder holding the libraries."""
    options, _ = VARIANTS[variant]
    lib = lib_dir(cache, variant)
    stamp = lib / "BUILT"
    made = f"llama-cpp-python {version} {' '.join(options)}\n"
    if stamp.exists() and stamp.read_text() == made and all((lib / n).exists() for n in LIBS):
        return lib
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
    build_dir = cache / ("build" if variant == "native" else f"build-{variant}")
    shutil.rmtree(build_dir, ignore_errors=True)
    _run(
        ["cmake", "-S", str(ggml), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
         "-DBUILD_SHARED_LIBS=ON", *options, "-DGGML_OPENMP=OFF",
         "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF", "-DGGML_CCACHE=OFF"],
        build_dir.with_name(f"{build_dir.name}-configure.log"),
    )  # fmt: skip
    log = build_dir.with_name(f"{build_dir.name}.log")
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs)], log)
    shutil.rmtree(lib, ignore_errors=True)
    lib.mkdir(parents=True)
    for path in (build_dir / "src").glob("libggml*.so*"):
        shutil.copy2(path, lib / path.name, follow_symlinks=True)
    missing = [name for name in LIBS if not (lib / name).exists()]
    if missing:
        sys.exit(f"build_ggml: the build made no {missing} (see {log})")
    stamp.write_text(made)
    return lib


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", default=VERSION, help="llama-cpp-python version")
    parser.add_argument("--cache", type=Path, default=default_cache(), help="cache folder")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="native")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    lib = build(args.version, args.cache, args.jobs, args.variant)
    print(f"ggml libraries in {lib} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
