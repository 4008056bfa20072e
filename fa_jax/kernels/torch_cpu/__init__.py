"""PyTorch's CPU attention kernels and fa_jax's bit-exact models of them.

``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors in bf16 or
fp16, under ``torch.nn.attention.sdpa_kernel``:

``torch-math`` (``SDPBackend.MATH``, ATen's ``_scaled_dot_product_attention_math``)
  upcasts bf16/fp16 inputs to FP32 and computes the unfused attention in FP32:
  Q' = fl32(Q r), K' = fl32(K r) with r = fl32(sqrt(scale)); S = Q' K'ᵀ (FP32
  GEMM, in index order with FMA); softmax as ATen's CPU kernel computes it
  (``native/cpu/SoftMaxKernel.cpp``: row max, e = exp(S − m) on every entry,
  Σ e by ``vec::reduce_all``, P = fl32(e · fl32(1 / Σ)));
  O = fl_in(P V) (FP32 GEMMs blocked as :func:`fa_jax.kernels.torch_cpu.vector_loop.gemm_k_blocks`,
  on Intel :func:`intel_sgemm_blocks`).  Model: those steps in :mod:`fa_jax.ops`.

``torch-flash`` (``SDPBackend.FLASH_ATTENTION``, ``cpu_flash_attention`` in
  ATen's ``native/cpu/FlashAttentionKernel.cpp``) tiles the queries in blocks of
  256 rows (N >= 768), 64 (N >= 192) or 32, and the keys in blocks of 512
  (capped at M).  Per key block: S = fl32(fl32(Q Kᵀ) · scale) (an FP32 GEMM
  summing in index order), the row max, P̃ = ``fexp_u20``(S − m) on full
  vectors of lanes and the scalar ``expf`` on the rest (:mod:`fa_jax.exponential`),
  P̃ stored in the input format, the row sum over two lane accumulators,
  l = α l + Σ P̃, o = fl(α o) ⊕ P V (the GEMM's blocked FP32 accumulation);
  at the end O = fl_in(fl32(o · fl32(1 / l))).  Model: a ``torch_*`` loop of
  :func:`fa_jax.attention.flash_attention` (:mod:`fa_jax.kernels.torch_cpu.vector_loop` gives
  every step) with the kernel's block sizes.  What was read in the source and
  what was measured on the kernel: the exp (``fexp_u20``, not the ``exp_u20``
  of older sources), the two accumulators and the GEMM's blocks were found by
  inputs built to isolate them.  The GEMMs are MKL's (``cpublas::gemm``);
  where the last query block holds 1 to 3 rows (N = 33, 35, 65, ..., N <= 3),
  MKL's small-matrix path sums Q Kᵀ in 4 lanes over the head dimension (8 for
  the key block's last width mod 4 keys) and P V as one FMA chain from o
  (:func:`fa_jax.kernels.torch_cpu.vector_loop.torch_qk`, ``torch_pv``), revealed by probes on
  MKL's ``cblas_gemm_f16f16f32`` and ``sgemm_``.

ATen builds both kernels once per CPU capability and dispatches to one
(``torch.backends.cpu.get_cpu_capability()``; ``ATEN_CPU_CAPABILITY=default``
or ``avx2``, set before torch is imported, forces a lower one).  The builds
differ in ``Vectorized<float>`` (``aten/src/ATen/cpu/vec``), so each has its
model (:data:`CAPABILITIES`; ``cpu_capability=`` below this CPU's is this CPU forced to it,
above it another machine's):

=========  =====  ==============================  ==================  ===========
build      lanes  lanes combined                  exp (flash / math)  a · b + c
=========  =====  ==============================  ==================  ===========
DEFAULT    8      in order (``vec_base.h``)       glibc / glibc       two roundings
AVX2       8      halving ((0+4)+(2+6))+…         fexp_u20 / Sleef    FMA
AVX512     16     halving (i+8, i+4, i+2, i+1)    fexp_u20 / Sleef    FMA
=========  =====  ==============================  ==================  ===========

Where torch-flash packs K and V for AMX (:func:`amx_packs`, ``need_pack``), its
GEMMs are tile dots (:mod:`fa_jax.kernels.x86.tile_dot`, the ``torch_avx512_amx`` loop); on an
Intel CPU the GEMMs are MKL's Intel kernels (the ``*_intel`` loops).  Where this
CPU runs a kernel not modelled, a model raises ``NotImplementedError`` with the
reason (:func:`unmodelled_here`; docs/kernels.md).

"glibc" is the C library's ``expf`` (``std::exp``), which the vector builds
also call on the flash loop's tail and for α = exp(m − m_new); "Sleef" is
``Sleef_expf8_u10`` / ``Sleef_expf16_u10`` (the same bits on every FP32 input
in [-104, 0], checked).  The GEMMs are the CPU BLAS's, the same under every
capability.  PyTorch is imported only when a kernel runs or the capability is read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import platform as _platform

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax.accumulation import SEQUENTIAL
from fa_jax.attention import Blocks, flash_attention
from fa_jax.exponential import (
    GLIBC_EXPF,
    SLEEF_U10,
    TORCH_FLASH_AVX2,
    TORCH_FLASH_AVX512,
    ExpModel,
)
from fa_jax.formats import FP32, Format, get_format
from fa_jax.heads import kv_groups, repeat_kv
from fa_jax.kernels.model import Kernel, KernelModel, refuse
from fa_jax.kernels.torch_cpu.vector_loop import (
    INTEL_GEMM_K,
    LANES,
    MKL_INTEL_LANES,
    gemm_accumulate,
    gemm_k_blocks,
    intel_sgemm_blocks,
    intel_takes_lanes,
    lane_sum,
    query_block,
    query_split,
)
from fa_jax.kernels.x86 import cpu
from fa_jax.policy import Policy
from fa_jax.presets import fa2_kernel
from fa_jax.rounding import round_to
from fa_jax.score_mods import add_bias
from fa_jax.softmax import shifted_exp

__all__ = [
    "CAPABILITIES",
    "TORCH_FLASH",
    "TORCH_MATH",
    "Build",
    "amx_packs",
    "flash_blocks",
    "flash_model",
    "math_model",
    "platform",
    "real_flash",
    "real_math",
    "runs_here",
    "unmodelled_here",
]

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16"}


@dataclasses.dataclass(frozen=True)
class Build:
    """What one CPU capability's build of the kernels computes: the flash loop's
    variant (:data:`fa_jax.kernels.torch_cpu.vector_loop.LANES`, with MKL's GEMMs as on an AMD CPU),
    the flash loop's exp and the softmax's exp; ``amx``, the flash loop's variant
    where it packs K and V for AMX in bf16 (:func:`amx_packs`), or None where the
    build cannot (its packing code is AVX-512's: the kernel fails)."""

    variant: str
    flash_exp: ExpModel
    softmax_exp: ExpModel
    amx: str | None = None

    @property
    def intel(self) -> str:
        """The flash loop's variant with MKL's GEMMs as on an Intel CPU."""
        return f"{self.variant}_intel"


CAPABILITIES: dict[str, Build] = {
    "DEFAULT": Build("torch_default", GLIBC_EXPF, GLIBC_EXPF),
    "AVX2": Build("torch_avx2", TORCH_FLASH_AVX2, SLEEF_U10),
    "AVX512": Build("torch_avx512", TORCH_FLASH_AVX512, SLEEF_U10, amx="torch_avx512_amx"),
}


# The CPU features ATen requires of each capability's kernels before it picks them
# (aten/src/ATen/native/DispatchStub.cpp, compute_cpu_capability).
_CAPABILITY_NEEDS = {
    "DEFAULT": frozenset(),
    "AVX2": frozenset({"avx2", "fma"}),
    "AVX512": frozenset({"avx512vl", "avx512bw", "avx512dq", "fma"}),
}


def runs_here(cpu_capability: str) -> bool:
    """Whether this CPU can run ATen's kernels of ``cpu_capability``: ATen takes
    ``ATEN_CPU_CAPABILITY`` without checking it, and a capability above the CPU's
    dies on its first illegal instruction."""
    needs = _CAPABILITY_NEEDS.get(cpu_capability)
    return needs is not None and needs <= cpu.flags()


def _unavailable() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not installed (pip install torch)"
    return None


@functools.cache
def capability() -> str:
    """The CPU capability ATen's kernels dispatch to (e.g. "AVX2", "AVX512")."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def platform() -> dict[str, str]:
    """PyTorch's version, the CPU capability its kernels use, the machine."""
    import torch

    return {
        "torch": str(torch.__version__),
        "cpu_capability": capability(),
        "backend": "cpu",
        "machine": _platform.machine(),
        "processor": _platform.processor() or _platform.machine(),
    }


def _check_causal(kernel: str, causal: bool, features: dict) -> None:
    """SDPA refuses an explicit attn_mask together with is_causal."""
    if causal and any(features.get(name) is not None for name in ("bias", "mask")):
        raise ValueError(
            f"{kernel}: causal: expected no bias or mask with causal=True (SDPA refuses an "
            "attn_mask with is_causal), got both"
        )


def _attn_mask(shape: tuple, dtype, bias, mask):
    """SDPA's attn_mask for a bias (a float mask of the query's dtype, its values
    exact there), a boolean mask (True = keep), or both (the bias, -inf where the
    mask drops the pair); broadcast to (..., H, N, M); None for neither."""
    import torch

    if bias is None and mask is None:
        return None
    if bias is None:
        return torch.from_numpy(np.array(np.broadcast_to(mask, shape)))
    b = np.broadcast_to(np.asarray(bias, np.float64), shape)
    if mask is not None:
        b = np.where(np.broadcast_to(mask, shape), b, -np.inf)
    return torch.from_numpy(np.ascontiguousarray(b, np.float32)).to(dtype)


def _sdpa(
    backend: str, q, k, v, fmt: Format, causal: bool, scale, bias=None, mask=None
) -> np.ndarray:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fmt = get_format(fmt)
    if fmt.name not in _DTYPES:
        raise ValueError(
            f"torch CPU attention: format: expected one of {sorted(_DTYPES)}, got {fmt.name!r}"
        )
    dtype = getattr(torch, _DTYPES[fmt.name])
    gqa = np.shape(k)[:-2] != np.shape(q)[:-2]
    attn_mask = _attn_mask((*np.shape(q)[:-1], np.shape(k)[-2]), dtype, bias, mask)
    q, k, v = (torch.from_numpy(np.asarray(t, dtype=np.float32)).to(dtype) for t in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend)), torch.no_grad():
        o = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=bool(causal),
            scale=None if scale is None else float(scale),
            enable_gqa=bool(gqa),
        )
    return o.to(torch.float64).numpy()


