"""Helpers shared by the tests (import them with ``from helpers import ...``)."""

import importlib.util
import pathlib
import re
import sys

from fa_jax._x64 import float64_enabled

# Enable float64 for the duration of a block, restoring the previous setting.
x64_enabled = float64_enabled

__all__ = [
    "csv_has_rows",
    "largest_n_below",
    "load_experiment",
    "wide_names",
    "wide_tensors",
    "wide_types",
    "x64_enabled",
]

_WIDE_TENSOR = re.compile(r"tensor<(?:[0-9]+x)+(f64|i64|ui64)>")  # of rank >= 1
_WIDE_ANY = re.compile(r"tensor<[0-9?x]*(?:f64|i64|ui64)>")
# reduce_window's padding, an attribute StableHLO always types i64: no array on the device
_PADDING_ATTRIBUTE = re.compile(r"padding = dense<[^>]*> : tensor<[0-9x]+i64>")
_WIDE_HLO = re.compile(r"\b(f64)\[|\b([su]64)\[[0-9]")
# Any 64-bit type named in StableHLO or HLO text, but not in ``array<i64: ...>``
# attributes (a gather's slice sizes): metadata, not values.
_WIDE_NAME = re.compile(r"(?<!array<)(?:(?<=[0-9?]x)|\b)(f64|i64|ui64|s64|u64)\b")


def wide_tensors(stablehlo: str, *, scalars: bool = False) -> list[str]:
    """The 64-bit array types in StableHLO text: of rank >= 1, or of any rank with
    ``scalars``."""
    pattern = _WIDE_ANY if scalars else _WIDE_TENSOR
    return pattern.findall(_PADDING_ATTRIBUTE.sub("", stablehlo))


def wide_names(text: str) -> list[str]:
    """Every 64-bit type in program text, scalars included (the strict check for
    programs that are wholly 32-bit); attributes aside."""
    return _WIDE_NAME.findall(_PADDING_ATTRIBUTE.sub("", text))


def wide_types(lowered, compiled=None) -> list[str]:
    """The 64-bit types of a ``jax.jit(...).lower(...)`` program (x64 on): in its
    StableHLO, every array of rank >= 1; in its compiled HLO, every float64 and
    every 64-bit integer array.  Python numbers lower as weakly typed 64-bit
    scalars that XLA folds away, and a scan's loop counter is an int64 scalar
    under x64 (int32 without it): scalars a TPU handles.  A ``reduce_window``'s
    padding attribute is i64 in every program and is not an array."""
    found = wide_tensors(lowered.as_text())
    compiled = lowered.compile() if compiled is None else compiled
    found += ["".join(m) for m in _WIDE_HLO.findall(compiled.as_text())]
    return sorted(set(found))


EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def load_experiment(path):
    """A script of experiments/ (a name or a path) as a module: its definitions run,
    its main does not."""
    path = pathlib.Path(path)
    if path.suffix != ".py":
        path = EXPERIMENTS / f"{path}.py"
    spec = importlib.util.spec_from_file_location(f"experiment_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look their module's names up
    spec.loader.exec_module(module)
    return module


def csv_has_rows(path) -> bool:
    """Whether a CSV file exists with at least one row below its header."""
    try:
        with open(path) as fh:
            return sum(1 for _ in fh) > 1
    except FileNotFoundError:
        return False


def largest_n_below(bound_at, longest: int, limit: float = 1.0) -> int:
    """The largest n in 1 .. longest with ``bound_at(n) < limit``, for a bound that
    grows with n (binary search; 1 if none)."""
    lo, hi = 1, longest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if bound_at(mid) < limit else (lo, mid - 1)
    return lo


def skip_unmodelled(kernel: str, fmt=None, **options) -> None:
    """Skip the calling test with the model's own refusal where ``kernel``'s model
    refuses the code this CPU runs (``Kernel.unmodelled``); nothing elsewhere.  A
    refusal is itself checked in test_kernels_unmodelled, so a skip hides nothing."""
    import pytest

    from fa_jax.kernels.registry import _lookup

    reason = _lookup(kernel).unmodelled(fmt, **options)
    if reason is not None:
        pytest.skip(f"the model refuses this CPU: {reason}")


def skip_unless_aten_runs(capability: str) -> None:
    """Skip, saying why, where this CPU cannot run ATen's ``capability`` kernels: ATen
    takes ATEN_CPU_CAPABILITY unchecked, and a child forced above the CPU dies on
    its first illegal instruction (:func:`fa_jax.kernels.torch_cpu.runs_here`)."""
    import pytest

    from fa_jax.kernels import torch_cpu
    from fa_jax.kernels.x86 import cpu

    if not torch_cpu.runs_here(capability):
        pytest.skip(
            f"this CPU ({cpu.describe()}) cannot run ATen's {capability} kernels: "
            "ATEN_CPU_CAPABILITY would force them onto it and die on an illegal instruction"
        )
