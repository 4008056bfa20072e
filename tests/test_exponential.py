"""fa_jax.exponential: the exp knob of a policy, and ATen's and YNNPACK's
vectorised FP32 exps emulated bit for bit.

The reference bits for ATen's come from PyTorch's own header (ATen/cpu/vec,
AVX2) compiled and run: ``Vectorized<float>::exp_u20``, ``::fexp_u20`` and
``::exp`` (Sleef's expf to 1 ulp) on the same FP32 inputs — the very
instruction sequence the kernels run.  The stored table is checked everywhere;
where g++ and PyTorch's headers are present, a slow test compiles the header
and checks thousands of inputs.  YNNPACK's bits were read from XLA's CPU
backend (jaxlib 0.10.2, AVX2 with FMA) running an exp inside a YNNPACK fusion;
tests/test_kernels_xla.py checks the model against that program live.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa_jax import BF16, FP32, ops
from fa_jax.exponential import (
    CORRECTLY_ROUNDED,
    EXP2,
    SLEEF_U10,
    TORCH_AVX2,
    YNNPACK,
    ExpModel,
    exp_models,
    exp_u20,
    fexp_u20,
    get_exp_model,
    register_exp_model,
    sleef_expf_u10,
    vectorised,
    ynnpack_exp,
)
from fa_jax.presets import fa2_kernel, torch_math
from fa_jax.softmax import safe_softmax

# (x, exp_u20(x), fexp_u20(x), Sleef expf u10(x)) as FP32 bit patterns.
TABLE = (
    (0x00000000, 0x3F800000, 0x3F7FFC80, 0x3F800000),
    (0x80000000, 0x3F800000, 0x3F7FFC80, 0x3F800000),
    (0x8DA24260, 0x3F800000, 0x3F7FFC80, 0x3F800000),
    (0xB3D6BF95, 0x3F7FFFFE, 0x3F7FFC80, 0x3F7FFFFE),
    (0xBE000000, 0x3F61EB50, 0x3F61EE80, 0x3F61EB51),
    (0xBF000000, 0x3F1B4597, 0x3F1B46C0, 0x3F1B4598),
    (0xBF317218, 0x3F000000, 0x3EFFFC80, 0x3F000000),
    (0xBF800000, 0x3EBC5AB3, 0x3EBC5780, 0x3EBC5AB2),
    (0xBFC00000, 0x3E647C3B, 0x3E647FC0, 0x3E647C3C),
    (0xC0000000, 0x3E0A9555, 0x3E0A9880, 0x3E0A9555),
    (0xC01CE275, 0x3DB07EEE, 0x3DB07BC0, 0x3DB07EEE),
    (0xC06C93A7, 0x3CCB3E28, 0x3CCB3D40, 0x3CCB3E28),
    (0xC0A59EDA, 0x3BB93962, 0x3BB93600, 0x3BB93962),
    (0xC10734AB, 0x396035E1, 0x39603900, 0x396035E1),
    (0xC1200000, 0x383E6BCF, 0x383E68C0, 0x383E6BCE),
    (0xC18A6666, 0x3303B967, 0x3303B980, 0x3303B967),
    (0xC2053333, 0x2778B2EC, 0x2778B340, 0x2778B2EA),
    (0xC2480000, 0x1B692BEC, 0x1B692F80, 0x1B692BEB),
    (0xC2A00000, 0x05BFECBE, 0x05BFE9C0, 0x05BFECBA),
    (0xC2AE0000, 0x00000000, 0x00B33340, 0x00B33687),
    (0xC2AEAC4F, 0x00000000, 0x007FFCC0, 0x00800026),
    (0xC2AEAC50, 0x00000000, 0x007FFC80, 0x007FFFE6),
    (0xC2AEAC57, 0x00000000, 0x00000000, 0x007FFE26),
    (0xC2B00000, 0x00000000, 0x00000000, 0x0041EDC4),
    (0xC2BF0000, 0x00000000, 0x00000000, 0x00000956),
    (0xC2CFCCCD, 0x00000000, 0x00000000, 0x00000001),
    (0xC2D00000, 0x00000000, 0x00000000, 0x00000000),
    (0xC2D03333, 0x00000000, 0x00000000, 0x00000000),
    (0xC2F00000, 0x00000000, 0x00000000, 0x00000000),
    (0xC3160000, 0x00000000, 0x00000000, 0x00000000),
    (0xFF800000, 0x00000000, 0x00000000, 0x00000000),
    (0x3E99999A, 0x3FACC82E, 0x3FACC540, 0x3FACC82C),
    (0x3F800000, 0x402DF855, 0x402DF580, 0x402DF854),
    (0x41200000, 0x46AC14EF, 0x46AC1200, 0x46AC14EE),
    (0x42B00000, 0x7EF882B3, 0x7EF88300, 0x7EF882B7),
    (0x42B16666, 0x7F7A37F8, 0x7F7A3780, 0x7F7A37FC),
    (0xC03520A3, 0x3D71B039, 0x3D71B2C0, 0x3D71B039),
    (0xC08339DD, 0x3C87A729, 0x3C87A980, 0x3C87A729),
    (0xC0118C68, 0x3DD2B29A, 0x3DD2B340, 0x3DD2B29B),
    (0xC06525EC, 0x3CE441E2, 0x3CE44540, 0x3CE441E3),
    (0xBF537D53, 0x3EE01F67, 0x3EE02280, 0x3EE01F68),
    (0xC1588D84, 0x35B1C21A, 0x35B1BEC0, 0x35B1C219),
    (0xBD1FCDAD, 0x3F763461, 0x3F7635C0, 0x3F763461),
    (0xC133CA31, 0x375D1CA9, 0x375D1F40, 0x375D1CAA),
    (0xC0134902, 0x3DCD0E96, 0x3DCD0E00, 0x3DCD0E97),
    (0xBF99DF98, 0x3E99E1E3, 0x3E99E380, 0x3E99E1E4),
    (0xC00A87E2, 0x3DEB1D7A, 0x3DEB2100, 0x3DEB1D7A),
    (0xBF9FD18D, 0x3E92E606, 0x3E92E900, 0x3E92E607),
    (0xC0665756, 0x3CE00AB5, 0x3CE00DC0, 0x3CE00AB5),
    (0xC0896F06, 0x3C5F7736, 0x3C5F7A40, 0x3C5F7737),
    (0xC0F12F1B, 0x3A0BB8A1, 0x3A0BBC00, 0x3A0BB8A1),
    (0xBF6366A6, 0x3ED29DDB, 0x3ED29E80, 0x3ED29DDC),
    (0xC1494254, 0x36672A55, 0x36672DC0, 0x36672A55),
    (0xC03C6124, 0x3D57CBF9, 0x3D57CDC0, 0x3D57CBFA),
    (0xBFB25DEF, 0x3E7E2A04, 0x3E7E27C0, 0x3E7E2A03),
    (0xC0623153, 0x3CEF0B95, 0x3CEF0E80, 0x3CEF0B95),
    (0xBE99B9D9, 0x3F3D9A53, 0x3F3D9740, 0x3F3D9A52),
    (0xBE75F328, 0x3F4956E3, 0x3F495580, 0x3F4956E3),
    (0xC09C9DD3, 0x3BF569B3, 0x3BF56B40, 0x3BF569B3),
    (0xC045DD25, 0x3D3A12E8, 0x3D3A0F80, 0x3D3A12E7),
    (0xC10C8AB0, 0x3920A07E, 0x3920A040, 0x3920A07D),
    (0xBFF3475F, 0x3E191063, 0x3E191200, 0x3E191063),
    (0xC005751C, 0x3DFE82F5, 0x3DFE8080, 0x3DFE82F5),
    (0xC09722FC, 0x3C11A030, 0x3C11A380, 0x3C11A031),
    (0xC006CB07, 0x3DF94153, 0x3DF94180, 0x3DF94153),
    (0xBDB59C0B, 0x3F6A46B7, 0x3F6A4A40, 0x3F6A46B7),
    (0xBF9628A2, 0x3E9E69E4, 0x3E9E6A40, 0x3E9E69E5),
    (0xC081D33A, 0x3C8DB93F, 0x3C8DBCC0, 0x3C8DB93F),
    (0xC0227DB1, 0x3DA1B153, 0x3DA1B0C0, 0x3DA1B152),
    (0xC0B2C310, 0x3B75AEF1, 0x3B75B080, 0x3B75AEF1),
    (0xBD07FF60, 0x3F77A3C4, 0x3F77A480, 0x3F77A3C4),
    (0xC0676172, 0x3CDC6EAC, 0x3CDC7140, 0x3CDC6EAD),
)

# (x, YNNPACK's exp(x)) as FP32 bit patterns: the inputs above, the overflow to inf
# (2^128) from 88.37627, the flush to zero below FLT_MIN, and a few around 0.
YNNPACK_TABLE = (
    (0x00000000, 0x3F800000),
    (0x80000000, 0x3F800000),
    (0x8DA24260, 0x3F800000),
    (0xB3D6BF95, 0x3F7FFFFE),
    (0xBE000000, 0x3F61EB51),
    (0xBF000000, 0x3F1B4598),
    (0xBF317218, 0x3F000000),
    (0xBF800000, 0x3EBC5AB2),
    (0xBFC00000, 0x3E647C3C),
    (0xC0000000, 0x3E0A9555),
    (0xC01CE275, 0x3DB07EEE),
    (0xC06C93A7, 0x3CCB3E28),
    (0xC0A59EDA, 0x3BB93962),
    (0xC10734AB, 0x396035E1),
    (0xC1200000, 0x383E6BCE),
    (0xC18A6666, 0x3303B967),
    (0xC2053333, 0x2778B2EA),
    (0xC2480000, 0x1B692BEB),
    (0xC2A00000, 0x05BFECBA),
    (0xC2AE0000, 0x00B33687),
    (0xC2AEAC4F, 0x00800026),
    (0xC2AEAC50, 0x00000000),
    (0xC2AEAC57, 0x00000000),
    (0xC2B00000, 0x00000000),
    (0xC2BF0000, 0x00000000),
    (0xC2CFCCCD, 0x00000000),
    (0xC2D00000, 0x00000000),
    (0xC2D03333, 0x00000000),
    (0xC2F00000, 0x00000000),
    (0xC3160000, 0x00000000),
    (0x3E99999A, 0x3FACC82C),
    (0x3F800000, 0x402DF854),
    (0x41200000, 0x46AC14EE),
    (0x42B00000, 0x7EF882B7),
    (0x42B16666, 0x7F800000),
    (0xC03520A3, 0x3D71B039),
    (0xC08339DD, 0x3C87A729),
    (0xC0118C68, 0x3DD2B29A),
    (0xC06525EC, 0x3CE441E3),
    (0xBF537D53, 0x3EE01F68),
    (0xC1588D84, 0x35B1C219),
    (0xBD1FCDAD, 0x3F763461),
    (0xC133CA31, 0x375D1CAA),
    (0xC0134902, 0x3DCD0E97),
    (0xBF99DF98, 0x3E99E1E4),
    (0xC00A87E2, 0x3DEB1D7A),
    (0xBF9FD18D, 0x3E92E607),
    (0xC0665756, 0x3CE00AB5),
    (0xC0896F06, 0x3C5F7737),
    (0xC0F12F1B, 0x3A0BB8A1),
    (0xBF6366A6, 0x3ED29DDC),
    (0xC1494254, 0x36672A55),
    (0xC03C6124, 0x3D57CBFA),
    (0xBFB25DEF, 0x3E7E2A03),
    (0xC0623153, 0x3CEF0B95),
    (0xBE99B9D9, 0x3F3D9A52),
    (0xBE75F328, 0x3F4956E3),
    (0xC09C9DD3, 0x3BF569B3),
    (0xC045DD25, 0x3D3A12E7),
    (0xC10C8AB0, 0x3920A07D),
    (0xBFF3475F, 0x3E191063),
    (0xC005751C, 0x3DFE82F5),
    (0xC09722FC, 0x3C11A031),
    (0xC006CB07, 0x3DF94153),
    (0xBDB59C0B, 0x3F6A46B7),
    (0xBF9628A2, 0x3E9E69E5),
    (0xC081D33A, 0x3C8DB93F),
    (0xC0227DB1, 0x3DA1B152),
    (0xC0B2C310, 0x3B75AEF1),
    (0xBD07FF60, 0x3F77A3C4),
    (0xC0676172, 0x3CDC6EAD),
    (0x42B0C0A5, 0x7F3504A4),
    (0x42B0C0A6, 0x7F800000),
    (0x42B17218, 0x7F800000),
    (0xC2AF5C29, 0x00000000),
    (0xC2B00F5C, 0x00000000),
    (0x33D6BF95, 0x3F800001),
    (0x3F000000, 0x3FD3094C),
)


def _f32(bits):
    return np.array(bits, np.uint32).view(np.float32).astype(np.float64)


def _bits(x):
    return np.asarray(x).astype(np.float32).view(np.uint32)


@pytest.mark.parametrize(
    "fn, column", [(exp_u20, 1), (fexp_u20, 2), (sleef_expf_u10, 3)], ids=["u20", "fexp", "sleef"]
)
def test_vector_exps_match_atens_bits(x64, fn, column):
    table = np.array(TABLE, np.uint32)
    got = _bits(jax.jit(fn)(jnp.asarray(_f32(table[:, 0]))))
    np.testing.assert_array_equal(got, table[:, column])


def test_ynnpack_exp_matches_xlas_bits(x64):
    table = np.array(YNNPACK_TABLE, np.uint32)
    got = _bits(jax.jit(ynnpack_exp)(jnp.asarray(_f32(table[:, 0]))))
    np.testing.assert_array_equal(got, table[:, 1])


def test_ynnpack_exp_edges_and_model(x64):
    """-inf is clamped (and flushed to 0), +inf overflows, NaN stays NaN; the
    model rounds to the stage's format."""
    y = np.asarray(jax.jit(ynnpack_exp)(jnp.asarray([-jnp.inf, jnp.inf, jnp.nan])))
    assert y[0] == 0 and y[1] == np.inf and np.isnan(y[2])
    x = jnp.asarray([-0.3, -2.0])
    np.testing.assert_array_equal(
        np.asarray(YNNPACK.fn(x, BF16)), np.asarray(ops.cast(ynnpack_exp(x), BF16))
    )


