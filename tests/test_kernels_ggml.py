"""The ``ggml`` kernel: llama.cpp's CPU flash attention against fa_jax's model of it.

The real-kernel tests skip where ggml's libraries are absent (build them with
``experiments/build_ggml.py`` or point ``FA_JAX_GGML_LIB`` at them), and where the
model refuses the loaded build's code, with its reason (:func:`ggml.unmodelled`:
every K/V type on an AVX-512 build, BF16 with AVX512-BF16, and on an AVX2 build with
FMA and F16C).  Where the model answers it is bit-exact on every case, so each
asserts 100 % identical elements, with the features too (GQA, mask, bias, q_offset,
ALiBi's max_bias, softcap, sinks) on every path.  The AVX2 build's model is also judged on AVX-512
hosts, through the lab (tests/lab.py).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from fa_jax import kernels
from fa_jax._x64 import float64_enabled
from fa_jax.formats import get_format
from fa_jax.kernels import ggml as G
from fa_jax.kernels.ggml import lib as ggml_lib

_REASON = ggml_lib.unavailable()
needs_ggml = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
_FMT = {"f32": "fp32", "f16": "fp16", "bf16": "bf16", "q8_0": "fp32", "q4_0": "fp32"}


def _inputs(seed, h, n, m, d, kv):
    from fa_jax.rounding import round_to

    rng = np.random.default_rng(seed)
    fmt = _FMT[kv]
    with float64_enabled():
        q, k, v = (
            np.asarray(round_to(rng.standard_normal(s), fmt))
            for s in ((h, n, d), (h, m, d), (h, m, d))
        )
    return fmt, q, k, v


def _compare(h, n, m, d, kv, causal=False, threads=1, seed=0):
    fmt, q, k, v = _inputs(seed, h, n, m, d, kv)
    refused = G.unmodelled(fmt, kv_type=kv)
    if refused is not None:
        pytest.skip(f"the model refuses this build's code: {refused}")
    options = {"kv_type": kv, "threads": threads}
    real = kernels.real("ggml", q, k, v, fmt=fmt, causal=causal, **options)
    emulated = kernels.emulate("ggml", q, k, v, fmt=fmt, causal=causal, **options)
    assert real.shape == emulated.shape == (h, n, d)
    np.testing.assert_array_equal(emulated, real)
    return real


# Run in the AVX2 lab (tests/lab.py): ggml_lib loaded on its own (numpy only, no jax),
# ggml's AVX2 build named by FA_JAX_GGML_LIB; inputs, masks and scales as G.real
# prepares them; the build's features and each case's output back.
_LAB_CHILD = """
import importlib.util, json, sys
import numpy as np
spec = importlib.util.spec_from_file_location("ggml_lib", sys.argv[1])
lib = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lib)
out = {"features": np.array(sorted(lib.build_features()))}
with np.load(sys.argv[2]) as f:
    for i, (kv, threads) in enumerate(json.loads(sys.argv[3])):
        mask = f[f"mask{i}"] if f"mask{i}" in f else None
        out[f"o{i}"] = lib.flash_attn_ext(
            f[f"q{i}"], f[f"k{i}"], f[f"v{i}"], mask, float(f[f"scale{i}"]), kv, threads
        )
