"""The op layer names the limitation on a backend that cannot bitcast float64 (TPU)."""

import jax
import pytest
from helpers import x64_enabled

from fa_jax import ops


def test_tpu_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with x64_enabled():
        with pytest.raises(RuntimeError, match="TPU backend emulates float64 without bitcasts"):
            ops.carrier([1.0])
        # Computations placed on the host CPU run.
        with jax.default_device(jax.devices("cpu")[0]):
            assert float(ops.carrier([1.5])[0]) == 1.5


def test_cpu_runs():
    with x64_enabled():
        assert float(ops.carrier([2.0])[0]) == 2.0
