"""OpenVINO's CPU ScaledDotProductAttention (``openvino-sdpa``) and fa_jax's bit-exact
model of its prefill and decoding paths (docs/kernels.md, "OpenVINO").

The real kernel runs where an LLM runs it: a stateful graph built with
``openvino.opset13`` (ReadValue of the past K and V, Gather by ``beam_idx``, Concat
with the new K and V, ScaledDotProductAttention, Assign), which the CPU plugin
fuses into its ScaledAttnWithKVCache node.  Q (..., H, N, d) and K, V (..., H_kv,
M, d) go in as one batch of query heads and cache heads, FP32; ``precision`` is
the ``INFERENCE_PRECISION_HINT`` ("bf16" or "f32"), ``kv_cache`` the
``KV_CACHE_PRECISION`` ("u8": per-token scale and zero point; "bf16"; "f32"),
``threads`` the ``INFERENCE_NUM_THREADS`` (default 1).

Which code runs (``nodes/scaled_attn.cpp``):

- N == M (prefill, one call): the multi-token kernel on the new K and V.  BF16:
  Q, K, V rounded to BF16, S = oneDNN brgemm (``vdpbf16ps`` or AMX's tile dots),
  OpenVINO's softmax with P rounded to BF16, O = brgemm(P V) rounded to BF16.
  F32: S = MLAS sgemm (four query rows a call; a last row alone in MLAS's one-row
  kernels), the softmax in FP32, O = MLAS sgemm(P V).  N == 1 runs the decoding
  kernel.  Modelled: :mod:`fa_jax.kernels.openvino.sdpa` and :mod:`fa_jax.kernels.x86.mlas`.
- N < M (decoding): the first M - N keys are set as the cache's state (bit for
  bit what a prefill call leaves, in O(M)), and ``mha_single_token`` runs the N
  queries on the cache in ``kv_cache`` precision: S = its ``dot_product`` (u8 keys
  dequantised, or on AVX2 in the affine form), the softmax in FP32, O = an FMA
  chain over the keys per thread's contiguous share of (cache head, key) work, the
  threads' partial sums added in thread order (``attn_reduce``); BF16 rounds O.
  BF16 on a u8 cache with d mod 16 != 0 is not modelled (the model raises).

GQA (the ``gqa`` feature) runs as an LLM export writes it: the cache holds H_kv
heads and ``repeat_kv`` is folded into the fused node by ``StatefulSDPAFusion``;
query head h reads cache head h / (H / H_kv), with each head's arithmetic as
without GQA, but the decoding kernel splits its threads over B · H_kv · M
(``mha_foreach_kv``), so a split may fall inside a group.  ``causal`` after the
cache (the ``q_offset`` feature, only M - N) is the mask bottom-right
(``ncausal = kv_len - q_len + m + 1``).  ``scale=None`` is fl32(1 / fl32(sqrt(d))),
as the kernel computes it.

The plugin and oneDNN pick their code from CPUID: the model follows their
AVX-512 code (``avx512_core``: F, BW, DQ, VL; bf16 with AVX512-BF16's
``vdpbf16ps`` or AMX's tile dots) and the plugin's AVX2 build on a CPU with AVX2
and FMA but no AVX-512F (:data:`fa_jax.kernels.openvino.sdpa.AVX2`; there the bf16 hint
compiles as f32 and is modelled so).  Elsewhere (BF16 on AVX-512 without those
instructions, AVX-512F without BW, DQ and VL, below AVX2) it raises
NotImplementedError (:func:`unmodelled`).  ``sdpa_model(..., isa="AVX2")`` (or
``"AVX512"``) gives the model of that code on any host.
"""

from __future__ import annotations

import functools
import platform as _platform

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fa_jax import ops
from fa_jax._checks import one_of, positive_int
from fa_jax.accumulation import SEQUENTIAL
from fa_jax.formats import BF16, FP32, Format, get_format
from fa_jax.heads import kv_groups, repeat_kv
from fa_jax.kernels.model import Kernel, KernelModel, refuse
from fa_jax.kernels.openvino import sdpa as ovs
from fa_jax.kernels.x86 import cpu, mlas
from fa_jax.presets import fa2_kernel

__all__ = ["KV_CACHES", "OPENVINO_SDPA", "PRECISIONS", "real_sdpa", "sdpa_model", "unmodelled"]

_FORMATS = ("fp32", "bf16")
PRECISIONS = ("bf16", "f32")
KV_CACHES = ("u8", "bf16", "f32")


