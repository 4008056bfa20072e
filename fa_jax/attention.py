"""Baseline (materialised) and tiled FlashAttention forward passes under a policy.

Q is ``(..., N, d)``, K and V ``(..., M, d)``/``(..., M, d_v)`` with Q's leading
dimensions (or fewer heads: :mod:`fa_jax.heads`).  Every arithmetic step goes
through :mod:`fa_jax.ops` and rounds to the policy's stage format.

Baseline (reference) attention::

    S = fl_scores(fl_qk_acc(Q Kᵀ) · scale)          (masked entries: -inf)
    P = safe softmax of S  (m, l in stats; P in p)  (fa_jax.softmax)
    O = fl_out(fl_pv_acc(P V))

Flash attention runs the online-softmax recurrence over key/value blocks of
``Bc`` columns, in order.  Each query row's statistics (m_i, l_i) and
accumulator o_i depend only on that row, so the ``Br``-row blocks of Q are
numerically independent: the emulation processes them all at once, and ``Br``
does not change the result.  The number of rescalings, which is what moves the
numerics, is set by ``Bc`` (Golden et al. 2024 §4.3, Fig 6).

Per key block j, with scores S_j (rows × Bc):

``fa2`` (Dao 2023, Algorithm 1)::

    m_new = max(m, rowmax S_j);  P̃ = exp(S_j − m_new);  α = exp(m − m_new)
    l = α l + rowsum P̃;          o = α o + fl_p(P̃) V_j
    O = fl_out(o / l)  once at the end  (or fl_out(o · fl_stats(1 / l)): Policy.normalise)

``fa1`` (Dao et al. 2022, Algorithm 1; block max m̃ and two rescale factors)::

    m̃ = rowmax S_j;  P̃ = exp(S_j − m̃);  l̃ = rowsum P̃;  m_new = max(m, m̃)
    α = exp(m − m_new);  β = exp(m̃ − m_new);  l_new = α l + β l̃
    o = ((l α) o + β (fl_p(P̃) V_j)) / l_new       (kept normalised)

``rowwise`` (one pass, o kept normalised by the running sum at every step)::

    m_new, l_new, P̃ as fa2
    o = ((l α) / l_new) o + fl_p(P̃ / l_new) V_j

A real kernel's own loop (PyTorch's CPU flash loop, :mod:`fa_jax.kernels.torch_cpu`) is
not a variant: its engine registers a :class:`KernelLoop` (its Q Kᵀ, its block update,
whether a bias joins the scaled scores in one FMA), a name ``flash_attention(variant=)`` takes
(the registry, ``Blocks`` and a call's checked configuration: :mod:`fa_jax.attention_calls`).

Sums and products round to ``stats`` (m, l), ``exp`` (shifts, exponentials),
``pv_acc`` (P V) and ``o_acc`` (the running o); the lse m + log l to ``stats``,
once.  ``Policy.scale`` "q" scales Q instead of S; "exp2" leaves S unscaled and
folds the scale into every exp2 (:mod:`fa_jax.softmax`; lse = m · scale + log l).

Masks (:mod:`fa_jax.masking`): ``causal`` and ``window=(left, right)``, aligned
by ``q_offset`` (top-left; "bottom-right" behind a KV cache), ``q_lengths``,
``kv_lengths`` and a boolean ``mask``.  K and V are padded
to a multiple of ``Bc`` and masked; flash's key loop ends at the last block holding
a key some row may keep; a fully masked row has output 0, log-sum-exp -inf.  A
``bias`` joins the scaled scores in its own stage (:mod:`fa_jax.score_mods`).

Gradients: both functions carry a ``jax.custom_vjp`` whose backward is emulated
under the same policy (:mod:`fa_jax.backward`; FlashAttention-2's Algorithm 2),
with respect to the arrays passed in (the rounding to ``inputs`` and a KV cache,
:mod:`fa_jax.kv_cache`, pass gradients straight through; masked rows and keys get
zero gradient; the lse's cotangent is accepted); first-order only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import cast

import jax
import jax.numpy as jnp

from fa_jax import masking, ops, split_kv
from fa_jax._checks import one_of
from fa_jax._fusion import materialised
from fa_jax._jit import jit_config
from fa_jax.attention_calls import (
    VARIANTS,
    Args,
    Blocks,
    Call,
    KernelLoop,
    blocks_from_sram,
    call_args,
    call_of,
    clear_masked,
    input_cotangents,
    is_array,
    kernel_loop,
    kernel_loops,
    register_kernel_loop,
)
from fa_jax.backward import flash_backward, reference_backward
from fa_jax.heads import repeat_kv, sum_groups
from fa_jax.kv_cache import read_kv
from fa_jax.policy import Policy
from fa_jax.score_mods import (
    add_bias,
    check_sink_values,
    prepare_bias,
    prepare_sinks,
    sink_start,
    softcap,
    softcap_grad_factor,
)
from fa_jax.softmax import (
    cast_scores,
    exp2_factor,
    normalise,
    online_update,
    rescale_factor,
    running_max,
    shifted_exp,
)

__all__ = [
    "VARIANTS",
    "Blocks",
    "KernelLoop",
    "blocks_from_sram",
    "flash_attention",
    "kernel_loops",
    "reference_attention",
    "register_kernel_loop",
]


def _prepare(q, k, v, policy: Policy, scale, groups: int = 1, kv_lengths=None):
    """Round Q, K, V to the input format, K and V read through the policy's KV cache
    (:mod:`fa_jax.kv_cache`) and repeated over their query heads' groups
    (:mod:`fa_jax.heads`); resolve the scale (rounded to the format of the
    stage it multiplies, as a kernel holds it)."""
    dtype = policy.carrier_dtype()
    q, k, v = (ops.cast(ops.carrier(t, dtype), policy.inputs) for t in (q, k, v))
    k, v = read_kv(k, v, policy, kv_lengths=kv_lengths, groups=groups)
    scale = _resolved_scale(scale, q.shape[-1], policy)
    if policy.scale == "q":
        q = ops.mul(q, scale, policy.inputs)
    return q, repeat_kv(k, groups), repeat_kv(v, groups), scale


def _resolved_scale(scale, d: int, policy: Policy):
    """The softmax scale (default 1/√d) rounded to the format of the stage it
    multiplies.  A host number is rounded at trace time wherever that format is
    concrete, so the backward (which resolves it again) and exp2's host product
    see a known value."""
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    stage = policy.inputs if policy.scale == "q" else policy.scores
    dtype = policy.carrier_dtype()
    if is_array(scale):
        return ops.cast(ops.carrier(scale, dtype), stage)
    with jax.ensure_compile_time_eval():
        return ops.constant(scale, stage, dtype)


def _qk(q, k_t, policy: Policy, variant=None):
    """fl_qk_acc(Q Kᵀ): a kernel loop's own where ``variant`` is one (KernelLoop)."""
    loop = kernel_loop(variant)
    if loop is not None:
        return loop.qk(q, k_t, policy)
    return ops.matmul(q, k_t, policy.qk_acc, accumulation=policy.accumulation)


