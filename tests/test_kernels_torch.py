"""fa_jax.kernels.torch_cpu: fa_jax's models of PyTorch's CPU SDPA kernels against
the real kernels, bit for bit (the share of identical output elements, and every
mismatch within 1 ulp of the format)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from helpers import x64_enabled  # noqa: E402

from fa_jax import BF16, FP16, FP32  # noqa: E402
from fa_jax.attention import Blocks  # noqa: E402
from fa_jax.kernels import torch_cpu  # noqa: E402
from fa_jax.rounding import round_to  # noqa: E402

FORMATS = {"bf16": BF16, "fp16": FP16}
KERNELS = {"math": torch_cpu.TORCH_MATH, "flash": torch_cpu.TORCH_FLASH}

needs_avx2 = pytest.mark.skipif(
    torch_cpu.capability() != "AVX2",
    reason="the torch-flash model covers AVX2's vector loop only",
)


def _inputs(shape, fmt, seed):
    rng = np.random.default_rng(seed)
    with x64_enabled():
        return [np.asarray(round_to(rng.standard_normal(shape), fmt)) for _ in range(3)]


def _ulps(a, b, fmt):
    big = np.maximum(np.abs(a), np.abs(b))
    e = np.maximum(np.floor(np.log2(np.where(big > 0, big, 1.0))), 1 - fmt.bias)
    return np.abs(a - b) / 2.0 ** (e - fmt.man_bits)


def _check(kernel, fmt, shape, causal, seed=0):
    q, k, v = _inputs(shape, fmt, seed)
    real = kernel.real(q, k, v, fmt=fmt, causal=causal)
    emulated = kernel.model(fmt, shape[-2], shape[-1])(q, k, v, causal=causal)
    assert real.shape == emulated.shape == shape
    share = np.mean(real == emulated)
    assert share >= 0.999, f"{kernel.name} {fmt.name} {shape} causal={causal}: {share:.5%}"
    assert _ulps(real, emulated, fmt).max() <= 1.0


@needs_avx2
@pytest.mark.parametrize("kernel", ["math", "flash"])
@pytest.mark.parametrize("fmt, causal", [("bf16", False), ("fp16", True)])
def test_bit_identical_small(kernel, fmt, causal):
    """A query and key count that leaves a scalar tail (100 = 12 vectors + 4) and an
    odd head dimension."""
    _check(KERNELS[kernel], FORMATS[fmt], (1, 2, 100, 40), causal)


@needs_avx2
@pytest.mark.parametrize(
    "kernel", [pytest.param("math", marks=pytest.mark.slow), "flash"]
)  # one key block: the flash loop's no-rescaling path; math has no blocks
@pytest.mark.parametrize("fmt, causal", [("fp16", False), ("bf16", True)])
def test_bit_identical_one_key_block(kernel, fmt, causal):
    _check(KERNELS[kernel], FORMATS[fmt], (1, 1, 256, 64), causal)


@pytest.mark.slow
@needs_avx2
@pytest.mark.parametrize("kernel", ["math", "flash"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 512, 64), (1, 1, 1100, 64), (2, 4, 1024, 128)])
def test_bit_identical(kernel, fmt, causal, shape):
    """Several key blocks (the rescaling), and a last key block of 76 keys."""
    _check(KERNELS[kernel], FORMATS[fmt], shape, causal, seed=1)


def test_flash_blocks_follow_the_kernels_rule():
    assert torch_cpu.flash_blocks(100, 100) == Blocks(32, 100)
    assert torch_cpu.flash_blocks(192, 192) == Blocks(64, 192)
    assert torch_cpu.flash_blocks(768, 768) == Blocks(256, 512)
    assert torch_cpu.flash_blocks(4096, 4096) == Blocks(256, 512)


def test_unmodelled_capability_is_refused():
    with pytest.raises(ValueError, match="CPU capability"):
        torch_cpu.flash_model(BF16, 512, 64, cpu_capability="AVX512")
    with pytest.raises(ValueError, match="CPU capability"):
        torch_cpu.math_model(BF16, 512, 64, cpu_capability="DEFAULT")
    model = torch_cpu.flash_model(BF16, 512, 64, cpu_capability="AVX2")
    assert model.policy.normalise == "reciprocal" and model.blocks == Blocks(64, 512)


def test_platform_and_formats():
    facts = torch_cpu.platform()
    assert facts["torch"] == torch.__version__ and facts["cpu_capability"]
    assert torch_cpu.TORCH_MATH.unavailable() is None
    with pytest.raises(ValueError, match="format"):
        torch_cpu.real_flash(
            np.zeros((1, 4, 8)), np.zeros((1, 4, 8)), np.zeros((1, 4, 8)), fmt=FP32
        )