np.savez(sys.argv[4], **out)
"""


def _avx2_build_dir():
    from helpers import load_experiment

    build = load_experiment("build_ggml")
    lib = build.lib_dir(build.default_cache(), "avx2")
    if not all((lib / name).exists() for name in build.LIBS):
        pytest.skip(
            f"ggml's AVX2 build is absent from {lib} "
            "(python experiments/build_ggml.py --variant avx2)"
        )
    return lib


def _far_exp_inputs():
    """One key scored 0 with V = 0, the others scored ``s`` exactly (q = 4·e0, k =
    s·e0, scale 1/4): the tiled path's exp of s over ggml_v_expf's ranges, |n| <= 126,
    126 < |n| <= 192 (where the AVX2 code rounds twice; the first four are values where
    that shows) and beyond, the output their subnormal weights times V."""
    twice = ("-0x1.6035eep+6", "-0x1.6033d4p+6", "-0x1.6aff12p+6", "-0x1.6d6f88p+6")
    n = m = 64
    d = 16
    s = np.concatenate([[float.fromhex(h) for h in twice], np.linspace(-95, -140, m - 5)])
    q = np.zeros((1, n, d))
    q[..., 0] = 4.0
    k = np.zeros((1, m, d))
    k[0, 1:, 0] = s.astype(np.float32)
    v = np.round(np.random.default_rng(1).standard_normal((1, m, d)) * 64) / 64
    v[0, 0] = 0.0
    return "fp32", q, k, v


@pytest.mark.extended  # about 4 min natively on the 2-core AVX2 EPYC (one compile a case)
def test_the_avx2_build_is_modelled_where_the_model_answers(tmp_path, monkeypatch):
    """ggml's AVX2 build run as an AVX2 CPU (natively, or under qemu-user on an
    AVX-512 host) against the model of its code, chosen from the build's features
    and named explicitly (``isa="AVX2"``): every K/V type and path bit for bit --
    the scalar loop (odd M, leftovers past the 32-element steps, causal), the tiled
    path (causal F16; F32 over the exp's ranges), split-KV with 1 and 2 threads
    (even and odd M).  The AVX-512 build's model gives other bits."""
    from lab import run_as_avx2

    lib = _avx2_build_dir()
    # (kv, threads, h, n, m, d, causal, seed); seed None: _far_exp_inputs
    cases = [
        ("q8_0", 1, 2, 3, 37, 64, False, 0),
        ("q4_0", 2, 2, 7, 7, 96, True, 1),
        ("f16", 1, 2, 3, 37, 80, False, 2),
        ("f32", 1, 2, 2, 37, 40, False, 3),
        ("bf16", 1, 2, 7, 7, 80, True, 4),
        ("f16", 1, 1, 65, 65, 80, True, 5),
        ("f32", 1, 1, 64, 64, 16, False, None),
        ("f16", 1, 1, 1, 600, 64, False, 6),
        ("f16", 2, 1, 1, 601, 64, False, 7),
        ("f32", 2, 1, 1, 600, 80, False, 8),
    ]
    arrays, inputs = {}, []
    for i, (kv, _, h, n, m, d, causal, seed) in enumerate(cases):
        fmt, q, k, v = _far_exp_inputs() if seed is None else _inputs(seed, h, n, m, d, kv)
        inputs.append((fmt, q, k, v))
        arrays.update({f"q{i}": G._as4(q), f"k{i}": G._as4(k), f"v{i}": G._as4(v)})
        arrays[f"scale{i}"] = np.float32(G._scale(None, d))
        if causal:
            arrays[f"mask{i}"] = G._mask(n, m, True)
    np.savez(tmp_path / "in.npz", **arrays)
    env = {**os.environ, "FA_JAX_GGML_LIB": str(lib)}
    spec = json.dumps([[kv, threads] for kv, threads, *_ in cases])
    out = tmp_path / "out.npz"
    run_as_avx2(_LAB_CHILD, ggml_lib.__file__, str(tmp_path / "in.npz"), spec, str(out), env=env)
    with np.load(out) as got:
        features = frozenset(str(f) for f in got["features"])
        real = [
            got[f"o{i}"].reshape(inputs[i][1].shape).astype(np.float64) for i in range(len(cases))
        ]
    assert {"avx2", "fma", "f16c"} <= features and "avx512" not in features
    monkeypatch.setattr(G, "_build", lambda: features)
    for (kv, threads, *_, causal, _), (fmt, q, k, v), r in zip(cases, inputs, real):
        options = {"kv_type": kv, "threads": threads}
        assert G.unmodelled(fmt, kv_type=kv) is None, kv
        n, d = q.shape[-2], q.shape[-1]
        for isa in (None, "AVX2"):  # the build's features pick the AVX2 code
            emulated = G.model(get_format(fmt), n, d, isa=isa, **options)(q, k, v, causal=causal)
            np.testing.assert_array_equal(emulated, r, err_msg=f"{kv} {threads} {n} {isa}")
    fmt, q, k, v = inputs[2]
    avx512 = G.model(get_format(fmt), 3, 80, kv_type="f16", isa="AVX512")(q, k, v)
    assert np.mean(avx512 == real[2]) < 1.0  # the AVX-512 build's bits are not these


def test_registered():
    assert "ggml" in kernels.names()


def test_an_explicit_isa_is_modelled_on_any_build(monkeypatch):
    """``isa`` names the build's code: the model answers even where the build here
    (an SSE-only one) is refused, and each name follows its own vector code."""
    monkeypatch.setattr(G, "_build", lambda: frozenset({"sse3"}))
    fp32 = get_format("fp32")
    with pytest.raises(NotImplementedError, match="does not follow"):
        G.model(fp32, 1, 64)
    assert G.unmodelled("fp32") is not None
    q = np.zeros((1, 1, 8))
    for isa in G.ISAS:
        out = G.model(fp32, 1, 8, isa=isa)(q, q, q + 1.0)
        np.testing.assert_array_equal(out, 1.0)


def test_paths():
    assert G.path(1, 512, 1, "f16") == "split-kv"
    assert G.path(1, 511, 1, "f16") == "scalar"
    assert G.path(1, 4096, 1, "q8_0") == "scalar"
    assert G.path(64, 64, 1, "f32") == "tiled"
    assert G.path(63, 600, 1, "f32") == "scalar"
    assert G.path(64, 64, 1, "q4_0") == "scalar"


def test_errors():
    with pytest.raises(ValueError, match=r"ggml: isa: expected one of \('AVX512', 'AVX2'\)"):
        G.model(get_format("fp32"), 1, 64, isa="SSE")
    with pytest.raises(ValueError, match="kv_type"):
        G.model(get_format("fp32"), 1, 64, kv_type="q5_1")
    with pytest.raises(ValueError, match="fmt"):
        G.model(get_format("fp8_e4m3"), 1, 64)
    with pytest.raises(ValueError, match="threads"):
        G.model(get_format("fp32"), 1, 64, threads=0)


def test_q8_0_rounding_ref_half_away_x86_half_even():
    """ggml's reference quantizer rounds halves away from zero (roundf), its x86 query
    quantizer to even (_mm256_round_ps): a block whose amax is 127 (d = 1) tells them apart."""
    from fa_jax.kernels.ggml import blocks as ggml_blocks

    x = np.zeros((32,))
    x[0], x[1], x[2] = 127.0, 2.5, -3.5
    with float64_enabled():
        q_ref, d_ref = jax.jit(ggml_blocks.quantize_ref, static_argnums=1)(x, "q8_0")
        q_x86, d_x86 = jax.jit(ggml_blocks.quantize_q8_0_x86)(x)
    assert float(d_ref[0, 0]) == float(d_x86[0, 0]) == 1.0
    assert [float(t) for t in q_ref[0, :3]] == [127.0, 3.0, -4.0]
    assert [float(t) for t in q_x86[0, :3]] == [127.0, 2.0, -4.0]


def test_q4_0_scale_from_signed_max():
    """Q4_0's scale is the signed value of largest magnitude over -8 (ggml-quants.c:132)."""
    from fa_jax.kernels.ggml import blocks as ggml_blocks

    x = np.linspace(-1.0, 0.5, 32)  # max |x| at -1: d = 1/8, values in [-8, 7]
    with float64_enabled():
        q, d = (
            np.asarray(t) for t in jax.jit(ggml_blocks.quantize_ref, static_argnums=1)(x, "q4_0")
        )
        back = np.asarray(ggml_blocks.dequantize(q, d, "q4_0"))
    assert float(d[0, 0]) == 0.125
    assert q.min() == -8.0 and q.max() <= 7.0
    assert np.max(np.abs(back - x)) <= 0.0625


@pytest.mark.extended  # for the default run's time only
@needs_ggml
def test_scalar_f16_accumulator_exact():
    """Decode-like rows, F16 K/V (FP16 accumulator, Q rounded to FP16), d = 80 (leftovers
    past the 64-element vector steps), causal."""
    _compare(2, 5, 5, 80, "f16", causal=True)


@needs_ggml
def test_scalar_quantized_exact():
    """Q8_0 and Q4_0 K/V (the scalar path, Q as x86 Q8_0 blocks): modelled on AVX2
    builds as on AVX-512 ones, so this runs on both kinds of CPU."""
    _compare(2, 3, 37, 64, "q8_0")
    _compare(2, 7, 7, 96, "q4_0", causal=True, seed=1)


@needs_ggml
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_scalar_exact(kv, d):
    if kv.startswith("q") and d % 32:
        d = 96  # blocks of 32
    _compare(2, 3, 37, d, kv)
    _compare(2, 7, 7, d, kv, causal=True, seed=1)


@needs_ggml
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_tiled_exact(kv):
    _compare(1, 70, 70, 64, kv)
    _compare(1, 65, 65, 80, kv, causal=True, seed=2)


@needs_ggml
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_split_kv_exact_and_thread_dependent(kv):
    """One query row over 600 keys: the output is the merge of one chunk per thread."""
    outs = [_compare(1, 1, 600, 64, kv, threads=t, seed=3) for t in (1, 2, 3)]
    assert any(not np.array_equal(outs[0], o) for o in outs[1:])


def test_library_dir_follows_the_environment(tmp_path, monkeypatch):
    for name in ("ggml-base", "ggml-cpu", "ggml"):
        (tmp_path / f"lib{name}.so").write_bytes(b"")
    monkeypatch.setenv("FA_JAX_GGML_LIB", str(tmp_path))
    assert ggml_lib.library_dir() == tmp_path
    (tmp_path / "libggml-cpu.so").unlink()
    assert ggml_lib.library_dir() != tmp_path


def test_build_script_builds_where_the_kernel_looks(tmp_path, monkeypatch):
    from helpers import load_experiment

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("FA_JAX_GGML_LIB", raising=False)
    build = load_experiment("build_ggml")
    assert build.default_cache() / "lib" == tmp_path / "fa_jax" / "ggml" / "lib"
    assert ggml_lib._candidates()[0] == build.default_cache() / "lib"


# ---- features (ggml_flash_attn_ext's mask, max_bias, logit_softcap; sinks; GQA) ----

FEATURE_NAMES = ("gqa", "mask", "bias", "q_offset", "alibi", "softcap", "sinks")


def _feature_call(features, kv, n, m, *, d=64, threads=1, seed=0):
    """(fmt, q, k, v, keywords) of a call with ``features``: GQA with 2 K/V heads
    for 6 query heads; a boolean mask keeping about 80 % (the first row none); a
    bias of FP16 values and -inf; the causal mask bottom-right (N queries after M - N
    cached keys); ALiBi with max_bias 8 on 6 heads (both of ggml's slope formulas);
    softcap 1.5 with scale 1; sinks of FP32 logits (head 0's above its rows' maxima)."""
    from fa_jax.rounding import round_to

    h = 6 if "alibi" in features or "gqa" in features else 2
    h_kv = 2 if "gqa" in features else h
    rng = np.random.default_rng(seed)
    fmt = _FMT[kv]
    with float64_enabled():
        q = np.asarray(round_to(rng.standard_normal((h, n, d)), fmt))
        k, v = (np.asarray(round_to(rng.standard_normal((h_kv, m, d)), fmt)) for _ in "kv")
    kw: dict = {"kv_type": kv, "threads": threads}
    if "mask" in features:
        keep = rng.random((h, n, m)) < 0.8
        keep[:, 0] = False
        kw["mask"] = keep
    if "bias" in features:
        bias = np.round(rng.standard_normal((1, n, m)) * 64) / 64
        kw["bias"] = np.where(rng.random((1, n, m)) < 0.1, -np.inf, bias)
    if "q_offset" in features or "alibi" in features:
        kw.update(causal=True, q_offset="bottom-right")
    if "alibi" in features:
        kw["max_bias"] = 8.0
    if "softcap" in features:
        kw.update(softcap=1.5, scale=1.0)
    if "sinks" in features:
        sinks = rng.standard_normal(h).astype(np.float32).astype(np.float64) * 2
        sinks[0] = 4.5  # above the row maxima: the branch that rescales o and S
        kw["sinks"] = sinks
    return fmt, q, k, v, kw


def _compare_features(features, kv, n, m, *, threads=1, seed=0):
    fmt, q, k, v, kw = _feature_call(features, kv, n, m, threads=threads, seed=seed)
    refused = G.unmodelled(fmt, kv_type=kv)
    if refused is not None:
        pytest.skip(f"the model refuses this build's code: {refused}")
    real = kernels.real("ggml", q, k, v, fmt=fmt, **kw)
    emulated = kernels.emulate("ggml", q, k, v, fmt=fmt, **kw)
    assert real.shape == emulated.shape == (*q.shape[:-1], v.shape[-1])
    np.testing.assert_array_equal(emulated, real)
    return real


def test_features_declared():
    assert kernels.get("ggml").features == {"gqa", "mask", "bias", "q_offset", "softcap", "sinks"}
    assert "max_bias" in kernels.get("ggml").options


@needs_ggml
def test_features_scalar_exact():
    """The scalar path with GQA, a boolean mask (a row keeping no key), the causal
    mask bottom-right and sinks at once (Q8_0 K/V: modelled on both kinds of
    build), and ALiBi with F16 K/V (the F16 accumulator, six heads' slopes)."""
    _compare_features(("gqa", "mask", "q_offset", "sinks"), "q8_0", 3, 37)
    _compare_features(("alibi",), "f16", 3, 37, seed=1)


@needs_ggml
@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURE_NAMES)
@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_feature_scalar_exact(feature, kv):
    _compare_features((feature,), kv, 3, 37, seed=2)


