"""XLA's attention: ``jax.nn.dot_product_attention(..., implementation="xla")``.

The real kernel runs natively in bf16, fp16 and fp32 on JAX's default backend
(the CPU here).  What it computes (jax/_src/nn/functions.py,
``_dot_product_attention_core``):

    S = fl32(Q Kᵀ)                 bf16/fp16: BF16_BF16_F32 / F16_F16_F32 dot
    S = fl32(S · fl32(scale))      the scale rounded to float32, applied to S
    masked S := -0.7 · FLT_MAX     (not -inf)
    P = fl_in(softmax32(S))        m = max S; e = exp32(S - m); P = e / sum e
    O = fl_in(P V)                 a dot in the input format

so its model is FlashAttention-2's policy with the materialised (reference)
algorithm (Dao 2023 §3.1): Q, K, V, P and O in the input format, scores, the
softmax statistics and both accumulators FP32.
"""

from __future__ import annotations

import functools
import platform as _platform

import numpy as np

from fa_jax.formats import Format
from fa_jax.kernels.model import Kernel, KernelModel
from fa_jax.presets import fa2_kernel

__all__ = ["XLA", "model", "platform", "real"]


@functools.cache
def _attention(dtype: str, causal: bool, scale):
    import jax
    import jax.numpy as jnp

    def run(q, k, v):
        q, k, v = (jnp.swapaxes(t, -2, -3).astype(dtype) for t in (q, k, v))
        o = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="xla"
        )
        return jnp.swapaxes(o, -2, -3).astype(jnp.float32)

    return jax.jit(run)


def real(q, k, v, *, fmt: Format, causal: bool = False, scale=None) -> np.ndarray:
    """XLA's output for (..., N, d) inputs exact in ``fmt``, as float64."""
    q, k, v = (np.asarray(t, dtype=np.float32) for t in (q, k, v))
    lead = q.shape[:-2]
    run = _attention(fmt.name, bool(causal), None if scale is None else float(scale))
    q4, k4, v4 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    out = np.asarray(run(q4, k4, v4), dtype=np.float64)
    return out.reshape(*lead, *out.shape[-2:])


def model(fmt: Format, n: int, d: int) -> KernelModel:
    """fa_jax's model of XLA's attention in ``fmt`` (module docstring)."""
    del n, d
    policy = fa2_kernel(fmt).replace(name=f"xla({fmt.name})")
    return KernelModel("xla", policy, "reference")


def platform() -> dict[str, str]:
    """jax and jaxlib versions, the backend and device, the CPU."""
    import importlib.metadata

    import jax

    device = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "machine": _platform.machine(),
        "processor": _platform.processor() or _platform.machine(),
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
)
