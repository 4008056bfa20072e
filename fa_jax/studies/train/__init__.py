"""Training with fa_jax attention: the weight-deviation study of Golden et al. 2024 (Figs 7-8).

Modules: data (a seeded synthetic language in a fixed order), precision (FP32,
BF16/FP16 mixed precision with FP32 master weights), attention_layer (fa_jax
attention as a model layer, and its gradient), model (a small decoder-only
transformer), loop (the optax Adam train step, resumable checkpoints), study
(``fig8``: four runs, pairwise weight drift, CSV, plot, ratio).

Needs optax (``pip install 'fa-jax[train]'``); ``fa_jax`` itself does not import
this package.
"""

from fa_jax.studies.train.attention_layer import AttentionSpec
from fa_jax.studies.train.data import MarkovData
from fa_jax.studies.train.loop import (
    Optim,
    RunSpec,
    TrainState,
    advance,
    init_state,
    load_checkpoint,
    save_checkpoint,
    train_step,
)
from fa_jax.studies.train.model import ModelConfig, forward, init_params, loss_fn
from fa_jax.studies.train.precision import BF16_MIXED, FP16_MIXED, FP32_TRAINING, TrainPrecision
from fa_jax.studies.train.study import FULL, QUICK, StudyConfig, fig8, load_overall, run_study

__all__ = [
    "BF16_MIXED",
    "FP16_MIXED",
    "FP32_TRAINING",
    "FULL",
    "QUICK",
    "AttentionSpec",
    "MarkovData",
    "ModelConfig",
    "Optim",
    "RunSpec",
    "StudyConfig",
    "TrainPrecision",
    "TrainState",
    "advance",
    "fig8",
    "forward",
    "init_params",
    "init_state",
    "load_checkpoint",
    "load_overall",
    "loss_fn",
    "run_study",
    "save_checkpoint",
    "train_step",
]
