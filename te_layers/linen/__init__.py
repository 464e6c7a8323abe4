"""Flax Linen modules on te_ops: Dense, Softmax, DotProductAttention, MultiHeadAttention, TopKRouter,
MoEBlock, NormDense (RMSNorm or LayerNorm, then Dense); RMSNorm, LayerNorm (in ``norm.py``).

Conventions: dataclass fields for configuration, ``self.param`` wrapped in
``nn.with_logical_partitioning`` (logical axis names, mapped to mesh axes with
``nn.logical_axis_rules``), a ``"dropout"`` RNG stream, ``deterministic`` at call time. MoE aux
losses are sown into the ``"intermediates"`` collection under ``"aux_loss"`` (sum them with
:func:`collect_aux_loss`); the aux-loss-free expert bias lives in the ``"router_state"`` collection
and is updated when that collection is mutable and ``deterministic=False``.

FP8: ``Dense``, the ``MultiHeadAttention`` projections and the ``MoEBlock`` experts take ``fp8=`` (a
``te_ops.fp8`` recipe, None = the :func:`te_layers.fp8_recipe` context, False = high precision).
Delayed scaling keeps each Dense's (and each MoEBlock's experts') state in the ``"fp8_state"``
collection; the training step differentiates with respect to it and keeps the "gradient" as the next state
(:func:`fp8_value_and_grad`, :func:`fp8_update`, :func:`fp8_accumulate` in ``te_layers.linen.fp8``).
A layer (``fp8=None``) that finds its state in the ``"fp8_state"`` collection passed to ``apply`` but
is called with no ``te_layers.fp8_recipe`` context active runs in high precision, leaves the state
as it is, and warns (``te_layers.fp8_recipe(None)``: no warning); inside a CurrentScaling or
BlockScaling context it runs with that recipe, leaves the state as it is and warns too.

Configuration is checked when a module is constructed (``__post_init__``) and inputs when it is called,
with the same messages as the NNX and Equinox modules (``te_layers.<Layer>: ...``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_layers import _common as C
from te_layers import _fp8 as F
from te_layers import _norm
from te_layers import _validation as V
from te_layers._norm import NormDenseOutput
from te_layers.linen.fp8 import FP8_COLLECTION, fp8_accumulate, fp8_update, fp8_value_and_grad
from te_layers.linen.norm import LayerNorm, RMSNorm

Initializer = Callable[..., jax.Array]
Axes = Sequence[str | None] | None


def _param(mod: nn.Module, name: str, init: Initializer, shape, dtype, axes: Axes):
    if axes is not None:
        init = nn.with_logical_partitioning(init, tuple(axes))
    return mod.param(name, init, tuple(shape), dtype)


def _stored_dim(mod: nn.Module, path: Sequence[str], axis: int) -> int | None:
    """Size of ``axis`` of the parameter at ``path`` under this module when it already exists (apply, or a
    second call during init), else None: the input features the parameters were created for."""
    node = mod.variables.get("params", {})
    for key in path:
        if not hasattr(node, "get") or key not in node:
            return None
        node = node[key]
    return nn.meta.unbox(node).shape[axis]


def _dropout_key(mod: nn.Module, layer: str, stream: str, deterministic: bool) -> jax.Array | None:
    """A key from the ``stream`` RNG stream for dropout on a training call, None otherwise; a missing stream
    raises here (Flax's own error would not name the layer or how to pass the key)."""
    if mod.dropout_rate <= 0 or deterministic:
        return None
    if not mod.has_rng(stream):
        name = "dropout_rng" if layer == "DotProductAttention" else "rngs"
        raise ValueError(
            V.err(layer, f"dropout (dropout_rate={mod.dropout_rate}) with deterministic=False needs the {stream!r} RNG "
                         f"stream ({name}): pass rngs={{{stream!r}: key}} to apply/init, or call with "
                         "deterministic=True.")
        )  # fmt: skip
    return mod.make_rng(stream)


class Dense(nn.Module):
    """``activation(x @ kernel + bias)`` on ``te_ops.dense``: kernel ``[in, features]``, bias ``[features]``.

    ``fp8``: a ``te_ops.fp8`` recipe (the GEMM is ``te_ops.fp8.fp8_dense``), None (the recipe of the
    :func:`te_layers.fp8_recipe` context, if any) or False (high precision). With DelayedScaling the
    state lives in ``"fp8_state"``/``x``, ``w``, ``g`` (created by ``init`` under the same recipe).
    """

    features: int
    use_bias: bool = True
    activation: str | Callable | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros_init()
    kernel_axes: Axes = None
    bias_axes: Axes = None
    fp8: Any = None

    def __post_init__(self):
        V.check_dense("Dense", sizes={"features": self.features}, use_bias=self.use_bias,
                      activation_=self.activation, dtype=self.dtype, param_dtype=self.param_dtype,
                      kernel_axes=self.kernel_axes, bias_axes=self.bias_axes)  # fmt: skip
        F.check_recipe_arg("Dense", self.fp8)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = V.dense_input("Dense", x, self.dtype, _stored_dim(self, ("kernel",), 0))
        kernel = _param(self, "kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype,
                        self.kernel_axes)  # fmt: skip
        bias = None
        if self.use_bias:
            b_axes = self.bias_axes if self.bias_axes is not None else (
                None if self.kernel_axes is None else (tuple(self.kernel_axes)[-1],))  # fmt: skip
            bias = _param(self, "bias", self.bias_init, (self.features,), self.param_dtype, b_axes)
        recipe = F.resolve("Dense", self.fp8)
        state = _fp8_state(self, recipe)
        return C.dense_apply(x, kernel, bias, activation=self.activation, dtype=self.dtype, fp8=recipe,
                             fp8_state=state)  # fmt: skip


class NormDense(nn.Module):
    """``activation(norm(x) @ kernel + bias)``: RMSNorm (``norm="rms"``) or LayerNorm (``norm="layer"``)
    over the last axis, then the :class:`Dense` projection. Parameters ``scale [H]`` (``norm_bias [H]``
    with LayerNorm), ``kernel [H, features]``, ``bias [features]``; H is read from the input.

    The norm is :class:`RMSNorm` / :class:`LayerNorm` (float32 statistics, output in the compute dtype;
    ``epsilon`` None: 1e-6 for "rms", 1e-5 for "layer"; ``zero_centered_gamma``: applied scale
    ``1 + scale``, ``scale_init`` None means ones, zeros with ``zero_centered_gamma``). The projection
    is :class:`Dense` (same ``kernel_init``, ``bias_init``, ``use_bias``, ``activation``, ``dtype``, ``fp8``).
    Logical axes: ``scale_axes`` None follows ``kernel_axes[0]``, ``norm_bias_axes`` None follows
    ``scale_axes``, ``bias_axes`` None follows ``kernel_axes[-1]``.

    ``return_normed=True``: returns ``NormDenseOutput(y, normed)`` with the normalized input (e.g. for a
    residual branch that starts after the norm). ``fp8``: as :class:`Dense`; only the GEMM runs in FP8,
    the norm stays in high precision (the quantization of its output is not fused into the norm kernel
    yet). With DelayedScaling the state lives in ``"fp8_state"``/``x``, ``w``, ``g`` at this module's path.
    """

    features: int
    norm: str = "rms"
    epsilon: float | None = None
    zero_centered_gamma: bool = False
    use_bias: bool = True
    activation: str | Callable | None = None
    return_normed: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    scale_init: Initializer | None = None
    norm_bias_init: Initializer = nn.initializers.zeros_init()
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros_init()
    scale_axes: Axes = None
    norm_bias_axes: Axes = None
    kernel_axes: Axes = None
    bias_axes: Axes = None
    fp8: Any = None

    def __post_init__(self):
        V.check_norm_dense("NormDense", sizes={"features": self.features}, norm=self.norm, epsilon=self.epsilon,
                           zero_centered_gamma=self.zero_centered_gamma, use_bias=self.use_bias,
                           activation_=self.activation, return_normed=self.return_normed, dtype=self.dtype,
                           param_dtype=self.param_dtype, scale_axes=self.scale_axes,
                           norm_bias_axes=self.norm_bias_axes, kernel_axes=self.kernel_axes,
                           bias_axes=self.bias_axes)  # fmt: skip
        F.check_recipe_arg("NormDense", self.fp8)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array):
        x = V.dense_input("NormDense", x, self.dtype, _stored_dim(self, ("kernel",), 0))
        n = x.shape[-1]
        s_axes, nb_axes = _norm.norm_dense_axes(self.scale_axes, self.norm_bias_axes, self.kernel_axes)
        init = self.scale_init or _norm.default_scale_init(self.zero_centered_gamma)
        scale = _param(self, "scale", init, (n,), self.param_dtype, s_axes)
        norm_bias = None
        if self.norm == "layer":
            norm_bias = _param(self, "norm_bias", self.norm_bias_init, (n,), self.param_dtype, nb_axes)
        kernel = _param(self, "kernel", self.kernel_init, (n, self.features), self.param_dtype, self.kernel_axes)
        bias = None
        if self.use_bias:
            b_axes = self.bias_axes
            if b_axes is None and self.kernel_axes is not None:
                b_axes = (tuple(self.kernel_axes)[-1],)
            bias = _param(self, "bias", self.bias_init, (self.features,), self.param_dtype, b_axes)
        recipe = F.resolve("NormDense", self.fp8)
        state = _fp8_state(self, recipe)
        eps = _norm.DEFAULT_EPSILON[self.norm] if self.epsilon is None else self.epsilon
        return _norm.norm_dense_apply(self.norm, x, scale, norm_bias, kernel, bias, epsilon=eps,
                                      zero_centered_gamma=self.zero_centered_gamma, activation=self.activation,
                                      dtype=self.dtype, fp8=recipe, fp8_state=state,
                                      return_normed=self.return_normed)  # fmt: skip


