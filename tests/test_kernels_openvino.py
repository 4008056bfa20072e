"""OpenVINO's fused CPU ScaledDotProductAttention (``openvino-sdpa``) and its exp and
softmax (:mod:`fa_jax.kernels.openvino.sdpa`) against the real library.

Skipped where openvino is absent.  The model-vs-real checks run where the model
answers in both precisions (:func:`fa_jax.kernels.openvino.unmodelled`: AVX-512
with BF16 dot products, ``avx512_bf16``, or AMX: the plugin's BF16 brgemm and
its softmax take the ``vdpbf16ps`` (or the tile dot's) and AVX-512 paths there,
the ones the model follows); elsewhere they skip with the model's refusal.
The plugin's AVX2 build (F32 inference) is checked where this CPU runs it, and
on any AVX2 or AVX-512 host through the lab (``tests/lab.py``: under qemu-user
on an AVX-512 host).  Where it answers the model is bit-exact on every case
here, so each asserts 100 %.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from numpy.typing import DTypeLike

import fa_jax
from fa_jax import BF16, FP32, kernels, ops
from fa_jax._x64 import float64_enabled
from fa_jax.kernels import openvino as O
from fa_jax.kernels.openvino import sdpa as ovs
from fa_jax.kernels.x86 import cpu
from fa_jax.kernels.x86.tile_dot import tile_dot

ov = pytest.importorskip("openvino", reason="openvino is not installed")

_REFUSED = O.unmodelled(precision="bf16")
needs_bf16_cpu = pytest.mark.skipif(
    _REFUSED is not None, reason=f"the model refuses this CPU: {_REFUSED}"
)
needs_avx2_build = pytest.mark.skipif(
    not O._avx2_build(cpu.flags()),
    reason=f"the plugin runs its AVX2 build on AVX2 CPUs without AVX-512F, not {cpu.describe()}",
)
_AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})


def _inputs(seed, h, n, m, d, dtype: DTypeLike = np.float32):
    rng = np.random.default_rng(seed)
    return tuple(
        rng.standard_normal(s).astype(dtype).astype(np.float64)
        for s in ((h, n, d), (h, m, d), (h, m, d))
    )


def _gqa_inputs(seed, h, h_kv, n, m, d):
    """Q (h, n, d) and K, V (h_kv, m, d), FP32 values."""
    rng = np.random.default_rng(seed)
    return tuple(
        rng.standard_normal(s).astype(np.float32).astype(np.float64)
        for s in ((h, n, d), (h_kv, m, d), (h_kv, m, d))
    )


def _identical(real, model) -> float:
    return float(np.mean(np.asarray(real) == np.asarray(model)))


def test_registered():
    assert "openvino-sdpa" in kernels.names()
    assert "openvino-sdpa" in kernels.available()
    kernel = kernels.get("openvino-sdpa")
    assert kernel.formats == ("fp32", "bf16")
    assert kernel.options == ("precision", "kv_cache", "threads")
    assert kernel.features == {"gqa", "q_offset"}
    facts = kernel.platform()
    assert facts["openvino"] == ov.__version__ and facts["backend"] == "cpu"


def test_options_checked():
    q, k, v = _inputs(0, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="precision"):
        kernels.real("openvino-sdpa", q, k, v, fmt="fp32", precision="f16")
    with pytest.raises(ValueError, match="kv_cache"):
        kernels.emulate("openvino-sdpa", q, k, v, fmt="fp32", kv_cache="i4")
    with pytest.raises(ValueError, match="threads"):
        kernels.real("openvino-sdpa", q, k, v, fmt="fp32", threads=0)
    with pytest.raises(ValueError, match="natively"):
        kernels.real("openvino-sdpa", q, k, v, fmt="fp16")
    q, k, v = _inputs(0, 1, 5, 4, 8)
    with pytest.raises(ValueError, match="N <= M"):
        kernels.real("openvino-sdpa", q, k, v, fmt="fp32")


def test_model_refuses_what_it_does_not_model(monkeypatch):
    """BF16 decoding on a u8 cache with d mod 16 != 0, on a CPU whose code is modelled."""
    monkeypatch.setattr(cpu, "flags", lambda: cpu.AVX512 | {"avx512_bf16"})
    q, k, v = _inputs(1, 1, 1, 20, 40)
    with pytest.raises(NotImplementedError, match="scalar tail"):
        kernels.emulate("openvino-sdpa", q, k, v, fmt="fp32", kv_cache="u8")


def test_the_model_follows_the_cpus_amx(monkeypatch):
    """On any CPU: the BF16 prefill's brgemm is the tile dot in blocks of 32 where the
    CPU has AMX (fa_jax.kernels.x86.tile_dot), the vdpbf16ps pair chain elsewhere; the two
    differ on these inputs (d = 80 = 32 + 32 + 16)."""
    for amx in (False, True):
        flags = cpu.AVX512 | {"avx512_bf16"} | ({"amx_bf16"} if amx else set())
        monkeypatch.setattr(cpu, "flags", lambda flags=flags: flags)
        forward = kernels.model("openvino-sdpa", "fp32", 8, 80).forward
        assert forward.keywords["amx"] is amx  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
    a, b = (_inputs(9, 1, 3, 3, 80, ml_dtypes.bfloat16)[i][0] for i in (0, 1))
    with float64_enabled():
        matmul = jax.jit(ovs.bf16_matmul, static_argnames="amx")
        s_amx = np.asarray(matmul(jnp.asarray(a), jnp.asarray(b.T), amx=True))
        s_vdp = np.asarray(matmul(jnp.asarray(a), jnp.asarray(b.T), amx=False))
        tiles = jax.jit(lambda a, b: tile_dot(a, b, FP32, chunking="blocks"))
        np.testing.assert_array_equal(s_amx, tiles(jnp.asarray(a), jnp.asarray(b.T)))
    assert np.any(s_amx != s_vdp)


def test_amx_prefill_is_its_steps(monkeypatch):
    """On any CPU: with AMX the BF16 prefill is the tile dots in blocks of 32, the
    softmax, and each head's N · d outputs stored as one run, so that only the
    last row's last (N · d) mod 16 = 8 go through ov::bfloat16 (which differs from
    nearest even on these inputs)."""
    monkeypatch.setattr(cpu, "flags", lambda: cpu.AVX512 | {"avx512_bf16", "amx_bf16"})
    q, k, v = _inputs(3, 2, 13, 13, 40)
    got = np.asarray(kernels.emulate("openvino-sdpa", q, k, v, fmt="fp32", precision="bf16"))

    def steps(q, k, v):
        qb, kb, vb = (ops.cast(t, BF16) for t in (q, k, v))
        s = tile_dot(qb, jnp.swapaxes(kb, -1, -2), FP32, chunking="blocks")
        p = ovs.softmax(s, O._scale(None, 40), None, bf16=True)
        o = tile_dot(p, vb, FP32, chunking="blocks").reshape(2, 13 * 40)
        head = [ops.cast(o[:, :512], BF16), ovs.bf16_scalar(o[:, 512:])]
        return jnp.concatenate(head, axis=-1).reshape(2, 13, 40), ops.cast(o, BF16)

    with float64_enabled():
        want, nearest = (np.asarray(x) for x in jax.jit(steps)(q, k, v))
    assert np.array_equal(got, want)
    assert not np.array_equal(want, nearest.reshape(2, 13, 40))


def test_exp_ps_reference_points():
    """exp_ps where its steps are known exactly: exp(0) = fl(p(0) · 2^-1) · 2 = 1 (n = 0,
    r = 0, p = 1); at and below ln FLT_MIN (n - 1 = -127, or the zero mask) it gives 0."""
    x = np.array([0.0, float(np.float32(-87.33654)), -88.0, -200.0], np.float32)
    with float64_enabled():
        e = np.asarray(ovs.exp_ps(jnp.asarray(x, jnp.float64)))
    assert e.tolist() == [1.0, 0.0, 0.0, 0.0]


@needs_bf16_cpu
@pytest.mark.parametrize(
    ("precision", "n", "d", "causal", "fmt"),
    [
        ("bf16", 11, 16, True, "fp32"),  # fp32 inputs rounded to bf16 by the plugin
        # N · d mod 16 = 8: with AMX the last row's last 8 outputs stored by ov::bfloat16
        ("bf16", 13, 40, False, "fp32"),
        # N mod 4 = 1: the last row in MLAS's one-row kernels (Q Kᵀ: 8 AVX lanes)
        ("f32", 5, 16, False, "fp32"),
        pytest.param("f32", 9, 20, True, "fp32", marks=pytest.mark.extended),
        # N = 1: the decoding kernel on the cache (u8 by default)
        pytest.param("bf16", 1, 64, False, "fp32", marks=pytest.mark.extended),
        pytest.param("f32", 13, 100, False, "fp32", marks=pytest.mark.extended),
        pytest.param("bf16", 17, 80, False, "bf16", marks=pytest.mark.extended),
        pytest.param("f32", 19, 64, True, "fp32", marks=pytest.mark.extended),
    ],
)
def test_prefill_exact(precision, n, d, causal, fmt):
    dtype = ml_dtypes.bfloat16 if fmt == "bf16" else np.float32
    q, k, v = _inputs(3, 2, n, n, d, dtype)
    real = kernels.real("openvino-sdpa", q, k, v, fmt=fmt, causal=causal, precision=precision)
    model = kernels.emulate("openvino-sdpa", q, k, v, fmt=fmt, causal=causal, precision=precision)
    assert _identical(real, model) == 1.0


@pytest.mark.extended
@needs_bf16_cpu
def test_prefill_exact_jit_and_scale():
    """The model's forward under an outer jit (eager above), with a scale given."""
    q, k, v = _inputs(4, 1, 15, 15, 64)
    real = kernels.real("openvino-sdpa", q, k, v, fmt="fp32", causal=True, scale=0.3)
    m = kernels.model("openvino-sdpa", "fp32", 15, 64)
    forward = m.forward
    assert forward is not None
    with float64_enabled():
        model = jax.jit(lambda a, b, c: forward(a, b, c, policy=m.policy, causal=True, scale=0.3))(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        )
    assert _identical(real, np.asarray(model, np.float64)) == 1.0


