"""Property tests on the GPU: every GPU implementation (native C++/CUDA, Triton, Gluon) against
``implementation="reference"``, forward and backward (``jax.vjp`` with a random cotangent), on cases
drawn from the SAME hypothesis strategies as tests/property (imported from there), narrowed with
``map`` / ``filter`` where an implementation documents shape constraints. Each constraint also gets
a test that a call outside it is refused with the documented message, or falls back as documented.

Comparisons: the project's tolerance table (``te_ops._core.testing.TOLERANCES`` through
``tests/property/_common.check_close``: NaN at the same positions, atol relative to the largest
reference value) for the dtype the op ran in; copies, maps and counts exactly; FP8 quantization byte
for byte against the reference run on the CPU (as tests/gpu/test_fp8_gpu.py: XLA's float32 division
on the GPU is not always correctly rounded); the FP8 GEMMs within 1e-2 (2e-2 with an activation) of
the largest reference value (test_fp8_gpu.py's bound); fused attention by relative Frobenius error
(test_fused_attention_gpu.py's REL_TOL, against a float32 reference). Every kernel output is
NaN-poisoned (``native.poisoned_outputs``), so an unwritten element fails the comparison.

The FP8 GEMMs and fused attention draw from the GPU-only strategies below (the grouped FP8 GEMM reuses
tests/property's grouped_dense case generator: uneven sizes, empty groups, all rows in one group,
negative / overflowing sizes). Their CPU property tests (tests/property/test_fp8_gemm_props.py,
test_attention_props.py, test_fp8_dispatch_props.py: the reference against numpy) have their own
strategies, which this file does not draw from yet.

Runtime: each new shape compiles (XLA, Triton, cuDNN), so the example count is an environment
variable and shapes stay small to moderate::

    python -m pytest -m gpu tests/gpu/test_property_gpu.py -q -n 4     # on the GPU
    TE_GPU_PROPERTY_EXAMPLES=100 python -m pytest -m gpu tests/gpu/test_property_gpu.py -q -n 4

* ``TE_GPU_PROPERTY_EXAMPLES``: examples per property test (default 25; the tests of out-of-constraint
  calls take a fifth of it, at least 2).
* ``TE_GPU_PROPERTY_SHRINK=1``: let hypothesis shrink a failing case (off by default: every shrink
  step compiles again, which can take minutes; the failing case is printed either way).
* ``TE_GPU_PROPERTY_CPU_DRYRUN=1``: a wiring check on the CPU: every GPU implementation name is
  mapped to "reference", 2 examples per test (unless TE_GPU_PROPERTY_EXAMPLES says otherwise), so
  the imports, the strategies and the argument validation of every generated call are exercised.
  ``--noconftest``: tests/conftest.py skips everything under tests/gpu where JAX sees no GPU::

      TE_GPU_PROPERTY_CPU_DRYRUN=1 python -m pytest --noconftest tests/gpu/test_property_gpu.py -q

Generation is derandomized (the same cases every run) and uses no example database.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

import te_ops
from te_ops import fp8
from te_ops._core import native, registry
from te_ops._core.registry import REFERENCE
from te_ops.fp8 import select as fp8_select
from te_ops.fp8 import triton as fp8_tri
from te_ops.fused_attention import native as fa_native
from te_ops.grouped_dense import triton as gd_tri
from te_ops.permutation import reference as perm_ref
from te_ops.permutation import triton as perm_tri
from te_ops.router import native as router_native
from tests.gpu.test_fused_attention_gpu import REL_TOL as ATTENTION_REL_TOL
from tests.property._common import SETTINGS, as64, check_close, rand, seeds, size
from tests.property.test_dense_props import (
    DENSE_ARGS,
    GROUP_KINDS,
    GROUPED_K,
    GROUPED_M,
    GROUPED_N,
    grouped_dense_case,
    grouped_ffn_case,
    grouped_ffn_inputs,
)
from tests.property.test_fp8_gemm_props import grouped_vjp
from tests.property.test_fp8_props import (
    BLOCK_ARGS,
    CURRENT_ARGS,
    DELAYED_ALGOS,
    DELAYED_ARGS,
    assert_same_f32,
    assert_same_fp8,
    delayed_inputs,
    fmt_name,
    make_x,
    np_amax,
    np_scale,
)
from tests.property.test_normalization_props import NORM_ARGS, norm_inputs
from tests.property.test_permutation_props import CAPACITIES, DISPATCH_ARGS, SORT_ARGS
from tests.property.test_router_props import AUX_LOSS_ARGS, AUX_SCORES_ARGS, TOPK_ARGS, _logits
from tests.property.test_softmax_props import (
    CAUSAL_SOFTMAX_ARGS,
    EMPTY_SOFTMAX_ARGS,
    MASKED_SOFTMAX_ARGS,
    SCALED_SOFTMAX_ARGS,
    causal_softmax_inputs,
    masked_softmax_inputs,
    scaled_softmax_inputs,
)

DRYRUN = os.environ.get("TE_GPU_PROPERTY_CPU_DRYRUN", "0") not in ("", "0")
EXAMPLES = int(os.environ.get("TE_GPU_PROPERTY_EXAMPLES", "2" if DRYRUN else "25"))
CONSTRAINT_EXAMPLES = max(2, EXAMPLES // 5)
_SHRINK = os.environ.get("TE_GPU_PROPERTY_SHRINK", "0") not in ("", "0")
_PHASES = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if _SHRINK else ())

pytestmark = pytest.mark.gpu

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
CPU = jax.devices("cpu")[0]
# The native / Triton kernels take float16 too; tests/property draws float32 and bfloat16 only.
GPU_FLOATS = st.sampled_from([F32, BF16, F16])


def fuzz_gpu(max_examples: int | None = None):
    """tests/property's settings (derandomized, no database, no deadline) with this file's example count."""
    return settings(max_examples=max_examples or EXAMPLES, phases=_PHASES, **SETTINGS)


def _name(impl: str) -> str:
    """The implementation to run: ``impl`` on the GPU, the reference in the CPU dry run."""
    return REFERENCE if DRYRUN else impl


# ----------------------------------------------------------------------------------------------
# Implementation variants: a registered implementation, possibly with a kernel / tile override
# active while it is traced, and the strategies narrowed to its documented constraints.
# ----------------------------------------------------------------------------------------------


class Variant(NamedTuple):
    impl: str  # implementation= of the op call
    context: Callable[[], Any] | None = None  # e.g. fp8 triton.kernel_override(...), entered around the trace
    opts: dict | None = None  # per-variant strategies (shape constraints), read by the test


def _variants(*specs) -> list:
    """pytest params of (id, impl, reason, context, opts): skipped with ``reason()`` where it is not
    None (never in the dry run)."""
    out = []
    for id_, impl, reason, context, opts in specs:
        why = None if DRYRUN else reason()
        marks = pytest.mark.skipif(why is not None, reason=f"{id_}: {why}")
        out.append(pytest.param(Variant(impl, context, opts or {}), id=id_, marks=marks))
    return out


def _family(family: str, impl: str) -> Callable[[], str | None]:
    return lambda: registry.family(family).get(impl).available() or native.cuda_device_unavailable_reason()


def _fp8_triton() -> str | None:
    return fp8_select.triton_fp8_unavailable_reason()


def _fp8_gluon() -> str | None:
    return _fp8_triton() or fp8_tri.gluon_gemm_unavailable_reason()


def needs(reason: Callable[[], str | None]):
    """A skip mark for tests that call a GPU implementation directly (none in the dry run)."""
    why = None if DRYRUN else reason()
    return pytest.mark.skipif(why is not None, reason=f"GPU test: {why}")


def run_impl(v: Variant, make: Callable[[str], Callable], *args):
    """``jax.jit(make(impl))(*args)`` traced with NaN-poisoned kernel outputs and the variant's overrides."""
    with native.poisoned_outputs(), v.context() if v.context else contextlib.nullcontext():
        return jax.jit(make(_name(v.impl)))(*args)


