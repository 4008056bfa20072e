"""The paper's question asked of serving: how far from FP64 does one decode drift
as its KV cache grows from 1 to 32k keys, per engine, KV type and model feature?

Golden et al. 2024 (arXiv 2405.02803, §3) measure a kernel by its deviation from
FP64 attention on the same inputs.  ``serving`` asks it of a decode: one cache of
T keys and values and T queries, drawn once per seed
(:func:`fa_jax.inputs.make_inputs`), each rounded to the format the engine takes.
Step t (1 … T) is query t - 1 attending to the first t keys: N = 1, M = t, causal
bottom-right (``q_offset`` = M - N), as a server runs it; steps are log-spaced
(:func:`decode_steps`).  Per step, against FP64 attention of the same rounded
inputs and features (``golden``, float64 numpy): the row error ||o_h - g_h|| /
||g_h|| averaged over heads (``mean_rel``) and max |o - g| (``max_abs``).

Features (:data:`FEATURES`): ``mha`` (H = H_kv = 4); ``gqa`` (8 query heads on 2
K/V heads, :mod:`fa_jax.heads`); ``alibi`` (slopes 2^(-8 h / H) =
:func:`fa_jax.score_mods.alibi_slopes` = ggml's from ``max_bias`` =
:data:`ALIBI_MAX_BIAS`, bias -slope · |t - 1 - j|; ggml takes the distances in
its F16 mask as llama.cpp does); ``softcap`` (c · tanh(s / c), c = 30, Gemma 2).

Engines (:func:`fa_jax.kernels.real`, one thread): ``ggml`` with K/V stored as
f32, f16, bf16, q8_0 or q4_0 (split-KV from 512 keys); ``onnxruntime-gqa`` (its
past K/V the first M - 1 keys) in FP32 and FP16; ``openvino-sdpa`` with
precision f32 and bf16 and ``kv_cache`` u8, bf16, f32; and fa_jax's presets
(``policies``) in BF16 and FP16, FlashAttention-2 with 128 x 128 tiles.  A
feature a kernel does not take (its :data:`~fa_jax.kernels.model.FEATURES`) is
left out by design and listed (``metadata.json``'s ``combos_skipped``); an engine
not installed here is left out with its reason printed.

Cost: the engine calls go through :func:`fa_jax.kernels.real` at the first two
steps, then to the kernel's own ``Kernel.real`` with the same checked keywords
(the study rounded the inputs itself; the second step checks both give the same
bits).  The presets run as one program per (policy, format, feature, bucket):
the steps of a bucket in a ``lax.map``, each cache padded to the bucket and cut
by ``kv_lengths``, bit for bit the direct N = 1, M = t call.

``identity``: at a few points (:data:`QUICK_CHECKS`, :data:`FULL_CHECKS`) the
model (:func:`fa_jax.kernels.emulate`) runs beside the real kernel and
:func:`fa_jax.kernels.compare` gives the share of identical outputs (or the
model's refusal of this CPU).  Files in ``out_dir/serving/``: ``results.csv``,
``identity.csv``, ``metadata.json``, ``serving.png`` (error vs step, log-log, a
panel per feature); a killed run resumes.  Grids (quick / full): T = 2048 /
32768, 2 / 4 steps per octave, 1 / 2 seeds, d = 64 / 128, presets in BF16 /
BF16 and FP16.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import kernels
from fa_jax._checks import non_negative_ints, one_of, positive_int, positive_ints
from fa_jax._x64 import float64_enabled
from fa_jax.attention import Blocks, flash_attention
from fa_jax.formats import get_format
from fa_jax.inputs import make_inputs
from fa_jax.presets import PRESETS
from fa_jax.rounding import round_to
from fa_jax.score_mods import alibi_slopes
from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.cache import compilation_cache
from fa_jax.studies.engine_figures import OPENVINO_MAX_KEYS
from fa_jax.studies.interrupt import check_interrupt
from fa_jax.studies.options import current_options
from fa_jax.studies.progress import track
from fa_jax.studies.results import (
    check_out_dir,
    mean_over_seeds,
    pyplot,
    read_complete,
    run_metadata,
    write_csv,
    write_json,
)
from fa_jax.studies.table import print_table

__all__ = [
    "ALIBI_MAX_BIAS",
    "FEATURES",
    "FULL",
    "FULL_CHECKS",
    "QUICK",
    "QUICK_CHECKS",
    "Feature",
    "ServingCheck",
    "ServingGrid",
    "decode_steps",
    "golden_steps",
    "preset_steps",
    "serving",
    "serving_cases",
]

GGML_KV = ("f32", "f16", "bf16", "q8_0", "q4_0")
ORT_FORMATS = ("fp32", "fp16")
OPENVINO_PRECISIONS = ("f32", "bf16")
OPENVINO_KV = ("u8", "bf16", "f32")
PRESET_FORMATS = ("bf16", "fp16")
ENGINES = ("ggml", "onnxruntime-gqa", "openvino-sdpa")
# ggml's max_bias whose slopes m0^(h+1), m0 = 2^(-max_bias / H), are ALiBi's 2^(-8 h / H)
# for H a power of two (fa_jax.kernels.ggml.attention.alibi_slopes, fa_jax.score_mods.alibi_slopes).
ALIBI_MAX_BIAS = 8.0
PRESET_BLOCKS = Blocks(128, 128)  # the presets' tiles, as fa_jax.studies.validation's

RESULT_COLUMNS = (
    "case",
    "engine",
    "kv",
    "fmt",
    "feature",
    "step",
    "seed",
    "max_abs",
    "mean_rel",
)
IDENTITY_COLUMNS = (
    "kernel",
    "options",
    "fmt",
    "feature",
    "step",
    "elements",
    "identical",
    "identical_share",
    "max_ulp",
    "note",
)


@dataclasses.dataclass(frozen=True)
class Feature:
    """One model shape of the study (module docstring): ``heads`` query heads on
    ``kv_heads`` K/V heads, ALiBi (``alibi``), a softcap c (``softcap``)."""

    name: str
    heads: int
    kv_heads: int
    alibi: bool = False
    softcap: float | None = None

    def __post_init__(self):
        positive_int(self.heads, "Feature.heads")
        positive_int(self.kv_heads, "Feature.kv_heads")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"Feature.kv_heads: expected a divisor of heads = {self.heads}, got {self.kv_heads}"
            )
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"Feature.softcap: expected c > 0 or None, got {self.softcap!r}")

    def slopes(self) -> tuple[float, ...] | None:
        """ALiBi's slopes of the heads, or None without ALiBi."""
        return tuple(float(s) for s in alibi_slopes(self.heads)) if self.alibi else None


