"""Per-stage error attribution: which stage's rounding makes attention deviate.

For a precision :class:`~fa_jax.policy.Policy` and one configuration (N, d,
tiles, loop order, seeds), the deviation of the output O from the golden output
(:func:`~fa_jax.presets.golden`, FP64 everywhere) is measured for

* ``full``: the policy itself;
* ``raised``: the policy with one stage raised to FP64,
  ``policy.replace(stage=FP64)``;
* ``lowered``: golden with one stage lowered to the policy's format for it,
  ``golden().replace(stage=policy.stage)`` (with the policy's accumulation
  model and scale placement, which only matter through the lowered stage);

for flash attention and for the reference (baseline) attention.  Each kind
is measured against its own algorithm under golden (flash against FP64 flash,
reference against FP64 reference), so every deviation is rounding alone: the
FP64 flash/reference difference (order of operations) is not counted, and the
``full`` deviations differ from the sweep's
``flash_vs_golden`` / ``baseline_vs_golden`` (whose golden is always the
reference) by at most that difference.  A stage's *share* of the full
deviation D::

    raised:   share_s = (D - D_raised_s) / D     (deviation removed by keeping s exact)
    lowered:  share_s = D_lowered_s / D          (deviation s causes on its own)

with 0/0 read as 0.  The two views agree when stages act independently; they
differ, and the shares do not sum to 1, where roundings interact (an error made
in one stage amplified or cancelled by another).  The tables print the sums.
A stage whose format already is FP64 changes nothing: its raised deviation is
D and its lowered deviation that of golden with the policy's accumulation and
scale (0 for the presets), and neither is computed again.

Deviation metrics, per seed and then averaged over seeds (as
:mod:`fa_jax.studies.figures` averages the sweep): ``max_abs_diff`` (primary) and
``mean_abs_diff`` of :mod:`fa_jax.metrics`.  The max is primary because it is
the statistic of the paper's figures (Golden et al. 2024, Figs 3-6: "max
diff"), whose "order of magnitude" at BF16 this attribution explains; the mean
is less noisy and is in the CSV.

Inputs: :func:`fa_jax.inputs.make_inputs` (same seeds and distributions as the
sweep).  With ``inputs="rounded"`` (the default, the sweep's convention) Q, K
and V are rounded to the policy's input format *once, for every run including
golden*: the deviation is then the computation's alone, and the ``inputs``
stage only measures what else it rounds (Q pre-scaled under ``scale="q"``;
nothing under the presets, so its share is 0).  With ``inputs="exact"`` every run, golden
included, starts from the float64 draws and the ``inputs`` stage carries the
cost of storing Q, K, V in the format.

Execution: every run of one attention kind whose policy has the same pytree
structure (formats of one kind: :class:`~fa_jax.formats.Format` widths are the
pytree leaves) goes through one jitted program, ``jax.lax.map`` over the
stacked policies, so an attribution compiles a handful of programs instead of
one per variant; the results equal direct calls bitwise
(``tests/test_attribution.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import metrics
from fa_jax._checks import non_negative_ints, one_of, positive_int
from fa_jax._x64 import float64_enabled
from fa_jax.attention import VARIANTS, Blocks, flash_attention, reference_attention
from fa_jax.exponential import EXP2
from fa_jax.formats import FP64, Format
from fa_jax.inputs import DISTRIBUTIONS, make_inputs
from fa_jax.policy import FORWARD_STAGES, STAGES, Policy
from fa_jax.presets import golden
from fa_jax.rounding import round_to
from fa_jax.studies.results import pyplot
from fa_jax.studies.results import write_csv as _write_rows
from fa_jax.studies.table import format_table

__all__ = [
    "ATTRIBUTION_METRICS",
    "CSV_COLUMNS",
    "DIRECTIONS",
    "FORWARD_STAGES",
    "KINDS",
    "Attribution",
    "AttributionConfig",
    "attribute",
    "plot_attribution",
    "variants",
    "write_csv",
]

KINDS = ("flash", "reference")
DIRECTIONS = ("full", "raised", "lowered")
ATTRIBUTION_METRICS = ("max_abs_diff", "mean_abs_diff")
INPUT_MODES = ("rounded", "exact")
CSV_COLUMNS = (
    "policy",
    "seq_len",
    "d",
    "br",
    "bc",
    "variant",
    "seeds",
    "distribution",
    "inputs",
    "kind",
    "direction",
    "stage",
    "stage_format",
    "metric",
    "deviation",
    "share",
)


@dataclasses.dataclass(frozen=True)
class AttributionConfig:
    """One attribution: the policy and the attention configuration it runs.

    ``seeds`` and ``distribution`` pick the inputs of
    :func:`fa_jax.inputs.make_inputs` (batch = heads = 1); ``kinds`` the
    attention paths (``"flash"``, ``"reference"``); ``inputs`` how Q, K, V meet
    the input format (module docstring).
    """

    policy: Policy
    seq_len: int = 1024
    d: int = 64
    blocks: Blocks = dataclasses.field(default_factory=lambda: Blocks(32, 32))
    variant: str = "fa2"
    seeds: tuple = (0, 1)
    distribution: str = "normal"
    kinds: tuple = KINDS
    inputs: str = "rounded"

    def __post_init__(self):
        if not isinstance(self.policy, Policy):
            raise TypeError(f"AttributionConfig.policy: expected a Policy, got {self.policy!r}")
        for name in ("seq_len", "d"):
            positive_int(getattr(self, name), f"AttributionConfig.{name}")
        if not isinstance(self.blocks, Blocks):
            raise TypeError(
                f"AttributionConfig.blocks: expected Blocks(br, bc), got {self.blocks!r}"
            )
        b = self.blocks
        if max(b.br, b.bc) > self.seq_len:
            raise ValueError(
                f"AttributionConfig.blocks: {b!r} gives br={b.br}, bc={b.bc}; expected both <= "
                f"the seq_len {self.seq_len}"
            )
        one_of(self.variant, VARIANTS, "AttributionConfig.variant")
        for name in ("seeds", "kinds"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes, int)) or not hasattr(v, "__iter__"):
                raise TypeError(f"AttributionConfig.{name}: expected a tuple, got {v!r}")
            v = tuple(v)
            if not v or len(set(v)) != len(v):
                raise ValueError(
                    f"AttributionConfig.{name}: expected distinct entries, at least one, got {v!r}"
                )
            object.__setattr__(self, name, v)
        object.__setattr__(self, "seeds", non_negative_ints(self.seeds, "AttributionConfig.seeds"))
        for k in self.kinds:
            one_of(k, KINDS, "AttributionConfig.kinds")
        one_of(self.distribution, DISTRIBUTIONS, "AttributionConfig.distribution")
        one_of(self.inputs, INPUT_MODES, "AttributionConfig.inputs")

    def describe(self) -> str:
        b = self.blocks
        return (
            f"{self.policy.name}, N={self.seq_len}, d={self.d}, {self.variant}, "
            f"Br={b.br} Bc={b.bc}, seeds {','.join(map(str, self.seeds))}, "
            f"{self.distribution} inputs ({self.inputs})"
        )


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Deviations of one attribution (module docstring).

    ``deviations[(kind, direction, stage, metric)]``: the metric of
    |O - golden|, mean over seeds; ``stage`` is ``""`` for ``"full"``.
    """

    config: AttributionConfig
    deviations: dict
    seconds: float

    def deviation(
        self, kind: str, direction: str, stage: str = "", metric: str = "max_abs_diff"
    ) -> float:
        return self.deviations[(kind, direction, stage if direction != "full" else "", metric)]

    def share(self, kind: str, direction: str, stage: str, metric: str = "max_abs_diff") -> float:
        """The stage's share of the full deviation (module docstring); 0/0 is 0 and
        x/0 (a deviation where the full policy has none) is nan."""
        if direction not in ("raised", "lowered"):
            raise ValueError(
                f"Attribution.share: expected direction 'raised' or 'lowered', got {direction!r}"
            )
        full = self.deviation(kind, "full", metric=metric)
        d = self.deviation(kind, direction, stage, metric)
        part = full - d if direction == "raised" else d
        if full == 0:
            return 0.0 if part == 0 else math.nan
        return part / full

    def share_sum(self, kind: str, direction: str, metric: str = "max_abs_diff") -> float:
        return math.fsum(self.share(kind, direction, s, metric) for s in FORWARD_STAGES)

    def rows(self) -> list[dict]:
        """Tidy records, one per (kind, direction, stage, metric): the CSV's rows."""
        c, pol = self.config, self.config.policy
        base = {
            "policy": pol.name,
            "seq_len": c.seq_len,
            "d": c.d,
            "br": c.blocks.br,
            "bc": c.blocks.bc,
            "variant": c.variant,
            "seeds": " ".join(map(str, c.seeds)),
            "distribution": c.distribution,
            "inputs": c.inputs,
        }
        out = []
        for kind in c.kinds:
            for metric in ATTRIBUTION_METRICS:
                out.append(
                    {
                        **base,
                        "kind": kind,
                        "direction": "full",
                        "stage": "",
                        "stage_format": "",
                        "metric": metric,
                        "deviation": repr(self.deviation(kind, "full", metric=metric)),
                        "share": "",
                    }
                )
                for direction in ("raised", "lowered"):
                    for s in FORWARD_STAGES:
                        out.append(
                            {
                                **base,
                                "kind": kind,
                                "direction": direction,
                                "stage": s,
                                "stage_format": getattr(pol, s).name,
                                "metric": metric,
                                "deviation": repr(self.deviation(kind, direction, s, metric)),
                                "share": repr(self.share(kind, direction, s, metric)),
                            }
                        )
        return out

    def table(self, metric: str = "max_abs_diff") -> str:
        """The raised and lowered tables for ``metric``, side by side per kind."""
        c, pol = self.config, self.config.policy
        kinds = c.kinds
        lines = [
            f"attribution: {c.describe()}",
            f"deviation: {metric} of |O - golden| (mean over seeds); golden = FP64",
        ]
        lines.append(
            "full policy:  "
            + "   ".join(f"{k} {self.deviation(k, 'full', metric=metric):.3e}" for k in kinds)
            + (
                f"   (flash / reference {_ratio(self, metric):.3g}x)"
                if set(kinds) == set(KINDS)
                else ""
            )
        )
        head = ["stage", "format"]
        for k in kinds:
            head += [f"{k} dev", f"{k} share"]
        for direction, title in (
            ("raised", "raise one stage to FP64: share = (D - D_raised) / D"),
            (
                "lowered",
                ("lower one stage from FP64 to the policy's format: share = D_lowered / D"),
            ),
        ):
            body = []
            for s in FORWARD_STAGES:
                row = [s, getattr(pol, s).name]
                for k in kinds:
                    row += [
                        f"{self.deviation(k, direction, s, metric):.3e}",
                        _pct(self.share(k, direction, s, metric)),
                    ]
                body.append(row)
            total = ["sum of shares", ""]
            for k in kinds:
                total += ["", _pct(self.share_sum(k, direction, metric))]
            lines += ["", format_table(head, [*body, total], title=title, right=head[2:])]
        lines += [
            "",
            (
                "Shares need not sum to 100%: stages interact (an error one stage "
                "makes is amplified or cancelled by another)."
            ),
            "A stage already in FP64 contributes nothing by construction.",
        ]
        if c.inputs == "rounded":
            lines.append(
                "Q, K, V are rounded to the input format once for every run, golden "
                "included: the inputs row only counts other roundings in that stage."
            )
        return "\n".join(lines)


