"""Sweeps of a real kernel: a grid's policy "kernel:NAME" runs fa_jax's model of
that kernel (fa_jax.kernels.emulate) for its flash column and reference attention
under the model's policy for its baseline, in the formats the kernel runs and on
the paper's attention only (fa_jax.studies.sweep.grid)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import skip_unmodelled, x64_enabled

from fa_jax import BF16, kernels, metrics
from fa_jax.attention import Blocks, reference_attention
from fa_jax.cli import main
from fa_jax.formats import custom
from fa_jax.inputs import make_inputs
from fa_jax.kernels.model import KernelModel
from fa_jax.presets import fa2_kernel, golden
from fa_jax.rounding import round_to
from fa_jax.studies.results import read_csv as read_rows
from fa_jax.studies.sweep import COMPARISONS, METRICS, Features, Grid, run_sweep
from fa_jax.studies.sweep.engine import pads
from fa_jax.studies.sweep.grid import policy_for


def test_policy_for_is_the_models_policy_in_native_formats_only():
    with pytest.raises(ValueError, match="natively"):
        policy_for("kernel:xla", custom(5, 7), 64, 32)
    skip_unmodelled("xla", BF16)
    assert policy_for("kernel:xla", BF16, 64, 32) == kernels.model("xla", BF16, 64, 32).policy


@pytest.mark.parametrize(
    "policy, kw, message",
    [
        ("kernel:nope", {}, "kernel"),
        ("kernel:cudnn", {}, "no CUDA GPU"),
        ("nope", {}, "kernel:NAME"),
        ("kernel:xla", {"formats": ("bf16", "e5m7")}, r"natively.*got formats \['e5m7'\]"),
        ("kernel:ggml", {"formats": ("fp64",)}, r"natively, \['fp32', 'fp16', 'bf16'\]"),
        ("kernel:xla", {"features": (Features(alibi=True),)}, "paper's attention.*alibi"),
    ],
)
def test_grid_rejects_what_a_kernel_entry_cannot_run(policy, kw, message):
    grid = dict(formats=("bf16",), seq_lens=(16,), blocks=(Blocks(8, 8),), policies=(policy,))
    with pytest.raises(ValueError, match=message):
        Grid(**{**grid, **kw})


def _direct(name, fmt, n, d, seed, batch=1, heads=1, causal=False):
    """The twelve values of one configuration from direct calls: the kernel's
    emulation, reference attention under its model's policy, the FP64 golden."""
    with x64_enabled():
        q, k, v = (
            np.asarray(round_to(t, fmt))
            for t in make_inputs(seed, n, batch=batch, heads=heads, d=d)
        )
        pol = kernels.model(name, fmt, n, d).policy
        outs = {
            "flash": kernels.emulate(name, q, k, v, fmt=fmt, causal=causal),
            "baseline": reference_attention(q, k, v, pol, causal=causal),
            "golden": reference_attention(q, k, v, golden(), causal=causal),
        }
        return {
            (c, m): float(getattr(metrics, m)(outs[c.split("_vs_")[0]], outs[c.split("_vs_")[1]]))
            for c in COMPARISONS
            for m in METRICS
        }


def _available(name, fmt=None):
    """Skip where the engine is absent, or its model refuses this CPU's code."""
    try:
        kernels.get(name)
    except (RuntimeError, ImportError) as err:  # an optional engine absent here
        pytest.skip(str(err))
    skip_unmodelled(name, fmt)


