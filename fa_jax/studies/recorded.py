"""A kernel's model judged against a recording of the real kernel, on any machine.

:func:`validate_recording` reads a recording (:mod:`fa_jax.kernels.recording`: the
real kernel's outputs on designed cases, made where the kernel runs, e.g. a GPU),
draws each case's inputs again (checked by digest), runs fa_jax's model of the
kernel (:func:`fa_jax.kernels.emulate`) and the FP64 golden on them, and judges
the model by :func:`fa_jax.kernels.compare` case by case and over all cases: the
share of output elements bit-identical to the recorded ones and the ulp
distances in the case's format.  A case the real kernel refused, or the model
refuses, is listed with the reason, not judged.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fa_jax import kernels
from fa_jax.kernels.compare import Comparison
from fa_jax.kernels.recording import Case, inputs, load
from fa_jax.studies.validation import golden_output

__all__ = ["RecordedValidation", "format_recorded", "validate_recording"]


@dataclasses.dataclass(frozen=True)
class RecordedValidation:
    """The result of :func:`validate_recording`: per case a Comparison of the model
    against the recorded output, or why it was not judged; the recording's platform."""

    kernel: str
    folder: str
    platform: dict
    rows: tuple[tuple[Case, Comparison | str], ...]

    def to_dict(self) -> dict:
        """Plain data for JSON: per case its Comparison's fields, or why not judged."""
        cases = [
            {"case": c.name, **dataclasses.asdict(r)}
            if isinstance(r, Comparison)
            else {"case": c.name, "not_judged": r}
            for c, r in self.rows
        ]
        return {
            "kernel": self.kernel,
            "recording": self.folder,
            "platform": self.platform,
            "identical_share": self.identical_share(),
            "cases": cases,
        }

    def identical_share(self) -> float:
        """Bit-identical elements over every judged case (NaN where none was)."""
        judged = [(c.n * c.d, r) for c, r in self.rows if isinstance(r, Comparison)]
        total = sum(size for size, _ in judged)
        if not total:
            return float("nan")
        return sum(size * r.identical_share for size, r in judged) / total


def validate_recording(kernel: str, folder) -> RecordedValidation:
    """``kernel``'s model against its outputs recorded in ``folder`` (module docstring)."""
    if kernel not in kernels.names():
        raise ValueError(
            f"validate_recording: expected a kernel of {kernels.names()}, got {kernel!r}"
        )
    recording = load(folder)
    rows: list[tuple[Case, Comparison | str]] = []
    for case, real in recording.outputs(kernel).items():
        if isinstance(real, str):
            rows.append((case, f"the real kernel refused: {real}"))
            continue
        q, k, v = inputs(case)
        try:
            model = kernels.emulate(kernel, q, k, v, fmt=case.fmt, causal=case.causal)
        except (NotImplementedError, ValueError) as err:
            rows.append((case, f"the model refused: {err}"))
            continue
        gold = golden_output(q, k, v, case.causal)
        rows.append((case, kernels.compare(real, np.asarray(model), gold, case.fmt)))
    versions = recording.versions  # the machine's, and each kernel's own (a dict, or why not)
    platform = {k: v for k, v in versions.items() if k not in kernels.names()}
    own = versions.get(kernel)
    platform.update(own if isinstance(own, dict) else {} if own is None else {kernel: own})
    return RecordedValidation(kernel, str(recording.folder), platform, tuple(rows))


def format_recorded(v: RecordedValidation) -> str:
    """A plain-text report: the recording, one line per case, the share over all."""
    facts = ", ".join(f"{key} {val}" for key, val in v.platform.items())
    lines = [f"kernel {v.kernel} against the recording in {v.folder}", f"recorded on: {facts}", ""]
    lines.append(f"{'case':<48} {'identical':>10} {'max ulp':>8}")
    for case, r in v.rows:
        if isinstance(r, Comparison):
            lines.append(f"{case.name:<48} {100 * r.identical_share:>9.4f}% {r.max_ulp:>8}")
        else:
            lines.append(f"{case.name:<48} {r}")
    judged = sum(isinstance(r, Comparison) for _, r in v.rows)
    lines.append(
        f"\n{judged} of {len(v.rows)} cases judged: "
        f"{100 * v.identical_share():.4f}% of their elements bit-identical"
    )
    return "\n".join(lines)