@needs_bf16_cpu  # BF16 inference: a CPU without AVX-512 BF16 may run the hint in f32
def test_decode_reads_the_cache_in_its_precision():
    """One query over 40 keys (two calls: 39 keys into the cache, then the query):
    the u8 cache's quantisation reaches the output, a bf16 cache's does not
    differ from an f32 one's under BF16 inference, and threads are accepted."""
    q, k, v = _inputs(5, 2, 1, 40, 64, ml_dtypes.bfloat16)
    out = {
        kv: kernels.real("openvino-sdpa", q, k, v, fmt="bf16", kv_cache=kv, threads=2)
        for kv in O.KV_CACHES
    }
    assert out["u8"].shape == (2, 1, 64)
    assert not np.array_equal(out["u8"], out["bf16"])
    assert np.array_equal(out["bf16"], out["f32"])


@needs_bf16_cpu
@pytest.mark.parametrize(
    ("h", "n", "m", "d", "kv_cache", "threads"),
    [
        # the two threads' shares split a head's keys
        pytest.param(3, 1, 37, 32, "bf16", 2, marks=pytest.mark.extended),
        pytest.param(2, 1, 1031, 80, "f32", 1, marks=pytest.mark.extended),
        pytest.param(4, 1, 1037, 128, "bf16", 2, marks=pytest.mark.extended),
        pytest.param(2, 3, 515, 64, "bf16", 2, marks=pytest.mark.extended),
        pytest.param(2, 1, 1031, 64, "u8", 1, marks=pytest.mark.extended),
        pytest.param(3, 1, 1031, 80, "u8", 2, marks=pytest.mark.extended),
        pytest.param(2, 2, 700, 128, "u8", 2, marks=pytest.mark.extended),
    ],
)
def test_decode_exact(h, n, m, d, kv_cache, threads):
    """BF16 decoding, N queries after M - N cached keys (u8: quantized per token),
    against the real kernel."""
    q, k, v = _inputs(6, h, n, m, d)
    call = {"fmt": "fp32", "kv_cache": kv_cache, "threads": threads}
    real = kernels.real("openvino-sdpa", q, k, v, **call)
    model = kernels.emulate("openvino-sdpa", q, k, v, **call)
    assert _identical(real, model) == 1.0


