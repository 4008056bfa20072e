"""fa_jax.studies.train: data order, the model under fa_jax attention, train steps, checkpoints,
resume, and the fig8 weight-drift study.

Every training test uses one tiny configuration (1 layer, d_model 32, context 16,
batch 2) derived from ``TINY``, so the three compiled train steps (baseline FP32,
flash FP32, baseline BF16) are shared by all tests through the step cache.
"""

import csv
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa_jax import Blocks, golden
from fa_jax.studies.train import study
from fa_jax.studies.train.attention_layer import AttentionSpec, float64_attention_vjp
from fa_jax.studies.train.data import MarkovData
from fa_jax.studies.train.loop import (
    RunSpec,
    advance,
    init_state,
    load_checkpoint,
    save_checkpoint,
    train_step,
)
from fa_jax.studies.train.model import forward, init_params, param_shapes
from fa_jax.studies.train.precision import COMPILER_OPTIONS, FP16_MIXED, LossScale, cast

TINY = dict(
    vocab=16,
    context=16,
    d_model=32,
    n_heads=2,
    n_layers=1,
    d_ff=64,
    batch=2,
    steps=3,
    record_every=1,
    warmup=2,
    br=4,
    bc=4,
)
CFG = dataclasses.replace(study.QUICK, **TINY)
POLICIES = ("paper_uniform",)
RUNS, PAIRS = CFG.runs(POLICIES)
BASELINE, FLASH, SEED, LOWP = RUNS
MODEL, DATA, OPTIM = CFG.model(), CFG.data(), CFG.optim()


def _leaves(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def _bits_equal(a, b):
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b)
    )


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# -- data ----------------------------------------------------------------------


def test_data_order_is_a_pure_function_of_seed_and_step():
    data = MarkovData(vocab=16, context=32, batch=3, seed=5)
    b = data.batch_at(7)
    assert b.dtype == np.int32 and b.shape == (3, 33)
    assert np.array_equal(b, MarkovData(vocab=16, context=32, batch=3, seed=5).batch_at(7))
    assert np.array_equal(b, data.batch_at(7, data.table()))
    assert not np.array_equal(b, data.batch_at(8))
    assert not np.array_equal(b, dataclasses.replace(data, seed=6).batch_at(7))
    successors, _ = data.table()
    assert b.min() >= 0 and b.max() < 16
    for row in b:  # every token after the first two follows the chain
        assert all(row[i] in successors[row[i - 1]] for i in range(2, len(row)))
    assert 0 < data.entropy_rate_bound() < np.log(data.branching)


def test_data_rejects_bad_arguments():
    with pytest.raises(ValueError, match="branching: expected at most vocab=4, got 5"):
        MarkovData(vocab=4, branching=5)
    with pytest.raises(ValueError, match="step: expected a non-negative integer, got -1"):
        MarkovData().batch_at(-1)


# -- the attention layer and the model ------------------------------------------


def test_forward_under_golden_reference_and_flash_agree(x64):
    params = init_params(MODEL, 0)
    tokens = jnp.asarray(DATA.batch_at(0)[:, :-1])
    run = jax.jit(forward, static_argnums=(2, 3, 4), static_argnames="return_activations")
    ref, acts = run(
        params,
        tokens,
        MODEL,
        AttentionSpec("reference", golden()),
        jnp.float32,
        return_activations=True,
    )
    fl = run(params, tokens, MODEL, AttentionSpec("flash", golden(), Blocks(4, 4)), jnp.float32)
    assert ref.dtype == jnp.float32 and ref.shape == (2, 16, 16)
    assert acts["layer0.attn_out"].dtype == jnp.float32
    assert float(jnp.max(jnp.abs(fl - ref)) / jnp.max(jnp.abs(ref))) <= 1e-12
    # the attention layer itself, on float64 carriers, agrees to 1e-12 relative
    q, k, v = np.random.default_rng(0).standard_normal((3, 2, 2, 16, 8))
    o_ref = AttentionSpec("reference", golden())(q, k, v)
    o_fl = AttentionSpec("flash", golden(), Blocks(4, 4))(q, k, v)
    assert np.max(np.abs(o_fl - o_ref)) / np.max(np.abs(o_ref)) <= 1e-12


