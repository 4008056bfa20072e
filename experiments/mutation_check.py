"""A targeted mutation check of the numerics: does the test suite notice a wrong bit?

Each mutant changes one exact snippet of fa_jax/rounding.py, ops.py, softmax.py,
attention.py or backward.py (a flipped comparison, a rounding mode's branch, a
stage swapped in a policy, a dropped rescale, an off-by-one mask, ...) and names
the tests that must fail on it.  For every mutant the script copies fa_jax/,
tests/ and pyproject.toml into a temporary folder, applies the mutant there
(the original snippet must occur exactly once), and runs

    python -m pytest -x -q -rs -p no:cacheprovider -n 0 -m "not slow" <the mutant's tests>

in that folder with PYTHONPATH pointing at the copy (checked: the copy is the
fa_jax that is imported).  The working checkout is never modified.  A mutant is
killed when pytest fails, survives when it passes, and times out past
``--timeout`` seconds.  Mutants that cannot change any result carry an
``equivalent`` reason and are reported but not counted as survivors.  A mutant
whose tests pass with some of them skipped (a real kernel absent here, or a model
that refuses this CPU's code) is not judged on this host: it is reported with
the skips' reasons and counted neither as killed nor as a survivor, so that a
CPU which cannot run a check neither fails the run nor passes it for that check.
``--budget`` bounds the whole run's time: past it no mutant is started, and
those left are listed as not run (counted neither way), so that CI on a slow
host ends within its limit and says which mutants it did not judge; ``--shuffle
SEED`` runs them in an order drawn from SEED, so that budgeted runs of
successive commits judge different ones.

    python experiments/mutation_check.py [--list] [--only PATTERN] [--jobs N] [--timeout S]
                                         [--budget S] [--shuffle SEED]

Prints one line per mutant and the score (killed / counted); exits 0 when every
mutant is killed or listed as equivalent, else 1.  The last run's score and its
survivors: docs/mutation.md.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
COPIED = ("fa_jax", "tests", "pyproject.toml")

# Test targets, named once: pytest node ids relative to the repository root.
_R = "tests/test_rounding.py"
CODES = f"{_R}::test_every_code_and_midpoint_matches_ml_dtypes"
RANDOM_F32 = f"{_R}::test_random_float32_bit_patterns_match_ml_dtypes"
F64_CASTS = f"{_R}::test_float64_carrier_matches_numpy_correctly_rounded_casts"
DIRECTED = f"{_R}::test_directed_modes_bracket_and_are_adjacent"
STOCHASTIC = f"{_R}::test_stochastic_resolves_probabilities_to_2_to_the_minus_12"
NO_X64 = f"{_R}::test_float64_input_without_x64_rounds_once"
RP_PATH = f"{_R}::test_reduce_precision_path_equals_the_integer_path"
RP_NOT_TAKEN = f"{_R}::test_reduce_precision_path_is_not_taken_where_it_would_be_wrong"
ORACLE = "tests/test_rounding_oracle.py"
METRIC_TREE = "tests/test_metrics.py::test_sums_follow_the_stated_tree_bit_for_bit"
_O = "tests/test_ops.py"
BINARY = f"{_O}::test_binary_ops_round_the_exact_result_once"
ADD_MID = f"{_O}::test_add_resolves_float64_midpoints"
DIV_MID = f"{_O}::test_div_resolves_quotients_that_float64_rounds_onto_a_midpoint"
DIV_FULL = f"{_O}::test_div_by_full_float64_divisors_resolves_midpoints"
MUL_FULL = f"{_O}::test_mul_of_full_float64_operands_rounds_once"
SUMS = f"{_O}::test_sum_models_against_exact_loops"
MATMULS = f"{_O}::test_matmul_models_against_exact_loops"
TC_MATMUL = f"{_O}::test_tensor_core_matmul_matches_the_rational_model"
TC_SUM = f"{_O}::test_tensor_core_sum_matches_the_rational_model"
TC_SPECIAL = f"{_O}::test_tensor_core_special_values"
SIGNED_ZERO = f"{_O}::test_signed_zero_sums_follow_ieee"
_S = "tests/test_softmax.py"
SOFTMAX_SIM = f"{_S}::test_bit_exact_against_simulation"
SOFTMAX_MASKED = f"{_S}::test_bit_exact_with_masked_entries"
SOFTMAX_NO_INF = f"{_S}::test_masked_entries_in_a_format_without_infinities"
SOFTMAX_MIDPOINT = f"{_S}::test_sums_are_exact_at_a_midpoint"
SOFTMAX_ZERO_ROWS = f"{_S}::test_fully_masked_rows_give_zero"
SOFTMAX_MUTANTS = "tests/test_softmax_mutants.py"
ATT_SIM = "tests/test_attention_sim.py::test_jitted_forward_and_backward_equal_the_simulation"
ATT_MIDPOINT = (
    "tests/test_attention_sim.py::test_a_float64_midpoint_quotient_rounds_by_its_residual"
)
_A = "tests/test_attention.py"
ATT_MASKS = f"{_A}::test_masks_agree_with_numpy_float64"
ATT_CAUSAL = f"{_A}::test_causal_with_n_not_m_matches_numpy_float64"
ATT_GOLDEN = f"{_A}::test_golden_flash_equals_reference"
ATT_ZERO_ROWS = f"{_A}::test_fully_masked_rows_are_zero_with_lse_minus_inf"
ATT_NO_INF = f"{_A}::test_formats_without_infinities_mask_cleanly"
BWD_GOLDEN = "tests/test_backward.py::test_golden_gradients_match_float64_autodiff"
_SL = "tests/test_slices32.py"
SLICED_DOT = f"{_SL}::test_the_fast_path_rounds_the_exact_sum_where_it_decides"
SLICED_PLANS = f"{_SL}::test_the_plans_keep_every_float32_sum_exact_and_int32_in_range"
SLICED_SUM = f"{_SL}::test_the_fast_sum_rounds_the_exact_sum_where_it_decides"
FALLBACK = "tests/test_sum32.py::test_the_fallback_is_exact_in_row_blocks_and_a_branch_under_vmap"
NATIVE_CHECKS = "tests/test_native32.py::test_each_check_sends_the_matmul_to_the_fallback"
_E = "tests/test_exponential_reference.py"
EXP_RANDOM = f"{_E}::test_random_inputs_match_the_published_algorithm"
EXP_EDGES = f"{_E}::test_every_branch_point_and_its_neighbours"
EXP_VECTORISED = f"{_E}::test_vectorised_splits_full_vectors_from_the_tail"
EXP_TAIL = "tests/test_exponential.py::test_vectorised_runs_the_scalar_exp_on_the_tail"
_T = "tests/test_accumulation_trees.py"
TREE_SHAPES = f"{_T}::test_tree_shapes_follow_the_builders_definitions"
TREE_VALUES = f"{_T}::test_tree_sums_and_dots_equal_the_exact_oracle"
EXP2_FLASH = "tests/test_exp2_scale.py::test_flash_with_the_exp2_scale_equals_the_simulation"
EXP2_REFERENCE = (
    "tests/test_exp2_scale.py::test_reference_attention_with_the_exp2_scale_equals_the_simulation"
)
_K = "tests/test_sweep_cache_keys.py"
KEY_FIELDS = f"{_K}::test_each_policy_shape_field_changes_the_key"
KEY_STATIC = f"{_K}::test_each_flash_static_argument_changes_the_key"
KEY_ARGS = f"{_K}::test_the_program_and_its_arguments_change_the_key"
KEY_ENV = f"{_K}::test_the_environment_changes_the_key"
KEY_MODELS = f"{_K}::test_models_that_differ_only_in_a_parameter_change_the_key"
_RS = "tests/test_sweep_resume.py"
RESUME_PARTLY = f"{_RS}::test_a_chunk_partly_written"
RESUME_ONE_ROW = f"{_RS}::test_one_configuration_missing_one_row"
RESUME_FOREIGN = f"{_RS}::test_a_configuration_with_a_foreign_part"
RESULTS_RESUME = "tests/test_results.py::test_resume_keeps_only_complete_configurations"
RESULTS_STRINGS = "tests/test_results.py::test_resume_compares_parts_as_strings"
_KC = "tests/test_kernels_compare.py"
COMPARE_BINS = f"{_KC}::test_binned_histogram_and_errors"
COMPARE_NAN = f"{_KC}::test_values_outside_the_format_are_counted_apart"
COMPARE_ULPS = f"{_KC}::test_ulp_histogram_matches_ml_dtypes_ordering"
KERNEL_INPUTS = "tests/test_kernels.py::test_bad_shapes_and_inexact_values_are_refused"
_OD = "tests/test_kernels_xla_own_dots.py"
PV_CHAINS = "tests/test_kernels_xla.py::test_pv_follows_chains_folds_blocks_and_the_remainder"
QK_SIMULATED = "tests/test_kernels_xla.py::test_simulated_probes_add_as_the_model_does"
LAST_ROWS = "tests/test_kernels_xla.py::test_last_rows_of_another_kernel_are_refused"
TILE_CHUNK = "tests/test_tile_dot.py::test_chunk_is_the_largest_even_divisor_up_to_32"
TILE_LOOP = "tests/test_tile_dot.py::test_tile_dot_is_the_sdm_loop"
AMX_GEMMS = "tests/test_vector_loop.py::test_amx_gemms_are_tile_dots"
FLASH_LOOP_CHOSEN = "tests/test_kernels_torch.py::test_the_flash_loop_follows_the_cpu"
OV_AMX = "tests/test_kernels_openvino.py::test_the_model_follows_the_cpus_amx"
ONE_ROW_T = (
    "tests/test_kernels_onnxruntime.py::test_one_row_transposed_gemm_is_bit_exact_on_any_cpu"
)
_U = "tests/test_kernels_unmodelled.py"
MLAS_FMA3_EXP = "tests/test_mlas.py::test_fma3_exp_is_zero_from_m_minus_127"
MLAS_LANES = "tests/test_mlas.py::test_lane_sum_follows_the_kernels_lanes"
MLAS_ISA = "tests/test_kernels_onnxruntime.py::test_mlas_isa_follows_its_cpuid_tests"
CPUS_NAMED = f"{_U}::test_models_follow_the_cpus_they_name"
XLA_CAPPED = f"{_U}::test_xla_refuses_a_capped_isa"
GGML_BUILDS = f"{_U}::test_ggml_follows_the_loaded_builds_features"
_CPU = "tests/test_kernels_cpu.py"
XCR0 = f"{_CPU}::test_features_count_only_where_the_os_saves_their_registers"
ISA_CLASSES = f"{_CPU}::test_isa_classes"
INTEL_BLOCKS = "tests/test_vector_loop.py::test_intel_sgemm_blocks_as_measured"
INTEL_GEMMS = "tests/test_vector_loop.py::test_intel_gemms_are_mkls"
INTEL_MATH_LANES = "tests/test_kernels_torch.py::test_the_math_model_takes_mkls_intel_lanes"
INTEL_CHOSEN = "tests/test_kernels_torch.py::test_the_math_model_takes_this_cpus_gemms"
OV_AMX_STEPS = "tests/test_kernels_openvino.py::test_amx_prefill_is_its_steps"
GEMV_REAL = f"{_OD}::test_gemv_is_xlas_matrix_vector_product"
OWN_DOTS_READ = f"{_OD}::test_own_dots_reads_the_entry_in_order"
EIGEN_KC = f"{_OD}::test_eigen_kc_fits_the_measured_blocks"
EIGEN_KCS = f"{_OD}::test_eigen_kcs_read_back_from_a_block_cut_the_other_shard_each_its_own_way"
_RV = "tests/test_reveal.py"
REVEAL_PREDICTED = f"{_RV}::test_predicted_probes_are_what_the_probes_see"
REVEAL_SPLIT = f"{_RV}::test_counts_beyond_the_output_format_are_split_over_probes"
REVEAL_FUSED = "tests/test_reveal_fused.py::test_a_fused_node_over_subtrees_is_revealed"
_AS = "tests/test_attention_sim.py"
SPLIT_SIM = f"{_AS}::test_split_kv_equals_the_simulation"
SPLIT_GOLDEN = "tests/test_split_kv.py::test_golden_combine_is_the_plain_float64_formula"
FEATURE_SIM = f"{_AS}::test_gqa_bias_mask_and_window_equal_the_simulation"
_KV = "tests/test_kv_cache.py"
KV_CODES = f"{_KV}::test_codes_scales_and_dequantized_values_match_numpy_and_ml_dtypes"
KV_ATTENTION = f"{_KV}::test_attention_with_a_cache_equals_attention_on_numpy_dequantized_kv"
GQA_REPEATED = "tests/test_heads.py::test_gqa_equals_repeated_heads_bitwise"
_MK = "tests/test_masking.py"
FEATURES_GOLDEN = f"{_MK}::test_golden_features_equal_plain_float64"
Q_OFFSET = f"{_MK}::test_q_offset_is_its_boolean_mask"
SINKS_GOLDEN = f"{_MK}::test_golden_sinks_equal_plain_float64"
SINK_AS_KEY = f"{_MK}::test_reference_sink_is_a_first_key_with_zero_value"
GGML_VEC_DOTS = "tests/test_ggml_vec.py::test_avx2_dots_follow_the_c_code"
GGML_VEC_EXPF = "tests/test_ggml_vec.py::test_avx2_v_expf_follows_the_c_code_over_its_ranges"
_OV = "tests/test_kernels_openvino.py"
OV_AVX2_SUMS = f"{_OV}::test_avx2_sums"
OV_AFFINE = f"{_OV}::test_u8_dot_product_corrects_after_the_sum"
OV_ISA = f"{_OV}::test_isa_chooses_the_build"
SKIPPED_BLOCKS = f"{_MK}::test_skipped_key_blocks_leave_the_bits"
_SM = "tests/test_score_mods.py"
ALIBI_SLOPES = f"{_SM}::test_alibi_slopes_are_press_et_al"
BIAS_STAGE = f"{_SM}::test_a_bias_rounds_in_its_stage"
NN_ROUTES = (
    "tests/test_nn.py::test_routes_bit_for_bit_with_transposes_and_rounds_to_the_query_dtype"
)
NN_JAX = "tests/test_nn.py::test_equals_jax_nn_where_both_compute_exactly"


class Mutant(NamedTuple):
    """One change: ``original`` (occurring exactly once in ``module``) becomes ``replacement``."""

    module: str
    original: str
    replacement: str
    description: str
    tests: tuple[str, ...]
    equivalent: str | None = None

    @property
    def name(self) -> str:
        """``module:description``: a core module by its name, an engine's by its
        folder and name (``ggml_vec``; ``ggml`` for its __init__; kernels/x86/ as
        ``cpu``, ``mlas``, ``tile_dot``), a study's by its name."""
        parts = Path(self.module).with_suffix("").parts[1:]
        if parts[0] == "studies":
            parts = parts[-1:]
        kept = [p for p in parts if p not in ("kernels", "x86", "__init__")]
        if kept[0] == "carrier32":  # the float32 carrier's modules, as before its package
            kept = [_CARRIER32_NAMES[kept[-1]]]
        return f"{'_'.join(kept)}:{self.description}"


