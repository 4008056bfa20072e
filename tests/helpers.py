"""Helpers shared by the tests (import them with ``from helpers import ...``)."""

from fa_jax._x64 import float64_enabled

# Enable float64 for the duration of a block, restoring the previous setting.
x64_enabled = float64_enabled

__all__ = ["x64_enabled"]
