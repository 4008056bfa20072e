"""Two ways to run several block configurations: grouping vs a masked tile layout.

The sweep (``fa_jax.studies.sweep``) must run flash attention for several key-block
widths Bc.  Two strategies, timed here side by side in one run, each over the
same configurations (every Bc × every seed), compiles included:

(a) **grouping** (what the sweep does): one compiled program per Bc, vmapped
    over seeds; ``fa_jax.flash_attention`` with ``Blocks(Bc, Bc)``.

(b) **masked tile layout**: one compiled program vmapped over (Bc × seeds)
    with Bc a *traced* integer.  Every configuration scans the same number of
    tiles, ``T = ceil(N / min Bc)``, each ``W = max Bc`` columns wide; tile t of
    a configuration holds its keys ``t·Bc … t·Bc + Bc − 1`` and masks the other
    ``W − Bc`` columns (and every tile past its last key) with ``-inf`` scores
    and zero values.  A masked column adds an exact 0 to every sum and leaves
    the running max alone, and a fully masked tile is the identity on
    (m_i, l_i, o_i), so (b) computes the same recurrence as (a).  It does
    ``len(Bc) · T · W`` columns of work per row against (a)'s ``len(Bc) · N``.

The script checks (b) against (a) bit for bit and prints both wall times and
their ratio.  (b) is built here from fa_jax.attention's own step functions; it
is a measurement prototype, not part of the library.

    python experiments/bench_block_layout.py
    python experiments/bench_block_layout.py --seq-lens 256 1024 4096 --bcs 16 32 64 128
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

from fa_jax import Blocks, flash_attention, paper_uniform
from fa_jax.attention import (
    _fa2_step,
    _lse,
    _mask,
    _prepare,
    _scores,
    _zero_masked_keys,
)
from fa_jax.softmax import normalise
from fa_jax.inputs import make_inputs


def flash_masked_layout(q, k, v, policy, bc, *, width: int, tiles: int):
    """FA2 forward with a traced key-block width ``bc`` laid out in ``tiles`` tiles of
    ``width`` columns (module docstring, strategy (b))."""
    q, k, v, scale = _prepare(q, k, v, policy, None)
    lead, n, mk, dv = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    w = jnp.arange(width)

    def step(carry, t):
        col0 = t * bc
        cols = col0 + w
        live = (w < bc) & (cols < mk)
        idx = jnp.clip(cols, 0, mk - 1)
        k_t = jnp.take(k, idx, axis=-2)
        v_t = jnp.where(live[:, None], jnp.take(v, idx, axis=-2), 0.0)
        v_t = _zero_masked_keys(v_t, mk, col0)
        s = _scores(q, jnp.swapaxes(k_t, -1, -2), scale, policy)
        keep = _mask(n, width, False, None, None, lead, col0) & live
        s = jnp.where(keep, s, -jnp.inf)
        return _fa2_step(carry, s, v_t, policy), None

    init = (jnp.full((*lead, n), -jnp.inf), jnp.zeros((*lead, n)), jnp.zeros((*lead, n, dv)))
    (m, l, o), _ = jax.lax.scan(step, init, jnp.arange(tiles))
    return normalise(o, l[..., None], policy.out), _lse(m, l, policy)


def run_grouped(qkv, policy, bcs):
    outs = {}
    for bc in bcs:
        fn = jax.jit(jax.vmap(lambda q, k, v, bc=bc: flash_attention(
            q, k, v, policy, Blocks(bc, bc))[0]))
        outs[bc] = np.asarray(fn(*qkv))
    return outs


def run_masked(qkv, policy, bcs, n):
    width, tiles = max(bcs), -(-n // min(bcs))
    seeds = qkv[0].shape[0]
    rep = [jnp.repeat(t[None], len(bcs), axis=0).reshape(-1, *t.shape[1:]) for t in qkv]
    bc_axis = jnp.repeat(jnp.asarray(bcs), seeds)
    fn = jax.jit(jax.vmap(lambda q, k, v, bc: flash_masked_layout(
        q, k, v, policy, bc, width=width, tiles=tiles)[0]))
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
    policy = paper_uniform(args.format)
    print(f"policy {policy.name}, d={args.d}, Bc {args.bcs}, {args.seeds} seeds; "
          f"wall times include compiles")
    print(f"{'N':>6} {'grouping s':>11} {'masked s':>9} {'masked/grouping':>16} {'bitwise':>8}")
    for n in args.seq_lens:
        qkv = [np.stack(t) for t in zip(*(make_inputs(s, n, d=args.d) for s in range(args.seeds)))]
        qkv = [jnp.asarray(t) for t in qkv]
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