_CARRIER32_NAMES = {
    "elementwise": "ops32",
    "sums": "sum32",
    "lse": "lse32",
    "exp": "exp32",
    "slices": "slices32",
    "native": "native32",
}


def _m(module: str, original: str, replacement: str, description: str, *tests, equivalent=None):
    return Mutant(f"fa_jax/{module}.py", original, replacement, description, tests, equivalent)


MUTANTS: tuple[Mutant, ...] = (
    # -- rounding.py --------------------------------------------------------------
    _m(
        "rounding",
        "(mask >> one) + ((sig >> du) & one)",
        "(mask >> one) + one",
        "ties to even -> ties away from zero",
        CODES,
    ),
    _m(
        "rounding",
        "(mask >> one) + ((sig >> du) & one)",
        "(mask >> one)",
        "ties to even -> ties toward zero",
        CODES,
    ),
    _m(
        "rounding",
        "(mask >> one) + ((sig >> du) & one)",
        "(mask >> one) + ((a >> du) & one)",
        "tie parity from the code instead of the significand",
        CODES,
        RANDOM_F32,
        ORACLE,
    ),
    _m(
        "rounding",
        "inc = jnp.where(neg, zero, mask)",
        "inc = jnp.where(neg, mask, zero)",
        "mode up rounds like down",
        DIRECTED,
        ORACLE,
    ),
    _m(
        "rounding",
        "        inc = zero\n",
        "        inc = mask >> one\n",
        "toward_zero rounds half down to nearest",
        DIRECTED,
        ORACLE,
    ),
    _m(
        "rounding",
        "a_r = (a + inc) & ~mask",
        "a_r = (a + inc) & ~(mask >> one)",
        "mask of the dropped bits one bit short",
        CODES,
    ),
    _m(
        "rounding",
        "d = jnp.clip(q_exp - (E_lin - M), _I32(0), _I32(M))",
        "d = jnp.clip(q_exp - (E_lin - M) + 1, _I32(0), _I32(M))",
        "quantum one bit too coarse",
        CODES,
    ),
    _m(
        "rounding",
        "(jnp.maximum(E, emin) if static.subnormals else E) - m",
        "E - m",
        "subnormal quantum not clamped at emin",
        CODES,
    ),
    _m(
        "rounding",
        "E = jnp.where(Ef > 0, E_lin, c.emin - M + top_bit)",
        "E = jnp.where(Ef > 0, E_lin, c.emin - M + top_bit + 1)",
        "binade of a carrier subnormal off by one",
        RANDOM_F32,
        F64_CASTS,
        ORACLE,
    ),
    _m(
        "rounding",
        "away = a > _pow2_bits(s_exp - 1, c)",
        "away = a >= _pow2_bits(s_exp - 1, c)",
        "S/2 ties away from zero",
        CODES,
    ),
    _m(
        "rounding",
        "away = ~neg & (a > 0)",
        "away = ~neg",
        "mode up rounds +0 to S",
        DIRECTED,
        ORACLE,
    ),
    _m(
        "rounding",
        '(2 if specials == "ieee" else 1) - b',
        '(2 if specials == "ieee" else 2) - b',
        "emax of formats without infinities one binade short",
        CODES,
    ),
    _m(
        "rounding",
        '(U(2) if specials == "fn" else one)',
        '(one if specials == "fn" else one)',
        "fn formats' max takes the NaN code",
        CODES,
    ),
    _m(
        "rounding",
        "mag = jnp.where(a_r > max_bits,",
        "mag = jnp.where(a_r >= max_bits,",
        "max itself overflows",
        CODES,
    ),
    _m(
        "rounding",
        "        toward_max = ~neg\n",
        "        toward_max = neg\n",
        "mode down saturates the wrong sign",
        DIRECTED,
        ORACLE,
    ),
    _m(
        "rounding",
        "is_nan = a > c.inf_bits",
        "is_nan = a >= c.inf_bits",
        "inf treated as NaN",
        CODES,
    ),
    _m(
        "rounding",
        "out_neg = jnp.where(is_nan, ~neg, neg)",
        "out_neg = neg",
        "finite formats keep a NaN's sign on its zero",
        CODES,
    ),
    _m(
        "rounding",
        "out_neg = jnp.where(mag == 0, False,",
        "out_neg = jnp.where(mag == 0, neg,",
        "fnuz formats give -0",
        CODES,
    ),
    _m(
        "rounding",
        "sub_shift = k - c.emin + c.man",
        "sub_shift = k - c.emin + c.man - 1",
        "2**k of a carrier subnormal off by one bit",
        CODES,
        F64_CASTS,
        ORACLE,
    ),
    _m(
        "rounding",
        "away = (rbits & U((1 << (M + 1)) - 1)) < t",
        "away = (rbits & U((1 << (M + 1)) - 1)) <= t",
        "stochastic rounding below S biased up",
        STOCHASTIC,
        "tests/test_rounding_mutants.py",
    ),
    _m(
        "rounding",
        "sh = s_exp - E_lin - 1",
        "sh = s_exp - E_lin",
        "stochastic probability below S halved",
        STOCHASTIC,
    ),
    _m(
        "rounding",
        "code = np.where(inexact, code | np.uint32(1), code)",
        "code = code",
        "float64 narrowing without x64: round to odd dropped",
        NO_X64,
    ),
    _m(
        "rounding",
        "jax.lax.RoundingMethod.TO_NEAREST_EVEN",
        "jax.lax.RoundingMethod.AWAY_FROM_ZERO",
        "reduce_precision path: subnormal ties away from zero",
        RP_PATH,
        F64_CASTS,
    ),
    _m(
        "rounding",
        "jnp.abs(x) < np.asarray(2.0**emin, x.dtype)",
        "jnp.abs(x) < np.asarray(2.0 ** (emin - 1), x.dtype)",
        "reduce_precision path: the top binade of subnormals left to reduce_precision",
        RP_PATH,
        F64_CASTS,
    ),
    _m(
        "rounding",
        "(bits & c.sign_mask) | c.qnan_bits",
        "c.qnan_bits",
        "reduce_precision path: NaN loses its sign",
        RP_PATH,
    ),
    _m(
        "rounding",
        "        and (1 - bias) - m >= c.emin\n",
        "",
        "reduce_precision path taken where the format's subnormals are carrier subnormals",
        RP_NOT_TAKEN,
        CODES,
    ),
    _m(
        "rounding",
        "        and 0 < m < c.man\n",
        "        and m < c.man\n",
        "reduce_precision path taken for a format without mantissa bits",
        RP_NOT_TAKEN,
        ORACLE,
    ),
    # -- ops.py -------------------------------------------------------------------
    _m(
        "ops",
        "e = jnp.where(inexact, e_n if not normalised else e, 0.0)",
        "e = jnp.where(inexact, e_n if not normalised else 0.0, 0.0)",
        "a TwoSum pair's error dropped before rounding to odd (add double-rounds)",
        ADD_MID,
        BINARY,
    ),
    _m(
        "ops",
        "return round_to(jnp.where(_is_fp64(fmt), s, s_odd), fmt)",
        "return round_to(s, fmt)",
        "round-to-odd step removed (add, mul, sums)",
        ADD_MID,
        MUL_FULL,
        BINARY,
    ),
    _m(
        "ops",
        "grow = (e > 0) == (s > 0)",
        "grow = (e > 0) != (s > 0)",
        "round to odd moves away from the exact value",
        ADD_MID,
        BINARY,
    ),
    _m(
        "ops",
        "return s, (a - ap) + (b - bp)",
        "return s, (a - ap)",
        "TwoSum error loses b's part",
        ADD_MID,
        BINARY,
    ),
    _m(
        "ops",
        "midpoint = (lo != hi) & (q - lo == hi - q) & ~_is_fp64(fmt)",
        "midpoint = (lo != hi) & (q - lo == hi - q) & _is_fp64(fmt)",
        "midpoint fix in div removed",
        DIV_MID,
        ATT_MIDPOINT,
    ),
    _m(
        "ops",
        "fixed = jnp.where(residual > 0, hi, jnp.where(residual < 0, lo, nearest))",
        "fixed = jnp.where(residual > 0, lo, jnp.where(residual < 0, hi, nearest))",
        "midpoint fix in div inverted",
        DIV_MID,
    ),
    _m(
        "ops",
        "residual = _sign_of_residual(a, b, q) * jnp.sign(b)",
        "residual = _sign_of_residual(a, b, q)",
        "div residual ignores the divisor's sign",
        DIV_MID,
        DIV_FULL,
    ),
    _m(
        "ops",
        "k = (e_a - e_q - e_b).astype(a.dtype)",
        "k = (e_a - e_q - e_b + 1).astype(a.dtype)",
        "div residual exponent off by one",
        DIV_MID,
        DIV_FULL,
    ),
    _m(
        "ops",
        "jnp.where(normal, jnp.sign(l), 0.0) * p * _BELOW_ULP",
        "jnp.where(normal, -jnp.sign(l), 0.0) * p * _BELOW_ULP",
        "mul's error stand-in has the wrong sign",
        MUL_FULL,
    ),
    _m(
        "ops",
        "l = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo",
        "l = (a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi",
        "Dekker's product drops lo * lo",
        MUL_FULL,
        DIV_FULL,
    ),
    _m(
        "ops",
        "_VELTKAMP = 2.0**27 + 1.0",
        "_VELTKAMP = 2.0**26 + 1.0",
        "Veltkamp split at 26 bits (halves not exact)",
        MUL_FULL,
        DIV_FULL,
    ),
    _m(
        "ops",
        "return round_to(jnp.maximum(a, b), get_format(fmt))",
        "return round_to(jnp.minimum(a, b), get_format(fmt))",
        "maximum computes the minimum",
        BINARY,
    ),
    _m(
        "ops",
        "    return _round_to_odd_then(*_sum_and_error(terms), fmt)",
        "    return round_to(jnp.sum(terms, axis=0), fmt)",
        "exact sum rounded twice (plain float64 sum)",
        SOFTMAX_MIDPOINT,
        SUMS,
    ),
    _m(
        "ops",
        "return s, (e1 + e2) + err",
        "return s, e1 + e2",
        "sum's combiner drops the TwoSum error",
        SOFTMAX_MIDPOINT,
        SUMS,
    ),
    _m(
        "ops",
        "return _round_to_odd_then(total, err + e_k, fmt), None",
        "return _round_to_odd_then(total, err, fmt), None",
        "chunked sum drops each chunk's error",
        SUMS,
        "tests/test_ops_mutants.py",
    ),
    _m(
        "ops",
        'c = 1 if model.kind == "sequential" else model.chunk',
        'c = 2 if model.kind == "sequential" else model.chunk',
        "sequential matmul adds two products per rounding",
        MATMULS,
    ),
    _m(
        "ops",
        "- typing.cast(int, model.extra_bits)",
        "- typing.cast(int, model.extra_bits) - 1",
        "tensor core aligns with one extra bit too many",
        TC_MATMUL,
        TC_SUM,
    ),
    _m(
        "ops",
        "kept = jnp.where(drop > 52, bits & _SIGN, bits & ~mask)",
        "kept = jnp.where(drop >= 52, bits & _SIGN, bits & ~mask)",
        "tensor core truncation flushes a term of one quantum",
        TC_MATMUL,
        TC_SUM,
    ),
    _m(
        "ops",
        "    s = jnp.where(s == 0, 0.0, s)  # an exact zero sum is +0\n",
        "",
        "tensor core block keeps a -0 sum",
        TC_SPECIAL,
        SIGNED_ZERO,
        TC_SUM,
        equivalent=(
            "jnp.sum reduces from XLA's init value +0, and +0 + (-0) = +0, so the block "
            "sum s is never -0 (blocks of k = 1 and k = 4 whose terms are all -0 or are "
            "truncated to -0 give +0 without the where): the where only states the intent"
        ),
    ),
    # -- softmax.py ---------------------------------------------------------------
    _m(
        "softmax",
        "shifted = ops.sub(x, m, policy.exp)",
        "shifted = ops.sub(x, m, policy.stats)",
        "shift x - m rounded to stats instead of exp",
        ATT_SIM,
    ),
    _m(
        "softmax",
        "d_new = ops.add(ops.mul(d, alpha, policy.stats), s, policy.stats)",
        "d_new = ops.add(d, s, policy.stats)",
        "running sum not rescaled by alpha",
        SOFTMAX_SIM,
    ),
    _m(
        "softmax",
        "m_new = running_max(m, jnp.max(x_block, axis=axis), policy.stats)",
        "m_new = cast_scores(jnp.max(x_block, axis=axis), policy.stats)",
        "m_i not updated (block max only)",
        SOFTMAX_SIM,
    ),
    _m(
        "softmax",
        "return shifted_exp(m_old, m_new, policy)",
        "return shifted_exp(m_new, m_old, policy)",
        "rescale factor exp(m_new - m_old)",
        SOFTMAX_SIM,
    ),
    _m(
        "softmax",
        "return jnp.where(den == 0, 0.0, ops.div(num, safe_den, fmt))",
        "return ops.div(num, safe_den, fmt)",
        "fully masked rows not zeroed",
        SOFTMAX_ZERO_ROWS,
        ATT_ZERO_ROWS,
        equivalent=(
            "den is 0 only on a row with no kept entry so far, and there num is +0: "
            "shifted_exp's exact +0 for masked entries (safe, online, reference), or "
            "flash's o (and fa1's and rowwise's numerators), each an ops.add whose first "
            "operand is the +0 of a product with the +0 of alpha or l, and +0 + (+-0) = "
            "+0; so ops.div(+0, 1) = +0, the value the where gives"
        ),
    ),
    _m(
        "softmax",
        "return jnp.where(x == -jnp.inf, -jnp.inf, "
        "ops.cast(jnp.where(x == -jnp.inf, 0.0, x), fmt))",
        "return ops.cast(x, fmt)",
        "masks rounded like values",
        SOFTMAX_NO_INF,
    ),
    _m(
        "softmax",
        "m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked so far: any shift will do",
        "m = m",
        "fully masked shift left at -inf",
        SOFTMAX_ZERO_ROWS,
        SOFTMAX_MASKED,
        equivalent=(
            "where m = -inf every entry is -inf too (m is the max), so every entry is "
            "masked and the NaN of -inf - (-inf) is replaced by the exact 0 of "
            "jnp.where(masked, 0.0, ...); no result can change"
        ),
    ),
    _m(
        "softmax",
        "    e = shifted_exp(x, m, policy)\n    d = ops.sum(e, policy.stats,",
        "    e = shifted_exp(x, m, policy)\n    d = ops.sum(e, policy.exp,",
        "safe softmax's sum in exp instead of stats",
        SOFTMAX_SIM,
        SOFTMAX_MUTANTS,
    ),
    _m(
        "softmax",
        "m = cast_scores(jnp.max(x, axis=-1, keepdims=True), policy.stats)",
        "m = cast_scores(jnp.max(x, axis=-1, keepdims=True), policy.scores)",
        "safe softmax's max in scores instead of stats",
        SOFTMAX_SIM,
        SOFTMAX_MUTANTS,
    ),
    _m(
        "softmax",
        "constant_values=-jnp.inf)",
        "constant_values=0.0)",
        "online softmax pads with 0 instead of a mask",
        SOFTMAX_SIM,
    ),
    _m(
        "softmax",
        "    pad = -n % block\n",
        "    pad = -n % block + block\n",
        "online softmax adds one fully masked block",
        SOFTMAX_SIM,
        equivalent=(
            "an all -inf block leaves m unchanged (max with -inf, m already in stats), "
            "gives alpha = exp(0) = 1 exactly and s = +0, so d = fl(fl(d * 1) + 0) = d"
        ),
    ),
    # -- attention.py -------------------------------------------------------------
    _m(
        "attention",
        "o = ops.add(ops.mul(o, alpha[..., None], policy.o_acc), pv, policy.o_acc)",
        "o = ops.add(o, pv, policy.o_acc)",
        "FA2 update drops the rescale alpha",
        ATT_SIM,
    ),
    _m(
        "attention",
        "o = ops.add(ops.mul(o, alpha[..., None], policy.o_acc), pv, policy.o_acc)",
        "o = ops.add(ops.mul(o, alpha[..., None], policy.pv_acc), pv, policy.o_acc)",
        "FA2 rescale o * alpha in pv_acc instead of o_acc",
        ATT_SIM,
    ),
    _m(
        "attention",
        "return ops.matmul(p, v_j, policy.pv_acc, accumulation=policy.accumulation)",
        "return ops.matmul(p, v_j, policy.o_acc, accumulation=policy.accumulation)",
        "flash P V in o_acc instead of pv_acc",
        ATT_SIM,
    ),
    _m(
        "attention",
        "log2_scale=log2_scale)\n    pv = _pv(ops.cast(e, policy.p), v_j, policy)",
        "log2_scale=log2_scale)\n    pv = _pv(e, v_j, policy)",
        "FA2 P not rounded to p before P V",
        ATT_SIM,
    ),
    _m(
        "attention",
        "return ops.mul(s, scale, policy.scores)",
        "return ops.cast(s, policy.scores)",
        "scale never applied to the scores",
        ATT_SIM,
    ),
    _m(
        "attention",
        '    if policy.scale == "q":\n        q = ops.mul(q, scale, policy.inputs)',
        "    if True:\n        q = ops.mul(q, scale, policy.inputs)",
        "scale applied twice (to Q and to the scores)",
        ATT_SIM,
    ),
    _m(
        "attention",
        "return ops.matmul(q, k_t, policy.qk_acc, accumulation=policy.accumulation)",
        "return ops.matmul(q, k_t, policy.scores, accumulation=policy.accumulation)",
        "Q K^T accumulated in scores instead of qk_acc",
        ATT_SIM,
    ),
    _m(
        "attention",
        'stage = policy.inputs if policy.scale == "q" else policy.scores',
        'stage = policy.scores if policy.scale == "q" else policy.inputs',
        "scale rounded to the wrong stage",
        ATT_SIM,
    ),
    _m(
        "attention",
        "scale = 1.0 / math.sqrt(d)",
        "scale = 1.0 / math.sqrt(d + 1)",
        "default scale 1/sqrt(d + 1)",
        ATT_SIM,
    ),
    _m(
        "masking",
        "keep = jnp.ones((n, m), bool) if not causal else j <= p",
        "keep = jnp.ones((n, m), bool) if not causal else j < p",
        "causal mask drops the diagonal",
        ATT_SIM,
    ),
    _m(
        "masking",
        "keep = keep & (i < ql)",
        "keep = keep & (i <= ql)",
        "q_lengths mask keeps one row too many",
        ATT_MASKS,
    ),
    _m(
        "masking",
        "keep = keep & (j < kl)",
        "keep = keep & (j <= kl)",
        "kv_lengths mask keeps one key too many",
        ATT_MASKS,
    ),
    _m(
        "masking",
        "return jnp.where(j[:, None] < kl, v, 0.0)",
        "return jnp.where(j[:, None] <= kl, v, 0.0)",
        "V past the key length zeroed one row late",
        ATT_MASKS,
        BWD_GOLDEN,
    ),
    _m(
        "attention",
        "ops.log_sum(m, l, policy.stats, scale=m_scale)",
        "ops.log_sum(-m, l, policy.stats, scale=m_scale)",
        "log-sum-exp -m + log l",
        ATT_SIM,
    ),
    _m(
        "attention",
        "ops.log_sum(m, l, policy.stats, scale=m_scale)",
        "ops.log_sum(m, l, policy.exp, scale=m_scale)",
        "log-sum-exp rounded to exp instead of stats",
        ATT_SIM,
    ),
    _m(
        "attention",
        "l_new = ops.add(l_alpha, ops.mul(beta, l_blk, policy.stats), policy.stats)",
        "l_new = ops.add(l_alpha, l_blk, policy.stats)",
        "FA1 block sum not rescaled by beta",
        ATT_SIM,
    ),
    _m(
        "attention",
        "ratio = normalise(ops.mul(l, alpha, policy.stats), l_new, policy.o_acc)",
        "ratio = normalise(l, l_new, policy.o_acc)",
        "rowwise ratio drops alpha",
        ATT_SIM,
    ),
    _m(
        "attention",
        "return normalise(o, l, policy.out)",
        "return normalise(o, l, policy.o_acc)",
        "FA2 final O / l in o_acc instead of out",
        ATT_SIM,
    ),
    _m(
        "attention",
        "return k_blocks, v_blocks, jnp.arange(n_blocks, dtype=jnp.int32) * bc",
        "return k_blocks, v_blocks, jnp.arange(n_blocks, dtype=jnp.int32) * bc + 1",
        "key blocks' first columns off by one",
        ATT_SIM,
    ),
    _m(
        "attention",
        "m = cast_scores(jnp.max(s, axis=-1, keepdims=True), policy.stats)",
        "m = cast_scores(jnp.max(s, axis=-1, keepdims=True), policy.exp)",
        "reference attention's max in exp instead of stats",
        ATT_SIM,
    ),
    _m(
        "attention",
        "p = normalise(e, l, policy.p)",
        "p = normalise(e, l, policy.exp)",
        "reference P rounded to exp instead of p",
        ATT_SIM,
    ),
    # -- backward.py --------------------------------------------------------------
    _m(
        "backward",
        "ops.mul(a, b, policy.d_stats), policy.d_stats",
        "ops.mul(a, b, policy.d_acc), policy.d_stats",
        "D's products in d_acc instead of d_stats",
        ATT_SIM,
    ),
    _m(
        "backward",
        "ops.sub(d_p, d_row[..., None], policy.d_stats)",
        "ops.sub(d_p, d_row[..., None], policy.d_p)",
        "dP - D rounded to d_p instead of d_stats",
        ATT_SIM,
    ),
    _m(
        "backward",
        "return ops.cast(ds, policy.d_s)",
        "return ds",
        "dS not rounded to d_s",
        ATT_SIM,
    ),
    _m(
        "backward",
        "return ops.cast(ops.mul(acc, scale, policy.d_acc), policy.grads)",
        "return ops.cast(acc, policy.grads)",
        "scale never applied to dQ (and dK)",
        ATT_SIM,
    ),
    _m(
        "backward",
        '    if policy.scale != "q":\n        return _scaled',
        '    if policy.scale == "q":\n        return _scaled',
        "dK scaled for the wrong scale placement",
        ATT_SIM,
    ),
    _m(
        "backward",
        "return ops.sub(d_row, d_lse, policy.d_stats)",
        "return ops.add(d_row, d_lse, policy.d_stats)",
        "log-sum-exp cotangent added instead of subtracted",
        ATT_SIM,
    ),
    _m(
        "backward",
        "d_q = ops.add(d_q, _matmul(d_s_j, k_j, policy), policy.d_acc)",
        "d_q = ops.add(d_q, _matmul(d_s_j, k_j, policy), policy.grads)",
        "flash dQ accumulated in grads instead of d_acc",
        ATT_SIM,
    ),
    _m(
        "backward",
        "_matmul(_t(ops.cast(p_j, policy.p)), d_o, policy)",
        "_matmul(_t(p_j), d_o, policy)",
        "flash dV from P not rounded to p",
        ATT_SIM,
    ),
    _m(
        "backward",
        "d_p = ops.cast(_matmul(d_o, _t(v), policy), policy.d_p)",
        "d_p = ops.cast(_matmul(d_o, _t(v), policy), policy.d_s)",
        "reference dP stored in d_s instead of d_p",
        ATT_SIM,
    ),
    _m(
        "backward",
        "return ops.matmul(a, b, policy.d_acc, accumulation=policy.accumulation)",
        "return ops.matmul(a, b, policy.pv_acc, accumulation=policy.accumulation)",
        "backward products in pv_acc instead of d_acc",
        ATT_SIM,
    ),
    _m(
        "backward",
        "p_j = shifted_exp(s_j, lse[..., None], policy,",
        "p_j = shifted_exp(s_j, lse[..., None] + 1.0, policy,",
        "recomputed P shifted by L + 1",
        ATT_SIM,
    ),
    # -- slices32.py / sum32.py: the float32 carrier's fast exact matmul -----------
    _m(
        "carrier32/slices",
        "    below = residual > np.float32(0)\n",
        "    below = residual < np.float32(0)\n",
        "an output with residuals below the grid called exact",
        SLICED_DOT,
    ),
    _m(
        "carrier32/slices",
        "return below, _I32(w + 2) + _floor_log2(",
        "return below, _I32(w - 4) + _floor_log2(",
        "the loss bound 64x too small",
        SLICED_DOT,
    ),
    _m(
        "carrier32/slices",
        "dropped = da.last[..., :, None] + db.last[..., None, :] > _I32(s)",
        "dropped = da.last[..., :, None] + db.last[..., None, :] > _I32(s + 1)",
        "an output missing low digit products called exact",
        SLICED_DOT,
    ),
    _m(
        "carrier32/slices",
        "beta = min(12, (24 - max(c - 1, 1).bit_length()) // 2)",
        "beta = min(12, (24 - max(c - 1, 1).bit_length()) // 2 + 1)",
        "digits a bit too wide for an exact float32 dot",
        SLICED_DOT,
        SLICED_PLANS,
    ),
    _m(
        "carrier32/slices",
        "d = (shift_bits(sig, shift - _I32(beta * (s - 1 - t))) & mask)",
        "d = (shift_bits(sig, shift - _I32(beta * (s - t))) & mask)",
        "digits cut one place off",
        SLICED_DOT,
        SLICED_SUM,
    ),
    _m(
        "carrier32/sums",
        "    lost = s.inexact.astype(jnp.int32)  # of either sign\n",
        "    lost = jnp.zeros_like(s.inexact, jnp.int32)\n",
        "the slices' loss ignored by the window test",
        FALLBACK,
    ),
    _m(
        "carrier32/sums",
        "            batch_all(sliced.safe),\n",
        "            jnp.bool_(True),\n",
        "the fast path taken where it cannot decide",
        FALLBACK,
    ),
    # -- native32.py --------------------------------------------------------------
    _m(
        "carrier32/native",
        "    return (lo_a * lo_b >= _PRODUCT_FLOOR) & (hi_a * hi_b <= _MAX)\n",
        "    return hi_a * hi_b <= _MAX\n",
        "products below 2**-102 (partial sums that may go subnormal) on the hardware",
        NATIVE_CHECKS,
    ),
    _m(
        "carrier32/native",
        "bits & _LOW_BITS if short else np.uint32(0)",
        "np.uint32(0)",
        "13-bit and wider significands (inexact products) on the hardware",
        NATIVE_CHECKS,
    ),
    _m(
        "carrier32/native",
        "    beyond = jnp.where(tiny, fraction,",
        "    beyond = jnp.where(tiny, 0 * fraction,",
        "subnormal operands (flushed) on the hardware",
        NATIVE_CHECKS,
    ),
    # -- exponential.py: the polynomial exp models ---------------------------------
    _m(
        "exponential",
        "(0.00828929059, 0.0418978221,",
        "(0.008289291523396969, 0.0418978221,",
        "exp_u20's degree-5 coefficient one ulp up",
        f"{EXP_RANDOM}[exp_u20]",
    ),
    _m(
        "exponential",
        "small | (n - 1 < -126)",
        "small | (n - 1 < -125)",
        "exp_u20 underflows to 0 one binade early",
        f"{EXP_EDGES}[exp_u20]",
    ),
    _m(
        "exponential",
        "small | (n - 1 < -126)",
        "(n - 1 < -126)",
        "exp_u20's mask below ln FLT_MIN dropped",
        f"{EXP_EDGES}[exp_u20]",
        f"{EXP_RANDOM}[exp_u20]",
        equivalent=(
            "below ln FLT_MIN the clamp gives x = ln FLT_MIN, where n = floor(fl(x log2 e "
            "+ 1/2)) = -126, so n - 1 < -126 already zeroes 2^(n-1): the mask (ATen's "
            "blendv) never changes a result"
        ),
    ),
    _m(
        "exponential",
        "for c in (*_U20_POLY[2:], _U20_C1, 1.0):",
        "for c in (*_U20_POLY[2:], 1.0, _U20_C1):",
        "exp_u20's last two Horner steps swapped",
        f"{EXP_RANDOM}[exp_u20]",
    ),
    _m(
        "exponential",
        "        -0.22433836478672356,\n",
        "        -0.2243383526802063,\n",
        "fexp_u20's quadratic coefficient one ulp off",
        f"{EXP_RANDOM}[fexp_u20]",
    ),
    _m(
        "exponential",
        "return jnp.where(x > _LN_FLT_MAX, jnp.inf, value)",
        "return jnp.where(x >= _LN_FLT_MAX, jnp.inf, value)",
        "fexp_u20 overflows at ln FLT_MAX itself",
        f"{EXP_EDGES}[fexp_u20]",
    ),
    _m(
        "exponential",
        "    t = ops.sub(src, p, FP32)\n",
        "    t = ops.add(src, p, FP32)\n",
        "fexp_u20 adds its correction instead of subtracting it",
        f"{EXP_RANDOM}[fexp_u20]",
    ),
    _m(
        "exponential",
        "        0.00833336077630519866943359,\n",
        "        0.008333361707627773,\n",
        "Sleef's degree-5 coefficient one ulp up",
        f"{EXP_RANDOM}[sleef_expf_u10]",
    ),
    _m(
        "exponential",
        "    s = ops.fma(q, jnp.full_like(q, -_SLEEF_LN2_LO), s, FP32)\n",
        "",
        "Sleef's reduction drops ln 2's low part",
        f"{EXP_RANDOM}[sleef_expf_u10]",
    ),
    _m(
        "exponential",
        "half = jnp.floor(q / 2)",
        "half = jnp.zeros_like(q)",
        "Sleef's ldexp in one step (2^q underflows before u scales it)",
        f"{EXP_EDGES}[sleef_expf_u10]",
    ),
    _m(
        "exponential",
        "jnp.where(x < -104.0, 0.0,",
        "jnp.where(x < -103.0, 0.0,",
        "Sleef's underflow threshold moved to -103",
        f"{EXP_RANDOM}[sleef_expf_u10]",
    ),
    _m(
        "exponential",
        "        8.3242934197e-03,\n",
        "        8.324294351041317e-03,\n",
        "YNNPACK's degree-5 coefficient one ulp up",
        f"{EXP_RANDOM}[ynnpack_exp]",
    ),
    _m(
        "exponential",
        "chains[i % 2] = ops.fma(s, chains[i % 2],",
        "chains[(i + 1) % 2] = ops.fma(s, chains[(i + 1) % 2],",
        "YNNPACK's even and odd Horner chains swapped",
        f"{EXP_RANDOM}[ynnpack_exp]",
    ),
    _m(
        "exponential",
        "scale = jnp.where(b > 127, jnp.inf, exact_pow2(b))",
        "scale = exact_pow2(b)",
        "YNNPACK's overflow to inf left to 2^b",
        f"{EXP_EDGES}[ynnpack_exp]",
        equivalent=(
            "exact_pow2 gives inf for every exponent above 127 itself (the code of +inf), so "
            "the where repeats it"
        ),
    ),
    _m(
        "exponential",
        "y = jnp.where(y < _FLT_MIN, 0.0, y)",
        "y = jnp.where(y < _FLT_MIN / 2, 0.0, y)",
        "YNNPACK keeps subnormal results down to FLT_MIN / 2",
        f"{EXP_EDGES}[ynnpack_exp]",
    ),
    _m(
        "exponential",
        "_YNN_MAX_X = _f32(88.72283935546875)",
        "_YNN_MAX_X = _f32(88.0)",
        "YNNPACK's upper clamp at 88 (finite where 2^b overflows)",
        f"{EXP_EDGES}[ynnpack_exp]",
    ),
    _m(
        "exponential",
        "full = lanes * (x.shape[-1] // lanes)",
        "full = lanes * -(-x.shape[-1] // lanes)",
        "a partial last vector runs the vector exp",
        EXP_VECTORISED,
    ),
    _m(
        "exponential",
        'TORCH_AVX2 = vectorised("torch_fexp_u20_avx2", 8, fexp_u20)',
        'TORCH_AVX2 = vectorised("torch_fexp_u20_avx2", 16, fexp_u20)',
        "PyTorch's AVX2 loop modelled with 16 lanes",
        EXP_TAIL,
    ),
    # -- accumulation_trees.py: summation trees --------------------------------------------
    _m(
        "accumulation_trees",
        "if len(node) == 2 and max(node) < n:",
        "if len(node) == 2 and min(node) < n:",
        "an explicit tree's FMA chains round a term joining a subtree",
        TREE_VALUES,
        TREE_SHAPES,
    ),
    _m(
        "accumulation_trees",
        "new_nodes.append((min(node),))\n"
        "                node = (n + len(new_nodes) - 1, max(node))",
        "new_nodes.append((max(node),))\n"
        "                node = (n + len(new_nodes) - 1, min(node))",
        "an explicit tree's FMA chains round the higher-index term",
        TREE_VALUES,
    ),
    _m(
        "accumulation_trees",
        'if t.order == "sequential" and t.size is None:',
        'if t.order == "sequential":',
        "FMA chains turn sequential(k)'s fused steps into a one-term chain",
        TREE_SHAPES,
    ),
    _m(
        "accumulation_trees",
        "acc = new(ids[0]) if t.from_zero else",
        "acc = ids[0] if t.from_zero else",
        "a chain from zero leaves its first term unrounded",
        TREE_VALUES,
    ),
    _m(
        "accumulation_trees",
        "level = pairs + level[len(level) - len(level) % 2 :]",
        "level = level[len(level) - len(level) % 2 :] + pairs",
        "pairwise carries an odd last value to the front of the next level",
        TREE_SHAPES,
    ),
    _m(
        "accumulation_trees",
        "m, h = len(level), (len(level) + 1) // 2",
        "m, h = len(level), len(level) // 2",
        "halving pairs an odd level's middle value",
        TREE_SHAPES,
    ),
    _m(
        "accumulation_trees",
        "groups = [ids[lane::size] for lane in range(min(size, len(ids)))]",
        "groups = [ids[i : i + size] for i in range(0, len(ids), size)]",
        "lanes sum contiguous blocks instead of strided terms",
        TREE_SHAPES,
    ),
    _m(
        "accumulation_trees",
        "main = len(ids) - len(ids) % size",
        "main = (len(ids) - 1) // size * size",
        "a vector loop's last full vector goes to the scalar tail",
        TREE_SHAPES,
    ),
    _m(
        "accumulation_trees",
        "h -= h % cast(int, t.align)",
        "h += -h % cast(int, t.align)",
        "halves cuts at the next multiple of align above half",
        TREE_SHAPES,
    ),
    _m(
        "accumulation_trees",
        'step = size if t.order == "blocked" else -(-len(ids) // size)',
        'step = size if t.order == "blocked" else max(1, len(ids) // size)',
        "split_k's parts of floor(n / parts) terms (one part too many)",
        TREE_SHAPES,
    ),
    _m(
        "accumulation_trees",
        "return _build(inner, [new(i) for i in ids], nodes, n)",
        "return _build(inner, ids, nodes, n)",
        "rounded products left unrounded",
        TREE_VALUES,
    ),
    _m(
        "accumulation_trees",
        "else ids[0] if k == 1 or len(ids) == 1 else new(*ids[:k])",
        "else ids[0] if k == 1 or len(ids) == 1 else new(*ids[: k + 1])",
        "sequential(k)'s first fused node one term too wide",
        TREE_SHAPES,
    ),
    # -- softmax.py: the exp2 scale -----------------------------------------------------
    _m(
        "softmax",
        "t = ops.mul(ops.sub(m_old, m_new, policy.exp), c, policy.exp)",
        "t = ops.sub(m_old, m_new, policy.exp)",
        "exp2 rescale without the scale",
        EXP2_FLASH,
    ),
    _m(
        "softmax",
        "t = ops.mul(ops.sub(m_old, m_new, policy.exp), c, policy.exp)",
        "t = ops.mul(ops.sub(m_old, m_new, policy.exp), c, policy.stats)",
        "exp2 rescale's exponent rounded to stats instead of exp",
        EXP2_FLASH,
    ),
    _m(
        "softmax",
        "return jnp.where(masked, 0.0, policy.exp_model.fn(t, policy.exp))",
        "return policy.exp_model.fn(t, policy.exp)",
        "exp2 rescale of a fully masked running max gives 1, not 0",
        EXP2_FLASH,
        equivalent=(
            "m_old = -inf only before any key was kept (FA1's beta: a block with none), "
            "where m_old is replaced by m_new, t = 0 and 2^0 = 1 multiplies l = +0 and "
            "o = +0 (FA1: l_blk = +0 and a P V of exact zeros): the same +0 as 0 times it"
        ),
    ),
    _m(
        "softmax",
        "return ops.constant(float(np.float64(scale) * _LOG2E), fmt, dtype)",
        "return ops.constant(float(np.float64(scale)), fmt, dtype)",
        "exp2 factor without log2 e",
        EXP2_REFERENCE,
    ),
    _m(
        "softmax",
        "shift = ops.mul(m, c if shift_scale is None else shift_scale, policy.exp)",
        "shift = ops.mul(m, c if shift_scale is None else shift_scale, policy.stats)",
        "exp2 shift m c rounded to stats instead of exp",
        EXP2_REFERENCE,
    ),
    _m(
        "softmax",
        "shifted = ops.fma(x, jnp.broadcast_to(c, x.shape), -shift, policy.exp)",
        "shifted = ops.sub(ops.mul(x, c, policy.exp), shift, policy.exp)",
        "exp2 exponent x c - m c rounded twice (no FMA)",
        EXP2_REFERENCE,
    ),
    # -- metrics.py: the stated order of the sums -----------------------------------------
    _m(
        "metrics",
        "x = x[:h] + x[h:]",
        "x = x[0::2] + x[1::2]",
        "metrics' pairwise sum pairs neighbours instead of halves",
        METRIC_TREE,
    ),
    _m(
        "metrics",
        "return total / jnp.where(jnp.isnan(total), n + 1, n).astype(total.dtype)",
        "return total * (1 / jnp.asarray(n, total.dtype))",
        "metrics' mean multiplies by a rounded 1/N",
        METRIC_TREE,
    ),
    # -- studies/sweep: the compiled-program cache key ------------------------------------
    _m(
        "studies/sweep/programs",
        'f"exp_model={self.exp_model.name!r}, normalise={self.normalise!r}, "',
        'f"exp_model={self.exp_model.name!r}, "',
        "program cache key omits the normalisation",
        KEY_FIELDS,
    ),
    _m(
        "studies/sweep/programs",
        'f"exp_model={self.exp_model.name!r}, normalise={self.normalise!r}, "',
        'f"exp_model={self.exp_model.base!r}, normalise={self.normalise!r}, "',
        "program cache key names the exp model by its base only",
        KEY_FIELDS,
    ),
    _m(
        "studies/sweep/programs",
        'f"accumulation={self.accumulation!r}, scale={self.scale!r}, "',
        'f"accumulation={self.accumulation.kind!r}, scale={self.scale!r}, "',
        "program cache key names the accumulation by its kind only",
        KEY_MODELS,
    ),
    _m(
        "studies/sweep/executables",
        "                sorted(static.items()),\n",
        "                sorted(static),\n",
        "program cache key holds the static arguments' names, not their values",
        KEY_STATIC,
    ),
    _m(
        "studies/sweep/executables",
        'return (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))',
        'return (tuple(x.shape), str(getattr(x, "sharding", None)))',
        "program cache key omits the arguments' dtypes",
        KEY_ARGS,
    ),
    _m(
        "studies/sweep/executables",
        '        bool(jax.config.read("jax_enable_x64")),\n',
        "",
        "program cache key omits jax_enable_x64",
        KEY_ENV,
    ),
    # -- studies/results.py: resume --------------------------------------------------------
    _m(
        "studies/serving",
        "s = feature.softcap * np.tanh(s / feature.softcap)",
        "s = np.tanh(s)",
        "the golden's softcap without its cap",
        "tests/test_studies_serving.py::test_golden_is_fp64_reference_attention_with_the_features",
    ),
    _m(
        "studies/serving",
        "math.floor(2.0 ** (i / per_octave) + 0.5)",
        "math.floor(2.0 ** (i / per_octave))",
        "decode steps rounded down, not to nearest",
        "tests/test_studies_serving.py::test_decode_steps_are_log_spaced_and_end_at_the_length",
    ),
    _m(
        "studies/results",
        "if want is not None and got == want:",
        "if want is not None and got >= want:",
        "a configuration with a foreign row counts as complete",
        RESUME_FOREIGN,
    ),
    _m(
        "studies/results",
        "if want is not None and got == want:",
        "if want is not None and len(got) == len(want):",
        "complete means as many parts as expected",
        RESULTS_RESUME,
    ),
    _m(
        "studies/results",
        "    return [r for r in rows if tuple(r[c] for c in key) in done], done\n",
        "    return rows, done\n",
        "rows of incomplete configurations kept beside their recomputation",
        RESUME_ONE_ROW,
    ),
    _m(
        "studies/results",
        "return None if parts is None else {tuple(str(v) for v in p) for p in parts}",
        "return None if parts is None else {tuple(p) for p in parts}",
        "expected parts compared unconverted with the CSV's strings",
        RESULTS_STRINGS,
    ),
    _m(
        "studies/results",
        "    old.extend(new)\n",
        "    old[:] = list(new)\n",
        "an append rewrites the file with the new rows only",
        RESUME_PARTLY,
    ),
    # -- kernels/: compare, registry, reveal ------------------------------------------------
    _m(
        "kernels/compare",
        "identical = int(np.count_nonzero(r.view(np.uint64) == e.view(np.uint64)))",
        "identical = int(np.count_nonzero(r == e))",
        "bit-identical counted by value (-0 equal to +0)",
        COMPARE_BINS,
    ),
    _m(
        "kernels/compare",
        "inside = d >= lo if hi is None else (d >= lo) & (d <= hi)",
        "inside = d >= lo if hi is None else (d >= lo) & (d < hi)",
        "ulp bins exclude their upper bound",
        COMPARE_BINS,
    ),
    _m(
        "kernels/compare",
        "max_ulp=int(good.max()) if good.size else 0,",
        "max_ulp=int(d.max()) if d.size else 0,",
        "the largest ulp distance counts NaN's",
        COMPARE_NAN,
    ),
    _m(
        "kernels/registry",
        "back = np.asarray(t, np.float64).astype(dtype).astype(np.float64)",
        "back = np.asarray(t, np.float64)",
        "inputs not exact in the kernel's format accepted",
        KERNEL_INPUTS,
    ),
    _m(
        "kernels/reveal",
        "out.append(n - size[a] - size[b])",
        "out.append(n - size[a] - size[b] - 1)",
        "predicted probes count the meeting node's other term",
        REVEAL_PREDICTED,
    ),
    _m(
        "kernels/reveal",
        "part = [q0] + [q for q in others if s[q] <= w]",
        "part = [q0] + [q for q in others if s[q] < w]",
        "a subtree's partition misses the terms meeting at its root",
        REVEAL_FUSED,
    ),
    _m(
        "kernels/reveal",
        "cap = 2 ** (int(ml_dtypes.finfo(np.dtype(out_dtype or dtype)).nmant) + 1)",
        "cap = 2 ** (int(ml_dtypes.finfo(np.dtype(out_dtype or dtype)).nmant) + 2)",
        "probes count past the output format's integers",
        REVEAL_SPLIT,
    ),
    _m(
        "kernels/xla/orders",
        "        cut = (m // block - 1) * block\n",
        "        cut = (m // block) * block\n",
        "P V's last keys a block of their own where they join the block before",
        PV_CHAINS,
    ),
    _m(
        "kernels/xla/probes",
        "(main[:, lo : lo + block], tile_k, block) for lo in range(0, n - rest, block)",
        "(main, tile_k, block) for lo in range(0, min(n - rest, 1), block)",
        "the probes' simulation pads a Q Kᵀ block to whole chains (reads 31 as 32)",
        QK_SIMULATED,
    ),
    _m(
        "kernels/xla/probes",
        "        if not np.array_equal(tail[:, col], read[key]):\n",
        "        if False:\n",
        "the last query rows of another kernel go unchecked",
        LAST_ROWS,
    ),
    _m(
        "kernels/xla/calls",
        'scale, layout)\n    return run if dtype == "float16"',
        'scale, layout)\n    return run if dtype == "float32"',
        "fp16's real call jitted (XLA's CPU backend refuses its dot under jit), fp32's eager",
        "tests/test_kernels_xla.py::test_xla_is_bit_identical_to_its_model",
    ),
    _m(
        "kernels/xla/probes",
        '        calls.real_call("float32", True, None)\n',
        '        calls.real_call("float32", False, None)\n',
        "the causal FMA keys probed on the program without the causal select",
        "tests/test_kernels_xla.py::test_small_shapes_in_xlas_own_loop_fusions",
    ),
    # -- tile_dot.py, vector_loop.py and torch_cpu.py: AMX's tile dot -------------
    _m(
        "kernels/x86/tile_dot",
        "return max(w for w in range(2, TERMS + 1, 2) if k % w == 0)",
        "return min(k, TERMS)",
        "chunks of 32 with a short last one",
        TILE_CHUNK,
    ),
    _m(
        "kernels/x86/tile_dot",
        "ops.sum(ops.add(even, odd, fmt), fmt, axis=0,",
        "ops.sum(ops.add(even, odd, fmt)[::-1], fmt, axis=0,",
        "the chunks added last to first",
        TILE_LOOP,
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        "return tile_dot(p, v_j, policy.o_acc, initial=o)",
        "return ops.add(o, tile_dot(p, v_j, policy.o_acc), policy.o_acc)",
        "P V's tile dots from 0, then added to o",
        AMX_GEMMS,
    ),
    _m(
        "kernels/torch_cpu/__init__",
        "        return build.amx\n",
        "        return build.variant\n",
        "the BLAS loop where ATen packs for AMX",
        FLASH_LOOP_CHOSEN,
    ),
    _m(
        "kernels/torch_cpu/__init__",
        'return build.intel if cpu.vendor() == "GenuineIntel" else build.variant',
        "return build.variant",
        "torch-flash with the AMD CPUs' GEMMs on an Intel CPU",
        FLASH_LOOP_CHOSEN,
    ),
    _m(
        "kernels/torch_cpu/__init__",
        "return known and order.index(cpu_capability) <= order.index(here)",
        "return known and cpu_capability == here",
        "a lower build forced on this CPU taken for another machine's",
        INTEL_CHOSEN,
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        "    half = -(-k // 2)\n    return [(0, half), (half, k)]",
        "    half = k // 2\n    return [(0, half), (half, k)]",
        "MKL's Intel halves with the shorter first",
        INTEL_BLOCKS,
    ),
    _m(
        "kernels/torch_cpu/__init__",
        'intel = _here(cpu_capability) and cpu.vendor() == "GenuineIntel"',
        "intel = False",
        "torch-math with the AMD CPUs' GEMM blocks on an Intel CPU",
        INTEL_CHOSEN,
    ),
    _m(
        "kernels/torch_cpu/__init__",
        "if intel and intel_takes_lanes(n, q.shape[-1]):",
        "if False:",
        "torch-math's Q Kᵀ without MKL's Intel lanes",
        INTEL_MATH_LANES,
    ),
    # -- vector_loop.py: MKL's GEMMs on an Intel CPU -------------------------------
    _m(
        "kernels/torch_cpu/vector_loop",
        "INTEL_LANES_PER_ROW = 24",
        "INTEL_LANES_PER_ROW = 25",
        "FP16's 16-lane Q Kᵀ from d = 25 per row",
        INTEL_GEMMS,
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        "INTEL_LANES_ROWS = 15",
        "INTEL_LANES_ROWS = 16",
        "FP16's 16-lane Q Kᵀ on 16 rows",
        INTEL_GEMMS,
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        "(((0, 4), 8), 12)",
        "(((0, 8), 4), 12)",
        "FP16's 16 lanes' quarters added out of order",
        INTEL_GEMMS,
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        "((0, 8), (1, 9))",
        "((0, 1), (8, 9))",
        "the BF16 matrix-vector product's lanes combined by neighbours first",
        INTEL_GEMMS,
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        "INTEL_GEMV_KEYS = 8",
        "INTEL_GEMV_KEYS = 16",
        "the BF16 matrix-vector P V in chains of 16 keys",
        INTEL_GEMMS,
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        'return tile_dot(q, k_t, policy.qk_acc, chunking="blocks")',
        "return tile_dot(q, k_t, policy.qk_acc)",
        "MKL's BF16 Q Kᵀ in ATen's packed chunks",
        INTEL_GEMMS,
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        "order = jnp.arange(k + pad).reshape(-1, 2)[:, ::-1].reshape(-1)",
        "order = jnp.arange(k + pad)",
        "vdpbf16ps adding the even term first",
        INTEL_GEMMS,
    ),
    _m(
        "kernels/openvino/sdpa",
        'return tile_dot(a, b, FP32, chunking="blocks")',
        'return tile_dot(a, b, FP32, chunking="divisor")',
        "the brgemm's tile dots in ATen's chunks",
        OV_AMX,
    ),
    _m(
        "kernels/openvino/__init__",
        'amx = "amx_bf16" in cpu.flags()',
        "amx = False",
        "vdpbf16ps chains on a CPU with AMX",
        OV_AMX,
    ),
    _m(
        "kernels/openvino/__init__",
        "return ovs.store_bf16(o.reshape(*o.shape[:-2], -1)).reshape(o.shape)",
        "return ovs.store_bf16(o)",
        "the AMX prefill stores its BF16 outputs a row at a time",
        OV_AMX_STEPS,
    ),
    _m(
        "kernels/x86/mlas",
        "tail = jnp.where(column < n - n % 2, pairs, halves) if n & 2 else halves",
        "tail = fours",
        "the one-row transposed GEMM's last N mod 4 columns in the blocks-of-4 tree",
        ONE_ROW_T,
    ),
    _m(
        "kernels/x86/mlas",
        "tail = jnp.where(column < n - n % 2, pairs, halves) if n & 2 else halves",
        "tail = halves",
        "its block of 2 columns in the last column's tree",
        ONE_ROW_T,
    ),
    _m(
        "kernels/x86/mlas",
        'FMA3 = SumExpKernel("fma3", _f32(-88.3762626647949), scale_from_bits=True, lanes=8)',
        'FMA3 = SumExpKernel("fma3", _f32(-103.9720840454), scale_from_bits=True, lanes=8)',
        "the FMA3 sum-exp kernel clamping at the AVX-512F kernel's LowerRange",
        MLAS_FMA3_EXP,
    ),
    _m(
        "kernels/x86/mlas",
        "    if kernel.scale_from_bits:  # exponent field m + 127 = 0: the scale is +0",
        "    if False:  # exponent field m + 127 = 0: the scale is +0",
        "the FMA3 kernel's 2^-127 as vscalefps's (a subnormal, not +0)",
        MLAS_FMA3_EXP,
    ),
    _m(
        "kernels/x86/mlas",
        "    if kernel.lanes == 16:\n        b = ops.add(b[..., 8:], b[..., :8], FP32)",
        "    if kernel.lanes == 16:\n        b = ops.add(b[..., 0::2], b[..., 1::2], FP32)",
        "the 16 lanes folded as neighbours (lane 2i + lane 2i+1), not i + i+8",
        MLAS_LANES,
    ),
    _m(
        "kernels/onnxruntime/__init__",
        '    if {"avx2", "fma"} <= have:\n        return "AVX2"',
        '    if {"avx2", "fma"} <= have:\n        return "AVX512"',
        "MLAS's FMA3 kernels taken for its AVX-512F ones on an AVX2 CPU",
        MLAS_ISA,
    ),
    # -- which CPU code each model follows: kernels/cpu and the refusals -----------------
    _m(
        "kernels/x86/cpu",
        "if xcr0 & _XCR0_AVX512 != _XCR0_AVX512:",
        "if False:",
        "AVX-512 counted where the OS does not save the ZMM registers",
        XCR0,
    ),
    _m(
        "kernels/x86/cpu",
        'if {"avx2", "fma", "f16c"} <= have:',
        'if "avx2" in have:',
        "AVX2 without FMA counted as the AVX2 class",
        ISA_CLASSES,
    ),
    _m(
        "kernels/xla/__init__",
        '    if cpu.isa() != "AVX512":\n        return (',
        "    if False:\n        return (",
        "the model answers for XLA's and YNNPACK's SSE code",
        CPUS_NAMED,
    ),
    _m(
        "kernels/xla/orders",
        'AVX2 = VectorCode("AVX2", gemv_lanes=(8,))',
        'AVX2 = VectorCode("AVX2", gemv_lanes=(16,))',
        "XLA's AVX2 GEMV in AVX-512's 16 lanes",
        "tests/test_kernels_xla.py::test_the_isa_names_the_vector_code_modelled",
    ),
    _m(
        "kernels/xla/orders",
        "if rest_fma and (m - rest) % min(block, m):",
        "if rest_fma and False:",
        "Eigen's left-over rows never FMA the last key onto their block",
        "tests/test_kernels_xla.py::test_pv_fmas_the_remainder_onto_its_block_where_asked",
    ),
    _m(
        "kernels/xla/__init__",
        'if rank < _MAX_ISAS.index("AVX2"):',
        'if rank < _MAX_ISAS.index("AVX"):',
        "an AVX2 CPU capped at AVX (no FMA) answered",
        XLA_CAPPED,
    ),
    _m(
        "kernels/xla/__init__",
        'not {"avx512_bf16", "amx_bf16"} & have or rank < _MAX_ISAS.index("AVX512_BF16")',
        'rank < _MAX_ISAS.index("AVX512_BF16")',
        "bf16 answered without AVX512-BF16's or AMX's dots",
        CPUS_NAMED,
    ),
    _m(
        "kernels/xla/__init__",
        '    if rank < _MAX_ISAS.index("AVX512"):\n        return (',
        "    if False:\n        return (",
        "a --xla_cpu_max_isa below AVX512 ignored on an AVX-512 CPU",
        XLA_CAPPED,
    ),
    _m(
        "kernels/onnxruntime/__init__",
        "    if mlas_isa() is not None:\n        return None",
        "    if True:\n        return None",
        "MLAS's SSE kernels answered as if modelled",
        CPUS_NAMED,
    ),
    _m(
        "kernels/openvino/__init__",
        'if precision == "bf16" and not {"avx512_bf16", "amx_bf16"} & have:',
        "if False:",
        "OpenVINO's bf16 answered without AVX512-BF16 or AMX",
        CPUS_NAMED,
    ),
    _m(
        "kernels/ggml/__init__",
        '    if {"avx2", "fma", "f16c"} <= build:\n        return KV_TYPES',
        '    if {"avx2", "f16c"} <= build:\n        return KV_TYPES',
        "an AVX2 build without FMA answered as one with it",
        GGML_BUILDS,
    ),
    _m(
        "kernels/ggml/vec",
        'AVX2 = VecCode("AVX2", lanes=8, reduce_hadd=True,',
        'AVX2 = VecCode("AVX2", lanes=8, reduce_hadd=False,',
        "the AVX2 dots' GGML_F32x8_REDUCE ending in AVX-512's tree, not two hadds",
        GGML_VEC_DOTS,
    ),
    _m(
        "kernels/ggml/vec",
        "jnp.where(jnp.abs(n) > 126, far, near)",
        "jnp.where(jnp.abs(n) > 192, far, near)",
        "the AVX2 v_expf rounding once, not twice, for 126 < |n| <= 192",
        GGML_VEC_EXPF,
    ),
    _m(
        "kernels/ggml/vec",
        "return _leftovers_in_double(_tree(_fold(acc), code.lanes), x, y, np_)",
        "return _leftovers_in_double(_vec_reduce(_fold(acc), code), x, y, np_)",
        "the AVX2 BF16 dot's accumulators reduced as the F32 dot's",
        GGML_VEC_DOTS,
    ),
    _m(
        "kernels/openvino/sdpa",
        "(((0, 1), (2, 3)), ((4, 5), (6, 7))),  # hsum (common.hpp)",
        "(((0, 4), (1, 5)), ((2, 6), (3, 7))),  # hsum (common.hpp)",
        "the AVX2 softmax's lanes summed as simd::reduce, not hsum",
        OV_AVX2_SUMS,
    ),
    _m(
        "kernels/openvino/sdpa",
        "return ops.mul(scale_t, ops.fma(-zp_t, head, raw, FP32), FP32)",
        "return ops.mul(scale_t, ops.sub(raw, ops.mul(zp_t, head, FP32), FP32), FP32)",
        "the AVX2 build's affine u8 score without its FMA",
        OV_AFFINE,
    ),
    _m(
        "kernels/openvino/__init__",
        'isa = "AVX2" if _avx2_build(cpu.flags()) else "AVX512"',
        'isa = "AVX512"',
        "OpenVINO's AVX2 build answered as its AVX512F one",
        OV_ISA,
    ),
    _m(
        "kernels/openvino/__init__",
        "thread_shares(h_kv * m, threads)",
        "thread_shares(h * m, threads)",
        "GQA's decoding threads split as if K/V were repeated",
        f"{_OV}::test_gqa_work_is_split_over_the_cache",
    ),
    _m(
        "kernels/openvino/__init__",
        "<= np.arange(n)[:, None] + (m - n))",
        "<= np.arange(n)[:, None])",
        "the causal mask after the cache top-left",
        f"{_OV}::test_gqa_avx2_exact",
    ),
    _m(
        "kernels/openvino/__init__",
        "want = m - n if causal else 0",
        "want = 0",
        "a top-left causal call after the cache accepted",
        f"{_OV}::test_q_offset_is_the_caches_bottom_right",
    ),
    _m(
        "kernels/ggml/attention",
        "big_m, big_s, o = _fold_sink(big_m, big_s, o, sink, fused=False)",
        "big_m, big_s, o = _fold_sink(big_m, big_s, o, sink, fused=True)",
        "the scalar loop's sink S·ms + vs fused like the tiled path's",
        "tests/test_kernels_ggml.py::test_features_scalar_exact",
    ),
    _m(
        "kernels/ggml/attention",
        "glibc_powf(m1, 2 * (h - log2) + 1)",
        "glibc_powf(m1, h - log2 + 1)",
        "ALiBi's slopes past n_head_log2 with the wrong power of m1",
        "tests/test_kernels_ggml.py::test_alibi_slopes",
    ),
    _m(
        "kernels/onnxruntime/gqa",
        "masked = (cols > pos[..., None])",
        "masked = (cols >= pos[..., None])",
        "GroupQueryAttention's flash blocks masking the diagonal key",
        "tests/test_kernels_onnxruntime_gqa.py::test_chunked_prefill_is_bit_exact",
    ),
    _m(
        "kernels/onnxruntime/gqa",
        "pairs = ops.add(acc[..., 0::2], acc[..., 1::2], FP32)",
        "pairs = ops.add(acc[..., :4], acc[..., 4:], FP32)",
        "the decoding GEMV's lanes paired as halves, not neighbours",
        "tests/test_kernels_onnxruntime_gqa.py::test_decode_is_bit_exact",
    ),
    _m(
        "kernels/onnxruntime/__init__",
        "keep = np.arange(m)[None, :] <= np.arange(n)[:, None] + q_offset",
        "keep = np.arange(m)[None, :] <= np.arange(n)[:, None]",
        "the Attention op's causal mask top-left behind its past K/V",
        "tests/test_kernels_onnxruntime.py::test_attention_behind_past_kv_is_bit_exact",
    ),
    _m(
        "masking",
        "    p = i + q_offset  # the query's position on the key axis",
        "    p = i  # the query's position on the key axis",
        "q_offset ignored: every mask top-left",
        Q_OFFSET,
    ),
    _m(
        "attention",
        "start = init if sinks is None else (*sink_start(sinks, n), init[2])",
        "start = init",
        "flash loops that drop the sinks",
        SINKS_GOLDEN,
    ),
    _m(
        "attention",
        "    if sinks is not None:\n        p = p[..., 1:]",
        "    if sinks is not None:\n        p = p[..., :-1]",
        "the reference's sink column dropped from the wrong end",
        SINK_AS_KEY,
    ),
    _m(
        "kernels/ggml/__init__",
        'return KV_TYPES if "avx512_bf16" in build else',
        "return KV_TYPES if True else",
        "bf16 K/V answered without AVX512-BF16's dot",
        GGML_BUILDS,
    ),
    # -- kernels/xla_own_dots: XLA's GEMVs ------------------------------------------------
    _m(
        "kernels/xla/own_dots",
        "[fold(chains[..., :whole], acc), y[",
        "[fold(chains[..., :whole], acc, halving=True), y[",
        "whole tiles of the row-major GEMV summed by halving, not AVX's hadd",
        GEMV_REAL,
    ),
    _m(
        "kernels/xla/own_dots",
        "    if r % lanes == 1:\n",
        "    if r % lanes == 2:\n",
        "the column-major GEMV's lone output taken for two",
        GEMV_REAL,
    ),
    _m(
        "kernels/xla/own_dots",
        "        first = min(TILE, t)\n",
        "        first = min(TILE - 1, t)\n",
        "the lone output's rounded tile a term short",
        GEMV_REAL,
    ),
    _m(
        "kernels/xla/own_dots",
        'return "row" if layout and layout[0] == int(dim) else "column"',
        'return "row" if layout and layout[-1] == int(dim) else "column"',
        "a GEMV's major read from the major-most dimension",
        OWN_DOTS_READ,
        GEMV_REAL,
    ),
    _m(
        "kernels/xla/own_dots",
        "    return min(k, -(-(k // slices) // _SLICE_MULTIPLE) * _SLICE_MULTIPLE)\n",
        "    return min(k, -(-(-(-k // slices)) // _SLICE_MULTIPLE) * _SLICE_MULTIPLE)\n",
        "TSL's slices of k rounded up before the multiple of 8",
        EIGEN_KC,
    ),
    _m(
        "kernels/xla/own_dots",
        "            kcs.setdefault(eigen_kc(rest, kc), kc)\n",
        "            kcs.setdefault(block, kc)\n",
        "only the smallest kc giving a shard's block offered",
        EIGEN_KCS,
    ),
    # -- split_kv.py, kv_cache.py, heads.py, masking.py, score_mods.py, nn.py ----------------
    _m(
        "split_kv",
        "per_split = -(-n_blocks // num_splits)",
        "per_split = n_blocks // num_splits + 1",
        "split boundaries one block late where the splits divide the blocks",
        SPLIT_SIM,
    ),
    _m(
        "split_kv",
        "    w = _exp_of_difference(lse_s, jnp.where(live, lse, 0.0), fmt)\n",
        "    w = t\n",
        "the combine weights not divided by their sum",
        SPLIT_SIM,
        SPLIT_GOLDEN,
    ),
    _m(
        "split_kv",
        "return ops.fma(jnp.broadcast_to(w_s[..., None], o.shape), o, acc, fmt), None",
        "return ops.add(ops.mul(w_s[..., None], o, fmt), acc, fmt), None",
        "the combine's fused multiply-add rounded twice",
        SPLIT_SIM,
    ),
    _m(
        "split_kv",
        "    lse = jnp.where(live, lse, -jnp.inf)\n    if normalised:",
        "    if normalised:",
        "a split that keeps no key has L_s = 0, not -inf",
        SPLIT_SIM,
    ),
    _m(
        "split_kv",
        'if policy.normalise == "divide":\n        return lse, normalise(',
        'if policy.normalise != "divide":\n        return lse, normalise(',
        "a split's output normalised by the other rule",
        SPLIT_SIM,
    ),
    _m(
        "split_kv",
        'm_scale = scale if policy.scale == "exp2" else None',
        "m_scale = None",
        "a split's lse under scale exp2 left in unscaled units",
        "tests/test_split_kv.py::test_golden_split_kv_under_every_scale_placement_is_plain_attention",
    ),
    _m(
        "kv_cache",
        "lengths = jnp.max(jnp.broadcast_to(lengths, q_lead).reshape(*lead, groups), axis=-1)",
        "lengths = jnp.min(jnp.broadcast_to(lengths, q_lead).reshape(*lead, groups), axis=-1)",
        "a K/V head's length its shortest query head's",
        "tests/test_kv_cache.py::test_a_kv_heads_length_is_its_longest_query_heads",
    ),
    _m(
        "quantization",
        "r = jnp.clip(jnp.round(y), -fmt.max, fmt.max)",
        "r = jnp.minimum(jnp.round(y), fmt.max)",
        "int8 codes clamped above only",
        "tests/test_quantization.py::test_int8_codes_round_ties_to_even_and_clamp_on_both_sides",
    ),
    _m(
        "studies/sweep/partition",
        "p = min(range(processes), key=lambda j: (load[j], j))",
        "p = min(range(processes), key=lambda j: (load[j], -j))",
        "equal loads dealt to the highest process index",
        "tests/test_merge.py::test_partition_takes_the_largest_first_and_breaks_ties_in_order",
    ),
    _m(
        "kernels/torch_cpu/vector_loop",
        "    o = ops.mul(o, alpha[..., None], policy.o_acc)\n",
        "",
        "PyTorch's loop keeps o unrescaled between key blocks",
        "tests/test_vector_loop.py::test_the_loop_over_many_key_blocks_is_attention_under_the_golden_policy",
    ),
    _m(
        "kv_cache",
        "return tuple(a for a in range(ndim) if a != ndim - 3)",
        "return tuple(a for a in range(ndim) if a != ndim - 2)",
        "a per-head scale spans the heads and keeps the keys apart",
        KV_CODES,
    ),
    _m(
        "kv_cache",
        "        return (ndim - 1,)\n",
        "        return (ndim - 2,)\n",
        "a per-token scale spans the keys",
        KV_CODES,
    ),
    _m(
        "kv_cache",
        "return jnp.where(j < lengths, a, 0.0)",
        "return jnp.where(j <= lengths, a, 0.0)",
        "the first key past its length sets a scale",
        KV_CODES,
        KV_ATTENTION,
    ),
    _m(
        "heads",
        "return jnp.repeat(x, groups, axis=-3)",
        "return jnp.tile(x, (groups, 1, 1))",
        "query head h reads K/V head h mod H_kv, not h // G",
        GQA_REPEATED,
        FEATURE_SIM,
    ),
    _m(
        "heads",
        "    return ops.cast(total, policy.grads)\n",
        "    return total\n",
        "dK, dV summed over a group left in d_acc, not rounded to grads",
        FEATURE_SIM,
    ),
    _m(
        "masking",
        "keep = keep & (j >= p - left)",
        "keep = keep & (j > p - left)",
        "a window keeps one key too few on the left",
        FEATURES_GOLDEN,
    ),
    _m(
        "masking",
        "return max(0, min(m, n + q_offset + window[1]))",
        "return max(0, min(m, n + q_offset + window[1] - 1))",
        "the flash loop skips the last key block a window keeps",
        SKIPPED_BLOCKS,
    ),
    _m(
        "score_mods",
        "return ops.sub(jnp.ones_like(t), ops.mul(t, t, policy.d_stats), policy.d_stats)",
        "return ops.add(jnp.ones_like(t), ops.mul(t, t, policy.d_stats), policy.d_stats)",
        "softcap's backward factor 1 + t^2",
        FEATURE_SIM,
        FEATURES_GOLDEN,
    ),
    _m(
        "score_mods",
        "return jnp.where(masked, -jnp.inf, ops.add(s, jnp.where(masked, 0.0, b), policy.bias))",
        "return jnp.where(masked, -jnp.inf, ops.add(s, jnp.where(masked, 0.0, b), policy.scores))",
        "S + B rounded in scores, not bias",
        BIAS_STAGE,
        FEATURE_SIM,
    ),
    _m(
        "score_mods",
        "slopes += power_of_two(2 * k)[0::2][: heads - k]",
        "slopes += power_of_two(2 * k)[1::2][: heads - k]",
        "ALiBi's extra slopes for a head count not a power of two taken off by one",
        ALIBI_SLOPES,
    ),
    _m(
        "nn",
        "    out = _to_dtype(jnp.swapaxes(jnp.asarray(o), 1, 2), query.dtype)\n",
        "    out = _to_dtype(jnp.swapaxes(jnp.asarray(o), 1, 3), query.dtype)\n",
        "the output's (B, N, T, H) axes put back wrong",
        NN_ROUTES,
    ),
    _m(
        "nn",
        "return None, jnp.asarray((j >= p - left) & (j <= p + right))",
        "return None, jnp.asarray((j >= p - left) & (j < p + right))",
        "a window with an unbounded side keeps one key too few on the right",
        NN_JAX,
    ),
)


