"""fa_jax.studies.attribution and `fa-jax attribute`.

Every attribution here runs the same tiny configuration (N=32, d=8, 8x8 tiles,
one seed), so its jitted programs compile once per stack size and are shared by
the tests (the file takes about 25 s on a 2-core CPU).
"""

import csv
import math

import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import BF16, FP16, FP64, Blocks, fa2_kernel, golden, metrics, paper_uniform
from fa_jax.attention import flash_attention, reference_attention
from fa_jax.cli import main
from fa_jax.inputs import make_inputs
from fa_jax.policy import STAGES
from fa_jax.rounding import round_to
from fa_jax.studies.attribution import (
    ATTRIBUTION_METRICS,
    CSV_COLUMNS,
    FORWARD_STAGES,
    KINDS,
    Attribution,
    AttributionConfig,
    attribute,
    variants,
    write_csv,
)

TINY = {"seq_len": 32, "d": 8, "blocks": Blocks(8, 8), "seeds": (0,)}


def _all_zero(res: Attribution):
    for kind in KINDS:
        for m in ATTRIBUTION_METRICS:
            assert res.deviation(kind, "full", metric=m) == 0.0
            for s in FORWARD_STAGES:
                for direction in ("raised", "lowered"):
                    assert res.deviation(kind, direction, s, m) == 0.0
                    assert res.share(kind, direction, s, m) == 0.0


def test_forward_stages_are_policy_stages():
    assert len(FORWARD_STAGES) == 9 and set(FORWARD_STAGES) <= set(STAGES)


@pytest.mark.parametrize(
    "policy",
    [
        golden(),
        paper_uniform(BF16).replace(**{s: FP64 for s in FORWARD_STAGES}),
    ],
    ids=["golden", "every_stage_raised"],
)
def test_fp64_policies_deviate_by_nothing(policy):
    """golden, and a policy with every forward stage raised to FP64, give exactly
    zero deviation and zero shares (traced-width FP64 runs equal golden bitwise)."""
    res = attribute(AttributionConfig(policy, **TINY))
    _all_zero(res)
    assert set(variants(policy)) == {("full", "")}


@pytest.mark.parametrize("stage", ["stats", "o_acc"])
def test_one_lowered_stage_takes_everything(stage):
    """golden with one stage in BF16: raising it removes all deviation (share 100%),
    lowering it alone reproduces all of it; every other stage has share 0."""
    policy = golden().replace(**{stage: BF16})
    res = attribute(AttributionConfig(policy, **TINY))
    assert set(variants(policy)) == {("full", ""), ("raised", stage), ("lowered", stage)}
    for kind in KINDS:
        full = res.deviation(kind, "full")
        if kind == "reference" and stage == "o_acc":  # the reference never reads o_acc
            assert full == 0.0
            continue
        assert full > 0
        assert res.deviation(kind, "raised", stage) == 0.0
        assert res.deviation(kind, "lowered", stage) == full
        assert res.share(kind, "raised", stage) == 1.0 == res.share(kind, "lowered", stage)
        for s in FORWARD_STAGES:
            if s != stage:
                assert res.share(kind, "raised", s) == 0.0 == res.share(kind, "lowered", s)
        assert res.share_sum(kind, "raised") == 1.0 == res.share_sum(kind, "lowered")


def test_exact_inputs_attribute_storage_to_the_inputs_stage():
    """inputs="exact": golden starts from the float64 draws, so storing Q, K, V in
    BF16 is a deviation, all of it the inputs stage's."""
    policy = golden().replace(inputs=BF16)
    rounded = attribute(AttributionConfig(policy, **TINY))
    exact = attribute(AttributionConfig(policy, inputs="exact", **TINY))
    _all_zero(rounded)
    for kind in KINDS:
        assert exact.deviation(kind, "full") > 0
        assert exact.share(kind, "raised", "inputs") == 1.0
        assert exact.share(kind, "lowered", "inputs") == 1.0


def _direct(kind, q, k, v, policy):
    if kind == "flash":
        return np.asarray(flash_attention(q, k, v, policy, TINY["blocks"])[0])
    return np.asarray(reference_attention(q, k, v, policy))


