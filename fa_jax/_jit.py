"""jit with the configuration (policies, block sizes, flags) as static arguments."""

from __future__ import annotations

import functools
import inspect

import jax


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def jit_config(*static: str):
    """Decorator: compile ``fn`` once per configuration, where ``static`` names the
    keyword arguments that configure it.  A configuration holding traced values
    (say, a Policy whose formats are vmapped) is not hashable; the function then
    runs inside the caller's trace instead, which is equally exact."""

    def wrap(fn):
        compiled = jax.jit(fn, static_argnames=static)
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            if all(_hashable(bound[s]) for s in static if s in bound):
                return compiled(*args, **kwargs)
            return fn(*args, **kwargs)

        return call

    return wrap
