"""The kernels' features against the real kernels, bit for bit: an additive bias,
a boolean mask, K/V with fewer heads (GQA), decoding shapes (few queries, many
keys), and for XLA a local window and key lengths (fa_jax.kernels.registry).

PyTorch's kernels run for every CPU capability ATen builds them for on x86-64:
the one here in this process, a lower one in a subprocess started with
``ATEN_CPU_CAPABILITY`` set (skipped with the reason where this CPU cannot run
it).  Where a model is exact on a case's inputs the assertion is 100% identical."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from helpers import skip_unless_aten_runs, skip_unmodelled, x64_enabled

from fa_jax import BF16, FP16, FP32, kernels
from fa_jax.rounding import round_to
from fa_jax.score_mods import alibi_bias, alibi_slopes

FORMATS = {"bf16": BF16, "fp16": FP16, "fp32": FP32}
CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


@functools.cache
def case_inputs(fmt: str, shape: tuple, kv_heads: int, m: int, features: tuple, seed: int):
    """(q, k, v, features) for (B, H, N, d), H_kv K/V heads and M keys: standard
    normal inputs and a bias (normal · 2, or ALiBi's) rounded to ``fmt``, a mask
    keeping 80% of the pairs (with one query row that keeps none)."""
    b, h, n, d = shape
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    with x64_enabled():

        def rounded(x):
            return np.asarray(round_to(x, f), np.float64)

        q = rounded(rng.standard_normal((b, h, n, d)))
        k, v = (rounded(rng.standard_normal((b, kv_heads, m, d))) for _ in range(2))
        out = {}
        if "bias" in features:
            out["bias"] = rounded(2 * rng.standard_normal((b, h, n, m)))
        if "alibi" in features:
            out["bias"] = rounded(alibi_bias(alibi_slopes(h), n, m))
        if "mask" in features:
            mask = rng.random((b, 1, n, m)) < 0.8
            mask[..., n // 2, :] = False
            out["mask"] = mask
        if "window" in features:
            out["window"] = (5, 3)
        if "kv_lengths" in features:
            out["kv_lengths"] = np.array([[m], [m - m // 3]][:b])
    return q, k, v, out


# -- PyTorch --------------------------------------------------------------------

# The real kernels in a process whose ATen dispatches to one capability: reads
# inputs.npz (q, k, v, and bias/mask where given) and the call, writes out.npz.
_CHILD = """
import json, sys
import numpy as np, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
kernel, dtype = json.loads(sys.argv[2])
x = dict(np.load(sys.argv[1] + "/inputs.npz"))
dt = getattr(torch, dtype)
q, k, v = (torch.from_numpy(x[t]).to(dt) for t in "qkv")
shape = (*q.shape[:-1], k.shape[-2])
mask = None
if "bias" in x:
    b = np.broadcast_to(x["bias"], shape)
    if "mask" in x:
        b = np.where(np.broadcast_to(x["mask"], shape), b, -np.inf)
    mask = torch.from_numpy(np.ascontiguousarray(b, np.float32)).to(dt)
elif "mask" in x:
    mask = torch.from_numpy(np.array(np.broadcast_to(x["mask"], shape)))
backend = SDPBackend.MATH if kernel == "torch-math" else SDPBackend.FLASH_ATTENTION
with sdpa_kernel(backend), torch.no_grad():
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=k.shape[-3] != q.shape[-3])
np.savez(sys.argv[1] + "/out.npz", o=o.to(torch.float64).numpy(),
         capability=np.array(str(torch.backends.cpu.get_cpu_capability())))
"""
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def torch_real(capability: str, kernel: str, fmt: str, q, k, v, features: dict) -> np.ndarray:
    """The real kernel's output under ``capability``: here through the registry if
    it is this process's, else in a subprocess with ATEN_CPU_CAPABILITY set; skips
    where this CPU cannot run that capability's kernels."""
    from fa_jax.kernels import torch_cpu

    if capability == torch_cpu.capability():
        return kernels.real(kernel, q, k, v, fmt=fmt, **features)
    skip_unless_aten_runs(capability)
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(os.path.join(tmp, "inputs.npz"), q=q, k=k, v=v, **features)
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
        call = json.dumps([kernel, _DTYPES[fmt]])
        subprocess.run([sys.executable, "-c", _CHILD, tmp, call], env=env, check=True)
        with np.load(os.path.join(tmp, "out.npz")) as out:
            ran = str(out["capability"])
            if ran != capability:
                pytest.skip(
                    f"this CPU cannot run ATen's {capability} kernels "
                    f"(ATEN_CPU_CAPABILITY={capability.lower()} gave {ran})"
                )
            return out["o"]


