"""Running XLA's attention for real: ``jax.nn.dot_product_attention(...,
implementation="xla")`` on the CPU, as the kernel runs and as the model reads it.

jax's call (``dot_product_attention`` and ``_dot_product_attention_xla`` in
jax/_src/nn/functions.py) runs jitted in bf16 and fp32; fp16 eagerly, op by op,
since XLA's CPU backend refuses the F16_F16_F32 dot under jit (eagerly jax falls
back to the default precision): :func:`real_call`.

Without features the (..., N, d) heads go to jax as one 3-D call on (B·H, N, d)
(jax adds the batch axis).  With features (bias, mask, window, key lengths,
fewer K/V heads, N != M) they go to jax's 4-D call (:class:`Layout`, with its
``local_window_size`` and ``key_value_seq_lengths``): jax groups the query heads
by K/V head, so XLA runs the dots on the grouped (B·H_kv, G·N, d) view
(:func:`grouped_call`, the program the order probes of
:mod:`~fa_jax.kernels.xla.probes` run).  :func:`real` is the kernel's real call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax.formats import Format
from fa_jax.kernels.model import flat_heads, heads_call

__all__ = [
    "Layout",
    "featured",
    "grouped_call",
    "jax_attention",
    "layout_of",
    "masked_grouped_call",
    "real",
    "real_call",
    "seq_lengths",
]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A call with features (K/V with fewer heads, decoding shapes, a bias, a mask, a
    window, key lengths): jax's 4-D call on ``batch`` sequences of ``n`` queries in
    ``kv_heads`` · ``groups`` heads and ``m`` keys in ``kv_heads`` heads; ``bias``
    and ``mask`` the shapes of the 4-D arrays passed (None: not passed),
    ``window`` jax's ``local_window_size``, ``lengths`` whether
    ``key_value_seq_lengths`` is.  XLA runs its dots on (B·H_kv, G·N, d) queries
    against (B·H_kv, M, d) keys (jax's ``_dot_product_attention_xla`` groups the
    heads so), the grouped view the model takes."""

    batch: int
    kv_heads: int
    groups: int
    n: int
    m: int
    bias: tuple[int, ...] | None = None
    mask: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None
    lengths: bool = False

    def plain(self) -> Layout:
        """The same shapes without bias, mask, window or lengths: the program probed."""
        return Layout(self.batch, self.kv_heads, self.groups, self.n, self.m)


def jax_attention(
    dtype: str, causal: bool, scale, layout: Layout | None = None
) -> Callable[..., jax.Array]:
    """jax's call as a function, not jitted, its inputs rounded to ``dtype`` and its
    output in float32.  ``layout`` None: (q, k, v) as (B·H, N, d), one 3-D call
    (jax adds the batch axis); else ``layout``'s 4-D call: (q, k, v) as (B, H, N, d),
    (B, H_kv, M, d), and the bias, mask and lengths it passes."""
    if layout is None:
        return heads_call(dtype, causal, scale, "xla")

    def run(q, k, v, bias=None, mask=None, lengths=None):
        q, k, v = (jnp.swapaxes(t, 1, 2).astype(dtype) for t in (q, k, v))
        o = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=None if bias is None else bias.astype(dtype),
            mask=mask,
            scale=scale,
            is_causal=causal,
            key_value_seq_lengths=lengths,
            local_window_size=layout.window,
            implementation="xla",
        )
        return jnp.swapaxes(o, 1, 2).astype(jnp.float32)

    return run


@functools.cache
def real_call(dtype: str, causal: bool, scale, layout: Layout | None = None):
    """The real call (:func:`jax_attention`) as the kernel runs it: jitted, except
    fp16, whose F16_F16_F32 dot XLA's CPU backend refuses under jit; eagerly jax
    falls back to the default precision, op by op."""
    run = jax_attention(dtype, causal, scale, layout)
    return run if dtype == "float16" else jax.jit(run)


@functools.cache
def grouped_call(dtype: str, layout: Layout, causal: bool = False):
    """The plain program of ``layout`` (no scale, bias or mask; causal or not) on the
    grouped view: q (B·H_kv, G·N, d), k and v (B·H_kv, M, d) -> (B·H_kv, G·N, d);
    what the order-revealing probes run."""
    b, kv, g, n, m = layout.batch, layout.kv_heads, layout.groups, layout.n, layout.m
    call = jax_attention(dtype, causal, None, layout.plain())

    def run(q, k, v):
        q4 = q.reshape(b, kv * g, n, q.shape[-1])
        k4, v4 = (t.reshape(b, kv, m, t.shape[-1]) for t in (k, v))
        return call(q4, k4, v4).reshape(q.shape)

    return run if dtype == "float16" else jax.jit(run)


