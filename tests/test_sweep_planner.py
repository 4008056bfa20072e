"""fa_jax.studies.sweep.planner: the partition of least predicted time, the costs it
measures and keeps, and the sweep under any plan writing the same bytes."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa_jax._x64 import float64_enabled
from fa_jax.attention import Blocks
from fa_jax.studies.options import study_options
from fa_jax.studies.profile import Profile
from fa_jax.studies.sweep import Grid, run_sweep
from fa_jax.studies.sweep.batch import MEMORY_BUDGET, FormatBatch
from fa_jax.studies.sweep.executables import Executables, device_label
from fa_jax.studies.sweep.planner import (
    COSTS_FILE,
    PRIORS,
    Call,
    Costs,
    best_buckets,
    bucket_seconds,
    family_of,
    load_costs,
    measured,
    save_costs,
    wall_seconds,
)
from fa_jax.studies.sweep.programs import flash_program, reference_program


def _partitions(lens):
    """Every partition of the sorted ``lens`` into contiguous buckets."""
    for cuts in itertools.product((False, True), repeat=len(lens) - 1):
        parts, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                parts.append(tuple(lens[start:i]))
                start = i
        yield [*parts, tuple(lens[start:])]


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 4096), min_size=1, max_size=7, unique=True),
    fixed=st.floats(0, 10),
    per_unit=st.floats(0, 1e-6),
)
def test_best_buckets_is_the_least_cost_partition(lens, fixed, per_unit):
    """Against every contiguous partition: a fixed cost per bucket (a compile) and a
    padded cost per length (each length run at its bucket's longest)."""

    def cost(bucket):
        return fixed + per_unit * len(bucket) * max(bucket) ** 2

    def total(parts):
        return sum(cost(b) for b in parts)

    best = best_buckets(lens, cost)
    assert [n for b in best for n in b] == sorted(lens)
    assert total(best) <= min(total(p) for p in _partitions(sorted(lens))) * (1 + 1e-12)


def test_best_buckets_extremes_and_ties():
    lens = [512, 128, 1024, 256, 256]
    assert best_buckets(lens, lambda b: 1.0) == [(128, 256, 512, 1024)]  # ties: fewest
    assert best_buckets(lens, lambda b: max(b) ** 2 * len(b)) == [(128,), (256,), (512,), (1024,)]
    with pytest.raises(ValueError, match="best_buckets: lengths: expected positive integers"):
        best_buckets([0, 3], lambda b: 1.0)


def test_family_and_bucket_seconds():
    assert family_of("flash fa2 Bc=64 causal N<=1024") == "flash fa2 Bc=64 causal"
    assert family_of("metrics") == "metrics"
    costs = Costs({"reference": 2.0}, {"reference": 1e-9, "flash fa2 Bc=64": 3e-9}, 0.25, 2)
    calls = [
        Call("a", "reference N<=8", 1e9, cached=False),
        Call("a", "reference N<=8", 1e9, cached=False),  # golden and baseline: one program
        Call("b", "flash fa2 Bc=64 N<=8", 1e9, cached=True),
    ]
    prepare, run = bucket_seconds(calls, costs)
    assert prepare == pytest.approx(2.0 + 0.25)  # one compile, one load
    assert run == pytest.approx(1.0 + 1.0 + 3.0)
    assert wall_seconds(calls, costs) == pytest.approx((2.0 + 0.25) / 2 + 5.0)  # two threads


def test_unmeasured_families_take_their_kin_then_the_prior():
    costs = Costs({"flash fa2 Bc=32": 1.0, "flash fa2 Bc=64": 3.0}, {}, 0.1)
    assert costs.compile_of("flash fa2 Bc=64") == 3.0
    assert costs.compile_of("flash fa1 Bc=128") == 2.0  # the mean of the flash families
    assert costs.compile_of("reference") == PRIORS["cpu"].compile_s
    assert costs.unit_of("reference") == PRIORS["cpu"].unit_s
    gpu = Costs({}, {}, 0.1, platform="gpu")
    assert gpu.unit_of("reference") == PRIORS["accelerator"].unit_s


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(compile_s={"reference": -1.0}), r"compile_s\['reference'\].*got -1.0"),
        (dict(unit_s={"x": float("nan")}), r"unit_s\['x'\].*got nan"),
        (dict(load_s=True), "load_s.*got True"),
        (dict(workers=0), "workers: expected a positive integer, got 0"),
    ],
)
def test_costs_refuse_what_is_not_seconds(fields, match):
    args = dict(compile_s={}, unit_s={}, load_s=0.1) | fields
    with pytest.raises(ValueError, match=match):
        Costs(**args)


