"""Which modelling choices make fa_jax reproduce a real kernel: knob search.

A *knob* is one choice a kernel model makes (:mod:`fa_jax.kernels.model`): the
format of a stage (:mod:`fa_jax.policy`), the exp implementation
(:mod:`fa_jax.exponential`), the accumulation model
(:mod:`fa_jax.accumulation`), where the scale is applied, how the output is
normalised, and the algorithm (the materialised reference, or the tiled
recurrence of Dao 2023, Algorithm 1, with the kernel's tiles).  The judge is the
share of output elements bit-identical to the real kernel on the same inputs.

``calibrate`` measures two things:

* **ablation**: the kernel's model with one knob set to each other value, and
  how much of the bit-identical share each change costs (or gains);
* **search**: greedy coordinate ascent from a generic preset (FlashAttention-2's
  policy, Dao 2023 §3.1, in the reference algorithm): at every step the one
  knob change that raises the share most is kept, until none raises it.  The
  path shows which knobs moved the match and by how much.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from fa_jax import kernels
from fa_jax._checks import non_negative_int, non_negative_ints
from fa_jax.accumulation import EXACT, SEQUENTIAL, chunked
from fa_jax.exponential import exp_models, get_exp_model
from fa_jax.formats import FP32, get_format
from fa_jax.kernels.model import KernelModel
from fa_jax.policy import FORWARD_STAGES, NORMALISE
from fa_jax.presets import fa2_kernel
from fa_jax.studies.validation import Shape, validation_inputs

__all__ = ["DEFAULT_SHAPE", "Calibration", "Knob", "calibrate", "format_calibration", "knobs_for"]

# Small enough for a search of many compiled variants; validate judges the large shapes.
DEFAULT_SHAPE = Shape(1, 1, 256, 64)
_STAGE_KNOBS = tuple(s for s in FORWARD_STAGES if s not in ("inputs", "out"))


@dataclasses.dataclass(frozen=True)
class Knob:
    """One modelling choice: its name, the values it may take (as labels), the
    label of a model's value, and how to set it."""

    name: str
    values: tuple[str, ...]
    current: Callable[[KernelModel], str]
    apply: Callable[[KernelModel, str], KernelModel]


def _policy_knob(name: str, values: dict) -> Knob:
    labels = tuple(values)

    def current(m: KernelModel) -> str:
        now = getattr(m.policy, name)
        for label, value in values.items():
            if value == now:
                return label
        return str(now)

    def apply(m: KernelModel, label: str) -> KernelModel:
        return dataclasses.replace(m, policy=m.policy.replace(**{name: values[label]}))

    return Knob(name, labels, current, apply)


def _algorithm_knob(tiled: KernelModel | None) -> Knob:
    def current(m: KernelModel) -> str:
        return m.algorithm

    def apply(m: KernelModel, label: str) -> KernelModel:
        if label == "reference":
            return dataclasses.replace(m, algorithm="reference", blocks=None, variant=None)
        assert tiled is not None
        return dataclasses.replace(m, algorithm="flash", blocks=tiled.blocks, variant=tiled.variant)

    values = ("reference", "flash") if tiled is not None else ("reference",)
    return Knob("algorithm", values, current, apply)


