"""ggml's CPU flash attention (``ggml_flash_attn_ext``), its three paths step by step.

The source is ``ggml/src/ggml-cpu/ops.cpp`` of ggml 0.25.3 (vendored by
llama-cpp-python 0.3.36).  ``ggml_compute_forward_flash_attn_ext_f16`` (ops.cpp:9441)
picks one of:

* the **split-KV** path (ops.cpp:9485): one query row (``N == 1``, batch 1), K and V
  both F32 or both F16, ``M >= 512`` keys: thread ``t`` of ``T`` runs the scalar loop
  on keys ``[t·c, (t+1)·c)``, ``c = ceil(M / T)``, and
  ``ggml_flash_attn_ext_reduce_partials`` (ops.cpp:9371) merges the chunks in order:
  ``M' = max(M, M_c)``, ``o = o·e^(M-M') + o_c·e^(M_c-M')`` (one FMA), the same for
  the sum, then ``o / S``.  The output depends on ``T``: :func:`split_kv`.
* the **tiled** path (ops.cpp:9081): ``N >= 64`` query rows, Q F32, K and V both F32 or
  both F16: tiles of 64 keys; scores ``q·k`` by ``simd_gemm`` (``simd-gemm.h``: one
  FMA per element of d, in order, Q not rounded), scaled, masked; per row the tile's
  maximum, ``expf`` (glibc) of the old minus the new maximum where it grows, rescale
  of ``o`` and ``S``, ``ggml_vec_soft_max_f32`` (vec.cpp:531: :func:`fa_jax.kernels.ggml.vec.v_expf`
  on 16 lanes (AVX-512) or 8 (AVX2), each vector's sum by a halving tree added in
  double; ``S`` (FP32) plus that double sum rounded to FP32); ``o += P·V`` by
  ``simd_gemm`` (one FMA per key, in order, whatever its register blocking): :func:`tiled`.
* the **scalar** path (ops.cpp:8843) otherwise (few query rows, or quantized K/V):
  Q rounded to K's dot type (FP16 for F16 K, BF16 for BF16 K, Q8_0 blocks for
  quantized K), for every key in order ``s = fl(fl(dot(k, q)) · scale) + mask``; where
  ``s > M``: ``M = s``, ``ms = expf(M_old - M)``, ``o ·= ms``, ``vs = 1``; else
  ``vs = expf(s - M)``; ``o += v · vs`` (FMA), ``S = fma(S, ms, vs)``; with F16 V the
  accumulator ``o`` is FP16, every step rounded to FP32 then to FP16
  (``ggml_vec_scale_f16``, ``ggml_vec_mad_f16``, vec.h); finally ``o · fl(1/S)``:
  :func:`scalar`.

``expf`` is glibc's (:func:`fa_jax.exponential.glibc_expf`).  Arrays: q (R, D) FP32
values (R query rows), k (R, M, D), v (R, M, D_v) as the K/V type's values (already
dequantized), mask (R, M) of additive FP32 values or None (:func:`mask_values`);
float64 carriers, x64 on.

The features of ``ggml_flash_attn_ext(q, k, v, mask, scale, max_bias,
logit_softcap)`` and ``ggml_flash_attn_ext_add_sinks`` enter every path alike
(ops.cpp:8901-8925, 9138-9153, 9178):

* ``logit_softcap`` c != 0: ``scale /= c`` once (FP32), then each score
  ``s = fl(c · tanhf(fl(s · scale)))`` with glibc's ``tanhf``
  (:func:`fa_jax.kernels.x86.glibc_tanhf.tanhf`; the tiled path's ``ggml_vec_tanh_f32`` is the
  same scalar ``tanhf`` loop, vec.h:909) -- before the mask is added;
* the mask (F16, broadcast over heads and batch) is added as ``mv = fl(slope ·
  mask)``; keys where it is -inf are skipped (scalar) or weigh 0 (tiled);
  ``slope`` is 1, or with ``max_bias`` > 0 ALiBi's ``m0^(h+1)`` for heads h below
  ``n_head_log2`` (the largest power of two <= n_head) and ``m1^(2(h -
  n_head_log2)+1)`` above, ``m0 = powf(2, -max_bias/n_head_log2)``, ``m1 =
  powf(2, -(max_bias/2)/n_head_log2)`` with glibc's ``powf``: :func:`alibi_slopes`;
* K/V head ``h // (n_head / n_head_kv)`` serves query head h (``ik2 = iq2 / rk2``);
* a sink logit s per head is folded in after the keys, before the division by S:
  where ``s > M``: ``ms = expf(M - s)``, ``o = fl(o · ms)`` (FP32, also for F16 V),
  ``M = s``, ``vs = 1``; else ``vs = expf(s - M)``; then ``S = S·ms + vs``: one
  FMA on the tiled path, ``fl(fl(S·ms) + vs)`` in the scalar loop (as the build
  compiles them: found by experiment).  The split-KV path folds it into the first
  chunk only (``ic_start == 0``).
The build's vector code (:class:`fa_jax.kernels.ggml.vec.VecCode`, ``code``) changes only the
dots and the tiled path's softmax: the scalar loop's ``ggml_vec_scale_*`` and
``ggml_vec_mad_*`` and ``simd_gemm`` round each element alike on any lane count.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax.exponential import glibc_expf
from fa_jax.formats import FP32, get_format
from fa_jax.kernels.ggml.vec import AVX512, VecCode, dot_bf16, dot_f16, dot_f32, reduce_add, v_expf

__all__ = [
    "TILE",
    "alibi_slopes",
    "glibc_powf",
    "mask_values",
    "merge_chunks",
    "scalar",
    "scalar_chunk",
    "split_kv",
    "tiled",
]

TILE = 64  # GGML_FA_TILE_Q = GGML_FA_TILE_KV (ggml-cpu/common.h:9)
FP16 = get_format("fp16")
FP64 = get_format("fp64")


# glibc's powf (sysdeps/ieee754/flt-32/e_powf.c, e_powf_log2_data.c,
# e_exp2f_data.c; glibc 2.28 and later; x86-64 runs its FMA build, e_powf-fma.c):
# log2(x) in double from a 16-entry table and a degree-5 polynomial, y·log2(x),
# 2^that from a 32-entry table and a cubic, rounded once to FP32.
_POWF_LOG2 = tuple(
    (float.fromhex(a), float.fromhex(b))
    for a, b in (
        ("0x1.661ec79f8f3bep+0", "-0x1.efec65b963019p-2"),
        ("0x1.571ed4aaf883dp+0", "-0x1.b0b6832d4fca4p-2"),
        ("0x1.49539f0f010bp+0", "-0x1.7418b0a1fb77bp-2"),
        ("0x1.3c995b0b80385p+0", "-0x1.39de91a6dcf7bp-2"),
        ("0x1.30d190c8864a5p+0", "-0x1.01d9bf3f2b631p-2"),
        ("0x1.25e227b0b8eap+0", "-0x1.97c1d1b3b7afp-3"),
        ("0x1.1bb4a4a1a343fp+0", "-0x1.2f9e393af3c9fp-3"),
        ("0x1.12358f08ae5bap+0", "-0x1.960cbbf788d5cp-4"),
        ("0x1.0953f419900a7p+0", "-0x1.a6f9db6475fcep-5"),
        ("0x1p+0", "0x0p+0"),
        ("0x1.e608cfd9a47acp-1", "0x1.338ca9f24f53dp-4"),
        ("0x1.ca4b31f026aap-1", "0x1.476a9543891bap-3"),
        ("0x1.b2036576afce6p-1", "0x1.e840b4ac4e4d2p-3"),
        ("0x1.9c2d163a1aa2dp-1", "0x1.40645f0c6651cp-2"),
        ("0x1.886e6037841edp-1", "0x1.88e9c2c1b9ff8p-2"),
        ("0x1.767dcf5534862p-1", "0x1.ce0a44eb17bccp-2"),
    )
)
_POWF_POLY = tuple(
    float.fromhex(h)
    for h in (
        "0x1.27616c9496e0bp-2",
        "-0x1.71969a075c67ap-2",
        "0x1.ec70a6ca7baddp-2",
        "-0x1.7154748bef6c8p-1",
        "0x1.71547652ab82bp0",
    )
)
# e_exp2f_data.c: tab[i] = bits(2^(i/32)) - (i << 47)
_EXP2F_TAB = (
    0x3FF0000000000000, 0x3FEFD9B0D3158574, 0x3FEFB5586CF9890F, 0x3FEF9301D0125B51,
    0x3FEF72B83C7D517B, 0x3FEF54873168B9AA, 0x3FEF387A6E756238, 0x3FEF1E9DF51FDEE1,
    0x3FEF06FE0A31B715, 0x3FEEF1A7373AA9CB, 0x3FEEDEA64C123422, 0x3FEECE086061892D,
    0x3FEEBFDAD5362A27, 0x3FEEB42B569D4F82, 0x3FEEAB07DD485429, 0x3FEEA47EB03A5585,
    0x3FEEA09E667F3BCD, 0x3FEE9F75E8EC5F74, 0x3FEEA11473EB0187, 0x3FEEA589994CCE13,
    0x3FEEACE5422AA0DB, 0x3FEEB737B0CDC5E5, 0x3FEEC49182A3F090, 0x3FEED503B23E255D,
    0x3FEEE89F995AD3AD, 0x3FEEFF76F2FB5E47, 0x3FEF199BDD85529C, 0x3FEF3720DCEF9069,
    0x3FEF5818DCFBA487, 0x3FEF7C97337B9B5F, 0x3FEFA4AFA2A490DA, 0x3FEFD0765B6E4540,
)  # fmt: skip
_EXP2F_POLY = tuple(
    float.fromhex(h)
    for h in ("0x1.c6af84b912394p-5", "0x1.ebfce50fac4f3p-3", "0x1.62e42ff0c52d6p-1")
)
_EXP2F_SHIFT = float.fromhex("0x1.8p+52") / 32


def _fma64(a: float, b: float, c: float) -> float:
    """fl64(a·b + c), one rounding."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def glibc_powf(x: float, y: float) -> float:
    """glibc's ``powf(x, y)`` for FP32 ``x`` positive and normal, ``y`` finite and
    ``|y·log2 x| < 126`` (ALiBi's slopes), as a Python float (a constant of the call:
    computed in double as the FMA build computes it, then rounded to FP32)."""
    ix = int(np.float32(x).view(np.uint32))
    if not 0x00800000 <= ix < 0x7F800000:
        raise ValueError(f"glibc_powf: x: expected a positive normal FP32 value, got {x!r}")
    tmp = (ix - 0x3F330000) & 0xFFFFFFFF  # uint32_t arithmetic
    i = (tmp >> 19) % 16
    top = tmp & 0xFF800000
    k = (top - (1 << 32) if top & 0x80000000 else top) >> 23
    invc, logc = _POWF_LOG2[i]
    z = float(np.uint32((ix - top) & 0xFFFFFFFF).view(np.float32))
    a = _POWF_POLY
    r = _fma64(z, invc, -1.0)
    r2 = r * r
    p = _fma64(a[2], r, a[3])
    q = _fma64(a[4], r, logc + k)
    q = _fma64(p, r2, q)
    logx = _fma64(_fma64(a[0], r, a[1]), r2 * r2, q)
    ylogx = float(np.float32(y)) * logx
    if abs(ylogx) >= 126.0:
        raise ValueError(f"glibc_powf: expected |y·log2 x| < 126, got {ylogx!r}")
    kd = ylogx + _EXP2F_SHIFT
    ki = int(np.float64(kd).view(np.uint64))
    kd -= _EXP2F_SHIFT
    rr = ylogx - kd
    bits = (_EXP2F_TAB[ki % 32] + (ki << 47)) % (1 << 64)
    s = float(np.uint64(bits).view(np.float64))
    c = _EXP2F_POLY
    w = _fma64(_fma64(c[0], rr, c[1]), rr * rr, _fma64(c[2], rr, 1.0))
    return float(np.float32(w * s))