@needs_bf16_cpu  # the plugin's BF16 paths beside its FP32 ones on the same host
@pytest.mark.parametrize(
    ("precision", "h", "n", "m", "d", "kv_cache", "threads"),
    [
        # FP32 queries: four accumulators over blocks of 16, the rest into the first,
        # ((0 + 1) + 2) + 3, and a scalar tail of rounded products (d = 100: 6 blocks + 4)
        # (on a u8 cache it reads K and V back as fl(fl(u - zp) · scale) first)
        ("f32", 2, 2, 9, 100, "u8", 2),
        pytest.param("f32", 2, 2, 9, 100, "f32", 2, marks=pytest.mark.extended),
        pytest.param("f32", 3, 3, 515, 80, "u8", 2, marks=pytest.mark.extended),
        # BF16 queries, d mod 16 != 0: the same tail; the last d mod 16 columns stored
        # as ov::bfloat16 rounds them
        pytest.param("bf16", 3, 1, 9, 40, "bf16", 2, marks=pytest.mark.extended),
        # under F32 inference a bf16 cache holds FP32
        pytest.param("f32", 2, 1, 37, 48, "bf16", 1, marks=pytest.mark.extended),
        pytest.param("bf16", 2, 2, 23, 8, "f32", 1, marks=pytest.mark.extended),
        pytest.param("f32", 2, 1, 1031, 80, "f32", 2, marks=pytest.mark.extended),
        pytest.param("f32", 8, 1, 2048, 112, "f32", 1, marks=pytest.mark.extended),
        pytest.param("f32", 4, 3, 515, 20, "bf16", 2, marks=pytest.mark.extended),
        pytest.param("bf16", 4, 1, 1031, 100, "bf16", 2, marks=pytest.mark.extended),
    ],
)
def test_decode_exact_fp32_and_tails(precision, h, n, m, d, kv_cache, threads):
    """F32 decoding and the dot product's scalar tail, against the real kernel."""
    q, k, v = _inputs(7, h, n, m, d)
    call = {"fmt": "fp32", "precision": precision, "kv_cache": kv_cache, "threads": threads}
    real = kernels.real("openvino-sdpa", q, k, v, **call)
    model = kernels.emulate("openvino-sdpa", q, k, v, **call)
    assert _identical(real, model) == 1.0