def _fp8_state(mod: nn.Module, recipe):
    """The Dense's delayed-scaling state tree from the ``"fp8_state"`` collection (created by init);
    warns when the collection holds it but the active recipe (or none) does not use it
    (:func:`te_layers._fp8.warn_if_state_unused`)."""
    if not isinstance(recipe, F.DelayedScaling):
        held = all(mod.has_variable(FP8_COLLECTION, r) for r in F.ROLES)
        F.warn_if_state_unused(type(mod).__name__, mod.fp8, recipe, held)
        return None
    if not mod.is_initializing() and not all(mod.has_variable(FP8_COLLECTION, r) for r in F.ROLES):
        F.check_state_tree(type(mod).__name__, None, recipe, f"the {FP8_COLLECTION!r} collection passed to apply")
    fresh = F.initial_state_tree(recipe)
    tree = {r: mod.variable(FP8_COLLECTION, r, lambda r=r: fresh[r]).value for r in F.ROLES}
    F.check_state_tree(type(mod).__name__, tree, recipe, f"the {FP8_COLLECTION!r} collection")
    return tree


def _moe_fp8_state(mod: nn.Module, recipe):
    """The MoEBlock experts' delayed-scaling state from ``"fp8_state"``: variables ``wi`` and ``wo``
    (one per grouped GEMM), created by init; warns as :func:`_fp8_state`."""
    if not isinstance(recipe, F.DelayedScaling):
        held = all(mod.has_variable(FP8_COLLECTION, k) for k in F.MOE_GEMMS)
        F.warn_if_state_unused("MoEBlock", mod.fp8, recipe, held)
        return None
    where = f"the {FP8_COLLECTION!r} collection"
    if not mod.is_initializing() and not all(mod.has_variable(FP8_COLLECTION, k) for k in F.MOE_GEMMS):
        F.check_moe_state_tree("MoEBlock", None, recipe, mod.num_experts, f"{where} passed to apply")
    fresh = F.initial_moe_state_tree(recipe, mod.num_experts)
    tree = {k: mod.variable(FP8_COLLECTION, k, lambda k=k: fresh[k]).value for k in F.MOE_GEMMS}
    F.check_moe_state_tree("MoEBlock", tree, recipe, mod.num_experts, where)
    return tree


