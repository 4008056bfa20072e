"""What a call of :mod:`fa_jax.attention` carries besides Q, K and V, and the loops it may run.

- ``VARIANTS`` (fa1, fa2, rowwise) and the registry of real kernels' flash loops:
  :class:`KernelLoop`, :func:`register_kernel_loop`, :func:`kernel_loops`; an
  engine (:mod:`fa_jax.kernels`) registers its loop here, and
  ``flash_attention(variant=name)`` runs it.
- :class:`Blocks` (the tiles, Br × Bc) and :func:`blocks_from_sram`,
  FlashAttention-1's tile sizes for an SRAM of M elements (Dao et al. 2022,
  Algorithm 1, line 1: Bc = ceil(M / 4d), Br = min(Bc, d)).
- The ``jax.custom_vjp`` plumbing both attention functions share: a call's
  configuration as :class:`Args` (what may hold arrays: the policy, lengths,
  scale, bias, mask, sinks) and :class:`Call` (what is static: the treedef and
  non-array leaves of the ``Args``, the dtypes of Q, K, V, the checked causal
  flag, tiles, variant, head groups, window, softcap, splits and query offset);
  :func:`call_of` checks a call's arguments before anything is traced and cuts
  its configuration into the static ``Call`` and the dynamic arrays,
  :func:`call_args` rebuilds the ``Args``; :func:`input_cotangents` gives dQ, dK, dV
  in the dtypes of Q, K, V; :func:`clear_masked` zeroes what a masked row or key
  would feed the backward (:mod:`fa_jax.backward`).

``fa_jax.attention`` re-exports the public names users had there (``VARIANTS``,
``Blocks``, ``blocks_from_sram``, ``KernelLoop``, ``register_kernel_loop``,
``kernel_loops``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from fa_jax import masking
from fa_jax._checks import positive_int
from fa_jax.formats import get_format
from fa_jax.heads import kv_groups
from fa_jax.policy import Policy
from fa_jax.rounding import round_to
from fa_jax.score_mods import check_softcap

__all__ = [
    "VARIANTS",
    "Args",
    "Blocks",
    "Call",
    "KernelLoop",
    "blocks_from_sram",
    "call_args",
    "call_of",
    "clear_masked",
    "input_cotangents",
    "is_array",
    "kernel_loop",
    "kernel_loops",
    "register_kernel_loop",
]

VARIANTS = ("fa1", "fa2", "rowwise")


@dataclasses.dataclass(frozen=True)
class KernelLoop:
    """A real kernel's flash loop, run by ``flash_attention(variant=name)``:
    ``qk(q, k_t, policy)`` its fl_qk_acc(Q Kᵀ); ``step(carry, s, v_j, policy, *,
    log2_scale)`` its update of (m, l, o) by one key block, as fa2's step in
    :mod:`fa_jax.attention`;
    ``fused_bias``, whether it adds a bias to the scaled scores in one FMA.  Its
    last key block holds only the keys left, unpadded; O = o / l at the end
    (Policy.normalise)."""

    qk: Callable
    step: Callable
    fused_bias: bool


_KERNEL_LOOPS: dict[str, KernelLoop] = {}


def register_kernel_loop(name: str, loop: KernelLoop) -> None:
    """Make ``loop`` a variant of :func:`flash_attention` under ``name``; a name an
    algorithm variant or another loop holds raises."""
    if not isinstance(loop, KernelLoop):
        raise TypeError(f"register_kernel_loop: expected a KernelLoop, got {loop!r}")
    if name in VARIANTS or _KERNEL_LOOPS.get(name, loop) != loop:
        raise ValueError(f"register_kernel_loop: name {name!r}: expected a new name, got one taken")
    _KERNEL_LOOPS[name] = loop


def kernel_loops() -> tuple[str, ...]:
    """The names of the registered kernel loops."""
    return tuple(sorted(_KERNEL_LOOPS))


def kernel_loop(name) -> KernelLoop | None:
    """The kernel loop registered under ``name``; None for an algorithm variant or None."""
    return _KERNEL_LOOPS.get(name) if name is not None else None


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes: ``br`` query rows and ``bc`` key/value columns per tile."""

    br: int
    bc: int

    def __post_init__(self):
        for name in ("br", "bc"):
            object.__setattr__(self, name, positive_int(getattr(self, name), f"Blocks.{name}"))


def blocks_from_sram(
    sram_elems: int, d: int, *, swap: bool = False, square: bool = False
) -> Blocks:
    """FlashAttention-1's tile sizes for an SRAM of M elements (Dao et al. 2022, Alg. 1):
    Bc = ceil(M / 4d), Br = min(Bc, d).

    ``swap`` exchanges them (Golden et al. Fig 6a); ``square`` sets Br = Bc (Fig 6b).
    M must hold at least one row of each of the four tiles (Q, K, V, O): M >= 4d.
    """
    sram_elems = positive_int(sram_elems, "blocks_from_sram: sram_elems")
    d = positive_int(d, "blocks_from_sram: d")
    if sram_elems < 4 * d:
        raise ValueError(
            f"blocks_from_sram: sram_elems: expected at least 4 * d = {4 * d} elements "
            f"(one row of each of the Q, K, V and O tiles), got {sram_elems}"
        )
    if swap and square:
        raise ValueError("blocks_from_sram: choose swap or square, not both")
    bc = math.ceil(sram_elems / (4 * d))
    br = min(bc, d)
    if swap:
        br, bc = bc, br
    if square:
        br = bc
    return Blocks(br, bc)


