"""The sweep's compiled-program cache keys (fa_jax.studies.sweep.executables):
a key must change with everything that changes a program, or a later run loads
another program's executable and writes its numbers under this one's name.

Every static argument of the sweep's programs (the policy shape's every field,
the flash variant, the tiles, the causal flag), the program itself, its
arguments' shapes and dtypes, and the environment (x64, XLA_FLAGS, fa_jax's
sources) is changed alone and must give a new key; equal arguments built afresh
must give the same key, or the cache would never hit.  The field list is read
from PolicyShape itself, so a field added later without a case here fails.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from fa_jax.accumulation import EXACT, SEQUENTIAL, chunked
from fa_jax.attention import Blocks
from fa_jax.exponential import CORRECTLY_ROUNDED, EXP2, SLEEF_U10
from fa_jax.formats import get_format
from fa_jax.presets import fa2_kernel, paper_uniform
from fa_jax.studies.sweep import executables
from fa_jax.studies.sweep.executables import Executables
from fa_jax.studies.sweep.programs import (
    PolicyShape,
    flash_program,
    policy_shape,
    reference_program,
    stage_slots,
)

BF16 = get_format("bf16")


def _shape() -> PolicyShape:
    pols = [paper_uniform(BF16), fa2_kernel(BF16)]
    return policy_shape(fa2_kernel(BF16), stage_slots(pols))


def _args(n: int = 16, dtype=np.float64):
    x = np.zeros((4, 1, 1, n, 8), dtype)
    return (x, x, x, np.zeros((3, 3), np.int32), np.zeros(4, np.int32))


def _static(**changes):
    return {"shape": _shape(), "variant": "fa2", "blocks": Blocks(8, 8), "causal": False, **changes}


def _key(program=flash_program, args=None, static=None) -> str:
    return Executables(None).key(program, _args() if args is None else args, static or _static())


# One other value for every PolicyShape field.
OTHER = {
    "slots": lambda s: tuple(reversed(s.slots)),
    "kinds": lambda s: tuple((not k[0], *k[1:]) for k in s.kinds),
    "accumulation": lambda s: SEQUENTIAL if s.accumulation != SEQUENTIAL else EXACT,
    "scale": lambda s: "q" if s.scale != "q" else "scores",
    "exp_model": lambda s: SLEEF_U10 if s.exp_model != SLEEF_U10 else CORRECTLY_ROUNDED,
    "normalise": lambda s: "reciprocal" if s.normalise != "reciprocal" else "divide",
    "carrier": lambda s: "float32" if s.carrier != "float32" else "float64",
}


def test_equal_arguments_built_afresh_give_one_key():
    assert _key() == _key(args=_args(), static=_static())
    assert _shape() is not _shape() and _key() == Executables(None).key(
        flash_program, _args(), dict(reversed(list(_static().items())))
    )


def test_every_policy_shape_field_is_covered_here():
    assert {f.name for f in dataclasses.fields(PolicyShape)} == set(OTHER)


@pytest.mark.parametrize("field", sorted(OTHER))
def test_each_policy_shape_field_changes_the_key(field):
    shape = _shape()
    other = dataclasses.replace(shape, **{field: OTHER[field](shape)})
    assert other != shape
    assert _key(static=_static(shape=other)) != _key()
    assert _key(reference_program, static={"shape": other, "causal": False}) != _key(
        reference_program, static={"shape": shape, "causal": False}
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"variant": "fa1"},
        {"variant": "rowwise"},
        {"blocks": Blocks(8, 4)},
        {"blocks": Blocks(4, 8)},
        {"causal": True},
    ],
    ids=str,
)
def test_each_flash_static_argument_changes_the_key(changes):
    assert _key(static=_static(**changes)) != _key()


def test_models_that_differ_only_in_a_parameter_change_the_key():
    """Accumulation and exp models are keyed by what they compute, not their kind."""
    shape = _shape()
    keys = {
        _key(static=_static(shape=dataclasses.replace(shape, accumulation=a)))
        for a in (chunked(8), chunked(16), EXACT)
    }
    assert len(keys) == 3
    base2 = dataclasses.replace(shape, scale="exp2", exp_model=EXP2)
    assert _key(static=_static(shape=base2)) != _key(
        static=_static(shape=dataclasses.replace(base2, exp_model=CORRECTLY_ROUNDED))
    )


def test_the_program_and_its_arguments_change_the_key():
    static = {"shape": _shape(), "causal": False}
    assert _key(reference_program, static=static) != _key(flash_program, static=static)
    assert _key(args=_args(24)) != _key()
    assert _key(args=_args(dtype=np.float32)) != _key()


def test_the_environment_changes_the_key(monkeypatch):
    base = _key()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert _key() != base
    monkeypatch.delenv("XLA_FLAGS")
    before = jax.config.read("jax_enable_x64")
    try:
        jax.config.update("jax_enable_x64", not before)
        flipped = _key()
    finally:
        jax.config.update("jax_enable_x64", before)
    assert flipped != base
    monkeypatch.setattr(executables, "source_fingerprint", lambda: "0" * 64)
    assert _key() != base
