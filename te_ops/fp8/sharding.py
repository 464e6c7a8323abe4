"""Sharding rules of the FP8 kernels (used through ``te_ops._core.partitioning.partitioned``).

The reference path is plain jnp, which XLA partitions itself (an amax over a sharded tensor becomes
a local max and one all-reduce(max)). The Triton kernels are custom calls that XLA would otherwise
run on gathered operands, so each gets a rule here. Every wrapper takes the *local* function (the
kernel launch on one shard) as an argument, so the CPU tests drive the same partitioning code with
reference functions in place of the kernels.

* **amax** (``x -> max|x|``): each shard's max, then one ``pmax`` over exactly the mesh axes x is
  sharded on. With ``batched`` (one amax per slice of the leading axis, e.g. per expert) the leading
  axis stays sharded and only the other axes are reduced.
* **per-tensor cast** (``x, scale -> fp8(x * scale)[, amax], scale_inv``): elementwise, any sharding
  of x; the scale is replicated (it was computed from a global amax), the optional amax of x is
  ``pmax``-ed like above, and scale_inv is computed from the replicated scale on every shard.
* **block quantize** (``x[..., R, C] -> q, scale_inv[..., R/br, C/bc]``) and **dual quantize**: no
  collective when every shard holds whole blocks. The rule states the block structure as compound
  factors (``(rb ri)``: block index times row in the block); a mesh axis stays on R (or C) only if
  it divides the number of blocks, and an axis that is not a multiple of its block is gathered.
* **block-scaled GEMM** (``a[M, K] x b_t[N, K] -> y[M, N]``): M (data parallel) and N (column
  parallel, whole 128-row weight blocks per shard) need no collective; K sharded (row parallel,
  whole 128-blocks per shard) computes float32 partial sums on every shard, then ONE ``psum`` and
  the cast to the output dtype (the answer equals the unsharded one up to summation order).
* **grouped block-scaled GEMM** (``a[M, K] x b_t[G, N, K], group_sizes[G] -> y[M, N]``): N
  sharded runs each shard's column slice (no collective); K sharded sums float32 partials with one
  ``psum``; expert parallel (G and M on the same mesh axis, grouped_dense's contract: each shard's
  rows are its local experts' rows) runs each shard's local experts; M sharded without G is
  gathered (group boundaries are global then).
* **grouped weight gradient** (``x^T[K, M], dy^T[N, M], group_sizes -> dW[G, K, N]``): K and N
  sharded need no collective, expert parallel neither; the reduction axis M is gathered otherwise.

A mesh axis used by two factors of one operand is kept on the first and dropped from the others.

vmap: ``custom_partitioning`` has no batching rule; each wrapper runs its local function under
``jax.vmap`` (the Triton bridge loops over the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from te_ops._core.partitioning import ShardContext, ShardPlan, batch_folding, factor_names, partitioned
from te_ops._core.validation import mesh_axes, mesh_size, spec_entry

F32 = jnp.float32


def _vmap_fold(local: Callable[..., Any]) -> Callable[..., Any]:
    def fold(axis_size, in_batched, *args):
        in_axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(local, in_axes=in_axes, axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return fold


def _wrap(local: Callable[..., Any], rule, plan, rule_needs_mesh: bool = False) -> Callable[..., Any]:
    part = partitioned(local, rule=rule, plan=plan, rule_needs_mesh=rule_needs_mesh)
    return batch_folding(part, _vmap_fold(local))


def _spec_axes(spec: Sequence[Any]) -> tuple[str, ...]:
    return tuple(a for e in spec for a in mesh_axes(e))


def _keep(entry: Any, n_units: int, mesh: Any, used: set[str]) -> tuple[str, ...]:
    """The mesh axes of ``entry`` that may shard an axis of ``n_units`` whole units (blocks): not
    used by an earlier factor, and their device count divides ``n_units``."""
    axes = tuple(a for a in mesh_axes(entry) if a not in used)
    if not axes or n_units % mesh_size(mesh, axes) != 0:
        return ()
    used.update(axes)
    return axes


def _dedup(spec: Sequence[Any]) -> list[Any]:
    """``spec`` with a mesh axis kept only on the first entry that uses it."""
    used: set[str] = set()
    out = []
    for e in spec:
        ax = tuple(a for a in mesh_axes(e) if a not in used)
        used.update(ax)
        out.append(spec_entry(ax))
    return out


# ----------------------------------------------------------------------------------------------
# amax
# ----------------------------------------------------------------------------------------------


def amax(local: Callable[[jax.Array], jax.Array], *, batched: bool = False) -> Callable[[jax.Array], jax.Array]:
    """``local(x) -> float32 []`` (or ``[B]`` per slice of axis 0 with ``batched``) made global."""

    def rule(shape):
        f = factor_names(len(shape))
        if batched:
            return f"{' '.join(f)} -> {f[0]}", {"reduction_factors": tuple(f[1:])}
        return f"{' '.join(f)} -> ", {"reduction_factors": tuple(f)}

    def plan(ctx: ShardContext) -> ShardPlan:
        spec = _dedup(ctx.arg_specs[0])
        red = _spec_axes(spec[1:] if batched else spec)

        def per_shard(x):
            a = local(x)
            return jax.lax.pmax(a, red) if red else a

        return ShardPlan([spec], [spec[0]] if batched else [], per_shard)

    return _wrap(local, rule, plan)


# ----------------------------------------------------------------------------------------------
# per-tensor cast
# ----------------------------------------------------------------------------------------------


def tensor_cast(local: Callable[..., tuple], *, with_amax: bool, batched: bool = False) -> Callable[..., tuple]:
    """``local(x, scale) -> (q, [amax,] scale_inv)``: elementwise over x; the amax of x (when
    returned) is reduced over x's sharded axes. ``batched``: scale, amax and scale_inv are [B], one
    per slice of x's leading axis."""

    def rule(x_shape, s_shape):
        f = factor_names(len(x_shape))
        xs = " ".join(f)
        sv = f[0] if batched else ""
        outs = [xs] + ([sv] if with_amax else []) + [sv]
        return f"{xs}, {sv} -> {', '.join(outs)}", {}

    def plan(ctx: ShardContext) -> ShardPlan:
        spec = _dedup(ctx.arg_specs[0])
        lead = spec[0] if batched else None
        vec = [lead] if batched else []
        red = _spec_axes(spec[1:] if batched else spec)

        def per_shard(x, s):
            outs = list(local(x, s))
            if with_amax and red:
                outs[1] = jax.lax.pmax(outs[1], red)
            return tuple(outs)

        outs = [spec] + ([vec] if with_amax else []) + [vec]
        return ShardPlan([spec, vec], outs, per_shard)

    return _wrap(local, rule, plan)