def _scores(q, k_t, scale, policy: Policy, variant=None):
    """S = fl_scores(fl_qk_acc(Q Kᵀ) · scale) (or fl_scores(Q' Kᵀ) with Q pre-scaled)."""
    s = _qk(q, k_t, policy, variant)
    if policy.scale == "scores":
        return ops.mul(s, scale, policy.scores)
    return ops.cast(s, policy.scores)


def _columns(x, col0, width: int):
    """Columns col0 .. col0 + width of a bias or mask (..., N, M) (padded past M
    where a key loop pads); all of it where it has one column (broadcast)."""
    if x is None or x.shape[-1] == 1:
        return x
    if isinstance(col0, int):
        return x[..., col0 : col0 + width]
    return jax.lax.dynamic_slice_in_dim(x, col0, width, axis=-1)


def _scorer(q, scale, policy: Policy, call: Call, args: Args, kv_lengths, bias, mask):
    """``scores(k_j, col0)``: S of Q against the keys ``k_j`` starting at column
    ``col0``, softcapped, the bias added (fa_jax.score_mods) and every masked
    (query, key) pair -inf (fa_jax.masking): the same scores for the forward passes
    and the backward's recomputation.  With ``grad=True``, (S, the softcap's
    factor ∂S'/∂S or None) for the backward."""
    lead, n = q.shape[:-2], q.shape[-2]

    def scores(k_j, col0=0, grad=False):
        width = k_j.shape[-2]
        b_j = _columns(bias, col0, width)
        loop = kernel_loop(call.variant)
        fused = loop is not None and loop.fused_bias and policy.scale == "scores"
        if b_j is not None and fused and call.softcap is None:
            # PyTorch's CPU flash loop built with FMA: S' = fl(fl(Q Kᵀ) · scale + B̂), one FMA
            raw = _qk(q, jnp.swapaxes(k_j, -1, -2), policy, call.variant)
            masked = b_j == -jnp.inf
            s = jnp.where(
                masked, -jnp.inf, ops.fma(raw, scale, jnp.where(masked, 0.0, b_j), policy.bias)
            )
            t = None
        else:
            s = _scores(q, jnp.swapaxes(k_j, -1, -2), scale, policy, call.variant)
            t = None
            if call.softcap is not None:
                s, t = softcap(s, call.softcap, policy)
            s = add_bias(s, b_j, policy)
        keep = masking.keep(
            n,
            width,
            lead,
            causal=call.causal,
            q_lengths=args.q_lengths,
            kv_lengths=kv_lengths,
            window=call.window,
            mask=_columns(mask, col0, width),
            col0=col0,
            q_offset=call.q_offset,
        )
        s = materialised(jnp.where(keep, s, -jnp.inf))  # read by the row max and the exp
        if not grad:
            return s
        return s, None if t is None else softcap_grad_factor(t, policy)

    return scores