@needs_ggml
@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURE_NAMES)
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_feature_tiled_exact(feature, kv):
    """N = 65: a full Q tile and one row; M = 130: a part-filled KV tile."""
    _compare_features((feature,), kv, 65, 130, seed=3)


@needs_ggml
@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("feature", FEATURE_NAMES)
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_feature_split_kv_exact(feature, kv, threads):
    """One query row over 601 keys; with 2 threads the sink goes to the first chunk."""
    _compare_features((feature,), kv, 1, 601, threads=threads, seed=4)


@needs_ggml
@pytest.mark.slow
def test_features_together_exact():
    """Every feature that goes with ALiBi at once, on each path."""
    every = ("gqa", "mask", "alibi", "softcap", "sinks")
    _compare_features(every, "f16", 3, 37, seed=5)
    _compare_features(every, "f32", 65, 130, seed=6)
    _compare_features(every, "f16", 1, 600, threads=2, seed=7)
    _compare_features(("gqa", "mask", "bias", "q_offset", "softcap", "sinks"), "q4_0", 3, 64)


@needs_ggml
@pytest.mark.slow
def test_alibi_with_a_batch_exact():
    """ALiBi on (B, H, N, d) inputs: H the heads of the slopes, B ggml's batch (so one
    query row over 600 keys takes the scalar path, not split-KV), sinks per head."""
    from fa_jax.rounding import round_to

    rng = np.random.default_rng(8)
    with float64_enabled():
        q = np.asarray(round_to(rng.standard_normal((2, 3, 1, 64)), "fp16"))
        k, v = (np.asarray(round_to(rng.standard_normal((2, 3, 600, 64)), "fp16")) for _ in "kv")
    kw = {"kv_type": "f16", "max_bias": 4.0, "sinks": np.array([1.0, 5.0, -2.0])}
    real = kernels.real("ggml", q, k, v, fmt="fp16", **kw)
    np.testing.assert_array_equal(kernels.emulate("ggml", q, k, v, fmt="fp16", **kw), real)


