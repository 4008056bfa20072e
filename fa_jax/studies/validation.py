"""A real kernel against fa_jax's model of it and against the generic presets.

``validate`` draws inputs (:func:`fa_jax.inputs.make_inputs`, rounded to the
format), runs the real kernel (:func:`fa_jax.kernels.real`), fa_jax's model of it
(:func:`fa_jax.kernels.emulate`) and, for comparison, every generic preset
(:data:`fa_jax.presets.PRESETS`) in the materialised reference algorithm and in
FlashAttention-2's tiled recurrence (Dao 2023, Algorithm 1).  Each emulation is
judged by :func:`fa_jax.kernels.compare` over all seeds at once: the share of
output elements bit-identical to the real kernel, the histogram of ulp
distances in the format, and the error of each against the FP64 golden output
(Golden et al. 2024, arXiv 2405.02803, §3).  The platform facts a kernel's
numerics may depend on (library versions, CPU capability) go with the result.

:class:`Features` asks for the kernel's features (:data:`fa_jax.kernels.model.FEATURES`):
K/V with fewer heads, decoding shapes (fewer queries than keys, ``Shape.n``
being the keys), a bias (ALiBi's, or normal values · 2, rounded to the format),
a boolean mask keeping about 80% of the pairs, a window, key lengths; the
golden output and the presets take the same features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from fa_jax import kernels
from fa_jax._checks import non_negative_ints, one_of, positive_int
from fa_jax._x64 import float64_enabled
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.formats import Format, get_format
from fa_jax.inputs import make_inputs
from fa_jax.kernels.compare import Comparison
from fa_jax.presets import PRESETS, golden
from fa_jax.rounding import round_to
from fa_jax.score_mods import alibi_bias, alibi_slopes

__all__ = [
    "Features",
    "Shape",
    "Validation",
    "format_validation",
    "validate",
    "validation_inputs",
]

_BIASES = ("alibi", "random")
_MASKS = ("random",)

# The tile of the generic presets' flash rows (Dao 2023's Bc = 128 for d = 64).
_PRESET_BLOCKS = Blocks(128, 128)


@dataclasses.dataclass(frozen=True)
class Shape:
    """(B, H, N, d) of the inputs of one validation."""

    batch: int = 1
    heads: int = 2
    n: int = 512
    d: int = 64

    def __post_init__(self):
        for name in ("batch", "heads", "n", "d"):
            positive_int(getattr(self, name), f"Shape.{name}")

    def __str__(self) -> str:
        return f"(B, H, N, d) = ({self.batch}, {self.heads}, {self.n}, {self.d})"


@dataclasses.dataclass(frozen=True)
class Features:
    """The features of one validation (module docstring): ``kv_heads`` K/V heads
    (dividing H; None: H), ``q_len`` queries (None: N, the keys), ``bias`` ("alibi"
    or "random"), ``mask`` ("random"), ``window`` (left, right), ``kv_len`` keys kept
    per sequence (key lengths); None for each leaves it out."""

    kv_heads: int | None = None
    q_len: int | None = None
    bias: str | None = None
    mask: str | None = None
    window: tuple[int, int] | None = None
    kv_len: int | None = None

    def __post_init__(self):
        for name in ("kv_heads", "q_len", "kv_len"):
            if getattr(self, name) is not None:
                positive_int(getattr(self, name), f"Features.{name}")
        if self.bias is not None:
            one_of(self.bias, _BIASES, "Features.bias")
        if self.mask is not None:
            one_of(self.mask, _MASKS, "Features.mask")
        if self.window is not None:
            from fa_jax.masking import check_window

            object.__setattr__(self, "window", check_window(tuple(self.window), "Features"))

    def __str__(self) -> str:
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return ", ".join(f"{k}={v}" for k, v in given.items()) or "none"

    def check(self, shape: Shape) -> None:
        """ValueError unless they fit ``shape``."""
        if self.kv_heads is not None and shape.heads % self.kv_heads:
            raise ValueError(
                f"validate: kv_heads: expected a divisor of H = {shape.heads}, got {self.kv_heads}"
            )
        if self.kv_len is not None and self.kv_len > shape.n:
            raise ValueError(
                f"validate: kv_len: expected at most N = {shape.n} keys, got {self.kv_len}"
            )


@dataclasses.dataclass(frozen=True)
class Validation:
    """The result of :func:`validate`: one Comparison per emulation, the kernel's
    model first; ``platform`` is the kernel's :meth:`~fa_jax.kernels.Kernel.platform`."""

    kernel: str
    fmt: str
    shape: Shape
    causal: bool
    seeds: tuple[int, ...]
    platform: dict[str, str]
    rows: tuple[tuple[str, Comparison], ...]
    features: Features = Features()

    def to_dict(self) -> dict:
        """Plain data for JSON."""
        return {
            "kernel": self.kernel,
            "format": self.fmt,
            "shape": dataclasses.asdict(self.shape),
            "causal": self.causal,
            "features": {k: v for k, v in dataclasses.asdict(self.features).items() if v},
            "seeds": list(self.seeds),
            "platform": dict(self.platform),
            "rows": [{"emulation": label, **dataclasses.asdict(c)} for label, c in self.rows],
        }


def validation_inputs(fmt: Format, shape: Shape, seed: int):
    """(q, k, v) of ``seed``, standard normal, rounded to ``fmt`` (float64 numpy)."""
    q, k, v = make_inputs(seed, shape.n, batch=shape.batch, heads=shape.heads, d=shape.d)
    with float64_enabled():
        return tuple(np.asarray(round_to(t, fmt), np.float64) for t in (q, k, v))


