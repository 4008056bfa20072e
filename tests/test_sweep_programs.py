"""fa_jax.studies.sweep.programs: a policy taken apart into its static shape and its
traced widths, put together again inside a program, gives the direct calls' bits;
policies of one shape share one compiled program."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import wide_types

from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.formats import FP32, get_format
from fa_jax.inputs import make_inputs
from fa_jax.policy import STAGES
from fa_jax.presets import fa2_kernel, golden, paper_uniform
from fa_jax.rounding import round_to
from fa_jax.studies.profile import Profile
from fa_jax.studies.sweep import Grid, run_sweep
from fa_jax.studies.sweep.executables import Executables
from fa_jax.studies.sweep.grid import COMPARISONS, METRICS
from fa_jax.studies.sweep.programs import (
    METRIC_LABEL,
    flash_program,
    golden_for,
    metric_plans,
    metric_values,
    policy_shape,
    policy_widths,
    reference_program,
    stage_slots,
)

BF16 = get_format("bf16")


def test_stage_slots_are_the_coarsest_common_partition():
    assert stage_slots([paper_uniform(BF16)]) == (0,) * len(STAGES)
    slots = stage_slots([paper_uniform(BF16), fa2_kernel(BF16), golden_for(BF16)])
    by_stage = dict(zip(STAGES, slots))
    assert len(set(slots)) == 3
    # golden splits the inputs from the rest, fa2_kernel its fmt stages from its FP32 ones
    assert by_stage["inputs"] != by_stage["p"] != by_stage["scores"] != by_stage["inputs"]
    assert by_stage["p"] == by_stage["out"] and by_stage["scores"] == by_stage["o_acc"]


def test_policy_widths_and_shape_in_shared_slots():
    slots = stage_slots([paper_uniform(BF16), fa2_kernel(BF16)])
    w = policy_widths(fa2_kernel(BF16), slots)
    assert w.dtype == np.int32 and w.shape == (2, 3)
    assert sorted(map(tuple, w.tolist())) == sorted(
        [(8, 7, 127), (FP32.exp_bits, FP32.man_bits, FP32.bias)]
    )
    assert policy_shape(paper_uniform(BF16), slots) == policy_shape(fa2_kernel(BF16), slots)
    # The cache keys programs by repr: it must not carry a process's addresses.
    assert "0x" not in repr(policy_shape(fa2_kernel(BF16), slots))
    with pytest.raises(ValueError, match="slot"):
        policy_shape(fa2_kernel(BF16), (0,) * len(STAGES))


def _bits(x):
    return np.asarray(x).view(np.uint64)


@pytest.mark.extended  # 4 s: for the default run's time only
def test_programs_equal_direct_calls_bitwise(x64):
    """fa2_kernel's stages traced in the slots it shares with paper_uniform and the
    golden (paper_uniform's own are checked by the sweep's tests against direct
    calls)."""
    f = get_format("fp16")
    pols = [fa2_kernel(f), golden_for(f), paper_uniform(f)]
    slots = stage_slots(pols)
    n, d = 24, 8
    qkv = [jnp.asarray(t)[None] for t in make_inputs(3, n, d=d)]
    lengths = jnp.array([n], jnp.int32)

    def run(program, pol, **static):
        w = jnp.asarray(policy_widths(pol, slots))
        return program(*qkv, w, lengths, shape=policy_shape(pol, slots), **static)[0]

    q, k, v = (t[0] for t in qkv)
    gold = reference_attention(round_to(q, f), round_to(k, f), round_to(v, f), golden())
    assert np.array_equal(_bits(run(reference_program, pols[1], causal=False)), _bits(gold))
    pol = pols[0]
    base = reference_attention(q, k, v, pol)
    flash = flash_attention(q, k, v, pol, Blocks(8, 8))[0]  # pyright: ignore[reportIndexIssue]
    assert np.array_equal(_bits(run(reference_program, pol, causal=False)), _bits(base))
    got = run(flash_program, pol, variant="fa2", blocks=Blocks(8, 8), causal=False)
    assert np.array_equal(_bits(got), _bits(flash))


@pytest.mark.slow  # attention's float32 programs are checked by default in test_carrier.py
def test_a_float32_flash_program_holds_no_64_bit_type(x64):
    """With x64 on, so that a stray float64 or int64 would show: the lowered flash
    program on a float32 carrier, traced widths and lengths, uses 32-bit types only."""
    pol = fa2_kernel("bf16")
    slots = stage_slots([pol])
    shape = dataclasses.replace(policy_shape(pol, slots), carrier="float32")
    q = jnp.zeros((2, 1, 1, 16, 8), jnp.float32)
    widths = jnp.asarray(policy_widths(pol, slots))
    lengths = jnp.array([16, 12], jnp.int32)
    static = dict(shape=shape, variant="fa2", blocks=Blocks(8, 8), causal=True)
    assert not wide_types(flash_program.lower(q, q, q, widths, lengths, **static))


def test_presets_of_one_shape_share_programs(tmp_path):
    """paper_uniform, fa2_kernel and the golden: one reference and one flash program."""
    profile = Profile()
    grid = Grid(
        formats=("bf16", "fp16"),
        seq_lens=(16,),
        blocks=(Blocks(8, 8),),
        policies=("paper_uniform", "fa2_kernel"),
        seeds=(0,),
        d=8,
    )
    run_sweep(grid, tmp_path, quiet=True, cache=False, profile=profile)
    attention = [p for p in profile.programs.values() if p.label != METRIC_LABEL]
    assert sum(p.compiled + p.loaded for p in attention) == 2


def test_metric_plans_are_the_programs_metric_values_runs(x64):
    """The metric program a sweep compiles ahead (metric_plans) is the one that
    metric_values then runs, for every output size up to the padded one: nothing
    more is compiled, and each comparison's values are the public metric
    functions' bit for bit."""
    from fa_jax import metrics

    profile = Profile()
    executables = Executables(None, profile)
    executables.prepare(metric_plans(96))
    assert profile.programs[METRIC_LABEL].compiled == 1
    rng = np.random.default_rng(3)
    for shape in ((2, 3, 16), (1, 1, 5), (2, 2, 24)):
        outs = dict(zip(("flash", "baseline", "golden"), rng.standard_normal((3, *shape))))
        outs["baseline"] *= 10.0 ** rng.integers(-3, 3, shape)
        got = metric_values(outs, 96, executables)
        assert got.shape == (len(COMPARISONS), len(METRICS))
        for comparison, row in zip(COMPARISONS, got):
            a, b = comparison.split("_vs_")
            want = metrics.abs_diff_summary(outs[a], outs[b])
            assert row.tolist() == [float(want[m]) for m in METRICS], comparison
    assert profile.programs[METRIC_LABEL].compiled == 1
    with pytest.raises(ValueError, match="at most 96 elements, got 100"):
        metric_values({k: np.zeros(100) for k in outs}, 96, executables)