FEATURES = {
    "mha": Feature("mha", 4, 4),
    "gqa": Feature("gqa", 8, 2),
    "alibi": Feature("alibi", 4, 4, alibi=True),
    "softcap": Feature("softcap", 4, 4, softcap=30.0),
}


@dataclasses.dataclass(frozen=True)
class ServingCheck:
    """One identity point: ``kernel`` real vs emulated in ``fmt`` at ``step`` (capped
    at the grid's T) with ``feature``, the kernel's ``options`` ((name, value) pairs)."""

    kernel: str
    fmt: str
    feature: str
    step: int
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        one_of(self.feature, tuple(FEATURES), "ServingCheck.feature")
        positive_int(self.step, "ServingCheck.step")

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.options) or "-"


def _ggml_check(kv: str, feature: str, step: int) -> ServingCheck:
    return ServingCheck("ggml", "fp32", feature, step, (("kv_type", kv), ("threads", 1)))


QUICK_CHECKS = (_ggml_check("f16", "mha", 1024),)
FULL_CHECKS = (
    _ggml_check("f16", "gqa", 4096),
    _ggml_check("q4_0", "alibi", 4096),
    ServingCheck("onnxruntime-gqa", "fp16", "softcap", 4096, (("threads", 1),)),
    ServingCheck(
        "openvino-sdpa",
        "fp32",
        "gqa",
        4096,
        (("precision", "f32"), ("kv_cache", "u8"), ("threads", 1)),
    ),
)