def _ratio(res: Attribution, metric: str) -> float:
    f = res.deviation("flash", "full", metric=metric)
    r = res.deviation("reference", "full", metric=metric)
    return f / r if r > 0 else math.inf


def _pct(share: float) -> str:
    return "nan" if math.isnan(share) else f"{100 * share:.1f}%"


# -- running ----------------------------------------------------------------------------


def _is_fp64(fmt: Format) -> bool:
    return (fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.specials) == (
        FP64.exp_bits,
        FP64.man_bits,
        FP64.bias,
        FP64.specials,
    )


def variants(policy: Policy) -> dict:
    """{(direction, stage): Policy} of the runs an attribution needs: the full policy
    under ``("full", "")``; per forward stage not already FP64 its raised and
    lowered variant; and, when the policy's accumulation model or scale placement
    differs from golden's, the base of the lowered runs (golden with those) under
    ``("lowered", "")``, the deviation of a lowered stage that is already FP64."""
    exp_model = EXP2 if policy.scale == "exp2" else golden().exp_model  # the exp's base follows
    lowered_base = golden().replace(
        accumulation=policy.accumulation, scale=policy.scale, exp_model=exp_model
    )
    out = {("full", ""): policy}
    if lowered_base != golden():
        out[("lowered", "")] = lowered_base
    for s in FORWARD_STAGES:
        fmt = getattr(policy, s)
        if _is_fp64(fmt):
            continue
        out[("raised", s)] = policy.replace(**{s: FP64})
        out[("lowered", s)] = lowered_base.replace(**{s: fmt})
    return out