def torch_emulated(capability: str, kernel: str, fmt: str, q, k, v, features: dict):
    """The model of ``capability``'s build, called as the registry calls it."""
    from fa_jax.kernels import torch_cpu

    factory = {"torch-math": torch_cpu.math_model, "torch-flash": torch_cpu.flash_model}[kernel]
    model = factory(FORMATS[fmt], q.shape[-2], q.shape[-1], cpu_capability=capability)
    return model(q, k, v, **features)


# (kernel, format, (B, H, N, d), H_kv, M, features, seed).  First tier: small,
# odd lengths, every feature of the kernel at once.
TORCH_DEFAULT = (
    ("torch-flash", "bf16", (1, 4, 19, 24), 2, 37, ("bias", "mask"), 0),
    ("torch-math", "fp16", (1, 4, 19, 24), 1, 37, ("bias", "mask"), 0),
)
# CI's extended stage runs these two; every capability runs in -m slow.
# Slow tier: d = 80 and 96, GQA ratios 2 to 8, several flash key blocks, decoding
# shapes (1 and 16 queries against up to 2048 keys), ALiBi.
TORCH_SLOW = tuple(
    (kernel, fmt, shape, kv, m, features, 1)
    for kernel in ("torch-flash", "torch-math")
    for fmt, shape, kv, m, features in (
        ("bf16", (1, 8, 67, 80), 1, 67, ("bias",)),
        ("fp16", (2, 4, 33, 96), 2, 555, ("mask",)),
        ("bf16", (1, 8, 1, 64), 2, 2048, ()),
        ("fp16", (1, 4, 16, 128), 4, 1031, ("bias", "mask")),
        ("bf16", (1, 8, 64, 64), 8, 64, ("alibi",)),
    )
)


def _torch_check(capability: str, case: tuple):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    kernel, fmt, shape, kv_heads, m, features, seed = case
    q, k, v, extra = case_inputs(fmt, shape, kv_heads, m, features, seed)
    from fa_jax.kernels import torch_cpu

    reason = torch_cpu.unmodelled_here(
        kernel, fmt, q.shape, k.shape, False, cpu_capability=capability
    )
    if reason is not None:
        pytest.skip(f"{reason} (test_kernels_torch: test_unmodelled_here_follows_the_cpu)")
    real = torch_real(capability, kernel, fmt, q, k, v, extra)
    emulated = torch_emulated(capability, kernel, fmt, q, k, v, extra)
    assert real.shape == emulated.shape == q.shape
    comparison = kernels.compare(real, emulated, real, fmt)
    assert comparison.identical_share == 1.0, f"{capability} {case}: {comparison.summary()}"


def _here() -> str:
    torch_cpu = pytest.importorskip("fa_jax.kernels.torch_cpu")
    pytest.importorskip("torch", reason="PyTorch is not installed")
    return torch_cpu.capability()


@pytest.mark.extended  # 10 to 16 s each
@pytest.mark.parametrize("index", range(len(TORCH_DEFAULT)))
def test_torch_features_bit_identical(index):
    _torch_check(_here(), TORCH_DEFAULT[index])


@pytest.mark.slow
@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("index", range(len(TORCH_DEFAULT)))
def test_torch_features_bit_identical_other_builds(capability, index):
    _torch_check(capability, TORCH_DEFAULT[index])


# Measured gaps (none left at these cases): (case index, capability) -> reason.
_GAPS: dict[tuple[int, str], str] = {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("capability", "index"),
    [
        pytest.param(
            c,
            i,
            marks=[pytest.mark.xfail(strict=True, reason=_GAPS[i, c])] if (i, c) in _GAPS else [],
        )
        for i in range(len(TORCH_SLOW))
        for c in CAPABILITIES
    ],
)
def test_torch_features_bit_identical_slow(capability, index):
    _torch_check(capability, TORCH_SLOW[index])


# -- XLA ------------------------------------------------------------------------