def test_edges(x64):
    """t = 0, underflow to 0 below ln FLT_MIN (-104 for Sleef), -inf gives 0."""
    x = jnp.asarray([0.0, -jnp.inf, -200.0])
    u20, fexp, sleef = (np.asarray(jax.jit(fn)(x)) for fn in (exp_u20, fexp_u20, sleef_expf_u10))
    assert u20[0] == 1.0 and sleef[0] == 1.0
    assert fexp[0] == 1 - 2.0**-14 + 2.0**-17  # fexp_u20(0) is not 1
    for y in (u20, fexp, sleef):
        assert (y[1:] == 0).all()


def test_vectorised_runs_the_scalar_exp_on_the_tail(x64):
    x = -jnp.linspace(0.0, 3.0, 13)
    got = np.asarray(jax.jit(lambda t: TORCH_AVX2.fn(t, FP32))(x))
    np.testing.assert_array_equal(got[:8], np.asarray(fexp_u20(x[:8])))
    np.testing.assert_array_equal(got[8:], np.asarray(ops.exp(x[8:], FP32)))
    assert vectorised("v", 4, exp_u20).fn(x, BF16).shape == x.shape


def test_policy_knob_default_and_hashable():
    p = fa2_kernel(BF16)
    assert p.exp_model is CORRECTLY_ROUNDED and p.normalise == "divide"
    q = p.replace(exp_model="sleef_expf_u10", normalise="reciprocal")
    assert q.exp_model is SLEEF_U10 and hash(q) != hash(p) and q != p
    assert "exp sleef_expf_u10" in q.describe() and "normalise by reciprocal" in q.describe()
    leaves, tree = jax.tree_util.tree_flatten(q)
    assert jax.tree_util.tree_unflatten(tree, leaves) == q
    with pytest.raises(ValueError, match=r"Policy\.normalise"):
        p.replace(normalise="multiply")


