"""encode/decode against ml_dtypes for every code of every <= 16-bit format."""

import math

import numpy as np
import pytest

from fa_jax import BF16, FP16, custom, registered_formats
from fa_jax.encoding import decode, encode, fields

SMALL = [f for f in registered_formats() if f.dtype is not None and f.bits <= 16]


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
def test_decode_every_code_matches_ml_dtypes(fmt):
    n = fmt.bits
    codes = np.arange(2**n, dtype=np.uint8 if n <= 8 else np.uint16)
    want = codes.view(fmt.dtype).astype(np.float64)
    got = np.array([decode(int(c), fmt) for c in codes])
    same = (got.view(np.uint64) == want.view(np.uint64)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), codes[~same][:5]


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
def test_encode_inverts_decode(fmt):
    for c in range(2**fmt.bits):
        v = decode(c, fmt)
        if math.isnan(v):
            assert math.isnan(decode(encode(v, fmt), fmt))
        else:
            assert encode(v, fmt) == c, (c, v)


def test_fields_and_errors():
    assert fields(0x3DCD, BF16) == (0, 0b01111011, 0b1001101)
    with pytest.raises(ValueError, match=r"expected 0\.\.65535 for float16, got 65536"):
        fields(65536, FP16)
    with pytest.raises(ValueError, match="not a value of bfloat16; round it first"):
        encode(0.1, BF16)
    with pytest.raises(ValueError, match="outside the finite range"):
        encode(1e6, FP16)
    with pytest.raises(ValueError, match="has no infinity"):
        encode(math.inf, custom(4, 3, specials="fn"))