def alibi_slopes(max_bias: float, n_head: int) -> tuple[float, ...]:
    """ALiBi's slope of each of ``n_head`` heads as ggml computes it (ops.cpp:8904,
    8937; FP32 arithmetic, glibc's ``powf``); all 1 where ``max_bias`` <= 0."""
    if max_bias <= 0.0:
        return (1.0,) * n_head
    f32 = np.float32
    log2 = 1 << int(np.floor(np.log2(n_head)))
    bias = f32(max_bias)
    m0 = glibc_powf(2.0, float(-bias / f32(log2)))
    m1 = glibc_powf(2.0, float(-(bias / f32(2.0)) / f32(log2)))
    return tuple(
        glibc_powf(m0, h + 1) if h < log2 else glibc_powf(m1, 2 * (h - log2) + 1)
        for h in range(n_head)
    )


def _tanhf(x):
    """glibc's ``tanhf`` (:mod:`fa_jax.kernels.x86.glibc_tanhf`); NotImplementedError where that
    model is absent."""
    try:
        from fa_jax.kernels.x86.glibc_tanhf import tanhf
    except ImportError as error:  # pragma: no cover - the module ships with fa_jax
        raise NotImplementedError(
            "ggml: softcap: glibc's tanhf is not modelled here "
            "(fa_jax.kernels.x86.glibc_tanhf absent)"
        ) from error
    return tanhf(x)