def test_exp_model_changes_softmax_only_through_the_knob(x64):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 40)))
    base = torch_math(BF16).replace(p=FP32)  # P in FP32: the exp's last bits show
    np.testing.assert_array_equal(
        safe_softmax(x, base), safe_softmax(x, base.replace(exp_model=CORRECTLY_ROUNDED))
    )
    assert not np.array_equal(
        safe_softmax(x, base), safe_softmax(x, base.replace(exp_model=TORCH_AVX2))
    )


def test_registry():
    names = {"correctly_rounded", "torch_fexp_u20_avx2", "sleef_expf_u10", "ynnpack"}
    assert names <= set(exp_models()) and get_exp_model("ynnpack") is YNNPACK
    assert get_exp_model("sleef_expf_u10") is SLEEF_U10 and get_exp_model(SLEEF_U10) is SLEEF_U10
    with pytest.raises(ValueError, match="exp model"):
        get_exp_model("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_exp_model(ExpModel("sleef_expf_u10", lambda x, fmt: x))
    with pytest.raises(TypeError):
        register_exp_model("sleef")  # pyright: ignore[reportArgumentType]


def test_base_2_model(x64):
    assert get_exp_model("exp2_correctly_rounded") is EXP2 and EXP2.base == "2"
    assert CORRECTLY_ROUNDED.base == "e"
    x = jnp.array([-3.0, 0.0, 0.5])
    np.testing.assert_array_equal(EXP2.fn(x, FP32), ops.exp2(x, FP32))
    with pytest.raises(ValueError, match=r"ExpModel\.base"):
        ExpModel("exp10", lambda x, fmt: x, base="10")


_PROGRAM = r"""
#include <ATen/cpu/vec/vec.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
int main() {
  using Vec = at::vec::Vectorized<float>;
  constexpr int L = Vec::size();
  uint32_t in[L];
  float x[L], a[L], b[L], c[L];
  while (std::fread(in, 4, L, stdin) == (size_t)L) {
    std::memcpy(x, in, sizeof x);
    Vec v = Vec::loadu(x);
    v.exp_u20().store(a);
    v.fexp_u20().store(b);
    v.exp().store(c);
    for (int i = 0; i < L; ++i) {
      uint32_t u[3];
      std::memcpy(&u[0], &a[i], 4); std::memcpy(&u[1], &b[i], 4); std::memcpy(&u[2], &c[i], 4);
      std::printf("%08x %08x %08x\n", u[0], u[1], u[2]);
    }
  }
}
"""


@pytest.mark.slow
def test_against_the_compiled_header(x64, tmp_path):
    """Compile ATen's vec header (AVX2) and compare on thousands of inputs."""
    torch = pytest.importorskip("torch")
    gxx = shutil.which("g++")
    root = pathlib.Path(torch.__file__).parent
    if gxx is None or not (root / "include" / "ATen" / "cpu" / "vec" / "vec.h").exists():
        pytest.skip("needs g++ and PyTorch's C++ headers")
    source, binary = tmp_path / "exps.cpp", tmp_path / "exps"
    source.write_text(_PROGRAM)
    lib = root / "lib"
    flags = [
        "-O2",
        "-std=c++17",
        "-mavx2",
        "-mfma",
        "-DCPU_CAPABILITY_AVX2",
        "-DCPU_CAPABILITY=AVX2",
    ]
    link = [f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    cmd = [gxx, *flags, f"-I{root / 'include'}", str(source), "-o", str(binary), *link]
    subprocess.run(cmd, check=True, capture_output=True)
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [-rng.exponential(3.0, 8000), -rng.uniform(0, 110, 4000), rng.uniform(-1e-3, 1e-3, 400)]
    ).astype(np.float32)
    out = subprocess.run([str(binary)], input=x.tobytes(), capture_output=True, check=True)
    want = np.array([int(w, 16) for w in out.stdout.split()], np.uint32).reshape(-1, 3)
    xs = jnp.asarray(x.astype(np.float64))
    for column, fn in enumerate((exp_u20, fexp_u20, sleef_expf_u10)):
        np.testing.assert_array_equal(_bits(jax.jit(fn)(xs)), want[:, column])