def real_math(q, k, v, *, fmt: Format, causal: bool = False, scale=None, **features) -> np.ndarray:
    """PyTorch's math SDPA on the CPU, in ``fmt`` (bf16 or fp16); ``bias`` and ``mask``
    as its attn_mask, K/V with fewer heads by ``enable_gqa``."""
    _check_causal("torch-math", causal, features)
    return _sdpa("MATH", q, k, v, fmt, causal, scale, **features)


def real_flash(q, k, v, *, fmt: Format, causal: bool = False, scale=None, **features) -> np.ndarray:
    """PyTorch's flash SDPA on the CPU, in ``fmt`` (bf16 or fp16); ``bias`` and
    ``mask`` as its attn_mask, K/V with fewer heads by ``enable_gqa``."""
    _check_causal("torch-flash", causal, features)
    return _sdpa("FLASH_ATTENTION", q, k, v, fmt, causal, scale, **features)


def _stage_policy(fmt: Format, name: str, **changes) -> Policy:
    """FlashAttention-2's stage formats (:func:`fa_jax.presets.fa2_kernel`): Q, K, V,
    P and O in ``fmt``; scores, statistics, exp and accumulators FP32."""
    f = get_format(fmt)
    return fa2_kernel(f).replace(name=f"{name}({f.name})", **changes)