def run_reference(make: Callable[[str], Callable], *args, cpu: bool = False):
    """``jax.jit(make("reference"))(*args)``, on the CPU with ``cpu`` (the FP8 reference's numbers)."""
    if cpu:
        args = jax.device_put(args, CPU)
    return jax.jit(make(REFERENCE))(*args)


def _same_kind(got, want, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.shape} {got.dtype}, the reference {want.shape} {want.dtype}"
    )


def close(got, want, dtype, what: str) -> None:
    """``got`` against the reference's ``want`` with the tolerance of ``dtype`` (NaNs at the same places)."""
    _same_kind(got, want, what)
    check_close(got, as64(want), dtype, what=what)


def same(got, want, what: str) -> None:
    """Bit-identical values (floats compared as float64 values; NaN == NaN)."""
    _same_kind(got, want, what)
    a, e = np.asarray(got), np.asarray(want)
    if jnp.issubdtype(a.dtype, jnp.floating):
        a, e = as64(a), as64(e)
    np.testing.assert_array_equal(a, e, err_msg=what)


def close_tree(got, want, dtype, what: str) -> None:
    """``close`` for the float leaves of two pytrees, ``same`` for the others (maps, counts)."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for i, (a, e) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if jnp.issubdtype(e.dtype, jnp.floating):
            close(a, e, dtype, f"{what} [{i}]")
        else:
            same(a, e, f"{what} [{i}]")


def expect_refused(reason: str | None, match: str, call: Callable[[], Any]) -> None:
    """An out-of-constraint call: the implementation's documented reason names it, and (on the GPU)
    the call raises with that reason."""
    assert reason is not None and match in reason, f"expected a reason containing {match!r}, got {reason!r}"
    if not DRYRUN:
        with pytest.raises(Exception, match=re.escape(match)):
            jax.block_until_ready(call())


def _up(multiple: int) -> Callable[[int], int]:
    """A size rounded up to a multiple (0 stays 0)."""
    return lambda v: -(-v // multiple) * multiple


def _cot(v):
    """A zero cotangent for a non-differentiable output (maps, counts)."""
    if v is None:
        return None
    if not jnp.issubdtype(v.dtype, jnp.floating):
        return np.zeros(v.shape, jax.dtypes.float0)
    return jnp.zeros_like(v)


# ----------------------------------------------------------------------------------------------
# dense (native: cuBLASLt): no shape constraint (empty axes run the reference's result, no handler)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", _variants(("native", "native", _family("dense", "native"), None, None)))
@fuzz_gpu()
@given(**{**DENSE_ARGS, "dtype": GPU_FLOATS})
def test_dense(v, lead, k, n, dtype, has_bias, activation, seed):
    rng = np.random.default_rng(seed)
    x, _ = rand(rng, (*lead, k), dtype)
    w, _ = rand(rng, (k, n), dtype, 1.0 / np.sqrt(max(k, 1)))
    b = rand(rng, (n,), dtype)[0] if has_bias else None
    dy, _ = rand(rng, (*lead, n), dtype)

    def make(impl):
        def f(x, w, b, dy):
            fn = lambda a, kk, bb: te_ops.dense(a, kk, bb, activation=activation, implementation=impl)  # noqa: E731
            y, vjp = jax.vjp(fn, x, w, b)
            return y, vjp(dy)

        return f

    (y, grads), (y_ref, grads_ref) = run_impl(v, make, x, w, b, dy), run_reference(make, x, w, b, dy)
    close(y, y_ref, dtype, f"dense y ({activation}, bias={has_bias})")
    for name, a, e in zip(("dx", "dkernel", "dbias"), grads, grads_ref, strict=True):
        if e is None:
            assert a is None, name
        else:
            close(a, e, dtype, f"dense {name}")


# ----------------------------------------------------------------------------------------------
# grouped_dense (triton): bf16 / f16, K and N multiples of 8 (16-byte rows), G <= 1024. On Hopper the
# default tiles run the Gluon warp-specialized kernel where K is a multiple of BK = 64 and the Triton
# kernel elsewhere: "triton" draws K multiples of 8 (mostly the Triton kernel), "gluon-ws" multiples of 64.
# ----------------------------------------------------------------------------------------------

GD_DTYPES = st.sampled_from([BF16, F16])
GROUPED_VARIANTS = _variants(
    ("triton", "triton", _family("grouped_dense", "triton"), None, dict(k=GROUPED_K.map(_up(8)))),
    ("gluon-ws", "triton", lambda: _family("grouped_dense", "triton")() or gd_tri.gluon_ws_unavailable_reason(),
     None, dict(k=GROUPED_K.map(lambda v: 64 * (1 + v // 32)))),
)  # fmt: skip


GD_N = GROUPED_N.map(_up(8))


def _grouped_cases(k, n=GD_N, dtypes=GD_DTYPES, m=GROUPED_M):
    """tests/property's grouped_dense cases, every size kind, with K / N / dtypes narrowed."""
    return st.sampled_from(GROUP_KINDS).flatmap(
        lambda kind: grouped_dense_case(kind, m=m, k=k, n=n, dtypes=dtypes).map(lambda c: (kind, *c))
    )


def _grouped_inputs(m, k, n, g, sizes, dtype, has_bias, seed):
    rng = np.random.default_rng(seed)
    x, _ = rand(rng, (m, k), dtype)
    w, _ = rand(rng, (g, k, n), dtype, 1.0 / np.sqrt(max(k, 1)))
    b = rand(rng, (g, n), dtype)[0] if has_bias else None
    dy, _ = rand(rng, (m, n), dtype)
    gs = jnp.asarray(np.asarray(sizes, np.int64).astype(np.int32))
    return x, w, b, gs, dy


def _grouped_make(impl):
    def f(x, w, b, gs, dy):
        y, vjp = jax.vjp(lambda a, kk, bb: te_ops.grouped_dense(a, kk, gs, bb, implementation=impl), x, w, b)
        return y, vjp(dy)

    return f


@pytest.mark.parametrize("v", GROUPED_VARIANTS)
@fuzz_gpu()
@given(data=st.data())
def test_grouped_dense(v, data):
    kind, m, k, n, g, sizes, dtype, has_bias, seed = data.draw(_grouped_cases(v.opts["k"]), label="case")
    args = _grouped_inputs(m, k, n, g, sizes, dtype, has_bias, seed)
    (y, grads), (y_ref, grads_ref) = run_impl(v, _grouped_make, *args), run_reference(_grouped_make, *args)
    close(y, y_ref, dtype, f"grouped_dense y ({kind} sizes {sizes})")
    for name, a, e in zip(("dx", "dkernels", "dbias"), grads, grads_ref, strict=True):
        if e is None:
            assert a is None, name
        else:
            close(a, e, dtype, f"grouped_dense {name} ({kind} sizes {sizes})")


# grouped_ffn (triton): the activation fused into the grouped GEMM epilogues (None / relu / silu;
# the GELUs between plain GEMMs); H, F and O multiples of 8, bf16 / f16.
FFN_VARIANTS = _variants(("triton", "triton", _family("grouped_ffn", "triton"), None, {}))


def _ffn_make(activation, gated):
    def make(impl):
        def f(x, wi, wo, gs, dy):
            y, vjp = jax.vjp(lambda *a: te_ops.grouped_ffn(*a, gs, activation=activation, gated=gated,
                                                           implementation=impl), x, wi, wo)  # fmt: skip
            return y, vjp(dy)

        return f

    return make


@pytest.mark.parametrize("v", FFN_VARIANTS)
@fuzz_gpu()
@given(data=st.data())
def test_grouped_ffn(v, data):
    kind = data.draw(st.sampled_from(GROUP_KINDS), label="kind")
    m, h, f, o, g, sizes, act, gated, dtype, seed = data.draw(
        grouped_ffn_case(kind, h=GROUPED_K.map(_up(8)), f=GROUPED_K.map(_up(8)), o=GD_N, dtypes=GD_DTYPES),
        label="case",
    )
    (x, wi, wo, dy), _ = grouped_ffn_inputs(m, h, f, o, g, gated, dtype, seed)
    gs = jnp.asarray(np.asarray(sizes, np.int64).astype(np.int32))
    make = _ffn_make(act, gated)
    (y, grads), (y_ref, grads_ref) = run_impl(v, make, x, wi, wo, gs, dy), run_reference(make, x, wi, wo, gs, dy)
    tag = f"({act}, gated={gated}, {kind} sizes {sizes})"
    close(y, y_ref, dtype, f"grouped_ffn y {tag}")
    for name, a, e in zip(("dx", "dwi", "dwo"), grads, grads_ref, strict=True):
        close(a, e, dtype, f"grouped_ffn {name} {tag}")


