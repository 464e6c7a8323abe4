"""The maths shared by te_layers' Linen, NNX and Equinox modules.

Every layer in every framework is a thin shell (parameters, RNG handling, state) around the pure
functions here, so the three flavours cannot drift apart: the same parameters give the same outputs.
Parameter layouts (all frameworks):

* Dense: ``kernel [in, out]``, ``bias [out]``.
* MultiHeadAttention: ``qkv`` Dense ``[H, (Nq + 2 Nkv) * D]`` (fused, per-kv-group-free layout
  ``[q heads | k heads | v heads]``) or ``query``/``key``/``value`` Dense; ``out`` Dense ``[Nq * D, H]``.
* TopKRouter: ``kernel [H, E]`` (float32 by default), optional non-trainable ``expert_bias [E]``.
* MoEBlock: ``router``, ``wi [E, H, F]`` (``[E, H, 2F]`` gated: ``[act half | linear half]``),
  ``wo [E, F, H]``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from te_layers import _validation as V
from te_ops._core.validation import is_master_kernel
from te_ops.dense import dense as _te_dense
from te_ops.dense.reference import activate as _activate
from te_ops.fused_attention import fused_attention
from te_ops.grouped_dense import grouped_dense as _te_grouped_dense
from te_ops.grouped_dense import grouped_ffn as _te_grouped_ffn
from te_ops.grouped_dense.reference import ffn_activation as _ffn_act
from te_ops.permutation import sort_chunks_by_index, token_combine, token_dispatch
from te_ops.router import compute_routing_scores_for_aux_loss, fused_moe_aux_loss, fused_topk_with_score_function
from te_ops.softmax import scaled_masked_softmax, scaled_softmax, scaled_upper_triang_masked_softmax

# ----------------------------------------------------------------------------------------------
# Dense
# ----------------------------------------------------------------------------------------------

FUSED_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")  # the ones te_ops.dense fuses into its epilogue
_NAMED_ACTIVATIONS: dict[str, Callable] = {  # te_ops.dense's activations (one definition), plus two
    **{a: functools.partial(_activate, activation=a) for a in FUSED_ACTIVATIONS},
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
}
assert tuple(_NAMED_ACTIVATIONS) == V.ACTIVATIONS


def activation_fn(activation: str | Callable | None) -> Callable:
    """The function an activation argument names (None = identity)."""
    if activation is None:
        return lambda z: z
    if callable(activation):
        return activation
    if activation not in _NAMED_ACTIVATIONS:
        raise ValueError(
            f"te_layers: activation must be None, a callable or one of {sorted(_NAMED_ACTIVATIONS)}, "
            f"got {activation!r}."
        )
    return _NAMED_ACTIVATIONS[activation]


def compute_dtype(x: jax.Array, dtype: Any) -> Any:
    """The dtype a layer computes in: ``dtype`` when given, else the input's dtype."""
    return jnp.dtype(x.dtype if dtype is None else dtype)


def dense_apply(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | Callable | None = None,
    dtype: Any = None,
    fp8: Any = None,
    fp8_state: Any = None,
) -> jax.Array:
    """``activation(x @ kernel + bias)`` through ``te_ops.dense`` (activation fused when it can be).

    ``fp8``: a resolved ``te_ops.fp8`` recipe (``te_layers._fp8.resolve``) or None; with one, the GEMM
    is ``te_ops.fp8.fp8_dense`` (``fp8_state``: the layer's delayed-scaling state tree with
    DelayedScaling)."""
    dt = compute_dtype(x, dtype)
    x, kernel = x.astype(dt), kernel.astype(dt)
    bias = None if bias is None else bias.astype(dt)
    if fp8 is not None:
        from te_layers._fp8 import fp8_dense_apply

        return fp8_dense_apply(x, kernel, bias, fp8, activation=activation, state_tree=fp8_state)
    if activation is None or (isinstance(activation, str) and activation in FUSED_ACTIVATIONS):
        return _te_dense(x, kernel, bias, activation=activation)
    return activation_fn(activation)(_te_dense(x, kernel, bias))


# ----------------------------------------------------------------------------------------------
# Softmax
# ----------------------------------------------------------------------------------------------

SOFTMAX_VARIANTS = V.SOFTMAX_VARIANTS