@pytest.mark.extended  # 14 s
def test_paper_uniform_matches_direct_calls_and_writes_rows(tmp_path):
    """The stacked, jitted runs equal direct calls of the attention functions with
    the static policies, bitwise; every forward stage has its rows."""
    policy = paper_uniform(BF16)
    res = attribute(AttributionConfig(policy, **TINY))
    with x64_enabled():
        q, k, v = (round_to(np.asarray(t), BF16) for t in make_inputs(0, 32, d=8))
        golds = {kind: _direct(kind, q, k, v, golden()) for kind in KINDS}
        for kind, direction, stage, pol in (
            ("flash", "full", "", policy),
            ("reference", "full", "", policy),
            ("flash", "raised", "o_acc", policy.replace(o_acc=FP64)),
            ("reference", "lowered", "stats", golden().replace(stats=BF16)),
        ):
            o = _direct(kind, q, k, v, pol)
            for m in ATTRIBUTION_METRICS:
                want = float(getattr(metrics, m)(o, golds[kind]))
                assert res.deviation(kind, direction, stage, m) == want, (kind, stage, m)
    for kind in KINDS:
        assert res.deviation(kind, "full") > 0
    # the reference never reads o_acc; flash's running accumulator does
    assert res.deviation("reference", "lowered", "o_acc") == 0.0
    assert res.deviation("reference", "raised", "o_acc") == res.deviation("reference", "full")
    assert res.deviation("flash", "lowered", "o_acc") > 0

    rows = res.rows()
    per_stage = {(r["kind"], r["direction"], r["metric"]): [] for r in rows}
    for r in rows:
        per_stage[(r["kind"], r["direction"], r["metric"])].append(r["stage"])
    for kind in KINDS:
        for m in ATTRIBUTION_METRICS:
            assert per_stage[(kind, "full", m)] == [""]
            for direction in ("raised", "lowered"):
                assert per_stage[(kind, direction, m)] == list(FORWARD_STAGES)
    path = write_csv(res, tmp_path / "a.csv")
    with open(path, newline="") as fh:
        back = list(csv.DictReader(fh))
    assert tuple(back[0]) == CSV_COLUMNS and len(back) == len(rows)
    r = next(
        r
        for r in back
        if r["kind"] == "flash"
        and r["direction"] == "raised"
        and r["stage"] == "stats"
        and r["metric"] == "max_abs_diff"
    )
    assert float(r["deviation"]) == res.deviation("flash", "raised", "stats")
    assert float(r["share"]) == res.share("flash", "raised", "stats")

    table = res.table()
    for s in FORWARD_STAGES:
        assert f"\n{s} " in table
    assert table.count("sum of shares") == 2 and "need not sum to 100%" in table


def test_shares_of_a_zero_deviation():
    cfg = AttributionConfig(golden(), **TINY)
    devs = {
        ("flash", "full", "", "max_abs_diff"): 0.0,
        ("flash", "raised", "exp", "max_abs_diff"): 0.0,
        ("flash", "lowered", "exp", "max_abs_diff"): 1e-3,
    }
    res = Attribution(cfg, devs, 0.0)
    assert res.share("flash", "raised", "exp") == 0.0
    assert math.isnan(res.share("flash", "lowered", "exp"))
    with pytest.raises(ValueError, match="direction"):
        res.share("flash", "full", "exp")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"seq_len": 0}, "seq_len: expected a positive integer, got 0"),
        ({"variant": "fa3"}, "variant: expected one of"),
        ({"seeds": ()}, "seeds: expected distinct entries"),
        ({"seeds": (0, -1)}, "seeds: expected non-negative integers"),
        ({"kinds": ("flash", "pytorch")}, "kinds: expected one of"),
        ({"inputs": "raw"}, "inputs: expected one of"),
        ({"distribution": "cauchy"}, "distribution: expected one of"),
        ({"blocks": (8, 8)}, r"blocks: expected Blocks\(br, bc\)"),
        (
            {"seq_len": 16, "blocks": Blocks(8, 32)},
            r"blocks: Blocks\(br=8, bc=32\) gives br=8, bc=32; expected both <= the seq_len 16",
        ),
        ({"seq_len": 16, "blocks": Blocks(17, 8)}, "blocks: .* expected both <= the seq_len 16"),
    ],
)
def test_config_errors_name_the_field(kw, match):
    with pytest.raises((ValueError, TypeError), match=f"AttributionConfig.{match}"):
        AttributionConfig(fa2_kernel(FP16), **kw)
    with pytest.raises(TypeError, match="expected a Policy"):
        AttributionConfig("paper_uniform")


@pytest.mark.extended  # about 14 s
def test_cli_attribute_prints_table_and_writes_files(tmp_path, capsys):
    assert (
        main(
            [
                "attribute",
                "--n",
                "32",
                "--d",
                "8",
                "--bc",
                "8",
                "--seeds",
                "0",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "raise one stage to FP64" in out and "lower one stage from FP64" in out
    assert "paper_uniform(bfloat16)" in out and "o_acc" in out
    with open(tmp_path / "attribution.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["direction"] for r in rows} == {"full", "raised", "lowered"}
    with open(tmp_path / "attribution.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--n", "x"], "--n: expected an integer"),
        (["--bc", "0"], "--bc: expected a positive integer"),
        (["--br", "0"], "--br: expected a positive integer"),
        (["--policy", "fast"], "--policy: unknown policy"),
        (["--format", "bf17"], "--format: unknown format"),
        (["--variant", "fa9"], "--variant: expected one of"),
        (["--seeds", "a"], "--seeds: expected integers"),
        (["--metric", "rmse"], "--metric: expected one of"),
    ],
)
def test_cli_attribute_bad_arguments_exit_2_in_one_line(argv, flag, capsys):
    assert main(["attribute", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fa-jax attribute: {flag}") and "\n" not in err