def _scores(scores, scale, mask, softcap=None):
    """fl(s · scale), then fl(c · tanhf(s)) with a softcap c, then + mask, FP32
    (ops.cpp:8960-8968; ``scale`` already divided by c)."""
    s = ops.mul(scores, jnp.full_like(scores, scale), FP32)
    if softcap is not None:
        s = ops.mul(jnp.full_like(s, softcap), _tanhf(s), FP32)
    if mask is not None:
        s = ops.add(s, mask, FP32)
    return s


def mask_values(mask, slopes=None):
    """The values ggml adds: ``fl(slope · mask)`` per row (R, M) from the F16 mask
    values (R, M) and a slope per row (R,), or the mask itself without ALiBi."""
    if slopes is None:
        return mask
    return ops.mul(mask, jnp.asarray(slopes, jnp.float64)[:, None], FP32)


def _fold_sink(big_m, big_s, o, sink, *, fused: bool):
    """A sink logit per row folded into (M, S, o) after the keys (ops.cpp:9031-9046,
    9331-9347): ``o`` FP32 whatever V's type; ``S = S·ms + vs`` one FMA where
    ``fused`` (the tiled path's), rounded twice otherwise (the scalar loop's: as
    compiled, found by experiment)."""
    new = sink > big_m
    ms = jnp.where(new, glibc_expf(ops.sub(big_m, sink, FP32)), 1.0)
    vs = jnp.where(new, 1.0, glibc_expf(ops.sub(sink, big_m, FP32)))
    o = jnp.where(new[:, None], ops.mul(o, ms[:, None], FP32), o)
    if fused:
        big_s = ops.fma(big_s, ms, vs, FP32)
    else:
        big_s = ops.add(ops.mul(big_s, ms, FP32), vs, FP32)
    return jnp.where(new, sink, big_m), big_s, o