def _check_shapes(fn: str, q, k, v) -> int:
    """G = H / H_kv (:mod:`fa_jax.heads`), after checking the shapes of Q, K, V."""
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            f"{fn}: expected q (..., N, d), k (..., M, d), v (..., M, d_v) of equal rank, "
            f"got {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{fn}: expected q (..., N, d), k (..., M, d), v (..., M, d_v), "
            f"got {q.shape}, {k.shape}, {v.shape}"
        )
    return kv_groups(fn, q.shape, k.shape, v.shape)


# -- custom_vjp plumbing ------------------------------------------------------------


class Args(NamedTuple):
    """A call's configuration that may hold arrays (see Call)."""

    policy: Policy
    q_lengths: Any = None
    kv_lengths: Any = None
    scale: Any = None
    bias: Any = None
    mask: Any = None
    sinks: Any = None


@dataclasses.dataclass(frozen=True)
class Call:
    """What a custom_vjp needs besides its arrays.  Its non-differentiable argument
    must hold no tracers, and a policy's formats may be traced (vmap over formats):
    ``static`` is the (treedef, leaves) of the :class:`Args` with every array leaf
    replaced by None; those travel as ``dynamic`` arguments.  ``groups`` is
    H / H_kv (fa_jax.heads); ``window`` a checked (left, right) or None;
    ``q_offset`` the checked key position of query 0 (fa_jax.masking);
    ``softcap`` a checked c > 0 or None (fa_jax.score_mods)."""

    static: tuple[Any, tuple]
    dtypes: tuple  # of q, k, v: the dtypes their cotangents must have
    causal: bool
    blocks: Blocks | None = None
    variant: str | None = None
    groups: int = 1
    window: tuple[int, int] | None = None
    softcap: float | None = None
    num_splits: int = 1  # split-KV decoding's S (fa_jax.split_kv)
    q_offset: int = 0


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, Tracer, np.ndarray))


def _check_call(fn: str, q, k, v, policy) -> None:
    """The errors a caller can act on, raised before anything is traced."""
    if not isinstance(policy, Policy):
        hint = (
            f"fa_jax.get_policy({policy!r}, 'bf16') builds a preset by name"
            if isinstance(policy, str)
            else "e.g. fa_jax.fa2_kernel('bf16')"
        )
        raise TypeError(f"{fn}: policy: expected a Policy ({hint}), got {policy!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim >= 2 and 0 in t.shape[-2:]:
            raise ValueError(
                f"{fn}: {name}: expected at least one row and one column in its last two "
                f"dimensions, got shape {t.shape}"
            )


def call_of(
    fn: str,
    q,
    k,
    v,
    config: Args,
    causal,
    blocks=None,
    variant=None,
    window=None,
    cap=None,
    q_offset=None,
):
    """(Call, q, k, v, dynamic) for a custom_vjp call (see Call)."""
    q, k, v = (jnp.asarray(t) for t in (q, k, v))
    _check_call(fn, q, k, v, config.policy)
    groups = _check_shapes(fn, q, k, v)
    window = masking.check_window(window, fn)
    offset = masking.check_q_offset(
        q_offset, q.shape[-2], k.shape[-2], causal=causal, window=window, fn=fn
    )
    cap = check_softcap(cap, fn)
    if cap is not None and config.policy.scale == "exp2":
        raise ValueError(
            f"{fn}: softcap: expected a policy whose scores are scaled (Policy.scale "
            "'scores' or 'q'), got scale='exp2', where the scores are unscaled"
        )
    arrays = ("bias", "mask", "sinks")
    config = config._replace(**{n: _as_array(getattr(config, n)) for n in arrays})
    leaves, treedef = jax.tree_util.tree_flatten(config)
    static = (treedef, tuple(None if is_array(x) else x for x in leaves))
    dynamic = tuple(x for x in leaves if is_array(x))
    dtypes = (q.dtype, k.dtype, v.dtype)
    call = Call(static, dtypes, causal, blocks, variant, groups, window, cap, q_offset=offset)
    return call, q, k, v, dynamic


def _as_array(x):
    """A bias or mask as an array (a nested list, a number), None kept."""
    return x if x is None or is_array(x) else np.asarray(x)


def call_args(call: Call, dynamic) -> Args:
    """The call's Args rebuilt from the static and dynamic leaves."""
    treedef, leaves = call.static
    arrays = iter(dynamic)
    return jax.tree_util.tree_unflatten(treedef, [next(arrays) if x is None else x for x in leaves])


def input_cotangents(call: Call, *grads):
    """dQ, dK, dV in the dtypes of q, k, v (rounded to them first, so the dtype
    conversion is exact), and no cotangent for the configuration."""
    out = []
    for g, dtype in zip(grads, call.dtypes):
        if g.dtype != dtype:
            g = jax.lax.convert_element_type(round_to(g, get_format(dtype)), dtype)
        out.append(g)
    return (*out, None)


def clear_masked(q, k, v, d_o, d_lse, lse, kv_lengths):
    """Zero Q, dO and dL on rows with no kept key (log-sum-exp -inf: l = 0) and K, V
    past the key lengths, so that masked (P = 0) entries meet no NaN padding
    (fa_jax.backward)."""
    live = (lse > -jnp.inf)[..., None]
    q, d_o = jnp.where(live, q, 0.0), jnp.where(live, d_o, 0.0)
    d_lse = jnp.where(live[..., 0], d_lse, 0.0)
    k, v = masking.zero_masked_keys(k, kv_lengths, 0), masking.zero_masked_keys(v, kv_lengths, 0)
    return q, k, v, d_o, d_lse