def _relabelled(policy: Policy) -> Policy:
    """The policy with every stage Format renamed ``"stage"`` and the policy renamed
    ``"attribution"``: names are static pytree data, widths are leaves, so policies
    whose formats are of one kind then share a pytree structure and can be stacked."""
    fmts = {}
    for s in STAGES:
        f = getattr(policy, s)
        if isinstance(f, Format):
            fmts[s] = Format(
                "stage",
                f.exp_bits,
                f.man_bits,
                bias=f.bias,
                subnormals=f.subnormals,
                specials=f.specials,
                overflow=f.overflow,
                float_exact_in=("float64",) if f.rounds_in_float(np.float64) else (),
            )
    return policy.replace(**fmts, name="attribution")


@functools.partial(jax.jit, static_argnames=("treedef", "kind", "blocks", "variant"))
def _program(leaves, q, k, v, *, treedef, kind, blocks, variant):
    """O of every stacked policy (leading axis of ``leaves``), one after another."""

    def one(ls):
        policy = jax.tree_util.tree_unflatten(treedef, ls)
        if kind == "flash":
            return flash_attention(q, k, v, policy, blocks, variant=variant)[0]  # pyright: ignore[reportIndexIssue]
        return reference_attention(q, k, v, policy)

    return jax.lax.map(one, leaves)


