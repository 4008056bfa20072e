"""fa_jax._checks: every argument check accepts what it should, rejects the rest,
and says what it expected and what it got."""

import math

import numpy as np
import pytest

from fa_jax import _checks as C

NOT_INTS = [1.0, 2.5, "3", None, True, False, np.bool_(True), np.float64(2.0), [1], math.nan]


@pytest.mark.parametrize("v", [0, 1, -3, 10**20, np.int8(4), np.int64(-1), np.uint16(9)])
def test_is_int_accepts_python_and_numpy_integers(v):
    assert C.is_int(v)


@pytest.mark.parametrize("v", NOT_INTS)
def test_is_int_rejects_bools_floats_and_others(v):
    assert not C.is_int(v)


@pytest.mark.parametrize("v", [1, 7, 10**20, np.int32(3), np.uint8(1)])
def test_positive_int_accepts(v):
    got = C.positive_int(v, "n")
    assert got == v and type(got) is int


@pytest.mark.parametrize("v", [0, -1, np.int64(0), *NOT_INTS])
def test_positive_int_rejects(v):
    with pytest.raises(ValueError) as info:
        C.positive_int(v, "Grid.seq_lens")
    assert str(info.value) == f"Grid.seq_lens: expected a positive integer, got {v!r}"


@pytest.mark.parametrize("v", [0, 1, 10**20, np.int64(0), np.uint8(5)])
def test_non_negative_int_accepts(v):
    got = C.non_negative_int(v, "seed")
    assert got == v and type(got) is int


@pytest.mark.parametrize("v", [-1, np.int64(-5), *NOT_INTS])
def test_non_negative_int_rejects(v):
    with pytest.raises(ValueError) as info:
        C.non_negative_int(v, "--seed")
    assert str(info.value) == f"--seed: expected a non-negative integer, got {v!r}"


def test_positive_ints_accepts_any_iterable():
    assert C.positive_ints([1, np.int64(2), 3], "lens") == (1, 2, 3)
    assert C.positive_ints((n for n in (4, 5)), "lens") == (4, 5)
    assert C.positive_ints([], "lens") == ()
    assert all(type(v) is int for v in C.positive_ints([np.int32(7)], "lens"))


@pytest.mark.parametrize("bad", [0, -2, True, 1.0, "4", None])
def test_positive_ints_rejects_and_shows_the_sequence(bad):
    values = [1, bad, 3]
    with pytest.raises(ValueError) as info:
        C.positive_ints(values, "Grid.seq_lens")
    assert str(info.value) == (
        f"Grid.seq_lens: expected positive integers, got {bad!r} in {tuple(values)!r}"
    )


def test_non_negative_ints():
    assert C.non_negative_ints([0, np.int64(2)], "seeds") == (0, 2)
    assert C.non_negative_ints(iter([5]), "seeds") == (5,)
    for bad in (-1, False, 0.0, None):
        with pytest.raises(ValueError) as info:
            C.non_negative_ints([0, bad], "--seeds")
        assert str(info.value) == (
            f"--seeds: expected non-negative integers, got {bad!r} in {(0, bad)!r}"
        )


@pytest.mark.parametrize("v", [1, 0.5, 1e-300, 1e300, np.float32(2.5), np.int64(3), np.float64(7)])
def test_positive_number_accepts(v):
    got = C.positive_number(v, "scale")
    assert got == float(v) and type(got) is float


@pytest.mark.parametrize(
    "v",
    [
        0,
        0.0,
        -0.0,
        -1,
        -1e-300,
        math.nan,
        math.inf,
        -math.inf,
        np.float64(math.nan),
        np.float32(math.inf),
        True,
        False,
        np.bool_(True),
        "1",
        None,
        [1.0],
        1 + 0j,
    ],
)
def test_positive_number_rejects(v):
    with pytest.raises(ValueError) as info:
        C.positive_number(v, "--lr")
    assert str(info.value) == f"--lr: expected a positive finite number, got {v!r}"


def test_one_of_accepts():
    assert C.one_of("fa2", ("fa1", "fa2"), "variant") == "fa2"
    assert C.one_of(3, [1, 3], "k") == 3
    assert C.one_of(None, (None, "x"), "mode") is None


@pytest.mark.parametrize("v", ["fa3", "", 2, None, ["fa1"], ("fa1",)])
def test_one_of_rejects(v):
    with pytest.raises(ValueError) as info:
        C.one_of(v, ["fa1", "fa2"], "flash_attention: variant")
    assert str(info.value) == (
        f"flash_attention: variant: expected one of ('fa1', 'fa2'), got {v!r}"
    )


def test_one_of_does_not_raise_type_errors_for_unhashable_values():
    with pytest.raises(ValueError, match="expected one of"):
        C.one_of({"a": 1}, ("a",), "what")


def test_broadcasts_to_is_numpys_rule_onto_the_target_itself():
    broadcasts_to = C.broadcasts_to
    assert broadcasts_to((), (2, 3)) and broadcasts_to((3,), (2, 3))
    assert broadcasts_to((2, 1), (2, 3)) and broadcasts_to((2, 3), (2, 3))
    assert not broadcasts_to((4,), (2, 3))  # incompatible
    assert not broadcasts_to((5, 2, 3), (2, 3))  # broadcasts, but to a larger shape
    assert not broadcasts_to((2, 3), (1, 3))
