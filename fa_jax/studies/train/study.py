"""Weight deviation over training (Golden et al. 2024, Figs 7-8): ``fig8``.

From one initialisation, on the same data in the same order, the study trains

(a) ``baseline``  the model with baseline attention (``reference_attention``)
                  under the attention policy (``paper_uniform(bf16)`` first), FP32;
(b) ``flash``     the same with ``flash_attention`` (tiles ``Blocks(br, bc)``,
                  default 32x32: 4 key blocks at context 128);
(c) ``seed``      (a) from another initialisation seed;
(d) ``lowp``      (a) in low-precision training (default BF16 mixed precision with
                  FP32 master weights; ``fp16``: FP16 with dynamic loss scaling).

Attention's backward pass is fa_jax's emulated one under the same policy
(``backward="emulated"``); ``backward="float64"`` keeps the forward emulated and
takes exact gradients (:mod:`fa_jax.studies.train.attention_layer`).  Every
``record_every`` steps the study compares the pairs' weights, per weight matrix
and over all parameters concatenated (``"overall"``): ``max |w_a - w_x|`` and the
Wasserstein-1 distance between the two runs' weight distributions
(:func:`fa_jax.metrics.wasserstein_1d`), both in float64.

Why these pairs (Golden et al. 2024, §5).  Training is chaotic, so a weight
difference means nothing alone.  (a, b) differ *only* in the attention
algorithm, so their drift is the effect of FlashAttention's numerics; (a, d)
differ only in the precision of the rest of the model, the paper's yardstick:
``drift(a, d) / drift(a, b)`` is the number it reports as 2-5x; (a, c) share
nothing but the recipe, the ceiling.

With several ``policies`` (default ``paper_uniform`` and ``fa2_kernel``, as the
other figures) the study trains an (a, b) pair under each (runs
``baseline-<policy>``, ``flash-<policy>``); (c) and (d) are trained under the
first policy only, so the other policies' flash drift is set against that
yardstick (their baselines differ from the first one's only inside attention).

Files in ``out_dir/fig8/``: ``results.csv`` (tidy rows ``step, policy, pair,
param, metric, value``; metrics ``max_abs_diff``, ``wasserstein_1d``, and for
``param = "loss"`` the pair's training losses ``loss_a`` and ``loss_x``),
``losses.csv`` (``step, run, loss``), ``metadata.json``, ``summary.json``
(ratios, final drift and losses), ``fig8.png`` and ``checkpoints/<run>.npz``,
all rewritten atomically at every record.  Re-running into the same folder
resumes from the checkpoints and equals an uninterrupted run bitwise; a folder
holding another configuration is an error.

Ratios: ``drift(a, d) / drift(a, b)`` per policy and metric, at the final record
and as the geometric mean of the per-record ratios over the records after step 0
(a geometric mean, so that early records where (a, b) has barely moved do not
dominate).

Presets: ``QUICK`` (2 layers, d_model 128, context 128, 150 steps, a record
every 10) and ``FULL`` (4 layers, context 256, 600 steps, a record every 20).
Unlike the paper's text-to-image model, this is a small decoder-only language
model on a synthetic Markov language (:mod:`fa_jax.studies.train.data`) with
attention *emulated* under a policy: its ratio is set beside the paper's, not
a reproduction of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time

import jax
import numpy as np

from fa_jax import metrics
from fa_jax._checks import one_of, positive_int
from fa_jax._x64 import float64_enabled
from fa_jax.attention import VARIANTS, Blocks
from fa_jax.formats import get_format
from fa_jax.presets import get_policy
from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.progress import track
from fa_jax.studies.results import (
    check_out_dir,
    pyplot,
    read_complete,
    read_csv,
    run_metadata,
    write_csv,
    write_json,
)
from fa_jax.studies.table import print_table
from fa_jax.studies.train.attention_layer import BACKWARDS, AttentionSpec
from fa_jax.studies.train.data import MarkovData
from fa_jax.studies.train.loop import (
    Optim,
    RunSpec,
    TrainState,
    advance,
    import_optax,
    init_state,
    load_checkpoint,
    save_checkpoint,
)
from fa_jax.studies.train.model import ModelConfig, param_shapes

__all__ = [
    "COLUMNS",
    "DEFAULT_POLICIES",
    "FULL",
    "METRICS",
    "PAPER_RATIO",
    "QUICK",
    "StudyConfig",
    "fig8",
    "load_overall",
    "run_study",
]

COLUMNS = ("step", "policy", "pair", "param", "metric", "value")
METRICS = ("max_abs_diff", "wasserstein_1d")
LOSS_METRICS = ("loss_a", "loss_x")
PAPER_RATIO = (2.0, 5.0)
PAIR_LABELS = {
    "flash": "(a,b) flash vs baseline attention",
    "seed": "(a,c) another init seed",
    "lowp": "(a,d) low-precision vs FP32 training",
}


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Everything that determines the study's numbers (module docstring)."""

    # model
    vocab: int = 32
    context: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    # data
    batch: int = 8
    branching: int = 4
    data_seed: int = 0
    # training
    steps: int = 150
    record_every: int = 10
    lr: float = 3e-3
    warmup: int = 20
    # runs
    format: str = "bf16"
    br: int = 32
    bc: int = 32
    variant: str = "fa2"
    backward: str = "emulated"
    low_precision: str = "bf16"
    init_seed: int = 0
    other_seed: int = 1

    def __post_init__(self):
        for name in ("steps", "record_every"):
            positive_int(getattr(self, name), f"StudyConfig.{name}")
        one_of(self.low_precision, ("bf16", "fp16"), "StudyConfig.low_precision")
        one_of(self.backward, BACKWARDS, "StudyConfig.backward")
        if self.init_seed == self.other_seed:
            raise ValueError(
                f"StudyConfig: other_seed must differ from init_seed "
                f"({self.init_seed}), got {self.other_seed}"
            )
        one_of(self.variant, VARIANTS, "StudyConfig.variant")
        try:
            get_format(self.format)
        except ValueError as err:
            raise ValueError(f"StudyConfig.format: {err}") from None
        self.model()  # each validates its fields
        self.data()
        self.optim()
        Blocks(self.br, self.bc)

    def model(self) -> ModelConfig:
        return ModelConfig(
            self.vocab, self.context, self.d_model, self.n_heads, self.n_layers, self.d_ff
        )

    def data(self) -> MarkovData:
        return MarkovData(self.vocab, self.context, self.batch, self.branching, self.data_seed)

    def optim(self) -> Optim:
        return Optim(lr=self.lr, warmup=self.warmup)

    def record_steps(self) -> list[int]:
        """0, k, 2k, ... and the last step."""
        return sorted(set(range(0, self.steps, self.record_every)) | {self.steps})

    def runs(self, policies) -> tuple[list[RunSpec], list[tuple[str, str, str, str]]]:
        """The runs and the pairs ``(policy, pair, run_a, run_x)`` (module docstring)."""
        runs, pairs = [], []
        blocks = Blocks(self.br, self.bc)
        for i, name in enumerate(policies):
            policy = get_policy(name) if name == "golden" else get_policy(name, self.format)
            ref = AttentionSpec("reference", policy, backward=self.backward)
            fl = AttentionSpec("flash", policy, blocks, self.variant, backward=self.backward)
            a = RunSpec(f"baseline-{name}", ref, "fp32", self.init_seed)
            runs += [a, RunSpec(f"flash-{name}", fl, "fp32", self.init_seed)]
            pairs.append((name, "flash", a.name, f"flash-{name}"))
            if i == 0:
                c = RunSpec(f"seed{self.other_seed}-{name}", ref, "fp32", self.other_seed)
                d = RunSpec(f"{self.low_precision}-{name}", ref, self.low_precision, self.init_seed)
                runs += [c, d]
                pairs += [(name, "seed", a.name, c.name), (name, "lowp", a.name, d.name)]
        return runs, pairs