@needs(_family("grouped_dense", "triton"))
@fuzz_gpu(CONSTRAINT_EXAMPLES)
@given(data=st.data())
def test_grouped_dense_outside_triton_constraints(data):
    """K or N not a multiple of 8, or float32: implementation="triton" is refused with the reason,
    implementation=None falls back to the reference."""
    bad = data.draw(st.sampled_from(["k", "n", "float32"]), label="constraint")
    k_st = GROUPED_K.filter(lambda v: v % 8) if bad == "k" else GROUPED_K.map(_up(8))
    n_st = GROUPED_N.filter(lambda v: v % 8) if bad == "n" else GD_N
    dtypes = st.just(F32) if bad == "float32" else GD_DTYPES
    kind, m, k, n, g, sizes, dtype, has_bias, seed = data.draw(_grouped_cases(k_st, n_st, dtypes), label="case")
    args = _grouped_inputs(m, k, n, g, sizes, dtype, has_bias, seed)
    why = gd_tri.unsupported_reason(dtype=dtype, kernels_dtype=dtype, m=m, k=k, n=n, g=g)
    match = "float16 inputs" if bad == "float32" else "multiples of 8"
    expect_refused(why, match, lambda: jax.jit(_grouped_make("triton"))(*args))
    close_tree(jax.jit(_grouped_make(None))(*args), run_reference(_grouped_make, *args), dtype, "implementation=None")


# ----------------------------------------------------------------------------------------------
# softmax family (native): no shape constraint (masked softmax takes rank 4, as the op); empty x
# runs the reference (no kernel)
# ----------------------------------------------------------------------------------------------

SOFTMAX_VARIANTS = _variants(("native", "native", _family("softmax", "native"), None, None))


def _softmax_check(v, op, x, g, dtype, what, mask=None, check_grad=True):
    def make(impl):
        def f(x, g, *m):
            y, vjp = jax.vjp(lambda a: op(a, *m, implementation=impl), x)
            return y, vjp(g)[0]

        return f

    args = (x, g) + ((mask,) if mask is not None else ())
    (y, dx), (y_ref, dx_ref) = run_impl(v, make, *args), run_reference(make, *args)
    close(y, y_ref, dtype, f"{what} forward")
    if check_grad:
        close(dx, dx_ref, dtype, f"{what} dx")


@pytest.mark.parametrize("v", SOFTMAX_VARIANTS)
@fuzz_gpu()
@given(**{**SCALED_SOFTMAX_ARGS, "dtype": GPU_FLOATS})
def test_scaled_softmax(v, lead, s, dtype, scale, special, seed):
    (x, _), (g, _) = scaled_softmax_inputs(np.random.default_rng(seed), lead, s, dtype, special)
    op = lambda a, implementation: te_ops.scaled_softmax(a, scale, implementation=implementation)  # noqa: E731
    # As in tests/property: gradients of rows with NaN / +inf are checked on the finite cases only.
    _softmax_check(v, op, x, g, dtype, f"scaled_softmax ({special}, scale {scale})", check_grad=special != "nan_inf")


@pytest.mark.parametrize("v", SOFTMAX_VARIANTS)
@fuzz_gpu()
@given(**{**MASKED_SOFTMAX_ARGS, "dtype": GPU_FLOATS})
def test_scaled_masked_softmax(v, b, n, sq, sk, bcast, mask_rank, density, dtype, scale, nan_masked, seed):
    # g is NaN where y is 0 (removed positions): no leak.
    mask_in, _, (x, _), (g, _) = masked_softmax_inputs(np.random.default_rng(seed), b, n, sq, sk, bcast, mask_rank,
                                                       density, dtype, nan_masked)  # fmt: skip
    op = lambda a, m, implementation: te_ops.scaled_masked_softmax(a, m, scale, implementation=implementation)  # noqa: E731
    _softmax_check(v, op, x, g, dtype, f"scaled_masked_softmax (mask {mask_in.shape})", mask=jnp.asarray(mask_in))


@pytest.mark.parametrize("v", SOFTMAX_VARIANTS)
@fuzz_gpu()
@given(**{**CAUSAL_SOFTMAX_ARGS, "dtype": GPU_FLOATS})
def test_scaled_upper_triang_masked_softmax(v, lead, s, dtype, scale, neginf, seed):
    # x holds NaN (garbage) at random positions above the diagonal.
    _, (x, _), (g, _) = causal_softmax_inputs(np.random.default_rng(seed), lead, s, dtype, neginf)
    op = lambda a, implementation: te_ops.scaled_upper_triang_masked_softmax(a, scale, implementation=implementation)  # noqa: E731
    _softmax_check(v, op, x, g, dtype, "scaled_upper_triang_masked_softmax")


@pytest.mark.parametrize("v", SOFTMAX_VARIANTS)
@fuzz_gpu(CONSTRAINT_EXAMPLES)
@given(**{**EMPTY_SOFTMAX_ARGS, "dtype": GPU_FLOATS})
def test_softmax_empty_axes_fall_back(v, shape, dtype):
    """An empty x with implementation="native" runs the reference (documented: no kernel launch)."""
    x = jnp.zeros(shape, dtype)

    def make(impl):
        def f(x):
            y, vjp = jax.vjp(lambda a: te_ops.scaled_softmax(a, 0.5, implementation=impl), x)
            return y, vjp(y)[0]

        return f

    for got, want in zip(run_impl(v, make, x), run_reference(make, x), strict=True):
        same(got, want, "empty softmax")


# ----------------------------------------------------------------------------------------------
# rms_norm / layer_norm (triton): no shape constraint (rows < 2**31); empty leading axes allowed
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", _variants(("triton", "triton", _family("normalization", "triton"), None, None)))
@fuzz_gpu()
@given(**{**NORM_ARGS, "dtype": GPU_FLOATS})
def test_norm(v, kind, lead, h, dtype, param_dtype, residual, zc, eps, row, seed):
    rng = np.random.default_rng(seed)
    shape = (*lead, h)
    pdt = param_dtype or dtype
    (x, x64), (r, r64), (gamma, _), (beta, _) = norm_inputs(rng, lead, h, dtype, param_dtype, residual, zc, row)
    dy, _ = rand(rng, shape, dtype)
    dh = rand(rng, shape, dtype)[0] if residual else None

    def make(impl):
        def f(x, gamma, beta, r, dy, dh):
            if kind == "rms":
                fn = lambda a, g_, b_, r_: te_ops.rms_norm(  # noqa: E731
                    a, g_, residual=r_, eps=eps, zero_centered_gamma=zc, implementation=impl
                )
            else:
                fn = lambda a, g_, b_, r_: te_ops.layer_norm(  # noqa: E731
                    a, g_, b_, residual=r_, eps=eps, zero_centered_gamma=zc, implementation=impl
                )
            out, vjp = jax.vjp(fn, x, gamma, beta, r)
            return out, vjp(te_ops.NormOutput(dy, dh) if residual else dy)

        return f

    args = (x, gamma, beta, r, dy, dh)
    (out, grads), (out_ref, grads_ref) = run_impl(v, make, *args), run_reference(make, *args)
    what = f"{kind}_norm ({row}, residual={residual}, zc={zc}, eps={eps})"
    if residual:
        close(out.y, out_ref.y, dtype, f"{what} y")
        same(out.h, out_ref.h, f"{what} h = x + residual")
    else:
        close(out, out_ref, dtype, f"{what} y")
    dx, dgamma, dbeta, dres = grads
    dx_r, dgamma_r, dbeta_r, dres_r = grads_ref
    close(dx, dx_r, dtype, f"{what} dx")
    if residual:
        close(dres, dres_r, dtype, f"{what} dresidual")
    close(dgamma, dgamma_r, pdt, f"{what} dgamma")
    if kind == "layer":
        close(dbeta, dbeta_r, pdt, f"{what} dbeta")


