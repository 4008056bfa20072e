"""jit with the configuration (policies, block sizes, flags) as static arguments."""

from __future__ import annotations

import functools
import inspect

import jax
from jax.core import Tracer


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def jit_config(*static: str, values=None, name: str | None = None):
    """Decorator: compile ``fn`` once per configuration, where ``static`` names the
    keyword arguments that configure it.  A configuration holding traced values
    (say, a Policy whose formats are vmapped) is not hashable; the function then
    runs inside the caller's trace instead, which is equally exact.  ``values``
    maps argument names to checks ``check(value, name)`` of their values, run
    before tracing where the argument is given and not itself traced (what a
    traced function cannot see); ``name`` (default: the function's) is the one
    their errors give."""

    def wrap(fn):
        compiled = jax.jit(fn, static_argnames=static)
        signature = inspect.signature(fn)
        rest = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            named = {**(bound.get(rest[0], {}) if rest else {}), **bound}
            for arg, check in (values or {}).items():
                x = named.get(arg)
                if x is not None and not isinstance(x, Tracer):
                    check(x, name or fn.__name__)
            if all(_hashable(bound[s]) for s in static if s in bound):
                return compiled(*args, **kwargs)
            return fn(*args, **kwargs)

        return call

    return wrap
