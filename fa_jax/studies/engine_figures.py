"""The paper's question asked of inference engines: how far from an FP64 golden
attention are llama.cpp's ggml, ONNX Runtime and OpenVINO, beside fa_jax's presets?

Golden et al. 2024 (arXiv 2405.02803, §3) measure a kernel by its deviation from
FP64 attention on the same inputs.  ``engines`` asks it of the real CPU kernels
of :mod:`fa_jax.kernels` (:func:`fa_jax.kernels.real`):

* ``ggml`` (``ggml_flash_attn_ext``): FP32 Q, K and V; the KV cache stored as
  ``f32``, ``f16``, ``bf16``, ``q8_0`` or ``q4_0`` (so the cache's rounding is
  part of its error), one thread;
* ``onnxruntime-attention`` (the ONNX ``Attention`` op) in FP32 and FP16 and
  ``onnxruntime-mha`` (MLAS flash attention) in FP32;
* ``openvino-sdpa`` (the CPU plugin's ScaledAttnWithKVCache) on FP32 Q, K and V
  with ``precision`` (the inference precision hint) ``bf16`` and ``f32``, one
  thread: at decode shapes with each KV cache (``u8``, ``bf16``, ``f32``: the
  cache holds the first M - 1 keys, so its precision is part of the error; up
  to :data:`OPENVINO_MAX_KEYS` keys), at prefill shapes once per precision (an
  empty cache: its precision does not reach the output);
* fa_jax's presets (``policies``, default ``paper_uniform`` and ``fa2_kernel``)
  in BF16 and FP16, FlashAttention-2's tiled loop with 128 x 128 tiles
  (:func:`fa_jax.studies.validation` runs them the same way);

at decode shapes (one query row against M keys) and prefill shapes (N query rows
against N keys), non-causal.  Inputs and golden follow ``fa-jax validate``
(:mod:`fa_jax.studies.validation`): standard normal draws rounded to the
format each kernel takes (FP32 for ggml at every KV type), and FP64 attention
of those rounded inputs.  Per output row (one query of one head), the relative
error ||o_i - g_i||_2 / ||g_i||_2; per run, max |o - g| and the mean of the
row errors; rows of the table are means over seeds.  A second reference, FP64
attention of the FP32-rounded draws (``*_fp32in`` columns), puts every row on
one footing: a BF16 or FP16 row then counts the rounding of its inputs too.

``threads``: ggml's split-KV path (one query row, float K/V, M >= 512) divides
the keys among its threads and combines their partial results, so its output
depends on the thread count.  For KV caches ``f32`` and ``f16`` at each decode
M, the output with 1, 2, 4, 8 threads: the share of outputs whose bits differ
from one thread's, the largest distance from it in FP32 ulps, whether a second
run with the same thread count repeats it bit for bit, and the error vs golden.

``identity``: fa_jax's models are bit-identical to these kernels
(docs/kernels.md); a few points (:data:`QUICK_CHECKS`, :data:`FULL_CHECKS`)
run both (:func:`fa_jax.kernels.emulate`) and report the share of identical
outputs and the largest ulp distance (:func:`fa_jax.kernels.compare`).

An engine not installed here is left out with its reason printed.  Files in
``out_dir/engines/``: ``results.csv`` (per case, shape and seed), ``threads.csv``,
``identity.csv``, ``metadata.json`` and ``engines.png``.  A run into a folder
that holds a killed run's CSVs resumes it: each (shape, seed) whose every row
is in ``results.csv``, and each (M, seed) complete in ``threads.csv``, is read
back, not run again (``identity`` always runs).  Grids (quick / full):
decode M = 1024, 4096 / 1024 … 32768; prefill N = 512 / 512, 1024, 2048; 2 / 4
seeds; d = 128, 4 heads.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import numpy as np

from fa_jax import kernels, metrics
from fa_jax._checks import non_negative_ints, one_of, positive_int, positive_ints
from fa_jax._x64 import float64_enabled
from fa_jax.formats import FP32, get_format
from fa_jax.presets import PRESETS
from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.interrupt import check_interrupt
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
from fa_jax.studies.validation import (
    Features,
    Shape,
    feature_inputs,
    golden_output,
    preset_attention,
    validation_inputs,
)

__all__ = [
    "FULL",
    "FULL_CHECKS",
    "QUICK",
    "QUICK_CHECKS",
    "Check",
    "EngineGrid",
    "engine_cases",
    "engines",
]

GGML_KV = ("f32", "f16", "bf16", "q8_0", "q4_0")
OPENVINO_PRECISIONS = ("bf16", "f32")
OPENVINO_KV = ("u8", "bf16", "f32")
# The real kernel's cache takes the first M - 1 keys as its state, O(M): OpenVINO's decode
# rows run the full grid's keys.
OPENVINO_MAX_KEYS = 32768
THREAD_KV = ("f32", "f16")  # the KV types whose one-row path is split-KV
PRESET_FORMATS = ("bf16", "fp16")

RESULT_COLUMNS = (
    "case",
    "engine",
    "fmt",
    "shape",
    "n_q",
    "m",
    "seed",
    "max_abs",
    "mean_rel",
    "max_abs_fp32in",
    "mean_rel_fp32in",
)
THREAD_COLUMNS = (
    "kv_type",
    "m",
    "threads",
    "seed",
    "elements",
    "differing",
    "median_ulp",
    "max_ulp",
    "max_diff",
    "repeat_identical",
    "max_abs",
    "mean_rel",
)
IDENTITY_COLUMNS = (
    "kernel",
    "options",
    "fmt",
    "n_q",
    "m",
    "elements",
    "identical",
    "identical_share",
    "max_ulp",
)


@dataclasses.dataclass(frozen=True)
class Check:
    """One identity point: ``kernel`` real vs emulated in ``fmt``, ``n_q`` query rows
    against ``m`` keys, with the kernel's ``options`` ((name, value) pairs)."""

    kernel: str
    fmt: str
    n_q: int
    m: int
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        positive_int(self.n_q, "Check.n_q")
        positive_int(self.m, "Check.m")
        if self.n_q > 1 and self.n_q != self.m:
            raise ValueError(
                f"Check: expected one query row (decode) or n_q == m (prefill), "
                f"got n_q = {self.n_q}, m = {self.m}"
            )

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.options) or "-"


