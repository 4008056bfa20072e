"""``ggml``: llama.cpp's CPU flash attention (``ggml_flash_attn_ext``) and its model.

The real kernel runs through :mod:`fa_jax.kernels.ggml.lib` (ctypes on ggml's
libraries); the model is :mod:`fa_jax.kernels.ggml.attention`, which picks the path ggml
picks (ops.cpp:9441): split-KV for one query row over ``M >= 512`` float K/V (its
output depends on ``threads``), tiled for ``N >= 64`` rows of float K/V, scalar
otherwise.  Q is F32; K and V are stored as ``kv_type`` (``f32``, ``f16``, ``bf16``,
``q8_0``, ``q4_0``).

Features (:data:`FEATURES`), as ``ggml_flash_attn_ext(q, k, v, mask, scale,
max_bias, logit_softcap)`` and ``ggml_flash_attn_ext_add_sinks`` take them (the
order in which ggml applies them: :mod:`fa_jax.kernels.ggml.attention`):

* ``gqa``: K/V with H_kv heads dividing H; query head h reads K/V head h // (H /
  H_kv) (ggml's ``ik2 = iq2 / rk2``, the same as :mod:`fa_jax.heads`);
* ``mask``, ``bias``, ``q_offset`` and the causal mask become ggml's one additive F16
  mask, built as llama.cpp builds its KQ mask (:func:`ggml_mask`): -inf where a pair
  is dropped (causal: key j <= i + q_offset), else the bias (0 without; values exact
  in FP16, else ValueError);
* ``softcap``: ggml's ``logit_softcap`` (FP32), with glibc's ``tanhf``;
* ``sinks``: a logit per head (FP32), ``ggml_flash_attn_ext_add_sinks``.

Keywords beyond the common calling convention (:mod:`fa_jax.kernels.model`):
``kv_type`` (default: ``f32`` for fp32 inputs, ``f16`` for fp16, ``bf16`` for bf16),
``threads`` (default 1) and ``max_bias`` (default 0: ALiBi off): ALiBi as llama.cpp
runs it, the mask holding the distance -|i + q_offset - j| of each kept pair, which
ggml multiplies by each head's slope (from ``max_bias`` and the number of heads);
the heads are then the last leading axis and the others ggml's batch (without
ALiBi every leading axis is a head, batch 1); ``bias`` with ``max_bias`` is refused,
and sinks that differ along the batch.  Quantized K/V take FP32 inputs; ggml's
reference quantizer makes the blocks (:mod:`fa_jax.kernels.ggml.blocks`).

Which code is modelled (:func:`unmodelled`): ggml picks its code when it is built,
so the loaded build's features decide (:func:`fa_jax.kernels.ggml.lib.build_features`;
without the libraries, those of a native build for this CPU).  The model follows
an AVX-512 build (:data:`fa_jax.kernels.ggml.vec.AVX512`; BF16 K/V: AVX512-BF16's dot) and
an AVX2 build with FMA and F16C (:data:`fa_jax.kernels.ggml.vec.AVX2`: 8-lane dots and exp)
for every K/V type; for Q8_0 and Q4_0 K/V both run the same AVX2 code
(:mod:`fa_jax.kernels.ggml.blocks`; glibc's expf and FMAs otherwise).  Builds without AVX2,
FMA and F16C, and BF16 K/V on an AVX-512 build without AVX512-BF16, are refused.
:func:`model`'s ``isa`` (``"AVX512"`` or ``"AVX2"``) names the build's code instead.
"""

from __future__ import annotations

import functools
import math
import platform as _platform

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from fa_jax import ops
from fa_jax._checks import one_of, positive_int
from fa_jax._x64 import float64_enabled
from fa_jax.formats import FP16, FP32, Format, get_format
from fa_jax.kernels.ggml import attention as ga
from fa_jax.kernels.ggml import lib as ggml_lib
from fa_jax.kernels.ggml import vec as ggml_vec
from fa_jax.kernels.model import Kernel, KernelModel, refuse
from fa_jax.kernels.x86 import cpu
from fa_jax.masking import q_offset_of
from fa_jax.presets import fa2_kernel
from fa_jax.rounding import round_to