def _window(window, n: int, m: int) -> tuple[int, int] | None:
    """fa_jax's (left, right) window (-1: unbounded) as jax's local_window_size."""
    if window is None:
        return None
    return tuple(int(w) if w >= 0 else n + m for w in window)  # type: ignore[return-value]


def layout_of(q_shape, k_shape, features: dict) -> Layout:
    """The 4-D call of (..., H, N, d) queries and (..., H_kv, M, d) keys with
    ``features``: the leading dimensions before the heads flattened into jax's batch."""
    if len(q_shape) < 3:
        raise ValueError(
            f"xla: expected q (..., H, N, d) with a heads axis for these features, "
            f"got shape {tuple(q_shape)}"
        )
    batch = int(np.prod(q_shape[:-3], dtype=int))
    h, kv, n, m = q_shape[-3], k_shape[-3], q_shape[-2], k_shape[-2]
    full = (batch, h, n, m)

    def shape_of(name):
        return None if features.get(name) is None else full

    return Layout(
        batch,
        kv,
        h // kv,
        n,
        m,
        bias=shape_of("bias"),
        mask=shape_of("mask"),
        window=_window(features.get("window"), n, m),
        lengths=features.get("kv_lengths") is not None,
    )


def seq_lengths(kv_lengths, lead: tuple, batch: int):
    """key_value_seq_lengths (B,) of lengths broadcastable to the leading dimensions
    (..., H): jax's take one per batch, so equal across the heads."""
    lengths = np.broadcast_to(np.asarray(kv_lengths, np.int32), lead)
    if not (lengths == lengths[..., :1]).all():
        raise ValueError(
            "xla: kv_lengths: expected one length per batch, equal across the heads "
            "(jax's key_value_seq_lengths has shape (B,)), got lengths that differ by head"
        )
    return lengths[..., 0].reshape(batch)


def featured(q, k, features: dict) -> bool:
    """Whether a call needs the 4-D program: features, fewer K/V heads or N != M."""
    return (
        bool(features) or np.shape(q)[:-2] != np.shape(k)[:-2] or np.shape(q)[-2] != np.shape(k)[-2]
    )


def real(q, k, v, *, fmt: Format, causal: bool = False, scale=None, **features) -> np.ndarray:
    """XLA's output for (..., N, d) inputs exact in ``fmt``, as float64; ``features``
    (bias, mask, window, kv_lengths; K/V with fewer heads) as jax's arguments."""
    scale = None if scale is None else float(scale)
    if not featured(q, k, features):
        lead, (q, k, v) = flat_heads(q, k, v)
        run = real_call(fmt.name, bool(causal), scale)
        out = np.asarray(run(q, k, v), dtype=np.float64)
        return out.reshape(*lead, *out.shape[-2:])
    layout = layout_of(np.shape(q), np.shape(k), features)
    full = (layout.batch, layout.kv_heads * layout.groups, layout.n, layout.m)
    q4, k4, v4 = (
        np.asarray(t, np.float32).reshape(layout.batch, *np.shape(t)[-3:]) for t in (q, k, v)
    )
    args = {}
    if layout.bias is not None:
        args["bias"] = np.broadcast_to(np.asarray(features["bias"], np.float32), full)
    if layout.mask is not None:
        args["mask"] = np.broadcast_to(np.asarray(features["mask"], bool), full)
    if layout.lengths:
        args["lengths"] = seq_lengths(features["kv_lengths"], np.shape(q)[:-2], layout.batch)
    run = real_call(fmt.name, bool(causal), scale, layout)
    out = np.asarray(run(q4, k4, v4, **args), dtype=np.float64)
    return out.reshape(np.shape(q)[:-1] + out.shape[-1:])


@functools.cache
def masked_grouped_call(layout: Layout):
    """fp16's plain program of ``layout`` on the grouped view, with a mask: q (B·H_kv,
    G·N, d), k and v (B·H_kv, M, d) and the pairs kept (B·H_kv, G·N, M).  Run op by
    op, its dots, exp and sums are the programs of the call without a mask (each op
    compiled for its own shapes); the mask only adds jax's ``where``."""
    b, kv, g, n, m = layout.batch, layout.kv_heads, layout.groups, layout.n, layout.m
    masked = dataclasses.replace(layout.plain(), mask=(b, kv * g, n, m))
    call = jax_attention("float16", False, None, masked)

    def run(q, k, v, keep):
        q4 = q.reshape(b, kv * g, n, q.shape[-1])
        k4, v4 = (t.reshape(b, kv, m, t.shape[-1]) for t in (k, v))
        return call(q4, k4, v4, mask=keep.reshape(b, kv * g, n, m)).reshape(q.shape)

    return run
