"""The model's forward pass of XLA's attention on the CPU (:func:`forward`): the
steps of ``_dot_product_attention_core`` (jax/_src/nn/functions.py) as XLA's CPU
backend runs them (:mod:`fa_jax.kernels.xla`), in the orders of
:mod:`~fa_jax.kernels.xla.orders`, with what the program decides read from it
(:mod:`~fa_jax.kernels.xla.hlo`, :mod:`~fa_jax.kernels.xla.probes`).

Calls with features (:class:`~fa_jax.kernels.xla.calls.Layout`) run on the
grouped (B·H_kv, G·N, d) view, where XLA may run a dot as its own
(:mod:`~fa_jax.kernels.xla.own_dots`: its GEMV, Eigen's contraction sharded over
the keys): :func:`fitted_own_dots` finds which reproduces the real program.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import masking, ops
from fa_jax.exponential import YNNPACK, ExpModel
from fa_jax.formats import Format, get_format
from fa_jax.kernels.xla import calls, hlo, orders, own_dots, probes
from fa_jax.kernels.xla.exp import XLA_CPU_EXP
from fa_jax.kernels.xla.orders import AVX512, VectorCode
from fa_jax.policy import Policy
from fa_jax.presets import fa2_kernel
from fa_jax.rounding import round_to

__all__ = ["PROBED", "exp_model_for", "fitted_own_dots", "forward", "kernel_policy"]


_F32_MAX = float(np.finfo(np.float32).max)
_LARGE_NEGATIVE = float(np.float32(-0.7 * _F32_MAX))  # jax's mask value, in float32


def kernel_policy(fmt: Format) -> Policy:
    """The model's policy in ``fmt``: fa2_kernel's stages, XLA's reciprocal, and
    the exp the jitted formats run on most shapes, YNNPACK's (XLA's own for fp16;
    :func:`exp_model_for` swaps it for the other where XLA's program does)."""
    exp = XLA_CPU_EXP if fmt.name == "float16" else YNNPACK
    return fa2_kernel(fmt).replace(name=f"xla({fmt.name})", exp_model=exp, normalise="reciprocal")


def exp_model_for(
    policy: Policy, shape: tuple[int, ...], causal: bool, layout: calls.Layout | None = None
) -> ExpModel:
    """The policy's exp, except that XLA's two exps stand for whichever of them the program
    runs for (B·H, N, d) inputs: YNNPACK's inside a YNNPACK fusion, XLA's own elsewhere
    (:mod:`~fa_jax.kernels.xla.hlo`).  Any other exp model (a calibration knob) is kept."""
    if policy.exp_model not in (XLA_CPU_EXP, YNNPACK):
        return policy.exp_model
    fused = hlo.in_ynn_fusions(policy.inputs.name, shape, causal, layout)[1]
    if fused:
        return YNNPACK
    return XLA_CPU_EXP


def forward(q, k, v, *, policy: Policy, causal: bool, scale, code: VectorCode = AVX512, **features):
    """The model of :func:`~fa_jax.kernels.xla.calls.real` on (..., N, d) inputs exact in
    ``policy``'s input format, for ``code``'s CPU (:class:`VectorCode`): the 3-D call's
    steps, or the 4-D call's where there are features (:func:`_featured_forward`)."""
    if policy.inputs.name == "float32" and np.shape(v)[-1] == 1:
        raise ValueError(
            "xla: fp32 with d = 1: XLA rewrites P V as element-wise products summed in "
            "reduce-windows, not a dot; not modelled"
        )
    if calls.featured(q, k, features):
        return _featured_forward(
            q, k, v, policy=policy, causal=causal, scale=scale, code=code, **features
        )
    q, k, v = (ops.carrier(t, np.float64) for t in (q, k, v))
    n, d = q.shape[-2:]
    shape = (int(np.prod(q.shape[:-2], dtype=int)), n, d)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    round_p = hlo.p_rounded(policy.inputs.name, shape, bool(causal))
    window = hlo.sum_window(policy.inputs.name, shape, bool(causal))
    qk = probes.qk_runs(policy.inputs.name, shape)
    pv = probes.pv_order(policy.inputs.name, shape)
    policy = policy.replace(exp_model=exp_model_for(policy, shape, bool(causal)))
    return _model_core(
        q,
        k,
        v,
        scale,
        causal=bool(causal),
        policy=policy,
        round_p=round_p,
        qk=qk,
        pv=pv,
        window=window,
        fma_step=probes.fma_step(policy.inputs.name, shape, bool(causal)),
    )


