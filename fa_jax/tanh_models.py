"""Tanh implementations: which tanh a kernel's softcap computes.

Softcapping (Gemma 2; FlashAttention-2's ``softcap``) maps a score s to
c · tanh(s / c) (:mod:`fa_jax.score_mods`).  A kernel rarely computes a correctly
rounded tanh: FlashAttention-2 calls ``cutlass::fast_tanh``, the GPU's
``tanh.approx.f32``.  A :class:`TanhModel` names one implementation; ``fn(x, fmt)``
returns its result for the carrier array ``x``, composed of :mod:`fa_jax.ops`
operations, as :class:`~fa_jax.exponential.ExpModel` does for exp.

:data:`CORRECTLY_ROUNDED` (``ops.tanh``, fl_fmt(tanh(x))) is every policy's
default (``Policy.tanh_model``).  More are registered by
:func:`register_tanh_model`; with no GPU to read ``tanh.approx.f32``'s bits from,
none models it yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from fa_jax import ops
from fa_jax.formats import Format

__all__ = [
    "CORRECTLY_ROUNDED",
    "TanhModel",
    "get_tanh_model",
    "register_tanh_model",
    "tanh_models",
]


@dataclasses.dataclass(frozen=True)
class TanhModel:
    """A tanh implementation: ``fn(x, fmt)`` is its result on the carrier ``x``,
    rounded to ``fmt`` as that implementation rounds."""

    name: str
    fn: Callable[[jax.Array, Format], jax.Array]

    def __str__(self) -> str:
        return self.name


def _correctly_rounded(x: jax.Array, fmt: Format) -> jax.Array:
    return ops.tanh(x, fmt)


CORRECTLY_ROUNDED = TanhModel("correctly_rounded", _correctly_rounded)

_MODELS: dict[str, TanhModel] = {CORRECTLY_ROUNDED.name: CORRECTLY_ROUNDED}


def register_tanh_model(model: TanhModel) -> None:
    """Make ``model`` available by name; a name already taken by another model raises."""
    if not isinstance(model, TanhModel):
        raise TypeError(f"register_tanh_model: expected a TanhModel, got {model!r}")
    known = _MODELS.get(model.name)
    if known is not None and known != model:
        raise ValueError(
            f"register_tanh_model: name {model.name!r}: expected a new name, got one "
            "already registered to another model"
        )
    _MODELS[model.name] = model


def tanh_models() -> list[str]:
    """The registered names."""
    return sorted(_MODELS)


def get_tanh_model(spec: str | TanhModel) -> TanhModel:
    """A TanhModel itself, or the registered one of that name."""
    if isinstance(spec, TanhModel):
        return spec
    if isinstance(spec, str) and spec in _MODELS:
        return _MODELS[spec]
    raise ValueError(f"tanh model: expected a TanhModel or one of {tanh_models()}, got {spec!r}")
