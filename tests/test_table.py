"""fa_jax.studies.table: the one table printer."""

import pytest

from fa_jax.studies.table import format_table, print_table


def test_layout_alignment_and_float_format():
    text = format_table(
        ("name", "n", "value"),
        [{"name": "a", "n": 10, "value": 0.000123456}, ("long name", 2, 3.0)],
        right=("n",),
        title="T",
    )
    assert text.splitlines() == [
        "T",
        "name        n  value",
        "a          10  0.000123",
        "long name   2  3",
    ]


def test_float_format_strings_and_empty_tables():
    assert format_table(("x",), [(1 / 3,)], float_format=".2e").splitlines()[1] == "3.33e-01"
    assert format_table(("x", "y"), []) == "x  y"
    assert format_table(("x",), [("-",)]).splitlines()[1] == "-"


def test_errors_say_what_was_expected():
    with pytest.raises(ValueError, match=r"expected 2 cells, got \[1\]"):
        format_table(("a", "b"), [(1,)])
    with pytest.raises(ValueError, match=r"right: expected names from \['a'\], got \['b'\]"):
        format_table(("a",), [], right=("b",))


def test_print_table(capsys):
    print_table(("a",), [(1,)], title="title")
    assert capsys.readouterr().out == "\ntitle\na\n1\n"
    print_table(("a",), [(1,)])
    assert capsys.readouterr().out == "a\n1\n"
