"""fa_jax.studies.profile: the --profile table."""

import pytest

from fa_jax.studies.profile import Profile


def test_table_lists_programs_by_time_then_phases_and_totals():
    p = Profile()
    p.prepared("flash fa2 Bc=64", "compiled", 1.5)
    p.ran("flash fa2 Bc=64", 0.25)
    p.ran("flash fa2 Bc=64", 0.25)
    p.prepared("golden", "loaded", 0.1)
    p.ran("golden", 0.2)
    p.prepared("baseline", "compiled", 0.05)  # one label, two programs (two shapes)
    p.prepared("baseline", "loaded", 0.05)
    p.add_phase("metrics", 0.4)
    p.add_phase("metrics", 0.1)
    lines = p.table().splitlines()
    assert lines[0].split() == ["program", "source", "calls", "prepare", "s", "run", "s"]
    assert lines[1].split()[-4:] == ["compiled", "2", "1.50", "0.50"]
    assert lines[2].split() == ["golden", "loaded", "1", "0.10", "0.20"]
    assert lines[3].split() == ["baseline", "mixed", "0", "0.10", "0.00"]
    assert lines[4].split() == ["metrics", "0.50"]
    assert lines[5].split()[:3] == ["total", "1.70", "1.20"]
    assert "(2 compiled, 2 loaded)" in lines[5]


def test_call_profile_splits_calls_into_trace_compile_and_the_rest():
    import jax
    import jax.numpy as jnp

    from fa_jax.studies.profile import CallProfile

    p = CallProfile()
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    with p.call("first"):
        f(jnp.arange(7.0)).block_until_ready()  # traced and compiled here
    with p.call("again"):
        f(jnp.arange(7.0)).block_until_ready()  # cached: neither
    first, again = p.calls["first"], p.calls["again"]
    assert first.calls == again.calls == 1
    assert first.trace_s > 0 and first.compile_s > 0
    assert first.trace_s + first.compile_s <= first.total_s
    assert again.trace_s == again.compile_s == 0.0
    lines = p.table(total_s=first.total_s + again.total_s + 1.0).splitlines()
    assert lines[0].split()[:2] == ["call", "calls"]
    assert [ln.split()[0] for ln in lines[1:]] == ["first", "again", "outside", "total"]
    assert lines[3].split()[-1] == "1.00"


def test_registry_times_real_and_model_calls_while_active():
    import numpy as np

    from fa_jax import presets
    from fa_jax.formats import get_format
    from fa_jax.kernels import registry
    from fa_jax.kernels.model import Kernel, KernelModel
    from fa_jax.studies.profile import CallProfile

    bf16 = get_format("bf16")
    toy = Kernel(
        name="toy-profile",
        description="q itself",
        real=lambda q, k, v, **_: q,
        model=lambda fmt, n, d: KernelModel(
            "toy-profile", presets.fa2_kernel(bf16), "reference", forward=lambda q, k, v, **_: q
        ),
        unavailable=lambda: None,
        platform=dict,
    )
    registry.register(toy)
    q = np.ones((1, 4, 8))
    p = CallProfile()
    try:
        with registry.timed_calls(p.call):
            registry.real("toy-profile", q, q, q, fmt="bf16")
            registry.emulate("toy-profile", q, q, q, fmt="bf16")
            registry.emulate("toy-profile", q, q, q, fmt="bf16")
        registry.real("toy-profile", q, q, q, fmt="bf16")  # no longer timed
    finally:
        registry._REGISTERED.pop("toy-profile")
    assert {k: c.calls for k, c in p.calls.items()} == {
        "toy-profile real": 1,
        "toy-profile model": 2,
    }


@pytest.mark.slow
def test_validate_profile_times_each_kernel_call(capsys):
    from helpers import skip_unmodelled

    from fa_jax.cli import main

    skip_unmodelled("xla", "bf16")

    rc = main(
        "validate --kernel xla --format bf16 --heads 1 --n 16 --d 8 --no-presets --profile".split()
    )
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    labels = [line.split()[0] for line in err]
    assert labels[:1] == ["call"] and {"xla", "outside", "total"} <= set(labels)
    rows = {" ".join(line.split()[:2]): line.split() for line in err[1:3]}
    assert set(rows) == {"xla real", "xla model"}
    assert all(row[2] == "1" for row in rows.values())  # one seed: one call each
