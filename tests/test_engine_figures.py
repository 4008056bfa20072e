"""The inference-engine study (fa_jax.studies.engine_figures): a shrunken grid runs end
to end; every available engine has its rows at the shapes its cases name, each the
mean over seeds of the CSV's rows; ggml's thread-count rows compare each count with
one thread; OpenVINO's rows order by their precision and KV cache."""

import csv
import math

import pytest
from host import cpu_flags, isa

from fa_jax.studies.engine_figures import (
    FULL,
    GGML_KV,
    OPENVINO_KV,
    OPENVINO_MAX_KEYS,
    OPENVINO_PRECISIONS,
    THREAD_KV,
    Check,
    EngineGrid,
    engine_cases,
    engines,
)
from fa_jax.studies.engine_figures import _unavailable as _reason  # the study's own rule

_GRID = EngineGrid(
    decode_keys=(512,),  # the smallest M of ggml's split-KV path
    prefill_lens=(64,),  # the smallest N of ggml's tiled path
    seeds=(0, 1),
    d=64,
    heads=2,
    presets=("fa2_kernel",),
)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return engines(tmp_path_factory.mktemp("engines"), quick=True, grid=_GRID, quiet=True)


@pytest.mark.extended  # the module's quick study: about 11 s of CPU
def test_rows_per_engine_and_shape_are_the_csv_means(result):
    with open(result["csv"]) as fh:
        raw = list(csv.DictReader(fh))
    cases = engine_cases(_GRID.presets)
    expected = {c.label for c in cases if _reason(c.engine) is None}
    assert {r["case"] for r in result["rows"]} == expected
    assert set(result["skipped"]) == {c.engine for c in cases if _reason(c.engine) is not None}
    for shape, n_q, m in _GRID.shapes():
        at = [r for r in result["rows"] if (r["shape"], r["n_q"], r["m"]) == (shape, n_q, m)]
        here = {c.label for c in cases if c.runs_at(shape, m)} & expected
        assert sorted(r["case"] for r in at) == sorted(here)
    for row in result["rows"]:
        assert row["seeds"] == 2
        for col in ("max_abs", "mean_rel", "max_abs_fp32in", "mean_rel_fp32in"):
            values = [
                float(r[col])
                for r in raw
                if (r["case"], r["shape"], int(r["m"])) == (row["case"], row["shape"], row["m"])
            ]
            assert len(values) == 2
            assert math.isfinite(row[col]) and row[col] > 0
            assert row[col] == pytest.approx(sum(values) / 2, rel=1e-12)
        if row["fmt"] == "fp32":  # one golden: the two references are the same
            assert row["max_abs"] == row["max_abs_fp32in"]


def _row(result, case, shape):
    return next(r for r in result["rows"] if (r["case"], r["shape"]) == (case, shape))


@pytest.mark.extended  # the module's quick study: about 11 s of CPU
def test_ggml_kv_types_order_by_their_precision(result):
    if _reason("ggml") is not None:
        pytest.skip(f"ggml: {_reason('ggml')}")
    assert {f"ggml {kv}" for kv in GGML_KV} <= {r["case"] for r in result["rows"]}
    for shape in ("decode", "prefill"):
        err = {kv: _row(result, f"ggml {kv}", shape)["mean_rel"] for kv in GGML_KV}
        # an F32 cache is FP32 arithmetic; Q4_0's 4-bit blocks cost most
        assert err["f32"] < 1e-5 < min(err[kv] for kv in ("f16", "bf16", "q8_0", "q4_0"))
        assert err["q4_0"] > 5 * err["q8_0"]


@pytest.mark.extended  # the module's quick study: about 11 s of CPU
def test_onnxruntime_fp16_costs_more_than_fp32(result):
    if _reason("onnxruntime-attention") is not None:
        pytest.skip(f"onnxruntime: {_reason('onnxruntime-attention')}")
    for shape in ("decode", "prefill"):
        fp32 = _row(result, "onnxruntime-attention fp32", shape)
        fp16 = _row(result, "onnxruntime-attention fp16", shape)
        assert fp32["mean_rel"] < 1e-5 < fp16["mean_rel"]
        # the FP16 inputs' own rounding counts against the FP32 inputs' golden
        assert fp16["mean_rel_fp32in"] > fp16["mean_rel"]


