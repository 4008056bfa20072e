"""ONNX Runtime's CPU attention (``onnxruntime-attention``, ``onnxruntime-mha``) and
MLAS's sgemm, exp and softmax (:mod:`fa_jax.kernels.x86.mlas`) against the real library.

Skipped where onnxruntime (and onnx) are absent.  The model-vs-real checks run
where the models answer (:func:`fa_jax.kernels.onnxruntime.unmodelled`: MLAS runs
its AVX-512F or its FMA3 kernels, the ones they follow), against the kernels of
this CPU; elsewhere they skip with the models' refusal.  Where they answer the
models are bit-exact on every case, so each asserts 100 %.  The FMA3 models are
checked on AVX-512 hosts too, in the AVX2 lab (:mod:`lab`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fa_jax import kernels
from fa_jax._x64 import float64_enabled
from fa_jax.kernels import onnxruntime as O
from fa_jax.kernels.x86 import cpu, mlas

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
onnx = pytest.importorskip("onnx", reason="onnx is not installed")

modelled_here = pytest.mark.skipif(
    O.unmodelled() is not None, reason=f"the models refuse this CPU: {O.unmodelled()}"
)


def _inputs(fmt, seed, h, n, m, d):
    rng = np.random.default_rng(seed)
    dtype = np.float32 if fmt == "fp32" else np.float16
    return tuple(
        rng.standard_normal(s).astype(dtype).astype(np.float64)
        for s in ((h, n, d), (h, m, d), (h, m, d))
    )


def _session(node, inputs, outputs):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _identical(real, model) -> float:
    return float(np.mean(np.asarray(real) == np.asarray(model)))


def test_registered():
    assert {"onnxruntime-attention", "onnxruntime-mha"} <= set(kernels.names())
    assert kernels.get("onnxruntime-attention").formats == ("fp32", "fp16")
    assert kernels.get("onnxruntime-mha").formats == ("fp32",)


def test_stride_k_follows_mlas():
    # N < K narrows StrideN from 128 to at most 16, doubling StrideK each time.
    assert mlas.stride_k(3, 2100) == 1024
    assert mlas.stride_k(64, 2048) == 256
    assert mlas.stride_k(128, 2048) == 128
    assert mlas.stride_k(2048, 64) == 64  # N >= K: halved while K fits in half
    assert mlas.stride_k(3, 2100, trans_a=True) == 128


def test_flash_blocks_from_l2():
    assert O.flash_blocks(2048, 2048, 64, 64, 1 << 20) == (128, 512)
    assert O.flash_blocks(5, 9, 64, 64, 1 << 20) == (5, 9)
    assert O.flash_blocks(300, 300, 64, 64, 1 << 16) == (32, 32)
    assert O.flash_blocks(10, 10, 64, 64, 1) == (1, 1)


def test_mlas_isa_follows_its_cpuid_tests(monkeypatch):
    """platform.cpp: AVX-512F first, then AVX2 with FMA, else the SSE kernels (no
    model); the sum-exp kernel follows, and isa= names one on any CPU."""
    for flags, isa, kernel in [
        (cpu.AVX512 | {"avx2", "fma"}, "AVX512", mlas.AVX512F),
        (frozenset({"avx", "avx2", "fma", "f16c"}), "AVX2", mlas.FMA3),
        (frozenset({"avx", "avx2", "f16c"}), None, None),
    ]:
        monkeypatch.setattr(cpu, "flags", lambda flags=flags: flags)
        assert O.mlas_isa() == isa
        if kernel is None:
            with pytest.raises(NotImplementedError, match="SSE kernels"):
                O.sum_exp_kernel()
        else:
            assert O.sum_exp_kernel() == kernel
        assert O.sum_exp_kernel("AVX2") == mlas.FMA3
    with pytest.raises(ValueError, match=r"onnxruntime: isa: expected one of \('AVX512', 'AVX2'\)"):
        O.sum_exp_kernel("SSE")


def test_errors(monkeypatch):
    """Bad arguments are ValueErrors on every CPU (an AVX-512 one assumed, so that
    the models answer)."""
    monkeypatch.setattr(cpu, "flags", lambda: cpu.AVX512)
    q, k, v = _inputs("fp32", 0, 1, 3, 3, 8)
    with pytest.raises(ValueError, match="causal"):
        kernels.emulate("onnxruntime-mha", q, k, v, fmt="fp32", causal=True)
    with pytest.raises(ValueError, match="causal"):
        kernels.real("onnxruntime-mha", q, k, v, fmt="fp32", causal=True)
    with pytest.raises(ValueError, match="expected one it runs natively"):
        kernels.emulate("onnxruntime-attention", q, k, v, fmt="bf16")
    with pytest.raises(ValueError, match="l2_cache_size"):
        O.mha_model(O.FP32, 3, 8, l2_cache_size=0)
    with float64_enabled(), pytest.raises(NotImplementedError, match="TransposeB"):
        mlas.sgemm(np.ones((1, 4)), np.ones((4, 3)), c=np.zeros((1, 3)), trans_b=True)


@pytest.mark.slow
def test_softmax_jit_matches_eager():
    rng = np.random.default_rng(3)
    s = rng.standard_normal((2, 21)).astype(np.float32).astype(np.float64) * 4
    with float64_enabled():
        eager = np.asarray(mlas.softmax(s))
        jitted = np.asarray(jax.jit(mlas.softmax)(s))
    np.testing.assert_array_equal(eager, jitted)


@modelled_here
@pytest.mark.parametrize(
    "width",
    [pytest.param(1, marks=pytest.mark.slow), 7, pytest.param(48, marks=pytest.mark.slow), 250],
)
def test_mlas_softmax_is_bit_exact(width):
    """MLAS's exp (the SumExp kernel this CPU runs: AVX-512F or FMA3), its lanes' sum
    and the reciprocal, through ONNX Runtime's Softmax op (MlasComputeSoftmax)."""
    from onnx import helper

    rng = np.random.default_rng(width)
    x = (rng.standard_normal((64, width)) * rng.uniform(0.1, 30, (64, 1))).astype(np.float32)
    x[0, : min(width, 3)] = -1e30  # the clamp at -103.97 (AVX-512F), -88.38 (FMA3)
    x[1, : min(width, 3)] = x[1].max() - 95  # exps in the subnormals (AVX-512F)
    x[2, : min(width, 3)] = x[2].max() - 87.7  # m = -127: +0 (FMA3)
    sess = _session(helper.make_node("Softmax", ["X"], ["Y"], axis=-1), "X", "Y")
    real = sess.run(None, {"X": x})[0]
    here = O.sum_exp_kernel()
    with float64_enabled():
        model = np.asarray(jax.jit(mlas.softmax, static_argnums=1)(x.astype(np.float64), here))
    assert _identical(real, model) == 1.0
    if width > 1:  # the other ISA's kernel is not these bits
        other = mlas.FMA3 if here == mlas.AVX512F else mlas.AVX512F
        with float64_enabled():
            wrong = np.asarray(mlas.softmax(x.astype(np.float64), other))
        assert _identical(real, wrong) < 1.0


