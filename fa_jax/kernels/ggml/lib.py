"""ggml's C library through ctypes: one ``ggml_flash_attn_ext`` node, run on the CPU.

ggml (the tensor library of llama.cpp) is found, in this order, in the folder named
by ``FA_JAX_GGML_LIB``, in the cache folder that ``experiments/build_ggml.py`` builds
into (``$XDG_CACHE_HOME/fa_jax/ggml/lib``, default ``~/.cache/fa_jax/ggml/lib``), or
in an installed ``llama_cpp`` package (``llama_cpp/lib``).  It needs
``libggml-base``, ``libggml-cpu`` and ``libggml``.

The calls follow ``ggml/include/ggml.h`` and ``ggml-cpu.h`` (ggml 0.25.3, as vendored
by llama-cpp-python 0.3.36): ``ggml_init(struct ggml_init_params {size_t mem_size;
void *mem_buffer; bool no_alloc;})``, ``ggml_new_tensor_4d``, ``ggml_flash_attn_ext(ctx,
q, k, v, mask, scale, max_bias, logit_softcap)`` with q ``[D, N, H, B]`` F32, k and v
``[D, M, H_kv, B]`` of the K/V type (H_kv dividing H), mask ``[M, N, H_m, B_m]`` F16
(H_m dividing H, B_m dividing B: broadcast) and the result ``[D_v, H, N, B]``
(permuted), ``ggml_flash_attn_ext_add_sinks(result, sinks)`` with sinks ``[H]`` F32,
``ggml_graph_compute_with_ctx(ctx, graph, n_threads)``.
Quantized K/V are made by ggml's own ``ggml_quantize_chunk`` from F32 values.
:func:`build_features` reads the x86 features the loaded ``libggml-cpu`` was
compiled for (``ggml_cpu_has_avx512`` and the like): its code is chosen when it is
built (``GGML_NATIVE``: the building CPU's), not when it runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

__all__ = [
    "BUILD_FEATURES",
    "GGML_TYPES",
    "build_features",
    "flash_attn_ext",
    "library_dir",
    "unavailable",
]

# enum ggml_type (ggml.h)
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
_NAMES = ("ggml-base", "ggml-cpu", "ggml")
# The x86 features a build reports (ggml-cpu.h: ggml_cpu_has_<name>), by those names.
BUILD_FEATURES = ("sse3", "avx", "avx2", "fma", "f16c", "avx512", "avx512_bf16", "amx_int8")


class _InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fa_jax" / "ggml" / "lib"


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get("FA_JAX_GGML_LIB")
    if env:
        out.append(Path(env))
    out.append(_cache_dir())
    try:
        import importlib.util

        spec = importlib.util.find_spec("llama_cpp")
        if spec is not None and spec.origin is not None:
            out.append(Path(spec.origin).parent / "lib")
    except (ImportError, ValueError):
        pass
    return out


def _has_libs(folder: Path) -> bool:
    return all((folder / f"lib{name}.so").exists() for name in _NAMES)


def library_dir() -> Path | None:
    """The first folder holding ggml's three libraries, or None."""
    for folder in _candidates():
        if _has_libs(folder):
            return folder
    return None


def unavailable() -> str | None:
    """None where ggml's libraries load here, else the reason."""
    folder = library_dir()
    if folder is None:
        places = ", ".join(str(p) for p in _candidates())
        return (
            f"ggml's libraries (lib{{ggml-base,ggml-cpu,ggml}}.so) not found in {places}; "
            "build them with experiments/build_ggml.py or set FA_JAX_GGML_LIB"
        )
    try:
        _libs()
    except OSError as error:
        return f"ggml's libraries in {folder} do not load: {error}"
    return None


@functools.cache
def _libs():
    folder = library_dir()
    if folder is None:
        raise OSError("ggml's libraries not found")
    base, cpu, main = (
        ctypes.CDLL(str(folder / f"lib{name}.so"), mode=ctypes.RTLD_GLOBAL) for name in _NAMES
    )
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    base.ggml_init.argtypes, base.ggml_init.restype = [_InitParams], p
    base.ggml_free.argtypes, base.ggml_free.restype = [p], None
    base.ggml_new_tensor_4d.argtypes = [p, ctypes.c_int, i64, i64, i64, i64]
    base.ggml_new_tensor_4d.restype = p
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [p], p
    base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [p], ctypes.c_size_t
    base.ggml_flash_attn_ext.argtypes = [p, p, p, p, p, f32, f32, f32]
    base.ggml_flash_attn_ext.restype = p
    base.ggml_flash_attn_ext_add_sinks.argtypes = [p, p]
    base.ggml_flash_attn_ext_add_sinks.restype = None
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [p], p
    base.ggml_build_forward_expand.argtypes, base.ggml_build_forward_expand.restype = [p, p], None
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, p, p, i64, i64, i64, p]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_fp32_to_fp16_row.argtypes = [p, p, i64]
    base.ggml_fp32_to_bf16_row.argtypes = [p, p, i64]
    cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_cpu_init.argtypes, cpu.ggml_cpu_init.restype = [], None
    cpu.ggml_cpu_init()
    del main
    return base, cpu


