"""``jax.nn.dot_product_attention``'s interface to the emulated attention.

:func:`dot_product_attention` takes jax.nn's arguments and (B, T, N, H) layout
(batch, query length, heads, head dim; K and V (B, S, K, H) with K dividing N:
GQA, query head n reads K/V head n // (N / K)), plus ``policy``, ``blocks`` and
``algorithm``, and runs :func:`fa_jax.reference_attention` (``"reference"``) or
:func:`fa_jax.flash_attention` (``"fa1"``, ``"fa2"``, ``"rowwise"``) on the
transposed (B, N, T, H) arrays, so that a Flax or Equinox model routes its
attention through the emulation.  The unbatched (T, N, H) form is accepted.

Semantics as jax.nn's (``jax/_src/nn/functions.py``): ``bias`` and ``mask``
broadcast to (B, N, T, S), mask True = keep; ``is_causal`` keeps key j <= query i
(top-left); ``query_seq_lengths``, ``key_value_seq_lengths`` (shape (B,)) keep
rows i < q_len and keys j < kv_len, rows past q_len giving 0;
``local_window_size`` w or (left, right) keeps i - left <= j <= i + right,
top-left aligned (a negative side is jax.nn's literal inequality, applied as a
mask; FlashAttention's -1 = unbounded is not this argument's meaning); ``scale``
defaults to 1/√H.  Differences from jax.nn:

* ``q_offset`` (not in jax.nn) aligns ``is_causal`` and ``local_window_size``
  otherwise: ``"bottom-right"`` for T new queries after S - T cached keys (query
  i at key position i + S - T), or an int (:mod:`fa_jax.masking`); the default,
  top-left, is jax.nn's meaning;

* a query row that keeps no key (all masked, but i < q_len) gives 0 here, as
  FlashAttention kernels do; jax.nn's XLA path fills masked logits with a large
  finite negative, so such a row gets the mean of V over all S keys;
* jax.nn runs the softmax in float32 whatever the dtype; here every stage is
  the policy's;
* V may have its own head dim; seq lengths may be any integer dtype (jax.nn:
  int32); there is no ``implementation`` or ``return_residual``.

Output: the query's dtype and shape.  The emulation returns values of
``policy.out`` in its carrier; they convert exactly where the query dtype holds
them (e.g. fa2_kernel(bf16) into bfloat16), otherwise they are rounded once to
nearest-even (:func:`fa_jax.round_to`).  Gradients: the emulation's custom_vjp
(FlashAttention-2's backward under the policy), cotangents in the input dtypes.

Defaults: ``policy`` :func:`default_policy` (fa2_kernel of the query's format,
golden for float64); ``blocks`` :func:`default_blocks` (FlashAttention-2's
forward tiles for the head dim); ``algorithm`` "fa2".

:func:`flax_attention_fn` builds the ``attention_fn`` of Flax's
``nnx.MultiHeadAttention``; Flax is not imported here.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import masking
from fa_jax._checks import is_int, one_of
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.formats import FP64, get_format
from fa_jax.policy import Policy
from fa_jax.presets import fa2_kernel, golden
from fa_jax.rounding import round_to
from fa_jax.widening import widen

__all__ = [
    "ALGORITHMS",
    "default_blocks",
    "default_policy",
    "dot_product_attention",
    "flax_attention_fn",
]

ALGORITHMS = ("reference", "fa1", "fa2", "rowwise")
_FN = "fa_jax.nn.dot_product_attention"


def default_policy(dtype) -> Policy:
    """The policy for queries of ``dtype`` when none is given: golden() (FP64
    throughout) for float64, else fa2_kernel of the dtype's format (inputs, P and
    the output in it; scores, statistics and accumulators FP32)."""
    fmt = get_format(jnp.dtype(dtype))
    return golden() if fmt == FP64 else fa2_kernel(fmt)


def default_blocks(head_dim: int) -> Blocks:
    """FlashAttention-2's forward tiles Br x Bc for the head dim (sm80,
    ``flash_fwd_launch_template.h``): 128 x 128 up to 64, 128 x 64 up to 128,
    64 x 64 beyond.  Only Bc changes the numbers (:mod:`fa_jax.attention`)."""
    if head_dim <= 64:
        return Blocks(128, 128)
    if head_dim <= 128:
        return Blocks(128, 64)
    return Blocks(64, 64)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    q_offset=None,
    policy: Policy | None = None,
    blocks: Blocks | None = None,
    algorithm: str = "fa2",
):
    """Attention of ``query`` (B, T, N, H) against ``key``, ``value`` (B, S, K, H)
    under ``policy`` (module docstring); returns (B, T, N, H_v) in the query's dtype.

    ``algorithm`` "reference" (the materialised baseline; ``blocks`` must be None)
    or a flash variant "fa1", "fa2", "rowwise" with ``blocks`` (default
    :func:`default_blocks`).  ``policy`` defaults to :func:`default_policy`.
    """
    one_of(algorithm, ALGORITHMS, f"{_FN}: algorithm")
    query, key, value = (jnp.asarray(t) for t in (query, key, value))
    unbatched = _check_arrays(query, key, value)
    if unbatched:
        query, key, value = (t[None] for t in (query, key, value))
    b, t, n, h = query.shape
    s = key.shape[1]
    q_lengths = _lengths(query_seq_lengths, "query_seq_lengths", b)
    kv_lengths = _lengths(key_value_seq_lengths, "key_value_seq_lengths", b)
    mask = masking.prepare_mask(_FN, mask, (b, n, t, s))
    offset = masking.check_q_offset(
        q_offset, t, s, causal=is_causal, window=local_window_size, fn=_FN
    )
    window, window_mask = _window(local_window_size, t, s, offset)
    if window_mask is not None:
        mask = window_mask if mask is None else jnp.logical_and(mask, window_mask)
    if policy is None:
        policy = default_policy(query.dtype)
    if not isinstance(policy, Policy):
        raise TypeError(
            f"{_FN}: policy: expected a Policy (e.g. fa_jax.fa2_kernel('bf16')) or None, "
            f"got {policy!r}"
        )
    if algorithm == "reference" and blocks is not None:
        raise ValueError(f"{_FN}: blocks: expected None with algorithm 'reference', got {blocks!r}")
    if blocks is not None and not isinstance(blocks, Blocks):
        raise TypeError(f"{_FN}: blocks: expected Blocks(br, bc) or None, got {blocks!r}")
    # (B, N, T, H), narrow floats (bfloat16, float16, ...) widened exactly to the carrier
    q, k, v = (jnp.swapaxes(_carried(x, policy), 1, 2) for x in (query, key, value))
    bias = None if bias is None else _carried(bias, policy)
    common: dict[str, Any] = dict(
        causal=bool(is_causal),
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        scale=scale,
        bias=bias,
        mask=mask,
        window=window,
        q_offset=offset if is_causal or window is not None else None,
    )
    if algorithm == "reference":
        o = reference_attention(q, k, v, policy, **common)
    else:
        tiles = default_blocks(h) if blocks is None else blocks
        outputs = flash_attention(q, k, v, policy, tiles, variant=algorithm, **common)
        o = outputs[0]  # pyright: ignore[reportIndexIssue]  # (O, lse), untyped in fa_jax.attention
    out = _to_dtype(jnp.swapaxes(jnp.asarray(o), 1, 2), query.dtype)
    return out[0] if unbatched else out


def _check_arrays(query, key, value) -> bool:
    """Whether the arrays are unbatched (T, N, H), after checking jax.nn's rules:
    equal rank 3 or 4, one floating dtype, K and V of one (B, S, K) with K
    dividing N, Q and K of one B and H."""
    shapes = f"query {query.shape}, key {key.shape}, value {value.shape}"
    if query.ndim not in (3, 4) or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            f"{_FN}: expected query (B, T, N, H), key and value (B, S, K, H), or all three "
            f"without B, got {shapes}"
        )
    dtypes = {x.dtype for x in (query, key, value)}
    if len(dtypes) != 1 or not jnp.issubdtype(query.dtype, jnp.floating):
        raise ValueError(
            f"{_FN}: expected query, key and value of one floating dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    q, k, v = (x.shape if x.ndim == 4 else (1, *x.shape) for x in (query, key, value))
    if k[:3] != v[:3] or q[0] != k[0] or q[3] != k[3]:
        raise ValueError(
            f"{_FN}: expected query (B, T, N, H), key (B, S, K, H) and value (B, S, K, H_v), "
            f"got {shapes}"
        )
    if q[2] % k[2] != 0:
        raise ValueError(
            f"{_FN}: key, value: expected a number of heads K dividing query's N = {q[2]}, "
            f"got K = {k[2]}"
        )
    return query.ndim == 3


def _lengths(lengths, name: str, b: int):
    """Seq lengths (B,) of an integer dtype as (B, 1): broadcast over the heads."""
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{_FN}: {name}: expected integers of shape (B,) = ({b},), got "
            f"{lengths.dtype} of shape {lengths.shape}"
        )
    return lengths[:, None]


def _window(size, t: int, s: int, offset: int = 0):
    """(window, mask) for ``local_window_size``: (left, right) for fa_jax's window
    where both are >= 0, else a (T, S) mask of jax.nn's inequalities
    j >= p - left and j <= p + right, p = i + ``offset`` the query's position."""
    if size is None:
        return None, None
    pair = (size, size) if is_int(size) else size
    try:
        left, right = pair
        ok = is_int(left) and is_int(right)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"{_FN}: local_window_size: expected an int or a (left, right) pair of ints, "
            f"got {size!r}"
        )
    left, right = int(left), int(right)
    if left >= 0 and right >= 0:
        return (left, right), None
    p, j = np.arange(t)[:, None] + offset, np.arange(s)[None, :]
    return None, jnp.asarray((j >= p - left) & (j <= p + right))


