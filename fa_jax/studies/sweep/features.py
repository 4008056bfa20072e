"""The attention features a sweep entry runs with: :class:`Features`.

One entry of :attr:`Grid.features <fa_jax.studies.sweep.Grid>` says how the
configurations' attention departs from the paper's (one K/V head per query head,
no bias, no window): K/V heads (GQA, :mod:`fa_jax.heads`), a sliding window
(:mod:`fa_jax.masking`), a softcap and ALiBi (:mod:`fa_jax.score_mods`), the
number of split-KV parts of the flash pass, decoding shapes (a few query rows
against every key) and a narrow KV cache (:mod:`fa_jax.kv_cache`).  Golden,
baseline and flash all run with the entry's features, on the same inputs, so
the comparisons stay like for like; the number of splits changes flash only,
and the KV cache the policies only: golden reads K and V as they are, so its
deviations include what the cache adds.

Inputs: the grid's Q, K, V (:func:`fa_jax.inputs.make_inputs`) with ``heads``
heads; with ``kv_heads`` = H_kv, K and V keep their first H_kv heads (query head
h reads K/V head h // (H / H_kv)); with ``queries`` = n_q, Q keeps its first n_q
rows, each facing all ``seq_len`` keys (masks are top-left aligned, so decoding
is refused with a causal mask or a window).  ALiBi's bias is
:func:`~fa_jax.score_mods.alibi_bias` of :func:`~fa_jax.score_mods.alibi_slopes`
(Press et al. 2022), rounded to the policy's ``bias`` stage by the attention.

Each entry has a label, the CSV's ``features`` column: ``none``, or its
non-default fields joined by ``+`` (``kv_heads=2+window=128:0+softcap=30+alibi+
splits=4+queries=1+kv=e4m3fn/head``); :meth:`Features.from_label` reads one back.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from fa_jax._checks import positive_int
from fa_jax.masking import check_window
from fa_jax.policy import Policy
from fa_jax.presets import golden
from fa_jax.quantization import storage_format
from fa_jax.score_mods import alibi_slopes, check_softcap

__all__ = ["PAPER", "Features"]


@dataclasses.dataclass(frozen=True)
class Features:
    """A sweep entry's attention features (module docstring); the default is the
    paper's attention."""

    kv_heads: int | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: bool = False
    num_splits: int = 1
    queries: int | None = None
    kv: str | None = None
    kv_scaling: str = "none"

    def __post_init__(self):
        if self.kv_heads is not None:
            positive_int(self.kv_heads, "Features.kv_heads")
        object.__setattr__(self, "window", check_window(self.window, "Features"))
        cap = check_softcap(self.softcap, "Features")
        object.__setattr__(self, "softcap", None if cap is None else float(cap))
        if not isinstance(self.alibi, bool):
            raise TypeError(f"Features.alibi: expected a bool, got {self.alibi!r}")
        positive_int(self.num_splits, "Features.num_splits")
        if self.kv is not None or self.kv_scaling != "none":
            try:  # the policy's own check of a KV cache
                golden().replace(kv=self.kv, kv_scaling=self.kv_scaling)
            except (ValueError, TypeError) as err:
                raise ValueError(f"Features: {err}") from None
            object.__setattr__(self, "kv", storage_format(self.kv).name)
        if self.queries is not None:
            positive_int(self.queries, "Features.queries")
            if self.window is not None:
                raise ValueError(
                    "Features: expected no window with queries (decoding): windows are "
                    f"aligned top-left, got window={self.window} and queries={self.queries}"
                )

    def label(self) -> str:
        """The CSV's ``features`` value (module docstring)."""
        parts = []
        if self.kv_heads is not None:
            parts.append(f"kv_heads={self.kv_heads}")
        if self.window is not None:
            parts.append(f"window={self.window[0]}:{self.window[1]}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.num_splits != 1:
            parts.append(f"splits={self.num_splits}")
        if self.queries is not None:
            parts.append(f"queries={self.queries}")
        if self.kv is not None:
            scaling = "" if self.kv_scaling == "none" else f"/{self.kv_scaling}"
            parts.append(f"kv={self.kv}{scaling}")
        return "+".join(parts) or "none"

    @classmethod
    def from_label(cls, label: str) -> Features:
        """The entry whose :meth:`label` is ``label``; ValueError naming the part
        it cannot read."""
        if label == "none":
            return cls()
        fields: dict = {}
        for part in label.split("+"):
            name, _, value = part.partition("=")
            try:
                if name == "alibi" and not value:
                    fields["alibi"] = True
                elif name in ("kv_heads", "queries") and value:
                    fields[name] = int(value)
                elif name == "splits" and value:
                    fields["num_splits"] = int(value)
                elif name == "softcap" and value:
                    fields["softcap"] = float(value)
                elif name == "window" and value:
                    left, right = value.split(":")
                    fields["window"] = (int(left), int(right))
                elif name == "kv" and value:
                    fmt, _, scaling = value.partition("/")
                    fields.update(kv=fmt, kv_scaling=scaling or "none")
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    "features: expected 'none' or parts among kv_heads=H, window=L:R, "
                    "softcap=C, alibi, splits=S, queries=Q, kv=FORMAT[/SCALING] joined by "
                    f"'+', got {part!r} in {label!r}"
                ) from None
        return cls(**fields)

    def check(self, heads: int, causal: bool, seq_lens, bcs) -> None:
        """ValueError where the entry does not fit the grid: H_kv must divide the
        query heads, decoding takes no causal mask, and every flash pass must have
        at least ``num_splits`` key blocks of each Bc in ``bcs``."""
        if self.kv_heads is not None and heads % self.kv_heads:
            raise ValueError(
                f"Features.kv_heads: expected a divisor of the grid's heads {heads}, "
                f"got {self.kv_heads}"
            )
        if self.queries is not None and causal:
            raise ValueError(
                "Features.queries: expected a grid without causal (decoding faces every "
                f"key; masks are aligned top-left), got queries={self.queries} with causal"
            )
        fewest = min(math.ceil(min(seq_lens) / bc) for bc in bcs)
        if self.num_splits > fewest:
            raise ValueError(
                f"Features.num_splits: expected at most the fewest key blocks of the grid "
                f"({fewest}), got {self.num_splits}"
            )

    def inputs(self, q, k, v):
        """Q, K, V ``(..., H, N, d)`` cut to the entry's query rows and K/V heads
        (copies: a cut holds none of the memory of what it was cut from)."""
        if self.queries is not None:
            q = np.array(q[..., : self.queries, :])
        if self.kv_heads is not None:
            k, v = np.array(k[..., : self.kv_heads, :, :]), np.array(v[..., : self.kv_heads, :, :])
        return q, k, v

    def attention_kwargs(self, heads: int, n: int, m: int, dtype) -> dict:
        """The attention keywords of the entry for ``heads`` query heads, ``n``
        query rows and ``m`` keys (a program's padded sizes): ``window``,
        ``softcap`` and ALiBi's ``bias`` (H, n, m), the product slope · |i - j|
        rounded once in ``dtype`` (exact where the slopes are powers of two: H of
        1, 2, 4 or 8), as :func:`~fa_jax.score_mods.alibi_bias` does in float64."""
        kw: dict = {"window": self.window, "softcap": self.softcap}
        if self.alibi:
            i = jnp.arange(n, dtype=jnp.int32)[:, None]
            j = jnp.arange(m, dtype=jnp.int32)[None, :]
            slopes = jnp.asarray(alibi_slopes(heads), dtype)
            kw["bias"] = -slopes[:, None, None] * jnp.abs(i - j).astype(dtype)
        return kw

    def policy(self, policy: Policy) -> Policy:
        """``policy`` with the entry's KV cache (unchanged without one)."""
        if self.kv is None:
            return policy
        return policy.replace(kv=self.kv, kv_scaling=self.kv_scaling)

    def for_golden(self) -> Features:
        """The entry the golden runs with: the same, without the KV cache."""
        return dataclasses.replace(self, kv=None, kv_scaling="none")

    def flash_kwargs(self) -> dict:
        """The keywords of the flash pass only: the number of split-KV parts."""
        return {} if self.num_splits == 1 else {"num_splits": self.num_splits}


PAPER = Features()  # the paper's attention: one K/V head per query head, no bias, no window
