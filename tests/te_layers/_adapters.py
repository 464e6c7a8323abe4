"""Build every te_layers layer in every framework as (params, pure apply function), so one test body
covers Linen, NNX and Equinox; and load one set of (Linen-layout) parameters into the others."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_layers import nnx as te_nnx

FRAMEWORKS = ("linen", "nnx", "eqx")
LAYERS = ("Dense", "Softmax", "DotProductAttention", "MultiHeadAttention", "TopKRouter", "MoEBlock")

B, S, H = 2, 16, 32
NH, NKV, D = 4, 2, 8
E, K, F = 4, 2, 16


def layer_input(layer: str, dtype, key=None):
    key = jax.random.key(0) if key is None else key
    if layer == "Softmax":
        return jax.random.normal(key, (B, NH, S, S), dtype)
    if layer == "DotProductAttention":
        kq, kk, kv = jax.random.split(key, 3)
        return (jax.random.normal(kq, (B, S, NH, D), dtype), jax.random.normal(kk, (B, S, NKV, D), dtype),
                jax.random.normal(kv, (B, S, NKV, D), dtype))  # fmt: skip
    return jax.random.normal(key, (B, S, H), dtype)


def _kwargs(layer: str, framework: str, dtype):
    """Constructor arguments (beyond the framework's input sizes and rngs/key)."""
    if layer == "Dense":
        return dict(use_bias=True, activation="gelu", dtype=dtype, kernel_axes=("embed", "mlp"))
    if layer == "Softmax":
        return dict(variant="causal", scale=0.5)
    if layer == "DotProductAttention":
        return dict(mask_type="causal")
    if layer == "MultiHeadAttention":
        return dict(num_kv_heads=NKV, dtype=dtype, use_bias=True)
    if layer == "TopKRouter":
        return dict(aux_loss_coeff=1e-2, score_function="sigmoid", use_expert_bias=True, num_groups=2, group_topk=1)
    if layer == "MoEBlock":
        return dict(dtype=dtype, aux_loss_coeff=1e-2)
    raise KeyError(layer)


def _positional(layer: str, framework: str):
    sizes = {"Dense": (H,), "MultiHeadAttention": (NH, D), "TopKRouter": (E, K), "MoEBlock": (E, K, F)}
    lead = {"Dense": (8,)}
    if layer in ("Softmax", "DotProductAttention"):
        return ()
    if framework == "linen":
        return lead.get(layer, sizes[layer])
    extra = {"Dense": (H, 8)}
    return extra.get(layer, (H, *sizes[layer]))


def _out(layer, y):
    """The differentiable output of a layer call (aux loss folded in where there is one)."""
    if layer == "TopKRouter":
        return (y.probs.astype(jnp.float32) ** 2).sum() + y.aux_loss
    if isinstance(y, tuple):  # eqx MoE: (out, MoEAux); nnx MoE here: (out, captured aux loss)
        return y[0], getattr(y[1], "aux_loss", y[1])
    return y


def build(framework: str, layer: str, dtype=jnp.float32, seed: int = 0, **override):
    """-> (params, apply(params, x) -> output pytree). Training mode where a layer has one."""
    kw = dict(_kwargs(layer, framework, dtype), **override)
    pos = _positional(layer, framework)
    x = layer_input(layer, dtype)
    call_x = (lambda m, x: m(*x)) if layer == "DotProductAttention" else (lambda m, x: m(x))
    if framework == "linen":
        m = getattr(te_linen, layer)(*pos, **kw)
        init = jax.jit(lambda k, *xs: nn.meta.unbox(m.init(k, *xs)))  # (eager init would run every op eagerly)
        variables = init(jax.random.key(seed), *(x if isinstance(x, tuple) else (x,)))

        def apply(params, x):
            return m.apply(params, *x) if isinstance(x, tuple) else m.apply(params, x)

        return variables, apply
    if framework == "nnx":
        if layer in ("Softmax",):
            m = te_nnx.Softmax(**kw)
        elif layer == "DotProductAttention":
            m = te_nnx.DotProductAttention(**kw)
        else:
            m = getattr(te_nnx, layer)(*pos, **kw, rngs=nnx.Rngs(seed))
        graphdef, state = nnx.split(m)

        def apply(state, x):
            fn = nnx.capture(call_x, te_nnx.AuxLoss, te_nnx.TokensPerExpert)
            y, losses, _ = fn(nnx.merge(graphdef, state), x)
            if layer == "MoEBlock":
                return y, te_nnx.collect_aux_loss(losses)
            return y

        return state, apply
    if layer == "Softmax":
        m = te_eqx.Softmax(**kw)
    elif layer == "DotProductAttention":
        m = te_eqx.DotProductAttention(**kw)
    else:
        m = getattr(te_eqx, layer)(*pos, **kw, key=jax.random.key(seed))
    params, static = eqx.partition(m, eqx.is_inexact_array)

    def apply(params, x):
        return call_x(eqx.combine(params, static), x)

    return params, apply


def scalar_loss(layer, y):
    y = _out(layer, y)
    leaves = jax.tree.leaves(y)
    return sum(jnp.sum(jnp.sin(leaf.astype(jnp.float32))) for leaf in leaves)


# ---- loading Linen-layout parameters into NNX / Equinox modules --------------------------------


def load_nnx(module, params: dict):
    for name, value in params.items():
        target = getattr(module, name)
        if isinstance(value, dict):
            load_nnx(target, value)
        else:
            target[...] = value
    return module


def load_eqx(module, params: dict):
    for name, value in params.items():
        if isinstance(value, dict):
            module = eqx.tree_at(lambda m, n=name: getattr(m, n), module, load_eqx(getattr(module, name), value))
        else:
            module = eqx.tree_at(lambda m, n=name: getattr(m, n), module, value)
    return module