class Softmax(nn.Module):
    """te_ops softmax: ``variant`` "scaled", "masked" (call with ``mask``, True = masked out) or "causal"."""

    variant: str = "scaled"
    scale: float = 1.0

    def __post_init__(self):
        V.check_softmax("Softmax", variant=self.variant, scale=self.scale)
        super().__post_init__()

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x, mask = V.softmax_inputs("Softmax", x, mask, self.variant)
        return C.softmax_apply(x, variant=self.variant, scale=self.scale, mask=mask)


class DotProductAttention(nn.Module):
    """Fused attention of ``q [B, Sq, Nq, D]``, ``k``/``v [B, Sk, Nkv, D]`` (GQA when Nkv < Nq)."""

    mask_type: str = "none"
    window_size: tuple[int, int] | None = None
    scale: float | None = None
    dropout_rate: float = 0.0
    dropout_rng: str = "dropout"

    def __post_init__(self):
        V.check_attention("DotProductAttention", mask_type=self.mask_type, window_size=self.window_size,
                          scale=self.scale, dropout_rate=self.dropout_rate)  # fmt: skip
        if not isinstance(self.dropout_rng, str):
            raise TypeError(V.err("DotProductAttention", f"dropout_rng must be an RNG stream name (str), got "
                                                         f"{self.dropout_rng!r}."))  # fmt: skip
        super().__post_init__()

    def __call__(self, q, k, v, *, bias=None, q_seqlens=None, kv_seqlens=None, q_segment_ids=None,
                 kv_segment_ids=None, q_segment_pos=None, kv_segment_pos=None,
                 deterministic: bool = True):  # fmt: skip
        q, k, v = V.attention_inputs("DotProductAttention", q, k, v)
        rng = _dropout_key(self, "DotProductAttention", self.dropout_rng, deterministic)
        return C.attention_apply(
            q, k, v, mask_type=self.mask_type, bias=bias, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_segment_pos=q_segment_pos,
            kv_segment_pos=kv_segment_pos, window_size=self.window_size,
            scale=self.scale, dropout_rate=self.dropout_rate, rng=rng, deterministic=deterministic,
        )  # fmt: skip