QUICK = StudyConfig()
FULL = StudyConfig(context=256, n_layers=4, steps=600, record_every=20)


# -- records -------------------------------------------------------------------


def _host64(x) -> np.ndarray:
    """float32 weights as float64 numpy (exact)."""
    return np.asarray(jax.device_get(x), np.float64)


def _pair_rows(
    step: int, policy: str, pair: str, a: TrainState, x: TrainState, loss_a: float, loss_x: float
) -> list[dict]:
    rows = []
    wa = {n: _host64(p) for n, p in a.params.items()}
    wx = {n: _host64(p) for n, p in x.params.items()}
    wa["overall"] = np.concatenate([w.ravel() for w in wa.values()])
    wx["overall"] = np.concatenate([w.ravel() for w in wx.values()])
    for name, w in wa.items():
        vals = (metrics.max_abs_diff(w, wx[name]), metrics.wasserstein_1d(w, wx[name]))
        for m, v in zip(METRICS, vals):
            rows.append(
                {
                    "step": step,
                    "policy": policy,
                    "pair": pair,
                    "param": name,
                    "metric": m,
                    "value": repr(float(v)),
                }
            )
    for m, v in zip(LOSS_METRICS, (loss_a, loss_x)):
        rows.append(
            {
                "step": step,
                "policy": policy,
                "pair": pair,
                "param": "loss",
                "metric": m,
                "value": repr(float(v)),
            }
        )
    return rows


