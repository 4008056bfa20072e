"""fa_jax: bit-exact floating-point format emulation in JAX, and the numerics of
FlashAttention's tiled online-softmax recurrence measured with it.

Modules: formats, rounding, encoding, widening (formats and exact rounding);
accumulation, ops (the emulated op layer); policy, policies (stage formats);
softmax, attention, backward (the algorithms); metrics, bounds (measuring and bounding
error); attribution (which stage's rounding causes it); quantization (scaled FP8
quantization and incoherent processing, FlashAttention-3 §3.3); testing (hypothesis
strategies).  Subpackage fa_jax.train (not imported here; needs optax): a small
transformer trained with fa_jax attention, and the weight-drift study of Figs 7-8.
"""

from fa_jax import backward, bounds, metrics, ops, policies, quantization
from fa_jax.accumulation import (
    EXACT,
    SEQUENTIAL,
    Accumulation,
    chunked,
    tensor_core,
    tensor_core_model,
)
from fa_jax.attention import Blocks, blocks_from_sram, flash_attention, reference_attention
from fa_jax.attribution import AttributionConfig, attribute
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
from fa_jax.policy import BACKWARD_STAGES, FORWARD_STAGES, STAGES, Policy
from fa_jax.rounding import ROUNDING_MODES, round_to
from fa_jax.softmax import naive_softmax, online_softmax, safe_softmax

__version__ = "0.1.0"

__all__ = [
    "BACKWARD_STAGES",
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
    "FORWARD_STAGES",
    "FP16",
    "FP32",
    "FP64",
    "ROUNDING_MODES",
    "SEQUENTIAL",
    "STAGES",
    "TF32",
    "Accumulation",
    "AttributionConfig",
    "Blocks",
    "Format",
    "Policy",
    "attribute",
    "backward",
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
    "quantization",
    "reference_attention",
    "registered_formats",
    "round_to",
    "safe_softmax",
    "tensor_core",
    "tensor_core_model",
    "torch_math",
]
