"""fa_jax: bit-exact floating-point format emulation in JAX, and the numerics of
FlashAttention's tiled online-softmax recurrence measured with it.

Modules: formats, rounding, encoding, widening (formats and exact rounding);
accumulation, ops (the emulated op layer); policy, policies (stage formats);
softmax, attention (the algorithms); metrics, bounds (measuring and bounding
error); testing (hypothesis strategies).
"""

from fa_jax import bounds, metrics, ops, policies
from fa_jax.accumulation import EXACT, SEQUENTIAL, Accumulation, chunked
from fa_jax.attention import Blocks, blocks_from_sram, flash_attention, reference_attention
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
from fa_jax.policies import fa2_kernel, golden, paper_uniform, torch_math
from fa_jax.policy import STAGES, Policy
from fa_jax.rounding import ROUNDING_MODES, round_to
from fa_jax.softmax import naive_softmax, online_softmax, safe_softmax

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
    "EXACT",
    "FP16",
    "FP32",
    "FP64",
    "ROUNDING_MODES",
    "SEQUENTIAL",
    "STAGES",
    "TF32",
    "Accumulation",
    "Blocks",
    "Format",
    "Policy",
    "blocks_from_sram",
    "bounds",
    "chunked",
    "custom",
    "fa2_kernel",
    "flash_attention",
    "get_format",
    "golden",
    "metrics",
    "naive_softmax",
    "online_softmax",
    "ops",
    "paper_uniform",
    "policies",
    "reference_attention",
    "registered_formats",
    "round_to",
    "safe_softmax",
    "torch_math",
]
