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
  of ``o`` and ``S``, ``ggml_vec_soft_max_f32`` (vec.cpp:531: :func:`fa_jax.ggml_vec.v_expf`
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
dequantized), mask (R, M) of additive F16 values or None; float64 carriers, x64 on.
The build's vector code (:class:`fa_jax.ggml_vec.VecCode`, ``code``) changes only the
dots and the tiled path's softmax: the scalar loop's ``ggml_vec_scale_*`` and
``ggml_vec_mad_*`` and ``simd_gemm`` round each element alike on any lane count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fa_jax import ops
from fa_jax.exponential import glibc_expf
from fa_jax.formats import FP32, get_format
from fa_jax.ggml_vec import AVX512, VecCode, dot_bf16, dot_f16, dot_f32, reduce_add, v_expf

__all__ = ["TILE", "merge_chunks", "scalar", "scalar_chunk", "split_kv", "tiled"]

TILE = 64  # GGML_FA_TILE_Q = GGML_FA_TILE_KV (ggml-cpu/common.h:9)
FP16 = get_format("fp16")
FP64 = get_format("fp64")


def _scores(scores, scale, mask):
    """fl(s · scale) + mask, FP32 (ops.cpp:8960-8968)."""
    s = ops.mul(scores, jnp.full_like(scores, scale), FP32)
    if mask is not None:
        s = ops.add(s, mask, FP32)
    return s


def scalar_chunk(scores, v, mask, *, scale: float, v_fp16: bool):
    """The scalar loop over the keys (last axis of ``scores``, the raw dot products):
    returns the running maximum M, the sum S (R,) and the unnormalised output (R, D_v)
    as FP32 values (ops.cpp:8952-9024)."""
    r = scores.shape[0]
    s_all = _scores(scores, scale, mask)
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


def scalar(scores, v, mask, *, scale: float, v_fp16: bool):
    """The scalar path's output (R, D_v) from the raw dot products ``scores`` (R, M)."""
    _, big_s, o = scalar_chunk(scores, v, mask, scale=scale, v_fp16=v_fp16)
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


def split_kv(scores, v, mask, *, scale: float, v_fp16: bool, threads: int):
    """The split-KV path's output (R, D_v) with ``threads`` threads (ops.cpp:9485)."""
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


def tiled(q, k, v, mask, *, scale: float, code: VecCode = AVX512):
    """The tiled path's output (R, D_v) (ops.cpp:9081) in the build's vector ``code``
    (``ggml_vec_soft_max_f32``'s exp and sums)."""
    r, m, _ = k.shape
    big_m = jnp.full((r,), -jnp.inf)
    big_s = jnp.zeros((r,))
    o = jnp.zeros((r, v.shape[-1]))
    for lo in range(0, m, TILE):
        hi = min(lo + TILE, m)
        s = _scores(_gemm_scores(q, k[:, lo:hi]), scale, None if mask is None else mask[:, lo:hi])
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
    return _normalise(o, big_s)
