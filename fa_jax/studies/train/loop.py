"""Training runs: the optax Adam train step, and checkpoints that resume bit for bit.

A :class:`RunSpec` is one training run: model initialisation seed, attention
(:class:`~fa_jax.studies.train.attention_layer.AttentionSpec`) and training precision
(:class:`~fa_jax.studies.train.precision.TrainPrecision`).  With a
:class:`~fa_jax.studies.train.model.ModelConfig`, an :class:`Optim` and the data
(:class:`~fa_jax.studies.train.data.MarkovData`) it determines every bit of the run:

* step ``s`` (0-based) trains on ``data.batch_at(s)``;
* :func:`train_step` is one jitted function per (model, attention, precision,
  optimiser), compiled with :data:`~fa_jax.studies.train.precision.COMPILER_OPTIONS`:
  loss and gradients (scaled for FP16), gradient clipping by global norm, Adam
  (Kingma & Ba 2015) with linear warm-up, applied to the float32 master weights;
  a step whose gradients are not finite is skipped (FP16's dynamic loss scale
  then halves);
* :class:`TrainState` is ``(step, params, opt_state, loss_scale)``.  A
  checkpoint (``.npz``) holds its leaves exactly, plus the per-step training
  losses so far, and is written atomically (temp file, fsync, rename).
  :func:`advance` continues a state from any checkpointed step; a resumed run
  equals an uninterrupted one bitwise (``tests/test_train.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax._checks import non_negative_int, positive_number
from fa_jax.studies.results import atomic_write
from fa_jax.studies.train.attention_layer import AttentionSpec
from fa_jax.studies.train.data import MarkovData
from fa_jax.studies.train.model import ModelConfig, init_params, loss_fn
from fa_jax.studies.train.precision import (
    COMPILER_OPTIONS,
    LossScale,
    TrainPrecision,
    all_finite,
    cast,
    get_precision,
)

__all__ = [
    "Optim",
    "RunSpec",
    "TrainState",
    "advance",
    "init_state",
    "load_checkpoint",
    "save_checkpoint",
    "train_step",
]


def import_optax():
    try:
        import optax
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("fa_jax.studies.train needs optax: pip install 'fa-jax[train]'") from err
    return optax


@dataclasses.dataclass(frozen=True)
class Optim:
    """Adam (Kingma & Ba 2015) with a linear warm-up to ``lr`` over the first
    ``warmup`` steps, then constant; gradients clipped to global norm ``clip`` first."""

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    warmup: int = 20
    clip: float = 1.0

    def __post_init__(self):
        for name in ("lr", "eps", "clip"):
            positive_number(getattr(self, name), f"Optim.{name}")
        for name in ("b1", "b2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1):
                raise ValueError(f"Optim.{name}: expected a number in [0, 1), got {v!r}")
        non_negative_int(self.warmup, "Optim.warmup")

    def transform(self):
        """The optax GradientTransformation."""
        optax = import_optax()
        return optax.chain(
            optax.clip_by_global_norm(self.clip),
            optax.adam(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps),
        )

    def learning_rate(self, count) -> jax.Array:
        """lr · min(1, (count + 1) / warmup) in float32: step 0 already moves."""
        if not self.warmup:
            return jnp.float32(self.lr)
        ramp = cast(count + 1, jnp.float32) / jnp.float32(self.warmup)
        return jnp.float32(self.lr) * jnp.minimum(jnp.float32(1), ramp)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run: its name, initialisation seed, attention and precision."""

    name: str
    attention: AttentionSpec
    precision: TrainPrecision | str = "fp32"
    init_seed: int = 0

    def __post_init__(self):
        if not self.name or not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(
                f"RunSpec.name: expected letters, digits, '_' or '-', got {self.name!r}"
            )
        if not isinstance(self.attention, AttentionSpec):
            raise TypeError(f"RunSpec.attention: expected an AttentionSpec, got {self.attention!r}")
        object.__setattr__(self, "precision", get_precision(self.precision))
        non_negative_int(self.init_seed, "RunSpec.init_seed")


class TrainState(NamedTuple):
    """Everything a step updates: step count, float32 master weights, optimizer
    state and loss-scale state."""

    step: jax.Array
    params: dict
    opt_state: Any
    loss_scale: LossScale


