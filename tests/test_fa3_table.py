"""fa_jax.studies.fa3_table (FlashAttention-3 Table 3): row definitions, configuration checks,
the files and printed table of a tiny run, the descale order, and the paper's
qualitative FP8 claim at a small size."""

import contextlib
import csv
import io
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa_jax import metrics, ops
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.formats import E4M3FN, FP16, FP32
from fa_jax.inputs import make_inputs
from fa_jax.presets import golden
from fa_jax.quantization import incoherent_transform, quantize_per_tensor
from fa_jax.rounding import round_to
from fa_jax.studies import fa3_table as t3

ROWS = {r.key: r for r in t3.ROWS}
# N=128, d=32 rather than smaller: the FP8 claim below held for each of 20 seeds tried
# there (baseline/FA3 RMSE ratio 1.07 to 1.65) but not at N=64, d=16 (0.83 to 1.59).
TILES = Blocks(32, 32)
TINY = t3.TableConfig(seq_lens=(128,), head_dims=(32,), seeds=(0, 1, 2), tiles=TILES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("fa3")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        res = t3.run_table(TINY, out)
    return out, res, printed.getvalue()


def fp16_inputs(seed, n, d):
    q, k, v = make_inputs(seed, n, batch=1, heads=2, d=d, distribution="outliers")
    return tuple(round_to(jnp.asarray(t), FP16) for t in (q, k, v))


# -- the rows -------------------------------------------------------------------------


def test_rows_are_the_papers_table():
    assert [(r.label, r.published) for r in t3.ROWS] == [
        ("Baseline FP16", 3.2e-4),
        ("FA2 FP16", 1.9e-4),
        ("FA3 FP16", 1.9e-4),
        ("Baseline FP8 (per-tensor)", 2.4e-2),
        ("FA3 FP8 (block + incoherent)", 9.1e-3),
        ("FA3 FP8 no block quant.", 9.3e-3),
        ("FA3 FP8 no incoherent", 2.4e-2),
    ]
    fp8 = [r for r in t3.ROWS if r.quant is not None]
    assert all(r.quant == E4M3FN and r.policy.p == E4M3FN for r in fp8)
    assert [(r.scaling, r.incoherent) for r in fp8] == [
        ("tensor", False),
        ("block", True),
        ("tensor", True),
        ("block", False),
    ]
    assert ROWS["baseline_fp8"].stage_map() == {
        "inputs": "float64",
        "qk_acc": "float32",
        "scores": "float16",
        "stats": "float16",
        "exp": "float16",
        "p": "float8_e4m3fn",
        "pv_acc": "float32",
        "o_acc": "float32",
        "out": "float16",
    }
    assert ROWS["fa3_fp8"].stage_map() == {
        "inputs": "float64",
        "qk_acc": "float32",
        "scores": "float32",
        "stats": "float32",
        "exp": "float32",
        "p": "float8_e4m3fn",
        "pv_acc": "float32",
        "o_acc": "float32",
        "out": "bfloat16",
    }
    # FA3 FP16 keeps FA2's numerics; the rows differ in their tiles only
    assert ROWS["fa2_fp16"].stage_map() == ROWS["fa3_fp16"].stage_map()
    assert t3.TILES["fa2"][128] != t3.TILES["fa3_fp16"][128]
    assert all(t3.TILES["fa3_fp8"][d] == Blocks(128, 128) for d in (64, 128, 256))


def test_p_scaled_format_is_e4m3fn_times_two_to_the_minus_8(x64):
    fmt = next(r for r in t3.ABLATIONS if r.key == "fa3_fp8_p_x256").policy.p
    p = jnp.asarray(np.random.default_rng(0).random(4096) ** 8)  # (0, 1), many tiny values
    scaled = round_to(p * 256.0, E4M3FN) / 256.0
    assert np.array_equal(np.asarray(round_to(p, fmt)), np.asarray(scaled))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"head_dims": (96,)}, "powers of 2"),
        ({"seq_lens": (72,)}, "must divide every seq_len; got seq_len 72"),
        ({"seq_lens": ()}, "non-empty"),
        ({"seeds": (-1,)}, r"TableConfig.seeds: expected non-negative integers, got -1"),
        ({"seeds": (1, 1)}, "seeds: expected distinct entries"),
        ({"heads": 0}, "TableConfig.heads: expected a positive integer, got 0"),
        ({"tiles": None}, "no fa2 tile sizes for d=16"),
    ],
)
def test_config_errors(changes, match):
    kw = {"seq_lens": (64,), "head_dims": (16,), "tiles": Blocks(16, 16)}
    kw.update(changes)
    with pytest.raises(ValueError, match=match):
        t3.TableConfig(**kw)


def test_row_errors():
    with pytest.raises(ValueError, match="quant and scaling go together"):
        t3.Row("r", "r", "reference", golden(), quant=E4M3FN)
    with pytest.raises(ValueError, match="a flash row needs tiles"):
        t3.Row("r", "r", "flash", golden())
    with pytest.raises(ValueError, match="block scaling needs tiles"):
        t3.Row("r", "r", "reference", golden(), quant=E4M3FN, scaling="block")


def test_kernel_tiles_divide_the_full_sweep():
    for row in t3.FULL.rows():  # the FULL config validated itself at import; spot-check
        if row.scaling == "block":
            for d in t3.FULL.head_dims:
                b = t3.row_blocks(row, d, t3.FULL)
                assert all(n % b.br == 0 and n % b.bc == 0 for n in t3.FULL.seq_lens)


# -- a tiny run -----------------------------------------------------------------------