# ----------------------------------------------------------------------------------------------
# router (native): E <= 1024, topk <= 32, num_groups <= 32, topk // group_topk <= 16 (tests/property
# draws inside these); the aux loss needs E >= 1
# ----------------------------------------------------------------------------------------------

ROUTER_VARIANTS = _variants(("native", "native", _family("fused_topk_with_score_function", "native"), None, None))


def _router_make(op):
    """(outputs, dlogits) of ``op(logits, impl)`` with cotangent g on the float output(s)."""

    def make(impl):
        def f(x, g):
            out, vjp = jax.vjp(lambda a: op(a, impl), x)
            cts = tuple(g if jnp.issubdtype(o.dtype, jnp.floating) else _cot(o) for o in out)
            return out, vjp(cts)[0]

        return f

    return make


@pytest.mark.parametrize("v", ROUTER_VARIANTS)
@fuzz_gpu()
@given(**{**TOPK_ARGS, "dtype": GPU_FLOATS})
def test_fused_topk_with_score_function(v, cfg, t, pre, with_bias, sf, compact, ties, dtype, seed):
    e, topk, score_function, num_groups, group_topk = cfg
    ties = ties and group_topk is None  # group scores that tie are not ordered by the spec
    rng = np.random.default_rng(seed)
    x, _ = _logits(rng, t, e, dtype, ties)
    bias = None
    if with_bias and score_function == "sigmoid":
        b64 = rng.integers(-2, 3, (e,)) / 4.0 if ties else 0.1 * rng.standard_normal(e)
        bias = jnp.asarray(np.float32(b64), jnp.float32)
    g = jnp.asarray(rng.standard_normal((t, e)), jnp.float32).astype(dtype)

    def op(a, impl):
        return te_ops.fused_topk_with_score_function(
            a, topk, score_function=score_function, use_pre_softmax=pre, num_groups=num_groups,
            group_topk=group_topk, scaling_factor=sf, expert_bias=bias, compact_routing_map=compact,
            implementation=impl,
        )  # fmt: skip

    make = _router_make(op)
    ((probs, rmap), dl), ((probs_r, rmap_r), dl_r) = run_impl(v, make, x, g), run_reference(make, x, g)
    what = f"router topk (E={e} k={topk} {score_function} pre={pre} groups={num_groups}/{group_topk} ties={ties})"
    same(rmap, rmap_r, f"{what} routing map (ties to the smaller expert index)")
    close(probs, probs_r, dtype, f"{what} probs")
    close(dl, dl_r, dtype, f"{what} dlogits")


@pytest.mark.parametrize("v", ROUTER_VARIANTS)
@fuzz_gpu()
@given(**{**AUX_SCORES_ARGS, "dtype": GPU_FLOATS})
def test_compute_routing_scores_for_aux_loss(v, e, t, k_frac, score_function, ties, dtype, seed):
    topk = max(1, min(e, int(round(k_frac * e))))
    rng = np.random.default_rng(seed)
    x, _ = _logits(rng, t, e, dtype, ties)
    g = jnp.asarray(rng.standard_normal((t, e)), jnp.float32).astype(dtype)

    def op(a, impl):
        return te_ops.compute_routing_scores_for_aux_loss(a, topk, score_function=score_function, implementation=impl)

    make = _router_make(op)
    ((rmap, scores), dl), ((rmap_r, scores_r), dl_r) = run_impl(v, make, x, g), run_reference(make, x, g)
    same(rmap, rmap_r, f"aux-loss routing map (E={e} k={topk} {score_function})")
    close(scores, scores_r, dtype, "aux-loss scores")
    close(dl, dl_r, dtype, "aux-loss scores dlogits")


def _aux_loss_make(tpe, topk, coeff):
    def make(impl):
        def f(p, g):
            loss, vjp = jax.vjp(
                lambda a: te_ops.fused_moe_aux_loss(a, tpe, topk=topk, coeff=coeff, implementation=impl), p
            )
            return loss, vjp(g)[0]

        return f

    return make


@pytest.mark.parametrize("v", ROUTER_VARIANTS)
@fuzz_gpu()
@given(**{**AUX_LOSS_ARGS, "e": AUX_LOSS_ARGS["e"].filter(lambda e: e >= 1), "dtype": GPU_FLOATS})
def test_fused_moe_aux_loss(v, e, t, topk, coeff, tpe_dtype, dtype, seed):
    rng = np.random.default_rng(seed)
    probs = jnp.asarray(rng.random((t, e)), jnp.float32).astype(dtype)
    tpe = jnp.asarray(rng.integers(0, 3 * max(t, 1), (e,)).astype(tpe_dtype))
    g = jnp.asarray(rng.standard_normal(), dtype)
    make = _aux_loss_make(tpe, topk, coeff)
    (loss, dp), (loss_r, dp_r) = run_impl(v, make, probs, g), run_reference(make, probs, g)
    close(loss, loss_r, dtype, f"aux loss (T={t} E={e} coeff={coeff})")
    close(dp, dp_r, dtype, "aux loss dprobs")


@needs(_family("fused_topk_with_score_function", "native"))
@fuzz_gpu(CONSTRAINT_EXAMPLES)
@given(t=TOPK_ARGS["t"], e=st.integers(33, 64), data=st.data(), dtype=GPU_FLOATS, seed=seeds)
def test_router_outside_native_constraints(t, e, data, dtype, seed):
    """topk > 32 (topk) and E == 0 (aux loss): implementation="native" is refused with the reason;
    implementation=None falls back to the reference."""
    topk = data.draw(st.integers(router_native.MAX_TOPK + 1, e), label="topk")
    rng = np.random.default_rng(seed)
    x, _ = _logits(rng, t, e, dtype, False)
    g = jnp.asarray(rng.standard_normal((t, e)), jnp.float32).astype(dtype)
    why = router_native.topk_unsupported_reason(dtype=x.dtype, shape=x.shape, topk=topk)

    def op(a, impl):
        return te_ops.fused_topk_with_score_function(a, topk, score_function="softmax", implementation=impl)

    make = _router_make(op)
    expect_refused(why, f"topk <= {router_native.MAX_TOPK}", lambda: jax.jit(make("native"))(x, g))
    close_tree(jax.jit(make(None))(x, g), run_reference(make, x, g), dtype, "implementation=None (the reference)")

    probs = jnp.zeros((t, 0), dtype)
    tpe = jnp.zeros((0,), jnp.int32)
    why = router_native.loss_unsupported_reason(dtype=probs.dtype, shape=probs.shape)
    make = _aux_loss_make(tpe, 2, 0.1)
    gl = jnp.asarray(1.0, dtype)
    expect_refused(why, "E >= 1", lambda: jax.jit(make("native"))(probs, gl))
    loss, dp = jax.jit(make(None))(probs, gl)
    assert float(loss) == 0.0 and dp.shape == (t, 0)


# ----------------------------------------------------------------------------------------------
# token_dispatch / token_combine (triton, gluon) and sort_chunks_by_index (triton): E <= 4096,
# T * E < 2**31; a zero-size axis runs the reference (documented: nothing for a kernel to do)
# ----------------------------------------------------------------------------------------------

PERM_VARIANTS = _variants(
    ("triton", "triton", _family("token_dispatch", "triton"), None, None),
    ("gluon", "gluon", _family("token_dispatch", "gluon"), None, None),
)