def test_measured_costs_from_a_profile():
    p = Profile()
    p.prepared("reference N<=8", "compiled", 3.0)
    p.prepared("reference N<=16", "compiled", 1.0)
    p.ran("reference N<=8", 0.5, units=1e8)
    p.ran("reference N<=16", 1.5, units=3e8)
    p.prepared("flash fa2 Bc=4 N<=16", "loaded", 0.2)
    p.prepared("flash fa2 Bc=4 N<=16", "loaded", 0.4)
    p.ran("flash fa2 Bc=4 N<=16", 1.0, units=1e9)
    p.prepared("metrics", "compiled", 9.0)  # no units: not the planner's
    p.ran("metrics", 9.0)
    before = Costs({"flash fa2 Bc=4": 7.0}, {}, 0.05, 2)
    after = measured(p, before)
    assert after.compile_s == {"reference": 2.0, "flash fa2 Bc=4": 7.0}
    assert after.unit_s == pytest.approx({"reference": 2.0 / 4e8, "flash fa2 Bc=4": 1e-9})
    assert after.load_s == pytest.approx(0.3)
    assert after.workers == 2


def test_costs_are_kept_per_device(tmp_path):
    fresh = load_costs(tmp_path, "cpu:a:1:2", "cpu", 2)
    assert (fresh.compile_s, fresh.unit_s, fresh.workers) == ({}, {}, 2)
    mine = Costs({"reference": 1.5}, {"reference": 2e-9}, 0.125, 2)
    save_costs(tmp_path, "cpu:a:1:2", mine)
    save_costs(tmp_path, "gpu:b:1:16", Costs({"reference": 4.0}, {}, 0.5, 16, "gpu"))
    assert load_costs(tmp_path, "cpu:a:1:2", "cpu", 2) == mine
    assert load_costs(tmp_path, "gpu:b:1:16", "gpu", 16).compile_s == {"reference": 4.0}
    (tmp_path / COSTS_FILE).write_text('{"cpu:a:1:2": {"load_s": "soon"}}')
    assert load_costs(tmp_path, "cpu:a:1:2", "cpu", 2).compile_s == {}  # unreadable: afresh
    (tmp_path / COSTS_FILE).write_text("not json")
    assert load_costs(tmp_path, "cpu:a:1:2", "cpu", 2).compile_s == {}
    save_costs(None, "cpu:a:1:2", mine)  # no cache: nothing kept, no error


GRID = Grid(
    formats=("bf16", "fp16"),
    seq_lens=(8, 24),
    blocks=(Blocks(4, 8),),
    variants=("fa2",),
    policies=("paper_uniform", "fa2_kernel"),
    seeds=(0, 1),  # two per length: a call's two configurations (batch.PIECE) one length's
    d=8,
)


def _sweep(cache, out, costs: Costs | None = None) -> tuple[bytes, Profile]:
    """The grid's CSV with ``costs`` planted in ``cache`` first, and the run's profile."""
    if costs is not None:
        save_costs(cache / "programs", device_label(), costs)
    profile = Profile()
    with study_options(cache=cache, profile=profile):
        csv_path = run_sweep(GRID, out, quiet=True)
    return csv_path.read_bytes(), profile


def _padded_lengths(profile: Profile, family: str) -> set[int]:
    return {
        int(label.rpartition("N<=")[2])
        for label in profile.programs
        if label.startswith(family + " N<=")
    }


