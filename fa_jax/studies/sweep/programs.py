"""The sweep's compiled programs: reference and flash attention over configurations.

One configuration is (policy, format, sequence length, tiles, variant, seed,
features); the features (:class:`~.features.Features`) are static arguments.
Each program maps configurations of one policy (one call: one format and
preset) to their outputs O, along a leading configuration axis.  That axis is
one more leading dimension of the attention's batch (every step of attention
is per leading index, so this is bitwise the configurations one at a time, and
the program is traced once, without ``vmap``'s batching of its key loop: about
half the tracing and a fifth of the compiling of a vmapped one), except where a
KV cache's scales span the batch (``kv_scaling`` "tensor" or "head"), which is
``vmap``'d over the configurations (:func:`_over_configs`).  A
:class:`~fa_jax.policy.Policy` is a pytree whose leaves are its stages' widths
(exp_bits, man_bits, bias), so a program takes a policy apart: its
:class:`PolicyShape` (which stages share a format, each format's kind, the
accumulation, scale, exp and normalisation models) is static, and its widths
are traced (:func:`policy_widths`).  Policies of one shape share one
compiled program: paper_uniform and fa2_kernel in the same format kind, and the
FP64 golden beside them, with their stages in the slots of
:func:`stage_slots`.  Sequence lengths are padded to the batch's longest and
masked with ``q_lengths``/``kv_lengths``, which gives the unpadded numbers
bitwise (a flash key loop runs to the call's longest length: a block past a
configuration's keys changes nothing, α = 1 and zeros added).

* golden (:func:`golden_for`): reference attention in FP64 on Q, K, V rounded
  to the format, the values the emulated runs see;
* baseline: :func:`~fa_jax.attention.reference_attention` under the policy
  (Golden et al. 2024, §3: the "baseline attention");
* flash: :func:`~fa_jax.attention.flash_attention` under the same policy
  (Dao 2023, Algorithm 1), tiles ``Blocks(bc, bc)``: the query tile Br does
  not change flash's numbers, only Bc, the number of rescalings, does;
* metrics (:func:`metric_values`): the three comparisons' statistics of one
  configuration, one program for every output size up to its padded one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import metrics
from fa_jax.accumulation import Accumulation
from fa_jax.attention import flash_attention, reference_attention
from fa_jax.exponential import ExpModel
from fa_jax.formats import Format
from fa_jax.kv_cache import scales_span_batch
from fa_jax.policy import STAGES, Policy
from fa_jax.presets import golden
from fa_jax.studies.sweep.executables import Executables
from fa_jax.studies.sweep.features import PAPER, Features
from fa_jax.studies.sweep.grid import COMPARISONS, METRICS

__all__ = [
    "METRIC_LABEL",
    "PolicyShape",
    "flash_program",
    "golden_for",
    "metric_plans",
    "metric_values",
    "policy_shape",
    "policy_widths",
    "reference_program",
    "stage_slots",
]


def _kind(f: Format) -> tuple:
    """The static part of a format: its pytree structure."""
    return (f.subnormals, f.specials, f.overflow)


def _traced_kind(f: Format, carrier: str) -> tuple:
    """A slot's static part in a program of a policy's ``carrier``: the format's kind
    and whether it rounds exactly in float64's float arithmetic (stated on the traced
    format, :attr:`~fa_jax.formats.Format.float_exact_in`, and used where the program
    computes on float64): true of the sweep's formats (bf16, fp16, fp8, FP32, FP64)
    alike, so they still share a program.  On a float32 carrier bf16 would not (its
    subnormals are float32 subnormals) and fp16 would: nothing is stated there, so
    they keep sharing one."""
    exact = carrier != "float32" and f.rounds_in_float(np.float64)
    return (*_kind(f), ("float64",) if exact else ())


@dataclasses.dataclass(frozen=True)
class PolicyShape:
    """The static part of a policy: which stages share a format (``slots``, one
    per stage), each slot's format kind, and the policy's models."""

    slots: tuple
    kinds: tuple
    accumulation: Accumulation
    scale: str
    exp_model: ExpModel
    normalise: str
    carrier: str = "auto"

    def __repr__(self) -> str:  # the same in every process: it keys the program cache
        return (
            f"PolicyShape(slots={self.slots}, kinds={self.kinds}, "
            f"accumulation={self.accumulation!r}, scale={self.scale!r}, "
            f"exp_model={self.exp_model.name!r}, normalise={self.normalise!r}, "
            f"carrier={self.carrier!r})"
        )


def _key(f: Format) -> tuple:
    return (f.exp_bits, f.man_bits, f.bias, *_kind(f))


def stage_slots(pols) -> tuple:
    """Slots for the policies ``pols``: two stages share one where their formats
    are equal in every policy, so a program rounds to as few traced formats as
    the policies need (paper_uniform's stages all share one)."""
    first: dict = {}
    keys = [tuple(_key(getattr(p, s)) for p in pols) for s in STAGES]
    return tuple(first.setdefault(k, len(first)) for k in keys)


def _slot_formats(pol: Policy, slots: tuple) -> list[Format]:
    fmts: dict = {}
    for s, slot in zip(STAGES, slots):
        f = getattr(pol, s)
        if _key(fmts.setdefault(slot, f)) != _key(f):
            raise ValueError(
                f"policy_shape: expected stages of one slot to share a format, got "
                f"{fmts[slot].name} and {f.name} (stage {s}) in {pol.name}"
            )
    return [fmts[i] for i in range(len(fmts))]


def policy_shape(pol: Policy, slots: tuple | None = None) -> PolicyShape:
    """``pol``'s static part (its stages in ``slots``, by default its own)."""
    slots = stage_slots([pol]) if slots is None else slots
    return PolicyShape(
        slots,
        tuple(_traced_kind(f, pol.carrier) for f in _slot_formats(pol, slots)),
        pol.accumulation,
        pol.scale,
        pol.exp_model,
        pol.normalise,
        pol.carrier,
    )


def policy_widths(pol: Policy, slots: tuple) -> np.ndarray:
    """``[slots, 3]`` int32: each slot's (exp_bits, man_bits, bias), what a program
    takes for its call's policy."""
    return np.array([[f.exp_bits, f.man_bits, f.bias] for f in _slot_formats(pol, slots)], np.int32)


def golden_for(f: Format) -> Policy:
    """The FP64 golden (:func:`~fa_jax.presets.golden`) on inputs rounded to ``f``."""
    return golden().replace(inputs=f)


def _policy(shape: PolicyShape, widths) -> Policy:
    fmts = [
        Format(
            "sweep",
            w[0],
            w[1],
            bias=w[2],
            subnormals=k[0],
            specials=k[1],
            overflow=k[2],
            float_exact_in=k[3],
        )
        for w, k in zip(widths, shape.kinds)
    ]
    return Policy(
        *(fmts[i] for i in shape.slots),
        accumulation=shape.accumulation,
        scale=shape.scale,
        name="sweep",
        exp_model=shape.exp_model,
        normalise=shape.normalise,
        carrier=shape.carrier,
    )


def _masks(q, k, n, features: Features) -> dict:
    """The keywords of one configuration of length ``n`` (padded to the program's
    length): its lengths (decoding's query rows are all real) and its features'."""
    kw = features.attention_kwargs(q.shape[-3], q.shape[-2], k.shape[-2], q.dtype)
    q_lengths = None if features.queries is not None else n
    return dict(kw, q_lengths=q_lengths, kv_lengths=n)


def _over_configs(one, features: Features, q, k, v, lengths):
    """``one(q, k, v, n)`` over the leading configuration axis of Q, K, V ``[C, B,
    H, N, d]`` and ``lengths`` ``[C]`` (module docstring): that axis as a leading
    batch dimension, each length broadcast over its configuration's (B, H); or
    ``vmap`` where the features' KV cache scales span the batch."""
    if features.kv is not None and scales_span_batch(features.kv_scaling):
        return jax.vmap(one)(q, k, v, lengths)
    return one(q, k, v, lengths[:, None, None])


@functools.partial(jax.jit, static_argnames=("shape", "causal", "features"))
def reference_program(q, k, v, widths, lengths, *, shape, causal, features=PAPER):
    """O of reference attention for configurations ``[C, ...]`` of one policy
    (``widths`` ``[slots, 3]``), each of ``lengths`` ``[C]``."""
    pol = features.policy(_policy(shape, widths))

    def one(q, k, v, n):
        return reference_attention(q, k, v, pol, causal=causal, **_masks(q, k, n, features))

    return _over_configs(one, features, q, k, v, lengths)


@functools.partial(jax.jit, static_argnames=("shape", "variant", "blocks", "causal", "features"))
def flash_program(q, k, v, widths, lengths, *, shape, variant, blocks, causal, features=PAPER):
    """O of flash attention, as :func:`reference_program`."""
    pol = features.policy(_policy(shape, widths))

    def one(q, k, v, n):
        kw = dict(_masks(q, k, n, features), **features.flash_kwargs())
        out = flash_attention(q, k, v, pol, blocks, variant=variant, causal=causal, **kw)
        return out[0]  # pyright: ignore[reportIndexIssue]

    return _over_configs(one, features, q, k, v, lengths)


METRIC_LABEL = "metrics"  # the profile's name of the metric program
_OUTPUTS = ("flash", "baseline", "golden")  # the rows of the metric program's outputs


def _pairs() -> tuple[list[int], list[int]]:
    """The rows of each comparison's measured and reference outputs, in
    :data:`COMPARISONS`' order."""
    pairs = [[_OUTPUTS.index(x) for x in comp.split("_vs_")] for comp in COMPARISONS]
    return [a for a, _ in pairs], [b for _, b in pairs]


@jax.jit
def _summaries(outputs, length):
    """``[comparisons, metrics]``: :func:`~fa_jax.metrics.abs_diff_summary` of each
    comparison of ``outputs`` (``[3, S]``, rows :data:`_OUTPUTS`, each holding one
    configuration's flattened output in its first ``length`` elements)."""
    a, b = _pairs()
    values = jax.vmap(lambda x, y: metrics.abs_diff_summary(x, y, length=length))(
        outputs[np.array(a)], outputs[np.array(b)]
    )
    return jnp.stack([values[m] for m in METRICS], axis=-1)


def metric_plans(padded_size: int) -> list:
    """The program :func:`metric_values` calls on outputs padded to
    ``padded_size`` elements, as :meth:`~.executables.Executables.prepare` takes
    it, so that a sweep compiles it ahead beside its other programs."""
    outputs = jax.ShapeDtypeStruct((len(_OUTPUTS), padded_size), np.float64)
    length = jax.ShapeDtypeStruct((), np.int64)
    return [(_summaries, (outputs, length), {}, METRIC_LABEL)]


def metric_values(outs: dict, padded_size: int, executables: Executables) -> np.ndarray:
    """``[comparisons, metrics]`` float64 (:data:`COMPARISONS` × :data:`METRICS`) of
    one configuration's ``outs`` (float64 arrays of one shape by name: flash,
    baseline, golden), bit for bit the public metric functions' values
    (:func:`~fa_jax.metrics.abs_diff_summary`, as a user's eager calls give
    them): one program, compiled once for every output size up to
    ``padded_size`` and kept on disk like the sweep's others, since the
    metrics' sums are exact over padding (their trees pad with zeros anyway)
    and contract no square into an FMA, whichever program they are in."""
    size = next(iter(outs.values())).size
    if size > padded_size:
        raise ValueError(
            f"metric_values: expected outputs of at most {padded_size} elements, got {size}"
        )
    outputs = np.zeros((len(_OUTPUTS), padded_size), np.float64)
    for row, name in enumerate(_OUTPUTS):
        outputs[row, :size] = np.asarray(outs[name], np.float64).reshape(-1)
    args = (outputs, np.array(size, np.int64))
    return np.asarray(executables.call(_summaries, args, {}, label=METRIC_LABEL))