def _expected_parts(model: ModelConfig, pairs) -> list[tuple]:
    """The (policy, pair, param, metric) of the rows of one complete record step."""
    names = [*param_shapes(model), "overall"]
    return [(p, k, n, m) for p, k, _, _ in pairs for n in names for m in METRICS] + [
        (p, k, "loss", m) for p, k, _, _ in pairs for m in LOSS_METRICS
    ]


def _loss_at(losses: list, step: int) -> float:
    """Training loss of the batch at ``step`` (the last one for the final step)."""
    return losses[min(step, len(losses) - 1)] if losses else math.nan


def _metadata(cfg: StudyConfig, policies, runs, pairs) -> dict:
    return run_metadata(
        dataclasses.asdict(cfg),
        packages=("optax",),
        policies=list(policies),
        runs=[
            {
                "name": r.name,
                "attention": r.attention.label(),
                "precision": dataclasses.asdict(r.precision),
                "init_seed": r.init_seed,
            }
            for r in runs
        ],
        pairs=[
            {"policy": p, "pair": k, "a": a, "x": x, "label": PAIR_LABELS[k]}
            for p, k, a, x in pairs
        ],
    )


# -- the study -----------------------------------------------------------------


def run_study(cfg: StudyConfig, out_dir, *, policies=DEFAULT_POLICIES, quiet: bool = False) -> dict:
    """Train the runs, write the records and return the summary (module docstring).

    Enables ``jax_enable_x64`` while it runs (the attention emulation needs float64
    carriers) and restores the previous setting when it returns.
    """
    if not isinstance(cfg, StudyConfig):
        raise TypeError(f"run_study: expected a StudyConfig, got {cfg!r}")
    policies = tuple(policies)
    if not policies or len(set(policies)) != len(policies):
        raise ValueError(f"run_study: expected distinct policy names, got {policies!r}")
    with float64_enabled():
        return _study(cfg, pathlib.Path(out_dir), policies, quiet)