QUICK_CHECKS = (
    Check("ggml", "fp32", 1, 1024, (("kv_type", "f32"), ("threads", 1))),
    Check("openvino-sdpa", "fp32", 1, 1024, (("precision", "bf16"), ("kv_cache", "u8"))),
)
FULL_CHECKS = (
    Check("ggml", "fp32", 1, 1024, (("kv_type", "f32"), ("threads", 1))),
    Check("ggml", "fp32", 1, 1024, (("kv_type", "f32"), ("threads", 4))),
    Check("ggml", "fp32", 1, 1024, (("kv_type", "f16"), ("threads", 8))),
    Check("ggml", "fp32", 1, 1024, (("kv_type", "q8_0"),)),
    Check("ggml", "fp32", 1, 1024, (("kv_type", "q4_0"),)),
    Check("ggml", "fp32", 512, 512, (("kv_type", "f16"),)),
    Check("onnxruntime-attention", "fp32", 512, 512),
    Check("onnxruntime-attention", "fp16", 512, 512),
    Check("onnxruntime-attention", "fp16", 1, 1024),
    Check("onnxruntime-mha", "fp32", 512, 512),
    Check("onnxruntime-mha", "fp32", 1, 1024),
    Check("openvino-sdpa", "fp32", 1, 1024, (("precision", "bf16"), ("kv_cache", "u8"))),
    Check("openvino-sdpa", "fp32", 1, 1024, (("precision", "bf16"), ("kv_cache", "bf16"))),
    Check(
        "openvino-sdpa",
        "fp32",
        1,
        1024,
        (("precision", "bf16"), ("kv_cache", "u8"), ("threads", 4)),
    ),
    Check("openvino-sdpa", "fp32", 512, 512, (("precision", "bf16"),)),
    Check("openvino-sdpa", "fp32", 512, 512, (("precision", "f32"),)),
)