# The AVX2 lab's child for the features: ggml_lib alone, each case's keywords of
# flash_attn_ext (G.call_args) from an npz (arrays) and JSON (the rest).
_LAB_FEATURES_CHILD = """
import importlib.util, json, sys
import numpy as np
spec = importlib.util.spec_from_file_location("ggml_lib", sys.argv[1])
lib = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lib)
out = {"features": np.array(sorted(lib.build_features()))}
with np.load(sys.argv[2]) as f:
    for i, kw in enumerate(json.loads(sys.argv[3])):
        for name in ("q", "k", "v", "mask", "sinks"):
            kw[name] = f[f"{name}{i}"] if f"{name}{i}" in f else None
        out[f"o{i}"] = lib.flash_attn_ext(**kw)
np.savez(sys.argv[4], **out)
"""


@pytest.mark.extended  # several compiles: minutes on 2 cores
def test_the_avx2_build_is_modelled_with_features(tmp_path, monkeypatch):
    """ggml's AVX2 build run as an AVX2 CPU (natively, or under qemu-user on an
    AVX-512 host) with the features against the model of its code: the scalar loop
    (F16 with GQA, a mask, bottom-right causal, softcap and sinks; Q4_0 with ALiBi),
    the tiled path and split-KV with 2 threads (ALiBi, GQA, a mask, softcap, sinks)."""
    from lab import run_as_avx2

    lib = _avx2_build_dir()
    every = ("gqa", "mask", "alibi", "softcap", "sinks")
    cases = [
        (("gqa", "mask", "q_offset", "softcap", "sinks"), "f16", 3, 37, 1),
        (("alibi", "sinks"), "q4_0", 3, 64, 1),
        (every, "f32", 65, 130, 1),
        (every, "f16", 1, 600, 2),
    ]
    arrays, specs, calls = {}, [], []
    for i, (features, kv, n, m, threads) in enumerate(cases):
        fmt, q, k, v, kw = _feature_call(features, kv, n, m, threads=threads, seed=10 + i)
        calls.append((fmt, q, k, v, kw))
        args = G.call_args(q, k, v, fmt=fmt, **kw)
        for name in ("q", "k", "v", "mask", "sinks"):
            x = args.pop(name)
            if x is not None:
                arrays[f"{name}{i}"] = x
        specs.append(args)
    np.savez(tmp_path / "in.npz", **arrays)
    env = {**os.environ, "FA_JAX_GGML_LIB": str(lib)}
    out = tmp_path / "out.npz"
    run_as_avx2(
        _LAB_FEATURES_CHILD,
        ggml_lib.__file__,
        str(tmp_path / "in.npz"),
        json.dumps(specs),
        str(out),
        env=env,
    )
    with np.load(out) as got:
        features = frozenset(str(f) for f in got["features"])
        real = [got[f"o{i}"].astype(np.float64) for i in range(len(cases))]
    assert {"avx2", "fma", "f16c"} <= features and "avx512" not in features
    monkeypatch.setattr(G, "_build", lambda: features)
    for (fmt, q, k, v, kw), r in zip(calls, real):
        options = {name: kw.pop(name) for name in ("kv_type", "threads", "max_bias") if name in kw}
        r = r.reshape(*q.shape[:-1], v.shape[-1])
        for isa in (None, "AVX2"):
            model = G.model(get_format(fmt), q.shape[-2], q.shape[-1], isa=isa, **options)
            np.testing.assert_array_equal(model(q, k, v, **kw), r, err_msg=f"{options} {isa}")