def unmodelled_here(
    kernel: str,
    fmt: Format,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    causal: bool,
    *,
    cpu_capability: str | None = None,
) -> str | None:
    """Why this CPU runs ``kernel`` (torch-math or torch-flash) on these shapes,
    under ``cpu_capability`` (the one here by default), in a way the models do not
    follow, or None where they do:

    - torch-flash packs K and V for AMX (:func:`amx_packs`) and the build has no
      model of it (:attr:`Build.amx`: fp16 on AMX-FP16; the builds below AVX512,
      whose packing fails);
    - MKL, which picks its GEMM kernels by CPU vendor, runs other kernels on an
      Intel CPU, measured on one with AVX-512 and AMX: torch-math's FP32 GEMM in
      :func:`intel_sgemm_blocks` (Q Kᵀ over 2 to 15 rows from d = 24 N in
      ``MKL_INTEL_LANES``) for N > 1, d and M up to 768;
      torch-flash's FP16 GEMM the same way for d up to 768 (the ``*_intel``
      loops), which needs AVX-512; its BF16 GEMM on AMX's tile dots and
      ``vdpbf16ps`` (a last query block of 1 row), which needs AMX-BF16.

    A model of a capability this CPU cannot run is another machine's, with the AMD
    CPUs' GEMMs: None."""
    n, d, m = int(q_shape[-2]), int(q_shape[-1]), int(k_shape[-2])
    name = get_format(fmt).name
    if kernel == "torch-flash" and amx_packs(fmt, q_shape, k_shape, causal):
        build = CAPABILITIES.get(capability() if cpu_capability is None else cpu_capability)
        if build is not None and build.amx is not None and name == "bfloat16":
            return None  # tile GEMMs on every row: no MKL
        return (
            f"{kernel}: expected a shape ATen runs without AMX packing, got "
            f"{name} Q {tuple(q_shape)}, K {tuple(k_shape)} on a CPU with "
            "AMX: K and V are packed for its tile GEMM there, which is modelled only for "
            "bf16 in the AVX512 build (the lower builds' packing fails)"
        )
    if cpu.vendor() != "GenuineIntel" or not _here(cpu_capability):
        return None
    if kernel == "torch-math":
        if n > 1 and max(d, m) <= INTEL_GEMM_K:
            return None  # intel_sgemm_blocks, MKL_INTEL_LANES
        return (
            f"{kernel}: expected N > 1, d <= {INTEL_GEMM_K} and M <= {INTEL_GEMM_K} (MKL's "
            f"FP32 GEMM on an Intel CPU as measured), got N = {n}, d = {d}, M = {m}: its "
            "matrix-vector product and larger GEMMs sum otherwise (docs/kernels.md)"
        )
    reason = _kernel_unmodelled(kernel)(fmt, cpu_capability=cpu_capability)
    if reason is not None:
        return reason  # MKL's GEMMs on an Intel CPU without the features measured
    if d > INTEL_GEMM_K:
        return (
            f"{kernel}: expected d <= {INTEL_GEMM_K} (MKL's {name} GEMM on an Intel CPU "
            f"as measured), got d = {d}"
        )
    return None