def _fills_agree(seed, h, n, m, d, precision, kv_cache, threads):
    """Decoding with the cache set as state and with it filled by a prefill call:
    the same bits (keys scaled per token, so the u8 scales differ)."""
    q, k, v = _inputs(seed, h, n, m, d)
    k = k * np.random.default_rng(seed).uniform(0.1, 10.0, (h, m, 1)).astype(np.float32)
    call = {"fmt": "fp32", "precision": precision, "kv_cache": kv_cache, "threads": threads}
    state = O.real_sdpa(q, k, v, fill="state", **call)
    prefill = O.real_sdpa(q, k, v, fill="prefill", **call)
    assert state.shape == (h, n, d)
    assert np.array_equal(state.view(np.uint64), prefill.view(np.uint64))
    return q, k, v, state


@needs_bf16_cpu  # BF16 inference as the plugin runs it with AVX-512 BF16
@pytest.mark.parametrize("precision", O.PRECISIONS)
def test_decode_cache_state_is_the_prefill_fill(precision):
    """Every cache and thread count, one or two queries after 36, 298 and 2047 keys."""
    for kv_cache in O.KV_CACHES:
        for threads in (1, 2):
            for h, n, m, d in ((2, 1, 37, 64), (3, 2, 300, 80), (2, 1, 2048, 128)):
                _fills_agree(threads, h, n, m, d, precision, kv_cache, threads)
    with pytest.raises(ValueError, match="fill"):
        O.real_sdpa(*_inputs(0, 1, 1, 4, 8), fmt="fp32", fill="zeros")


@needs_bf16_cpu
@pytest.mark.skipif(
    O._avx2_build(cpu.flags()),
    reason="the AVX2 build runs the bf16 hint as F32 inference: nothing is rounded to BF16",
)
def test_decode_cache_state_rounds_to_bf16_first(monkeypatch):
    """A u8 state quantizes what it is given: FP32 keys and values set unrounded under
    BF16 inference give other bits than the prefill fill (BF16 first: the same)."""
    import openvino as ov

    def unrounded(request, k, v, precision, h):
        for state in request.query_state():
            x = {"past_k": k, "past_v": v}[state.name]
            state.state = ov.Tensor(np.ascontiguousarray(x))

    q, k, v, state = _fills_agree(8, 2, 1, 300, 64, "bf16", "u8", 1)
    monkeypatch.setitem(O._FILLS, "state", unrounded)
    assert not np.array_equal(O.real_sdpa(q, k, v, fmt="fp32", kv_cache="u8"), state)


@pytest.mark.slow
@needs_bf16_cpu
@pytest.mark.parametrize("precision", O.PRECISIONS)
@pytest.mark.parametrize("kv_cache", O.KV_CACHES)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_cache_state_is_the_prefill_fill_slow(precision, kv_cache, threads):
    """d with tails (d mod 16, d mod 64), three queries, a longer cache."""
    for h, n, m, d in ((2, 3, 515, 100), (4, 1, 1031, 48), (1, 1, 8192, 128)):
        _fills_agree(m, h, n, m, d, precision, kv_cache, threads)


def test_dot_product_orders():
    """d = 100: six blocks of 16 and a tail of 4.  Lane 0 holds 2^24 (block 0), -2^24
    (block 1), 1 (blocks 4 and 5): for FP32 queries blocks 4 and 5 both join
    accumulator 0 and vanish into 2^24, so the lanes give 0; for BF16 ones block 5
    goes to accumulator 1, where -2^24 + 1 is exact, so they give 1.  The tail's
    four ones are added after: 4 and 5."""
    q = np.zeros((1, 1, 100))
    q[..., [0, 16, 64, 80]] = [2.0**24, -(2.0**24), 1.0, 1.0]
    q[..., 96:] = 1.0
    k = np.ones((1, 1, 100))
    with float64_enabled():
        got = [
            np.asarray(jax.jit(ovs.dot_product, static_argnames="fp32")(q, k, fp32=fp32)).item()
            for fp32 in (True, False)
        ]
    assert got == [4.0, 5.0]


