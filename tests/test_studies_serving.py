"""The serving study (fa_jax.studies.serving): its step sampling, its FP64 golden,
its bucketed preset programs (the bits of direct N = 1, M = t calls, jitted and
eager), and a shrunken decode run end to end: rows per case, feature and step,
the combinations a kernel refuses listed, identity, resume."""

import csv
import dataclasses
import json

import jax
import numpy as np
import pytest

from fa_jax._x64 import float64_enabled
from fa_jax.attention import flash_attention, reference_attention
from fa_jax.formats import get_format
from fa_jax.kernels.ggml import attention as ggml_attention
from fa_jax.presets import PRESETS, golden
from fa_jax.score_mods import alibi_bias, alibi_slopes
from fa_jax.studies import serving as sv
from fa_jax.studies.serving import (
    ALIBI_MAX_BIAS,
    FEATURES,
    PRESET_BLOCKS,
    Feature,
    ServingCheck,
    ServingGrid,
    decode_steps,
    golden_steps,
    preset_steps,
    serving,
    serving_cases,
)


def test_decode_steps_are_log_spaced_and_end_at_the_length():
    assert decode_steps(16, 1) == (1, 2, 4, 8, 16)
    assert decode_steps(2048, 2)[:8] == (1, 2, 3, 4, 6, 8, 11, 16)
    steps = decode_steps(32768, 4)
    assert steps[-1] == 32768 and len(steps) == 56
    assert steps == tuple(sorted(set(steps)))
    assert decode_steps(100, 4)[-2:] == (91, 100)
    assert decode_steps(1, 3) == (1,)
    with pytest.raises(ValueError, match="per_octave"):
        decode_steps(16, 0)


def test_alibi_slopes_are_ggmls_for_its_max_bias():
    for h in (4, 8):
        assert ggml_attention.alibi_slopes(ALIBI_MAX_BIAS, h) == tuple(alibi_slopes(h))


def _inputs(fmt, h=4, h_kv=2, t=300, d=32, seed=3):
    rng = np.random.default_rng(seed)
    f = get_format(fmt)
    from fa_jax.rounding import round_to

    with float64_enabled():
        q, k, v = (
            np.asarray(round_to(rng.standard_normal(s), f), np.float64)
            for s in ((t, h, d), (h_kv, t, d), (h_kv, t, d))
        )
    return q, k, v


_FEATURE = Feature("all", 4, 2, alibi=True, softcap=30.0)
_STEPS = (1, 129, 300)  # one key, past a tile, a bucket's last key


def _direct(preset, fmt, q_rows, k, v, steps, feature):
    policy = PRESETS[preset](get_format(fmt))
    out = []
    with float64_enabled():
        for i, t in enumerate(steps):
            extra = {}
            if feature.alibi:
                extra["bias"] = alibi_bias(alibi_slopes(feature.heads), 1, t, "bottom-right")[None]
            o = flash_attention(
                q_rows[i][None, :, None, :],
                k[None, :, :t],
                v[None, :, :t],
                policy,
                PRESET_BLOCKS,
                causal=True,
                q_offset="bottom-right",
                softcap=feature.softcap,
                **extra,
            )[0]  # pyright: ignore[reportIndexIssue]
            out.append(np.asarray(o)[0, :, 0, :])
    return np.stack(out)


def test_bucketed_presets_are_the_direct_calls_bit_for_bit():
    q, k, v = _inputs("bf16")
    steps = (1, 300)
    rows = q[np.asarray(steps) - 1]
    direct = _direct("fa2_kernel", "bf16", rows, k, v, steps, _FEATURE)
    jitted = preset_steps("fa2_kernel", "bf16", rows, k, v, steps, _FEATURE, (130, 300))
    assert np.abs(direct).max() > 0
    assert jitted.shape == (len(steps), 4, 32)
    np.testing.assert_array_equal(jitted, direct)
    with pytest.raises(ValueError, match="buckets"):
        preset_steps("fa2_kernel", "bf16", rows, k, v, steps, _FEATURE, (130,))