__all__ = [
    "FEATURES",
    "GGML",
    "ISAS",
    "KV_TYPES",
    "call_args",
    "ggml_mask",
    "model",
    "path",
    "real",
    "unmodelled",
]

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
FEATURES = frozenset({"bias", "mask", "q_offset", "softcap", "sinks", "gqa"})
_DEFAULT_KV = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}


def _kv_type(fmt: Format, kv_type: str | None) -> str:
    if kv_type is None:
        name = get_format(fmt).name
        for short, kv in _DEFAULT_KV.items():
            if get_format(short).name == name:
                return kv
        raise ValueError(f"ggml: fmt: expected fp32, fp16 or bf16, got {name!r}")
    return one_of(kv_type, KV_TYPES, "ggml: kv_type")


def path(n: int, m: int, batch: int, kv_type: str) -> str:
    """The path ggml takes for N query rows, M keys, batch size (ops.cpp:9478, 9547)."""
    floats = kv_type in ("f32", "f16")
    if floats and n == 1 and batch == 1 and m >= 512:
        return "split-kv"
    if floats and n >= ga.TILE:
        return "tiled"
    return "scalar"


def _mask(n: int, m: int, causal: bool) -> np.ndarray | None:
    """The causal mask llama.cpp builds, top-left: 0 and -inf (N, M); None without."""
    if not causal:
        return None
    return np.where(np.arange(m)[None, :] <= np.arange(n)[:, None], 0.0, -np.inf)


def ggml_mask(xp, lead, n: int, m: int, *, causal, q_offset=0, mask=None, bias=None, alibi=False):
    """ggml's additive mask as llama.cpp builds its KQ mask (``llama-kv-cache.cpp``,
    ``set_input_kq_mask``), in ``xp`` (numpy or jax.numpy): -inf for the pairs the
    causal mask (query i at key position i + ``q_offset``) or the boolean ``mask``
    drops, else ``bias`` (0 without), or with ``alibi`` the distance -|i + q_offset
    - j| that ggml multiplies by each head's slope.  (N, M) where it is the same for
    every head, else (*lead, N, M); None where nothing is masked."""
    if not (causal or alibi or mask is not None or bias is not None):
        return None
    i = xp.arange(n)[:, None] + q_offset
    j = xp.arange(m)[None, :]
    base = -xp.abs(i - j).astype(xp.float64) if alibi else xp.zeros((n, m), xp.float64)
    if bias is not None:
        base = base + bias
    keep = j <= i if causal else xp.ones((n, m), bool)
    if mask is not None:
        keep = keep & mask
    out = xp.where(keep, base, -xp.inf)
    if mask is None and bias is None:
        return out
    return xp.broadcast_to(out, (*lead, n, m))


def _scale(scale, d: int) -> float:
    return float(np.float32(1.0 / np.sqrt(d) if scale is None else scale))


def _layout(lead: tuple, max_bias: float) -> tuple[int, int]:
    """ggml's batch and heads (ne3, ne2) for leading axes ``lead``: every axis
    flattened into heads, batch 1; with ALiBi (``max_bias`` > 0), whose slopes follow
    the head index, the last axis is the heads and the others the batch."""
    if max_bias > 0:
        h = lead[-1] if lead else 1
        return math.prod(lead[:-1]), h
    return 1, math.prod(lead)


def _options(max_bias, softcap, bias) -> tuple[float, float | None]:
    """``max_bias`` and ``softcap`` as ggml's FP32 parameters; ValueError for values
    or combinations it does not take."""
    try:
        mb = float(max_bias)
    except (TypeError, ValueError):
        mb = math.nan
    if not (math.isfinite(mb) and mb >= 0):
        raise ValueError(f"ggml: max_bias: expected a finite number >= 0, got {max_bias!r}")
    if mb > 0 and bias is not None:
        raise ValueError(
            "ggml: bias with max_bias: ggml's mask holds ALiBi's distances there "
            "(llama.cpp's -|i - j|); expected one or the other"
        )
    cap = None if softcap is None else float(np.float32(softcap))
    return float(np.float32(mb)), cap