def decode_steps(length: int, per_octave: int) -> tuple[int, ...]:
    """The sampled steps of a decode of ``length`` steps: round(2^(i / per_octave))
    for i = 0, 1, … up to ``length``, and ``length`` itself, without repeats."""
    positive_int(length, "decode_steps: length")
    positive_int(per_octave, "decode_steps: per_octave")
    steps, i = {length}, 0
    while 2.0 ** (i / per_octave) <= length:
        steps.add(math.floor(2.0 ** (i / per_octave) + 0.5))
        i += 1
    return tuple(sorted(s for s in steps if s <= length))


@dataclasses.dataclass(frozen=True)
class ServingGrid:
    """The decode of one run (module docstring): ``length`` T steps sampled
    ``per_octave`` a doubling, ``seeds``, head size ``d``, the ``features`` (names of
    :data:`FEATURES`), the ``engines`` (real kernels) and ``presets`` (run in
    ``preset_formats``), the presets' ``buckets`` (padded key counts, each step in
    the smallest holding it; None: T alone) and the identity ``checks``."""

    length: int
    per_octave: int
    seeds: tuple[int, ...]
    d: int = 128
    features: tuple[str, ...] = tuple(FEATURES)
    engines: tuple[str, ...] = ENGINES
    presets: tuple[str, ...] = DEFAULT_POLICIES
    preset_formats: tuple[str, ...] = PRESET_FORMATS
    buckets: tuple[int, ...] | None = None
    checks: tuple[ServingCheck, ...] = ()

    def __post_init__(self):
        positive_int(self.length, "ServingGrid.length")
        positive_int(self.per_octave, "ServingGrid.per_octave")
        positive_int(self.d, "ServingGrid.d")
        seeds = tuple(non_negative_ints(self.seeds, "ServingGrid.seeds"))
        if not seeds:
            raise ValueError("ServingGrid.seeds: expected at least one seed, got none")
        object.__setattr__(self, "seeds", seeds)
        for name, allowed in (
            ("features", tuple(FEATURES)),
            ("engines", ENGINES),
            ("preset_formats", PRESET_FORMATS),
        ):
            values = tuple(getattr(self, name))
            for v in values:
                one_of(v, allowed, f"ServingGrid.{name}")
            object.__setattr__(self, name, values)
        presets = tuple(self.presets)
        for p in presets:
            if str(p).startswith("kernel:"):
                raise ValueError(
                    f"serving: policies: expected preset names (the study runs the real "
                    f"kernels themselves), got {p!r}"
                )
            one_of(p, sorted(PRESETS), "serving: policies")
        object.__setattr__(self, "presets", presets)
        buckets = (self.length,) if self.buckets is None else self.buckets
        buckets = tuple(sorted(set(positive_ints(buckets, "ServingGrid.buckets"))))
        if buckets[-1] != self.length:
            raise ValueError(
                f"ServingGrid.buckets: expected the largest to be T = {self.length}, got {buckets}"
            )
        object.__setattr__(self, "buckets", buckets)
        for c in self.checks:
            if not isinstance(c, ServingCheck):
                raise TypeError(f"ServingGrid.checks: expected ServingCheck entries, got {c!r}")
        object.__setattr__(self, "checks", tuple(self.checks))

    def steps(self) -> tuple[int, ...]:
        return decode_steps(self.length, self.per_octave)

    def bucketed(self) -> list[tuple[int, tuple[int, ...]]]:
        """(padded key count, its steps) for every bucket holding a step."""
        out, low = [], 0
        for b in self.buckets or ():
            steps = tuple(s for s in self.steps() if low < s <= b)
            if steps:
                out.append((b, steps))
            low = b
        return out

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["steps"] = list(self.steps())
        out["features"] = {f: dataclasses.asdict(FEATURES[f]) for f in self.features}
        out["checks"] = [{**dataclasses.asdict(c), "options": dict(c.options)} for c in self.checks]
        return out


# The quick grid runs the presets in BF16 only: each (preset, format, feature) is a
# program to compile, the most of a quick run's time.
QUICK = ServingGrid(
    length=2048, per_octave=2, seeds=(0,), d=64, preset_formats=("bf16",), checks=QUICK_CHECKS
)
FULL = ServingGrid(
    length=32768, per_octave=4, seeds=(0, 1), d=128, buckets=(4096, 32768), checks=FULL_CHECKS
)


