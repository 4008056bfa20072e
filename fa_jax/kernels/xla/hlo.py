"""Reading the optimised HLO XLA's CPU backend compiles for the real call
(:func:`program_text`; fp16's eager ops each a program of its own): the steps of
the model that the program, not the shape, decides.

XLA hands the dots, reductions and element-wise steps to YNNPACK fusions
(``__ynn_fusion``, openxla/xla ``xla/backends/cpu/ynn_*``) or keeps them in loop
fusions of its own; the model reads from the text

* whether P's rounding to bf16 before P V is dropped: where XLA fuses the
  softmax and the conversion into the Q Kᵀ dot's YNNPACK fusion (excess
  precision; :func:`p_rounded`);
* which of the two float32 exps runs: YNNPACK's ``simd::exp``
  (``ynnpack/base/simd/target_independent.inc``) inside a YNNPACK fusion,
  XLA's own (:mod:`~fa_jax.kernels.xla.exp`) elsewhere (:func:`in_ynn_fusions`);
* how the softmax sum runs: YNNPACK's, or ``reduce-window`` levels and a
  ``reduce`` where XLA rewrites it as a tree reduction, or one ``reduce`` in an
  XLA loop fusion (:func:`sum_window`, :func:`window_in`);
* the step into which an XLA loop fusion fuses the scale's multiply (LLVM's
  FMA contraction: :func:`contracted`);
* which dots XLA runs as its own, and their GEMVs' majors
  (:func:`own_dot_majors`, :mod:`~fa_jax.kernels.xla.own_dots`).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax.kernels.xla import calls, orders, own_dots

__all__ = [
    "computations",
    "contracted",
    "converts_product_to_bf16",
    "in_ynn_fusions",
    "own_dot_majors",
    "p_rounded",
    "program_text",
    "sum_window",
    "window_in",
]


def computations(text: str) -> dict[str, str]:
    """The bodies of an HLO module's computations, by name ("ENTRY" for the entry)."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    return {k: "\n".join(v) for k, v in bodies.items()}