def scalar_chunk(scores, v, mask, *, scale: float, v_fp16: bool, softcap=None, sink=None):
    """The scalar loop over the keys (last axis of ``scores``, the raw dot products):
    returns the running maximum M, the sum S (R,) and the unnormalised output (R, D_v)
    as FP32 values (ops.cpp:8952-9046); ``sink`` (R,) folded in after the keys."""
    r = scores.shape[0]
    s_all = _scores(scores, scale, mask, softcap)
    keep = jnp.ones_like(s_all, bool) if mask is None else mask != -jnp.inf
    acc_fmt = FP16 if v_fp16 else FP32

    def step(carry, inputs):
        big_m, big_s, o = carry
        s, vj, kept = inputs
        new = s > big_m
        ms = jnp.where(new, glibc_expf(ops.sub(big_m, s, FP32)), 1.0)
        vs = jnp.where(new, 1.0, glibc_expf(ops.sub(s, jnp.where(new, s, big_m), FP32)))
        scaled = jnp.where(new[:, None], ops.cast(ops.mul(o, ms[:, None], FP32), acc_fmt), o)
        o_new = ops.cast(ops.fma(vj, vs[:, None], scaled, FP32), acc_fmt)
        s_new = ops.fma(big_s, ms, vs, FP32)
        m_new = jnp.where(new, s, big_m)
        return (
            jnp.where(kept, m_new, big_m),
            jnp.where(kept, s_new, big_s),
            jnp.where(kept[:, None], o_new, o),
        ), None

    init = (
        jnp.full((r,), -jnp.inf),
        jnp.zeros((r,)),
        jnp.zeros((r, v.shape[-1])),
    )
    xs = (s_all.T, jnp.moveaxis(v, 1, 0), keep.T)
    (big_m, big_s, o), _ = jax.lax.scan(step, init, xs)
    if sink is not None:
        big_m, big_s, o = _fold_sink(big_m, big_s, o, sink, fused=False)
    return big_m, big_s, o