def init_state(run: RunSpec, cfg: ModelConfig, optim: Optim) -> TrainState:
    """The state before step 0."""
    params = init_params(cfg, run.init_seed)
    return TrainState(
        jnp.asarray(0, jnp.int32),
        params,
        optim.transform().init(params),
        LossScale.init(get_precision(run.precision)),
    )


@functools.cache
def _compiled_step(
    cfg: ModelConfig, attention: AttentionSpec, precision: TrainPrecision, optim: Optim
):
    tx = optim.transform()
    dtype = precision.dtype

    def step(state: TrainState, tokens):
        def objective(params):
            loss = loss_fn(params, tokens, cfg, attention, dtype)
            return state.loss_scale.scale_loss(loss, precision), loss

        grads, loss = jax.grad(objective, has_aux=True)(state.params)
        grads = state.loss_scale.unscale(grads, precision)
        finite = all_finite(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = jax.tree_util.tree_map(lambda p, u: p + u, state.params, updates)
        if precision.dynamic:  # skip the update where the gradients overflowed

            def keep(new, old):
                return jnp.where(finite, new, old)

            params = jax.tree_util.tree_map(keep, params, state.params)
            opt_state = jax.tree_util.tree_map(keep, opt_state, state.opt_state)
        new = TrainState(
            state.step + 1, params, opt_state, state.loss_scale.adjust(finite, precision)
        )
        return new, loss

    return jax.jit(step, compiler_options=COMPILER_OPTIONS)


def train_step(state: TrainState, tokens, run: RunSpec, cfg: ModelConfig, optim: Optim):
    """(next state, float32 training loss of this batch) for int32 tokens (B, T + 1)."""
    step = _compiled_step(cfg, run.attention, run.precision, optim)
    return step(state, jnp.asarray(tokens, jnp.int32))


def advance(
    state: TrainState,
    losses: list,
    until: int,
    run: RunSpec,
    cfg: ModelConfig,
    optim: Optim,
    data: MarkovData,
    table=None,
):
    """Train from ``state.step`` to step ``until``, appending each step's loss (a
    Python float) to ``losses``; returns the new state."""
    table = data.table() if table is None else table
    pending = []  # device scalars: no host round trip per step, dispatch runs ahead
    for s in range(int(state.step), until):
        state, loss = train_step(state, data.batch_at(s, table), run, cfg, optim)
        pending.append(loss)
    losses.extend(float(x) for x in jax.device_get(pending))
    return state


# -- checkpoints ---------------------------------------------------------------


def save_checkpoint(path, state: TrainState, losses) -> None:
    """Write ``state`` (every leaf, exactly) and the loss history to ``path`` (.npz)."""
    leaves = jax.tree_util.tree_leaves(state)
    arrays = {f"leaf_{i:04d}": np.asarray(jax.device_get(x)) for i, x in enumerate(leaves)}
    arrays["losses"] = np.asarray(losses, np.float64)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # numpy's stubs cannot tell the array keywords from savez's own options
    atomic_write(path, lambda fh: np.savez(fh, **arrays), binary=True)  # pyright: ignore[reportArgumentType]


def load_checkpoint(path, like: TrainState) -> tuple[TrainState, list]:
    """(state, losses) from ``path``; ``like`` (e.g. :func:`init_state`) gives the
    tree structure, shapes and dtypes, which must match."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    with np.load(path) as z:
        got = [z[f"leaf_{i:04d}"] for i in range(len(leaves)) if f"leaf_{i:04d}" in z]
        if len(got) != len(leaves) or len(z.files) != len(leaves) + 1:
            raise ValueError(
                f"checkpoint {path}: expected {len(leaves)} state leaves, found {len(z.files) - 1}"
            )
        for i, (a, b) in enumerate(zip(got, leaves)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"checkpoint {path}: leaf {i}: expected {b.dtype}{list(b.shape)}, "
                    f"got {a.dtype}{list(a.shape)}"
                )
        losses = [float(x) for x in z["losses"]]
    state = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in got])
    if len(losses) != int(state.step):
        raise ValueError(
            f"checkpoint {path}: expected {int(state.step)} losses for step "
            f"{int(state.step)}, got {len(losses)}"
        )
    return state, losses