def _kernel_unmodelled(kernel: str):
    """``Kernel.unmodelled`` of ``kernel``: the limits that hold for every shape (the
    capability here; on an Intel CPU the features MKL's measured GEMMs need), the
    shape's own being :func:`unmodelled_here`'s."""

    def unmodelled(fmt=None, *, cpu_capability: str | None = None, **options) -> str | None:
        del options
        cap = capability() if cpu_capability is None else cpu_capability
        if cap not in CAPABILITIES:
            return (
                f"{kernel}: ATen's {cap} kernels (this CPU: {cpu.describe()}) are not "
                f"modelled; modelled: the {', '.join(CAPABILITIES)} builds"
            )
        if kernel != "torch-flash" or cpu.vendor() != "GenuineIntel" or not _here(cpu_capability):
            return None
        names = ["bfloat16", "float16"] if fmt is None else [get_format(fmt).name]
        needs = {"bfloat16": "amx_bf16", "float16": "avx512f"}
        lacking = [name for name in names if needs[name] not in cpu.flags()]
        if not lacking:
            return None
        return (
            f"{kernel}: {', '.join(lacking)} on an Intel CPU without "
            f"{', '.join(needs[name] for name in lacking)} ({cpu.describe()}): MKL's GEMMs "
            "there are not modelled; modelled on Intel CPUs: bf16 with AMX-BF16, fp16 "
            "with AVX-512 (docs/kernels.md)"
        )

    return unmodelled