def knobs_for(model: KernelModel) -> tuple[Knob, ...]:
    """The knobs searched for a kernel model in its input format."""
    fmt = model.policy.inputs
    stage_values = {fmt.name: fmt, FP32.name: FP32}
    accumulations = {str(a): a for a in (EXACT, SEQUENTIAL, chunked(16), model.policy.accumulation)}
    out = [_policy_knob(s, stage_values) for s in _STAGE_KNOBS]
    # the exps of the model's base: a base-2 exp goes with scale "exp2" only
    base = model.policy.exp_model.base
    same_base = [e for e in map(get_exp_model, exp_models()) if e.base == base]
    out.append(_policy_knob("exp_model", {str(e): e for e in same_base}))
    out.append(_policy_knob("accumulation", accumulations))
    out.append(_policy_knob("scale", {"scores": "scores", "q": "q"}))
    out.append(_policy_knob("normalise", {n: n for n in NORMALISE}))
    if model.forward is None:
        out.append(_algorithm_knob(model if model.algorithm == "flash" else None))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The result of :func:`calibrate` (module docstring).

    ``ablation`` rows: (knob, the model's value, the value tried, share, whether
    any output bit changed: a knob that changes none is either irrelevant at this
    shape or not read by the model's steps).
    ``search`` rows: (step, knob, value, share), step 0 being the start."""

    kernel: str
    fmt: str
    shape: Shape
    causal: bool
    seeds: tuple[int, ...]
    model_share: float
    ablation: tuple[tuple[str, str, str, float, bool], ...]
    search: tuple[tuple[int, str, str, float], ...]


def _outputs_of(inputs, causal: bool) -> Callable[[KernelModel], np.ndarray]:
    def outputs(m: KernelModel) -> np.ndarray:
        return np.stack([m(q, k, v, causal=causal) for q, k, v in inputs])

    return outputs


def _identical(a: np.ndarray, b: np.ndarray) -> float:
    """The share of elements of ``a`` bit-identical to ``b``."""
    return float(np.mean(a.view(np.uint64) == b.view(np.uint64)))


def calibrate(
    kernel: str,
    fmt,
    *,
    shape: Shape = DEFAULT_SHAPE,
    causal: bool = False,
    seeds: Sequence[int] = (0,),
    max_steps: int = 8,
    knobs: Sequence[str] | None = None,
) -> Calibration:
    """Ablation around ``kernel``'s model and a greedy search from a generic preset
    (module docstring), judged on ``seeds`` at ``shape``; ``knobs`` limits both
    to the named knobs (default: all of :func:`knobs_for`)."""
    f = get_format(fmt)
    seeds = tuple(non_negative_ints(seeds, "calibrate: seeds"))
    if not seeds:
        raise ValueError("calibrate: seeds: expected at least one seed, got none")
    max_steps = non_negative_int(max_steps, "calibrate: max_steps")
    inputs = [validation_inputs(f, shape, s) for s in seeds]
    real = np.stack([kernels.real(kernel, q, k, v, fmt=f, causal=causal) for q, k, v in inputs])
    outputs = _outputs_of(inputs, causal)

    def share(m: KernelModel) -> float:
        return _identical(outputs(m), real)

    model = kernels.model(kernel, f, shape.n, shape.d)
    every = knobs_for(model)
    if knobs is not None:
        names = [k.name for k in every]
        unknown = sorted(set(knobs) - set(names))
        if unknown:
            raise ValueError(f"calibrate: knobs: expected names among {names}, got {unknown}")
    chosen = tuple(k for k in every if knobs is None or k.name in knobs)
    model_out = outputs(model)
    model_share = _identical(model_out, real)
    ablation = []
    for knob in chosen:
        now = knob.current(model)
        for value in knob.values:
            if value != now:
                out = outputs(knob.apply(model, value))
                changed = not np.array_equal(out.view(np.uint64), model_out.view(np.uint64))
                ablation.append((knob.name, now, value, _identical(out, real), changed))
    start = dataclasses.replace(model, policy=fa2_kernel(f), algorithm="reference")
    start = dataclasses.replace(start, blocks=None, variant=None)
    search = [(0, "start", "fa2_kernel reference", share(start))]
    best, best_share = start, search[0][3]
    for step in range(1, max_steps + 1):
        trials = [
            (share(knob.apply(best, value)), knob, value)
            for knob in chosen
            for value in knob.values
            if value != knob.current(best)
        ]
        top = max(trials, key=lambda t: t[0], default=None)
        if top is None or top[0] <= best_share:
            break
        best_share, knob, value = top
        best = knob.apply(best, value)
        search.append((step, knob.name, value, best_share))
    return Calibration(
        kernel, f.name, shape, causal, seeds, model_share, tuple(ablation), tuple(search)
    )


def format_calibration(c: Calibration) -> str:
    """The ablation table, then the search path."""
    lines = [
        f"kernel {c.kernel}, {c.fmt}, {c.shape}, causal={c.causal}, seeds {list(c.seeds)}",
        f"the kernel's model: {100 * c.model_share:.4f}% bit-identical",
        "",
        "ablation: the model with one knob changed",
        f"{'knob':<14} {'model':<28} {'tried':<28} {'identical':>10} {'change':>9}",
    ]
    for name, now, value, s, changed in sorted(c.ablation, key=lambda r: r[3]):
        note = "" if changed else "  (no output bit changed)"
        lines.append(
            f"{name:<14} {now:<28} {value:<28} {100 * s:>9.4f}% "
            f"{100 * (s - c.model_share):>+8.4f}%{note}"
        )
    lines += ["", "search from fa2_kernel (reference): the best single change per step"]
    lines.append(f"{'step':>4} {'knob':<14} {'value':<28} {'identical':>10} {'gain':>9}")
    previous = None
    for step, name, value, s in c.search:
        gain = "" if previous is None else f"{100 * (s - previous):>+8.4f}%"
        lines.append(f"{step:>4} {name:<14} {value:<28} {100 * s:>9.4f}% {gain:>9}")
        previous = s
    return "\n".join(lines)
