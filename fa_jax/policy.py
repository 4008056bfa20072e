"""Precision policies: the format every stage of attention rounds to.

Stages, in the order attention meets them (DESIGN §4):

==========  ==========================================================
``inputs``  Q, K and V as stored
``qk_acc``  the accumulator of S = Q Kᵀ
``scores``  the stored, scaled scores S
``stats``   the softmax statistics: running max m and sum l
``exp``     the shifted scores S - m and their exponentials
``p``       the probabilities P that enter P V
``pv_acc``  the accumulator of P V
``o_acc``   flash attention's running output accumulator O
``out``     the final output
==========  ==========================================================

plus the :mod:`accumulation <fa_jax.accumulation>` model of every dot and sum,
and where the softmax scale is applied: ``"scores"`` (S = fl(fl(Q Kᵀ) · scale))
or ``"q"`` (Q is pre-scaled: fl(Q · scale), as some kernels do).

A Policy is a pytree whose leaves are its formats' widths, so policies can be
vmapped over formats.  Presets live in :mod:`fa_jax.policies`.
"""

from __future__ import annotations

import dataclasses

import jax

from fa_jax.accumulation import EXACT, Accumulation, get_accumulation
from fa_jax.formats import Format, get_format

__all__ = ["Policy", "STAGES"]

STAGES = ("inputs", "qk_acc", "scores", "stats", "exp", "p", "pv_acc", "o_acc", "out")
_SCALES = ("scores", "q")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Policy:
    """The Format of each attention stage (module docstring), the accumulation
    model and the scale placement.  Build one directly or with a preset."""

    inputs: Format
    qk_acc: Format
    scores: Format
    stats: Format
    exp: Format
    p: Format
    pv_acc: Format
    o_acc: Format
    out: Format
    accumulation: Accumulation = EXACT
    scale: str = "scores"
    name: str = "custom"

    def __post_init__(self):
        for stage in STAGES:
            object.__setattr__(self, stage, get_format(getattr(self, stage)))
        object.__setattr__(self, "accumulation", get_accumulation(self.accumulation))
        if self.scale not in _SCALES:
            raise ValueError(f"Policy.scale: expected one of {_SCALES}, got {self.scale!r}")

    def replace(self, **changes) -> "Policy":
        """A copy with some stages (or the accumulation/scale) changed."""
        unknown = set(changes) - set(STAGES) - {"accumulation", "scale", "name"}
        if unknown:
            raise ValueError(f"Policy.replace: unknown fields {sorted(unknown)}; stages are {STAGES}")
        return dataclasses.replace(self, **changes)

    def tree_flatten(self):
        return tuple(getattr(self, s) for s in STAGES), (self.accumulation, self.scale, self.name)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for s, f in zip(STAGES, children):
            object.__setattr__(obj, s, f)
        for k, v in zip(("accumulation", "scale", "name"), aux):
            object.__setattr__(obj, k, v)
        return obj

    def describe(self) -> str:
        """One line per stage."""
        lines = [f"policy {self.name}: accumulation {self.accumulation}, scale on {self.scale}"]
        lines += [f"  {s:<7} {getattr(self, s).name}" for s in STAGES]
        return "\n".join(lines)
