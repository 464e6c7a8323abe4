"""cuDNN implementation of fused_attention (csrc/fused_attention, extension ``te_ops._native_cudnn``).

The FFI handlers build cuDNN SDPA graphs with the cuDNN frontend, once per (device, shape, dtype,
config) key, in XLA's initialize stage, and execute them graph-safely (kCmdBufferCompatible).

Support and workspace: before using the native path, :func:`unsupported_reason` asks the extension
(``te_fused_attention_query``, an exported C symbol reached through ctypes) to build the forward and
backward graphs for the call; cuDNN's own verdict becomes the reason (so ``implementation=None`` falls
back to the reference for anything this cuDNN cannot run), and the plan's workspace size becomes an
extra FFI result buffer: XLA owns that memory and nothing is allocated at run time.

Mapping of the te_ops semantics onto cuDNN:

* causal (top-left) -> diagonal band right bound 0, TOP_LEFT alignment;
* causal bottom-right -> the same band with BOTTOM_RIGHT alignment (cuDNN shifts the diagonal by
  ``Sk - Sq``, or per batch entry by ``seq_len_kv - seq_len_q`` with padding, as the reference does);
* window (left, right) -> left bound ``left + 1`` (cuDNN keeps ``j > i + off - left_bound``), right bound
  ``right``, with the alignment of the causal mask;
* padding -> cuDNN padding mask with ``seq_len_q`` / ``seq_len_kv`` int32 tensors;
* segment ids -> an additive ``[B, 1, Sq, Sk]`` mask (0 / -inf) built here and applied to any user bias
  (-inf where masked, whatever the bias holds; cuDNN's fused kernels take no per-token ids);
* segment positions, or a bottom-right mask with segment ids or a bias (cuDNN's bottom-right mask
  takes no bias) -> the causal and window rules go into that additive mask too ("folded"), and cuDNN
  gets no diagonal band (its band compares indices, not positions);
* dropout -> cuDNN Philox dropout; int64 seed and offset read on the device from the first of the
  op's per-(batch, head) uint32[4] seeds of this shard (so shards draw different masks);
* deterministic (backward) -> ``set_deterministic_algorithm(true)`` on the SDPA backward node (dQ is
  otherwise accumulated with atomics, so its low bits vary run to run); part of the support query,
  since it can change cuDNN's verdict and the workspace size.

Rows (queries) with no visible key, keys that no query sees, and the gradient entries of masked bias
positions are set to exactly 0 here with cheap ``where`` ops (cuDNN leaves some of them unwritten or
undefined); such rows' logsumexp is +inf, as in the reference.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import native as _native
from te_ops.fused_attention import reference
from te_ops.fused_attention.reference import Residuals

MODULE = "_native_cudnn"
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_PADDING = reference.PADDING
_CAUSAL = reference.CAUSAL
_BOTTOM_RIGHT = reference.BOTTOM_RIGHT


# ----------------------------------------------------------------------------------------------
# Support query (ctypes into the extension)
# ----------------------------------------------------------------------------------------------


@functools.cache
def query(ints: tuple[int, ...], scale: float, dropout: float) -> tuple[str | None, int]:
    """(reason or None, workspace bytes) for one graph configuration (see te_fused_attention_query)."""
    ws = ctypes.c_int64(0)
    extra = ((ctypes.c_double, float(scale)), (ctypes.c_double, float(dropout)),
             (ctypes.POINTER(ctypes.c_int64), ctypes.byref(ws)))  # fmt: skip
    rc, why = _native.ctypes_query(MODULE, "te_fused_attention_query", ints, extra)
    return (why, 0) if rc else (None, int(ws.value))


def folded(*, mask_type, has_bias, has_segments, has_positions) -> bool:
    """Whether the causal and window rules go into the additive mask instead of cuDNN's diagonal band:
    with segment positions (cuDNN's band compares indices), and for a bottom-right mask when an
    additive mask or bias exists anyway (cuDNN's bottom-right band refuses a bias)."""
    if has_segments and has_positions:
        return True
    return mask_type in _BOTTOM_RIGHT and (has_segments or has_bias)


def _graph_config(
    *, dtype, q_shape, k_shape, v_shape, bias_shape, has_segments, mask_type, window, has_positions=False
):
    """The ints of te_fused_attention_query minus (device, backward, stats, dbias)."""
    b, s_q, hq, d = q_shape
    _, s_k, hk, _ = k_shape
    dv = v_shape[3]
    fold = folded(
        mask_type=mask_type, has_bias=bias_shape is not None, has_segments=has_segments, has_positions=has_positions
    )
    bias_b = bias_h = 0
    if bias_shape is not None:
        bias_b, bias_h = bias_shape[0], bias_shape[1]
    if has_segments or (fold and mask_type in _PADDING):  # a per-batch-entry mask
        bias_b, bias_h = b, (bias_h if bias_h else 1)
    left_bound = right_bound = -1
    if mask_type in _CAUSAL and not fold:
        right_bound = 0
    if window is not None and not fold:
        left, right = window
        if left >= 0:
            left_bound = left + 1
        if right >= 0 and mask_type not in _CAUSAL:
            right_bound = right
    bottom_right = int(mask_type in _BOTTOM_RIGHT and not fold)
    io = 0 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 1
    return (
        io, b, s_q, s_k, hq, hk, d, dv, bias_b, bias_h, int(mask_type in _PADDING), left_bound, right_bound,
        bottom_right,
    )  # fmt: skip


def _ints(
    cfg, backward: bool, *, stats: bool = True, dbias: bool = False, deterministic: bool = False, device: int = 0
) -> tuple[int, ...]:
    io, *rest, bottom_right = cfg
    return (
        device, io, int(backward), *rest, int(stats or backward), int(backward and dbias), bottom_right,
        int(backward and deterministic),
    )  # fmt: skip


def unsupported_reason(
    *,
    dtype,
    q_shape,
    k_shape,
    v_shape,
    bias_shape=None,
    has_segments=False,
    has_positions=False,
    mask_type="none",
    window=None,
    scale=1.0,
    dropout_rate=0.0,
    deterministic=False,
    **_,
) -> str | None:
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"native (cuDNN) fused_attention supports bfloat16 and float16, got {jnp.dtype(dtype)}"
    if 0 in (*q_shape, *k_shape, *v_shape):
        return (
            f"native (cuDNN) fused_attention needs non-empty inputs, got q {tuple(q_shape)}, k {tuple(k_shape)}, "
            f"v {tuple(v_shape)} (the reference gives the defined result: zeros)"
        )
    cfg = _graph_config(
        dtype=dtype,
        q_shape=q_shape,
        k_shape=k_shape,
        v_shape=v_shape,
        bias_shape=bias_shape,
        has_segments=has_segments,
        mask_type=mask_type,
        window=window,
        has_positions=has_positions,
    )
    for backward in (False, True):
        ints = _ints(cfg, backward, dbias=bias_shape is not None, deterministic=bool(deterministic))
        why, _ = query(ints, float(scale), float(dropout_rate))
        if why is not None:
            kind = "backward" if backward else "forward"
            return f"cuDNN cannot run this {kind} configuration: {why}"
    return None


# ----------------------------------------------------------------------------------------------
# Visibility helpers (rows with no key, keys with no query)
# ----------------------------------------------------------------------------------------------


def _band(xp, a, n_other, lo, hi):
    """Whether position a (a query for rows, a key for columns) sees at least one of the n_other
    positions of the other axis inside its window [a - lo, a + hi]; xp is numpy or jax.numpy."""
    return xp.maximum(0, a - lo) <= xp.minimum(n_other - 1, a + hi)


def _visible(b, s_q, s_k, masks):
    """reference.visible for the mask arguments of one call (a dict, see forward)."""
    return reference.visible(b, s_q, s_k, **masks)


def _valid(b, s_q, s_k, masks):
    """(row_valid [B|1, Sq] or None, col_valid [B|1, Sk] or None); None: every row (key) is visible."""
    mask_type, window = masks["mask_type"], masks["window"]
    if mask_type == "none" and window is None and masks["q_segment_ids"] is None:
        return None, None
    if masks["q_segment_ids"] is not None:
        vis = _visible(b, s_q, s_k, masks)[:, 0]
        return vis.any(-1), vis.any(-2)
    big = s_q + s_k + 1
    left = window[0] if window is not None and window[0] >= 0 else big
    right = window[1] if window is not None and window[1] >= 0 else big
    if mask_type in _CAUSAL:
        right = min(right, 0)
    bottom_right = mask_type in _BOTTOM_RIGHT
    if mask_type not in _PADDING:
        # Static shapes and bounds: decide with numpy, and skip the where() passes (a full extra read and
        # write of the output and gradients) whenever every row and every key is visible, e.g. plain causal.
        # Query i's diagonal is at key i + off.
        off = s_k - s_q if bottom_right else 0
        row_np = _band(np, np.arange(s_q) + off, s_k, left, right)
        col_np = _band(np, np.arange(s_k) - off, s_q, right, left)
        # Built from iota, not from the numpy arrays: a numpy constant would become a closed-over
        # constant of the traced function, which custom_partitioning (our sharding rule) rejects.
        row = None if row_np.all() else _band(jnp, jnp.arange(s_q) + off, s_k, left, right)[None]
        col = None if col_np.all() else _band(jnp, jnp.arange(s_k) - off, s_q, right, left)[None]
        return row, col
    i = jnp.arange(s_q)[None, :]
    j = jnp.arange(s_k)[None, :]
    qlen, kvlen = masks["q_seqlens"][:, None], masks["kv_seqlens"][:, None]
    off = kvlen - qlen if bottom_right else 0
    row = _band(jnp, i + off, kvlen, left, right) & (i < qlen)
    col = _band(jnp, j - off, qlen, right, left) & (j < kvlen)
    return row, col


def _bias_for_cudnn(q, k, bias, masks, fold):
    """The additive bias cuDNN receives, in q's dtype, or None: the user bias, set to -inf where the
    rules that cuDNN does not apply itself (segment ids; folded causal/window rules) hide the key."""
    total = None if bias is None else bias.astype(q.dtype)
    if fold:
        keep = _visible(q.shape[0], q.shape[1], k.shape[1], masks)
    elif masks["q_segment_ids"] is not None:
        keep = (masks["q_segment_ids"][:, :, None] == masks["kv_segment_ids"][:, None, :])[:, None]
    else:
        return total
    base = jnp.zeros((), q.dtype) if total is None else total
    return jnp.where(keep, base, jnp.array(-jnp.inf, q.dtype))


def _operands(q, bias_total, q_seqlens, kv_seqlens, seed, mask_type):
    dummy_f = jnp.zeros((1,), q.dtype)
    dummy_i = jnp.zeros((1,), jnp.int32)
    padding = mask_type in _PADDING
    return (
        bias_total if bias_total is not None else dummy_f,
        q_seqlens.astype(jnp.int32) if padding else dummy_i,
        kv_seqlens.astype(jnp.int32) if padding else dummy_i,
        # cuDNN takes one seed per call: the first (batch, head) seed of this shard.
        seed.reshape(-1, 4)[0].astype(jnp.uint32) if seed is not None else jnp.zeros((4,), jnp.uint32),
    )


def _attrs(cfg, scale, dropout_rate, has_bias, stats=None, need_dbias=None, deterministic=None):
    _, _, _, _, _, _, _, _, _, _, padding, left_bound, right_bound, bottom_right = cfg
    extra = {} if stats is None else {"stats": np.int32(stats)}
    if need_dbias is not None:
        extra["need_dbias"] = np.int32(need_dbias)
    if deterministic is not None:  # backward only
        extra["deterministic"] = np.int32(deterministic)
    return dict(
        **extra,
        scale=np.float32(scale),
        dropout=np.float32(dropout_rate),
        has_bias=np.int32(has_bias),
        padding=np.int32(padding),
        left_bound=np.int32(left_bound),
        right_bound=np.int32(right_bound),
        bottom_right=np.int32(bottom_right),
    )


def _setup(q, k, v, bias, masks):
    """(graph config, folded) for one call; masks: the mask arguments of reference.visible."""
    has_seg, has_pos = masks["q_segment_ids"] is not None, masks["q_segment_pos"] is not None
    mask_type = masks["mask_type"]
    cfg = _graph_config(
        dtype=q.dtype,
        q_shape=q.shape,
        k_shape=k.shape,
        v_shape=v.shape,
        bias_shape=None if bias is None else bias.shape,
        has_segments=has_seg,
        mask_type=mask_type,
        window=masks["window"],
        has_positions=has_pos,
    )
    fold = folded(mask_type=mask_type, has_bias=bias is not None, has_segments=has_seg, has_positions=has_pos)
    return cfg, fold


def _masks(mask_type, window, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, q_segment_pos, kv_segment_pos):
    return dict(
        mask_type=mask_type,
        window=window,
        q_seqlens=q_seqlens,
        kv_seqlens=kv_seqlens,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_segment_pos=q_segment_pos,
        kv_segment_pos=kv_segment_pos,
    )


# ----------------------------------------------------------------------------------------------
# forward / backward
# ----------------------------------------------------------------------------------------------


def forward(
    q,
    k,
    v,
    bias=None,
    q_seqlens=None,
    kv_seqlens=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    seed=None,
    q_segment_pos=None,
    kv_segment_pos=None,
    *,
    mask_type: str,
    window,
    scale: float,
    dropout_rate: float,
    need_stats: bool = True,
):
    b, s_q, hq, _ = q.shape
    s_k = k.shape[1]
    masks = _masks(
        mask_type, window, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, q_segment_pos, kv_segment_pos
    )
    cfg, fold = _setup(q, k, v, bias, masks)
    stats = True
    if not need_stats:  # inference graph (no statistics), as jax's cuDNN path uses outside autodiff
        why, ws = query(_ints(cfg, False, stats=False), float(scale), float(dropout_rate))
        stats = why is not None  # fall back to the training graph if cuDNN refuses the inference one
    if stats:
        why, ws = query(_ints(cfg, False), float(scale), float(dropout_rate))
    if why is not None:
        raise RuntimeError(f"te_ops.fused_attention: cuDNN cannot run this forward configuration: {why}")
    bias_total = _bias_for_cudnn(q, k, bias, masks, fold)
    out, lse, _ = _native.ffi_call(
        "te_fused_attention_fwd",
        (
            jax.ShapeDtypeStruct((b, s_q, hq, v.shape[3]), q.dtype),
            jax.ShapeDtypeStruct((b, hq, s_q), jnp.float32),
            jax.ShapeDtypeStruct((max(ws, 1),), jnp.uint8),
        ),
        q,
        k,
        v,
        *_operands(q, bias_total, q_seqlens, kv_seqlens, seed, mask_type),
        **_attrs(cfg, scale, dropout_rate, bias_total is not None, stats=int(stats)),
    )
    row, _ = _valid(b, s_q, s_k, masks)
    if row is not None:
        out = jnp.where(row[:, :, None, None], out, jnp.zeros((), out.dtype))
        lse = jnp.where(row[:, None, :], lse, jnp.inf)
    res = Residuals(
        q,
        k,
        v,
        bias,
        out,
        lse,
        q_seqlens,
        kv_seqlens,
        q_segment_ids,
        kv_segment_ids,
        seed,
        q_segment_pos,
        kv_segment_pos,
    )
    return out, res


def backward(
    res: Residuals, g, *, mask_type: str, window, scale: float, dropout_rate: float, deterministic: bool = False
):
    """deterministic: cuDNN's deterministic backward algorithm (dQ accumulated in a fixed order, not with
    atomics), so two runs on the same inputs give bit-identical gradients; can be slower."""
    q, k, v, bias = res.q, res.k, res.v, res.bias
    b, s_q, hq, d = q.shape
    s_k = k.shape[1]
    masks = _masks(
        mask_type, window, res.q_seqlens, res.kv_seqlens, res.q_segment_ids, res.kv_segment_ids,
        res.q_segment_pos, res.kv_segment_pos,
    )  # fmt: skip
    cfg, fold = _setup(q, k, v, bias, masks)
    ints = _ints(cfg, True, dbias=bias is not None, deterministic=deterministic)
    why, ws = query(ints, float(scale), float(dropout_rate))
    if why is not None:
        raise RuntimeError(f"te_ops.fused_attention: cuDNN cannot run this backward configuration: {why}")
    row, col = _valid(b, s_q, s_k, masks)
    g = g.astype(q.dtype)
    out, lse = res.out, res.lse
    if row is not None:
        g = jnp.where(row[:, :, None, None], g, jnp.zeros((), g.dtype))
        out = jnp.where(row[:, :, None, None], out, jnp.zeros((), out.dtype))
        lse = jnp.where(row[:, None, :], lse, jnp.inf)
    bias_total = _bias_for_cudnn(q, k, bias, masks, fold)
    dbias_shape = bias_total.shape if bias is not None else (1,)
    dq, dk, dv, dbias, _ = _native.ffi_call(
        "te_fused_attention_bwd",
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(dbias_shape, q.dtype),
            jax.ShapeDtypeStruct((max(ws, 1),), jnp.uint8),
        ),
        q,
        k,
        v,
        out,
        g,
        lse.astype(jnp.float32),
        *_operands(q, bias_total, res.q_seqlens, res.kv_seqlens, res.seed, mask_type),
        **_attrs(
            cfg,
            scale,
            dropout_rate,
            bias_total is not None,
            need_dbias=int(bias is not None),
            deterministic=int(bool(deterministic)),
        ),
    )
    zero = jnp.zeros((), q.dtype)
    if row is not None:
        dq = jnp.where(row[:, :, None, None], dq, zero)
    if col is not None:
        dk = jnp.where(col[:, :, None, None], dk, zero)
        dv = jnp.where(col[:, :, None, None], dv, zero)
    if bias is None:
        return dq, dk, dv, None
    vis = _visible(b, s_q, s_k, masks)
    if vis is not None:
        if dbias.shape[0] == 1 and vis.shape[0] != 1:
            vis = vis.any(0, keepdims=True)  # a batch-broadcast bias position counts if any batch sees it
        dbias = jnp.where(vis, dbias, jnp.zeros((), dbias.dtype))
    if bias.shape[0] == 1 and dbias.shape[0] != 1:
        dbias = dbias.astype(jnp.float32).sum(0, keepdims=True)
    return dq, dk, dv, dbias.astype(bias.dtype)
