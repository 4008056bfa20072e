"""Split-KV (flash-decoding) forward: S online-softmax passes over parts of the
key axis, combined by a log-sum-exp rescale.

FlashAttention-2's ``num_splits`` (Dao et al. 2023, "Flash-Decoding for
long-context inference"; csrc/flash_attn/src/flash_fwd_kernel.h at commit
0251105a, ``compute_attn_1rowblock_splitkv`` and ``combine_attn_seqk_parallel``;
line numbers below are of that file).  With n_b = ceil(M / Bc)
key blocks and S splits, n_bps = ceil(n_b / S) blocks per split (line 535) and
split s visits the blocks [s n_bps, min((s + 1) n_bps, n_b)) (lines 536-539),
a split past the last block visiting none.  Each split runs the flash loop of
:mod:`fa_jax.attention` (``fa2``, ``fa1`` or ``rowwise``) over its blocks, in
key order, from m = -inf, l = 0, o = 0, giving (m_s, l_s, o_s), and writes
(``normalize_softmax_lse``, softmax.h lines 170-186)::

    Ō_s = fl_o_acc(o_s / l_s)   (fa2 under Policy.normalise "divide";
                                  fl_o_acc(o_s · fl_stats(1 / l_s)) under "reciprocal";
                                  fa1 and rowwise keep o_s normalised: Ō_s = o_s)
    L_s = fl_combine(m_s + ln l_s)   (m_s · scale + ln l_s under scale "exp2");
                                      -inf where l_s = 0 (no kept key)

Ō_s stays in the accumulator (fp32 ``oaccum``, the ``o_acc`` stage); L_s goes to
``softmax_lseaccum`` (fp32), the ``combine`` stage of the policy (default: the
format of ``stats``).  The combine (lines 1190-1273), every value in ``combine``::

    L_max = max_s L_s                   (exact; 0 where every L_s is -inf)
    t_s   = fl(exp(fl(L_s − L_max)))    (0 where L_s = -inf)
    Σ     = fl(Σ_s t_s)                 (the policy's accumulation model, split order)
    L     = fl(fl(ln Σ) + L_max)        (-inf where Σ = 0: no split kept a key)
    w_s   = fl(exp(fl(L_s − L)))        (0 where L_s = -inf)
    acc   = fl(w_s Ō_s + acc)           (one fused multiply-add per split, in order)
    O     = fl_out(acc)

(L_max: line 1196; t_s and Σ: 1197-1201; L: 1204; w_s: 1221; acc: 1252-1264; O:
1273.)  ``expf``/``logf`` are taken correctly rounded in ``combine`` (the kernel,
built with ``--use_fast_math``, gets ``__expf``/``__logf``, not modelled), the
``+=`` of line 1264 as the FMA a CUDA compiler contracts it to, and Σ, a
thread-level sum and a warp all-reduce in the kernel, by the accumulation model.
Within a split the blocks go in key order, as fa_jax's one-pass flash loop takes
them (the kernel visits them from the last to the first, in both modes).
A split whose keys are all masked (causal, lengths, window, mask, or no block at
all) has L_s = -inf and contributes exactly zero; a row no split keeps has O = 0
and L = -inf (the kernel writes +inf there).

The boundaries follow M, the key axis given, also where ``kv_lengths`` keep
fewer keys (FlashAttention-2 takes each sequence's own length there, which is
not modelled): a padded call and an unpadded one differ once S > 1.

The splits run side by side: one scan of n_bps steps whose carry has a split
axis; a block past the last one is all padding, masked, and leaves its split's
(m, l, o) unchanged (α = 1, nothing added), as not visiting it would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fa_jax import ops
from fa_jax._checks import positive_int
from fa_jax.policy import Policy
from fa_jax.softmax import normalise

__all__ = ["check_num_splits", "combine", "split_forward", "split_outputs"]


def check_num_splits(num_splits, m: int, bc: int, variant: str, fn: str) -> int:
    """``num_splits`` as an int in [1, ceil(m / bc)] (a split per key block at
    most); above 1 only for the variants fa2, fa1 and rowwise."""
    num_splits = positive_int(num_splits, f"{fn}: num_splits")
    n_blocks = -(-m // bc)
    if num_splits > n_blocks:
        raise ValueError(
            f"{fn}: num_splits: expected at most the number of key blocks, "
            f"ceil(M / Bc) = ceil({m} / {bc}) = {n_blocks}, got {num_splits}"
        )
    if num_splits > 1 and variant not in ("fa2", "fa1", "rowwise"):
        raise ValueError(
            f"{fn}: num_splits: expected 1 for the kernel loop {variant!r} "
            f"(split-KV decoding runs the variants fa2, fa1 and rowwise), got {num_splits}"
        )
    return num_splits


def _by_split(blocks, num_splits: int, n_blocks: int):
    """Key blocks (n, ...) as (n_bps, S, ...): entry [t, s] is block s n_bps + t,
    padding (zero K and V starting at a column past every key) where that block
    does not exist."""
    k_blocks, v_blocks, col0s = blocks
    n, bc = k_blocks.shape[0], k_blocks.shape[-2]
    per_split = -(-n_blocks // num_splits)
    slots = per_split * num_splits
    pad = slots - n

    def arranged(x, fill):
        x = jnp.concatenate([x, jnp.full((pad, *x.shape[1:]), fill, x.dtype)])
        return jnp.swapaxes(x.reshape(num_splits, per_split, *x.shape[1:]), 0, 1)

    past = jnp.arange(n, n + pad, dtype=col0s.dtype) * bc
    col0s = jnp.concatenate([col0s, past])
    return (
        arranged(k_blocks, 0.0),
        arranged(v_blocks, 0.0),
        jnp.swapaxes(col0s.reshape(num_splits, per_split), 0, 1),
    )


def split_forward(step, init, blocks, num_splits: int, n_blocks: int, first=None):
    """The S splits' (m_s, l_s, o_s), each with a leading split axis: ``step(carry,
    (K_j, V_j, col0))`` of the flash loop run over each split's blocks, the splits
    side by side, each from ``init`` (the first from ``first`` where given: an
    attention sink's m_0 = σ̂, l_0 = 1, fa_jax.score_mods).  ``blocks`` are the
    (K_j, V_j, col0) of the visited key blocks; ``n_blocks`` is ceil(M / Bc) of
    the whole key axis, which sets the split boundaries (blocks past the visited
    ones are masked padding).  Columns past M must be masked by ``step``'s scores."""
    by_split = _by_split(blocks, num_splits, n_blocks)
    carry = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_splits, *x.shape)), init)
    if first is not None:
        carry = jax.tree_util.tree_map(lambda c, x: c.at[0].set(x), carry, first)
    split_step = jax.vmap(lambda c, xs: step(c, xs)[0])
    return jax.lax.scan(lambda c, xs: (split_step(c, xs), None), carry, by_split)[0]


