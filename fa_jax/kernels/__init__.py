"""Real attention kernels beside fa_jax's bit-exact models of them.

A :class:`Kernel` is a real implementation (XLA's ``dot_product_attention`` on
the CPU, PyTorch's scaled-dot-product attention, GPU kernels) and a
:class:`KernelModel` is fa_jax's emulation of it (:mod:`fa_jax.kernels.model`).
:func:`real` runs a kernel, :func:`emulate` its model, and :func:`compare` judges
the two bit for bit and against an FP64 golden output
(:mod:`fa_jax.kernels.compare`).  Kernels are looked up by name
(:mod:`fa_jax.kernels.registry`); PyTorch is optional and imported only when a
PyTorch kernel runs.
"""

from __future__ import annotations

from fa_jax.kernels.compare import Comparison, compare
from fa_jax.kernels.model import Kernel, KernelModel
from fa_jax.kernels.registry import available, emulate, get, model, names, real, register

# Names resolved on first use (fa_jax.kernels.reveal_order), so that a missing
# or broken module behind them does not break importing this package (PEP 562).
_LAZY = {"reveal_order": "fa_jax.kernels.reveal"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fa_jax.kernels' has no attribute {name!r}")


__all__ = [
    "Comparison",
    "Kernel",
    "KernelModel",
    "available",
    "compare",
    "emulate",
    "get",
    "model",
    "names",
    "real",
    "register",
]