def _study(cfg: StudyConfig, out: pathlib.Path, policies, quiet: bool) -> dict:
    start = time.monotonic()
    import_optax()  # an install hint, before any folder is made
    check_out_dir(out, {"results.csv": COLUMNS, "losses.csv": ("step", "run", "loss")})
    out.mkdir(parents=True, exist_ok=True)
    runs, pairs = cfg.runs(policies)
    meta = _metadata(cfg, policies, runs, pairs)
    meta_path = out / "metadata.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if (old.get("config"), old.get("policies")) != (meta["config"], meta["policies"]):
            raise ValueError(
                f"fig8: {out} holds a study with another configuration "
                f"({old.get('config')}, policies {old.get('policies')}); "
                "choose another output folder"
            )
    write_json(meta_path, meta)

    model, data, optim = cfg.model(), cfg.data(), cfg.optim()
    table = data.table()
    csv_path = out / "results.csv"
    rows, done_keys = read_complete(
        csv_path,
        COLUMNS,
        ("step",),
        ("policy", "pair", "param", "metric"),
        _expected_parts(model, pairs),
    )
    done = {int(k[0]) for k in done_keys}

    ckpt = out / "checkpoints"
    states, losses = {}, {}
    for r in runs:
        fresh = init_state(r, model, optim)
        path = ckpt / f"{r.name}.npz"
        states[r.name], losses[r.name] = (
            load_checkpoint(path, fresh) if path.exists() else (fresh, [])
        )
    for target in track(cfg.record_steps(), desc="fig8", unit="record", quiet=quiet):
        if target in done:
            continue
        for r in runs:
            at = int(states[r.name].step)
            if at > target:
                raise ValueError(
                    f"fig8: checkpoint of run {r.name} is at step {at}, past "
                    f"record step {target} whose rows are missing; "
                    f"remove {out} and run again"
                )
            if at < target or not (ckpt / f"{r.name}.npz").exists():
                states[r.name] = advance(
                    states[r.name], losses[r.name], target, r, model, optim, data, table
                )
                save_checkpoint(ckpt / f"{r.name}.npz", states[r.name], losses[r.name])
        for policy, pair, a, x in pairs:
            rows += _pair_rows(
                target,
                policy,
                pair,
                states[a],
                states[x],
                _loss_at(losses[a], target),
                _loss_at(losses[x], target),
            )
        done.add(target)
        rows.sort(key=lambda r: int(r["step"]))
        write_csv(csv_path, COLUMNS, rows)
        _write_losses(out / "losses.csv", runs, losses)
    _write_losses(out / "losses.csv", runs, losses)
    wall = time.monotonic() - start
    summary = _summarise(csv_path, pairs, losses, wall)
    write_json(out / "summary.json", summary)
    return {
        "csv": str(csv_path),
        "losses_csv": str(out / "losses.csv"),
        "metadata": str(meta_path),
        "summary": summary,
        "out": str(out),
    }


def _write_losses(path, runs, losses) -> None:
    rows = [
        {"step": s, "run": r.name, "loss": repr(v)}
        for r in runs
        for s, v in enumerate(losses[r.name])
    ]
    write_csv(path, ("step", "run", "loss"), rows)


# -- summary: ratios -----------------------------------------------------------


def load_overall(csv_path) -> dict:
    """{(policy, pair, metric): [(step, value), ...]} of the "overall" rows, plus the
    loss rows under metric "loss_a"/"loss_x"."""
    out: dict = {}
    for r in read_csv(csv_path, COLUMNS):
        if r["param"] in ("overall", "loss"):
            out.setdefault((r["policy"], r["pair"], r["metric"]), []).append(
                (int(r["step"]), float(r["value"]))
            )
    for v in out.values():
        v.sort()
    return out


def _geomean_ratio(num, den) -> float:
    """Geometric mean of num/den over the steps > 0 where both are positive."""
    d = dict(den)
    logs = [math.log(v / d[s]) for s, v in num if s > 0 and v > 0 and d.get(s, 0) > 0]
    return math.exp(sum(logs) / len(logs)) if logs else math.nan


def _summarise(csv_path, pairs, losses, wall: float) -> dict:
    overall = load_overall(csv_path)
    first = pairs[0][0]
    ratios = []
    for policy, pair, _, _ in pairs:
        if pair != "flash":
            continue
        for m in METRICS:
            flash = overall[(policy, "flash", m)]
            for other in ("lowp", "seed"):
                o = overall[(first, other, m)]
                ratios.append(
                    {
                        "policy": policy,
                        "metric": m,
                        "ratio": f"{other}/flash",
                        "final": o[-1][1] / flash[-1][1] if flash[-1][1] > 0 else math.inf,
                        "geomean": _geomean_ratio(o, flash),
                    }
                )
    final = {
        p[0] + ":" + p[1]: {m: overall[(p[0], p[1], m)][-1][1] for m in METRICS} for p in pairs
    }
    return {
        "ratios": ratios,
        "final_drift": final,
        "final_loss": {r: v[-1] for r, v in losses.items()},
        "wall_s": wall,
        "paper_ratio": list(PAPER_RATIO),
    }


# -- figure --------------------------------------------------------------------