def split_outputs(m, l, o, scale, policy: Policy, *, normalised: bool):
    """(L_s, Ō_s) of each split (module docstring): the log-sum-exp in ``combine``
    and the normalised accumulator in ``o_acc``; ``scale`` multiplies m under
    scale "exp2"."""
    live = l > 0
    m_live, l_live = jnp.where(live, m, 0.0), jnp.where(live, l, 1.0)
    m_scale = scale if policy.scale == "exp2" else None
    lse = ops.log_sum(m_live, l_live, policy.combine, scale=m_scale)
    lse = jnp.where(live, lse, -jnp.inf)
    if normalised:
        return lse, o
    if policy.normalise == "divide":
        return lse, normalise(o, l[..., None], policy.o_acc)
    reciprocal = normalise(jnp.ones_like(l), l, policy.stats)
    return lse, ops.mul(o, reciprocal[..., None], policy.o_acc)


def _exp_of_difference(a, b, fmt):
    """fl(exp(fl(a − b))) with 0 where a = -inf (b finite)."""
    empty = a == -jnp.inf
    d = ops.sub(jnp.where(empty, b, a), b, fmt)
    return jnp.where(empty, 0.0, ops.exp(d, fmt))


def combine(lse_s, o_s, policy: Policy):
    """(O, L): the splits' (L_s, Ō_s), split axis leading, combined by the
    log-sum-exp rescale of FlashAttention-2's combine kernel (module docstring)."""
    fmt = policy.combine
    lse_max = jnp.max(lse_s, axis=0)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)
    t = _exp_of_difference(lse_s, lse_max, fmt)
    total = ops.sum(t, fmt, axis=0, accumulation=policy.accumulation)
    live = total > 0
    log_total = ops.log_sum(jnp.zeros_like(total), jnp.where(live, total, 1.0), fmt)
    lse = jnp.where(live, ops.add(log_total, lse_max, fmt), -jnp.inf)
    w = _exp_of_difference(lse_s, jnp.where(live, lse, 0.0), fmt)

    def fma(acc, xs):
        w_s, o = xs
        return ops.fma(jnp.broadcast_to(w_s[..., None], o.shape), o, acc, fmt), None

    acc = jax.lax.scan(fma, jnp.zeros_like(o_s[0]), (w, o_s))[0]
    return ops.cast(acc, policy.out), lse