@pytest.mark.extended  # the module's quick study: about 11 s of CPU
def test_thread_rows_compare_with_one_thread(result):
    if _reason("ggml") is not None:
        pytest.skip(f"ggml: {_reason('ggml')}")
    rows = result["thread_rows"]
    assert {(r["kv_type"], r["m"], r["threads"]) for r in rows} == {
        (kv, m, t) for kv in THREAD_KV for m in _GRID.decode_keys for t in _GRID.threads
    }
    for r in rows:
        assert r["repeat"] is True  # one thread count, one result
        assert math.isfinite(r["max_abs"]) and r["max_abs"] > 0
        if r["threads"] == 1:
            assert (r["differing"], r["max_ulp"], r["max_diff"]) == (0, 0, 0.0)
    # more threads, more split-KV parts: the combined output's bits change
    assert all(r["differing"] > 0 for r in rows if r["threads"] > 1)
    with open(result["threads_csv"]) as fh:
        raw = list(csv.DictReader(fh))
    assert len(raw) == len(THREAD_KV) * len(_GRID.decode_keys) * len(_GRID.threads) * 2


@pytest.mark.extended  # the module's quick study: about 11 s of CPU
def test_figure_and_identity_file(result):
    assert result["png"].endswith("engines.png")
    with open(result["png"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(result["identity_csv"]) as fh:
        assert list(csv.DictReader(fh)) == []  # no points asked for


@pytest.mark.extended  # about 10 s: one emulation's compile
def test_identity_point_is_bit_identical(tmp_path):
    if _reason("ggml") is not None:
        pytest.skip(f"ggml: {_reason('ggml')}")
    from fa_jax.kernels import ggml

    if (refused := ggml.unmodelled("fp32", kv_type="f32")) is not None:
        pytest.skip(refused)
    grid = EngineGrid(
        decode_keys=(),
        prefill_lens=(),
        seeds=(0,),
        d=64,
        heads=2,
        threads=(),
        presets=(),
        checks=(Check("ggml", "fp32", 1, 512, (("kv_type", "f32"), ("threads", 2))),),
    )
    res = engines(tmp_path, quick=True, grid=grid, quiet=True)
    (row,) = res["identity_rows"]
    assert (row["elements"], row["identical"], row["max_ulp"]) == (128, 128, 0)
    assert row["identical_share"] == 1.0


# OpenVINO's BF16 inference takes the vdpbf16ps (or AMX) paths only with AVX-512 BF16
# (a CPU without it may run the hint in FP32), as tests/test_kernels_openvino.py.
def _openvino_bf16_reason() -> str | None:
    reason = _reason("openvino-sdpa")
    if reason is not None:
        return f"openvino-sdpa: {reason}"
    if isa() != "avx512" or "avx512_bf16" not in cpu_flags():
        return (
            "the OpenVINO model follows its AVX-512 BF16 kernels; this host: "
            f"{isa()}, avx512_bf16 {'avx512_bf16' in cpu_flags()}"
        )
    return None


def test_openvino_cases_per_precision_and_cache():
    cases = [c for c in engine_cases(()) if c.engine == "openvino-sdpa"]
    decode = {c.label for c in cases if c.runs_at("decode", OPENVINO_MAX_KEYS)}
    assert decode == {
        f"openvino-sdpa {p} cache {kv}" for p in OPENVINO_PRECISIONS for kv in OPENVINO_KV
    }
    assert not any(c.runs_at("decode", 2 * OPENVINO_MAX_KEYS) for c in cases)
    assert OPENVINO_MAX_KEYS >= max(FULL.decode_keys)  # the cache set as state: O(M)
    prefill = {c.label for c in cases if c.runs_at("prefill", 2048)}
    assert prefill == {f"openvino-sdpa {p}" for p in OPENVINO_PRECISIONS}
    assert all(c.fmt == "fp32" and dict(c.options)["threads"] == 1 for c in cases)


@pytest.mark.extended  # the module's quick study: about 11 s of CPU
def test_openvino_rows_order_by_precision_and_cache(result):
    reason = _openvino_bf16_reason()
    if reason is not None:
        pytest.skip(reason)
    err = {r["case"]: r["mean_rel"] for r in result["rows"] if r["engine"] == "openvino-sdpa"}
    # F32 inference on an F32 cache is FP32 arithmetic; BF16 inference rounds Q, K, V
    # (and its cache) to BF16; a u8 cache's quantisation costs more than BF16's rounding
    assert err["openvino-sdpa f32 cache f32"] < 1e-5 < err["openvino-sdpa bf16 cache bf16"]
    assert err["openvino-sdpa f32"] < 1e-5 < err["openvino-sdpa bf16"]
    for p in OPENVINO_PRECISIONS:
        assert err[f"openvino-sdpa {p} cache u8"] > 2 * err[f"openvino-sdpa {p} cache bf16"]
    # under BF16 inference the cache holds BF16 values whatever its precision
    assert err["openvino-sdpa bf16 cache f32"] == err["openvino-sdpa bf16 cache bf16"]


@pytest.mark.extended  # about 45 s on the shared 2-core host: the models' compiles
def test_openvino_identity_points_are_bit_identical(tmp_path):
    from fa_jax.kernels import openvino

    if (reason := _reason("openvino-sdpa")) is not None:
        pytest.skip(f"openvino-sdpa: {reason}")
    if (refused := openvino.unmodelled("fp32", precision="bf16")) is not None:
        pytest.skip(refused)
    checks = (
        Check("openvino-sdpa", "fp32", 1, 512, (("precision", "bf16"), ("kv_cache", "u8"))),
        Check("openvino-sdpa", "fp32", 64, 64, (("precision", "f32"),)),
    )
    grid = EngineGrid((), (), (0,), threads=(), d=64, heads=2, presets=(), checks=checks)
    rows = engines(tmp_path, quick=True, grid=grid, quiet=True)["identity_rows"]
    assert [(r["n_q"], r["elements"], r["identical"], r["max_ulp"]) for r in rows] == [
        (1, 128, 128, 0),
        (64, 64 * 128, 64 * 128, 0),
    ]


def test_grid_rejects_kernel_policies_and_a_first_count_other_than_one():
    with pytest.raises(ValueError, match="preset names"):
        EngineGrid((512,), (), (0,), presets=("kernel:ggml",))
    with pytest.raises(ValueError, match="expected 1 first"):
        EngineGrid((512,), (), (0,), threads=(2, 4))
    with pytest.raises(ValueError, match="n_q == m"):
        Check("ggml", "fp32", 4, 512)


@pytest.mark.extended  # 9 s: for the default run's time only
def test_absent_engines_are_skipped_with_their_reason(tmp_path, monkeypatch, capsys):
    import fa_jax.studies.engine_figures as ef

    real_get = ef.kernels.get

    def get(name):
        if name in ("ggml", "onnxruntime-attention", "onnxruntime-mha", "openvino-sdpa"):
            raise RuntimeError(f"kernel {name!r} is not available here: not installed")
        return real_get(name)

    monkeypatch.setattr(ef.kernels, "get", get)
    res = engines(tmp_path, quick=True, grid=_GRID, quiet=True)
    assert set(res["skipped"]) == {
        "ggml",
        "onnxruntime-attention",
        "onnxruntime-mha",
        "openvino-sdpa",
    }
    out = capsys.readouterr().out
    assert "engines: ggml rows skipped: kernel 'ggml' is not available here" in out
    assert {r["case"] for r in res["rows"]} == {"fa2_kernel bf16", "fa2_kernel fp16"}
    assert res["thread_rows"] == []
    assert not (tmp_path / "engines" / "threads.csv").exists()


@pytest.mark.extended  # 5 s: for the default run's time only
def test_a_killed_run_resumes_to_the_same_files(tmp_path, monkeypatch):
    """A run whose CSVs lost their last unit's rows (as a kill leaves them) runs only
    that unit again and writes the same bytes as the uninterrupted run."""
    from fa_jax.studies import engine_figures

    grid = EngineGrid(decode_keys=(512,), prefill_lens=(), seeds=(0, 1), d=32, heads=1, presets=())
    engines(tmp_path, quick=True, grid=grid, quiet=True)
    folder = tmp_path / "engines"
    whole = {name: (folder / name).read_bytes() for name in ("results.csv", "threads.csv")}
    rerun = {}
    for name in whole:  # seed 1's rows cut short: half of them kept
        lines = whole[name].decode().splitlines(keepends=True)
        seed = lines[0].split(",").index("seed")
        first = [line for line in lines[1:] if line.split(",")[seed] == "0"]
        second = [line for line in lines[1:] if line.split(",")[seed] == "1"]
        (folder / name).write_text("".join([lines[0], *first, *second[: len(second) // 2]]))
        rerun[name] = len(second)
    calls = []
    run_case = engine_figures._run_case
    monkeypatch.setattr(
        engine_figures, "_run_case", lambda c, *a: calls.append(c) or run_case(c, *a)
    )
    engines(tmp_path, quick=True, grid=grid, quiet=True)
    for name, data in whole.items():
        assert (folder / name).read_bytes() == data, name
    assert len(calls) == rerun["results.csv"] == len({c.label for c in calls})
