"""ONNX Runtime's CPU attention: the ONNX ``Attention`` op, ``com.microsoft``
MultiHeadAttention, and fa_jax's bit-exact models of them.

``onnxruntime-attention``: the ONNX ``Attention`` op (opset 23) on the
CPUExecutionProvider, a graph of one node built with :mod:`onnx.helper`
(``onnxruntime/core/providers/cpu/llm/attention.cc``).  It runs unfused, per
head (heads split over ``intra_op_num_threads``; each GEMM single-threaded, so
the output does not depend on the thread count):

- S = MLAS sgemm(Q, Kᵀ, alpha = scale, beta = 1 onto a causal mask of 0 and the
  format's lowest finite value, or beta = 0) (``ComputeAttentionProbs``);
- P = MLAS softmax of S (``attention_softmax.h``: ``MlasComputeSoftmax``);
- O = MLAS sgemm(P, V) (``ComputeVxAttentionScore``).

In FP16 (``AttentionGemm`` on x86-64, where ``MlasHGemmSupported`` is false) each
GEMM upcasts its operands to FP32, runs the FP32 sgemm and rounds C to FP16; the
softmax upcasts S, runs in FP32 and rounds P to FP16.  So S and P are rounded to
FP16.  The model is those steps with :mod:`fa_jax.kernels.x86.mlas` (its sgemm, exp and
softmax).  ``scale=None`` passes fl32(1/sqrt(d)) as the op's ``scale``.  K/V with
fewer heads (``gqa``) go in as they are; a causal call with N < M passes the
first M - N keys as ``past_key``/``past_value`` (``q_offset`` = M - N, the op's
mask keeping j <= i + M - N; for one query the op masks nothing).

``onnxruntime-mha``: ``com.microsoft`` MultiHeadAttention (FP32; the CPU op has
no FP16 kernel), non-causal, which runs ``MlasFlashAttention``
(``core/mlas/lib/flashattn.cpp``): per chunk of Br query rows and block of Bc
keys, S = sgemm(Q, Kᵀ, alpha = scale), the row max m, P = MLAS's exp of S - m and
its 16-lane sum, l = fl(fl(std::exp(m_old - m) · l) + Σ), O = sgemm(P, V, beta = 1
onto fl(std::exp(m_old - m) · O)), finally O / l (a division).  Bc = L2 / (16 (d +
d_v)), Br = min(Bc, d + d_v) (``multihead_attention.cc``; :func:`flash_blocks`),
so the output depends on the L2 size (``l2_cache_size``, this host's by default)
and, through MLAS's one-row sgemm kernel, on whether a chunk holds one row.

Keywords beyond the common calling convention (:mod:`fa_jax.kernels.model`):
``threads`` (the session's ``intra_op_num_threads``, default 1; both models take
it, and neither output depends on it: heads and query chunks are split over the
threads, each GEMM runs on one) and, for the MHA model, ``l2_cache_size``.

MLAS picks its kernels when it starts, from CPUID (``platform.cpp``): its AVX-512F
kernels where the CPU has AVX-512F and the OS saves the ZMM registers, else its
FMA3 kernels where it has AVX2 and FMA, else SSE ones.  The models follow the
first two (:mod:`fa_jax.kernels.x86.mlas`: :data:`~fa_jax.kernels.x86.mlas.AVX512F`,
:data:`~fa_jax.kernels.x86.mlas.FMA3`), the ones MLAS runs here unless ``isa`` ("AVX512",
"AVX2") names one; on a CPU that runs the SSE kernels they raise
NotImplementedError (:func:`unmodelled`).
"""

from __future__ import annotations

import functools
import platform as _platform

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax._checks import one_of, positive_int
from fa_jax.accumulation import SEQUENTIAL
from fa_jax.exponential import glibc_expf
from fa_jax.formats import FP16, FP32, Format, get_format
from fa_jax.heads import repeat_kv
from fa_jax.kernels.model import Kernel, KernelModel, refuse
from fa_jax.kernels.x86 import cpu, mlas
from fa_jax.presets import fa2_kernel

__all__ = [
    "ONNXRUNTIME_ATTENTION",
    "ONNXRUNTIME_MHA",
    "attention_model",
    "mha_model",
    "mlas_isa",
    "real_attention",
    "real_mha",
    "sum_exp_kernel",
    "unmodelled",
]

_OPSET = 23
_FORMATS = ("fp32", "fp16")


def unavailable() -> str | None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime and onnx are not installed (pip install fa_jax[onnxruntime])"
    return None