def _score_mods(fn: str, q, args: Args, policy: Policy, m: int, padded: int | None = None):
    """(B̂, mask): the bias rounded to its stage and the boolean mask, each checked
    against (..., N, M) and, with ``padded``, padded on the key axis to that many
    columns (bias 0, mask False) for a key loop's blocks."""
    target = (*q.shape[:-2], q.shape[-2], m)
    bias = prepare_bias(fn, args.bias, target, policy)
    mask = masking.prepare_mask(fn, args.mask, target)
    if padded is not None:
        bias, mask = (_pad_columns(x, padded) for x in (bias, mask))
    return bias, mask


def _pad_columns(x, width: int):
    if x is None or x.shape[-1] == 1 or x.shape[-1] == width:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _lse(m, l, scale, policy: Policy):
    """log-sum-exp m + log l (m · scale + log l for unscaled scores: scale "exp2")
    in the stats format, rounded once; -inf for fully masked rows."""
    live = l > 0
    m, l = jnp.where(live, m, 0.0), jnp.where(live, l, 1.0)
    m_scale = scale if policy.scale == "exp2" else None
    return jnp.where(live, ops.log_sum(m, l, policy.stats, scale=m_scale), -jnp.inf)


def _log2_scale(scale, policy: Policy):
    """c = fl_exp(scale · log2 e) under scale "exp2", else None (unused)."""
    return exp2_factor(scale, policy.exp) if policy.scale == "exp2" else None


# -- reference attention ------------------------------------------------------------


