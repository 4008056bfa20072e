"""Preset precision policies: paper_uniform, fa2_kernel, torch_math, golden.

Each names the forward and the backward stages (:mod:`fa_jax.policy`)."""

from __future__ import annotations

from fa_jax.accumulation import EXACT
from fa_jax.formats import FP32, FP64, get_format
from fa_jax.policy import STAGES, Policy

__all__ = ["PRESETS", "fa2_kernel", "get_policy", "golden", "paper_uniform", "torch_math"]


def paper_uniform(fmt, *, accumulation=EXACT) -> Policy:
    """Every stage in ``fmt``, forward and backward: the paper's re-implementation
    (Golden et al. 2024 §3), where one precision is chosen for the whole computation."""
    f = get_format(fmt)
    return Policy(*(f,) * len(STAGES), accumulation=accumulation, name=f"paper_uniform({f.name})")


def fa2_kernel(fmt, *, accumulation=EXACT) -> Policy:
    """A FlashAttention-2 kernel: Q, K, V and P in ``fmt``; scores, m, l, exp and all
    accumulators FP32; the output rounded once to ``fmt`` (Dao 2023 §3.1).

    Backward (Dao 2023 §3.2, Algorithm 2): dO in ``fmt``; the recomputed P, dP,
    D and dS in FP32 registers and every accumulator FP32; P and dS cast to
    ``fmt`` before the dV = Pᵀ dO and dQ, dK products; dQ, dK, dV written in ``fmt``.
    """
    f = get_format(fmt)
    return Policy(
        inputs=f,
        qk_acc=FP32,
        scores=FP32,
        stats=FP32,
        exp=FP32,
        p=f,
        pv_acc=FP32,
        o_acc=FP32,
        out=f,
        d_out=f,
        d_acc=FP32,
        d_p=FP32,
        d_stats=FP32,
        d_s=f,
        grads=f,
        accumulation=accumulation,
        name=f"fa2_kernel({f.name})",
    )


def torch_math(fmt, *, accumulation=EXACT) -> Policy:
    """PyTorch's unfused attention (the SDPA math path): matmuls accumulate in FP32
    and store in ``fmt``, so the scores and P are ``fmt``; softmax's internals (max,
    exp, sum) are FP32.

    Backward (autograd of that path): dO, and every matmul's output (dP, dQ, dK,
    dV), stored in ``fmt`` after FP32 accumulation; the softmax backward
    dS = P ∘ (dP − rowsum(P ∘ dP)) computed in FP32 and stored in ``fmt``.
    """
    f = get_format(fmt)
    return Policy(
        inputs=f,
        qk_acc=FP32,
        scores=f,
        stats=FP32,
        exp=FP32,
        p=f,
        pv_acc=FP32,
        o_acc=FP32,
        out=f,
        d_out=f,
        d_acc=FP32,
        d_p=f,
        d_stats=FP32,
        d_s=f,
        grads=f,
        accumulation=accumulation,
        name=f"torch_math({f.name})",
    )


def golden() -> Policy:
    """FP64 everywhere, forward and backward: the reference the others are measured against."""
    return Policy(*(FP64,) * len(STAGES), accumulation=EXACT, name="golden")


PRESETS = {
    "paper_uniform": paper_uniform,
    "fa2_kernel": fa2_kernel,
    "torch_math": torch_math,
}


def get_policy(name: str, fmt=None, **kwargs) -> Policy:
    """A preset by name: "golden", or "paper_uniform" / "fa2_kernel" / "torch_math"
    with a format."""
    if name == "golden":
        return golden()
    if name not in PRESETS:
        raise ValueError(f"unknown policy {name!r}: expected 'golden' or one of {sorted(PRESETS)}")
    if fmt is None:
        raise ValueError(f"policy {name!r} needs a format, e.g. get_policy({name!r}, 'bf16')")
    return PRESETS[name](fmt, **kwargs)