# The sum-exp kernel of the MLAS code each ISA runs (platform.cpp's CPUID tests).
_SUM_EXP = {"AVX512": mlas.AVX512F, "AVX2": mlas.FMA3}
EXP_MODELS = {mlas.AVX512F: mlas.MLAS_SUM_EXP, mlas.FMA3: mlas.MLAS_SUM_EXP_FMA3}


def mlas_isa() -> str | None:
    """The ISA whose kernels MLAS runs on this CPU ("AVX512" or "AVX2"), None for its
    SSE kernels (module docstring)."""
    have = cpu.flags()
    if "avx512f" in have:
        return "AVX512"
    if {"avx2", "fma"} <= have:
        return "AVX2"
    return None


def unmodelled(fmt=None, **options) -> str | None:
    """None where MLAS runs kernels the models follow here (AVX-512F, FMA3), else why
    not (module docstring); the same for every format and option."""
    del fmt, options
    if mlas_isa() is not None:
        return None
    return (
        f"onnxruntime: MLAS on this CPU ({cpu.describe()}) runs its SSE kernels (GEMM, "
        "exp, softmax), which are not modelled; modelled: its AVX-512F kernels (a CPU "
        "with AVX-512F) and its FMA3 kernels (AVX2 and FMA)"
    )


def sum_exp_kernel(isa: str | None = None) -> mlas.SumExpKernel:
    """The sum-exp kernel of the MLAS code ``isa`` names, or (None) of the code MLAS
    runs here, refusing where that is not modelled."""
    if isa is None:
        refuse(unmodelled())
        isa = mlas_isa()
    name = one_of(isa, tuple(_SUM_EXP), "onnxruntime: isa")
    assert name is not None  # one of _SUM_EXP's keys
    return _SUM_EXP[name]


def platform_facts() -> dict[str, str]:
    import onnxruntime

    return {
        "onnxruntime": str(onnxruntime.__version__),
        "backend": "cpu",
        "l2_cache_bytes": str(l2_cache_bytes()),
        "machine": _platform.machine(),
        "processor": _platform.processor() or _platform.machine(),
    }


def _fmt(fmt) -> Format:
    f = get_format(fmt)
    if f.name not in {get_format(n).name for n in _FORMATS}:
        raise ValueError(f"onnxruntime: fmt: expected one of {_FORMATS}, got {f.name!r}")
    return f


def _scale(scale, d: int) -> float:
    return float(np.float32(1.0 / np.sqrt(d) if scale is None else scale))