def _unavailable() -> str | None:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return "openvino is not installed (pip install fa_jax[openvino])"
    return None


ISAS = (
    "AVX512",
    "AVX2",
)  # the plugin's builds the model follows (fa_jax.kernels.x86.cpu.isa names)
_CODE = {"AVX512": ovs.AVX512F, "AVX2": ovs.AVX2}


def _avx2_build(have) -> bool:
    """The plugin runs its AVX2 build: AVX2 and FMA, no AVX-512F (module docstring)."""
    return {"avx2", "fma"} <= have and "avx512f" not in have


def unmodelled(fmt=None, *, precision: str = "bf16", **options) -> str | None:
    """None where OpenVINO runs the code the model follows here for ``precision``
    (both precisions where ``fmt`` is None), else why not (module docstring)."""
    del fmt, options
    have = cpu.flags()
    if _avx2_build(have):  # bf16: the plugin runs the hint in f32 there
        return None
    if not cpu.AVX512 <= have:
        return (
            f"openvino-sdpa: the CPU plugin on this CPU ({cpu.describe()}) runs its "
            "AVX-512F kernels without AVX-512 BW, DQ and VL, or its SSE ones, which are "
            "not modelled; modelled: its AVX-512 (avx512_core) kernels, and its AVX2 "
            "build (f32)"
        )
    if precision == "bf16" and not {"avx512_bf16", "amx_bf16"} & have:
        return (
            f"openvino-sdpa: precision bf16 on this CPU ({cpu.describe()}), without "
            "AVX512-BF16 or AMX-BF16, is not modelled; modelled: bf16 with vdpbf16ps or "
            "AMX's tile dots, and f32"
        )
    return None


def _platform_facts() -> dict[str, str]:
    import openvino as ov

    core = ov.Core()
    return {
        "openvino": str(ov.__version__),
        "backend": "cpu",
        "device": str(core.get_property("CPU", "FULL_DEVICE_NAME")),
        "capabilities": " ".join(map(str, core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))),
        "machine": _platform.machine(),
        "processor": _platform.processor() or _platform.machine(),
    }


def _fmt(fmt) -> Format:
    f = get_format(fmt)
    if f.name not in {get_format(n).name for n in _FORMATS}:
        raise ValueError(f"openvino-sdpa: fmt: expected one of {_FORMATS}, got {f.name!r}")
    return f


def _scale(scale, d: int) -> float:
    if scale is None:  # 1.0f / std::sqrt(float(d)): two FP32 roundings
        return float(np.float32(1.0) / np.sqrt(np.float32(d)))
    return float(np.float32(scale))


@functools.lru_cache(maxsize=4)  # a compiled model keeps its state buffers (~250 MB at 32k keys)
def _compiled(
    h: int, h_kv: int, d: int, d_v: int, causal: bool, scale, precision, kv_cache, threads
):
    """The stateful graph (module docstring), compiled for the CPU: H query heads, the
    cache's H_kv; with H_kv < H each K/V head repeated H / H_kv times between the
    concat and the SDPA as an LLM's export writes ``repeat_kv`` (Unsqueeze, a
    bidirectional Broadcast, Reshape), the pattern ``StatefulSDPAFusion`` folds into
    the fused node."""
    import openvino as ov
    import openvino.opset13 as op

    f32 = ov.Type.f32
    q = op.parameter([-1, h, -1, d], f32, name="q")
    k = op.parameter([-1, h_kv, -1, d], f32, name="k")
    v = op.parameter([-1, h_kv, -1, d_v], f32, name="v")
    beam = op.parameter([-1], ov.Type.i32, name="beam_idx")
    groups = h // h_kv
    present, sinks = [], []
    for name, x, width in (("k", k, d), ("v", v, d_v)):
        info = ov.op.util.VariableInfo()
        info.data_shape = ov.PartialShape([-1, h_kv, -1, width])
        info.data_type = f32
        info.variable_id = f"past_{name}"
        variable = ov.op.util.Variable(info)
        batch = op.gather(op.shape_of(x), op.constant([0]), op.constant(0))
        empty = op.concat([batch, op.constant(np.array([h_kv, 0, width], np.int64))], 0)
        past = op.read_value(op.broadcast(op.constant(np.float32(0)), empty), variable)
        cat = op.concat([op.gather(past, beam, op.constant(0)), x], 2)
        sinks.append(op.assign(cat, variable))
        if groups > 1:  # repeat_kv: (B, H_kv, L, S) -> (B, H_kv, G, L, S) -> (B, H, L, S)
            cat = op.unsqueeze(cat, op.constant(np.array([2], np.int64)))
            shape = op.constant(np.array([1, 1, groups, 1, 1], np.int64))
            cat = op.broadcast(cat, shape, broadcast_spec="bidirectional")
            shape = op.constant(np.array([0, h, -1, width], np.int64))
            cat = op.reshape(cat, shape, special_zero=True)
        present.append(cat)
    extra = {}
    if scale is not None:
        extra = {
            "attention_mask": op.constant(np.zeros(1, np.float32)),
            "scale": op.constant(np.float32(scale)),
        }
    node = op.scaled_dot_product_attention(q, present[0], present[1], causal=causal, **extra)
    model = ov.Model([node.output(0)], sinks, [q, k, v, beam], "sdpa")  # pyright: ignore[reportGeneralTypeIssues]
    config = {
        "INFERENCE_PRECISION_HINT": precision,
        "KV_CACHE_PRECISION": kv_cache,
        "INFERENCE_NUM_THREADS": threads,
    }
    return ov.Core().compile_model(model, "CPU", config)