def read(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_tiny_run_writes_every_row(tiny):
    out, res, printed = tiny
    rows = read(res["csv"])
    assert len(rows) == len(t3.ROWS) * len(t3.REFERENCES) * 3
    assert {(r["row"], r["reference"], r["seed"]) for r in rows} == {
        (k, ref, str(s)) for k in ROWS for ref in t3.REFERENCES for s in (0, 1, 2)
    }
    for r in rows:
        assert math.isfinite(float(r["rmse"])) and float(r["rmse"]) > 0
        assert (r["seq_len"], r["d"], r["batch"], r["heads"]) == ("128", "32", "1", "2")
    summary = {(r["row"], r["reference"]): r for r in read(res["summary"])}
    assert {float(r["published"]) for r in summary.values()} == {r.published for r in t3.ROWS}
    mean = {}
    for key, r in summary.items():
        vals = [float(x["rmse"]) for x in rows if (x["row"], x["reference"]) == key]
        mean[key] = float(r["rmse_mean"])
        assert mean[key] == sum(vals) / 3 and r["seeds"] == "3"
        assert (float(r["rmse_min"]), float(r["rmse_max"])) == (min(vals), max(vals))
    ratios = {(r["reference"], r["ratio"]): float(r["measured"]) for r in read(res["ratios"])}
    assert ratios[("draws", "baseline/FA3 FP8")] == (
        mean[("baseline_fp8", "draws")] / mean[("fa3_fp8", "draws")]
    )
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["config"] == TINY.to_json() and len(meta["rows"]) == len(t3.ROWS)
    assert meta["rows"][3]["stages"]["scores"] == "float16"
    assert meta["rows"][4]["tiles"] == {"32": {"br": 32, "bc": 32}}
    for r in t3.ROWS:
        assert r.label in printed
    assert "3.2e-04" in printed and "2.6x" in printed and "closest to the published" in printed


def test_block_and_incoherent_beat_per_tensor_fp8_baseline(tiny):
    """The paper's FP8 claim, qualitatively: for every seed and either reference,
    FA3 FP8 (block quantization + incoherent processing) has a lower RMSE than the
    per-tensor FP8 baseline."""
    by = {(r["row"], r["reference"], r["seed"]): float(r["rmse"]) for r in read(tiny[1]["csv"])}
    for ref in t3.REFERENCES:
        for seed in "012":
            assert by[("fa3_fp8", ref, seed)] < by[("baseline_fp8", ref, seed)]


def test_tiny_run_matches_direct_calls(x64, tiny):
    """The CSV's numbers are those of direct public calls on the same inputs."""
    by = {(r["row"], r["reference"], r["seed"]): float(r["rmse"]) for r in read(tiny[1]["csv"])}
    q, k, v = fp16_inputs(0, 128, 32)
    ref = reference_attention(q, k, v, golden())
    o = flash_attention(q, k, v, ROWS["fa2_fp16"].policy, TILES)[0]
    assert by[("fa2_fp16", "fp16_inputs", "0")] == float(metrics.rmse(o, ref))
    o = t3.row_output(q, k, v, jax.random.key(0), ROWS["fa3_fp8_no_block"], TILES)
    assert by[("fa3_fp8_no_block", "fp16_inputs", "0")] == float(metrics.rmse(o, ref))


@pytest.mark.extended  # 4 s: for the default run's time only
def test_descale_order_changes_the_fp8_rmse_negligibly(x64):
    """Rows descale before the products (exact x̂·s operands); a kernel multiplies
    fl32(Q̂ K̂ᵀ) by fl32(s_q s_k / √d) and the output by s_v.  Measured here on the
    per-tensor FA3 row: the RMSE moves by far less than 1% of itself."""
    row, d = ROWS["fa3_fp8_no_block"], 32
    q, k, v = fp16_inputs(0, 128, d)
    key = jax.random.key(0)
    ref = reference_attention(q, k, v, golden())
    o_rows = t3.row_output(q, k, v, key, row, TILES)
    qi, ki = incoherent_transform(q, k, key)
    (qh, sq), (kh, sk), (vh, sv) = (quantize_per_tensor(t, E4M3FN) for t in (qi, ki, v))
    descale = ops.mul(ops.mul(sq, sk, FP32), round_to(jnp.float64(1 / math.sqrt(d)), FP32), FP32)
    o32 = flash_attention(qh, kh, vh, row.policy.replace(out=FP32), TILES, scale=descale)[0]
    o_kernel = ops.mul(o32, sv, row.policy.out)
    e_rows, e_kernel = float(metrics.rmse(o_rows, ref)), float(metrics.rmse(o_kernel, ref))
    assert abs(e_kernel - e_rows) <= 1e-2 * e_rows
    assert float(metrics.rmse(o_rows, o_kernel)) <= 1e-2 * e_rows


# -- the command ------------------------------------------------------------------------


def test_reproduce_routes_fa3_table_and_all_stays_figures(monkeypatch, tmp_path, capsys):
    from fa_jax.cli import main
    from fa_jax.studies import reproduce

    calls = []

    def fake(out_dir, *, quick, quiet=False, ablations=False):
        calls.append((str(out_dir), quick))
        return {"figure": "fa3-table", "csv": "results.csv"}

    monkeypatch.setattr(t3, "fa3_table", fake)
    assert main(["reproduce", "fa3-table", "--quick", "--out", str(tmp_path)]) == 0
    assert calls == [(str(tmp_path), True)]
    assert capsys.readouterr().out.strip() == "fa3-table: results.csv"
    assert main(["reproduce", "fa3-table", "--policy", "torch_math"]) == 2
    assert "--policy: fa3-table's rows fix their own policies" in capsys.readouterr().err
    assert "fa3-table" not in reproduce.FIGURES and len(calls) == 1