@functools.cache
def build_features() -> frozenset[str]:
    """The features of :data:`BUILD_FEATURES` the loaded ``libggml-cpu`` was compiled
    for (OSError where the libraries do not load)."""
    _, cpu = _libs()
    out = set()
    for name in BUILD_FEATURES:
        fn = getattr(cpu, f"ggml_cpu_has_{name}")
        fn.argtypes, fn.restype = [], ctypes.c_int
        if fn():
            out.add(name)
    return frozenset(out)


def _fill(base, tensor, x: np.ndarray, kind: str) -> None:
    """Write the F32 array ``x`` (rows of its last axis) into ``tensor`` as ``kind``."""
    x = np.ascontiguousarray(x, np.float32)
    dst = base.ggml_get_data(tensor)
    n = x.size
    src = x.ctypes.data_as(ctypes.c_void_p)
    if kind == "f32":
        ctypes.memmove(dst, src, 4 * n)
    elif kind == "f16":
        base.ggml_fp32_to_fp16_row(src, dst, n)
    elif kind == "bf16":
        base.ggml_fp32_to_bf16_row(src, dst, n)
    else:
        row = x.shape[-1]
        base.ggml_quantize_chunk(GGML_TYPES[kind], src, dst, 0, n // row, row, None)


def flash_attn_ext(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
    kv_type: str,
    threads: int,
    *,
    max_bias: float = 0.0,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """ggml's CPU flash attention of F32 q (B, H, N, D), k (B, H_kv, M, D), v (B, H_kv,
    M, D_v) stored as ``kv_type``, an optional additive mask (N, M) or (B_m, H_m, N,
    M) stored as F16, ALiBi's ``max_bias``, the ``softcap`` (``logit_softcap``; 0:
    none) and optional sinks (H,) F32; returns float32 (B, H, N, D_v)."""
    base, cpu = _libs()
    b, h, n, d = q.shape
    _, h_kv, m, d_v = v.shape
    if mask is not None:
        mask = np.asarray(mask, np.float32)
        mask = mask.reshape(1, 1, *mask.shape) if mask.ndim == 2 else mask
    size = 4 * (q.size + k.size + v.size + b * h * n * d_v + h) + 64 * 1024 * 1024
    size += 0 if mask is None else 2 * mask.size
    ctx = base.ggml_init(_InitParams(size, None, False))
    if not ctx:
        raise RuntimeError("ggml_init failed")
    try:
        t = GGML_TYPES[kv_type]
        tq = base.ggml_new_tensor_4d(ctx, GGML_TYPES["f32"], d, n, h, b)
        tk = base.ggml_new_tensor_4d(ctx, t, d, m, h_kv, b)
        tv = base.ggml_new_tensor_4d(ctx, t, d_v, m, h_kv, b)
        _fill(base, tq, q, "f32")
        _fill(base, tk, k, kv_type)
        _fill(base, tv, v, kv_type)
        tm = None
        if mask is not None:
            b_m, h_m = mask.shape[:2]
            tm = base.ggml_new_tensor_4d(ctx, GGML_TYPES["f16"], m, n, h_m, b_m)
            _fill(base, tm, mask, "f16")
        out = base.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, scale, max_bias, softcap)
        if sinks is not None:
            ts = base.ggml_new_tensor_4d(ctx, GGML_TYPES["f32"], h, 1, 1, 1)
            _fill(base, ts, np.asarray(sinks, np.float32).reshape(h), "f32")
            base.ggml_flash_attn_ext_add_sinks(out, ts)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        status = cpu.ggml_graph_compute_with_ctx(ctx, graph, threads)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute_with_ctx failed with status {status}")
        res = np.empty((b, n, h, d_v), np.float32)
        ctypes.memmove(res.ctypes.data, base.ggml_get_data(out), res.nbytes)
    finally:
        base.ggml_free(ctx)
    return res.transpose(0, 2, 1, 3).copy()
