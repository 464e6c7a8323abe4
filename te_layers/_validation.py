"""Configuration and input checks shared by te_layers' Linen, NNX and Equinox modules.

Every front end calls these with the layer's class name, so one mistake gives one message in every
framework: ``te_layers.<Layer>: <argument> must be ..., got ... <fix>``. Configuration is checked when a
layer is constructed (Linen: ``__post_init__``; NNX and Equinox: ``__init__``), inputs when it is called.

Exception types: ``TypeError`` when a value has the wrong Python type or an array the wrong dtype,
``ValueError`` when a value is out of range, not one of the accepted choices, or an array has the wrong
shape.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core.validation import FLOAT_DTYPES, FLOAT_DTYPES_WITH_F64, is_array
from te_ops.fused_attention.api import MASK_TYPES

# Accepted values (the maths behind the names lives in te_layers._common).
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "tanh", "sigmoid")
SOFTMAX_VARIANTS = ("scaled", "masked", "causal")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
GROUPED_GEMM_BACKENDS = ("auto", "te_ops", "ragged_dot")
NORM_KINDS = ("rms", "layer")  # NormDense(norm=...): RMSNorm or LayerNorm
DEFAULT_EPSILON = {"rms": 1e-6, "layer": 1e-5}  # as RMSNorm / LayerNorm
ROUTER_OPTIONS = (
    "score_function", "use_pre_softmax", "num_groups", "group_topk", "scaling_factor", "aux_loss_coeff",
    "use_expert_bias", "expert_bias_update_rate",
)  # fmt: skip

# Marks a constructor argument a framework does not have (Linen infers input sizes from the input).
ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "ABSENT"})()


def err(layer: str, msg: str) -> str:
    """The message ``te_layers.<layer>: <msg>``."""
    return f"te_layers.{layer}: {msg}"


def _desc(v: Any) -> str:
    return f"{v!r:.80} ({type(v).__name__})"


def _dtype_names(dtypes: Sequence[Any]) -> str:
    names = [str(jnp.dtype(d)) for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


# ----------------------------------------------------------------------------------------------
# Scalars
# ----------------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, (bool, np.bool_))


def positive_int(layer: str, name: str, v: Any, *, allow_none: bool = False) -> int | None:
    """``v`` as a Python int >= 1 (or None when allowed)."""
    if v is None and allow_none:
        return None
    what = "a positive int" + (" or None" if allow_none else "")
    if not _is_int(v):
        raise TypeError(err(layer, f"{name} must be {what}, got {_desc(v)}."))
    if v < 1:
        raise ValueError(err(layer, f"{name} must be {what}, got {int(v)}."))
    return int(v)


def flag(layer: str, name: str, v: Any) -> bool:
    """``v`` as a bool (Python or NumPy bool; ints are refused so that 0/1 typos show)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(err(layer, f"{name} must be a bool (True or False), got {_desc(v)}."))
    return bool(v)


def real(
    layer: str, name: str, v: Any, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
    hi_open: bool = False, allow_none: bool = False, fix: str = "",
) -> float | None:  # fmt: skip
    """``v`` as a finite Python float in the interval given by ``lo``/``hi`` (a static configuration value)."""
    if v is None and allow_none:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.floating, np.integer)):
        what = "a finite Python float" + (" or None" if allow_none else "")
        raise TypeError(err(layer, f"{name} must be {what}, got {_desc(v)}."))
    f = float(v)
    below = lo is not None and (f <= lo if lo_open else f < lo)
    above = hi is not None and (f >= hi if hi_open else f > hi)
    if not math.isfinite(f) or below or above:
        if lo is not None and hi is not None:
            rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
        elif hi is not None:
            rng = f"{'<' if hi_open else '<='} {hi:g}"
        else:
            rng = "finite"
        raise ValueError(err(layer, f"{name} must be {rng}, got {f}.{' ' + fix if fix else ''}"))
    return f


def one_of(layer: str, name: str, v: Any, choices: Sequence[Any]) -> Any:
    """``v`` if it equals one of ``choices``."""
    if not isinstance(v, (str, type(None), bool)) or v not in tuple(choices):
        raise ValueError(err(layer, f"{name} must be one of {list(choices)}, got {v!r}."))
    return v


def rate(layer: str, name: str, v: Any) -> float:
    """A dropout rate in [0, 1)."""
    return real(layer, name, v, lo=0.0, hi=1.0, hi_open=True)