def _normalise(o, big_s):
    """o · fl(1/S), 0 where S == 0 (ops.cpp:9050)."""
    inv = jnp.where(big_s == 0, 0.0, ops.div(jnp.ones_like(big_s), big_s, FP32))
    return ops.mul(o, inv[:, None], FP32)


def dot(q, k, dot_type: str, code: VecCode = AVX512):
    """K·q by K's ``vec_dot`` for the float types (``f32``, ``f16``, ``bf16``) in the
    build's vector ``code``."""
    if dot_type == "f32":
        return dot_f32(k, q[:, None, :], code)
    if dot_type == "f16":
        return dot_f16(k, q[:, None, :], code)
    if dot_type == "bf16":
        return dot_bf16(k, q[:, None, :], code)
    raise ValueError(f"dot: dot_type: expected 'f32', 'f16' or 'bf16', got {dot_type!r}")


def scalar(scores, v, mask, *, scale: float, v_fp16: bool, softcap=None, sinks=None):
    """The scalar path's output (R, D_v) from the raw dot products ``scores`` (R, M)."""
    _, big_s, o = scalar_chunk(
        scores, v, mask, scale=scale, v_fp16=v_fp16, softcap=softcap, sink=sinks
    )
    return _normalise(o, big_s)


def merge_chunks(parts):
    """``ggml_flash_attn_ext_reduce_partials`` (ops.cpp:9371) of (M, S, o) chunks in
    order, normalised."""
    r, d_v = parts[0][2].shape
    big_m = jnp.full((r,), -jnp.inf)
    big_s = jnp.zeros((r,))
    o = jnp.zeros((r, d_v))
    for m_c, s_c, o_c in parts:
        use = s_c != 0
        m_new = jnp.maximum(big_m, m_c)
        old = glibc_expf(ops.sub(big_m, m_new, FP32))
        new = glibc_expf(ops.sub(m_c, m_new, FP32))
        o_n = ops.fma(o, old[:, None], ops.mul(o_c, new[:, None], FP32), FP32)
        s_n = ops.fma(big_s, old, ops.mul(s_c, new, FP32), FP32)
        o = jnp.where(use[:, None], o_n, o)
        big_s = jnp.where(use, s_n, big_s)
        big_m = jnp.where(use, m_new, big_m)
    inv = ops.div(jnp.ones_like(big_s), big_s, FP32)
    return jnp.where((big_s == 0)[:, None], o, ops.mul(o, inv[:, None], FP32))