@jit_config(
    "policy",
    "causal",
    "return_lse",
    "window",
    "softcap",
    "q_offset",
    values={"sinks": check_sink_values},
)
def reference_attention(
    q,
    k,
    v,
    policy: Policy,
    *,
    causal=False,
    q_lengths=None,
    kv_lengths=None,
    scale=None,
    return_lse=False,
    bias=None,
    mask=None,
    window=None,
    softcap=None,
    q_offset=None,
    sinks=None,
):
    """Baseline attention with the N×M score matrix materialised (module docstring).

    Q (..., H, N, d); K and V (..., H_kv, M, d) and (..., H_kv, M, d_v) with H_kv
    dividing H (:mod:`fa_jax.heads`).  ``bias`` and ``mask`` broadcast to
    (..., H, N, M); ``window`` is (left, right) or None, ``q_offset`` the causal
    mask's and the window's alignment ("top-left", the default; "bottom-right",
    as behind a KV cache; or an int) (:mod:`fa_jax.masking`);
    ``softcap`` c > 0 or None, ``sinks`` a logit per head broadcastable to
    (..., H) or None (:mod:`fa_jax.score_mods`).
    Returns O (..., N, d_v) as float64 carrier values of ``policy.out``, and the
    log-sum-exp (..., N) too if ``return_lse``.  Differentiable in reverse mode
    with respect to q, k, v (module docstring,
    :func:`fa_jax.backward.reference_backward`).
    """
    args = Args(policy, q_lengths, kv_lengths, scale, bias, mask, sinks)
    call, q, k, v, dynamic = call_of(
        "reference_attention", q, k, v, args, causal, window=window, cap=softcap, q_offset=q_offset
    )
    # custom_vjp erases the return type: it is the (O, lse) of _reference_forward.
    o, lse = _reference_vjp(call, q, k, v, dynamic)  # pyright: ignore[reportGeneralTypeIssues]
    if return_lse:
        return o, lse
    return o


