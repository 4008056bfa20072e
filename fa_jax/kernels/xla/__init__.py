"""XLA's attention on the CPU: ``jax.nn.dot_product_attention(..., implementation="xla")``.

The real kernel runs natively in bf16, fp16 and fp32 (fp16 eagerly, op by op:
XLA's CPU backend refuses the F16_F16_F32 dot under jit).  What it computes
(``_dot_product_attention_core`` in jax/_src/nn/functions.py), as XLA's CPU
backend runs it (the optimised HLO, the rest found by experiment)::

    S = fl32(Q Kᵀ)              products exact for bf16/fp16, FMAs for fp32
    S = fl32(S · fl32(scale))   the scale rounded to float32; in XLA's own loop
                                fusions fused (an FMA) into the next + or -
    masked S := fl32(-0.7 · FLT_MAX)                      (not -inf)
    m = max S;  e = exp32(fl32(S - m));  l = sum32(e)
    P = fl32(e · fl32(1 / l))   XLA rewrites the division as a reciprocal
    P = fl_in(P)                kept or dropped (read from the program)
    O = fl_in(fl32(P V))        V widened to float32, an FP32 dot

XLA hands the dots, reductions and element-wise steps to YNNPACK fusions (or
keeps them in loop fusions, or runs a dot as its own); their orders and which
runs where are read from the program this host compiles.  One concept a module,
each importing only those above it:

* :mod:`~fa_jax.kernels.xla.calls`: running XLA's attention for real (jax's
  call, jitted or eager; the 4-D call of features,
  :class:`~fa_jax.kernels.xla.calls.Layout`);
* :mod:`~fa_jax.kernels.xla.exp`: XLA CPU's own float32 exp (:func:`xla_cpu_exp`);
* :mod:`~fa_jax.kernels.xla.own_dots`: the dots XLA runs as its own (its GEMV,
  Eigen's contraction sharded over the keys);
* :mod:`~fa_jax.kernels.xla.orders`: the summation orders of YNNPACK's dots and
  softmax sum, the model's numerics, and the CPU code (:class:`VectorCode`:
  AVX-512, AVX2);
* :mod:`~fa_jax.kernels.xla.hlo`: reading the optimised HLO (fusions, P's
  rounding, which exp, the sum's windows, the FMA steps, XLA's own dots);
* :mod:`~fa_jax.kernels.xla.probes`: the order probes (FPRev-style) that read
  the dots' orders and blocks from the real program;
* :mod:`~fa_jax.kernels.xla.forward`: the model's forward pass from the above;
* this module: which CPU code is modelled (:func:`unmodelled`,
  :func:`vector_code`), :func:`model`, :func:`platform` and the :data:`XLA`
  kernel, and the public names of the modules above.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform as _platform
import re

import jax

from fa_jax._checks import one_of
from fa_jax.formats import Format, get_format
from fa_jax.kernels.model import Kernel, KernelModel, refuse
from fa_jax.kernels.x86 import cpu
from fa_jax.kernels.xla import forward, orders
from fa_jax.kernels.xla.calls import real
from fa_jax.kernels.xla.exp import XLA_CPU_EXP, xla_cpu_exp, xla_cpu_exp_model
from fa_jax.kernels.xla.orders import AVX2, AVX512, VectorCode

__all__ = [
    "AVX2",
    "AVX512",
    "XLA",
    "XLA_CPU_EXP",
    "VectorCode",
    "model",
    "platform",
    "real",
    "unmodelled",
    "vector_code",
    "xla_cpu_exp",
    "xla_cpu_exp_model",
]


# --xla_cpu_max_isa's values (xla/backends/cpu/codegen/cpu_features.cc), narrowest
# first: a cap below AVX512 keeps XLA from the code modelled, below AVX512_BF16
# from bf16's pair instruction.
_MAX_ISAS = ("SSE4_2", "AVX", "AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX", "AMX_FP16")


def _max_isa() -> str | None:
    """The ``--xla_cpu_max_isa`` in ``XLA_FLAGS`` (upper case), or None."""
    import os

    found = re.findall(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return found[-1].upper() if found else None


def unmodelled(fmt=None, **options) -> str | None:
    """None where XLA's CPU backend here runs the code the model follows for ``fmt``
    (every format where None), else why not.  XLA targets the features CPUID reports,
    capped by ``--xla_cpu_max_isa`` (xla/backends/cpu/codegen/cpu_features.cc,
    ``ShouldEnableX86CpuFeature``); YNNPACK picks its kernels by the CPU's own
    features, which no flag caps (ynnpack/base/arch.cc, ``get_supported_arch_flags``:
    cpuinfo; XLA creates its runtimes with no flags).  The model follows their
    AVX-512 code (bf16 with AVX512-BF16's pairs or AMX's tile dots), as measured on
    an AMD EPYC and an Intel Xeon with AMX, and their AVX2 code (AVX2, FMA and
    F16C), as measured on an AVX2-only AMD EPYC; only on the CPU backend.  An
    AVX-512 CPU capped below AVX512 runs neither (XLA's own code for AVX2 beside
    YNNPACK's AVX-512 kernels), nor does a cap below AVX2 (no FMA in XLA's code)."""
    del options
    backend = jax.default_backend()
    if backend != "cpu":
        return f"xla: the model is of XLA's CPU backend; jax's default backend is {backend!r}"
    have = cpu.flags()
    cap = _max_isa()
    rank = _MAX_ISAS.index(cap) if cap in _MAX_ISAS else len(_MAX_ISAS)
    modelled = (
        "modelled: AVX-512 (F, BW, DQ, VL; bf16 with AVX512-BF16 or AMX-BF16) and "
        "AVX2 (with FMA and F16C, no AVX-512; every format), uncapped by "
        "--xla_cpu_max_isa below the CPU's class"
    )
    here = cpu.describe() + (f", --xla_cpu_max_isa={cap}" if cap else "")
    if cpu.isa() == "AVX2":
        if rank < _MAX_ISAS.index("AVX2"):
            return (
                f"xla: XLA's own code on this CPU ({here}) is capped below AVX2 (no FMA), "
                f"which is not modelled; {modelled}"
            )
        return None
    if cpu.isa() != "AVX512":
        return (
            f"xla: XLA and YNNPACK on this CPU ({here}) run code below AVX2 "
            f"(SSE kernels, no FMA), which is not modelled; {modelled}"
        )
    if rank < _MAX_ISAS.index("AVX512"):
        return (
            f"xla: on this CPU ({here}) XLA's own code is capped below AVX-512 while "
            f"YNNPACK still runs its AVX-512 kernels (no flag caps them), a mix that "
            f"is not modelled; {modelled}"
        )
    bf16 = fmt is None or get_format(fmt).name == "bfloat16"
    if bf16 and (not {"avx512_bf16", "amx_bf16"} & have or rank < _MAX_ISAS.index("AVX512_BF16")):
        return (
            f"xla: bf16 on this CPU ({here}) runs its dots without AVX512-BF16 or AMX, "
            f"which is not modelled; {modelled}"
        )
    return None


def vector_code(fmt=None, isa: str | None = None) -> VectorCode:
    """The :class:`VectorCode` of ``isa`` ("AVX512" or "AVX2"), or (None) of the code
    XLA runs here, refusing where that is not modelled (:func:`unmodelled`)."""
    if isa is None:
        refuse(unmodelled(fmt))
        return orders.CODES[cpu.isa()]
    return orders.CODES[one_of(isa, tuple(orders.CODES), "xla: isa")]


def model(fmt: Format, n: int, d: int, *, isa: str | None = None) -> KernelModel:
    """fa_jax's model of XLA's attention in ``fmt`` (module docstring); ``algorithm``
    names the closest attention function, the reference.  The policy's exp is the
    one the jitted formats run on most shapes, YNNPACK's (XLA's own for fp16); the
    model swaps it for the other where XLA's program does.  ``isa`` ("AVX512" or
    "AVX2"): the model of that code (:class:`VectorCode`) on any host, without
    refusing; None: the code XLA runs here, NotImplementedError where it does not
    follow it (:func:`unmodelled`).  The dot orders, blocks and fusions are read
    from the program this host runs, so a model of another ISA's code than the
    host's is judged where that code runs (tests/lab.py's AVX2 lab)."""
    del n, d
    code = vector_code(fmt, isa)
    policy = forward.kernel_policy(fmt)
    return KernelModel(
        "xla", policy, "reference", forward=functools.partial(forward.forward, code=code)
    )


def _cpu() -> tuple[str, str]:
    """The CPU's model name and its vector features (Linux; empty elsewhere): what
    XLA's CPU backend targets, and YNNPACK picks its kernels by."""
    wanted = ("avx", "fma", "amx", "f16c", "sse4")
    vector = sorted(f for f in cpu.flags() if f.startswith(wanted))
    return cpu.cpuinfo().get("model name", ""), " ".join(vector)


def platform() -> dict[str, str]:
    """jax and jaxlib versions, the backend and device, the CPU XLA targets, and
    where the exp model comes from."""
    device = jax.devices()[0]
    cpu, features = _cpu()
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "machine": _platform.machine(),
        "processor": _platform.processor() or _platform.machine(),
        "cpu": cpu,
        "cpu_features": features,
        "exp_model": (
            "YNNPACK's float32 exp inside YNNPACK fusions (ynnpack_exp), "
            "XLA CPU's own elsewhere (xla_cpu_exp)"
        ),
    }


XLA = Kernel(
    name="xla",
    description=(
        "jax.nn.dot_product_attention(implementation='xla') on JAX's default backend "
        "(jax/_src/nn/functions.py)"
    ),
    real=real,
    model=model,
    unavailable=lambda: None,
    platform=platform,
    formats=("bf16", "fp16", "fp32"),
    features=frozenset({"bias", "mask", "window", "kv_lengths", "gqa"}),
    unmodelled=unmodelled,
)
