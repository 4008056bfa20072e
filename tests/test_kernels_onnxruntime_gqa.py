"""ONNX Runtime's CPU GroupQueryAttention (``onnxruntime-gqa``) and glibc's fdlibm
``tanhf`` (:mod:`fa_jax.kernels.x86.glibc_tanhf`) against the real library.

Skipped where onnxruntime (and onnx) are absent.  The model-vs-real checks run
where the model answers (MLAS runs its AVX-512F or FMA3 kernels; a softcap also
needs glibc's fdlibm ``tanhf``), against the kernels of this CPU; elsewhere they
skip with the model's refusal.  Where it answers the model is bit-exact on every
case, so each asserts 100 %.  The FMA3 model is checked on AVX-512 hosts too, in
the AVX2 lab (:mod:`lab`).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest

from fa_jax import kernels
from fa_jax._x64 import float64_enabled
from fa_jax.kernels.onnxruntime import gqa as G
from fa_jax.kernels.x86 import cpu

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
onnx = pytest.importorskip("onnx", reason="onnx is not installed")

_NAME = "onnxruntime-gqa"
modelled_here = pytest.mark.skipif(
    G.unmodelled() is not None, reason=f"the model refuses this CPU: {G.unmodelled()}"
)
fdlibm_tanhf = pytest.mark.skipif(
    G._tanhf_unmodelled() is not None, reason=f"{G._tanhf_unmodelled()}"
)


def _inputs(fmt, seed, h, h_kv, n, m, d, spread=1.0):
    rng = np.random.default_rng(seed)
    dtype = np.float32 if fmt == "fp32" else np.float16
    return tuple(
        (spread * rng.standard_normal(s)).astype(dtype).astype(np.float64)
        for s in ((h, n, d), (h_kv, m, d), (h_kv, m, d))
    )


def _identical(real, model) -> float:
    return float(np.mean(np.asarray(real) == np.asarray(model)))


def _both(q, k, v, fmt, **features):
    call = {"fmt": fmt, "causal": True, "q_offset": "bottom-right", **features}
    return kernels.real(_NAME, q, k, v, **call), kernels.emulate(_NAME, q, k, v, **call)


def test_registered():
    kernel = kernels.get(_NAME)
    assert kernel.formats == ("fp32", "fp16")
    assert kernel.features == {"q_offset", "window", "softcap", "gqa"}
    assert kernel.options == ("threads",)


def test_calls_the_op_cannot_make_are_value_errors(monkeypatch):
    monkeypatch.setattr(cpu, "flags", lambda: cpu.AVX512)
    q, k, v = _inputs("fp32", 0, 2, 1, 3, 5, 8)
    for fn in (kernels.real, kernels.emulate):
        with pytest.raises(ValueError, match="q_offset: expected M - N = 2"):
            fn(_NAME, q, k, v, fmt="fp32", causal=True, q_offset=1)
        with pytest.raises(ValueError, match="causal: expected True"):
            fn(_NAME, q, k, v, fmt="fp32")
        with pytest.raises(ValueError, match="N <= M"):
            fn(_NAME, k, q[:1], q[:1], fmt="fp32", causal=True, q_offset="bottom-right")
        with pytest.raises(ValueError, match="multiple of 8"):
            fn(_NAME, q[..., :4], k[..., :4], v, fmt="fp32", causal=True, q_offset=2)
        with pytest.raises(ValueError, match="d_v: expected d = 8"):
            fn(_NAME, q, k, v[..., :4], fmt="fp32", causal=True, q_offset=2)
        with pytest.raises(ValueError, match="expected one it runs natively"):
            fn(_NAME, q, k, v, fmt="bf16", causal=True, q_offset=2)
        with pytest.raises(ValueError, match="kv_lengths: not supported"):
            fn(_NAME, q, k, v, fmt="fp32", causal=True, q_offset=2, kv_lengths=np.array(4))
    with pytest.raises(ValueError, match="l2_cache_size"):
        G.gqa_model(G.FP32, 3, 8, l2_cache_size=0)


def test_window_and_scale_follow_the_op():
    # local_window_size = left + 1: query at p keeps keys p - left ... p
    assert G._local_window(3, 9, 8, causal=True, q_offset=6, window=(2, 0)) == 3
    assert G._local_window(3, 9, 8, causal=True, q_offset=6, window=(-1, 0)) == -1
    assert G._local_window(1, 9, 8, causal=False, q_offset=0, window=None) == -1
    start, end = G._rows(3, 9, 3)
    assert start.tolist() == [4, 5, 6] and end.tolist() == [7, 8, 9]
    # 1.0f / sqrtf(24): sqrt in FP32 first, not 1 / sqrt(24) rounded once
    assert G.default_scale(24) != float(np.float32(1 / np.sqrt(24)))
    assert G.default_scale(64) == 0.125


def test_softcap_needs_fdlibm_tanhf(monkeypatch):
    monkeypatch.setattr(cpu, "flags", lambda: cpu.AVX512)
    monkeypatch.setattr(G, "glibc_version", lambda: (2, 41))
    q, k, v = _inputs("fp32", 0, 1, 1, 1, 1, 8)
    with pytest.raises(NotImplementedError, match=r"glibc 2\.41.*fdlibm tanhf"):
        kernels.emulate(_NAME, q, k, v, fmt="fp32", causal=True, softcap=2.0)
    monkeypatch.setattr(G, "glibc_version", lambda: None)
    assert "not glibc" in (G._tanhf_unmodelled() or "")
    monkeypatch.setattr(G, "glibc_version", lambda: (2, 36))
    assert G._tanhf_unmodelled() is None


@modelled_here
def test_chunked_prefill_is_bit_exact():
    """GQA 4:1, 5 new queries after 7 past keys, a window of 6 keys (flash path)."""
    q, k, v = _inputs("fp32", 1, 4, 1, 5, 12, 16)
    real, model = _both(q, k, v, "fp32", window=(5, 0))
    assert _identical(real, model) == 1.0


@modelled_here
def test_decode_is_bit_exact():
    """One new query after 8 keys (the flash path's GEMV decode), FP32's 1 / sqrtf(24)."""
    q, k, v = _inputs("fp32", 2, 4, 2, 1, 9, 24)
    real, model = _both(q, k, v, "fp32")
    assert _identical(real, model) == 1.0


@pytest.mark.slow
@modelled_here
@pytest.mark.parametrize(
    ("fmt", "h", "h_kv", "n", "m", "d", "window"),
    [
        ("fp32", 4, 1, 7, 7, 16, None),  # prefill, odd
        ("fp32", 2, 2, 8, 8, 32, (2, 0)),  # prefill, even, 1:1
        ("fp32", 2, 1, 300, 300, 128, None),  # 3 x 3 blocks (an L2 of 512 KiB)
        ("fp32", 2, 1, 129, 129, 128, None),  # a last query block of one row
        ("fp32", 2, 2, 130, 301, 128, None),  # chunked prefill over key blocks
        ("fp32", 2, 1, 200, 333, 128, (50, 0)),  # whole key blocks before the window
        ("fp32", 4, 1, 1, 300, 128, None),  # decode
        ("fp32", 4, 1, 1, 300, 64, (99, 0)),
        ("fp32", 4, 1, 1, 1, 8, None),  # M = 1: the materialised path
        ("fp16", 4, 1, 7, 7, 16, None),
        ("fp16", 2, 1, 130, 301, 128, (60, 0)),
        ("fp16", 4, 2, 1, 77, 64, None),
    ],
)
def test_model_is_bit_exact_slow(fmt, h, h_kv, n, m, d, window):
    q, k, v = _inputs(fmt, 3, h, h_kv, n, m, d)
    features = {} if window is None else {"window": window}
    real, model = _both(q, k, v, fmt, **features)
    assert _identical(real, model) == 1.0


@pytest.mark.slow
@modelled_here
@fdlibm_tanhf
@pytest.mark.parametrize(
    ("fmt", "h", "h_kv", "n", "m", "d", "window", "cap"),
    [
        ("fp32", 4, 1, 8, 8, 16, None, 1.5),
        ("fp32", 4, 1, 3, 20, 16, (5, 0), 2.0),
        ("fp16", 4, 1, 1, 9, 16, (4, 0), 3.0),
        ("fp16", 2, 2, 5, 5, 8, None, 30.0),
    ],
)
def test_softcap_is_bit_exact_slow(fmt, h, h_kv, n, m, d, window, cap):
    """The softcap leaves the flash path: S / c, glibc's tanhf, · c, then MLAS's
    softmax over each row's window."""
    q, k, v = _inputs(fmt, 4, h, h_kv, n, m, d, spread=3.0)
    features = {"softcap": cap} if window is None else {"softcap": cap, "window": window}
    real, model = _both(q, k, v, fmt, **features)
    assert _identical(real, model) == 1.0


@pytest.mark.slow
@modelled_here
def test_flash_decoding_follows_the_threads():
    """One head, more threads than heads, 3 key blocks (d = 128 and an L2 of 512 KiB
    or more): flash decoding, whose output the plain decode model does not give."""
    l2 = G.l2_cache_bytes()
    if not (1 << 19) <= l2 < (1 << 20):
        pytest.skip(f"the case is sized for an L2 of 512 KiB to 1 MiB; this host's is {l2}")
    q, k, v = _inputs("fp32", 5, 1, 1, 1, 301, 128)
    for window in (None, (130, 0)):
        features = {} if window is None else {"window": window}
        real, model = _both(q, k, v, "fp32", threads=2, **features)
        assert _identical(real, model) == 1.0
    plain = G.gqa_model(G.FP32, 1, 128, threads=1)(q, k, v, causal=True, q_offset=300)
    assert _identical(real, plain) < 1.0


@pytest.mark.slow
@modelled_here
def test_disabling_flash_takes_the_materialised_path(monkeypatch):
    q, k, v = _inputs("fp32", 6, 2, 1, 6, 11, 16)
    flash_real, flash_model = _both(q, k, v, "fp32")
    monkeypatch.setenv("ORT_GQA_DISABLE_FLASH_ATTENTION", "1")
    real, model = _both(q, k, v, "fp32")
    assert _identical(real, model) == 1.0
    assert _identical(flash_real, flash_model) == 1.0
    assert _identical(real, flash_real) < 1.0


def _libm(name: str):
    path = ctypes.util.find_library("m")
    fn = getattr(ctypes.CDLL(path), name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.vectorize(lambda x: fn(float(x)), otypes=[np.float32])


@pytest.mark.slow
@fdlibm_tanhf
def test_tanhf_and_expm1f_are_glibcs_bits():
    """Every branch of fdlibm's tanhf (|x| below 2^-55, below 1, up to 22, beyond)
    and of the expm1f it calls (k = 0, ±1, below 23, up to 56, beyond)."""
    from fa_jax.kernels.x86.glibc_tanhf import expm1f, tanhf

    rng = np.random.default_rng(7)
    bits = rng.integers(
        np.float32(2.0**-60).view(np.uint32), np.float32(30.0).view(np.uint32), 20000
    )
    x = bits.astype(np.uint32).view(np.float32) * rng.choice(
        np.array([-1, 1], np.float32), bits.size
    )
    x = np.concatenate([x, np.array([0.0, -0.0, 1.0, -1.0, 22.0, 2**-55, 0.34657359], np.float32)])
    y = np.concatenate([rng.uniform(-2, 44, 20000), rng.uniform(-0.4, 0.4, 2000)])
    y = y.astype(np.float32)
    with float64_enabled():
        got_t = np.asarray(tanhf(np.asarray(x, np.float64))).astype(np.float32)
        got_e = np.asarray(expm1f(np.asarray(y, np.float64))).astype(np.float32)
    np.testing.assert_array_equal(got_t.view(np.uint32), _libm("tanhf")(x).view(np.uint32))
    np.testing.assert_array_equal(got_e.view(np.uint32), _libm("expm1f")(y).view(np.uint32))
    with float64_enabled():  # fdlibm's tanhf is not correctly rounded
        exact = np.tanh(x.astype(np.float64)).astype(np.float32)
    assert (got_t != exact).any()


# Run in the AVX2 lab (tests/lab.py): the real op on the inputs saved by the test,
# with the kernels MLAS picks on an AVX2 CPU; its outputs back.
_LAB_CHILD = """
import sys
import numpy as np
from fa_jax.kernels import onnxruntime as O
from fa_jax.kernels.onnxruntime import gqa as G
out = {"isa": np.array(O.mlas_isa() or "")}
with np.load(sys.argv[1]) as f:
    out["prefill"] = G.real_gqa(f["q"], f["k"], f["v"], fmt="fp32", causal=True, q_offset=5)
    out["decode"] = G.real_gqa(f["q"][:, -1:], f["k"], f["v"], fmt="fp32", causal=True,
                               q_offset=int(f["k"].shape[-2]) - 1, window=(7, 0))
    out["fp16"] = G.real_gqa(f["q16"], f["k16"], f["v16"], fmt="fp16", causal=True)
np.savez(sys.argv[2], **out)
"""


@pytest.mark.extended
def test_the_fma3_model_is_the_avx2_kernels_bits(tmp_path):
    """ONNX Runtime run as an AVX2 CPU (natively, or under qemu-user on an AVX-512
    host): MLAS runs its FMA3 kernels, and the model for ``isa="AVX2"`` gives
    their bits on the flash path (prefill, decode) and the materialised one (FP16);
    the AVX-512F model does not."""
    from lab import run_as_avx2

    q, k, v = _inputs("fp32", 8, 4, 1, 40, 45, 16, spread=4.0)
    q16, k16, v16 = _inputs("fp16", 9, 2, 2, 9, 9, 16, spread=4.0)
    np.savez(tmp_path / "in.npz", q=q, k=k, v=v, q16=q16, k16=k16, v16=v16)
    run_as_avx2(_LAB_CHILD, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    with np.load(tmp_path / "out.npz") as got:
        isa, real = str(got["isa"]), {name: got[name] for name in ("prefill", "decode", "fp16")}
    assert isa == "AVX2"
    m = k.shape[-2]
    calls = {
        "prefill": (G.FP32, (q, k, v), {"q_offset": 5}),
        "decode": (G.FP32, (q[:, -1:], k, v), {"q_offset": m - 1, "window": (7, 0)}),
        "fp16": (G.FP16, (q16, k16, v16), {}),
    }
    for name, (fmt, qkv, features) in calls.items():
        n, d = qkv[0].shape[-2:]
        fma3 = G.gqa_model(fmt, n, d, isa="AVX2")(*qkv, causal=True, **features)
        assert _identical(real[name], fma3) == 1.0, name
    avx512f = G.gqa_model(G.FP32, 40, 16, isa="AVX512")(q, k, v, causal=True, q_offset=5)
    assert _identical(real["prefill"], avx512f) < 1.0
