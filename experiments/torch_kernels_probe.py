"""Bit-identical share of fa_jax's models of PyTorch's CPU attention kernels.

For each kernel, format, shape (B, H, N, d), causal flag and seed: the share of
output elements equal to the real kernel's, and the largest mismatch in ulps of
the format.  Usage: python experiments/torch_kernels_probe.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

from fa_jax import BF16, FP16
from fa_jax._x64 import float64_enabled
from fa_jax.kernels import torch_cpu
from fa_jax.rounding import round_to

SHAPES = ((1, 2, 512, 64), (2, 4, 1024, 128), (1, 1, 4096, 64))


def inputs(shape, fmt, seed):
    rng = np.random.default_rng(seed)
    with float64_enabled():
        return [np.asarray(round_to(rng.standard_normal(shape), fmt)) for _ in range(3)]


def ulps(a, b, fmt):
    """|a - b| in ulps of fmt at the larger magnitude."""
    big = np.maximum(np.abs(a), np.abs(b))
    e = np.floor(np.log2(np.where(big > 0, big, 1.0)))
    e = np.maximum(e, 1 - (2 ** (fmt.exp_bits - 1) - 1))
    return np.abs(a - b) / 2.0 ** (e - fmt.man_bits)


def compare(kernel, fmt, shape, causal, seed, model=None):
    q, k, v = inputs(shape, fmt, seed)
    real = kernel.real(q, k, v, fmt=fmt, causal=causal)
    model = model or kernel.model(fmt, shape[-2], shape[-1])
    t = time.perf_counter()
    emulated = model(q, k, v, causal=causal)
    dt = time.perf_counter() - t
    same = real == emulated
    return same.mean(), ulps(real, emulated, fmt).max(), dt


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kernel", default="both", choices=("math", "flash", "both"))
    args = parser.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    kernels = {"math": torch_cpu.TORCH_MATH, "flash": torch_cpu.TORCH_FLASH}
    names = list(kernels) if args.kernel == "both" else [args.kernel]
    print(torch_cpu.platform())
    print("kernel  fmt       shape              causal  seed  identical   max_ulp  model_s")
    for name, fmt, shape, causal, seed in itertools.product(
        names, (BF16, FP16), shapes, (False, True), (0, 1)
    ):
        share, worst, dt = compare(kernels[name], fmt, shape, causal, seed)
        print(
            f"{name:<7} {fmt.name:<9} {shape!s:<18} {causal!s:<7} {seed:<5} "
            f"{100 * share:8.4f}%  {worst:7.2f}  {dt:6.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