def _reference_forward(call: Call, q, k, v, dynamic):
    """((O, lse), (Q, K, V, scale, P, ∂S'/∂S)): the outputs and what the backward reads."""
    args = call_args(call, dynamic)
    policy, kv_lengths = args.policy, args.kv_lengths
    q, k, v, scale = _prepare(q, k, v, policy, args.scale, call.groups, kv_lengths)
    bias, mask = _score_mods("reference_attention", q, args, policy, k.shape[-2])
    s, d_cap = _scorer(q, scale, policy, call, args, kv_lengths, bias, mask)(k, grad=True)
    sinks = prepare_sinks("reference_attention", args.sinks, q.shape[:-2], policy)
    if sinks is not None:  # the sink as the first column of S' (fa_jax.score_mods)
        s = jnp.concatenate([sink_start(sinks, s.shape[-2])[0][..., None], s], axis=-1)
    m = cast_scores(jnp.max(s, axis=-1, keepdims=True), policy.stats)
    e = shifted_exp(s, m, policy, log2_scale=_log2_scale(scale, policy))
    l = ops.sum(e, policy.stats, axis=-1, accumulation=policy.accumulation)[..., None]
    p = normalise(e, l, policy.p, divisor=policy.stats)  # l: a sum rounded to stats
    if sinks is not None:
        p = p[..., 1:]
    v = masking.zero_masked_keys(v, kv_lengths, 0)
    o = ops.cast(ops.matmul(p, v, policy.pv_acc, accumulation=policy.accumulation), policy.out)
    return (o, _lse(m[..., 0], l[..., 0], scale, policy)), (q, k, v, scale, p, d_cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reference_vjp(call: Call, q, k, v, dynamic):
    return _reference_forward(call, q, k, v, dynamic)[0]


def _reference_vjp_fwd(call: Call, q, k, v, dynamic):
    outputs, saved = _reference_forward(call, q, k, v, dynamic)
    return outputs, (saved, outputs[1], dynamic)


def _reference_vjp_bwd(call: Call, residuals, cotangents):
    (q, k, v, _, p, d_cap), lse, dynamic = residuals
    args = call_args(call, dynamic)
    policy = args.policy
    scale = _resolved_scale(args.scale, q.shape[-1], policy)
    d_o, d_lse = cotangents
    q, k, v, d_o, d_lse = clear_masked(q, k, v, d_o, d_lse, lse, args.kv_lengths)
    d_q, d_k, d_v = reference_backward(q, k, v, p, d_o, d_lse, scale, policy, d_cap)
    return input_cotangents(call, d_q, *(sum_groups(g, call.groups, policy) for g in (d_k, d_v)))


_reference_vjp.defvjp(_reference_vjp_fwd, _reference_vjp_bwd)


# -- flash attention ----------------------------------------------------------------


def flash_attention(
    q,
    k,
    v,
    policy: Policy,
    blocks: Blocks,
    *,
    variant: str = "fa2",
    causal=False,
    q_lengths=None,
    kv_lengths=None,
    scale=None,
    bias=None,
    mask=None,
    window=None,
    softcap=None,
    num_splits=1,
    q_offset=None,
    sinks=None,
):
    """Tiled FlashAttention forward (module docstring).

    Shapes, ``bias``, ``mask``, ``window``, ``q_offset``, ``softcap`` and ``sinks`` as for
    :func:`reference_attention`.  ``num_splits`` S in [1, ceil(M / Bc)] splits
    the key axis for split-KV decoding (:mod:`fa_jax.split_kv`; S = 1: one pass).
    Returns (O, lse): O (..., N, d_v) in ``policy.out`` and the log-sum-exp
    (..., N) in ``policy.stats``, both as float64 carrier arrays.  Differentiable
    in reverse mode with respect to q, k, v by FlashAttention-2's backward
    (module docstring, :func:`fa_jax.backward.flash_backward`).
    """
    if kernel_loop(variant) is None:  # else a kernel's loop, registered by fa_jax.kernels
        one_of(variant, (*VARIANTS, *kernel_loops()), "flash_attention: variant")
    if not isinstance(blocks, Blocks):
        raise TypeError(f"flash_attention: expected blocks=Blocks(br, bc), got {blocks!r}")
    return _flash(
        q,
        k,
        v,
        policy=policy,
        blocks=blocks,
        variant=variant,
        causal=causal,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        scale=scale,
        bias=bias,
        mask=mask,
        window=window,
        softcap=softcap,
        num_splits=num_splits,
        q_offset=q_offset,
        sinks=sinks,
    )


@jit_config(
    "policy",
    "blocks",
    "variant",
    "causal",
    "window",
    "softcap",
    "num_splits",
    "q_offset",
    values={"sinks": check_sink_values},
    name="flash_attention",
)
def _flash(
    q, k, v, *, policy, blocks, variant, causal, window, softcap, num_splits, q_offset, **arrays
):
    args = Args(policy, **arrays)
    call, q, k, v, dynamic = call_of(
        "flash_attention", q, k, v, args, causal, blocks, variant, window, softcap, q_offset
    )
    s = split_kv.check_num_splits(num_splits, k.shape[-2], blocks.bc, variant, "flash_attention")
    call = dataclasses.replace(call, num_splits=s)
    return _flash_vjp(call, q, k, v, dynamic)


def _key_blocks(k, v, bc: int):
    """K, V zero-padded to a multiple of Bc and split into blocks along a new
    leading axis, and each block's first column."""
    lead, mk = k.shape[:-2], k.shape[-2]
    n_blocks = -(-mk // bc)
    pad = n_blocks * bc - mk
    k = jnp.pad(k, [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
    v = jnp.pad(v, [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
    k_blocks = jnp.moveaxis(k.reshape(*lead, n_blocks, bc, k.shape[-1]), -3, 0)
    v_blocks = jnp.moveaxis(v.reshape(*lead, n_blocks, bc, v.shape[-1]), -3, 0)
    return k_blocks, v_blocks, jnp.arange(n_blocks, dtype=jnp.int32) * bc


def _padded(k, bc: int) -> int:
    """The number of key columns padded to a multiple of Bc."""
    return -(-k.shape[-2] // bc) * bc


def _over_key_blocks(step, init, blocks, last, bc: int):
    """``step`` over the key blocks in order; with ``last`` (the largest kept key
    length), only over the first ceil(last / Bc), as FlashAttention kernels bound
    their key loop by the sequence length.  A block past every key would only
    rescale by α = 1 and add zeros; skipping it gives a padded call the unpadded
    numbers at the unpadded cost: the trip count is a traced value (per
    configuration under ``vmap``), so one program serves every length up to its
    padded one."""
    if last is None:
        return jax.lax.scan(step, init, blocks)[0]
    n_blocks = blocks[0].shape[0]
    live = jnp.clip(-(-last // bc), 0, n_blocks).astype(jnp.int32)

    def body(j, carry):
        return step(carry, jax.tree_util.tree_map(lambda x: x[j], blocks))[0]

    return jax.lax.fori_loop(jnp.int32(0), live, body, init)


def _unless_past(last, col0: int, update, carry):
    """``update(carry)`` for the block starting at ``col0``, unless it lies past
    every key (``last``, None for all kept)."""
    if last is None:
        return update(carry)
    return jax.lax.cond(col0 < last, update, lambda c: c, carry)


def _unblock(x_blocks, mk: int):
    """(n_blocks, ..., Bc, c) blocks back to (..., M, c), the padding dropped."""
    x = jnp.moveaxis(x_blocks, 0, -3)
    return x.reshape(*x.shape[:-3], -1, x.shape[-1])[..., :mk, :]


def _flash_forward(call: Call, q, k, v, dynamic):
    """((O, lse), (Q, K, V, scale)): the outputs and the prepared inputs the backward reads."""
    args = call_args(call, dynamic)
    policy, kv_lengths = args.policy, args.kv_lengths
    bc = cast(Blocks, call.blocks).bc  # flash calls always carry blocks
    q, k, v, scale = _prepare(q, k, v, policy, args.scale, call.groups, kv_lengths)
    prepared = (q, k, v, scale)
    bias, mask = _score_mods("flash_attention", q, args, policy, k.shape[-2], _padded(k, bc))
    # Keys right of every row's window are never visited (fa_jax.masking).
    hi = masking.window_end(q.shape[-2], k.shape[-2], call.window, call.q_offset)
    k, v = k[..., :hi, :], v[..., :hi, :]
    lead, n, mk, dv = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    kv_len = mk if kv_lengths is None else jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), mk)
    variant = cast(str, call.variant)
    # A kernel loop's last block holds only the keys left, unpadded.
    loop = kernel_loop(variant)
    full = mk - mk % bc if loop is not None else mk
    steps = {"fa2": _fa2_step, "fa1": _fa1_step, "rowwise": _rowwise_step}
    update = loop.step if loop is not None else steps[variant]
    update = functools.partial(update, log2_scale=_log2_scale(scale, policy))
    scores = _scorer(q, scale, policy, call, args, kv_len, bias, mask)

    def step(carry, xs):
        k_j, v_j, col0 = xs
        v_j = masking.zero_masked_keys(v_j, kv_len, col0)
        return update(carry, scores(k_j, col0), v_j, policy), None

    init = (
        jnp.full((*lead, n), -jnp.inf, q.dtype),
        jnp.zeros((*lead, n), q.dtype),
        jnp.zeros((*lead, n, dv), q.dtype),
    )
    sinks = prepare_sinks("flash_attention", args.sinks, lead, policy)
    start = init if sinks is None else (*sink_start(sinks, n), init[2])  # m_0 = σ̂, l_0 = 1
    if call.num_splits > 1:  # split-KV decoding: S passes side by side, then combined
        n_blocks = _padded(prepared[1], bc) // bc  # of the whole key axis (FA2's splits)
        m_s, l_s, o_s = split_kv.split_forward(
            step, init, _key_blocks(k, v, bc), call.num_splits, n_blocks, first=start
        )
        lse_s, o_s = split_kv.split_outputs(
            m_s, l_s, o_s, scale, policy, normalised=variant != "fa2"
        )
        return split_kv.combine(lse_s, o_s, policy), prepared
    last = None if kv_lengths is None else jnp.max(kv_len)  # past it no block holds a key
    init = start
    if full:
        blocks = _key_blocks(k[..., :full, :], v[..., :full, :], bc)
        init = _over_key_blocks(step, init, blocks, last, bc)
    if full < mk:
        rest = (k[..., full:, :], v[..., full:, :], full)
        init = _unless_past(last, full, lambda c: step(c, rest)[0], init)
    m, l, o = init
    if variant == "fa2" or loop is not None:
        out = _normalise_output(o, l[..., None], policy)
    else:
        out = ops.cast(o, policy.out)
    return (out, _lse(m, l, scale, policy)), prepared


def _normalise_output(o, l, policy: Policy):
    """O = o / l as the policy's ``normalise`` says: fl_out(o / l) ("divide"), or
    fl_out(fl_o_acc(o · fl_stats(1 / l))) ("reciprocal"); 0 where l = 0."""
    if policy.normalise == "divide":
        return normalise(o, l, policy.out)
    reciprocal = normalise(jnp.ones_like(l), l, policy.stats)
    return ops.cast(ops.mul(o, reciprocal, policy.o_acc), policy.out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_vjp(call: Call, q, k, v, dynamic):
    return _flash_forward(call, q, k, v, dynamic)[0]


def _flash_vjp_fwd(call: Call, q, k, v, dynamic):
    outputs, prepared = _flash_forward(call, q, k, v, dynamic)
    return outputs, (prepared, outputs, dynamic)


def _flash_vjp_bwd(call: Call, residuals, cotangents):
    (q, k, v, _), (o, lse), dynamic = residuals
    args = call_args(call, dynamic)
    policy, kv_lengths = args.policy, args.kv_lengths
    scale = _resolved_scale(args.scale, q.shape[-1], policy)
    bc = cast(Blocks, call.blocks).bc
    mk = k.shape[-2]
    kv_len = mk if kv_lengths is None else jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), mk)
    d_o, d_lse = cotangents
    q, k, v, d_o, d_lse = clear_masked(q, k, v, d_o, d_lse, lse, kv_len)
    k_blocks, v_blocks, col0s = _key_blocks(k, v, bc)
    bias, mask = _score_mods("flash_attention", q, args, policy, mk, _padded(k, bc))
    # S_j as the forward computes it, masked entries -inf, and the softcap's factor.
    scores = functools.partial(_scorer(q, scale, policy, call, args, kv_len, bias, mask), grad=True)
    d_q, d_k, d_v = flash_backward(
        q, k_blocks, v_blocks, col0s, o, lse, d_o, d_lse, scores, scale, policy
    )
    d_k, d_v = (sum_groups(_unblock(g, mk), call.groups, policy) for g in (d_k, d_v))
    return input_cotangents(call, d_q, d_k, d_v)


_flash_vjp.defvjp(_flash_vjp_fwd, _flash_vjp_bwd)


def _pv(p, v_j, policy: Policy):
    return ops.matmul(p, v_j, policy.pv_acc, accumulation=policy.accumulation)


def _fa2_step(carry, s, v_j, policy: Policy, *, log2_scale):
    m, l, o = carry
    m_new, l_new, e, alpha = online_update(m, l, s, policy, log2_scale=log2_scale)
    pv = _pv(ops.cast(e, policy.p), v_j, policy)
    o = ops.add(ops.mul(o, alpha[..., None], policy.o_acc), pv, policy.o_acc)
    return m_new, l_new, o


def _fa1_step(carry, s, v_j, policy: Policy, *, log2_scale):
    m, l, o = carry
    m_blk = cast_scores(jnp.max(s, axis=-1), policy.stats)
    e = shifted_exp(s, m_blk[..., None], policy, log2_scale=log2_scale)
    l_blk = ops.sum(e, policy.stats, axis=-1, accumulation=policy.accumulation)
    m_new = running_max(m, m_blk, policy.stats)
    alpha = rescale_factor(m, m_new, policy, log2_scale=log2_scale)
    beta = rescale_factor(m_blk, m_new, policy, log2_scale=log2_scale)
    l_alpha = ops.mul(l, alpha, policy.stats)
    l_new = ops.add(l_alpha, ops.mul(beta, l_blk, policy.stats), policy.stats)
    pv = _pv(ops.cast(e, policy.p), v_j, policy)
    num = ops.add(
        ops.mul(l_alpha[..., None], o, policy.o_acc),
        ops.mul(beta[..., None], pv, policy.o_acc),
        policy.o_acc,
    )
    return m_new, l_new, normalise(num, l_new[..., None], policy.o_acc)


def _rowwise_step(carry, s, v_j, policy: Policy, *, log2_scale):
    m, l, o = carry
    m_new, l_new, e, alpha = online_update(m, l, s, policy, log2_scale=log2_scale)
    ratio = normalise(ops.mul(l, alpha, policy.stats), l_new, policy.o_acc)
    pv = _pv(normalise(e, l_new[..., None], policy.p), v_j, policy)
    o = ops.add(ops.mul(ratio[..., None], o, policy.o_acc), pv, policy.o_acc)
    return m_new, l_new, o
