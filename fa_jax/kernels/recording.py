"""Recordings of real kernels: the cases, their inputs drawn again, the stored outputs.

A recording (``experiments/record_gpu_kernels.py`` writes one, on a GPU) is a folder
of ``<kernel>.npz`` (each case's output as its format's bits, uint16, or
``<case>.refused``: the kernel's error), ``recording.json`` (the versions of every
piece of the platform, and each case's parameters with the SHA-256 of its inputs)
and ``ex2.npz``.  Inputs are not stored: :func:`inputs` draws them again from the
case, and :func:`load` checks each digest, so a recording cannot be judged on
inputs other than the ones the kernel saw.  Models are then built and judged
against the recorded outputs on any machine
(:func:`fa_jax.studies.validation.validate_recording`).

Cases (:func:`cases`), for bf16 and fp16, causal and not, one batch and head:

* ``random``: Q, K, V ~ N(0, 1) rounded to the format, head dims 64, 96, 128 and
  256 at (N, M) = (1, 1), (1, 77), (63, 129), (128, 128), (255, 256), and (513,
  1000) at d = 128: decode and prefill, odd and even, N below and equal to M
  (causal cases square, N = M = the larger: :mod:`fa_jax.kernels` asks where
  N != M how the mask is aligned, which the GPU kernels do not declare);
* ``wide``: scores over about [-40, 40] (Q and K scaled by 2): a row's maximum
  moves across key tiles, so the rescale exp2(m_old - m_new) runs, and small
  exponentials flush;
* ``equal_scores``: every key the same, so every score of a row is equal and P
  is 1 after the max: O is V's column sums over M, and V's columns hold
  order-revealing patterns (2^e at one key, -2^e at another, ones elsewhere:
  the ones added between them are lost or kept by the kernel's summation
  order; Xie et al. 2025, FPRev);
* ``one_key``: M = 1 (P = 1 exactly: O is V rounded through the output path).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib

import numpy as np

from fa_jax.formats import get_format
from fa_jax.rounding import round_to

__all__ = [
    "FORMATS",
    "Case",
    "Recording",
    "cases",
    "digest",
    "from_bits",
    "inputs",
    "load",
    "to_bits",
]

FORMATS = ("bfloat16", "float16")
HEAD_DIMS = (64, 96, 128, 256)
SHAPES = ((1, 1), (1, 77), (63, 129), (128, 128), (255, 256))
LARGE = (513, 1000, 128)  # (N, M, d): one long prefill


@dataclasses.dataclass(frozen=True)
class Case:
    """One recorded call: its inputs' kind, format, shape and mask."""

    kind: str
    fmt: str
    n: int
    m: int
    d: int
    causal: bool
    seed: int = 0

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.kind}-{self.fmt}-n{self.n}-m{self.m}-d{self.d}-{mask}-s{self.seed}"


def _square(n: int, m: int, causal: bool) -> tuple[int, int]:
    """A causal case's shape: N = M (fa_jax.kernels asks where N != M whether the mask is
    aligned top-left or bottom-right, which these kernels do not declare)."""
    return (max(n, m), max(n, m)) if causal else (n, m)


def cases(quick: bool = False) -> list[Case]:
    """The recorded cases (module docstring); ``quick``: a few small ones."""
    if quick:
        small = (("random", (63, 129)), ("equal_scores", (16, 32)))
        return [
            Case(kind, fmt, *_square(n, m, causal), 64, causal)
            for kind, (n, m) in small
            for fmt in FORMATS
            for causal in (False, True)
        ] + [Case("one_key", "bfloat16", 8, 1, 64, False)]
    out = []
    for fmt in FORMATS:
        for causal in (False, True):
            out += [
                Case("random", fmt, *_square(n, m, causal), d, causal)
                for d in HEAD_DIMS
                for n, m in SHAPES
            ]
            n, m, d = LARGE
            out.append(Case("random", fmt, *_square(n, m, causal), d, causal))
            out += [
                Case("wide", fmt, *_square(n, m, causal), 128, causal)
                for n, m in ((128, 128), (255, 256))
            ]
            out += [
                Case("equal_scores", fmt, *_square(n, m, causal), d, causal)
                for d in (64, 128)
                for n, m in ((64, 64), (63, 129), (128, 512))
            ]
    out += [Case("one_key", fmt, 64, 1, d, False) for fmt in FORMATS for d in (64, 128)]
    return out