def _outputs(kind: str, policies: dict, q, k, v, config: AttributionConfig) -> dict:
    """{key: O} for every policy, one program per pytree structure."""
    groups: dict = {}
    for key, pol in policies.items():
        leaves, treedef = jax.tree_util.tree_flatten(_relabelled(pol))
        groups.setdefault(treedef, []).append((key, leaves))
    out = {}
    for treedef, members in groups.items():
        stacked = [np.array(col, dtype=np.int32) for col in zip(*(ls for _, ls in members))]
        o = np.asarray(
            _program(
                stacked,
                q,
                k,
                v,
                treedef=treedef,
                kind=kind,
                blocks=config.blocks,
                variant=config.variant,
            )
        )
        for i, (key, _) in enumerate(members):
            out[key] = o[i]
    return out


def _deviation(o, gold, metric: str) -> float:
    """The metric per seed (leading axis), averaged over seeds."""
    fn = getattr(metrics, metric)
    return math.fsum(float(fn(o[i], gold[i])) for i in range(gold.shape[0])) / gold.shape[0]


def attribute(config: AttributionConfig) -> Attribution:
    """Run an attribution (module docstring).  Enables ``jax_enable_x64`` while it
    runs and restores the previous setting."""
    if not isinstance(config, AttributionConfig):
        raise TypeError(f"attribute: expected an AttributionConfig, got {config!r}")
    with float64_enabled():
        return _attribute(config)


def _golden(kind: str, q, k, v, config: AttributionConfig):
    """The kind's own algorithm under golden() (FP64 everywhere, exact sums)."""
    if kind == "flash":
        return np.asarray(
            flash_attention(q, k, v, golden(), config.blocks, variant=config.variant)[0]  # pyright: ignore[reportIndexIssue]
        )
    return np.asarray(reference_attention(q, k, v, golden()))