def float_dtype(layer: str, name: str, v: Any, dtypes: Sequence[Any], *, allow_none: bool) -> Any:
    """``v`` if it names one of ``dtypes`` (a dtype object, a scalar type such as ``jnp.bfloat16``, or a
    name such as ``"bfloat16"``), or None when allowed."""
    if v is None and allow_none:
        return None
    what = ("None or " if allow_none else "") + _dtype_names(dtypes)
    try:
        d = jnp.dtype(v)
    except TypeError:
        d = None
    if d is None or d not in tuple(jnp.dtype(t) for t in dtypes):
        raise ValueError(err(layer, f"{name} must be {what}, got {v!r}."))
    return v


def compute_dtype_arg(layer: str, v: Any) -> Any:
    """``dtype``: None (compute in the input's dtype) or a dtype the te_ops kernels take."""
    return float_dtype(layer, "dtype", v, FLOAT_DTYPES, allow_none=True)


def param_dtype_arg(layer: str, name: str, v: Any) -> Any:
    """A parameter storage dtype: any float the layers can cast to the compute dtype."""
    return float_dtype(layer, name, v, FLOAT_DTYPES_WITH_F64, allow_none=False)


def activation(layer: str, name: str, v: Any, *, allow_none: bool) -> Any:
    """``v`` if it is a callable, one of :data:`ACTIVATIONS`, or None when allowed."""
    if (v is None and allow_none) or callable(v) or (isinstance(v, str) and v in ACTIVATIONS):
        return v
    what = ("None, " if allow_none else "") + f"a callable or one of {list(ACTIVATIONS)}"
    raise ValueError(err(layer, f"{name} must be {what}, got {v!r}."))


def axes(layer: str, name: str, v: Any, rank: int) -> Any:
    """Logical axis names of a rank-``rank`` parameter: None or ``rank`` entries, each a str or None."""
    ok = v is None or (
        isinstance(v, Sequence) and not isinstance(v, str) and len(v) == rank
        and all(a is None or isinstance(a, str) for a in v)
    )  # fmt: skip
    if not ok:
        raise ValueError(
            err(layer, f"{name} must be None or {rank} logical axis names (str or None, one per dimension of the "
                       f"parameter), got {v!r}.")
        )  # fmt: skip
    return v


def window(layer: str, v: Any) -> Any:
    """``window_size``: None or ``(left, right)`` with ints >= -1 (-1 = unbounded side)."""
    ok = v is None or (isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_int(w) and int(w) >= -1 for w in v))
    if not ok:
        raise ValueError(
            err(layer, f"window_size must be None or (left, right) with ints >= -1 (-1 = unbounded side), got {v!r}.")
        )
    return v


# ----------------------------------------------------------------------------------------------
# Layer configurations
# ----------------------------------------------------------------------------------------------


def _sizes(layer: str, sizes: dict[str, Any]) -> None:
    for name, v in sizes.items():
        if v is not ABSENT:
            positive_int(layer, name, v)


def check_dense(layer: str, *, sizes: dict[str, Any], use_bias: Any, activation_: Any, dtype: Any,
                param_dtype: Any, kernel_axes: Any, bias_axes: Any) -> None:  # fmt: skip
    """Dense: feature sizes (``features`` / ``in_features``, ``out_features``), flags, dtypes, axes."""
    _sizes(layer, sizes)
    flag(layer, "use_bias", use_bias)
    activation(layer, "activation", activation_, allow_none=True)
    compute_dtype_arg(layer, dtype)
    param_dtype_arg(layer, "param_dtype", param_dtype)
    axes(layer, "kernel_axes", kernel_axes, 2)
    axes(layer, "bias_axes", bias_axes, 1)


def check_softmax(layer: str, *, variant: Any, scale: Any) -> None:
    one_of(layer, "variant", variant, SOFTMAX_VARIANTS)
    real(layer, "scale", scale)


def check_attention(layer: str, *, mask_type: Any, window_size: Any, scale: Any = None, dropout_rate: Any) -> None:
    """DotProductAttention (and the attention part of MultiHeadAttention)."""
    one_of(layer, "mask_type", mask_type, MASK_TYPES)
    window(layer, window_size)
    real(layer, "scale", scale, allow_none=True)
    rate(layer, "dropout_rate", dropout_rate)


