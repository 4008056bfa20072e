"""This CPU as Linux describes it (``/proc/cpuinfo``): the facts by which the real
kernels' libraries pick their code, read once.

XLA targets the model and vector features; YNNPACK, MKL and oneDNN choose their
kernels by the features and, for MKL, by the vendor as well (its Intel kernels
are not the ones it runs on AMD CPUs).  Empty strings where the file or a field
is missing (other systems)."""

from __future__ import annotations

import functools

__all__ = ["cpuinfo", "flags", "vendor"]


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields


def flags() -> frozenset[str]:
    """The CPU's feature flags (``avx512f``, ``amx_bf16``, ...)."""
    return frozenset(cpuinfo().get("flags", "").split())


def vendor() -> str:
    """The CPU's vendor: ``"GenuineIntel"``, ``"AuthenticAMD"``, ... (``""`` unknown)."""
    return cpuinfo().get("vendor_id", "")