@dataclasses.dataclass(frozen=True)
class _Case:
    """One line of the figure: a real kernel with options, or a preset (``engine``
    "fa_jax"); ``kv`` its KV type (the input format where it has none)."""

    label: str
    engine: str
    fmt: str
    kv: str
    options: tuple[tuple[str, Any], ...] = ()
    preset: str | None = None
    max_keys: int | None = None

    def steps(self, grid: ServingGrid) -> tuple[int, ...]:
        return tuple(s for s in grid.steps() if self.max_keys is None or s <= self.max_keys)


def serving_cases(grid: ServingGrid) -> tuple[_Case, ...]:
    """The lines of the study: ggml per KV type, ONNX Runtime's GroupQueryAttention
    per format, OpenVINO per precision and KV cache, the presets per format."""
    cases = []
    if "ggml" in grid.engines:
        cases += [
            _Case(f"ggml {kv}", "ggml", "fp32", kv, (("kv_type", kv), ("threads", 1)))
            for kv in GGML_KV
        ]
    if "onnxruntime-gqa" in grid.engines:
        cases += [
            _Case(f"onnxruntime-gqa {f}", "onnxruntime-gqa", f, f, (("threads", 1),))
            for f in ORT_FORMATS
        ]
    if "openvino-sdpa" in grid.engines:
        cases += [
            _Case(
                f"openvino-sdpa {prec} cache {kv}",
                "openvino-sdpa",
                "fp32",
                kv,
                (("precision", prec), ("kv_cache", kv), ("threads", 1)),
                max_keys=OPENVINO_MAX_KEYS,
            )
            for prec in OPENVINO_PRECISIONS
            for kv in OPENVINO_KV
        ]
    cases += [
        _Case(f"{p} {f}", "fa_jax", f, f, preset=p)
        for p in grid.presets
        for f in grid.preset_formats
    ]
    return tuple(cases)


def _unavailable(engine: str) -> str | None:
    """Why ``engine`` cannot run here, or None."""
    if engine == "fa_jax":
        return None
    try:
        kernels.get(engine)
    except (RuntimeError, ImportError) as err:
        return str(err)
    return None


# -- inputs and golden ----------------------------------------------------------------


def _draw(grid: ServingGrid, feature: Feature, seed: int):
    """The decode's raw float64 draws: q (H, T, d), k and v (H_kv, T, d)."""
    q, k, v = make_inputs(seed, grid.length, heads=feature.heads, d=grid.d)
    if feature.kv_heads != feature.heads:  # as fa_jax.studies.validation.feature_inputs
        _, k, v = make_inputs(seed, grid.length, heads=feature.kv_heads, d=grid.d)
    return q[0], k[0], v[0]


def _rounded(draws, fmt: str, steps):
    """(q rows of ``steps`` (S, H, d) float64, k, v) rounded to ``fmt``: k and v held
    as float32 (exact: every format of the study fits), a head at a time, so that a
    32k cache costs half the memory; widened to float64 where a step reads them."""
    q, k, v = draws
    f = get_format(fmt)
    if f.exp_bits > 8 or f.man_bits > 23:
        raise ValueError(f"serving: expected formats within FP32, got {f.name}")
    rows = q[:, np.asarray(steps) - 1, :].transpose(1, 0, 2)
    with float64_enabled():
        rows = np.asarray(round_to(rows, f), np.float64)
        k, v = (np.stack([np.asarray(round_to(x, f), np.float32) for x in t]) for t in (k, v))
    return rows, k, v