def softmax_apply(x: jax.Array, *, variant: str = "scaled", scale: float = 1.0, mask: jax.Array | None = None):
    """The three te_ops softmax variants: "scaled", "masked" (``mask`` True = masked out), "causal"."""
    if variant == "scaled":
        if mask is not None:
            raise ValueError("te_layers.Softmax: mask given to the 'scaled' variant; use variant='masked'.")
        return scaled_softmax(x, scale)
    if variant == "masked":
        if mask is None:
            raise ValueError("te_layers.Softmax: variant='masked' needs mask= (bool, True = masked out).")
        return scaled_masked_softmax(x, mask, scale)
    if variant == "causal":
        return scaled_upper_triang_masked_softmax(x, scale)
    raise ValueError(f"te_layers.Softmax: variant must be one of {SOFTMAX_VARIANTS}, got {variant!r}.")


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding (rotate-half layout) of ``x [B, S, N, D]`` at ``positions [B, S]``."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"te_layers: rotary embeddings need an even head_dim, got {d}.")
    half = d // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[..., None, None] * freq  # [B, S, 1, half]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def positions_from_segments(segment_ids: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """Positions restarting at 0 at every segment start (packed sequences), else ``arange(seq)``."""
    if segment_ids is None:
        return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    idx = jnp.arange(seq, dtype=jnp.int32)
    start = jnp.concatenate([jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    seg_start = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    return idx - seg_start


def attention_apply(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask_type: str = "none",
    bias: jax.Array | None = None,
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_segment_pos: jax.Array | None = None,
    kv_segment_pos: jax.Array | None = None,
    window_size: tuple[int, int] | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    rng: jax.Array | None = None,
    deterministic: bool = True,
) -> jax.Array:
    """``te_ops.fused_attention`` with dropout turned off when deterministic; the kv segment ids and
    positions default to the query ones when q and k have the same length (self-attention)."""
    rate = 0.0 if deterministic else float(dropout_rate)
    if rate > 0.0 and rng is None:
        raise ValueError("te_layers.attention_apply: rng is required when dropout_rate > 0 and deterministic=False.")
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids if q_segment_ids is not None and q.shape[1] == k.shape[1] else None
    if kv_segment_pos is None:
        kv_segment_pos = q_segment_pos if q_segment_pos is not None and q.shape[1] == k.shape[1] else None
    return fused_attention(
        q, k, v, bias=bias, mask_type=mask_type, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_segment_pos=q_segment_pos,
        kv_segment_pos=kv_segment_pos, window_size=window_size, scale=scale, dropout_rate=rate,
        rng=rng if rate > 0.0 else None,
    )  # fmt: skip


def split_qkv(qkv: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int):
    """``[B, S, (Nq + 2 Nkv) * D]`` -> q ``[B, S, Nq, D]``, k, v ``[B, S, Nkv, D]``."""
    b, s = qkv.shape[:2]
    q, k, v = jnp.split(qkv, [num_heads * head_dim, (num_heads + num_kv_heads) * head_dim], axis=-1)
    return (
        q.reshape(b, s, num_heads, head_dim),
        k.reshape(b, s, num_kv_heads, head_dim),
        v.reshape(b, s, num_kv_heads, head_dim),
    )


def heads_attention(
    q, k, v, *, use_rope, rope_theta, positions, kv_positions, segment_ids, segment_pos=None, **attn_kw
) -> jax.Array:
    """RoPE on q/k, fused attention, heads merged: ``[B, Sq, Nq * Dv]``. ``segment_pos`` (positions
    inside the packed segments) steers the causal mask and the window, and is the default RoPE position."""
    b, sq = q.shape[:2]
    if use_rope:
        if positions is None:
            positions = segment_pos if segment_pos is not None else positions_from_segments(segment_ids, b, sq)
        if kv_positions is None:
            kv_positions = positions if k.shape[1] == sq else positions_from_segments(None, b, k.shape[1])
        q = rotary_embedding(q, positions, rope_theta)
        k = rotary_embedding(k, kv_positions, rope_theta)
    out = attention_apply(q, k, v, q_segment_ids=segment_ids, q_segment_pos=segment_pos, **attn_kw)
    return out.reshape(b, sq, out.shape[2] * out.shape[3])  # explicit size: -1 is ambiguous when B or Sq is 0


# ----------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Every option of ``te_ops.router`` plus the aux loss and aux-loss-free bias settings.

    Checked on construction; ``layer`` (not part of equality or hashing) names the layer in the messages.
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
    layer: str = dataclasses.field(default="TopKRouter", compare=False, repr=False)

    def __post_init__(self):
        V.check_router(
            self.layer, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layer"}
        )


def router_config(layer: str, num_experts: int, topk: int, options: dict[str, Any]) -> RouterConfig:
    """A checked RouterConfig from keyword router options (unknown names are refused)."""
    V.check_router_options(layer, options)
    return RouterConfig(num_experts=num_experts, topk=topk, layer=layer, **options)


class RouterOutput(NamedTuple):
    probs: jax.Array  # [T, E] routing weights (0 where not routed), float32
    routing_map: jax.Array  # bool [T, E]
    aux_loss: jax.Array  # scalar float32 (0 when aux_loss_coeff == 0)
    tokens_per_expert: jax.Array  # int32 [E]: tokens routed to each expert (global under expert parallelism)


def router_logits(x2d: jax.Array, kernel: jax.Array) -> jax.Array:
    """Router logits in float32 (``[T, H] @ [H, E]``); zero tokens give ``[0, E]``."""
    if x2d.shape[0] == 0:
        return jnp.zeros((0, kernel.shape[1]), jnp.float32)
    return _te_dense(x2d.astype(jnp.float32), kernel.astype(jnp.float32))


def empty_route(num_experts: int) -> RouterOutput:
    """The routing of zero tokens: empty probs and map, aux loss 0, no tokens per expert."""
    return RouterOutput(
        jnp.zeros((0, num_experts), jnp.float32), jnp.zeros((0, num_experts), bool), jnp.zeros((), jnp.float32),
        jnp.zeros((num_experts,), jnp.int32),
    )  # fmt: skip


def route(
    logits: jax.Array,
    cfg: RouterConfig,
    expert_bias: jax.Array | None = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> RouterOutput:
    """Top-k routing and the load-balancing loss of ``logits [T, E]`` (float32).

    Inside ``shard_map`` with tokens split over ``axis_name`` the aux loss and tokens_per_expert are
    the global ones (token counts are summed over the axis and the loss uses the global token count).
    Zero tokens (outside shard_map) give :func:`empty_route`: the aux loss, a mean over tokens, is
    defined as 0 there.
    """
    if logits.shape[0] == 0 and axis_name is None:
        return empty_route(logits.shape[1])
    probs, rmap = fused_topk_with_score_function(
        logits, cfg.topk, score_function=cfg.score_function, use_pre_softmax=cfg.use_pre_softmax,
        num_groups=cfg.num_groups, group_topk=cfg.group_topk, scaling_factor=cfg.scaling_factor,
        expert_bias=expert_bias if cfg.use_expert_bias else None,
    )  # fmt: skip
    tpe = rmap.sum(0, dtype=jnp.int32)
    if axis_name is not None:
        tpe = jax.lax.psum(tpe, axis_name)
    aux = jnp.zeros((), jnp.float32)
    if cfg.aux_loss_coeff:
        aux_map, scores = compute_routing_scores_for_aux_loss(logits, cfg.topk, score_function=cfg.score_function)
        aux_tpe = aux_map.sum(0, dtype=jnp.int32)
        if axis_name is None:
            aux = fused_moe_aux_loss(scores, aux_tpe, topk=cfg.topk, coeff=cfg.aux_loss_coeff)
        else:
            # Local call scales by 1 / T_local^2; the global loss scales by 1 / (P T_local)^2.
            shards = jax.lax.psum(1, axis_name)
            aux_tpe = jax.lax.psum(aux_tpe, axis_name)
            local = fused_moe_aux_loss(scores, aux_tpe, topk=cfg.topk, coeff=cfg.aux_loss_coeff)
            aux = jax.lax.psum(local.astype(jnp.float32), axis_name) / (shards * shards)
    return RouterOutput(probs.astype(jnp.float32), rmap, aux.astype(jnp.float32), tpe)


def updated_expert_bias(expert_bias: jax.Array, tokens_per_expert: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower over-loaded ones."""
    load = tokens_per_expert.astype(jnp.float32)
    return (expert_bias.astype(jnp.float32) + rate * jnp.sign(load.mean() - load)).astype(expert_bias.dtype)


# ----------------------------------------------------------------------------------------------
# Grouped GEMM (te_ops.grouped_dense or jax.lax.ragged_dot)
# ----------------------------------------------------------------------------------------------

GROUPED_GEMM_BACKENDS = V.GROUPED_GEMM_BACKENDS


def _ragged_grouped_dense(x, kernels, group_sizes, bias=None):
    """Fallback with grouped_dense's contract: rows past sum(group_sizes) are zero."""
    m = x.shape[0]
    y = jax.lax.ragged_dot(x, kernels, group_sizes, preferred_element_type=jnp.float32)
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(m, dtype=group_sizes.dtype)
    valid = (rows < ends[-1])[:, None]
    if bias is not None:
        gid = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), kernels.shape[0] - 1)
        y = y + bias.astype(jnp.float32)[gid]
    return jnp.where(valid, y, 0.0).astype(x.dtype)


def grouped_dense(x, kernels, group_sizes, bias=None, *, backend: str = "auto"):
    """``grouped_dense(x[M, K], kernels[G, K, N], group_sizes[G], bias[G, N])`` per docs/semantics.md.

    backend: "te_ops" (``te_ops.grouped_dense``; its GPU kernels need K and N multiples of 8, other
    sizes take its reference path), "ragged_dot" (``jax.lax.ragged_dot``), or "auto": te_ops when
    K and N are multiples of 8, else ragged_dot.
    """
    group_sizes = group_sizes.astype(jnp.int32)
    if backend not in GROUPED_GEMM_BACKENDS:
        raise ValueError(
            f"te_layers.grouped_dense: grouped_gemm must be one of {list(GROUPED_GEMM_BACKENDS)}, got {backend!r}."
        )
    aligned = x.shape[-1] % 8 == 0 and kernels.shape[-1] % 8 == 0
    ragged = backend == "ragged_dot" or (backend == "auto" and not aligned)
    # float32 master kernels with a 16-bit x go to te_ops as they are (it casts them itself and
    # returns float32 dkernels, not rounded to x's dtype)
    if kernels.dtype != x.dtype and (ragged or not is_master_kernel(x.dtype, kernels.dtype)):
        kernels = kernels.astype(x.dtype)
    if ragged:
        return _ragged_grouped_dense(x, kernels, group_sizes, bias)
    kw = {} if aligned else {"implementation": "reference"}
    return _te_grouped_dense(x, kernels, group_sizes, bias, **kw)


# ----------------------------------------------------------------------------------------------
# MoE block
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The MoE block's routing and expert-FFN configuration, checked on construction (messages name
    ``router.layer``)."""

    router: RouterConfig
    ffn_dim: int
    activation: str | Callable = "silu"  # "silu" (SwiGLU when gated), "gelu"/"gelu_tanh" (GeGLU), ...
    gated: bool = True
    expert_axis: str | None = None  # mesh axis the experts (and tokens) are split over
    grouped_gemm: str = "auto"
    fp8_dispatch: bool = True  # with FP8 experts: dispatch (and all-to-all) FP8 rows (moe_apply)

    def __post_init__(self):
        if not isinstance(self.router, RouterConfig):
            raise TypeError(f"te_layers.MoEConfig: router must be a RouterConfig, got {type(self.router).__name__}.")
        V.check_moe_ffn(self.router.layer, ffn_dim=self.ffn_dim, activation_=self.activation, gated=self.gated,
                        expert_axis=self.expert_axis, grouped_gemm=self.grouped_gemm,
                        fp8_dispatch=self.fp8_dispatch)  # fmt: skip


class MoEOutput(NamedTuple):
    out: jax.Array  # [..., H]
    aux_loss: jax.Array  # scalar float32
    tokens_per_expert: jax.Array  # int32 [E] (global)


def _grouped_gemm(fp8, fp8_state):
    """``grouped(a, kernels, group_sizes, backend, which)``: ``te_ops.fp8.fp8_grouped_dense`` with a
    recipe (``which``: "wi" or "wo", the state tree entry with DelayedScaling), else
    :func:`grouped_dense`."""
    if fp8 is None:
        return lambda a, k, gs, backend, which: grouped_dense(a, k, gs, backend=backend)
    from te_layers._fp8 import from_tree
    from te_ops.fp8 import DelayedScaling, fp8_grouped_dense

    delayed = isinstance(fp8, DelayedScaling)

    def gemm(a, k, gs, backend, which):
        st = from_tree(fp8_state[which]) if delayed else None
        return fp8_grouped_dense(a, k, gs.astype(jnp.int32), fp8, state=st)

    return gemm


def _ffn_activation(h, activation, gated, dtype):
    """``act(h)`` or, gated, ``act(h[:, :F]) * h[:, F:]``, in float32, rounded to ``dtype``
    (te_ops.fp8's :func:`ffn_activation`, which the fused FP8 expert FFN computes too)."""
    return _ffn_act(h, activation_fn(activation), gated).astype(dtype)


# float32 expert parameters with a 16-bit compute dtype: with FP8 experts they reach te_ops as master
# kernels (quantized straight from float32: the quantize kernel reads 4 bytes a parameter instead of a
# cast pass reading 4 and writing 2 and the quantize reading 2; the wgrad kernel writes float32
# gradients, 4 bytes instead of 2, which the optimizer then reads: about even in bytes, one pass fewer
# and one rounding fewer). Without FP8 they are cast before the op unless BF16_MASTER_KERNELS: there
# the cast's transpose (bfloat16 gradient -> float32) fuses into the optimizer's update, so master
# kernels (float32 gradients, no bfloat16 rounding) only add bytes: the wgrad kernel writes 4 bytes a
# parameter instead of 2 and the optimizer reads 4 instead of 2 (403M expert parameters in
# benchmarks/train_moe.py: about 1.6 GB, ~0.4 ms a step at 4 TB/s). Off until measured
# (benchmarks/train_moe.py model te_layers_master).
BF16_MASTER_KERNELS = False


def _expert_kernels(w, dtype, fp8):
    """An expert weight for the grouped GEMMs: float32 parameters with a bfloat16 / float16 compute
    dtype stay float32 (te_ops' grouped GEMMs take them as master kernels: cast or quantized inside
    the op, float32 gradients from the weight-gradient kernel) with FP8 experts or
    ``BF16_MASTER_KERNELS``; anything else is cast to ``dtype``."""
    if is_master_kernel(dtype, w.dtype) and (fp8 is not None or BF16_MASTER_KERNELS):
        return w
    return w.astype(dtype)


def expert_ffn(x, wi, wo, group_sizes, *, activation, gated, backend, fp8=None, fp8_state=None):
    """Per-expert FFN on expert-major rows: ``act(x @ wi[g]) [* (x @ wi_lin[g])] @ wo[g]``.

    ``fp8``: a resolved recipe (CurrentScaling, DelayedScaling or 1 x 128 / 128 x 128 BlockScaling)
    or None; with one, both grouped GEMMs are ``te_ops.fp8.fp8_grouped_dense`` (``backend`` is then
    not used). ``fp8_state``: with DelayedScaling, ``{"wi": tree, "wo": tree}`` (the state of each
    grouped GEMM as a dict tree, ``te_layers._fp8.initial_moe_state_tree``)."""
    if fp8 is None and _bf16_fused_ffn_applies(x, wi, wo, activation, backend):
        return _te_grouped_ffn(x, wi, wo, group_sizes.astype(jnp.int32), activation=activation, gated=gated)
    grouped = _grouped_gemm(fp8, fp8_state)
    h = grouped(x, wi, group_sizes, backend, "wi")
    h = _ffn_activation(h, activation, gated, x.dtype)
    return grouped(h, wo, group_sizes, backend, "wo")


# The bfloat16 / float16 experts as one op, te_ops.grouped_ffn (the activation fused into the
# epilogues of the grouped GEMMs around it: neither h nor the activation's gradient input makes an
# extra round trip through memory). Same numbers as the unfused path (bit for bit on the reference
# path). Off until its kernels have run on a GPU (benchmarks/train_moe.py model te_layers_fused_ffn
# turns it on); read at trace time.
BF16_FUSED_FFN = False


def _bf16_fused_ffn_applies(x, wi, wo, activation, backend) -> bool:
    """grouped_ffn takes the call: switched on, a named activation, the te_ops backend (or "auto" with
    the 16-byte-aligned sizes its GPU kernels need), kernels of x's dtype or float32 masters. The
    kernels' sharding is not looked at: grouped_ffn gathers kernels sharded along F (tensor
    parallel), so the switch is for unsharded or expert-parallel experts."""
    from te_ops.dense.reference import ACTIVATIONS

    named = activation is None or (isinstance(activation, str) and activation in ACTIVATIONS)
    aligned = all(d % 8 == 0 for d in (x.shape[-1], wo.shape[1], wo.shape[2]))
    dtypes_ok = wi.dtype == wo.dtype and (wi.dtype == x.dtype or is_master_kernel(x.dtype, wi.dtype))
    return BF16_FUSED_FFN and named and dtypes_ok and (backend == "te_ops" or (backend == "auto" and aligned))


# The FP8 block-scaled MoE experts as one op, te_ops.fp8.fp8_dispatch_ffn (the activation fused into
# the quantizations around it: neither the activation nor its gradient goes to memory in high
# precision). Same numbers as the unfused path (bit for bit on the reference path). Off until its
# kernels have run on a GPU (benchmarks/train_moe.py model te_layers_fp8_block_fused turns it on);
# read at trace time.
FP8_FUSED_FFN = False


def _fused_ffn_applies(fp8, cfg: MoEConfig) -> bool:
    from te_ops.fp8 import BlockScaling
    from te_ops.fp8.ffn import ACTIVATIONS

    blocks = (getattr(fp8, "act_block", None), getattr(fp8, "weight_block", None))
    named = cfg.activation is None or (isinstance(cfg.activation, str) and cfg.activation in ACTIVATIONS)
    return FP8_FUSED_FFN and isinstance(fp8, BlockScaling) and blocks == ((1, 128), (128, 128)) and named


def _fp8_dispatch_ffn(x2d, routing_map, n, wi, wo, cfg: MoEConfig, fp8, fp8_state):
    """FP8 token dispatch: ``te_ops.fp8.fp8_dispatch_grouped_dense`` (tokens quantized once, FP8
    rows dispatched, the wi GEMM on them), then the activation and the wo GEMM as in
    :func:`expert_ffn`; with ``FP8_FUSED_FFN`` and block scaling all of it in
    ``te_ops.fp8.fp8_dispatch_ffn``. Returns (y [N, H], row_id_map)."""
    from te_layers._fp8 import from_tree
    from te_ops.fp8 import DelayedScaling, fp8_dispatch_ffn, fp8_dispatch_grouped_dense

    if _fused_ffn_applies(fp8, cfg):
        d = fp8_dispatch_ffn(x2d, routing_map, n, wi, wo, fp8,
                             activation=cfg.activation, gated=cfg.gated)  # fmt: skip
        return d.out, d.row_id_map

    st = from_tree(fp8_state["wi"]) if isinstance(fp8, DelayedScaling) else None
    d = fp8_dispatch_grouped_dense(x2d, routing_map, n, wi, fp8, state=st)
    h = _ffn_activation(d.out, cfg.activation, cfg.gated, x2d.dtype)
    y = _grouped_gemm(fp8, fp8_state)(h, wo, d.tokens_per_expert, cfg.grouped_gemm, "wo")
    return y, d.row_id_map


def _moe_local(x2d, router_kernel, expert_bias, wi, wo, cfg: MoEConfig, axis_name, fp8=None, fp8_state=None):
    """MoE on the local tokens; with ``axis_name`` inside shard_map, experts are split over it."""
    rc = cfg.router
    logits = router_logits(x2d, router_kernel)
    r = route(logits, rc, expert_bias, axis_name=axis_name)
    t = x2d.shape[0]
    n = t * rc.topk
    if fp8 is not None and cfg.fp8_dispatch and axis_name is None:
        y, row_id_map = _fp8_dispatch_ffn(x2d, r.routing_map, n, wi, wo, cfg, fp8, fp8_state)
        out = token_combine(y, row_id_map, merging_probs=r.probs)
        return out, r.aux_loss, r.tokens_per_expert
    if fp8 is not None and cfg.fp8_dispatch:
        y, row_id_map = _fp8_expert_parallel_ffn(x2d, r.routing_map, n, wi, wo, cfg, fp8, fp8_state, axis_name)
        out = token_combine(y, row_id_map, merging_probs=r.probs)
        return out, r.aux_loss, r.tokens_per_expert
    dispatched = token_dispatch(x2d, r.routing_map, n)
    rows, row_id_map, tpe_local = dispatched.out, dispatched.row_id_map, dispatched.tokens_per_expert
    ffn = functools.partial(expert_ffn, activation=cfg.activation, gated=cfg.gated, backend=cfg.grouped_gemm, fp8=fp8,
                            fp8_state=fp8_state)  # fmt: skip
    if axis_name is None:
        y = ffn(rows, wi, wo, tpe_local)
    else:
        y = _expert_parallel_ffn(rows, tpe_local, wi, wo, ffn, axis_name)
    out = token_combine(y, row_id_map, merging_probs=r.probs)
    return out, r.aux_loss, r.tokens_per_expert


class _EPLayout(NamedTuple):
    """Where the expert-major rows of one shard go in the expert-parallel exchange."""

    send_sizes: jax.Array  # int32 [P]: rows for shard j's local experts
    starts: jax.Array  # int32 [P]: their first row in the local expert-major buffer
    recv_counts: jax.Array  # int32 [P(source), El]: rows received per source and local expert
    split: jax.Array  # int32 [P * (El + 1)]: the received chunks (per source: El experts, then padding)


def _ep_order(p: int, el: int) -> np.ndarray:
    """Chunk order regrouping the received rows expert-major (all sources' rows of local expert 0,
    then expert 1, ...), then every source's padding."""
    return np.array(
        [i * (el + 1) + j for j in range(el) for i in range(p)] + [i * (el + 1) + el for i in range(p)], np.int32
    )


def _ep_layout(tpe, el: int, n: int, axis_name) -> _EPLayout:
    p = jax.lax.psum(1, axis_name)
    counts = tpe.reshape(p, el).astype(jnp.int32)  # rows for shard j's local experts
    send_sizes = counts.sum(1)
    starts = jnp.cumsum(send_sizes) - send_sizes
    recv_counts = jax.lax.all_to_all(counts, axis_name, 0, 0, tiled=False)  # [P(source), El]
    pad = n - recv_counts.sum(1, keepdims=True)
    split = jnp.concatenate([recv_counts, pad], axis=1).reshape(-1).astype(jnp.int32)
    return _EPLayout(send_sizes, starts, recv_counts, split)


def _ep_send(rows, lay: _EPLayout, axis_name):
    """The send buffer ``[P, N, ...]`` (chunk j: the rows for shard j, zero-padded to N) through the
    all-to-all: ``[P(source), N, ...]``. Any dtype (FP8 rows travel as uint16 byte pairs)."""
    p = jax.lax.psum(1, axis_name)
    n = rows.shape[0]
    ar = jnp.arange(n, dtype=jnp.int32)
    src = lay.starts[:, None] + ar[None, :]  # [P, N]
    valid = (ar[None, :] < lay.send_sizes[:, None]).reshape((p, n) + (1,) * (rows.ndim - 1))
    send = jnp.where(valid, rows[jnp.clip(src, 0, n - 1)], jnp.zeros((), rows.dtype))
    return jax.lax.all_to_all(send, axis_name, 0, 0, tiled=False)


def _ep_return(y, lay: _EPLayout, axis_name, n: int):
    """The inverse exchange of the FFN output ``y [P * N, H]`` (expert-major on the expert's shard):
    un-regroup, all-to-all back, and gather the rows into the local expert-major order ``[N, H]``."""
    p = jax.lax.psum(1, axis_name)
    el = lay.recv_counts.shape[1]
    order = _ep_order(p, el)
    inverse = np.argsort(order).astype(np.int32)
    back, _ = sort_chunks_by_index(y, lay.split[order], jnp.asarray(inverse))
    ret = jax.lax.all_to_all(back.reshape(p, n, -1), axis_name, 0, 0, tiled=False)  # [P(dest shard), N, H]
    ar = jnp.arange(n, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(jnp.cumsum(lay.send_sizes), ar, side="right"), 0, p - 1)
    return ret.reshape(p * n, -1)[owner * n + (ar - lay.starts[owner])]


def _expert_parallel_ffn(rows, tpe, wi_local, wo_local, ffn, axis_name):
    """All-to-all the expert-major ``rows [N, H]`` to the shards owning the experts, regroup them by
    local expert with sort_chunks_by_index, run the FFN, and send the results back.

    Each send chunk is padded to N rows (the most one shard can send another), which keeps the
    exchange exact (no token dropping) with static shapes.
    """
    p = jax.lax.psum(1, axis_name)
    el = wi_local.shape[0]
    n, h = rows.shape
    lay = _ep_layout(tpe, el, n, axis_name)
    recv = _ep_send(rows, lay, axis_name)  # [P(source), N, H]
    grouped, _ = sort_chunks_by_index(recv.reshape(p * n, h), lay.split, jnp.asarray(_ep_order(p, el)))
    y = ffn(grouped, wi_local, wo_local, lay.recv_counts.sum(0))
    return _ep_return(y, lay, axis_name, n)


# FP8 rows across the all-to-all ---------------------------------------------------------------


def _regroup_index(split, order: np.ndarray, total: int):
    """Source row of each output row of ``sort_chunks_by_index(x, split, order)`` (an integer gather:
    FP8 byte pairs are moved by indexing, never by a float kernel, so every bit pattern, -0 included,
    comes through)."""
    sizes = split[order]
    dst_end = jnp.cumsum(sizes)
    dst_start = dst_end - sizes
    src_start = (jnp.cumsum(split) - split)[order]
    r = jnp.arange(total, dtype=jnp.int32)
    k = jnp.clip(jnp.searchsorted(dst_end, r, side="right"), 0, len(order) - 1)
    return src_start[k] + (r - dst_start[k])


def _ep_send_quantized(q, lay: _EPLayout, axis_name):
    """The dispatched FP8 rows ``q [N, H]`` (with their 1 x 128 scale rows for block scaling) through
    the exchange and regrouped by local expert: ``[P * N, H]``. The bytes travel as uint16 pairs
    (half the bytes of bfloat16 rows), the scale rows as float32; padding rows are FP8 zeros with
    inverse scale 1 (a quantized zero row)."""
    from te_ops.fp8.reference import QuantizedTensor

    p = jax.lax.psum(1, axis_name)
    n, h = q.data.shape
    el = lay.recv_counts.shape[1]
    idx = _regroup_index(lay.split, _ep_order(p, el), p * n)
    data = q.data if h % 2 == 0 else jnp.pad(q.data, ((0, 0), (0, 1)))
    pairs = jax.lax.bitcast_convert_type(data.reshape(n, -1, 2), jnp.uint16)  # [N, ceil(H / 2)]
    pairs = _ep_send(pairs, lay, axis_name).reshape(p * n, -1)[idx]
    data = jax.lax.bitcast_convert_type(pairs, q.data.dtype).reshape(p * n, -1)[:, :h]
    if q.block is None:
        sinv = q.scale_inv
    else:
        s = _ep_send(q.scale_inv, lay, axis_name).reshape(p * n, -1)[idx]
        sinv = jnp.where(s == 0, jnp.ones((), jnp.float32), s)
    return QuantizedTensor(data, sinv, q.block, q.dtype)


def _ep_quantize_tokens(recipe, impl, x, st, axis_name):
    """The local tokens quantized once. Current scaling: one scale from the amax over ALL shards'
    tokens (pmax over the expert axis), so every shard's rows (and every expert's received rows)
    share one scale, the single-device one; delayed: the replicated state's scale; block: 1 x 128."""
    from te_ops.fp8 import CurrentScaling
    from te_ops.fp8 import dispatch as D
    from te_ops.fp8 import reference as ref
    from te_ops.fp8.recipes import format_max

    if isinstance(recipe, CurrentScaling):
        fx = recipe.format("x")
        amax = jax.lax.pmax(ref.amax(x), axis_name)
        scale = ref.compute_scale(amax, format_max(fx), recipe.margin, recipe.power_of_2)
        q = ref.QuantizedTensor(ref.cast_scaled(x, scale, fx), (1.0 / scale).astype(jnp.float32), None, x.dtype)
        return q, st
    return D._stage(impl, functools.partial(D._quant_x, recipe), x, st)


def _fp8_ep_fwd(x, kernels, routing_map, state, statics):
    from te_ops.fp8 import DelayedScaling
    from te_ops.fp8 import dispatch as D

    recipe, n, impl, axis_name = statics
    delayed = isinstance(recipe, DelayedScaling)
    qx, st_x = _ep_quantize_tokens(recipe, impl, x, state.x if delayed else None, axis_name)
    d = D._move(qx, routing_map, n, None, None)  # local dispatch of the FP8 rows (byte pairs)
    lay = _ep_layout(d.tokens_per_expert, kernels.shape[0], n, axis_name)
    qg = _ep_send_quantized(d.out, lay, axis_name)
    gs = lay.recv_counts.sum(0)
    st_w = state.w if delayed else None
    y, qx_t, qw_t, st_w = D._stage(impl, functools.partial(D._experts, recipe), qg, kernels, gs, st_w)
    res = (qx_t, qw_t, gs, d.row_id_map, lay, st_x, st_w, state.g if delayed else None, jnp.zeros((), kernels.dtype))
    return (y, d.row_id_map, lay), res


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_ep_wi(x, kernels, routing_map, state, statics):
    return _fp8_ep_fwd(x, kernels, routing_map, state, statics)[0]


def _fp8_ep_bwd(statics, res, ct):
    from te_ops.fp8 import DelayedScaling
    from te_ops.fp8 import dispatch as D
    from te_ops.fp8.dense import DenseScalingState

    recipe, n, impl, axis_name = statics
    qx_t, qw_t, gs, row_id_map, lay, st_x, st_w, st_g, w_proto = res
    fn = functools.partial(D._experts_bwd, recipe)
    dxd, dk, st_g = D._stage(impl, fn, qx_t, qw_t, gs, st_g, w_proto, ct[0])
    # the forward moved FP8 rows; the gradient goes back in high precision: reverse exchange, then
    # token_dispatch's backward (a float32 sum of each token's rows)
    dx = token_combine(_ep_return(dxd, lay, axis_name, n), row_id_map)
    dstate = DenseScalingState(st_x, st_w, st_g) if isinstance(recipe, DelayedScaling) else None
    return dx, dk, None, dstate


_fp8_ep_wi.defvjp(_fp8_ep_fwd, _fp8_ep_bwd)


def _fp8_expert_parallel_ffn(x2d, routing_map, n, wi, wo, cfg: MoEConfig, fp8, fp8_state, axis_name):
    """FP8 token dispatch under expert parallelism: the local tokens are quantized once, dispatched
    expert-major as FP8 rows, and those FP8 rows (uint16 byte pairs, with their float32 1 x 128 scale
    rows for block scaling) cross the all-to-all; the owning shard regroups them by local expert and
    runs the FP8 wi GEMM on them directly (``_fp8_ep_wi``, a custom VJP as
    ``te_ops.fp8.fp8_dispatch_grouped_dense``: the gradient crosses back in high precision). Then the
    activation, the wo GEMM and the high-precision return exchange as :func:`_expert_parallel_ffn`.
    Returns (y [N, H] local expert-major, row_id_map)."""
    from te_layers._fp8 import from_tree
    from te_ops._core.partitioning import match_vma
    from te_ops.fp8 import DelayedScaling
    from te_ops.fp8 import grouped as G
    from te_ops.fp8.select import resolve

    p = jax.lax.psum(1, axis_name)
    el = wi.shape[0]
    impl = resolve("reference" if G._triton_unsupported(p * n, el) else None)
    st = from_tree(fp8_state["wi"]) if isinstance(fp8, DelayedScaling) else None
    x2d, wi_c, routing_map = match_vma(x2d, wi, routing_map)
    h, row_id_map, lay = _fp8_ep_wi(x2d, wi_c, routing_map, st, (fp8, n, impl, axis_name))
    h = _ffn_activation(h, cfg.activation, cfg.gated, x2d.dtype)
    y = _grouped_gemm(fp8, fp8_state)(h, wo, lay.recv_counts.sum(0), cfg.grouped_gemm, "wo")
    return _ep_return(y, lay, axis_name, n), row_id_map


def _current_mesh(layer, mesh):
    if mesh is not None:
        return mesh
    m = jax.sharding.get_abstract_mesh()
    if m is None or m.empty:
        raise ValueError(
            V.err(layer, "mesh is required with expert_axis: pass mesh= or call the layer inside "
                         "`with jax.set_mesh(mesh):`.")
        )  # fmt: skip
    return m


def moe_apply(
    x: jax.Array,
    router_kernel: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    cfg: MoEConfig,
    expert_bias: jax.Array | None = None,
    *,
    dtype: Any = None,
    mesh: Any = None,
    fp8: Any = None,
    fp8_state: Any = None,
) -> MoEOutput:
    """MoE block: router -> token_dispatch -> grouped expert FFN -> token_combine.

    With ``cfg.expert_axis`` the experts (dimension 0 of wi/wo) and the tokens are split over that mesh
    axis inside ``shard_map``; tokens are exchanged with two all-to-alls. Zero tokens give an empty
    output of x's shape, aux loss 0 and no tokens per expert. ``fp8``: the experts' resolved recipe
    (see :func:`expert_ffn`); the router and the combine stay in high precision. With
    ``cfg.fp8_dispatch`` (default) the tokens are quantized once and the FP8 rows dispatched
    (:func:`_fp8_dispatch_ffn`); under ``cfg.expert_axis`` those FP8 rows, as uint16 byte pairs with
    their float32 1 x 128 scale rows (block scaling), cross the all-to-all and the owning shard runs
    the FP8 wi GEMM on them (:func:`_fp8_expert_parallel_ffn`; current scaling takes one scale from
    the amax over all shards' tokens, a pmax, so every shard and every expert sees the single-device
    scale; delayed scaling's scale is replicated). The gradient crosses back in high precision. With
    ``fp8_dispatch=False`` the dispatch (and the all-to-all) moves high-precision rows and each
    expert GEMM quantizes its own input. ``fp8_state``:
    with DelayedScaling, the experts' state tree (:func:`expert_ffn`); under ``cfg.expert_axis``
    the per-expert kernel states are split with the experts, and the activation and gradient
    states are combined over the shards by max (:func:`te_layers._fp8.shard_replicated_state`).
    """
    layer = cfg.router.layer
    dt = compute_dtype(x, dtype)
    lead, hdim = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, hdim).astype(dt)
    wi, wo = _expert_kernels(wi, dt, fp8), _expert_kernels(wo, dt, fp8)
    if x2d.shape[0] == 0:
        r = empty_route(cfg.router.num_experts)
        return MoEOutput(jnp.zeros(x.shape, dt), r.aux_loss, r.tokens_per_expert)
    if cfg.expert_axis is None:
        out, aux, tpe = _moe_local(x2d, router_kernel, expert_bias, wi, wo, cfg, None, fp8, fp8_state)
    else:
        ax = cfg.expert_axis
        m = _current_mesh(layer, mesh)
        V.check_expert_mesh(layer, m, ax, cfg.router.num_experts)
        if x2d.shape[0] % m.shape[ax]:
            raise ValueError(
                V.err(layer, f"x must hold a number of tokens (the product of its leading dimensions) divisible by "
                             f"the {m.shape[ax]} shards of mesh axis {ax!r} (expert_axis), got shape {tuple(x.shape)} "
                             f"({x2d.shape[0]} tokens).")
            )  # fmt: skip
        eb = expert_bias if expert_bias is not None else jnp.zeros((cfg.router.num_experts,), jnp.float32)
        # delayed scaling: the kernels' states (one per expert) split with the experts; the x and g
        # states copied to every shard (rows are split) and their updates combined by max
        rep, per_expert = {}, {}
        if fp8_state is not None:
            from te_layers._fp8 import shard_replicated_state

            rep = shard_replicated_state({k: {r: t[r] for r in ("x", "g")} for k, t in fp8_state.items()}, m.shape[ax])
            per_expert = {k: t["w"] for k, t in fp8_state.items()}

        def body(xs, rk, ebias, wis, wos, rep, per_expert):
            st = None
            if fp8_state is not None:
                st = {k: {"x": jax.tree.map(lambda a: a[0], rep[k]["x"]), "w": per_expert[k],
                          "g": jax.tree.map(lambda a: a[0], rep[k]["g"])} for k in per_expert}  # fmt: skip
            return _moe_local(xs, rk, ebias if cfg.router.use_expert_bias else None, wis, wos, cfg, ax, fp8, st)

        out, aux, tpe = jax.shard_map(
            body, mesh=m,
            in_specs=(PartitionSpec(ax), PartitionSpec(), PartitionSpec(), PartitionSpec(ax), PartitionSpec(ax),
                      PartitionSpec(ax), PartitionSpec(ax)),
            out_specs=(PartitionSpec(ax), PartitionSpec(), PartitionSpec()),
        )(x2d, router_kernel, eb, wi, wo, rep, per_expert)  # fmt: skip
    return MoEOutput(out.reshape(*lead, hdim), aux, tpe)


def lecun_normal_in_axis(in_axis: int = -2, out_axis: int = -1, batch_axis=()):
    """Variance-scaling init for stacked expert kernels (fan-in from ``in_axis``)."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis, out_axis, batch_axis)


def default_expert_init():
    return lecun_normal_in_axis(-2, -1, (0,))


def head_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
