"""XLA's attention on the CPU: ``jax.nn.dot_product_attention(..., implementation="xla")``.

The real kernel runs natively in bf16, fp16 and fp32 (fp16 eagerly, op by op:
XLA's CPU backend refuses the F16_F16_F32 dot under jit).  What it computes
(``_dot_product_attention_core`` in jax/_src/nn/functions.py), as XLA's CPU
backend runs it (the optimised HLO, the rest found by experiment)::

    S = fl32(Q Kᵀ)              products exact for bf16/fp16, FMAs for fp32
    S = fl32(S · fl32(scale))   the scale rounded to float32; in XLA's own loop
                                fusions fused (an FMA) into the next + or -
    masked S := fl32(-0.7 · FLT_MAX)                      (not -inf)
    m = max S;  e = exp32(fl32(S - m));  l = sum32(e)
    P = fl32(e · fl32(1 / l))   XLA rewrites the division as a reciprocal
    P = fl_in(P)                kept or dropped: see below
    O = fl_in(fl32(P V))        V widened to float32, an FP32 dot

XLA hands the dots, reductions and element-wise steps to YNNPACK fusions, whose
orders were found with FPRev-style probes (±M pairs among small terms, checked
against a simulation of each candidate order, :func:`_simulated_dot`):

* the dots: YNNPACK picks a dot kernel by the shape (google/XNNPACK,
  ``ynnpack/kernels/dot/generator/x86_fp32_k2.py``, ``x86_fp32_k4.py``).  A
  kernel keeps ``tile_k`` FMA chains per output in its vector lanes (term t in
  chain t mod tile_k), folds them pairwise at the end, ((c0 + c1) + (c2 + c3)),
  and leaves the last n mod tile_k terms to a remainder path whose products
  are rounded and added in order.  bf16 Q Kᵀ runs AVX-512 BF16's pair
  instruction (or AVX2's FMAs in its order), one chain in the order 1, 0, 3,
  2, ..., or AMX's tile dot, blocks of 32 terms in two chains (even, odd).
  Q Kᵀ's order is read per key and task of keys, with the blocks YNNPACK cuts
  its reduction into where the dot has few rows (:func:`_qk_order`, :func:`_qk_split`);
  P V's tile_k and its blocks of keys (each block's sum added in order; a
  size YNNPACK derives at run time from the L2 cache) per query
  (:func:`_pv_order`);
* the softmax sum: YNNPACK's ``sum_float_k1`` (``ynnpack/kernels/reduce/sum.h``)
  on 16 lanes, term j in lane j mod 16: chunks of 64 terms (4 per lane, left to
  right), four chunks added together while 256 terms remain, a level-1
  accumulator added to the level-2 one by compensated (Kahan) summation every
  1024 terms read by the loops over whole chunks (not the ragged last one) and
  at the end (Higham 2002, §4.3); the 16 lane sums then halved.  Where
  XLA rewrites the sum as a tree reduction (decoding shapes), the HLO shows a
  ``reduce-window`` of 32 keys (zeros padded around the row) in a loop fusion
  of XLA's (each window summed left to right) or a YNNPACK fusion (each window
  by ``sum_float_k1``), then a ``reduce`` of the window sums, left to right;
  in an XLA loop fusion (small shapes) the whole row left to right; the model
  reads which (:func:`_sum_window`; fp16's from its own eager program).

P's rounding to bf16 before P V is dropped where XLA fuses the softmax and the
conversion into the Q Kᵀ dot's YNNPACK fusion (excess precision; read).

Two float32 exps run, read from the program: in a YNNPACK fusion (bf16, fp32
under jit, from 64 keys or so) YNNPACK's ``simd::exp`` (``ynnpack/base/simd/
target_independent.inc``; :func:`fa_jax.exponential.ynnpack_exp`); elsewhere
(eager fp16, small shapes) XLA's own Cephes polynomial with FMAs, results below
FLT_MIN flushed to zero (:func:`xla_cpu_exp`).  Both bit for bit; they differ
by an ulp on a few percent of inputs.

Features (bias, mask, window, key lengths, fewer K/V heads, N != M) go to jax's
4-D call (:class:`_Layout`): the dots run on the grouped (B·H_kv, G·N, d) view,
probed, or XLA's own dots there (:mod:`~fa_jax.kernels.xla.own_dots`).  The CPU
code: AVX-512, AVX2 (:class:`VectorCode`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import importlib.metadata
import itertools
import math
import platform as _platform
import re

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import masking, ops
from fa_jax._checks import one_of
from fa_jax.exponential import YNNPACK, ExpModel, register_exp_model
from fa_jax.formats import FP32, Format, get_format
from fa_jax.kernels.model import Kernel, KernelModel, flat_heads, refuse
from fa_jax.kernels.x86 import cpu
from fa_jax.kernels.xla import own_dots
from fa_jax.policy import Policy
from fa_jax.presets import fa2_kernel
from fa_jax.rounding import round_to

__all__ = [
    "AVX2",
    "AVX512",
    "XLA",
    "XLA_CPU_EXP",
    "VectorCode",
    "model",
    "platform",
    "real",
    "unmodelled",
    "vector_code",
    "xla_cpu_exp",
    "xla_cpu_exp_model",
]

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)
_LARGE_NEGATIVE = float(np.float32(-0.7 * _F32_MAX))  # jax's mask value, in float32
_LANES = 16  # the softmax sum's lanes
_CHUNK = 64  # terms the softmax sum reads at a time (4 vectors of 16 lanes)
_KAHAN = 1024  # terms read between the softmax sum's compensated steps


@dataclasses.dataclass(frozen=True)
class VectorCode:
    """The vector code XLA's CPU backend and YNNPACK run on a class of CPU, as far as
    the model's fixed steps depend on it (the dot orders, blocks and fusions are
    read from the real program by probes, whatever the code).

    ``gemv_lanes``: the float32 lanes XLA's own GEMV (:mod:`~fa_jax.kernels.xla.own_dots`)
    can give its vector, the widths of the registers LLVM targets (AVX's 256 bits;
    AVX-512's 512 too); the model checks each against the real program.

    What does not vary, by YNNPACK's design of kernels numerically consistent
    across ISAs (google/XNNPACK, ynnpack/):

    * the softmax sum's 16 lanes: ``sum_float_k1`` runs its ``*_k1_fp32_*``
      kernels with ``consistent_n = 64 / sizeof(float)`` lanes whatever the vector
      width (kernels/reduce/sum.h, ``sum_float_k1``; AVX holds them in two 8-lane
      registers, kernels/reduce/x86_avx.cc ``sum_k1_fp32_avx``), and
      ``horizontal_sum`` halves them as AVX-512 does (base/simd/vec.h);
    * YNNPACK's exp (``simd::exp``, base/simd/target_independent.inc, FMAs on AVX2
      as on AVX-512: base/simd/x86_vec256_base.h ``fma``) and XLA's own (LLVM's
      FMAs, element by element);
    * bf16 dots without AVX512-BF16: ``x86_avx2_fma3_bf16_bf16_fp32`` adds each
      pair's odd term first, then the even one, by FMAs in one chain, "to match
      the behavior of dpbf16ps" (kernels/dot/generator/x86_bf16_bf16_fp32.py,
      ``product``): the order the probes find with AVX512-BF16;
    * fp32 dots: ``x86_fma3_fp32`` (one chain), ``x86_avx2_fma3_fp32_k2`` (two
      chains, ``hadd``: c0 + c1; kernels/dot/generator/x86_fp32_k2.py), as the
      AVX-512 kernels' chains folded pairwise, whose tile_k the probes read.
    """

    name: str  # the CPU class, as :func:`fa_jax.kernels.x86.cpu.isa` names it
    gemv_lanes: tuple[int, ...]


AVX512 = VectorCode("AVX512", gemv_lanes=(8, 16))
AVX2 = VectorCode("AVX2", gemv_lanes=(8,))  # AVX2 and FMA: 256-bit registers
_CODES = {code.name: code for code in (AVX512, AVX2)}


def _attention_fn(dtype: str, causal: bool, scale):
    def run(q, k, v):
        q, k, v = (jnp.swapaxes(t, -2, -3).astype(dtype) for t in (q, k, v))
        o = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="xla"
        )
        return jnp.swapaxes(o, -2, -3).astype(jnp.float32)

    return run


def _jit_attention(dtype: str, causal: bool, scale):
    return jax.jit(_attention_fn(dtype, causal, scale))


@functools.cache
def _attention(dtype: str, causal: bool, scale):
    """The real call: jitted, except fp16, whose F16_F16_F32 dot XLA's CPU backend
    refuses under jit; eagerly jax falls back to the default precision, op by op."""
    if dtype == "float16":
        return _attention_fn(dtype, causal, scale)
    return _jit_attention(dtype, causal, scale)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A call with features (K/V with fewer heads, decoding shapes, a bias, a mask, a
    window, key lengths): jax's 4-D call on ``batch`` sequences of ``n`` queries in
    ``kv_heads`` · ``groups`` heads and ``m`` keys in ``kv_heads`` heads; ``bias``
    and ``mask`` the shapes of the 4-D arrays passed (None: not passed),
    ``window`` jax's ``local_window_size``, ``lengths`` whether
    ``key_value_seq_lengths`` is.  XLA runs its dots on (B·H_kv, G·N, d) queries
    against (B·H_kv, M, d) keys (jax's ``_dot_product_attention_xla`` groups the
    heads so), the grouped view the model takes."""

    batch: int
    kv_heads: int
    groups: int
    n: int
    m: int
    bias: tuple[int, ...] | None = None
    mask: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None
    lengths: bool = False

    def plain(self) -> _Layout:
        """The same shapes without bias, mask, window or lengths: the program probed."""
        return _Layout(self.batch, self.kv_heads, self.groups, self.n, self.m)


def _call_fn(dtype: str, causal: bool, scale, layout: _Layout):
    """jax's 4-D call for ``layout``: (q, k, v) as (B, H, N, d), (B, H_kv, M, d),
    and the bias, mask and lengths it passes; the output (B, H, N, d) in float32."""

    def run(q, k, v, bias=None, mask=None, lengths=None):
        q, k, v = (jnp.swapaxes(t, 1, 2).astype(dtype) for t in (q, k, v))
        o = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=None if bias is None else bias.astype(dtype),
            mask=mask,
            scale=scale,
            is_causal=causal,
            key_value_seq_lengths=lengths,
            local_window_size=layout.window,
            implementation="xla",
        )
        return jnp.swapaxes(o, 1, 2).astype(jnp.float32)

    return run


@functools.cache
def _call(dtype: str, causal: bool, scale, layout: _Layout):
    """:func:`_call_fn`, jitted except for fp16 (as :func:`_attention`)."""
    run = _call_fn(dtype, causal, scale, layout)
    return run if dtype == "float16" else jax.jit(run)


@functools.cache
def _grouped_run(dtype: str, layout: _Layout, causal: bool = False):
    """The plain program of ``layout`` (no scale, bias or mask; causal or not) on the
    grouped view: q (B·H_kv, G·N, d), k and v (B·H_kv, M, d) -> (B·H_kv, G·N, d);
    what the order-revealing probes run."""
    b, kv, g, n, m = layout.batch, layout.kv_heads, layout.groups, layout.n, layout.m
    call = _call_fn(dtype, causal, None, layout.plain())

    def run(q, k, v):
        q4 = q.reshape(b, kv * g, n, q.shape[-1])
        k4, v4 = (t.reshape(b, kv, m, t.shape[-1]) for t in (k, v))
        return call(q4, k4, v4).reshape(q.shape)

    return run if dtype == "float16" else jax.jit(run)


def _window(window, n: int, m: int) -> tuple[int, int] | None:
    """fa_jax's (left, right) window (-1: unbounded) as jax's local_window_size."""
    if window is None:
        return None
    return tuple(int(w) if w >= 0 else n + m for w in window)  # type: ignore[return-value]


