"""fa_jax.studies.profile: the --profile table."""

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
