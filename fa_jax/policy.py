"""Precision policies: the format every stage of attention rounds to.

Forward stages, in the order attention meets them (Dao 2023, Algorithm 1):

==========  ==========================================================
``inputs``  Q, K and V as stored
``qk_acc``  the accumulator of S = Q Kᵀ
``scores``  the stored, scaled scores S
``stats``   the softmax statistics: running max m, sum l, log-sum-exp L
``exp``     the shifted scores S - m and their exponentials
``p``       the probabilities P that enter P V
``pv_acc``  the accumulator of P V
``o_acc``   flash attention's running output accumulator O
``out``     the final output
==========  ==========================================================

An additive bias (:mod:`fa_jax.score_mods`) has a stage of its own, ``bias`` (B
and S + B); left out, it takes the format of ``scores``.  It is not one of
``STAGES``: every preset adds a bias in its scores' format.  A softcap's tanh is
``tanh_model`` (:mod:`fa_jax.tanh_models`; correctly rounded by default).

Backward stages (:mod:`fa_jax.backward`; Dao 2023, Algorithm 2).  The P that
the backward recomputes goes through the forward stages (qk_acc, scores, exp,
p).  Left out (``None``), a backward stage takes the format of the forward
stage in the last column:

===========  =============================================  ==========
``d_out``    dO as stored                                   ``inputs``
``d_acc``    the accumulators of dV = Pᵀ dO, dP = dO Vᵀ,    ``pv_acc``
             dQ = dS K and dK = dSᵀ Q
``d_p``      dP as stored                                   ``scores``
``d_stats``  D = rowsum(dO ∘ O) (flash) or rowsum(P ∘ dP)   ``stats``
             (reference), dP − D, and dS = P ∘ (dP − D)
             as computed
``d_s``      dS as it enters the dQ and dK products         ``p``
``grads``    the returned dQ, dK and dV                     ``out``
===========  =============================================  ==========

(Every preset's backward formats agree with these defaults: dO is stored like
the inputs, dP like S, dS like P, the gradients like O.)  ``replace`` changes only the stages
it names: a derived backward stage does not follow a later change of its
forward stage.

plus the :mod:`accumulation <fa_jax.accumulation>` model of every dot and sum,
where the softmax scale is applied: ``"scores"`` (S = fl(fl(Q Kᵀ) · scale)),
``"q"`` (Q is pre-scaled: fl(Q · scale), as some kernels do) or ``"exp2"``
(S unscaled; the scale and log2 e folded into one FMA before an exp2,
P̃ = 2^fl_exp(fma(S, c, -fl_exp(m c))) with c = fl_exp(scale · log2 e), as the
FlashAttention-2/3 CUDA kernels compute it: :mod:`fa_jax.softmax`), the
:mod:`exp implementation <fa_jax.exponential>` of the ``exp`` stage
(``exp_model``; correctly rounded by default; a base-2 model, and only one,
with ``"exp2"``), and how flash attention's final
output is normalised: ``"divide"`` (fl_out(o / l)) or ``"reciprocal"``
(fl_out(fl_o_acc(o · fl_stats(1 / l))), as PyTorch's CPU flash kernel does), and the
``carrier`` the emulation computes in: ``"float64"``, ``"float32"`` (no 64-bit
type, for every stage that fits float32: :mod:`fa_jax.carrier32.elementwise`) or ``"auto"``
(float64 when ``jax_enable_x64`` is on, else float32).  Both give the same bits.

A Policy is a pytree whose leaves are its formats' widths, so policies can be
vmapped over formats.  Presets live in :mod:`fa_jax.presets`.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import numpy as np

from fa_jax import ops
from fa_jax._checks import one_of
from fa_jax.accumulation import EXACT, Accumulation, get_accumulation
from fa_jax.exponential import CORRECTLY_ROUNDED, ExpModel, get_exp_model
from fa_jax.formats import Format, get_format
from fa_jax.quantization import IntFormat, storage_format
from fa_jax.tanh_models import CORRECTLY_ROUNDED as CORRECTLY_ROUNDED_TANH
from fa_jax.tanh_models import TanhModel, get_tanh_model

__all__ = ["BACKWARD_STAGES", "FORWARD_STAGES", "KV_SCALINGS", "NORMALISE", "STAGES", "Policy"]

FORWARD_STAGES = ("inputs", "qk_acc", "scores", "stats", "exp", "p", "pv_acc", "o_acc", "out")
BACKWARD_STAGES = ("d_out", "d_acc", "d_p", "d_stats", "d_s", "grads")
STAGES = FORWARD_STAGES + BACKWARD_STAGES
# The forward stage whose format a backward stage left out takes (module docstring).
_BACKWARD_DEFAULTS = {
    "d_out": "inputs",
    "d_acc": "pv_acc",
    "d_p": "scores",
    "d_stats": "stats",
    "d_s": "p",
    "grads": "out",
}
# Stages outside STAGES, each with the stage it follows when left out: an additive
# bias (fa_jax.score_mods) and split-KV's combine (fa_jax.split_kv).
_DEFAULTS = {**_BACKWARD_DEFAULTS, "bias": "scores", "combine": "stats"}
_ALL_STAGES = (*STAGES, "bias", "combine")
_SCALES = ("scores", "q", "exp2")
NORMALISE = ("divide", "reciprocal")
_STATIC = ("accumulation", "scale", "name", "exp_model", "normalise", "carrier", "tanh_model")
# The KV cache (fa_jax.kv_cache): its format, a leaf (None: none), and its static scaling.
KV_SCALINGS = ("none", "tensor", "head", "token")
_KV_FIELDS = ("kv", "kv_scaling")


def _too_wide(fmt: Format) -> bool:
    """A concrete format that float32 cannot carry (a traced one is checked when rounded)."""
    return fmt.is_concrete and not fmt.fits(np.float32)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Policy:
    """The Format of each attention stage (module docstring), the accumulation
    model, the scale placement, the exp model and the final normalisation.
    Build one directly or with a preset; the backward stages may be left out
    (module docstring).  ``combine`` is split-KV decoding's stage (each split's
    log-sum-exp, the rescale factors, their sum and the combined output's
    accumulator: :mod:`fa_jax.split_kv`); left out, the format of ``stats``.

    A KV cache (:mod:`fa_jax.kv_cache`) is the stage ``kv``, the format K and V
    are stored in (a Format, or ``"int8"``), with ``kv_scaling``, how they are
    scaled into it: ``"none"`` (a plain cast, scale 1), ``"tensor"``, ``"head"``
    or ``"token"`` (one FP32 amax scale per tensor, K/V head or key).  Left out
    (``kv=None``), K and V are read as ``inputs`` stores them: no cache, which a
    later ``replace(inputs=...)`` keeps.  Like ``bias``, ``kv`` is not one of
    ``STAGES``; a scaled ``kv`` needs a concrete format (not vmapped widths).
    E.g. ``fa2_kernel("bf16").replace(kv="e4m3fn", kv_scaling="head")``.
    """

    inputs: Format
    qk_acc: Format
    scores: Format
    stats: Format
    exp: Format
    p: Format
    pv_acc: Format
    o_acc: Format
    out: Format
    d_out: Format | None = None
    d_acc: Format | None = None
    d_p: Format | None = None
    d_stats: Format | None = None
    d_s: Format | None = None
    grads: Format | None = None
    accumulation: Accumulation = EXACT
    scale: str = "scores"
    name: str = "custom"
    exp_model: ExpModel = CORRECTLY_ROUNDED
    normalise: str = "divide"
    carrier: str = "auto"
    bias: Format | None = None
    tanh_model: TanhModel = CORRECTLY_ROUNDED_TANH
    combine: Format | None = None
    kv: Format | IntFormat | None = None
    kv_scaling: str = "none"

    def __post_init__(self):
        for stage, source in _DEFAULTS.items():
            if getattr(self, stage) is None:
                object.__setattr__(self, stage, getattr(self, source))
        for stage in _ALL_STAGES:
            object.__setattr__(self, stage, get_format(getattr(self, stage)))
        object.__setattr__(self, "accumulation", get_accumulation(self.accumulation))
        if self.scale not in _SCALES:
            raise ValueError(f"Policy.scale: expected one of {_SCALES}, got {self.scale!r}")
        object.__setattr__(self, "exp_model", get_exp_model(self.exp_model))
        object.__setattr__(self, "tanh_model", get_tanh_model(self.tanh_model))
        if (self.scale == "exp2") != (self.exp_model.base == "2"):
            raise ValueError(
                f"Policy: scale='exp2' goes with a base-2 exp model and only it, got "
                f"scale={self.scale!r} with exp model {self.exp_model.name!r} "
                f"(base {self.exp_model.base}); e.g. .replace(scale='exp2', "
                "exp_model='exp2_correctly_rounded')"
            )
        one_of(self.normalise, NORMALISE, "Policy.normalise")
        one_of(self.carrier, ops.CARRIERS, "Policy.carrier")
        self._check_kv()
        if self.carrier == "float32":
            self._stages_fitting_float32()

    def _check_kv(self) -> None:
        if self.kv is not None:
            object.__setattr__(self, "kv", storage_format(self.kv))
        one_of(self.kv_scaling, KV_SCALINGS, "Policy.kv_scaling")
        if self.kv is None and self.kv_scaling != "none":
            raise ValueError(
                f"Policy.kv: kv_scaling={self.kv_scaling!r} scales K and V into a cache "
                "format: expected one, e.g. kv='e4m3fn', got None"
            )
        if isinstance(self.kv, IntFormat) and self.kv_scaling == "none":
            raise ValueError(
                f"Policy.kv_scaling: an integer cache ({self.kv.name}) needs scales: "
                f"expected one of {KV_SCALINGS[1:]}, got 'none'"
            )

    def _stages_fitting_float32(self) -> None:
        kv = () if self.kv is None else ("kv",)
        wide = [s for s in (*_ALL_STAGES, *kv) if _too_wide(getattr(self, s))]
        if not wide:
            return
        what = (
            f"Policy {self.name!r}: a float32 carrier holds formats that fit float32, got "
            + ", ".join(f"{s}={getattr(self, s).name}" for s in wide[:3])
            + (f" and {len(wide) - 3} more" if len(wide) > 3 else "")
        )
        if self.carrier == "auto":  # x64 is off
            raise RuntimeError(
                f"{what}: they need a float64 carrier, enable it with "
                "jax.config.update('jax_enable_x64', True)"
            )
        raise ValueError(f"{what} (carrier='float64', or 'auto' with jax_enable_x64 on)")

    def carrier_dtype(self) -> np.dtype:
        """The dtype this policy computes in (``carrier``: "auto" is float64 when
        ``jax_enable_x64`` is on, else float32; :func:`fa_jax.ops.carrier_dtype`)."""
        dtype = ops.carrier_dtype(self.carrier)
        if dtype == np.float32:
            self._stages_fitting_float32()
        return dtype

    def replace(self, **changes) -> Policy:
        """A copy with some stages (or the accumulation, scale, name, exp model,
        normalisation, carrier, bias or combine stage, or KV cache) changed."""
        unknown = set(changes) - set(_ALL_STAGES) - set(_STATIC) - set(_KV_FIELDS)
        if unknown:
            raise ValueError(
                f"Policy.replace: unknown fields {sorted(unknown)}; stages are {STAGES}"
            )
        return dataclasses.replace(self, **changes)

    def tree_flatten(self):
        children = (*(getattr(self, s) for s in _ALL_STAGES), self.kv)
        return children, (*(getattr(self, k) for k in _STATIC), self.kv_scaling)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for s, f in zip((*_ALL_STAGES, "kv"), children):
            object.__setattr__(obj, s, f)
        for k, v in zip((*_STATIC, "kv_scaling"), aux):
            object.__setattr__(obj, k, v)
        return obj

    def describe(self) -> str:
        """One line per stage, forward then backward."""
        lines = [
            f"policy {self.name}: accumulation {self.accumulation}, scale on {self.scale}, "
            f"exp {self.exp_model.name}, normalise by {self.normalise}, carrier {self.carrier}"
        ]
        lines += [f"  {s:<7} {getattr(self, s).name}" for s in FORWARD_STAGES]
        bias = typing.cast(Format, self.bias)
        lines += [f"  {'bias':<7} {bias.name}  (an additive bias, when given)"]
        combine = typing.cast(Format, self.combine)
        lines += [f"  {'combine':<7} {combine.name}  (split-KV decoding's combine)"]
        if self.kv is None:
            lines += [f"  {'kv':<7} {self.inputs.name}  (K and V as inputs: no cache)"]
        else:
            lines += [f"  {'kv':<7} {self.kv.name}  (K and V cached, scaling {self.kv_scaling})"]
        lines += ["  backward:"]
        lines += [f"  {s:<7} {getattr(self, s).name}" for s in BACKWARD_STAGES]
        return "\n".join(lines)