def check_mha(layer: str, *, in_features: Any = ABSENT, num_heads: Any, head_dim: Any, num_kv_heads: Any,
              out_features: Any, fused_qkv: Any, use_bias: Any, mask_type: Any, window_size: Any, use_rope: Any,
              rope_theta: Any, dropout_rate: Any, dtype: Any, param_dtype: Any, kernel_axes: Any,
              out_kernel_axes: Any) -> int:  # fmt: skip
    """MultiHeadAttention; returns the number of kv heads (``num_heads`` when ``num_kv_heads`` is None)."""
    _sizes(layer, {"in_features": in_features, "num_heads": num_heads, "head_dim": head_dim})
    nkv = positive_int(layer, "num_kv_heads", num_kv_heads, allow_none=True)
    nkv = num_heads if nkv is None else nkv
    if num_heads % nkv:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            err(layer, f"num_kv_heads must divide num_heads={num_heads} (each kv head serves num_heads // "
                       f"num_kv_heads query heads), got num_kv_heads={nkv}. Use one of {divisors}.")
        )  # fmt: skip
    positive_int(layer, "out_features", out_features, allow_none=True)
    flag(layer, "fused_qkv", fused_qkv)
    flag(layer, "use_bias", use_bias)
    if flag(layer, "use_rope", use_rope) and head_dim % 2:
        raise ValueError(
            err(layer, f"head_dim must be even with use_rope=True (rotary embeddings rotate pairs of features), "
                       f"got head_dim={head_dim}. Use an even head_dim or use_rope=False.")
        )  # fmt: skip
    real(layer, "rope_theta", rope_theta, lo=0.0, lo_open=True)
    check_attention(layer, mask_type=mask_type, window_size=window_size, dropout_rate=dropout_rate)
    compute_dtype_arg(layer, dtype)
    param_dtype_arg(layer, "param_dtype", param_dtype)
    axes(layer, "kernel_axes", kernel_axes, 2)
    axes(layer, "out_kernel_axes", out_kernel_axes, 2)
    return nkv


def check_router(layer: str, *, num_experts: Any, topk: Any, score_function: Any, use_pre_softmax: Any,
                 num_groups: Any, group_topk: Any, scaling_factor: Any, aux_loss_coeff: Any, use_expert_bias: Any,
                 expert_bias_update_rate: Any) -> None:  # fmt: skip
    """The routing options (TopKRouter, and the router inside MoEBlock)."""
    e = positive_int(layer, "num_experts", num_experts)
    if not _is_int(topk):
        raise TypeError(err(layer, f"topk must be an int in [1, num_experts={e}], got {_desc(topk)}."))
    if not 1 <= topk <= e:
        raise ValueError(
            err(layer, f"topk must be in [1, num_experts={e}] (experts chosen per token), got topk={int(topk)}.")
        )
    one_of(layer, "score_function", score_function, SCORE_FUNCTIONS)
    if flag(layer, "use_pre_softmax", use_pre_softmax) and score_function != "softmax":
        raise ValueError(
            err(layer, f"use_pre_softmax=True needs score_function='softmax', got {score_function!r}. "
                       "Drop use_pre_softmax for sigmoid scores.")
        )  # fmt: skip
    if (num_groups is None) != (group_topk is None):
        raise ValueError(
            err(layer, f"num_groups and group_topk must be given together (grouped selection), got "
                       f"num_groups={num_groups!r}, group_topk={group_topk!r}. Pass both, or neither.")
        )  # fmt: skip
    if num_groups is not None:
        g = positive_int(layer, "num_groups", num_groups)
        gk = positive_int(layer, "group_topk", group_topk)
        if e % g:
            raise ValueError(err(layer, f"num_groups must divide num_experts={e}, got num_groups={g}."))
        if gk > g:
            raise ValueError(err(layer, f"group_topk must be <= num_groups={g}, got group_topk={gk}."))
        if topk % gk:
            raise ValueError(err(layer, f"group_topk must divide topk={topk}, got group_topk={gk}."))
        if topk // gk > e // g:
            raise ValueError(
                err(layer, f"group_topk={gk} is too small: topk // group_topk = {topk // gk} experts per chosen "
                           f"group exceed the group size num_experts // num_groups = {e // g}. Raise group_topk "
                           "or use fewer, larger groups.")
            )  # fmt: skip
    real(layer, "scaling_factor", scaling_factor)
    real(layer, "aux_loss_coeff", aux_loss_coeff, lo=0.0)
    if flag(layer, "use_expert_bias", use_expert_bias) and score_function != "sigmoid":
        raise ValueError(
            err(layer, "use_expert_bias=True (aux-loss-free balancing) needs score_function='sigmoid', got "
                       f"{score_function!r}.")
        )  # fmt: skip
    real(layer, "expert_bias_update_rate", expert_bias_update_rate, lo=0.0)


