"""Softmax under a policy whose stages all differ, bit for bit against the op-by-op
simulation (tests/attention_sim.py, exact rationals rounded once per op).

test_softmax.py checks the softmaxes under uniform policies, where a value rounded
to the wrong stage (the safe softmax's max in ``scores`` instead of ``stats``, its
sum in ``exp``) cannot be seen; here ``scores``, ``stats``, ``exp`` and ``p`` are
four different formats, so such a swap changes some bit.
"""

import numpy as np
import pytest
from attention_sim import add, cast, div, mul, row_sum, shifted_exp
from helpers import x64_enabled

from fa_jax import custom
from fa_jax.accumulation import get_accumulation
from fa_jax.policy import STAGES, Policy
from fa_jax.softmax import naive_softmax, online_softmax, safe_softmax

# stage -> (exp_bits, man_bits): scores wider than stats, exp wider than both, p narrow.
WIDTHS = {"scores": (7, 10), "stats": (8, 7), "exp": (7, 12), "p": (6, 9)}


def _policy(accumulation: str) -> Policy:
    fmts = {s: custom(*WIDTHS.get(s, (8, 20))) for s in STAGES}
    return Policy(
        **fmts,
        accumulation=get_accumulation(accumulation),
        scale="scores",
        name=f"softmax-stages-{accumulation}",
    )


def _rows() -> np.ndarray:
    x = np.random.default_rng(7).standard_normal((4, 7)) * 3.0
    x[1, 2] = x[3, 0] = -np.inf  # masked entries
    return x


def _safe(x, policy: Policy) -> np.ndarray:
    kind = policy.accumulation.kind
    x = cast(x, policy.scores)
    m = cast(x.max(axis=-1), policy.stats)
    e = shifted_exp(x, m[:, None], policy.exp)
    return div(e, row_sum(e, policy.stats, kind)[:, None], policy.p)


def _online(x, policy: Policy, block: int) -> np.ndarray:
    kind = policy.accumulation.kind
    x = cast(x, policy.scores)
    m, d = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
    for j in range(0, x.shape[1], block):
        xb = x[:, j : j + block]
        m_new = cast(np.maximum(m, xb.max(axis=-1)), policy.stats)
        alpha = shifted_exp(m, m_new, policy.exp)
        s = row_sum(shifted_exp(xb, m_new[:, None], policy.exp), policy.stats, kind)
        d = add(mul(d, alpha, policy.stats), s, policy.stats)
        m = m_new
    return div(shifted_exp(x, m[:, None], policy.exp), d[:, None], policy.p)


def _naive(x, policy: Policy) -> np.ndarray:
    kind = policy.accumulation.kind
    # exp of the unshifted scores: a shift by 0 (scores' values are exp's values too)
    e = shifted_exp(cast(x, policy.scores), 0.0, policy.exp)
    return div(e, row_sum(e, policy.stats, kind)[:, None], policy.p)


@pytest.mark.parametrize("accumulation", ["exact", "sequential"])
def test_every_softmax_rounds_each_value_to_its_own_stage(accumulation):
    policy = _policy(accumulation)
    x = _rows()
    with x64_enabled():
        runs = {
            "safe": (safe_softmax(x, policy), _safe(x, policy)),
            "naive": (naive_softmax(x, policy), _naive(x, policy)),
        }
        for block in (1, 3):
            runs[f"online block={block}"] = (
                online_softmax(x, policy, block=block),
                _online(x, policy, block),
            )
    for name, (got, want) in runs.items():
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{name}, {accumulation}")
