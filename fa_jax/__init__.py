"""fa_jax: bit-exact floating-point format emulation in JAX, and the numerics of
FlashAttention's tiled online-softmax recurrence measured with it."""

from fa_jax.formats import (
    BF16,
    E2M1FN,
    E2M3FN,
    E3M2FN,
    E3M4,
    E4M3,
    E4M3B11FNUZ,
    E4M3FN,
    E4M3FNUZ,
    E5M2,
    E5M2FNUZ,
    FP16,
    FP32,
    FP64,
    TF32,
    Format,
    custom,
    get_format,
    registered_formats,
)
from fa_jax.rounding import ROUNDING_MODES, round_to

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "E2M1FN",
    "E2M3FN",
    "E3M2FN",
    "E3M4",
    "E4M3",
    "E4M3B11FNUZ",
    "E4M3FN",
    "E4M3FNUZ",
    "E5M2",
    "E5M2FNUZ",
    "FP16",
    "FP32",
    "FP64",
    "ROUNDING_MODES",
    "TF32",
    "Format",
    "custom",
    "get_format",
    "registered_formats",
    "round_to",
]