def _check_offset(q_offset, n: int, m: int, causal: bool) -> None:
    """The causal mask the plugin runs: bottom-right (``ncausal = kv_len - q_len + m +
    1``), q_offset = M - N; none without ``causal`` (ValueError otherwise)."""
    want = m - n if causal else 0
    if q_offset != want:
        what = "M - N (bottom-right: queries after the cache)" if causal else "0 (no causal mask)"
        raise ValueError(
            f"openvino-sdpa: q_offset: expected {what} = {want} for N = {n}, M = {m}, "
            f"causal={bool(causal)}, got {q_offset!r}"
        )


def real_sdpa(
    q,
    k,
    v,
    *,
    fmt,
    causal: bool = False,
    scale=None,
    q_offset: int = 0,
    precision: str = "bf16",
    kv_cache: str = "u8",
    threads: int = 1,
    fill: str = "state",
) -> np.ndarray:
    """OpenVINO's fused SDPA output (..., H, N, d_v) on the CPU, as float64 (module
    docstring); K and V (..., H_kv, M, d) with H_kv dividing H; ``q_offset`` M - N
    for a causal call (0 where N == M); ``fill``: how the first M - N keys enter the
    cache, ``"state"`` (set directly) or ``"prefill"`` (a call of M - N queries),
    the two bit for bit the same."""
    _fmt(fmt)
    fill = one_of(fill, tuple(_FILLS), "openvino-sdpa: fill")
    precision = one_of(precision, PRECISIONS, "openvino-sdpa: precision")
    kv_cache = one_of(kv_cache, KV_CACHES, "openvino-sdpa: kv_cache")
    threads = positive_int(threads, "openvino-sdpa: threads")
    q, k, v = (np.asarray(t) for t in (q, k, v))
    groups = kv_groups("openvino-sdpa", q.shape, k.shape, v.shape)
    lead, n, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    m, d_v = k.shape[-2], v.shape[-1]
    if n > m:
        raise ValueError(f"openvino-sdpa: expected N <= M (queries after a cache), got {n} > {m}")
    _check_offset(q_offset, n, m, causal)
    h = int(np.prod(lead, dtype=np.int64)) if lead else 1
    h_kv = h // groups
    q4 = np.asarray(q, np.float32).reshape(1, h, n, d)
    k4, v4 = (np.asarray(t, np.float32).reshape(1, h_kv, m, -1) for t in (k, v))
    given = None if scale is None else _scale(scale, d)
    compiled = _compiled(h, h_kv, d, d_v, bool(causal), given, precision, kv_cache, threads)
    request = compiled.create_infer_request()
    beam = np.zeros(1, np.int32)
    if m > n:  # the first M - N keys into the cache
        _FILLS[fill](request, k4[:, :, : m - n], v4[:, :, : m - n], precision, h)
    out = request.infer({"q": q4, "k": k4[:, :, m - n :], "v": v4[:, :, m - n :], "beam_idx": beam})
    return np.asarray(out[0], np.float64).reshape(*lead, n, d_v)


