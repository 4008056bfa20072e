"""Argument checks shared by every public entry point.

One function per kind of value.  Each returns the value (normalised to a Python
``int`` where it checks an integer) or raises ``ValueError`` with a message of
the form ``"<what>: expected <kind>, got <value>"``, where ``what`` names the
argument as the caller's user knows it (``"Grid.seq_lens"``, ``"--n"``).
Format names are checked by :func:`fa_jax.formats.get_format`, policy names by
:func:`fa_jax.presets.get_policy` and tile shapes by :class:`fa_jax.attention.Blocks`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "broadcasts_to",
    "is_int",
    "non_negative_int",
    "non_negative_ints",
    "one_of",
    "positive_int",
    "positive_ints",
    "positive_number",
]

T = TypeVar("T")


def is_int(v: Any) -> bool:
    """A concrete integer (Python or numpy), not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _int_at_least(v: Any, lo: int, kind: str, what: str) -> int:
    if not is_int(v) or v < lo:
        raise ValueError(f"{what}: expected {kind}, got {v!r}")
    return int(v)


def positive_int(v: Any, what: str) -> int:
    """``v`` as an int >= 1."""
    return _int_at_least(v, 1, "a positive integer", what)


def non_negative_int(v: Any, what: str) -> int:
    """``v`` as an int >= 0."""
    return _int_at_least(v, 0, "a non-negative integer", what)


def positive_ints(values: Iterable[Any], what: str) -> tuple[int, ...]:
    """Every entry an int >= 1 (the message shows the whole sequence)."""
    values = tuple(values)
    for v in values:
        if not is_int(v) or v < 1:
            raise ValueError(f"{what}: expected positive integers, got {v!r} in {values!r}")
    return tuple(int(v) for v in values)


def non_negative_ints(values: Iterable[Any], what: str) -> tuple[int, ...]:
    """Every entry an int >= 0 (the message shows the whole sequence)."""
    values = tuple(values)
    for v in values:
        if not is_int(v) or v < 0:
            raise ValueError(f"{what}: expected non-negative integers, got {v!r} in {values!r}")
    return tuple(int(v) for v in values)


def positive_number(v: Any, what: str) -> float:
    """``v`` as a finite float > 0."""
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    if not ok or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what}: expected a positive finite number, got {v!r}")
    return float(v)


def non_negative_number(v: Any, what: str) -> float:
    """``v`` as a finite float >= 0."""
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    if not ok or not math.isfinite(v) or v < 0:
        raise ValueError(f"{what}: expected a non-negative finite number, got {v!r}")
    return float(v)


def broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` exactly (NumPy's rules,
    the result ``target`` itself)."""
    try:
        return np.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def one_of(v: T, choices: Sequence[T], what: str) -> T:
    """``v`` if it is one of ``choices``."""
    if not isinstance(v, (str, int, float, bool, type(None))) or v not in choices:
        raise ValueError(f"{what}: expected one of {tuple(choices)}, got {v!r}")
    return v
