"""Logical masks of attention: which (query i, key j) pairs are kept.

A pair is kept when every mask given keeps it (indices from 0; query i sits at
position p_i = i + q_offset of the key axis)::

    causal            j <= p_i                     (PyTorch's ``is_causal``, jax.nn)
    q_lengths         i < q_len                    (per leading index, broadcast)
    kv_lengths        j < kv_len
    window (l, r)     p_i - l <= j <= p_i + r      (FlashAttention-2's ``window_size``;
                                                   -1 leaves that side unbounded)
    mask              mask[..., i, j]              (boolean, True = keep, as jax.nn;
                                                   broadcastable to (..., N, M))

``q_offset`` (:func:`check_q_offset`) aligns the causal mask and the window:
``"top-left"`` (0: row i faces key i whatever N and M are; PyTorch's
``is_causal``, jax.nn's ``local_window_size``), ``"bottom-right"`` (M - N: the
last query faces the last key, as FlashAttention-2 aligns both when N != M, and
as a decoder's N new queries after M - N cached keys see them: llama.cpp's KQ
mask, vLLM), or an int.  For N = M the two agree.  ``window=(-1, 0)`` is the
causal mask.  A masked pair gets score -inf and probability 0; a row that keeps
no key (under bottom-right with N > M, the first N - M rows) has output 0 and
log-sum-exp -inf.

FlashAttention kernels skip key blocks that no row of their query block keeps
(``n_block_min``/``n_block_max`` in ``flash_fwd_kernel.h``).  The emulation takes
all rows at once, so it skips a key block no query row keeps: under a window,
every key past ``N - 1 + q_offset + r`` (:func:`window_end`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fa_jax._checks import broadcasts_to

__all__ = [
    "ALIGNMENTS",
    "check_broadcast",
    "check_q_offset",
    "check_window",
    "keep",
    "prepare_mask",
    "q_offset_of",
    "window_end",
    "zero_masked_keys",
]


def check_broadcast(fn: str, name: str, x, target: tuple) -> None:
    """ValueError naming ``name`` unless ``x`` broadcasts to ``target`` (..., N, M)."""
    if not broadcasts_to(np.shape(x), target):
        raise ValueError(
            f"{fn}: {name}: expected an array broadcastable to (..., N, M) = {target}, "
            f"got shape {tuple(np.shape(x))}"
        )


def prepare_mask(fn: str, mask, target: tuple):
    """The boolean mask (True = keep) as a jax array, checked to be boolean and to
    broadcast to ``target`` (..., N, M); None for no mask."""
    if mask is None:
        return None
    check_broadcast(fn, "mask", mask, target)
    if jnp.result_type(mask) != jnp.bool_:
        raise ValueError(
            f"{fn}: mask: expected a boolean array (True = keep), got dtype "
            f"{jnp.result_type(mask)}; an additive mask is a bias"
        )
    return jnp.asarray(mask)


def check_window(window, fn: str = "attention") -> tuple[int, int] | None:
    """``window`` as a (left, right) pair of ints, each -1 (unbounded) or >= 0; None
    for no window (also for (-1, -1)).  ValueError naming it otherwise."""
    if window is None:
        return None
    try:
        left, right = window
        ok = all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"{fn}: window: expected (left, right) with each an int, -1 (unbounded) or >= 0, "
            f"got {window!r}"
        )
    return None if (left, right) == (-1, -1) else (int(left), int(right))


# q_offset's names for the two alignments (module docstring): the offset for N queries, M keys.
ALIGNMENTS = {"top-left": lambda n, m: 0, "bottom-right": lambda n, m: m - n}


def q_offset_of(q_offset, n: int, m: int, fn: str = "attention") -> int:
    """``q_offset`` (module docstring) as the int key position of query 0 for ``n``
    queries and ``m`` keys: one of :data:`ALIGNMENTS` or an int (None: top-left).
    ValueError naming it otherwise."""
    if q_offset is None or (isinstance(q_offset, str) and q_offset in ALIGNMENTS):
        return ALIGNMENTS[q_offset or "top-left"](n, m)
    if isinstance(q_offset, (int, np.integer)) and not isinstance(q_offset, bool):
        return int(q_offset)
    raise ValueError(
        f"{fn}: q_offset: expected one of {tuple(ALIGNMENTS)} or an int (the key "
        f"position of query 0), got {q_offset!r}"
    )


def check_q_offset(q_offset, n: int, m: int, *, causal, window, fn: str = "attention") -> int:
    """:func:`q_offset_of` for an attention call, whose non-zero offset needs the
    causal mask or a window, the masks it aligns (ValueError otherwise)."""
    offset = q_offset_of(q_offset, n, m, fn)
    if offset and not causal and window is None:
        raise ValueError(
            f"{fn}: q_offset: {q_offset!r} aligns the causal mask and the window, and the "
            "call has neither: expected causal=True or a window with it"
        )
    return offset


def window_end(n: int, m: int, window, q_offset: int = 0) -> int:
    """The number of keys any of ``n`` query rows may keep under ``window``: keys
    past ``n - 1 + q_offset + right`` lie right of every row's window (at most ``m``)."""
    if window is None or window[1] < 0:
        return m
    return max(0, min(m, n + q_offset + window[1]))


def keep(
    n,
    m,
    lead,
    *,
    causal=False,
    q_lengths=None,
    kv_lengths=None,
    window=None,
    mask=None,
    col0=0,
    q_offset=0,
):
    """Boolean (..., n, m) mask of kept (query, key) pairs (module docstring);
    keys start at column col0; query i sits at key position i + ``q_offset`` (an
    int, :func:`check_q_offset`); ``mask`` is the boolean mask's columns from col0
    (broadcastable to (..., n, m))."""
    i = jnp.arange(n, dtype=jnp.int32)[:, None]
    j = col0 + jnp.arange(m, dtype=jnp.int32)[None, :]
    p = i + q_offset  # the query's position on the key axis
    keep = jnp.ones((n, m), bool) if not causal else j <= p
    if window is not None:
        left, right = window
        if left >= 0:
            keep = keep & (j >= p - left)
        if right >= 0:
            keep = keep & (j <= p + right)
    keep = jnp.broadcast_to(keep, (*lead, n, m))
    if q_lengths is not None:
        ql = jnp.broadcast_to(jnp.asarray(q_lengths, jnp.int32), lead)[..., None, None]
        keep = keep & (i < ql)
    if kv_lengths is not None:
        kl = jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), lead)[..., None, None]
        keep = keep & (j < kl)
    if mask is not None:
        keep = keep & mask
    return keep


def zero_masked_keys(v, kv_lengths, col0):
    """V rows at or past kv_length set to 0, so that P = 0 there meets no inf/NaN padding."""
    if kv_lengths is None:
        return v
    j = col0 + jnp.arange(v.shape[-2], dtype=jnp.int32)
    kl = jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), v.shape[:-2])[..., None, None]
    return jnp.where(j[:, None] < kl, v, 0.0)