# ggml at 16 keys runs its scalar path (FP16 K and V, FP32 inputs stage: its baseline
# reads the FP16 inputs), torch-flash its own tiles (32 x 16), openvino-sdpa its BF16
# prefill where the CPU has BF16 dots (there equal to reference attention under its
# policy; None: it differs where the AVX2 build runs the hint in FP32, its policy's P
# stage then FP32); two lengths in one grid (a kernel grid runs unpadded) and two
# tilings (the kernel follows neither: rows repeat).
@pytest.mark.extended  # 40-55 s each on the shared 2-core host: the models' compiles
@pytest.mark.parametrize(
    "name, fmt, causal, differs",
    [
        ("ggml", "fp16", False, True),
        ("torch-flash", "bf16", True, True),
        ("openvino-sdpa", "bf16", False, None),
    ],
)
def test_kernel_rows_are_the_emulation_bitwise(name, fmt, causal, differs, tmp_path):
    _available(name, fmt)
    grid = Grid(
        formats=(fmt,),
        seq_lens=(12, 16),
        blocks=(Blocks(4, 4), Blocks(8, 8)),
        policies=(f"kernel:{name}",),
        heads=2,
        d=8,
        causal=causal,
    )
    assert not pads(grid) and pads(dataclasses.replace(grid, policies=("paper_uniform",)))
    rows = read_rows(run_sweep(grid, tmp_path, quiet=True))
    assert len(rows) == 2 * 2 * len(COMPARISONS) * len(METRICS)
    for n in grid.seq_lens:
        want = _direct(name, fmt, n, 8, 0, heads=2, causal=causal)
        for blocks in ("4x4", "8x8"):
            got = {
                (r["comparison"], r["metric"]): float(r["value"])
                for r in rows
                if (r["seq_len"], r["blocks"]) == (str(n), blocks)
            }
            assert got == want, (n, blocks)
    # the kernel's own order of steps against reference attention's
    diffs = [float(r["value"]) for r in rows if r["comparison"] == "flash_vs_baseline"]
    if differs is None:
        differs = kernels.model(name, fmt, 16, 8).policy.p != BF16
    assert any(x > 0 for x in diffs) == differs


def test_kernel_the_model_does_not_cover_is_refused_at_its_shape(tmp_path, monkeypatch):
    """A model that raises NotImplementedError at a shape (OpenVINO's F32 prefill at
    N mod 4 == 1, say) ends the sweep with a ValueError naming the shape."""
    from fa_jax.kernels import registry

    base = registry._lookup("ggml")  # its formats; a model of its own, on any CPU

    def model(fmt, n, d):
        def forward(q, k, v, **kw):
            raise NotImplementedError(f"N = {n} is not modelled")

        return KernelModel("odd", fa2_kernel(fmt), "reference", forward=forward)

    odd = dataclasses.replace(base, name="odd", model=model, unavailable=lambda: None)
    monkeypatch.setitem(registry._REGISTERED, "odd", odd)
    grid = Grid(
        formats=("bf16",), seq_lens=(5,), blocks=(Blocks(4, 4),), policies=("kernel:odd",), d=4
    )
    with pytest.raises(ValueError, match=r"kernel:odd: expected .* covers, got bfloat16 at N = 5"):
        run_sweep(grid, tmp_path, quiet=True)


@pytest.mark.extended  # about 10 s: the golden and baseline programs' compiles
def test_kernel_models_own_refusal_passes_through(tmp_path):
    """ONNX Runtime's MultiHeadAttention is not causal: its model's ValueError ends
    the sweep as it is."""
    _available("onnxruntime-mha", "fp32")
    grid = Grid(
        formats=("fp32",),
        seq_lens=(4,),
        blocks=(Blocks(4, 4),),
        policies=("kernel:onnxruntime-mha",),
        d=4,
        causal=True,
    )
    with pytest.raises(ValueError, match="causal: expected False"):
        run_sweep(grid, tmp_path, quiet=True)


ARGV = ["sweep", "--seq-lens", "16", "--blocks", "8x8", "--d", "4", "--seeds", "1"]


@pytest.mark.extended  # about 40 s on the shared 2-core host: XLA's probes, compiles
def test_cli_sweep_kernel_flag(tmp_path):
    skip_unmodelled("xla", BF16)
    out = tmp_path / "s"
    assert main([*ARGV, "--formats", "bf16", "--kernel", "xla", "--out", str(out), "--quiet"]) == 0
    rows = read_rows(out / "results.csv")
    assert {r["policy"] for r in rows} == {"kernel:xla"}
    want = _direct("xla", "bf16", 16, 4, 1)
    assert {(r["comparison"], r["metric"]): float(r["value"]) for r in rows} == want


def test_cli_sweep_kernel_flag_refusals(tmp_path, capsys):
    t = str(tmp_path / "t")
    assert main([*ARGV, "--formats", "e5m7", "--kernel", "xla", "--out", t]) == 2
    assert "--policies: kernel:xla runs the kernel's model" in capsys.readouterr().err
    assert main([*ARGV, "--formats", "bf16", "--kernel", "nope", "--out", t]) == 2
    assert "--kernel: expected one of" in capsys.readouterr().err
    assert main(["reproduce", "fig8", "--kernel", "xla", "--out", str(tmp_path / "r")]) == 2
