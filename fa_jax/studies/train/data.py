"""Locally generated training tokens with a fixed order: a seeded second-order Markov chain.

The language: ``vocab`` tokens.  Token ``x_{t-1}`` allows ``branching``
successors (distinct, chosen once from the seed); which of them follows, and
with what probability, depends on the context ``(x_{t-2}, x_{t-1})``: each
context has its own flat-Dirichlet distribution over the successors of
``x_{t-1}``.  A model that looks only at the current token learns the allowed
successors quickly (loss from ``log(vocab)`` to about ``log(branching)``); to
go further it must attend to the previous position, so attention carries real
signal in training.  The floor, knowing the whole table, is the mean entropy of
the context distributions (:meth:`MarkovData.entropy_rate_bound`, about ``1/2
+ 1/3 + 1/4 = 1.08`` nats for ``branching = 4``).

Order: batch ``step`` is drawn from ``numpy.random.default_rng([seed, step])``
(a SeedSequence of both), independently of every other step and of the run
that asks for it, so every run of a study sees the same tokens in the same
order and a resumed run sees what an uninterrupted one would.  Each row starts
with two uniform tokens and follows the chain; nothing is downloaded or read.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fa_jax._checks import non_negative_int, positive_int

__all__ = ["MarkovData"]


@dataclasses.dataclass(frozen=True)
class MarkovData:
    """Batches of ``(batch, context + 1)`` int32 tokens (inputs ``[:, :-1]``,
    targets ``[:, 1:]``) from the second-order chain of the module docstring."""

    vocab: int = 32
    context: int = 128
    batch: int = 8
    branching: int = 4
    seed: int = 0

    def __post_init__(self):
        for name in ("vocab", "context", "batch", "branching"):
            object.__setattr__(self, name, positive_int(getattr(self, name), f"MarkovData.{name}"))
        if self.branching > self.vocab:
            raise ValueError(
                f"MarkovData.branching: expected at most vocab={self.vocab}, got {self.branching}"
            )
        object.__setattr__(self, "seed", non_negative_int(self.seed, "MarkovData.seed"))

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(successors ``(vocab, branching)``, cumulative probabilities
        ``(vocab², branching)``): row ``b`` of the first lists the tokens allowed
        after ``b``; row ``a * vocab + b`` of the second is the distribution over
        them in the context (x_{t-2}, x_{t-1}) = (a, b)."""
        rng = np.random.default_rng([self.seed, 2**31])  # apart from every batch's stream
        v, k = self.vocab, self.branching
        successors = np.argsort(rng.random((v, v)), axis=1)[:, :k].astype(np.int32)
        cdf = np.cumsum(rng.dirichlet(np.ones(k), size=v * v), axis=1)
        cdf[:, -1] = 1.0  # the last successor takes any rounding slack
        return successors, cdf

    def entropy_rate_bound(self) -> float:
        """Mean entropy (nats) of the successor distributions: the loss a model that
        knew the table would reach, if contexts were uniform."""
        _, cdf = self.table()
        p = np.diff(cdf, axis=1, prepend=0.0)
        return float(
            np.mean(-np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1))
        )

    def batch_at(self, step: int, table=None) -> np.ndarray:
        """The tokens of training step ``step`` (module docstring), int32
        ``(batch, context + 1)``.  ``table`` is ``self.table()``, passed to save
        recomputing it."""
        non_negative_int(step, "MarkovData.batch_at: step")
        successors, cdf = self.table() if table is None else table
        rng = np.random.default_rng([self.seed, int(step)])
        n, t = self.batch, self.context + 1
        tokens = np.empty((n, t), np.int32)
        tokens[:, :2] = rng.integers(0, self.vocab, size=(n, 2), dtype=np.int32)
        u = rng.random((n, t))
        for i in range(2, t):
            ctx = tokens[:, i - 2] * self.vocab + tokens[:, i - 1]
            choice = np.minimum((u[:, i, None] >= cdf[ctx]).sum(axis=1), self.branching - 1)
            tokens[:, i] = successors[tokens[:, i - 1], choice]
        return tokens