@functools.cache
def _session(op: str, elem: int, causal: bool, scale: float, threads: int, past: bool = False):
    import onnxruntime as ort
    from onnx import helper

    # With past K/V (inputs 4 and 5; 3, the mask, left out) the CPU op needs the
    # present K/V outputs declared too.
    inputs = ["Q", "K", "V", "", "past_key", "past_value"] if past else ["Q", "K", "V"]
    outputs = ["Y", "present_key", "present_value"] if past else ["Y"]
    node = helper.make_node(op, inputs, outputs, is_causal=int(causal), scale=scale)
    graph = helper.make_graph(
        [node],
        "attention",
        [helper.make_tensor_value_info(n, elem, None) for n in inputs if n],
        [helper.make_tensor_value_info(n, elem, None) for n in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _past(causal: bool, n: int, m: int, q_offset: int) -> int:
    """The number of past keys P a call passes as ``past_key``/``past_value``: the
    op's causal mask keeps j <= i + P, so a causal call with N != M must be the
    mask behind them (``q_offset`` = M - N; the op masks nothing for one query, its
    causal being ``is_causal && q_len > 1``); ValueError otherwise."""
    want = m - n if causal else 0
    if q_offset != want or want < 0:
        raise ValueError(
            f"onnxruntime-attention: q_offset: expected {want} (the op's causal mask "
            f"keeps j <= i + P behind its P past keys, P = M - N), got {q_offset} "
            f"for N = {n}, M = {m}"
        )
    return want


def _as_bhsd(t, dtype):
    """(..., H, S, d) as the op's (B, H, S, d): the leading axes before the heads in B."""
    t = np.asarray(t, dtype)
    return t.reshape(-1, *(t.shape[-3:] if t.ndim >= 3 else (1, *t.shape)))


def real_attention(
    q, k, v, *, fmt, causal: bool = False, scale=None, threads: int = 1, q_offset: int = 0
) -> np.ndarray:
    """The ONNX ``Attention`` op's output (..., N, d_v) on ONNX Runtime's CPU, as
    float64; with ``q_offset`` = M - N (causal), the first M - N keys and values go
    in as its past K/V."""
    from onnx import TensorProto

    f = _fmt(fmt)
    threads = positive_int(threads, "onnxruntime: threads")
    dtype = np.float32 if f.name == FP32.name else np.float16
    elem = TensorProto.FLOAT if dtype is np.float32 else TensorProto.FLOAT16
    q, k, v = (np.asarray(t) for t in (q, k, v))
    lead, n, m = q.shape[:-2], q.shape[-2], k.shape[-2]
    p = _past(bool(causal), n, m, q_offset)
    q4, k4, v4 = (_as_bhsd(t, dtype) for t in (q, k, v))
    sess = _session("Attention", elem, bool(causal), _scale(scale, q.shape[-1]), threads, p > 0)
    feeds = {"Q": q4, "K": k4[:, :, p:], "V": v4[:, :, p:]}
    if p:
        feeds.update(past_key=k4[:, :, :p], past_value=v4[:, :, :p])
    out = sess.run(["Y"], feeds)[0]
    return np.asarray(out, np.float64).reshape(*lead, n, v.shape[-1])


def _attention_forward(q, k, v, *, policy, causal, scale, fp16: bool, kernel, q_offset=0):
    """The op's three stages, each compiled on its own (one program for all three
    compiles several times slower at N = 2048); K and V repeated for GQA."""
    del policy
    q, k, v = (jnp.asarray(t, jnp.float64) for t in (q, k, v))
    n, m = q.shape[-2], k.shape[-2]
    _past(bool(causal), n, m, q_offset)
    if q.ndim >= 3:
        k, v = (repeat_kv(t, q.shape[-3] // k.shape[-3]) for t in (k, v))
    c = None
    if causal and n > 1:  # the op's causal: is_causal && q_len > 1
        lowest = float(np.finfo(np.float16 if fp16 else np.float32).min)
        keep = np.arange(m)[None, :] <= np.arange(n)[:, None] + q_offset
        mask = np.where(keep, 0.0, lowest)
        c = jnp.asarray(np.broadcast_to(mask, (*q.shape[:-1], m)))
    s = _scores(q, k, c, scale=_scale(scale, q.shape[-1]), fp16=fp16)
    p = _probabilities(s, fp16=fp16, kernel=kernel)
    return _output(p, v, fp16=fp16)


@functools.partial(jax.jit, static_argnames=("scale", "fp16"))
def _scores(q, k, c, *, scale: float, fp16: bool):
    s = mlas.sgemm(q, jnp.swapaxes(k, -1, -2), alpha=scale, c=c, trans_b=True)
    return ops.cast(s, FP16) if fp16 else s


@functools.partial(jax.jit, static_argnames=("fp16", "kernel"))
def _probabilities(s, *, fp16: bool, kernel):
    p = mlas.softmax(s, kernel)
    return ops.cast(p, FP16) if fp16 else p


@functools.partial(jax.jit, static_argnames=("fp16",))
def _output(p, v, *, fp16: bool):
    o = mlas.sgemm(p, v)
    return ops.cast(o, FP16) if fp16 else o


def attention_model(
    fmt: Format, n: int, d: int, *, threads: int = 1, isa: str | None = None
) -> KernelModel:
    """fa_jax's model of ``onnxruntime-attention`` in ``fmt`` for the MLAS code of
    ``isa`` (None: the code here; module docstring); ``threads`` is accepted for
    symmetry with :func:`real_attention` (the output does not depend on it)."""
    del n, d
    f = _fmt(fmt)
    positive_int(threads, "onnxruntime: threads")
    kernel = sum_exp_kernel(isa)
    fp16 = f.name == FP16.name
    policy = fa2_kernel(f).replace(
        name=f"onnxruntime_attention({f.name})",
        p=f,
        accumulation=SEQUENTIAL,
        exp_model=EXP_MODELS[kernel],
        normalise="reciprocal",
    )
    forward = functools.partial(_attention_forward, fp16=fp16, kernel=kernel)
    return KernelModel("onnxruntime-attention", policy, "reference", forward=forward)


ONNXRUNTIME_ATTENTION = Kernel(
    name="onnxruntime-attention",
    description=(
        "ONNX Runtime's CPU ONNX Attention op (opset 23), unfused: MLAS sgemm, "
        "MLAS softmax (onnxruntime/core/providers/cpu/llm/attention.cc)"
    ),
    real=real_attention,
    model=attention_model,
    unavailable=unavailable,
    platform=platform_facts,
    formats=_FORMATS,
    features=frozenset({"q_offset", "gqa"}),
    options=("threads",),
    unmodelled=unmodelled,
)


# --- com.microsoft MultiHeadAttention: MLAS flash attention ---------------------------------


def l2_cache_bytes() -> int:
    """This host's L2 cache size in bytes (``/sys/devices/system/cpu/cpu0/cache/index2``),
    which ONNX Runtime's MultiHeadAttention sizes its blocks from; 0 where unknown."""
    import pathlib

    try:
        text = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
    except OSError:
        return 0
    units = {"K": 1024, "M": 1024 * 1024}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text) if text.isdigit() else 0


def flash_blocks(n: int, m: int, d: int, d_v: int, l2_cache_size: int) -> tuple[int, int]:
    """(q_block, kv_block) of ``MultiHeadAttention<float>::Compute``
    (``contrib_ops/cpu/bert/multihead_attention.cc``): Bc = L2 / (4 · 4 (d + d_v))
    (at least 1), Br = min(Bc, d + d_v), each capped at the sequence length."""
    kv = max(l2_cache_size // (4 * 4 * (d + d_v)), 1)
    q = min(kv, d + d_v)
    return min(q, n), min(kv, m)


@functools.cache
def _mha_session(n_heads: int, scale: float, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    node = helper.make_node(
        "MultiHeadAttention",
        ["Q", "K", "V"],
        ["Y"],
        domain="com.microsoft",
        num_heads=n_heads,
        scale=scale,
    )
    elem = TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "mha",
        [helper.make_tensor_value_info(n, elem, None) for n in "QKV"],
        [helper.make_tensor_value_info("Y", elem, None)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", _OPSET), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def real_mha(q, k, v, *, fmt, causal: bool = False, scale=None, threads: int = 1) -> np.ndarray:
    """``com.microsoft`` MultiHeadAttention's output (..., N, d_v) on ONNX Runtime's
    CPU (FP32 only; non-causal: its flash path), as float64."""
    f = _fmt(fmt)
    if f.name != FP32.name:
        raise ValueError(
            f"onnxruntime-mha: fmt: expected fp32 (the CPU op's only type), got {f.name!r}"
        )
    if causal:
        raise ValueError(
            "onnxruntime-mha: causal: expected False (unidirectional leaves the flash path)"
        )
    threads = positive_int(threads, "onnxruntime: threads")
    q, k, v = (np.asarray(t) for t in (q, k, v))
    lead, n, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    m, d_v = k.shape[-2], v.shape[-1]
    h = int(np.prod(lead, dtype=np.int64)) if lead else 1

    def bsnh(t, rows, width):  # (H, rows, width) -> (1, rows, H · width)
        return np.ascontiguousarray(
            np.asarray(t, np.float32)
            .reshape(h, rows, width)
            .transpose(1, 0, 2)
            .reshape(1, rows, h * width)
        )

    sess = _mha_session(h, _scale(scale, d), threads)
    out = sess.run(None, {"Q": bsnh(q, n, d), "K": bsnh(k, m, d), "V": bsnh(v, m, d_v)})[0]
    out = np.asarray(out, np.float64).reshape(n, h, d_v).transpose(1, 0, 2)
    return out.reshape(*lead, n, d_v)


@functools.partial(jax.jit, static_argnames=("scale", "rows_apart", "kernel"))
def _mha_first(q, kb, vb, *, scale: float, rows_apart: bool, kernel):
    """The first key block of ``MlasFlashAttentionThreaded`` (``core/mlas/lib/flashattn.cpp``):
    (m, l, O)."""
    s = mlas.sgemm(q, jnp.swapaxes(kb, -1, -2), alpha=scale, trans_b=True, rows_apart=rows_apart)
    row_m = jnp.max(s, axis=-1, keepdims=True)  # max(lowest, rowmax)
    p = mlas.sum_exp(ops.add(s, -row_m, FP32), kernel)
    return row_m, mlas.lane_sum(p, kernel)[..., None], mlas.sgemm(p, vb, rows_apart=rows_apart)


@functools.partial(jax.jit, static_argnames=("scale", "rows_apart", "kernel"))
def _mha_next(q, kb, vb, row_m, l, o, *, scale: float, rows_apart: bool, kernel):
    """A later key block: the rescale by std::exp(m_old - m) and O += P V (beta = 1)."""
    s = mlas.sgemm(q, jnp.swapaxes(kb, -1, -2), alpha=scale, trans_b=True, rows_apart=rows_apart)
    new_m = jnp.maximum(row_m, jnp.max(s, axis=-1, keepdims=True))
    m_diff = ops.sub(row_m, new_m, FP32)  # old - new
    p = mlas.sum_exp(ops.add(s, -new_m, FP32), kernel)
    rowsum = mlas.lane_sum(p, kernel)[..., None]
    exp_diff = glibc_expf(m_diff)  # std::exp
    l = ops.add(ops.mul(exp_diff, l, FP32), rowsum, FP32)
    o = mlas.sgemm(p, vb, c=ops.mul(exp_diff, o, FP32), rows_apart=rows_apart)
    return new_m, l, o


@jax.jit
def _divide(o, l):
    return ops.div(o, l, FP32)


def _mha_rows(q, k, v, *, scale: float, kv_block: int, rows_apart: bool, kernel):
    """MLAS flash attention on rows of Q whose chunks hold more than one row, or
    (``rows_apart``) one row each: the GEMMs then take MLAS's one-row kernel.
    Each key block's step is compiled on its own."""
    step = functools.partial(_mha_next, scale=scale, rows_apart=rows_apart, kernel=kernel)
    kb, vb = k[..., :kv_block, :], v[..., :kv_block, :]
    row_m, l, o = _mha_first(q, kb, vb, scale=scale, rows_apart=rows_apart, kernel=kernel)
    for lo in range(kv_block, k.shape[-2], kv_block):
        kb, vb = k[..., lo : lo + kv_block, :], v[..., lo : lo + kv_block, :]
        row_m, l, o = step(q, kb, vb, row_m, l, o)
    return _divide(o, l)


def _mha_forward(q, k, v, *, policy, causal, scale, l2_cache_size: int, kernel):
    del policy
    if causal:
        raise ValueError("onnxruntime-mha: causal: expected False (the flash path is not causal)")
    q, k, v = (jnp.asarray(t, jnp.float64) for t in (q, k, v))
    n, d, m, d_v = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    q_block, kv_block = flash_blocks(n, m, d, d_v, l2_cache_size)
    rows = functools.partial(
        _mha_rows, k=k, v=v, scale=_scale(scale, d), kv_block=kv_block, kernel=kernel
    )
    if q_block == 1:
        return rows(q, rows_apart=True)
    if n % q_block != 1:
        return rows(q, rows_apart=False)
    # The last chunk holds one row.
    parts = [rows(q[..., :-1, :], rows_apart=False)] if n > 1 else []
    parts.append(rows(q[..., -1:, :], rows_apart=True))
    return jnp.concatenate(parts, axis=-2)


def mha_model(
    fmt: Format,
    n: int,
    d: int,
    *,
    threads: int = 1,
    l2_cache_size: int | None = None,
    isa: str | None = None,
) -> KernelModel:
    """fa_jax's model of ``onnxruntime-mha`` (FP32): MLAS flash attention with the
    blocks :func:`flash_blocks` derives from ``l2_cache_size`` (this host's by
    default), for the MLAS code of ``isa`` (None: the code here); ``threads`` is
    accepted (the output does not depend on it)."""
    del n, d
    f = _fmt(fmt)
    if f.name != FP32.name:
        raise ValueError(f"onnxruntime-mha: fmt: expected fp32, got {f.name!r}")
    positive_int(threads, "onnxruntime: threads")
    l2 = (
        l2_cache_bytes()
        if l2_cache_size is None
        else positive_int(l2_cache_size, "onnxruntime-mha: l2_cache_size")
    )
    kernel = sum_exp_kernel(isa)
    policy = fa2_kernel(f).replace(
        name="onnxruntime_mha(fp32)", accumulation=SEQUENTIAL, exp_model=EXP_MODELS[kernel]
    )
    forward = functools.partial(_mha_forward, l2_cache_size=l2, kernel=kernel)
    return KernelModel("onnxruntime-mha", policy, "reference", forward=forward)


ONNXRUNTIME_MHA = Kernel(
    name="onnxruntime-mha",
    description=(
        "ONNX Runtime's CPU com.microsoft MultiHeadAttention (FP32, non-causal): MLAS flash "
        "attention, blocks from the L2 cache size (onnxruntime/core/mlas/lib/flashattn.cpp)"
    ),
    real=real_mha,
    model=mha_model,
    unavailable=unavailable,
    platform=platform_facts,
    formats=("fp32",),
    options=("threads",),
    unmodelled=unmodelled,
)