# ----------------------------------------------------------------------------------------------
# block quantize
# ----------------------------------------------------------------------------------------------


def _block_dims(size: int, block: int, name: str, sizes: dict, need_rep: list, mesh: Any) -> tuple[str, str]:
    """(token of the data axis, token of the scale axis) of one axis tiled by ``block``.

    The rule states "R is R/b blocks of b rows" as a compound factor only where every mesh axis
    divides the block count: otherwise Shardy may split a mesh axis into sub-axes across the two
    parts, a sharding that custom_partitioning cannot express. Elsewhere the scale axis is its own
    factor, and the partition plan (not the rule) keeps data and scales aligned.
    """
    if block == 1:
        return name, name
    if size % block == 0 and all((size // block) % int(n) == 0 for n in dict(mesh.shape).values()):
        sizes[f"{name}i"] = block
        return f"({name}b {name}i)", f"{name}b"
    if size % block == 0:
        return name, f"{name}b"
    need_rep += [name, f"{name}b"]
    return name, f"{name}b"


def _block_axes(spec_entry_: Any, size: int, block: int, mesh: Any, used: set[str]) -> tuple[str, ...]:
    if size % block != 0:
        return ()
    return _keep(spec_entry_, size // block, mesh, used)


def block_quantize(local: Callable[[jax.Array], tuple], block: tuple[int, int]) -> Callable[[jax.Array], tuple]:
    """``local(x[..., R, C]) -> (q, scale_inv[..., cdiv(R, br), cdiv(C, bc)])``."""
    br, bc = block

    def rule(shape, mesh):
        lead = factor_names(len(shape) - 2, "b")
        sizes: dict = {}
        need: list = []
        r, rs = _block_dims(shape[-2], br, "r", sizes, need, mesh)
        c, cs = _block_dims(shape[-1], bc, "c", sizes, need, mesh)
        x = " ".join(lead + [r, c])
        s = " ".join(lead + [rs, cs])
        return f"{x} -> {x}, {s}", {"need_replication_factors": tuple(need), **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        shape, spec = ctx.arg_shapes[0], ctx.arg_specs[0]
        used: set[str] = set()
        lead = [spec_entry(_keep(e, d, ctx.mesh, used)) for e, d in zip(spec[:-2], shape[:-2], strict=True)]
        r = spec_entry(_block_axes(spec[-2], shape[-2], br, ctx.mesh, used))
        c = spec_entry(_block_axes(spec[-1], shape[-1], bc, ctx.mesh, used))
        s = lead + [r, c]
        return ShardPlan([s], [s, s], None)

    return _wrap(local, rule, plan, True)


def _tile_entries(ctx: ShardContext, block: int) -> tuple[Any, Any]:
    """Spec entries of a 2-D tensor tiled by ``block`` both ways (the first argument): its mesh axes
    kept where each shard holds whole blocks."""
    (rr, cc), spec = ctx.arg_shapes[0], ctx.arg_specs[0]
    used: set[str] = set()
    r = spec_entry(_block_axes(spec[0], rr, block, ctx.mesh, used))
    return r, spec_entry(_block_axes(spec[1], cc, block, ctx.mesh, used))


def dual_quantize(
    local: Callable[[jax.Array], tuple], block: int, t_square: bool = False
) -> Callable[[jax.Array], tuple]:
    """``local(x[R, C]) -> (q[R, C], s[R, C/b], qt[C, R], st[C, R/b])`` (1 x b tiles of x and x^T);
    with ``t_square``, ``st[C/b, R/b]`` (b x b blocks of x^T)."""

    def rule(shape, mesh):
        sizes: dict = {}
        need: list = []
        r, rs = _block_dims(shape[0], block, "r", sizes, need, mesh)
        c, cs = _block_dims(shape[1], block, "c", sizes, need, mesh)
        st = f"{cs} {rs}" if t_square else f"{c} {rs}"
        return f"{r} {c} -> {r} {c}, {r} {cs}, {c} {r}, {st}", {"need_replication_factors": tuple(need), **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        r, c = _tile_entries(ctx, block)
        return ShardPlan([[r, c]], [[r, c], [r, c], [c, r], [c, r]], None)

    return _wrap(local, rule, plan, True)


def requantize_t(local: Callable[..., tuple], block: int) -> Callable[..., tuple]:
    """``local(q[R, C], s[R, C/b]) -> (qt[C, R], st[C, R/b])``: FP8 1 x b row tiles dequantized and
    quantized again as 1 x b tiles of the transpose (b x 1 column tiles); no collective when every
    shard holds whole b x b tiles."""

    def rule(shape, s_shape, mesh):
        sizes: dict = {}
        need: list = []
        r, rs = _block_dims(shape[0], block, "r", sizes, need, mesh)
        c, cs = _block_dims(shape[1], block, "c", sizes, need, mesh)
        return f"{r} {c}, {r} {cs} -> {c} {r}, {c} {rs}", {"need_replication_factors": tuple(need), **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        r, c = _tile_entries(ctx, block)
        return ShardPlan([[r, c], [r, c]], [[c, r], [c, r]], None)

    return _wrap(local, rule, plan, True)


def _row_entry(ctx: ShardContext, block: int) -> Any:
    """The spec entry of the first argument's rows (whole blocks per shard), for the FFN kernels."""
    return spec_entry(_block_axes(ctx.arg_specs[0][0], ctx.arg_shapes[0][0], block, ctx.mesh, set()))


def ffn_act_quantize(local: Callable[..., tuple], block: int) -> Callable[..., tuple]:
    """``local(h[R, W]) -> (q[R, F], s[R, F/b], qt[F, R], st[F, R/b])`` (the activation of each row,
    gated: of its two halves, then dual_quantize's outputs): rows shard in whole blocks, columns are
    gathered (a gated row's two halves belong together)."""

    def rule(shape, mesh):
        sizes: dict = {}
        need: list = ["w", "f", "fs"]
        r, rs = _block_dims(shape[0], block, "r", sizes, need, mesh)
        return f"{r} w -> {r} f, {r} fs, f {r}, f {rs}", {"need_replication_factors": tuple(need), **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        r = _row_entry(ctx, block)
        return ShardPlan([[r, None]], [[r, None], [r, None], [None, r], [None, r]], None)

    return _wrap(local, rule, plan, True)


def ffn_dact_quantize(local: Callable[..., tuple], block: int) -> Callable[..., tuple]:
    """``local(da[R, F], h[R, W]) -> (q[R, W], s[R, W/b], qt[W, R], st[W/b, R/b])`` (the activation's
    backward, then 1 x b tiles and b x b blocks of the transpose): rows shard in whole blocks,
    columns are gathered."""

    def rule(shape, h_shape, mesh):
        sizes: dict = {}
        need: list = ["f", "w", "ws"]
        r, rs = _block_dims(shape[0], block, "r", sizes, need, mesh)
        outs = f"{r} w, {r} ws, w {r}, ws {rs}"
        return f"{r} f, {r} w -> {outs}", {"need_replication_factors": tuple(need), **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        r = _row_entry(ctx, block)
        return ShardPlan([[r, None], [r, None]], [[r, None], [r, None], [None, r], [None, r]], None)

    return _wrap(local, rule, plan, True)


def dact_dbias_quantize(local: Callable[..., tuple], block: int) -> Callable[..., tuple]:
    """``local(dy[R, C], z[R, C]) -> (q[R, C], s[R, C/b], qt[C, R], st[C/b, R/b], dbp[R/b, C])``:
    elementwise over whole b x b tiles (the per-row-block dbias partials shard like the rows; their
    sum over row blocks, outside, is where a row-sharded dbias gets its one all-reduce)."""

    def rule(shape, z_shape, mesh):
        sizes: dict = {}
        need: list = []
        r, rs = _block_dims(shape[0], block, "r", sizes, need, mesh)
        c, cs = _block_dims(shape[1], block, "c", sizes, need, mesh)
        outs = f"{r} {c}, {r} {cs}, {c} {r}, {cs} {rs}, {rs} {c}"
        return f"{r} {c}, {r} {c} -> {outs}", {"need_replication_factors": tuple(need), **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        r, c = _tile_entries(ctx, block)
        return ShardPlan([[r, c], [r, c]], [[r, c], [r, c], [c, r], [c, r], [r, c]], None)

    return _wrap(local, rule, plan, True)


# ----------------------------------------------------------------------------------------------
# block-scaled GEMMs
# ----------------------------------------------------------------------------------------------

BK = BN = 128  # the K and N extents of one weight block


def block_scaled_gemm(local: Callable[..., jax.Array], out_dtype: Any, *, has_bias: bool = False) -> Callable:
    """``local(a[M, K], sa[M, Kb], b_t[N, K], sb[Nb, Kb][, bias[N]], dtype=...) -> y[M, N]``. Row
    parallel adds the bias once, after the reduction."""

    def rule(a_shape, sa_shape, b_shape, sb_shape, *bias_shape, mesh):
        sizes: dict = {}
        need: list = []
        k, kb = _block_dims(a_shape[1], BK, "k", sizes, need, mesh)
        n, nb = _block_dims(b_shape[0], BN, "n", sizes, need, mesh)
        red = tuple(f for f in (("k", "kb") if k == "k" else ("kb",)) if f not in need)
        bias = f", {n}" if bias_shape else ""
        rule_ = f"m {k}, m {kb}, {n} {k}, {nb} {kb}{bias} -> m {n}"
        return rule_, {"need_replication_factors": tuple(need), "reduction_factors": red, **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        (m, k), (n, _) = ctx.arg_shapes[0], ctx.arg_shapes[2]
        a_spec, b_spec = ctx.arg_specs[0], ctx.arg_specs[2]
        used: set[str] = set()
        k_axes = _block_axes(a_spec[1], k, BK, ctx.mesh, used)
        m_axes = _keep(a_spec[0], m, ctx.mesh, used)
        n_axes = _block_axes(b_spec[0], n, BN, ctx.mesh, used)
        ek, em, en = spec_entry(k_axes), spec_entry(m_axes), spec_entry(n_axes)
        in_specs = [[em, ek], [em, ek], [en, ek], [en, ek]] + ([[en]] if has_bias else [])

        def row_parallel(a, sa, b, sb, *bias):
            z = jax.lax.psum(local(a, sa, b, sb, dtype=F32), k_axes)
            return (z + bias[0] if bias else z).astype(out_dtype)

        per_shard = row_parallel if k_axes else (lambda *args: local(*args, dtype=out_dtype))
        return ShardPlan(in_specs, [em, en], per_shard)

    return _wrap(lambda *args: local(*args, dtype=out_dtype), rule, plan, True)


def grouped_block_scaled_gemm(local: Callable[..., jax.Array], out_dtype: Any) -> Callable[..., jax.Array]:
    """``local(a[M, K], sa[M, Kb], b_t[G, N, K], sb[G, Nb, Kb], group_sizes[G], out_dtype) -> y[M, N]``.

    Expert parallel (M and G on one mesh axis) and N sharded need no collective; K sharded (whole
    128-blocks, e.g. the dx GEMM of a column-parallel expert layer, whose reduction runs over N)
    sums float32 partials with one ``psum``."""

    def rule(a_shape, sa_shape, b_shape, sb_shape, gs_shape, mesh):
        sizes: dict = {}
        need: list = []
        k, kb = _block_dims(a_shape[1], BK, "k", sizes, need, mesh)
        n, nb = _block_dims(b_shape[1], BN, "n", sizes, need, mesh)
        red = tuple(f for f in (("k", "kb") if k == "k" else ("kb",)) if f not in need)
        rule_ = f"m {k}, m {kb}, g {n} {k}, g {nb} {kb}, g -> m {n}"
        return rule_, {"need_replication_factors": tuple(need), "reduction_factors": red, **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        (m, k), (g, n, _) = ctx.arg_shapes[0], ctx.arg_shapes[2]
        a_spec, b_spec = ctx.arg_specs[0], ctx.arg_specs[2]
        used: set[str] = set()
        ep = ()
        if a_spec[0] is not None and a_spec[0] == b_spec[0]:  # expert parallel (grouped_dense's contract)
            ep = _keep(b_spec[0], g, ctx.mesh, used)
            if ep and m % mesh_size(ctx.mesh, ep) != 0:
                used.difference_update(ep)
                ep = ()
        k_axes = _block_axes(a_spec[1] if a_spec[1] is not None else b_spec[2], k, BK, ctx.mesh, used)
        n_axes = _block_axes(b_spec[1], n, BN, ctx.mesh, used)
        e, ek, en = spec_entry(ep), spec_entry(k_axes), spec_entry(n_axes)
        in_specs = [[e, ek], [e, ek], [e, en, ek], [e, en, ek], [e]]

        def row_parallel(a, sa, b, sb, gs):
            return jax.lax.psum(local(a, sa, b, sb, gs, F32), k_axes).astype(out_dtype)

        per_shard = row_parallel if k_axes else (lambda a, sa, b, sb, gs: local(a, sa, b, sb, gs, out_dtype))
        return ShardPlan(in_specs, [e, en], per_shard)

    return _wrap(lambda a, sa, b, sb, gs: local(a, sa, b, sb, gs, out_dtype), rule, plan, True)


def grouped_block_scaled_wgrad(local: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``local(at[K, M], sat[K, Mb], bt[N, M], sbt[Nb, Mb], group_sizes[G]) -> dW[G, K, N]``.

    K sharded (at's rows) and N sharded (whole 128-row blocks of bt) give each shard its slice of
    every expert's gradient, no collective; expert parallel (M and the group sizes on the same mesh
    axis, grouped_dense's contract) gives each shard its local experts. The reduction axis M is
    gathered otherwise (its groups span shards)."""

    def rule(at_shape, sat_shape, bt_shape, sbt_shape, gs_shape, mesh):
        sizes: dict = {}
        need = ["m", "mb"]
        n, nb = _block_dims(bt_shape[0], BN, "n", sizes, need, mesh)
        return f"k m, k mb, {n} m, {nb} mb, g -> g k {n}", {"need_replication_factors": tuple(need), **sizes}

    def plan(ctx: ShardContext) -> ShardPlan:
        (k, m), (n, _), (g,) = ctx.arg_shapes[0], ctx.arg_shapes[2], ctx.arg_shapes[4]
        at_spec, bt_spec, gs_spec = ctx.arg_specs[0], ctx.arg_specs[2], ctx.arg_specs[4]
        used: set[str] = set()
        ep = ()
        if at_spec[1] is not None and at_spec[1] == gs_spec[0]:  # expert parallel
            ep = _keep(gs_spec[0], g, ctx.mesh, used)
            if ep and m % (mesh_size(ctx.mesh, ep) * BK) != 0:  # whole 128-row chunks per shard
                used.difference_update(ep)
                ep = ()
        k_axes = _keep(at_spec[0], k, ctx.mesh, used)
        n_axes = _block_axes(bt_spec[0], n, BN, ctx.mesh, used)
        e, ek, en = spec_entry(ep), spec_entry(k_axes), spec_entry(n_axes)
        return ShardPlan([[ek, e], [ek, e], [en, e], [en, e], [e]], [e, ek, en], None)

    return _wrap(local, rule, plan, True)
