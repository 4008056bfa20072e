"""The configurations of a sweep: :class:`Grid`, its tile specs and its CSV schema.

A configuration is (policy preset, format, sequence length, blocks, variant,
seed, attention features) plus the shared shape (batch, heads, d), input
distribution (:mod:`fa_jax.inputs`) and causal flag; the features (GQA, window,
softcap, ALiBi, split-KV, decoding shapes) are :class:`~.features.Features`.
A ``"kernel:NAME"`` policies entry is a real kernel's computation: its flash
column is :func:`fa_jax.kernels.emulate` of the kernel (its model's own order of
steps, tiles and loop), and its baseline is reference attention under the
policy of that model (:func:`policy_for`), both on Q, K, V rounded to the
format, as the golden sees them; it needs formats the kernel runs
natively and the paper's attention (no features), and its rows repeat under
every blocks and variants entry, which the kernel does not follow.
Every configuration is compared three ways, ``flash_vs_golden``,
``baseline_vs_golden`` and ``flash_vs_baseline``, with the metrics
``max_abs_diff``, ``mean_abs_diff``, ``std_abs_diff`` and ``rmse`` of
:mod:`fa_jax.metrics`: one tidy CSV row per (configuration, comparison,
metric), :data:`KEY_COLUMNS` then ``comparison, metric, value``.
"""

from __future__ import annotations

import dataclasses

from fa_jax import kernels
from fa_jax._checks import non_negative_ints, one_of, positive_int, positive_ints
from fa_jax.attention import VARIANTS, Blocks, blocks_from_sram
from fa_jax.formats import Format, custom, get_format
from fa_jax.inputs import DISTRIBUTIONS
from fa_jax.policy import Policy
from fa_jax.presets import PRESETS
from fa_jax.studies.sweep.features import PAPER, Features

__all__ = [
    "COLUMNS",
    "COMPARISONS",
    "KERNEL_PREFIX",
    "KEY_COLUMNS",
    "METRICS",
    "Grid",
    "SramBlocks",
    "kernel_name",
    "policy_for",
    "row_key",
]

# A grid's policies entry "kernel:NAME" runs a real kernel's model (module docstring).
KERNEL_PREFIX = "kernel:"
COMPARISONS = ("flash_vs_golden", "baseline_vs_golden", "flash_vs_baseline")
METRICS = ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "rmse")
KEY_COLUMNS = (
    "policy",
    "format",
    "exp_bits",
    "man_bits",
    "seq_len",
    "blocks",
    "br",
    "bc",
    "variant",
    "seed",
    "distribution",
    "batch",
    "heads",
    "d",
    "causal",
    "features",
)
COLUMNS = (*KEY_COLUMNS, "comparison", "metric", "value")


@dataclasses.dataclass(frozen=True)
class SramBlocks:
    """Tile sizes from an SRAM size in elements: :func:`blocks_from_sram` at the grid's d."""

    sram_elems: int
    swap: bool = False
    square: bool = False

    def __post_init__(self):
        positive_int(self.sram_elems, "SramBlocks.sram_elems")
        if self.swap and self.square:
            raise ValueError("SramBlocks: expected swap or square, not both")

    def resolve(self, d: int) -> Blocks:
        return blocks_from_sram(self.sram_elems, d, swap=self.swap, square=self.square)

    def label(self) -> str:
        return (
            f"sram{self.sram_elems}"
            + ("_swap" if self.swap else "")
            + ("_square" if self.square else "")
        )


BlockSpec = Blocks | SramBlocks


def _block_label(b: BlockSpec) -> str:
    return b.label() if isinstance(b, SramBlocks) else f"{b.br}x{b.bc}"


def _resolve_format(spec) -> Format:
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ValueError(f"Grid.formats: expected (exp_bits, man_bits), got {spec!r}")
        return custom(*spec)
    return get_format(spec)