def check_router_options(layer: str, options: dict[str, Any]) -> None:
    """Keyword router options (NNX and Equinox take them as ``**router_options``) must be known names."""
    unknown = sorted(set(options) - set(ROUTER_OPTIONS))
    if unknown:
        raise TypeError(err(layer, f"unknown router option(s) {unknown}; the options are {list(ROUTER_OPTIONS)}."))


def check_router_params(layer: str, *, in_features: Any = ABSENT, param_dtype: Any, kernel_axes: Any) -> None:
    _sizes(layer, {"in_features": in_features})
    param_dtype_arg(layer, "param_dtype", param_dtype)
    axes(layer, "kernel_axes", kernel_axes, 2)


def check_moe_ffn(layer: str, *, ffn_dim: Any, activation_: Any, gated: Any, expert_axis: Any,
                  grouped_gemm: Any, fp8_dispatch: Any = True) -> None:  # fmt: skip
    positive_int(layer, "ffn_dim", ffn_dim)
    activation(layer, "activation", activation_, allow_none=False)
    flag(layer, "gated", gated)
    flag(layer, "fp8_dispatch", fp8_dispatch)
    if expert_axis is not None and not isinstance(expert_axis, str):
        raise TypeError(err(layer, f"expert_axis must be None or a mesh axis name (str), got {_desc(expert_axis)}."))
    one_of(layer, "grouped_gemm", grouped_gemm, GROUPED_GEMM_BACKENDS)


def check_expert_mesh(layer: str, mesh: Any, expert_axis: str, num_experts: int) -> None:
    """``expert_axis`` names an axis of ``mesh`` whose size divides ``num_experts``."""
    names = tuple(mesh.axis_names)
    if expert_axis not in names:
        raise ValueError(err(layer, f"expert_axis must be an axis of the mesh {list(names)}, got {expert_axis!r}."))
    p = mesh.shape[expert_axis]
    if num_experts % p:
        raise ValueError(
            err(layer, f"num_experts must be a multiple of the {p} shards of mesh axis {expert_axis!r} "
                       f"(expert_axis), got num_experts={num_experts}.")
        )  # fmt: skip


def check_moe_params(layer: str, *, in_features: Any = ABSENT, num_experts: int, expert_axis: Any, mesh: Any,
                     dtype: Any, param_dtype: Any, router_param_dtype: Any, router_kernel_axes: Any, wi_axes: Any,
                     wo_axes: Any) -> None:  # fmt: skip
    """MoEBlock arguments beyond the router and FFN configuration."""
    _sizes(layer, {"in_features": in_features})
    compute_dtype_arg(layer, dtype)
    param_dtype_arg(layer, "param_dtype", param_dtype)
    param_dtype_arg(layer, "router_param_dtype", router_param_dtype)
    axes(layer, "router_kernel_axes", router_kernel_axes, 2)
    axes(layer, "wi_axes", wi_axes, 3)
    axes(layer, "wo_axes", wo_axes, 3)
    if mesh is not None:
        if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
            raise TypeError(err(layer, f"mesh must be None or a jax.sharding.Mesh, got {_desc(mesh)}."))
        if expert_axis is not None:
            check_expert_mesh(layer, mesh, expert_axis, num_experts)


# ----------------------------------------------------------------------------------------------
# Inputs (at call time)
# ----------------------------------------------------------------------------------------------


