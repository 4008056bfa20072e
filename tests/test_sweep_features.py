"""Sweep axes for attention features (fa_jax.studies.sweep.features): every row of
a grid with GQA, a window, a softcap with ALiBi and a decoding shape equals direct
calls of the attention with those features, bit for bit; labels round-trip; a
feature that does not fit the grid is refused before any work."""

import csv

import numpy as np
import pytest

from fa_jax import metrics
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.inputs import make_inputs
from fa_jax.presets import fa2_kernel, golden
from fa_jax.rounding import round_to
from fa_jax.score_mods import alibi_bias, alibi_slopes
from fa_jax.studies.sweep import COMPARISONS, METRICS, Features, Grid, run_sweep

HEADS, D = 4, 8
# The paper's attention (Features()) is every other sweep test's.
ENTRIES = (
    Features(kv_heads=2, softcap=5.0, alibi=True, kv="e4m3fn", kv_scaling="head"),
    Features(window=(4, 0), num_splits=2),
    Features(queries=1),
)
PRESET = "fa2_kernel"  # other sweep tests cover the presets; these, the features


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    grid = Grid(
        formats=("bf16",),
        seq_lens=(16, 24),
        blocks=(Blocks(8, 8),),
        heads=HEADS,
        d=D,
        features=ENTRIES,
        policies=(PRESET,),
    )
    with open(run_sweep(grid, tmp_path_factory.mktemp("features"), quiet=True)) as fh:
        return list(csv.DictReader(fh))


def direct(feat: Features, n: int):
    """flash, baseline and golden by direct calls, with the entry's features
    written out here (not through Features.attention_kwargs); the KV cache is the
    policies', not the golden's."""
    q, k, v = make_inputs(0, n, heads=HEADS, d=D)
    if feat.queries is not None:
        q = q[..., : feat.queries, :]
    if feat.kv_heads is not None:
        k, v = k[:, : feat.kv_heads], v[:, : feat.kv_heads]
    kw = dict(window=feat.window, softcap=feat.softcap)
    if feat.alibi:
        kw["bias"] = alibi_bias(alibi_slopes(HEADS), q.shape[-2], n)
    pol = fa2_kernel("bf16")
    if feat.kv is not None:
        pol = pol.replace(kv=feat.kv, kv_scaling=feat.kv_scaling)
    rounded = [round_to(t, "bf16") for t in (q, k, v)]
    return {
        "flash": flash_attention(q, k, v, pol, Blocks(8, 8), num_splits=feat.num_splits, **kw)[0],
        "baseline": reference_attention(q, k, v, pol, **kw),
        "golden": reference_attention(*rounded, golden(), **kw),
    }


@pytest.mark.extended  # the module's sweep: about 30 s of CPU
@pytest.mark.parametrize("feat", ENTRIES, ids=lambda f: f.label())
def test_rows_equal_direct_calls_bitwise(x64, rows, feat):
    """At the shorter length, padded in the sweep to the longer one (split-KV's
    flash runs unpadded: its boundaries follow the key axis)."""
    outs = direct(feat, 16)
    got = {
        (r["comparison"], r["metric"]): float(r["value"])
        for r in rows
        if (r["features"], r["seq_len"]) == (feat.label(), "16")
    }
    want = {}
    for comp in COMPARISONS:
        a, b = comp.split("_vs_")
        want.update({(comp, m): float(getattr(metrics, m)(outs[a], outs[b])) for m in METRICS})
    assert got == want


@pytest.mark.extended  # shares the sweep above
def test_every_entry_changes_the_numbers(rows):
    """Each feature reaches the computation: no two entries give the same golden
    deviation column."""
    by_label = {}
    for r in rows:
        if r["comparison"] == "flash_vs_golden" and r["metric"] == "rmse":
            by_label.setdefault(r["features"], []).append(r["value"])
    assert len(by_label) == len(ENTRIES)
    assert len({tuple(v) for v in by_label.values()}) == len(ENTRIES)


@pytest.mark.parametrize(
    "feat",
    [
        *ENTRIES,
        Features(),
        Features(kv_heads=1, window=(-1, 3), softcap=2.5, alibi=True, num_splits=2),
        Features(kv="int8", kv_scaling="token"),
    ],
    ids=lambda f: f.label(),
)
def test_labels_round_trip(feat):
    assert Features.from_label(feat.label()) == feat


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(features=(Features(kv_heads=3),)), r"kv_heads.*divisor of the grid's heads 4, got 3"),
        (dict(features=(Features(queries=1),), causal=True), r"queries.*without causal"),
        (dict(features=(Features(num_splits=3),)), r"num_splits.*at most.*\(2\), got 3"),
        (dict(features=(Features(), Features())), r"Grid.features: expected distinct"),
    ],
)
def test_bad_entries_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Grid(formats=("bf16",), seq_lens=(16,), blocks=(Blocks(8, 8),), heads=4, d=8, **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(window=(-2, 0)), r"Features: window.*-1 \(unbounded\).*got \(-2, 0\)"),
        (dict(softcap=0.0), r"Features: softcap"),
        (dict(num_splits=0), r"Features.num_splits"),
        (dict(kv_heads=0), r"Features.kv_heads"),
        (dict(queries=1, window=(2, 0)), r"no window with queries"),
        (dict(kv="int8"), r"Features: Policy.kv_scaling: an integer cache"),
    ],
)
def test_bad_features_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Features(**kw)


def test_bad_labels_name_the_part():
    with pytest.raises(ValueError, match=r"got 'heads=2'"):
        Features.from_label("alibi+heads=2")
    with pytest.raises(TypeError, match=r"Grid\.features: expected Features"):
        Grid(formats=("bf16",), seq_lens=(16,), blocks=(Blocks(8, 8),), features=("alibi",))


def test_cli_names_the_bad_entry(tmp_path, capsys):
    from fa_jax.cli import main

    base = ["sweep", "--formats", "bf16", "--seq-lens", "16", "--blocks", "8x8", "--d", "8"]
    out = str(tmp_path / "out")
    assert main([*base, "--heads", "2", "--features", "none", "kv_heads=3", "--out", out]) == 2
    assert "--features: kv_heads: expected a divisor of the grid's heads 2, got 3" in (
        capsys.readouterr().err
    )
    assert main([*base, "--features", "none,heads=3", "--out", out]) == 2
    assert "--features: heads=3: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_decoding_reads_only_the_first_query_rows():
    q, k, v = (np.arange(2 * 4 * 6 * 2.0).reshape(2, 4, 6, 2) + i for i in range(3))
    fq, fk, fv = Features(queries=2, kv_heads=2).inputs(q, k, v)
    assert fq.shape == (2, 4, 2, 2) and fk.shape == fv.shape == (2, 2, 6, 2)
    np.testing.assert_array_equal(fq, q[:, :, :2])
    np.testing.assert_array_equal(fk, k[:, :2])
