"""ONNX Runtime's ``com.microsoft`` GroupQueryAttention on the CPU, and fa_jax's
bit-exact model of it (docs/kernels.md, "GroupQueryAttention").

``onnxruntime-gqa``: the op onnxruntime-genai runs for Llama, Mistral, Phi and
Qwen on CPUs, a graph of one node on the CPUExecutionProvider
(``contrib_ops/cpu/bert/group_query_attention.cc``, ``gqa_attention_base.h``).
It masks causally, bottom-right: the N new queries follow a past of P = M - N
keys, query i at key position P + i.

Calling convention (:mod:`fa_jax.kernels.model`): q (..., H, N, d), k and v
(..., H_kv, M, d), H_kv dividing H (``gqa``); the first M - N keys and values are
the past (``past_key``, ``past_value``), the last N the new ones; ``seqlens_k``
= M - 1, ``total_sequence_length`` = M; every leading index its own call.  The
call is causal with ``q_offset`` = M - N, or (N = 1, no window) non-causal.
``window`` (left, right) is ``local_window_size`` = left + 1; ``softcap`` is the
op's; ``scale=None`` is the op's fl(1 / sqrtf(d)); d a multiple of 8; no
``kv_lengths`` (a short ``seqlens_k`` is another layout), no rotary.

Heads go to K/V head h // (H / H_kv), split over ``intra_op_num_threads``.
FP32 with M > 1 and no softcap (unless ``ORT_GQA_DISABLE_FLASH_ATTENTION``):
``MlasFlashAttentionGQA`` (``core/mlas/lib/flashattn_gqa.cpp``), blocks from the
L2 size (Bc = L2 / (32 d), Br = min(Bc, 2d),
:func:`fa_jax.kernels.onnxruntime.flash_blocks`):

- N > 1: per block of Br rows and Bc keys up to the block's last visible key,
  S = sgemm(Q, Kᵀ, alpha = scale), keys outside a row's causal window at FP32's
  lowest (a row with none keeps its state), m' = max(m, rowmax), P = MLAS's
  sum-exp of S - m', l = Σ or fl(fl(expf(m - m') · l) + Σ), O = fl(O · expf(m -
  m')) then sgemm(P, V, beta 0 or 1) (glibc's ``expf``); finally O · fl(1 / l);
- N = 1: baseline-ISA GEMVs (``MlasGQADecodeQK``: products rounded, 8 lanes,
  ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), · scale; ``MlasGQADecodeSV``:
  O += fl(p_t v_t) in key order), the sum-exp over all M, O · fl(1 / Σ); with fewer
  heads than threads and several key blocks, flash decoding (per block, then
  merged in order with expf(m_c - max m_c): the thread count matters).

Otherwise (FP16, a softcap, M = 1): ``GQAAttentionBase::ApplyAttention``: S =
sgemm over the M keys; per row, on the window's columns [s0, L), the softcap
(``MlasComputeSoftcap<float>``: s / c, glibc's ``tanhf``
(:mod:`fa_jax.kernels.x86.glibc_tanhf`), · c) and MLAS's softmax of those columns alone (its
lanes counted from s0), +0 elsewhere; O = sgemm(P, V).  FP16 is widened to FP32
(no half GEMM on x86-64) and only O rounded to FP16.

The sum-exp kernel is that of the MLAS code this CPU runs (AVX-512F or FMA3,
:func:`fa_jax.kernels.onnxruntime.sum_exp_kernel`); the flash blocks follow
``l2_cache_size`` (this host's by default).  The softcap is modelled for glibc's
fdlibm ``tanhf`` (glibc up to 2.40) and refused with another C library.
Sources: ONNX Runtime 1.32 (the flash path is newer than 1.28).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax._checks import positive_int
from fa_jax.accumulation import SEQUENTIAL
from fa_jax.exponential import glibc_expf
from fa_jax.formats import FP16, FP32, Format, get_format
from fa_jax.heads import kv_groups, repeat_kv
from fa_jax.kernels.model import Kernel, KernelModel, refuse
from fa_jax.kernels.onnxruntime import (
    EXP_MODELS,
    flash_blocks,
    l2_cache_bytes,
    platform_facts,
    sum_exp_kernel,
    unavailable,
)
from fa_jax.kernels.onnxruntime import unmodelled as _mlas_unmodelled
from fa_jax.kernels.x86 import mlas
from fa_jax.kernels.x86.glibc_tanhf import GLIBC_TANHF
from fa_jax.presets import fa2_kernel

__all__ = [
    "ONNXRUNTIME_GQA",
    "default_scale",
    "flash_disabled",
    "glibc_version",
    "gqa_model",
    "real_gqa",
    "unmodelled",
]

_FORMATS = ("fp32", "fp16")
_NAME = "onnxruntime-gqa"
_FDLIBM_TANHF_UNTIL = (2, 40)  # glibc 2.41 replaced fdlibm's tanhf with CORE-MATH's


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the glibc this process runs, None for another C library."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError, AttributeError):
        return None
    name, _, version = text.partition(" ")
    parts = version.split(".")
    if name != "glibc" or len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


def _tanhf_unmodelled() -> str | None:
    version = glibc_version()
    if version is not None and version <= _FDLIBM_TANHF_UNTIL:
        return None
    found = "not glibc" if version is None else f"glibc {version[0]}.{version[1]}"
    return (
        f"{_NAME}: softcap: the C library's tanhf ({found}) is not modelled; modelled: "
        "glibc's fdlibm tanhf (glibc up to 2.40)"
    )


def unmodelled(fmt=None, **options) -> str | None:
    """None where MLAS runs kernels the model follows here (AVX-512F, FMA3), else why
    not (:func:`fa_jax.kernels.onnxruntime.unmodelled`); a softcap also needs glibc's
    fdlibm ``tanhf`` (module docstring), refused by the model when called."""
    return _mlas_unmodelled(fmt, **options)


def flash_disabled() -> bool:
    """Whether ``ORT_GQA_DISABLE_FLASH_ATTENTION`` turns the FP32 flash path off (the
    op reads it when a session builds the kernel)."""
    return os.environ.get("ORT_GQA_DISABLE_FLASH_ATTENTION", "").strip().lower() in {"1", "true"}


def _fmt(fmt) -> Format:
    f = get_format(fmt)
    if f.name not in {get_format(n).name for n in _FORMATS}:
        raise ValueError(f"{_NAME}: fmt: expected one of {_FORMATS}, got {f.name!r}")
    return f


def default_scale(d: int) -> float:
    """The op's scale where its attribute is absent: 1.0f / sqrt((float) d), in FP32
    (``ComputeAttentionProbs``)."""
    return float(np.float32(1.0) / np.sqrt(np.float32(d)))


def _alpha(scale, d: int) -> float:
    return default_scale(d) if scale is None else float(np.float32(scale))


def _local_window(
    n: int, m: int, d: int, *, causal: bool, q_offset, window, d_v: int | None = None
) -> int:
    """The op's ``local_window_size`` (-1: none) for a call of N queries, M keys,
    after checking that the op computes it (module docstring)."""
    if d % 8:
        raise ValueError(f"{_NAME}: d: expected a multiple of 8 (the op's head_size), got {d}")
    if d_v is not None and d_v != d:
        raise ValueError(f"{_NAME}: d_v: expected d = {d} (the op's one head_size), got {d_v}")
    if n > m:
        raise ValueError(f"{_NAME}: expected N <= M (N new keys after M - N past), got {n} > {m}")
    offset = int(q_offset or 0)
    if causal or window is not None:
        if offset != m - n:
            raise ValueError(
                f"{_NAME}: q_offset: expected M - N = {m - n} ('bottom-right': the op's "
                f"queries follow the past keys), got {offset}"
            )
        if not causal and n != 1:
            raise ValueError(f"{_NAME}: causal: expected True (the op masks causally), got False")
    elif n != 1:
        raise ValueError(
            f"{_NAME}: causal: expected True (the op masks causally; only N = 1 sees every "
            f"key without it), got False with N = {n}"
        )
    if window is None or window[0] < 0:
        return -1
    return int(window[0]) + 1


# --- the real op ------------------------------------------------------------------------


@functools.cache
def _session(
    elem: int,
    heads: int,
    kv_heads: int,
    past: bool,
    local_window: int,
    scale,
    softcap,
    threads: int,
    no_flash: bool,
):
    """A session of one GroupQueryAttention node; ``no_flash`` (the environment's
    ``ORT_GQA_DISABLE_FLASH_ATTENTION`` when it is built) keys the cache."""
    del no_flash
    import onnxruntime as ort
    from onnx import TensorProto, helper

    attributes: dict[str, Any] = {
        "num_heads": heads,
        "kv_num_heads": kv_heads,
        "local_window_size": local_window,
    }
    if scale is not None:
        attributes["scale"] = scale
    if softcap is not None:
        attributes["softcap"] = softcap
    names = ["query", "key", "value", "past_key" if past else "", "past_value" if past else ""]
    node = helper.make_node(
        "GroupQueryAttention",
        [*names, "seqlens_k", "total_sequence_length"],
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        **attributes,
    )
    int32 = TensorProto.INT32
    graph = helper.make_graph(
        [node],
        "gqa",
        [helper.make_tensor_value_info(n, elem, None) for n in names if n]
        + [
            helper.make_tensor_value_info(n, int32, None)
            for n in ("seqlens_k", "total_sequence_length")
        ],
        [
            helper.make_tensor_value_info(n, elem, None)
            for n in ("output", "present_key", "present_value")
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _heads(t) -> np.ndarray:
    """(..., H, rows, d) as (B, H, rows, d); no heads axis: H = 1."""
    t = np.asarray(t)
    if t.ndim == 2:
        t = t[None]
    return t.reshape(-1, *t.shape[-3:])


def real_gqa(
    q,
    k,
    v,
    *,
    fmt,
    causal: bool = False,
    scale=None,
    window=None,
    q_offset=0,
    softcap=None,
    threads: int = 1,
) -> np.ndarray:
    """GroupQueryAttention's output (..., N, d_v) on ONNX Runtime's CPU, as float64
    (module docstring); one op call per leading index (batch 1)."""
    from onnx import TensorProto

    f = _fmt(fmt)
    threads = positive_int(threads, f"{_NAME}: threads")
    n, m, d = np.shape(q)[-2], np.shape(k)[-2], np.shape(q)[-1]
    local = _local_window(
        n, m, d, causal=causal, q_offset=q_offset, window=window, d_v=np.shape(v)[-1]
    )
    dtype = np.float32 if f.name == FP32.name else np.float16
    elem = TensorProto.FLOAT if dtype is np.float32 else TensorProto.FLOAT16
    qb, kb, vb = (_heads(t).astype(dtype) for t in (q, k, v))
    heads, kv_heads, past = qb.shape[1], kb.shape[1], m - n
    cap = None if softcap is None else float(np.float32(softcap))
    sess = _session(
        elem,
        heads,
        kv_heads,
        past > 0,
        local,
        None if scale is None else float(np.float32(scale)),
        cap,
        threads,
        flash_disabled(),
    )

    def bsh(t):  # (H, rows, d) -> (1, rows, H · d)
        return np.ascontiguousarray(t.transpose(1, 0, 2).reshape(1, t.shape[1], -1))

    outs = []
    for b in range(qb.shape[0]):
        feeds = {
            "query": bsh(qb[b]),
            "key": bsh(kb[b, :, past:]),
            "value": bsh(vb[b, :, past:]),
            "seqlens_k": np.array([m - 1], np.int32),
            "total_sequence_length": np.array(m, np.int32),
        }
        if past:
            feeds["past_key"] = np.ascontiguousarray(kb[b : b + 1, :, :past])
            feeds["past_value"] = np.ascontiguousarray(vb[b : b + 1, :, :past])
        out = sess.run(["output"], feeds)[0]
        outs.append(np.asarray(out, np.float64).reshape(n, heads, -1).transpose(1, 0, 2))
    return np.stack(outs).reshape(*np.shape(q)[:-1], np.shape(v)[-1])


# --- the model --------------------------------------------------------------------------


def _rows(n: int, m: int, local_window: int) -> tuple[np.ndarray, np.ndarray]:
    """Each query row's softmax columns [start, end) (``ComputeAttentionProbs``):
    end = L = M - N + i + 1, start = L - W where the window W >= 0 is shorter."""
    end = m - n + np.arange(n) + 1
    start = np.where((local_window >= 0) & (end > local_window), end - local_window, 0)
    return start, end


@functools.partial(jax.jit, static_argnames=("alpha",))
def _scores(q, k, *, alpha: float):
    return mlas.sgemm(q, jnp.swapaxes(k, -1, -2), alpha=alpha, trans_b=True)


@functools.partial(jax.jit, static_argnames=("local_window", "cap", "kernel", "tanh"))
def _probabilities(s, *, local_window: int, cap, kernel, tanh):
    """The softcap and MLAS's softmax on each row's columns [start, end) alone, their
    lanes counted from start; +0 elsewhere (module docstring)."""
    n, m = s.shape[-2:]
    start, end = _rows(n, m, local_window)
    width = end - start
    t = np.arange(int(width.max()))
    valid = t[None, :] < width[:, None]  # (N, W_max)
    x = s[..., np.arange(n)[:, None], np.minimum(start[:, None] + t, m - 1)]
    if cap is not None:
        caps = jnp.full_like(x, cap)
        x = ops.mul(tanh.fn(ops.div(x, caps, FP32), FP32), caps, FP32)
    row_max = jnp.max(jnp.where(valid, x, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(valid, mlas.sum_exp(ops.add(x, -row_max, FP32), kernel), 0.0)
    total = mlas.lane_sum(e, kernel)  # the +0 past a row's width adds nothing
    p = ops.mul(e, ops.div(jnp.ones_like(total), total, FP32)[..., None], FP32)
    j = np.arange(m)
    inside = (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])
    back = np.clip(j[None, :] - start[:, None], 0, len(t) - 1)
    return jnp.where(inside, p[..., np.arange(n)[:, None], back], 0.0)


@functools.partial(jax.jit, static_argnames=("fp16",))
def _output(p, v, *, fp16: bool):
    o = mlas.sgemm(p, v)
    return ops.cast(o, FP16) if fp16 else o


def _lanes_dot(q, k):
    """``MlasGQADecodeQK``'s dot products of q (..., 1, d) with each row of k (..., M, d):
    products rounded, product h into lane h mod 8 in order, then
    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (d is a multiple of 8)."""
    prod = ops.mul(q, k, FP32)  # (..., M, d)
    lanes = prod.reshape(*prod.shape[:-1], -1, 8)
    acc = ops.sum(
        lanes, FP32, axis=-2, accumulation="sequential", initial=jnp.zeros_like(lanes[..., 0, :])
    )
    pairs = ops.add(acc[..., 0::2], acc[..., 1::2], FP32)
    quads = ops.add(pairs[..., 0::2], pairs[..., 1::2], FP32)
    return ops.add(quads[..., 0], quads[..., 1], FP32)


def _weighted_rows(p, v):
    """``MlasGQADecodeSV``: out[h] = +0, then out[h] += fl(p_t · v_t[h]) for t in order."""
    prod = ops.mul(p[..., :, None], v, FP32)  # (..., M, d)
    return ops.sum(
        prod, FP32, axis=-2, accumulation="sequential", initial=jnp.zeros_like(prod[..., 0, :])
    )


_LOWEST = float(np.finfo(np.float32).min)


@functools.partial(jax.jit, static_argnames=("alpha", "local_window", "kernel"))
def _decode(q, k, v, *, alpha: float, local_window: int, kernel):
    """``MlasGQADecodeGQAThreaded`` (one query row, every key): the GEMV scores, keys
    before the window at FP32's lowest, the sum-exp kernel over all M, the GEMV
    output times fl(1 / Σ)."""
    m = k.shape[-2]
    s = ops.mul(_lanes_dot(q, k), jnp.full((), alpha), FP32)  # (..., M)
    start = m - local_window if 0 <= local_window < m else 0
    s = jnp.where(jnp.arange(m) < start, _LOWEST, s)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    e = mlas.sum_exp(ops.add(s, -row_max, FP32), kernel)
    total = mlas.lane_sum(e, kernel)
    o = _weighted_rows(e, v)
    return ops.mul(o, ops.div(jnp.ones_like(total), total, FP32)[..., None], FP32)[..., None, :]


@functools.partial(jax.jit, static_argnames=("alpha", "local_window", "kernel", "chunk"))
def _flash_decode(q, k, v, *, alpha: float, local_window: int, kernel, chunk: int):
    """Flash decoding (``MlasFlashDecodingGQAThreaded``, ``...ReduceThreaded``): each
    chunk of ``chunk`` keys its own max m_c, Σ_c and GEMV output; then, over the
    chunks in order from 0, Σ += fl(r_c Σ_c) and O += fl(r_c O_c) with
    r_c = expf(m_c - max m_c) (chunks all masked skipped), and O · fl(1 / Σ)."""
    m = k.shape[-2]
    s = ops.mul(_lanes_dot(q, k), jnp.full((), alpha), FP32)
    start = m - local_window if 0 <= local_window < m else 0
    s = jnp.where(jnp.arange(m) < start, _LOWEST, s)
    outs, maxes, sums = [], [], []
    for lo in range(0, m, chunk):
        sc = s[..., lo : lo + chunk]
        mc = jnp.max(sc, axis=-1, keepdims=True)
        e = mlas.sum_exp(ops.add(sc, -mc, FP32), kernel)
        dead = mc == _LOWEST
        maxes.append(mc)
        sums.append(jnp.where(dead, 0.0, mlas.lane_sum(e, kernel)[..., None]))
        outs.append(jnp.where(dead, 0.0, _weighted_rows(e, v[..., lo : lo + chunk, :])))
    global_m = functools.reduce(jnp.maximum, maxes)
    total = jnp.zeros_like(global_m)
    o = jnp.zeros_like(outs[0])
    for mc, lc, oc in zip(maxes, sums, outs, strict=True):
        r = glibc_expf(ops.sub(mc, global_m, FP32))
        live = lc > 0
        total = jnp.where(live, ops.add(total, ops.mul(r, lc, FP32), FP32), total)
        o = jnp.where(live, ops.add(o, ops.mul(r, oc, FP32), FP32), o)
    inv = jnp.where(total > 0, ops.div(jnp.ones_like(total), total, FP32), 0.0)
    return ops.mul(o, inv, FP32)[..., None, :]


@functools.partial(jax.jit, static_argnames=("alpha", "kernel", "first", "one_row"))
def _flash_softmax(q, kb, cols, pos, window_start, row_m, l, o, *, alpha, kernel, first, one_row):
    """One key block of ``MlasFlashAttentionGQAThreaded`` for query blocks q
    (..., B, R, d) at key positions ``pos`` (B, R), up to its P V product: S =
    sgemm(Q, Kᵀ, alpha), keys past a row's position or before its window at
    FP32's lowest; a row with no key left keeps its state (and P = 0); else m' =
    max(m, rowmax), P = sum-exp of S - m', Σ = its lanes, then l = Σ (first
    block) or fl(fl(e l) + Σ) with e = expf(m - m') and O = fl(O e).  Returns
    (m, l, P, the O that the product adds onto or None)."""
    kb = jnp.broadcast_to(kb[..., None, :, :], (*q.shape[:-2], *kb.shape[-2:]))
    s = mlas.sgemm(q, jnp.swapaxes(kb, -1, -2), alpha=alpha, trans_b=True, rows_apart=one_row)
    masked = (cols > pos[..., None]) | (cols < window_start[..., None])
    s = jnp.where(masked, _LOWEST, s)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    dead = row_max == _LOWEST
    new_m = jnp.maximum(row_m, row_max)
    e = mlas.sum_exp(ops.add(s, -new_m, FP32), kernel)
    rowsum = mlas.lane_sum(e, kernel)[..., None]
    p = jnp.where(dead, 0.0, e)
    if first:
        new_l, c = rowsum, None
    else:
        scale = glibc_expf(ops.sub(row_m, new_m, FP32))
        new_l = ops.add(ops.mul(scale, l, FP32), rowsum, FP32)
        c = jnp.where(dead, o, ops.mul(o, scale, FP32))
    return jnp.where(dead, row_m, new_m), jnp.where(dead, l, new_l), p, c


@functools.partial(jax.jit, static_argnames=("one_row",))
def _flash_product(p, vb, c, *, one_row):
    """O = sgemm(P, V) for a key block: beta = 0 (``c`` None, the first block) or 1."""
    vb = jnp.broadcast_to(vb[..., None, :, :], (*p.shape[:-2], *vb.shape[-2:]))
    return mlas.sgemm(p, vb, c=c, rows_apart=one_row)


@jax.jit
def _normalise(o, l):
    inv = jnp.where(l > 0, ops.div(jnp.ones_like(l), l, FP32), 0.0)
    return ops.mul(o, inv, FP32)


def _flash_rows(
    q, k, v, *, q0: int, past: int, alpha: float, local_window: int, kv_block: int, kernel
):
    """``MlasFlashAttentionGQAThreaded`` on the query blocks q (..., B, R, d) whose
    first rows are the queries q0, q0 + R, ...: each key block from the first
    to the last any of them reaches (a block past a query block's last row is
    skipped there: it leaves the state as it is)."""
    nb, r = q.shape[-3:-1]
    pos = past + q0 + np.arange(nb)[:, None] * r + np.arange(r)[None, :]  # (B, R)
    window_start = np.where(
        (local_window >= 0) & (pos + 1 > local_window), pos + 1 - local_window, 0
    )
    row_m = jnp.full((*q.shape[:-1], 1), _LOWEST)
    l = jnp.zeros_like(row_m)
    o = jnp.zeros(q.shape[:-1] + v.shape[-1:])
    softmax = functools.partial(_flash_softmax, alpha=alpha, kernel=kernel, one_row=r == 1)
    for lo in range(0, min(k.shape[-2], int(pos.max()) + 1), kv_block):
        kb, vb = k[..., lo : lo + kv_block, :], v[..., lo : lo + kv_block, :]
        cols = jnp.arange(lo, lo + kb.shape[-2])
        # query blocks whose rows all precede the block skip it: every key masked
        skip = (pos[:, :1] + r <= lo).repeat(r, axis=1) if lo else np.zeros_like(pos, bool)
        at = jnp.asarray(np.where(skip, -1, pos))
        row_m, l, p, c = softmax(
            q, kb, cols, at, jnp.asarray(window_start), row_m, l, o, first=lo == 0
        )
        o = _flash_product(p, vb, c, one_row=r == 1)
    return _normalise(o, l)


def _forward(
    q,
    k,
    v,
    *,
    policy,
    causal,
    scale,
    window=None,
    q_offset=0,
    softcap=None,
    fp16: bool,
    kernel,
    threads: int,
    l2_cache_size: int,
):
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    local = _local_window(
        n, m, d, causal=causal, q_offset=q_offset, window=window, d_v=np.shape(v)[-1]
    )
    if softcap is not None:
        refuse(_tanhf_unmodelled())
    groups = kv_groups(_NAME, q.shape, k.shape, v.shape)
    q, k, v = (jnp.asarray(t, jnp.float64) for t in (q, k, v))
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    alpha = _alpha(scale, d)
    if fp16 or softcap is not None or m == 1 or flash_disabled():  # ApplyAttention
        s = _scores(q, k, alpha=alpha)
        cap = None if softcap is None else float(np.float32(softcap))
        p = _probabilities(s, local_window=local, cap=cap, kernel=kernel, tanh=policy.tanh_model)
        return _output(p, v, fp16=fp16)
    q_block, kv_block = flash_blocks(n, m, d, d, l2_cache_size)  # ApplyAttentionFlash
    if n == 1:
        heads = q.shape[-3] if q.ndim > 2 else 1  # one op call per leading index
        if heads < threads and -(-m // kv_block) > 1:
            return _flash_decode(
                q, k, v, alpha=alpha, local_window=local, kernel=kernel, chunk=kv_block
            )
        return _decode(q, k, v, alpha=alpha, local_window=local, kernel=kernel)
    rows = functools.partial(
        _flash_rows, past=m - n, alpha=alpha, local_window=local, kv_block=kv_block, kernel=kernel
    )
    full = n - n % q_block
    parts = []
    if full:
        blocks = q[..., :full, :].reshape(*q.shape[:-2], full // q_block, q_block, d)
        parts.append(rows(blocks, k, v, q0=0).reshape(*q.shape[:-2], full, -1))
    if n % q_block:
        parts.append(rows(q[..., None, full:, :], k, v, q0=full)[..., 0, :, :])
    return jnp.concatenate(parts, axis=-2)


def gqa_model(
    fmt: Format,
    n: int,
    d: int,
    *,
    threads: int = 1,
    l2_cache_size: int | None = None,
    isa: str | None = None,
) -> KernelModel:
    """fa_jax's model of ``onnxruntime-gqa`` in ``fmt`` for the MLAS code of ``isa``
    ("AVX512", "AVX2"; None: the code here, refusing where it is not modelled),
    with the flash blocks of ``l2_cache_size`` (this host's by default) and
    ``threads`` (which pick flash decoding for one query row; module docstring)."""
    del n, d
    f = _fmt(fmt)
    threads = positive_int(threads, f"{_NAME}: threads")
    l2 = (
        l2_cache_bytes()
        if l2_cache_size is None
        else positive_int(l2_cache_size, f"{_NAME}: l2_cache_size")
    )
    kernel = sum_exp_kernel(isa)
    policy = fa2_kernel(f).replace(
        name=f"onnxruntime_gqa({f.name})",
        p=FP32,  # P stays FP32 in FP16 too (module docstring)
        accumulation=SEQUENTIAL,
        exp_model=EXP_MODELS[kernel],
        tanh_model=GLIBC_TANHF,
        normalise="reciprocal",
    )
    forward = functools.partial(
        _forward, fp16=f.name == FP16.name, kernel=kernel, threads=threads, l2_cache_size=l2
    )
    return KernelModel(_NAME, policy, "reference", forward=forward)


ONNXRUNTIME_GQA = Kernel(
    name=_NAME,
    description=(
        "ONNX Runtime's CPU com.microsoft GroupQueryAttention (past K/V cache, causal "
        "bottom-right, local window, softcap): MLAS sgemm, MLAS softmax over each row's "
        "window (onnxruntime/contrib_ops/cpu/bert/gqa_attention_base.h)"
    ),
    real=real_gqa,
    model=gqa_model,
    unavailable=unavailable,
    platform=platform_facts,
    formats=_FORMATS,
    features=frozenset({"q_offset", "window", "softcap", "gqa"}),
    options=("threads",),
    unmodelled=unmodelled,
)