def float_input(layer: str, name: str, x: Any, *, dtypes: Sequence[Any] | None = None, why: str = "",
                rank: int | None = None, min_rank: int | None = None, layout: str = "") -> jax.Array:  # fmt: skip
    """``x`` as a floating-point array (integer, bool and complex arrays are refused), of one of ``dtypes``
    when given (``why`` says why), with ``rank`` / at least ``min_rank`` dimensions."""
    if not is_array(x):
        try:
            x = jnp.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(err(layer, f"{name} must be a floating-point array, got {_desc(x)}.")) from e
    dt = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            err(layer, f"{name} must be a floating-point array, got dtype {dt}. Cast it first, e.g. "
                       f"{name}.astype(jnp.float32).")
        )  # fmt: skip
    if dtypes is not None and dt not in tuple(jnp.dtype(d) for d in dtypes):
        raise TypeError(err(layer, f"{name} must be {_dtype_names(dtypes)}{why}, got dtype {dt}."))
    lay = f" {layout}" if layout else ""
    if rank is not None and x.ndim != rank:
        raise ValueError(err(layer, f"{name} must have rank {rank}{lay}, got shape {tuple(x.shape)}."))
    if min_rank is not None and x.ndim < min_rank:
        raise ValueError(err(layer, f"{name} must have rank >= {min_rank}{lay}, got shape {tuple(x.shape)}."))
    return x


def compute_input(layer: str, name: str, x: Any, dtype: Any, **kw) -> jax.Array:
    """An input a layer with a ``dtype`` argument computes on: without ``dtype`` the te_ops kernels run in
    the input's dtype, so it must be one they take."""
    why = " when dtype=None (the layer computes in the input's dtype; pass dtype= to cast)"
    return float_input(layer, name, x, dtypes=FLOAT_DTYPES if dtype is None else None, why=why, **kw)


def features(layer: str, name: str, x: jax.Array, expected: int | None) -> None:
    """The last axis of ``x`` holds the layer's input features: ``expected`` of them (when known), else >= 1."""
    if expected is None:
        if x.shape[-1] < 1:
            raise ValueError(err(layer, f"{name} must have a non-empty last dimension (the features), got shape "
                                        f"{tuple(x.shape)}."))  # fmt: skip
    elif x.shape[-1] != expected:
        raise ValueError(
            err(layer, f"{name} must have last dimension {expected} (the layer's input features), got shape "
                       f"{tuple(x.shape)}.")
        )  # fmt: skip