def _fill_state(request, k, v, precision: str, h: int) -> None:
    """The cache set directly (``VariableState.state``, O(M)): the plugin converts the
    state as its concat converts new keys (u8: ``attn_quant_u8``, one scale and zero
    point per token; else its cache precision).  Under BF16 inference (the hint
    where the plugin takes it: not on a CPU without BF16, ``INFERENCE_PRECISION_HINT``
    of the compiled model f32) the keys and values are rounded to BF16 first
    (nearest even), as the graph rounds its inputs before the cache: a u8 state
    quantizes the values it is given.  ``h``: the query heads (unused)."""
    import openvino as ov

    del h
    runs = request.get_compiled_model().get_property("INFERENCE_PRECISION_HINT")
    for state in request.query_state():
        x = {"past_k": k, "past_v": v}[state.name]
        if precision == "bf16" and runs == ov.Type.bf16:
            x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        state.state = ov.Tensor(np.ascontiguousarray(x, np.float32))


def _fill_prefill(request, k, v, precision: str, h: int) -> None:
    """The cache filled by a prefill call of M - N zero queries (``h`` heads), whose
    output is unused (the multi-token kernel: O(M²))."""
    del precision
    m, d = k.shape[2:]
    q = np.zeros((1, h, m, d), np.float32)
    request.infer({"q": q, "k": k, "v": v, "beam_idx": np.zeros(1, np.int32)})


_FILLS = {"state": _fill_state, "prefill": _fill_prefill}


def _keep(n: int, m: int, causal: bool):
    """The keys each query sees (None: all): causal bottom-right, query i seeing keys
    up to i + M - N (``ncausal = kv_len - q_len + m + 1`` in both kernels)."""
    if not causal:
        return None
    return jnp.asarray(np.arange(m)[None, :] <= np.arange(n)[:, None] + (m - n))


@functools.partial(jax.jit, static_argnames=("scale", "causal", "amx"))
def _bf16_prefill(q, k, v, *, scale: float, causal: bool, amx: bool):
    q, k, v = (ops.cast(t, BF16) for t in (q, k, v))
    s = ovs.bf16_matmul(q, jnp.swapaxes(k, -1, -2), amx=amx)
    p = ovs.softmax(s, scale, _keep(q.shape[-2], k.shape[-2], causal), bf16=True)
    o = ovs.bf16_matmul(p, v, amx=amx)
    if not amx:
        return ops.cast(o, BF16)
    # the AMX path's FP32 scratch, stored to BF16 a head (N · d values) at a time
    return ovs.store_bf16(o.reshape(*o.shape[:-2], -1)).reshape(o.shape)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "rows", "code"))
def _f32_prefill(q, k, v, *, scale: float, causal: bool, rows: int, code: ovs.VectorCode):
    """The MLAS path: rows [0, rows) in sgemms of more than one row, the rest (one
    row, N mod 4 = 1) in MLAS's one-row kernels."""
    n, m = q.shape[-2], k.shape[-2]
    keep = _keep(n, m, causal)
    out = []
    for lo, hi in ((0, rows), (rows, n)):
        if hi > lo:
            s = mlas.sgemm(q[..., lo:hi, :], jnp.swapaxes(k, -1, -2), trans_b=True)
            p = ovs.softmax(s, scale, None if keep is None else keep[lo:hi], code=code)
            out.append(mlas.sgemm(p, v))
    return jnp.concatenate(out, axis=-2) if len(out) > 1 else out[0]


_M_BLOCK = 4  # MHAKernel<KT_MLAS, float>: query rows per sgemm call


