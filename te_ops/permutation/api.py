"""Public permutation ops: validation, custom VJP, sharding, vmap and implementation dispatch.

Sharding (Shardy rules + partition callbacks through ``te_ops._core.partitioning.partitioned``):

* token_dispatch / token_combine are **data parallel over tokens**: when the token axis of the
  inputs is sharded, each shard routes its own tokens (``num_out_tokens / shards`` rows each), so
  ``out``, ``permuted_probs`` and ``row_id_map`` are the concatenation of the per-shard results and
  row_id_map values are shard-local rows. ``tokens_per_expert`` and ``pad_offsets`` keep their
  global meaning (computed from the whole routing map). token_combine must see the same token
  sharding as the token_dispatch that made its row_id_map (the natural case inside one
  data-parallel region). With ``align_size`` the per-shard padded sizes would not add up to the
  global N, so padded dispatch gathers the tokens instead (exact, not scaled out).
* sort_chunks_by_index gathers its row axis (chunks are global) and keeps a sharded hidden axis.

vmap: every vmapped call runs the op once per batch element (``lax.map``), because each batch
element routes its own tokens.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import partitioning as P
from te_ops._core import registry
from te_ops._core import triton_bridge as tb
from te_ops._core.partitioning import match_vma
from te_ops.permutation import reference as ref
from te_ops.permutation import triton as tri

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float64))


def _gluon_available() -> str | None:
    why = tb.unavailable_reason(gluon=True)
    if why:
        return why
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None  # the registry reports the missing device
    cc = str(getattr(devices[0], "compute_capability", "0.0"))
    if tuple(int(p) for p in cc.split(".")[:2]) < (9, 0):
        return f"the Gluon kernels are written for Hopper (sm_90+); this device is sm_{cc.replace('.', '')}"
    return None


# ----------------------------------------------------------------------------------------------
# Implementations: stage adapters returning only arrays (row_id_map is the shared residual).
# ----------------------------------------------------------------------------------------------


def _dispatch_fwd(mod, **kw):
    def fwd(x, routing_map, probs, *, num_out_tokens, align_size):
        outs, _ = mod.dispatch_forward(
            x, routing_map, probs, num_out_tokens=num_out_tokens, align_size=align_size, **kw
        )
        return outs[0], outs[1], outs[2]

    return fwd


def _dispatch_bwd(mod, **kw):
    def bwd(row_id_map, g_out, g_pp, *, num_out_tokens, align_size):
        res = ref.DispatchResiduals(row_id_map, row_id_map.shape[0], g_pp is not None)
        return mod.dispatch_backward(
            res, g_out, g_pp, num_out_tokens=num_out_tokens, align_size=align_size, **kw
        )

    return bwd


def _combine_fwd(mod, **kw):
    def fwd(y, row_id_map, merging_probs):
        return mod.combine_forward(y, row_id_map, merging_probs, **kw)[0]

    return fwd


def _combine_bwd(mod, **kw):
    def bwd(row_id_map, g, y, merging_probs, *, num_rows):
        res = ref.CombineResiduals(y, row_id_map, merging_probs, num_rows)
        return mod.combine_backward(res, g, **kw)

    return bwd


def _sort_fwd(mod):
    return lambda x, sizes, idx: mod.sort_forward(x, sizes, idx)[0]


def _sort_bwd(mod):
    return lambda row_id_map, g: mod.sort_backward(ref.SortResiduals(row_id_map), g)


DISPATCH = registry.family("token_dispatch")
COMBINE = registry.family("token_combine")
SORT = registry.family("sort_chunks_by_index")

_triton_available = lambda: tb.unavailable_reason()  # noqa: E731
for _fam, _f, _b in ((DISPATCH, _dispatch_fwd, _dispatch_bwd), (COMBINE, _combine_fwd, _combine_bwd)):
    _fam.register(
        registry.Implementation("triton", _f(tri), _b(tri), tri.unsupported_reason, "cuda", _triton_available)
    )
    _fam.register(
        registry.Implementation(
            "gluon",
            _f(tri, gluon=True),
            _b(tri, gluon=True),
            tri.unsupported_reason,
            "cuda",
            _gluon_available,
        )
    )
    _fam.register(registry.Implementation(registry.REFERENCE, _f(ref), _b(ref)))
SORT.register(
    registry.Implementation(
        "triton", _sort_fwd(tri), _sort_bwd(tri), tri.unsupported_reason, "cuda", _triton_available
    )
)
SORT.register(registry.Implementation(registry.REFERENCE, _sort_fwd(ref), _sort_bwd(ref)))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _arr(x: Any) -> jax.Array:
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def _check_rows(op: str, name: str, x: Any) -> jax.Array:
    x = _arr(x)
    if x.ndim != 2:
        raise ValueError(
            f"te_ops.{op}: {name} must have rank 2 [rows, hidden], got shape {tuple(x.shape)}. "
            f"Reshape it first, e.g. {name}.reshape(-1, {name}.shape[-1])."
        )
    if jnp.dtype(x.dtype) not in _FLOATS:
        raise TypeError(
            f"te_ops.{op}: {name} must be a floating-point array, got dtype {jnp.dtype(x.dtype)}. "
            f"Cast it first, e.g. {name}.astype(jnp.bfloat16)."
        )
    return x


def _check_static_int(op: str, name: str, v: Any, minimum: int, allow_none: bool = False) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (numbers.Integral, np.integer)):
        raise TypeError(
            f"te_ops.{op}: {name} must be a static Python int, got {type(v).__name__} {v!r}. It sets an "
            f"output shape, so it cannot be a traced value; pass e.g. {name}=T * topk."
        )
    if int(v) < minimum:
        raise ValueError(f"te_ops.{op}: {name} must be >= {minimum}, got {v}.")
    return int(v)


def _check_probs(op: str, name: str, p: Any, shape: tuple[int, int]) -> jax.Array | None:
    if p is None:
        return None
    p = _arr(p)
    if tuple(p.shape) != tuple(shape):
        raise ValueError(
            f"te_ops.{op}: {name} must have shape {tuple(shape)} [tokens, experts] like routing_map, got "
            f"{tuple(p.shape)}."
        )
    if jnp.dtype(p.dtype) not in _FLOATS:
        raise TypeError(
            f"te_ops.{op}: {name} must be floating point, got dtype {jnp.dtype(p.dtype)}; cast it with "
            f"{name}.astype(jnp.float32)."
        )
    return p


def _check_int_vector(op: str, name: str, v: Any, length: int | None = None) -> jax.Array:
    v = _arr(v)
    if v.ndim != 1 or not jnp.issubdtype(v.dtype, jnp.integer):
        raise TypeError(
            f"te_ops.{op}: {name} must be a 1-D integer array, got shape {tuple(v.shape)} dtype "
            f"{jnp.dtype(v.dtype)}. Build it with jnp.asarray(..., jnp.int32)."
        )
    if length is not None and v.shape[0] != length:
        raise ValueError(f"te_ops.{op}: {name} must have {length} entries, got {v.shape[0]}.")
    return v.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Sharding rules and vmap
# ----------------------------------------------------------------------------------------------


def _map_fold(fn):
    def fold(axis_size, in_batched, *args):
        present = [a is not None for a in args]
        real = [a for a in args if a is not None]
        flags = [b for a, b in zip(args, in_batched, strict=True) if a is not None]
        xs = P.broadcast_batched(axis_size, flags, real)

        def body(xs):
            it = iter(xs)
            return fn(*[next(it) if p else None for p in present])

        out = jax.lax.map(body, tuple(xs))
        return out, jax.tree.map(lambda _: True, out)

    return fold


def _vmapped(fn):
    return P.batch_folding(fn, _map_fold(fn))


# ----------------------------------------------------------------------------------------------
# token_dispatch
# ----------------------------------------------------------------------------------------------


def _global_counts(routing_map, align_size):
    counts = routing_map.astype(jnp.int32).sum(0, dtype=jnp.int32)
    a = align_size or 1
    padded = (counts + a - 1) // a * a
    pad = padded - counts
    return padded, (jnp.cumsum(pad, dtype=jnp.int32) - pad) if align_size else None


@functools.cache
def _build_dispatch(
    num_out_tokens: int, align_size: int | None, implementation: str | None, has_probs: bool, num_tokens: int
):
    statics_for = lambda t_local: dict(  # noqa: E731
        num_out_tokens=_local_out_tokens(num_out_tokens, t_local, num_tokens), align_size=align_size
    )

    def desc(x, rm, probs, n):
        return dict(
            dtype=x.dtype,
            num_tokens=x.shape[0],
            num_experts=rm.shape[1],
            probs_dtype=None if probs is None else probs.dtype,
            num_rows=n,
        )

    def fwd_impl(x, rm, *probs):
        p = probs[0] if probs else None
        st = statics_for(x.shape[0])
        n = ref.out_rows(st["num_out_tokens"], rm.shape[1], align_size)
        out, pp, row_id_map = DISPATCH.dispatch(implementation, "forward", (x, rm, p), st, desc(x, rm, p, n))
        return (out, pp, row_id_map) if has_probs else (out, row_id_map)

    def bwd_impl(row_id_map, g_out, *g_pp):
        gp = g_pp[0] if g_pp else None
        st = statics_for(row_id_map.shape[0])
        e_ = (row_id_map.shape[1] - 1) // 2
        call = dict(
            dtype=g_out.dtype,
            num_tokens=row_id_map.shape[0],
            num_experts=e_,
            probs_dtype=None if gp is None else gp.dtype,
            num_rows=g_out.shape[0],
        )
        dx, dprobs = DISPATCH.dispatch(implementation, "backward", (row_id_map, g_out, gp), st, call)
        return (dx, dprobs) if has_probs else dx

    def fwd_specs(arg_specs, shapes):
        t_ax = None if align_size else arg_specs[0][0]
        in_specs = [[t_ax, None], [t_ax, None]] + ([[t_ax, None]] if has_probs else [])
        outs = [[t_ax, None]] + ([[t_ax]] if has_probs else []) + [[t_ax, None]]
        return in_specs, outs

    def bwd_specs(arg_specs, shapes):
        t_ax = None if align_size else arg_specs[0][0]
        in_specs = [[t_ax, None], [t_ax, None]] + ([[t_ax]] if has_probs else [])
        outs = [[t_ax, None], [t_ax, None]] if has_probs else [t_ax, None]
        return in_specs, outs

    def fwd_rule(*shapes):
        ops = "t h, t e" + (", t e" if has_probs else "")
        res = "n h" + (", n" if has_probs else "") + ", t r"
        return f"{ops} -> {res}", {}

    def bwd_rule(*shapes):
        ops = "t r, n h" + (", n" if has_probs else "")
        res = "t h" + (", t e" if has_probs else "")
        return f"{ops} -> {res}", {}

    fwd_call = _vmapped(P.partitioned(fwd_impl, rule=fwd_rule, specs=fwd_specs))
    bwd_call = _vmapped(P.partitioned(bwd_impl, rule=bwd_rule, specs=bwd_specs))

    def run(x, rm, probs):
        outs = fwd_call(x, rm, *([probs] if has_probs else []))
        out, pp, row_id_map = outs if has_probs else (outs[0], None, outs[1])
        tpe, pad = _global_counts(rm, align_size)
        return (out, pp, row_id_map, pad, tpe)

    @jax.custom_vjp
    def op(x, rm, probs):
        return run(x, rm, probs)

    def op_fwd(x, rm, probs):
        outs = run(x, rm, probs)
        return outs, outs[2]

    def op_bwd(row_id_map, cts):
        g_out, g_pp = cts[0], cts[1]
        if has_probs:
            dx, dprobs = bwd_call(row_id_map, g_out, g_pp)
            return dx, None, dprobs
        return bwd_call(row_id_map, g_out), None, None

    op.defvjp(op_fwd, op_bwd)
    return op


def _local_out_tokens(num_out_tokens: int, t_local: int, t_global: int) -> int:
    if t_local == t_global:
        return num_out_tokens
    if (num_out_tokens * t_local) % t_global:
        raise ValueError(
            f"te_ops.token_dispatch: with tokens sharded into {t_global // max(t_local, 1)} shards, "
            f"num_out_tokens ({num_out_tokens}) must split evenly over the shards; use a multiple of the "
            "shard count (e.g. T * topk)."
        )
    return num_out_tokens * t_local // t_global


def token_dispatch(
    x: jax.Array,
    routing_map: jax.Array,
    num_out_tokens: int,
    *,
    probs: jax.Array | None = None,
    align_size: int | None = None,
    implementation: str | None = None,
):
    """Permutes token rows into expert-major order (MoE dispatch).

    Output rows hold all tokens routed to expert 0 (ascending token order), then expert 1, ...;
    with ``align_size`` each expert's block is padded with zero rows to a multiple of it. Rows past
    the routed count are zero. The row_id_map layout is documented in
    ``te_ops/permutation/reference.py``.

    Equivalent to (without padding, all pairs fitting in num_out_tokens)::

        t_idx, e_idx = jnp.nonzero(routing_map.T)[::-1]          # expert-major, tokens ascending
        out = jnp.zeros((num_out_tokens, H), x.dtype).at[:len(t_idx)].set(x[t_idx])
        permuted_probs = ... probs[t_idx, e_idx] ...
        tokens_per_expert = routing_map.sum(0)

    Args:
      x: ``[T, H]`` float rows.
      routing_map: ``[T, E]`` bool (True = token routed to expert).
      num_out_tokens: static int, normally ``T * topk``.
      probs: optional ``[T, E]`` routing probabilities, permuted alongside.
      align_size: optional static int A: pad each expert block to a multiple of A.
      implementation: None (best available), "triton", "gluon" or "reference".

    Returns:
      ``(out[N, H], permuted_probs[N] or None, row_id_map int32[T, 2E+1], pad_offsets int32[E] or None,
      tokens_per_expert int32[E])`` with N = num_out_tokens, or
      ``((num_out_tokens + E * (A - 1)) // A) * A`` with padding.
    """
    op = "token_dispatch"
    x = _check_rows(op, "x", x)
    routing_map = _arr(routing_map)
    if routing_map.ndim != 2 or routing_map.shape[0] != x.shape[0]:
        raise ValueError(
            f"te_ops.{op}: routing_map must have shape [T, E] with T = x.shape[0] = {x.shape[0]}, got "
            f"{tuple(routing_map.shape)}."
        )
    if routing_map.dtype != jnp.bool_:
        raise TypeError(
            f"te_ops.{op}: routing_map must be bool, got dtype {routing_map.dtype}; convert it with "
            "routing_map != 0."
        )
    num_out_tokens = _check_static_int(op, "num_out_tokens", num_out_tokens, 0)
    align_size = _check_static_int(op, "align_size", align_size, 1, allow_none=True)
    probs = _check_probs(op, "probs", probs, routing_map.shape)
    return _build_dispatch(num_out_tokens, align_size, implementation, probs is not None, x.shape[0])(
        *match_vma(x, routing_map, probs)
    )


# ----------------------------------------------------------------------------------------------
# token_combine
# ----------------------------------------------------------------------------------------------


@functools.cache
def _build_combine(implementation: str | None, has_probs: bool, num_rows: int, num_tokens: int):
    def fwd_impl(y, row_id_map, *mp):
        m = mp[0] if mp else None
        call = dict(
            dtype=y.dtype,
            num_tokens=row_id_map.shape[0],
            num_experts=(row_id_map.shape[1] - 1) // 2,
            probs_dtype=None if m is None else m.dtype,
            num_rows=y.shape[0],
        )
        return COMBINE.dispatch(implementation, "forward", (y, row_id_map, m), {}, call)

    def bwd_impl(row_id_map, g, *ymp):
        y, m = (ymp[0], ymp[1]) if ymp else (None, None)
        # rows of y in this shard: N scaled like the tokens
        n = num_rows * row_id_map.shape[0] // max(num_tokens, 1)
        call = dict(
            dtype=g.dtype,
            num_tokens=row_id_map.shape[0],
            num_experts=(row_id_map.shape[1] - 1) // 2,
            probs_dtype=None if m is None else m.dtype,
            num_rows=n,
        )
        dy, dmp = COMBINE.dispatch(implementation, "backward", (row_id_map, g, y, m), dict(num_rows=n), call)
        return (dy, dmp) if has_probs else dy

    def fwd_specs(arg_specs, shapes):
        t_ax = arg_specs[1][0]
        ins = [[t_ax, None], [t_ax, None]] + ([[t_ax, None]] if has_probs else [])
        return ins, [t_ax, None]

    def bwd_specs(arg_specs, shapes):
        t_ax = arg_specs[0][0]
        ins = [[t_ax, None], [t_ax, None]] + ([[t_ax, None], [t_ax, None]] if has_probs else [])
        outs = [[t_ax, None], [t_ax, None]] if has_probs else [t_ax, None]
        return ins, outs

    def fwd_rule(*shapes):
        return "n h, t r" + (", t e" if has_probs else "") + " -> t h", {}

    def bwd_rule(*shapes):
        ops = "t r, t h" + (", n h, t e" if has_probs else "")
        res = "n h" + (", t e" if has_probs else "")
        return f"{ops} -> {res}", {}

    fwd_call = _vmapped(P.partitioned(fwd_impl, rule=fwd_rule, specs=fwd_specs))
    bwd_call = _vmapped(P.partitioned(bwd_impl, rule=bwd_rule, specs=bwd_specs))

    @jax.custom_vjp
    def op(y, row_id_map, mp):
        return fwd_call(y, row_id_map, *([mp] if has_probs else []))

    def op_fwd(y, row_id_map, mp):
        out = fwd_call(y, row_id_map, *([mp] if has_probs else []))
        return out, ((row_id_map, y, mp) if has_probs else (row_id_map,))

    def op_bwd(res, g):
        if has_probs:
            row_id_map, y, mp = res
            dy, dmp = bwd_call(row_id_map, g, y, mp)
            return dy, None, dmp
        return bwd_call(res[0], g), None, None

    op.defvjp(op_fwd, op_bwd)
    return op


def token_combine(
    y: jax.Array,
    row_id_map: jax.Array,
    *,
    merging_probs: jax.Array | None = None,
    pad_offsets: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Inverse of :func:`token_dispatch`: sums each token's expert rows, weighted by merging_probs.

    Equivalent to::

        out[t] = sum over t's rows (t, e) of y[row].astype(f32) * merging_probs[t, e]   # fp32, then y.dtype

    Args:
      y: ``[N, H]`` expert outputs in token_dispatch's row order.
      row_id_map: the int32 ``[T, 2E+1]`` map returned by token_dispatch.
      merging_probs: optional ``[T, E]`` weights (plain sum without them).
      pad_offsets: accepted for TransformerEngine compatibility; row_id_map already holds padded
        rows, so it does not change the result.
      implementation: None (best available), "triton", "gluon" or "reference".

    Returns:
      ``[T, H]`` in y's dtype.
    """
    op = "token_combine"
    y = _check_rows(op, "y", y)
    row_id_map = _arr(row_id_map)
    if row_id_map.ndim != 2 or row_id_map.dtype != jnp.int32 or row_id_map.shape[1] % 2 != 1:
        raise ValueError(
            f"te_ops.{op}: row_id_map must be the int32 [T, 2E+1] map from token_dispatch, got shape "
            f"{tuple(row_id_map.shape)} dtype {row_id_map.dtype}."
        )
    e_ = (row_id_map.shape[1] - 1) // 2
    merging_probs = _check_probs(op, "merging_probs", merging_probs, (row_id_map.shape[0], e_))
    if pad_offsets is not None:
        _check_int_vector(op, "pad_offsets", pad_offsets, e_)
    return _build_combine(implementation, merging_probs is not None, y.shape[0], row_id_map.shape[0])(
        *match_vma(y, row_id_map, merging_probs)
    )


# ----------------------------------------------------------------------------------------------
# sort_chunks_by_index
# ----------------------------------------------------------------------------------------------


@functools.cache
def _build_sort(implementation: str | None):
    def fwd_impl(x, sizes, idx):
        return SORT.dispatch(
            implementation, "forward", (x, sizes, idx), {}, dict(dtype=x.dtype, num_rows=x.shape[0])
        )

    def bwd_impl(row_id_map, g):
        return SORT.dispatch(
            implementation, "backward", (row_id_map, g), {}, dict(dtype=g.dtype, num_rows=g.shape[0])
        )

    def fwd_specs(arg_specs, shapes):
        h_ax = arg_specs[0][1]
        return [[None, h_ax], [None], [None]], [[None, h_ax], [None]]

    def bwd_specs(arg_specs, shapes):
        h_ax = arg_specs[1][1]
        return [[None], [None, h_ax]], [None, h_ax]

    fwd_call = _vmapped(
        P.partitioned(
            fwd_impl,
            rule=lambda *s: ("n h, s, s -> n h, n", {"need_replication_factors": ("n",)}),
            specs=fwd_specs,
        )
    )
    bwd_call = _vmapped(
        P.partitioned(
            bwd_impl, rule=lambda *s: ("n, n h -> n h", {"need_replication_factors": ("n",)}), specs=bwd_specs
        )
    )

    @jax.custom_vjp
    def op(x, sizes, idx):
        return fwd_call(x, sizes, idx)

    def op_fwd(x, sizes, idx):
        out, row_id_map = fwd_call(x, sizes, idx)
        return (out, row_id_map), row_id_map

    def op_bwd(row_id_map, cts):
        return bwd_call(row_id_map, cts[0]), None, None

    op.defvjp(op_fwd, op_bwd)
    return op


def sort_chunks_by_index(
    x: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array, *, implementation: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Reorders S consecutive chunks of rows (sizes ``split_sizes``) into the order ``sorted_indices``.

    Rows past ``sum(split_sizes)`` stay where they are. ``sorted_indices`` must be a permutation of
    ``range(S)``; negative sizes count as 0 and chunks are clipped at N rows.

    Equivalent to::

        chunks = jnp.split(x[:total], np.cumsum(split_sizes)[:-1])
        out = jnp.concatenate([chunks[i] for i in sorted_indices] + [x[total:]])

    Returns:
      ``(out[N, H], row_id_map int32[N])`` with ``out[row_id_map[i]] = x[i]``.
    """
    op = "sort_chunks_by_index"
    x = _check_rows(op, "x", x)
    split_sizes = _check_int_vector(op, "split_sizes", split_sizes)
    sorted_indices = _check_int_vector(op, "sorted_indices", sorted_indices, split_sizes.shape[0])
    return _build_sort(implementation)(*match_vma(x, split_sizes, sorted_indices))