# (format, (B, H, N, d), H_kv, M, features, causal, seed).  Default tier: one small
# case with every feature (the probes and compiles of each new shape cost seconds).
XLA_DEFAULT = (("bf16", (2, 4, 5, 4), 2, 6, ("bias", "mask", "window", "kv_lengths"), False, 0),)
# Slow tier: GQA ratios 2 to 8, d = 80 and 96, odd lengths, decoding shapes (1 and
# 16 queries against up to 2048 keys), every format where the model holds.
XLA_SLOW = (
    ("bf16", (2, 8, 33, 80), 2, 33, (), False, 1),
    ("bf16", (1, 4, 50, 96), 2, 50, ("bias", "mask"), False, 1),
    ("fp16", (1, 4, 50, 96), 2, 50, ("bias", "mask"), False, 1),
    ("bf16", (1, 8, 64, 64), 1, 64, ("alibi", "window"), True, 1),
    ("bf16", (1, 4, 1, 64), 1, 1000, (), False, 1),
    ("bf16", (1, 4, 16, 64), 2, 700, ("bias", "mask"), False, 1),
    ("bf16", (2, 2, 600, 64), 2, 600, ("bias", "window", "kv_lengths"), False, 1),
    ("bf16", (1, 8, 16, 64), 8, 2048, ("kv_lengths",), False, 1),
)


