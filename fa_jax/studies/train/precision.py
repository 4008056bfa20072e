"""Training precision: FP32, or BF16/FP16 mixed precision with FP32 master weights.

A :class:`TrainPrecision` names the *compute* dtype of the forward and backward
pass; master weights, gradients as the optimizer sees them, and the optimizer
state are always float32 (Micikevicius et al. 2018, "Mixed Precision
Training", §3):

* the forward casts the float32 master weights of every matmul and embedding to
  the compute dtype (a native ``jnp.bfloat16``/``jnp.float16`` array: one
  round-to-nearest-even per weight), and every activation between them — the
  residual stream, Q, K, V, the attention output, the MLP — is a native array of
  that dtype; XLA rounds after every operation because the train step is
  compiled with ``xla_allow_excess_precision=False`` (:data:`COMPILER_OPTIONS`;
  otherwise it may keep bf16 chains in float32).  Matmuls take
  compute-dtype operands and return compute-dtype results (one rounding of an
  accumulation the backend does in float32, as tensor cores do);
* layer-norm statistics and the softmax cross-entropy are computed in float32
  (the usual mixed-precision exceptions) and cast back;
* the backward pass runs through the same casts, so activation gradients are
  compute-dtype arrays; the weight gradients arrive in float32 through the
  cast's transpose and update the float32 master weights;
* FP16 multiplies the loss by a dynamic loss scale (start 2**15; halve and skip
  the step on a non-finite gradient; double after ``growth_interval`` finite
  steps) so small gradients survive FP16's range (Micikevicius et al. §3.2).

Attention itself is the emulated fa_jax function under its own Policy: it
receives Q, K, V converted exactly to float64 carriers and its output is
converted to the compute dtype (exact whenever the policy's output format fits
the compute dtype, e.g. BF16 output in FP32 or BF16 training).

The native casts here are the point: this module makes a low-precision run a
real low-precision run, it does not emulate one.  (The attention emulation
never casts; it rounds through fa_jax.ops.)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fa_jax._checks import one_of, positive_int, positive_number

__all__ = [
    "BF16_MIXED",
    "COMPILER_OPTIONS",
    "FP16_MIXED",
    "FP32_TRAINING",
    "PRECISIONS",
    "LossScale",
    "TrainPrecision",
    "all_finite",
    "cast",
    "get_precision",
    "to_carrier",
]

COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class TrainPrecision:
    """Compute dtype of a training run and its loss scaling (module docstring)."""

    name: str
    compute: str  # "float32", "bfloat16" or "float16"
    loss_scale: float = 1.0  # initial scale
    dynamic: bool = False  # dynamic loss scaling (halve on overflow, grow when stable)
    growth_interval: int = 2000

    def __post_init__(self):
        one_of(self.compute, tuple(_DTYPES), "TrainPrecision.compute")
        positive_number(self.loss_scale, "TrainPrecision.loss_scale")
        positive_int(self.growth_interval, "TrainPrecision.growth_interval")

    @property
    def dtype(self):
        """The compute dtype (a jnp scalar type)."""
        return _DTYPES[self.compute]

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled at all (FP32/BF16: no)."""
        return self.dynamic or self.loss_scale != 1.0


FP32_TRAINING = TrainPrecision("fp32", "float32")
BF16_MIXED = TrainPrecision("bf16", "bfloat16")
FP16_MIXED = TrainPrecision("fp16", "float16", loss_scale=2.0**15, dynamic=True)
PRECISIONS = {p.name: p for p in (FP32_TRAINING, BF16_MIXED, FP16_MIXED)}


def get_precision(spec) -> TrainPrecision:
    """A TrainPrecision, or its name: "fp32", "bf16" or "fp16"."""
    if isinstance(spec, TrainPrecision):
        return spec
    return PRECISIONS[one_of(spec, tuple(PRECISIONS), "training precision")]


def cast(x, dtype) -> jax.Array:
    """``x`` as a native ``dtype`` array (round to nearest even when narrowing)."""
    return jax.lax.convert_element_type(x, dtype)


def to_carrier(x) -> jax.Array:
    """A float32/bfloat16/float16 activation as a float64 carrier for fa_jax attention.

    Every such value is a float64 value, and ``convert_element_type`` is
    differentiable, so gradients reach Q, K and V.  (XLA on CPU flushes float32
    subnormals, |x| < 2**-126, to zero in this conversion.)
    """
    return jax.lax.convert_element_type(x, jnp.float64)


class LossScale(NamedTuple):
    """Dynamic loss-scale state: the scale (float32) and the finite steps since the
    last change (int32)."""

    scale: jax.Array
    good_steps: jax.Array

    @classmethod
    def init(cls, precision: TrainPrecision) -> LossScale:
        return cls(jnp.asarray(precision.loss_scale, jnp.float32), jnp.asarray(0, jnp.int32))

    def scale_loss(self, loss, precision: TrainPrecision):
        """loss · scale (float32)."""
        return loss * self.scale if precision.scaled else loss

    def unscale(self, grads, precision: TrainPrecision):
        """grads / scale, leaf by leaf (float32)."""
        if not precision.scaled:
            return grads
        return jax.tree_util.tree_map(lambda g: g / self.scale, grads)

    def adjust(self, finite, precision: TrainPrecision) -> LossScale:
        """The next state after a step whose gradients were (or were not) all finite."""
        if not precision.dynamic:
            return self
        grow = finite & (self.good_steps + 1 >= precision.growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, self.scale * 2, self.scale),
            jnp.maximum(self.scale / 2, jnp.float32(1)),
        )
        good = jnp.where(finite & ~grow, self.good_steps + 1, jnp.int32(0))
        return LossScale(cast(scale, jnp.float32), cast(good, jnp.int32))


def all_finite(tree) -> jax.Array:
    """True when every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.stack(leaves).all()