def split_kv(
    scores, v, mask, *, scale: float, v_fp16: bool, threads: int, softcap=None, sinks=None
):
    """The split-KV path's output (R, D_v) with ``threads`` threads (ops.cpp:9485);
    the sinks go to the first chunk."""
    m = scores.shape[1]
    c = -(-m // threads)
    parts = []
    for t in range(threads):
        lo, hi = t * c, min((t + 1) * c, m)
        if lo >= m:
            continue
        parts.append(
            scalar_chunk(
                scores[:, lo:hi],
                v[:, lo:hi],
                None if mask is None else mask[:, lo:hi],
                scale=scale,
                v_fp16=v_fp16,
                softcap=softcap,
                sink=sinks if lo == 0 else None,
            )
        )
    return merge_chunks(parts)


def _gemm_scores(q, k):
    """``simd_gemm`` of Q (R, D) and a K tile (R, T, D): one FMA per element of d."""

    def step(acc, qk):
        qi, ki = qk
        return ops.fma(qi[:, None], ki, acc, FP32), None

    acc, _ = jax.lax.scan(step, jnp.zeros(k.shape[:-1]), (q.T, jnp.moveaxis(k, 2, 0)))
    return acc


def tiled(q, k, v, mask, *, scale: float, code: VecCode = AVX512, softcap=None, sinks=None):
    """The tiled path's output (R, D_v) (ops.cpp:9081) in the build's vector ``code``
    (``ggml_vec_soft_max_f32``'s exp and sums).  A KV tile that every row of a Q tile
    masks is skipped there (ops.cpp:9191); here its rows add p = 0, which changes at
    most the sign of a zero."""
    r, m, _ = k.shape
    big_m = jnp.full((r,), -jnp.inf)
    big_s = jnp.zeros((r,))
    o = jnp.zeros((r, v.shape[-1]))
    for lo in range(0, m, TILE):
        hi = min(lo + TILE, m)
        s = _scores(
            _gemm_scores(q, k[:, lo:hi]),
            scale,
            None if mask is None else mask[:, lo:hi],
            softcap,
        )
        s = jnp.pad(s, ((0, 0), (0, TILE - (hi - lo))), constant_values=-jnp.inf)
        tile_max = jnp.max(s, axis=1)
        skip = tile_max == -jnp.inf
        m_new = jnp.maximum(big_m, tile_max)
        grow = (m_new > big_m) & ~skip
        ms = glibc_expf(ops.sub(big_m, jnp.where(grow, m_new, big_m), FP32))
        o = jnp.where(grow[:, None], ops.mul(o, ms[:, None], FP32), o)
        big_s = jnp.where(grow, ops.mul(big_s, ms, FP32), big_s)
        big_m = jnp.where(skip, big_m, m_new)
        x = ops.sub(s, jnp.where(skip, 0.0, big_m)[:, None], FP32)
        p = jnp.where(jnp.isneginf(x), 0.0, v_expf(jnp.where(jnp.isneginf(x), 0.0, x), code))
        groups = TILE // code.lanes
        sums = reduce_add(p.reshape(r, groups, code.lanes), code)  # (R, groups) FP32
        # S += (double sum) in double, rounded to FP32; sum = ((0 + g0) + g1) + ...
        dsum = sums[:, 0]
        for g in range(1, groups):
            dsum = ops.add(dsum, sums[:, g], FP64)
        big_s = jnp.where(skip, big_s, ops.cast(ops.add(big_s, dsum, FP64), FP32))
        p = jnp.where(skip[:, None], 0.0, p)[:, : hi - lo]

        def pv(o, pj_vj):
            pj, vj = pj_vj
            return ops.fma(pj[:, None], vj, o, FP32), None

        o, _ = jax.lax.scan(pv, o, (p.T, jnp.moveaxis(v[:, lo:hi], 1, 0)))
    if sinks is not None:
        _, big_s, o = _fold_sink(big_m, big_s, o, sinks, fused=True)
    return _normalise(o, big_s)
