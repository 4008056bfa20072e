"""No silent answers: each CPU kernel's model states the code it follows
(``Kernel.unmodelled``) and raises NotImplementedError wherever the real kernel runs
other code, by the CPU (CPUID) or, for ggml, by the loaded build's features.

The verdicts are checked on every host with the CPU's features replaced by those
of the CPU classes in question (an AVX2-only CPU, AVX-512 without and with
AVX512-BF16, AMX); on this host, every model that refuses raises instead of
answering."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import x64_enabled

import fa_jax
from fa_jax import kernels
from fa_jax.kernels import ggml
from fa_jax.kernels.model import KernelModel
from fa_jax.kernels.registry import _lookup
from fa_jax.kernels.x86 import cpu

_SSE = frozenset({"sse", "sse2", "sse4_2"})
_AVX2 = _SSE | {"avx", "avx2", "fma", "f16c"}
_AVX512 = _AVX2 | cpu.AVX512
_ZEN4 = _AVX512 | {"avx512_bf16"}
_AMX = _ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}
CPUS = {"sse": _SSE, "avx2": _AVX2, "avx512": _AVX512, "zen4": _ZEN4, "amx": _AMX}

# (kernel, format, options) -> the CPUs whose code its model follows.
VERDICTS = [
    ("xla", "fp32", {}, {"avx2", "avx512", "zen4", "amx"}),
    ("xla", "fp16", {}, {"avx2", "avx512", "zen4", "amx"}),
    ("xla", "bf16", {}, {"avx2", "zen4", "amx"}),
    ("onnxruntime-attention", "fp32", {}, {"avx2", "avx512", "zen4", "amx"}),
    ("onnxruntime-attention", "fp16", {}, {"avx2", "avx512", "zen4", "amx"}),
    ("onnxruntime-mha", "fp32", {}, {"avx2", "avx512", "zen4", "amx"}),
    ("onnxruntime-gqa", "fp32", {}, {"avx2", "avx512", "zen4", "amx"}),
    ("onnxruntime-gqa", "fp16", {}, {"avx2", "avx512", "zen4", "amx"}),
    ("openvino-sdpa", "fp32", {"precision": "f32"}, {"avx2", "avx512", "zen4", "amx"}),
    ("openvino-sdpa", "bf16", {"precision": "bf16"}, {"avx2", "zen4", "amx"}),
]


def _verdict(monkeypatch, flags, name, fmt, options):
    monkeypatch.setattr(cpu, "flags", lambda: flags)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    return _lookup(name).unmodelled(fmt, **options)


@pytest.mark.parametrize(("name", "fmt", "options", "modelled"), VERDICTS)
def test_models_follow_the_cpus_they_name(monkeypatch, name, fmt, options, modelled):
    for label, flags in CPUS.items():
        reason = _verdict(monkeypatch, flags, name, fmt, options)
        assert (reason is None) == (label in modelled), (label, reason)
        if reason is not None:
            assert cpu.describe() in reason  # names this CPU's ISA
            assert "modelled" in reason  # and the code modelled
            with pytest.raises(NotImplementedError, match="not modelled"):
                _lookup(name).model(fa_jax.get_format(fmt), 8, 16, **options)
        else:
            model = _lookup(name).model(fa_jax.get_format(fmt), 8, 16, **options)
            assert isinstance(model, KernelModel)


@pytest.mark.parametrize(
    ("flags", "caps"),
    [
        # An AVX-512 CPU capped to AVX2 runs XLA's AVX2 code beside YNNPACK's
        # AVX-512 kernels (no flag caps YNNPACK): neither model's code.
        (_AMX, [("AVX2", set()), ("AVX512", {"fp32"}), ("AMX", {"fp32", "bf16"})]),
        # An AVX2 CPU: a cap at or above AVX2 changes nothing; below, no FMA.
        (_AVX2, [("AVX", set()), ("AVX2", {"fp32", "bf16"}), ("AMX", {"fp32", "bf16"})]),
    ],
)
def test_xla_refuses_a_capped_isa(monkeypatch, flags, caps):
    monkeypatch.setattr(cpu, "flags", lambda: flags)
    for cap, modelled in caps:
        monkeypatch.setenv(
            "XLA_FLAGS", f"--xla_cpu_multi_thread_eigen=false --xla_cpu_max_isa={cap}"
        )
        for fmt in ("fp32", "bf16"):
            reason = _lookup("xla").unmodelled(fmt)
            assert (reason is None) == (fmt in modelled), (cap, fmt, reason)
            assert reason is None or f"--xla_cpu_max_isa={cap}" in reason


_SHARED = frozenset({"avx", "avx2", "fma", "f16c", "sse3"})
BUILDS = {
    "sse": (frozenset({"sse3"}), ()),
    "avx2": (_SHARED, ggml.KV_TYPES),
    "avx2_without_fma": (_SHARED - {"fma"}, ()),  # GGML_F32x8_FMA is a mul and an add
    "avx512": (_SHARED | {"avx512"}, ("f32", "f16", "q8_0", "q4_0")),
    "avx512_bf16": (_SHARED | {"avx512", "avx512_bf16"}, ggml.KV_TYPES),
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_ggml_follows_the_loaded_builds_features(monkeypatch, build):
    """ggml's code is fixed when it is built: its features decide, K/V type by type
    (AVX2 builds with FMA and F16C are modelled; BF16 on AVX-512 needs AVX512-BF16)."""
    features, modelled = BUILDS[build]
    monkeypatch.setattr(ggml, "_build", lambda: features)
    fmt = {"f32": "fp32", "f16": "fp16", "bf16": "bf16", "q8_0": "fp32", "q4_0": "fp32"}
    for kv in ggml.KV_TYPES:
        reason = ggml.unmodelled(fmt[kv], kv_type=kv)
        assert (reason is None) == (kv in modelled), (kv, reason)
        if reason is not None:
            assert kv in reason and " ".join(sorted(features)) in reason
            with pytest.raises(NotImplementedError, match="does not follow"):
                ggml.model(fa_jax.get_format(fmt[kv]), 4, 8, kv_type=kv)
    assert (ggml.unmodelled() is None) == (set(modelled) == set(ggml.KV_TYPES))


def test_ggml_without_its_libraries_is_a_native_build_here(monkeypatch):
    """No libraries loaded: the build experiments/build_ggml.py makes for this CPU."""
    monkeypatch.setattr(ggml.ggml_lib, "library_dir", lambda: None)
    for flags, build in [(_AVX2, {"avx", "avx2", "fma", "f16c"}), (_ZEN4, None)]:
        monkeypatch.setattr(cpu, "flags", lambda flags=flags: flags)
        got = ggml._build()
        if build is not None:
            assert got == build
        else:
            assert {"avx512", "avx512_bf16"} <= got


_CPU_KERNELS = [
    "xla",
    "onnxruntime-attention",
    "onnxruntime-mha",
    "onnxruntime-gqa",
    "openvino-sdpa",
    "ggml",
]


@pytest.mark.parametrize("name", _CPU_KERNELS)
def test_models_here_answer_only_for_the_code_they_follow(name):
    """On this host: a model whose code does not run here raises, never answers."""
    kernel = _lookup(name)
    for fmt_name in kernel.formats:
        fmt = fa_jax.get_format(fmt_name)
        rng = np.random.default_rng(0)
        with x64_enabled():
            q, k, v = (
                np.asarray(fa_jax.round_to(rng.standard_normal((1, 4, 16)), fmt)) for _ in "qkv"
            )
        reason = kernel.unmodelled(fmt)
        if reason is None:
            continue  # answers: the real-kernel tests judge it
        with pytest.raises(NotImplementedError) as raised:
            kernels.emulate(name, q, k, v, fmt=fmt)
        assert str(raised.value) == reason


@pytest.mark.skipif(
    not cpu.AVX512 <= cpu.flags(), reason=f"a fact of AVX-512 CPUs; this one is {cpu.describe()}"
)
def test_an_avx512_host_models_every_engine_in_fp32():
    """Where the host has AVX-512 (detected), the fp32 models answer: a refusal there
    would leave the real-kernel tests nothing to judge."""
    for name in ("xla", "onnxruntime-attention", "onnxruntime-mha", "onnxruntime-gqa"):
        assert _lookup(name).unmodelled("fp32") is None, name
    assert _lookup("openvino-sdpa").unmodelled("fp32", precision="f32") is None


def test_cli_kernels_says_which_models_answer_here(monkeypatch, capsys):
    """`fa-jax kernels`: "modelled here" or "refused", and each refusal in full."""
    from fa_jax.cli import main

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(cpu, "flags", lambda: _SSE)
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    xla_row = next(line for line in out.splitlines() if line.startswith("xla "))
    assert "refused (below)" in xla_row
    assert f"- {_lookup('xla').unmodelled()}" in out
    monkeypatch.setattr(cpu, "flags", lambda: _AMX)
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    xla_row = next(line for line in out.splitlines() if line.startswith("xla "))
    assert "modelled here" in xla_row and "- xla:" not in out
