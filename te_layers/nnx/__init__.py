"""Flax NNX modules on te_ops: Dense, Softmax, DotProductAttention, MultiHeadAttention, TopKRouter,
MoEBlock, NormDense (RMSNorm or LayerNorm, then Dense); RMSNorm, LayerNorm (in ``norm.py``).

Conventions: input sizes given at construction, parameters created eagerly from ``rngs``
(``rngs.params``), ``nnx.Param`` carrying ``out_sharding`` logical axis metadata (what
``nnx.with_partitioning`` attaches; resolved with ``nnx.get_partition_spec`` and logical axis rules),
dropout keys from a forked ``rngs.dropout`` stream, ``deterministic`` as an attribute switched in place
by ``model.train()`` / ``model.eval()``, set on a view by ``nnx.view(model, deterministic=True)``
(``set_view``, as flax's own nnx.Dropout and nnx.MultiHeadAttention), or overridden per call
(``deterministic=``); it turns dropout off (DotProductAttention, MultiHeadAttention) and the
expert-bias update off (TopKRouter, MoEBlock). MoE aux losses are sown as
:class:`AuxLoss` (an ``nnx.Intermediate``): capture them with
``nnx.capture(fn, te_layers.nnx.AuxLoss)`` and sum the captured state with :func:`collect_aux_loss`.
Outside ``nnx.capture`` nothing is sown: a call leaves the module unchanged (no variable that grows
per call, no ``nnx.jit`` retrace, no flax DeprecationWarning). The
aux-loss-free expert bias is an :class:`ExpertBias` variable (not an ``nnx.Param``, so optimisers
skip it) updated in place on training calls.

FP8: ``Dense``, the ``MultiHeadAttention`` projections and the ``MoEBlock`` experts take ``fp8=`` (a
``te_ops.fp8`` recipe, None = the :func:`te_layers.fp8_recipe` context, False = high precision).
A Dense or MoEBlock built with DelayedScaling holds an :class:`FP8State` variable, updated by
:func:`fp8_value_and_grad` (``te_layers.nnx.fp8``). One that got it from the context (``fp8=None``)
must be called inside the context too: called outside every ``fp8_recipe`` block it runs in high
precision, its FP8State is not updated, and it warns (``te_layers.fp8_recipe(None)``: no warning);
inside a CurrentScaling or BlockScaling context it runs with that recipe and warns the same way.

Configuration is checked in ``__init__`` and inputs when a module is called, with the same messages as
the Linen and Equinox modules (``te_layers.<Layer>: ...``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_layers import _common as C
from te_layers import _fp8 as F
from te_layers import _norm
from te_layers import _validation as V
from te_layers._norm import NormDenseOutput
from te_layers.nnx.fp8 import FP8State, fp8_accumulate, fp8_value_and_grad
from te_layers.nnx.norm import LayerNorm, RMSNorm

Initializer = Callable[..., jax.Array]
Axes = Sequence[str | None] | None

_lecun = jax.nn.initializers.lecun_normal()
_zeros = jax.nn.initializers.zeros
_expert_init = C.default_expert_init()


class AuxLoss(nnx.Intermediate):
    """A sown MoE load-balancing loss."""


class TokensPerExpert(nnx.Intermediate):
    """Sown per-expert token counts of the last call."""


class ExpertBias(nnx.Variable):
    """Aux-loss-free balancing bias ``[E]``: not trained by gradients, updated from token counts."""


_SOW_HAS_CAPTURE_NOOP = "capture_noop" in inspect.signature(nnx.Module.sow).parameters


def _sow(mod: nnx.Module, variable_type: type[nnx.Variable], name: str, value: Any) -> None:
    """``mod.sow`` into the enclosing ``nnx.capture`` only. Outside one the module is left as it is:
    flax's deprecated fallback would store the value as a variable on the module that grows by one
    entry per call (and so changes the module's state: an ``nnx.jit`` retrace on every call)."""
    if _SOW_HAS_CAPTURE_NOOP:
        mod.sow(variable_type, name, value, capture_noop=True)
    elif hasattr(mod, "__captures__"):  # a flax without capture_noop: the test its sow makes
        mod.sow(variable_type, name, value)


def _param(rngs: nnx.Rngs, init: Initializer, shape, dtype, axes: Axes) -> nnx.Param:
    value = init(rngs.params(), tuple(shape), dtype)
    if axes is None:
        return nnx.Param(value)
    # Logical names are metadata (resolved by nnx.get_partition_spec + logical axis rules), so no eager
    # sharding: a name such as "embed" is not a mesh axis.
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def _dropout_stream(rngs: nnx.Rngs | None, rate: float):
    if rate > 0 and rngs is not None:
        return rngs.dropout.fork()
    return nnx.data(None)


class _DeterministicView(nnx.Module):
    """Base of the modules with a ``deterministic`` attribute: ``set_view`` for ``nnx.view``."""

    def set_view(self, deterministic: bool | None = None):
        """Used by ``nnx.view``: ``nnx.view(model, deterministic=True)`` returns a view of the model
        (sharing its variables) with this module deterministic, as ``model.eval()`` does in place:
        attention without dropout; router and MoE block without the expert-bias update (aux-loss-free
        balancing).

        Args:
          deterministic: True makes the module deterministic, False not; None leaves it as it is.
        """
        if deterministic is not None:
            self.deterministic = V.flag(type(self).__name__, "deterministic", deterministic)


class Dense(nnx.Module):
    """``activation(x @ kernel + bias)`` on ``te_ops.dense``: kernel ``[in_features, out_features]``.

    ``fp8``: a ``te_ops.fp8`` recipe (the GEMM is ``te_ops.fp8.fp8_dense``), None (the recipe of the
    :func:`te_layers.fp8_recipe` context when called) or False (high precision). With DelayedScaling
    (argument, or the context at construction) the layer holds ``fp8_state``, an :class:`FP8State`.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 activation: str | Callable | None = None, dtype: Any = None, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = _lecun, bias_init: Initializer = _zeros, kernel_axes: Axes = None,
                 bias_axes: Axes = None, fp8: Any = None, rngs: nnx.Rngs):  # fmt: skip
        V.check_dense("Dense", sizes={"in_features": in_features, "out_features": out_features}, use_bias=use_bias,
                      activation_=activation, dtype=dtype, param_dtype=param_dtype, kernel_axes=kernel_axes,
                      bias_axes=bias_axes)  # fmt: skip
        recipe = F.resolve("Dense", fp8)
        self.fp8 = nnx.static(fp8)
        delayed = isinstance(recipe, F.DelayedScaling)
        self.fp8_state = FP8State(F.initial_state_tree(recipe)) if delayed else nnx.data(None)
        self.in_features, self.out_features = in_features, out_features
        self.activation, self.dtype = activation, dtype
        self.kernel = _param(rngs, kernel_init, (in_features, out_features), param_dtype, kernel_axes)
        if bias_axes is None and kernel_axes is not None:
            bias_axes = (tuple(kernel_axes)[-1],)
        self.bias = _param(rngs, bias_init, (out_features,), param_dtype, bias_axes) if use_bias else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = V.dense_input("Dense", x, self.dtype, self.in_features)
        bias = None if self.bias is None else self.bias[...]
        recipe = F.resolve("Dense", self.fp8)
        F.warn_if_state_unused("Dense", self.fp8, recipe, self.fp8_state is not None)
        state = None
        if isinstance(recipe, F.DelayedScaling):
            state = None if self.fp8_state is None else self.fp8_state.get_value()
            F.check_state_tree("Dense", state, recipe, "its FP8State variable (dense.fp8_state)")
        return C.dense_apply(x, self.kernel[...], bias, activation=self.activation, dtype=self.dtype, fp8=recipe,
                             fp8_state=state)  # fmt: skip


class NormDense(nnx.Module):
    """``activation(norm(x) @ kernel + bias)``: RMSNorm (``norm="rms"``) or LayerNorm (``norm="layer"``)
    over the last axis, then the :class:`Dense` projection. Parameters ``scale [in_features]``
    (``norm_bias [in_features]`` with LayerNorm), ``kernel [in_features, out_features]``,
    ``bias [out_features]``.

    The norm is :class:`RMSNorm` / :class:`LayerNorm` (float32 statistics, output in the compute dtype;
    ``epsilon`` None: 1e-6 for "rms", 1e-5 for "layer"; ``zero_centered_gamma``: applied scale
    ``1 + scale``, ``scale_init`` None means ones, zeros with ``zero_centered_gamma``). The projection
    is :class:`Dense` (same ``kernel_init``, ``bias_init``, ``use_bias``, ``activation``, ``dtype``, ``fp8``).
    Logical axes: ``scale_axes`` None follows ``kernel_axes[0]``, ``norm_bias_axes`` None follows
    ``scale_axes``, ``bias_axes`` None follows ``kernel_axes[-1]``.

    ``return_normed=True``: returns ``NormDenseOutput(y, normed)`` with the normalized input. ``fp8``: as
    :class:`Dense`; only the GEMM runs in FP8, the norm stays in high precision (the quantization of its
    output is not fused into the norm kernel yet). With DelayedScaling (argument, or the context at
    construction) the layer holds ``fp8_state``, an :class:`FP8State`.
    """

    def __init__(self, in_features: int, out_features: int, *, norm: str = "rms", epsilon: float | None = None,
                 zero_centered_gamma: bool = False, use_bias: bool = True, activation: str | Callable | None = None,
                 return_normed: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
                 scale_init: Initializer | None = None, norm_bias_init: Initializer = _zeros,
                 kernel_init: Initializer = _lecun, bias_init: Initializer = _zeros, scale_axes: Axes = None,
                 norm_bias_axes: Axes = None, kernel_axes: Axes = None, bias_axes: Axes = None, fp8: Any = None,
                 rngs: nnx.Rngs):  # fmt: skip
        eps = V.check_norm_dense("NormDense", sizes={"in_features": in_features, "out_features": out_features},
                                 norm=norm, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                                 use_bias=use_bias, activation_=activation, return_normed=return_normed, dtype=dtype,
                                 param_dtype=param_dtype, scale_axes=scale_axes, norm_bias_axes=norm_bias_axes,
                                 kernel_axes=kernel_axes, bias_axes=bias_axes)  # fmt: skip
        recipe = F.resolve("NormDense", fp8)
        self.fp8 = nnx.static(fp8)
        delayed = isinstance(recipe, F.DelayedScaling)
        self.fp8_state = FP8State(F.initial_state_tree(recipe)) if delayed else nnx.data(None)
        self.in_features, self.out_features, self.norm = in_features, out_features, norm
        self.epsilon, self.zero_centered_gamma, self.return_normed = eps, zero_centered_gamma, return_normed
        self.activation, self.dtype = activation, dtype
        s_axes, nb_axes = _norm.norm_dense_axes(scale_axes, norm_bias_axes, kernel_axes)
        init = scale_init or _norm.default_scale_init(zero_centered_gamma)
        self.scale = _param(rngs, init, (in_features,), param_dtype, s_axes)
        self.norm_bias = (_param(rngs, norm_bias_init, (in_features,), param_dtype, nb_axes) if norm == "layer"
                          else nnx.data(None))  # fmt: skip
        self.kernel = _param(rngs, kernel_init, (in_features, out_features), param_dtype, kernel_axes)
        if bias_axes is None and kernel_axes is not None:
            bias_axes = (tuple(kernel_axes)[-1],)
        self.bias = _param(rngs, bias_init, (out_features,), param_dtype, bias_axes) if use_bias else nnx.data(None)

    def __call__(self, x: jax.Array):
        x = V.dense_input("NormDense", x, self.dtype, self.in_features)
        norm_bias = None if self.norm_bias is None else self.norm_bias[...]
        bias = None if self.bias is None else self.bias[...]
        recipe = F.resolve("NormDense", self.fp8)
        F.warn_if_state_unused("NormDense", self.fp8, recipe, self.fp8_state is not None)
        state = None
        if isinstance(recipe, F.DelayedScaling):
            state = None if self.fp8_state is None else self.fp8_state.get_value()
            F.check_state_tree("NormDense", state, recipe, "its FP8State variable (layer.fp8_state)")
        return _norm.norm_dense_apply(self.norm, x, self.scale[...], norm_bias, self.kernel[...], bias,
                                      epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                                      activation=self.activation, dtype=self.dtype, fp8=recipe, fp8_state=state,
                                      return_normed=self.return_normed)  # fmt: skip


class Softmax(nnx.Module):
    """te_ops softmax: ``variant`` "scaled", "masked" (call with ``mask``, True = masked out) or "causal"."""

    def __init__(self, variant: str = "scaled", scale: float = 1.0):
        V.check_softmax("Softmax", variant=variant, scale=scale)
        self.variant, self.scale = variant, scale

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x, mask = V.softmax_inputs("Softmax", x, mask, self.variant)
        return C.softmax_apply(x, variant=self.variant, scale=self.scale, mask=mask)


class DotProductAttention(_DeterministicView):
    """Fused attention of ``q [B, Sq, Nq, D]``, ``k``/``v [B, Sk, Nkv, D]`` (GQA when Nkv < Nq)."""

    def __init__(self, *, mask_type: str = "none", window_size: tuple[int, int] | None = None,
                 scale: float | None = None, dropout_rate: float = 0.0, deterministic: bool = False,
                 rngs: nnx.Rngs | None = None):  # fmt: skip
        V.check_attention("DotProductAttention", mask_type=mask_type, window_size=window_size, scale=scale,
                          dropout_rate=dropout_rate)  # fmt: skip
        V.flag("DotProductAttention", "deterministic", deterministic)
        self.mask_type, self.window_size, self.scale = mask_type, window_size, scale
        self.dropout_rate, self.deterministic = dropout_rate, deterministic
        self.rngs = _dropout_stream(rngs, dropout_rate)

    def __call__(self, q, k, v, *, bias=None, q_seqlens=None, kv_seqlens=None, q_segment_ids=None,
                 kv_segment_ids=None, q_segment_pos=None, kv_segment_pos=None, deterministic: bool | None = None,
                 rngs=None):  # fmt: skip
        q, k, v = V.attention_inputs("DotProductAttention", q, k, v)
        det = self.deterministic if deterministic is None else deterministic
        return C.attention_apply(
            q, k, v, mask_type=self.mask_type, bias=bias, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_segment_pos=q_segment_pos,
            kv_segment_pos=kv_segment_pos, window_size=self.window_size,
            scale=self.scale, dropout_rate=self.dropout_rate, rng=_dropout_key(self, rngs, det), deterministic=det,
        )  # fmt: skip


def _dropout_key(mod, rngs, deterministic):
    if deterministic or mod.dropout_rate <= 0:
        return None
    stream = rngs if rngs is not None else mod.rngs
    if stream is None:
        raise ValueError(
            V.err(type(mod).__name__, "rngs is required for dropout (pass rngs= at construction or call), or call "
                                      "with deterministic=True / model.eval().")
        )  # fmt: skip
    if isinstance(stream, nnx.Rngs):
        return stream.dropout()
    return stream() if isinstance(stream, nnx.RngStream) else stream


class MultiHeadAttention(_DeterministicView):
    """Multi-head (GQA) self- or cross-attention with optional fused QKV projection and RoPE.

    Call: ``mha(x, inputs_kv=None, *, segment_ids=None, segment_pos=None, seqlens=None, positions=None, bias=None,
    deterministic=None)`` -> ``[B, S, out_features or in_features]``.
    """

    def __init__(self, in_features: int, num_heads: int, head_dim: int, *, num_kv_heads: int | None = None,
                 out_features: int | None = None, fused_qkv: bool = True, use_bias: bool = False,
                 mask_type: str = "causal", window_size: tuple[int, int] | None = None, use_rope: bool = True,
                 rope_theta: float = 10000.0, dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype: Any = None, param_dtype: Any = jnp.float32, kernel_init: Initializer = _lecun,
                 bias_init: Initializer = _zeros, kernel_axes: Axes = ("embed", "heads"),
                 out_kernel_axes: Axes = ("heads", "embed"), fp8: Any = None, rngs: nnx.Rngs):  # fmt: skip
        nkv = V.check_mha(
            "MultiHeadAttention", in_features=in_features, num_heads=num_heads, head_dim=head_dim,
            num_kv_heads=num_kv_heads, out_features=out_features, fused_qkv=fused_qkv, use_bias=use_bias,
            mask_type=mask_type, window_size=window_size, use_rope=use_rope, rope_theta=rope_theta,
            dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype, kernel_axes=kernel_axes,
            out_kernel_axes=out_kernel_axes,
        )  # fmt: skip
        V.flag("MultiHeadAttention", "deterministic", deterministic)
        F.check_recipe_arg("MultiHeadAttention", fp8)
        self.in_features, self.dtype = in_features, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, nkv, head_dim
        self.fused_qkv, self.mask_type, self.window_size = fused_qkv, mask_type, window_size
        self.use_rope, self.rope_theta = use_rope, rope_theta
        self.dropout_rate, self.deterministic = dropout_rate, deterministic

        def proj(fin, n, axes):
            return Dense(fin, n, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                         bias_init=bias_init, kernel_axes=axes, fp8=fp8, rngs=rngs)  # fmt: skip

        d = head_dim
        if fused_qkv:
            self.qkv = proj(in_features, (num_heads + 2 * nkv) * d, kernel_axes)
        else:
            self.query = proj(in_features, num_heads * d, kernel_axes)
            self.key = proj(in_features, nkv * d, kernel_axes)
            self.value = proj(in_features, nkv * d, kernel_axes)
        self.out = proj(num_heads * d, out_features or in_features, out_kernel_axes)
        self.rngs = _dropout_stream(rngs, dropout_rate)

    def __call__(self, x, inputs_kv=None, *, segment_ids=None, segment_pos=None, seqlens=None, positions=None,
                 bias=None, deterministic: bool | None = None, rngs=None):  # fmt: skip
        x, inputs_kv = V.mha_inputs(
            "MultiHeadAttention", x, inputs_kv, dtype=self.dtype, in_features=self.in_features,
            kv_features=self.in_features, fused_qkv=self.fused_qkv, use_rope=self.use_rope, mask_type=self.mask_type,
            segment_ids=segment_ids, seqlens=seqlens, positions=positions, segment_pos=segment_pos,
        )  # fmt: skip
        det = self.deterministic if deterministic is None else deterministic
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        b, s = x.shape[:2]
        if self.fused_qkv:
            q, k, v = C.split_qkv(self.qkv(x), nq, nkv, d)
        else:
            kv_in = x if inputs_kv is None else inputs_kv
            q = self.query(x).reshape(b, s, nq, d)
            k = self.key(kv_in).reshape(b, kv_in.shape[1], nkv, d)
            v = self.value(kv_in).reshape(b, kv_in.shape[1], nkv, d)
        padded = self.mask_type.startswith("padding")
        o = C.heads_attention(
            q, k, v, use_rope=self.use_rope, rope_theta=self.rope_theta, positions=positions, kv_positions=None,
            segment_ids=segment_ids, segment_pos=segment_pos, mask_type=self.mask_type, bias=bias,
            q_seqlens=seqlens if padded else None, kv_seqlens=seqlens if padded and inputs_kv is None else None,
            window_size=self.window_size, dropout_rate=self.dropout_rate, rng=_dropout_key(self, rngs, det),
            deterministic=det,
        )  # fmt: skip
        return self.out(o)


class _RouterParams(nnx.Module):
    def __init__(self, in_features, num_experts, use_expert_bias, param_dtype, kernel_init, kernel_axes, rngs):
        self.kernel = _param(rngs, kernel_init, (in_features, num_experts), param_dtype, kernel_axes)
        self.expert_bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32)) if use_expert_bias else nnx.data(None)

    def bias_value(self):
        return None if self.expert_bias is None else self.expert_bias[...]

    def update(self, cfg: C.RouterConfig, tokens_per_expert, deterministic):
        if self.expert_bias is not None and not deterministic:
            self.expert_bias[...] = C.updated_expert_bias(
                self.expert_bias[...], tokens_per_expert, cfg.expert_bias_update_rate
            )


class TopKRouter(_DeterministicView):
    """Router: logits = x @ kernel ``[H, E]`` (float32), then te_ops top-k routing and the aux loss.

    Router options (keywords, see :class:`te_layers._common.RouterConfig`): score_function,
    use_pre_softmax, num_groups, group_topk, scaling_factor, aux_loss_coeff, use_expert_bias,
    expert_bias_update_rate. Returns a ``RouterOutput(probs, routing_map, aux_loss, tokens_per_expert)``;
    with ``aux_loss_coeff`` the aux loss is also sown as :class:`AuxLoss` into an enclosing
    ``nnx.capture`` (outside one nothing is stored on the module).
    """

    def __init__(self, in_features: int, num_experts: int, topk: int, *, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = _lecun, kernel_axes: Axes = ("embed", None),
                 deterministic: bool = False, rngs: nnx.Rngs, **router_options):  # fmt: skip
        router_options.setdefault("aux_loss_coeff", 0.0)
        self.cfg = nnx.static(C.router_config("TopKRouter", num_experts, topk, router_options))
        V.check_router_params("TopKRouter", in_features=in_features, param_dtype=param_dtype, kernel_axes=kernel_axes)
        self.in_features, self.deterministic = in_features, V.flag("TopKRouter", "deterministic", deterministic)
        p = _RouterParams(in_features, num_experts, self.cfg.use_expert_bias, param_dtype, kernel_init,
                          kernel_axes, rngs)  # fmt: skip
        self.kernel, self.expert_bias = p.kernel, p.expert_bias

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> C.RouterOutput:
        x = V.token_input("TopKRouter", x, None, self.in_features, router=True)
        det = self.deterministic if deterministic is None else deterministic
        bias = None if self.expert_bias is None else self.expert_bias[...]
        logits = C.router_logits(x.reshape(-1, x.shape[-1]), self.kernel[...])
        r = C.route(logits, self.cfg, bias)
        if self.cfg.aux_loss_coeff:
            _sow(self, AuxLoss, "aux_loss", r.aux_loss)
        if self.expert_bias is not None and not det:
            self.expert_bias[...] = C.updated_expert_bias(bias, r.tokens_per_expert, self.cfg.expert_bias_update_rate)
        return r


class MoEBlock(_DeterministicView):
    """Mixture-of-experts FFN: router -> token_dispatch -> grouped expert FFN -> token_combine.

    Parameters: ``router.kernel [H, E]``, ``wi [E, H, 2F]`` (gated) or ``[E, H, F]``, ``wo [E, F, H]``.
    With ``expert_axis`` the experts are sharded over that mesh axis (``mesh`` or the mesh set with
    ``jax.set_mesh``) and tokens exchanged by all-to-all. Returns ``[..., H]``; the aux loss is sown
    as :class:`AuxLoss` and the token counts as :class:`TokensPerExpert` into an enclosing
    ``nnx.capture`` (outside one nothing is stored on the module: repeated calls leave its state, and
    an ``nnx.jit`` of them traces once). ``fp8``: the experts'
    recipe (CurrentScaling, DelayedScaling or 1 x 128 / 128 x 128 BlockScaling), None (the
    context's) or False. ``fp8_dispatch`` (default True): with FP8 experts, quantize the tokens once
    and dispatch the FP8 rows (``te_ops.fp8.fp8_dispatch_grouped_dense``); with ``expert_axis`` the
    FP8 rows (and their 1 x 128 scale rows) also cross the all-to-all (current scaling: one scale from
    the amax over all shards' tokens; the gradient crosses back in high precision). False dispatches
    (and exchanges) high-precision rows. With DelayedScaling (argument, or the context at
    construction) the block
    holds ``fp8_state``, an :class:`FP8State` with the state of both grouped GEMMs
    (``{"wi", "wo"}``, the kernels' amax histories and scales one per expert).
    """

    def __init__(self, in_features: int, num_experts: int, topk: int, ffn_dim: int, *, activation: str = "silu",
                 gated: bool = True, aux_loss_coeff: float = 1e-2, expert_axis: str | None = None, mesh: Any = None,
                 grouped_gemm: str = "auto", dtype: Any = None, param_dtype: Any = jnp.float32,
                 router_param_dtype: Any = jnp.float32, kernel_init: Initializer = _expert_init,
                 router_kernel_init: Initializer = _lecun, router_kernel_axes: Axes = ("embed", None),
                 wi_axes: Axes = ("expert", "embed", "mlp"), wo_axes: Axes = ("expert", "mlp", "embed"),
                 deterministic: bool = False, fp8: Any = None, fp8_dispatch: bool = True, rngs: nnx.Rngs,
                 **router_options):  # fmt: skip
        rc = C.router_config("MoEBlock", num_experts, topk, dict(router_options, aux_loss_coeff=aux_loss_coeff))
        self.cfg = nnx.static(C.MoEConfig(rc, ffn_dim, activation, gated, expert_axis, grouped_gemm, fp8_dispatch))
        V.check_moe_params(
            "MoEBlock", in_features=in_features, num_experts=num_experts, expert_axis=expert_axis, mesh=mesh,
            dtype=dtype, param_dtype=param_dtype, router_param_dtype=router_param_dtype,
            router_kernel_axes=router_kernel_axes, wi_axes=wi_axes, wo_axes=wo_axes,
        )  # fmt: skip
        self.mesh = nnx.static(mesh)
        F.check_recipe_arg("MoEBlock", fp8)
        self.fp8 = nnx.static(fp8)
        recipe = F.resolve("MoEBlock", fp8, grouped=True)
        delayed = isinstance(recipe, F.DelayedScaling)
        self.fp8_state = FP8State(F.initial_moe_state_tree(recipe, num_experts)) if delayed else nnx.data(None)
        self.in_features, self.dtype = in_features, dtype
        self.deterministic = V.flag("MoEBlock", "deterministic", deterministic)
        self.router = _RouterParams(in_features, num_experts, rc.use_expert_bias, router_param_dtype,
                                    router_kernel_init, router_kernel_axes, rngs)  # fmt: skip
        f2 = ffn_dim * (2 if gated else 1)
        self.wi = _param(rngs, kernel_init, (num_experts, in_features, f2), param_dtype, wi_axes)
        self.wo = _param(rngs, kernel_init, (num_experts, ffn_dim, in_features), param_dtype, wo_axes)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
        x = V.token_input("MoEBlock", x, self.dtype, self.in_features)
        det = self.deterministic if deterministic is None else deterministic
        recipe = F.resolve("MoEBlock", self.fp8, grouped=True)
        F.warn_if_state_unused("MoEBlock", self.fp8, recipe, self.fp8_state is not None)
        state = None
        if isinstance(recipe, F.DelayedScaling):
            state = None if self.fp8_state is None else self.fp8_state.get_value()
            F.check_moe_state_tree("MoEBlock", state, recipe, self.wi.shape[0], "its FP8State variable (moe.fp8_state)")
        r = C.moe_apply(x, self.router.kernel[...], self.wi[...], self.wo[...], self.cfg, self.router.bias_value(),
                        dtype=self.dtype, mesh=self.mesh, fp8=recipe, fp8_state=state)  # fmt: skip
        _sow(self, AuxLoss, "aux_loss", r.aux_loss)
        _sow(self, TokensPerExpert, "tokens_per_expert", r.tokens_per_expert)
        self.router.update(self.cfg.router, r.tokens_per_expert, det)
        return r.out


def collect_aux_loss(captured: Any) -> jax.Array:
    """Sum of the :class:`AuxLoss` values in ``captured``: the state ``nnx.capture(fn, AuxLoss)``
    returned, or a module (any :class:`AuxLoss` / :class:`TokensPerExpert` variables stored on it are
    popped).

    te_layers' modules sow only into an enclosing ``nnx.capture``: called outside one they leave
    the module unchanged, so a module holds no aux loss of theirs. Given a module with an aux-loss
    layer (MoEBlock, TopKRouter with ``aux_loss_coeff``) and nothing stored on it, this returns 0
    with a warning: capture the loss instead.
    """
    if isinstance(captured, nnx.Module):
        losses = nnx.pop(captured, AuxLoss)
        nnx.pop(captured, TokensPerExpert)
        if not jax.tree.leaves(losses) and any(
            isinstance(m, MoEBlock) or (isinstance(m, TopKRouter) and m.cfg.aux_loss_coeff)
            for _, m in nnx.iter_modules(captured)
        ):
            warnings.warn(
                "te_layers.nnx.collect_aux_loss: got a module with no aux loss stored on it; te_layers.nnx "
                "modules sow their aux loss only inside nnx.capture (a call outside it leaves the module "
                "unchanged). Capture it: `y, sown = nnx.capture(fn, te_layers.nnx.AuxLoss)(model, x)`, then "
                "collect_aux_loss(sown).",
                UserWarning,
                stacklevel=2,
            )
    else:
        losses = captured
    leaves = jax.tree.leaves(losses)
    return sum((jnp.asarray(v, jnp.float32) for v in leaves), jnp.zeros((), jnp.float32))


__all__ = [
    "AuxLoss",
    "Dense",
    "DotProductAttention",
    "ExpertBias",
    "FP8State",
    "LayerNorm",
    "MoEBlock",
    "MultiHeadAttention",
    "NormDense",
    "NormDenseOutput",
    "RMSNorm",
    "Softmax",
    "TokensPerExpert",
    "TopKRouter",
    "collect_aux_loss",
    "fp8_accumulate",
    "fp8_value_and_grad",
]