@pytest.mark.extended  # op by op: about 15 s of CPU
def test_bucketed_presets_run_eagerly_are_the_same_bits():
    q, k, v = _inputs("fp16", t=130, d=8)
    steps = (3, 130)
    rows = q[np.asarray(steps) - 1]
    jitted = preset_steps("fa2_kernel", "fp16", rows, k, v, steps, _FEATURE)
    with jax.disable_jit():
        eager = preset_steps("fa2_kernel", "fp16", rows, k, v, steps, _FEATURE)
    np.testing.assert_array_equal(eager, jitted)


@pytest.mark.extended  # every preset and format, each a program per bucket
@pytest.mark.parametrize("preset", ["paper_uniform", "fa2_kernel"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("feature", ["mha", "gqa", "alibi", "softcap"])
def test_every_preset_and_feature_bucketed_is_direct(preset, fmt, feature):
    f = FEATURES[feature]
    q, k, v = _inputs(fmt, f.heads, f.kv_heads)
    rows = q[np.asarray(_STEPS) - 1]
    direct = _direct(preset, fmt, rows, k, v, _STEPS, f)
    for buckets in ((130, 300), None):  # two buckets; one of the longest step
        got = preset_steps(preset, fmt, rows, k, v, _STEPS, f, buckets)
        np.testing.assert_array_equal(got, direct)


def test_golden_is_fp64_reference_attention_with_the_features():
    q, k, v = _inputs("fp32")
    steps = (1, 300)
    rows = q[np.asarray(steps) - 1]
    got = golden_steps(rows, k, v, steps, _FEATURE)
    with float64_enabled():
        for i, t in enumerate(steps):
            bias = alibi_bias(alibi_slopes(4), 1, t, "bottom-right")[None]
            want = reference_attention(
                rows[i][None, :, None, :],
                k[None, :, :t],
                v[None, :, :t],
                golden(),
                causal=True,
                q_offset="bottom-right",
                bias=bias,
                softcap=30.0,
            )
            np.testing.assert_allclose(got[i], np.asarray(want)[0, :, 0, :], rtol=1e-13, atol=1e-15)
    plain = golden_steps(rows, k, v, steps, Feature("x", 4, 2))
    assert not np.allclose(plain[-1], got[-1], rtol=1e-6)  # ALiBi and softcap count


def test_grid_checks_its_fields():
    with pytest.raises(ValueError, match="buckets"):
        ServingGrid(length=64, per_octave=1, seeds=(0,), buckets=(32,))
    with pytest.raises(ValueError, match="features"):
        ServingGrid(length=64, per_octave=1, seeds=(0,), features=("mqa",))
    with pytest.raises(ValueError, match="preset names"):
        ServingGrid(length=64, per_octave=1, seeds=(0,), presets=("kernel:ggml",))
    with pytest.raises(ValueError, match="seed"):
        ServingGrid(length=64, per_octave=1, seeds=())
    with pytest.raises(ValueError, match="kv_heads"):
        Feature("x", 4, 3)
    grid = ServingGrid(length=100, per_octave=1, seeds=(0,), buckets=(10, 100))
    assert grid.bucketed() == [(10, (1, 2, 4, 8)), (100, (16, 32, 64, 100))]


_GRID = ServingGrid(
    length=256,
    per_octave=1,
    seeds=(0,),
    d=32,
    features=("alibi",),
    engines=("ggml", "onnxruntime-gqa"),
    presets=("fa2_kernel",),
    preset_formats=("bf16",),
)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving")
    return out, serving(out, quick=True, grid=_GRID, quiet=True)


def _available(engine):
    return sv._unavailable(engine) is None


def test_the_study_writes_a_row_per_case_feature_step_and_lists_refusals(result):
    _, res = result
    with open(res["csv"]) as fh:
        raw = list(csv.DictReader(fh))
    cases = [c for c in serving_cases(_GRID) if _available(c.engine)]
    refused = {f"{c.label} / alibi" for c in cases if c.engine == "onnxruntime-gqa"}
    assert set(res["combos_skipped"]) == refused
    for reason in res["combos_skipped"].values():
        assert "bias: not supported" in reason
    want = {
        (c.label, f, str(t))
        for c in cases
        for f in _GRID.features
        for t in _GRID.steps()
        if f"{c.label} / {f}" not in refused
    }
    assert {(r["case"], r["feature"], r["step"]) for r in raw} == want
    assert len(raw) == len(want)
    by = {(r["case"], r["feature"], int(r["step"])): r for r in raw}
    if _available("ggml"):  # one FP32 key: the output is its value, exactly
        assert float(by[("ggml f32", "alibi", 1)]["max_abs"]) == 0.0
        assert 0 < float(by[("ggml f32", "alibi", 256)]["mean_rel"]) < 1e-5
        assert float(by[("ggml q4_0", "alibi", 256)]["mean_rel"]) > 1e-3
    assert 1e-4 < float(by[("fa2_kernel bf16", "alibi", 256)]["mean_rel"]) < 1e-1
    meta = json.loads((result[0] / "serving" / "metadata.json").read_text())
    assert meta["config"]["steps"] == list(_GRID.steps())
    assert meta["combos_skipped"] == res["combos_skipped"]
    assert meta["wall_s"] > 0
    assert res["png"].endswith("serving.png")


@pytest.mark.extended  # the model's program: about 10 s of CPU
@pytest.mark.skipif(not _available("ggml"), reason="ggml is not installed here")
def test_identity_rows_compare_the_model_at_the_capped_step(tmp_path):
    check = ServingCheck("ggml", "fp32", "alibi", 1024, (("kv_type", "q8_0"), ("threads", 1)))
    grid = dataclasses.replace(_GRID, engines=("ggml",), presets=(), checks=(check,))
    res = serving(tmp_path, quick=True, grid=grid, quiet=True)
    (row,) = res["identity_rows"]
    assert (row["kernel"], row["feature"], row["step"]) == ("ggml", "alibi", 256)
    if row["note"]:
        assert row["note"].startswith("model refuses this CPU")
    else:
        assert row["identical_share"] == 1.0 and row["max_ulp"] == 0
    with open(res["identity_csv"]) as fh:
        assert [r["options"] for r in csv.DictReader(fh)] == ["kv_type=q8_0 threads=1"]


def test_a_second_run_reads_every_row_back(result, monkeypatch):
    out, first = result

    engine_steps = sv._engine_steps

    def fail(case, *args):
        if f"{case.label} / {args[-1].name}" in first["combos_skipped"]:
            return engine_steps(case, *args)  # refused again (ValueError), not stored
        raise AssertionError("computed again")

    monkeypatch.setattr(sv, "_engine_steps", fail)
    monkeypatch.setattr(sv, "preset_steps", fail)
    again = serving(out, quick=True, grid=_GRID, quiet=True)
    assert again["rows"] == first["rows"]
    assert again["combos_skipped"] == first["combos_skipped"]


def test_the_cli_names_the_study():
    from fa_jax.cli import build_parser

    args = build_parser().parse_args(["reproduce", "serving", "--quick", "--out", "x"])
    assert (args.figure, args.quick) == ("serving", True)


@pytest.mark.extended  # the quick grid: under a minute of CPU
def test_the_quick_grid_through_reproduce(tmp_path):
    from fa_jax.studies.reproduce import reproduce

    res = reproduce("serving", tmp_path, quick=True, quiet=True)["serving"]
    assert res["grid"]["length"] == 2048 and res["grid"]["steps"][-1] == 2048
    cases = {c.label for c in serving_cases(sv.QUICK) if _available(c.engine)}
    assert {r["case"] for r in res["rows"]} == cases
    assert {r["feature"] for r in res["rows"]} == set(FEATURES)
    for what in res["combos_skipped"]:  # only ALiBi and softcap where the kernel lacks them
        case, feature = what.split(" / ")
        assert feature in ("alibi", "softcap") and not case.startswith("ggml")
    if _available("ggml"):
        (row,) = res["identity_rows"]
        assert row["note"] or row["identical_share"] == 1.0
