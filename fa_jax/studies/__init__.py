"""What fa_jax's numerics are used for: the studies.

``sweep`` (grids of configurations run as vmapped programs into tidy CSV),
``figures`` (Golden et al. 2024, Figs 3-6), ``fa3_table`` (FlashAttention-3
Table 3), ``attribution`` (which stage's rounding causes the deviation) and
``train`` (the weight-drift study of Figs 7-8; needs optax).  They share one
``results`` layer (tidy CSV, resume, ``metadata.json``), one ``table`` printer
and one ``progress`` display.  Only :mod:`fa_jax.cli` parses arguments.

``import fa_jax`` does not import this package; import the study you need.
"""

# The policy presets every figure and the training study run under by default:
# the paper's uniform low precision and FlashAttention-2's kernel numerics.
DEFAULT_POLICIES = ("paper_uniform", "fa2_kernel")

__all__ = ["DEFAULT_POLICIES"]
