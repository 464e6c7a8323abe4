"""Configuration errors (at construction), input errors (at call time) and zero-token inputs, with the same
``te_layers.<Layer>: <argument> ...`` messages in Linen, NNX and Equinox."""

from __future__ import annotations

import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_layers import nnx as te_nnx

FRAMEWORKS = ("linen", "nnx", "eqx")
MODULES = {"linen": te_linen, "nnx": te_nnx, "eqx": te_eqx}
B, S, H = 2, 8, 32
E, K, F = 4, 2, 16

# Constructor arguments every framework takes; NNX and Equinox also take in_features.
_SIZES = {
    "Dense": {"out_features": 8},
    "Softmax": {},
    "DotProductAttention": {},
    "MultiHeadAttention": {"num_heads": 4, "head_dim": 8},
    "TopKRouter": {"num_experts": E, "topk": K},
    "MoEBlock": {"num_experts": E, "topk": K, "ffn_dim": F},
}
_NO_IN_FEATURES = ("Softmax", "DotProductAttention")


def _arg(framework: str, layer: str, name: str) -> str:
    """The framework's name for an argument (Linen's Dense calls out_features ``features``)."""
    return "features" if (framework == "linen" and layer == "Dense" and name == "out_features") else name


def make(framework: str, layer: str, **kw):
    """Constructs ``layer`` (validation runs here) with small default sizes overridden by ``kw``."""
    kw = {**_SIZES[layer], **kw}
    if framework == "linen":
        kw.pop("in_features", None)
        if "out_features" in kw and layer == "Dense":
            kw["features"] = kw.pop("out_features")
        return getattr(te_linen, layer)(**kw)
    if layer not in _NO_IN_FEATURES:
        kw.setdefault("in_features", H)
    cls = getattr(MODULES[framework], layer)
    if layer == "Softmax" or (layer == "DotProductAttention" and framework == "eqx"):
        return cls(**kw)
    if framework == "nnx":
        return cls(**kw, rngs=nnx.Rngs(0))
    return cls(**kw, key=jax.random.key(0))


def good_input(layer: str):
    k = jax.random.split(jax.random.key(1), 3)
    if layer == "Softmax":
        return (jax.random.normal(k[0], (B, 4, S, S)),)
    if layer == "DotProductAttention":
        return (jax.random.normal(k[0], (B, S, 4, 8)), jax.random.normal(k[1], (B, S, 2, 8)),
                jax.random.normal(k[2], (B, S, 2, 8)))  # fmt: skip
    return (jax.random.normal(k[0], (B, S, H)),)


def linen_variables(module, layer: str) -> dict:
    """Random variables of a Linen module, built for the good input (shapes by eval_shape, no compile)."""
    if layer in _NO_IN_FEATURES:
        return {}
    kw = {"seqlens": jnp.full((B,), S)} if getattr(module, "mask_type", "").startswith("padding") else {}
    shapes = jax.eval_shape(lambda key: nn.meta.unbox(module.init(key, *good_input(layer), **kw)), jax.random.key(0))
    return jax.tree.map(lambda s: jax.random.normal(jax.random.key(2), s.shape, s.dtype), shapes)


def call(framework: str, module, layer: str, *args, **kw):
    """Calls ``module``; Linen modules get parameters built for the good input first, so checks against the
    stored parameter sizes run too. Returns (output, aux loss or None)."""
    if framework == "linen":
        variables = linen_variables(module, layer)
        y, state = module.apply(variables, *args, **kw, mutable=["intermediates"])
        aux = te_linen.collect_aux_loss(state.get("intermediates", {}))
        return y, aux
    if framework == "nnx":
        y, losses = nnx.capture(lambda m: m(*args, **kw), te_nnx.AuxLoss)(module)
        return y, te_nnx.collect_aux_loss(losses)
    y = module(*args, **kw)
    if isinstance(y, tuple) and isinstance(y[1], te_eqx.MoEAux):
        return y[0], y[1].aux_loss
    return y, None


def _raises(exc, layer: str, text: str):
    return pytest.raises(exc, match="^" + re.escape(f"te_layers.{layer}: {text}"))