def test_bf16_scalar_store():
    """ov::bfloat16's rounding: an odd last BF16 bit rounds up from the half, an even
    one truncates (0x3f808000 -> 0x3f80, 0x3f818000 -> 0x3f82, 0x3f80ffff -> 0x3f80)."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0xBF817FFF], np.uint32)
    with float64_enabled():
        out = np.asarray(ovs.bf16_scalar(jnp.asarray(bits.view(np.float32), jnp.float64)))
    got = (out.astype(np.float32).view(np.uint32) >> 16).tolist()
    assert got == [0x3F80, 0x3F82, 0x3F80, 0xBF81]


def test_thread_shares():
    """OpenVINO's splitter: contiguous shares, the first ``work mod threads`` one longer."""
    assert O.thread_shares(10, 1) == [(0, 10)]
    assert O.thread_shares(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert O.thread_shares(2, 3) == [(0, 1), (1, 2), (2, 2)]


@pytest.mark.extended
@needs_bf16_cpu
@pytest.mark.parametrize("precision", O.PRECISIONS)
@pytest.mark.parametrize("d", [64, 80, 128])
def test_prefill_exact_extended(precision, d):
    n = 127 if d != 80 else 131
    for causal in (True, False):
        q, k, v = _inputs(d, 2, n, n, d)
        real = kernels.real(
            "openvino-sdpa", q, k, v, fmt="fp32", causal=causal, precision=precision
        )
        model = kernels.emulate(
            "openvino-sdpa", q, k, v, fmt="fp32", causal=causal, precision=precision
        )
        assert _identical(real, model) == 1.0


def test_isa_chooses_the_build(monkeypatch):
    """On any CPU: None follows the CPU (AVX2 without AVX-512F: the AVX2 build, where
    the bf16 hint runs in f32); an explicit isa answers on any CPU; anything else
    is an error."""
    monkeypatch.setattr(cpu, "flags", lambda: _AVX2_FLAGS)
    f = fa_jax.get_format("fp32")
    for precision in O.PRECISIONS:
        for isa in (None, "AVX2"):
            forward = O.sdpa_model(f, 4, 16, precision=precision, isa=isa).forward
            assert forward.keywords["code"] is ovs.AVX2  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
            assert forward.keywords["precision"] == "f32"  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
    forward = O.sdpa_model(f, 4, 16, precision="bf16", isa="AVX512").forward
    assert forward.keywords["code"] is ovs.AVX512F  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
    monkeypatch.setattr(cpu, "flags", lambda: cpu.AVX512 | _AVX2_FLAGS)
    forward = O.sdpa_model(f, 4, 16, precision="f32").forward
    assert forward.keywords["code"] is ovs.AVX512F  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
    forward = O.sdpa_model(f, 4, 16, precision="f32", isa="AVX2").forward
    assert forward.keywords["code"] is ovs.AVX2  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
    with pytest.raises(ValueError, match="isa: expected one of"):
        O.sdpa_model(f, 4, 16, precision="f32", isa="SSE")
    # AVX-512F without BW, DQ and VL: the plugin's AVX512F build, not modelled
    monkeypatch.setattr(cpu, "flags", lambda: _AVX2_FLAGS | {"avx512f"})
    assert "not modelled" in str(O.unmodelled(precision="f32"))


def test_avx2_sums():
    """The AVX2 build's horizontal sums.  Σ e in 8 lanes by hsum, ((l0 + l1) + (l2 +
    l3)) + ((l4 + l5) + (l6 + l7)): lanes 2^24, 1, 1, 0, -2^24 lose both ones into
    2^24 (a tie, to even) and give 0; the AVX-512 code's 16 lanes (lane i + lane
    i+4 after i + i+8) cancel the 2^24s first and give 2.  The dot product's
    simd::reduce, ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), on products
    2^24, 1, 0, 0, -2^24, 1: 0 + 2 = 2; on AVX-512, d = 8 is all scalar tail, summed
    in order: 2^24 + 1 = 2^24, ..., then - 2^24 + 1 = 1."""
    e = np.zeros((1, 16))
    e[0, [0, 1, 2, 4]] = [2.0**24, 1.0, 1.0, -(2.0**24)]
    q = np.zeros((1, 1, 8))
    q[..., [0, 1, 4, 5]] = [2.0**24, 1.0, -(2.0**24), 1.0]
    k = np.ones((1, 1, 8))
    codes = (ovs.AVX2, ovs.AVX512F)
    with float64_enabled():
        sums = jax.jit(ovs.lane_sum, static_argnames=("code", "tree"))
        got = [float(sums(jnp.asarray(e), code)[0]) for code in codes]
        dot = jax.jit(ovs.dot_product, static_argnames=("fp32", "code"))
        dots = [float(np.asarray(dot(q, k, fp32=True, code=c)).item()) for c in codes]
    assert got == [0.0, 2.0]
    assert dots == [2.0, 1.0]


def test_u8_dot_product_corrects_after_the_sum():
    """The AVX2 build's u8 keys: scale · fma(-zp, Σ q, Σ q·u), the integers summed
    first.  d = 9: one block of 8 and a tail of 1, whose sums are exact here
    (Σ q = 7.75, Σ q·u = 404.75), so the result is that formula's one FMA and one
    product, and not the unfused fl(zp · Σ q) first."""
    q = np.array([[[0.5, 1, 1, 1, 1, 1, 1, 1, 0.25]]])
    u = np.array([[[3, 0, 255, 1, 2, 7, 9, 128, 5]]], np.float64)
    scale, zp = (np.array([[[np.float32(x)]]], np.float64) for x in (0.1, 77.3))
    with float64_enabled():
        got = np.asarray(jax.jit(ovs.u8_dot_product)(q, u, scale, zp)).item()
    head, raw, s, z = 7.75, 404.75, scale.item(), zp.item()
    assert float(np.sum(q)) == head and float(np.sum(q * u)) == raw
    assert got == float(np.float32(s * float(np.float32(raw - z * head))))
    assert got != float(np.float32(s * float(np.float32(raw - float(np.float32(z * head))))))


@needs_avx2_build
@pytest.mark.parametrize(
    ("precision", "h", "n", "m", "d", "kv_cache", "threads", "causal"),
    [
        # the bf16 hint, which the plugin runs in f32 on this CPU (keys set as state
        # unrounded: no BF16 inference rounds them)
        pytest.param("bf16", 2, 2, 30, 36, "u8", 1, False, marks=pytest.mark.extended),
        # decoding, F32 cache: blocks of 8 into four accumulators, simd::reduce, a tail
        pytest.param("f32", 2, 1, 37, 20, "f32", 1, False, marks=pytest.mark.extended),
        # u8 keys in the affine form, d mod 8 = 4, two threads splitting a head's keys
        ("f32", 2, 2, 9, 100, "u8", 2, False),
        pytest.param("f32", 3, 1, 37, 72, "u8", 2, False, marks=pytest.mark.extended),
        pytest.param("f32", 2, 1, 40, 4, "u8", 1, False, marks=pytest.mark.extended),
        pytest.param("f32", 2, 3, 515, 20, "u8", 1, False, marks=pytest.mark.extended),
        pytest.param("f32", 2, 1, 1031, 80, "f32", 2, False, marks=pytest.mark.extended),
        pytest.param("f32", 2, 3, 515, 100, "bf16", 2, False, marks=pytest.mark.extended),
        # prefill: MLAS's GEMMs and the softmax's 8 lanes (N mod 4 = 1: one-row kernels)
        ("f32", 2, 5, 5, 16, "f32", 1, False),
        pytest.param("f32", 2, 9, 9, 20, "f32", 1, True, marks=pytest.mark.extended),
        pytest.param("f32", 2, 13, 13, 100, "u8", 1, True, marks=pytest.mark.extended),
        pytest.param("f32", 2, 19, 19, 64, "f32", 2, True, marks=pytest.mark.extended),
        pytest.param("f32", 2, 8, 8, 36, "f32", 1, False, marks=pytest.mark.extended),
    ],
)
def test_avx2_build_exact(precision, h, n, m, d, kv_cache, threads, causal):
    """F32 inference on the plugin's AVX2 build (this CPU's), against the real kernel
    (with the bf16 hint too)."""
    q, k, v = _inputs(11, h, n, m, d)
    call = {"fmt": "fp32", "precision": precision, "kv_cache": kv_cache, "threads": threads}
    real = kernels.real("openvino-sdpa", q, k, v, causal=causal, **call)
    model = kernels.emulate("openvino-sdpa", q, k, v, causal=causal, **call)
    assert _identical(real, model) == 1.0


_LAB_CHILD = """
import json, sys
import numpy as np
from fa_jax.kernels.x86 import cpu
from fa_jax.kernels import openvino as O
out = {"flags": np.array(sorted(cpu.flags()))}
with np.load(sys.argv[1]) as f:
    for i, (kv, threads, causal) in enumerate(json.loads(sys.argv[2])):
        out[f"o{i}"] = O.real_sdpa(
            f[f"q{i}"], f[f"k{i}"], f[f"v{i}"], fmt="fp32", precision="f32",
            kv_cache=kv, threads=threads, causal=causal,
            q_offset=f[f"k{i}"].shape[-2] - f[f"q{i}"].shape[-2] if causal else 0,
        )
np.savez(sys.argv[3], **out)
"""


@pytest.mark.extended
def test_the_avx2_build_is_modelled_on_any_host(tmp_path):
    """OpenVINO run as an AVX2 CPU (natively, or under qemu-user on an AVX-512 host):
    the plugin's AVX2 build, F32 inference on F32 and u8 caches, decoding, a causal
    prefill, and GQA 2:1 decoding after a cache with the causal mask bottom-right,
    bit for bit as the model with isa="AVX2" gives it on this host; the AVX-512
    model's bits are not these."""
    from lab import run_as_avx2

    # (kv, threads, causal, h, h_kv, n, m, d)
    cases = [
        ("f32", 1, False, 2, 2, 1, 37, 20),
        ("u8", 2, False, 2, 2, 2, 19, 36),
        ("f32", 1, True, 2, 2, 9, 9, 24),
        ("u8", 2, True, 6, 3, 2, 19, 36),
    ]
    arrays, inputs = {}, []
    for i, (_, _, _, h, h_kv, n, m, d) in enumerate(cases):
        q, k, v = _gqa_inputs(20 + i, h, h_kv, n, m, d)
        inputs.append((q, k, v))
        arrays.update({f"q{i}": q, f"k{i}": k, f"v{i}": v})
    np.savez(tmp_path / "in.npz", **arrays)
    spec = json.dumps([[kv, threads, causal] for kv, threads, causal, *_ in cases])
    out = tmp_path / "out.npz"
    run_as_avx2(_LAB_CHILD, str(tmp_path / "in.npz"), spec, str(out))
    with np.load(out) as got:
        flags = frozenset(str(f) for f in got["flags"])
        real = [got[f"o{i}"] for i in range(len(cases))]
    assert O._avx2_build(flags), flags
    fp32 = fa_jax.get_format("fp32")
    avx512_equal = []
    for (kv, threads, causal, _, _, n, m, d), (q, k, v), r in zip(cases, inputs, real):
        options = {"precision": "f32", "kv_cache": kv, "threads": threads}
        at = {"causal": causal, **({"q_offset": m - n} if causal and m != n else {})}
        model = O.sdpa_model(fp32, n, d, isa="AVX2", **options)(q, k, v, **at)
        np.testing.assert_array_equal(np.asarray(model), r, err_msg=str((kv, causal)))
        avx512 = O.sdpa_model(fp32, n, d, isa="AVX512", **options)(q, k, v, **at)
        avx512_equal.append(np.array_equal(np.asarray(avx512), r))
    assert not all(avx512_equal)


def test_gqa_graph_is_the_fused_node_on_the_cache():
    """K/V with H_kv < H heads: the state holds H_kv heads and the repeat_kv pattern
    (Unsqueeze, Broadcast, Reshape) folds into the fused node, whose K and V inputs
    and past K and V have H_kv heads (six inputs: q, k, v, beam_idx, past k, v)."""
    for h, h_kv in ((4, 2), (4, 1)):
        compiled = O._compiled(h, h_kv, 16, 16, False, None, "f32", "u8", 1)
        ops = compiled.get_runtime_model().get_ops()
        types = [str(o.get_rt_info()["layerType"].astype(str)) for o in ops]
        assert "Reshape" not in types
        (node,) = [o for o, t in zip(ops, types) if t == "ScaledDotProductAttention"]
        assert node.get_input_size() == 6
        heads = [node.input(i).get_partial_shape()[1].get_length() for i in (0, 1, 2, 4, 5)]
        assert heads == [h, h_kv, h_kv, h_kv, h_kv]


def test_gqa_work_is_split_over_the_cache():
    """Two threads share B · H_kv · M (kv head, key) items: with H = 6, H_kv = 3 the
    split falls inside K/V head 1, so query heads 2 and 3 sum two partials, which K/V
    repeated to 6 heads (the split falling between heads 2 and 3) does not; the
    other heads' bits are the same."""
    q, k, v = _gqa_inputs(0, 6, 3, 1, 37, 20)
    call = {"fmt": "fp32", "precision": "f32", "kv_cache": "f32", "threads": 2}
    gqa = O.real_sdpa(q, k, v, **call)
    repeated = O.real_sdpa(q, np.repeat(k, 2, 0), np.repeat(v, 2, 0), **call)
    same = [np.array_equal(gqa[i], repeated[i]) for i in range(6)]
    assert same == [True, True, False, False, True, True]
    shares = O._shares(6, 3, 37, 2)  # (T, H, 1, M)
    assert shares[:, 2:4].any(axis=(-1, -2)).all()  # both threads hold keys of heads 2, 3
    assert not shares[1, :2].any() and not shares[0, 4:].any()


def test_q_offset_is_the_caches_bottom_right():
    """A causal call with N < M runs the plugin's mask behind its cache, bottom-right;
    top-left (or any other offset) is refused by the real kernel and the model."""
    q, k, v = _gqa_inputs(1, 2, 1, 2, 9, 8)
    for run in (kernels.real, kernels.emulate):
        with pytest.raises(ValueError, match="q_offset: expected M - N"):
            run("openvino-sdpa", q, k, v, fmt="fp32", causal=True, q_offset="top-left")
        with pytest.raises(ValueError, match="q_offset: expected M - N"):
            run("openvino-sdpa", q, k, v, fmt="fp32", causal=True, q_offset=3)
    with pytest.raises(ValueError, match="q_offset: expected 0"):
        O.real_sdpa(q, k, v, fmt="fp32", q_offset=7)


def _gqa_exact(seed, h, h_kv, n, m, d, kv_cache, threads, causal, precision="f32"):
    q, k, v = _gqa_inputs(seed, h, h_kv, n, m, d)
    call = {"fmt": "fp32", "precision": precision, "kv_cache": kv_cache, "threads": threads}
    if causal and n != m:
        call["q_offset"] = "bottom-right"
    real = kernels.real("openvino-sdpa", q, k, v, causal=causal, **call)
    model = kernels.emulate("openvino-sdpa", q, k, v, causal=causal, **call)
    assert _identical(real, model) == 1.0


@needs_avx2_build
def test_gqa_avx2_exact():
    """GQA 2:1 on a u8 cache, two queries after 39 keys, causal bottom-right, two
    threads whose split falls inside a K/V head (the AVX2 build, this CPU's)."""
    _gqa_exact(2, 6, 3, 2, 41, 36, "u8", 2, True)


@pytest.mark.slow
@needs_avx2_build
@pytest.mark.parametrize("kv_cache", ["f32", "u8"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("h", "h_kv"), [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_gqa_avx2_exact_slow(h, h_kv, kv_cache, threads):
    """GQA 1:1, 2:1, 4:1 on the AVX2 build: decoding (one query, odd M; d mod 8 = 4),
    chunked decoding with the causal mask bottom-right (three queries, d odd), and
    causal prefill, odd and even N (N mod 4 = 1: MLAS's one-row kernels)."""
    for seed, (n, m, d, causal) in enumerate(
        (
            (1, 37, 20, False),
            (3, 30, 17, True),
            (2, 19, 36, False),
            (9, 9, 24, True),
            (8, 8, 16, False),
        )
    ):
        _gqa_exact(seed, h, h_kv, n, m, d, kv_cache, threads, causal)


@pytest.mark.slow
@needs_bf16_cpu
@pytest.mark.parametrize("precision", O.PRECISIONS)
@pytest.mark.parametrize("kv_cache", O.KV_CACHES)
def test_gqa_exact_avx512(precision, kv_cache):
    """GQA 2:1 and 4:1 where the model follows the AVX-512 code: decoding and chunked
    causal decoding (two threads), and causal prefill."""
    for seed, (h, h_kv, n, m, d, causal) in enumerate(
        ((4, 2, 1, 37, 32, False), (8, 2, 3, 40, 64, True), (4, 1, 13, 13, 48, True))
    ):
        _gqa_exact(seed, h, h_kv, n, m, d, kv_cache, 2, causal, precision)


@pytest.mark.extended
def test_chunked_causal_decoding_is_each_query_alone():
    """N = 3 queries after 9 cached keys, causal bottom-right: query i's row is, bit
    for bit, one query decoding alone over the first 10 + i keys (its softmax on
    those, P = 0 after: an FMA of 0 · V leaves O as it is), on the real kernel
    and in the model of the AVX2 build (any host), one thread, an f32 cache."""
    q, k, v = _gqa_inputs(3, 4, 2, 3, 12, 20)
    call = {"fmt": "fp32", "precision": "f32", "kv_cache": "f32", "threads": 1}
    model = O.sdpa_model(fa_jax.get_format("fp32"), 3, 20, isa="AVX2", precision="f32")
    runs = {
        "real": lambda q, k, v, **at: O.real_sdpa(q, k, v, **call, **at),
        "model": lambda q, k, v, **at: model(q, k, v, **at),
    }
    for name, run in runs.items():
        chunk = np.asarray(run(q, k, v, causal=True, q_offset=9))
        alone = [np.asarray(run(q[:, i : i + 1], k[:, : 10 + i], v[:, : 10 + i])) for i in range(3)]
        np.testing.assert_array_equal(chunk, np.concatenate(alone, axis=1), err_msg=name)
    assert not np.array_equal(chunk, np.asarray(model(q, k, v)))  # the mask matters
