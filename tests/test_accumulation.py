"""Accumulation models: construction, parsing, errors."""

import pytest

from fa_jax.accumulation import EXACT, SEQUENTIAL, Accumulation, chunked, get_accumulation


def test_parse_and_print():
    assert get_accumulation("exact") is not None and get_accumulation("exact") == EXACT
    assert get_accumulation(" Sequential ") == SEQUENTIAL
    assert get_accumulation("chunked") == chunked(16)
    assert get_accumulation("chunked(4)") == Accumulation("chunked", 4)
    assert str(chunked(8)) == "chunked(8)" and str(EXACT) == "exact"
    assert get_accumulation(chunked(3)) == chunked(3)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: get_accumulation("kahan"), r"expected 'exact', 'sequential', 'chunked' or 'chunked\(k\)', got 'kahan'"),
        (lambda: chunked(0), r"Accumulation.chunk: expected a positive integer for 'chunked', got 0"),
        (lambda: Accumulation("exact", 4), r"only 'chunked' takes a chunk, got 4"),
        (lambda: Accumulation("pairwise"), r"Accumulation.kind: expected"),
    ],
)
def test_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()