def _dispatch_make(rmap, num_out, align, with_probs):
    def make(impl):
        def f(x, probs, gy, gp, y, mp, g0, g1):
            def dispatch(a, p):
                r = te_ops.token_dispatch(a, rmap, num_out, probs=p, align_size=align, implementation=impl)
                return (r.out, r.permuted_probs), r

            _, vjp, res = jax.vjp(dispatch, x, probs, has_aux=True)
            dx, dp = vjp((gy, gp))
            combined = []
            for weighted, g in ((False, g0), (True, g1)):

                def combine(yy, m, weighted=weighted):
                    return te_ops.token_combine(yy, res.row_id_map, merging_probs=m if weighted else None,
                                                implementation=impl)  # fmt: skip

                c, cvjp = jax.vjp(combine, y, mp)
                combined.append((c, *cvjp(g)))
            return res, dx, dp, combined

        return f

    return make


@pytest.mark.parametrize("v", PERM_VARIANTS)
@fuzz_gpu()
@given(**{**DISPATCH_ARGS, "dtype": GPU_FLOATS}, capacity=st.sampled_from(CAPACITIES))
def test_token_dispatch_and_combine(v, capacity, rk, h, align, with_probs, dtype, seed):
    rmap, topk = rk
    t, e = rmap.shape
    rng = np.random.default_rng(seed)
    routed = int(rmap.sum())
    num_out = {"exact": t * topk, "short": routed // 2, "long": routed + 5, "zero": 0}[capacity]
    n = perm_ref.out_rows(num_out, e, align)
    x, _ = rand(rng, (t, h), dtype)
    probs = rand(rng, (t, e), F32)[0] if with_probs else None
    gy, _ = rand(rng, (n, h), dtype)
    gp = rand(rng, (n,), F32)[0] if with_probs else None
    y, _ = rand(rng, (n, h), dtype)
    mp, _ = rand(rng, (t, e), F32)
    g0, _ = rand(rng, (t, h), dtype)
    g1, _ = rand(rng, (t, h), dtype)
    make = _dispatch_make(jnp.asarray(rmap), num_out, align, with_probs)
    args = (x, probs, gy, gp, y, mp, g0, g1)
    (res, dx, dp, comb), (res_r, dx_r, dp_r, comb_r) = run_impl(v, make, *args), run_reference(make, *args)
    what = f"token_dispatch (T={t} E={e} H={h} capacity={capacity} N={n} align={align})"
    for field in res._fields:
        a, b = getattr(res, field), getattr(res_r, field)
        if b is None:
            assert a is None, f"{what} {field}"
        else:
            same(a, b, f"{what} {field}")  # copies, maps and counts: exact
    close(dx, dx_r, dtype, f"{what} dx")
    if with_probs:
        same(dp, dp_r, f"{what} dprobs")
    for weighted, (c, dy, dmp), (c_r, dy_r, dmp_r) in zip((False, True), comb, comb_r, strict=True):
        close(c, c_r, dtype, f"token_combine (weighted={weighted})")
        close(dy, dy_r, dtype, f"token_combine dy (weighted={weighted})")
        if weighted:
            close(dmp, dmp_r, F32, "token_combine dmerging_probs")


@pytest.mark.parametrize("v", _variants(("triton", "triton", _family("sort_chunks_by_index", "triton"), None, None)))
@fuzz_gpu()
@given(**{**SORT_ARGS, "dtype": GPU_FLOATS})
def test_sort_chunks_by_index(v, n, h, sizes, perm_seed, dtype, seed):
    rng = np.random.default_rng(seed)
    order = np.random.default_rng(perm_seed).permutation(len(sizes))
    x, _ = rand(rng, (n, h), dtype)
    g, _ = rand(rng, (n, h), dtype)
    split, idx = jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32)

    def make(impl):
        def f(x, g):
            (out, rid), vjp = jax.vjp(lambda a: te_ops.sort_chunks_by_index(a, split, idx, implementation=impl), x)
            return out, rid, vjp((g, _cot(rid)))[0]

        return f

    for name, a, b in zip(("out", "row_id_map", "dx"), run_impl(v, make, x, g), run_reference(make, x, g), strict=True):
        same(a, b, f"sort_chunks_by_index {name} (sizes {sizes}, order {order.tolist()})")


@needs(_family("token_dispatch", "triton"))
@fuzz_gpu(CONSTRAINT_EXAMPLES)
@given(t=st.integers(1, 4), e=st.integers(perm_tri.MAX_EXPERTS + 1, perm_tri.MAX_EXPERTS + 8),
       h=DISPATCH_ARGS["h"].filter(bool), dtype=GPU_FLOATS, seed=seeds)  # fmt: skip
def test_token_dispatch_outside_triton_constraints(t, e, h, dtype, seed):
    """More than 4096 experts: implementation="triton" / "gluon" are refused with the reason;
    implementation=None falls back to the reference."""
    rng = np.random.default_rng(seed)
    rmap = np.zeros((t, e), bool)
    rmap[np.arange(t), rng.integers(0, e, t)] = True
    x, _ = rand(rng, (t, h), dtype)
    why = perm_tri.unsupported_reason(dtype=x.dtype, num_tokens=t, num_experts=e, num_rows=t)

    def make(impl):
        return lambda x: te_ops.token_dispatch(x, jnp.asarray(rmap), t, implementation=impl)

    for impl in ("triton", "gluon"):
        if DRYRUN or _family("token_dispatch", impl)() is None:
            expect_refused(why, f"up to {perm_tri.MAX_EXPERTS} experts", lambda impl=impl: jax.jit(make(impl))(x))
    close_tree(jax.jit(make(None))(x), run_reference(make, x), dtype, "implementation=None (the reference)")


# ----------------------------------------------------------------------------------------------
# fp8 quantize (triton): power-of-two blocks of at most 128 x 128 elements; bytes and scales equal to
# the reference on the CPU. No backward (quantization has no gradient).
#
# XLA:CPU flushes float32 subnormals (the strict xfails in tests/property/test_fp8_props.py): where
# that changes the CPU reference's result (a subnormal scale_inv, or subnormal inputs the spec's scale
# lifts into FP8 range, or a subnormal amax), the reference is not the spec's and the case is skipped.
# ----------------------------------------------------------------------------------------------

TINY = np.float32(2.0**-126)  # the smallest normal float32