def _attribute(config: AttributionConfig) -> Attribution:
    start = time.monotonic()
    policy = config.policy
    raw = [
        make_inputs(s, config.seq_len, d=config.d, distribution=config.distribution)
        for s in config.seeds
    ]
    q, k, v = (jnp.asarray(np.stack([r[i] for r in raw])) for i in range(3))  # (S,1,1,N,d)
    if config.inputs == "rounded":
        q, k, v = (round_to(t, policy.inputs) for t in (q, k, v))
    runs = variants(policy)
    deviations = {}
    for kind in config.kinds:
        gold = _golden(kind, q, k, v, config)
        outs = _outputs(kind, runs, q, k, v, config)
        for metric in ATTRIBUTION_METRICS:
            measured = {key: _deviation(o, gold, metric) for key, o in outs.items()}
            full = measured[("full", "")]
            floor = measured.get(("lowered", ""), 0.0)  # a lowered stage already FP64
            deviations[(kind, "full", "", metric)] = full
            for s in FORWARD_STAGES:
                deviations[(kind, "raised", s, metric)] = measured.get(("raised", s), full)
                deviations[(kind, "lowered", s, metric)] = measured.get(("lowered", s), floor)
    return Attribution(config, deviations, time.monotonic() - start)


# -- files ----------------------------------------------------------------------------------


def write_csv(results, path) -> pathlib.Path:
    """Every result's :meth:`Attribution.rows` to one CSV (columns :data:`CSV_COLUMNS`);
    deviations and shares as ``repr(float)``, so they round-trip exactly."""
    results = [results] if isinstance(results, Attribution) else list(results)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write_rows(path, CSV_COLUMNS, [row for r in results for row in r.rows()])


def plot_attribution(results, path, *, metric: str = "max_abs_diff") -> pathlib.Path:
    """Bar chart: one row of panels per result, raised and lowered side by side.

    Bars are each stage's deviation per attention kind (linear scale, so that
    kinds and stages compare directly), labelled with its share; dashed lines
    mark each kind's full-policy deviation.  A raised bar far below its line, or
    a lowered bar reaching it, marks the stage that causes the deviation.
    """
    results = [results] if isinstance(results, Attribution) else list(results)
    plt = pyplot("fa_jax.studies.attribution: the bar chart")
    fig, axes = plt.subplots(len(results), 2, figsize=(13, 4.2 * len(results)), squeeze=False)
    colors = {"flash": "C0", "reference": "C1"}
    for row, res in zip(axes, results):
        c = res.config
        xs = np.arange(len(FORWARD_STAGES))
        w = 0.8 / len(c.kinds)
        top = max(v for (_, _, _, m), v in res.deviations.items() if m == metric)
        for ax, direction in zip(row, ("raised", "lowered")):
            for i, kind in enumerate(c.kinds):
                dev = [res.deviation(kind, direction, s, metric) for s in FORWARD_STAGES]
                x = xs + (i - (len(c.kinds) - 1) / 2) * w
                ax.bar(x, dev, w, color=colors[kind], label=kind)
                for xi, s, d in zip(x, FORWARD_STAGES, dev):
                    ax.annotate(
                        _pct(res.share(kind, direction, s, metric)),
                        (xi, d),
                        ha="center",
                        va="bottom",
                        fontsize=6,
                        rotation=90,
                        xytext=(0, 2),
                        textcoords="offset points",
                    )
                full = res.deviation(kind, "full", metric=metric)
                ax.axhline(
                    full, color=colors[kind], ls="--", lw=1, label=f"{kind}, full policy {full:.2e}"
                )
            ax.set_ylim(0, 1.45 * top if top > 0 else 1.0)
            ax.set_xticks(
                xs, [f"{s}\n{getattr(c.policy, s).name}" for s in FORWARD_STAGES], fontsize=7
            )
            what = (
                "one stage raised to FP64; share = (D - D_raised) / D"
                if direction == "raised"
                else "one stage lowered from FP64, rest FP64; share = D_lowered / D"
            )
            ax.set_title(f"{c.policy.name}: {what}", fontsize=9)
            ax.legend(fontsize=7, loc="upper center", ncol=4)
        row[0].set_ylabel(f"{metric} vs golden")
    c0 = results[0].config
    fig.suptitle(
        f"Per-stage attribution of |O - golden| (N={c0.seq_len}, d={c0.d}, "
        f"{c0.variant}, Br={c0.blocks.br} Bc={c0.blocks.bc}, seeds "
        f"{','.join(map(str, c0.seeds))}, mean over seeds)",
        fontsize=10,
    )
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