def test_every_plan_writes_the_same_csv(tmp_path):
    """Compiles free: every length its own program; runs free and programs dear,
    even cached ones: one program for all.  The two CSVs are the same, byte for
    byte (the fixed buckets' are the snapshot tests'); the profile shows each plan."""
    cache = tmp_path / "cache"
    apart, p_apart = _sweep(cache, tmp_path / "o1", _ALL(0.0, 1.0, 0.0))
    merged, p_merged = _sweep(cache, tmp_path / "o2", _ALL(1e3, 0.0, 1e3))
    assert apart == merged
    assert _padded_lengths(p_apart, "reference") == {8, 24}
    assert _padded_lengths(p_apart, "flash fa2 Bc=8") == {8, 24}
    assert _padded_lengths(p_merged, "reference") == {24}
    assert _padded_lengths(p_merged, "flash fa2 Bc=8") == {24}
    assert any("reference buckets [(8,), (24,)]" in line for line in p_apart.plans)
    assert "pred prep" in p_merged.table()


def _ALL(compile_s: float, unit_s: float, load_s: float) -> Costs:
    families = ["reference", "flash fa2 Bc=8"]
    return Costs(dict.fromkeys(families, compile_s), dict.fromkeys(families, unit_s), load_s)


def test_each_run_keeps_its_measured_costs_and_its_programs_count_as_cached(tmp_path):
    """A run leaves this device's measured costs in the cache; the calls of a bucket
    whose programs it compiled are then cached (a load in the plan), others not."""
    cache = tmp_path / "cache"
    _sweep(cache, tmp_path / "o1", _ALL(1e3, 0.0, 0.0))  # one bucket: lengths padded to 24
    kept = json.loads((cache / "programs" / COSTS_FILE).read_text())[device_label()]
    assert set(kept["compile_s"]) == {"reference", "flash fa2 Bc=8"}
    assert all(0 < s < 1e3 for s in kept["compile_s"].values())  # measured, not planted
    assert all(s > 0 for s in kept["unit_s"].values())

    batch = FormatBatch(
        GRID, GRID.resolved_formats(), True, MEMORY_BUDGET, Executables(cache / "programs")
    )
    static = dict(causal=False, tile_cols=8, variant="fa2", blocks=Blocks(8, 8))
    for bucket, cached in (((8, 24), True), ((8,), False)):
        with float64_enabled():  # as in a sweep: the keys hold the setting
            calls = batch.calls(reference_program, bucket, "fa2_kernel", causal=False)
            calls += batch.calls(flash_program, bucket, "paper_uniform", **static)
        assert {c.cached for c in calls} == {cached}
        assert {family_of(c.label) for c in calls} == {"reference", "flash fa2 Bc=8"}


def test_a_cached_bucket_costs_a_load():
    """The same calls, their program cached or not: what tips a plan to a kept program."""
    fresh = [Call("k", "reference N<=40", 100.0, cached=False)]
    kept = [Call("k", "reference N<=40", 100.0, cached=True)]
    costs = Costs({"reference": 5.0}, {"reference": 0.01}, 0.5)
    assert bucket_seconds(fresh, costs) == (5.0, 1.0)
    assert bucket_seconds(kept, costs) == (0.5, 1.0)


def test_the_table_shows_the_plan_and_its_predictions():
    p = Profile()
    p.planned("bf16 (none): reference buckets [(8, 12)]")
    p.prepared("reference N<=12", "compiled", 1.5)
    p.ran("reference N<=12", 0.5, units=10.0)
    p.predict("reference N<=12", 1.0, 0.25)
    p.predict("reference N<=12", 1.0, 0.25)  # a second batch's calls of the label
    lines = p.table().splitlines()
    assert lines[0] == "plan: bf16 (none): reference buckets [(8, 12)]"
    assert lines[1].split()[-4:] == ["pred", "prep", "pred", "run"]
    assert lines[2].split()[-2:] == ["2.00", "0.50"]
    assert p.programs["reference N<=12"].units == 10.0