def _xla_check(case: tuple):
    fmt, shape, kv_heads, m, features, causal, seed = case
    skip_unmodelled("xla", fmt)
    q, k, v, extra = case_inputs(fmt, shape, kv_heads, m, features, seed)
    real = kernels.real("xla", q, k, v, fmt=fmt, causal=causal, **extra)
    emulated = kernels.emulate("xla", q, k, v, fmt=fmt, causal=causal, **extra)
    assert real.shape == emulated.shape == q.shape
    comparison = kernels.compare(real, emulated, real, fmt)
    assert comparison.identical_share == 1.0, f"{case}: {comparison.summary()}"
    if "mask" in features:
        # jax masks with a large negative, not -inf: the row that keeps no key
        # weighs every key alike (fa_jax's reference gives 0 there)
        assert np.abs(real[..., shape[2] // 2, :]).max() > 0


@pytest.mark.extended  # 10 to 15 s of CPU
@pytest.mark.parametrize("index", range(len(XLA_DEFAULT)))
def test_xla_features_bit_identical(index):
    _xla_check(XLA_DEFAULT[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(XLA_SLOW)))
def test_xla_features_bit_identical_slow(index):
    _xla_check(XLA_SLOW[index])


# -- the registry ------------------------------------------------------------------


def test_unsupported_features_and_bad_values_are_refused():
    q, k, v, extra = case_inputs("bf16", (1, 4, 5, 16), 2, 7, ("bias", "mask"), 0)
    with pytest.raises(ValueError, match=r"'torch-flash': window: not supported.*bias.*gqa"):
        kernels.emulate("torch-flash", q, k, v, fmt="bf16", window=(2, 2))
    with pytest.raises(ValueError, match=r"'cudnn': gqa: not supported"):
        kernels.emulate("cudnn", q, k, v, fmt="bf16")
    with pytest.raises(ValueError, match="bias: expected values exact in bfloat16"):
        kernels.emulate("xla", q, k, v, fmt="bf16", bias=extra["bias"] + 1e-3)
    with pytest.raises(ValueError, match="mask: expected a boolean array"):
        kernels.emulate("xla", q, k, v, fmt="bf16", mask=extra["mask"].astype(float))
    with pytest.raises(ValueError, match=r"bias: expected an array broadcastable"):
        kernels.emulate("xla", q, k, v, fmt="bf16", bias=extra["bias"][..., :3])
    with pytest.raises(ValueError, match=r"kv_lengths: expected integers in \[0, M = 7\]"):
        kernels.emulate("xla", q, k, v, fmt="bf16", kv_lengths=np.array([8]))
    with pytest.raises(ValueError, match=r"window: expected \(left, right\)"):
        kernels.emulate("xla", q, k, v, fmt="bf16", window=(2,))
    three = np.concatenate([k, k[:, :1]], axis=1)  # 3 K/V heads for 4 query heads
    with pytest.raises(ValueError, match=r"H_kv heads .* divides"):
        kernels.emulate("xla", q, three, three, fmt="bf16")
    with pytest.raises(ValueError, match=r"'xla': unknown option 'kv_type'"):
        kernels.emulate("xla", q, k, v, fmt="bf16", kv_type="q8_0")
    q, k, v, extra = case_inputs("bf16", (1, 4, 5, 16), 2, 5, ("mask",), 0)
    with pytest.raises(ValueError, match="causal: expected no bias or mask"):
        kernels.emulate("torch-math", q, k, v, fmt="bf16", causal=True, mask=extra["mask"])


def test_a_kernel_gets_its_features_and_options():
    """A registered kernel declares features and options; the registry passes them
    (and only those given), checked: features and options to its real function,
    the options to its model's construction and the features to the model's call."""
    from fa_jax import fa2_kernel
    from fa_jax.kernels import Kernel, KernelModel

    seen = []

    def forward(q, k, v, *, policy, causal, scale, **given):
        seen.append(sorted(given))
        return np.zeros(q.shape)

    def real(q, k, v, *, fmt, causal=False, scale=None, **given):
        seen.append(sorted(given))
        return np.zeros(q.shape)

    kernel = Kernel(
        name="test-features",
        description="records what it gets",
        real=real,
        model=lambda fmt, n, d, **options: (
            seen.append(sorted(options))
            or KernelModel("t", fa2_kernel(fmt), "reference", forward=forward)
        ),
        unavailable=lambda: None,
        platform=lambda: {},
        features=frozenset({"mask", "gqa"}),
        options=("kv_type",),
    )
    kernels.register(kernel)
    q, k, v, extra = case_inputs("bf16", (1, 4, 5, 16), 1, 7, ("mask",), 0)
    kernels.real("test-features", q, k, v, fmt="bf16")
    kernels.emulate("test-features", q, k, v, fmt="bf16", mask=extra["mask"], kv_type="q8_0")
    assert seen == [[], ["kv_type"], ["mask"]]
    with pytest.raises(ValueError, match=r"'test-features': bias: not supported.*gqa.*mask"):
        kernels.real("test-features", q, k, v, fmt="bf16", bias=np.zeros((5, 7)))
    with pytest.raises(ValueError, match=r"features: expected names among"):
        Kernel("bad", "", real, kernel.model, lambda: None, dict, features=frozenset({"alibi"}))
    with pytest.raises(ValueError, match="options: expected names other than"):
        Kernel("bad", "", real, kernel.model, lambda: None, dict, options=("bias",))


# -- fa-jax validate ----------------------------------------------------------------


def test_validate_flags_become_features():
    from fa_jax import cli
    from fa_jax.studies.commands import validation_features
    from fa_jax.studies.validation import Features, Shape

    args = cli.build_parser().parse_args(
        "validate --kernel xla --kv-heads 2 --q-len 3 --bias alibi --mask random "
        "--window 4,-1 --kv-len 7".split()
    )
    assert validation_features(args) == Features(2, 3, "alibi", "random", (4, -1), 7)
    args = cli.build_parser().parse_args("validate --kernel xla".split())
    assert validation_features(args) == Features()
    bad = cli.build_parser().parse_args("validate --kernel xla --window 4".split())
    with pytest.raises(ValueError, match="--window: expected L,R"):
        validation_features(bad)
    with pytest.raises(ValueError, match="kv_heads: expected a divisor of H = 4"):
        Features(kv_heads=3).check(Shape(heads=4))
    with pytest.raises(ValueError, match=r"Features\.bias"):
        Features(bias="sine")


@pytest.mark.slow  # 9 s: the torch-math model's compile
def test_validate_with_features_reports_them():
    pytest.importorskip("torch", reason="PyTorch is not installed")
    from fa_jax.studies.validation import Features, Shape, format_validation, validate

    # 4 query rows: past MKL's small-matrix path, which the models refuse on Intel
    features = Features(kv_heads=1, q_len=4, bias="alibi", mask="random")
    v = validate("torch-math", "bf16", shape=Shape(1, 2, 20, 8), presets=(), features=features)
    assert v.rows[0][1].identical_share == 1.0 and v.rows[0][1].elements == 1 * 2 * 4 * 8
    assert v.to_dict()["features"] == {"kv_heads": 1, "q_len": 4, "bias": "alibi", "mask": "random"}
    text = format_validation(v)
    assert "features: kv_heads=1, q_len=4, bias=alibi, mask=random" in text
    assert "torch-math model [kv_heads=1" in text
