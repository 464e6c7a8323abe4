"""Sharding rules, partition specs and vmap folds of fused_attention.

Sharding: the batch and head axes may be sharded (heads as the kv-head factor ``h``, with the query
heads ``(h g)`` for GQA, so a group of query heads stays with its key/value head); sequence and
head-dim axes are replicated. A bias broadcast over batch (or heads) keeps that axis replicated,
so its gradient needs no cross-shard reduction: no collective at all.

Segment positions shard like the segment ids (batch only).

vmap: ``custom_partitioning`` has no batching rule, so the vmapped axis is folded into the batch
axis (axis 0 of every operand, the dropout seeds and segment positions too); a bias broadcast over the batch stays
broadcast, and the bias gradient is summed back over what was broadcast.

Operands, in order: ``q, k, v`` (forward and inference) or ``q, k, v, out, g, lse`` (backward),
then the optional operands present (``OPTIONAL`` order). Stages: "fwd" (out, lse), "infer" (out),
"bwd" (dq, dk, dv[, dbias]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from te_ops._core import partitioning as P

# Optional array operands, in the order every internal function takes them.
OPTIONAL = (
    "bias",
    "q_seqlens",
    "kv_seqlens",
    "q_segment_ids",
    "kv_segment_ids",
    "seed",
    "q_segment_pos",
    "kv_segment_pos",
)


def n_leading(stage: str) -> int:
    """Number of leading (always present) operands of a stage."""
    return 6 if stage == "bwd" else 3


def split_factors(factors: str) -> list[str]:
    """``"b sq (h g) d"`` -> ``["b", "sq", "(h g)", "d"]``."""
    out, depth, cur = [], 0, ""
    for ch in factors:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == " " and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [f for f in out if f]


def factor_strings(shapes, present: Sequence[bool], stage: str):
    """(operand factor strings, result factor strings, replicated factors, extra factor sizes,
    names of the optional operands present)."""
    q_shape, k_shape = shapes[0], shapes[1]
    group = q_shape[2] // k_shape[2]
    qh = "(h g)" if group > 1 else "h"
    extra = {"g": group} if group > 1 else {}
    ops = [f"b sq {qh} d", "b sk h d", "b sk h e"]
    if stage == "bwd":
        ops += [f"b sq {qh} e", f"b sq {qh} e", f"b {qh} sq"]  # out, g, lse
    n0 = len(ops)
    names = [n for n, p in zip(OPTIONAL, present, strict=True) if p]
    replicated = ["sq", "sk", "d", "e"]
    for i, name in enumerate(names):
        shape = shapes[n0 + i]
        if name == "bias":
            bb = "b" if shape[0] == q_shape[0] and shape[0] != 1 else "bb"
            bh = qh if shape[1] == q_shape[2] and shape[1] != 1 else "bh"
            ops.append(f"{bb} {bh} sq sk")
            replicated += [f for f in (bb, bh) if f in ("bb", "bh")]
        elif name in ("q_seqlens", "kv_seqlens"):
            ops.append("b")
        elif name in ("q_segment_ids", "q_segment_pos"):
            ops.append("b sq")
        elif name in ("kv_segment_ids", "kv_segment_pos"):
            ops.append("b sk")
        elif name == "seed":
            ops.append(f"b {qh} r")
            replicated.append("r")
    if stage == "fwd":
        results = [f"b sq {qh} e", f"b {qh} sq"]
    elif stage == "infer":
        results = [f"b sq {qh} e"]
    else:
        results = [f"b sq {qh} d", "b sk h d", "b sk h e"]
        if "bias" in names:
            results.append(ops[n0 + names.index("bias")])
    return ops, results, replicated, extra, names


def bias_blocks(shapes, names: Sequence[str], n0: int, q_shape) -> tuple[bool, bool]:
    """(replicate batch, replicate heads) because a bias broadcasts over them."""
    if "bias" not in names:
        return False, False
    bshape = shapes[n0 + names.index("bias")]
    return bshape[0] == 1 and q_shape[0] != 1, bshape[1] == 1 and q_shape[2] != 1


def rule(present: Sequence[bool], stage: str, *shapes) -> tuple[str, dict[str, Any]]:
    """Shardy rule: ``b`` and ``h`` propagate; sequence, head-dim, broadcast-bias and seed-word
    factors are replicated."""
    ops, results, replicated, extra, _ = factor_strings(shapes, present, stage)
    rule_str = f"{', '.join(ops)} -> {', '.join(results)}"
    # Shardy wants special factors in the order of their indices (first appearance in the rule).
    order = []
    for f in split_factors(rule_str.replace(",", " ").replace("->", " ").replace("(", " ").replace(")", " ")):
        if f not in order:
            order.append(f)
    need = tuple(f for f in order if f in set(replicated))
    return rule_str, {"need_replication_factors": need, **extra}


def specs(present: Sequence[bool], stage: str, arg_specs: Sequence[list[Any]], shapes):
    """Runs with q's batch and head sharding on every operand and result (none where a bias
    broadcasts over that axis), every other axis gathered."""
    ops, results, _, _, names = factor_strings(shapes, present, stage)
    q_spec = arg_specs[0]
    rep_b, rep_h = bias_blocks(shapes, names, n_leading(stage), shapes[0])
    b_ax = None if rep_b else q_spec[0]
    h_ax = None if rep_h else q_spec[2]
    table = {"b": b_ax, "h": h_ax, "(h g)": h_ax}

    def spec_of(factors):
        return [table.get(f) for f in split_factors(factors)]

    out_specs = [spec_of(r) for r in results]
    return [spec_of(o) for o in ops], (out_specs[0] if stage == "infer" else out_specs)


def fold(fn: Callable[..., Any], present: Sequence[bool], stage: str, axis_size: int, in_batched, *args):
    """vmap rule: ``[V, B, ...]`` operands fold into ``[V*B, ...]``; results unfold. A bias
    broadcast over the batch stays broadcast; its gradient is summed over what was broadcast."""
    n_lead = n_leading(stage)
    names = [n for n, p in zip(OPTIONAL, present, strict=True) if p]
    kinds = ["x"] * n_lead + names
    bias_idx = n_lead + names.index("bias") if "bias" in names else None
    vb = axis_size
    batch = args[0].shape[1] if in_batched[0] else args[0].shape[0]
    folded = []
    for kind, a, batched in zip(kinds, args, in_batched, strict=True):
        if kind == "bias" and not batched and a.shape[0] == 1:
            folded.append(a)  # broadcast over the folded batch as it was over the batch
            continue
        if not batched:
            a = jnp.broadcast_to(a, (vb, *a.shape))
        if kind == "bias" and a.shape[1] == 1 and batch != 1:
            a = jnp.broadcast_to(a, (vb, batch, *a.shape[2:]))
        folded.append(a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]))
    outs = fn(*folded)
    single = stage == "infer"
    if single:
        outs = (outs,)
    result, out_batched = [], []
    for i, o in enumerate(outs):
        if stage == "bwd" and i == 3:  # dbias
            bias, b_batched = args[bias_idx], in_batched[bias_idx]
            if not b_batched and bias.shape[0] == 1:
                result.append(o)
                out_batched.append(False)
                continue
            o = o.reshape(vb, o.shape[0] // vb, *o.shape[1:])
            if not b_batched:
                result.append(o.sum(0))
                out_batched.append(False)
                continue
            if bias.shape[1] == 1:
                o = o.sum(1, keepdims=True)
            result.append(o)
            out_batched.append(True)
            continue
        result.append(o.reshape(vb, o.shape[0] // vb, *o.shape[1:]))
        out_batched.append(True)
    if single:
        return result[0], out_batched[0]
    return tuple(result), tuple(out_batched)


def sharded(impl: Callable[..., Any], present: Sequence[bool], stage: str) -> Callable[..., Any]:
    """``impl`` with the rule, specs and vmap fold of ``stage``."""
    part = P.partitioned(
        impl, rule=functools.partial(rule, present, stage), specs=functools.partial(specs, present, stage)
    )
    return P.batch_folding(part, functools.partial(fold, part, present, stage))
