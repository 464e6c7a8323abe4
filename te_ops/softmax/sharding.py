"""Sharding rule, partition specs and vmap fold of the softmax family.

Sharding: the batch, head and query axes may be sharded; the softmax axis (the last one) is
gathered, since every row needs all of its elements. In causal mode the query axis is gathered too:
the kernels read the query position from the local row index. A mask axis that broadcasts (size 1
where x is larger) gets its own factor, so it stays replicated. No collective is needed beyond
gathering the axes above.

vmap: ``custom_partitioning`` has no batching rule, so the vmapped axis is folded into the leading
axes the kernels already handle (the rows of x, and the batch axis of a ``[B, N, Sq, Sk]`` masked
softmax).

Operands: ``n_x_like`` arrays shaped like x (forward: x; backward: y and dy), then the bool mask
``[B|1, N|1, Sq|1, Sk]`` in mode "mask".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from te_ops._core import partitioning as P
from te_ops._core.validation import broadcast_batched


def factors(x_shape: Sequence[int], mask_shape: Sequence[int] | None, mode: str):
    """(factors of x, factors of the mask or None, factors to replicate)."""
    xf = P.factor_names(len(x_shape))
    mf = None
    if mask_shape is not None:
        mf = [xf[i] if mask_shape[i] == x_shape[i] else f"m{i}" for i in range(4)]
    replicate = [xf[-1]] + ([xf[-2]] if mode == "causal" else [])
    return xf, mf, replicate


def rule(mode: str, n_x_like: int, *shapes) -> tuple[str, dict[str, Any]]:
    """Shardy rule: ``d0 d1 ... , [mask] -> d0 d1 ...`` with the softmax axis (and, causal, the
    query axis) replicated."""
    x_shape = shapes[0]
    mask_shape = shapes[n_x_like] if len(shapes) > n_x_like else None
    xf, mf, replicate = factors(x_shape, mask_shape, mode)
    operands = [" ".join(xf)] * n_x_like + ([" ".join(mf)] if mf else [])
    return f"{', '.join(operands)} -> {' '.join(xf)}", {"need_replication_factors": tuple(sorted(set(replicate)))}


def specs(mode: str, n_x_like: int, arg_specs: Sequence[list[Any]], shapes) -> tuple[list[list[Any]], list[Any]]:
    """Keeps x's sharding on the leading axes, gathers the softmax axis (and, causal, the query
    axis); a mask axis follows x where it has x's size and is replicated where it broadcasts."""
    x_shape = shapes[0]
    x_spec = list(arg_specs[0])
    x_spec[-1] = None
    if mode == "causal":
        x_spec[-2] = None
    in_specs = [x_spec] * n_x_like
    if len(shapes) > n_x_like:
        m_shape = shapes[n_x_like]
        in_specs.append([x_spec[i] if m_shape[i] == x_shape[i] else None for i in range(3)] + [None])
    return in_specs, x_spec


def fold(fn: Callable[..., Any], n_x_like: int, has_mask: bool, axis_size: int, in_batched, *args):
    """vmap rule: without a mask the vmapped axis is one more leading axis of x (the kernels see
    rows); with a mask ``[V, B, N, Sq, Sk]`` folds into ``[V*B, N, Sq, Sk]`` and the mask follows
    (tiled over V where it is not vmapped and not broadcast over B)."""
    xs = broadcast_batched(axis_size, in_batched[:n_x_like], args[:n_x_like])
    if not has_mask:
        return fn(*xs), True
    mask, mask_batched = args[n_x_like], in_batched[n_x_like]
    lead = xs[0].shape[:2]  # (V, B)
    folded = [a.reshape(lead[0] * lead[1], *a.shape[2:]) for a in xs]
    if mask_batched:
        mask = jnp.broadcast_to(mask, (*lead, *mask.shape[2:])).reshape(lead[0] * lead[1], *mask.shape[2:])
    elif mask.shape[0] != 1:
        mask = jnp.tile(mask, (axis_size, 1, 1, 1))
    out = fn(*folded, mask)
    return out.reshape(*lead, *out.shape[1:]), True


def sharded(impl: Callable[..., Any], mode: str, n_x_like: int, has_mask: bool) -> Callable[..., Any]:
    """``impl`` with the rule, specs and vmap fold above."""
    part = P.partitioned(
        impl, rule=functools.partial(rule, mode, n_x_like), specs=functools.partial(specs, mode, n_x_like)
    )
    return P.batch_folding(part, functools.partial(fold, part, n_x_like, has_mask))