def test_alibi_slopes():
    """ggml's slopes: m0^(h+1) below n_head_log2, m1^(2(h - n_head_log2)+1) above."""
    from fa_jax.kernels.ggml.attention import alibi_slopes

    assert alibi_slopes(8.0, 8) == tuple(2.0 ** -(h + 1) for h in range(8))
    assert alibi_slopes(8.0, 6) == (0.25, 0.0625, 2.0**-6, 2.0**-8, 0.5, 0.125)
    assert alibi_slopes(0.0, 3) == (1.0, 1.0, 1.0)


@pytest.mark.skipif(
    __import__("platform").libc_ver()[0] != "glibc", reason="compares with glibc's powf"
)
def test_glibc_powf_is_the_c_librarys():
    """The model's powf against the C library's, on ALiBi's slopes for many
    (max_bias, n_head) and on random arguments (where correct rounding would differ
    in about 1 case in 300)."""
    import ctypes
    import ctypes.util

    from fa_jax.kernels.ggml.attention import alibi_slopes, glibc_powf

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.powf.argtypes, libm.powf.restype = [ctypes.c_float, ctypes.c_float], ctypes.c_float
    rng = np.random.default_rng(0)
    xs = rng.uniform(0.01, 4.0, 3000).astype(np.float32)
    ys = rng.uniform(-15.0, 15.0, 3000).astype(np.float32)
    for x, y in zip(xs.tolist(), ys.tolist()):
        assert glibc_powf(x, y) == libm.powf(x, y), (x, y)
    f32 = np.float32
    for max_bias in (0.5, 5.0, 8.5):
        for n_head in (3, 12, 40, 96):
            log2 = 1 << int(np.log2(n_head))
            m0 = libm.powf(2.0, float(-f32(max_bias) / f32(log2)))
            m1 = libm.powf(2.0, float(-(f32(max_bias) / f32(2)) / f32(log2)))
            want = [
                libm.powf(m0, h + 1) if h < log2 else libm.powf(m1, 2 * (h - log2) + 1)
                for h in range(n_head)
            ]
            assert alibi_slopes(max_bias, n_head) == tuple(want), (max_bias, n_head)