@modelled_here
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        pytest.param(1, 7, 3, marks=pytest.mark.slow),
        (1, 38, 5),
        (3, 37, 5),
        pytest.param(4, 1100, 3, marks=pytest.mark.slow),
    ],
)
def test_mlas_sgemm_is_bit_exact(m, k, n):
    """MLAS's sgemm through ONNX Runtime's MatMul: one FMA chain per K slice (M > 1),
    the one-row kernel's groups of four (M = 1)."""
    from onnx import helper

    rng = np.random.default_rng(k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    sess = _session(helper.make_node("MatMul", ["A", "B"], ["Y"]), "AB", "Y")
    real = sess.run(None, {"A": a, "B": b})[0]
    with float64_enabled():
        model = np.asarray(jax.jit(mlas.sgemm)(a.astype(np.float64), b.astype(np.float64)))
    assert _identical(real, model) == 1.0


def test_one_row_transposed_gemm_is_bit_exact_on_any_cpu():
    """``MlasSgemmKernelM1TransposeBAvx`` through Gemm(transB) with one row of A: the
    same AVX code on every x86 CPU, so checked on AVX2 and AVX-512 hosts alike;
    columns in blocks of 4, then the blocks of 2 and 1 of N mod 4, each its own
    lane tree (all three meet at N = 7; 13 and 50 add more blocks)."""
    from onnx import helper

    rng = np.random.default_rng(7)
    sess = _session(helper.make_node("Gemm", ["A", "B"], ["Y"], transB=1), "AB", "Y")
    model = jax.jit(lambda a, b: mlas.sgemm(a, b, trans_b=True))
    for k, n in [(5, 7), (37, 13), (64, 50), (300, 6), (16, 1)]:
        a = rng.standard_normal((1, k)).astype(np.float32)
        bt = rng.standard_normal((n, k)).astype(np.float32)
        real = sess.run(None, {"A": a, "B": bt})[0]
        with float64_enabled():
            got = np.asarray(model(a.astype(np.float64), bt.T.astype(np.float64)))
        assert _identical(real, got) == 1.0, (k, n)


@modelled_here
@pytest.mark.parametrize(
    ("fmt", "h", "n", "m", "d", "causal"),
    [
        ("fp32", 2, 7, 7, 16, True),
        pytest.param("fp16", 2, 1, 9, 8, False, marks=pytest.mark.slow),
    ],
)
def test_attention_model_is_bit_exact(fmt, h, n, m, d, causal):
    q, k, v = _inputs(fmt, 0, h, n, m, d)
    real = kernels.real("onnxruntime-attention", q, k, v, fmt=fmt, causal=causal)
    model = kernels.emulate("onnxruntime-attention", q, k, v, fmt=fmt, causal=causal)
    assert _identical(real, model) == 1.0


@modelled_here
def test_mha_model_is_bit_exact():
    q, k, v = _inputs("fp32", 1, 2, 5, 9, 8)
    real = kernels.real("onnxruntime-mha", q, k, v, fmt="fp32", threads=2)
    model = kernels.emulate("onnxruntime-mha", q, k, v, fmt="fp32", threads=2)
    assert _identical(real, model) == 1.0


def test_threads_do_not_change_the_output():
    q, k, v = _inputs("fp32", 2, 4, 9, 9, 8)
    for name in ("onnxruntime-attention", "onnxruntime-mha"):
        one = kernels.real(name, q, k, v, fmt="fp32", threads=1)
        two = kernels.real(name, q, k, v, fmt="fp32", threads=2)
        np.testing.assert_array_equal(one, two)


@pytest.mark.slow
@modelled_here
@pytest.mark.parametrize(
    ("fmt", "h", "n", "m", "d", "causal"),
    [
        ("fp32", 2, 37, 37, 64, True),
        ("fp32", 2, 1, 77, 64, False),
        ("fp32", 2, 100, 100, 128, False),
        ("fp32", 1, 300, 300, 64, True),
        ("fp16", 2, 37, 37, 64, True),
        ("fp16", 2, 100, 100, 128, False),
        ("fp16", 2, 1, 301, 64, False),
    ],
)
def test_attention_model_is_bit_exact_slow(fmt, h, n, m, d, causal):
    q, k, v = _inputs(fmt, 5, h, n, m, d)
    real = kernels.real("onnxruntime-attention", q, k, v, fmt=fmt, causal=causal)
    model = kernels.emulate("onnxruntime-attention", q, k, v, fmt=fmt, causal=causal)
    assert _identical(real, model) == 1.0


@pytest.mark.slow
@modelled_here
@pytest.mark.parametrize(
    ("h", "n", "blocks", "d"),
    [(2, 1, 2.3, 64), (2, 129, 1.2, 64), (2, 200, 2.7, 64), (3, 1, 2.1, 32)],
)
def test_mha_model_is_bit_exact_slow(h, n, blocks, d):
    """Several key blocks (``blocks`` of this host's Bc), a last chunk of one query
    row (N = 129: Br = d + d_v = 128), decode (N = 1: MLAS's one-row sgemm adding
    onto C)."""
    l2 = O.l2_cache_bytes()
    if l2 < 1 << 18:
        pytest.skip(f"the cases are sized for an L2 of 256 KiB or more; this host's is {l2}")
    m = int(blocks * O.flash_blocks(1 << 20, 1 << 20, d, d, l2)[1])
    q, k, v = _inputs("fp32", 6, h, n, m, d)
    real = kernels.real("onnxruntime-mha", q, k, v, fmt="fp32")
    model = kernels.emulate("onnxruntime-mha", q, k, v, fmt="fp32")
    assert _identical(real, model) == 1.0
    # the model for a 64 KiB L2 (the real kernel takes its host's; the registry has no option)
    other = O.mha_model(O.FP32, n, d, l2_cache_size=1 << 16)(q, k, v)
    assert _identical(real, other) < 1.0  # the blocks matter


# Run in the AVX2 lab (tests/lab.py): the real ops on the inputs saved by the test,
# with the kernels MLAS picks on an AVX2 CPU; their outputs back.
_LAB_CHILD = """
import sys
import numpy as np
from fa_jax.kernels.x86 import cpu
from fa_jax.kernels import onnxruntime as O
out = {"isa": np.array(O.mlas_isa() or "")}
with np.load(sys.argv[1]) as f:
    out["attention"] = O.real_attention(
        f["q"], f["k"], f["v"], fmt="fp32", causal=True, q_offset=267
    )
    out["attention16"] = O.real_attention(f["q16"], f["k16"], f["v16"], fmt="fp16")
    out["mha"] = O.real_mha(f["q"], f["k"], f["v"], fmt="fp32")
np.savez(sys.argv[2], **out)
"""


@pytest.mark.extended
def test_the_fma3_models_are_the_avx2_kernels_bits(tmp_path):
    """ONNX Runtime run as an AVX2 CPU (natively, or under qemu-user on an AVX-512
    host): MLAS runs its FMA3 kernels, and the models for ``isa="AVX2"`` give their
    bits; the AVX-512F models do not.  The causal case has 267 past keys
    (q_offset = M - N); the MHA case keeps one key block and a last one-row chunk
    for any L2 of 160 KiB or more (d = 16: Br = 32)."""
    from lab import run_as_avx2

    q, k, v = _inputs("fp32", 8, 2, 33, 300, 16)
    q16, k16, v16 = _inputs("fp16", 9, 2, 37, 37, 64)
    np.savez(tmp_path / "in.npz", q=q, k=k, v=v, q16=q16, k16=k16, v16=v16)
    run_as_avx2(_LAB_CHILD, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    with np.load(tmp_path / "out.npz") as got:
        isa, real = (
            str(got["isa"]),
            {name: got[name] for name in ("attention", "attention16", "mha")},
        )
    assert isa == "AVX2"
    models = {
        "attention": (O.attention_model, O.FP32, (q, k, v), True),
        "attention16": (O.attention_model, O.FP16, (q16, k16, v16), False),
        "mha": (O.mha_model, O.FP32, (q, k, v), False),
    }
    for name, (factory, fmt, qkv, causal) in models.items():
        n, d = qkv[0].shape[-2:]
        behind = {"q_offset": 267} if causal else {}
        fma3 = factory(fmt, n, d, isa="AVX2")(*qkv, causal=causal, **behind)
        assert _identical(real[name], fma3) == 1.0, name
    avx512f = O.attention_model(O.FP32, 33, 16, isa="AVX512")(q, k, v, causal=True, q_offset=267)
    assert _identical(real["attention"], avx512f) < 1.0


PAST_CASES = [  # (fmt, h, h_kv, n, m, d, causal)
    ("fp32", 4, 2, 5, 12, 16, True),
    pytest.param("fp32", 2, 2, 1, 12, 16, True, marks=pytest.mark.slow),
    pytest.param("fp16", 2, 2, 5, 12, 16, True, marks=pytest.mark.slow),
    pytest.param("fp32", 4, 2, 37, 70, 64, True, marks=pytest.mark.slow),
    pytest.param("fp32", 4, 1, 5, 12, 16, False, marks=pytest.mark.slow),
]


@modelled_here
@pytest.mark.parametrize(("fmt", "h", "h_kv", "n", "m", "d", "causal"), PAST_CASES)
def test_attention_behind_past_kv_is_bit_exact(fmt, h, h_kv, n, m, d, causal):
    """The ONNX Attention op with past K/V (the first M - N keys) and GQA: its causal
    mask keeps j <= i + M - N (``q_offset="bottom-right"``), none for one query."""
    rng = np.random.default_rng(n * m)
    dtype = np.float32 if fmt == "fp32" else np.float16
    q, k, v = (
        rng.standard_normal(s).astype(dtype).astype(np.float64)
        for s in ((1, h, n, d), (1, h_kv, m, d), (1, h_kv, m, d))
    )
    how = {"causal": True, "q_offset": "bottom-right"} if causal else {}
    real = kernels.real("onnxruntime-attention", q, k, v, fmt=fmt, **how)
    model = kernels.emulate("onnxruntime-attention", q, k, v, fmt=fmt, **how)
    assert _identical(real, model) == 1.0


def test_attention_refuses_a_causal_mask_the_op_does_not_run():
    q, k, v = _inputs("fp32", 3, 2, 1, 12, 16)
    for run in (kernels.real, kernels.emulate):
        with pytest.raises(ValueError, match=r"onnxruntime-attention: q_offset: expected 11"):
            run("onnxruntime-attention", q, k, v, fmt="fp32", causal=True, q_offset="top-left")