@dataclasses.dataclass(frozen=True)
class EngineGrid:
    """The shapes, seeds, thread counts and identity points of one run (module
    docstring); ``presets`` are preset names run in BF16 and FP16."""

    decode_keys: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    seeds: tuple[int, ...]
    threads: tuple[int, ...] = (1, 2, 4, 8)
    d: int = 128
    heads: int = 4
    presets: tuple[str, ...] = DEFAULT_POLICIES
    checks: tuple[Check, ...] = ()

    def __post_init__(self):
        for name in ("decode_keys", "prefill_lens"):
            object.__setattr__(self, name, tuple(positive_ints(getattr(self, name), name)))
        object.__setattr__(self, "seeds", tuple(non_negative_ints(self.seeds, "EngineGrid.seeds")))
        object.__setattr__(
            self, "threads", tuple(positive_ints(self.threads, "EngineGrid.threads"))
        )
        if not self.seeds:
            raise ValueError("EngineGrid.seeds: expected at least one seed, got none")
        if self.threads and self.threads[0] != 1:
            raise ValueError(
                f"EngineGrid.threads: expected 1 first (the others are compared with it), "
                f"got {self.threads}"
            )
        positive_int(self.d, "EngineGrid.d")
        positive_int(self.heads, "EngineGrid.heads")
        presets = tuple(self.presets)
        for p in presets:
            if str(p).startswith("kernel:"):
                raise ValueError(
                    f"engines: policies: expected preset names (the study runs the real "
                    f"kernels themselves), got {p!r}"
                )
            one_of(p, sorted(PRESETS), "engines: policies")
        object.__setattr__(self, "presets", presets)
        for c in self.checks:
            if not isinstance(c, Check):
                raise TypeError(f"EngineGrid.checks: expected Check entries, got {c!r}")
        object.__setattr__(self, "checks", tuple(self.checks))

    def shapes(self) -> list[tuple[str, int, int]]:
        """(shape, n_q, m): the decode shapes, then the prefill shapes."""
        return [("decode", 1, m) for m in self.decode_keys] + [
            ("prefill", n, n) for n in self.prefill_lens
        ]

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["checks"] = [{**dataclasses.asdict(c), "options": dict(c.options)} for c in self.checks]
        return out


QUICK = EngineGrid(decode_keys=(1024, 4096), prefill_lens=(512,), seeds=(0, 1), checks=QUICK_CHECKS)
FULL = EngineGrid(
    decode_keys=(1024, 4096, 16384, 32768),
    prefill_lens=(512, 1024, 2048),
    seeds=(0, 1, 2, 3),
    checks=FULL_CHECKS,
)


@dataclasses.dataclass(frozen=True)
class _Case:
    """One row family: a real kernel with options, or a preset (``engine`` "fa_jax"),
    run at the ``shapes`` ("decode", "prefill") it names, up to ``max_keys`` keys."""

    label: str
    engine: str
    fmt: str
    options: tuple[tuple[str, Any], ...] = ()
    preset: str | None = None
    shapes: tuple[str, ...] = ("decode", "prefill")
    max_keys: int | None = None

    def runs_at(self, shape: str, m: int) -> bool:
        """Whether the case has a row at ``shape`` with ``m`` keys."""
        return shape in self.shapes and (self.max_keys is None or m <= self.max_keys)