def _featured_forward(
    q, k, v, *, policy: Policy, causal: bool, scale, code: VectorCode = AVX512, **features
):
    """The model of :func:`~fa_jax.kernels.xla.calls.real`'s 4-D call
    (:class:`~fa_jax.kernels.xla.calls.Layout`): on the grouped view (B·H_kv, G·N, d) of
    the queries against (B·H_kv, M, d) keys, as XLA's dots run; the bias (exact in the
    input format, so in FP32) added to the scaled scores in FP32, then every pair that
    the mask, causal, window or key lengths drop set to jax's large negative (not -inf:
    a row that keeps no key averages V)."""
    layout = calls.layout_of(np.shape(q), np.shape(k), features)
    b, kv, g, n, m = layout.batch, layout.kv_heads, layout.groups, layout.n, layout.m
    d = np.shape(q)[-1]
    shape = (b * kv, g * n, d)
    q3 = ops.carrier(q, np.float64).reshape(shape)
    k3, v3 = (ops.carrier(t, np.float64).reshape(b * kv, m, -1) for t in (k, v))
    full = (b, kv * g, n, m)
    lengths = None
    if features.get("kv_lengths") is not None:
        lengths = calls.seq_lengths(features["kv_lengths"], np.shape(q)[:-2], b)[:, None]
    keep = masking.keep(
        n,
        m,
        (b, kv * g),
        causal=bool(causal),
        kv_lengths=lengths,
        window=features.get("window"),
        mask=features.get("mask"),
    )
    keep = jnp.broadcast_to(keep, full).reshape(b * kv, g * n, m)
    bias = features.get("bias")
    if bias is not None:
        bias = jnp.broadcast_to(ops.carrier(bias, np.float64), full).reshape(b * kv, g * n, m)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dtype = policy.inputs.name
    round_p = hlo.p_rounded(dtype, shape, bool(causal), layout)
    window = hlo.sum_window(dtype, shape, bool(causal), layout)
    own = _own_dots_of(dtype, shape, layout.plain(), code)
    if own is None:
        raise ValueError(
            f"xla: {dtype} {g * n} grouped query rows, d = {d}, over {m} keys in {b * kv} "
            "groups: XLA runs its own dot here, and neither the probed orders, XLA's "
            "GEMV nor Eigen's shards over the keys reproduce it on random inputs; "
            "not modelled"
        )
    qk = () if own.qk else probes.qk_runs(dtype, shape, layout)
    pv = () if own.pv else probes.pv_order(dtype, shape, layout)
    policy = policy.replace(exp_model=exp_model_for(policy, shape, bool(causal), layout))
    out = _model_core(
        q3,
        k3,
        v3,
        scale,
        causal=False,
        policy=policy,
        round_p=round_p,
        qk=qk,
        pv=pv,
        window=window,
        fma_step=probes.fma_step(dtype, shape, bool(causal), layout),
        own=own,
        bias=bias,
        keep=keep,
    )
    return out.reshape(np.shape(q)[:-1] + np.shape(v)[-1:])


PROBED = own_dots.OwnDots()  # both dots in the probed orders (YNNPACK's, or XLA's fitting them)


def _own_dots_of(
    dtype: str, shape: tuple[int, ...], layout: calls.Layout, code: VectorCode = AVX512
) -> own_dots.OwnDots | None:
    """:func:`fitted_own_dots` for ``dtype``: none for fp16 (eager, op by op: the probed
    orders); for bf16 fp32's where bf16's program runs the same dots as XLA's own
    (on float32 operands, so the same kernels): a bf16 output is too coarse for the
    check to tell Eigen's shards apart (unsharded fitted its random inputs at
    (2,4,3,64)/3078, where the real P V runs shards of 1544 keys)."""
    if dtype == "float16":
        return PROBED
    if dtype != "float32" and hlo.own_dot_majors(dtype, shape, layout) == hlo.own_dot_majors(
        "float32", shape, layout
    ):
        return fitted_own_dots("float32", shape, layout, code)
    return fitted_own_dots(dtype, shape, layout, code)


