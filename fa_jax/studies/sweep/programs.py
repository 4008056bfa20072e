"""The sweep's compiled programs: golden, baseline and flash attention, vmapped.

One configuration is (policy preset, format, sequence length, tiles, variant,
seed).  Each program maps one of them to its output O and is vmapped over a
flat axis of (format × seq_len × seed).  The formats of one *kind*
``(subnormals, specials, overflow)`` differ only in their pytree leaves
(exp_bits, man_bits, bias), so they enter as traced integer ``widths``; the
kind, preset, variant, tiles and causal flag are static.  Sequence lengths are
padded to the batch's longest and masked with ``q_lengths``/``kv_lengths``,
which gives the unpadded numbers bitwise.

* golden: :func:`~fa_jax.attention.reference_attention` under
  :func:`~fa_jax.presets.golden` on Q, K, V rounded to the format, the values
  the emulated runs see;
* baseline: ``reference_attention`` under the preset's policy (Golden et al.
  2024, §3: the "baseline attention");
* flash: :func:`~fa_jax.attention.flash_attention` under the same policy
  (Dao 2023, Algorithm 1), tiles ``Blocks(bc, bc)``: the query tile Br does
  not change flash's numbers, only Bc, the number of rescalings, does.
"""

from __future__ import annotations

import functools

import jax

from fa_jax import metrics
from fa_jax.attention import flash_attention, reference_attention
from fa_jax.formats import Format
from fa_jax.presets import golden
from fa_jax.rounding import round_to
from fa_jax.studies.sweep.grid import METRICS, policy_for

__all__ = [
    "Kind",
    "baseline_program",
    "flash_program",
    "golden_program",
    "kind_of",
    "metric_values",
]

Kind = tuple  # (subnormals, specials, overflow)


def kind_of(f: Format) -> Kind:
    """The static part of a format: its pytree structure."""
    return (f.subnormals, f.specials, f.overflow)


def _fmt(widths, kind: Kind) -> Format:
    e, m, b = widths
    return Format("sweep", e, m, bias=b, subnormals=kind[0], specials=kind[1], overflow=kind[2])


@functools.partial(jax.jit, static_argnames=("kind", "causal"))
def golden_program(q, k, v, widths, lengths, *, kind, causal):
    def one(q, k, v, w, n):
        f = _fmt(w, kind)
        q, k, v = (round_to(t, f) for t in (q, k, v))
        return reference_attention(q, k, v, golden(), causal=causal, q_lengths=n, kv_lengths=n)

    return jax.vmap(one)(q, k, v, widths, lengths)


@functools.partial(jax.jit, static_argnames=("preset", "kind", "causal"))
def baseline_program(q, k, v, widths, lengths, *, preset, kind, causal):
    def one(q, k, v, w, n):
        pol = policy_for(preset, _fmt(w, kind), *q.shape[-2:])
        return reference_attention(q, k, v, pol, causal=causal, q_lengths=n, kv_lengths=n)

    return jax.vmap(one)(q, k, v, widths, lengths)


@functools.partial(jax.jit, static_argnames=("preset", "kind", "variant", "blocks", "causal"))
def flash_program(q, k, v, widths, lengths, *, preset, kind, variant, blocks, causal):
    def one(q, k, v, w, n):
        pol = policy_for(preset, _fmt(w, kind), *q.shape[-2:])
        return flash_attention(
            q, k, v, pol, blocks, variant=variant, causal=causal, q_lengths=n, kv_lengths=n
        )[0]  # pyright: ignore[reportIndexIssue]

    return jax.vmap(one)(q, k, v, widths, lengths)


def metric_values(a, b):
    """The public metric functions, called eagerly as a user would: fused under one
    jit, rmse's last bit can change, and the CSV must equal direct calls."""
    return [getattr(metrics, m)(a, b) for m in METRICS]