def converts_product_to_bf16(body: str) -> bool:
    """Whether an HLO computation's body converts the result of one of its
    multiplies to bf16 (P = e · (1/l) rounded to bf16)."""
    opcodes = dict(re.findall(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*\S+\s+([\w-]+)\(", body, re.M))
    operands = re.findall(r"= bf16\[[^\]]*\]\S* convert\(%([^,\s)]+)\)", body)
    return any(opcodes.get(name) == "multiply" for name in operands)


@functools.cache
def program_text(dtype: str, shape: tuple[int, ...], causal: bool, layout) -> str:
    """The optimised HLO of the real call: the 3-D one on (B·H, N, d) inputs, or
    ``layout``'s 4-D one (``shape`` then its grouped view); compiled once, read by
    each step's reading (P's rounding, the exp, the sum, the FMA steps, the dots)."""
    args, extra = _abstract_args(shape, layout)
    run = jax.jit(calls.jax_attention(dtype, causal, None, layout))
    return run.lower(*args, **extra).compile().as_text() or ""


def _abstract_args(shape: tuple[int, ...], layout) -> tuple[list, dict]:
    """The float32 (shape-only) arguments of the real call: q, k, v of ``shape`` for
    the 3-D call (``layout`` None), or ``layout``'s 4-D call's q, k, v (``shape``
    its grouped view) and its features (bias, mask, key lengths) as keywords."""
    if layout is None:
        x = jax.ShapeDtypeStruct(shape, np.float32)
        return [x, x, x], {}
    d = shape[-1]
    b, kv, g, n, m = dataclasses.astuple(layout)[:5]
    f32 = np.float32
    args = [
        jax.ShapeDtypeStruct((b, kv * g, n, d), f32),
        jax.ShapeDtypeStruct((b, kv, m, d), f32),
        jax.ShapeDtypeStruct((b, kv, m, d), f32),
    ]
    extra = {}
    if layout.bias is not None:
        extra["bias"] = jax.ShapeDtypeStruct(layout.bias, f32)
    if layout.mask is not None:
        extra["mask"] = jax.ShapeDtypeStruct(layout.mask, np.bool_)
    if layout.lengths:
        extra["lengths"] = jax.ShapeDtypeStruct((b,), np.int32)
    return args, extra


@functools.cache
def in_ynn_fusions(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: calls.Layout | None = None
) -> tuple[bool, bool]:
    """Whether, in the program XLA compiles for (B·H, N, d) inputs (or ``layout``'s
    call), P's bf16 conversion (a convert of the product e · (1/l)) and the exp sit
    in YNNPACK fusions (module docstring).  fp16 runs eagerly: no conversion in a
    fusion, and the exp as its own program has it (:func:`_eager_exp_in_ynn`).
    The conversions of Q, K and V to bf16 do not count."""
    if dtype == "float16":
        return False, _eager_exp_in_ynn(shape, causal, layout)
    text = program_text(dtype, shape, causal, layout)
    bodies = computations(text or "")
    convert = exp = False
    for line in bodies.get("ENTRY", "").splitlines():
        called = re.search(r"calls=%([^,\s]+)", line)
        if "__ynn_fusion" in line and called:
            body = bodies.get(called.group(1), "")
            convert |= converts_product_to_bf16(body)
            exp |= " exponential(" in body
    return convert, exp


_WINDOW = re.compile(r"window=\{size=(\S+) stride=(\S+)(?: pad=(\S+))?\}")


@functools.cache
def sum_window(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: calls.Layout | None = None
) -> tuple[orders.Levels, bool] | None:
    """The levels of ``reduce-window`` (size, leading pad, in YNNPACK) of the softmax
    sum where XLA's program computes it as a tree of them over the keys (its
    tree-reduction rewrite, in decoding shapes), and whether the last level's sums
    are reduced by YNNPACK (in the same fusion) rather than XLA, read from the HLO
    (:func:`window_in`).  Where the sum is one ``reduce`` in an XLA loop fusion
    (small shapes), one window of every key, left to right.  None where the whole
    sum is YNNPACK's.  fp16 runs eagerly: the HLO read is that of its sum's own
    program (:func:`_eager_programs`)."""
    if dtype == "float16":
        text = _eager_programs(shape, causal, layout)["reduce_sum"]
    else:
        text = program_text(dtype, shape, causal, layout)
    window = window_in(text, shape, dtype)
    if window is None and _sum_in_loop_fusion(text):
        m = shape[-2] if layout is None else layout.m
        return ((m, 0, False),), False
    return window


def _fusions(text: str):
    """(the fusion's line in the entry, the body it calls) for each fusion an
    optimised HLO module's entry calls."""
    bodies = computations(text)
    for line in bodies.get("ENTRY", "").splitlines():
        called = re.search(r"calls=%([^,\s]+)", line)
        if called:
            yield line, bodies.get(called.group(1), "")


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*\S+\s+([\w-]+)\(([^)]*)\)", re.M)


_MOVES = ("bitcast", "copy", "reshape", "transpose")  # in a fusion, they move no bits


def contracted(text: str) -> str | None:
    """The step into which one of XLA's own loop fusions (small and decoding shapes) fuses
    the scale's multiply, S·scale: XLA's CPU backend lets LLVM contract a multiply and
    an add into an FMA, so fl(S·scale + bias) (``"add"``) or fl(S·scale - m)
    (``"subtract"``) is one rounding.  ``"select"`` where a select (a mask) stands
    between the product and the subtraction: LLVM folds it, and fuses, only where it
    proves the select's condition (:func:`~fa_jax.kernels.xla.probes.fused_keys`).  None
    where no product feeds either, or the steps run in YNNPACK fusions, which round each
    product (measured).  Bitcasts, copies, reshapes and transposes inside a fusion only
    index: the product feeds the step through them."""
    for line, body in _fusions(text):
        if "__ynn_fusion" in line:
            continue
        graph = {
            name: (op, re.findall(r"%([^,\s]+)", args))
            for name, op, args in _INSTRUCTION.findall(body)
        }
        for name, (op, _) in graph.items():
            if op != "multiply":
                continue
            reached, selected = [(name, False)], None
            while reached:
                at, through = reached.pop()
                for user, (user_op, args) in graph.items():
                    if at not in args:
                        continue
                    if user_op in _MOVES or (user_op == "select" and args.index(at) > 0):
                        reached.append((user, through or user_op == "select"))
                    elif user_op == "subtract" and through:
                        selected = "select"
                    elif user_op in ("add", "subtract"):
                        return user_op
            if selected:
                return selected
    return None


def _sum_in_loop_fusion(text: str) -> bool:
    """Whether the softmax sum (a ``reduce`` of additions) sits in one of XLA's own
    loop fusions (small shapes), which reduce left to right from 0 (XLA's
    elemental emitter: a sequential loop), rather than in a YNNPACK fusion."""
    adds = {
        name
        for name, body in computations(text).items()
        if re.search(r"^\s*ROOT\s+\S+\s*=\s*\S+\s+add\(", body, re.M)
    }
    for line, body in _fusions(text):
        for found in re.finditer(r" reduce\([^\n]*to_apply=%([^,\s]+)", body):
            if found.group(1) in adds:
                return "__ynn_fusion" not in line
    return False


def window_in(text: str, shape: tuple[int, ...], dtype: str) -> tuple[orders.Levels, bool] | None:
    """:func:`sum_window`'s reading of an optimised HLO module ``text``: the first
    ``reduce-window`` of additions called from the entry, then each one called on
    the one before's result, as (size, leading pad (0 where the HLO gives none), in
    a YNNPACK fusion); and whether a ``reduce`` of the last one's window sums sits
    in its YNNPACK fusion too.  None where there is none."""
    bodies = computations(text)
    levels: list[tuple[int, int, bool]] = []
    source, total = None, False
    for line in bodies.get("ENTRY", "").splitlines():
        called = re.search(r"calls=%([^,\s]+)", line)
        if not called or (source and not re.search(rf"[(\s]%{re.escape(source)}[,)]", line)):
            continue
        body = bodies.get(called.group(1), "")
        for inner in body.splitlines():
            found = _WINDOW.search(inner)
            apply = re.search(r"to_apply=%([^,\s]+)", inner)
            if " reduce-window(" not in inner or not found or not apply:
                continue
            if " add(" not in bodies.get(apply.group(1), ""):
                continue  # the max's
            size, stride = found.group(1).split("x")[-1], found.group(2).split("x")[-1]
            lo = found.group(3).split("x")[-1].split("_")[0] if found.group(3) else "0"
            if size != stride:
                raise ValueError(
                    f"xla: the softmax sum of {shape} ({dtype}) is a reduce-window of size "
                    f"{size} and stride {stride}; only equal ones are modelled"
                )
            ynn = "__ynn_fusion" in line
            name = inner.split("=")[0].strip().removeprefix("ROOT").strip()
            total = ynn and re.search(rf" reduce\({re.escape(name)}[,)]", body) is not None
            levels.append((int(size), int(lo), ynn))
            source = line.split("=")[0].strip().removeprefix("ROOT").strip().lstrip("%")
            break
    return (tuple(levels), total) if levels else None


def _eager_shapes(shape: tuple[int, ...], causal: bool, layout) -> dict[str, tuple[int, ...]]:
    """The shapes of the float32 arrays fp16's eager softmax steps take (``exp``,
    ``reduce_sum``: jax's ``_softmax`` in jax/_src/nn/functions.py, under the vmap of
    ``_dot_product_attention_xla``), read from the jaxpr of the real call: the 3-D
    one on (B·H, N, d) inputs, or ``layout``'s 4-D one (``shape`` its grouped view)."""
    args, extra = _abstract_args(shape, layout)
    run = calls.jax_attention("float16", causal, None, layout)
    found: dict[str, tuple[int, ...]] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("exp", "reduce_sum"):
                found[eqn.primitive.name] = tuple(eqn.invars[0].aval.shape)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(run)(*args, **extra).jaxpr)
    if set(found) != {"exp", "reduce_sum"}:
        raise ValueError(
            f"xla: expected an exp and a reduce_sum in jax's float16 attention of {shape}, "
            f"found {sorted(found)}"
        )
    return found


@functools.cache
def _eager_programs(shape: tuple[int, ...], causal: bool, layout=None) -> dict[str, str]:
    """The optimised HLO of fp16's eager exp and softmax sum (``exp``,
    ``reduce_sum``): run op by op, each is a program of its own, compiled for the
    shape it takes (:func:`_eager_shapes`), as jax's eager ``jnp.exp`` and
    ``jnp.sum(..., keepdims=True)`` over the keys."""
    shapes = _eager_shapes(shape, causal, layout)

    def text(fn, x):
        return jax.jit(fn).lower(jax.ShapeDtypeStruct(x, np.float32)).compile().as_text() or ""

    return {
        "exp": text(jnp.exp, shapes["exp"]),
        "reduce_sum": text(lambda x: jnp.sum(x, axis=-1, keepdims=True), shapes["reduce_sum"]),
    }


def _eager_exp_in_ynn(shape: tuple[int, ...], causal: bool, layout=None) -> bool:
    """Whether fp16's eager exp runs in a YNNPACK fusion (:func:`_eager_programs`)."""
    entry = computations(_eager_programs(shape, causal, layout)["exp"]).get("ENTRY", "")
    return "__ynn_fusion" in entry


def p_rounded(
    dtype: str, shape: tuple[int, ...], causal: bool, layout: calls.Layout | None = None
) -> bool:
    """Whether XLA keeps P's rounding to ``dtype`` for (B·H, N, d) inputs (or
    ``layout``'s call): False when the conversion sits in a YNNPACK fusion (module
    docstring)."""
    return dtype != "bfloat16" or not in_ynn_fusions(dtype, shape, causal, layout)[0]


def own_dot_majors(
    dtype: str, shape: tuple[int, ...], layout: calls.Layout
) -> tuple[str | None, str | None]:
    """:func:`~fa_jax.kernels.xla.own_dots.own_dots` of the plain program's HLO."""
    bodies = computations(program_text(dtype, shape, False, layout))
    return own_dots.own_dots(bodies.get("ENTRY", ""), bodies)