def engine_cases(presets=DEFAULT_POLICIES) -> tuple[_Case, ...]:
    """The cases of the table: ggml per KV type, ONNX Runtime's two ops, OpenVINO per
    precision (and per KV cache at decode), the presets."""
    cases = [
        _Case(f"ggml {kv}", "ggml", "fp32", (("kv_type", kv), ("threads", 1))) for kv in GGML_KV
    ]
    cases += [
        _Case("onnxruntime-attention fp32", "onnxruntime-attention", "fp32"),
        _Case("onnxruntime-attention fp16", "onnxruntime-attention", "fp16"),
        _Case("onnxruntime-mha fp32", "onnxruntime-mha", "fp32"),
    ]
    for prec in OPENVINO_PRECISIONS:
        cases += [
            _Case(
                f"openvino-sdpa {prec} cache {kv}",
                "openvino-sdpa",
                "fp32",
                (("precision", prec), ("kv_cache", kv), ("threads", 1)),
                shapes=("decode",),
                max_keys=OPENVINO_MAX_KEYS,
            )
            for kv in OPENVINO_KV
        ]
        cases.append(
            _Case(
                f"openvino-sdpa {prec}",
                "openvino-sdpa",
                "fp32",
                (("precision", prec), ("threads", 1)),
                shapes=("prefill",),
            )
        )
    cases += [_Case(f"{p} {f}", "fa_jax", f, preset=p) for p in presets for f in PRESET_FORMATS]
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


def _inputs(fmt: str, grid: EngineGrid, n_q: int, m: int, seed: int):
    """(q, k, v) as ``fa-jax validate`` draws them: decode through Features(q_len=1)."""
    f = get_format(fmt)
    shape = Shape(1, grid.heads, m, grid.d)
    if n_q == m:
        return validation_inputs(f, shape, seed)
    q, k, v, _ = feature_inputs(f, shape, Features(q_len=n_q), seed)
    return q, k, v


def _errors(out: np.ndarray, golden: np.ndarray) -> tuple[float, float]:
    """(max |out - golden|, mean over output rows of ||o_i - g_i||_2 / ||g_i||_2)."""
    with float64_enabled():
        max_abs = float(metrics.max_abs_diff(out, golden))
    rows = np.linalg.norm(out - golden, axis=-1) / np.linalg.norm(golden, axis=-1)
    return max_abs, float(np.mean(rows))


def _run_case(case: _Case, q, k, v) -> np.ndarray:
    if case.preset is not None:
        return preset_attention(case.preset, "flash", get_format(case.fmt))(q, k, v, False)
    return kernels.real(case.engine, q, k, v, fmt=case.fmt, **dict(case.options))


def _typed(rows, columns) -> list[dict]:
    """Rows read back from a CSV with their values as written: ints, bools, floats
    (a float's text is its shortest round-trip repr, so nothing changes)."""

    def value(column: str, text: str):
        if column in _TEXT_COLUMNS:
            return text
        if column in _BOOL_COLUMNS:
            return text == "True"
        return int(text) if column in _INT_COLUMNS else float(text)

    return [{c: value(c, r[c]) for c in columns} for r in rows]


_TEXT_COLUMNS = frozenset({"case", "engine", "fmt", "shape", "kv_type"})
_INT_COLUMNS = frozenset({"n_q", "m", "seed", "threads", "elements", "differing", "max_ulp"})
_BOOL_COLUMNS = frozenset({"repeat_identical"})


def _resumed(path, columns, key, part, expected) -> tuple[list[dict], set[tuple]]:
    """The rows of ``path``'s complete units (:func:`~fa_jax.studies.results.read_complete`,
    ``expected(unit)`` the parts of a unit of this grid, None for others), typed,
    and the units done (as str tuples)."""
    rows, done = read_complete(path, columns, key, part, expected)
    return _typed(rows, columns), done