# ----------------------------------------------------------------------------------------------
# Configuration errors: (layer, constructor kwargs, exception, argument, the message after the argument)
# ----------------------------------------------------------------------------------------------

_ROUTER_CASES = [
    (dict(num_experts=0), ValueError, "num_experts", "must be a positive int, got 0."),
    (dict(num_experts=4.0), TypeError, "num_experts", "must be a positive int, got 4.0 (float)."),
    (dict(topk=0), ValueError, "topk", "must be in [1, num_experts=4]"),
    (dict(topk=5), ValueError, "topk", "must be in [1, num_experts=4] (experts chosen per token), got topk=5."),
    (dict(topk=2.0), TypeError, "topk", "must be an int in [1, num_experts=4], got 2.0 (float)."),
    (dict(score_function="relu"), ValueError, "score_function", "must be one of ['softmax', 'sigmoid'], got 'relu'."),
    (
        dict(score_function="sigmoid", use_pre_softmax=True),
        ValueError,
        "use_pre_softmax",
        "=True needs score_function='softmax', got 'sigmoid'.",
    ),
    (dict(use_pre_softmax=1), TypeError, "use_pre_softmax", "must be a bool (True or False), got 1 (int)."),
    (dict(num_groups=2), ValueError, "num_groups", "and group_topk must be given together"),
    (dict(num_groups=3, group_topk=1), ValueError, "num_groups", "must divide num_experts=4, got num_groups=3."),
    (dict(num_groups=2, group_topk=3), ValueError, "group_topk", "must be <= num_groups=2, got group_topk=3."),
    (
        dict(num_experts=8, topk=3, num_groups=2, group_topk=2),
        ValueError,
        "group_topk",
        "must divide topk=3, got group_topk=2.",
    ),
    (dict(topk=4, num_groups=2, group_topk=1), ValueError, "group_topk", "=1 is too small"),
    (dict(num_groups=2, group_topk=0), ValueError, "group_topk", "must be a positive int, got 0."),
    (dict(scaling_factor=float("nan")), ValueError, "scaling_factor", "must be finite, got nan."),
    (dict(aux_loss_coeff=-1.0), ValueError, "aux_loss_coeff", "must be >= 0, got -1.0."),
    (
        dict(use_expert_bias=True),
        ValueError,
        "use_expert_bias",
        "=True (aux-loss-free balancing) needs score_function='sigmoid', got 'softmax'.",
    ),
    (
        dict(score_function="sigmoid", use_expert_bias=True, expert_bias_update_rate=-0.1),
        ValueError,
        "expert_bias_update_rate",
        "must be >= 0, got -0.1.",
    ),
]