def _plain_causal_attention(q, k, v):
    n = q.shape[-2]
    s = jnp.einsum("...id,...jd->...ij", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("...ij,...jd->...id", jax.nn.softmax(s, axis=-1), v)


def test_float64_backward_is_the_gradient_of_attention(x64):
    q, k, v, d_o = np.random.default_rng(1).standard_normal((4, 2, 12, 8))
    spec = AttentionSpec("reference", golden(), backward="float64")

    @jax.jit
    def grads(q, k, v, d_o):
        o, vjp = jax.vjp(_plain_causal_attention, q, k, v)
        return vjp(d_o), float64_attention_vjp(q, k, v, o, d_o), jax.vjp(spec, q, k, v)[1](d_o)

    want, got, layer = grads(q, k, v, d_o)
    for g, lg, w in zip(got, layer, want):  # the formula, and golden forward + formula
        assert float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) <= 1e-12
        assert float(jnp.max(jnp.abs(lg - w)) / jnp.max(jnp.abs(w))) <= 1e-12


def test_attention_spec_rejects_bad_arguments():
    with pytest.raises(ValueError, match="flash attention needs blocks=Blocks"):
        AttentionSpec("flash", golden())
    with pytest.raises(
        ValueError, match="kind: expected one of \\('reference', 'flash'\\), got 'fast'"
    ):
        AttentionSpec("fast", golden())
    with pytest.raises(ValueError, match="backward: expected one of"):
        AttentionSpec("reference", golden(), backward="auto")


# -- training steps --------------------------------------------------------------


def test_train_step_is_bitwise_deterministic_and_keeps_float32_state(x64):
    state = init_state(BASELINE, MODEL, OPTIM)
    tokens = DATA.batch_at(0)
    s1, loss1 = train_step(state, tokens, BASELINE, MODEL, OPTIM)
    s2, loss2 = train_step(state, tokens, BASELINE, MODEL, OPTIM)
    assert _bits_equal(_leaves(s1), _leaves(s2)) and float(loss1) == float(loss2)
    assert int(s1.step) == 1 and loss1.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in s1.params.values())
    assert {x.dtype for x in jax.tree_util.tree_leaves(s1.opt_state)} <= {
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.int32),
    }
    assert not _bits_equal(_leaves(s1.params), _leaves(state.params))  # it trained


def test_low_precision_run_computes_in_bf16(x64):
    params = init_params(MODEL, 0)
    tokens = jnp.asarray(DATA.batch_at(0)[:, :-1])
    assert LOWP.precision.dtype == jnp.bfloat16 and LOWP.attention == BASELINE.attention
    logits, acts = jax.eval_shape(
        lambda p, t: forward(p, t, MODEL, LOWP.attention, jnp.bfloat16, return_activations=True),
        params,
        tokens,
    )
    assert logits.dtype == jnp.bfloat16
    assert {a.dtype for a in acts.values()} == {jnp.dtype(jnp.bfloat16)}
    # one step: another loss and other weights than FP32's; float32 master weights
    state = init_state(LOWP, MODEL, OPTIM)
    lo, loss_lo = train_step(state, DATA.batch_at(0), LOWP, MODEL, OPTIM)
    hi, loss_hi = train_step(state, DATA.batch_at(0), BASELINE, MODEL, OPTIM)
    assert float(loss_lo) != float(loss_hi)
    assert all(p.dtype == jnp.float32 for p in lo.params.values())
    assert not _bits_equal(_leaves(lo.params), _leaves(hi.params))


