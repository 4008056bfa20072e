"""fa_jax: bit-exact floating-point format emulation in JAX, and the numerics of
FlashAttention's tiled online-softmax recurrence measured with it.

The numerics, each layer using only those above it:

* formats, rounding, encoding, widening: formats and exact rounding onto them;
* accumulation, ops: the emulated op layer every algorithm calls;
* policy, presets: the format of every stage of attention;
* softmax, attention, backward, quantization: the algorithms (heads, masking,
  score_mods: GQA, masks and windows, biases);
* metrics, bounds: measuring and bounding their error;
* inputs, testing: seeded input distributions, hypothesis strategies.

:mod:`fa_jax.studies` (sweeps, the paper's figures, the FlashAttention-3 table,
attribution, training) uses them and is not imported here; :mod:`fa_jax.cli` is
the ``fa-jax`` command.
"""

from typing import TYPE_CHECKING

from fa_jax import backward, bounds, inputs, kv_cache, metrics, nn, ops, presets, quantization
from fa_jax.accumulation import (
    EXACT,
    SEQUENTIAL,
    Accumulation,
    chunked,
    tensor_core,
    tensor_core_model,
)
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
from fa_jax.inputs import DISTRIBUTIONS, make_inputs
from fa_jax.policy import BACKWARD_STAGES, FORWARD_STAGES, STAGES, Policy
from fa_jax.presets import PRESETS, fa2_kernel, get_policy, golden, paper_uniform, torch_math
from fa_jax.rounding import ROUNDING_MODES, round_to
from fa_jax.score_mods import alibi_bias, alibi_slopes
from fa_jax.softmax import naive_softmax, online_softmax, safe_softmax

__version__ = "0.1.0"

policies = presets  # the presets module's former name

if TYPE_CHECKING:
    from fa_jax.studies.attribution import AttributionConfig, attribute

# Names that live in fa_jax.studies, resolved on first use so that importing
# fa_jax does not import the studies (PEP 562).
_STUDY_NAMES = {
    "attribute": "fa_jax.studies.attribution",
    "AttributionConfig": "fa_jax.studies.attribution",
}


def __getattr__(name: str):
    if name in _STUDY_NAMES:
        import importlib

        return getattr(importlib.import_module(_STUDY_NAMES[name]), name)
    raise AttributeError(f"module 'fa_jax' has no attribute {name!r}")


__all__ = [
    "BACKWARD_STAGES",
    "BF16",
    "DISTRIBUTIONS",
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
    "PRESETS",
    "ROUNDING_MODES",
    "SEQUENTIAL",
    "STAGES",
    "TF32",
    "Accumulation",
    "AttributionConfig",
    "Blocks",
    "Format",
    "Policy",
    "alibi_bias",
    "alibi_slopes",
    "attribute",
    "backward",
    "blocks_from_sram",
    "bounds",
    "chunked",
    "custom",
    "fa2_kernel",
    "flash_attention",
    "get_format",
    "get_policy",
    "golden",
    "inputs",
    "kv_cache",
    "make_inputs",
    "metrics",
    "naive_softmax",
    "nn",
    "online_softmax",
    "ops",
    "paper_uniform",
    "policies",
    "presets",
    "quantization",
    "reference_attention",
    "registered_formats",
    "round_to",
    "safe_softmax",
    "tensor_core",
    "tensor_core_model",
    "torch_math",
]
