"""The kernel registry: real kernels and fa_jax's models of them, by name.

Built-in kernels are registered on first use from the modules that define them
(``xla``; ``torch-math`` and ``torch-flash``; ``cudnn``, ``torch-cuda-flash`` and
``torch-cuda-mem-efficient``), so that importing :mod:`fa_jax.kernels` imports
neither PyTorch nor the kernels' modules.  :func:`real` runs a kernel,
:func:`emulate` runs fa_jax's model of it on the same inputs.

Both take the features of :data:`fa_jax.kernels.model.FEATURES` (``bias``,
``mask``, ``window``, ``kv_lengths``, ``q_offset``, ``softcap``, ``sinks``; K
and V with H_kv heads dividing H) and a
kernel's own keyword options (``Kernel.options``); they are checked here once,
and a kernel asked for a feature it does not declare (``Kernel.features``)
raises ValueError naming the kernel, the feature and what it supports.  A
feature not given is not passed on, so a kernel without features is called as
before.  ``q_offset`` is passed on as an int where it is not 0 (top-left: no
feature); a causal call with N != M must name its alignment (``q_offset``
"top-left" or "bottom-right"), since kernels differ in the one they take, and
reaches only a kernel that declares ``q_offset``.

:func:`timed_calls` puts a timer around every :func:`real` and :func:`emulate`
call (labelled "<kernel> real", "<kernel> model") while it is active: how
``fa-jax validate --profile`` says where its time goes
(:class:`fa_jax.studies.profile.CallProfile`).
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import numpy as np

from fa_jax.formats import Format, get_format
from fa_jax.kernels.model import FEATURES, Kernel, KernelModel

__all__ = [
    "available",
    "emulate",
    "get",
    "model",
    "names",
    "real",
    "register",
    "timed_calls",
]

# Built-in kernel name -> (module, attribute holding its Kernel).
_BUILTINS = {
    "xla": ("fa_jax.kernels.xla", "XLA"),
    "torch-math": ("fa_jax.kernels.torch_cpu", "TORCH_MATH"),
    "torch-flash": ("fa_jax.kernels.torch_cpu", "TORCH_FLASH"),
    "cudnn": ("fa_jax.kernels.cuda", "CUDNN"),
    "torch-cuda-flash": ("fa_jax.kernels.cuda", "TORCH_CUDA_FLASH"),
    "torch-cuda-mem-efficient": ("fa_jax.kernels.cuda", "TORCH_CUDA_MEM_EFFICIENT"),
    "ggml": ("fa_jax.kernels.ggml", "GGML"),
    "onnxruntime-attention": ("fa_jax.kernels.onnxruntime", "ONNXRUNTIME_ATTENTION"),
    "onnxruntime-mha": ("fa_jax.kernels.onnxruntime", "ONNXRUNTIME_MHA"),
    "onnxruntime-gqa": ("fa_jax.kernels.onnxruntime.gqa", "ONNXRUNTIME_GQA"),
    "openvino-sdpa": ("fa_jax.kernels.openvino", "OPENVINO_SDPA"),
}
_REGISTERED: dict[str, Kernel] = {}
_TIMERS: list[Callable[[str], AbstractContextManager]] = []


@contextlib.contextmanager
def timed_calls(timer: Callable[[str], AbstractContextManager]) -> Iterator[None]:
    """While the block runs, every :func:`real` and :func:`emulate` call runs inside
    ``timer(label)`` (module docstring)."""
    _TIMERS.append(timer)
    try:
        yield
    finally:
        _TIMERS.remove(timer)


def _timed(label: str) -> AbstractContextManager:
    return _TIMERS[-1](label) if _TIMERS else contextlib.nullcontext()


def register(kernel: Kernel) -> None:
    """Add (or replace) a kernel under ``kernel.name``."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"register: expected a fa_jax.kernels.Kernel, got {kernel!r}")
    _REGISTERED[kernel.name] = kernel


def names() -> list[str]:
    """Every known kernel name, built-in or registered, available here or not."""
    return sorted(set(_BUILTINS) | set(_REGISTERED))


