"""The feature studies (fa_jax.studies.feature_figures): a shrunken grid runs end to
end, and each row of the table is the mean over seeds of the CSV's rows of its
configuration."""

import csv

import pytest

from fa_jax.attention import Blocks
from fa_jax.studies.feature_figures import features
from fa_jax.studies.sweep import Features


@pytest.mark.extended  # 7 s; the features axis itself runs by default
def test_features_rows_are_the_csv_means(tmp_path):
    overrides = dict(
        formats=("bf16",),
        seq_lens=(32,),
        blocks=(Blocks(16, 16),),
        heads=2,
        seeds=(0, 1),
        features=(Features(), Features(kv_heads=1, alibi=True)),
    )
    res = features(
        tmp_path, quick=True, policies=("fa2_kernel",), grid_overrides=overrides, quiet=True
    )
    with open(res["csv"]) as fh:
        rows = list(csv.DictReader(fh))
    assert {r["features"] for r in rows} == {"none", "kv_heads=1+alibi"}
    assert len(res["rows"]) == 2
    for row in res["rows"]:
        for comp in ("flash_vs_golden", "baseline_vs_golden"):
            values = [
                float(r["value"])
                for r in rows
                if (r["features"], r["comparison"], r["metric"])
                == (row["features"], comp, "max_abs_diff")
            ]
            assert len(values) == 2
            assert row[comp] == (values[0] + values[1]) / 2
        assert row["ratio"] == row["flash_vs_golden"] / row["baseline_vs_golden"]
    assert (tmp_path / "features" / "features.png").stat().st_size > 0