def int_input(layer: str, name: str, x: Any, shape: tuple[int, ...], layout: str) -> jax.Array:
    """``x`` as an integer array of ``shape`` (``layout`` names the dimensions)."""
    x = x if is_array(x) else jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(err(layer, f"{name} must be an integer array {layout}, got dtype {x.dtype}."))
    if tuple(x.shape) != tuple(shape):
        raise ValueError(err(layer, f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(x.shape)}."))
    return x


def attention_inputs(layer: str, q: Any, k: Any, v: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``q [B, Sq, Nq, D]``, ``k [B, Sk, Nkv, D]``, ``v [B, Sk, Nkv, Dv]`` with Nq a multiple of Nkv."""
    q = float_input(layer, "q", q, dtypes=FLOAT_DTYPES, rank=4, layout="[B, Sq, Nq, D]")
    k = float_input(layer, "k", k, dtypes=FLOAT_DTYPES, rank=4, layout="[B, Sk, Nkv, D]")
    v = float_input(layer, "v", v, dtypes=FLOAT_DTYPES, rank=4, layout="[B, Sk, Nkv, Dv]")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(err(layer, f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}."))
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(err(layer, f"k and v must have q's batch size (axis 0), got {shapes}."))
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(err(layer, f"v must match k in [B, Sk, Nkv] (axes 0-2), got {shapes}."))
    if k.shape[3] != q.shape[3]:
        raise ValueError(err(layer, f"k must have q's head dim D (axis 3), got {shapes}."))
    if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        raise ValueError(err(layer, f"k must have a number of heads Nkv (axis 2) that divides q's Nq, got {shapes}."))
    return q, k, v


def softmax_inputs(layer: str, x: Any, mask: Any, variant: str) -> tuple[jax.Array, jax.Array | None]:
    """x (and mask) for the softmax variants: "scaled" ``[..., S]``, "masked" ``x [B, N, Sq, Sk]`` with a
    bool mask broadcastable as ``[B or 1, N or 1, Sq or 1, Sk]``, "causal" ``[..., S, S]``."""
    if variant == "masked":
        x = float_input(layer, "x", x, dtypes=FLOAT_DTYPES, rank=4, layout="[B, N, Sq, Sk]")
        if mask is None:
            raise ValueError(err(layer, "mask is required with variant='masked' (bool, True = masked out)."))
        mask = mask if is_array(mask) else jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(err(layer, f"mask must be a bool array (True = masked out), got dtype {mask.dtype}. "
                                       "Convert it, e.g. mask = (mask != 0)."))  # fmt: skip
        padded = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        if mask.ndim > 4 or padded[3] != x.shape[3] or any(
            m not in (1, d) for m, d in zip(padded[:3], x.shape[:3], strict=True)
        ):  # fmt: skip
            raise ValueError(
                err(layer, f"mask must be broadcastable as [B or 1, N or 1, Sq or 1, Sk] to x {tuple(x.shape)}, got "
                           f"shape {tuple(mask.shape)}.")
            )  # fmt: skip
        return x, mask
    if mask is not None:
        raise ValueError(err(layer, f"mask is only used by variant='masked', got a mask with variant={variant!r}."))
    if variant == "causal":
        x = float_input(layer, "x", x, dtypes=FLOAT_DTYPES, min_rank=2, layout="[..., S, S]")
        if x.shape[-1] != x.shape[-2]:
            raise ValueError(err(layer, f"x must end in a square [S, S] score block with variant='causal', got shape "
                                        f"{tuple(x.shape)}."))  # fmt: skip
        return x, None
    return float_input(layer, "x", x, dtypes=FLOAT_DTYPES, min_rank=1, layout="[..., S]"), None


def dense_input(layer: str, x: Any, dtype: Any, in_features: int | None) -> jax.Array:
    x = compute_input(layer, "x", x, dtype, min_rank=1, layout="[..., in_features]")
    features(layer, "x", x, in_features)
    return x


def token_input(layer: str, x: Any, dtype: Any, in_features: int | None, *, router: bool = False) -> jax.Array:
    """Router / MoE input ``[..., H]`` (all leading axes are tokens). The router computes in float32, so it
    takes any floating dtype."""
    if router:
        x = float_input(layer, "x", x, min_rank=1, layout="[..., H]")
    else:
        x = compute_input(layer, "x", x, dtype, min_rank=1, layout="[..., H]")
    features(layer, "x", x, in_features)
    return x


def mha_inputs(layer: str, x: Any, inputs_kv: Any, *, dtype: Any, in_features: int | None,
               kv_features: int | None, fused_qkv: bool, use_rope: bool, mask_type: str, segment_ids: Any,
               seqlens: Any, positions: Any,
               segment_pos: Any = None) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    """``x [B, S, H]``, ``inputs_kv [B, Skv, H]`` (cross-attention, fused_qkv=False only) and the
    optional per-token arguments."""
    x = compute_input(layer, "x", x, dtype, rank=3, layout="[B, S, H]")
    features(layer, "x", x, in_features)
    b, s = x.shape[:2]
    if inputs_kv is not None:
        if fused_qkv:
            msg = ("inputs_kv must be None with fused_qkv=True (the fused projection is self-attention only); "
                   "construct with fused_qkv=False for cross-attention.")  # fmt: skip
            raise ValueError(err(layer, msg))
        inputs_kv = compute_input(layer, "inputs_kv", inputs_kv, dtype, rank=3, layout="[B, Skv, H]")
        features(layer, "inputs_kv", inputs_kv, kv_features)
        if inputs_kv.shape[0] != b:
            raise ValueError(err(layer, f"inputs_kv must have x's batch size {b} (axis 0), got shape "
                                        f"{tuple(inputs_kv.shape)}."))  # fmt: skip
    if segment_ids is not None:
        int_input(layer, "segment_ids", segment_ids, (b, s), "[B, S]")
        if inputs_kv is not None and inputs_kv.shape[1] != s:
            raise ValueError(err(layer, f"segment_ids label the tokens of both x and inputs_kv, so inputs_kv must have "
                                        f"x's length {s} (axis 1), got shape {tuple(inputs_kv.shape)}."))  # fmt: skip
    if segment_pos is not None:
        if segment_ids is None:
            raise ValueError(err(layer, "segment_pos (positions inside the packed segments) needs segment_ids; "
                                        "pass segment_ids or drop segment_pos."))  # fmt: skip
        int_input(layer, "segment_pos", segment_pos, (b, s), "[B, S]")
    padded = mask_type.startswith("padding")
    if padded and seqlens is None:
        raise ValueError(err(layer, f"seqlens (int [B], valid tokens per sequence) is required with "
                                    f"mask_type={mask_type!r}."))  # fmt: skip
    if seqlens is not None:
        if not padded:
            raise ValueError(err(layer, "seqlens are only used with a padding mask_type ('padding', "
                                        "'padding_causal' or 'padding_causal_bottom_right'), got "
                                        f"mask_type={mask_type!r}."))  # fmt: skip
        int_input(layer, "seqlens", seqlens, (b,), "[B]")
    if positions is not None:
        if not use_rope:
            raise ValueError(err(layer, "positions are only used by rotary embeddings; construct with use_rope=True "
                                        "or drop positions."))  # fmt: skip
        positions = positions if is_array(positions) else jnp.asarray(positions)
        dt = jnp.dtype(positions.dtype)
        if not (jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.floating)):
            raise TypeError(err(layer, f"positions must be an integer (or real float) array [B, S], got dtype {dt}. "
                                       "Convert it, e.g. positions.astype(jnp.int32)."))  # fmt: skip
        if tuple(positions.shape) != (b, s):
            raise ValueError(err(layer, f"positions must have shape [B, S] = {(b, s)}, got "
                                        f"{tuple(positions.shape)}."))  # fmt: skip
    return x, inputs_kv


# ----------------------------------------------------------------------------------------------
# Normalization layers (RMSNorm, LayerNorm)
# ----------------------------------------------------------------------------------------------


def check_norm(layer: str, *, sizes: dict[str, Any], epsilon: Any, zero_centered_gamma: Any, dtype: Any,
               param_dtype: Any, scale_axes: Any, bias_axes: Any = ABSENT) -> None:  # fmt: skip
    """RMSNorm / LayerNorm: feature size (NNX, Equinox), epsilon > 0, flags, dtypes, axes."""
    _sizes(layer, sizes)
    real(layer, "epsilon", epsilon, lo=0.0, lo_open=True, fix="It keeps 1 / sqrt(var + epsilon) finite, e.g. 1e-6.")
    flag(layer, "zero_centered_gamma", zero_centered_gamma)
    compute_dtype_arg(layer, dtype)
    param_dtype_arg(layer, "param_dtype", param_dtype)
    axes(layer, "scale_axes", scale_axes, 1)
    if bias_axes is not ABSENT:
        axes(layer, "bias_axes", bias_axes, 1)


def check_norm_dense(layer: str, *, sizes: dict[str, Any], norm: Any, epsilon: Any, zero_centered_gamma: Any,
                     use_bias: Any, activation_: Any, return_normed: Any, dtype: Any, param_dtype: Any,
                     scale_axes: Any, norm_bias_axes: Any, kernel_axes: Any, bias_axes: Any) -> float:  # fmt: skip
    """NormDense: ``norm`` ("rms" or "layer"), epsilon > 0 (None: the norm's default), the Dense
    arguments, flags and axes. Returns the epsilon to use."""
    one_of(layer, "norm", norm, NORM_KINDS)
    if epsilon is None:
        epsilon = DEFAULT_EPSILON[norm]
    fix = "It keeps 1 / sqrt(var + epsilon) finite, e.g. 1e-6 (None: 1e-6 for 'rms', 1e-5 for 'layer')."
    real(layer, "epsilon", epsilon, lo=0.0, lo_open=True, fix=fix)
    flag(layer, "zero_centered_gamma", zero_centered_gamma)
    flag(layer, "return_normed", return_normed)
    check_dense(layer, sizes=sizes, use_bias=use_bias, activation_=activation_, dtype=dtype, param_dtype=param_dtype,
                kernel_axes=kernel_axes, bias_axes=bias_axes)  # fmt: skip
    axes(layer, "scale_axes", scale_axes, 1)
    axes(layer, "norm_bias_axes", norm_bias_axes, 1)
    if norm == "rms" and norm_bias_axes is not None:
        raise ValueError(err(layer, f"norm_bias_axes is only used with norm='layer' (RMSNorm has no bias), got "
                                    f"norm_bias_axes={norm_bias_axes!r} with norm='rms'."))  # fmt: skip
    return float(epsilon)


def norm_inputs(layer: str, x: Any, residual: Any, dtype: Any, in_features: int | None):
    """``x [..., H]`` (H = the layer's features when known) and an optional residual of x's shape."""
    x = compute_input(layer, "x", x, dtype, min_rank=1, layout="[..., H]")
    features(layer, "x", x, in_features)
    if residual is not None:
        residual = compute_input(layer, "residual", residual, dtype, min_rank=1, layout="[..., H]")
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(err(layer, f"residual must have x's shape {tuple(x.shape)}, got "
                                        f"{tuple(residual.shape)}."))  # fmt: skip
    return x, residual