CONFIG_CASES = [
    ("Dense", dict(out_features=0), ValueError, "out_features", "must be a positive int, got 0."),
    ("Dense", dict(out_features=8.0), TypeError, "out_features", "must be a positive int, got 8.0 (float)."),
    ("Dense", dict(in_features=-1), ValueError, "in_features", "must be a positive int, got -1."),
    (
        "Dense",
        dict(activation="swish"),
        ValueError,
        "activation",
        "must be None, a callable or one of ['gelu', 'gelu_tanh', 'relu', 'silu', 'tanh', 'sigmoid'], got 'swish'.",
    ),
    ("Dense", dict(dtype="int32"), ValueError, "dtype", "must be None or float32, bfloat16 or float16, got 'int32'."),
    ("Dense", dict(dtype="float33"), ValueError, "dtype", "must be None or float32, bfloat16 or float16"),
    ("Dense", dict(param_dtype=jnp.int8), ValueError, "param_dtype", "must be float32, bfloat16, float16 or float64"),
    ("Dense", dict(use_bias=1), TypeError, "use_bias", "must be a bool (True or False), got 1 (int)."),
    ("Dense", dict(kernel_axes=("embed",)), ValueError, "kernel_axes", "must be None or 2 logical axis names"),
    ("Dense", dict(bias_axes=("a", "b")), ValueError, "bias_axes", "must be None or 1 logical axis names"),
    (
        "Softmax",
        dict(variant="upper"),
        ValueError,
        "variant",
        "must be one of ['scaled', 'masked', 'causal'], got 'upper'.",
    ),
    ("Softmax", dict(scale=float("nan")), ValueError, "scale", "must be finite, got nan."),
    ("Softmax", dict(scale="1"), TypeError, "scale", "must be a finite Python float, got '1' (str)."),
    (
        "DotProductAttention",
        dict(mask_type="sliding"),
        ValueError,
        "mask_type",
        "must be one of ['none', 'causal', 'padding', 'padding_causal', 'causal_bottom_right', "
        "'padding_causal_bottom_right'], got 'sliding'.",
    ),
    (
        "DotProductAttention",
        dict(window_size=(3,)),
        ValueError,
        "window_size",
        "must be None or (left, right) with ints >= -1",
    ),
    ("DotProductAttention", dict(window_size=(4, -2)), ValueError, "window_size", "must be None or (left, right)"),
    ("DotProductAttention", dict(dropout_rate=1.0), ValueError, "dropout_rate", "must be in [0, 1), got 1.0."),
    ("DotProductAttention", dict(dropout_rate=-0.1), ValueError, "dropout_rate", "must be in [0, 1), got -0.1."),
    ("DotProductAttention", dict(scale=float("inf")), ValueError, "scale", "must be finite, got inf."),
    ("MultiHeadAttention", dict(num_heads=0), ValueError, "num_heads", "must be a positive int, got 0."),
    ("MultiHeadAttention", dict(head_dim=-8), ValueError, "head_dim", "must be a positive int, got -8."),
    ("MultiHeadAttention", dict(head_dim="8"), TypeError, "head_dim", "must be a positive int, got '8' (str)."),
    ("MultiHeadAttention", dict(in_features=0), ValueError, "in_features", "must be a positive int, got 0."),
    (
        "MultiHeadAttention",
        dict(num_kv_heads=3),
        ValueError,
        "num_kv_heads",
        "must divide num_heads=4 (each kv head serves num_heads // num_kv_heads query heads), got num_kv_heads=3. "
        "Use one of [1, 2, 4].",
    ),
    ("MultiHeadAttention", dict(num_kv_heads=0), ValueError, "num_kv_heads", "must be a positive int or None, got 0."),
    ("MultiHeadAttention", dict(head_dim=7), ValueError, "head_dim", "must be even with use_rope=True"),
    ("MultiHeadAttention", dict(out_features=0), ValueError, "out_features", "must be a positive int or None, got 0."),
    ("MultiHeadAttention", dict(rope_theta=0.0), ValueError, "rope_theta", "must be > 0, got 0.0."),
    ("MultiHeadAttention", dict(dropout_rate=1.5), ValueError, "dropout_rate", "must be in [0, 1), got 1.5."),
    ("MultiHeadAttention", dict(mask_type="bidirectional"), ValueError, "mask_type", "must be one of"),
    ("MultiHeadAttention", dict(window_size=5.0), ValueError, "window_size", "must be None or (left, right)"),
    ("MultiHeadAttention", dict(fused_qkv="yes"), TypeError, "fused_qkv", "must be a bool (True or False)"),
    ("MultiHeadAttention", dict(use_rope=None), TypeError, "use_rope", "must be a bool (True or False)"),
    ("MultiHeadAttention", dict(dtype=jnp.int32), ValueError, "dtype", "must be None or float32, bfloat16 or float16"),
    (
        "MultiHeadAttention",
        dict(kernel_axes=("a", "b", "c")),
        ValueError,
        "kernel_axes",
        "must be None or 2 logical axis names",
    ),
    (
        "MultiHeadAttention",
        dict(out_kernel_axes=(1, 2)),
        ValueError,
        "out_kernel_axes",
        "must be None or 2 logical axis names",
    ),
    *[("TopKRouter", *case) for case in _ROUTER_CASES],
    ("TopKRouter", dict(in_features=0), ValueError, "in_features", "must be a positive int, got 0."),
    ("TopKRouter", dict(param_dtype="int32"), ValueError, "param_dtype", "must be float32, bfloat16, float16"),
    ("TopKRouter", dict(kernel_axes=("embed",)), ValueError, "kernel_axes", "must be None or 2 logical axis names"),
    *[("MoEBlock", *case) for case in _ROUTER_CASES],
    ("MoEBlock", dict(in_features=0), ValueError, "in_features", "must be a positive int, got 0."),
    ("MoEBlock", dict(ffn_dim=0), ValueError, "ffn_dim", "must be a positive int, got 0."),
    (
        "MoEBlock",
        dict(activation=None),
        ValueError,
        "activation",
        "must be a callable or one of ['gelu', 'gelu_tanh', 'relu', 'silu', 'tanh', 'sigmoid'], got None.",
    ),
    ("MoEBlock", dict(activation="swiglu"), ValueError, "activation", "must be a callable or one of"),
    ("MoEBlock", dict(gated=0), TypeError, "gated", "must be a bool (True or False), got 0 (int)."),
    ("MoEBlock", dict(expert_axis=3), TypeError, "expert_axis", "must be None or a mesh axis name (str), got 3"),
    (
        "MoEBlock",
        dict(grouped_gemm="cutlass"),
        ValueError,
        "grouped_gemm",
        "must be one of ['auto', 'te_ops', 'ragged_dot'], got 'cutlass'.",
    ),
    ("MoEBlock", dict(dtype="float64"), ValueError, "dtype", "must be None or float32, bfloat16 or float16"),
    ("MoEBlock", dict(param_dtype="int8"), ValueError, "param_dtype", "must be float32, bfloat16, float16 or float64"),
    ("MoEBlock", dict(router_param_dtype="int8"), ValueError, "router_param_dtype", "must be float32"),
    (
        "MoEBlock",
        dict(router_kernel_axes=("embed",)),
        ValueError,
        "router_kernel_axes",
        "must be None or 2 logical axis names",
    ),
    ("MoEBlock", dict(wi_axes=("expert", "embed")), ValueError, "wi_axes", "must be None or 3 logical axis names"),
    ("MoEBlock", dict(wo_axes="expert"), ValueError, "wo_axes", "must be None or 3 logical axis names"),
    ("MoEBlock", dict(mesh="mesh"), TypeError, "mesh", "must be None or a jax.sharding.Mesh, got 'mesh' (str)."),
]
_LINEN_ONLY = {"DotProductAttention": dict(dropout_rng=0)}
_NOT_IN_LINEN = ("in_features",)