def test_train_step_compile_options_keep_every_bf16_rounding():
    """By default XLA may compute a bf16 chain that ends in a float32 cast in float32
    (LayerNorm and the loss do cast to float32); COMPILER_OPTIONS forbid it, so the
    jitted chain equals numpy + ml_dtypes rounding after every operation."""
    import ml_dtypes

    a, b, c = np.random.default_rng(0).standard_normal((3, 4096)).astype(np.float32)
    bf = jnp.bfloat16

    def chain(a, b, c):
        return cast(cast(a, bf) * cast(b, bf) + cast(c, bf), jnp.float32)

    lo = [x.astype(ml_dtypes.bfloat16) for x in (a, b, c)]
    want = (lo[0] * lo[1] + lo[2]).astype(np.float32)
    got = np.asarray(jax.jit(chain, compiler_options=COMPILER_OPTIONS)(a, b, c))
    assert got.tobytes() == want.tobytes()


def test_loss_scale_halves_and_skips_on_overflow_and_grows_when_stable():
    ls = LossScale.init(FP16_MIXED)
    assert float(ls.scale) == 2.0**15
    down = ls.adjust(jnp.asarray(False), FP16_MIXED)
    assert (float(down.scale), int(down.good_steps)) == (2.0**14, 0)
    p = dataclasses.replace(FP16_MIXED, growth_interval=2)
    one = ls.adjust(jnp.asarray(True), p)
    two = one.adjust(jnp.asarray(True), p)
    assert (float(one.scale), int(one.good_steps)) == (2.0**15, 1)
    assert (float(two.scale), int(two.good_steps)) == (2.0**16, 0)


@pytest.mark.slow
def test_fp16_step_with_an_overflowing_scale_is_skipped(x64):
    run = RunSpec(
        "fp16", BASELINE.attention, dataclasses.replace(FP16_MIXED, loss_scale=2.0**100), 0
    )
    state = init_state(run, MODEL, OPTIM)
    new, loss = train_step(state, DATA.batch_at(0), run, MODEL, OPTIM)
    assert np.isfinite(float(loss))
    assert _bits_equal(_leaves(new.params), _leaves(state.params))
    assert float(new.loss_scale.scale) == 2.0**99 and int(new.step) == 1


@pytest.mark.extended  # 7 s
def test_checkpoint_resume_equals_an_uninterrupted_run(x64, tmp_path):
    table = DATA.table()
    straight, straight_losses = init_state(FLASH, MODEL, OPTIM), []
    straight = advance(straight, straight_losses, 3, FLASH, MODEL, OPTIM, DATA, table)
    part, losses = init_state(FLASH, MODEL, OPTIM), []
    part = advance(part, losses, 1, FLASH, MODEL, OPTIM, DATA, table)
    save_checkpoint(tmp_path / "run.npz", part, losses)
    part, losses = load_checkpoint(tmp_path / "run.npz", init_state(FLASH, MODEL, OPTIM))
    part = advance(part, losses, 3, FLASH, MODEL, OPTIM, DATA, table)
    assert _bits_equal(_leaves(part), _leaves(straight)) and losses == straight_losses
    other = dataclasses.replace(MODEL, d_ff=32)
    with pytest.raises(ValueError, match=r"leaf \d+: expected float32\[32, 32\], got float32"):
        load_checkpoint(tmp_path / "run.npz", init_state(FLASH, other, OPTIM))


# -- the study -------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("fig8")
    return out, study.fig8(out, quick=True, policies=POLICIES, grid_overrides=TINY, quiet=True)


