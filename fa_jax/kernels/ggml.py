"""``ggml``: llama.cpp's CPU flash attention (``ggml_flash_attn_ext``) and its model.

The real kernel runs through :mod:`fa_jax.kernels.ggml_lib` (ctypes on ggml's
libraries); the model is :mod:`fa_jax.ggml_attention`, which picks the path ggml
picks (ops.cpp:9441): split-KV for one query row over ``M >= 512`` float K/V (its
output depends on ``threads``), tiled for ``N >= 64`` rows of float K/V, scalar
otherwise.  Q is F32; K and V are stored as ``kv_type`` (``f32``, ``f16``, ``bf16``,
``q8_0``, ``q4_0``); causal attention is an additive F16 mask of 0 and -inf.

Keywords beyond the common calling convention (:mod:`fa_jax.kernels.model`):
``kv_type`` (default: ``f32`` for fp32 inputs, ``f16`` for fp16, ``bf16`` for bf16)
and ``threads`` (default 1).  Quantized K/V take FP32 inputs; ggml's reference
quantizer makes the blocks (:mod:`fa_jax.ggml_blocks`).

Which code is modelled (:func:`unmodelled`): ggml picks its code when it is built,
so the loaded build's features decide (:func:`fa_jax.kernels.ggml_lib.build_features`;
without the libraries, those of a native build for this CPU).  The model follows
an AVX-512 build (:data:`fa_jax.ggml_vec.AVX512`; BF16 K/V: AVX512-BF16's dot) and
an AVX2 build with FMA and F16C (:data:`fa_jax.ggml_vec.AVX2`: 8-lane dots and exp)
for every K/V type; for Q8_0 and Q4_0 K/V both run the same AVX2 code
(:mod:`fa_jax.ggml_blocks`; glibc's expf and FMAs otherwise).  Builds without AVX2,
FMA and F16C, and BF16 K/V on an AVX-512 build without AVX512-BF16, are refused.
:func:`model`'s ``isa`` (``"AVX512"`` or ``"AVX2"``) names the build's code instead.
"""

from __future__ import annotations

import functools
import platform as _platform

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ggml_attention as ga
from fa_jax import ggml_vec
from fa_jax._checks import one_of, positive_int
from fa_jax.formats import FP32, Format, get_format
from fa_jax.kernels import cpu, ggml_lib
from fa_jax.kernels.model import Kernel, KernelModel, refuse
from fa_jax.presets import fa2_kernel

__all__ = ["GGML", "ISAS", "KV_TYPES", "model", "path", "real", "unmodelled"]

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
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
    if not causal:
        return None
    return np.where(np.arange(m)[None, :] <= np.arange(n)[:, None], 0.0, -np.inf)


def _scale(scale, d: int) -> float:
    return float(np.float32(1.0 / np.sqrt(d) if scale is None else scale))


def _as4(t: np.ndarray) -> np.ndarray:
    """(..., N, d) as (B, H, N, d) with B = 1 and H = the product of the leading axes."""
    return np.asarray(t, np.float32).reshape(1, -1, *t.shape[-2:])


def real(
    q, k, v, *, fmt, causal: bool = False, scale=None, kv_type: str | None = None, threads=1
) -> np.ndarray:
    """ggml's output (..., N, d_v) as float64."""
    kv = _kv_type(fmt, kv_type)
    threads = positive_int(threads, "ggml: threads")
    q = np.asarray(q)
    n, m = q.shape[-2], np.shape(k)[-2]
    out = ggml_lib.flash_attn_ext(
        _as4(q),
        _as4(np.asarray(k)),
        _as4(np.asarray(v)),
        _mask(n, m, causal),
        _scale(scale, q.shape[-1]),
        kv,
        threads,
    )
    return out.reshape(*q.shape[:-1], np.shape(v)[-1]).astype(np.float64)


def _stored(x, kv: str):
    """K or V as ggml stores them (dequantized values), float64 carrier."""
    from fa_jax.rounding import round_to

    if kv == "f32":
        return x
    if kv in ("f16", "bf16"):
        return round_to(x, get_format("fp16" if kv == "f16" else "bf16"))
    from fa_jax import ggml_blocks

    return ggml_blocks.dequantize(*ggml_blocks.quantize_ref(x, kv), kv)


def _forward(q, k, v, *, policy, causal, scale, kv: str, threads: int, code: ggml_vec.VecCode):
    del policy
    q, k, v = (jnp.asarray(t, jnp.float64) for t in (q, k, v))
    return _forward_jit(
        q, k, v, causal=bool(causal), scale=scale, kv=kv, threads=threads, code=code
    )


@functools.partial(jax.jit, static_argnames=("causal", "scale", "kv", "threads", "code"))
def _forward_jit(q, k, v, *, causal: bool, scale, kv: str, threads: int, code):
    from fa_jax.rounding import round_to

    lead, n, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    m, d_v = k.shape[-2], v.shape[-1]
    qf = jnp.asarray(q).reshape(-1, d)  # rows (heads·N, d)
    h = qf.shape[0] // n
    kf = _stored(jnp.asarray(k).reshape(h, m, d), kv)
    vf = _stored(jnp.asarray(v).reshape(h, m, d_v), kv)
    kr = jnp.repeat(kf, n, axis=0)
    vr = jnp.repeat(vf, n, axis=0)
    mask = _mask(n, m, causal)
    mr = None if mask is None else jnp.tile(jnp.asarray(mask), (h, 1))
    sc = _scale(scale, d)
    which = path(n, m, 1, kv)
    if which == "tiled":
        out = ga.tiled(qf, kr, vr, mr, scale=sc, code=code)
    else:
        if kv in ("f32", "f16", "bf16"):
            qd = qf if kv == "f32" else round_to(qf, get_format("fp16" if kv == "f16" else "bf16"))
            scores = ga.dot(qd, kr, kv, code)
        else:
            from fa_jax import ggml_blocks

            raw = jnp.repeat(k.reshape(h, m, d), n, axis=0)
            scores = ggml_blocks.dot(qf, raw, kv)
        if which == "split-kv":
            out = ga.split_kv(scores, vr, mr, scale=sc, v_fp16=kv == "f16", threads=threads)
        else:
            out = ga.scalar(scores, vr, mr, scale=sc, v_fp16=kv == "f16")
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


def unmodelled(fmt=None, *, kv_type: str | None = None, threads=1) -> str | None:
    """None where the model follows the code ggml's build here runs for ``fmt`` K/V
    stored as ``kv_type`` (every K/V type where ``fmt`` is None), else why not
    (module docstring)."""
    del threads
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
    isa: str | None = None,
) -> KernelModel:
    """fa_jax's model of ``ggml`` for ``fmt`` inputs stored as ``kv_type`` with
    ``threads`` threads (the split-KV path's output depends on it), following the
    vector code of the build ``isa`` names (``"AVX512"`` or ``"AVX2"``); None: the
    build here, NotImplementedError where it runs other code (:func:`unmodelled`)."""
    del n, d
    kv = _kv_type(fmt, kv_type)
    threads = positive_int(threads, "ggml: threads")
    if isa is None:
        refuse(unmodelled(fmt, kv_type=kv))
        code = _code(_build())
    else:
        code = ggml_vec.CODES[one_of(isa, ISAS, "ggml: isa")]
    policy = fa2_kernel(FP32).replace(name=f"ggml_cpu({kv})")
    forward = functools.partial(_forward, kv=kv, threads=threads, code=code)
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
    options=("kv_type", "threads"),
    unmodelled=unmodelled,
)