def _config_params():
    out = []
    for layer, kw, exc, arg, text in CONFIG_CASES:
        for fw in FRAMEWORKS:
            if fw == "linen" and arg in _NOT_IN_LINEN:
                continue
            out.append(pytest.param(fw, layer, kw, exc, arg, text, id=f"{fw}-{layer}-{arg}-{len(out)}"))
    return out


@pytest.mark.parametrize("framework,layer,kw,exc,arg,text", _config_params())
def test_config_error(framework, layer, kw, exc, arg, text):
    sep = "" if text.startswith("=") else " "
    with _raises(exc, layer, f"{_arg(framework, layer, arg)}{sep}{text}"):
        make(framework, layer, **kw)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_config_defaults_and_valid_options_are_accepted(framework):
    """The checks do not refuse valid configurations (every layer, with the options the errors above probe)."""
    make(framework, "Dense", activation=jax.nn.gelu, dtype="bfloat16", param_dtype=np.float32,
         kernel_axes=["embed", None], bias_axes=(None,))  # fmt: skip
    make(framework, "Softmax", variant="causal", scale=0.5)
    make(framework, "DotProductAttention", mask_type="padding_causal", window_size=(4, -1), scale=2, dropout_rate=0.1)
    make(framework, "MultiHeadAttention", num_kv_heads=np.int64(1), head_dim=7, use_rope=False, out_features=16)
    make(framework, "TopKRouter", num_experts=8, topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
         use_expert_bias=True, aux_loss_coeff=0)  # fmt: skip
    make(framework, "MoEBlock", activation=jax.nn.relu, gated=False, grouped_gemm="ragged_dot", dtype=jnp.bfloat16)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_expert_mesh_errors(framework):
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    with _raises(ValueError, "MoEBlock", "num_experts must be a multiple of the 2 shards of mesh axis 'ep' "
                                         "(expert_axis), got num_experts=3."):  # fmt: skip
        make(framework, "MoEBlock", num_experts=3, topk=1, expert_axis="ep", mesh=mesh)
    with _raises(ValueError, "MoEBlock", "expert_axis must be an axis of the mesh ['ep'], got 'tp'."):
        make(framework, "MoEBlock", expert_axis="tp", mesh=mesh)