def test_fig8_writes_csv_metadata_summary_and_plot(uninterrupted, capsys):
    out, res = uninterrupted
    folder = out / "fig8"
    rows = _rows(res["csv"])
    names = [*param_shapes(MODEL), "overall"]
    want = {
        (str(s), p, n, m)
        for s in range(4)
        for _, p, _, _ in PAIRS
        for n in names
        for m in study.METRICS
    }
    want |= {
        (str(s), p, "loss", m)
        for s in range(4)
        for _, p, _, _ in PAIRS
        for m in ("loss_a", "loss_x")
    }
    got = [(r["step"], r["pair"], r["param"], r["metric"]) for r in rows]
    assert len(got) == len(set(got)) and set(got) == want
    assert {r["policy"] for r in rows} == set(POLICIES)
    value = {(r["step"], r["pair"], r["param"], r["metric"]): float(r["value"]) for r in rows}
    assert value[("0", "flash", "overall", "max_abs_diff")] == 0.0  # same initialisation
    assert value[("0", "seed", "overall", "max_abs_diff")] > 0.0
    assert value[("3", "flash", "overall", "max_abs_diff")] > 0.0  # the algorithms differ
    assert value[("3", "lowp", "overall", "wasserstein_1d")] > 0.0
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["config"] == dataclasses.asdict(CFG) and meta["backend"] == jax.default_backend()
    assert [r["name"] for r in meta["runs"]] == [r.name for r in RUNS]
    summary = json.loads((folder / "summary.json").read_text())
    assert {r["ratio"] for r in summary["ratios"]} == {"lowp/flash", "seed/flash"}
    assert len(_rows(folder / "losses.csv")) == 3 * len(RUNS)
    with open(res["png"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_resume_after_an_interruption_equals_the_uninterrupted_study(
    uninterrupted, tmp_path, monkeypatch
):
    out, _ = uninterrupted
    real_save = study.save_checkpoint

    def crash_once(path, state, losses):  # the 2nd run dies before its step-2 checkpoint
        if path.stem == FLASH.name and int(state.step) == 2:
            raise KeyboardInterrupt
        real_save(path, state, losses)

    monkeypatch.setattr(study, "save_checkpoint", crash_once)
    with pytest.raises(KeyboardInterrupt):
        study.run_study(CFG, tmp_path, policies=POLICIES, quiet=True)
    assert {int(r["step"]) for r in _rows(tmp_path / "results.csv")} == {0, 1}
    monkeypatch.setattr(study, "save_checkpoint", real_save)
    study.run_study(CFG, tmp_path, policies=POLICIES, quiet=True)
    for name in ("results.csv", "losses.csv"):
        assert (tmp_path / name).read_bytes() == (out / "fig8" / name).read_bytes()
    for run in RUNS:
        like = init_state(run, MODEL, OPTIM)
        a, la = load_checkpoint(tmp_path / "checkpoints" / f"{run.name}.npz", like)
        b, lb = load_checkpoint(out / "fig8" / "checkpoints" / f"{run.name}.npz", like)
        assert _bits_equal(_leaves(a), _leaves(b)) and la == lb
    # a finished study re-run computes nothing and changes nothing
    before = (tmp_path / "results.csv").read_bytes()
    study.run_study(CFG, tmp_path, policies=POLICIES, quiet=True)
    assert (tmp_path / "results.csv").read_bytes() == before


def test_a_folder_with_another_configuration_is_not_resumed(uninterrupted):
    out, _ = uninterrupted
    with pytest.raises(ValueError, match="holds a study with another configuration"):
        study.run_study(dataclasses.replace(CFG, lr=1e-2), out / "fig8", policies=POLICIES)


def test_study_config_rejects_bad_arguments():
    with pytest.raises(
        ValueError, match=r"low_precision: expected one of \('bf16', 'fp16'\), got 'fp32'"
    ):
        dataclasses.replace(CFG, low_precision="fp32")
    with pytest.raises(ValueError, match="other_seed must differ from init_seed"):
        dataclasses.replace(CFG, other_seed=CFG.init_seed)
    assert CFG.record_steps() == [0, 1, 2, 3]
    assert dataclasses.replace(CFG, steps=25, record_every=10).record_steps() == [0, 10, 20, 25]


def test_reproduce_dispatches_fig8_and_keeps_it_out_of_all(monkeypatch, tmp_path):
    from fa_jax.cli import build_parser
    from fa_jax.studies import reproduce as rp

    calls = []

    def fake_fig8(out, **kw):
        calls.append(kw)
        return {"csv": "c", "png": "p"}

    monkeypatch.setattr(study, "fig8", fake_fig8)
    assert rp.reproduce("fig8", tmp_path, quick=True, policies=["fa2_kernel"]) == {
        "fig8": {"csv": "c", "png": "p"}
    }
    assert calls == [{"quick": True, "policies": ("fa2_kernel",), "quiet": False}]
    assert "fig8" not in rp.FIGURES
    assert build_parser().parse_args(["reproduce", "fig8", "--quick"]).figure == "fig8"