def _blocks(x32: np.ndarray, block) -> np.ndarray:
    """[..., nr, nc, br * bc] blocks of the last two axes (zero padding), or [1, 1, size] (per tensor)."""
    if block is None:
        return x32.reshape(1, 1, -1)
    br, bc = block
    r, c = x32.shape[-2:]
    nr, nc = -(-r // br), -(-c // bc)
    pad = [(0, 0)] * (x32.ndim - 2) + [(0, nr * br - r), (0, nc * bc - c)]
    xb = np.pad(x32, pad).reshape(*x32.shape[:-2], nr, br, nc, bc)
    return np.moveaxis(xb, -3, -2).reshape(*x32.shape[:-2], nr, nc, br * bc)


def ftz_sensitive(x32: np.ndarray, block, fmt: str, margin: int, power_of_2: bool) -> bool:
    """Whether flushing float32 subnormals changes the quantization of x (per tensor or per block)."""
    if x32.size == 0:
        return False
    xb = _blocks(x32, block)
    scale = np_scale(np_amax(xb, axis=-1), fmt, margin, power_of_2)
    with np.errstate(divide="ignore"):
        sinv = (np.float32(1) / scale).astype(np.float32)
    if np.any((sinv != 0) & (np.abs(sinv) < TINY)):
        return True
    subnormal = np.any((xb != 0) & (np.abs(xb) < TINY), axis=-1)
    return bool(np.any(subnormal & (scale >= np.float32(2.0**100))))


def same_quantized(got, want, what: str) -> None:
    assert got.block == want.block and got.dtype == want.dtype, f"{what}: {got.block} {got.dtype}, {want.block}"
    assert_same_fp8(got.data, np.asarray(want.data), f"{what} data")
    assert_same_f32(got.scale_inv, np.asarray(want.scale_inv, np.float32), f"{what} scale_inv")


FP8_QUANT_VARIANTS = _variants(("triton", "triton", _fp8_triton, None, None))


def _quantize_make(recipe, role, state=None):
    def make(impl):
        if state is None:
            return lambda x: fp8.quantize(x, recipe, role, implementation=impl)
        return lambda x, st: fp8.quantize(x, recipe, role, st, implementation=impl)

    return make


@pytest.mark.parametrize("v", FP8_QUANT_VARIANTS)
@fuzz_gpu()
@given(**CURRENT_ARGS)
def test_fp8_quantize_current_scaling(v, shape, dtype, formats, role, margin, power_of_2, special, seed):
    rng = np.random.default_rng(seed)
    x, x32 = make_x(rng, tuple(shape), dtype, special)
    assume(not ftz_sensitive(x32, None, fmt_name(formats, role), margin, power_of_2))
    make = _quantize_make(fp8.CurrentScaling(formats=formats, margin=margin, power_of_2=power_of_2), role)
    same_quantized(run_impl(v, make, x), run_reference(make, x, cpu=True), f"current scaling ({special})")


def _triton_block(block) -> bool:
    return fp8_tri.unsupported_reason(block=block) is None


@pytest.mark.parametrize("v", FP8_QUANT_VARIANTS)
@fuzz_gpu()
@given(**{**BLOCK_ARGS, "block": BLOCK_ARGS["block"].filter(lambda b: b is None or _triton_block(b))})
def test_fp8_quantize_block_scaling(v, lead, r, c, block, dtype, formats, role, power_of_2, special, seed):
    rng = np.random.default_rng(seed)
    x, x32 = make_x(rng, (*lead, r, c), dtype, special)
    if block is None:  # the DeepSeek-V3 defaults
        recipe = fp8.BlockScaling(formats=formats, power_of_2=power_of_2)
    else:
        recipe = fp8.BlockScaling(formats=formats, act_block=block, weight_block=block[::-1], power_of_2=power_of_2)
    assume(not ftz_sensitive(x32, recipe.block(role), fmt_name(formats, role), 0, power_of_2))
    make = _quantize_make(recipe, role)
    same_quantized(run_impl(v, make, x), run_reference(make, x, cpu=True), f"block scaling {recipe.block(role)}")


def same_state(got, want, what: str) -> None:
    """amax histories exact; next scales within 1 ulp (XLA's float32 division on the GPU)."""
    np.testing.assert_array_equal(np.asarray(got.amax_history), np.asarray(want.amax_history), f"{what} history")
    got_scale, want_scale = np.asarray(got.scale), np.asarray(want.scale)
    np.testing.assert_allclose(got_scale, want_scale, rtol=2.0**-23, atol=0, err_msg=f"{what} scale")


@pytest.mark.parametrize("v", FP8_QUANT_VARIANTS)
@fuzz_gpu()
@given(**DELAYED_ARGS, algo=st.sampled_from(DELAYED_ALGOS))
def test_fp8_quantize_delayed_scaling(v, algo, shape, history_len, hist_kind, formats, role, margin, special, dtype,
                                      seed):  # fmt: skip
    (x, x32), recipe, state, _ = delayed_inputs(np.random.default_rng(seed), algo, shape, history_len, hist_kind,
                                                formats, margin, special, dtype)  # fmt: skip
    amax = np_amax(x32)
    assume(not (0 < amax < TINY))  # a subnormal amax: the CPU reference records 0 (flush to zero)
    make = _quantize_make(recipe, role, state)
    (q, new), (q_r, new_r) = run_impl(v, make, x, state), run_reference(make, x, state, cpu=True)
    same_quantized(q, q_r, f"delayed scaling ({algo}, {hist_kind})")
    same_state(new, new_r, "delayed scaling state")


@fuzz_gpu(CONSTRAINT_EXAMPLES)
@given(**{**BLOCK_ARGS, "block": st.sampled_from([(3, 5), (256, 128), (12, 8), (128, 256)])})
def test_fp8_quantize_outside_triton_constraints(lead, r, c, block, dtype, formats, role, power_of_2, special, seed):
    """Blocks that are not powers of two or larger than 128 x 128: implementation="triton" raises the
    documented ValueError (at trace time, on any platform); implementation=None quantizes with the
    reference."""
    rng = np.random.default_rng(seed)
    x, _ = make_x(rng, (*lead, r, c), dtype, special)
    recipe = fp8.BlockScaling(formats=formats, act_block=block, weight_block=block[::-1], power_of_2=power_of_2)
    with pytest.raises(ValueError, match="power-of-two blocks of at most 128 x 128"):
        fp8.quantize(x, recipe, role, implementation="triton")
    make = _quantize_make(recipe, role)
    same_quantized(jax.jit(make(None))(x), run_reference(make, x), "implementation=None (the reference)")


# ----------------------------------------------------------------------------------------------
# fp8_dense (triton, xla): GPU-only generator (the CPU one checks the reference). Triton with block scaling takes
# 1 x 128 / 128 x 128 blocks only; its GEMM is the Gluon kernel where K % 16 == 0 and N % 8 == 0
# (16-byte TMA rows), the tiled Triton kernel elsewhere ("triton-gluon" draws such K and N);
# "tiled" / "persistent" force the other Triton GEMM kernels. "xla" takes current / delayed scaling.
# Smooth activations (GELU, SiLU) only with M, N >= 128: the fused activation backward's libdevice
# derivative differs from XLA's CPU one in a few last ulps, which can move one FP8 byte of dz, and
# with short sums one such byte is more than the tolerance.
# ----------------------------------------------------------------------------------------------

FP8_DTYPES = st.sampled_from([BF16, F16, F32])
FP8_LEAD = st.lists(size(64, sizes=(1, 2, 3, 17, 64)), min_size=1, max_size=2)  # x's leading axes
FP8_K = size(320, sizes=(1, 16, 100, 128, 129, 256, 300))
FP8_N = size(200, sizes=(1, 8, 16, 130, 136, 200))
FP8_FORMATS = st.sampled_from(["e4m3", "hybrid"])
BLOCK_RECIPES = st.builds(fp8.BlockScaling, formats=FP8_FORMATS, power_of_2=st.booleans())
CURRENT_RECIPES = st.builds(fp8.CurrentScaling, formats=FP8_FORMATS, margin=st.sampled_from([0, 0, 1]),
                            power_of_2=st.booleans(), fast_accumulation=st.booleans())  # fmt: skip
DELAYED_RECIPES = st.builds(fp8.DelayedScaling, formats=FP8_FORMATS, history_len=st.sampled_from([1, 2, 5]),
                            margin=st.sampled_from([0, 1]), amax_compute_algo=st.sampled_from(DELAYED_ALGOS),
                            fast_accumulation=st.booleans())  # fmt: skip
ALL_RECIPES = st.one_of(BLOCK_RECIPES, CURRENT_RECIPES, DELAYED_RECIPES)
PER_TENSOR_RECIPES = st.one_of(CURRENT_RECIPES, DELAYED_RECIPES)
SMOOTH = ("gelu", "gelu_tanh", "silu")
FP8_ACTIVATIONS = st.sampled_from([None, None, "relu", *SMOOTH])


def _override(**kw):
    return lambda: fp8_tri.kernel_override(**kw)


FP8_DENSE_VARIANTS = _variants(
    ("triton-gluon", "triton", _fp8_gluon, None, dict(recipes=ALL_RECIPES, k=FP8_K.map(_up(16)), n=FP8_N.map(_up(8)))),
    ("triton-tiled", "triton", _fp8_triton, _override(dense="tiled"), dict(recipes=BLOCK_RECIPES)),
    ("triton-persistent", "triton", _fp8_triton, _override(dense="persistent"), dict(recipes=BLOCK_RECIPES)),
    ("xla", "xla", _fp8_triton, None, dict(recipes=PER_TENSOR_RECIPES)),
)


def _fp8_state(rng, recipe, tensors, groups=None):
    """A DenseScalingState for (x, w, g) with random histories and scales near each tensor's
    fmax / amax (w: one state per expert with ``groups``)."""

    def one(t, role, lead=()):
        fmax = 57344.0 if recipe.format(role) == fp8.E5M2 else 448.0
        amax = np.max(np.abs(as64(t)).reshape(*lead, -1), axis=-1)
        scale = fmax / np.maximum(amax, 1e-3) / np.exp2(rng.integers(0, 3, lead))
        hist = np.abs(rng.standard_normal((*lead, recipe.history_len))) * np.exp2(rng.integers(-4, 4))
        return fp8.DelayedScalingState(jnp.asarray(hist, F32), jnp.asarray(scale, F32))

    x, w, g = tensors
    return fp8.DenseScalingState(one(x, "x"), one(w, "w", () if groups is None else (groups,)), one(g, "g"))


def _fp8_gemm_inputs(rng, recipe, lead, k, n, dtype, *, groups=None, w_std=1.0, bias=None):
    """One FP8 GEMM case's inputs, in this order from ``rng``: x [*lead, K], the kernel [K, N] (one per
    expert, [G, K, N], with ``groups``) of standard deviation w_std / sqrt(K), the bias [N] (``bias``:
    None for none, "random", or "+-3": +-3 entries), the cotangent dy [*lead, N], and for delayed
    scaling a DenseScalingState (else None). Returns (x, w, bias, dy, state)."""
    x, _ = rand(rng, (*lead, k), dtype)
    w, _ = rand(rng, (k, n) if groups is None else (groups, k, n), dtype, w_std / np.sqrt(k))
    if bias == "+-3":
        b = jnp.asarray(3.0 * np.sign(rng.standard_normal(n) + 1e-9), dtype)
    else:
        b = rand(rng, (n,), dtype)[0] if bias == "random" else None
    dy, _ = rand(rng, (*lead, n), dtype)
    state = _fp8_state(rng, recipe, (x, w, dy), groups) if isinstance(recipe, fp8.DelayedScaling) else None
    return x, w, b, dy, state


def fp8_close(got, want, tol: float, what: str) -> None:
    """Within ``tol`` times the largest reference value (rtol 0), no NaN (unwritten output)."""
    _same_kind(got, want, what)
    a, e = as64(got), as64(want)
    assert not np.isnan(a).any(), f"{what}: NaN (unwritten poisoned element?)"
    np.testing.assert_allclose(a, e, rtol=0, atol=tol * float(np.max(np.abs(e), initial=0.0)), err_msg=what)


def _fp8_dense_args(data, recipes, k_st, n_st):
    recipe = data.draw(recipes, label="recipe")
    activation = data.draw(FP8_ACTIVATIONS, label="activation")
    if activation in SMOOTH:
        lead, n = [data.draw(st.integers(128, 300), label="M")], data.draw(n_st.filter(lambda n: n >= 128), label="N")
    else:
        lead, n = data.draw(FP8_LEAD, label="lead"), data.draw(n_st, label="N")
    k = data.draw(k_st, label="K")
    dtype = data.draw(FP8_DTYPES, label="dtype")
    has_bias = data.draw(st.booleans(), label="bias")
    rng = np.random.default_rng(data.draw(seeds, label="seed"))
    # With an activation: z = x @ w + bias kept away from 0 (bias +-3, x @ w of std 0.25), as in
    # tests/gpu/test_fp8_gpu.py: the GPU's and the CPU's GEMMs round z differently, and a z within that
    # rounding of 0 would flip ReLU's derivative.
    bias_kind = "+-3" if activation is not None else "random" if has_bias else None
    w_std = 0.25 if activation else 1.0
    x, w, bias, dy, state = _fp8_gemm_inputs(rng, recipe, lead, k, n, dtype, w_std=w_std, bias=bias_kind)
    return recipe, activation, dtype, (x, w, bias, state, dy)


def _fp8_dense_make(recipe, activation):
    def make(impl):
        def f(x, w, b, st, dy):
            if st is None:
                fn = lambda x, w, b: fp8.fp8_dense(x, w, recipe, bias=b, activation=activation, implementation=impl)  # noqa: E731
                y, vjp = jax.vjp(fn, x, w, b)
            else:
                fn = lambda x, w, b, s: fp8.fp8_dense(  # noqa: E731
                    x, w, recipe, bias=b, state=s, activation=activation, implementation=impl
                )
                y, vjp = jax.vjp(fn, x, w, b, st)
            return y, vjp(dy)

        return f

    return make


def _check_fp8_gemm(got, want, recipe, tol, names, what):
    """(y, gradients) of an FP8 GEMM against the reference's: y and the gradients ``names`` within
    ``tol`` (fp8_close; a None gradient must be None), and for delayed scaling the updated state (the
    state's cotangent, the gradient after them) by same_state."""
    (y, grads), (y_r, grads_r) = got, want
    fp8_close(y, y_r, tol, f"{what} y")
    for name, a, e in zip(names, grads[: len(names)], grads_r[: len(names)], strict=True):
        if e is None:
            assert a is None, name
        else:
            fp8_close(a, e, tol, f"{what} {name}")
    if isinstance(recipe, fp8.DelayedScaling):  # the updated state is the state's cotangent
        for role in ("x", "w", "g"):
            same_state(getattr(grads[len(names)], role), getattr(grads_r[len(names)], role), f"{what} state.{role}")


def _check_fp8_dense(got, want, recipe, activation, what):
    _check_fp8_gemm(got, want, recipe, 2e-2 if activation else 1e-2, ("dx", "dkernel", "dbias"), what)


@pytest.mark.parametrize("v", FP8_DENSE_VARIANTS)
@fuzz_gpu()
@given(data=st.data())
def test_fp8_dense(v, data):
    recipe, activation, dtype, args = _fp8_dense_args(data, v.opts["recipes"], v.opts.get("k", FP8_K),
                                                      v.opts.get("n", FP8_N))  # fmt: skip
    make = _fp8_dense_make(recipe, activation)
    what = f"fp8_dense ({recipe}, {activation}, x {args[0].shape} {jnp.dtype(dtype).name}, K={args[1].shape})"
    _check_fp8_dense(run_impl(v, make, *args), run_reference(make, *args, cpu=True), recipe, activation, what)


@needs(_fp8_triton)
@fuzz_gpu(CONSTRAINT_EXAMPLES)
@given(data=st.data())
def test_fp8_dense_outside_triton_constraints(data):
    """Block scaling with other blocks: implementation="triton" and "xla" raise the documented
    ValueError (any platform), implementation=None runs the reference. K % 16 != 0 or N % 8 != 0 with
    the Gluon GEMM asked for: the documented fallback to the tiled kernel, with the reference's result."""
    act_block = data.draw(st.sampled_from([(1, 64), (1, 32), (2, 128), (1, 128)]), label="act_block")
    wb = data.draw(st.sampled_from([64, 32, 128]), label="weight_block")
    assume((act_block, wb) != ((1, 128), 128))
    other = fp8.BlockScaling(act_block=act_block, weight_block=(wb, wb))
    _, activation, dtype, args = _fp8_dense_args(data, st.just(other), FP8_K, FP8_N)
    x, w = args[0], args[1]
    with pytest.raises(ValueError, match=r"implementation='triton' takes CurrentScaling, DelayedScaling, or Block"):
        fp8.fp8_dense(x, w, other, implementation="triton")
    with pytest.raises(ValueError, match="XLA has no block-scaled FP8 GEMM"):
        fp8.fp8_dense(x, w, other, implementation="xla")
    make = _fp8_dense_make(other, activation)
    _check_fp8_dense(jax.jit(make(None))(*args), run_reference(make, *args), other, activation, "implementation=None")

    # The Gluon GEMM outside its K / N rule: the tiled kernel runs instead.
    k_st = FP8_K.filter(lambda k: k % 16)
    n_st = data.draw(st.sampled_from([FP8_N, FP8_N.filter(lambda n: n % 8)]), label="N strategy")
    recipe, activation, dtype, args = _fp8_dense_args(data, BLOCK_RECIPES, k_st, n_st)
    k, n = args[1].shape
    if not DRYRUN and fp8_tri.gluon_gemm_unavailable_reason() is None:  # Gluon runs here, but not this call
        why = fp8_tri.gluon_gemm_unavailable_reason(k, n, dtype)
        assert why is not None and ("K % 16" in why or "N % 8" in why), why
    make = _fp8_dense_make(recipe, activation)
    v = Variant("triton", _override(dense="gluon"))
    _check_fp8_dense(run_impl(v, make, *args), run_reference(make, *args, cpu=True), recipe, activation,
                     f"fp8_dense Gluon fallback (K={k}, N={n})")  # fmt: skip


# ----------------------------------------------------------------------------------------------
# fp8_grouped_dense (triton): tests/property's grouped_dense cases (every size kind), K and N from the
# FP8 sizes above (no zero-size axes: not defined for the FP8 ops), G <= 1024. The grouped GEMM is the
# Gluon kernel where K % 16 == 0 and N % 8 == 0 ("triton-gluon" draws those), else the Triton kernel
# ("triton-kernel" forces it everywhere); the weight gradient has one Triton kernel.
# ----------------------------------------------------------------------------------------------

FP8_GROUPED_VARIANTS = _variants(
    ("triton-gluon", "triton", _fp8_gluon, None, dict(k=FP8_K.map(_up(16)), n=FP8_N.map(_up(8)))),
    ("triton-kernel", "triton", _fp8_triton, _override(grouped="triton"), dict(k=FP8_K, n=FP8_N)),
)


def _fp8_grouped_make(recipe):
    return lambda impl: grouped_vjp(recipe, impl)


@pytest.mark.parametrize("v", FP8_GROUPED_VARIANTS)
@fuzz_gpu()
@given(data=st.data())
def test_fp8_grouped_dense(v, data):
    cases = _grouped_cases(v.opts["k"], v.opts["n"], FP8_DTYPES, m=GROUPED_M.filter(bool))
    kind, m, k, n, g, sizes, dtype, _, seed = data.draw(cases, label="case")
    recipe = data.draw(ALL_RECIPES, label="recipe")
    x, w, _, dy, state = _fp8_gemm_inputs(np.random.default_rng(seed), recipe, (m,), k, n, dtype, groups=g)
    gs = jnp.asarray(np.asarray(sizes, np.int64).astype(np.int32))
    make = _fp8_grouped_make(recipe)
    args = (x, w, gs, state, dy)
    what = f"fp8_grouped_dense ({recipe}, {kind} sizes {sizes}, M={m} K={k} N={n} {jnp.dtype(dtype).name})"
    _check_fp8_gemm(run_impl(v, make, *args), run_reference(make, *args, cpu=True), recipe, 1e-2, ("dx", "dkernels"),
                    what)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# fused_attention (native: cuDNN): GPU-only generator. bf16 / f16, head dim a multiple of 8 up to 256
# (the op's rule; cuDNN may refuse more: then the native call must be refused with cuDNN's reason),
# odd sequence lengths, GQA / MQA head counts, no mask or causal.
# ----------------------------------------------------------------------------------------------


ATTENTION_DTYPES = st.sampled_from([BF16, F16])


@st.composite
def attention_case(draw, dtypes=ATTENTION_DTYPES):
    b = draw(st.integers(1, 3), label="B")
    sq = draw(size(160, sizes=(1, 3, 17, 64, 77, 127, 129)), label="Sq")
    sk = draw(size(160, sizes=(1, 5, 33, 64, 100, 131)), label="Sk")
    hk = draw(st.sampled_from([1, 2, 4]), label="Hk")
    hq = hk * draw(st.sampled_from([1, 2, 4]), label="Hq / Hk")
    d = draw(st.sampled_from([8, 16, 32, 40, 64, 72, 96, 128, 160, 256]), label="D")
    mask_type = draw(st.sampled_from(["none", "causal"]), label="mask_type")
    return b, sq, sk, hq, hk, d, mask_type, draw(dtypes, label="dtype"), draw(seeds, label="seed")


def _attention_inputs(b, sq, sk, hq, hk, d, dtype, seed):
    rng = np.random.default_rng(seed)
    q, _ = rand(rng, (b, sq, hq, d), dtype)
    k, _ = rand(rng, (b, sk, hk, d), dtype)
    v, _ = rand(rng, (b, sk, hk, d), dtype)
    g, _ = rand(rng, (b, sq, hq, d), dtype)
    return q, k, v, g


def _attention_make(mask_type):
    def make(impl):
        def f(q, k, v, g):
            out, vjp = jax.vjp(lambda q, k, v: te_ops.fused_attention(q, k, v, mask_type=mask_type,
                                                                      implementation=impl), q, k, v)  # fmt: skip
            return out, vjp(g)

        return f

    return make


def _rel_err(a, e) -> float:
    """Relative Frobenius error, with a floor of 1e-2 RMS under the reference's norm (a gradient that
    is 0 in exact arithmetic, e.g. dq with one visible key, is not compared relative to 0)."""
    a, e = as64(a), as64(e)
    assert not np.isnan(a).any(), "NaN in the native result (unwritten poisoned element or cuDNN NaN)"
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-2 * math.sqrt(max(e.size, 1))))