def _measure(grid: EngineGrid, cases, quiet: bool, write, path) -> list[dict]:
    formats = sorted({c.fmt for c in cases} | {"fp32"})
    units = [(s, seed) for s in grid.shapes() for seed in grid.seeds]
    labels = {
        tuple(map(str, (*shape, seed))): [
            (c.label,) for c in cases if c.runs_at(shape[0], shape[2])
        ]
        for shape, seed in units
    }
    results, done = _resumed(
        path, RESULT_COLUMNS, ("shape", "n_q", "m", "seed"), ("case",), labels.get
    )
    units = [u for u in units if tuple(map(str, (*u[0], u[1]))) not in done]
    for (shape, n_q, m), seed in track(units, desc="engines", unit="shape", quiet=quiet):
        inputs = {f: _inputs(f, grid, n_q, m, seed) for f in formats}
        goldens = {f: golden_output(q, k, v, False) for f, (q, k, v) in inputs.items()}
        for case in (c for c in cases if c.runs_at(shape, m)):
            out = _run_case(case, *inputs[case.fmt])
            err = _errors(out, goldens[case.fmt])
            err32 = _errors(out, goldens["fp32"])
            results.append(
                dict(
                    zip(
                        RESULT_COLUMNS,
                        (case.label, case.engine, case.fmt, shape, n_q, m, seed, *err, *err32),
                    )
                )
            )
        write(results)
        check_interrupt()
    return results


def _measure_threads(grid: EngineGrid, quiet: bool, write, path) -> list[dict]:
    keys = [m for m in grid.decode_keys if m >= 512]
    units = [(m, seed) for m in keys for seed in grid.seeds]
    parts = [(kv, t) for kv in THREAD_KV for t in grid.threads]
    expected = {(str(m), str(seed)): parts for m, seed in units}
    rows, done = _resumed(path, THREAD_COLUMNS, ("m", "seed"), ("kv_type", "threads"), expected.get)
    units = [(m, seed) for m, seed in units if (str(m), str(seed)) not in done]
    for m, seed in track(units, desc="threads", unit="shape", quiet=quiet):
        q, k, v = _inputs("fp32", grid, 1, m, seed)
        golden = golden_output(q, k, v, False)
        for kv in THREAD_KV:
            outs = {}
            for t in grid.threads:
                out = kernels.real("ggml", q, k, v, fmt=FP32, kv_type=kv, threads=t)
                again = kernels.real("ggml", q, k, v, fmt=FP32, kv_type=kv, threads=t)
                outs[t] = out
                one = outs[grid.threads[0]]
                with float64_enabled():
                    ulp = np.asarray(metrics.ulp_distance(out, one, FP32))
                rows.append(
                    dict(
                        zip(
                            THREAD_COLUMNS,
                            (
                                kv,
                                m,
                                t,
                                seed,
                                out.size,
                                int(np.count_nonzero(out != one)),
                                float(np.median(ulp)),
                                int(ulp.max()),
                                float(np.max(np.abs(out - one))),
                                bool(np.array_equal(out, again)),
                                *_errors(out, golden),
                            ),
                        )
                    )
                )
        write(rows)
        check_interrupt()
    return rows


def _measure_identity(grid: EngineGrid, quiet: bool) -> list[dict]:
    rows = []
    for c in track(grid.checks, desc="identity", unit="point", quiet=quiet):
        reason = _unavailable(c.kernel)
        if reason is not None:
            if not quiet:
                print(f"engines: identity {c.kernel} {c.label()}: skipped, {reason}")
            continue
        q, k, v = _inputs(c.fmt, grid, c.n_q, c.m, grid.seeds[0])
        opts = dict(c.options)
        real = kernels.real(c.kernel, q, k, v, fmt=c.fmt, **opts)
        emulated = kernels.emulate(c.kernel, q, k, v, fmt=c.fmt, **opts)
        cmp = kernels.compare(real, emulated, golden_output(q, k, v, False), c.fmt)
        rows.append(
            dict(
                zip(
                    IDENTITY_COLUMNS,
                    (
                        c.kernel,
                        c.label(),
                        c.fmt,
                        c.n_q,
                        c.m,
                        cmp.elements,
                        cmp.identical,
                        cmp.identical_share,
                        cmp.max_ulp,
                    ),
                )
            )
        )
        check_interrupt()
    return rows