def _lookup(name: str) -> Kernel:
    """The kernel called ``name``, loading a built-in's module on first use."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTINS:
        raise ValueError(f"unknown kernel {name!r}: expected one of {names()}")
    module, attribute = _BUILTINS[name]
    kernel = getattr(importlib.import_module(module), attribute)
    _REGISTERED.setdefault(name, kernel)
    return _REGISTERED[name]


def get(name: str) -> Kernel:
    """The kernel called ``name``; RuntimeError with the reason if it cannot run here."""
    kernel = _lookup(name)
    reason = kernel.unavailable()
    if reason is not None:
        raise RuntimeError(f"kernel {name!r} is not available here: {reason}")
    return kernel


def available() -> list[str]:
    """The names of the kernels that run here."""
    out = []
    for name in names():
        try:
            kernel = _lookup(name)
        except (ImportError, AttributeError):
            continue  # a built-in whose module is missing or incomplete
        if kernel.unavailable() is None:
            out.append(name)
    return out


def _native_format(kernel: Kernel, fmt) -> Format:
    fmt = get_format(fmt)
    if fmt.name not in {get_format(name).name for name in kernel.formats}:
        raise ValueError(
            f"kernel {kernel.name!r}: format: expected one it runs natively, one of "
            f"{kernel.formats}, got {fmt.name!r}"
        )
    return fmt


def _shapes(q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v as float64 numpy arrays after checking (..., H, N, d), (..., H_kv, M, d),
    (..., H_kv, M, d_v) with H_kv dividing H (equal leading dimensions otherwise)."""
    from fa_jax.heads import kv_groups

    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            "kernel: expected q (..., N, d), k (..., M, d), v (..., M, d_v) of equal rank "
            f"at least 2, got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if (
        q.shape[-1] != k.shape[-1]
        or k.shape[-2] != v.shape[-2]
        or k.shape[:-2] != v.shape[:-2]
        or 0 in q.shape + k.shape + v.shape
    ):
        raise ValueError(
            "kernel: expected q (..., N, d), k (..., M, d), v (..., M, d_v) with equal "
            f"leading dimensions and no empty axis, got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    kv_groups("kernel", q.shape, k.shape, v.shape)  # H_kv dividing H, else ValueError
    return q, k, v


def _exact_in(fmt: Format, **arrays: np.ndarray) -> None:
    """ValueError unless every value is exact in ``fmt``: its round trip through the
    format's numpy or ml_dtypes storage type gives it back (any correct cast path
    returns an exact value and moves an inexact one), else ``round_to`` (a format
    with no storage type)."""
    from fa_jax._x64 import float64_enabled
    from fa_jax.rounding import round_to

    dtype = fmt.dtype
    for name, t in arrays.items():
        if dtype is not None:
            with np.errstate(over="ignore", invalid="ignore"):
                back = np.asarray(t, np.float64).astype(dtype).astype(np.float64)
        else:
            with float64_enabled():
                back = np.asarray(round_to(t, fmt))
        if not np.array_equal(back, t, equal_nan=True):
            raise ValueError(
                f"kernel: {name}: expected values exact in {fmt.name} "
                f"(round them with fa_jax.round_to first)"
            )


def _inputs(kernel: Kernel, q, k, v, fmt, causal: bool, q_offset):
    fmt = _native_format(kernel, fmt)
    q, k, v = _shapes(q, k, v)
    _exact_in(fmt, q=q, k=k, v=v)
    n, m = q.shape[-2], k.shape[-2]
    if causal and q_offset is None and n != m:
        raise ValueError(
            f"kernel: causal: expected N == M, or q_offset naming the mask's alignment "
            f"('top-left' or 'bottom-right', as kernels differ), got N = {n}, "
            f"M = {m} and no q_offset"
        )
    if causal and n != m and "q_offset" not in kernel.features:
        raise ValueError(
            f"kernel {kernel.name!r}: causal: expected N == M (its model was checked with "
            f"causal masks on square score matrices only; it declares no q_offset), got "
            f"N = {n}, M = {m}"
        )
    return fmt, q, k, v


def _features(kernel: Kernel, fmt: Format, q, k, causal: bool, given: dict, options: dict) -> dict:
    """The features given (not None), checked against the inputs and against what
    ``kernel`` supports, then its own options after theirs: what its ``real`` and
    its model get."""
    from fa_jax._checks import broadcasts_to
    from fa_jax.masking import check_broadcast, check_q_offset, check_window
    from fa_jax.score_mods import check_sink_values, check_softcap

    target = (*q.shape[:-1], k.shape[-2])  # (..., H, N, M)
    out: dict = {}
    if given["bias"] is not None:
        bias = np.asarray(given["bias"])
        if not np.issubdtype(bias.dtype, np.floating):
            raise ValueError(f"kernel: bias: expected a float array, got dtype {bias.dtype}")
        check_broadcast("kernel", "bias", bias, target)
        bias = bias.astype(np.float64)
        if np.isnan(bias).any() or (bias == np.inf).any():
            raise ValueError("kernel: bias: expected finite values or -inf, got NaN or +inf")
        _exact_in(fmt, bias=bias)
        out["bias"] = bias
    if given["mask"] is not None:
        mask = np.asarray(given["mask"])
        if mask.dtype != np.bool_:
            raise ValueError(
                f"kernel: mask: expected a boolean array (True = keep), got dtype {mask.dtype}"
            )
        check_broadcast("kernel", "mask", mask, target)
        out["mask"] = mask
    window = check_window(given["window"], "kernel")
    if window is not None:
        out["window"] = window
    offset = check_q_offset(
        given["q_offset"], q.shape[-2], k.shape[-2], causal=causal, window=window, fn="kernel"
    )
    if offset:
        out["q_offset"] = offset
    cap = check_softcap(given["softcap"], "kernel")
    if cap is not None:
        out["softcap"] = cap
    if given["sinks"] is not None:
        sinks = np.asarray(given["sinks"])
        lead = q.shape[:-2]
        if not broadcasts_to(sinks.shape, lead) or not np.issubdtype(sinks.dtype, np.floating):
            raise ValueError(
                f"kernel: sinks: expected floats broadcastable to the leading dimensions "
                f"{lead} (a logit per head), got {sinks.dtype} of shape {sinks.shape}"
            )
        check_sink_values(sinks, "kernel")
        _exact_in(get_format("fp32"), sinks=sinks.astype(np.float64))
        out["sinks"] = sinks.astype(np.float64)
    if given["kv_lengths"] is not None:
        lengths = np.asarray(given["kv_lengths"])
        lead = q.shape[:-2]
        if not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"kernel: kv_lengths: expected integers, got dtype {lengths.dtype}")
        in_range = lengths.min() >= 0 and lengths.max() <= k.shape[-2]
        if not broadcasts_to(lengths.shape, lead) or not in_range:
            raise ValueError(
                f"kernel: kv_lengths: expected integers in [0, M = {k.shape[-2]}] "
                f"broadcastable to the leading dimensions {lead}, got shape "
                f"{lengths.shape}, values in [{lengths.min()}, {lengths.max()}]"
            )
        out["kv_lengths"] = lengths.astype(np.int64)
    used = [name for name in FEATURES if name in out]
    if k.shape[:-2] != q.shape[:-2]:
        used.append("gqa")
    for name in used:
        if name not in kernel.features:
            raise ValueError(
                f"kernel {kernel.name!r}: {name}: not supported by this kernel; it "
                f"supports {sorted(kernel.features) or 'no features'}"
            )
    for name in options:
        if name not in kernel.options:
            raise ValueError(
                f"kernel {kernel.name!r}: unknown option {name!r}: expected one of "
                f"{list(kernel.options) or 'none'}"
            )
    return {**out, **options}