def _table(res: dict, pairs) -> list[dict]:
    overall = load_overall(res["csv"])
    rows = []
    for policy, pair, a, x in pairs:
        la, lx = (overall[(policy, pair, m)][-1][1] for m in LOSS_METRICS)
        rows.append(
            {
                "policy": policy,
                "pair": pair,
                "runs": f"{a} / {x}",
                "max_abs_diff": overall[(policy, pair, "max_abs_diff")][-1][1],
                "wasserstein_1d": overall[(policy, pair, "wasserstein_1d")][-1][1],
                "loss_a": la,
                "loss_x": lx,
            }
        )
    return rows


def _print(cfg: StudyConfig, rows: list[dict], summary: dict) -> None:
    print_table(
        ("policy", "pair", "runs", "max_abs_diff", "wasserstein_1d", "loss_a", "loss_x"),
        rows,
        title=f"Fig 8: weight drift over all parameters at step {cfg.steps} "
        f"(pairs: {', '.join(PAIR_LABELS.values())})",
    )
    lo, hi = PAPER_RATIO
    ratios = [
        {**r, "final": f"{r['final']:.3g}x", "geomean": f"{r['geomean']:.3g}x"}
        for r in summary["ratios"]
        if r["ratio"] == "lowp/flash"
    ]
    print_table(
        ("policy", "metric", "final", "geomean"),
        ratios,
        right=("final", "geomean"),
        title=f"drift(low precision, {cfg.low_precision}) / drift(flash), overall "
        f"weights (paper: {lo:g}-{hi:g}x); geomean over the records at steps > 0",
    )
    print(f"wall time {summary['wall_s']:.0f} s")


def _plot(out: pathlib.Path, cfg: StudyConfig, pairs, csv_path, losses_csv):
    try:
        plt = pyplot("fig8: the plot")
    except ImportError as err:  # pragma: no cover - depends on the environment
        print(f"{err}; no plot written")
        return None

    overall = load_overall(csv_path)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    styles = {"flash": "o-", "seed": "s--", "lowp": "^-"}
    for policy, pair, _, _ in pairs:
        label = PAIR_LABELS[pair] + (f" [{policy}]" if pair == "flash" else "")
        for ax, m in zip(axes[:2], METRICS):
            pts = [(s, v) for s, v in overall[(policy, pair, m)] if v > 0]
            if pts:
                ax.semilogy(*zip(*pts), styles[pair], ms=3, label=label)
    by_run: dict = {}
    for r in read_csv(losses_csv):
        by_run.setdefault(r["run"], []).append((int(r["step"]), float(r["loss"])))
    for run, pts in by_run.items():
        axes[2].plot(*zip(*sorted(pts)), lw=1, label=run)
    axes[0].set_title("max |w_a - w_x| over all weights")
    axes[1].set_title("Wasserstein-1 between weight distributions")
    axes[2].set_title("training loss (nats)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Fig 8: weight drift over training ({cfg.n_layers}-layer d_model "
        f"{cfg.d_model} LM, context {cfg.context}; flash tiles {cfg.br}x{cfg.bc})"
    )
    fig.tight_layout()
    png = out / "fig8.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def fig8(
    out_dir, *, quick: bool, policies=DEFAULT_POLICIES, grid_overrides=None, quiet: bool = False
) -> dict:
    """The study (module docstring) into ``out_dir/fig8/``: QUICK or FULL, with any
    :class:`StudyConfig` field overridden by ``grid_overrides``; prints the table and
    the ratio drift(low precision) / drift(flash) beside the paper's 2-5x.

    Returns ``{"figure": "fig8", "csv", "png" (None without matplotlib), "grid"
    (the configuration), "rows" (the table), "summary"}``.
    """
    cfg = dataclasses.replace(QUICK if quick else FULL, **(grid_overrides or {}))
    out = pathlib.Path(out_dir) / "fig8"
    res = run_study(cfg, out, policies=policies, quiet=quiet)
    _, pairs = cfg.runs(tuple(policies))
    rows = _table(res, pairs)
    _print(cfg, rows, res["summary"])
    png = _plot(out, cfg, pairs, res["csv"], res["losses_csv"])
    return {
        "figure": "fig8",
        "csv": res["csv"],
        "png": None if png is None else str(png),
        "grid": dataclasses.asdict(cfg),
        "rows": rows,
        "summary": res["summary"],
    }