class MultiHeadAttention(nn.Module):
    """Multi-head (GQA) self- or cross-attention with optional fused QKV projection and RoPE.

    Call: ``mha(x, inputs_kv=None, *, segment_ids=None, segment_pos=None, seqlens=None, positions=None, bias=None,
    deterministic=True)`` -> ``[B, S, out_features or H]``.
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    out_features: int | None = None
    fused_qkv: bool = True
    use_bias: bool = False
    mask_type: str = "causal"
    window_size: tuple[int, int] | None = None
    use_rope: bool = True
    rope_theta: float = 10000.0
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros_init()
    kernel_axes: Axes = ("embed", "heads")
    out_kernel_axes: Axes = ("heads", "embed")
    fp8: Any = None

    def __post_init__(self):
        self._check()
        F.check_recipe_arg("MultiHeadAttention", self.fp8)
        super().__post_init__()

    def _check(self) -> int:
        return V.check_mha(
            "MultiHeadAttention", num_heads=self.num_heads, head_dim=self.head_dim, num_kv_heads=self.num_kv_heads,
            out_features=self.out_features, fused_qkv=self.fused_qkv, use_bias=self.use_bias,
            mask_type=self.mask_type, window_size=self.window_size, use_rope=self.use_rope,
            rope_theta=self.rope_theta, dropout_rate=self.dropout_rate, dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_axes=self.kernel_axes, out_kernel_axes=self.out_kernel_axes,
        )  # fmt: skip

    @nn.compact
    def __call__(self, x, inputs_kv=None, *, segment_ids=None, segment_pos=None, seqlens=None, positions=None,
                 bias=None, deterministic: bool = True):  # fmt: skip
        nq, d, nkv = self.num_heads, self.head_dim, self._check()
        first = "qkv" if self.fused_qkv else "query"
        x, inputs_kv = V.mha_inputs(
            "MultiHeadAttention", x, inputs_kv, dtype=self.dtype, in_features=_stored_dim(self, (first, "kernel"), 0),
            kv_features=_stored_dim(self, ("key", "kernel"), 0), fused_qkv=self.fused_qkv, use_rope=self.use_rope,
            mask_type=self.mask_type, segment_ids=segment_ids, seqlens=seqlens, positions=positions,
            segment_pos=segment_pos,
        )  # fmt: skip
        proj = lambda n, name: Dense(  # noqa: E731
            n, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
            bias_init=self.bias_init, kernel_axes=self.kernel_axes, fp8=self.fp8, name=name)  # fmt: skip
        b, s = x.shape[:2]
        if self.fused_qkv:
            q, k, v = C.split_qkv(proj((nq + 2 * nkv) * d, "qkv")(x), nq, nkv, d)
        else:
            kv_in = x if inputs_kv is None else inputs_kv
            q = proj(nq * d, "query")(x).reshape(b, s, nq, d)
            k = proj(nkv * d, "key")(kv_in).reshape(b, kv_in.shape[1], nkv, d)
            v = proj(nkv * d, "value")(kv_in).reshape(b, kv_in.shape[1], nkv, d)
        rng = _dropout_key(self, "MultiHeadAttention", "dropout", deterministic)
        padded = self.mask_type.startswith("padding")
        o = C.heads_attention(
            q, k, v, use_rope=self.use_rope, rope_theta=self.rope_theta, positions=positions, kv_positions=None,
            segment_ids=segment_ids, segment_pos=segment_pos, mask_type=self.mask_type, bias=bias,
            q_seqlens=seqlens if padded else None, kv_seqlens=seqlens if padded and inputs_kv is None else None,
            window_size=self.window_size, dropout_rate=self.dropout_rate, rng=rng, deterministic=deterministic,
        )  # fmt: skip
        return Dense(
            self.out_features or x.shape[-1], use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=self.kernel_init, bias_init=self.bias_init, kernel_axes=self.out_kernel_axes, fp8=self.fp8,
            name="out",
        )(o)  # fmt: skip


def _router_config(m, layer: str) -> C.RouterConfig:
    return C.RouterConfig(
        num_experts=m.num_experts, topk=m.topk, score_function=m.score_function, use_pre_softmax=m.use_pre_softmax,
        num_groups=m.num_groups, group_topk=m.group_topk, scaling_factor=m.scaling_factor,
        aux_loss_coeff=m.aux_loss_coeff, use_expert_bias=m.use_expert_bias,
        expert_bias_update_rate=m.expert_bias_update_rate, layer=layer,
    )  # fmt: skip


def _router_params(mod, hidden: int):
    kernel = _param(mod, "kernel", mod.kernel_init, (hidden, mod.num_experts), mod.param_dtype, mod.kernel_axes)
    bias = None
    if mod.use_expert_bias:
        bias = mod.variable("router_state", "expert_bias", jnp.zeros, (mod.num_experts,), jnp.float32).value
    return kernel, bias


def _update_bias(mod, tokens_per_expert, rate, deterministic):
    if mod.use_expert_bias and not deterministic and mod.is_mutable_collection("router_state"):
        bias = mod.get_variable("router_state", "expert_bias")
        mod.put_variable("router_state", "expert_bias", C.updated_expert_bias(bias, tokens_per_expert, rate))


class TopKRouter(nn.Module):
    """Router: logits = x @ kernel ``[H, E]`` (float32), then te_ops top-k routing and the aux loss.

    Returns a :class:`te_layers._common.RouterOutput` ``(probs, routing_map, aux_loss,
    tokens_per_expert)`` for ``x [..., H]`` flattened to tokens. The aux loss is also sown into
    ``"intermediates"``/``"aux_loss"``. With ``use_expert_bias`` (sigmoid scores) the bias lives in
    ``"router_state"``/``"expert_bias"`` and moves by ``expert_bias_update_rate`` per training call.
    """

    num_experts: int
    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float = 1.0
    aux_loss_coeff: float = 0.0
    use_expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.lecun_normal()
    kernel_axes: Axes = ("embed", None)

    def __post_init__(self):
        _router_config(self, "TopKRouter")
        V.check_router_params("TopKRouter", param_dtype=self.param_dtype, kernel_axes=self.kernel_axes)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> C.RouterOutput:
        cfg = _router_config(self, "TopKRouter")
        x = V.token_input("TopKRouter", x, None, _stored_dim(self, ("kernel",), 0), router=True)
        kernel, bias = _router_params(self, x.shape[-1])
        logits = C.router_logits(x.reshape(-1, x.shape[-1]), kernel)
        r = C.route(logits, cfg, bias)
        if cfg.aux_loss_coeff:
            self.sow("intermediates", "aux_loss", r.aux_loss)
        _update_bias(self, r.tokens_per_expert, cfg.expert_bias_update_rate, deterministic)
        return r


class _RouterParams(nn.Module):
    """The router's parameters inside MoEBlock (same names and layout as TopKRouter's)."""

    num_experts: int
    use_expert_bias: bool
    param_dtype: Any
    kernel_init: Initializer
    kernel_axes: Axes

    @nn.compact
    def __call__(self, hidden: int):
        return _router_params(self, hidden)

    def update(self, tokens_per_expert, rate, deterministic):
        _update_bias(self, tokens_per_expert, rate, deterministic)


class MoEBlock(nn.Module):
    """Mixture-of-experts FFN: router -> token_dispatch -> grouped expert FFN -> token_combine.

    ``wi [E, H, 2F]`` (gated: ``act(x wi[:, :, :F]) * (x wi[:, :, F:])``, SwiGLU with "silu") or
    ``[E, H, F]``, ``wo [E, F, H]``. With ``expert_axis`` the experts are sharded over that mesh axis
    (``mesh`` or the mesh set with ``jax.set_mesh``) and tokens exchanged by all-to-all. Returns the
    output ``[..., H]``; the aux loss is sown into ``"intermediates"``/``"aux_loss"`` and the
    tokens per expert into ``"intermediates"``/``"tokens_per_expert"``. ``fp8``: the experts' recipe
    (CurrentScaling, DelayedScaling or BlockScaling with 1 x 128 / 128 x 128 blocks), None (the
    context's) or False; the router and combine stay in high precision. ``fp8_dispatch`` (default
    True): with FP8 experts, quantize the tokens once and dispatch the FP8 rows
    (``te_ops.fp8.fp8_dispatch_grouped_dense``); with ``expert_axis`` the FP8 rows (and their 1 x 128
    scale rows) also cross the all-to-all, at half the bytes of bfloat16 rows (current scaling: one
    scale from the amax over all shards' tokens); the gradient crosses back in high precision. False
    dispatches (and exchanges) high-precision rows. With
    DelayedScaling the state of the two grouped GEMMs lives in ``"fp8_state"``/``wi`` and ``wo``
    (each ``{"x", "w", "g"}``, ``w`` with one history and scale per expert; created by ``init``).
    """

    num_experts: int
    topk: int
    ffn_dim: int
    activation: str = "silu"
    gated: bool = True
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float = 1.0
    aux_loss_coeff: float = 1e-2
    use_expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    expert_axis: str | None = None
    mesh: Any = None
    grouped_gemm: str = "auto"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    router_param_dtype: Any = jnp.float32
    kernel_init: Initializer = C.default_expert_init()
    router_kernel_init: Initializer = nn.initializers.lecun_normal()
    router_kernel_axes: Axes = ("embed", None)
    wi_axes: Axes = ("expert", "embed", "mlp")
    wo_axes: Axes = ("expert", "mlp", "embed")
    fp8: Any = None
    fp8_dispatch: bool = True

    def __post_init__(self):
        self._config()
        F.check_recipe_arg("MoEBlock", self.fp8)
        V.check_moe_params(
            "MoEBlock", num_experts=self.num_experts, expert_axis=self.expert_axis, mesh=self.mesh, dtype=self.dtype,
            param_dtype=self.param_dtype, router_param_dtype=self.router_param_dtype,
            router_kernel_axes=self.router_kernel_axes, wi_axes=self.wi_axes, wo_axes=self.wo_axes,
        )  # fmt: skip
        super().__post_init__()

    def _config(self) -> C.MoEConfig:
        return C.MoEConfig(_router_config(self, "MoEBlock"), self.ffn_dim, self.activation, self.gated,
                           self.expert_axis, self.grouped_gemm, self.fp8_dispatch)  # fmt: skip

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        cfg = self._config()
        x = V.token_input("MoEBlock", x, self.dtype, _stored_dim(self, ("wi",), 1))
        hdim = x.shape[-1]
        router = _RouterParams(self.num_experts, self.use_expert_bias, self.router_param_dtype,
                               self.router_kernel_init, self.router_kernel_axes, name="router")  # fmt: skip
        rkernel, bias = router(hdim)
        f2 = self.ffn_dim * (2 if self.gated else 1)
        wi = _param(self, "wi", self.kernel_init, (self.num_experts, hdim, f2), self.param_dtype, self.wi_axes)
        wo = _param(self, "wo", self.kernel_init, (self.num_experts, self.ffn_dim, hdim), self.param_dtype,
                    self.wo_axes)  # fmt: skip
        recipe = F.resolve("MoEBlock", self.fp8, grouped=True)
        r = C.moe_apply(x, rkernel, wi, wo, cfg, bias, dtype=self.dtype, mesh=self.mesh, fp8=recipe,
                        fp8_state=_moe_fp8_state(self, recipe))  # fmt: skip
        self.sow("intermediates", "aux_loss", r.aux_loss)
        self.sow("intermediates", "tokens_per_expert", r.tokens_per_expert)
        router.update(r.tokens_per_expert, self.expert_bias_update_rate, deterministic)
        return r.out


def collect_aux_loss(intermediates: Any) -> jax.Array:
    """Sum of every sown ``aux_loss`` in an ``"intermediates"`` collection (0 if none)."""
    total = jnp.zeros((), jnp.float32)
    flat = jax.tree_util.tree_flatten_with_path(intermediates)[0]
    for path, leaf in flat:
        if any(getattr(k, "key", None) == "aux_loss" for k in path):
            total = total + leaf.astype(jnp.float32)
    return total


__all__ = [
    "FP8_COLLECTION",
    "Dense",
    "DotProductAttention",
    "LayerNorm",
    "MoEBlock",
    "MultiHeadAttention",
    "NormDense",
    "NormDenseOutput",
    "RMSNorm",
    "Softmax",
    "TopKRouter",
    "collect_aux_loss",
    "fp8_accumulate",
    "fp8_update",
    "fp8_value_and_grad",
]
