"""GPU attention kernels (CUDA): cuDNN through JAX, PyTorch's CUDA flash and
memory-efficient scaled-dot-product attention.

* ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")``, cuDNN's
  fused flash attention (jax/_src/cudnn/fused_attention_stablehlo.py).
* ``torch-cuda-flash``: ``torch.nn.functional.scaled_dot_product_attention`` with
  only the FLASH_ATTENTION backend enabled (FlashAttention-2, Dao 2023).
* ``torch-cuda-mem-efficient``: the same call with only EFFICIENT_ATTENTION (the
  memory-efficient kernel of Rabe & Staats 2021 as implemented in xFormers).

Each runs only on a CUDA GPU; ``unavailable()`` says why not otherwise.  Their
models are the closest fa_jax preset, FlashAttention-2's policy with the tiled
fa2 recurrence (Dao 2023, Algorithm 1) at the kernels' usual tile sizes, and
are NOT validated bit for bit against the real kernels.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np

from fa_jax.attention import Blocks
from fa_jax.formats import Format
from fa_jax.kernels.model import Kernel, KernelModel, flat_heads, heads_call
from fa_jax.presets import fa2_kernel

__all__ = ["CUDNN", "TORCH_CUDA_FLASH", "TORCH_CUDA_MEM_EFFICIENT"]

_NO_TORCH = "PyTorch is not installed (pip install 'fa-jax[kernels]')"
_NO_GPU = "no CUDA GPU"


def _jax_gpu_unavailable() -> str | None:
    import jax

    try:
        return None if jax.devices("gpu") else _NO_GPU
    except RuntimeError:
        return _NO_GPU


def _torch_gpu_unavailable() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return _NO_TORCH
    import torch

    return None if torch.cuda.is_available() else _NO_GPU


@functools.cache
def _cudnn_attention(dtype: str, causal: bool, scale):
    import jax

    return jax.jit(heads_call(dtype, causal, scale, "cudnn"), device=jax.devices("gpu")[0])


def _cudnn_real(q, k, v, *, fmt: Format, causal: bool = False, scale=None) -> np.ndarray:
    lead, (q, k, v) = flat_heads(q, k, v)
    run = _cudnn_attention(fmt.name, bool(causal), None if scale is None else float(scale))
    out = np.asarray(run(q, k, v), dtype=np.float64)
    return out.reshape(*lead, *out.shape[-2:])


def _torch_real(backend: str):
    def real(q, k, v, *, fmt: Format, causal: bool = False, scale=None) -> np.ndarray:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        lead, arrays = flat_heads(q, k, v)
        dtype = getattr(torch, fmt.name)
        q_t, k_t, v_t = (torch.from_numpy(t).to("cuda", dtype)[None] for t in arrays)
        with sdpa_kernel(getattr(SDPBackend, backend)), torch.no_grad():
            o = torch.nn.functional.scaled_dot_product_attention(
                q_t, k_t, v_t, is_causal=causal, scale=scale
            )
        out = o[0].float().cpu().numpy().astype(np.float64)
        return out.reshape(*lead, *out.shape[-2:])

    return real


def _model(kernel: str, bc: int):
    def model(fmt: Format, n: int, d: int) -> KernelModel:
        """The closest fa_jax preset (module docstring): unvalidated."""
        del d
        policy = fa2_kernel(fmt).replace(name=f"{kernel}({fmt.name})")
        return KernelModel(kernel, policy, "flash", Blocks(min(128, n), min(bc, n)), "fa2")

    return model


def _jax_platform() -> dict[str, str]:
    import importlib.metadata

    import jax

    facts = {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib")}
    if _jax_gpu_unavailable() is None:
        facts.update(backend="gpu", device=jax.devices("gpu")[0].device_kind)
    return facts


def _torch_platform() -> dict[str, str]:
    if importlib.util.find_spec("torch") is None:
        return {"torch": "not installed"}
    import torch

    facts = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    if torch.cuda.is_available():
        facts.update(backend="cuda", device=torch.cuda.get_device_name(0))
    return facts


CUDNN = Kernel(
    name="cudnn",
    description="jax.nn.dot_product_attention(implementation='cudnn') on a CUDA GPU "
    "(jax/_src/cudnn/fused_attention_stablehlo.py); model unvalidated",
    real=_cudnn_real,
    model=_model("cudnn", 128),
    unavailable=_jax_gpu_unavailable,
    platform=_jax_platform,
)
TORCH_CUDA_FLASH = Kernel(
    name="torch-cuda-flash",
    description="torch scaled_dot_product_attention, FLASH_ATTENTION backend, on a CUDA GPU "
    "(aten/src/ATen/native/transformers/cuda/flash_attn); model unvalidated",
    real=_torch_real("FLASH_ATTENTION"),
    model=_model("torch-cuda-flash", 128),
    unavailable=_torch_gpu_unavailable,
    platform=_torch_platform,
)
TORCH_CUDA_MEM_EFFICIENT = Kernel(
    name="torch-cuda-mem-efficient",
    description="torch scaled_dot_product_attention, EFFICIENT_ATTENTION backend, on a CUDA "
    "GPU (aten/src/ATen/native/transformers/cuda/mem_eff_attention); model unvalidated",
    real=_torch_real("EFFICIENT_ATTENTION"),
    model=_model("torch-cuda-mem-efficient", 64),
    unavailable=_torch_gpu_unavailable,
    platform=_torch_platform,
    formats=("bf16", "fp16", "fp32"),
)