def _check_bias_f16(bias) -> None:
    """ValueError unless ``bias`` (concrete) holds values exact in FP16 or -inf."""
    if bias is None or isinstance(bias, Tracer):
        return
    b = np.asarray(bias, np.float64)
    with float64_enabled():
        exact = np.array_equal(np.asarray(round_to(b, FP16)), b)
    if not exact:
        raise ValueError(
            "ggml: bias: expected values exact in FP16 (ggml's mask is F16), got values that round"
        )


def _sinks_per_head(sinks, lead, b: int, h: int) -> np.ndarray | None:
    """Sinks (broadcastable to ``lead``) as ggml's F32 tensor of ``h`` heads; ValueError
    where they differ along the batch (ggml reads one per head)."""
    if sinks is None:
        return None
    full = np.broadcast_to(np.asarray(sinks, np.float64), lead).reshape(b, h)
    if not (full == full[:1]).all():
        raise ValueError(
            "ggml: sinks with max_bias: ggml takes one sink per head, expected the same "
            "sinks for every batch entry"
        )
    return full[0]


def _as4(t: np.ndarray, b: int = 1) -> np.ndarray:
    """(..., N, d) as (B, H, N, d): ``b`` batch entries, H the rest of the leading axes."""
    return np.asarray(t, np.float32).reshape(b, -1, *t.shape[-2:])


def call_args(
    q,
    k,
    v,
    *,
    fmt,
    causal: bool = False,
    scale=None,
    kv_type: str | None = None,
    threads=1,
    max_bias=0.0,
    mask=None,
    bias=None,
    q_offset=0,
    softcap=None,
    sinks=None,
) -> dict:
    """The keywords of :func:`fa_jax.kernels.ggml.lib.flash_attn_ext` for a call of
    :func:`real` (numpy arrays and numbers: what the AVX2 lab's child is given)."""
    kv = _kv_type(fmt, kv_type)
    threads = positive_int(threads, "ggml: threads")
    mb, cap = _options(max_bias, softcap, bias)
    _check_bias_f16(bias)
    q = np.asarray(q)
    lead, n, m = q.shape[:-2], q.shape[-2], np.shape(k)[-2]
    b, h = _layout(lead, mb)
    q_offset = q_offset_of(q_offset, n, m, "ggml")
    full = ggml_mask(
        np, lead, n, m, causal=causal, q_offset=q_offset, mask=mask, bias=bias, alibi=mb > 0
    )
    if full is not None and full.ndim > 2:
        full = full.reshape(b, h, n, m)
    return {
        "q": _as4(q, b),
        "k": _as4(np.asarray(k), b),
        "v": _as4(np.asarray(v), b),
        "mask": full,
        "scale": _scale(scale, q.shape[-1]),
        "kv_type": kv,
        "threads": threads,
        "max_bias": mb,
        "softcap": 0.0 if cap is None else cap,
        "sinks": _sinks_per_head(sinks, lead, b, h),
    }


def real(q, k, v, *, fmt, **keywords) -> np.ndarray:
    """ggml's output (..., N, d_v) as float64 (keywords: :func:`call_args`)."""
    out = ggml_lib.flash_attn_ext(**call_args(q, k, v, fmt=fmt, **keywords))
    return out.reshape(*np.shape(q)[:-1], np.shape(v)[-1]).astype(np.float64)


def _stored(x, kv: str):
    """K or V as ggml stores them (dequantized values), float64 carrier."""
    from fa_jax.rounding import round_to

    if kv == "f32":
        return x
    if kv in ("f16", "bf16"):
        return round_to(x, get_format("fp16" if kv == "f16" else "bf16"))
    from fa_jax.kernels.ggml import blocks as ggml_blocks

    return ggml_blocks.dequantize(*ggml_blocks.quantize_ref(x, kv), kv)