def _figure(grid: EngineGrid, summary, thread_summary, out: pathlib.Path) -> pathlib.Path:
    plt = pyplot("fa_jax.studies.engine_figures: plotting")
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), squeeze=False)
    labels = list(dict.fromkeys(r["case"] for r in summary))
    styles = {
        "ggml": "o-",
        "onnxruntime-attention": "s-",
        "onnxruntime-mha": "D-",
        "openvino-sdpa": "^-",
        "fa_jax": "x--",
    }
    for ax, shape, xlabel in (
        (axes[0][0], "decode", "keys M (one query row)"),
        (axes[0][1], "prefill", "N (N queries, N keys)"),
    ):
        for i, label in enumerate(labels):
            pr = [r for r in summary if (r["case"], r["shape"]) == (label, shape)]
            if not pr:
                continue
            ax.plot(
                [r["m"] for r in pr],
                [max(r["mean_rel"], 1e-300) for r in pr],
                styles.get(pr[0]["engine"], "o-"),
                color=plt.get_cmap("tab20")(i % 20),
                label=label,
                ms=4,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape}: mean row relative error vs FP64")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean ||o_i - g_i|| / ||g_i||")
    if summary:  # each panel names its cases; there is room between FP32 and the rest
        for ax in axes[0][:2]:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, ncol=2, loc="center", bbox_to_anchor=(0.5, 0.3))
    ax = axes[0][2]
    for kv in THREAD_KV:
        for j, m in enumerate(sorted({r["m"] for r in thread_summary})):
            pr = [r for r in thread_summary if (r["kv_type"], r["m"]) == (kv, m)]
            if pr:
                ax.semilogx(
                    [r["threads"] for r in pr],
                    [r["mean_rel"] for r in pr],
                    "o-" if kv == "f32" else "s--",
                    color=f"C{j}",
                    label=f"{kv}, M={m}",
                    base=2,
                    ms=4,
                )
    ax.set_yscale("log")
    ax.set_title("ggml split-KV, one query row: error per thread count")
    ax.set_xlabel("threads")
    ax.set_ylabel("mean ||o_i - g_i|| / ||g_i||")
    if thread_summary:
        ax.legend(fontsize=7)
    fig.suptitle(f"Inference engines vs FP64 golden (d={grid.d}, {grid.heads} heads, non-causal)")
    fig.tight_layout()
    png = out / "engines.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _print(grid: EngineGrid, summary, thread_summary, identity) -> None:
    n = len(grid.seeds)
    print_table(
        (
            "case",
            "shape",
            "n_q",
            "m",
            "max_abs",
            "mean_rel",
            "max_abs_fp32in",
            "mean_rel_fp32in",
        ),
        summary,
        title=f"Engines: |out - golden| (golden: FP64 of the same inputs; *_fp32in: of the "
        f"FP32 inputs), d={grid.d}, {grid.heads} heads, mean over {n} seeds",
    )
    if thread_summary:
        print_table(
            (
                "kv_type",
                "m",
                "threads",
                "differing",
                "median_ulp",
                "max_ulp",
                "max_diff",
                "repeat",
                "max_abs",
                "mean_rel",
            ),
            thread_summary,
            title=f"ggml split-KV, one query row: vs threads=1 the share of outputs that "
            f"differ, FP32 ulps (median, max) and max |difference|; whether a rerun repeats "
            f"the bits; error vs FP64; {n} seeds",
        )
    if identity:
        print_table(
            ("kernel", "options", "fmt", "n_q", "m", "identical_share", "max_ulp"),
            identity,
            title=f"Identity: fa_jax's model vs the real kernel (seed {grid.seeds[0]})",
        )