@functools.cache
def fitted_own_dots(
    dtype: str, shape: tuple[int, ...], layout: calls.Layout, code: VectorCode = AVX512
) -> own_dots.OwnDots | None:
    """How the model reproduces the plain program of ``layout`` in ``dtype`` (jitted: bf16
    or fp32) on random inputs where it runs a dot as XLA's own
    (:mod:`~fa_jax.kernels.xla.own_dots`): with one row per group a dot is XLA's GEMV of
    the major the HLO's layouts give, of each width ``code``'s registers give it
    (:attr:`VectorCode.gemv_lanes`), else the probed order; otherwise P V is Eigen's
    contraction, which can shard the keys over threads
    (:func:`~fa_jax.kernels.xla.orders.sharded_pv_dot`, which the probes, reading the
    first key's blocks, cannot see): unsharded, then each size Eigen can pick, cut by
    each ``kc`` that gives the probed block, then unsharded with the last keys joined to
    the block before (measured, rule unknown: docs/kernels.md), then with the last N mod
    tile_k keys FMA'd onto their block (Eigen's rows left over from its vector panels:
    :attr:`~fa_jax.kernels.xla.own_dots.OwnDots.pv_rest_fma`).  :data:`PROBED` without a
    check where YNNPACK runs both dots, or P V's keys are too few to shard and neither
    dot is a GEMV (every such shape measured fits); None where nothing fits."""
    qk_major, pv_major = hlo.own_dot_majors(dtype, shape, layout)
    one_row = shape[1] == 1
    qk: list = [None]
    if qk_major and one_row:
        qk = [*(own_dots.Gemv(qk_major, lanes) for lanes in code.gemv_lanes), None]
    if pv_major and one_row:
        gemvs = (own_dots.Gemv(pv_major, lanes) for lanes in code.gemv_lanes)
        pv = [*(own_dots.OwnDots(pv=gemv) for gemv in gemvs), PROBED]
    else:
        shards = own_dots.eigen_shards(layout.m) if pv_major else []
        block = probes.pv_order(dtype, shape, layout)[0][-1] if shards else layout.m
        pv = [PROBED] + [
            own_dots.OwnDots(pv_shard=shard, pv_kc=kc)
            for shard in shards
            for kc in (
                own_dots.eigen_kcs_giving(shard, block, layout.m % shard or shard)
                if block < shard
                else [None]
            )
        ]
        if shards and layout.m % block:
            pv.append(own_dots.OwnDots(pv_joined=True))
        if shards:  # each of the above again with Eigen's left-over rows
            pv += [dataclasses.replace(own, pv_rest_fma=True) for own in pv if not own.pv_joined]
    if qk == [None] and len(pv) == 1:
        return pv[0]
    rng = np.random.default_rng(0)
    bh, _, d = shape
    fmt = get_format(dtype)
    q, k, v = (
        np.asarray(round_to(rng.standard_normal(s), fmt), np.float32)
        for s in (shape, (bh, layout.m, d), (bh, layout.m, d))
    )
    real = np.asarray(calls.grouped_call(dtype, layout)(q, k, v), np.float64)
    policy = kernel_policy(fmt)
    policy = policy.replace(exp_model=exp_model_for(policy, shape, False, layout))
    for gemv, candidate in itertools.product(qk, pv):
        own = dataclasses.replace(candidate, qk=gemv)
        emulated = _model_core(
            *(ops.carrier(t, np.float64) for t in (q, k, v)),
            1.0 / math.sqrt(d),
            causal=False,
            policy=policy,
            round_p=hlo.p_rounded(dtype, shape, False, layout),
            qk=() if own.qk else probes.qk_runs(dtype, shape, layout),
            pv=() if own.pv else probes.pv_order(dtype, shape, layout),
            window=hlo.sum_window(dtype, shape, False, layout),
            fma_step=probes.fma_step(dtype, shape, False, layout),
            own=own,
        )
        if np.array_equal(np.asarray(emulated), real):
            return own
    return None