def _checked(kernel: Kernel, q, k, v, fmt, causal: bool, given: dict, options: dict):
    """(fmt, q, k, v, the features and options): the inputs and the keywords of a
    call of ``kernel``, each checked once (:func:`_inputs`, :func:`_features`)."""
    fmt, q, k, v = _inputs(kernel, q, k, v, fmt, causal, given["q_offset"])
    return fmt, q, k, v, _features(kernel, fmt, q, k, causal, given, options)


def real(
    name: str,
    q,
    k,
    v,
    *,
    fmt,
    causal: bool = False,
    scale=None,
    bias=None,
    mask=None,
    window=None,
    kv_lengths=None,
    q_offset=None,
    softcap=None,
    sinks=None,
    **options,
) -> np.ndarray:
    """The real kernel's output (..., N, d_v) as float64 (module docstring);
    ``options`` are the kernel's own keywords (``ggml``: ``kv_type``, ``threads``)."""
    kernel = get(name)
    given = {
        "bias": bias,
        "mask": mask,
        "window": window,
        "kv_lengths": kv_lengths,
        "q_offset": q_offset,
        "softcap": softcap,
        "sinks": sinks,
    }
    fmt, q, k, v, extra = _checked(kernel, q, k, v, fmt, causal, given, options)
    with _timed(f"{name} real"):
        out = kernel.real(q, k, v, fmt=fmt, causal=causal, scale=scale, **extra)
        return np.asarray(out, np.float64)


def model(name: str, fmt, n: int, d: int) -> KernelModel:
    """fa_jax's model of the kernel for format ``fmt`` and (N, d); needs no real kernel."""
    from fa_jax._checks import positive_int

    kernel = _lookup(name)
    return kernel.model(
        _native_format(kernel, fmt), positive_int(n, "model: n"), positive_int(d, "model: d")
    )


def emulate(
    name: str,
    q,
    k,
    v,
    *,
    fmt,
    causal: bool = False,
    scale=None,
    bias=None,
    mask=None,
    window=None,
    kv_lengths=None,
    q_offset=None,
    softcap=None,
    sinks=None,
    **options,
) -> np.ndarray:
    """fa_jax's emulation of the kernel on the same inputs, float64 (..., N, d_v):
    its model built for ``options`` (as for :func:`real`), called with the features."""
    kernel = _lookup(name)
    given = {
        "bias": bias,
        "mask": mask,
        "window": window,
        "kv_lengths": kv_lengths,
        "q_offset": q_offset,
        "softcap": softcap,
        "sinks": sinks,
    }
    fmt, q, k, v, extra = _checked(kernel, q, k, v, fmt, causal, given, options)
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"emulate: scale: expected a finite number, got {scale!r}")
    features = {name: x for name, x in extra.items() if name not in options}
    with _timed(f"{name} model"):
        m = kernel.model(fmt, q.shape[-2], q.shape[-1], **options)
        return m(q, k, v, causal=causal, scale=scale, **features)