def _refuse_unmodelled(
    cpu_capability: str | None, kernel: str, policy: Policy, q, k, causal
) -> None:
    """NotImplementedError with :func:`unmodelled_here`'s reason."""
    reason = unmodelled_here(
        kernel, policy.inputs, q.shape, k.shape, bool(causal), cpu_capability=cpu_capability
    )
    if reason:
        raise NotImplementedError(reason)


def _flash_variant(build: Build, here: bool, policy: Policy, q, k, causal) -> str:
    """The build's flash loop: its AMX loop where this CPU packs K and V for it, its
    loop with MKL's Intel GEMMs on an Intel CPU, else with the AMD CPUs'."""
    if not here:
        return build.variant
    if build.amx is not None and amx_packs(policy.inputs, q.shape, k.shape, bool(causal)):
        return build.amx
    return build.intel if cpu.vendor() == "GenuineIntel" else build.variant


def _here(cpu_capability: str | None) -> bool:
    """Whether a model is of this CPU's kernels: its capability (named or not) or a
    lower one ATen can be forced to (``ATEN_CPU_CAPABILITY``), whose kernels call
    the same BLAS; only then do this CPU's AMX and BLAS apply."""
    if cpu_capability is None:
        return True
    order = list(CAPABILITIES)
    here = capability()
    known = cpu_capability in order and here in order
    return known and order.index(cpu_capability) <= order.index(here)


def _modelled(cpu_capability: str | None, kernel: str) -> Build:
    """The build of the capability (the one here by default)."""
    cap = capability() if cpu_capability is None else cpu_capability
    if cpu_capability is None and cap not in CAPABILITIES:
        refuse(_kernel_unmodelled(kernel)())  # ATen's capability here has no model
    if cap not in CAPABILITIES:
        raise ValueError(
            f"{kernel} model: cpu_capability: expected one of {sorted(CAPABILITIES)} "
            f"(the builds modelled), got {cap!r}"
        )
    return CAPABILITIES[cap]


def math_model(fmt: Format, n: int, d: int, *, cpu_capability: str | None = None) -> KernelModel:
    """The model of ``torch-math`` in ``fmt`` (module docstring), for
    ``cpu_capability`` (the one here by default)."""
    del n, d
    build = _modelled(cpu_capability, "torch-math")
    policy = _stage_policy(
        fmt,
        "torch_math_cpu",
        p=FP32,
        accumulation=SEQUENTIAL,
        exp_model=build.softmax_exp,
        scale="q",
    )
    forward = functools.partial(_math_call, variant=build.variant, cpu_capability=cpu_capability)
    return KernelModel("torch-math", policy, "reference", forward=forward)


def _math_call(
    q,
    k,
    v,
    *,
    policy: Policy,
    variant: str,
    cpu_capability: str | None,
    causal,
    scale,
    bias=None,
    mask=None,
):
    _check_causal("torch-math", causal, {"bias": bias, "mask": mask})
    _refuse_unmodelled(cpu_capability, "torch-math", policy, q, k, causal)
    intel = _here(cpu_capability) and cpu.vendor() == "GenuineIntel"
    return _math_jit(
        q,
        k,
        v,
        policy=policy,
        variant=variant,
        intel=intel,
        causal=causal,
        scale=scale,
        bias=bias,
        mask=mask,
    )