@functools.partial(
    jax.jit,
    static_argnames=("causal", "policy", "round_p", "qk", "pv", "window", "fma_step", "own"),
)
def _model_core(
    q,
    k,
    v,
    scale,
    *,
    causal: bool,
    policy: Policy,
    round_p: bool,
    qk: tuple[tuple[int, int, bool, int, int], ...],
    pv: tuple[tuple[int, int, int, int], ...],
    window: tuple[orders.Levels, bool] | None = None,
    fma_step: str | tuple[int, ...] | None = None,
    own: own_dots.OwnDots = PROBED,
    bias=None,
    keep=None,
):
    """The model's steps; every rounding names the stage of ``policy`` it belongs to, so
    calibration's knobs reach it (the summation orders are XLA's, fixed).  ``bias`` is
    added to the scaled scores in the scores' stage, and ``keep`` (the pairs kept) sets
    the others to jax's large negative, as ``causal`` does.  ``fma_step``
    (:func:`~fa_jax.kernels.xla.hlo.contracted`): the step the scale's product is fused
    into, S·scale + bias or S·scale - m, one rounding; ``own``: the dots XLA runs as its
    own (:class:`~fa_jax.kernels.xla.own_dots.OwnDots`): Q Kᵀ or P V as its GEMV, in
    place of ``qk``'s or ``pv``'s probed runs, or P V as Eigen's shards
    (:func:`~fa_jax.kernels.xla.orders.sharded_pv_dot`)."""
    fmt = policy.inputs
    q, k, v = (ops.cast(t, fmt) for t in (q, k, v))
    n, m = q.shape[-2], k.shape[-2]
    if own.qk:
        s = own_dots.gemv(q, k, policy.qk_acc, own.qk)
    else:
        s = jnp.concatenate(
            [
                orders.qk_dot(
                    q, k[..., lo:hi, :], pairs=pairs, acc=policy.qk_acc, tile_k=tile_k, block=block
                )
                for lo, hi, pairs, tile_k, block in qk
            ],
            axis=-1,
        )
    unscaled, scale = s, round_to(scale, policy.scores)
    if bias is not None and fma_step == "add":
        s = ops.fma(unscaled, scale, bias, policy.scores)
    else:
        s = ops.mul(unscaled, scale, policy.scores)
        if bias is not None:
            s = ops.add(s, bias, policy.scores)
    kept = jnp.tril(jnp.ones((n, m), bool)) if causal else None
    if keep is not None:
        kept = keep if kept is None else kept & keep
    if kept is not None:
        s = jnp.where(kept, s, _LARGE_NEGATIVE)
    m_i = jnp.max(s, axis=-1, keepdims=True)
    shifted = ops.sub(s, m_i, policy.exp)
    if fma_step is not None and fma_step != "add":
        fused = ops.fma(unscaled, scale, -m_i, policy.exp)
        if fma_step != "subtract":  # the keys where the select is folded
            folded = jnp.zeros(m, bool).at[np.asarray(fma_step)].set(True)
            kept = folded if kept is None else kept & folded
        shifted = fused if kept is None else jnp.where(kept, fused, shifted)
    e = policy.exp_model.fn(shifted, policy.exp)
    if window is None:
        total = orders.softmax_sum(e, policy.stats)
    else:
        levels, ynn_total = window
        total = orders.windowed_sum(e, levels, policy.stats, ynn_total)
    if policy.normalise == "reciprocal":
        p = ops.mul(e, ops.div(1.0, total, policy.stats)[..., None], policy.stats)
    else:
        p = ops.div(e, total[..., None], policy.stats)
    if round_p:
        p = ops.cast(p, policy.p)
    if own.pv:
        o = own_dots.gemv(p, jnp.swapaxes(v, -1, -2), policy.pv_acc, own.pv)
    else:
        o = jnp.concatenate(
            [
                orders.pv_dot(
                    p[..., lo:hi, :],
                    v,
                    policy.pv_acc,
                    block,
                    tile_k,
                    own.pv_joined,
                    own.pv_rest_fma,
                )
                if own.pv_shard is None
                else orders.sharded_pv_dot(
                    p[..., lo:hi, :],
                    v,
                    policy.pv_acc,
                    block,
                    tile_k,
                    own.pv_shard,
                    own.pv_kc,
                    own.pv_rest_fma,
                )
                for lo, hi, tile_k, block in pv
            ],
            axis=-2,
        )
    return ops.cast(o, policy.out)
