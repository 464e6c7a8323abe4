"""Sharding rules of grouped_dense (used through ``te_ops._core.partitioning.partitioned``).

Operands ``x[m k], kernels[g k n], group_sizes[g]`` (and ``bias[g n]``); forward ``-> y[m n]``,
backward ``(x, kernels, group_sizes, dy[m n]) -> dx[m k], dkernels[g k n], dbias[g n]``.

* **Expert parallel**: the expert axis G of ``kernels`` (and ``bias``, ``group_sizes``) and the rows
  of ``x`` sharded over the *same* mesh axis. Contract: each shard's block of rows holds exactly the
  rows of that shard's local experts, in expert order, followed by its own zero tail (what an
  all-to-all token dispatch produces); ``group_sizes`` are the local sizes (each shard's sizes sum to
  at most its row count). Every shard runs its local grouped GEMM: no collective in the forward or
  the backward. G sharded while x's rows are not (FSDP-style weight sharding) is not expert
  parallel: the kernels are gathered and the op keeps its unsharded meaning; row sharding of ``x``
  without expert sharding is gathered too (group boundaries are global then).
* **Tensor parallel**: the N axis of ``kernels``/``bias`` sharded: each shard computes its N slice of
  the output (forward: no collective); in the backward each shard's dx is a partial sum over its N
  slice, all-reduced once (:func:`backward_plan`).
* K is always gathered (a contraction; sharding it would need a reduction in the forward).

vmap: each batch element has its own group sizes, so the vmapped axis is looped over
(``te_ops._core.validation.sequential_fold``); folding the elements into one call would need a copy
of the kernels per element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from te_ops._core.partitioning import ShardContext, ShardPlan


def expert_parallel_axis(x_spec: Sequence[Any], kernels_spec: Sequence[Any]) -> Any:
    """The expert-parallel mesh axis: G sharded *and* x's rows sharded on the same axis (the caller's
    sign that each shard holds its local experts' rows). G sharded alone (e.g. FSDP-style weight
    sharding) is gathered instead, so the result keeps the unsharded meaning."""
    return kernels_spec[0] if kernels_spec[0] is not None and x_spec[0] == kernels_spec[0] else None


def parallel_axes(x_spec: Sequence[Any], kernels_spec: Sequence[Any]) -> tuple[Any, Any]:
    """(expert-parallel spec entry, tensor-parallel spec entry); a mesh axis used for both stays on
    the experts."""
    ep, tp = expert_parallel_axis(x_spec, kernels_spec), kernels_spec[2]
    if tp is not None and tp == ep:
        tp = None
    return ep, tp


def forward_rule(*shapes):
    """Shardy rule of the forward ``(x, kernels, group_sizes[, bias]) -> y``."""
    ops = ["m k", "g k n", "g"] + (["g n"] if len(shapes) == 4 else [])
    return f"{', '.join(ops)} -> m n", {"need_replication_factors": ("k",)}


def forward_specs(arg_specs, shapes):
    """Operand and result specs of the forward (per shard: the op itself, no collective)."""
    ep, tp = parallel_axes(arg_specs[0], arg_specs[1])
    in_specs = [[ep, None], [ep, None, tp], [ep]] + ([[ep, tp]] if len(shapes) == 4 else [])
    return in_specs, [ep, tp]


def backward_rule(*shapes):
    """Shardy rule of the backward ``(x, kernels, group_sizes, dy) -> (dx, dkernels, dbias)``."""
    del shapes
    return "m k, g k n, g, m n -> m k, g k n, g n", {"need_replication_factors": ("k",)}


def dx_summed_over(impl: Callable[..., Any], tp: Any) -> Callable[..., Any]:
    """The per-shard backward with N sharded over ``tp``: ``impl``'s dx is a partial sum over the
    local N slice, all-reduced (in float32) over ``tp``."""

    def per_shard(*args):
        dx, dk, db = impl(*args)
        dx = jax.lax.psum(dx.astype(jnp.float32), tp).astype(dx.dtype)
        return dx, dk, db

    return per_shard


def backward_plan(ctx: ShardContext, *, impl: Callable[..., Any]) -> ShardPlan:
    """Specs and per-shard function of the backward (``impl``, plus the dx reduction when N is
    sharded)."""
    ep, tp = parallel_axes(ctx.arg_specs[0], ctx.arg_specs[1])
    in_specs = [[ep, None], [ep, None, tp], [ep], [ep, tp]]
    out_specs = [[ep, None], [ep, None, tp], [ep, tp]]
    return ShardPlan(in_specs, out_specs, dx_summed_over(impl, tp) if tp is not None else None)
