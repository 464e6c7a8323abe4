"""Public router ops: validation, custom VJPs, registration and implementation dispatch.

Three op families (one registry family per public function, so ``use_implementation`` can pick
them separately): ``fused_topk_with_score_function``, ``compute_routing_scores_for_aux_loss`` and
``fused_moe_aux_loss``; plus the compact routing-map converters ``pack_routing_map`` /
``unpack_routing_map``. Sharding rules and vmap folds: :mod:`te_ops.router.sharding`. The exact
semantics, edge cases included: docs/semantics.md ("Router") and the docstrings below.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from te_ops._core import registry
from te_ops._core.partitioning import match_vma
from te_ops._core.validation import (
    FLOAT_DTYPES_WITH_F64,
    as_array,
    check_bool,
    check_float,
    check_int_array,
    err,
    static_bool,
    static_choice,
    static_float,
    static_int,
)
from te_ops.router import native, reference, sharding
from te_ops.router.reference import LossResiduals, ScoresResiduals, TopkResiduals

TOPK = registry.family("fused_topk_with_score_function")
SCORES = registry.family("compute_routing_scores_for_aux_loss")
LOSS = registry.family("fused_moe_aux_loss")

for _fam, _fwd, _bwd, _why, _rfwd, _rbwd in (
    (TOPK, native.topk_forward, native.topk_backward, native.topk_unsupported_reason,
     reference.topk_forward, reference.topk_backward),
    (SCORES, native.scores_forward, native.scores_backward, native.scores_unsupported_reason,
     reference.scores_forward, reference.scores_backward),
    (LOSS, native.loss_forward, native.loss_backward, native.loss_unsupported_reason,
     reference.loss_forward, reference.loss_backward),
):  # fmt: skip
    _fam.register(
        registry.Implementation(
            name="native",
            forward=_fwd,
            backward=_bwd,
            unsupported_reason=_why,
            platform="cuda",
            # The default on CUDA: tests/gpu/test_router_gpu.py checks it against the reference.
            available=registry.native_available("_native", "router"),
        )
    )
    _fam.register(registry.Implementation(name=registry.REFERENCE, forward=_rfwd, backward=_rbwd))

_SCORE_FUNCTIONS = ("softmax", "sigmoid")


# ----------------------------------------------------------------------------------------------
# Validation (router-specific; the generic checks are te_ops._core.validation)
# ----------------------------------------------------------------------------------------------


def _check_rows(op: str, name: str, x: Any, *, min_experts: int) -> jax.Array:
    """``x`` as a float ``[T, E]`` array with ``E >= min_experts``."""
    x = check_float(op, name, x)
    if x.ndim != 2:
        raise ValueError(
            err(
                op,
                f"{name} must have rank 2 [tokens, experts], got shape {tuple(x.shape)}. "
                f"Flatten the leading axes first, e.g. {name}.reshape(-1, {name}.shape[-1]).",
            )
        )
    if x.shape[1] < min_experts:
        raise ValueError(
            err(op, f"{name} must have at least {min_experts} expert (E >= {min_experts}), got shape {tuple(x.shape)}.")
        )
    return x


def _check_topk(op: str, topk: Any, num_experts: int) -> int:
    topk = static_int(op, "topk", topk, minimum=1, why="It fixes the number of experts chosen per token.")
    if topk > num_experts:
        raise ValueError(
            err(
                op,
                f"topk must be <= the number of experts E={num_experts}, got topk={topk}. "
                "Choose fewer experts per token.",
            )
        )
    return topk


def _check_groups(op: str, num_groups: Any, group_topk: Any, num_experts: int, topk: int):
    if num_groups is None and group_topk is None:
        return None, None
    if num_groups is None or group_topk is None:
        raise ValueError(
            err(
                op,
                f"num_groups and group_topk must be given together (grouped selection), got "
                f"num_groups={num_groups!r}, group_topk={group_topk!r}. Pass both, or neither for plain top-k.",
            )
        )
    num_groups = static_int(op, "num_groups", num_groups, minimum=1)
    group_topk = static_int(op, "group_topk", group_topk, minimum=1)
    if num_experts % num_groups:
        raise ValueError(
            err(
                op,
                f"the number of experts E={num_experts} must be divisible by num_groups, got "
                f"num_groups={num_groups}. Pick a divisor of E.",
            )
        )
    if topk % group_topk:
        raise ValueError(err(op, f"topk must be divisible by group_topk, got topk={topk}, group_topk={group_topk}."))
    if group_topk > num_groups:
        raise ValueError(err(op, f"group_topk must be <= num_groups={num_groups}, got group_topk={group_topk}."))
    if topk // group_topk > num_experts // num_groups:
        raise ValueError(
            err(
                op,
                f"topk // group_topk = {topk // group_topk} experts per chosen group exceed the group size "
                f"E // num_groups = {num_experts // num_groups}. Use more groups per token (larger "
                "group_topk) or fewer, larger groups.",
            )
        )
    return num_groups, group_topk


def _check_bias(op: str, expert_bias: Any, score_function: str, num_experts: int):
    if expert_bias is None:
        return None
    if score_function != "sigmoid":
        raise ValueError(
            err(
                op,
                f"expert_bias is only supported with score_function='sigmoid', got "
                f"score_function={score_function!r}. Drop expert_bias or use the sigmoid score function.",
            )
        )
    expert_bias = check_float(op, "expert_bias", expert_bias, FLOAT_DTYPES_WITH_F64)
    if tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(
            err(
                op,
                f"expert_bias must have shape [E] = ({num_experts},), got shape {tuple(expert_bias.shape)}. "
                "Give one bias per expert.",
            )
        )
    return expert_bias.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Compact routing maps
# ----------------------------------------------------------------------------------------------


def pack_routing_map(routing_map: jax.Array) -> jax.Array:
    """Packs a bool routing map into bytes: expert ``e`` in bit ``e % 8`` of byte ``e // 8``.

    The layout of ``compact_routing_map=True`` (and of ``np.packbits(..., bitorder="little")``).
    The padding bits past E in the last byte are 0. Works on any leading axes.

    Equivalent to::

        E = routing_map.shape[-1]
        bits = jnp.pad(routing_map, [(0, 0)] * (routing_map.ndim - 1) + [(0, -E % 8)])
        packed = (bits.reshape(*bits.shape[:-1], -1, 8) << jnp.arange(8)).sum(-1).astype(jnp.uint8)

    Args:
      routing_map: bool ``[..., E]`` (rank >= 1). Integer or float maps are refused: convert them
        with ``routing_map != 0`` (a value of 2 has no single-bit meaning).

    Returns:
      uint8 ``[..., ceil(E / 8)]``.
    """
    op = "pack_routing_map"
    routing_map = check_bool(
        op, "routing_map", routing_map, hint="Convert it with routing_map != 0 (each entry becomes one bit)."
    )
    if routing_map.ndim < 1:
        raise ValueError(
            err(
                op,
                "routing_map must have rank >= 1 [..., E], got a scalar. Pass a map with an "
                "expert axis, e.g. routing_map[None].",
            )
        )
    return reference.pack_routing_map(routing_map)


def unpack_routing_map(packed: jax.Array, num_experts: int) -> jax.Array:
    """Inverse of :func:`pack_routing_map`: uint8 ``[..., ceil(E / 8)]`` -> bool ``[..., E]``.

    Checked at trace time: dtype uint8, rank >= 1, and ``num_experts`` consistent with the packed
    width (``ceil(num_experts / 8) == packed.shape[-1]``). Not checked (values are not known at
    trace time): padding bits past ``num_experts`` in the last byte are ignored whatever they hold,
    and the number of set bits per row is not checked against any ``topk``.

    Equivalent to::

        bits = (packed[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
        routing_map = bits.reshape(*packed.shape[:-1], -1)[..., :num_experts].astype(bool)

    Args:
      packed: uint8 ``[..., ceil(E / 8)]`` (rank >= 1).
      num_experts: E, a static Python int with ``8 * (packed.shape[-1] - 1) < E <= 8 * packed.shape[-1]``
        (0 for a packed width of 0).

    Returns:
      bool ``[..., num_experts]``.
    """
    op = "unpack_routing_map"
    packed = check_int_array(op, "packed", packed, dtype=jnp.uint8)
    if packed.ndim < 1:
        raise ValueError(err(op, "packed must have rank >= 1 [..., ceil(E / 8)], got a scalar."))
    num_experts = static_int(op, "num_experts", num_experts, minimum=0, why="It fixes the output shape.")
    width = packed.shape[-1]
    if (num_experts + 7) // 8 != width:
        lo, hi = max(8 * width - 7, 0), 8 * width
        raise ValueError(
            err(
                op,
                f"num_experts={num_experts} needs ceil(num_experts / 8) = {(num_experts + 7) // 8} bytes per "
                f"row, but packed has {width} (shape {tuple(packed.shape)}). For this packed width "
                f"num_experts must be in [{lo}, {hi}]; pass the E the map was packed from.",
            )
        )
    return reference.unpack_routing_map(packed, num_experts)


# ----------------------------------------------------------------------------------------------
# fused_topk_with_score_function
# ----------------------------------------------------------------------------------------------


@functools.cache
def _build_topk(statics_items: tuple, implementation: str | None, has_bias: bool):
    statics = dict(statics_items)
    map_kind = "tc" if statics["compact_routing_map"] else "te"

    def desc(x):
        return dict(dtype=x.dtype, shape=tuple(x.shape), **statics)

    def fwd_impl(logits, *bias):
        b = bias[0] if bias else None
        (probs, rmap), _ = TOPK.dispatch(implementation, "forward", (logits, b), statics, desc(logits))
        return probs, rmap

    def bwd_impl(logits, rmap, g):
        return TOPK.dispatch(implementation, "backward", (TopkResiduals(logits, rmap), g), statics, desc(logits))

    fwd_ops = ("te", "e") if has_bias else ("te",)
    fwd_call = sharding.rowwise_call(fwd_impl, fwd_ops, ("te", map_kind), n_rows_args=1)
    bwd_call = sharding.rowwise_call(bwd_impl, ("te", map_kind, "te"), ("te",), n_rows_args=3)

    def fwd_common(logits, *bias):
        probs, rmap = fwd_call(logits, *bias)
        return (probs, rmap), TopkResiduals(logits, rmap)

    def bwd_common(res, cts):
        return bwd_call(res.logits, res.routing_map, cts[0])  # the routing map has no cotangent

    if has_bias:

        @jax.custom_vjp
        def op(logits, bias):
            return fwd_common(logits, bias)[0]

        op.defvjp(fwd_common, lambda res, cts: (bwd_common(res, cts), None))  # no gradient to the bias
    else:

        @jax.custom_vjp
        def op(logits):
            return fwd_common(logits)[0]

        op.defvjp(fwd_common, lambda res, cts: (bwd_common(res, cts),))
    return op


def fused_topk_with_score_function(
    logits: jax.Array,
    topk: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float = 1.0,
    expert_bias: jax.Array | None = None,
    compact_routing_map: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """MoE router: score function, (grouped) top-k selection and the dense routing weights.

    Per token row, in fp32 (docs/semantics.md, "Router"):

    1. scores ``s`` = softmax(logits) over E with ``use_pre_softmax``, the logits themselves for
       softmax without it, sigmoid(logits) for sigmoid;
    2. selection scores ``s + expert_bias`` (sigmoid only);
    3. with ``group_topk``: E splits into ``num_groups`` contiguous groups, a group scores the sum of
       its top ``topk // group_topk`` selection scores, only the best ``group_topk`` groups can be
       chosen;
    4. top-k over the selection scores; ties go to the larger value, then the smaller expert index;
    5. weights from the UNBIASED scores of the chosen experts: softmax over the k chosen logits
       (softmax without pre-softmax), the chosen softmax scores (with it), the chosen sigmoids (topk
       == 1) or the chosen sigmoids divided by (their sum + 1e-20) (topk > 1);
    6. ``probs = scaling_factor * weights`` at the chosen experts and exactly 0 elsewhere.

    ``routing_map`` always has exactly ``topk`` True entries per row (also for rows with NaN, ties
    or -inf); it is NOT ``probs != 0`` (a chosen weight can underflow to 0, or be scaled by 0).

    Non-finite logits: the op does not sanitise them. A row whose logits contain a NaN gets NaN
    probs at ALL of its chosen experts (every score function, as a NaN poisons a whole
    ``jax.nn.softmax`` row), and which experts such a row chooses is unspecified (NaN has no
    place in the order; implementations may rank it first or last); rows without NaN are not
    affected. +-inf follow the formulas above: with softmax, +inf gives NaN weights (inf - inf), a
    chosen -inf gets weight 0 unless every chosen logit is -inf (then NaN); sigmoid maps them to
    1 and 0. A NaN in ``expert_bias`` only affects the selection. Gradients of rows with non-finite
    logits are unspecified. Zero tokens (T == 0) give empty results.

    Equivalent to (plain softmax, no groups, finite logits)::

        x = logits.astype(jnp.float32)
        vals, idx = jax.lax.top_k(x, topk)
        w = jax.nn.softmax(vals, axis=-1) * scaling_factor
        probs = jnp.put_along_axis(jnp.zeros_like(x), idx, w, axis=-1, inplace=False).astype(logits.dtype)
        routing_map = jnp.zeros(x.shape, bool).at[jnp.arange(x.shape[0])[:, None], idx].set(True)

    Args:
      logits: ``[T, E]`` float32, bfloat16 or float16, E >= 1 (T may be 0).
      topk: experts per token, a static int in ``[1, E]``.
      score_function: "softmax" or "sigmoid".
      use_pre_softmax: a Python bool: softmax over all E before the top-k (softmax only; ignored for
        sigmoid). Ints such as 1 are refused.
      num_groups, group_topk: grouped selection (give both, or neither); E % num_groups == 0,
        topk % group_topk == 0, group_topk <= num_groups, topk // group_topk <= E // num_groups.
      scaling_factor: static finite multiplier of the weights.
      expert_bias: float ``[E]`` added to the selection scores only (sigmoid only); gets no gradient.
      compact_routing_map: a Python bool: return the map as uint8 ``[T, ceil(E/8)]`` (see :func:`pack_routing_map`)
        instead of bool ``[T, E]``.
      implementation: None (best available), "native" or "reference".

    Returns:
      ``(probs [T, E] in logits' dtype, routing_map)``. Gradients flow to ``logits`` only (none to
      ``expert_bias``, none from ``routing_map``).
    """
    op = "fused_topk_with_score_function"
    logits = _check_rows(op, "logits", logits, min_experts=1)
    e = logits.shape[1]
    topk = _check_topk(op, topk, e)
    score_function = static_choice(op, "score_function", score_function, _SCORE_FUNCTIONS)
    num_groups, group_topk = _check_groups(op, num_groups, group_topk, e, topk)
    bias = _check_bias(op, expert_bias, score_function, e)
    scaling_factor = static_float(op, "scaling_factor", scaling_factor)
    statics = (
        ("topk", topk),
        ("score_function", score_function),
        ("use_pre_softmax", static_bool(op, "use_pre_softmax", use_pre_softmax) and score_function == "softmax"),
        ("num_groups", num_groups),
        ("group_topk", group_topk),
        ("scaling_factor", scaling_factor),
        ("compact_routing_map", static_bool(op, "compact_routing_map", compact_routing_map)),
    )  # fmt: skip
    fn = _build_topk(statics, implementation, bias is not None)
    return fn(*match_vma(logits, bias)) if bias is not None else fn(*match_vma(logits))


# ----------------------------------------------------------------------------------------------
# compute_routing_scores_for_aux_loss
# ----------------------------------------------------------------------------------------------


@functools.cache
def _build_scores(statics_items: tuple, implementation: str | None):
    statics = dict(statics_items)
    map_kind = "tc" if statics["compact_routing_map"] else "te"

    def desc(x):
        return dict(dtype=x.dtype, shape=tuple(x.shape), **statics)

    def fwd_impl(logits):
        out, _ = SCORES.dispatch(implementation, "forward", (logits,), statics, desc(logits))
        return out

    def bwd_impl(logits, g):
        return SCORES.dispatch(implementation, "backward", (ScoresResiduals(logits), g), statics, desc(logits))

    fwd_call = sharding.rowwise_call(fwd_impl, ("te",), (map_kind, "te"), n_rows_args=1)
    bwd_call = sharding.rowwise_call(bwd_impl, ("te", "te"), ("te",), n_rows_args=2)

    @jax.custom_vjp
    def op(logits):
        return fwd_call(logits)

    def op_fwd(logits):
        return fwd_call(logits), ScoresResiduals(logits)

    def op_bwd(res, cts):
        return (bwd_call(res.logits, cts[1]),)

    op.defvjp(op_fwd, op_bwd)
    return op


def compute_routing_scores_for_aux_loss(
    logits: jax.Array,
    topk: int,
    *,
    score_function: str = "softmax",
    compact_routing_map: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense router scores for the load-balancing loss, and the top-k routing map of those scores.

    No bias, groups or scaling. Scores are softmax(logits) over E, or sigmoid(logits) divided by
    (their sum over E + 1e-20); the map marks the top ``topk`` scores per row (ties: smaller expert
    index first) and has exactly ``topk`` True entries per row. A row whose logits contain a NaN
    gets NaN scores across the whole row (both score functions), and its map has ``topk``
    unspecified experts. Zero tokens (T == 0) give empty results.

    Equivalent to::

        x = logits.astype(jnp.float32)
        s = jax.nn.softmax(x, -1) if score_function == "softmax" else (
            jax.nn.sigmoid(x) / (jax.nn.sigmoid(x).sum(-1, keepdims=True) + 1e-20))
        _, idx = jax.lax.top_k(s, topk)
        routing_map = jnp.zeros(s.shape, bool).at[jnp.arange(T)[:, None], idx].set(True)
        scores = s.astype(logits.dtype)

    Args:
      logits: ``[T, E]`` float32, bfloat16 or float16, E >= 1 (T may be 0).
      topk: experts per token, a static int in ``[1, E]``.
      score_function: "softmax" or "sigmoid".
      compact_routing_map: a Python bool: uint8 ``[T, ceil(E/8)]`` map (see :func:`pack_routing_map`) instead of bool.
      implementation: None (best available), "native" or "reference".

    Returns:
      ``(routing_map, scores [T, E] in logits' dtype)``; gradients flow from scores to logits.
    """
    op = "compute_routing_scores_for_aux_loss"
    logits = _check_rows(op, "logits", logits, min_experts=1)
    topk = _check_topk(op, topk, logits.shape[1])
    score_function = static_choice(op, "score_function", score_function, _SCORE_FUNCTIONS)
    compact = static_bool(op, "compact_routing_map", compact_routing_map)
    statics = (("topk", topk), ("score_function", score_function), ("compact_routing_map", compact))
    return _build_scores(statics, implementation)(*match_vma(logits))


# ----------------------------------------------------------------------------------------------
# fused_moe_aux_loss: a reduction over tokens (see sharding.py for the partition plans)
# ----------------------------------------------------------------------------------------------


def loss_scale(num_experts: int, num_tokens: int, topk: int, coeff: float) -> float:
    """``E * coeff / (topk * T^2)`` with T the global token count; 0 when T == 0 (no tokens, no loss)."""
    if num_tokens == 0:
        return 0.0
    return num_experts * coeff / (topk * float(num_tokens) * float(num_tokens))


@functools.cache
def _build_loss(topk: int, coeff: float, implementation: str | None, shape: tuple[int, int], dtype):
    t, e = shape
    scale = loss_scale(e, t, topk, coeff)

    def partial_sum(probs, tpe):
        call = dict(dtype=probs.dtype, shape=tuple(probs.shape))
        partial, _ = LOSS.dispatch(implementation, "forward", (probs, tpe), {}, call)
        return partial

    def finish(partial):
        return (jnp.float32(scale) * partial).astype(dtype)

    def backward_for(local_shape):
        def bwd(tpe, gs):
            call = dict(dtype=dtype, shape=local_shape)
            statics = dict(shape=local_shape, dtype=dtype)
            return LOSS.dispatch(implementation, "backward", (LossResiduals(tpe), gs), statics, call)

        return bwd

    fwd_call = sharding.loss_call(
        lambda probs, tpe: finish(partial_sum(probs, tpe)),
        rule=sharding.loss_forward_rule,
        plan=functools.partial(sharding.loss_forward_plan, partial_sum, finish),
    )
    bwd_call = sharding.loss_call(
        backward_for((t, e)),
        rule=sharding.loss_backward_rule,
        plan=functools.partial(sharding.loss_backward_plan, backward_for),
    )

    @jax.custom_vjp
    def op(probs, tpe):
        return fwd_call(probs, tpe)

    def op_fwd(probs, tpe):
        return fwd_call(probs, tpe), LossResiduals(tpe)

    def op_bwd(res, g):
        gs = jnp.float32(scale) * g.astype(jnp.float32)
        return bwd_call(res.tokens_per_expert, gs), None  # no gradient to tokens_per_expert

    op.defvjp(op_fwd, op_bwd)
    return op


def fused_moe_aux_loss(
    probs: jax.Array,
    tokens_per_expert: jax.Array,
    *,
    topk: int,
    coeff: float,
    implementation: str | None = None,
) -> jax.Array:
    """Switch-style load-balancing loss over the GLOBAL batch of tokens.

    ``loss = E * coeff / (topk * T**2) * sum_e (sum_t probs[t, e]) * tokens_per_expert[e]`` with T
    the global token count: with ``probs`` sharded over tokens (and/or experts) the result equals
    the unsharded loss (each shard reduces its block, one all-reduce adds the partial sums).
    ``d probs[t, e] = E * coeff / (topk * T**2) * tokens_per_expert[e] * g``; no gradient to
    ``tokens_per_expert``. Empty inputs are defined: T == 0 gives loss 0 and an empty gradient;
    E == 0 gives loss 0 and an empty gradient. NaN/inf in ``probs`` or ``tokens_per_expert``
    propagate into the loss (a plain sum). The values of ``tokens_per_expert`` are not checked
    (negative counts are summed like any other).

    Equivalent to::

        T, E = probs.shape
        per_expert = probs.astype(jnp.float32).sum(0)
        scale = E * coeff / (topk * T * T) if T else 0.0
        loss = (scale * jnp.sum(per_expert * tokens_per_expert)).astype(probs.dtype)

    Args:
      probs: ``[T, E]`` float32, bfloat16 or float16 (typically the aux-loss scores).
      tokens_per_expert: ``[E]`` int or float counts (global); gets no gradient.
      topk: experts per token, a static int >= 1.
      coeff: loss coefficient, a static finite float.
      implementation: None (best available), "native" or "reference".

    Returns:
      Scalar in probs' dtype.
    """
    op = "fused_moe_aux_loss"
    probs = _check_rows(op, "probs", probs, min_experts=0)
    tpe = as_array(op, "tokens_per_expert", tokens_per_expert)
    if not (jnp.issubdtype(tpe.dtype, jnp.integer) or jnp.issubdtype(tpe.dtype, jnp.floating)):
        raise TypeError(
            err(
                op,
                f"tokens_per_expert must be an int or float array, got dtype {tpe.dtype}. Convert it, e.g. "
                "tokens_per_expert.astype(jnp.int32).",
            )
        )
    if tuple(tpe.shape) != (probs.shape[1],):
        raise ValueError(
            err(
                op,
                f"tokens_per_expert must have shape [E] = ({probs.shape[1]},) to match probs "
                f"{tuple(probs.shape)}, got shape {tuple(tpe.shape)}.",
            )
        )
    topk = static_int(op, "topk", topk, minimum=1, why="It is compiled into the loss scale.")
    coeff = static_float(op, "coeff", coeff)
    tpe = jax.lax.stop_gradient(tpe).astype(jnp.float32)
    fn = _build_loss(topk, coeff, implementation, tuple(probs.shape), jnp.dtype(probs.dtype))
    return fn(*match_vma(probs, tpe))