def test_ggml_mask_as_llama_cpp_builds_it():
    """-inf where dropped, else the bias or ALiBi's -|i + q_offset - j|; bottom-right."""
    out = G.ggml_mask(np, (2,), 2, 4, causal=True, q_offset=2, alibi=True)
    inf = np.inf
    np.testing.assert_array_equal(out, [[-2, -1, 0, -inf], [-3, -2, -1, 0]])
    assert G.ggml_mask(np, (2,), 2, 4, causal=False) is None
    keep = np.array([[True, False, True, True]])
    bias = np.full((2, 1, 4), 0.5)
    both = G.ggml_mask(np, (2,), 1, 4, causal=False, mask=keep, bias=bias)
    assert both.shape == (2, 1, 4)
    np.testing.assert_array_equal(both[1, 0], [0.5, -inf, 0.5, 0.5])


def test_feature_errors():
    fp32 = get_format("fp32")
    q = np.zeros((2, 3, 8))
    model = G.model(fp32, 3, 8, isa="AVX2")
    with pytest.raises(ValueError, match="bias with max_bias"):
        G.model(fp32, 3, 8, isa="AVX2", max_bias=8.0)(q, q, q, bias=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="max_bias: expected a finite number >= 0"):
        G.model(fp32, 3, 8, isa="AVX2", max_bias=-1.0)
    with pytest.raises(ValueError, match="exact in FP16"):
        model(q, q, q, bias=np.full((3, 3), 1.0 + 2.0**-12))
    with pytest.raises(NotImplementedError, match="window"):
        model(q, q, q, window=(1, 0))
    with pytest.raises(ValueError, match="one sink per head"):
        G.model(fp32, 3, 8, isa="AVX2", max_bias=8.0)(
            np.zeros((2, 2, 3, 8)),
            np.zeros((2, 2, 3, 8)),
            np.zeros((2, 2, 3, 8)),
            sinks=np.array([[0.0, 1.0], [1.0, 0.0]]),
        )
    with pytest.raises(ValueError, match="'ggml': window: not supported"):
        kernels.emulate("ggml", q, q, q, fmt="fp32", window=(1, 0))


@pytest.mark.slow
def test_features_answer_on_either_code():
    """Both codes' models take every feature (their arithmetic for the features is
    the same C; only the dots and the tiled softmax differ): GQA broadcasts K/V
    heads as ggml does, and a sink of -inf with no key kept gives NaN, as in C."""
    fp32 = get_format("fp32")
    rng = np.random.default_rng(0)
    q = np.round(rng.standard_normal((4, 2, 8)) * 4) / 4
    k, v = (np.round(rng.standard_normal((2, 5, 8)) * 4) / 4 for _ in "kv")
    for isa in G.ISAS:
        model = G.model(fp32, 2, 8, isa=isa)
        grouped = model(q, k, v)
        repeated = model(q, np.repeat(k, 2, axis=0), np.repeat(v, 2, axis=0))
        np.testing.assert_array_equal(grouped, repeated)
        none = np.zeros((4, 2, 5), bool)
        out = model(q, k, v, mask=none, sinks=np.array([0.0, -np.inf, 1.0, 2.0]))
        assert np.isnan(out[1]).all() and (out[[0, 2, 3]] == 0).all()