@dataclasses.dataclass(frozen=True)
class Grid:
    """The configurations of a sweep: the product of every tuple field.

    ``formats``: names ("bf16", "e5m4", ...), :class:`Format` objects or
    ``(exp_bits, man_bits)`` tuples.  ``blocks``: :class:`Blocks` or
    :class:`SramBlocks`.  ``policies``: preset names of
    :data:`fa_jax.presets.PRESETS`, or ``"kernel:NAME"`` for fa_jax's model of a
    real kernel (module docstring): formats the kernel runs natively and the
    paper's attention only.  ``distribution``: one of
    :data:`DISTRIBUTIONS` (module docstring).  ``features``: :class:`Features`
    entries, the paper's attention by default.
    """

    formats: tuple
    seq_lens: tuple
    blocks: tuple
    variants: tuple = ("fa2",)
    policies: tuple = ("paper_uniform",)
    seeds: tuple = (0,)
    batch: int = 1
    heads: int = 1
    d: int = 64
    distribution: str = "normal"
    causal: bool = False
    features: tuple = (Features(),)

    def __post_init__(self):
        axes = ("formats", "seq_lens", "blocks", "variants", "policies", "seeds", "features")
        for name in axes:
            v = getattr(self, name)
            if isinstance(v, (str, bytes, Blocks, SramBlocks)) or not hasattr(v, "__iter__"):
                raise TypeError(f"Grid.{name}: expected a tuple, got {v!r}")
            v = tuple(v)
            if not v:
                raise ValueError(f"Grid.{name}: expected a non-empty tuple, got ()")
            object.__setattr__(self, name, v)
        for name in ("batch", "heads", "d"):
            positive_int(getattr(self, name), f"Grid.{name}")
        object.__setattr__(self, "seq_lens", positive_ints(self.seq_lens, "Grid.seq_lens"))
        object.__setattr__(self, "seeds", non_negative_ints(self.seeds, "Grid.seeds"))
        fmts = tuple(_resolve_format(f) for f in self.formats)
        names = [f.name for f in fmts]
        if len(set(names)) != len(names):
            raise ValueError(f"Grid.formats: expected distinct format names, got {names}")
        for p in self.policies:
            _check_policy(p, fmts, self.features)
        for v in self.variants:
            one_of(v, VARIANTS, "Grid.variants")
        one_of(self.distribution, DISTRIBUTIONS, "Grid.distribution")
        if not isinstance(self.causal, bool):
            raise TypeError(f"Grid.causal: expected a bool, got {self.causal!r}")
        n_max = max(self.seq_lens)
        labels = []
        for b in self.blocks:
            if not isinstance(b, (Blocks, SramBlocks)):
                raise TypeError(f"Grid.blocks: expected Blocks or SramBlocks, got {b!r}")
            r = b.resolve(self.d) if isinstance(b, SramBlocks) else b
            if max(r.br, r.bc) > n_max:
                raise ValueError(
                    f"Grid.blocks: {b!r} gives br={r.br}, bc={r.bc}; expected both <= the "
                    f"largest seq_len {n_max}"
                )
            labels.append(_block_label(b))
        bcs = [b.bc for _, b in self.resolved_blocks()]
        for feat in self.features:
            if not isinstance(feat, Features):
                raise TypeError(f"Grid.features: expected Features entries, got {feat!r}")
            feat.check(self.heads, self.causal, self.seq_lens, bcs)
        for name, vals in (
            ("seq_lens", self.seq_lens),
            ("seeds", self.seeds),
            ("blocks", labels),
            ("variants", self.variants),
            ("policies", self.policies),
            ("features", [f.label() for f in self.features]),
        ):
            if len(set(vals)) != len(vals):
                raise ValueError(f"Grid.{name}: expected distinct entries, got {vals!r}")

    # -- resolved views ------------------------------------------------------

    def resolved_formats(self) -> tuple[Format, ...]:
        return tuple(_resolve_format(f) for f in self.formats)

    def resolved_blocks(self) -> tuple[tuple[str, Blocks], ...]:
        """(label, Blocks) per blocks entry, in grid order."""
        return tuple(
            (_block_label(b), b.resolve(self.d) if isinstance(b, SramBlocks) else b)
            for b in self.blocks
        )

    def to_json(self) -> dict:
        def fmt(f: Format):
            return {
                "name": f.name,
                "exp_bits": f.exp_bits,
                "man_bits": f.man_bits,
                "bias": f.bias,
                "subnormals": f.subnormals,
                "specials": f.specials,
                "overflow": f.overflow,
            }

        def blk(b):
            if isinstance(b, SramBlocks):
                r = b.resolve(self.d)
                return {
                    "sram_elems": b.sram_elems,
                    "swap": b.swap,
                    "square": b.square,
                    "br": r.br,
                    "bc": r.bc,
                }
            return {"br": b.br, "bc": b.bc}

        return {
            "formats": [fmt(f) for f in self.resolved_formats()],
            "seq_lens": list(self.seq_lens),
            "blocks": [blk(b) for b in self.blocks],
            "variants": list(self.variants),
            "policies": list(self.policies),
            "seeds": list(self.seeds),
            "batch": self.batch,
            "heads": self.heads,
            "d": self.d,
            "distribution": self.distribution,
            "causal": self.causal,
            "features": [f.label() for f in self.features],
        }


