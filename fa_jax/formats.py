"""Floating-point formats described by their bit layout.

A :class:`Format` is a sign bit, ``exp_bits`` exponent bits with a ``bias`` and
``man_bits`` stored mantissa bits, plus how the format spends its top codes
(``specials``) and what an overflowing value becomes (``overflow``).  Derived
fields follow ``ml_dtypes.finfo`` / ``numpy.finfo``: ``emin``/``emax`` are the
exponents of the smallest and largest normal binade (``finfo.minexp`` and
``finfo.maxexp - 1``), ``tiny`` the smallest normal, ``eps = 2**-man_bits`` and
``unit_roundoff = 2**-(man_bits + 1)`` (Higham's *u*).

Specials encodings (the names ml_dtypes uses):

``"ieee"``   all-ones exponent holds ±inf and NaN (IEEE 754; float16, bfloat16,
             float8_e5m2, float8_e4m3, float8_e3m4).
``"fn"``     finite: no infinities, NaN only where exponent and mantissa are all
             ones (float8_e4m3fn).
``"fnuz"``   finite, unsigned zero: the code of -0 is the only NaN
             (float8_e4m3fnuz, float8_e5m2fnuz, float8_e4m3b11fnuz).
``"finite"`` no infinities and no NaN at all (OCP MX float6_e3m2fn,
             float6_e2m3fn, float4_e2m1fn).

``exp_bits``, ``man_bits`` and ``bias`` are pytree leaves, so they may be traced
JAX integers: ``jax.vmap(lambda m: round_to(x, custom(8, m)))(ms)`` compiles one
program for every mantissa width.  Traced fields are not range-checked and the
derived float fields need concrete values.

Rounding to nearest is exact float arithmetic in a carrier (Eq. R below) where
every quantum the format rounds to is a normal number of the carrier and
``2**M_c`` times its largest quantum is finite, or where the format is the
carrier's own layout (:meth:`Format.rounds_in_float`): ``round_to`` then takes
that shorter path.  A traced format cannot be checked, so it may state the
carriers where this holds for every width it takes (``float_exact_in``; the
sweep does, from the concrete formats it traces over)::

    fl_q(|x|) = (|x| + C) - C,   C = 2**(q + M_c)                        (R)

(``q``: log2 of the target's quantum at ``x``; the sum's ulp is ``2**q`` and
both operations round to nearest even once.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import ml_dtypes
import numpy as np
from jax.core import Tracer

from fa_jax._checks import is_int

__all__ = [
    "BF16",
    "E2M1FN",
    "E2M3FN",
    "E3M2FN",
    "E3M4",
    "E4M3",
    "E4M3B11FNUZ",
    "E4M3FN",
    "E4M3FNUZ",
    "E5M2",
    "E5M2FNUZ",
    "FP16",
    "FP32",
    "FP64",
    "TF32",
    "Format",
    "Overflow",
    "Specials",
    "custom",
    "get_format",
    "registered_formats",
]

Specials = Literal["ieee", "fn", "fnuz", "finite"]
Overflow = Literal["inf", "saturate"]

_SPECIALS = ("ieee", "fn", "fnuz", "finite")
_OVERFLOWS = ("inf", "saturate")
EXP_BITS_RANGE = (2, 11)
MAN_BITS_RANGE = (0, 52)


def _is_traced(v) -> bool:
    """A JAX array or tracer: a width chosen at run time (vmap over formats)."""
    return isinstance(v, (jax.Array, Tracer))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format (see the module docstring).

    Args:
      name: a label; registry formats use ml_dtypes' dtype names.
      exp_bits: exponent field width, 2..11.
      man_bits: stored mantissa (fraction) width, 0..52.
      subnormals: whether the format has subnormal numbers.  Without them,
        values below ``tiny`` round onto {0, tiny} (``x / tiny`` rounded to an
        integer in the same mode).
      specials: "ieee", "fn", "fnuz" or "finite" (module docstring).
      bias: exponent bias; ``None`` means ``2**(exp_bits - 1) - 1``.
      overflow: "inf" — a finite value that rounds past ``max`` becomes ±inf,
        or NaN where the format has no infinities (ml_dtypes' cast); or
        "saturate" — it becomes ±max, and ±inf inputs do too.  ``None``
        picks "saturate" for ``specials="finite"`` (the only choice there) and
        "inf" otherwise.
      float_exact_in: for traced widths, the carrier dtype names in which every
        width they take rounds exactly in float arithmetic (module docstring;
        :meth:`rounds_in_float` answers it for a concrete format).  A concrete
        format derives this itself and may only state carriers where it holds.
    """

    name: str
    exp_bits: int
    man_bits: int
    subnormals: bool = True
    specials: Specials = "ieee"
    # None until __post_init__ fills in the default: always set on a built Format.
    bias: int = None  # pyright: ignore[reportAssignmentType]
    overflow: Overflow = None  # pyright: ignore[reportAssignmentType]
    # Carriers ("float32", "float64") where rounding to nearest is exact float
    # arithmetic for every width a traced format takes (module docstring).
    float_exact_in: tuple[str, ...] = ()

    def __post_init__(self):
        if self.overflow is None:
            object.__setattr__(self, "overflow", "saturate" if self.specials == "finite" else "inf")
        for field, (lo, hi) in (("exp_bits", EXP_BITS_RANGE), ("man_bits", MAN_BITS_RANGE)):
            v = getattr(self, field)
            if not _is_traced(v) and not (is_int(v) and lo <= v <= hi):
                raise ValueError(f"Format.{field}: expected an integer in {lo}..{hi}, got {v!r}")
        if self.bias is None:
            object.__setattr__(self, "bias", (1 << (self.exp_bits - 1)) - 1)
        self._validate()

    # -- validation ---------------------------------------------------------

    def _validate(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Format.name: expected a str, got {self.name!r}")
        if not isinstance(self.subnormals, bool):
            raise TypeError(f"Format.subnormals: expected a bool, got {self.subnormals!r}")
        if self.specials not in _SPECIALS:
            raise ValueError(f"Format.specials: expected one of {_SPECIALS}, got {self.specials!r}")
        if self.overflow not in _OVERFLOWS:
            raise ValueError(
                f"Format.overflow: expected one of {_OVERFLOWS}, got {self.overflow!r}"
            )
        if self.specials == "finite" and self.overflow != "saturate":
            raise ValueError(
                "Format.overflow: a format with specials='finite' has neither inf nor "
                f"NaN to overflow to, so overflow must be 'saturate'; got {self.overflow!r}"
            )
        if not _is_traced(self.bias) and not is_int(self.bias):
            raise ValueError(f"Format.bias: expected an integer, got {self.bias!r}")
        if not isinstance(self.float_exact_in, tuple) or not set(self.float_exact_in) <= set(
            _CARRIER_LIMITS
        ):
            raise ValueError(
                "Format.float_exact_in: expected a tuple of carrier names among "
                f"{tuple(_CARRIER_LIMITS)}, got {self.float_exact_in!r}"
            )
        if not self.is_concrete:
            return  # traced fields cannot be range-checked
        if self.specials == "fn" and self.man_bits < 1:
            raise ValueError(
                "Format.man_bits: specials='fn' keeps NaN in the all-ones mantissa of the "
                f"top binade and needs man_bits >= 1, got {self.man_bits}"
            )
        if not self._fits(*_CARRIER_LIMITS["float64"]):
            raise ValueError(
                f"Format {self.name!r} (exp_bits={self.exp_bits}, man_bits={self.man_bits}, "
                f"bias={self.bias}) does not fit a float64 carrier: expected "
                f"man_bits <= 52, emax <= 1023 and emin - man_bits >= -1074, got "
                f"emax={self.emax}, emin={self.emin}"
            )
        wrong = [c for c in self.float_exact_in if not self.rounds_in_float(c)]
        if wrong:
            raise ValueError(
                f"Format.float_exact_in: {self.name!r} does not round exactly in float "
                f"arithmetic in {wrong} (expected its quanta normal numbers of the carrier "
                f"with 2**M_c times the largest finite, or the carrier's own layout)"
            )

    # -- pytree -------------------------------------------------------------

    def tree_flatten(self):
        children = (self.exp_bits, self.man_bits, self.bias)
        aux = (self.name, self.subnormals, self.specials, self.overflow, self.float_exact_in)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        # JAX rebuilds pytrees with tracers or placeholders as leaves: no checks.
        obj = object.__new__(cls)
        for k, v in zip(("exp_bits", "man_bits", "bias"), children):
            object.__setattr__(obj, k, v)
        for k, v in zip(("name", "subnormals", "specials", "overflow", "float_exact_in"), aux):
            object.__setattr__(obj, k, v)
        return obj

    # -- derived fields -----------------------------------------------------

    @property
    def is_concrete(self) -> bool:
        """True when exp_bits, man_bits and bias are Python/numpy integers."""
        return all(is_int(v) for v in (self.exp_bits, self.man_bits, self.bias))

    def require_concrete(self, what: str) -> None:
        if not self.is_concrete:
            raise TypeError(
                f"Format.{what} needs concrete exp_bits/man_bits/bias; got traced values "
                f"({self.exp_bits!r}, {self.man_bits!r}, {self.bias!r})"
            )

    @functools.cached_property
    def bits(self) -> int:
        """Total width: sign + exponent + mantissa."""
        self.require_concrete("bits")
        return 1 + self.exp_bits + self.man_bits

    @functools.cached_property
    def emin(self) -> int:
        """Exponent of the smallest normal binade, 1 - bias (finfo.minexp)."""
        self.require_concrete("emin")
        return 1 - self.bias

    @functools.cached_property
    def emax(self) -> int:
        """Exponent of the largest finite binade (finfo.maxexp - 1)."""
        self.require_concrete("emax")
        top = (1 << self.exp_bits) - 1  # all-ones exponent field
        return (top - 1 if self.specials == "ieee" else top) - self.bias

    @functools.cached_property
    def max(self) -> float:
        """Largest finite value."""
        self.require_concrete("max")
        # "fn" spends the all-ones mantissa of the top binade on NaN.
        frac_codes = (1 << self.man_bits) - (2 if self.specials == "fn" else 1)
        return float(np.ldexp(float((1 << self.man_bits) + frac_codes), self.emax - self.man_bits))

    @functools.cached_property
    def tiny(self) -> float:
        """Smallest positive normal value, 2**emin."""
        return float(np.ldexp(1.0, self.emin))

    @functools.cached_property
    def smallest_subnormal(self) -> float:
        """Smallest positive value: 2**(emin - man_bits), or tiny without subnormals."""
        return float(np.ldexp(1.0, self.min_exponent))

    @functools.cached_property
    def min_exponent(self) -> int:
        """log2 of the smallest positive value."""
        return self.emin - self.man_bits if self.subnormals else self.emin

    @functools.cached_property
    def eps(self) -> float:
        """Distance from 1 to the next larger value, 2**-man_bits."""
        self.require_concrete("eps")
        return float(np.ldexp(1.0, -self.man_bits))

    @functools.cached_property
    def unit_roundoff(self) -> float:
        """u = 2**-(man_bits + 1): relative error bound of round-to-nearest."""
        self.require_concrete("unit_roundoff")
        return float(np.ldexp(1.0, -self.man_bits - 1))

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.specials != "finite"

    @property
    def has_negative_zero(self) -> bool:
        return self.specials != "fnuz"

    # -- carriers -----------------------------------------------------------

    def _fits(self, man_c: int, emin_c: int, emax_c: int) -> bool:
        # Every binade's quantum, down to the lowest normal one (2**(emin - man_bits),
        # also the subnormal spacing), must be a multiple of the carrier's smallest step.
        return (
            self.man_bits <= man_c
            and self.emax <= emax_c
            and self.emin - self.man_bits >= emin_c - man_c
        )

    def fits(self, dtype) -> bool:
        """Whether every value of this format is exactly representable in ``dtype``
        (float32 or float64), so that ``dtype`` can carry it."""
        self.require_concrete("fits")
        key = np.dtype(dtype).name
        if key not in _CARRIER_LIMITS:
            raise ValueError(
                f"carrier dtype: expected float32 or float64, got {np.dtype(dtype).name}"
            )
        return self._fits(*_CARRIER_LIMITS[key])

    def rounds_in_float(self, dtype) -> bool:
        """Whether rounding to nearest to this format is exact in ``dtype``'s float
        arithmetic by Eq. (R) of the module docstring, also where the CPU flushes
        subnormals: the format is the carrier's own layout (every value already
        exact), or its finest quantum ``2**(emin - man_bits)`` is a normal number
        above the carrier's smallest (a carrier subnormal then rounds to 0 however
        it is read) and ``2**(emax - man_bits + M_c)`` is finite.  A traced format
        answers from ``float_exact_in``."""
        key = np.dtype(dtype).name
        if key not in _CARRIER_LIMITS:
            raise ValueError(
                f"carrier dtype: expected float32 or float64, got {np.dtype(dtype).name}"
            )
        if not self.is_concrete:
            return key in self.float_exact_in
        man_c, emin_c, emax_c = _CARRIER_LIMITS[key]
        own = self.subnormals and self.man_bits == man_c and self.emin == emin_c
        finest, coarsest = self.emin - self.man_bits, self.emax - self.man_bits
        return self._fits(man_c, emin_c, emax_c) and (
            own or (finest > emin_c and coarsest + man_c <= emax_c)
        )

    @property
    def carrier(self) -> np.dtype:
        """The narrowest carrier (float32, else float64) that holds this format."""
        return np.dtype(np.float32) if self.fits(np.float32) else np.dtype(np.float64)

    @property
    def dtype(self) -> np.dtype | None:
        """The numpy/ml_dtypes storage dtype with this layout, if one exists."""
        for fmt, dt in _REGISTRY_DTYPES:
            if fmt == self:
                return np.dtype(dt)
        return None

    # -- construction -------------------------------------------------------

    @classmethod
    def from_dtype(cls, dtype) -> Format:
        """The registered Format of a numpy or ml_dtypes floating dtype."""
        try:
            dt = np.dtype(dtype)
        except TypeError as err:
            raise ValueError(f"Format.from_dtype: expected a float dtype, got {dtype!r}") from err
        for fmt, reg in _REGISTRY_DTYPES:
            if np.dtype(reg) == dt:
                return fmt
        raise ValueError(
            f"Format.from_dtype: expected one of "
            f"{sorted(np.dtype(d).name for _, d in _REGISTRY_DTYPES)}, got {dt.name}"
        )

    def __repr__(self) -> str:
        if not self.is_concrete:
            return (
                f"Format({self.name!r}, exp_bits={self.exp_bits!r}, "
                f"man_bits={self.man_bits!r}, traced)"
            )
        extras = []
        if not self.subnormals:
            extras.append("subnormals=False")
        if self.specials != "ieee":
            extras.append(f"specials={self.specials!r}")
        if self.bias != (1 << (self.exp_bits - 1)) - 1:
            extras.append(f"bias={self.bias}")
        if self.overflow != ("saturate" if self.specials == "finite" else "inf"):
            extras.append(f"overflow={self.overflow!r}")
        tail = "".join(", " + e for e in extras)
        return f"Format({self.name!r}, exp_bits={self.exp_bits}, man_bits={self.man_bits}{tail})"


# (man_bits, emin, emax) of each carrier dtype.
_CARRIER_LIMITS = {"float32": (23, -126, 127), "float64": (52, -1022, 1023)}


def custom(exp_bits, man_bits, **kwargs) -> Format:
    """A custom format ``e{exp_bits}m{man_bits}``; keyword arguments as :class:`Format`.

    ``exp_bits``/``man_bits`` may be traced integers (not range-checked then).
    """
    name = kwargs.pop("name", None)
    if name is None:
        concrete = is_int(exp_bits) and is_int(man_bits)
        name = f"e{exp_bits}m{man_bits}" if concrete else "custom"
    return Format(name, exp_bits, man_bits, **kwargs)


BF16 = Format("bfloat16", 8, 7)
FP16 = Format("float16", 5, 10)
TF32 = Format("tf32", 8, 10)
FP32 = Format("float32", 8, 23)
FP64 = Format("float64", 11, 52)
E5M2 = Format("float8_e5m2", 5, 2)
E4M3 = Format("float8_e4m3", 4, 3)
E3M4 = Format("float8_e3m4", 3, 4)
E4M3FN = Format("float8_e4m3fn", 4, 3, specials="fn")
E4M3FNUZ = Format("float8_e4m3fnuz", 4, 3, specials="fnuz", bias=8)
E5M2FNUZ = Format("float8_e5m2fnuz", 5, 2, specials="fnuz", bias=16)
E4M3B11FNUZ = Format("float8_e4m3b11fnuz", 4, 3, specials="fnuz", bias=11)
E3M2FN = Format("float6_e3m2fn", 3, 2, specials="finite")
E2M3FN = Format("float6_e2m3fn", 2, 3, specials="finite")
E2M1FN = Format("float4_e2m1fn", 2, 1, specials="finite")

# Formats with a storage dtype, in registry order.
_REGISTRY_DTYPES = (
    (BF16, ml_dtypes.bfloat16),
    (FP16, np.float16),
    (FP32, np.float32),
    (FP64, np.float64),
    (E5M2, ml_dtypes.float8_e5m2),
    (E4M3, ml_dtypes.float8_e4m3),
    (E3M4, ml_dtypes.float8_e3m4),
    (E4M3FN, ml_dtypes.float8_e4m3fn),
    (E4M3FNUZ, ml_dtypes.float8_e4m3fnuz),
    (E5M2FNUZ, ml_dtypes.float8_e5m2fnuz),
    (E4M3B11FNUZ, ml_dtypes.float8_e4m3b11fnuz),
    (E3M2FN, ml_dtypes.float6_e3m2fn),
    (E2M3FN, ml_dtypes.float6_e2m3fn),
    (E2M1FN, ml_dtypes.float4_e2m1fn),
)

_ALIASES = {
    "bf16": BF16,
    "bfloat16": BF16,
    "fp16": FP16,
    "f16": FP16,
    "float16": FP16,
    "half": FP16,
    "tf32": TF32,
    "tensorfloat32": TF32,
    "fp32": FP32,
    "f32": FP32,
    "float32": FP32,
    "single": FP32,
    "fp64": FP64,
    "f64": FP64,
    "float64": FP64,
    "double": FP64,
}
for _fmt, _ in _REGISTRY_DTYPES[4:]:
    # float8_e4m3fn -> also "e4m3fn", "fp8_e4m3fn"; float4_e2m1fn -> "e2m1fn", "fp4_e2m1fn".
    _short = _fmt.name.split("_", 1)[1]
    _width = _fmt.name.split("_", 1)[0].removeprefix("float")
    _ALIASES.update({_fmt.name: _fmt, _short: _fmt, f"fp{_width}_{_short}": _fmt})


def registered_formats() -> tuple[Format, ...]:
    """Every registry format: those with an ml_dtypes/numpy dtype, then TF32."""
    return (*(f for f, _ in _REGISTRY_DTYPES), TF32)


def get_format(spec) -> Format:
    """A Format from a name or alias ("bf16", "half", "e4m3fn", ...), a dtype, or a Format.

    Names are case-insensitive; ``"e5m4"``-style names build custom IEEE-like formats.
    """
    if isinstance(spec, Format):
        return spec
    if spec is None:  # numpy would read None as float64
        raise ValueError("get_format: expected a format name, dtype or Format, got None")
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key in _ALIASES:
            return _ALIASES[key]
        parsed = _parse_em(key)
        if parsed is not None:
            return custom(*parsed)
        raise ValueError(
            f"unknown format {spec!r}: expected one of {sorted(_ALIASES)} "
            "or 'e<exp_bits>m<man_bits>'"
        )
    try:
        return Format.from_dtype(spec)
    except ValueError:
        raise ValueError(
            f"get_format: expected a format name, dtype or Format, got {spec!r}"
        ) from None


def _parse_em(key: str):
    if not key.startswith("e") or "m" not in key:
        return None
    e, _, m = key[1:].partition("m")
    if e.isdigit() and m.isdigit():
        return int(e), int(m)
    return None