def thread_shares(work: int, threads: int) -> list[tuple[int, int]]:
    """[start, end) of each thread's share of ``work`` items (OpenVINO's ``splitter``)."""
    if threads <= 1:
        return [(0, work)]
    n1 = -(-work // threads)
    n2 = n1 - 1
    t_big = work - n2 * threads
    out = []
    for tid in range(threads):
        start = tid * n1 if tid <= t_big else t_big * n1 + (tid - t_big) * n2
        out.append((start, start + (n1 if tid < t_big else n2)))
    return out


_VALUE_BLOCK = 64  # attn_acc_value on u8: AVX-512 over blocks of 64, the rest scalar


def _u8_value_tail(p, v_read, v_scale, shares):
    """O's last d_v mod 64 columns on a u8 cache: the scalar loop ``out += w · (v -
    zp) · scale``, contracted to fma(fl(w · fl(v - zp)), scale, out), per thread
    share (``shares`` (T, H, 1, M)), (T, H, N, columns)."""
    t = ops.mul(jnp.swapaxes(p, -1, -2)[..., None], v_read[..., None, :], FP32)  # (H, M, N, c)
    terms = t * v_scale[..., None, :]  # exact products: one rounding per fma
    terms = jnp.where(jnp.swapaxes(shares, -1, -2)[..., None], terms, 0.0)
    return ops.sum(terms, FP32, axis=-3, accumulation=SEQUENTIAL)


def _shares(h: int, h_kv: int, m: int, threads: int) -> np.ndarray:
    """(T, H, 1, M): which thread's share holds each (query head, key).  The work
    split is over the cache, B · H_kv · M (kv head, then key: ``mha_foreach_kv``
    in ``mha_kv_cache_codec.cpp``), one item a key of a K/V head for all H / H_kv
    query heads of its group (``heads_per_kv_group``)."""
    group = np.arange(h) // (h // h_kv)  # query head h reads K/V head h // G
    work = (group[:, None] * m + np.arange(m)[None, :])[:, None, :]  # (H, 1, M)
    return np.stack([(work >= lo) & (work < hi) for lo, hi in thread_shares(h_kv * m, threads)])


@functools.partial(jax.jit, static_argnames=("scale", "threads", "u8", "bf16", "code", "causal"))
def _decode(
    q,
    k,
    v,
    *,
    scale: float,
    threads: int,
    u8: bool,
    bf16: bool,
    code: ovs.VectorCode,
    causal: bool = False,
):
    """``mha_single_token`` with BF16 queries on a BF16 or u8 cache (``bf16``), or
    with FP32 queries on an FP32 or u8 cache (module docstring); q (H, N, d), k and v
    (H_kv, M, ·) with H_kv dividing H; ``code`` the build (lanes and sums of the dot
    product and softmax); ``causal``: bottom-right."""
    h, h_kv, n, m = q.shape[0], k.shape[0], q.shape[-2], k.shape[-2]
    shares = _shares(h, h_kv, m, threads)
    # Each query head reads its group's K/V head: the cache's rows (each quantized on
    # its own, u8) read as they are, so repeating them first gives the same values.
    k, v = repeat_kv(k, h // h_kv), repeat_kv(v, h // h_kv)
    if bf16:
        q, k, v = (ops.cast(t, BF16) for t in (q, k, v))
    d_v = v.shape[-1]
    keep = _keep(n, m, causal)
    s = None
    if u8 and not bf16:
        # FP32 queries read V back as fl(fl(u - zp) · scale), and K too (AVX-512) or
        # score its integers and correct the sums (AVX2: ovs.u8_dot_product)
        if code.f32_u8 == "affine":
            k_u, k_scale, k_zp = ovs.quantize_u8(k)
            s = ovs.u8_dot_product(q, k_u, k_scale, k_zp, code)
        else:
            k = ovs.dequantize_u8(k)
        v = ovs.dequantize_u8(v)
        u8 = False
    tail = d_v % _VALUE_BLOCK if u8 else 0
    if u8:
        k_u, k_scale, k_zp = ovs.quantize_u8(k)
        v_u, v_scale, v_zp = ovs.quantize_u8(v)
        k_read = ops.sub(k_u, jnp.broadcast_to(k_zp, k_u.shape), FP32)
        v = ops.sub(v_u, jnp.broadcast_to(v_zp, v_u.shape), FP32)
        s = ops.mul(ovs.dot_product(q, k_read, code=code), jnp.swapaxes(k_scale, -1, -2), FP32)
        p = ovs.softmax(s, scale, keep, code=code)
        w = ops.mul(p, jnp.swapaxes(v_scale, -1, -2), FP32)  # weight · scale of V
    else:
        if s is None:
            s = ovs.dot_product(q, k, fp32=not bf16, code=code)
        p = w = ovs.softmax(s, scale, keep, code=code)
    parts = []
    if d_v - tail:
        w_t = jnp.where(shares, w, 0.0)
        parts.append(ops.matmul(w_t, v[..., : d_v - tail], FP32, accumulation=SEQUENTIAL))
    if tail:
        parts.append(_u8_value_tail(p, v[..., d_v - tail :], v_scale, shares))  # pyright: ignore[reportPossiblyUnbound]
    partial = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    # attn_reduce: from zero, thread by thread (a thread without keys of a head adds 0;
    # one thread: the partial itself).
    out = ops.sum(partial, FP32, axis=0, accumulation=SEQUENTIAL)
    if not bf16:
        return out
    return ovs.store_bf16(out)  # a row at a time


def _forward(
    q,
    k,
    v,
    *,
    policy,
    causal,
    scale,
    q_offset: int = 0,
    precision: str = "bf16",
    threads: int = 1,
    u8: bool = False,
    amx: bool = False,
    code=ovs.AVX512F,
):
    del policy
    q, k, v = (jnp.asarray(t, jnp.float64) for t in (q, k, v))
    groups = kv_groups("openvino-sdpa", q.shape, k.shape, v.shape)
    n, d, m = q.shape[-2], q.shape[-1], k.shape[-2]
    _check_offset(q_offset, n, m, causal)
    s = _scale(scale, d)
    if n != m or n == 1:  # one query row, or queries after a cache: mha_single_token
        if u8 and precision == "bf16" and d % ovs.LANES:
            raise NotImplementedError(
                f"openvino-sdpa: decoding on a u8 cache with d = {d}: the u8 dot product's "
                "scalar tail (d mod 16) is not modelled"
            )
        lead = q.shape[:-2]
        flat = [t.reshape(-1, *t.shape[-2:]) for t in (q, k, v)]
        bf16 = precision == "bf16"
        out = _decode(
            *flat, scale=s, threads=threads, u8=u8, bf16=bf16, code=code, causal=bool(causal)
        )
        return out.reshape(*lead, n, v.shape[-1])
    # the multi-token kernels read K/V head h // G for query head h (h_each_group_len)
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    if precision == "bf16":
        return _bf16_prefill(q, k, v, scale=s, causal=bool(causal), amx=amx)
    rows = n - 1 if n % _M_BLOCK == 1 else n  # the last block of one row: M = 1 kernels
    return _f32_prefill(q, k, v, scale=s, causal=bool(causal), rows=rows, code=code)


def sdpa_model(
    fmt: Format,
    n: int,
    d: int,
    *,
    precision: str = "bf16",
    kv_cache: str = "u8",
    threads: int = 1,
    isa: str | None = None,
) -> KernelModel:
    """fa_jax's model of ``openvino-sdpa`` (module docstring): the prefill path
    (N == M; neither ``kv_cache`` nor ``threads`` reaches its output) and
    decoding (N < M, or N = 1) on each ``kv_cache`` with ``threads``, K and V with
    H_kv heads dividing H (``gqa``), a causal call with N < M taking q_offset =
    M - N (bottom-right); ``isa`` ("AVX512" or "AVX2"; None: the build this CPU
    runs, refused where it is not modelled) the plugin build it follows."""
    del n, d
    f = _fmt(fmt)
    precision = one_of(precision, PRECISIONS, "openvino-sdpa: precision")
    kv_cache = one_of(kv_cache, KV_CACHES, "openvino-sdpa: kv_cache")
    threads = positive_int(threads, "openvino-sdpa: threads")
    if isa is None:
        refuse(unmodelled(f, precision=precision))
        isa = "AVX2" if _avx2_build(cpu.flags()) else "AVX512"
    isa = one_of(isa, ISAS, "openvino-sdpa: isa")
    if isa == "AVX2":  # no BF16 there: the plugin runs the bf16 hint in f32
        precision = "f32"
    stage = BF16 if precision == "bf16" else FP32
    policy = fa2_kernel(stage).replace(
        name=f"openvino_sdpa({f.name}, {precision})",
        p=stage,
        accumulation=SEQUENTIAL,
        exp_model=ovs.OPENVINO_EXP,
        normalise="reciprocal",
    )
    u8 = kv_cache == "u8"
    amx = "amx_bf16" in cpu.flags()  # the brgemm's tile dots: this CPU's, read as it runs
    forward = functools.partial(
        _forward, precision=precision, threads=threads, u8=u8, amx=amx, code=_CODE[isa]
    )
    return KernelModel("openvino-sdpa", policy, "reference", forward=forward)


OPENVINO_SDPA = Kernel(
    name="openvino-sdpa",
    description=(
        "OpenVINO's CPU ScaledDotProductAttention with a KV cache (stateful graph, "
        "ScaledAttnWithKVCache): oneDNN brgemm in BF16 or MLAS sgemm in FP32, its own "
        "softmax (src/plugins/intel_cpu/src/nodes/scaled_attn.cpp)"
    ),
    real=real_sdpa,
    model=sdpa_model,
    unavailable=_unavailable,
    platform=_platform_facts,
    formats=_FORMATS,
    features=frozenset({"gqa", "q_offset"}),
    options=("precision", "kv_cache", "threads"),
    unmodelled=unmodelled,
)
