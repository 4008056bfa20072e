"""A real attention kernel beside fa_jax's model of it.

:class:`Kernel` describes one real implementation (what runs, where, the formats
it runs natively) and :class:`KernelModel` is fa_jax's bit-exact emulation of it:
a :class:`~fa_jax.Policy` (the format of every stage, the accumulation model,
the exp model, the scale placement) and an algorithm, either the materialised
``reference`` attention or the tiled ``flash`` recurrence with its tile sizes
and loop variant (:mod:`fa_jax.attention`; Dao 2023, Algorithm 1).

Calling convention (every kernel, real or emulated): q, k, v are float64 arrays
of shape ``(..., N, d)`` whose values are exact in the kernel's format; the
result is a float64 numpy array.  ``scale=None`` means 1/sqrt(d); ``causal``
keeps key j for query i when j <= i + q_offset (top-left, q_offset = 0, unless
the ``q_offset`` feature aligns it otherwise).

Features (:data:`FEATURES`), each passed only when used, with the meaning of
:func:`fa_jax.attention.reference_attention`: ``bias`` (float64, broadcastable
to (..., H, N, M), values exact in the kernel's format or -inf), ``mask``
(boolean, True = keep), ``window`` ((left, right)), ``kv_lengths`` (ints
broadcastable to the leading dimensions), ``q_offset`` (an int other than 0:
query i at key position i + q_offset, for the causal mask and the window, as
:mod:`fa_jax.masking`; "bottom-right" is M - N, N queries behind a KV cache),
``softcap`` (c > 0: scores c · tanh(S / c)), ``sinks`` (a logit per head,
broadcastable to (..., H), exact in FP32, or -inf: no sink; both
:mod:`fa_jax.score_mods`), and ``gqa``: K and V with H_kv heads dividing H
(:mod:`fa_jax.heads`).  A kernel declares the features it supports
(``Kernel.features``) and any keyword options of its own (``Kernel.options``),
which reach its ``real`` and its ``model`` unchanged.

A model answers only for the CPU code it follows: ``Kernel.unmodelled`` names the
code the real kernel runs on this CPU where the model does not follow it, and the
model then raises NotImplementedError with that reason (:func:`refuse`), never an
answer for code it was not checked against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from fa_jax._x64 import float64_enabled
from fa_jax.attention import VARIANTS, Blocks, flash_attention, reference_attention
from fa_jax.policy import Policy

__all__ = [
    "ALGORITHMS",
    "FEATURES",
    "Kernel",
    "KernelModel",
    "flat_heads",
    "heads_call",
    "refuse",
]

ALGORITHMS = ("reference", "flash")

# The features a kernel may support beyond (q, k, v, causal, scale): the keyword
# arguments of reference_attention, and "gqa" for K/V with fewer heads.
FEATURES = ("bias", "mask", "window", "kv_lengths", "q_offset", "softcap", "sinks", "gqa")


def _everything_modelled(fmt=None, **options) -> str | None:
    del fmt, options
    return None


def refuse(reason: str | None) -> None:
    """NotImplementedError(``reason``) where there is one: a model's answer to a call
    on CPU code it does not follow (module docstring)."""
    if reason is not None:
        raise NotImplementedError(reason)


@dataclasses.dataclass(frozen=True)
class KernelModel:
    """fa_jax's model of a real kernel: policy, algorithm, blocks, loop variant.

    ``forward``, when given, replaces the algorithm: a function
    ``forward(q, k, v, *, policy, causal, scale, **features)`` of float64 arrays
    composed of :mod:`fa_jax.ops` steps, for a kernel whose order of steps
    neither attention function follows (``algorithm`` then names the closest
    one); it gets the features given (module docstring).
    """

    kernel: str
    policy: Policy
    algorithm: str
    blocks: Blocks | None = None
    variant: str | None = None
    forward: Callable[..., Any] | None = None

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"KernelModel.algorithm: expected one of {ALGORITHMS}, got {self.algorithm!r}"
            )
        if not isinstance(self.policy, Policy):
            raise TypeError(f"KernelModel.policy: expected a Policy, got {self.policy!r}")
        if self.algorithm == "flash":
            if not isinstance(self.blocks, Blocks):
                raise ValueError(
                    f"KernelModel.blocks: the flash algorithm needs Blocks(br, bc), "
                    f"got {self.blocks!r}"
                )
            if self.variant is not None and self.variant not in VARIANTS:
                raise ValueError(
                    f"KernelModel.variant: expected one of {VARIANTS}, got {self.variant!r}"
                )
        elif self.blocks is not None or self.variant is not None:
            raise ValueError(
                "KernelModel: blocks and variant belong to the flash algorithm, "
                f"got them with {self.algorithm!r}"
            )

    def __call__(self, q, k, v, *, causal: bool = False, scale=None, **features) -> np.ndarray:
        """The emulated output (..., N, d_v) as a float64 numpy array; ``features``
        (module docstring) only those used, K/V with fewer heads taken as GQA."""
        with float64_enabled():
            if self.forward is not None:
                out = self.forward(
                    q, k, v, policy=self.policy, causal=causal, scale=scale, **features
                )
            elif self.algorithm == "reference":
                out = reference_attention(
                    q, k, v, self.policy, causal=causal, scale=scale, **features
                )
            else:
                assert self.blocks is not None  # checked in __post_init__
                out = flash_attention(
                    q,
                    k,
                    v,
                    self.policy,
                    self.blocks,
                    variant=self.variant or "fa2",
                    causal=causal,
                    scale=scale,
                    **features,
                )[0]  # pyright: ignore[reportIndexIssue]
            return np.asarray(out, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A real attention kernel (module docstring for the calling convention).

    ``real(q, k, v, *, fmt, causal=False, scale=None, **features)`` runs it;
    ``model(fmt, n, d, **options)`` is fa_jax's model of it for that format and shape;
    ``unavailable()`` is None where it runs here, else the reason;
    ``platform()`` gives the facts a report needs (library versions, CPU
    capability, backend and device); ``formats`` are the names of the formats
    the real kernel runs natively; ``features`` the names of :data:`FEATURES` it
    supports (both ``real`` and the model then take them); ``options`` the names
    of keyword options of its own (e.g. a thread count), passed to ``real`` and
    to ``model``.  ``unmodelled(fmt=None, **options)`` is None where the model
    follows the code the real kernel runs on this CPU for that format and those
    options (for every format and option it offers where ``fmt`` is None), else
    why not: the code that runs here and the code modelled; ``model`` then raises
    NotImplementedError with it (limits that depend on the shape are the model's
    own, raised when it is called).
    """

    name: str
    description: str
    real: Callable[..., np.ndarray]
    model: Callable[..., KernelModel]
    unavailable: Callable[[], str | None]
    platform: Callable[[], dict[str, str]]
    formats: tuple[str, ...] = ("bf16", "fp16")
    features: frozenset[str] = frozenset()
    options: tuple[str, ...] = ()
    unmodelled: Callable[..., str | None] = _everything_modelled

    def __post_init__(self):
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(
                f"Kernel {self.name!r}: features: expected names among {FEATURES}, "
                f"got {sorted(unknown)}"
            )
        clash = set(self.options) & {*FEATURES, "fmt", "causal", "scale"}
        if clash:
            raise ValueError(
                f"Kernel {self.name!r}: options: expected names other than the common "
                f"arguments and features, got {sorted(clash)}"
            )
        object.__setattr__(self, "features", frozenset(self.features))
        object.__setattr__(self, "options", tuple(self.options))


def flat_heads(q, k, v):
    """(..., N, d) arrays as float32 (B·H, N, d) for a real kernel's call (their values
    are exact in any format up to FP32), and q's leading shape to restore."""
    lead = np.shape(q)[:-2]
    return lead, [np.asarray(t, np.float32).reshape(-1, *np.shape(t)[-2:]) for t in (q, k, v)]


def heads_call(dtype: str, causal: bool, scale, implementation: Literal["xla", "cudnn"]):
    """``jax.nn.dot_product_attention`` with ``implementation`` ("xla", "cudnn") as a
    function on (B·H, N, d) inputs (:func:`flat_heads`), not jitted: its inputs
    rounded to ``dtype`` by the call itself, its output in float32."""
    import jax
    import jax.numpy as jnp

    def run(q, k, v):
        q, k, v = (jnp.swapaxes(t, -2, -3).astype(dtype) for t in (q, k, v))
        o = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation=implementation
        )
        return jnp.swapaxes(o, -2, -3).astype(jnp.float32)

    return run