def _forward(
    q,
    k,
    v,
    *,
    policy,
    causal,
    scale,
    kv: str,
    threads: int,
    code: ggml_vec.VecCode,
    max_bias: float = 0.0,
    mask=None,
    bias=None,
    q_offset=0,
    softcap=None,
    sinks=None,
    **others,
):
    del policy
    if others:
        raise NotImplementedError(
            f"ggml: {', '.join(sorted(others))}: not modelled (ggml_flash_attn_ext has "
            f"no such input); modelled: {', '.join(sorted(FEATURES))} and max_bias"
        )
    mb, cap = _options(max_bias, softcap, bias)
    _check_bias_f16(bias)
    q, k, v = (jnp.asarray(t, jnp.float64) for t in (q, k, v))
    lead = q.shape[:-2]
    b, h = _layout(lead, mb)
    sink_rows = None
    if sinks is not None:
        if not isinstance(sinks, Tracer):
            _sinks_per_head(sinks, lead, b, h)
        sink_rows = jnp.broadcast_to(jnp.asarray(sinks, jnp.float64), lead)
    return _forward_jit(
        q,
        k,
        v,
        None if mask is None else jnp.asarray(mask, bool),
        None if bias is None else jnp.asarray(bias, jnp.float64),
        sink_rows,
        causal=bool(causal),
        scale=scale,
        kv=kv,
        threads=threads,
        code=code,
        max_bias=mb,
        q_offset=q_offset_of(q_offset, q.shape[-2], k.shape[-2], "ggml"),
        softcap=cap,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "causal",
        "scale",
        "kv",
        "threads",
        "code",
        "max_bias",
        "q_offset",
        "softcap",
    ),
)
def _forward_jit(
    q,
    k,
    v,
    mask,
    bias,
    sinks,
    *,
    causal: bool,
    scale,
    kv: str,
    threads: int,
    code,
    max_bias: float,
    q_offset: int,
    softcap,
):
    from fa_jax.rounding import round_to

    lead, n, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    m, d_v = k.shape[-2], v.shape[-1]
    b, h = _layout(lead, max_bias)
    qf = jnp.asarray(q).reshape(-1, d)  # rows (heads·N, d)
    heads = qf.shape[0] // n
    kv_heads = math.prod(k.shape[:-2])
    rep = (heads // kv_heads) * n  # GQA: query head h reads K/V head h // (H / H_kv)
    kf = _stored(jnp.asarray(k).reshape(kv_heads, m, d), kv)
    vf = _stored(jnp.asarray(v).reshape(kv_heads, m, d_v), kv)
    kr = jnp.repeat(kf, rep, axis=0)
    vr = jnp.repeat(vf, rep, axis=0)
    full = ggml_mask(
        jnp, lead, n, m, causal=causal, q_offset=q_offset, mask=mask, bias=bias, alibi=max_bias > 0
    )
    mr = None
    if full is not None:
        rows = jnp.broadcast_to(full, (*lead, n, m)).reshape(-1, m)
        slopes = None
        if max_bias > 0:
            per_head = np.tile(np.asarray(ga.alibi_slopes(max_bias, h)), b)
            slopes = np.repeat(per_head, n)
        mr = ga.mask_values(ops.cast(rows, FP16), slopes)
    sink_rows = None if sinks is None else jnp.repeat(sinks.reshape(-1), n)
    sc = _scale(scale, d)
    if softcap is not None:
        sc = float(np.float32(sc) / np.float32(softcap))  # ggml's scale /= logit_softcap
    extra = {"softcap": softcap, "sinks": sink_rows}
    which = path(n, m, b, kv)
    if which == "tiled":
        out = ga.tiled(qf, kr, vr, mr, scale=sc, code=code, **extra)
    else:
        if kv in ("f32", "f16", "bf16"):
            qd = qf if kv == "f32" else round_to(qf, get_format("fp16" if kv == "f16" else "bf16"))
            scores = ga.dot(qd, kr, kv, code)
        else:
            from fa_jax.kernels.ggml import blocks as ggml_blocks

            raw = jnp.repeat(k.reshape(kv_heads, m, d), rep, axis=0)
            scores = ggml_blocks.dot(qf, raw, kv)
        if which == "split-kv":
            out = ga.split_kv(
                scores, vr, mr, scale=sc, v_fp16=kv == "f16", threads=threads, **extra
            )
        else:
            out = ga.scalar(scores, vr, mr, scale=sc, v_fp16=kv == "f16", **extra)
    return out.reshape(*lead, n, d_v)


ISAS = tuple(ggml_vec.CODES)  # the builds' vector code the model follows, by cpu.isa()'s names


def _build() -> frozenset[str]:
    """The features of the ggml whose code runs here: the loaded build's, else those
    a native build (``experiments/build_ggml.py``) takes from this CPU."""
    if ggml_lib.library_dir() is not None:
        try:
            return ggml_lib.build_features()
        except OSError:
            pass
    flags = cpu.flags()
    named = {"avx512": "avx512f", "sse3": "pni", "amx_int8": "amx_int8"}
    return frozenset(f for f in ggml_lib.BUILD_FEATURES if named.get(f, f) in flags)


def _modelled(build: frozenset[str]) -> tuple[str, ...]:
    """The K/V types whose code in a build with these features the model follows."""
    if "avx512" in build:
        return KV_TYPES if "avx512_bf16" in build else tuple(k for k in KV_TYPES if k != "bf16")
    if {"avx2", "fma", "f16c"} <= build:
        return KV_TYPES
    return ()


def _code(build: frozenset[str]) -> ggml_vec.VecCode:
    """The vector code of a build with these features (one :func:`_modelled` accepts):
    ``__AVX512F__`` decides (simd-mappings.h:446)."""
    return ggml_vec.AVX512 if "avx512" in build else ggml_vec.AVX2


def unmodelled(fmt=None, *, kv_type: str | None = None, threads=1, max_bias=0.0) -> str | None:
    """None where the model follows the code ggml's build here runs for ``fmt`` K/V
    stored as ``kv_type`` (every K/V type where ``fmt`` is None), else why not
    (module docstring)."""
    del threads, max_bias
    asked = KV_TYPES if fmt is None else (_kv_type(get_format(fmt), kv_type),)
    build = _build()
    kept = _modelled(build)
    refused = [kv for kv in asked if kv not in kept]
    if not refused:
        return None
    return (
        f"ggml: {', '.join(refused)} K/V: the ggml build here (features: "
        f"{' '.join(sorted(build)) or 'none'}; this CPU: {cpu.describe()}) runs code "
        "the model does not follow; modelled: AVX-512 builds (bf16 K/V with "
        "AVX512-BF16) and AVX2 builds with FMA and F16C, for every K/V type"
    )


def model(
    fmt: Format,
    n: int,
    d: int,
    *,
    kv_type: str | None = None,
    threads=1,
    max_bias=0.0,
    isa: str | None = None,
) -> KernelModel:
    """fa_jax's model of ``ggml`` for ``fmt`` inputs stored as ``kv_type`` with
    ``threads`` threads (the split-KV path's output depends on it), following the
    vector code of the build ``isa`` names (``"AVX512"`` or ``"AVX2"``); None: the
    build here, NotImplementedError where it runs other code (:func:`unmodelled`)."""
    del n, d
    kv = _kv_type(fmt, kv_type)
    threads = positive_int(threads, "ggml: threads")
    max_bias, _ = _options(max_bias, None, None)
    if isa is None:
        refuse(unmodelled(fmt, kv_type=kv))
        code = _code(_build())
    else:
        code = ggml_vec.CODES[one_of(isa, ISAS, "ggml: isa")]
    policy = fa2_kernel(FP32).replace(name=f"ggml_cpu({kv})")
    forward = functools.partial(_forward, kv=kv, threads=threads, code=code, max_bias=max_bias)
    return KernelModel("ggml", policy, "reference", forward=forward)


def _platform_facts() -> dict[str, str]:
    folder = ggml_lib.library_dir()
    return {
        "ggml_lib": str(folder) if folder is not None else "absent",
        "machine": _platform.machine(),
    }


GGML = Kernel(
    name="ggml",
    description=(
        "llama.cpp's CPU flash attention, ggml_flash_attn_ext (ggml/src/ggml-cpu/ops.cpp), "
        "K/V in f32, f16, bf16, q8_0 or q4_0"
    ),
    real=real,
    model=model,
    unavailable=ggml_lib.unavailable,
    platform=_platform_facts,
    formats=("fp32", "fp16", "bf16"),
    features=FEATURES,
    options=("kv_type", "threads", "max_bias"),
    unmodelled=unmodelled,
)