def check_unique(mutant: Mutant, root: Path = REPO) -> None:
    """Raise ValueError unless the mutant's original snippet occurs exactly once."""
    text = (root / mutant.module).read_text()
    count = text.count(mutant.original)
    if count != 1:
        raise ValueError(
            f"{mutant.name}: expected the original snippet once in {mutant.module}, "
            f"found it {count} times: {mutant.original!r}"
        )


class Outcome(NamedTuple):
    mutant: Mutant
    status: str  # killed, survived, skipped (not judged here), timeout, error
    seconds: float
    detail: str = ""


def _workspace() -> Path:
    """A fresh copy of the package, the tests and pyproject.toml; checks that Python
    imports fa_jax from it."""
    root = Path(tempfile.mkdtemp(prefix="fa_jax_mutant_"))
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, root / name)
    probe = subprocess.run(
        [sys.executable, "-c", "import fa_jax; print(fa_jax.__file__)"],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    imported = Path(probe.stdout.strip()).resolve()
    if probe.returncode != 0 or root.resolve() not in imported.parents:
        raise RuntimeError(f"the copy in {root} is not the fa_jax imported: {probe.stdout}")
    return root


def _env(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FA_JAX_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def run_mutant(mutant: Mutant, root: Path, timeout: float) -> Outcome:
    """Apply ``mutant`` in the copy at ``root``, run its tests, restore the file."""
    path = root / mutant.module
    original = path.read_text()
    check_unique(mutant, root)
    path.write_text(original.replace(mutant.original, mutant.replacement, 1))
    start = time.perf_counter()
    # -m "not slow": the named tests run whichever tier the default run keeps them in.
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0"]
    cmd += ["-m", "not slow"]
    try:
        proc = subprocess.Popen(
            [*cmd, *mutant.tests],
            cwd=root,
            env=_env(root),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return Outcome(mutant, "timeout", time.perf_counter() - start)
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - start
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if proc.returncode == 0:
        skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
        if skips:  # passed with checks this host cannot run: not judged here
            return Outcome(mutant, "skipped", seconds, f"{last}; {skips[0]}")
        return Outcome(mutant, "survived", seconds, last)
    if proc.returncode in (1, 2):  # failures, or errors the mutant caused at collection
        return Outcome(mutant, "killed", seconds, last)
    return Outcome(mutant, "error", seconds, f"pytest exit {proc.returncode}: {last}")


def run_all(
    mutants, jobs: int, timeout: float, report=print, budget: float | None = None
) -> list[Outcome]:
    """Run the mutants on ``jobs`` workers, each with a copy of its own; past
    ``budget`` seconds none is started any more (each left is "not run")."""
    end = None if budget is None else time.perf_counter() + budget
    spaces: queue.Queue[Path] = queue.Queue()
    roots = [_workspace() for _ in range(min(jobs, len(mutants)))]
    for root in roots:
        spaces.put(root)
    lock = threading.Lock()

    def one(mutant: Mutant) -> Outcome:
        root = spaces.get()
        try:
            if end is not None and time.perf_counter() > end:
                outcome = Outcome(mutant, "not run", 0.0, f"the {budget:.0f} s budget was spent")
            else:
                outcome = run_mutant(mutant, root, timeout)
        finally:
            spaces.put(root)
        with lock:
            report(_line(outcome))
        return outcome

    try:
        with ThreadPoolExecutor(max_workers=len(roots)) as pool:
            return list(pool.map(one, mutants))
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def _line(o: Outcome) -> str:
    status = o.status if o.mutant.equivalent is None or o.status == "killed" else "equivalent"
    return f"{status:10s} {o.seconds:7.1f}s  {o.mutant.name}  {o.detail}"


def summary(outcomes: list[Outcome]) -> tuple[str, bool]:
    """(the score line, whether every mutant is killed or listed as equivalent)."""
    unrun = [o for o in outcomes if o.status == "not run"]
    unjudged = [
        o for o in outcomes if (o.status == "skipped" and o.mutant.equivalent is None) or o in unrun
    ]
    counted = [o for o in outcomes if o.mutant.equivalent is None and o not in unjudged]
    killed = sum(o.status == "killed" for o in counted)
    equivalent = sum(o.mutant.equivalent is not None for o in outcomes)
    bad = [o for o in counted if o.status != "killed"]
    line = f"score: {killed} / {len(counted)} killed ({equivalent} listed as equivalent"
    if len(unjudged) > len(unrun):
        line += f"; {len(unjudged) - len(unrun)} not judged on this host: their tests skip here"
    if unrun:
        line += f"; {len(unrun)} not run: the time budget was spent"
    return line + ")", not bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", metavar="PATTERN", help="run mutants whose name matches (regex)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds after which no mutant is started (those left are listed as not run)",
    )
    parser.add_argument(
        "--shuffle", metavar="SEED", help="run the mutants in an order drawn from SEED"
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs: expected a positive integer, got {args.jobs}")
    if args.timeout <= 0:
        parser.error(f"--timeout: expected a positive number, got {args.timeout}")
    mutants = [m for m in MUTANTS if args.only is None or re.search(args.only, m.name)]
    for m in mutants:
        check_unique(m)
    if args.list:
        for m in mutants:
            eq = "  [equivalent]" if m.equivalent else ""
            print(f"{m.name}{eq}\n    tests: {' '.join(m.tests)}")
        return 0
    if not mutants:
        print(f"no mutant matches {args.only!r}", file=sys.stderr)
        return 1
    if args.shuffle is not None:
        random.Random(args.shuffle).shuffle(mutants)
        print(f"mutants shuffled with seed {args.shuffle!r}")
    start = time.perf_counter()
    outcomes = run_all(mutants, args.jobs, args.timeout, budget=args.budget)
    line, ok = summary(outcomes)
    print(line)
    for o in outcomes:
        if o.mutant.equivalent is not None and o.status != "killed":
            print(f"equivalent: {o.mutant.name}: {o.mutant.equivalent}")
        elif o.status == "skipped":
            print(f"not judged here: {o.mutant.name}: {o.detail}")
        elif o.status == "not run":
            print(f"not run: {o.mutant.name}: {o.detail}")
        elif o.status != "killed":
            print(f"{o.status}: {o.mutant.name} (tests: {' '.join(o.mutant.tests)})")
    print(f"wall time: {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