def _thread_summary(rows) -> list[dict]:
    out = []
    for r in mean_over_seeds(rows, ("kv_type", "m", "threads"), ("max_abs", "mean_rel")):
        rs = [
            x
            for x in rows
            if (x["kv_type"], x["m"], x["threads"])
            == tuple(r[f] for f in ("kv_type", "m", "threads"))
        ]
        r["differing"] = sum(x["differing"] for x in rs) / sum(x["elements"] for x in rs)
        r["median_ulp"] = float(np.mean([x["median_ulp"] for x in rs]))
        r["max_ulp"] = max(x["max_ulp"] for x in rs)
        r["max_diff"] = max(x["max_diff"] for x in rs)
        r["repeat"] = all(x["repeat_identical"] for x in rs)
        out.append(r)
    return out


def engines(
    out_dir,
    *,
    quick: bool,
    policies=DEFAULT_POLICIES,
    grid: EngineGrid | None = None,
    quiet: bool = False,
) -> dict:
    """``fa-jax reproduce engines``: :data:`QUICK` or :data:`FULL` (or ``grid``) into
    ``out_dir/engines/`` (module docstring); returns {"figure", "csv", "threads_csv",
    "identity_csv", "png", "grid", "rows", "thread_rows", "identity_rows", "skipped"}."""
    if grid is None:
        grid = dataclasses.replace(QUICK if quick else FULL, presets=tuple(policies))
    if not isinstance(grid, EngineGrid):
        raise TypeError(f"engines: grid: expected an EngineGrid, got {grid!r}")
    paths = {
        "results": "results.csv",
        "threads": "threads.csv",
        "identity": "identity.csv",
    }
    out = check_out_dir(
        pathlib.Path(out_dir) / "engines",
        {
            "results.csv": RESULT_COLUMNS,
            "threads.csv": THREAD_COLUMNS,
            "identity.csv": IDENTITY_COLUMNS,
        },
    )
    out.mkdir(parents=True, exist_ok=True)
    files = {k: out / v for k, v in paths.items()}
    t0 = time.monotonic()
    skipped = {}
    for engine in dict.fromkeys(c.engine for c in engine_cases(grid.presets)):
        reason = _unavailable(engine)
        if reason is not None:
            skipped[engine] = reason
            print(f"engines: {engine} rows skipped: {reason}")
    cases = tuple(c for c in engine_cases(grid.presets) if c.engine not in skipped)
    meta = run_metadata(grid.to_json(), skipped=skipped)
    with float64_enabled():
        results = _measure(
            grid,
            cases,
            quiet,
            lambda rows: write_csv(files["results"], RESULT_COLUMNS, rows),
            files["results"],
        )
        thread_rows = []
        if "ggml" not in skipped:
            thread_rows = _measure_threads(
                grid,
                quiet,
                lambda rows: write_csv(files["threads"], THREAD_COLUMNS, rows),
                files["threads"],
            )
        identity = _measure_identity(grid, quiet)
        write_csv(files["identity"], IDENTITY_COLUMNS, identity)
    meta["platform"] = {
        e: dict(kernels.get(e).platform())
        for e in dict.fromkeys(c.engine for c in cases)
        if e != "fa_jax"
    }
    meta["wall_s"] = time.monotonic() - t0
    write_json(out / "metadata.json", meta)
    summary = mean_over_seeds(
        results,
        ("case", "engine", "fmt", "shape", "n_q", "m"),
        ("max_abs", "mean_rel", "max_abs_fp32in", "mean_rel_fp32in"),
    )
    thread_summary = _thread_summary(thread_rows)
    if not quiet:
        _print(grid, summary, thread_summary, identity)
    png = _figure(grid, summary, thread_summary, out)
    return {
        "figure": "engines",
        "csv": str(files["results"]),
        "threads_csv": str(files["threads"]),
        "identity_csv": str(files["identity"]),
        "png": str(png),
        "grid": grid.to_json(),
        "rows": summary,
        "thread_rows": thread_summary,
        "identity_rows": identity,
        "skipped": skipped,
    }