def _math_forward(
    q, k, v, *, policy: Policy, variant: str, intel: bool, causal, scale, bias=None, mask=None
):
    """ATen's math SDPA on FP32 upcasts (module docstring), step by step, its GEMMs
    those of MKL on an AMD CPU or (``intel``) an Intel one; K and V
    repeated per group (``enable_gqa``: ``repeat_interleave``), the float attn_mask
    (``bias``, exact in the input format) added to the scaled scores in FP32
    (``attn.add_(attn_mask)``), a boolean one as -inf (``convert_boolean_attn_mask``),
    rows with no key kept 0 (``_safe_softmax``)."""
    fp32 = policy.scores
    q, k, v = (ops.cast(ops.carrier(t, np.float64), policy.inputs) for t in (q, k, v))
    groups = kv_groups("torch-math", q.shape, k.shape, v.shape)
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    root = round_to(jnp.float64(math.sqrt(scale)), fp32)  # a double sqrt, as a float scalar
    q, k = ops.mul(q, root, fp32), ops.mul(k, root, fp32)
    n, m = q.shape[-2], k.shape[-2]
    blocks = intel_sgemm_blocks if intel else gemm_k_blocks
    if intel and intel_takes_lanes(n, q.shape[-1]):
        s = ops.matmul(q, jnp.swapaxes(k, -1, -2), fp32, accumulation=MKL_INTEL_LANES)
    else:
        s = _gemm(jnp.zeros((*q.shape[:-1], m)), q, jnp.swapaxes(k, -1, -2), fp32, blocks)
    if causal:
        s = jnp.where(jnp.arange(m)[None, :] <= jnp.arange(n)[:, None], s, -jnp.inf)
    if bias is not None:
        s = add_bias(s, ops.carrier(bias, s.dtype), policy)  # exact: FP32 holds the bias
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    empty = row_max == -jnp.inf
    e = shifted_exp(s, jnp.where(empty, 0.0, row_max), policy)
    total = lane_sum(e, LANES[variant], policy.stats, accumulators=1, vector_tail=True)
    reciprocal = ops.div(jnp.ones_like(total), total, policy.stats)
    p = jnp.where(empty, 0.0, ops.mul(e, reciprocal[..., None], policy.p))
    o = _gemm(jnp.zeros((*p.shape[:-1], v.shape[-1])), p, v, policy.pv_acc, blocks)
    return ops.cast(o, policy.out)


def _gemm(c, a, b, fmt, k_blocks=gemm_k_blocks):
    """:func:`vector_loop.gemm_accumulate` (c + a @ b summed per inner block of
    ``k_blocks`` from 0, each block then added into c in order) as one batched
    matmul of the blocks,
    the narrower ones padded with zero products at their end (a sum from 0 never
    holds -0, so adding 0 changes no bit), and a loop adding their sums: the same
    operations, in a program whose size does not grow with the number of blocks (11
    at 2048 keys)."""
    blocks = k_blocks(a.shape[-1])
    if len(blocks) == 1:
        return gemm_accumulate(c, a, b, fmt, k_blocks)
    width = max(hi - lo for lo, hi in blocks)

    def padded(x, axis, lo, hi):
        x = jax.lax.slice_in_dim(x, lo, hi, axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - (hi - lo))
        return jnp.pad(x, pad)

    a_blocks = jnp.stack([padded(a, a.ndim - 1, lo, hi) for lo, hi in blocks])
    b_blocks = jnp.stack([padded(b, b.ndim - 2, lo, hi) for lo, hi in blocks])
    sums = ops.matmul(a_blocks, b_blocks, fmt, accumulation="sequential")  # (blocks, ..., n, m)

    def add(total, block_sum):
        return ops.add(total, block_sum, fmt), None

    return jax.lax.scan(add, jnp.broadcast_to(c, sums.shape[1:]), sums)[0]


_math_jit = jax.jit(
    _math_forward, static_argnames=("policy", "variant", "intel", "causal", "scale")
)


def _could_pack(fmt: Format) -> bool:
    """``cpublas::could_pack``: whether this CPU has AMX for ``fmt`` (AMX tiles for
    bf16, AMX-FP16 for fp16), as PyTorch reads it."""
    import torch

    probe = {"bfloat16": "_is_amx_tile_supported", "float16": "_is_amx_fp16_supported"}
    name = probe.get(get_format(fmt).name)
    return name is not None and bool(getattr(torch.cpu, name, lambda: False)())


