"""fa_jax.studies.sweep: grid validation, bitwise agreement with direct calls on the same
inputs, atomic/resumable CSV output, multi-device sharding."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import csv_has_rows, skip_unmodelled

from fa_jax import metrics
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.formats import custom, get_format
from fa_jax.inputs import make_inputs
from fa_jax.presets import golden, paper_uniform
from fa_jax.rounding import round_to
from fa_jax.studies.options import study_options
from fa_jax.studies.sweep import (
    COLUMNS,
    COMPARISONS,
    METRICS,
    Grid,
    SramBlocks,
    run_sweep,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# SramBlocks(128) at d=8: Bc = ceil(128 / 32) = 4, Br = min(4, 8) = 4.
GRID_SRC = (
    "Grid(formats=('bf16', (5, 4)), seq_lens=(16, 24), blocks=(Blocks(8, 8), SramBlocks(128)),"
    " variants=('fa2', 'fa1'), seeds=(0, 1), d=8)"
)
# A sub-grid for the multi-device run: 8 configurations over 3 devices (padded to 9).
SMALL_SRC = GRID_SRC.replace(" SramBlocks(128)", "").replace("('fa2', 'fa1')", "('fa1',)")
GRID = eval(GRID_SRC)  # the same text runs in the subprocesses below


def read_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def as_set(rows):
    return {tuple(r[c] for c in COLUMNS) for r in rows}


@pytest.fixture(scope="module")
def sweep_csv(tmp_path_factory):
    return run_sweep(GRID, tmp_path_factory.mktemp("sweep"), quiet=True)


# -- validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"formats": ()}, "Grid.formats"),
        ({"seq_lens": ()}, "Grid.seq_lens"),
        ({"seq_lens": (0, 16)}, "Grid.seq_lens"),
        ({"seq_lens": (16, -1)}, "Grid.seq_lens"),
        ({"d": 0}, "Grid.d"),
        ({"batch": -2}, "Grid.batch"),
        ({"heads": 0}, "Grid.heads"),
        ({"seeds": (-1,)}, "Grid.seeds"),
        ({"formats": ("bf17",)}, "bf17"),
        ({"formats": ((8,),)}, "Grid.formats"),
        ({"policies": ("golden_ish",)}, "Grid.policies"),
        ({"variants": ("fa3",)}, "Grid.variants"),
        ({"distribution": "cauchy"}, "Grid.distribution"),
        ({"blocks": (Blocks(32, 8),)}, "Grid.blocks"),
        ({"blocks": (Blocks(8, 32),)}, "Grid.blocks"),
        ({"blocks": (SramBlocks(4096),)}, "Grid.blocks"),
        ({"blocks": ()}, "Grid.blocks"),
        ({"formats": ("bf16", "bfloat16")}, "Grid.formats"),
    ],
)
def test_grid_validation_names_field(changes, field):
    kwargs = {"formats": ("bf16",), "seq_lens": (16, 24), "blocks": (Blocks(8, 8),), "d": 8}
    kwargs.update(changes)
    with pytest.raises(ValueError, match=field):
        Grid(**kwargs)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"blocks": ((8, 8),)}, "Grid.blocks"),
        ({"seeds": 3}, "Grid.seeds"),
        ({"variants": "fa2"}, "Grid.variants"),
    ],
)
def test_grid_type_errors(changes, field):
    kwargs = {"formats": ("bf16",), "seq_lens": (16,), "blocks": (Blocks(8, 8),), "d": 8}
    kwargs.update(changes)
    with pytest.raises(TypeError, match=field):
        Grid(**kwargs)


def test_grid_block_error_names_value_and_expectation():
    with pytest.raises(ValueError, match=r"bc=32.*largest seq_len 24"):
        Grid(formats=("bf16",), seq_lens=(16, 24), blocks=(Blocks(8, 32),), d=8)


def test_sram_blocks_resolve_and_validate():
    assert SramBlocks(128).resolve(8) == Blocks(4, 4)
    assert SramBlocks(1024).resolve(8) == Blocks(8, 32)
    assert SramBlocks(1024, swap=True).resolve(8) == Blocks(32, 8)
    assert SramBlocks(1024, square=True).resolve(8) == Blocks(32, 32)
    with pytest.raises(ValueError, match="sram_elems"):
        SramBlocks(0)
    with pytest.raises(ValueError, match="swap or square"):
        SramBlocks(64, swap=True, square=True)


def test_grid_accepts_format_kinds():
    g = Grid(formats=("bf16", get_format("e4m3fn"), (5, 4)), seq_lens=[16], blocks=[Blocks(4, 4)])
    assert [f.name for f in g.resolved_formats()] == ["bfloat16", "float8_e4m3fn", "e5m4"]
    assert isinstance(g.seq_lens, tuple)
    json.dumps(g.to_json())


# -- results ----------------------------------------------------------------------


def test_csv_equals_its_stored_snapshot(sweep_csv):
    """Byte for byte the CSV the engine wrote before its compile-time work (metadata
    aside): batching, caching and compiling ahead change no value."""
    with open(os.path.join(REPO, "tests", "data", "sweep_snapshot.csv"), "rb") as fh:
        assert sweep_csv.read_bytes() == fh.read()


def test_csv_complete_and_duplicate_free(sweep_csv):
    rows = read_rows(sweep_csv)
    assert tuple(rows[0]) == COLUMNS
    n_cfg = 2 * 2 * 2 * 2 * 2  # formats × seq_lens × blocks × variants × seeds
    assert len(rows) == n_cfg * len(COMPARISONS) * len(METRICS)
    assert len(as_set(rows)) == len(rows)
    assert {r["blocks"] for r in rows} == {"8x8", "sram128"}
    assert {(r["format"], r["exp_bits"], r["man_bits"]) for r in rows} == {
        ("bfloat16", "8", "7"),
        ("e5m4", "5", "4"),
    }
    meta = json.loads((sweep_csv.parent / "metadata.json").read_text())
    assert meta["config"] == GRID.to_json() and meta["device_count"] >= 1
    for k in (
        "fa_jax",
        "jax",
        "jaxlib",
        "ml_dtypes",
        "numpy",
        "backend",
        "device_kind",
        "command",
        "start_time",
    ):
        assert k in meta
    # Sanity: FP64 golden vs low precision deviates, but only a little.
    vals = [float(r["value"]) for r in rows if r["metric"] == "max_abs_diff"]
    assert all(0 <= v < 0.5 for v in vals)


@pytest.mark.parametrize(
    "fmt, n, blocks_label, blocks, variant, seed",
    [("bf16", 24, "8x8", Blocks(8, 8), "fa2", 1), ((5, 4), 16, "sram128", Blocks(4, 4), "fa1", 0)],
)
def test_sweep_equals_direct_calls_bitwise(
    x64, sweep_csv, fmt, n, blocks_label, blocks, variant, seed
):
    f = custom(*fmt) if isinstance(fmt, tuple) else get_format(fmt)
    pol = paper_uniform(f)
    q, k, v = make_inputs(seed, n, d=8)
    flash = flash_attention(q, k, v, pol, blocks, variant=variant)[0]
    base = reference_attention(q, k, v, pol)
    gold = reference_attention(*(round_to(t, f) for t in (q, k, v)), golden())
    outs = {"flash": flash, "baseline": base, "golden": gold}
    want = {}
    for comp in COMPARISONS:
        a, b = comp.split("_vs_")
        for m in METRICS:
            want[(comp, m)] = float(getattr(metrics, m)(outs[a], outs[b]))
    got = {
        (r["comparison"], r["metric"]): float(r["value"])
        for r in read_rows(sweep_csv)
        if (r["format"], r["seq_len"], r["blocks"], r["variant"], r["seed"])
        == (f.name, str(n), blocks_label, variant, str(seed))
    }
    assert got == want  # bitwise: repr round-trips
    assert got[("flash_vs_golden", "max_abs_diff")] > 0


@pytest.mark.extended  # for the default run's time only
def test_lengths_far_apart_share_flash_programs_and_equal_direct_calls(x64, tmp_path):
    """Flash programs pad lengths up to 8x apart (they skip the key blocks past a
    configuration's length; the reference programs keep 2x buckets), and every
    row still equals unpadded direct calls; kernel models, whose policies change
    with the length, keep the reference buckets."""
    from fa_jax.studies.sweep.batch import chunks_of, flash_chunks_of

    g = Grid(formats=("bf16",), seq_lens=(8, 20), blocks=(Blocks(8, 8),), d=8)
    assert chunks_of(g, True) == [(8,), (20,)]
    assert flash_chunks_of(g, True) == [(8, 20)]
    rows = read_rows(run_sweep(g, tmp_path, quiet=True))
    pol = paper_uniform("bf16")
    for n in g.seq_lens:
        q, k, v = make_inputs(0, n, d=8)
        outs = {
            "flash": flash_attention(q, k, v, pol, Blocks(8, 8))[0],
            "baseline": reference_attention(q, k, v, pol),
            "golden": reference_attention(*(round_to(t, "bf16") for t in (q, k, v)), golden()),
        }
        got = {
            (r["comparison"], r["metric"]): float(r["value"])
            for r in rows
            if r["seq_len"] == str(n)
        }
        want = {}
        for comp in COMPARISONS:
            a, b = comp.split("_vs_")
            want.update({(comp, m): float(getattr(metrics, m)(outs[a], outs[b])) for m in METRICS})
        assert got == want, n
    skip_unmodelled("xla", "bf16")  # a kernel grid's policies are its model's
    kernel = Grid(
        formats=("bf16",), seq_lens=(32, 512), blocks=(Blocks(8, 8),), d=8, policies=("kernel:xla",)
    )
    assert flash_chunks_of(kernel, True) == chunks_of(kernel, True) == [(32,), (512,)]


def test_causal_sweep_equals_direct_call(x64, tmp_path):
    # Two tilings with the same Bc share one flash run in the sweep (Br does not
    # change the numbers); each label must still equal its own direct call.
    g = Grid(
        formats=("fp16",),
        seq_lens=(16, 24),
        blocks=(Blocks(8, 8), Blocks(2, 8)),
        seeds=(2,),
        d=8,
        causal=True,
        distribution="outliers",
        policies=("fa2_kernel",),
    )
    rows = read_rows(run_sweep(g, tmp_path, quiet=True))
    assert len(rows) == 2 * 2 * len(COMPARISONS) * len(METRICS)
    from fa_jax.presets import fa2_kernel

    q, k, v = make_inputs(2, 16, d=8, distribution="outliers")
    gold = reference_attention(*(round_to(t, "fp16") for t in (q, k, v)), golden(), causal=True)
    for label, blocks in (("8x8", Blocks(8, 8)), ("2x8", Blocks(2, 8))):
        flash = flash_attention(q, k, v, fa2_kernel("fp16"), blocks, causal=True)[0]
        got = {
            r["metric"]: float(r["value"])
            for r in rows
            if r["seq_len"] == "16"
            and r["blocks"] == label
            and r["comparison"] == "flash_vs_golden"
        }
        assert got == {m: float(getattr(metrics, m)(flash, gold)) for m in METRICS}


def test_rerun_skips_everything(sweep_csv, tmp_path):
    import shutil

    shutil.copy(sweep_csv, tmp_path / "results.csv")
    before = (tmp_path / "results.csv").read_bytes()
    run_sweep(GRID, tmp_path, quiet=True)
    assert (tmp_path / "results.csv").read_bytes() == before


# -- subprocesses: kill + resume, multiple devices -----------------------------------


def _script(out_dir, grid_src=GRID_SRC, memory_budget=None, carrier="float64"):
    budget = "" if memory_budget is None else f", memory_budget={memory_budget}"
    return (
        "import jax\n"
        "from fa_jax.attention import Blocks\n"
        "from fa_jax.studies.options import study_options\n"
        "from fa_jax.studies.sweep import Grid, SramBlocks, run_sweep\n"
        f"with study_options(carrier={carrier!r}):\n"
        f"    run_sweep({grid_src}, {str(out_dir)!r}{budget})\n"
        "print(len(jax.devices()))\n"
    )


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_killed_sweep_resumes_to_the_same_rows(sweep_csv, tmp_path, capfd):
    # Killed once its first group's rows are on disk (polled, not timed), then resumed
    # in this process, which already holds the compiled programs of `sweep_csv`.
    out = tmp_path / "out"
    csv_path = out / "results.csv"
    with open(tmp_path / "stderr.txt", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _script(out)], env=_env(), stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            deadline = time.monotonic() + 300
            waiting = lambda: proc.poll() is None and time.monotonic() < deadline  # noqa: E731
            while not csv_has_rows(csv_path) and waiting():
                time.sleep(0.02)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        err.seek(0)
        child = f"child exit status {proc.returncode}, stderr:\n{err.read()}"
    assert csv_has_rows(csv_path), child
    partial, full = csv_path.read_bytes(), sweep_csv.read_bytes()
    assert len(partial) < len(full), f"the kill should land before the last group; {child}"
    assert full.startswith(partial), child  # whole groups only, in the uninterrupted order
    leftovers = [p for p in out.iterdir() if p.name not in ("results.csv", "metadata.json")]
    assert leftovers == [] or all(p.name.endswith(".tmp") for p in leftovers), child
    capfd.readouterr()
    run_sweep(GRID, out)
    assert capfd.readouterr().err == ""  # no progress line when stderr is not a TTY
    assert csv_path.read_bytes() == full


# Per configuration of SMALL at N = 24, d = 8, the sweep estimates 3·8·24² bytes for
# golden/baseline and 3·8·24·(8 + 8) for flash: this budget makes pieces of 3 and 4
# configurations, so pieces, padding and device sharding all meet in one run.
SMALL_BUDGET = 3 * (3 * 8 * 24 * 24)


@pytest.mark.extended  # 7 s per carrier: three device processes
@pytest.mark.parametrize("carrier", ["float64", pytest.param("float32", marks=pytest.mark.slow)])
def test_three_devices_equal_single_device(sweep_csv, tmp_path, carrier):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3"
    done = subprocess.run(
        [sys.executable, "-c", _script(tmp_path, SMALL_SRC, SMALL_BUDGET, carrier)],
        env=_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=180 if carrier == "float64" else 900,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "3"
    sharded = as_set(read_rows(tmp_path / "results.csv"))
    assert len(sharded) == 8 * len(COMPARISONS) * len(METRICS)
    assert sharded <= as_set(read_rows(sweep_csv))


def test_length_buckets_bound_the_padding():
    from fa_jax.studies.sweep import length_buckets

    assert length_buckets([1024, 128, 256, 512]) == [(128, 256), (512, 1024)]
    assert length_buckets([16, 24]) == [(16, 24)]
    assert length_buckets([100, 150, 199, 300, 401]) == [(100, 150, 199), (300, 401)]
    for bucket in length_buckets(range(1, 200, 7)):
        assert max(bucket) <= 2 * min(bucket)


@pytest.mark.slow
def test_float32_carrier_gives_the_same_rows(sweep_csv, tmp_path):
    """Flash runs on float32 carriers (no 64-bit type): every row as on float64."""
    with study_options(carrier="float32"):
        rows = as_set(read_rows(run_sweep(eval(SMALL_SRC), tmp_path, quiet=True)))
    assert len(rows) == 8 * len(COMPARISONS) * len(METRICS)
    assert rows <= as_set(read_rows(sweep_csv))


def test_memory_budget_pieces_equal_one_call(sweep_csv, tmp_path):
    rows = as_set(read_rows(run_sweep(eval(SMALL_SRC), tmp_path, quiet=True, memory_budget=1)))
    assert len(rows) == 8 * len(COMPARISONS) * len(METRICS)
    assert rows <= as_set(read_rows(sweep_csv))
    with pytest.raises(ValueError, match="memory_budget"):
        run_sweep(GRID, tmp_path, memory_budget=0)