@pytest.mark.parametrize("v", _variants(("native", "native", _family("fused_attention", "native"), None, None)))
@fuzz_gpu()
@given(case=attention_case())
def test_fused_attention(v, case):
    b, sq, sk, hq, hk, d, mask_type, dtype, seed = case
    q, k, vv, g = _attention_inputs(b, sq, sk, hq, hk, d, dtype, seed)
    make = _attention_make(mask_type)
    if not DRYRUN:
        call = dict(dtype=q.dtype, q_shape=q.shape, k_shape=k.shape, v_shape=vv.shape, mask_type=mask_type,
                    scale=1 / math.sqrt(d), dropout_rate=0.0)  # fmt: skip
        why = fa_native.unsupported_reason(**call)
        if why is not None:  # cuDNN refuses this configuration: the native call says so
            expect_refused(why, why[:40], lambda: jax.jit(make("native"))(q, k, vv, g))
            return
    out, grads = run_impl(v, make, q, k, vv, g)
    f32 = [a.astype(F32) for a in (q, k, vv, g)]
    with jax.default_matmul_precision("highest"):  # a float32 (not TF32) reference
        want, want_grads = run_reference(make, *f32)
    tol = ATTENTION_REL_TOL[jnp.dtype(dtype)]
    what = f"fused_attention (B={b} Sq={sq} Sk={sk} Hq={hq} Hk={hk} D={d} {mask_type} {jnp.dtype(dtype).name})"
    assert out.dtype == q.dtype and out.shape == want.shape, what
    assert _rel_err(out, want) < tol, (what, "out", _rel_err(out, want))
    for name, a, e in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert a.dtype == q.dtype and a.shape == e.shape, (what, name)
        assert _rel_err(a, e) < 2 * tol, (what, name, _rel_err(a, e))