def amx_packs(
    fmt: Format,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    causal: bool,
    *,
    threads: int | None = None,
    could_pack: bool | None = None,
) -> bool:
    """Whether ``torch-flash`` packs K and V for AMX here (``need_pack`` in ATen's
    ``cpu_flash_attention``): where the CPU could pack (``could_pack``, this one's
    by default) and N and M are at least 64 (bf16) or 16 (fp16), when each of the
    ``threads`` threads' GEMM work, ⌈B·H·⌈N/Br⌉ / threads⌉ · Br · M' · d with
    M' = min(N, M) if causal else M, is at least 4 (bf16) or 1 (fp16) times the
    packing's, B·H_kv·M·d.  ``threads`` is PyTorch's (``torch.get_num_threads()``)
    by default."""
    fmt = get_format(fmt)
    if could_pack is None:
        could_pack = _could_pack(fmt)
    bf16 = fmt.name == "bfloat16"
    *lead, n, d = (int(x) for x in q_shape)
    m, h_kv = int(k_shape[-2]), int(k_shape[-3]) if len(k_shape) > 2 else 1
    threshold = 64 if bf16 else 16
    if not could_pack or n < threshold or m < threshold:
        return False
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    b, h = math.prod(lead[:-1]), (lead[-1] if lead else 1)
    split = query_block(n)
    per_thread = (b * h * -(-n // split) + threads - 1) // threads
    gemm = float(per_thread) * split * (min(n, m) if causal else m) * d
    return gemm / float(b * h_kv * m * d) >= (4 if bf16 else 1)


def flash_blocks(n: int, m: int) -> Blocks:
    """The kernel's tiles for N queries and M keys: 256/64/32 query rows (N >= 768,
    >= 192, else) and min(512, M) key columns."""
    return Blocks(query_split(n), min(512, m))


def flash_model(fmt: Format, n: int, d: int, *, cpu_capability: str | None = None) -> KernelModel:
    """The model of ``torch-flash`` in ``fmt`` for N = M = ``n`` (module docstring),
    for ``cpu_capability`` (the one here by default)."""
    del d
    build = _modelled(cpu_capability, "torch-flash")
    policy = _stage_policy(
        fmt,
        "torch_flash_cpu",
        accumulation=SEQUENTIAL,
        exp_model=build.flash_exp,
        normalise="reciprocal",
    )
    blocks = flash_blocks(n, n)
    # The AMX path and the BLAS are this host's: a model of a build above this CPU's
    # (the one another machine runs) has neither.
    forward = functools.partial(_flash_forward, build=build, cpu_capability=cpu_capability)
    return KernelModel("torch-flash", policy, "flash", blocks, forward=forward)


def _flash_forward(
    q, k, v, *, policy: Policy, build: Build, cpu_capability: str | None, causal, scale, **features
):
    """The kernel's loop (a flash_attention variant outside fa_jax.attention.VARIANTS;
    its AMX loop where this CPU packs K and V for it), with its tiles for the
    inputs' N and M (``blocks`` of the KernelModel are those for M = N); ``bias``
    and ``mask`` as the attn_mask the kernel adds to its scaled scores (in one FMA
    where the build fuses a · b + c: ``_scale_attn_mask_fusion_kernel``'s
    ``a * scale + mask``, contracted by the compiler), K/V with fewer heads as
    ``enable_gqa`` reads them."""
    _check_causal("torch-flash", causal, features)
    _refuse_unmodelled(cpu_capability, "torch-flash", policy, q, k, causal)
    blocks = flash_blocks(q.shape[-2], k.shape[-2])
    variant = _flash_variant(build, _here(cpu_capability), policy, q, k, causal)
    out = flash_attention(
        q, k, v, policy, blocks, variant=variant, causal=causal, scale=scale, **features
    )
    return out[0]  # pyright: ignore[reportIndexIssue]  (custom_vjp erases the (O, lse) type)


TORCH_MATH = Kernel(
    name="torch-math",
    description=(
        "PyTorch scaled_dot_product_attention, SDPBackend.MATH, CPU "
        "(aten/src/ATen/native/transformers/attention.cpp)"
    ),
    real=real_math,
    model=math_model,
    unavailable=_unavailable,
    platform=platform,
    features=frozenset({"bias", "mask", "gqa"}),
    unmodelled=_kernel_unmodelled("torch-math"),
)

TORCH_FLASH = Kernel(
    name="torch-flash",
    description=(
        "PyTorch scaled_dot_product_attention, SDPBackend.FLASH_ATTENTION, CPU "
        "(aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)"
    ),
    real=real_flash,
    model=flash_model,
    unavailable=_unavailable,
    platform=platform,
    features=frozenset({"bias", "mask", "gqa"}),
    unmodelled=_kernel_unmodelled("torch-flash"),
)
