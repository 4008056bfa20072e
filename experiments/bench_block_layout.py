"""Two ways to run several key-block widths: grouping vs a masked tile layout.

A sweep over key-block widths Bc (Golden et al. 2024 §4.3, Fig 6) must run
flash attention once per Bc.  Two strategies, timed side by side in one run over
the same configurations (every Bc × every seed), compiles included:

(a) **grouping** (what ``fa_jax.studies.sweep`` does): one compiled program per
    Bc, vmapped over seeds: ``fa_jax.flash_attention`` with ``Blocks(Bc, Bc)``.

(b) **masked tile layout**: one compiled program vmapped over (Bc × seeds) with
    Bc a *traced* integer.  Every configuration scans the same number of tiles,
    ``T = ceil(N / min Bc)``, each ``W = max Bc`` columns wide; tile t of a
    configuration holds its keys ``t·Bc … t·Bc + Bc − 1`` and masks the other
    ``W − Bc`` columns (and every tile past its last key) with ``-inf`` scores
    and zero values.  A masked column adds an exact 0 to every sum and leaves
    the running max alone, and a fully masked tile is the identity on
    (m_i, l_i, o_i), so (b) computes the same recurrence as (a).  It does
    ``len(Bc) · T · W`` columns of work per row against (a)'s ``len(Bc) · N``.

(b) is FlashAttention-2's forward (Dao 2023, Algorithm 1) written here from
fa_jax's public op layer (``fa_jax.ops``, ``fa_jax.softmax.online_update``,
``normalise``); the script checks it against (a) bit for bit and prints both
wall times and their ratio.  Results: see docs/performance.md.

    python experiments/bench_block_layout.py
    python experiments/bench_block_layout.py --seq-lens 256 1024 4096 --bcs 16 32 64 128
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import Blocks, Policy, flash_attention, make_inputs, ops, paper_uniform, round_to
from fa_jax.softmax import normalise, online_update


def prepare(q, k, v, policy: Policy):
    """Q, K, V rounded to the input format, and the scale 1/sqrt(d) rounded to the
    format of the stage it multiplies (applied to Q here when ``policy.scale == "q"``)."""
    q, k, v = (ops.cast(ops.carrier(t), policy.inputs) for t in (q, k, v))
    stage = policy.inputs if policy.scale == "q" else policy.scores
    scale = round_to(jnp.float64(1.0 / math.sqrt(q.shape[-1])), stage)
    if policy.scale == "q":
        q = ops.mul(q, scale, policy.inputs)
    return q, k, v, scale


def scores(q, k_t, scale, policy: Policy):
    """S = fl_scores(fl_qk_acc(Q Kᵀ) · scale), or fl_scores(Q' Kᵀ) with Q pre-scaled."""
    s = ops.matmul(q, k_t, policy.qk_acc, accumulation=policy.accumulation)
    if policy.scale == "q":
        return ops.cast(s, policy.scores)
    return ops.mul(s, scale, policy.scores)


def flash_masked_layout(q, k, v, policy: Policy, bc, *, width: int, tiles: int):
    """FA2 forward output with a traced key-block width ``bc`` laid out in ``tiles``
    tiles of ``width`` columns (module docstring, strategy (b))."""
    q, k, v, scale = prepare(q, k, v, policy)
    lead, n, mk, dv = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    w = jnp.arange(width)

    def step(carry, t):
        m, l, o = carry
        cols = t * bc + w
        live = (w < bc) & (cols < mk)
        idx = jnp.clip(cols, 0, mk - 1)
        k_t = jnp.take(k, idx, axis=-2)
        v_t = jnp.where(live[:, None], jnp.take(v, idx, axis=-2), 0.0)
        s = jnp.where(live, scores(q, jnp.swapaxes(k_t, -1, -2), scale, policy), -jnp.inf)
        m, l, e, alpha = online_update(m, l, s, policy)
        pv = ops.matmul(ops.cast(e, policy.p), v_t, policy.pv_acc, accumulation=policy.accumulation)
        o = ops.add(ops.mul(o, alpha[..., None], policy.o_acc), pv, policy.o_acc)
        return (m, l, o), None

    init = (jnp.full((*lead, n), -jnp.inf), jnp.zeros((*lead, n)), jnp.zeros((*lead, n, dv)))
    (_, l, o), _ = jax.lax.scan(step, init, jnp.arange(tiles))
    return normalise(o, l[..., None], policy.out)


def run_grouped(qkv, policy: Policy, bcs):
    outs = {}
    for bc in bcs:
        fn = jax.jit(
            jax.vmap(lambda q, k, v, bc=bc: flash_attention(q, k, v, policy, Blocks(bc, bc))[0])
        )
        outs[bc] = np.asarray(fn(*qkv))
    return outs


def run_masked(qkv, policy: Policy, bcs, n: int):
    width, tiles = max(bcs), -(-n // min(bcs))
    seeds = qkv[0].shape[0]
    rep = [jnp.repeat(t[None], len(bcs), axis=0).reshape(-1, *t.shape[1:]) for t in qkv]
    bc_axis = jnp.repeat(jnp.asarray(bcs), seeds)
    fn = jax.jit(
        jax.vmap(
            lambda q, k, v, bc: flash_masked_layout(q, k, v, policy, bc, width=width, tiles=tiles)
        )
    )
    out = np.asarray(fn(*rep, bc_axis)).reshape(len(bcs), seeds, *qkv[0].shape[1:])
    return {bc: out[i] for i, bc in enumerate(bcs)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--bcs", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--format", default="bf16")
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    policy = paper_uniform(args.format)
    print(
        f"policy {policy.name}, d={args.d}, Bc {args.bcs}, {args.seeds} seeds; "
        f"wall times include compiles"
    )
    print(f"{'N':>6} {'grouping s':>11} {'masked s':>9} {'masked/grouping':>16} {'bitwise':>8}")
    for n in args.seq_lens:
        runs = [make_inputs(s, n, d=args.d) for s in range(args.seeds)]
        qkv = [jnp.asarray(np.stack(t)) for t in zip(*runs)]
        t0 = time.perf_counter()
        a = run_grouped(qkv, policy, args.bcs)
        t_a = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = run_masked(qkv, policy, args.bcs, n)
        t_b = time.perf_counter() - t0
        same = all(np.array_equal(a[bc], b[bc]) for bc in args.bcs)
        print(f"{n:>6} {t_a:>11.2f} {t_b:>9.2f} {t_b / t_a:>16.2f} {same!s:>8}", flush=True)


if __name__ == "__main__":
    main()