def _rounded(x: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(round_to(x, get_format(fmt)), np.float64)


@functools.cache
def inputs(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The case's Q (1, N, d), K and V (1, M, d), float64 values exact in its format,
    drawn from ``numpy.random.default_rng([seed, N, M, d])``."""
    rng = np.random.default_rng([case.seed, case.n, case.m, case.d])
    q, k, v = (rng.standard_normal((1, s, case.d)) for s in (case.n, case.m, case.m))
    if case.kind == "wide":
        q, k = 2.0 * q, 2.0 * k
    if case.kind == "equal_scores":
        k = np.broadcast_to(k[:, :1], k.shape).copy()
        big = (
            24.0 if case.fmt == "bfloat16" else 15.0
        )  # 2^24 absorbs fp32's ones; fp16's max is 2^15
        v = np.ones_like(v)
        cols = np.arange(case.d)
        v[0, cols % case.m, cols] = 2.0**big
        v[0, (cols * 7 + 3) % case.m, cols] -= 2.0**big  # -2^big once rounded; 0 on one key
    q, k, v = (_rounded(t, case.fmt) for t in (q, k, v))
    return q, k, v


def digest(arrays) -> str:
    """SHA-256 of the arrays' float64 bits, in order."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, np.float64).tobytes())
    return h.hexdigest()


def _storage(fmt: str) -> np.dtype:
    """The 16-bit numpy or ml_dtypes type that stores ``fmt`` (:attr:`Format.dtype`)."""
    dtype = get_format(fmt).dtype
    if dtype is None or dtype.itemsize != 2:
        raise ValueError(f"recording: expected a format stored in 16 bits, got {fmt}")
    return dtype


def to_bits(out: np.ndarray, fmt: str) -> np.ndarray:
    """The output's values as the format's bits (uint16; it must hold them exactly)."""
    narrow = np.asarray(out, np.float64).astype(_storage(fmt))  # exact: checked below
    if not np.array_equal(narrow.astype(np.float64), out, equal_nan=True):
        raise ValueError(f"to_bits: expected values exact in {fmt}, got values that are not")
    return narrow.view(np.uint16)


def from_bits(bits: np.ndarray, fmt: str) -> np.ndarray:
    """:func:`to_bits`'s values again, as float64."""
    return np.asarray(bits, np.uint16).view(_storage(fmt)).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class Recording:
    """A recording's folder and its ``recording.json``: the platform it was made on
    (``versions``) and its cases (module docstring)."""

    folder: pathlib.Path
    versions: dict
    cases: tuple[Case, ...]

    def outputs(self, kernel: str) -> dict[Case, np.ndarray | str]:
        """Each case's recorded output (float64), or the kernel's refusal (its text)."""
        path = self.folder / f"{kernel}.npz"
        if not path.exists():
            have = sorted(p.stem for p in self.folder.glob("*.npz") if p.stem != "ex2")
            raise ValueError(f"recording {self.folder}: expected {kernel}.npz, got {have}")
        with np.load(path) as stored:
            out: dict[Case, np.ndarray | str] = {}
            for case in self.cases:
                if case.name in stored.files:
                    out[case] = from_bits(stored[case.name], case.fmt)
                elif f"{case.name}.refused" in stored.files:
                    out[case] = str(stored[f"{case.name}.refused"])
            return out


def load(folder) -> Recording:
    """The recording in ``folder``, every case's inputs drawn again and checked
    against the digest recorded with it (ValueError naming the first that differs)."""
    folder = pathlib.Path(folder)
    try:
        meta = json.loads((folder / "recording.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(
            f"recording {folder}: expected a readable recording.json, got {err}"
        ) from None
    found = []
    for name, fields in meta.get("cases", {}).items():
        fields = dict(fields)
        want = fields.pop("inputs_sha256", None)
        case = Case(**fields)
        if case.name != name or digest(inputs(case)) != want:
            raise ValueError(
                f"recording {folder}: expected case {name}'s inputs to be drawn again alike "
                f"(SHA-256 {want}), got {digest(inputs(case))}"
            )
        found.append(case)
    return Recording(folder, meta.get("versions", {}), tuple(found))