def test_linen_dropout_rng_name():
    with _raises(TypeError, "DotProductAttention", "dropout_rng must be an RNG stream name (str), got 0."):
        make("linen", "DotProductAttention", **_LINEN_ONLY["DotProductAttention"])


@pytest.mark.parametrize("framework,flag_name", [("nnx", "deterministic"), ("eqx", "inference")])
@pytest.mark.parametrize("layer", ["DotProductAttention", "MultiHeadAttention"])
def test_mode_flag_must_be_bool(framework, flag_name, layer):
    with _raises(TypeError, layer, f"{flag_name} must be a bool (True or False), got 'no' (str)."):
        make(framework, layer, **{flag_name: "no"})


@pytest.mark.parametrize("framework", ("nnx", "eqx"))
@pytest.mark.parametrize("layer", ["TopKRouter", "MoEBlock"])
def test_unknown_router_option(framework, layer):
    with _raises(TypeError, layer, "unknown router option(s) ['top_k']; the options are ['score_function',"):
        make(framework, layer, top_k=2)


# ----------------------------------------------------------------------------------------------
# Input errors: (layer, constructor kwargs, inputs, call kwargs, exception, message after "te_layers.<L>: ")
# ----------------------------------------------------------------------------------------------


def _x(shape, dtype=jnp.float32):
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.random.normal(jax.random.key(3), shape, dtype)
    return jnp.ones(shape, dtype)


_QKV = ((B, S, 4, 8), (B, S, 2, 8), (B, S, 2, 8))
_Q, _K, _V = (_x(s) for s in _QKV)