def kernel_name(policy: str) -> str | None:
    """NAME of a ``"kernel:NAME"`` policies entry; None for a preset."""
    if isinstance(policy, str) and policy.startswith(KERNEL_PREFIX):
        return policy[len(KERNEL_PREFIX) :]
    return None


def _check_policy(name, fmts, features) -> None:
    kernel = kernel_name(name)
    if kernel is not None:
        one_of(kernel, kernels.names(), "Grid.policies: kernel")
        try:
            real = kernels.get(kernel)
        except RuntimeError as err:
            raise ValueError(f"Grid.policies: {err}") from None
        native = {get_format(f).name for f in real.formats}
        other = [f.name for f in fmts if f.name not in native]
        if other:
            raise ValueError(
                f"Grid.policies: {name} runs the kernel's model, which takes the formats "
                f"the kernel runs natively, {list(real.formats)}; got formats {other}"
            )
        other = [f.label() for f in features if isinstance(f, Features) and f != PAPER]
        if other:
            raise ValueError(
                f"Grid.policies: {name} runs the kernel's model on the paper's attention; "
                f"expected features {PAPER.label()!r} only, got {other}"
            )
        return
    if name not in PRESETS:
        raise ValueError(
            f"Grid.policies: expected a preset among {sorted(PRESETS)} or "
            f"'{KERNEL_PREFIX}NAME' with NAME among {kernels.names()}, got {name!r}"
        )


def policy_for(name: str, fmt: Format, n: int, d: int) -> Policy:
    """The policy of a grid's ``policies`` entry in format ``fmt``: a preset of
    :data:`~fa_jax.presets.PRESETS`, or ``"kernel:NAME"``, the policy of fa_jax's
    model of that real kernel for (n, d) (:func:`fa_jax.kernels.model`: ``fmt``
    one the kernel runs natively), under which a kernel row's baseline runs."""
    kernel = kernel_name(name)
    if kernel is not None:
        return kernels.model(kernel, fmt, n, d).policy
    return PRESETS[name](fmt)


def row_key(grid, preset, f, n, label, blocks, variant, seed, features=PAPER):
    vals = {
        "policy": preset,
        "format": f.name,
        "exp_bits": f.exp_bits,
        "man_bits": f.man_bits,
        "seq_len": n,
        "blocks": label,
        "br": blocks.br,
        "bc": blocks.bc,
        "variant": variant,
        "seed": seed,
        "distribution": grid.distribution,
        "batch": grid.batch,
        "heads": grid.heads,
        "d": grid.d,
        "causal": grid.causal,
        "features": features.label(),
    }
    return {c: str(vals[c]) for c in KEY_COLUMNS}