@needs(_family("fused_attention", "native"))
@fuzz_gpu(CONSTRAINT_EXAMPLES)
@given(case=attention_case(dtypes=st.just(F32)), pad=st.sampled_from([1, 4, 7]))
def test_fused_attention_outside_native_constraints(case, pad):
    """float32 with implementation="native": refused with the reason (implementation=None runs the
    reference); a head dim that is not a multiple of 8: the op's ValueError, for every implementation."""
    b, sq, sk, hq, hk, d, mask_type, dtype, seed = case
    q, k, vv, g = _attention_inputs(b, sq, sk, hq, hk, d, dtype, seed)
    why = fa_native.unsupported_reason(dtype=q.dtype, q_shape=q.shape, k_shape=k.shape, v_shape=vv.shape)
    make = _attention_make(mask_type)
    expect_refused(why, "bfloat16 and float16", lambda: jax.jit(make("native"))(q, k, vv, g))
    close_tree(jax.jit(make(None))(q, k, vv, g), run_reference(make, q, k, vv, g), dtype, "implementation=None")
    bad = [jnp.pad(a, ((0, 0),) * 3 + ((0, pad),)) for a in (q, k, vv)]
    for impl in ("native", "reference", None):
        with pytest.raises(ValueError, match="must be a multiple of 8 and at most 256"):
            te_ops.fused_attention(*bad, mask_type=mask_type, implementation=impl)
