"""A small decoder-only transformer whose attention is a pluggable fa_jax function.

Pre-LN GPT (Radford et al. 2019) without biases in the linear layers::

    x_0 = E[tokens] + P                              (token and position embeddings)
    x   = x + W_o · attn(LN_1(x) W_q, LN_1(x) W_k, LN_1(x) W_v)      per layer
    x   = x + W_2 · gelu(LN_2(x) W_1)                                per layer
    logits = LN_f(x) · W_u

``attn`` is causal multi-head attention computed by an
:class:`~fa_jax.studies.train.attention_layer.AttentionSpec`:
``fa_jax.reference_attention`` (baseline) or ``fa_jax.flash_attention`` (tiled)
under a :class:`~fa_jax.Policy`.  Q, K, V go in as float64 carriers
(:func:`~fa_jax.studies.train.precision.to_carrier`) and the output comes back in the
compute dtype; every other array has an explicit float32 / bfloat16 / float16
dtype, so ``jax_enable_x64`` (which the emulation needs) widens nothing else.
See :mod:`fa_jax.studies.train.precision` for what each dtype is.

Parameters are a flat ``{name: float32 array}`` dict (names like
``"layer0.attn.wq"``), initialised from ``numpy.random.default_rng(seed)``:
weights N(0, 0.02²), the residual projections ``wo`` and ``w2`` N(0, (0.02 /
sqrt(2 n_layers))²) (GPT-2), layer-norm scales 1 and biases 0.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax._checks import positive_int
from fa_jax.studies.train.attention_layer import AttentionSpec
from fa_jax.studies.train.precision import cast, to_carrier

__all__ = [
    "ModelConfig",
    "cross_entropy",
    "forward",
    "init_params",
    "loss_fn",
    "param_shapes",
]

_LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the transformer: ``vocab`` tokens, ``context`` positions, ``d_model``
    wide, ``n_heads`` heads of ``d_model / n_heads``, ``n_layers`` blocks, MLP ``d_ff``."""

    vocab: int = 32
    context: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512

    def __post_init__(self):
        for name in ("vocab", "context", "d_model", "n_heads", "n_layers", "d_ff"):
            object.__setattr__(self, name, positive_int(getattr(self, name), f"ModelConfig.{name}"))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig: d_model={self.d_model} is not a multiple of n_heads={self.n_heads}"
            )

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in a fixed order."""
    d, f = cfg.d_model, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab, d), "pos": (cfg.context, d)}
    for i in range(cfg.n_layers):
        p = f"layer{i}."
        shapes.update(
            {
                p + "ln1.scale": (d,),
                p + "ln1.bias": (d,),
                p + "attn.wq": (d, d),
                p + "attn.wk": (d, d),
                p + "attn.wv": (d, d),
                p + "attn.wo": (d, d),
                p + "ln2.scale": (d,),
                p + "ln2.bias": (d,),
                p + "mlp.w1": (d, f),
                p + "mlp.w2": (f, d),
            }
        )
    shapes.update({"ln_f.scale": (d,), "ln_f.bias": (d,), "unembed": (d, cfg.vocab)})
    return shapes


def init_params(cfg: ModelConfig, seed: int) -> dict[str, jax.Array]:
    """float32 parameters (module docstring), a pure function of (cfg, seed)."""
    rng = np.random.default_rng(seed)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".scale"):
            value = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            value = np.zeros(shape, np.float32)
        else:
            std = resid_std if name.endswith((".wo", ".w2")) else 0.02
            value = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        params[name] = jnp.asarray(value, jnp.float32)
    return params


def _dense(x, w):
    """x @ w with operands and result in x's dtype (HIGHEST: no TF32/bf16 passes)."""
    return jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=x.dtype)


def _layer_norm(x, scale, bias):
    """LN(x) with float32 statistics and float32 scale/bias, returned in x's dtype."""
    x32 = cast(x, jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + jnp.float32(_LN_EPS)) * scale + bias
    return cast(y, x.dtype)


def _heads(x, cfg: ModelConfig):
    """(B, T, D) -> (B, H, T, D/H)."""
    b, t, _ = x.shape
    return jnp.transpose(x.reshape(b, t, cfg.n_heads, cfg.d_head), (0, 2, 1, 3))


def forward(
    params,
    tokens,
    cfg: ModelConfig,
    attention: AttentionSpec,
    dtype=jnp.float32,
    *,
    return_activations: bool = False,
):
    """Logits (B, T, vocab) in ``dtype`` for int tokens (B, T), T <= context.

    ``dtype`` is the compute dtype (module docstring).  With
    ``return_activations`` also returns ``{name: array}`` of the residual stream
    after every layer and the attention outputs (to check their dtypes).
    """
    b, t = tokens.shape
    if t > cfg.context:
        raise ValueError(f"forward: expected at most context={cfg.context} tokens, got {t}")
    w = {n: (p if ".ln" in n or n.startswith("ln") else cast(p, dtype)) for n, p in params.items()}
    acts = {}
    x = w["embed"][tokens] + w["pos"][:t]
    for i in range(cfg.n_layers):
        p = f"layer{i}."
        h = _layer_norm(x, w[p + "ln1.scale"], w[p + "ln1.bias"])
        q, k, v = (to_carrier(_heads(_dense(h, w[p + f"attn.w{n}"]), cfg)) for n in "qkv")
        o = cast(attention(q, k, v), dtype)
        o = jnp.transpose(o, (0, 2, 1, 3)).reshape(b, t, cfg.d_model)
        x = x + _dense(o, w[p + "attn.wo"])
        h = _layer_norm(x, w[p + "ln2.scale"], w[p + "ln2.bias"])
        x = x + _dense(jax.nn.gelu(_dense(h, w[p + "mlp.w1"]), approximate=True), w[p + "mlp.w2"])
        acts[p + "attn_out"], acts[p + "resid"] = o, x
    logits = _dense(_layer_norm(x, w["ln_f.scale"], w["ln_f.bias"]), w["unembed"])
    return (logits, acts) if return_activations else logits


def cross_entropy(logits, targets) -> jax.Array:
    """Mean next-token negative log-likelihood in float32 (nats)."""
    logp = jax.nn.log_softmax(cast(logits, jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


def loss_fn(params, tokens, cfg: ModelConfig, attention: AttentionSpec, dtype=jnp.float32):
    """Cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (float32)."""
    return cross_entropy(forward(params, tokens[:, :-1], cfg, attention, dtype), tokens[:, 1:])
