"""Reference and flash attention: golden agreement, masks vs numpy, padding, jit, the
flash-attention repo's 2x acceptance rule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled
from hypothesis import given, settings
from hypothesis import strategies as st

from fa_jax import BF16, FP16, get_format
from fa_jax.attention import (
    VARIANTS,
    Blocks,
    blocks_from_sram,
    flash_attention,
    reference_attention,
)
from fa_jax.presets import fa2_kernel, golden, paper_uniform, torch_math
from fa_jax.rounding import round_to


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def numpy_attention(q, k, v, *, causal=False, q_lengths=None, kv_lengths=None):
    """Plain float64 attention with masks; fully masked rows give 0."""
    n, m = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    keep = np.ones(s.shape, bool)
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]
    if causal:
        keep &= j <= i
    if q_lengths is not None:
        keep &= i < np.asarray(q_lengths)[..., None, None]
    if kv_lengths is not None:
        keep &= j < np.asarray(kv_lengths)[..., None, None]
    s = np.where(keep, s, -np.inf)
    mx = np.max(s, -1, keepdims=True)
    e = np.where(keep, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1), 0)
    return p @ np.where(np.isfinite(v), v, 0) if kv_lengths is None else p @ v


def qkv(seed, lead=(2,), n=37, m=37, d=16, dv=None, scale=1.0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((*lead, n, d)) * scale,
        rng.standard_normal((*lead, m, d)) * scale,
        rng.standard_normal((*lead, m, dv or d)),
    )


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


# Bc = 1 (one key per tile), 16 (a ragged last tile: N = 37) and 64 (one tile, wider
# than N) for fa2; fa1 and rowwise run the same tile loop, with the ragged case in the
# default run and the other two in `-m slow`.
GOLDEN_TILES = [
    (v, bc) if v == "fa2" or bc == 16 else pytest.param(v, bc, marks=pytest.mark.slow)
    for v in VARIANTS
    for bc in (1, 16, 64)
]


@pytest.mark.parametrize("variant, bc", GOLDEN_TILES)
def test_golden_flash_equals_reference(variant, bc):
    q, k, v = qkv(0)
    ref = np.asarray(reference_attention(q, k, v, golden()))
    out, lse = flash_attention(q, k, v, golden(), Blocks(8, bc), variant=variant)
    assert rel_err(out, ref) < 1e-12
    s = q @ np.swapaxes(k, -1, -2) / 4.0
    want_lse = np.log(np.sum(np.exp(s - s.max(-1, keepdims=True)), -1)) + s.max(-1)
    assert np.max(np.abs(np.asarray(lse) - want_lse)) < 1e-12


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
@given(
    seed=st.integers(0, 2**31),
    q_lengths=st.lists(st.integers(0, 20), min_size=3, max_size=3),
    kv_lengths=st.lists(st.integers(0, 20), min_size=3, max_size=3),
)
@settings(max_examples=max(5, settings.default.max_examples // 6))  # 10 in "ci"
def test_masks_agree_with_numpy_float64(variant, causal, seed, q_lengths, kv_lengths):
    q, k, v = qkv(seed, lead=(3,), n=20, m=20)
    ql, kl = np.array(q_lengths), np.array(kv_lengths)
    want = numpy_attention(q, k, v, causal=causal, q_lengths=ql, kv_lengths=kl)
    ref = reference_attention(q, k, v, golden(), causal=causal, q_lengths=ql, kv_lengths=kl)
    out, _ = flash_attention(
        q, k, v, golden(), Blocks(4, 8), variant=variant, causal=causal, q_lengths=ql, kv_lengths=kl
    )
    for got in (ref, out):
        got = np.asarray(got)
        assert not np.isnan(got).any()
        assert np.max(np.abs(got - want)) <= 1e-12 * max(1.0, np.max(np.abs(want)))


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    """No key kept (kv_length 0): O = 0 and lse = -inf in every variant and the
    reference, while a live row is finite.  The shapes, tiles, policy and length
    arguments are those of the padded run of test_padded_equals_unpadded_bitwise, so
    the compiled programs are shared."""
    q, k, v = qkv(1, lead=(1,), n=32, m=32)
    pol, blocks, ql = paper_uniform(BF16), Blocks(4, 8), np.array([32])
    for variant in VARIANTS:
        for kl in (0, 32):
            out, lse = flash_attention(
                q, k, v, pol, blocks, variant=variant, q_lengths=ql, kv_lengths=np.array([kl])
            )
            if kl == 0:
                assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
            else:
                assert np.isfinite(np.asarray(out)).all(), variant
    ref = reference_attention(q, k, v, pol, q_lengths=ql, kv_lengths=np.array([0]))
    assert (np.asarray(ref) == 0).all()


@pytest.mark.parametrize(
    "variant, policy",
    [(v, paper_uniform(BF16)) for v in VARIANTS] + [("fa2", fa2_kernel(FP16))],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_padded_equals_unpadded_bitwise(variant, policy):
    """Garbage (even NaN) past the lengths changes nothing, bit for bit."""
    q, k, v = qkv(2, lead=(1,), n=21, m=21)
    pad = lambda x: np.concatenate([x, np.full((1, 11, x.shape[-1]), np.nan)], axis=-2)  # noqa: E731
    blocks = Blocks(4, 8)
    small, _ = flash_attention(q, k, v, policy, blocks, variant=variant)
    big, _ = flash_attention(
        pad(q),
        pad(k),
        pad(v),
        policy,
        blocks,
        variant=variant,
        q_lengths=np.array([21]),
        kv_lengths=np.array([21]),
    )
    np.testing.assert_array_equal(np.asarray(big)[:, :21], np.asarray(small))
    ref_small = reference_attention(q, k, v, policy)
    ref_big = reference_attention(
        pad(q), pad(k), pad(v), policy, q_lengths=np.array([21]), kv_lengths=np.array([21])
    )
    np.testing.assert_array_equal(np.asarray(ref_big)[:, :21], np.asarray(ref_small))


@pytest.mark.parametrize(
    "variant",
    # Eager mode compiles every primitive it meets (seconds per call): the default run's
    # eager check of flash_attention is test_backward's, whose forward is fa2's (the
    # default variant) with the same comparison; every variant runs here in `-m slow`.
    [pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS],
)
def test_jit_equals_eager_bitwise(variant):
    """Op-by-op execution (jax.disable_jit: no fusion, no excess precision) gives the
    same bits as the compiled program: causal, a ragged last key tile (M = 7, Bc = 4)
    and chunked sums."""
    q, k, v = qkv(3, lead=(1,), n=5, m=7, d=4)
    pol, blocks = paper_uniform(BF16, accumulation="chunked(2)"), Blocks(2, 4)
    jitted, jlse = flash_attention(q, k, v, pol, blocks, variant=variant, causal=True)
    with jax.disable_jit():
        eager, lse = flash_attention(q, k, v, pol, blocks, variant=variant, causal=True)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))
    np.testing.assert_array_equal(np.asarray(jlse), np.asarray(lse))


def test_reference_jit_equals_eager_bitwise():
    """reference_attention's compiled program and its op-by-op run give the same bits
    (the policy of test_jit_equals_eager_bitwise; Q, K, V and S of one shape, since
    eager compiles every op for every shape it meets)."""
    q, k, v = qkv(3, lead=(1,), n=4, m=4, d=4)
    pol = paper_uniform(BF16, accumulation="chunked(2)")
    jitted = reference_attention(q, k, v, pol, causal=True)
    with jax.disable_jit():
        eager = reference_attention(q, k, v, pol, causal=True)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))


def test_block_rows_do_not_change_the_result():
    """Rows are independent: Br is numerically irrelevant, Bc is not."""
    q, k, v = qkv(4, n=40, m=40)
    pol = paper_uniform(BF16)
    a, _ = flash_attention(q, k, v, pol, Blocks(1, 8))
    b, _ = flash_attention(q, k, v, pol, Blocks(40, 8))
    c, _ = flash_attention(q, k, v, pol, Blocks(1, 16))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_fa2_kernel_bf16_within_2x_of_torch_math(variant, seed):
    """flash-attention's acceptance rule: error vs an exact reference at most 2x that of
    the same-precision PyTorch reference; both measured against golden on the same
    BF16-rounded inputs."""
    q, k, v = (
        np.asarray(round_to(jnp.asarray(t), BF16))
        for t in qkv(seed, lead=(2, 2), n=128, m=128, d=64)
    )
    gold = np.asarray(reference_attention(q, k, v, golden()))
    base = rel_err(reference_attention(q, k, v, torch_math(BF16)), gold)
    flash, _ = flash_attention(q, k, v, fa2_kernel(BF16), Blocks(64, 32), variant=variant)
    assert rel_err(flash, gold) <= 2 * base, (rel_err(flash, gold), base)


def test_blocks_from_sram_follows_fa1():
    # M = 100K elements, d = 64: Bc = ceil(100000 / 256) = 391, Br = min(391, 64) = 64.
    assert blocks_from_sram(100_000, 64) == Blocks(64, 391)
    assert blocks_from_sram(100_000, 64, swap=True) == Blocks(391, 64)
    assert blocks_from_sram(100_000, 64, square=True) == Blocks(391, 391)
    assert blocks_from_sram(1024, 64) == Blocks(4, 4)


def test_block_arguments_are_checked():
    assert Blocks(np.int64(4), 8) == Blocks(4, 8)
    assert type(Blocks(np.int64(4), 8).br) is int
    for bad in (0, -1, True, 2.0, None):
        with pytest.raises(
            ValueError, match=rf"Blocks.br: expected a positive integer, got {bad!r}"
        ):
            Blocks(bad, 4)
    with pytest.raises(ValueError, match=r"blocks_from_sram: sram_elems: expected a positive"):
        blocks_from_sram(0, 64)
    with pytest.raises(ValueError, match=r"blocks_from_sram: d: expected a positive integer, got"):
        blocks_from_sram(1024, 64.0)
    with pytest.raises(ValueError, match="swap or square"):
        blocks_from_sram(1024, 64, swap=True, square=True)
    # Below 4d an SRAM cannot hold one row of each tile: no silent 1x1 tiles.
    assert blocks_from_sram(256, 64) == Blocks(1, 1)
    with pytest.raises(ValueError, match=r"sram_elems: expected at least 4 \* d = 256 .*got 255"):
        blocks_from_sram(255, 64)


def test_errors():
    q, k, v = qkv(5)
    with pytest.raises(ValueError, match=r"Blocks.bc: expected a positive integer, got 0"):
        Blocks(4, 0)
    variants = r"\('fa1', 'fa2', 'rowwise'"  # and the kernel loops registered
    with pytest.raises(ValueError, match=rf"flash_attention: variant: expected one of {variants}"):
        flash_attention(q, k, v, golden(), Blocks(4, 4), variant="fa3")
    with pytest.raises(TypeError, match="expected blocks=Blocks"):
        flash_attention(q, k, v, golden(), (4, 4))
    with pytest.raises(ValueError, match="leading dimensions differ"):
        reference_attention(q, k[:1], v, golden())
    q4, k4, v4 = qkv(5, lead=(4,))  # H = 4 query heads: 3 K/V heads do not divide them
    with pytest.raises(ValueError, match=r"H_kv heads .* where H_kv divides q's H, got q \(4, 37"):
        reference_attention(q4, k4[:3], v4[:3], golden())
    with pytest.raises(ValueError, match="choose swap or square"):
        blocks_from_sram(1000, 16, swap=True, square=True)


@pytest.mark.parametrize("attention", ["reference", "flash"])
def test_policy_must_be_a_policy(attention):
    q, k, v = qkv(7)
    call = {
        "reference": lambda p: reference_attention(q, k, v, p),
        "flash": lambda p: flash_attention(q, k, v, p, Blocks(4, 4)),
    }[attention]
    name = f"{attention}_attention"
    with pytest.raises(TypeError, match=rf"{name}: policy: .*get_policy\('fa2_kernel', 'bf16'\)"):
        call("fa2_kernel")
    with pytest.raises(TypeError, match=rf"{name}: policy: expected a Policy .*got None"):
        call(None)


@pytest.mark.parametrize(
    "shapes, bad",
    [
        (((0, 8), (4, 8), (4, 8)), "q"),
        (((4, 0), (4, 0), (4, 8)), "q"),
        (((4, 8), (0, 8), (0, 8)), "k"),
    ],
)
def test_empty_dimensions_are_rejected(x64, shapes, bad):
    q, k, v = (np.ones(s) for s in shapes)
    for call in (
        lambda: reference_attention(q, k, v, golden()),
        lambda: flash_attention(q, k, v, golden(), Blocks(4, 4)),
    ):
        with pytest.raises(ValueError, match=rf"{bad}: expected at least one row and one column"):
            call()


def test_golden_needs_x64():
    q, k, v = qkv(6)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(RuntimeError, match="jax_enable_x64"):
            reference_attention(q, k, v, golden())
    finally:
        jax.config.update("jax_enable_x64", previous)


# In the default run, the sweep's vmapped programs (test_sweep: every row equals direct
# calls, bitwise) and test_backward's vmapped gradients check traced format widths.
@pytest.mark.slow
def test_vmap_over_policy_mantissa_widths_equals_separate_calls():
    """One compiled program for several formats (the sweep engine relies on it)."""
    from fa_jax import custom

    q, k, v = qkv(7, n=20, m=20, d=8)
    widths = jnp.array([3, 6])
    flash = jax.jit(
        jax.vmap(lambda m: flash_attention(q, k, v, paper_uniform(custom(8, m)), Blocks(4, 8))[0])
    )(widths)
    ref = jax.jit(jax.vmap(lambda m: reference_attention(q, k, v, paper_uniform(custom(5, m)))))(
        widths
    )
    for i, m in enumerate((3, 6)):
        want_flash, _ = flash_attention(q, k, v, paper_uniform(custom(8, m)), Blocks(4, 8))
        np.testing.assert_array_equal(np.asarray(flash[i]), np.asarray(want_flash))
        np.testing.assert_array_equal(
            np.asarray(ref[i]),
            np.asarray(reference_attention(q, k, v, paper_uniform(custom(5, m)))),
        )


# Every variant masks in e4m3fn; e4m3fnuz (no negative zero either) takes the same
# mask path, checked with fa2 by default and with the other variants in `-m slow`.
NO_INF_CASES = [
    (v, f) if f == "e4m3fn" or v == "fa2" else pytest.param(v, f, marks=pytest.mark.slow)
    for f in ("e4m3fn", "e4m3fnuz")
    for v in VARIANTS
]


@pytest.mark.parametrize("variant, fmt", NO_INF_CASES)
def test_formats_without_infinities_mask_cleanly(variant, fmt):
    """-inf is a mask, never rounded: e4m3fn/fnuz (no inf) must not produce NaN."""
    q, k, v = qkv(8, lead=(2,), n=12, m=12, d=8)
    pol, kl = paper_uniform(get_format(fmt)), np.array([12, 5])
    out, _ = flash_attention(
        q, k, v, pol, Blocks(4, 4), variant=variant, causal=True, kv_lengths=kl
    )
    ref = reference_attention(q, k, v, pol, causal=True, kv_lengths=kl)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(ref)).all()
    assert rel_err(out, numpy_attention(q, k, v, causal=True, kv_lengths=kl)) < 0.5


def numpy_causal_rows(q, k, v, scale):
    """Float64 causal attention row by row, written apart from the mask code: with
    N queries and M keys the mask is top-left aligned (fa_jax.attention's
    convention, as PyTorch's is_causal), so query i sees keys 0..min(i, M - 1) --
    for N < M the last M - N keys are seen by no query but the last rows, for
    N > M the rows i >= M see every key.  Returns (O, lse)."""
    n, m = q.shape[-2], k.shape[-2]
    out = np.zeros((*q.shape[:-1], v.shape[-1]))
    lse = np.zeros(q.shape[:-1])
    for b in np.ndindex(q.shape[:-2]):
        for i in range(n):
            seen = min(i, m - 1) + 1
            s = np.array([float(np.dot(q[b][i], k[b][j])) * scale for j in range(seen)])
            w = np.exp(s - s.max())
            out[b][i] = (w / w.sum()) @ v[b][:seen]
            lse[b][i] = s.max() + math.log(w.sum())
    return out, lse


@pytest.mark.parametrize(
    "n, m, blocks", [(7, 19, Blocks(4, 8)), (19, 7, Blocks(3, 5))], ids=["N<M", "N>M"]
)
def test_causal_with_n_not_m_matches_numpy_float64(n, m, blocks):
    """Causal reference and flash attention (every variant, blocks that divide neither
    length) with N != M under golden() equal a row-by-row float64 computation."""
    q, k, v = qkv(3, lead=(2,), n=n, m=m, d=8)
    want, want_lse = numpy_causal_rows(q, k, v, 1 / math.sqrt(8))
    scale = max(1.0, float(np.max(np.abs(want))))
    ref = np.asarray(reference_attention(q, k, v, golden(), causal=True))
    assert np.max(np.abs(ref - want)) <= 1e-12 * scale
    for variant in VARIANTS:
        out, lse = flash_attention(q, k, v, golden(), blocks, variant=variant, causal=True)
        assert np.max(np.abs(np.asarray(out) - want)) <= 1e-12 * scale, variant
        assert np.max(np.abs(np.asarray(lse) - want_lse)) <= 1e-12 * max(
            1.0, float(np.max(np.abs(want_lse)))
        ), variant


# -- the exp2 placement (Policy.scale "exp2") ----------------------------------------------


def _exp2(fmt):
    return fa2_kernel(fmt).replace(scale="exp2", exp_model="exp2_correctly_rounded")


def test_exp2_reference_attention_against_exact_rationals():
    """S unscaled, P̃ = fl32(2^fl32(fma(S, c, -fl32(m c)))), l, P, O each rounded
    once, computed with Fractions: reference attention gives the same bits."""
    from fractions import Fraction

    from oracle import round_exact

    from fa_jax.formats import FP32

    q, k, v = (round_to(jnp.asarray(t), BF16) for t in qkv(11, lead=(), n=3, m=5, d=4))
    pol = _exp2(BF16)
    got = np.asarray(reference_attention(q, k, v, pol))
    fq, fk, fv = ([[Fraction(float(x)) for x in row] for row in np.asarray(t)] for t in (q, k, v))
    c = Fraction(float(np.float32(0.5 * math.log2(math.e))))  # scale 1/√4: exact in FP32
    for i in range(3):
        s = [round_exact(sum(a * b for a, b in zip(fq[i], fk[j])), FP32) for j in range(5)]
        m = max(s)
        shift = Fraction(round_exact(Fraction(m) * c, FP32))
        e = [float(np.float32(np.exp2(round_exact(Fraction(x) * c - shift, FP32)))) for x in s]
        l = Fraction(round_exact(sum(Fraction(x) for x in e), FP32))
        p = [Fraction(round_exact(Fraction(x) / l, BF16)) for x in e]
        for col in range(4):
            o = round_exact(round_exact(sum(p[j] * fv[j][col] for j in range(5)), FP32), BF16)
            assert got[i, col] == o, (i, col)


@pytest.mark.extended  # 7 s: for the default run's time only
def test_exp2_flash_lse_and_grads():
    """One key block: flash's (m, l) are reference's, so their log-sum-exps
    m · scale + log l agree bitwise; the exp2 placement changes O; gradients run
    through the emulated backward (which recomputes P with the exp2 shift of the
    log-sum-exp) and at FP64 stages agree with the natural-exp gradients to
    float64 rounding."""
    q, k, v = qkv(12, n=24, m=24, d=8)
    pol = _exp2(BF16)
    _, lse_ref = reference_attention(q, k, v, pol, return_lse=True)
    _, lse_fl = flash_attention(q, k, v, pol, Blocks(24, 24))
    np.testing.assert_array_equal(np.asarray(lse_fl), np.asarray(lse_ref))
    fp32_out = {"out": get_format("fp32")}  # O unrounded to bf16, where the two differ
    o_exp2 = flash_attention(q, k, v, pol.replace(**fp32_out), Blocks(24, 24))[0]
    o_exp = flash_attention(q, k, v, fa2_kernel(BF16).replace(**fp32_out), Blocks(24, 24))[0]
    assert not np.array_equal(np.asarray(o_exp2), np.asarray(o_exp))
    gold2 = golden().replace(scale="exp2", exp_model="exp2_correctly_rounded")

    def loss(pol, q, k, v):
        return flash_attention(q, k, v, pol, Blocks(8, 8))[0].sum()

    g2 = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)(gold2, q, k, v)
    ge = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)(golden(), q, k, v)
    for a, b in zip(g2, ge):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-13)
