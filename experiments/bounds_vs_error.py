"""Measured softmax and attention error against the analytic bounds of fa_jax.bounds.

For formats BF16, FP16, FP32, E4M3FN and row lengths n = 16 .. 65,536, every
computation runs under ``paper_uniform(fmt)`` (each stage rounds to ``fmt``,
exact-then-round sums: the model of the bounds) and is compared with the same
computation under ``golden()`` (FP64) on the same inputs, rounded to ``fmt``.

Softmax (the quantity fa_jax.bounds bounds)
    Rows x of n scores drawn N(0, sigma^2), sigma = 1 and 4, rounded to ``fmt``
    (the bounds assume the scores are values of the format).  Measured: the
    componentwise relative error ``|y_hat_j - y_j| / y_j`` of ``safe_softmax`` and
    of ``online_softmax(block=32)``; "max" is the worst over all entries of all
    rows, "mean" the mean over them.  Bounds: ``softmax_bound`` /
    ``online_softmax_bound(block=32)`` (rigorous) and their ``_first_order``
    parts, evaluated at the largest spread ``R = x_max - x_min`` of the rows
    (the bounds grow with R, so that one value bounds every row).  Rows per
    length: ``min(4096, max(32, 2**21 // n))``.

Attention
    Q, K, V from :func:`fa_jax.inputs.make_inputs` (seed 0, N(0, 1), d = 64),
    rounded to ``fmt``; 128 query rows (all rows for n < 128) against n keys.
    Query rows are independent, so this measures the same per-row error as a
    full N x N run without materialising N x N float64 scores.  Measured:
    ``max |O_hat - O|`` and the mean, for ``reference_attention`` and
    ``flash_attention`` (FA2, Br = Bc = 32), each against
    ``reference_attention`` under ``golden()``.  Bound:
    :func:`fa_jax.bounds.attention_bound` (per entry ``F_i W_ic + Z_i``, with
    ``W = softmax(S) |V|``; its docstring gives the derivation).  The
    "first-order" attention line is the max over entries of the leading term
    of ``F`` times ``W``.

Probabilistic scaling: the line ``sqrt(n) u`` (Higham & Mary 2019, lambda = 1;
times mean W for attention) shows where errors that add up like a random walk
over n roundings would sit; it is a scale, not a bound.

Output: ``docs/figures/bounds_vs_error.png`` (one column per format; rows:
safe softmax, online softmax, attention), ``fa_jax_out/bounds_vs_error/
bounds_vs_error.csv`` and a printed table of bound / measured max ("loose by
x...") per (format, n).  A bound is reported as vacuous where it is no better
than the trivial one: ``inf``, a relative error >= 1 (softmax), or F >= 1
(attention: the bound is then at least W, the size of O's terms).

    python experiments/bounds_vs_error.py                   # full: n = 16 .. 65536
    python experiments/bounds_vs_error.py --max-n 1024      # quick
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import (
    Blocks,
    flash_attention,
    get_format,
    golden,
    online_softmax,
    paper_uniform,
    reference_attention,
    round_to,
    safe_softmax,
)
from fa_jax import bounds as B
from fa_jax.inputs import make_inputs

FORMATS = ("bf16", "fp16", "fp32", "e4m3fn")
NS = (16, 64, 256, 1024, 4096, 16384, 65536)
SIGMAS = (1.0, 4.0)
BLOCK = 32  # online softmax block and flash Bc (Br = Bc)
D = 64
Q_ROWS = 128
COLUMNS = (
    "format",
    "n",
    "quantity",
    "sigma",
    "rows",
    "x_range",
    "measured_max",
    "measured_mean",
    "bound",
    "bound_first_order",
    "sqrt_n_u",
    "loose_by",
    "vacuous",
    "trivial_level",
    "violations",
)


def softmax_rows(n: int) -> int:
    return min(4096, max(32, 2**21 // n))


# -- softmax ---------------------------------------------------------------------------


def softmax_case(fmt, n: int) -> list[dict]:
    """Both sigmas as one batch (sigma, rows, n); safe and online against golden."""
    rows = softmax_rows(n)
    rng = np.random.default_rng([n, 7])
    x = np.stack([rng.normal(0.0, s, (rows, n)) for s in SIGMAS])
    x = round_to(jnp.asarray(x), fmt)
    y = np.asarray(safe_softmax(x, golden()))
    pol = paper_uniform(fmt)
    x_np = np.asarray(x)
    spread = (x_np.max(axis=-1) - x_np.min(axis=-1)).max(axis=-1)  # per sigma
    u = fmt.unit_roundoff
    out = []
    for name, y_hat, bound, first in (
        (
            "safe_softmax",
            safe_softmax(x, pol),
            lambda R: B.softmax_bound(n, R, fmt),
            lambda R: B.softmax_bound_first_order(n, R, fmt),
        ),
        (
            "online_softmax",
            online_softmax(x, pol, block=BLOCK),
            lambda R: B.online_softmax_bound(n, R, fmt, block=BLOCK),
            lambda R: B.online_softmax_bound_first_order(n, R, fmt, block=BLOCK),
        ),
    ):
        rel = np.abs(np.asarray(y_hat) - y) / y
        for i, sigma in enumerate(SIGMAS):
            R = float(spread[i])
            r = rel[i]
            b = bound(R)
            worst = float(r.max()) if np.isfinite(r).all() else math.nan
            out.append(
                _row(
                    fmt,
                    n,
                    name,
                    sigma,
                    rows,
                    R,
                    worst,
                    float(np.mean(r)),
                    b,
                    first(R),
                    math.sqrt(n) * u,
                    vacuous=b >= 1,
                    trivial=1.0,
                    violations=_violations(r, b),
                )
            )
    return out


# -- attention -------------------------------------------------------------------------


def _first_order(fmt, n: int, bound, bc):
    """The leading term of the bound's factor F, per row, times W: an estimate."""
    u, eta = fmt.unit_roundoff, B.default_exp_error(fmt.unit_roundoff)
    R = bound.x_range + 2 * bound.score_error
    delta = bound.score_error
    if bc is None:
        first = [
            B.softmax_bound_first_order(n, r, fmt) + 2 * u + 2 * dl
            for r, dl in zip(R.tolist(), delta.tolist())
        ]
    else:
        K = -(-n // bc)
        n_u = 1 + B.summation_roundings(bc) + 3 * (K - 1)  # l: exp, block sum, 3 per rescale
        n_o = 3 * K + 1
        first = (2 * R + n_o + n_u + 1) * u + 2 * K * eta + 2 * delta
    first = np.where(np.isfinite(bound.factor), np.asarray(first), np.inf)
    return float((first[:, None] * bound.weights).max())


def attention_bounds(fmt, n: int, q, k, v):
    """fa_jax.bounds.attention_bound for reference and flash, and the first-order lines."""
    ref = B.attention_bound(q, k, v, fmt)
    fl = B.attention_bound(q, k, v, fmt, bc=BLOCK)
    R = float((ref.x_range + 2 * ref.score_error).max())
    return {
        "attention_reference": (
            ref.bound,
            _first_order(fmt, n, ref, None),
            R,
            float(ref.factor.max()),
        ),
        "attention_flash": (fl.bound, _first_order(fmt, n, fl, BLOCK), R, float(fl.factor.max())),
        "W_mean": float(ref.weights.mean()),
        "W_max": float(ref.weights.max()),
    }


def attention_case(fmt, n: int) -> list[dict]:
    q, k, v = (np.asarray(round_to(jnp.asarray(t[0, 0]), fmt)) for t in make_inputs(0, n, d=D))
    q = q[:Q_ROWS]
    gold = np.asarray(reference_attention(q, k, v, golden()))
    pol = paper_uniform(fmt)
    outs = {
        "attention_reference": np.asarray(reference_attention(q, k, v, pol)),
        "attention_flash": np.asarray(flash_attention(q, k, v, pol, Blocks(BLOCK, BLOCK))[0]),
    }
    bnd = attention_bounds(fmt, n, q, k, v)
    rows = []
    for name, o in outs.items():
        err = np.abs(o - gold)
        per_entry, first, R, F = bnd[name]
        worst = float(err.max()) if np.isfinite(err).all() else math.nan
        rows.append(
            _row(
                fmt,
                n,
                name,
                1.0,
                q.shape[0],
                R,
                worst,
                float(np.mean(err)),
                float(per_entry.max()),
                float(first),
                math.sqrt(n) * fmt.unit_roundoff * bnd["W_mean"],
                vacuous=F >= 1,
                trivial=bnd["W_max"],
                violations=_violations(err, per_entry),
            )
        )
    return rows


def _violations(err, bound) -> int:
    """Entries not shown to be within their bound (NaN counts) where the bound is finite."""
    bound = np.broadcast_to(bound, err.shape)
    return int((~(err <= bound) & np.isfinite(bound)).sum())


def _row(
    fmt,
    n,
    quantity,
    sigma,
    rows,
    R,
    worst,
    mean,
    bound,
    first,
    sqrt_n_u,
    *,
    vacuous,
    trivial,
    violations,
):
    """``vacuous``: the bound is no better than the trivial one, a relative error of 1
    (softmax) or a factor F >= 1 on W (attention); ``trivial`` is that level."""
    loose = bound / worst if worst > 0 and math.isfinite(bound) else math.nan
    return {
        "format": fmt.name,
        "n": n,
        "quantity": quantity,
        "sigma": sigma,
        "rows": rows,
        "x_range": R,
        "measured_max": worst,
        "measured_mean": mean,
        "bound": bound,
        "bound_first_order": first,
        "sqrt_n_u": sqrt_n_u,
        "loose_by": loose,
        "vacuous": bool(vacuous),
        "trivial_level": trivial,
        "violations": violations,
    }


# -- output ----------------------------------------------------------------------------


def print_table(rows) -> None:
    """bound / measured max per (format, n), one column per quantity and sigma."""
    cols = [
        ("safe_softmax", 1.0),
        ("safe_softmax", 4.0),
        ("online_softmax", 1.0),
        ("online_softmax", 4.0),
        ("attention_reference", 1.0),
        ("attention_flash", 1.0),
    ]
    names = ["safe s=1", "safe s=4", "online s=1", "online s=4", "attn ref", "attn flash"]
    by = {(r["format"], r["n"], r["quantity"], r["sigma"]): r for r in rows}

    def cell(r):
        if r is None:
            return "-"
        if math.isnan(r["measured_max"]):
            return "meas NaN"
        if math.isinf(r["bound"]):
            return "inf (vac.)"
        text = f"x{r['loose_by']:.3g}" if math.isfinite(r["loose_by"]) else "meas 0"
        return text + (" (vac.)" if r["vacuous"] else "")

    print(
        "\nbound / measured max ('loose by'); 'vac.' = vacuous: inf, a relative bound >= 1, "
        "or an attention bound >= W (F >= 1)"
    )
    head = ["format", "n", *names]
    body = [
        [f, str(n), *(cell(by.get((f, n, q, s))) for q, s in cols)]
        for f in sorted(
            {r["format"] for r in rows},
            key=lambda f: [get_format(x).name for x in FORMATS].index(f),
        )
        for n in sorted({r["n"] for r in rows if r["format"] == f})
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    for r in [head, *body]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    bad = [r for r in rows if r["violations"]]
    print(
        f"\nentries above their bound: {sum(r['violations'] for r in rows)}"
        + "".join(
            f"\n  {r['format']} n={r['n']} {r['quantity']} sigma={r['sigma']}: {r['violations']}"
            for r in bad
        )
    )


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = [
        get_format(f).name for f in FORMATS if any(r["format"] == get_format(f).name for r in rows)
    ]
    quantities = [
        ("safe softmax: max_j |y^-y|/y", ("safe_softmax",)),
        ("online softmax (block 32)", ("online_softmax",)),
        ("attention: |O^ - O|", ("attention_reference", "attention_flash")),
    ]
    fig, axes = plt.subplots(3, len(fmts), figsize=(4.2 * len(fmts), 10.5), squeeze=False)
    for col, f in enumerate(fmts):
        for row, (title, names) in enumerate(quantities):
            ax = axes[row][col]
            for name in names:
                for sigma in SIGMAS:
                    ls = ":" if sigma != 1.0 else "-." if name == "attention_flash" else "-"
                    rs = sorted(
                        (
                            r
                            for r in rows
                            if r["format"] == f and r["quantity"] == name and r["sigma"] == sigma
                        ),
                        key=lambda r: r["n"],
                    )
                    if not rs:
                        continue
                    ns = [r["n"] for r in rs]
                    tag = "" if len(names) == 1 else name.split("_")[1] + " "
                    lab = f"{tag}s={sigma:g}" if len(names) == 1 else tag
                    mk = "o" if name != "attention_flash" else "^"

                    def fin(v):
                        return v if math.isfinite(v) and v > 0 else np.nan

                    ax.loglog(
                        ns,
                        [fin(r["bound"]) for r in rs],
                        "C3" + ls,
                        lw=1.5,
                        label=f"rigorous bound {lab}",
                    )
                    ax.loglog(
                        ns,
                        [fin(r["bound_first_order"]) for r in rs],
                        "C1" + ls,
                        lw=1,
                        label=f"first-order {lab}",
                    )
                    ax.loglog(
                        ns,
                        [fin(r["measured_max"]) for r in rs],
                        "C0" + ls + mk,
                        ms=3,
                        label=f"measured max {lab}",
                    )
                    ax.loglog(
                        ns,
                        [fin(r["measured_mean"]) for r in rs],
                        "C2" + ls + mk,
                        ms=3,
                        label=f"measured mean {lab}",
                    )
                    if name != "attention_flash" and sigma == 1.0:
                        ax.loglog(
                            ns,
                            [r["sqrt_n_u"] for r in rs],
                            "k--",
                            lw=0.8,
                            label="sqrt(n) u" + (" mean W" if len(names) > 1 else ""),
                        )
            levels = [
                r["trivial_level"] for r in rows if r["format"] == f and r["quantity"] in names
            ]
            ax.axhline(max(levels), color="grey", lw=0.8)
            ax.set_ylim(top=10 * max(levels))
            ax.set_xscale("log", base=2)
            ax.set_title(f"{f}: {title}", fontsize=9)
            ax.set_xlabel("n")
            ax.grid(alpha=0.3, which="major")
            if col == 0:
                ax.legend(fontsize=6, ncol=1)
    fig.suptitle(
        "Measured error vs analytic bounds under paper_uniform(fmt) "
        "(grey: the trivial level, relative error 1 or max W; panels end at 10x it; "
        "dotted: sigma = 4; attention: solid/o reference, dash-dot/^ flash)",
        fontsize=10,
    )
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-n", type=int, default=max(NS))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--out", default="fa_jax_out/bounds_vs_error")
    p.add_argument("--figure", default="docs/figures/bounds_vs_error.png")
    args = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)  # the op layer carries float64
    t0 = time.monotonic()
    rows = []
    for f in args.formats.split(","):
        fmt = get_format(f)
        for n in (n for n in NS if n <= args.max_n):
            t = time.monotonic()
            rows += softmax_case(fmt, n) + attention_case(fmt, n)
            print(f"{fmt.name:>14} n={n:<6} {time.monotonic() - t:6.1f} s", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bounds_vs_error.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(
            {k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
        )
    print_table(rows)
    plot(rows, args.figure)
    print(
        f"\nwrote {out / 'bounds_vs_error.csv'} and {args.figure}; "
        f"total {time.monotonic() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
