"""XLA's own dots, judged by XLA: its GEMVs against the dot_general XLA runs
itself, bit for bit, the HLO reading of which dots are XLA's, and Eigen's shard
sizes and buffer sum against float32 replays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import ops
from fa_jax.formats import FP32
from fa_jax.kernels import xla
from fa_jax.kernels.x86 import cpu
from fa_jax.kernels.xla import hlo, orders
from fa_jax.kernels.xla import own_dots as xla_own_dots


def _real_gemv(x, a, major: str):
    """XLA's dot of x (B, H, T) with the matrix a (B, H, R, T) stored with t minor
    ("row") or r minor ("column"), jitted as attention's: (the result as (B, H, 1,
    R), the major :func:`xla_own_dots.own_dots` reads from its HLO)."""
    if major == "column":
        a = np.ascontiguousarray(np.swapaxes(a, -1, -2))
    dims = (((2,), (3 if major == "row" else 2,)), ((0, 1), (0, 1)))
    run = jax.jit(lambda x, a: jax.lax.dot_general(x, a, dims))
    bodies = hlo.computations(run.lower(x, a).compile().as_text() or "")
    read = xla_own_dots.own_dots(bodies["ENTRY"], bodies)[0]
    return np.asarray(run(x, a), np.float64).reshape(*x.shape[:2], 1, -1), read


_GEMV = jax.jit(xla_own_dots.gemv, static_argnums=(2, 3))


def _lanes(x, a, major: str, expected):
    """The widths XLA's GEMV takes in this CPU's code (:attr:`xla.VectorCode.gemv_lanes`;
    AVX-512's, the widest, where the code is not modelled) at which
    :func:`xla_own_dots.gemv` (jitted) equals ``expected``."""
    code = orders.CODES.get(cpu.isa(), xla.AVX512)
    with x64_enabled():
        x, a = (jnp.asarray(t, jnp.float64) for t in (x[:, :, None], a))
        return [
            lanes
            for lanes in code.gemv_lanes
            if np.array_equal(_GEMV(x, a, FP32, xla_own_dots.Gemv(major, lanes)), expected)
        ]


@pytest.mark.parametrize("major", ["row", "column"])
@pytest.mark.parametrize(
    ("b", "h", "r", "t"),
    [(2, 2, 1501, 84), (1, 3, 21, 33), (2, 4, 5, 4), (2, 8, 97, 33)],
)
def test_gemv_is_xlas_matrix_vector_product(major, b, h, r, t):
    """One row x against a matrix of r outputs, stored either way: whole tiles of 8
    outputs and the last r mod 8, t with and without an epilogue, t under 8 (no
    vector part), and r mod 8 = 1 (the column-major lone output)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((b, h, t)).astype(np.float32)
    a = rng.standard_normal((b, h, r, t)).astype(np.float32)
    real, read = _real_gemv(x, a, major)
    assert read == major
    assert _lanes(x, a, major, real)


@pytest.mark.extended  # 10 s: op by op, each step compiled on its first call
@pytest.mark.parametrize("major", ["row", "column"])
def test_gemv_eager_equals_jitted(major):
    """The same bits op by op as jitted, with an epilogue, a lone output and a
    ragged tile."""
    rng = np.random.default_rng(4)
    with x64_enabled():
        x, a = (jnp.asarray(rng.standard_normal(s)) for s in ((2, 1, 11), (2, 9, 11)))
        how = xla_own_dots.Gemv(major, 8)
        eager = np.asarray(xla_own_dots.gemv(x, a, FP32, how))
        assert np.array_equal(eager, np.asarray(_GEMV(x, a, FP32, how)))


def test_the_lone_column_major_output_is_not_one_chain():
    """The rounded first tile matters: one FMA chain alone misses the lone output."""
    rng = np.random.default_rng(3)
    x = rng.random((2, 8, 97)).astype(np.float32)
    a = rng.standard_normal((2, 8, 33, 97)).astype(np.float32)
    real = _real_gemv(x, a, "column")[0][..., 0, 32]
    with x64_enabled():
        x, a = (jnp.asarray(t, jnp.float64) for t in (x, a))
        chain = jnp.zeros((2, 8), jnp.float64)
        for j in range(97):
            chain = ops.fma(x[..., j], a[..., 32, j], chain, FP32)
    assert not np.array_equal(np.asarray(chain), real)


def test_own_dots_reads_the_entry_in_order():
    """Q Kᵀ then P V: a bare dot is XLA's, one in a called fusion is not."""
    fused = "%fused_computation = {\n  %d = f32[2] dot(%a, %b)\n}"
    bodies = hlo.computations(fused + "\nENTRY %main {\n}")
    entry = (
        "  %f = f32[4]{0} fusion(%a), kind=kCustom, calls=%fused_computation\n"
        "  %dot.1 = f32[2] dot(%v, %f), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
    )
    v = "  %v = f32[8,4]{0,1} parameter(0)\n"
    assert xla_own_dots.own_dots(v + entry, bodies) == (None, "column")
    assert xla_own_dots.own_dots(v.replace("{0,1}", "{1,0}") + entry, bodies) == (None, "row")
    assert xla_own_dots.own_dots("", bodies) == (None, None)


def test_eigen_buffers_sum_in_ranges_of_four_then_three_at_a_time():
    """Eigen's aggregation of shard buffers (aggregateL0Blocks) against a plain
    float32 replay of its additions, for 1 to 14 shards."""
    rng = np.random.default_rng(7)
    for count in range(1, 15):
        parts = [
            np.float32(x) for x in rng.standard_normal(count) * 10.0 ** rng.integers(-4, 4, count)
        ]
        ranges = []
        for lo in range(0, count, 4):
            r = parts[lo : lo + 4]
            if len(r) == 4:
                ranges.append((r[0] + r[1]) + (r[2] + r[3]))
            else:
                t = r[0]
                for x in r[1:]:
                    t = t + x
                ranges.append(t)
        want, i = ranges[0], 1
        while i + 2 < len(ranges):
            want = (want + ranges[i]) + (ranges[i + 1] + ranges[i + 2])
            i += 3
        for x in ranges[i:]:
            want = want + x
        with x64_enabled():
            got = xla_own_dots.eigen_buffers_sum([jnp.float64(x) for x in parts], FP32)
        assert float(got) == float(want)


def test_eigen_shards_follow_block_size():
    """blockSize: ceil(k / threads) rounded up to max(8, packet), at least 12 packets."""
    shards = xla_own_dots.eigen_shards(1500)
    assert 752 in shards  # 2 threads, 16-float packets (AVX-512)
    assert all(s < 1500 and s % 8 == 0 for s in shards)
    assert xla_own_dots.eigen_shards(90) == []  # fewer keys than 12 packets of 8: one shard


def test_eigen_kc_fits_the_measured_blocks():
    """TSL's roughly equal slices of Eigen's kc (320 here): the blocks the probes
    read in XLA's P V (2 K/V heads, 2 rows in 4 groups), shards of 1256 and 1244
    keys (over 2500) in blocks of 320 and 312, 2504 and 2496 (over 5000) in 320
    and 312, 752 (over 1500) in 256, 2248 and 2233 (over 4481, 4 rows) in 288 and
    320; and 993 (over 2001) in 248, where rounding k / slices up first would give
    256 (the model then fits no candidate).  A block is a multiple of 8 or all the
    keys."""
    measured = {
        1256: 320, 1244: 312, 2504: 320, 2496: 312, 752: 256, 993: 248, 100: 100,
        2248: 288, 2233: 320,
    }  # fmt: skip
    assert {k: xla_own_dots.eigen_kc(k, 320) for k in measured} == measured
    for k in range(1, 3000, 7):
        for kc in range(8, 321, 8):
            block = xla_own_dots.eigen_kc(k, kc)
            assert block == k or block % 8 == 0


def test_eigen_kcs_read_back_from_a_block_cut_the_other_shard_each_its_own_way():
    """Every kc up to Eigen's threaded cap that gives a shard's block is offered,
    once per cut of the last shard: 2248 keys in blocks of 288 (over 4481, where
    the real P V cuts the 2233 others in blocks of 320) come from kc 288 .. 320,
    which cut 2233 keys in 280 or 320."""
    assert xla_own_dots.eigen_kcs_giving(2248, 288, 2233) == [288, 320]
    assert xla_own_dots.eigen_kcs_giving(1256, 320, 1244) == [320]
    assert xla_own_dots.eigen_kcs_giving(1000, 7, 500) == []  # not a multiple of 8
    for k in range(50, 3000, 37):
        rest = k - k // 3
        for kc in range(8, 321, 8):
            block = xla_own_dots.eigen_kc(k, kc)
            if block == k:
                continue
            kcs = xla_own_dots.eigen_kcs_giving(k, block, rest)
            assert all(xla_own_dots.eigen_kc(k, c) == block for c in kcs)
            cuts = [xla_own_dots.eigen_kc(rest, c) for c in kcs]
            assert len(set(cuts)) == len(cuts) and xla_own_dots.eigen_kc(rest, kc) in cuts
