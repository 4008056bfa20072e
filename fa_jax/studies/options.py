"""How studies run, beside what they compute: the compilation cache, the profile
and the carrier of the emulated runs.

:func:`study_options` sets them for a block (a context variable, so nested calls
and threads see their own); :func:`~fa_jax.studies.sweep.run_sweep` reads them
where its own arguments leave them open, so a figure or table that runs several
sweeps needs no extra parameters.  The CLI sets them from ``--no-cache``,
``--profile`` and ``--carrier``.  Defaults: the cache on at
:func:`fa_jax.studies.cache.cache_dir`, no profile, float64 carriers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator

from fa_jax._checks import one_of
from fa_jax.studies.profile import Profile

__all__ = ["StudyOptions", "current_options", "study_options"]


@dataclasses.dataclass(frozen=True)
class StudyOptions:
    """``cache``: True (the default folder), a folder path, or False (off).
    ``profile``: a :class:`~fa_jax.studies.profile.Profile` to fill, or None.
    ``carrier``: what the flash runs compute on, "float64" or "float32" (the same
    bits; the golden and baselines stay float64: :mod:`fa_jax.studies.sweep.batch`)."""

    cache: bool | str | os.PathLike = True
    profile: Profile | None = None
    carrier: str = "float64"

    def __post_init__(self):
        one_of(self.carrier, ("float64", "float32"), "StudyOptions.carrier")


_DEFAULT = StudyOptions()
_OPTIONS: contextvars.ContextVar[StudyOptions | None] = contextvars.ContextVar(
    "fa_jax_study_options", default=None
)


def current_options() -> StudyOptions:
    """The options in force here."""
    return _OPTIONS.get() or _DEFAULT


@contextlib.contextmanager
def study_options(**changes) -> Iterator[StudyOptions]:
    """The current options with ``changes`` (fields of :class:`StudyOptions`) while
    the block runs."""
    options = dataclasses.replace(current_options(), **changes)
    token = _OPTIONS.set(options)
    try:
        yield options
    finally:
        _OPTIONS.reset(token)
