"""Public grouped_ffn op: the MoE experts' FFN, ``act(x @ wi[g]) @ wo[g]`` per group (gated:
``act(h[:, :F]) * h[:, F:]`` between the GEMMs), as one op with one custom VJP.

It computes exactly what two :func:`grouped_dense` calls with :func:`ffn_activation` between them
compute (``reference.ffn_forward`` / ``ffn_backward``). The Triton implementation moves the
activation into the epilogues of the GEMMs around it, so h is not read back to compute the
activation, and the activation's incoming gradient ``da`` never goes to memory:

* forward: the first GEMM's epilogue writes h (the backward needs it) *and* the activation of h;
  no separate pass reads h back to write the activation;
* backward: the second GEMM's dx (``da = dy @ wo^T``) never goes to memory; its epilogue reads h
  and writes the activation's gradient dh, the first GEMM's backward operand.

Per row, with F the FFN width and 2-byte elements, gated: the unfused path reads h once more in the
forward (4F bytes) and writes and reads ``da`` in the backward (4F): ``8F`` bytes a row, about
2.1 GB per layer at 131072 rows and F = 2048 (docs/perf_notes.md). Non-gated: ``6F``.

Sharding: expert parallel (the expert axis of wi and wo and x's rows on the same mesh axis, as
grouped_dense takes it): each shard runs its local FFN, no collective. Other shardings are gathered
(the gated W axis holds two F-wide halves side by side, which one mesh axis cannot split into
matching pieces).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from te_ops._core import registry
from te_ops._core import triton_bridge as tb
from te_ops._core.partitioning import batch_folding, match_vma, partitioned
from te_ops._core.validation import (
    check_float,
    check_int_array,
    err,
    is_master_kernel,
    sequential_fold,
    static_choice,
)
from te_ops.dense.reference import ACTIVATIONS
from te_ops.grouped_dense import reference as ref
from te_ops.grouped_dense import sharding
from te_ops.grouped_dense import triton as tri
from te_ops.grouped_dense.reference import FFNResiduals, ffn_activation

OP = "grouped_ffn"


# ----------------------------------------------------------------------------------------------
# Implementations (signatures: forward(x, wi, wo, gs, *, activation, gated) -> (y, h, act);
# backward(FFNResiduals, dy, *, activation, gated, wgrad_dtype) -> (dx, dwi, dwo))
# ----------------------------------------------------------------------------------------------


def _triton_forward(x, wi, wo, group_sizes, *, activation, gated: bool):
    fwd_cfg, _, _ = tri._configs()
    if activation in tri.FFN_FUSED_ACTIVATIONS:
        h, a = tri.ffn_act_gemm(x, wi, group_sizes, activation=activation, gated=gated)
    else:  # the GELUs: the activation in XLA between the plain GEMMs (see tri.FFN_FUSED_ACTIVATIONS)
        h = tri.grouped_gemm(x, wi, group_sizes, None, trans_b=False, cfg=fwd_cfg)
        a = ffn_activation(h, activation, gated)
    y = tri.grouped_gemm(a, wo, group_sizes, None, trans_b=False, cfg=fwd_cfg)
    return y, h, a


def _triton_backward(res: FFNResiduals, dy, *, activation, gated: bool, wgrad_dtype=None):
    x, wi, wo, gs, h, a = res
    _, dx_cfg, wg_cfg = tri._configs()
    dy = dy.astype(x.dtype)
    if activation in tri.FFN_FUSED_ACTIVATIONS:
        dh = tri.ffn_dact_gemm(dy, wo, h, gs, activation=activation, gated=gated)
    else:
        da = tri.grouped_gemm(dy, wo, gs, None, trans_b=True, cfg=dx_cfg)
        dh = jax.vjp(lambda h: ffn_activation(h, activation, gated), h)[1](da)[0]
    e = wi.shape[0]
    dwo = tri.grouped_wgrad(a, dy, gs, e, cfg=wg_cfg, out_dtype=wgrad_dtype or wo.dtype)
    dx = tri.grouped_gemm(dh, wi, gs, None, trans_b=True, cfg=dx_cfg)
    dwi = tri.grouped_wgrad(x, dh, gs, e, cfg=wg_cfg, out_dtype=wgrad_dtype or wi.dtype)
    return dx, dwi, dwo


def _triton_unsupported(*, dtype=None, m=None, h=None, f=None, o=None, g=None, **_) -> str | None:
    why = tri.unsupported_reason(dtype=dtype, m=m, k=h, n=o, g=g)
    if why is None and f is not None and f % 8:
        why = f"the Triton grouped FFN needs F multiples of 8 (16-byte rows), got F={f}"
    return why


FAMILY = registry.family(OP)
FAMILY.register(
    registry.Implementation(
        name="triton",
        forward=_triton_forward,
        backward=_triton_backward,
        unsupported_reason=_triton_unsupported,
        platform="cuda",
        available=lambda: tb.unavailable_reason(),
    )
)
FAMILY.register(registry.Implementation(name=registry.REFERENCE, forward=ref.ffn_forward, backward=ref.ffn_backward))


# ----------------------------------------------------------------------------------------------
# Sharding: expert parallel only (module docstring)
# ----------------------------------------------------------------------------------------------

_REPLICATED = {"need_replication_factors": ("h", "w", "f", "o")}


def _forward_rule(*shapes):
    del shapes
    return "m h, g h w, g f o, g -> m o, m w, m f", _REPLICATED


def _ep_specs(arg_specs):
    """(rows spec, kernels spec): expert parallel when wi's and wo's expert axes and x's rows share
    one mesh axis (grouped_dense's rule), else replicated."""
    ep = sharding.expert_parallel_axis(arg_specs[0], arg_specs[1])
    if arg_specs[2][0] != ep:
        ep = None
    return [ep, None], [ep, None, None]


def _forward_specs(arg_specs, shapes):
    del shapes
    rows, kern = _ep_specs(arg_specs)
    return [rows, kern, kern, rows[:1]], [rows, rows, rows]


def _backward_rule(*shapes):
    del shapes
    return "m h, g h w, g f o, g, m w, m f, m o -> m h, g h w, g f o", _REPLICATED


def _backward_specs(arg_specs, shapes):
    del shapes
    rows, kern = _ep_specs(arg_specs)
    return [rows, kern, kern, rows[:1], rows, rows, rows], [rows, kern, kern]


# ----------------------------------------------------------------------------------------------
# The custom_vjp op, built once per static configuration
# ----------------------------------------------------------------------------------------------


def _call_desc(x, wi, wo):
    return dict(dtype=x.dtype, m=x.shape[0], h=x.shape[1], f=wo.shape[1], o=wo.shape[2], g=wi.shape[0])


@functools.cache
def _build(implementation, activation, gated: bool, tuning, master: bool):
    statics = dict(activation=activation, gated=gated)
    bwd_statics = dict(statics, wgrad_dtype=jnp.dtype(jnp.float32) if master else None)

    def tuned():
        return tri.config_override(*tuning) if tuning is not None else contextlib.nullcontext()

    def fwd_impl(x, wi, wo, gs):
        with tuned():
            return FAMILY.dispatch(implementation, "forward", (x, wi, wo, gs), statics, _call_desc(x, wi, wo))

    def bwd_impl(x, wi, wo, gs, h, a, dy):
        with tuned():
            return FAMILY.dispatch(
                implementation, "backward", (FFNResiduals(x, wi, wo, gs, h, a), dy), bwd_statics, _call_desc(x, wi, wo)
            )

    fwd_part = partitioned(fwd_impl, rule=_forward_rule, specs=_forward_specs)
    bwd_part = partitioned(bwd_impl, rule=_backward_rule, specs=_backward_specs)
    fwd_call = batch_folding(fwd_part, sequential_fold(fwd_part))
    bwd_call = batch_folding(bwd_part, sequential_fold(bwd_part))

    def cast(x, w):
        return w.astype(x.dtype) if master else w

    @jax.custom_vjp
    def op(x, wi, wo, gs):
        return fwd_call(x, cast(x, wi), cast(x, wo), gs)[0]

    def op_fwd(x, wi, wo, gs):
        wi, wo = cast(x, wi), cast(x, wo)
        y, h, a = fwd_call(x, wi, wo, gs)
        return y, FFNResiduals(x, wi, wo, gs, h, a)

    def op_bwd(res, dy):
        dx, dwi, dwo = bwd_call(*res, dy)
        return dx, dwi, dwo, None

    op.defvjp(op_fwd, op_bwd)
    return op


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _validate(x, wi, wo, group_sizes, activation, gated):
    x = check_float(OP, "x", x, rank=2, layout="[M, H]")
    wi = check_float(OP, "wi", wi, rank=3, layout="[G, H, W]")
    wo = check_float(OP, "wo", wo, rank=3, layout="[G, F, O]")
    if not isinstance(gated, bool):
        raise TypeError(err(OP, f"gated must be a static bool, got {gated!r:.60}."))
    if not (activation is None or (isinstance(activation, str) and activation in ACTIVATIONS)):
        names = ", ".join(repr(a) for a in ACTIVATIONS if a)
        raise ValueError(err(OP, f"activation must be None or one of {names}, got {activation!r:.60}."))
    g, hdim, w = wi.shape
    if g == 0:
        raise ValueError(err(OP, f"wi must hold at least one expert kernel (G >= 1), got shape {tuple(wi.shape)}."))
    if hdim != x.shape[1]:
        raise ValueError(err(OP, f"wi must be [G, H, W] with H = x.shape[1] = {x.shape[1]}, got wi {tuple(wi.shape)}."))
    if wo.shape[0] != g:
        raise ValueError(err(OP, f"wo must hold one kernel per expert (G = wi.shape[0] = {g}), got wo "
                                 f"{tuple(wo.shape)}."))  # fmt: skip
    f = wo.shape[1]
    if w != (2 * f if gated else f):
        want = f"2F = {2 * f} (gated: the activation's input in the first F columns, the linear half in the last F)" \
            if gated else f"F = {f}"  # fmt: skip
        raise ValueError(err(OP, f"wi's W must be {want}, F = wo.shape[1]; got wi {tuple(wi.shape)}, wo "
                                 f"{tuple(wo.shape)}."))  # fmt: skip
    for name, k in (("wi", wi), ("wo", wo)):
        if k.dtype != x.dtype and not is_master_kernel(x.dtype, k.dtype):
            raise TypeError(err(OP, f"{name} must have x's dtype, or be float32 master kernels with a bfloat16 or "
                                    f"float16 x; got x {x.dtype} and {name} {k.dtype}."))  # fmt: skip
    if wi.dtype != wo.dtype:
        raise TypeError(err(OP, f"wi and wo must have one dtype (x's, or float32 master kernels), got wi {wi.dtype} "
                                f"and wo {wo.dtype}."))  # fmt: skip
    group_sizes = check_int_array(OP, "group_sizes", group_sizes, dtype=jnp.int32)
    if group_sizes.shape != (g,):
        raise ValueError(err(OP, f"group_sizes must have shape [G] = ({g},) (one size per expert), got shape "
                                 f"{tuple(group_sizes.shape)}."))  # fmt: skip
    return x, wi, wo, group_sizes


def grouped_ffn(
    x: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    group_sizes: jax.Array,
    *,
    activation: str | None = "silu",
    gated: bool = True,
    implementation: str | None = None,
) -> jax.Array:
    """The MoE experts' FFN on expert-major rows, as one op.

    Equal to::

        h = grouped_dense(x, wi, group_sizes)              # [M, W]
        a = ffn_activation(h, activation, gated)           # act(h), or act(h[:, :F]) * h[:, F:]
        y = grouped_dense(a, wo, group_sizes)              # [M, O]

    with the activation computed in float32 from h and rounded to x's dtype, and its gradient
    likewise (rounded to x's dtype, from the rounded ``da``). The rows of no group are zero in y and
    dx. Gradients: dx, dwi, dwo (per-group sums, zero for an empty group); none for group_sizes.
    The group rule (negative sizes, sizes summing past M) is grouped_dense's.

    The Triton implementation (CUDA, bfloat16 / float16) fuses the activation into the GEMM
    epilogues for None, "relu" and "silu" (module docstring); the GELUs run between plain grouped
    GEMMs. Its results equal the reference's up to the last-ulp rounding of the activation's
    transcendental (and the order of the float32 accumulation).

    Args:
      x: ``[M, H]`` float32, bfloat16 or float16, rows grouped by expert.
      wi: ``[G, H, W]``, x's dtype or float32 master kernels with a 16-bit x (cast inside; float32
        gradient): the first kernels, ``W = 2F`` gated (the activation's input in the first F
        columns, the linear half in the last F), else ``W = F``.
      wo: ``[G, F, O]``, wi's dtype: the second kernels.
      group_sizes: int32 ``[G]``.
      activation: static, None or one of "gelu", "gelu_tanh", "relu", "silu".
      gated: static bool.
      implementation: None (the Triton kernels on CUDA for bfloat16 / float16 with H, F and O
        multiples of 8, else the reference), "triton" or "reference".

    Returns:
      ``[M, O]`` array of x's dtype.

    Raises:
      TypeError: wrong dtypes (non-float x or kernels, kernels of another dtype than x other than
        float32 masters, wi and wo of different dtypes, group_sizes not int32), gated not a bool.
      ValueError: wrong ranks or shapes, G = 0, an unknown activation or implementation.
    """
    x, wi, wo, group_sizes = _validate(x, wi, wo, group_sizes, activation, gated)
    implementation = static_choice(OP, "implementation", implementation, (None, "reference", "triton"))
    master = is_master_kernel(x.dtype, wi.dtype)
    op = _build(implementation, activation, gated, tri.current_override(), master)
    return op(*match_vma(x, wi, wo, group_sizes))
