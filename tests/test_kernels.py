"""The kernel registry: lookup, errors, lazy PyTorch import, the model's checks."""

import subprocess
import sys

import numpy as np
import pytest
from helpers import x64_enabled

import fa_jax
from fa_jax import kernels
from fa_jax.attention import Blocks
from fa_jax.kernels.model import Kernel, KernelModel

BUILTINS = (
    "cudnn",
    "torch-cuda-flash",
    "torch-cuda-mem-efficient",
    "torch-flash",
    "torch-math",
    "xla",
)


def _inputs(shape=(1, 2, 8, 4), fmt=fa_jax.BF16, seed=0):
    rng = np.random.default_rng(seed)
    with x64_enabled():
        return [np.asarray(fa_jax.round_to(rng.standard_normal(shape), fmt)) for _ in range(3)]


def test_names_list_every_builtin():
    assert set(BUILTINS) <= set(kernels.names())


def test_unknown_name_lists_the_known():
    with pytest.raises(ValueError, match=r"unknown kernel 'nope'.*xla"):
        kernels.get("nope")


def test_gpu_kernels_unavailable_here_say_why():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        kernels.get("cudnn")
    assert "cudnn" not in kernels.available()
    assert "xla" in kernels.available()


def test_format_not_native_is_refused():
    q, k, v = _inputs(fmt=fa_jax.E4M3)
    with pytest.raises(ValueError, match=r"runs natively.*bf16.*got 'float8_e4m3'"):
        kernels.real("xla", q, k, v, fmt="e4m3")


def test_bad_shapes_and_inexact_values_are_refused():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"expected q \(\.\.\., N, d\)"):
        kernels.real("xla", q, k[..., :3], v, fmt="bf16")
    with pytest.raises(ValueError, match="causal: expected N == M, or q_offset naming"):
        kernels.real("xla", q, k[..., :5, :], v[..., :5, :], fmt="bf16", causal=True)
    with pytest.raises(ValueError, match="exact in bfloat16"):
        kernels.real("xla", q + 1e-3, k, v, fmt="bf16")


def test_model_checks_its_arguments():
    policy = fa_jax.fa2_kernel("bf16")
    with pytest.raises(ValueError, match="algorithm"):
        KernelModel("x", policy, "tiled")
    with pytest.raises(ValueError, match="needs Blocks"):
        KernelModel("x", policy, "flash")
    with pytest.raises(ValueError, match="belong to the flash"):
        KernelModel("x", policy, "reference", Blocks(4, 4))
    with pytest.raises(ValueError, match="n: expected a positive integer"):
        kernels.model("xla", "bf16", 0, 64)


def test_register_and_emulate_a_kernel():
    def model(fmt, n, d):
        return KernelModel("ref", fa_jax.fa2_kernel(fmt), "flash", Blocks(4, 4), "fa2")

    kernel = Kernel(
        name="test-ref",
        description="fa_jax's own reference",
        real=lambda q, k, v, *, fmt, causal=False, scale=None: KernelModel(
            "ref", fa_jax.fa2_kernel(fmt), "reference"
        )(q, k, v, causal=causal, scale=scale),
        model=model,
        unavailable=lambda: None,
        platform=lambda: {},
    )
    kernels.register(kernel)
    assert kernels.get("test-ref") is kernel
    q, k, v = _inputs()
    real = kernels.real("test-ref", q, k, v, fmt="bf16", causal=True)
    emulated = kernels.emulate("test-ref", q, k, v, fmt="bf16", causal=True)
    assert real.dtype == emulated.dtype == np.float64 and real.shape == q.shape
    with pytest.raises(TypeError, match=r"expected a fa_jax\.kernels\.Kernel"):
        kernels.register("test-ref")  # pyright: ignore[reportArgumentType]


def test_q_offset_reaches_a_kernel_that_declares_it():
    """Queries behind a KV cache: ``q_offset="bottom-right"`` reaches a kernel with
    the feature as the int M - N (here a kernel whose real side masks by absolute
    position, and whose model is the core's aligned causal mask: the same bits);
    "top-left" is no feature at all; a kernel without it refuses causal N != M
    under either alignment (its model was checked on square masks only)."""

    def real(q, k, v, *, fmt, causal=False, scale=None, q_offset=0):
        p, j = np.arange(q.shape[-2])[:, None] + q_offset, np.arange(k.shape[-2])[None, :]
        mask = j <= p if causal else None
        return KernelModel("ref", fa_jax.fa2_kernel(fmt), "reference")(
            q, k, v, scale=scale, mask=mask
        )

    kernels.register(
        Kernel(
            name="test-positions",
            description="masks by absolute position",
            real=real,
            model=lambda fmt, n, d: KernelModel("ref", fa_jax.fa2_kernel(fmt), "reference"),
            unavailable=lambda: None,
            platform=lambda: {},
            features=frozenset({"q_offset"}),
        )
    )
    q, k, v = _inputs()
    q = q[..., :3, :]  # 3 queries after 5 cached keys
    got = {
        how: (
            kernels.real("test-positions", q, k, v, fmt="bf16", causal=True, q_offset=how),
            kernels.emulate("test-positions", q, k, v, fmt="bf16", causal=True, q_offset=how),
        )
        for how in ("bottom-right", "top-left")
    }
    for real_out, model_out in got.values():
        np.testing.assert_array_equal(real_out, model_out)
    assert not np.array_equal(got["bottom-right"][0], got["top-left"][0])
    with pytest.raises(ValueError, match=r"'xla': causal: expected N == M .* declares no q_offset"):
        kernels.emulate("xla", q, k, v, fmt="bf16", causal=True, q_offset="bottom-right")
    with pytest.raises(ValueError, match=r"'xla': causal: expected N == M .* declares no q_offset"):
        kernels.real("xla", q, k, v, fmt="bf16", causal=True, q_offset="top-left")
    with pytest.raises(ValueError, match="'test-positions': softcap: not supported"):
        kernels.emulate("test-positions", q, k, v, fmt="bf16", softcap=30.0)
    with pytest.raises(ValueError, match=r"kernel: softcap: expected a finite number > 0, got -1"):
        kernels.emulate("test-positions", q, k, v, fmt="bf16", softcap=-1)
    with pytest.raises(ValueError, match="'test-positions': sinks: not supported"):
        kernels.emulate("test-positions", q, k, v, fmt="bf16", sinks=np.zeros(2))
    with pytest.raises(ValueError, match=r"kernel: sinks: expected floats broadcastable"):
        kernels.emulate("test-positions", q, k, v, fmt="bf16", sinks=np.zeros(3))
    with pytest.raises(ValueError, match=r"kernel: sinks: expected values exact in float32"):
        kernels.emulate("test-positions", q, k, v, fmt="bf16", sinks=np.full(2, 0.1))


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # importing torch now fails
import fa_jax.kernels as k
try:
    k.model("xla", "bf16", 8, 4)
except NotImplementedError:
    pass  # XLA's code on this CPU is not modelled: the import is what is checked
for name in ("torch-math", "torch-cuda-flash"):
    try:
        k.get(name)
    except (RuntimeError, ImportError) as e:
        print(name, e)
print("torch" in sys.modules and sys.modules["torch"] is not None)
"""


def test_importing_kernels_does_not_import_torch():
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[-1] == "False"
    assert "torch-cuda-flash PyTorch is not installed" in out.replace(
        "kernel 'torch-cuda-flash' is not available here: ", ""
    )


def test_reveal_order_is_resolved_lazily():
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kernels.nothing  # pyright: ignore[reportAttributeAccessIssue]  # noqa: B018
