"""The model's attention: an fa_jax attention function under a Policy, and its gradient.

Forward: :class:`AttentionSpec` calls ``fa_jax.reference_attention`` (baseline,
scores materialised) or ``fa_jax.flash_attention`` (tiled online softmax) with
``causal=True``; every step rounds as the policy says.

Backward, ``AttentionSpec.backward``:

``"emulated"``  differentiate the fa_jax function itself: its custom VJP, the
                backward pass emulated under the same policy
                (:mod:`fa_jax.backward`: FlashAttention-2's tiled backward for
                flash, the materialised one for the reference);
``"float64"``   a custom VJP that applies the FlashAttention-2 backward
                equations (Dao 2023, Algorithm 2) in float64, untiled, to the
                inputs and the *emulated* output O::

                    P  = softmax(scale · Q Kᵀ)  (causal; float64)
                    dV = Pᵀ dO;   dP = dO Vᵀ;   D = rowsum(dO ∘ O)
                    dS = P ∘ (dP − D);  dQ = scale · dS K;  dK = scale · dSᵀ Q

                so the forward's rounding reaches the gradient through O (as
                it does in a kernel) and through the weights, but the backward
                adds none: a study can separate the forward's share of a drift
                from the backward's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from fa_jax._checks import one_of
from fa_jax.attention import VARIANTS, Blocks, flash_attention, reference_attention
from fa_jax.policy import Policy

__all__ = ["BACKWARDS", "AttentionSpec", "float64_attention_vjp"]

BACKWARDS = ("emulated", "float64")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Causal attention by fa_jax: ``kind`` "reference" (baseline) or "flash" (tiles
    ``blocks``, loop order ``variant``) under ``policy``; gradient per ``backward``
    (module docstring)."""

    kind: str
    policy: Policy
    blocks: Blocks | None = None
    variant: str = "fa2"
    backward: str = "emulated"

    def __post_init__(self):
        one_of(self.kind, ("reference", "flash"), "AttentionSpec.kind")
        if not isinstance(self.policy, Policy):
            raise TypeError(f"AttentionSpec.policy: expected a Policy, got {self.policy!r}")
        if self.kind == "flash" and not isinstance(self.blocks, Blocks):
            raise ValueError(
                f"AttentionSpec: flash attention needs blocks=Blocks(br, bc), got {self.blocks!r}"
            )
        one_of(self.variant, VARIANTS, "AttentionSpec.variant")
        one_of(self.backward, BACKWARDS, "AttentionSpec.backward")

    def forward(self, q, k, v) -> jax.Array:
        """O (..., N, d_v) for float64 carriers q, k, v: the fa_jax function's output."""
        if self.kind == "reference":
            return reference_attention(q, k, v, self.policy, causal=True)  # pyright: ignore[reportReturnType]
        assert self.blocks is not None  # __post_init__: flash attention has blocks
        o = flash_attention(q, k, v, self.policy, self.blocks, variant=self.variant, causal=True)
        return o[0]  # pyright: ignore[reportIndexIssue]  # (O, lse), untyped in fa_jax.attention

    def __call__(self, q, k, v) -> jax.Array:
        """O for q, k, v (..., N, d) float64 carriers, differentiable per ``backward``."""
        if self.backward == "emulated":
            return self.forward(q, k, v)
        return _float64_vjp_attention(self, q, k, v)

    def label(self) -> str:
        b = self.blocks
        if self.kind == "reference" or b is None:
            where = "reference"
        else:
            where = f"flash {self.variant} Br={b.br} Bc={b.bc}"
        return f"{where}, {self.policy.name}, {self.backward} backward"


def _causal_probs(q, k):
    """P = softmax(scale · Q Kᵀ) with the causal mask, float64."""
    n, m = q.shape[-2], k.shape[-2]
    s = jnp.einsum("...id,...jd->...ij", q, k, precision=jax.lax.Precision.HIGHEST)
    s = s * (1.0 / math.sqrt(q.shape[-1]))
    keep = jnp.arange(m)[None, :] <= jnp.arange(n)[:, None]
    return jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)


def float64_attention_vjp(q, k, v, o, d_o):
    """(dQ, dK, dV) of causal attention by Dao 2023 Algorithm 2 in float64 (module
    docstring), with ``o`` the forward's output."""
    hi = jax.lax.Precision.HIGHEST
    p = _causal_probs(q, k)
    d_v = jnp.einsum("...ij,...id->...jd", p, d_o, precision=hi)
    d_p = jnp.einsum("...id,...jd->...ij", d_o, v, precision=hi)
    d_row = jnp.sum(d_o * o, axis=-1, keepdims=True)
    d_s = p * (d_p - d_row)
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_q = scale * jnp.einsum("...ij,...jd->...id", d_s, k, precision=hi)
    d_k = scale * jnp.einsum("...ij,...id->...jd", d_s, q, precision=hi)
    return d_q, d_k, d_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _float64_vjp_attention(spec: AttentionSpec, q, k, v):
    return spec.forward(q, k, v)


def _fwd(spec, q, k, v):
    o = spec.forward(q, k, v)
    return o, (q, k, v, o)


def _bwd(spec, res, d_o):
    q, k, v, o = res
    return float64_attention_vjp(q, k, v, o, d_o)


_float64_vjp_attention.defvjp(_fwd, _bwd)