def _carried(x, policy: Policy) -> jax.Array:
    """``x`` widened exactly to the policy's carrier where its dtype is a floating
    type narrower than float32 or not floating (the emulation takes float32 and
    float64 arrays)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):  # an integer bias: exact in range
        return x.astype(policy.carrier_dtype())
    if jnp.finfo(x.dtype).bits < 32:
        return widen(x, policy.carrier_dtype())
    return x


def _to_dtype(o, dtype):
    """The carrier's values of policy.out in ``dtype``: exact where it holds them,
    else rounded once to nearest-even (round_to, then an exact conversion)."""
    if o.dtype == dtype:
        return o
    if jnp.finfo(dtype).bits >= jnp.finfo(o.dtype).bits:
        return o.astype(dtype)
    return jax.lax.convert_element_type(round_to(o, get_format(dtype)), dtype)


def flax_attention_fn(
    *, policy: Policy | None = None, blocks: Blocks | None = None, algorithm: str = "fa2"
):
    """An ``attention_fn`` for Flax's ``nnx.MultiHeadAttention`` (and
    ``flax.nnx.dot_product_attention``'s signature) that runs
    :func:`dot_product_attention` with ``policy``, ``blocks`` and ``algorithm``.

    Like Flax's own: q, k, v promoted to ``dtype`` (or their common dtype),
    several or no batch dimensions, a mask of any dtype read as ``mask != 0``.
    ``precision`` is ignored (the policy sets the arithmetic).  Attention dropout
    (``dropout_rate > 0`` and not ``deterministic``) and sowing the weights
    (``module``) raise ValueError: the emulation does neither.
    """
    one_of(algorithm, ALGORITHMS, "fa_jax.nn.flax_attention_fn: algorithm")
    fn = "fa_jax.nn.flax_attention_fn"

    def attention_fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout: bool = True,
        dropout_rng=None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype=None,
        precision=None,
        module=None,
        promote_dtype=None,
        is_causal: bool = False,
    ):
        del broadcast_dropout, dropout_rng, precision
        if dropout_rate > 0.0 and not deterministic:
            raise ValueError(
                f"{fn}: dropout_rate: expected 0 or deterministic=True (the emulation "
                f"applies no attention dropout), got dropout_rate={dropout_rate} with "
                "deterministic=False"
            )
        if module is not None:
            raise ValueError(
                f"{fn}: module: expected None (the emulation does not sow attention "
                f"weights: sow_weights=False), got {type(module).__name__}"
            )
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        else:
            dtype = jnp.result_type(query, key, value) if dtype is None else dtype
            query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
        if mask is not None:
            mask = jnp.asarray(mask) != 0
        batch = query.shape[:-3]
        if len(batch) > 1:
            query, key, value = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
            bias, mask = (_flat_batch(x, batch) for x in (bias, mask))
        out = dot_product_attention(
            query,
            key,
            value,
            bias,
            mask,
            is_causal=is_causal,
            policy=policy,
            blocks=blocks,
            algorithm=algorithm,
        )
        return out.reshape(*batch, *out.shape[-3:])

    return attention_fn


def _flat_batch(x, batch: tuple):
    """A bias or mask (*batch', N, T, S) broadcast over ``batch`` and flattened to
    (prod(batch), N, T, S), as Flax flattens q, k, v."""
    if x is None:
        return None
    x = jnp.asarray(x)
    x = jnp.broadcast_to(x, (*batch, *x.shape[-3:])) if x.ndim >= 3 else x
    return x.reshape(math.prod(batch), *x.shape[-3:]) if x.ndim >= 3 else x
