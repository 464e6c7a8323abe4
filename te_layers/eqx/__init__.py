"""Equinox modules on te_ops: Dense, Softmax, DotProductAttention, MultiHeadAttention, TopKRouter,
MoEBlock, NormDense (RMSNorm or LayerNorm, then Dense); RMSNorm, LayerNorm (in ``norm.py``).

Conventions: input sizes at construction and a keyword-only ``key`` (``jax.random`` key) for the
initialisers; configuration in static fields, parameters as array fields (stored in
``param_dtype``, computed in ``dtype``); dropout takes a keyword-only ``key`` at call time and an
``inference`` flag (field, overridable per call, toggled by ``eqx.nn.inference_mode``). MoE modules
return the aux loss alongside the output (``(out, MoEAux(aux_loss, tokens_per_expert))``);
aux-loss-free balancing is functional: ``block = block.update_expert_bias(aux.tokens_per_expert)``.
Partitioning metadata: every parameter has logical axis names; :func:`logical_axes` returns a pytree
of ``PartitionSpec`` (logical names) shaped like the model.

FP8: ``Dense``, the ``MultiHeadAttention`` projections and the ``MoEBlock`` experts take ``fp8=`` (a
``te_ops.fp8`` recipe, None = the :func:`te_layers.fp8_recipe` context, False = high precision). A
Dense or MoEBlock built with DelayedScaling holds an ``eqx.nn.StateIndex`` (``fp8_index``): call it
as ``y, state = dense(x, state)`` (``(out, aux), state = moe(x, state)``; MultiHeadAttention
``out, state = mha(x, state)`` too, or ``state=``) and update the state with
:func:`fp8_value_and_grad` (``te_layers.eqx.fp8``). One that got DelayedScaling from the context
(``fp8=None``) must be called inside the context too: called outside every ``fp8_recipe`` block it
runs in high precision, its state entry is not updated, and it warns (``te_layers.fp8_recipe(None)``:
no warning); inside a CurrentScaling or BlockScaling context it runs with that recipe and warns too.
Layers that hold no state (RMSNorm, LayerNorm, Softmax) refuse an ``eqx.nn.State`` in their second
argument with an error that says so.

Configuration is checked in ``__init__`` (``__check_init__`` for the field-only modules) and inputs when a
module is called, with the same messages as the Linen and NNX modules (``te_layers.<Layer>: ...``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from te_layers import _common as C
from te_layers import _fp8 as F
from te_layers import _norm
from te_layers import _validation as V
from te_layers._norm import NormDenseOutput
from te_layers.eqx.fp8 import fp8_accumulate, fp8_update, fp8_value_and_grad
from te_layers.eqx.norm import LayerNorm, RMSNorm, _refuse_state

Initializer = Callable[..., jax.Array]
Axes = Sequence[str | None] | None

_lecun = jax.nn.initializers.lecun_normal()
_zeros = jax.nn.initializers.zeros
_expert_init = C.default_expert_init()


def _axes(a: Axes):
    return None if a is None else tuple(a)


class Dense(eqx.Module):
    """``activation(x @ kernel + bias)`` on ``te_ops.dense``: kernel ``[in_features, out_features]``.

    ``fp8``: a ``te_ops.fp8`` recipe (the GEMM is ``te_ops.fp8.fp8_dense``), None (the recipe of the
    :func:`te_layers.fp8_recipe` context when called) or False (high precision). With DelayedScaling
    (argument, or the context at construction) the layer holds ``fp8_index`` (an
    ``eqx.nn.StateIndex``) and is called as ``y, state = dense(x, state)``. Any Dense called with a
    state returns ``(y, state)``.
    """

    kernel: jax.Array
    bias: jax.Array | None
    fp8_index: eqx.nn.StateIndex | None
    activation: str | Callable | None = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    param_axes: dict = eqx.field(static=True)
    fp8: Any = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 activation: str | Callable | None = None, dtype: Any = None, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = _lecun, bias_init: Initializer = _zeros, kernel_axes: Axes = None,
                 bias_axes: Axes = None, fp8: Any = None, key: jax.Array):  # fmt: skip
        V.check_dense("Dense", sizes={"in_features": in_features, "out_features": out_features}, use_bias=use_bias,
                      activation_=activation, dtype=dtype, param_dtype=param_dtype, kernel_axes=kernel_axes,
                      bias_axes=bias_axes)  # fmt: skip
        recipe = F.resolve("Dense", fp8)
        self.fp8 = fp8
        delayed = isinstance(recipe, F.DelayedScaling)
        self.fp8_index = eqx.nn.StateIndex(F.initial_state_tree(recipe)) if delayed else None
        kk, bk = jax.random.split(key)
        self.kernel = kernel_init(kk, (in_features, out_features), param_dtype)
        self.bias = bias_init(bk, (out_features,), param_dtype) if use_bias else None
        self.activation, self.dtype = activation, dtype
        if bias_axes is None and kernel_axes is not None:
            bias_axes = (tuple(kernel_axes)[-1],)
        self.param_axes = {"kernel": _axes(kernel_axes), "bias": _axes(bias_axes)}

    def __call__(self, x: jax.Array, state: eqx.nn.State | None = None):
        x = V.dense_input("Dense", x, self.dtype, self.kernel.shape[0])
        recipe = F.resolve("Dense", self.fp8)
        F.warn_if_state_unused("Dense", self.fp8, recipe, self.fp8_index is not None)
        tree = None
        if isinstance(recipe, F.DelayedScaling):
            if state is None or self.fp8_index is None:
                what = "no state was passed" if state is None else "the layer was built without it"
                raise ValueError(
                    V.err("Dense", f"fp8 is {recipe!r}, which needs the layer's delayed-scaling state: call "
                                   "`y, state = dense(x, state)` with the eqx.nn.State of a model built with the same "
                                   f"recipe (fp8= or inside te_layers.fp8_recipe) by eqx.nn.make_with_state; {what}.")
                )  # fmt: skip
            tree = state.get(self.fp8_index)
            F.check_state_tree("Dense", tree, recipe, "its eqx.nn.State entry (dense.fp8_index)")
        y = C.dense_apply(x, self.kernel, self.bias, activation=self.activation, dtype=self.dtype, fp8=recipe,
                          fp8_state=tree)  # fmt: skip
        return y if state is None else (y, state)


class NormDense(eqx.Module):
    """``activation(norm(x) @ kernel + bias)``: RMSNorm (``norm="rms"``) or LayerNorm (``norm="layer"``)
    over the last axis, then the :class:`Dense` projection. Parameters ``scale [in_features]``
    (``norm_bias [in_features]`` with LayerNorm, else None), ``kernel [in_features, out_features]``,
    ``bias [out_features]``.

    The norm is :class:`RMSNorm` / :class:`LayerNorm` (float32 statistics, output in the compute dtype;
    ``epsilon`` None: 1e-6 for "rms", 1e-5 for "layer"; ``zero_centered_gamma``: applied scale
    ``1 + scale``, ``scale_init`` None means ones, zeros with ``zero_centered_gamma``). The projection
    is :class:`Dense` (same ``kernel_init``, ``bias_init``, ``use_bias``, ``activation``, ``dtype``, ``fp8``).
    Logical axes (``param_axes``): ``scale_axes`` None follows ``kernel_axes[0]``, ``norm_bias_axes`` None
    follows ``scale_axes``, ``bias_axes`` None follows ``kernel_axes[-1]``.

    ``return_normed=True``: returns ``NormDenseOutput(y, normed)`` with the normalized input. ``fp8``: as
    :class:`Dense`; only the GEMM runs in FP8, the norm stays in high precision (the quantization of its
    output is not fused into the norm kernel yet). With DelayedScaling the layer holds ``fp8_index`` and
    is called as ``out, state = layer(x, state)``; any NormDense called with a state returns
    ``(out, state)``.
    """

    scale: jax.Array
    norm_bias: jax.Array | None
    kernel: jax.Array
    bias: jax.Array | None
    fp8_index: eqx.nn.StateIndex | None
    norm: str = eqx.field(static=True)
    epsilon: float = eqx.field(static=True)
    zero_centered_gamma: bool = eqx.field(static=True)
    activation: str | Callable | None = eqx.field(static=True)
    return_normed: bool = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    param_axes: dict = eqx.field(static=True)
    fp8: Any = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, *, norm: str = "rms", epsilon: float | None = None,
                 zero_centered_gamma: bool = False, use_bias: bool = True, activation: str | Callable | None = None,
                 return_normed: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
                 scale_init: Initializer | None = None, norm_bias_init: Initializer = _zeros,
                 kernel_init: Initializer = _lecun, bias_init: Initializer = _zeros, scale_axes: Axes = None,
                 norm_bias_axes: Axes = None, kernel_axes: Axes = None, bias_axes: Axes = None, fp8: Any = None,
                 key: jax.Array):  # fmt: skip
        eps = V.check_norm_dense("NormDense", sizes={"in_features": in_features, "out_features": out_features},
                                 norm=norm, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                                 use_bias=use_bias, activation_=activation, return_normed=return_normed, dtype=dtype,
                                 param_dtype=param_dtype, scale_axes=scale_axes, norm_bias_axes=norm_bias_axes,
                                 kernel_axes=kernel_axes, bias_axes=bias_axes)  # fmt: skip
        recipe = F.resolve("NormDense", fp8)
        self.fp8 = fp8
        delayed = isinstance(recipe, F.DelayedScaling)
        self.fp8_index = eqx.nn.StateIndex(F.initial_state_tree(recipe)) if delayed else None
        ks, knb, kk, bk = jax.random.split(key, 4)
        init = scale_init or _norm.default_scale_init(zero_centered_gamma)
        self.scale = init(ks, (in_features,), param_dtype)
        self.norm_bias = norm_bias_init(knb, (in_features,), param_dtype) if norm == "layer" else None
        self.kernel = kernel_init(kk, (in_features, out_features), param_dtype)
        self.bias = bias_init(bk, (out_features,), param_dtype) if use_bias else None
        self.norm, self.epsilon, self.zero_centered_gamma = norm, eps, bool(zero_centered_gamma)
        self.activation, self.return_normed, self.dtype = activation, bool(return_normed), dtype
        s_axes, nb_axes = _norm.norm_dense_axes(scale_axes, norm_bias_axes, kernel_axes)
        if bias_axes is None and kernel_axes is not None:
            bias_axes = (tuple(kernel_axes)[-1],)
        self.param_axes = {"scale": _axes(s_axes), "norm_bias": _axes(nb_axes) if norm == "layer" else None,
                           "kernel": _axes(kernel_axes), "bias": _axes(bias_axes)}  # fmt: skip

    def __call__(self, x: jax.Array, state: eqx.nn.State | None = None):
        x = V.dense_input("NormDense", x, self.dtype, self.kernel.shape[0])
        recipe = F.resolve("NormDense", self.fp8)
        F.warn_if_state_unused("NormDense", self.fp8, recipe, self.fp8_index is not None)
        tree = None
        if isinstance(recipe, F.DelayedScaling):
            if state is None or self.fp8_index is None:
                what = "no state was passed" if state is None else "the layer was built without it"
                raise ValueError(
                    V.err("NormDense", f"fp8 is {recipe!r}, which needs the layer's delayed-scaling state: call "
                                       "`out, state = layer(x, state)` with the eqx.nn.State of a model built with "
                                       "the same recipe (fp8= or inside te_layers.fp8_recipe) by "
                                       f"eqx.nn.make_with_state; {what}.")
                )  # fmt: skip
            tree = state.get(self.fp8_index)
            F.check_state_tree("NormDense", tree, recipe, "its eqx.nn.State entry (layer.fp8_index)")
        out = _norm.norm_dense_apply(self.norm, x, self.scale, self.norm_bias, self.kernel, self.bias,
                                     epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                                     activation=self.activation, dtype=self.dtype, fp8=recipe, fp8_state=tree,
                                     return_normed=self.return_normed)  # fmt: skip
        return out if state is None else (out, state)


class Softmax(eqx.Module):
    """te_ops softmax: ``variant`` "scaled", "masked" (call with ``mask``, True = masked out) or "causal"."""

    variant: str = eqx.field(static=True, default="scaled")
    scale: float = eqx.field(static=True, default=1.0)

    def __check_init__(self):
        V.check_softmax("Softmax", variant=self.variant, scale=self.scale)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        _refuse_state("Softmax", "mask", mask, "y = softmax(x)` or `softmax(x, mask)")
        x, mask = V.softmax_inputs("Softmax", x, mask, self.variant)
        return C.softmax_apply(x, variant=self.variant, scale=self.scale, mask=mask)


def _dropout_key(name, rate, inference, key):
    if inference or rate <= 0:
        return None
    if key is None:
        raise ValueError(V.err(name, "key is required for dropout (dropout_rate > 0): pass key= at call time, or "
                                     "inference=True."))  # fmt: skip
    return key


class DotProductAttention(eqx.Module):
    """Fused attention of ``q [B, Sq, Nq, D]``, ``k``/``v [B, Sk, Nkv, D]`` (GQA when Nkv < Nq)."""

    mask_type: str = eqx.field(static=True, default="none")
    window_size: tuple[int, int] | None = eqx.field(static=True, default=None)
    scale: float | None = eqx.field(static=True, default=None)
    dropout_rate: float = eqx.field(static=True, default=0.0)
    inference: bool = False

    def __check_init__(self):
        V.check_attention("DotProductAttention", mask_type=self.mask_type, window_size=self.window_size,
                          scale=self.scale, dropout_rate=self.dropout_rate)  # fmt: skip
        V.flag("DotProductAttention", "inference", self.inference)

    def __call__(self, q, k, v, *, bias=None, q_seqlens=None, kv_seqlens=None, q_segment_ids=None,
                 kv_segment_ids=None, q_segment_pos=None, kv_segment_pos=None, key=None,
                 inference: bool | None = None):  # fmt: skip
        q, k, v = V.attention_inputs("DotProductAttention", q, k, v)
        inf = self.inference if inference is None else inference
        return C.attention_apply(
            q, k, v, mask_type=self.mask_type, bias=bias, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_segment_pos=q_segment_pos,
            kv_segment_pos=kv_segment_pos, window_size=self.window_size,
            scale=self.scale, dropout_rate=self.dropout_rate,
            rng=_dropout_key("DotProductAttention", self.dropout_rate, inf, key), deterministic=inf,
        )  # fmt: skip


class MultiHeadAttention(eqx.Module):
    """Multi-head (GQA) self- or cross-attention with optional fused QKV projection and RoPE.

    Call: ``mha(x, inputs_kv=None, *, segment_ids=None, segment_pos=None, seqlens=None, positions=None, bias=None,
    key=None, inference=None, state=None)`` -> ``[B, S, out_features or in_features]``, or ``(out, state)``
    when ``state`` (an ``eqx.nn.State``, needed by delayed-scaling ``fp8``) is given. The state may
    also be passed positionally, ``out, state = mha(x, state)``, like the other layers that take one
    (Dense, NormDense, MoEBlock): an ``eqx.nn.State`` in the ``inputs_kv`` position is the state
    (cross-attention with a state: ``mha(x, inputs_kv, state=state)``).
    """

    qkv: Dense | None
    query: Dense | None
    key: Dense | None
    value: Dense | None
    out: Dense
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    mask_type: str = eqx.field(static=True)
    window_size: tuple[int, int] | None = eqx.field(static=True)
    use_rope: bool = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    dropout_rate: float = eqx.field(static=True)
    inference: bool

    def __init__(self, in_features: int, num_heads: int, head_dim: int, *, num_kv_heads: int | None = None,
                 out_features: int | None = None, fused_qkv: bool = True, use_bias: bool = False,
                 mask_type: str = "causal", window_size: tuple[int, int] | None = None, use_rope: bool = True,
                 rope_theta: float = 10000.0, dropout_rate: float = 0.0, inference: bool = False,
                 dtype: Any = None, param_dtype: Any = jnp.float32, kernel_init: Initializer = _lecun,
                 bias_init: Initializer = _zeros, kernel_axes: Axes = ("embed", "heads"),
                 out_kernel_axes: Axes = ("heads", "embed"), fp8: Any = None, key: jax.Array):  # fmt: skip
        nkv = V.check_mha(
            "MultiHeadAttention", in_features=in_features, num_heads=num_heads, head_dim=head_dim,
            num_kv_heads=num_kv_heads, out_features=out_features, fused_qkv=fused_qkv, use_bias=use_bias,
            mask_type=mask_type, window_size=window_size, use_rope=use_rope, rope_theta=rope_theta,
            dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype, kernel_axes=kernel_axes,
            out_kernel_axes=out_kernel_axes,
        )  # fmt: skip
        V.flag("MultiHeadAttention", "inference", inference)
        F.check_recipe_arg("MultiHeadAttention", fp8)
        keys = iter(jax.random.split(key, 5))

        def proj(fin, n, axes):
            return Dense(fin, n, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                         bias_init=bias_init, kernel_axes=axes, fp8=fp8, key=next(keys))  # fmt: skip

        d = head_dim
        self.qkv = proj(in_features, (num_heads + 2 * nkv) * d, kernel_axes) if fused_qkv else None
        self.query = None if fused_qkv else proj(in_features, num_heads * d, kernel_axes)
        self.key = None if fused_qkv else proj(in_features, nkv * d, kernel_axes)
        self.value = None if fused_qkv else proj(in_features, nkv * d, kernel_axes)
        self.out = proj(num_heads * d, out_features or in_features, out_kernel_axes)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, nkv, head_dim
        self.mask_type, self.window_size = mask_type, window_size
        self.use_rope, self.rope_theta = use_rope, rope_theta
        self.dropout_rate, self.inference = dropout_rate, inference

    def __call__(self, x, inputs_kv=None, *, segment_ids=None, segment_pos=None, seqlens=None, positions=None,
                 bias=None, key=None, inference: bool | None = None, state: eqx.nn.State | None = None):  # fmt: skip
        if isinstance(inputs_kv, eqx.nn.State):  # mha(x, state), as dense(x, state) / moe(x, state)
            if state is not None:
                raise TypeError(
                    V.err("MultiHeadAttention", "got an eqx.nn.State both as inputs_kv (the second positional "
                                                "argument) and as state=; pass it once: `out, state = mha(x, state)`, "
                                                "or `mha(x, inputs_kv, state=state)` for cross-attention.")
                )  # fmt: skip
            inputs_kv, state = None, inputs_kv
        in_features = (self.qkv if self.qkv is not None else self.query).kernel.shape[0]
        x, inputs_kv = V.mha_inputs(
            "MultiHeadAttention", x, inputs_kv, dtype=self.out.dtype, in_features=in_features,
            kv_features=in_features, fused_qkv=self.qkv is not None, use_rope=self.use_rope,
            mask_type=self.mask_type, segment_ids=segment_ids, seqlens=seqlens, positions=positions,
            segment_pos=segment_pos,
        )  # fmt: skip
        inf = self.inference if inference is None else inference
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        b, s = x.shape[:2]

        def proj(layer, a):
            nonlocal state
            if state is None:
                return layer(a)
            y, state = layer(a, state)
            return y

        if self.qkv is not None:
            q, k, v = C.split_qkv(proj(self.qkv, x), nq, nkv, d)
        else:
            kv_in = x if inputs_kv is None else inputs_kv
            q = proj(self.query, x).reshape(b, s, nq, d)
            k = proj(self.key, kv_in).reshape(b, kv_in.shape[1], nkv, d)
            v = proj(self.value, kv_in).reshape(b, kv_in.shape[1], nkv, d)
        padded = self.mask_type.startswith("padding")
        o = C.heads_attention(
            q, k, v, use_rope=self.use_rope, rope_theta=self.rope_theta, positions=positions, kv_positions=None,
            segment_ids=segment_ids, segment_pos=segment_pos, mask_type=self.mask_type, bias=bias,
            q_seqlens=seqlens if padded else None, kv_seqlens=seqlens if padded and inputs_kv is None else None,
            window_size=self.window_size, dropout_rate=self.dropout_rate,
            rng=_dropout_key("MultiHeadAttention", self.dropout_rate, inf, key), deterministic=inf,
        )  # fmt: skip
        out = proj(self.out, o)
        return out if state is None else (out, state)


class MoEAux(NamedTuple):
    aux_loss: jax.Array  # scalar float32
    tokens_per_expert: jax.Array  # int32 [E]


class TopKRouter(eqx.Module):
    """Router: logits = x @ kernel ``[H, E]`` (float32), then te_ops top-k routing and the aux loss.

    Router options (keywords, see :class:`te_layers._common.RouterConfig`): score_function,
    use_pre_softmax, num_groups, group_topk, scaling_factor, aux_loss_coeff, use_expert_bias,
    expert_bias_update_rate. Returns ``RouterOutput(probs, routing_map, aux_loss, tokens_per_expert)``.
    """

    kernel: jax.Array
    expert_bias: jax.Array | None
    cfg: C.RouterConfig = eqx.field(static=True)
    param_axes: dict = eqx.field(static=True)

    def __init__(self, in_features: int, num_experts: int, topk: int, *, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = _lecun, kernel_axes: Axes = ("embed", None), key: jax.Array,
                 **router_options):  # fmt: skip
        router_options.setdefault("aux_loss_coeff", 0.0)
        self.cfg = C.router_config("TopKRouter", num_experts, topk, router_options)
        V.check_router_params("TopKRouter", in_features=in_features, param_dtype=param_dtype, kernel_axes=kernel_axes)
        self.kernel = kernel_init(key, (in_features, num_experts), param_dtype)
        self.expert_bias = jnp.zeros((num_experts,), jnp.float32) if self.cfg.use_expert_bias else None
        self.param_axes = {"kernel": _axes(kernel_axes), "expert_bias": (None,)}

    def __call__(self, x: jax.Array) -> C.RouterOutput:
        x = V.token_input("TopKRouter", x, None, self.kernel.shape[0], router=True)
        logits = C.router_logits(x.reshape(-1, x.shape[-1]), self.kernel)
        bias = None if self.expert_bias is None else jax.lax.stop_gradient(self.expert_bias)
        return C.route(logits, self.cfg, bias)

    def update_expert_bias(self, tokens_per_expert: jax.Array) -> TopKRouter:
        """A copy with the aux-loss-free bias moved towards balance (no-op without use_expert_bias)."""
        if self.expert_bias is None:
            return self
        new = C.updated_expert_bias(self.expert_bias, tokens_per_expert, self.cfg.expert_bias_update_rate)
        return eqx.tree_at(lambda m: m.expert_bias, self, new)


class MoEBlock(eqx.Module):
    """Mixture-of-experts FFN: router -> token_dispatch -> grouped expert FFN -> token_combine.

    Parameters: ``router.kernel [H, E]``, ``wi [E, H, 2F]`` (gated) or ``[E, H, F]``, ``wo [E, F, H]``.
    With ``expert_axis`` the experts are sharded over that mesh axis (``mesh`` or the mesh set with
    ``jax.set_mesh``) and tokens exchanged by all-to-all. ``block(x)`` returns
    ``(out [..., H], MoEAux(aux_loss, tokens_per_expert))``. ``fp8``: the experts' recipe
    (CurrentScaling, DelayedScaling or 1 x 128 / 128 x 128 BlockScaling), None (the context's) or
    False. ``fp8_dispatch`` (default True): with FP8 experts, quantize the tokens once and dispatch
    the FP8 rows (``te_ops.fp8.fp8_dispatch_grouped_dense``); with ``expert_axis`` the FP8 rows (and
    their 1 x 128 scale rows) also cross the all-to-all (current scaling: one scale from the amax over
    all shards' tokens; the gradient crosses back in high precision). False dispatches (and
    exchanges) high-precision rows. With DelayedScaling (argument, or the context at
    construction) the block holds
    ``fp8_index`` (an ``eqx.nn.StateIndex`` with the state of both grouped GEMMs) and is called as
    ``(out, aux), state = block(x, state)``; any MoEBlock called with a state returns
    ``((out, aux), state)``, like the other stateful layers.
    """

    router: TopKRouter
    wi: jax.Array
    wo: jax.Array
    cfg: C.MoEConfig = eqx.field(static=True)
    mesh: Any = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    param_axes: dict = eqx.field(static=True)
    fp8: Any = eqx.field(static=True)
    fp8_index: eqx.nn.StateIndex | None

    def __init__(self, in_features: int, num_experts: int, topk: int, ffn_dim: int, *, activation: str = "silu",
                 gated: bool = True, aux_loss_coeff: float = 1e-2, expert_axis: str | None = None, mesh: Any = None,
                 grouped_gemm: str = "auto", dtype: Any = None, param_dtype: Any = jnp.float32,
                 router_param_dtype: Any = jnp.float32, kernel_init: Initializer = _expert_init,
                 router_kernel_init: Initializer = _lecun, router_kernel_axes: Axes = ("embed", None),
                 wi_axes: Axes = ("expert", "embed", "mlp"), wo_axes: Axes = ("expert", "mlp", "embed"),
                 fp8: Any = None, fp8_dispatch: bool = True, key: jax.Array, **router_options):  # fmt: skip
        rc = C.router_config("MoEBlock", num_experts, topk, dict(router_options, aux_loss_coeff=aux_loss_coeff))
        cfg = C.MoEConfig(rc, ffn_dim, activation, gated, expert_axis, grouped_gemm, fp8_dispatch)
        V.check_moe_params(
            "MoEBlock", in_features=in_features, num_experts=num_experts, expert_axis=expert_axis, mesh=mesh,
            dtype=dtype, param_dtype=param_dtype, router_param_dtype=router_param_dtype,
            router_kernel_axes=router_kernel_axes, wi_axes=wi_axes, wo_axes=wo_axes,
        )  # fmt: skip
        F.check_recipe_arg("MoEBlock", fp8)
        self.fp8 = fp8
        recipe = F.resolve("MoEBlock", fp8, grouped=True)
        delayed = isinstance(recipe, F.DelayedScaling)
        self.fp8_index = eqx.nn.StateIndex(F.initial_moe_state_tree(recipe, num_experts)) if delayed else None
        rk, ik, ok = jax.random.split(key, 3)  # (checked above, so errors name MoEBlock, not TopKRouter)
        self.router = TopKRouter(in_features, num_experts, topk, param_dtype=router_param_dtype,
                                 kernel_init=router_kernel_init, kernel_axes=router_kernel_axes, key=rk,
                                 aux_loss_coeff=aux_loss_coeff, **router_options)  # fmt: skip
        f2 = ffn_dim * (2 if gated else 1)
        self.wi = kernel_init(ik, (num_experts, in_features, f2), param_dtype)
        self.wo = kernel_init(ok, (num_experts, ffn_dim, in_features), param_dtype)
        self.cfg = cfg
        self.mesh, self.dtype = mesh, dtype
        self.param_axes = {"wi": _axes(wi_axes), "wo": _axes(wo_axes)}

    def __call__(self, x: jax.Array, state: eqx.nn.State | None = None):
        x = V.token_input("MoEBlock", x, self.dtype, self.wi.shape[1])
        bias = None if self.router.expert_bias is None else jax.lax.stop_gradient(self.router.expert_bias)
        recipe = F.resolve("MoEBlock", self.fp8, grouped=True)
        F.warn_if_state_unused("MoEBlock", self.fp8, recipe, self.fp8_index is not None)
        tree = None
        if isinstance(recipe, F.DelayedScaling):
            if state is None or self.fp8_index is None:
                what = "no state was passed" if state is None else "the layer was built without it"
                raise ValueError(
                    V.err("MoEBlock", f"fp8 is {recipe!r}, which needs the experts' delayed-scaling state: call "
                                      "`(out, aux), state = moe(x, state)` with the eqx.nn.State of a model built "
                                      "with the same recipe (fp8= or inside te_layers.fp8_recipe) by "
                                      f"eqx.nn.make_with_state; {what}.")
                )  # fmt: skip
            tree = state.get(self.fp8_index)
            F.check_moe_state_tree("MoEBlock", tree, recipe, self.wi.shape[0], "its eqx.nn.State entry (moe.fp8_index)")
        r = C.moe_apply(x, self.router.kernel, self.wi, self.wo, self.cfg, bias, dtype=self.dtype, mesh=self.mesh,
                        fp8=recipe, fp8_state=tree)  # fmt: skip
        out = (r.out, MoEAux(r.aux_loss, r.tokens_per_expert))
        return out if state is None else (out, state)

    def update_expert_bias(self, tokens_per_expert: jax.Array) -> MoEBlock:
        """A copy with the router's aux-loss-free bias updated (no-op without use_expert_bias)."""
        return eqx.tree_at(lambda m: m.router, self, self.router.update_expert_bias(tokens_per_expert))


def logical_axes(model: Any) -> Any:
    """A pytree like ``model`` whose array leaves are replaced by ``PartitionSpec`` s of logical axis
    names (``PartitionSpec()`` where a parameter has none). Map them to mesh axes with your rules."""

    def visit(node):
        if isinstance(node, eqx.Module):
            axes = getattr(node, "param_axes", {})
            names, values = [], []
            for f in dataclasses.fields(node):
                if f.metadata.get("static", False):
                    continue
                v = getattr(node, f.name)
                if isinstance(v, jax.Array):
                    names.append(f.name)
                    values.append(PartitionSpec(*(axes.get(f.name) or ())))
                elif isinstance(v, (eqx.Module, list, tuple, dict)):
                    names.append(f.name)
                    values.append(visit(v))
            if not names:
                return node
            return eqx.tree_at(lambda m: [getattr(m, n) for n in names], node, values, is_leaf=lambda x: x is None)
        if isinstance(node, (list, tuple)):
            return type(node)(visit(v) for v in node)
        if isinstance(node, dict):
            return {k: visit(v) for k, v in node.items()}
        return PartitionSpec() if isinstance(node, jax.Array) else node

    return visit(model)


__all__ = [
    "Dense",
    "DotProductAttention",
    "LayerNorm",
    "MoEAux",
    "MoEBlock",
    "MultiHeadAttention",
    "NormDense",
    "NormDenseOutput",
    "RMSNorm",
    "Softmax",
    "TopKRouter",
    "fp8_accumulate",
    "fp8_update",
    "fp8_value_and_grad",
    "logical_axes",
]