INPUT_CASES = [
    (
        "Dense",
        {},
        (_x((B, S, H), jnp.int32),),
        {},
        TypeError,
        "x must be a floating-point array, got dtype int32. Cast it first, e.g. x.astype(jnp.float32).",
    ),
    ("Dense", {}, (_x((B, S, H), jnp.bool_),), {}, TypeError, "x must be a floating-point array, got dtype bool."),
    (
        "Dense",
        {},
        (_x((B, S, H), jnp.complex64),),
        {},
        TypeError,
        "x must be a floating-point array, got dtype complex64.",
    ),
    ("Dense", {}, ([[1, 2]],), {}, TypeError, "x must be a floating-point array, got dtype int32."),
    (
        "Dense",
        {},
        (_x((B, S, H), jnp.float8_e4m3fn),),
        {},
        TypeError,
        "x must be float32, bfloat16 or float16 when dtype=None (the layer computes in the input's dtype; pass dtype= "
        "to cast), got dtype float8_e4m3fn.",
    ),
    ("Dense", {}, (jnp.float32(1.0),), {}, ValueError, "x must have rank >= 1 [..., in_features], got shape ()."),
    (
        "Dense",
        {},
        (_x((B, S, H + 1)),),
        {},
        ValueError,
        "x must have last dimension 32 (the layer's input features), got shape (2, 8, 33).",
    ),
    ("Softmax", {}, (_x((B, 4, S, S), jnp.int32),), {}, TypeError, "x must be a floating-point array, got dtype int32"),
    (
        "Softmax",
        {},
        (_x((B, 4, S, S), jnp.float8_e5m2),),
        {},
        TypeError,
        "x must be float32, bfloat16 or float16, got dtype float8_e5m2.",
    ),
    (
        "Softmax",
        {},
        (_x((B, 4, S, S)), jnp.zeros((S, S), bool)),
        {},
        ValueError,
        "mask is only used by variant='masked', got a mask with variant='scaled'.",
    ),
    (
        "Softmax",
        dict(variant="masked"),
        (_x((B, 4, S, S)),),
        {},
        ValueError,
        "mask is required with variant='masked' (bool, True = masked out).",
    ),
    (
        "Softmax",
        dict(variant="masked"),
        (_x((B, 4, S, S)), jnp.zeros((S, S), jnp.int32)),
        {},
        TypeError,
        "mask must be a bool array (True = masked out), got dtype int32.",
    ),
    (
        "Softmax",
        dict(variant="masked"),
        (_x((B, 4, S, S)), jnp.zeros((3, S), bool)),
        {},
        ValueError,
        "mask must be broadcastable as [B or 1, N or 1, Sq or 1, Sk] to x (2, 4, 8, 8), got shape (3, 8).",
    ),
    (
        "Softmax",
        dict(variant="masked"),
        (_x((4, S, S)), jnp.zeros((S, S), bool)),
        {},
        ValueError,
        "x must have rank 4 [B, N, Sq, Sk], got shape (4, 8, 8).",
    ),
    (
        "Softmax",
        dict(variant="causal"),
        (_x((B, 4, S, S + 1)),),
        {},
        ValueError,
        "x must end in a square [S, S] score block with variant='causal', got shape (2, 4, 8, 9).",
    ),
    (
        "Softmax",
        dict(variant="causal"),
        (_x((S,)),),
        {},
        ValueError,
        "x must have rank >= 2 [..., S, S], got shape (8,).",
    ),
    (
        "DotProductAttention",
        {},
        (_Q.astype(jnp.int32), _K, _V),
        {},
        TypeError,
        "q must be a floating-point array, got dtype int32.",
    ),
    (
        "DotProductAttention",
        {},
        (_Q, _K, _V.astype(jnp.complex64)),
        {},
        TypeError,
        "v must be a floating-point array, got dtype complex64.",
    ),
    ("DotProductAttention", {}, (_Q, _K[0], _V), {}, ValueError, "k must have rank 4 [B, Sk, Nkv, D], got shape"),
    (
        "DotProductAttention",
        {},
        (_Q, _K, _V.astype(jnp.bfloat16)),
        {},
        TypeError,
        "q, k and v must share one dtype, got float32, float32, bfloat16.",
    ),
    ("DotProductAttention", {}, (_Q, _K[:1], _V[:1]), {}, ValueError, "k and v must have q's batch size (axis 0)"),
    ("DotProductAttention", {}, (_Q, _K, _V[:, :4]), {}, ValueError, "v must match k in [B, Sk, Nkv] (axes 0-2)"),
    ("DotProductAttention", {}, (_Q, _K[..., :4], _V), {}, ValueError, "k must have q's head dim D (axis 3)"),
    (
        "DotProductAttention",
        {},
        (_Q, _x((B, S, 3, 8)), _x((B, S, 3, 8))),
        {},
        ValueError,
        "k must have a number of heads Nkv (axis 2) that divides q's Nq",
    ),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H), jnp.int32),),
        {},
        TypeError,
        "x must be a floating-point array, got dtype int32.",
    ),
    ("MultiHeadAttention", {}, (_x((B * S, H)),), {}, ValueError, "x must have rank 3 [B, S, H], got shape (16, 32)."),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H - 1)),),
        {},
        ValueError,
        "x must have last dimension 32 (the layer's input features), got shape (2, 8, 31).",
    ),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H)), _x((B, S, H))),
        {},
        ValueError,
        "inputs_kv must be None with fused_qkv=True (the fused projection is self-attention only)",
    ),
    (
        "MultiHeadAttention",
        dict(fused_qkv=False),
        (_x((B, S, H)), _x((B, S, H), jnp.int8)),
        {},
        TypeError,
        "inputs_kv must be a floating-point array, got dtype int8.",
    ),
    (
        "MultiHeadAttention",
        dict(fused_qkv=False),
        (_x((B, S, H)), _x((B, S, H + 2))),
        {},
        ValueError,
        "inputs_kv must have last dimension 32 (the layer's input features), got shape (2, 8, 34).",
    ),
    (
        "MultiHeadAttention",
        dict(fused_qkv=False),
        (_x((B, S, H)), _x((B + 1, S, H))),
        {},
        ValueError,
        "inputs_kv must have x's batch size 2 (axis 0), got shape (3, 8, 32).",
    ),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H)),),
        dict(segment_ids=jnp.zeros((B, S))),
        TypeError,
        "segment_ids must be an integer array [B, S], got dtype float32.",
    ),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H)),),
        dict(segment_ids=jnp.zeros((B, S + 1), jnp.int32)),
        ValueError,
        "segment_ids must have shape [B, S] = (2, 8), got (2, 9).",
    ),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H)),),
        dict(segment_pos=jnp.zeros((B, S), jnp.int32)),
        ValueError,
        "segment_pos (positions inside the packed segments) needs segment_ids; pass segment_ids or drop segment_pos.",
    ),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H)),),
        dict(segment_ids=jnp.zeros((B, S), jnp.int32), segment_pos=jnp.zeros((B, S - 1), jnp.int32)),
        ValueError,
        "segment_pos must have shape [B, S] = (2, 8), got (2, 7).",
    ),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H)),),
        dict(seqlens=jnp.full((B,), S)),
        ValueError,
        "seqlens are only used with a padding mask_type ('padding', 'padding_causal' or "
        "'padding_causal_bottom_right'), got mask_type='causal'.",
    ),
    (
        "MultiHeadAttention",
        dict(mask_type="padding"),
        (_x((B, S, H)),),
        {},
        ValueError,
        "seqlens (int [B], valid tokens per sequence) is required with mask_type='padding'.",
    ),
    (
        "MultiHeadAttention",
        dict(mask_type="padding"),
        (_x((B, S, H)),),
        dict(seqlens=jnp.full((B, 1), S)),
        ValueError,
        "seqlens must have shape [B] = (2,), got (2, 1).",
    ),
    (
        "MultiHeadAttention",
        dict(use_rope=False),
        (_x((B, S, H)),),
        dict(positions=jnp.zeros((B, S), jnp.int32)),
        ValueError,
        "positions are only used by rotary embeddings",
    ),
    (
        "MultiHeadAttention",
        {},
        (_x((B, S, H)),),
        dict(positions=jnp.zeros((S,), jnp.int32)),
        ValueError,
        "positions must have shape [B, S] = (2, 8), got (8,).",
    ),
    (
        "TopKRouter",
        {},
        (_x((B, S, H), jnp.int32),),
        {},
        TypeError,
        "x must be a floating-point array, got dtype int32.",
    ),
    ("TopKRouter", {}, (_x((B, S, H), jnp.bool_),), {}, TypeError, "x must be a floating-point array, got dtype bool."),
    ("TopKRouter", {}, (jnp.float32(1.0),), {}, ValueError, "x must have rank >= 1 [..., H], got shape ()."),
    (
        "TopKRouter",
        {},
        (_x((B, S, 16)),),
        {},
        ValueError,
        "x must have last dimension 32 (the layer's input features), got shape (2, 8, 16).",
    ),
    ("MoEBlock", {}, (_x((B, S, H), jnp.int32),), {}, TypeError, "x must be a floating-point array, got dtype int32."),
    (
        "MoEBlock",
        {},
        (_x((B, S, H), jnp.complex64),),
        {},
        TypeError,
        "x must be a floating-point array, got dtype complex64.",
    ),
    (
        "MoEBlock",
        {},
        (_x((B, S, H), jnp.float8_e4m3fn),),
        {},
        TypeError,
        "x must be float32, bfloat16 or float16 when dtype=None",
    ),
    ("MoEBlock", {}, (jnp.float32(1.0),), {}, ValueError, "x must have rank >= 1 [..., H], got shape ()."),
    (
        "MoEBlock",
        {},
        (_x((B, S, 16)),),
        {},
        ValueError,
        "x must have last dimension 32 (the layer's input features), got shape (2, 8, 16).",
    ),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(
    "layer,kw,args,call_kw,exc,text", INPUT_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(INPUT_CASES)]
)
def test_input_error(framework, layer, kw, args, call_kw, exc, text):
    module = make(framework, layer, **kw)
    with _raises(exc, layer, text):
        call(framework, module, layer, *args, **call_kw)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dtype_argument_lets_other_floats_in(framework):
    """With dtype= the layer casts, so a float input the kernels do not take is accepted (and computed in dtype)."""
    y, _ = call(framework, make(framework, "Dense", dtype=jnp.float32), "Dense", _x((B, S, H), jnp.float8_e4m3fn))
    assert y.shape == (B, S, 8) and y.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(y)))


