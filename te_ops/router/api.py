"""Public router ops: validation, custom VJPs, sharding, vmap and implementation dispatch.

Three op families (one registry family per public function, so ``use_implementation`` can pick
them separately): ``fused_topk_with_score_function``, ``compute_routing_scores_for_aux_loss`` and
``fused_moe_aux_loss``.

Sharding: the top-k and score ops are row-wise, so tokens (T) may be sharded freely (no
collective) while the expert axis is gathered. The aux loss is a reduction over tokens (and
experts): each shard computes its partial sum, one ``psum`` inside the partition adds them, and
the scale uses the GLOBAL token count, so the sharded loss equals the unsharded one.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from te_ops._core import partitioning as P
from te_ops._core import registry
from te_ops._core.partitioning import match_vma
from te_ops.router import native, reference
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
            # Default on CUDA since tests/gpu/test_router_gpu.py passed 35/35 on the H200 (2026-12-03).
            available=registry.native_available("_native", "router"),
        )
    )
    _fam.register(registry.Implementation(name=registry.REFERENCE, forward=_rfwd, backward=_rbwd))

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SCORE_FUNCTIONS = ("softmax", "sigmoid")


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _as_array(x: Any) -> jax.Array:
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def _check_float_2d(op: str, name: str, x: Any) -> jax.Array:
    x = _as_array(x)
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(
            f"te_ops.{op}: {name} must be float32, bfloat16 or float16, got dtype {jnp.dtype(x.dtype)}. "
            f"Cast it first, e.g. {name}.astype(jnp.float32)."
        )
    if x.ndim != 2:
        raise ValueError(
            f"te_ops.{op}: {name} must have rank 2 [tokens, experts], got shape {tuple(x.shape)}. "
            f"Flatten the leading axes first, e.g. {name}.reshape(-1, {name}.shape[-1])."
        )
    return x


def _check_static_int(op: str, name: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (numbers.Integral, np.integer)):
        raise TypeError(f"te_ops.{op}: {name} must be a static Python int, got {v!r} ({type(v).__name__}).")
    v = int(v)
    if v < minimum:
        raise ValueError(f"te_ops.{op}: {name} must be >= {minimum}, got {v}.")
    return v


def _check_static_float(op: str, name: str, v: Any) -> float:
    if (
        isinstance(v, (jax.Array, jax.core.Tracer))
        or isinstance(v, bool)
        or not isinstance(v, (numbers.Real, np.floating, np.integer))
    ):
        raise TypeError(
            f"te_ops.{op}: {name} must be a static Python float, got {type(v).__name__}. It is compiled "
            "into the kernel; pass a number, not an array."
        )
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"te_ops.{op}: {name} must be finite, got {v}.")
    return v


def _check_topk(op: str, topk: Any, num_experts: int) -> int:
    topk = _check_static_int(op, "topk", topk)
    if topk > num_experts:
        raise ValueError(
            f"te_ops.{op}: topk must be <= the number of experts E={num_experts}, got topk={topk}. "
            "Choose fewer experts per token."
        )
    return topk


def _check_score_function(op: str, score_function: Any) -> str:
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(
            f"te_ops.{op}: score_function must be 'softmax' or 'sigmoid', got {score_function!r}."
        )
    return score_function


def _check_groups(op: str, num_groups: Any, group_topk: Any, num_experts: int, topk: int):
    if num_groups is None and group_topk is None:
        return None, None
    if num_groups is None or group_topk is None:
        raise ValueError(
            f"te_ops.{op}: num_groups and group_topk must be given together (grouped selection), got "
            f"num_groups={num_groups!r}, group_topk={group_topk!r}. Pass both, or neither for plain top-k."
        )
    num_groups = _check_static_int(op, "num_groups", num_groups)
    group_topk = _check_static_int(op, "group_topk", group_topk)
    if num_experts % num_groups:
        raise ValueError(
            f"te_ops.{op}: the number of experts E={num_experts} must be divisible by num_groups, got "
            f"num_groups={num_groups}. Pick a divisor of E."
        )
    if topk % group_topk:
        raise ValueError(
            f"te_ops.{op}: topk must be divisible by group_topk, got topk={topk}, group_topk={group_topk}."
        )
    if group_topk > num_groups:
        raise ValueError(
            f"te_ops.{op}: group_topk must be <= num_groups={num_groups}, got group_topk={group_topk}."
        )
    if topk // group_topk > num_experts // num_groups:
        raise ValueError(
            f"te_ops.{op}: topk // group_topk = {topk // group_topk} experts per chosen group exceed the "
            f"group size E // num_groups = {num_experts // num_groups}. Use more groups per token "
            "(larger group_topk) or fewer, larger groups."
        )
    return num_groups, group_topk


def _check_bias(op: str, expert_bias: Any, score_function: str, num_experts: int):
    if expert_bias is None:
        return None
    if score_function != "sigmoid":
        raise ValueError(
            f"te_ops.{op}: expert_bias is only supported with score_function='sigmoid', got "
            f"score_function={score_function!r}. Drop expert_bias or use the sigmoid score function."
        )
    expert_bias = _as_array(expert_bias)
    if not jnp.issubdtype(expert_bias.dtype, jnp.floating):
        raise TypeError(f"te_ops.{op}: expert_bias must be a float array, got dtype {expert_bias.dtype}.")
    if tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(
            f"te_ops.{op}: expert_bias must have shape [E] = ({num_experts},), got shape "
            f"{tuple(expert_bias.shape)}. Give one bias per expert."
        )
    return expert_bias.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Row-wise ops (top-k, aux scores): sharding and vmap
# ----------------------------------------------------------------------------------------------


def _rowwise_rule(operand_kinds: tuple[str, ...], result_kinds: tuple[str, ...]):
    """kinds: "te" = [T, E], "tc" = compact map [T, ceil(E/8)], "e" = [E]."""
    names = {"te": "t e", "tc": "t c", "e": "e"}

    def rule(*shapes):
        del shapes
        ops = ", ".join(names[k] for k in operand_kinds)
        res = ", ".join(names[k] for k in result_kinds)
        order = []  # factors in order of first appearance (Shardy wants special factors sorted by index)
        for f in " ".join(names[k] for k in operand_kinds + result_kinds).split():
            if f not in order:
                order.append(f)
        return f"{ops} -> {res}", {"need_replication_factors": tuple(f for f in order if f != "t")}

    return rule


def _rowwise_specs(operand_kinds: tuple[str, ...], result_kinds: tuple[str, ...]):
    def specs(arg_specs, shapes):
        del shapes
        t_spec = arg_specs[0][0]
        spec = {"te": [t_spec, None], "tc": [t_spec, None], "e": [None]}
        ins = [spec[k] for k in operand_kinds]
        outs = [spec[k] for k in result_kinds]
        return ins, (tuple(outs) if len(outs) > 1 else outs[0])

    return specs


def _rowwise_fold(n_rows_args: int):
    """vmap rule: fold the vmapped axis into T for the first ``n_rows_args`` ([T, ...]) operands;
    trailing operands ([E] expert bias) must be unbatched, else fall back to a sequential map."""

    def fold(axis_size, in_batched, *args):
        fn = fold.fn
        if any(in_batched[n_rows_args:]):
            xs = P.broadcast_batched(axis_size, in_batched, args)
            out = jax.lax.map(lambda a: fn(*a), tuple(xs))
            return out, jax.tree.map(lambda _: True, out)
        xs = P.broadcast_batched(axis_size, in_batched[:n_rows_args], args[:n_rows_args])
        v, t = xs[0].shape[:2]
        folded = [a.reshape(v * t, *a.shape[2:]) for a in xs]
        out = fn(*folded, *args[n_rows_args:])
        out = jax.tree.map(lambda o: o.reshape(v, t, *o.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return fold


def _rowwise_call(impl, operand_kinds, result_kinds, n_rows_args):
    part = P.partitioned(
        impl,
        rule=_rowwise_rule(operand_kinds, result_kinds),
        specs=_rowwise_specs(operand_kinds, result_kinds),
    )
    fold = _rowwise_fold(n_rows_args)
    fold.fn = part
    return P.batch_folding(part, fold)


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
        res = TopkResiduals(logits, rmap)
        return TOPK.dispatch(implementation, "backward", (res, g), statics, desc(logits))

    fwd_ops = ("te", "e") if has_bias else ("te",)
    fwd_call = _rowwise_call(fwd_impl, fwd_ops, ("te", map_kind), n_rows_args=1)
    bwd_call = _rowwise_call(bwd_impl, ("te", map_kind, "te"), ("te",), n_rows_args=3)

    def fwd_common(logits, *bias):
        probs, rmap = fwd_call(logits, *bias)
        return (probs, rmap), TopkResiduals(logits, rmap)

    def bwd_common(res, cts):
        g_probs = cts[0]  # the routing map (bool/uint8) has no cotangent
        return bwd_call(res.logits, res.routing_map, g_probs)

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

    Per token (fp32 maths; see SEMANTICS.md "Router"): scores ``s`` = softmax(logits) with
    ``use_pre_softmax``, logits for softmax without it, sigmoid(logits) for sigmoid; selection scores
    ``s + expert_bias`` (sigmoid only); with ``group_topk`` only the best ``group_topk`` of
    ``num_groups`` contiguous expert groups (group score = sum of its top ``topk // group_topk``
    selection scores) can be chosen; top-k with ties to the larger value, then the smaller index.
    Weights from the unbiased scores: softmax over the k chosen logits (softmax without pre-softmax),
    the chosen softmax scores (with it), the chosen sigmoids normalised to sum 1 (sigmoid, topk > 1).

    Equivalent to (plain softmax, no groups)::

        x = logits.astype(jnp.float32)
        vals, idx = jax.lax.top_k(x, topk)
        w = jax.nn.softmax(vals, axis=-1) * scaling_factor
        probs = jnp.put_along_axis(jnp.zeros_like(x), idx, w, axis=-1, inplace=False).astype(logits.dtype)
        routing_map = probs != 0  # (chosen experts)

    Args:
      logits: ``[T, E]`` float32, bfloat16 or float16.
      topk: experts per token (static, <= E).
      score_function: "softmax" or "sigmoid".
      use_pre_softmax: softmax over all E before the top-k (softmax only; ignored for sigmoid).
      num_groups, group_topk: grouped selection (give both, or neither).
      scaling_factor: static multiplier of the weights.
      expert_bias: float ``[E]`` added to the selection scores only (sigmoid only); gets no gradient.
      compact_routing_map: return the map as uint8 ``[T, ceil(E/8)]``, expert e in bit e % 8 of
        byte e // 8, instead of bool ``[T, E]``.
      implementation: None (best available), "native" or "reference".

    Returns:
      ``(probs [T, E] in logits' dtype, routing_map)``. Gradients flow to ``logits`` only.
    """
    op = "fused_topk_with_score_function"
    logits = _check_float_2d(op, "logits", logits)
    e = logits.shape[1]
    topk = _check_topk(op, topk, e)
    score_function = _check_score_function(op, score_function)
    num_groups, group_topk = _check_groups(op, num_groups, group_topk, e, topk)
    bias = _check_bias(op, expert_bias, score_function, e)
    scaling_factor = _check_static_float(op, "scaling_factor", scaling_factor)
    statics = (
        ("topk", topk),
        ("score_function", score_function),
        ("use_pre_softmax", bool(use_pre_softmax) and score_function == "softmax"),
        ("num_groups", num_groups),
        ("group_topk", group_topk),
        ("scaling_factor", scaling_factor),
        ("compact_routing_map", bool(compact_routing_map)),
    )
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
        return SCORES.dispatch(
            implementation, "backward", (ScoresResiduals(logits), g), statics, desc(logits)
        )

    fwd_call = _rowwise_call(fwd_impl, ("te",), (map_kind, "te"), n_rows_args=1)
    bwd_call = _rowwise_call(bwd_impl, ("te", "te"), ("te",), n_rows_args=2)

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

    No bias, groups or scaling. Equivalent to::

        x = logits.astype(jnp.float32)
        s = jax.nn.softmax(x, -1) if score_function == "softmax" else (
            jax.nn.sigmoid(x) / (jax.nn.sigmoid(x).sum(-1, keepdims=True) + 1e-20))
        _, idx = jax.lax.top_k(s, topk)
        routing_map = jnp.zeros(s.shape, bool).at[jnp.arange(T)[:, None], idx].set(True)
        scores = s.astype(logits.dtype)

    Args:
      logits: ``[T, E]`` float32, bfloat16 or float16.
      topk: experts per token (static, <= E).
      score_function: "softmax" or "sigmoid".
      compact_routing_map: uint8 ``[T, ceil(E/8)]`` map (bit e % 8 of byte e // 8) instead of bool.
      implementation: None (best available), "native" or "reference".

    Returns:
      ``(routing_map, scores [T, E] in logits' dtype)``; gradients flow from scores to logits.
    """
    op = "compute_routing_scores_for_aux_loss"
    logits = _check_float_2d(op, "logits", logits)
    topk = _check_topk(op, topk, logits.shape[1])
    score_function = _check_score_function(op, score_function)
    statics = (
        ("topk", topk),
        ("score_function", score_function),
        ("compact_routing_map", bool(compact_routing_map)),
    )
    return _build_scores(statics, implementation)(*match_vma(logits))


# ----------------------------------------------------------------------------------------------
# fused_moe_aux_loss: a reduction over tokens, partitioned by hand (psum of partial sums).
# ----------------------------------------------------------------------------------------------


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _shards(mesh, axes: tuple[str, ...]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


@functools.cache
def _build_loss(topk: int, coeff: float, implementation: str | None, shape: tuple[int, int], dtype):
    t, e = shape
    scale = e * coeff / (topk * float(t) * float(t))  # uses the GLOBAL token count

    def partial_sum(probs, tpe):
        call = dict(dtype=probs.dtype, shape=tuple(probs.shape))
        partial, _ = LOSS.dispatch(implementation, "forward", (probs, tpe), {}, call)
        return partial

    def finish(partial):
        return (jnp.float32(scale) * partial).astype(dtype)

    # Forward: every shard sums its block, one psum over the sharded axes, then the global scale.
    fwd = custom_partitioning(lambda probs, tpe: finish(partial_sum(probs, tpe)))

    def fwd_partition(mesh, arg_shapes, result_shape):
        del result_shape
        spec = P.padded_spec(arg_shapes[0].sharding.spec, 2)
        t_axes, e_axes = _axes(spec[0]), _axes(spec[1])
        axes = t_axes + e_axes

        def lower(probs, tpe):
            partial = partial_sum(probs, tpe)
            if axes:
                partial = jax.lax.psum(partial, axes)
            return finish(partial)

        in_sh = (
            NamedSharding(mesh, PartitionSpec(spec[0], spec[1])),
            NamedSharding(mesh, PartitionSpec(spec[1])),
        )
        return mesh, lower, NamedSharding(mesh, PartitionSpec()), in_sh

    fwd.def_partition(
        fwd_partition, sharding_rule=lambda *a: ("t e, e -> ", {"reduction_factors": ("t", "e")})
    )

    # Backward: d probs[t, e] = scale * g * tokens_per_expert[e]; tokens stay sharded, E gathered.
    def bwd_for(local_shape):
        def bwd(tpe, gs):
            call = dict(dtype=dtype, shape=local_shape)
            statics = dict(shape=local_shape, dtype=dtype)
            return LOSS.dispatch(implementation, "backward", (LossResiduals(tpe), gs), statics, call)

        return bwd

    bwd = custom_partitioning(bwd_for((t, e)))

    def bwd_partition(mesh, arg_shapes, result_shape):
        del arg_shapes
        t_spec = P.padded_spec(result_shape.sharding.spec, 2)[0]
        local = (t // _shards(mesh, _axes(t_spec)), e)
        in_sh = (NamedSharding(mesh, PartitionSpec(None)), NamedSharding(mesh, PartitionSpec()))
        return mesh, bwd_for(local), NamedSharding(mesh, PartitionSpec(t_spec, None)), in_sh

    bwd.def_partition(bwd_partition, sharding_rule=lambda *a: ("e, -> t e", {}))

    def seq_fold(fn):
        def fold(axis_size, in_batched, *args):
            xs = P.broadcast_batched(axis_size, in_batched, args)
            return jax.lax.map(lambda a: fn(*a), tuple(xs)), True

        return P.batch_folding(fn, fold)

    fwd_call, bwd_call = seq_fold(fwd), seq_fold(bwd)

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
    the global token count: with ``probs`` sharded over tokens the result equals the unsharded loss
    (each shard reduces its block, one all-reduce adds the partial sums).

    Equivalent to::

        T, E = probs.shape
        per_expert = probs.astype(jnp.float32).sum(0)
        loss = (E * coeff / (topk * T * T) * jnp.sum(per_expert * tokens_per_expert)).astype(probs.dtype)

    Args:
      probs: ``[T, E]`` float32, bfloat16 or float16 (typically the aux-loss scores).
      tokens_per_expert: ``[E]`` int or float counts (global); gets no gradient.
      topk: experts per token (static).
      coeff: loss coefficient (static float).
      implementation: None (best available), "native" or "reference".

    Returns:
      Scalar in probs' dtype.
    """
    op = "fused_moe_aux_loss"
    probs = _check_float_2d(op, "probs", probs)
    tpe = _as_array(tokens_per_expert)
    if not (jnp.issubdtype(tpe.dtype, jnp.integer) or jnp.issubdtype(tpe.dtype, jnp.floating)):
        raise TypeError(
            f"te_ops.{op}: tokens_per_expert must be an int or float array, got dtype {tpe.dtype}."
        )
    if tuple(tpe.shape) != (probs.shape[1],):
        raise ValueError(
            f"te_ops.{op}: tokens_per_expert must have shape [E] = ({probs.shape[1]},) to match probs "
            f"{tuple(probs.shape)}, got shape {tuple(tpe.shape)}."
        )
    topk = _check_static_int(op, "topk", topk)
    coeff = _check_static_float(op, "coeff", coeff)
    tpe = jax.lax.stop_gradient(tpe).astype(jnp.float32)
    return _build_loss(topk, coeff, implementation, tuple(probs.shape), jnp.dtype(probs.dtype))(*match_vma(probs, tpe))