def _layout(q_shape, k_shape, features: dict) -> _Layout:
    """The 4-D call of (..., H, N, d) queries and (..., H_kv, M, d) keys with
    ``features``: the leading dimensions before the heads flattened into jax's batch."""
    if len(q_shape) < 3:
        raise ValueError(
            f"xla: expected q (..., H, N, d) with a heads axis for these features, "
            f"got shape {tuple(q_shape)}"
        )
    batch = int(np.prod(q_shape[:-3], dtype=int))
    h, kv, n, m = q_shape[-3], k_shape[-3], q_shape[-2], k_shape[-2]
    full = (batch, h, n, m)

    def shape_of(name):
        return None if features.get(name) is None else full

    return _Layout(
        batch,
        kv,
        h // kv,
        n,
        m,
        bias=shape_of("bias"),
        mask=shape_of("mask"),
        window=_window(features.get("window"), n, m),
        lengths=features.get("kv_lengths") is not None,
    )


def _lengths(kv_lengths, lead: tuple, batch: int):
    """key_value_seq_lengths (B,) of lengths broadcastable to the leading dimensions
    (..., H): jax's take one per batch, so equal across the heads."""
    lengths = np.broadcast_to(np.asarray(kv_lengths, np.int32), lead)
    if not (lengths == lengths[..., :1]).all():
        raise ValueError(
            "xla: kv_lengths: expected one length per batch, equal across the heads "
            "(jax's key_value_seq_lengths has shape (B,)), got lengths that differ by head"
        )
    return lengths[..., 0].reshape(batch)


def _featured(q, k, features: dict) -> bool:
    """Whether a call needs the 4-D program: features, fewer K/V heads or N != M."""
    return (
        bool(features) or np.shape(q)[:-2] != np.shape(k)[:-2] or np.shape(q)[-2] != np.shape(k)[-2]
    )


def real(q, k, v, *, fmt: Format, causal: bool = False, scale=None, **features) -> np.ndarray:
    """XLA's output for (..., N, d) inputs exact in ``fmt``, as float64; ``features``
    (bias, mask, window, kv_lengths; K/V with fewer heads) as jax's arguments."""
    scale = None if scale is None else float(scale)
    if not _featured(q, k, features):
        lead, (q, k, v) = flat_heads(q, k, v)
        run = _attention(fmt.name, bool(causal), scale)
        out = np.asarray(run(q, k, v), dtype=np.float64)
        return out.reshape(*lead, *out.shape[-2:])
    layout = _layout(np.shape(q), np.shape(k), features)
    full = (layout.batch, layout.kv_heads * layout.groups, layout.n, layout.m)
    q4, k4, v4 = (
        np.asarray(t, np.float32).reshape(layout.batch, *np.shape(t)[-3:]) for t in (q, k, v)
    )
    args = {}
    if layout.bias is not None:
        args["bias"] = np.broadcast_to(np.asarray(features["bias"], np.float32), full)
    if layout.mask is not None:
        args["mask"] = np.broadcast_to(np.asarray(features["mask"], bool), full)
    if layout.lengths:
        args["lengths"] = _lengths(features["kv_lengths"], np.shape(q)[:-2], layout.batch)
    run = _call(fmt.name, bool(causal), scale, layout)
    out = np.asarray(run(q4, k4, v4, **args), dtype=np.float64)
    return out.reshape(np.shape(q)[:-1] + out.shape[-1:])


# -- XLA CPU's float32 exp -----------------------------------------------------------

_LOG2E = 1.44269504088896341
_C1, _C2 = 0.693359375, -2.12194440e-4  # ln 2 = C1 + C2 (Cody & Waite)
_CEPHES = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1)
_HALF_COEFF = 5.0000001201e-1


def _f32(v: float) -> float:
    return float(np.float32(v))


def xla_cpu_exp(x: jax.Array) -> jax.Array:
    """XLA CPU's float32 exp of float32 values ``x`` (float64 carriers), bit for bit.

    x clamped to [-104, 88.8]; n = floor(fma(x, log2 e, 1/2)) clamped to
    [-127, 127]; a = fma(-C2, n, fma(-C1, n, x)); z = 1 + fma(p(a), a², a) with
    the Cephes polynomial p evaluated by FMAs (Horner); the result z · 2^n, and
    0 where it falls below FLT_MIN (flushed to zero).
    """
    x = jnp.clip(x, -104.0, 88.8)
    n = jnp.floor(ops.fma(x, _f32(_LOG2E), 0.5, FP32))
    n = jnp.clip(n, -127.0, 127.0)
    a = ops.fma(-_f32(_C1), n, x, FP32)
    a = ops.fma(-_f32(_C2), n, a, FP32)
    z = ops.fma(a, _f32(_CEPHES[0]), _f32(_CEPHES[1]), FP32)
    for c in (*_CEPHES[2:], _HALF_COEFF):
        z = ops.fma(z, a, _f32(c), FP32)
    z = ops.fma(z, ops.mul(a, a, FP32), a, FP32)
    z = ops.add(1.0, z, FP32)
    out = jnp.ldexp(z, n.astype(jnp.int32))  # exact in float64
    return jnp.where(out < _F32_TINY, 0.0, out)


def _xla_cpu_exp(x, fmt: Format) -> jax.Array:
    return ops.cast(xla_cpu_exp(x), fmt)


XLA_CPU_EXP = ExpModel("xla_cpu", _xla_cpu_exp)
register_exp_model(XLA_CPU_EXP)


def xla_cpu_exp_model() -> ExpModel:
    """:func:`xla_cpu_exp` as a :class:`fa_jax.exponential.ExpModel` ("xla_cpu")."""
    return XLA_CPU_EXP


# -- summation orders ------------------------------------------------------------------


def _qk(q, k, *, pairs: bool, acc: Format, tile_k: int = 1, block: int | None = None):
    """fl32(Q Kᵀ), each dot ``tile_k`` sequential FMA chains over d (term t in chain
    t mod tile_k) folded pairwise, the last d mod tile_k terms as rounded products
    added in order, added last; with ``pairs`` (bf16 inputs) the terms in the order 1, 0, 3,
    2, ... (an odd last term comes last), else 0, 1, 2, ...  With ``block`` the
    terms before the remainder are cut into blocks of ``block`` (the last shorter),
    each summed so from zero and the block sums added in order (YNNPACK splits the
    reduction so where a dot has few rows: decoding shapes).  ``tile_k`` 0: every
    product rounded, added in order (YNNPACK's reference kernel,
    ``dot_fp32_1xNx1_1x1x1``: :func:`_qk_split`)."""
    d = q.shape[-1]
    if tile_k == 0:
        return _rounded_products([(q[..., :, None, t], k[..., None, :, t]) for t in range(d)], acc)
    if pairs:
        order = _permuted(d, True)
        q, k = q[..., order], k[..., order]
    rest = d % tile_k if d > tile_k else 0
    if rest:
        main = _qk(
            q[..., : d - rest], k[..., : d - rest], pairs=False, acc=acc, tile_k=tile_k, block=block
        )
        tail = [(q[..., :, None, t], k[..., None, :, t]) for t in range(d - rest, d)]
        return ops.add(main, _rounded_products(tail, acc), acc)
    if block is not None and block < d:
        parts = [
            _qk(
                q[..., lo : lo + block],
                k[..., lo : lo + block],
                pairs=False,
                acc=acc,
                tile_k=tile_k,
            )
            for lo in range(0, d, block)
        ]
        total = parts[0]
        for part in parts[1:]:
            total = ops.add(total, part, acc)
        return total
    if d < tile_k:  # a short block: the kernel's lanes past d hold zeros
        q = jnp.concatenate([q, jnp.zeros((*q.shape[:-1], tile_k - d), q.dtype)], axis=-1)
        k = jnp.concatenate([k, jnp.zeros((*k.shape[:-1], tile_k - d), k.dtype)], axis=-1)
        d = tile_k
    steps = d // tile_k
    # Chain r holds terms r, r + tile_k, ...: (..., tile_k, N, steps) @ (..., tile_k, steps, M).
    qs = jnp.swapaxes(q.reshape(*q.shape[:-1], steps, tile_k), -1, -2)
    ks = jnp.swapaxes(k.reshape(*k.shape[:-1], steps, tile_k), -1, -2)
    qs = jnp.moveaxis(qs, -2, -3)
    ks = jnp.moveaxis(ks, -2, -3)
    chains = ops.matmul(qs, jnp.swapaxes(ks, -1, -2), acc, accumulation="sequential")
    return own_dots.fold(chains, acc)


def _chain(terms, acc: Format):
    """Sum axis -2 of ``terms`` left to right (the first term is exact, 0 + t)."""
    total = terms[..., 0, :]
    for i in range(1, terms.shape[-2]):
        total = ops.add(total, terms[..., i, :], acc)
    return total


def _kahan(a, total, error, acc: Format):
    """One step of compensated (Kahan) summation: ``a`` corrected by the running
    error, added to ``total``; the new total and error (Higham 2002, Algorithm 4.2)."""
    y = ops.sub(a, error, acc)
    t = ops.add(total, y, acc)
    return t, ops.sub(ops.sub(t, total, acc), y, acc)