def feature_inputs(fmt: Format, shape: Shape, features: Features, seed: int):
    """(q, k, v, extra) of ``seed`` with ``features``: q (B, H, N_q, d), k and v
    (B, H_kv, N, d), standard normal rounded to ``fmt``; ``extra`` the keyword
    arguments of the features (module docstring)."""
    n_q = shape.n if features.q_len is None else features.q_len
    kv = shape.heads if features.kv_heads is None else features.kv_heads
    b, h, n, d = shape.batch, shape.heads, shape.n, shape.d
    q = make_inputs(seed, n_q, batch=b, heads=h, d=d)[0]
    _, k, v = make_inputs(seed, n, batch=b, heads=kv, d=d)
    rng = np.random.default_rng([seed, n_q, n, 26])
    extra: dict = {}
    with float64_enabled():
        q, k, v = (np.asarray(round_to(t, fmt), np.float64) for t in (q, k, v))
        if features.bias == "alibi":
            extra["bias"] = np.asarray(round_to(alibi_bias(alibi_slopes(h), n_q, n), fmt))
        elif features.bias == "random":
            extra["bias"] = np.asarray(round_to(2 * rng.standard_normal((b, h, n_q, n)), fmt))
    if features.mask == "random":
        extra["mask"] = rng.random((b, 1, n_q, n)) < 0.8
    if features.window is not None:
        extra["window"] = features.window
    if features.kv_len is not None:
        extra["kv_lengths"] = np.full((b, 1), features.kv_len)
    return q, k, v, extra


def golden_output(q, k, v, causal: bool, **extra) -> np.ndarray:
    with float64_enabled():
        return np.asarray(
            reference_attention(q, k, v, golden(), causal=causal, **extra), np.float64
        )


def preset_attention(name: str, algorithm: str, fmt: Format):
    policy = PRESETS[name](fmt)

    def run(q, k, v, causal: bool, **extra) -> np.ndarray:
        with float64_enabled():
            if algorithm == "reference":
                out = reference_attention(q, k, v, policy, causal=causal, **extra)
            else:
                out = flash_attention(q, k, v, policy, _PRESET_BLOCKS, causal=causal, **extra)[0]  # pyright: ignore[reportIndexIssue]
            return np.asarray(out, np.float64)

    return run


def validate(
    kernel: str,
    fmt,
    *,
    shape: Shape = Shape(),
    causal: bool = False,
    seeds: Sequence[int] = (0,),
    presets: Sequence[str] = tuple(PRESETS),
    features: Features = Features(),
) -> Validation:
    """Real ``kernel`` vs its model and the generic ``presets`` (names of
    :data:`~fa_jax.presets.PRESETS`; empty for none), in format ``fmt``, over
    ``seeds``, with ``features`` (module docstring)."""
    f = get_format(fmt)
    if not isinstance(features, Features):
        raise TypeError(f"validate: features: expected a Features, got {features!r}")
    features.check(shape)
    seeds = tuple(non_negative_ints(seeds, "validate: seeds"))
    if not seeds:
        raise ValueError("validate: seeds: expected at least one seed, got none")
    entry = kernels.get(kernel)
    emulations: dict[str, Callable[..., np.ndarray] | None] = {f"{kernel} model": None}
    for name in presets:
        one_of(name, sorted(PRESETS), "validate: presets")
        for algorithm in ("reference", "flash"):
            emulations[f"{name} {algorithm}"] = preset_attention(name, algorithm, f)
    real, golden_out = [], []
    outputs: dict[str, list[np.ndarray]] = {label: [] for label in emulations}
    for seed in seeds:
        if features == Features():
            q, k, v = validation_inputs(f, shape, seed)
            extra = {}
        else:
            q, k, v, extra = feature_inputs(f, shape, features, seed)
        real.append(kernels.real(kernel, q, k, v, fmt=f, causal=causal, **extra))
        golden_out.append(golden_output(q, k, v, causal, **extra))
        for label, run in emulations.items():
            if run is None:
                emulated = kernels.emulate(kernel, q, k, v, fmt=f, causal=causal, **extra)
                outputs[label].append(emulated)
            else:
                outputs[label].append(run(q, k, v, causal, **extra))
    r, g = np.stack(real), np.stack(golden_out)
    rows = tuple(
        (label, kernels.compare(r, np.stack(outs), g, f)) for label, outs in outputs.items()
    )
    platform = dict(entry.platform())
    return Validation(kernel, f.name, shape, causal, seeds, platform, rows, features)


def format_validation(v: Validation) -> str:
    """A plain-text report: the platform, then one row per emulation."""
    facts = ", ".join(f"{k} {val}" for k, val in v.platform.items())
    real = v.rows[0][1]
    given = "" if v.features == Features() else f", features: {v.features}"
    lines = [
        f"kernel {v.kernel}, {v.fmt}, {v.shape}, causal={v.causal}, seeds {list(v.seeds)}{given}",
        f"platform: {facts}",
        f"real kernel vs FP64: max abs {real.real_max_abs:.3e}, "
        f"relative Frobenius {real.real_rel_frobenius:.3e}",
        "",
    ]
    bins = list(real.ulp_histogram)
    header = f"{'emulation':<26} {'identical':>10} {'max ulp':>8} " + " ".join(
        f"{'ulp ' + b:>9}" for b in bins
    )
    lines += [header + f" {'max abs vs FP64':>16}", "-" * (len(header) + 17)]
    tag = "" if v.features == Features() else f" [{v.features}]"
    for label, c in v.rows:
        label = label + (tag if label.endswith(" model") else "")
        counts = " ".join(f"{c.ulp_histogram.get(b, 0):>9}" for b in bins)
        lines.append(
            f"{label:<26} {100 * c.identical_share:>9.4f}% {c.max_ulp:>8} {counts} "
            f"{c.emulated_max_abs:>16.3e}"
        )
    return "\n".join(lines)