def golden_steps(q_rows, k, v, steps, feature: Feature) -> np.ndarray:
    """FP64 attention of each step's query (``q_rows`` (S, H, d)) on the first t
    keys of ``k``, ``v`` (H_kv, T, d), with ``feature``'s softcap and ALiBi (bias
    -slope · |t - 1 - j|): float64 numpy, no rounding step (module docstring);
    (S, H, d_v)."""
    h, h_kv, d = q_rows.shape[1], k.shape[0], q_rows.shape[-1]
    slopes = feature.slopes()
    out = np.empty((len(steps), h, v.shape[-1]))
    for i, t in enumerate(steps):
        qg = q_rows[i].reshape(h_kv, h // h_kv, d)
        kt, vt = (np.asarray(x[:, :t], np.float64) for x in (k, v))
        s = np.einsum("grd,gmd->grm", qg, kt) * (1.0 / math.sqrt(d))
        if feature.softcap is not None:
            s = feature.softcap * np.tanh(s / feature.softcap)
        if slopes is not None:
            dist = np.abs(t - 1 - np.arange(t)).astype(np.float64)
            s = s + (-np.asarray(slopes).reshape(h_kv, h // h_kv, 1) * dist)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        o = np.einsum("grm,gmd->grd", p, vt) / p.sum(axis=-1, keepdims=True)
        out[i] = o.reshape(h, -1)
    return out


def _errors(out: np.ndarray, golden: np.ndarray) -> tuple[float, float]:
    """(max |out - golden|, mean over heads of ||o_h - g_h||_2 / ||g_h||_2) of one step,
    in float64 (:func:`fa_jax.metrics.max_abs_diff`'s value, without a JAX call per step)."""
    diff = np.asarray(out, np.float64) - np.asarray(golden, np.float64)
    rows = np.linalg.norm(diff, axis=-1) / np.linalg.norm(golden, axis=-1)
    return float(np.max(np.abs(diff))), float(np.mean(rows))


# -- presets ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("policy", "softcap", "slopes"))
def _preset_program(q_rows, lengths, k, v, *, policy, softcap, slopes):
    """Flash outputs (S, 1, H, 1, d_v) of queries ``q_rows`` (S, 1, H, 1, d), step s
    on the first ``lengths[s]`` keys of k, v (1, H_kv, B, d), one after another."""
    b = k.shape[-2]

    def one(x):
        q, t = x
        kw: dict = {}
        if slopes is not None:
            dist = jnp.abs(t - 1 - jnp.arange(b)).astype(jnp.float64)
            kw["bias"] = (-jnp.asarray(slopes, jnp.float64)[:, None, None] * dist)[None]
        out = flash_attention(
            q,
            k,
            v,
            policy,
            PRESET_BLOCKS,
            kv_lengths=jnp.reshape(t, (1, 1)),
            softcap=softcap,
            **kw,
        )
        return out[0]  # pyright: ignore[reportIndexIssue]

    return jax.lax.map(one, (q_rows, lengths))


def preset_steps(
    preset: str, fmt: str, q_rows, k, v, steps, feature: Feature, buckets=None
) -> np.ndarray:
    """The preset's flash outputs (S, H, d_v) at ``steps`` (module docstring): per
    bucket (``buckets``, default the largest step) one program over its steps, each
    on its cache padded to the bucket and cut by ``kv_lengths``; the same bits as
    ``flash_attention(q_t, k[:, :t], v[:, :t], causal=True, q_offset="bottom-right",
    bias=alibi_bias(slopes, 1, t, "bottom-right"), softcap=c)``."""
    policy = PRESETS[preset](get_format(fmt))
    steps = tuple(int(s) for s in steps)
    buckets = (max(steps),) if buckets is None else tuple(sorted(buckets))
    out, low = [], 0
    with float64_enabled():
        for b in buckets:
            idx = [i for i, s in enumerate(steps) if low < s <= b]
            low = b
            if not idx:
                continue
            rows = jnp.asarray(np.asarray(q_rows)[idx][:, None, :, None, :])
            lengths = jnp.asarray(np.array([steps[i] for i in idx], np.int32))
            kb = jnp.asarray(np.asarray(k)[None, :, :b], jnp.float64)
            vb = jnp.asarray(np.asarray(v)[None, :, :b], jnp.float64)
            got = _preset_program(
                rows,
                lengths,
                kb,
                vb,
                policy=policy,
                softcap=feature.softcap,
                slopes=feature.slopes(),
            )
            out.append(np.asarray(got, np.float64)[:, 0, :, 0, :])
    if low < max(steps):
        raise ValueError(f"preset_steps: buckets: expected one holding {max(steps)}, got {buckets}")
    return np.concatenate(out)


# -- engines ----------------------------------------------------------------------------


def _keywords(case: _Case, feature: Feature, t: int) -> dict:
    """The feature keywords of ``case``'s kernel at step ``t`` (ALiBi: ggml's
    ``max_bias``, else the bias, which a kernel without the ``bias`` feature refuses)."""
    kw: dict = dict(case.options)
    if feature.softcap is not None:
        kw["softcap"] = float(feature.softcap)
    if feature.alibi:
        if case.engine == "ggml":
            kw["max_bias"] = ALIBI_MAX_BIAS
        else:
            slopes = np.asarray(feature.slopes())
            kw["bias"] = (-slopes[:, None, None] * np.abs(t - 1 - np.arange(t)))[None]
    return kw


def _engine_steps(case: _Case, q_rows, k, v, steps, feature: Feature) -> np.ndarray:
    """The real kernel's outputs (S, H, d_v) at ``steps``: the first two through
    :func:`fa_jax.kernels.real` (ValueError where the kernel refuses the feature),
    the rest through the kernel's ``real`` with the same keywords (module docstring)."""
    kernel = kernels.get(case.engine)
    fmt = get_format(case.fmt)
    out = np.empty((len(steps), q_rows.shape[1], v.shape[-1]))
    for i, t in enumerate(steps):
        q = q_rows[i][None, :, None, :]
        kt, vt = (np.asarray(x[None, :, :t], np.float64) for x in (k, v))
        kw = _keywords(case, feature, t)
        if i < 2:
            got = kernels.real(
                case.engine, q, kt, vt, fmt=fmt, causal=True, q_offset="bottom-right", **kw
            )
        if i > 0:
            direct = kernel.real(
                q, kt, vt, fmt=fmt, causal=True, scale=None, **({"q_offset": t - 1} | kw)
            )
            direct = np.asarray(direct, np.float64)
            if i == 1 and not np.array_equal(direct, got, equal_nan=True):
                raise RuntimeError(
                    f"serving: {case.label} ({feature.name}): the kernel's own call differs "
                    f"from fa_jax.kernels.real at step {t}"
                )
            got = direct
        out[i] = got[0, :, 0, :]
    return out


# -- the study --------------------------------------------------------------------------


def _measure(grid: ServingGrid, cases, quiet: bool, write, path):
    """(rows, combos skipped by design {"case / feature": reason})."""
    units = [(c, f, s) for s in grid.seeds for f in grid.features for c in cases]
    expected = {(c.label, f, str(s)): [(t,) for t in c.steps(grid)] for c, f, s in units}
    raw, done = read_complete(
        path, RESULT_COLUMNS, ("case", "feature", "seed"), ("step",), expected.get
    )
    rows = [_typed(r) for r in raw]
    skipped: dict[str, str] = {}
    todo = [(s, f) for s in grid.seeds for f in grid.features]
    for seed, fname in track(todo, desc="serving", unit="feature", quiet=quiet):
        left = [c for c in cases if (c.label, fname, str(seed)) not in done]
        if not left:
            continue
        feature = FEATURES[fname]
        draws = _draw(grid, feature, seed)
        inputs = {f: _rounded(draws, f, grid.steps()) for f in dict.fromkeys(c.fmt for c in left)}
        del draws
        goldens = {
            f: golden_steps(q_f, k_f, v_f, grid.steps(), feature)
            for f, (q_f, k_f, v_f) in inputs.items()
        }
        for case in left:
            steps = case.steps(grid)
            q_rows, k, v = inputs[case.fmt]
            n = len(steps)
            try:
                if case.preset is not None:
                    out = preset_steps(
                        case.preset, case.fmt, q_rows[:n], k, v, steps, feature, grid.buckets
                    )
                else:
                    out = _engine_steps(case, q_rows[:n], k, v, steps, feature)
            except ValueError as err:
                skipped[f"{case.label} / {fname}"] = str(err)
                continue
            for i, t in enumerate(steps):
                err = _errors(out[i], goldens[case.fmt][i])
                values = (case.label, case.engine, case.kv, case.fmt, fname, t, seed, *err)
                rows.append(dict(zip(RESULT_COLUMNS, values)))
            write(rows)
            check_interrupt()
    return rows, skipped


def _typed(r: dict) -> dict:
    out: dict = dict(r)
    for c in ("step", "seed"):
        out[c] = int(r[c])
    for c in ("max_abs", "mean_rel"):
        out[c] = float(r[c])
    return out


def _measure_identity(grid: ServingGrid, quiet: bool) -> list[dict]:
    rows = []
    for c in track(grid.checks, desc="identity", unit="point", quiet=quiet):
        if c.kernel not in grid.engines:
            continue
        reason = _unavailable(c.kernel)
        if reason is not None:
            if not quiet:
                print(f"serving: identity {c.kernel} {c.label()}: skipped, {reason}")
            continue
        feature = FEATURES[c.feature]
        t = min(c.step, grid.length)
        q_rows, k, v = _rounded(_draw(grid, feature, grid.seeds[0]), c.fmt, (t,))
        case = _Case(c.kernel, c.kernel, c.fmt, "", c.options)
        kw = _keywords(case, feature, t)
        q = q_rows[0][None, :, None, :]
        kt, vt = (np.asarray(x[None, :, :t], np.float64) for x in (k, v))
        call: dict[str, Any] = dict(fmt=c.fmt, causal=True, q_offset="bottom-right", **kw)
        real = kernels.real(c.kernel, q, kt, vt, **call)
        note, numbers = "", (real.size, -1, math.nan, -1)
        try:
            emulated = kernels.emulate(c.kernel, q, kt, vt, **call)
        except NotImplementedError as err:
            note = f"model refuses this CPU: {err}"
        else:
            golden = golden_steps(q_rows, k, v, (t,), feature)[:, None, :, None, :]
            cmp = kernels.compare(real, emulated, golden[0], c.fmt)
            numbers = (cmp.elements, cmp.identical, cmp.identical_share, cmp.max_ulp)
        values = (c.kernel, c.label(), c.fmt, c.feature, t, *numbers, note)
        rows.append(dict(zip(IDENTITY_COLUMNS, values)))
        check_interrupt()
    return rows


def _summary(rows) -> list[dict]:
    """Rows averaged over seeds per (case, feature, step), by feature, case, step."""
    keys = ("case", "engine", "kv", "fmt", "feature", "step")
    out = mean_over_seeds(rows, keys, ("max_abs", "mean_rel"))
    return sorted(out, key=lambda r: (r["feature"], r["case"], r["step"]))


def _figure(grid: ServingGrid, summary, out: pathlib.Path) -> pathlib.Path:
    """A panel per feature, a line per case; an error of 0 (one FP32 key: o = v) is
    not drawn on the log scale."""
    plt = pyplot("fa_jax.studies.serving: plotting")
    feats = list(grid.features)
    ncols = min(2, len(feats))
    nrows = -(-len(feats) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols + 3.5, 4.6 * nrows), squeeze=False)
    labels = list(dict.fromkeys(r["case"] for r in summary))
    styles = {"ggml": "o-", "onnxruntime-gqa": "s-", "openvino-sdpa": "^-", "fa_jax": "x--"}
    handles = {}
    for ax, fname in zip(axes.flat, feats):
        f = FEATURES[fname]
        for i, label in enumerate(labels):
            pr = [r for r in summary if (r["case"], r["feature"]) == (label, fname)]
            pr = [r for r in pr if r["mean_rel"] > 0]
            if not pr:
                continue
            (line,) = ax.plot(
                [r["step"] for r in pr],
                [r["mean_rel"] for r in pr],
                styles.get(pr[0]["engine"], "o-"),
                color=plt.get_cmap("tab20")(i % 20),
                label=label,
                ms=3,
                lw=1,
            )
            handles.setdefault(label, line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{fname} (H={f.heads}, H_kv={f.kv_heads})", fontsize=10)
        ax.set_xlabel("decode step t (keys in the cache)")
        ax.set_ylabel("mean over heads of ||o - g|| / ||g||")
        ax.grid(True, which="major", lw=0.3)
    for ax in list(axes.flat)[len(feats) :]:
        ax.axis("off")
    if handles:
        fig.legend(
            [handles[k] for k in labels if k in handles],
            [k for k in labels if k in handles],
            loc="center right",
            fontsize=7,
        )
    fig.suptitle(
        f"Serving: one decode of {grid.length} steps vs FP64 (d={grid.d}, causal "
        f"bottom-right, one thread, mean over {len(grid.seeds)} seeds)"
    )
    fig.tight_layout(rect=(0, 0, 1 - 3.2 / (6.5 * ncols + 3.5), 1))
    png = out / "serving.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _table_steps(grid: ServingGrid) -> list[int]:
    """The steps the printed table shows: 1, the one nearest 1024, T."""
    steps = grid.steps()
    near = min(steps, key=lambda s: abs(math.log2(s) - 10))
    return sorted({steps[0], near, steps[-1]})


def serving(
    out_dir,
    *,
    quick: bool,
    policies=DEFAULT_POLICIES,
    grid: ServingGrid | None = None,
    quiet: bool = False,
) -> dict:
    """``fa-jax reproduce serving``: :data:`QUICK` or :data:`FULL` (or ``grid``) into
    ``out_dir/serving/`` (module docstring); returns {"figure", "csv", "identity_csv",
    "png", "grid", "rows", "identity_rows", "skipped", "combos_skipped", "wall_s"}."""
    if grid is None:
        grid = dataclasses.replace(QUICK if quick else FULL, presets=tuple(policies))
    if not isinstance(grid, ServingGrid):
        raise TypeError(f"serving: grid: expected a ServingGrid, got {grid!r}")
    out = check_out_dir(
        pathlib.Path(out_dir) / "serving",
        {"results.csv": RESULT_COLUMNS, "identity.csv": IDENTITY_COLUMNS},
    )
    out.mkdir(parents=True, exist_ok=True)
    csv_path, identity_path = out / "results.csv", out / "identity.csv"
    t0 = time.monotonic()
    skipped = {}
    for engine in dict.fromkeys(c.engine for c in serving_cases(grid)):
        reason = _unavailable(engine)
        if reason is not None:
            skipped[engine] = reason
            print(f"serving: {engine} rows skipped: {reason}")
    cases = tuple(c for c in serving_cases(grid) if c.engine not in skipped)
    meta = run_metadata(grid.to_json(), skipped=skipped)
    with float64_enabled(), compilation_cache(current_options().cache):
        rows, combos = _measure(
            grid, cases, quiet, lambda rs: write_csv(csv_path, RESULT_COLUMNS, rs), csv_path
        )
        identity = _measure_identity(grid, quiet)
        write_csv(identity_path, IDENTITY_COLUMNS, identity)
    if not quiet:
        for what, reason in combos.items():
            print(f"serving: {what}: left out, {reason}")
    meta["combos_skipped"] = combos
    meta["platform"] = {
        e: dict(kernels.get(e).platform())
        for e in dict.fromkeys(c.engine for c in cases)
        if e != "fa_jax"
    }
    meta["wall_s"] = time.monotonic() - t0
    write_json(out / "metadata.json", meta)
    summary = _summary(rows)
    if not quiet:
        shown = _table_steps(grid)
        print_table(
            ("feature", "case", "step", "max_abs", "mean_rel"),
            [r for r in summary if r["step"] in shown],
            title=f"Serving: a decode of {grid.length} steps vs FP64 (d={grid.d}, mean over "
            f"{len(grid.seeds)} seeds); wall {meta['wall_s']:.0f} s",
        )
        if identity:
            print_table(
                (
                    "kernel",
                    "options",
                    "fmt",
                    "feature",
                    "step",
                    "identical_share",
                    "max_ulp",
                    "note",
                ),
                identity,
                title=f"Identity: fa_jax's model vs the real kernel (seed {grid.seeds[0]})",
            )
    png = _figure(grid, summary, out)
    return {
        "figure": "serving",
        "csv": str(csv_path),
        "identity_csv": str(identity_path),
        "png": str(png),
        "grid": grid.to_json(),
        "rows": summary,
        "identity_rows": identity,
        "skipped": skipped,
        "combos_skipped": combos,
        "wall_s": meta["wall_s"],
    }
