"""CUDA implementation of the MoE router ops (csrc/router): XLA-FFI handlers, graph-safe.

Same signatures and residual layouts as :mod:`te_ops.router.reference`. One warp owns one token
row at a time (persistent warps prefetch their next row): each lane holds E/32 contiguous logits in
registers (E <= 1024, 16-byte loads), the top-k is k rounds of one ``redux.sync`` (sm_80+) on
order-preserving integer keys plus a ballot (the lowest lane wins ties = the smaller expert index),
and the score function, grouped selection, weights, the dense probs and the routing map are
produced in the same pass. The backward of softmax (without pre-softmax) and sigmoid reads the
logits and d probs only where the routing map is set. Design notes: ``csrc/router/router_kernels.cuh``.

Non-finite logits (what the kernel code does; the GPU tests check the parts the op documents):
the selection keys order floats in the IEEE total order (+NaN above +inf, -NaN below -inf, -0 below
+0), as ``lax.top_k`` does on CPU, and exactly ``topk`` experts are chosen per row. Experts of
dropped groups get key 0, below every allowed expert (-inf and NaN included). One known
difference from the reference: with softmax without pre-softmax the weights are computed from
the chosen logits only, so a row whose only NaN is a NEGATIVE-signed NaN that is not chosen gets
finite weights here, where the reference (and the documented semantics) give NaN at every chosen
expert of a row containing a NaN. Positive NaN (``jnp.nan``, and the NaN CUDA arithmetic
produces) ranks first and poisons the row in both. Sigmoid scores pass through ``1 / (1 +
expf(-x))``, whose NaN result is expected to be the GPU's canonical positive NaN (ranked first; the
GPU test ``test_nan_rows`` checks it), and pre-softmax / aux scores reduce over the whole row, so
those modes agree with the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import native as _native
from te_ops.router.reference import LossResiduals, ScoresResiduals, TopkResiduals

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_EXPERTS = 1024  # 32 lanes x 32 register slots
MAX_TOPK = 32
MAX_GROUPS = 32  # one group per lane
MAX_PER_GROUP_TOPK = 16  # topk // group_topk
LOSS_PARTIALS = 512  # fixed number of per-block partial sums of the aux-loss kernel (deterministic)
_SCORE = {"softmax": 0, "sigmoid": 1}


def _poisoning() -> bool:
    # With poisoned outputs the map buffer is filled with an integer sentinel, which bool cannot
    # hold: the kernel then writes a uint8 map (0/1) that is converted to bool here. Otherwise the
    # kernel writes the bool (PRED, one byte) map directly and no conversion pass is needed.
    return bool(getattr(_native._poison, "on", False))


def _map_struct(t: int, e: int, compact: bool):
    if compact:
        return jax.ShapeDtypeStruct((t, (e + 7) // 8), jnp.uint8)
    return jax.ShapeDtypeStruct((t, e), jnp.uint8 if _poisoning() else jnp.bool_)


def _as_bool_map(rmap: jax.Array, compact: bool) -> jax.Array:
    if compact or rmap.dtype == jnp.bool_:
        return rmap
    return rmap != 0


def topk_forward(
    logits,
    expert_bias=None,
    *,
    topk,
    score_function,
    use_pre_softmax,
    num_groups,
    group_topk,
    scaling_factor,
    compact_routing_map,
):
    t, e = logits.shape
    bias = jnp.zeros((1,), jnp.float32) if expert_bias is None else expert_bias.astype(jnp.float32)
    probs, rmap = _native.ffi_call(
        "te_router_topk_fwd",
        [jax.ShapeDtypeStruct((t, e), logits.dtype), _map_struct(t, e, compact_routing_map)],
        logits,
        bias,
        vmap_method="sequential",
        topk=np.int32(topk),
        score_function=np.int32(_SCORE[score_function]),
        use_pre_softmax=np.int32(bool(use_pre_softmax)),
        num_groups=np.int32(num_groups if group_topk is not None else 0),
        group_topk=np.int32(group_topk or 0),
        scaling_factor=np.float32(scaling_factor),
        compact=np.int32(bool(compact_routing_map)),
        has_bias=np.int32(expert_bias is not None),
    )
    rmap = _as_bool_map(rmap, compact_routing_map)
    return (probs, rmap), TopkResiduals(logits, rmap)


def topk_backward(
    res,
    g,
    *,
    topk,
    score_function,
    use_pre_softmax,
    num_groups,
    group_topk,
    scaling_factor,
    compact_routing_map,
):
    del num_groups, group_topk
    logits = res.logits
    return _native.ffi_call(
        "te_router_topk_bwd",
        jax.ShapeDtypeStruct(logits.shape, logits.dtype),
        logits,
        res.routing_map,
        g.astype(logits.dtype),
        vmap_method="sequential",
        topk=np.int32(topk),
        score_function=np.int32(_SCORE[score_function]),
        use_pre_softmax=np.int32(bool(use_pre_softmax)),
        scaling_factor=np.float32(scaling_factor),
        compact=np.int32(bool(compact_routing_map)),
    )


def topk_unsupported_reason(*, dtype, shape, topk, num_groups=None, group_topk=None, **_) -> str | None:
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"native router supports float32, bfloat16 and float16 logits, got {jnp.dtype(dtype)}"
    if len(shape) != 2:
        return f"native router needs logits of rank 2 [T, E], got shape {shape}"
    if shape[1] > MAX_EXPERTS:
        return f"native router supports up to {MAX_EXPERTS} experts, got E={shape[1]}"
    if topk > MAX_TOPK:
        return f"native router supports topk <= {MAX_TOPK}, got {topk}"
    if group_topk is not None:
        if num_groups > MAX_GROUPS:
            return f"native grouped selection supports num_groups <= {MAX_GROUPS}, got {num_groups}"
        if topk // group_topk > MAX_PER_GROUP_TOPK:
            return (
                f"native grouped selection supports topk // group_topk <= {MAX_PER_GROUP_TOPK}, "
                f"got {topk // group_topk}"
            )
    return None


def scores_forward(logits, *, topk, score_function, compact_routing_map):
    t, e = logits.shape
    rmap, s = _native.ffi_call(
        "te_router_scores_fwd",
        [_map_struct(t, e, compact_routing_map), jax.ShapeDtypeStruct((t, e), logits.dtype)],
        logits,
        vmap_method="sequential",
        topk=np.int32(topk),
        score_function=np.int32(_SCORE[score_function]),
        compact=np.int32(bool(compact_routing_map)),
    )
    return (_as_bool_map(rmap, compact_routing_map), s), ScoresResiduals(logits)


def scores_backward(res, g, *, topk, score_function, compact_routing_map):
    del topk, compact_routing_map
    logits = res.logits
    return _native.ffi_call(
        "te_router_scores_bwd",
        jax.ShapeDtypeStruct(logits.shape, logits.dtype),
        logits,
        g.astype(logits.dtype),
        vmap_method="sequential",
        score_function=np.int32(_SCORE[score_function]),
    )


def scores_unsupported_reason(*, dtype, shape, topk, **_) -> str | None:
    return topk_unsupported_reason(dtype=dtype, shape=shape, topk=topk)


def loss_forward(probs, tokens_per_expert):
    tpe = tokens_per_expert.astype(jnp.float32)
    _, partial = _native.ffi_call(
        "te_router_aux_loss_fwd",
        [jax.ShapeDtypeStruct((LOSS_PARTIALS,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32)],
        probs,
        tpe,
        vmap_method="sequential",
    )
    return partial, LossResiduals(tpe)


def loss_backward(res, g_scaled, *, shape, dtype):
    return _native.ffi_call(
        "te_router_aux_loss_bwd",
        jax.ShapeDtypeStruct(tuple(shape), dtype),
        res.tokens_per_expert.astype(jnp.float32),
        jnp.asarray(g_scaled, jnp.float32).reshape(()),
        vmap_method="sequential",
    )


def loss_unsupported_reason(*, dtype, shape, **_) -> str | None:
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"native aux loss supports float32, bfloat16 and float16 probs, got {jnp.dtype(dtype)}"
    if len(shape) != 2:
        return f"native aux loss needs probs of rank 2 [T, E], got shape {shape}"
    if shape[1] < 1:
        return f"native aux loss needs E >= 1 experts, got shape {shape} (the reference returns 0)"
    return None