def _softmax_sum(e, acc: Format):
    """The softmax sum: YNNPACK's ``sum_float_k1`` (ynnpack/kernels/reduce/sum.h) on
    16 float32 lanes, term j of a row in lane j mod 16.

    The row is read in chunks of 64 terms (4 per lane, summed left to right; a
    ragged last chunk padded with zeros).  While 256 terms or more remain, four
    chunks are summed left to right and their sum added to a level-1
    accumulator; after that, each chunk is added to it alone.  Each time 1024
    terms have been read, and at the end, the level-1 accumulator is added to
    the level-2 one by compensated (Kahan) summation and cleared.  The 16 lane
    sums are then halved (l + l+8, then + 4, + 2, + 1)."""
    m = e.shape[-1]
    chunks = -(-m // _CHUNK)
    pad = chunks * _CHUNK - m
    if pad:
        e = jnp.concatenate([e, jnp.zeros((*e.shape[:-1], pad), e.dtype)], axis=-1)
    # (..., chunks, 4, 16): a chunk's 4 vectors of 16 lanes.
    terms = e.reshape(*e.shape[:-1], chunks, _CHUNK // _LANES, _LANES)
    leaves = _chain(terms, acc)  # (..., chunks, 16)
    unrolled = m // (4 * _CHUNK)
    groups = leaves[..., : 4 * unrolled, :].reshape(*leaves.shape[:-2], unrolled, 4, _LANES)
    items = jnp.concatenate([_chain(groups, acc), leaves[..., 4 * unrolled :, :]], axis=-2)
    # The chunks read once each item is added: a compensated step at each 1024 terms.
    # YNNPACK's clock ticks in its loops over whole chunks only, so a ragged last
    # chunk (the kernel's remainder) never triggers one; the end does.
    read = [4 * (u + 1) for u in range(unrolled)] + list(range(4 * unrolled + 1, chunks + 1))
    flush = np.asarray([r % (_KAHAN // _CHUNK) == 0 for r in read])
    if pad:
        flush[-1] = False
    zeros = jnp.zeros_like(items[..., 0, :])

    def step(carry, item):
        level1, total, error = carry
        term, now = item
        level1 = ops.add(level1, term, acc)
        kahan_total, kahan_error = _kahan(level1, total, error, acc)
        total = jnp.where(now, kahan_total, total)
        error = jnp.where(now, kahan_error, error)
        return (jnp.where(now, zeros, level1), total, error), None

    xs = (jnp.moveaxis(items, -2, 0), jnp.asarray(flush))
    level1, total, error = jax.lax.scan(step, (zeros, zeros, zeros), xs)[0]
    lanes = _kahan(level1, total, error, acc)[0]
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = ops.add(lanes[..., :half], lanes[..., half:], acc)
    return lanes[..., 0]


_Levels = tuple[tuple[int, int, bool], ...]  # reduce-windows: (size, leading pad, in YNNPACK)


def _windowed_sum(e, levels: _Levels, acc: Format, ynn_total: bool = False):
    """The softmax sum where XLA rewrites it as a tree reduction (decoding shapes):
    ``levels`` of ``reduce-window``, each of ``size`` terms (stride ``size``; ``pad``
    zeros before the row and as many as fill the last window after it), each
    window summed left to right from 0 in a loop fusion of XLA's, or by YNNPACK's
    sum (:func:`_softmax_sum` on the padded window) where the windows sit in a
    YNNPACK fusion; the next level reduces the window sums so; then a ``reduce``
    of the last sums: XLA's, left to right from 0, or YNNPACK's (:func:`_softmax_sum`
    again) where it sits in the last windows' fusion (``ynn_total``)."""
    for size, pad, ynn in levels:
        m = e.shape[-1]
        windows = -(-(pad + m) // size)
        after = windows * size - pad - m
        zeros = functools.partial(jnp.zeros, dtype=e.dtype)
        e = jnp.concatenate(
            [zeros((*e.shape[:-1], pad)), e, zeros((*e.shape[:-1], after))], axis=-1
        )
        terms = e.reshape(*e.shape[:-1], windows, size)
        e = _softmax_sum(terms, acc) if ynn else _chain(jnp.swapaxes(terms, -1, -2), acc)
    if ynn_total:
        return _softmax_sum(e, acc)
    return _chain(e[..., None], acc)[..., 0]


def _rounded_products(pairs, acc: Format):
    """A dot kernel's remainder (the last n mod tile_k terms): each product rounded,
    then added in order (no FMA), as measured against the real kernel."""
    a, b = pairs[0]
    total = ops.mul(a, b, acc)
    for a, b in pairs[1:]:
        total = ops.add(total, ops.mul(a, b, acc), acc)
    return total


def _pv(
    p,
    v,
    acc: Format,
    block: int,
    tile_k: int = 1,
    joined: bool = False,
    rest_fma: bool = False,
    tail: list | None = None,
):
    """fl32(P V): blocks of ``block`` keys; in each, ``tile_k`` FMA chains from zero
    (key j of the block in chain j mod tile_k), folded pairwise; the block sums
    added in order; the last N mod tile_k keys (the kernel's remainder) as
    rounded products added in order, added last.  ``joined``: the last keys, fewer
    than a block, are one block with the block before.  Each chain is a
    sequential matmul (:func:`fa_jax.ops.matmul`, on the float32 hardware where
    its products are exact), every block and chain at once, so the program's size
    does not grow with the number of blocks.  ``rest_fma``: the last N mod tile_k
    keys FMA'd in order onto the folded chains of the block they end (one of their
    own, from zero, where the blocks before are whole) before it is added
    (:attr:`~fa_jax.kernels.xla.own_dots.OwnDots.pv_rest_fma`); ``tail``, those
    keys' (P, V) pairs, given with the keys before them."""
    m = p.shape[-1]
    if joined and m > block and m % block:
        cut = (m // block - 1) * block
        last = _pv(p[..., cut:], v[..., cut:, :], acc, m - cut, tile_k)
        if not cut:
            return last
        return ops.add(_pv(p[..., :cut], v[..., :cut, :], acc, block, tile_k), last, acc)
    rest = m % tile_k if m > tile_k else 0
    if rest:
        tail = [(p[..., j, None], v[..., j, None, :]) for j in range(m - rest, m)]
        if rest_fma and (m - rest) % min(block, m):
            return _pv(p[..., : m - rest], v[..., : m - rest, :], acc, block, tile_k, tail=tail)
        main = _pv(p[..., : m - rest], v[..., : m - rest, :], acc, block, tile_k)
        if rest_fma:
            own = jnp.zeros_like(main)
            for a, b in tail:
                own = ops.fma(a, b, own, acc)
            return ops.add(main, own, acc)
        return ops.add(main, _rounded_products(tail, acc), acc)
    block = min(block, m)
    nb = -(-m // block)
    steps = -(-block // tile_k)
    pad = nb * steps * tile_k - m
    if pad:
        p = jnp.concatenate([p, jnp.zeros((*p.shape[:-1], pad), p.dtype)], axis=-1)
        v = jnp.concatenate([v, jnp.zeros((*v.shape[:-2], pad, v.shape[-1]), v.dtype)], axis=-2)
    lead = p.ndim - 2
    # Chain r of block b: (..., nb, tile_k, N, steps) @ (..., nb, tile_k, steps, dv).
    ps = p.reshape(*p.shape[:-1], nb, steps, tile_k)
    ps = jnp.transpose(ps, (*range(lead), lead + 1, lead + 3, lead, lead + 2))
    vs = v.reshape(*v.shape[:-2], nb, steps, tile_k, v.shape[-1])
    vs = jnp.transpose(vs, (*range(lead), lead, lead + 2, lead + 1, lead + 3))
    chains = ops.matmul(ps, vs, acc, accumulation="sequential")
    blocks = own_dots.fold(chains, acc)  # (..., nb, N, dv)
    if tail:
        last = blocks[..., -1, :, :]
        for a, b in tail:
            last = ops.fma(a, b, last, acc)
        blocks = jnp.concatenate([blocks[..., :-1, :, :], last[..., None, :, :]], axis=-3)
    if nb == 1:
        return blocks[..., 0, :, :]

    def add(total, block_sum):
        return ops.add(total, block_sum, acc), None

    rest = jnp.moveaxis(blocks[..., 1:, :, :], -3, 0)
    return jax.lax.scan(add, blocks[..., 0, :, :], rest)[0]


def _sharded_pv(
    p,
    v,
    acc: Format,
    block: int,
    tile_k: int,
    shard: int,
    kc: int | None,
    rest_fma: bool = False,
):
    """fl32(P V) as Eigen's contraction sharded over the keys (``evalShardedByInnerDim``,
    unsupported/Eigen/src/Tensor/TensorContractionThreadPool.h): shards of ``shard``
    keys, each its own :func:`_pv` from zero into a buffer of its own, then the
    buffers summed in Eigen's order (:func:`~fa_jax.kernels.xla.own_dots.eigen_buffers_sum`).
    Each shard is cut in blocks for its own size by Eigen's ``kc``
    (:func:`~fa_jax.kernels.xla.own_dots.eigen_kc`); ``block``, probed at the first
    keys, where no kc cuts them (a shard of one block); ``rest_fma`` as :func:`_pv`'s,
    in each shard."""
    m = p.shape[-1]
    parts = [
        _pv(
            p[..., lo : lo + shard],
            v[..., lo : lo + shard, :],
            acc,
            block if kc is None else own_dots.eigen_kc(min(shard, m - lo), kc),
            tile_k,
            rest_fma=rest_fma,
        )
        for lo in range(0, m, shard)
    ]
    return own_dots.eigen_buffers_sum(parts, acc)


# -- the model -------------------------------------------------------------------------


def _computations(text: str) -> dict[str, str]:
    """The bodies of an HLO module's computations, by name ("ENTRY" for the entry)."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    return {k: "\n".join(v) for k, v in bodies.items()}


def _converts_product_to_bf16(body: str) -> bool:
    """Whether an HLO computation's body converts the result of one of its
    multiplies to bf16 (P = e · (1/l) rounded to bf16)."""
    opcodes = dict(re.findall(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*\S+\s+([\w-]+)\(", body, re.M))
    operands = re.findall(r"= bf16\[[^\]]*\]\S* convert\(%([^,\s)]+)\)", body)
    return any(opcodes.get(name) == "multiply" for name in operands)


@functools.cache
def _program_text(dtype: str, shape: tuple[int, ...], causal: bool, layout) -> str:
    """The optimised HLO of the real call: the 3-D one on (B·H, N, d) inputs, or
    ``layout``'s 4-D one (``shape`` then its grouped view); compiled once, read by
    each step's reading (P's rounding, the exp, the sum, the FMA steps, the dots)."""
    if layout is None:
        x = jax.ShapeDtypeStruct(shape, np.float32)
        return _jit_attention(dtype, causal, None).lower(x, x, x).compile().as_text() or ""
    args, extra = _abstract_args(layout, shape[-1])
    run = jax.jit(_call_fn(dtype, causal, None, layout))
    return run.lower(*args, **extra).compile().as_text() or ""


def _abstract_args(layout, d: int) -> tuple[list, dict]:
    """The float32 (shape-only) arguments of ``layout``'s 4-D call: q, k, v and its
    features (bias, mask, key lengths) as keywords."""
    b, kv, g, n, m = dataclasses.astuple(layout)[:5]
    f32 = np.float32
    args = [
        jax.ShapeDtypeStruct((b, kv * g, n, d), f32),
        jax.ShapeDtypeStruct((b, kv, m, d), f32),
        jax.ShapeDtypeStruct((b, kv, m, d), f32),
    ]
    extra = {}
    if layout.bias is not None:
        extra["bias"] = jax.ShapeDtypeStruct(layout.bias, f32)
    if layout.mask is not None:
        extra["mask"] = jax.ShapeDtypeStruct(layout.mask, np.bool_)
    if layout.lengths:
        extra["lengths"] = jax.ShapeDtypeStruct((b,), np.int32)
    return args, extra


@functools.cache
def _in_ynn_fusions(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: _Layout | None = None
) -> tuple[bool, bool]:
    """Whether, in the program XLA compiles for (B·H, N, d) inputs (or ``layout``'s
    call), P's bf16 conversion (a convert of the product e · (1/l)) and the exp sit
    in YNNPACK fusions (module docstring).  fp16 runs eagerly: no conversion in a
    fusion, and the exp as its own program has it (:func:`_eager_exp_in_ynn`).
    The conversions of Q, K and V to bf16 do not count."""
    if dtype == "float16":
        return False, _eager_exp_in_ynn(shape, causal, layout)
    text = _program_text(dtype, shape, causal, layout)
    bodies = _computations(text or "")
    convert = exp = False
    for line in bodies.get("ENTRY", "").splitlines():
        called = re.search(r"calls=%([^,\s]+)", line)
        if "__ynn_fusion" in line and called:
            body = bodies.get(called.group(1), "")
            convert |= _converts_product_to_bf16(body)
            exp |= " exponential(" in body
    return convert, exp


_WINDOW = re.compile(r"window=\{size=(\S+) stride=(\S+)(?: pad=(\S+))?\}")


@functools.cache
def _sum_window(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: _Layout | None = None
) -> tuple[_Levels, bool] | None:
    """The levels of ``reduce-window`` (size, leading pad, in YNNPACK) of the softmax
    sum where XLA's program computes it as a tree of them over the keys (its
    tree-reduction rewrite, in decoding shapes), and whether the last level's sums
    are reduced by YNNPACK (in the same fusion) rather than XLA, read from the HLO
    (:func:`_window_in`).  Where the sum is one ``reduce`` in an XLA loop fusion
    (small shapes), one window of every key, left to right.  None where the whole
    sum is YNNPACK's.  fp16 runs eagerly: the HLO read is that of its sum's own
    program (:func:`_eager_programs`)."""
    if dtype == "float16":
        text = _eager_programs(shape, causal, layout)["reduce_sum"]
    else:
        text = _program_text(dtype, shape, causal, layout)
    window = _window_in(text, shape, dtype)
    if window is None and _sum_in_loop_fusion(text):
        m = shape[-2] if layout is None else layout.m
        return ((m, 0, False),), False
    return window


def _fusions(text: str):
    """(the fusion's line in the entry, the body it calls) for each fusion an
    optimised HLO module's entry calls."""
    bodies = _computations(text)
    for line in bodies.get("ENTRY", "").splitlines():
        called = re.search(r"calls=%([^,\s]+)", line)
        if called:
            yield line, bodies.get(called.group(1), "")


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*\S+\s+([\w-]+)\(([^)]*)\)", re.M)


_MOVES = ("bitcast", "copy", "reshape", "transpose")  # in a fusion, they move no bits


def _contracted(text: str) -> str | None:
    """The step into which one of XLA's own loop fusions (small and decoding shapes)
    fuses the scale's multiply, S·scale: XLA's CPU backend lets LLVM contract a
    multiply and an add into an FMA, so fl(S·scale + bias) (``"add"``) or
    fl(S·scale - m) (``"subtract"``) is one rounding.  ``"select"`` where a select
    (a mask) stands between the product and the subtraction: LLVM folds it, and
    fuses, only where it proves the select's condition (:func:`_fused_keys`).
    None where no product feeds either, or the steps run in YNNPACK fusions, which
    round each product (measured).  Bitcasts, copies, reshapes and transposes
    inside a fusion only index: the product feeds the step through them."""
    for line, body in _fusions(text):
        if "__ynn_fusion" in line:
            continue
        graph = {
            name: (op, re.findall(r"%([^,\s]+)", args))
            for name, op, args in _INSTRUCTION.findall(body)
        }
        for name, (op, _) in graph.items():
            if op != "multiply":
                continue
            reached, selected = [(name, False)], None
            while reached:
                at, through = reached.pop()
                for user, (user_op, args) in graph.items():
                    if at not in args:
                        continue
                    if user_op in _MOVES or (user_op == "select" and args.index(at) > 0):
                        reached.append((user, through or user_op == "select"))
                    elif user_op == "subtract" and through:
                        selected = "select"
                    elif user_op in ("add", "subtract"):
                        return user_op
            if selected:
                return selected
    return None


def _sum_in_loop_fusion(text: str) -> bool:
    """Whether the softmax sum (a ``reduce`` of additions) sits in one of XLA's own
    loop fusions (small shapes), which reduce left to right from 0 (XLA's
    elemental emitter: a sequential loop), rather than in a YNNPACK fusion."""
    adds = {
        name
        for name, body in _computations(text).items()
        if re.search(r"^\s*ROOT\s+\S+\s*=\s*\S+\s+add\(", body, re.M)
    }
    for line, body in _fusions(text):
        for found in re.finditer(r" reduce\([^\n]*to_apply=%([^,\s]+)", body):
            if found.group(1) in adds:
                return "__ynn_fusion" not in line
    return False


def _window_in(text: str, shape: tuple[int, ...], dtype: str) -> tuple[_Levels, bool] | None:
    """:func:`_sum_window`'s reading of an optimised HLO module ``text``: the first
    ``reduce-window`` of additions called from the entry, then each one called on
    the one before's result, as (size, leading pad (0 where the HLO gives none), in
    a YNNPACK fusion); and whether a ``reduce`` of the last one's window sums sits
    in its YNNPACK fusion too.  None where there is none."""
    bodies = _computations(text)
    levels: list[tuple[int, int, bool]] = []
    source, total = None, False
    for line in bodies.get("ENTRY", "").splitlines():
        called = re.search(r"calls=%([^,\s]+)", line)
        if not called or (source and not re.search(rf"[(\s]%{re.escape(source)}[,)]", line)):
            continue
        body = bodies.get(called.group(1), "")
        for inner in body.splitlines():
            found = _WINDOW.search(inner)
            apply = re.search(r"to_apply=%([^,\s]+)", inner)
            if " reduce-window(" not in inner or not found or not apply:
                continue
            if " add(" not in bodies.get(apply.group(1), ""):
                continue  # the max's
            size, stride = found.group(1).split("x")[-1], found.group(2).split("x")[-1]
            lo = found.group(3).split("x")[-1].split("_")[0] if found.group(3) else "0"
            if size != stride:
                raise ValueError(
                    f"xla: the softmax sum of {shape} ({dtype}) is a reduce-window of size "
                    f"{size} and stride {stride}; only equal ones are modelled"
                )
            ynn = "__ynn_fusion" in line
            name = inner.split("=")[0].strip().removeprefix("ROOT").strip()
            total = ynn and re.search(rf" reduce\({re.escape(name)}[,)]", body) is not None
            levels.append((int(size), int(lo), ynn))
            source = line.split("=")[0].strip().removeprefix("ROOT").strip().lstrip("%")
            break
    return (tuple(levels), total) if levels else None


def _eager_shapes(shape: tuple[int, ...], causal: bool, layout) -> dict[str, tuple[int, ...]]:
    """The shapes of the float32 arrays fp16's eager softmax steps take (``exp``,
    ``reduce_sum``: jax's ``_softmax`` in jax/_src/nn/functions.py, under the vmap of
    ``_dot_product_attention_xla``), read from the jaxpr of the real call: the 3-D
    one on (B·H, N, d) inputs, or ``layout``'s 4-D one (``shape`` its grouped view)."""
    f32 = np.float32
    if layout is None:
        x = jax.ShapeDtypeStruct(shape, f32)
        args, extra = [x, x, x], {}
        run = _attention_fn("float16", causal, None)
    else:
        args, extra = _abstract_args(layout, shape[-1])
        run = _call_fn("float16", causal, None, layout)
    found: dict[str, tuple[int, ...]] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("exp", "reduce_sum"):
                found[eqn.primitive.name] = tuple(eqn.invars[0].aval.shape)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(run)(*args, **extra).jaxpr)
    if set(found) != {"exp", "reduce_sum"}:
        raise ValueError(
            f"xla: expected an exp and a reduce_sum in jax's float16 attention of {shape}, "
            f"found {sorted(found)}"
        )
    return found


@functools.cache
def _eager_programs(shape: tuple[int, ...], causal: bool, layout=None) -> dict[str, str]:
    """The optimised HLO of fp16's eager exp and softmax sum (``exp``,
    ``reduce_sum``): run op by op, each is a program of its own, compiled for the
    shape it takes (:func:`_eager_shapes`), as jax's eager ``jnp.exp`` and
    ``jnp.sum(..., keepdims=True)`` over the keys."""
    shapes = _eager_shapes(shape, causal, layout)

    def text(fn, x):
        return jax.jit(fn).lower(jax.ShapeDtypeStruct(x, np.float32)).compile().as_text() or ""

    return {
        "exp": text(jnp.exp, shapes["exp"]),
        "reduce_sum": text(lambda x: jnp.sum(x, axis=-1, keepdims=True), shapes["reduce_sum"]),
    }


def _eager_exp_in_ynn(shape: tuple[int, ...], causal: bool, layout=None) -> bool:
    """Whether fp16's eager exp runs in a YNNPACK fusion (:func:`_eager_programs`)."""
    entry = _computations(_eager_programs(shape, causal, layout)["exp"]).get("ENTRY", "")
    return "__ynn_fusion" in entry


_PROBE_BIG = 2.0**15  # M of a probe, exact in every format
_PROBE_SMALL = 2.0**-10  # the small terms: 2^-25 M, absorbed by ±M in float32
_PROBE_TERMS = 8  # small terms counted after the -M of a probe column
_PROBE_MAX_FP16_KEYS = 2**14  # beyond, fp16 outputs cannot count a uniform P's small terms


def _pv_probe_counts(
    run, shape: tuple[int, ...], tests: list[int], m: int | None = None
) -> np.ndarray:
    """For each key j of ``tests`` and each query, the small terms counted by a P V
    probe: q = k = 0, so P is uniform (``run`` is the program without a mask), and
    V's column holds M at key 0, -M at key j and small terms on the next keys.
    All of them are counted where key j's product joins key 0's in one FMA chain
    (M - M cancels, then they add); fewer where the keys sit in different chains
    or blocks (those after j in j's chain are absorbed by -M).  ``m`` keys (N by
    default).  Returns (len(tests), N)."""
    bh, n, d = shape
    m = n if m is None else m
    zeros = np.zeros(shape, np.float32)
    kv_zeros = np.zeros((bh, m, d), np.float32)
    counts = np.zeros((len(tests), n), int)
    for start in range(0, len(tests), d):
        chunk = tests[start : start + d]
        v = np.zeros((bh, m, d), np.float32)
        for col, j in enumerate(chunk):
            v[:, 0, col] = _PROBE_BIG
            v[:, j, col] = -_PROBE_BIG
            v[:, j + 1 : j + 1 + _PROBE_TERMS, col] = _PROBE_SMALL
        out = np.asarray(run(zeros, kv_zeros, v), dtype=np.float64)
        counts[start : start + len(chunk)] = np.round(out[0, :, : len(chunk)].T * m / _PROBE_SMALL)
    return counts


_SPARSE_KEYS = 1024  # the keys a sparse P V probe keeps: P = 2^-10 on each


@functools.cache
def _masked_grouped_run(layout: _Layout):
    """fp16's plain program of ``layout`` on the grouped view, with a mask: q (B·H_kv,
    G·N, d), k and v (B·H_kv, M, d) and the pairs kept (B·H_kv, G·N, M).  Run op by
    op, its dots, exp and sums are the programs of the call without a mask (each op
    compiled for its own shapes); the mask only adds jax's ``where``."""
    b, kv, g, n, m = layout.batch, layout.kv_heads, layout.groups, layout.n, layout.m
    masked = dataclasses.replace(layout.plain(), mask=(b, kv * g, n, m))
    call = _call_fn("float16", False, None, masked)

    def run(q, k, v, keep):
        q4 = q.reshape(b, kv * g, n, q.shape[-1])
        k4, v4 = (t.reshape(b, kv, m, t.shape[-1]) for t in (k, v))
        return call(q4, k4, v4, mask=keep.reshape(b, kv * g, n, m)).reshape(q.shape)

    return run


def _pv_sparse_probe_counts(run, shape: tuple[int, ...], tests: list[int], m: int) -> np.ndarray:
    """:func:`_pv_probe_counts` for fp16 beyond 2^14 keys, where a uniform P is too
    small for fp16's outputs to count the small terms: ``run``
    (:func:`_masked_grouped_run`) keeps only 1024 keys, the probe's and the first
    others (V zero there), so P is 2^-10 on them and 0 elsewhere; the dot's order
    is the same, its other products zero.  Returns (len(tests), N)."""
    bh, n, d = shape
    zeros = np.zeros(shape, np.float32)
    kv_zeros = np.zeros((bh, m, d), np.float32)
    counts = np.zeros((len(tests), n), int)
    width = min(d, (_SPARSE_KEYS - 1) // (1 + _PROBE_TERMS))
    for start in range(0, len(tests), width):
        chunk = tests[start : start + width]
        v = np.zeros((bh, m, d), np.float32)
        active = np.zeros(m, bool)
        active[0] = True
        for col, j in enumerate(chunk):
            v[:, 0, col] = _PROBE_BIG
            v[:, j, col] = -_PROBE_BIG
            v[:, j + 1 : j + 1 + _PROBE_TERMS, col] = _PROBE_SMALL
            active[j : j + 1 + _PROBE_TERMS] = True
        active[np.flatnonzero(~active)[: _SPARSE_KEYS - int(active.sum())]] = True
        keep = np.broadcast_to(active, (bh, n, m))
        out = np.asarray(run(zeros, kv_zeros, v, keep), dtype=np.float64)
        scaled = out[0, :, : len(chunk)].T * _SPARSE_KEYS / _PROBE_SMALL
        counts[start : start + len(chunk)] = np.round(scaled)
    return counts


_TILES_K = (1, 2, 4, 8)  # the tile_k of YNNPACK's dot kernels (one, or lanes folded pairwise)


def _simulated_dot(terms: np.ndarray, tile_k: int, block: int) -> np.ndarray:
    """The sums of the rows of ``terms`` (exact products, float32) in a dot's order:
    blocks of ``block`` terms, in each ``tile_k`` chains from zero folded pairwise,
    the block sums added in order, the last n mod tile_k terms one more chain
    added last; float32 arithmetic, as the kernel's."""
    rows, n = terms.shape
    rest = n % tile_k if n > tile_k else 0
    if rest:
        main = _simulated_dot(terms[:, : n - rest], tile_k, block)
        return main + _simulated_dot(terms[:, n - rest :], 1, rest)
    block = min(block, n)
    nb, steps = -(-n // block), -(-block // tile_k)
    x = np.zeros((rows, nb * steps * tile_k), np.float32)
    x[:, :n] = terms
    x = x.reshape(rows, nb, steps, tile_k)
    chains = np.zeros((rows, nb, tile_k), np.float32)
    for step in range(steps):
        chains = chains + x[:, :, step]
    while chains.shape[-1] > 1:
        chains = chains[..., 0::2] + chains[..., 1::2]
    total = chains[:, 0, 0]
    for b in range(1, nb):
        total = total + chains[:, b, 0]
    return total


def _pv_probe_terms(n: int, tests: list[int], p: float) -> np.ndarray:
    """The P V probes' products p·V (float32, exact), p the probes' uniform P."""
    terms = np.zeros((len(tests), n), np.float32)
    for row, j in enumerate(tests):
        terms[row, 0] = p * _PROBE_BIG
        terms[row, j] = -p * _PROBE_BIG
        terms[row, j + 1 : j + 1 + _PROBE_TERMS] = p * _PROBE_SMALL
    return terms


def _pv_predicted(n: int, tests: list[int], p: float, tile_k: int, block: int) -> np.ndarray:
    """The counts :func:`_pv_probe_counts` reads where the dot runs in this order."""
    sums = _simulated_dot(_pv_probe_terms(n, tests, p), tile_k, block).astype(np.float64)
    return np.round(sums / (p * _PROBE_SMALL)).astype(int)


def _probe_p(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: _Layout | None = None
) -> float:
    """The probes' uniform P: fl32(1 / M) (q = k = 0, every exp 1, the sum exact), and
    rounded to ``dtype`` where XLA keeps P's rounding (in ``layout``'s plain call)."""
    m = shape[1] if layout is None else layout.m
    p = np.float32(1.0) / np.float32(m)
    if _p_rounded(dtype, shape, causal, None if layout is None else layout.plain()):
        p = np.asarray(p).astype(jnp.dtype(dtype)).astype(np.float32)
    return float(p)


@functools.cache
def _pv_order(
    dtype: str, shape: tuple[int, ...], layout: _Layout | None = None
) -> tuple[tuple[int, int, int, int], ...]:
    """(tile_k, block) of the P V dot for (B·H, N, d) inputs, read from the real
    program with order-revealing probes (:func:`_pv_probe_counts`).

    YNNPACK picks a dot kernel by the shape (tile_k: how many FMA chains each
    output's vector lanes keep, folded pairwise at the end) and blocks the
    reduction over keys by a size it derives at run time from the CPU's L2 cache
    and the kernel's tile, so neither XLA's program nor the shape alone gives
    them.  tile_k is the candidate whose simulated probes (:func:`_simulated_dot`)
    match the real counts of keys 1 .. 8 against key 0; the block, a search over
    multiples of tile_k for the first key whose probe, with the one tile_k before
    it, no longer matches one block's prediction (a key alone can be the last of a
    block).  One block of N keys where N < 4.  With ``layout``, the grouped view's
    (B·H_kv, G·N, d) queries against its M keys, in its plain call.  fp16 beyond
    2^14 keys is probed with a mask (:func:`_pv_sparse_probe_counts`), the 3-D
    call as the 4-D one it is (jax adds the batch axis)."""
    bh, n, d = shape
    m = n if layout is None else layout.m
    if m < 4:
        return ((0, n, 1, m),)
    if dtype == "float16" and m > _PROBE_MAX_FP16_KEYS:
        grouped = _Layout(1, bh, 1, n, n) if layout is None else layout
        probe = functools.partial(_pv_sparse_probe_counts, _masked_grouped_run(grouped))
        p = 1.0 / _SPARSE_KEYS
    else:
        # The same dot as the causal (or masked) program's.
        plain = layout is None
        run = _attention(dtype, False, None) if plain else _grouped_run(dtype, layout.plain())
        probe = functools.partial(_pv_probe_counts, run)
        p = _probe_p(dtype, shape, False, layout)
    first = list(range(1, min(m - 1, 9)))
    counts = probe(shape, first, m)
    predicted = {t: _pv_predicted(m, first, p, t, m) for t in _TILES_K}
    tiles = []
    for query in range(n):
        found = [t for t in _TILES_K if np.array_equal(predicted[t], counts[:, query])]
        if not found:
            raise ValueError(
                f"xla: the P V probes of {shape} ({dtype}) at query {query} fit no modelled "
                f"dot order (tile_k in {_TILES_K}): counts {counts[:, query].tolist()}"
            )
        tiles.append(found[0])
    # Per query: lo·tile_k is in key 0's block, hi·tile_k is not (or hi past the end).
    bounds = {query: (1, -(-(m - 1) // t)) for query, t in enumerate(tiles)}
    closed = {query: False for query in range(n)}
    while True:
        open_rows = [r for r in range(n) if bounds[r][1] - bounds[r][0] > 1]
        groups = sorted({(tiles[r], *bounds[r]) for r in open_rows})
        if not groups:
            break
        per_group = max(1, (d // 2) // len(groups))
        tests: list[int] = []
        plan = []  # (group, point, index of its first test)
        for t, lo, hi in groups:
            span = np.linspace(lo + 1, hi - 1, num=min(per_group, hi - lo - 1))
            for j in sorted({int(x) for x in span}):
                plan.append(((t, lo, hi), j, len(tests)))
                tests += [min((j - 1) * t, m - 1), min(j * t, m - 1)]
        got = probe(shape, tests, m)
        want = {t: _pv_predicted(m, tests, p, t, m) for t, _, _ in groups}
        for query in range(n):
            t, lo, hi = tiles[query], *bounds[query]
            if hi - lo <= 1:
                continue
            mine = (t, lo, hi)  # the query's group; lo rises as its points match
            for group, j, at in plan:
                if group != mine or not lo < j < hi:
                    continue
                same = got[at : at + 2, query] == want[t][at : at + 2]
                if same.all():
                    lo = j
                else:
                    hi, closed[query] = j, True
                    break
            bounds[query] = (lo, hi)
    blocks = [bounds[r][1] * tiles[r] if closed[r] else m for r in range(n)]
    runs: list[tuple[int, int, int, int]] = []
    for query, (t, block) in enumerate(zip(tiles, blocks)):
        if runs and runs[-1][2:] == (t, block):
            runs[-1] = (runs[-1][0], query + 1, t, block)
        else:
            runs.append((query, query + 1, t, block))
    return tuple(runs)


_QK_UNIT = 2.0**-10  # q's unit terms; a probe key's row is 2^8, so each product is 1/4
_QK_KEY = 2.0**8


def _qk_probe_counts(
    run,
    shape: tuple[int, ...],
    pairs: list[tuple[int, int]],
    keys: list[int],
    m: int | None = None,
    *,
    last: bool = False,
) -> np.ndarray:
    """For each (a, b) and each key of ``keys``, the count a Q Kᵀ probe reads: a
    query row holds M at term a, -M at term b and a unit elsewhere, each probe
    key's row is 2^8 everywhere, so S[i, key] is a quarter of the number of unit
    products not absorbed by ±M; the other keys are zero.  V sends each probe key
    to an output column of its own and one zero key (``_zero_key``) to another, so
    the ratio of the two is exp(S[i, key] · scale).  ``m`` keys (N by default).
    The probes fill the query rows from the first, or with ``last`` from the
    last one back.  Returns (len(pairs), len(keys))."""
    bh, n, d = shape
    m = n if m is None else m
    zero = _zero_key(m, keys)
    slots = [(b, i) for b in range(bh) for i in range(n)]
    if last:
        slots.reverse()
    scale = float(np.float32(1.0 / math.sqrt(d)))
    counts = np.zeros((len(pairs), len(keys)), int)
    for start in range(0, len(pairs), len(slots)):
        chunk = pairs[start : start + len(slots)]
        q = np.zeros(shape, np.float32)
        k = np.zeros((bh, m, d), np.float32)
        v = np.zeros((bh, m, d), np.float32)
        k[:, keys, :] = _QK_KEY
        v[:, zero, 0] = 1.0
        for col, key in enumerate(keys):
            v[:, key, col + 1] = 1.0
        for (b, i), (a, c) in zip(slots, chunk):
            q[b, i, :] = _QK_UNIT
            q[b, i, a] = _PROBE_BIG
            q[b, i, c] = -_PROBE_BIG
        out = np.asarray(run(q, k, v), dtype=np.float64)
        for row, ((b, i), _) in enumerate(zip(slots, chunk)):
            ratio = np.log(out[b, i, 1 : len(keys) + 1] / out[b, i, 0]) / scale
            counts[start + row] = np.round(ratio * 4)
    return counts


def _zero_key(n: int, keys: list[int]) -> int:
    """A key outside ``keys`` (its S is zero in a Q Kᵀ probe), as early as possible."""
    return min(set(range(n)) - set(keys))


def _permuted(d: int, pairs: bool) -> list[int]:
    """The order of the Q Kᵀ terms: 1, 0, 3, 2, ... (an odd last term last) with
    ``pairs``, else 0, 1, 2, ..."""
    if not pairs:
        return list(range(d))
    return [j for p in range(0, d - 1, 2) for j in (p + 1, p)] + ([d - 1] if d % 2 else [])


_QK_TAIL = 64  # the last keys probed one by one: a dot kernel's column remainder


def _qk_split(rows: int, m: int, d: int) -> int:
    """The keys of each task YNNPACK cuts a dot of ``rows`` rows, ``m`` columns
    (keys) and ``d`` terms into (``choose_split_factors``, ynnpack/subgraph/dot.cc:
    a tile grown from 16 rows by one column block, doubled, until its cost (rows +
    columns) · min(d, 1024) reaches 64 Ki or its area 64 Ki; the block's width, a
    power of two, does not change the result).  Each task runs the dot kernel on its
    own columns, so the last task, narrower where m is no multiple of the width,
    gets an order of its own (:func:`_qk_order`)."""
    k = min(d, 1024)
    least = max(min(rows, 64) * min(m, 64), 256)
    cols, tile_rows = min(m, 16), min(rows, 16)
    while True:
        if cols * tile_rows >= least and (
            (tile_rows + cols) * k >= 1024 * 64 or tile_rows * cols >= 256 * 256
        ):
            break
        if (4 * cols <= tile_rows or tile_rows >= rows) and cols < m:
            cols *= 2
        elif (tile_rows <= 4 * cols or cols >= m) and tile_rows < rows:
            tile_rows *= 2
        else:
            break
    return min(cols, 65536)


_QK_ROUNDING = (2.0**20, -(2.0**20) * (1 + 2.0**-12), 2.0**5)  # q's first three terms
_QK_ROUNDING_KEY = (1.0, 1 + 2.0**-12, 2.0**4)  # a probe key's


def _qk_rounded(run, shape: tuple[int, ...], keys: list[int], m: int) -> np.ndarray:
    """For each key of ``keys``, whether its Q Kᵀ products are rounded before they
    are added (in order) rather than fused into the sum: the three products 2^20,
    -2^20 (1 + 2^-11 + 2^-24) and 2^9 sum to -2^-4 with FMAs; rounded, the second
    is a tie that goes to -2^20 (1 + 2^-11), and the sum is 0 (Higham 2002, §2.6).
    The other keys and terms are zero; V reads S as :func:`_qk_probe_counts` does."""
    bh, _, d = shape
    zero = _zero_key(m, keys)
    q = np.zeros(shape, np.float32)
    k = np.zeros((bh, m, d), np.float32)
    v = np.zeros((bh, m, d), np.float32)
    q[..., :3] = _QK_ROUNDING
    k[:, keys, :3] = _QK_ROUNDING_KEY
    v[:, zero, 0] = 1.0
    for col, key in enumerate(keys):
        v[:, key, col + 1] = 1.0
    out = np.asarray(run(q, k, v), dtype=np.float64)
    scale = float(np.float32(1.0 / math.sqrt(d)))
    s = np.log(out[..., 1 : len(keys) + 1] / out[..., :1]) / scale
    return np.asarray((np.abs(s) < 2.0**-5).all(axis=(0, 1)))


def _qk_candidates(dtype: str, d: int, pairs, counts: np.ndarray) -> list[tuple[bool, int, int]]:
    """The (pairs, tile_k, block) orders whose simulated probes give ``counts``: one
    block of d terms first; where none fits, the reduction cut into blocks of the
    smallest size that fits.  Keys that read alike share the search."""
    read = tuple(int(c) for c in counts)
    return list(_qk_candidates_of(dtype, d, tuple(map(tuple, pairs)), read))


@functools.cache
def _qk_candidates_of(
    dtype: str, d: int, pairs: tuple, counts: tuple[int, ...]
) -> tuple[tuple[bool, int, int], ...]:
    terms = np.full((len(pairs), d), 0.25, np.float32)
    big = np.float32(_PROBE_BIG * _QK_KEY)
    for row, (a, b) in enumerate(pairs):
        terms[row, a], terms[row, b] = big, -big

    def fits(swap: bool, t: int, block: int) -> bool:
        return np.array_equal(4 * _simulated_qk(terms, (swap, t, block)), np.asarray(counts))

    swaps = (dtype == "bfloat16", dtype != "bfloat16")
    whole = [(swap, t, d) for swap in swaps for t in _TILES_K if fits(swap, t, d)]
    if whole:
        return tuple(whole)
    for block in range(1, d):
        found = [
            (swap, t, block)
            for swap in swaps
            for t in _TILES_K
            if t <= block and fits(swap, t, block)
        ]
        if found:
            return tuple(found)
    return ()


def _simulated_qk(terms: np.ndarray, order: tuple[bool, int, int]) -> np.ndarray:
    """The sums of the rows of ``terms`` (exact products, float32) in the Q Kᵀ
    order (pairs, tile_k, block) as :func:`_qk` adds them: the terms permuted, the
    last d mod tile_k added last, the rest cut into blocks of ``block`` terms, each
    a dot of its own (:func:`_simulated_dot`, its own remainder where tile_k does
    not divide the block), the block sums added in order."""
    swap, tile_k, block = order
    n = terms.shape[1]
    terms = terms[:, _permuted(n, swap)]
    rest = n % tile_k if n > tile_k else 0
    main = terms[:, : n - rest]
    parts = [
        _simulated_dot(main[:, lo : lo + block], tile_k, block) for lo in range(0, n - rest, block)
    ]
    if rest:
        parts.append(_simulated_dot(terms[:, n - rest :], 1, rest))
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


@functools.cache
def _qk_order(
    dtype: str, shape: tuple[int, ...], layout: _Layout | None = None
) -> tuple[tuple[bool, int, int], ...]:
    """The order of each key's Q Kᵀ dots for (B·H, N, d) inputs, one (pairs, tile_k,
    block) per key, read from the real program with order-revealing probes
    (:func:`_qk_probe_counts`): for key 0 and each of the last keys, the
    candidate (terms in pairs, odd first, as AVX-512 BF16's dot instruction adds
    them, or in order; tile_k chains folded pairwise) whose simulated probes match
    the real counts of every pair among the first 16 terms and the last ones.
    YNNPACK runs the last columns of a dot (the keys past its last full tile)
    with a kernel of a narrower tile, whose tile_k can differ; the probes find
    them without knowing the tile.  Where a dot has few rows (decoding shapes)
    YNNPACK also cuts the reduction over d into blocks, each summed from zero and
    the block sums added in order, by a size its schedule picks (at 16 queries and
    d = 128: 64 terms at key 0, 66 at the last keys); pairs of term 0 with every
    other find them.  With ``layout``, the grouped view's M keys, in its plain
    call."""
    _, n, d = shape
    m = n if layout is None else layout.m
    if d < 2 or m < 3 or n < 2:
        return ((dtype == "bfloat16", 1, d),) * m
    # The same dot as the causal (or masked) program's.
    run = _attention(dtype, False, None) if layout is None else _grouped_run(dtype, layout.plain())
    head = range(min(d, 16))
    tail = range(max(0, d - 5), d)
    pairs = sorted({(a, b) for a in (*head, *tail) for b in (*head, *tail) if a < b})
    # Term 0 against every other: where the reduction is cut into blocks.
    pairs = sorted({*pairs, *((0, b) for b in range(1, d))})
    # Key 0, the first of the last task (:func:`_qk_split`), and the last keys.
    last = (m - 1) // _qk_split(n, m, d) * _qk_split(n, m, d)
    probed = sorted({0, last, *range(max(2, m - _QK_TAIL), m)} - {1})  # 1: the zero key
    width = max(1, min(d - 1, m // 2))
    orders: dict[int, tuple[bool, int, int]] = {}
    read: dict[int, np.ndarray] = {}
    for start in range(0, len(probed), width):
        keys = probed[start : start + width]
        counts = _qk_probe_counts(run, shape, pairs, keys, m)
        for col, key in enumerate(keys):
            read[key] = counts[:, col]
            found = _qk_candidates(dtype, d, pairs, counts[:, col])
            if not found:
                raise ValueError(
                    f"xla: the Q Kᵀ probes of {shape} ({dtype}) at key {key} fit no "
                    f"modelled dot order: counts {counts[:, col].tolist()} for pairs {pairs}"
                )
            orders[key] = found[0]
    _check_last_rows(run, shape, dtype, pairs, read, m)
    # One float32 chain over all d terms may be YNNPACK's reference kernel, whose
    # products are rounded (a task narrower than a column block): told apart here.
    whole = [key for key in probed if orders[key] == (False, 1, d)]
    if dtype == "float32" and d >= 3:
        for start in range(0, len(whole), width):
            keys = whole[start : start + width]
            for key, rounded in zip(keys, _qk_rounded(run, shape, keys, m)):
                if rounded:
                    orders[key] = (False, 0, d)
    first = max(2, m - _QK_TAIL)  # the last keys, probed one by one
    if dtype == "float16":
        orders.update(_qk_interior(run, shape, pairs, m, first, orders[0]))
    known = sorted(orders)  # each key takes the order of the nearest key probed below it
    return tuple(orders[known[bisect.bisect_right(known, j) - 1]] for j in range(m))


def _check_last_rows(
    run, shape: tuple[int, ...], dtype: str, pairs: list, read: dict[int, np.ndarray], m: int
) -> None:
    """A ValueError where the dot's last query rows, which the probes of
    :func:`_qk_order` (filling the rows from the first) did not reach, read
    another order than the first rows at key 0 and the last key probed: YNNPACK
    can run a remainder of rows with another kernel (on a Xeon with AMX, the last
    2 of 175 rows, d = 35, with AVX-512 BF16's pairs), and the model gives every
    row of a key one order."""
    bh, n, _ = shape
    if bh * n <= len(pairs):
        return
    ends = sorted({0, max(read)})
    tail = _qk_probe_counts(run, shape, pairs, ends, m, last=True)
    for col, key in enumerate(ends):
        if not np.array_equal(tail[:, col], read[key]):
            raise ValueError(
                f"xla: the last query rows of {shape} ({dtype}) add Q Kᵀ in another order "
                f"than the first at key {key} (YNNPACK runs a remainder of rows with "
                "another kernel), which the model does not follow"
            )


_QK_STRIDE = 64  # the keys sampled between key 0 and the last ones (fp16)


def _qk_interior(
    run, shape: tuple[int, ...], pairs: list, m: int, first: int, order0: tuple[bool, int, int]
) -> dict[int, tuple[bool, int, int]]:
    """The orders of fp16's Q Kᵀ keys between key 0 and ``first`` (the last keys,
    probed one by one), where they differ from key 0's ``order0``: YNNPACK splits a
    dot of few rows over its columns too, and cuts the reduction of each part by a
    size of its own (at 24 rows, d = 64 and 3000 keys: blocks of 32 terms for
    keys 0 to 2047, 34 from 2048).  Every 64th key is read with the pairs of term
    0 and every other (which pin the cut and tile_k); between two that read
    differently every key is, and so are those after the last 64th key; one key
    of each reading that differs from key 0's is then probed with all of
    ``pairs`` (:func:`_qk_order`).  Keys map to their order where it changes (the
    keys above take it)."""
    _, _, d = shape
    cut = [(0, b) for b in range(1, d)]
    width = max(1, min(d - 1, m // 2))

    def read(keys: list[int]) -> dict[int, tuple[int, ...]]:
        got = {}
        for start in range(0, len(keys), width):
            group = keys[start : start + width]
            counts = _qk_probe_counts(run, shape, cut, group, m)
            got.update({key: tuple(counts[:, col]) for col, key in enumerate(group)})
        return got

    samples = list(range(_QK_STRIDE, first, _QK_STRIDE))
    if not samples:
        return {}
    seen = read([0, *samples])
    bounds = [0, *samples]
    for lo, hi in itertools.pairwise(bounds):
        if seen[lo] != seen[hi]:
            seen.update(read([j for j in range(lo + 1, hi) if j != 1]))
    # The keys up to the last ones, whose orders are not read so.
    seen.update(read(list(range(samples[-1] + 1, first))))
    classes = {seen[0]: order0}
    reps = sorted({sig: key for key, sig in sorted(seen.items(), reverse=True)}.items())
    reps = [(sig, key) for sig, key in reps if sig not in classes]
    for start in range(0, len(reps), width):
        group = reps[start : start + width]
        counts = _qk_probe_counts(run, shape, pairs, [key for _, key in group], m)
        for col, (sig, key) in enumerate(group):
            found = _qk_candidates("float16", d, pairs, counts[:, col])
            if not found:
                raise ValueError(
                    f"xla: the Q Kᵀ probes of {shape} (float16) at key {key} fit no "
                    f"modelled dot order: counts {counts[:, col].tolist()} for pairs {pairs}"
                )
            classes[sig] = found[0]
    keys = sorted(seen)
    return {
        key: classes[seen[key]]
        for prev, key in zip([None, *keys], keys)
        if prev is None or classes[seen[key]] != classes[seen[prev]]
    }


def _p_rounded(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: _Layout | None = None
) -> bool:
    """Whether XLA keeps P's rounding to ``dtype`` for (B·H, N, d) inputs (or
    ``layout``'s call): False when the conversion sits in a YNNPACK fusion (module
    docstring)."""
    return dtype != "bfloat16" or not _in_ynn_fusions(dtype, shape, causal, layout)[0]


def _exp_model(
    policy: Policy, shape: tuple[int, ...], causal: bool, layout: _Layout | None = None
) -> ExpModel:
    """The policy's exp, except that XLA's two exps stand for whichever of them the
    program runs for (B·H, N, d) inputs: YNNPACK's inside a YNNPACK fusion, XLA's own
    elsewhere (module docstring). Any other exp model (a calibration knob) is kept."""
    if policy.exp_model not in (XLA_CPU_EXP, YNNPACK):
        return policy.exp_model
    fused = _in_ynn_fusions(policy.inputs.name, shape, causal, layout)[1]
    if fused:
        return YNNPACK
    return XLA_CPU_EXP


@functools.cache
def _fma_step(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: _Layout | None = None
) -> str | tuple[int, ...] | None:
    """:func:`_contracted` for the program of (B·H, N, d) inputs (or ``layout``'s
    call), a select resolved to the keys where it is folded (:func:`_fused_keys`;
    a causal mask's alone: the others' conditions are data); None for fp16, whose
    steps run eagerly, each a program of its own."""
    if dtype == "float16":
        return None
    step = _contracted(_program_text(dtype, shape, causal, layout))
    if step != "select":
        return step
    causal_only = layout is None or layout == layout.plain()
    # bf16's outputs are too coarse to read the shift; its softmax runs the same
    # float32 loop fusion as fp32's, which the probe reads instead.
    keys = _fused_keys(shape, layout) if causal and causal_only else ()
    m = shape[-2] if layout is None else layout.m
    # The probe reads every key but the last (its maximum): all of them fused is all.
    return "subtract" if len(keys) == m - 1 > 0 else keys or None


_FUSED_SCORE = 2.0**10  # about the largest scaled score of :func:`_fused_keys`' probe


def _fused_probe_scores(scale: float) -> tuple[float, float, float, float]:
    """(S, S', d_rounded, d_fused) of :func:`_fused_keys`' probe: S' = 2^k with S'·scale
    (exact) near 2^10, and S = S' - t·ulp (t > 0, a float32) whose S·scale has the
    largest rounding error r; the shift fl(S·scale) - S'·scale (rounded) and
    S·scale - S'·scale (fused, to within r's own rounding)."""
    top = 2.0 ** round(math.log2(_FUSED_SCORE / scale))
    exact = top * scale
    below = top * 2.0**-24  # float32's spacing just below top
    best = (0.0, 0.0, 0.0)
    for t in range(1, 64):
        x = top - t * below
        rounded = float(np.float32(x * scale)) - exact
        if abs(x * scale - exact - rounded) > abs(best[2]):
            best = (x, rounded, x * scale - exact - rounded)
    x, rounded, error = best
    return x, top, rounded, rounded + error


def _fused_keys(shape: tuple[int, ...], layout: _Layout | None) -> tuple[int, ...]:
    """The keys whose S·scale - m fp32's real causal program computes with one rounding
    (an FMA), read from the last query row: LLVM folds the causal select where it
    proves a key kept (key 0 of a loop it unrolls: i >= 0), then fuses.

    The probe (:func:`_fused_probe_scores`): the last key's score S'·scale is the
    row's maximum m, exact; every other key's S·scale is not, so its shift
    fl(S·scale) - m and the fused S·scale - m differ by the product's rounding
    error.  V sends each key to a column of its own (the last key to column d - 1),
    so P_j / P_last = exp(shift_j) tells which shift key j took."""
    bh, n, d = shape
    m = n if layout is None else layout.m
    scale = float(np.float32(1.0 / math.sqrt(d)))
    x, top, rounded, fused = _fused_probe_scores(scale)
    run = (
        _jit_attention("float32", True, None)
        if layout is None
        else _grouped_run("float32", layout, True)
    )
    found = []
    width = d - 1
    for lo in range(0, m - 1, width):
        keys = np.arange(lo, min(lo + width, m - 1))
        q = np.zeros(shape, np.float32)
        q[..., 0], q[..., 1] = x, top
        k = np.zeros((bh, m, d), np.float32)
        k[:, :, 0] = 1.0
        k[:, m - 1] = 0.0
        k[:, m - 1, 1] = 1.0
        v = np.zeros((bh, m, d), np.float32)
        v[:, keys, keys - lo] = 1.0
        v[:, m - 1, d - 1] = 1.0
        out = np.asarray(run(q, k, v), dtype=np.float64)[0, -1]
        shift = np.log(out[: len(keys)] / out[d - 1])
        found += [int(j) for j, s in zip(keys, shift) if abs(s - fused) < abs(s - rounded)]
    return tuple(found)


def _qk_runs(dtype: str, shape: tuple[int, ...], layout: _Layout | None = None):
    """:func:`_qk_order` as runs (:func:`_runs`)."""
    return _runs(_qk_order(dtype, shape, layout))


def _runs(orders) -> tuple[tuple[int, int, bool, int, int], ...]:
    """Per-key orders as runs (first key, key past the last, pairs, tile_k, block)."""
    runs: list[tuple[int, int, bool, int, int]] = []
    for j, order in enumerate(orders):
        if runs and runs[-1][2:] == tuple(order):
            runs[-1] = (runs[-1][0], j + 1, *order)
        else:
            runs.append((j, j + 1, *order))
    return tuple(runs)


def _forward(
    q, k, v, *, policy: Policy, causal: bool, scale, code: VectorCode = AVX512, **features
):
    if policy.inputs.name == "float32" and np.shape(v)[-1] == 1:
        raise ValueError(
            "xla: fp32 with d = 1: XLA rewrites P V as element-wise products summed in "
            "reduce-windows, not a dot; not modelled"
        )
    if _featured(q, k, features):
        return _featured_forward(
            q, k, v, policy=policy, causal=causal, scale=scale, code=code, **features
        )
    q, k, v = (ops.carrier(t, np.float64) for t in (q, k, v))
    n, d = q.shape[-2:]
    shape = (int(np.prod(q.shape[:-2], dtype=int)), n, d)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    round_p = _p_rounded(policy.inputs.name, shape, bool(causal))
    window = _sum_window(policy.inputs.name, shape, bool(causal))
    qk = _qk_runs(policy.inputs.name, shape)
    pv = _pv_order(policy.inputs.name, shape)
    policy = policy.replace(exp_model=_exp_model(policy, shape, bool(causal)))
    return _model_core(
        q,
        k,
        v,
        scale,
        causal=bool(causal),
        policy=policy,
        round_p=round_p,
        qk=qk,
        pv=pv,
        window=window,
        fma_step=_fma_step(policy.inputs.name, shape, bool(causal)),
    )


def _featured_forward(
    q, k, v, *, policy: Policy, causal: bool, scale, code: VectorCode = AVX512, **features
):
    """The model of :func:`real`'s 4-D call (:class:`_Layout`): on the grouped view
    (B·H_kv, G·N, d) of the queries against (B·H_kv, M, d) keys, as XLA's dots run;
    the bias (exact in the input format, so in FP32) added to the scaled scores in
    FP32, then every pair that the mask, causal, window or key lengths drop set to
    jax's large negative (not -inf: a row that keeps no key averages V)."""
    layout = _layout(np.shape(q), np.shape(k), features)
    b, kv, g, n, m = layout.batch, layout.kv_heads, layout.groups, layout.n, layout.m
    d = np.shape(q)[-1]
    shape = (b * kv, g * n, d)
    q3 = ops.carrier(q, np.float64).reshape(shape)
    k3, v3 = (ops.carrier(t, np.float64).reshape(b * kv, m, -1) for t in (k, v))
    full = (b, kv * g, n, m)
    lengths = None
    if features.get("kv_lengths") is not None:
        lengths = _lengths(features["kv_lengths"], np.shape(q)[:-2], b)[:, None]
    keep = masking.keep(
        n,
        m,
        (b, kv * g),
        causal=bool(causal),
        kv_lengths=lengths,
        window=features.get("window"),
        mask=features.get("mask"),
    )
    keep = jnp.broadcast_to(keep, full).reshape(b * kv, g * n, m)
    bias = features.get("bias")
    if bias is not None:
        bias = jnp.broadcast_to(ops.carrier(bias, np.float64), full).reshape(b * kv, g * n, m)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dtype = policy.inputs.name
    round_p = _p_rounded(dtype, shape, bool(causal), layout)
    window = _sum_window(dtype, shape, bool(causal), layout)
    own = _own_dots_of(dtype, shape, layout.plain(), code)
    if own is None:
        raise ValueError(
            f"xla: {dtype} {g * n} grouped query rows, d = {d}, over {m} keys in {b * kv} "
            "groups: XLA runs its own dot here, and neither the probed orders, XLA's "
            "GEMV nor Eigen's shards over the keys reproduce it on random inputs; "
            "not modelled"
        )
    qk = () if own.qk else _qk_runs(dtype, shape, layout)
    pv = () if own.pv else _pv_order(dtype, shape, layout)
    policy = policy.replace(exp_model=_exp_model(policy, shape, bool(causal), layout))
    out = _model_core(
        q3,
        k3,
        v3,
        scale,
        causal=False,
        policy=policy,
        round_p=round_p,
        qk=qk,
        pv=pv,
        window=window,
        fma_step=_fma_step(dtype, shape, bool(causal), layout),
        own=own,
        bias=bias,
        keep=keep,
    )
    return out.reshape(np.shape(q)[:-1] + np.shape(v)[-1:])


_PROBED = own_dots.OwnDots()  # both dots in the probed orders (YNNPACK's, or XLA's fitting them)


def _own_dots_of(
    dtype: str, shape: tuple[int, ...], layout: _Layout, code: VectorCode = AVX512
) -> own_dots.OwnDots | None:
    """:func:`_own_dots` for ``dtype``: none for fp16 (eager, op by op: the probed
    orders); for bf16 fp32's where bf16's program runs the same dots as XLA's own
    (on float32 operands, so the same kernels): a bf16 output is too coarse for the
    check to tell Eigen's shards apart (unsharded fitted its random inputs at
    (2,4,3,64)/3078, where the real P V runs shards of 1544 keys)."""
    if dtype == "float16":
        return _PROBED
    if dtype != "float32" and _dots_of(dtype, shape, layout) == _dots_of("float32", shape, layout):
        return _own_dots("float32", shape, layout, code)
    return _own_dots(dtype, shape, layout, code)


def _dots_of(dtype: str, shape: tuple[int, ...], layout: _Layout) -> tuple[str | None, str | None]:
    """:func:`~fa_jax.kernels.xla.own_dots.own_dots` of the plain program's HLO."""
    bodies = _computations(_program_text(dtype, shape, False, layout))
    return own_dots.own_dots(bodies.get("ENTRY", ""), bodies)


@functools.cache
def _own_dots(
    dtype: str, shape: tuple[int, ...], layout: _Layout, code: VectorCode = AVX512
) -> own_dots.OwnDots | None:
    """How the model reproduces the plain program of ``layout`` in ``dtype`` (jitted:
    bf16 or fp32) on random inputs where it runs a dot as XLA's own
    (:mod:`~fa_jax.kernels.xla.own_dots`): with one row per group a dot is XLA's
    GEMV of the major the HLO's layouts give, of each width ``code``'s registers
    give it (:attr:`VectorCode.gemv_lanes`), else the probed order; otherwise P V
    is Eigen's contraction, which can shard the keys over threads
    (:func:`_sharded_pv`, which the probes, reading the first key's blocks,
    cannot see): unsharded, then each size Eigen can pick, cut by each
    ``kc`` that gives the probed block, then unsharded with the last keys joined
    to the block before (measured, rule unknown: docs/kernels.md), then with the
    last N mod tile_k keys FMA'd onto their block (Eigen's rows left over from its
    vector panels: :attr:`~fa_jax.kernels.xla.own_dots.OwnDots.pv_rest_fma`).  :data:`_PROBED`
    without a check where YNNPACK runs both dots, or P V's keys are too few to
    shard and neither dot is a GEMV (every such shape measured fits); None where
    nothing fits."""
    qk_major, pv_major = _dots_of(dtype, shape, layout)
    one_row = shape[1] == 1
    qk: list = [None]
    if qk_major and one_row:
        qk = [*(own_dots.Gemv(qk_major, lanes) for lanes in code.gemv_lanes), None]
    if pv_major and one_row:
        gemvs = (own_dots.Gemv(pv_major, lanes) for lanes in code.gemv_lanes)
        pv = [*(own_dots.OwnDots(pv=gemv) for gemv in gemvs), _PROBED]
    else:
        shards = own_dots.eigen_shards(layout.m) if pv_major else []
        block = _pv_order(dtype, shape, layout)[0][-1] if shards else layout.m
        pv = [_PROBED] + [
            own_dots.OwnDots(pv_shard=shard, pv_kc=kc)
            for shard in shards
            for kc in (
                own_dots.eigen_kcs_giving(shard, block, layout.m % shard or shard)
                if block < shard
                else [None]
            )
        ]
        if shards and layout.m % block:
            pv.append(own_dots.OwnDots(pv_joined=True))
        if shards:  # each of the above again with Eigen's left-over rows
            pv += [dataclasses.replace(own, pv_rest_fma=True) for own in pv if not own.pv_joined]
    if qk == [None] and len(pv) == 1:
        return pv[0]
    rng = np.random.default_rng(0)
    bh, _, d = shape
    fmt = get_format(dtype)
    q, k, v = (
        np.asarray(round_to(rng.standard_normal(s), fmt), np.float32)
        for s in (shape, (bh, layout.m, d), (bh, layout.m, d))
    )
    real = np.asarray(_grouped_run(dtype, layout)(q, k, v), np.float64)
    policy = model(fmt, 1, d, isa=code.name).policy
    policy = policy.replace(exp_model=_exp_model(policy, shape, False, layout))
    for gemv, candidate in itertools.product(qk, pv):
        own = dataclasses.replace(candidate, qk=gemv)
        emulated = _model_core(
            *(ops.carrier(t, np.float64) for t in (q, k, v)),
            1.0 / math.sqrt(d),
            causal=False,
            policy=policy,
            round_p=_p_rounded(dtype, shape, False, layout),
            qk=() if own.qk else _qk_runs(dtype, shape, layout),
            pv=() if own.pv else _pv_order(dtype, shape, layout),
            window=_sum_window(dtype, shape, False, layout),
            fma_step=_fma_step(dtype, shape, False, layout),
            own=own,
        )
        if np.array_equal(np.asarray(emulated), real):
            return own
    return None


@functools.partial(
    jax.jit,
    static_argnames=("causal", "policy", "round_p", "qk", "pv", "window", "fma_step", "own"),
)
def _model_core(
    q,
    k,
    v,
    scale,
    *,
    causal: bool,
    policy: Policy,
    round_p: bool,
    qk: tuple[tuple[int, int, bool, int, int], ...],
    pv: tuple[tuple[int, int, int, int], ...],
    window: tuple[_Levels, bool] | None = None,
    fma_step: str | tuple[int, ...] | None = None,
    own: own_dots.OwnDots = _PROBED,
    bias=None,
    keep=None,
):
    """The model's steps; every rounding names the stage of ``policy`` it belongs to,
    so calibration's knobs reach it (the summation orders are XLA's, fixed).
    ``bias`` is added to the scaled scores in the scores' stage, and ``keep`` (the
    pairs kept) sets the others to jax's large negative, as ``causal`` does.
    ``fma_step`` (:func:`_contracted`): the step the scale's product is fused into,
    S·scale + bias or S·scale - m, one rounding; ``own``: the dots XLA runs as its
    own (:class:`~fa_jax.kernels.xla.own_dots.OwnDots`): Q Kᵀ or P V as its GEMV,
    in place of ``qk``'s or ``pv``'s probed runs, or P V as Eigen's shards
    (:func:`_sharded_pv`)."""
    fmt = policy.inputs
    q, k, v = (ops.cast(t, fmt) for t in (q, k, v))
    n, m = q.shape[-2], k.shape[-2]
    if own.qk:
        s = own_dots.gemv(q, k, policy.qk_acc, own.qk)
    else:
        s = jnp.concatenate(
            [
                _qk(q, k[..., lo:hi, :], pairs=pairs, acc=policy.qk_acc, tile_k=tile_k, block=block)
                for lo, hi, pairs, tile_k, block in qk
            ],
            axis=-1,
        )
    unscaled, scale = s, round_to(scale, policy.scores)
    if bias is not None and fma_step == "add":
        s = ops.fma(unscaled, scale, bias, policy.scores)
    else:
        s = ops.mul(unscaled, scale, policy.scores)
        if bias is not None:
            s = ops.add(s, bias, policy.scores)
    kept = jnp.tril(jnp.ones((n, m), bool)) if causal else None
    if keep is not None:
        kept = keep if kept is None else kept & keep
    if kept is not None:
        s = jnp.where(kept, s, _LARGE_NEGATIVE)
    m_i = jnp.max(s, axis=-1, keepdims=True)
    shifted = ops.sub(s, m_i, policy.exp)
    if fma_step is not None and fma_step != "add":
        fused = ops.fma(unscaled, scale, -m_i, policy.exp)
        if fma_step != "subtract":  # the keys where the select is folded
            folded = jnp.zeros(m, bool).at[np.asarray(fma_step)].set(True)
            kept = folded if kept is None else kept & folded
        shifted = fused if kept is None else jnp.where(kept, fused, shifted)
    e = policy.exp_model.fn(shifted, policy.exp)
    if window is None:
        total = _softmax_sum(e, policy.stats)
    else:
        levels, ynn_total = window
        total = _windowed_sum(e, levels, policy.stats, ynn_total)
    if policy.normalise == "reciprocal":
        p = ops.mul(e, ops.div(1.0, total, policy.stats)[..., None], policy.stats)
    else:
        p = ops.div(e, total[..., None], policy.stats)
    if round_p:
        p = ops.cast(p, policy.p)
    if own.pv:
        o = own_dots.gemv(p, jnp.swapaxes(v, -1, -2), policy.pv_acc, own.pv)
    else:
        o = jnp.concatenate(
            [
                _pv(
                    p[..., lo:hi, :],
                    v,
                    policy.pv_acc,
                    block,
                    tile_k,
                    own.pv_joined,
                    own.pv_rest_fma,
                )
                if own.pv_shard is None
                else _sharded_pv(
                    p[..., lo:hi, :],
                    v,
                    policy.pv_acc,
                    block,
                    tile_k,
                    own.pv_shard,
                    own.pv_kc,
                    own.pv_rest_fma,
                )
                for lo, hi, tile_k, block in pv
            ],
            axis=-2,
        )
    return ops.cast(o, policy.out)


# --xla_cpu_max_isa's values (xla/backends/cpu/codegen/cpu_features.cc), narrowest
# first: a cap below AVX512 keeps XLA from the code modelled, below AVX512_BF16
# from bf16's pair instruction.
_MAX_ISAS = ("SSE4_2", "AVX", "AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX", "AMX_FP16")


def _max_isa() -> str | None:
    """The ``--xla_cpu_max_isa`` in ``XLA_FLAGS`` (upper case), or None."""
    import os

    found = re.findall(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return found[-1].upper() if found else None


def unmodelled(fmt=None, **options) -> str | None:
    """None where XLA's CPU backend here runs the code the model follows for ``fmt``
    (every format where None), else why not.  XLA targets the features CPUID reports,
    capped by ``--xla_cpu_max_isa`` (xla/backends/cpu/codegen/cpu_features.cc,
    ``ShouldEnableX86CpuFeature``); YNNPACK picks its kernels by the CPU's own
    features, which no flag caps (ynnpack/base/arch.cc, ``get_supported_arch_flags``:
    cpuinfo; XLA creates its runtimes with no flags).  The model follows their
    AVX-512 code (bf16 with AVX512-BF16's pairs or AMX's tile dots), as measured on
    an AMD EPYC and an Intel Xeon with AMX, and their AVX2 code (AVX2, FMA and
    F16C), as measured on an AVX2-only AMD EPYC; only on the CPU backend.  An
    AVX-512 CPU capped below AVX512 runs neither (XLA's own code for AVX2 beside
    YNNPACK's AVX-512 kernels), nor does a cap below AVX2 (no FMA in XLA's code)."""
    del options
    backend = jax.default_backend()
    if backend != "cpu":
        return f"xla: the model is of XLA's CPU backend; jax's default backend is {backend!r}"
    have = cpu.flags()
    cap = _max_isa()
    rank = _MAX_ISAS.index(cap) if cap in _MAX_ISAS else len(_MAX_ISAS)
    modelled = (
        "modelled: AVX-512 (F, BW, DQ, VL; bf16 with AVX512-BF16 or AMX-BF16) and "
        "AVX2 (with FMA and F16C, no AVX-512; every format), uncapped by "
        "--xla_cpu_max_isa below the CPU's class"
    )
    here = cpu.describe() + (f", --xla_cpu_max_isa={cap}" if cap else "")
    if cpu.isa() == "AVX2":
        if rank < _MAX_ISAS.index("AVX2"):
            return (
                f"xla: XLA's own code on this CPU ({here}) is capped below AVX2 (no FMA), "
                f"which is not modelled; {modelled}"
            )
        return None
    if cpu.isa() != "AVX512":
        return (
            f"xla: XLA and YNNPACK on this CPU ({here}) run code below AVX2 "
            f"(SSE kernels, no FMA), which is not modelled; {modelled}"
        )
    if rank < _MAX_ISAS.index("AVX512"):
        return (
            f"xla: on this CPU ({here}) XLA's own code is capped below AVX-512 while "
            f"YNNPACK still runs its AVX-512 kernels (no flag caps them), a mix that "
            f"is not modelled; {modelled}"
        )
    bf16 = fmt is None or get_format(fmt).name == "bfloat16"
    if bf16 and (not {"avx512_bf16", "amx_bf16"} & have or rank < _MAX_ISAS.index("AVX512_BF16")):
        return (
            f"xla: bf16 on this CPU ({here}) runs its dots without AVX512-BF16 or AMX, "
            f"which is not modelled; {modelled}"
        )
    return None


def vector_code(fmt=None, isa: str | None = None) -> VectorCode:
    """The :class:`VectorCode` of ``isa`` ("AVX512" or "AVX2"), or (None) of the code
    XLA runs here, refusing where that is not modelled (:func:`unmodelled`)."""
    if isa is None:
        refuse(unmodelled(fmt))
        return _CODES[cpu.isa()]
    return _CODES[one_of(isa, tuple(_CODES), "xla: isa")]


def model(fmt: Format, n: int, d: int, *, isa: str | None = None) -> KernelModel:
    """fa_jax's model of XLA's attention in ``fmt`` (module docstring); ``algorithm``
    names the closest attention function, the reference.  The policy's exp is the
    one the jitted formats run on most shapes, YNNPACK's (XLA's own for fp16); the
    model swaps it for the other where XLA's program does.  ``isa`` ("AVX512" or
    "AVX2"): the model of that code (:class:`VectorCode`) on any host, without
    refusing; None: the code XLA runs here, NotImplementedError where it does not
    follow it (:func:`unmodelled`).  The dot orders, blocks and fusions are read
    from the program this host runs, so a model of another ISA's code than the
    host's is judged where that code runs (tests/lab.py's AVX2 lab)."""
    del n, d
    code = vector_code(fmt, isa)
    exp = XLA_CPU_EXP if fmt.name == "float16" else YNNPACK
    policy = fa2_kernel(fmt).replace(name=f"xla({fmt.name})", exp_model=exp, normalise="reciprocal")
    return KernelModel("xla", policy, "reference", forward=functools.partial(_forward, code=code))


def _cpu() -> tuple[str, str]:
    """The CPU's model name and its vector features (Linux; empty elsewhere): what
    XLA's CPU backend targets, and YNNPACK picks its kernels by."""
    wanted = ("avx", "fma", "amx", "f16c", "sse4")
    vector = sorted(f for f in cpu.flags() if f.startswith(wanted))
    return cpu.cpuinfo().get("model name", ""), " ".join(vector)


def platform() -> dict[str, str]:
    """jax and jaxlib versions, the backend and device, the CPU XLA targets, and
    where the exp model comes from."""
    device = jax.devices()[0]
    cpu, features = _cpu()
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "machine": _platform.machine(),
        "processor": _platform.processor() or _platform.machine(),
        "cpu": cpu,
        "cpu_features": features,
        "exp_model": (
            "YNNPACK's float32 exp inside YNNPACK fusions (ynnpack_exp), "
            "XLA CPU's own elsewhere (xla_cpu_exp)"
        ),
    }


XLA = Kernel(
    name="xla",
    description=(
        "jax.nn.dot_product_attention(implementation='xla') on JAX's default backend "
        "(jax/_src/nn/functions.py)"
    ),
    real=real,
    model=model,
    unavailable=lambda: None,
    platform=platform,
    formats=("bf16", "fp16", "fp32"),
    features=frozenset({"bias", "mask", "window", "kv_lengths", "gqa"}),
    unmodelled=unmodelled,
)