# ----------------------------------------------------------------------------------------------
# Zero tokens
# ----------------------------------------------------------------------------------------------

ZERO_SHAPES = [(0, 16, H), (4, 0, H), (0, H)]


@pytest.mark.parametrize("shape", ZERO_SHAPES, ids=str)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_router_zero_tokens(framework, shape):
    router = make(framework, "TopKRouter", aux_loss_coeff=0.1)
    r, _ = call(framework, router, "TopKRouter", jnp.ones(shape, jnp.float32))
    assert r.probs.shape == (0, E) and r.probs.dtype == jnp.float32
    assert r.routing_map.shape == (0, E) and r.routing_map.dtype == jnp.bool_
    assert r.aux_loss.shape == () and float(r.aux_loss) == 0.0
    assert r.tokens_per_expert.shape == (E,) and r.tokens_per_expert.dtype == jnp.int32
    assert not np.any(np.asarray(r.tokens_per_expert))


@pytest.mark.parametrize("shape", ZERO_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_moe_zero_tokens(framework, dtype, shape):
    block = make(framework, "MoEBlock", aux_loss_coeff=0.1)
    y, aux = call(framework, block, "MoEBlock", jnp.ones(shape, dtype))
    assert y.shape == shape and y.dtype == dtype
    assert aux.shape == () and float(aux) == 0.0


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_moe_zero_tokens_gradient(framework):
    """Training on an empty batch is defined: zero gradients, no error."""
    block = make(framework, "MoEBlock", aux_loss_coeff=0.1)
    x = jnp.ones((0, S, H))
    if framework == "linen":
        params = linen_variables(block, "MoEBlock")["params"]

        def loss(p):
            y, st = block.apply({"params": p}, x, mutable=["intermediates"])
            return jnp.sum(y) + te_linen.collect_aux_loss(st["intermediates"])
    elif framework == "nnx":
        graphdef, params, rest = nnx.split(block, nnx.Param, ...)

        def loss(p):
            y, losses = nnx.capture(lambda m: m(x), te_nnx.AuxLoss)(nnx.merge(graphdef, p, rest))
            return jnp.sum(y) + te_nnx.collect_aux_loss(losses)
    else:
        params, static = eqx.partition(block, eqx.is_inexact_array)

        def loss(p):
            y, aux = eqx.combine(p, static)(x)
            return jnp.sum(y) + aux.aux_loss

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert float(value) == 0.0
    leaves = jax.tree.leaves(grads)
    assert leaves and all(not np.any(np.asarray(g)) for g in leaves)


# ----------------------------------------------------------------------------------------------
# Equinox: layers that hold no state refuse an eqx.nn.State passed as ``layer(x, state)``
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer,slot", [("RMSNorm", "residual"), ("LayerNorm", "residual"), ("Softmax", "mask")])
def test_eqx_stateless_layers_refuse_a_state(layer, slot):
    module = {"RMSNorm": lambda: te_eqx.RMSNorm(H), "LayerNorm": lambda: te_eqx.LayerNorm(H),
              "Softmax": lambda: te_eqx.Softmax()}[layer]()  # fmt: skip
    state = eqx.nn.State(te_eqx.Dense(H, 8, key=jax.random.key(0)))
    with pytest.raises(TypeError, match=rf"^te_layers\.{layer}: got an eqx.nn.State as {slot}; {layer} holds no state"):
        module(_x((B, S, H)), state)
