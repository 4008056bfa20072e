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
vmapped over formats.
"""

from __future__ import annotations

import dataclasses

import jax

from fa_jax.accumulation import EXACT, Accumulation, get_accumulation
from fa_jax.formats import FP32, FP64, Format, get_format

__all__ = ["Policy", "STAGES", "paper_uniform", "fa2_kernel", "torch_math", "golden", "PRESETS", "get_policy"]

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


def paper_uniform(fmt, *, accumulation=EXACT) -> Policy:
    """Every stage in ``fmt``: the paper's re-implementation (Golden et al. 2024 §3),
    where one precision is chosen for the whole computation."""
    f = get_format(fmt)
    return Policy(*(f,) * len(STAGES), accumulation=accumulation, name=f"paper_uniform({f.name})")


def fa2_kernel(fmt, *, accumulation=EXACT) -> Policy:
    """A FlashAttention-2 kernel: Q, K, V and P in ``fmt``; scores, m, l, exp and all
    accumulators FP32; the output rounded once to ``fmt`` (Dao 2023 §3.1)."""
    f = get_format(fmt)
    return Policy(
        inputs=f, qk_acc=FP32, scores=FP32, stats=FP32, exp=FP32, p=f, pv_acc=FP32,
        o_acc=FP32, out=f, accumulation=accumulation, name=f"fa2_kernel({f.name})",
    )


def torch_math(fmt, *, accumulation=EXACT) -> Policy:
    """PyTorch's unfused attention (the SDPA math path): matmuls accumulate in FP32
    and store in ``fmt``, so the scores and P are ``fmt``; softmax's internals (max,
    exp, sum) are FP32."""
    f = get_format(fmt)
    return Policy(
        inputs=f, qk_acc=FP32, scores=f, stats=FP32, exp=FP32, p=f, pv_acc=FP32,
        o_acc=FP32, out=f, accumulation=accumulation, name=f"torch_math({f.name})",
    )


def golden() -> Policy:
    """FP64 everywhere: the reference the others are measured against."""
    return Policy(*(FP64,) * len(STAGES), accumulation=EXACT, name="golden")


PRESETS = {
    "paper_uniform": paper_uniform,
    "fa2_kernel": fa2_kernel,
    "torch_math": torch_math,
}


def get_policy(name: str, fmt=None, **kwargs) -> Policy:
    """A preset by name: "golden", or "paper_uniform" / "fa2_kernel" / "torch_math" with a format."""
    if name == "golden":
        return golden()
    if name not in PRESETS:
        raise ValueError(f"unknown policy {name!r}: expected 'golden' or one of {sorted(PRESETS)}")
    if fmt is None:
        raise ValueError(f"policy {name!r} needs a format, e.g. get_policy({name!r}, 'bf16')")
    return PRESETS[name](fmt, **kwargs)
