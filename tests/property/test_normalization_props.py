"""rms_norm / layer_norm against a numpy formulation of docs/semantics.md ("Normalization"):
residual, zero-centred gamma, gamma/beta dtypes independent of x, forward and hand-derived backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import te_ops
from tests.property._common import check_close, float_dtypes, fuzz, rand, round_to, seeds, size

IMPL = "reference"


def np_norm(kind, x64, r64, gamma64, beta64, eps, zc, dtype):
    """Forward in float64: returns (y, h, xhat, rstd, w) with y and h rounded to x's dtype."""
    h = x64 if r64 is None else round_to(x64 + r64, dtype)  # the sum rounded to x's dtype
    n = h.shape[-1]
    mean = h.mean(-1, keepdims=True) if kind == "layer" else np.zeros(h.shape[:-1] + (1,))
    var = ((h - mean) ** 2).sum(-1, keepdims=True) / n
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (h - mean) * rstd
    w = 1.0 + gamma64 if zc else gamma64
    y = xhat * w + (beta64 if kind == "layer" else 0.0)
    return y, h, xhat, rstd, w


def np_norm_grad(kind, xhat, rstd, w, dy64, dh64):
    """dx (= dresidual), dgamma, dbeta per the spec's backward formulas."""
    g = dy64 * w
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    if kind == "layer":
        dx = dx - rstd * g.mean(-1, keepdims=True)
    if dh64 is not None:
        dx = dx + dh64
    lead = tuple(range(xhat.ndim - 1))
    return dx, (dy64 * xhat).sum(lead), dy64.sum(lead)


# The strategies of the test, importable: tests/gpu/test_property_gpu.py draws from them too.
NORM_ARGS = dict(
    kind=st.sampled_from(["rms", "layer"]),
    lead=st.lists(size(9, min_size=0, sizes=(0, 1, 2, 3, 7)), min_size=0, max_size=2),
    h=size(129, sizes=(1, 2, 3, 7, 13, 31, 64, 127, 129)),
    dtype=float_dtypes,
    param_dtype=st.sampled_from([None, jnp.float32, jnp.bfloat16]),
    residual=st.booleans(),
    zc=st.booleans(),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    row=st.sampled_from(["random", "zero_row", "const_row", "big"]),
    seed=seeds,
)


def norm_inputs(rng, lead, h, dtype, param_dtype, residual, zc, row):
    """x, residual, gamma and beta of one drawn case (each as (jnp array, float64 values); residual
    (None, None) without one). ``row`` "big" scales x by 100; "zero_row" / "const_row" make the first
    row of x zero / constant (and the residual's first row zero)."""
    shape = (*lead, h)
    pdt = param_dtype or dtype
    x, x64 = rand(rng, shape, dtype, 100.0 if row == "big" else 1.5)
    if x64.size and x64.ndim > 1 and row in ("zero_row", "const_row"):
        x64[(0,) * (x64.ndim - 1)] = 0.0 if row == "zero_row" else 0.75
        x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    r, r64 = rand(rng, shape, dtype) if residual else (None, None)
    if residual and row in ("zero_row", "const_row") and x64.ndim > 1 and x64.size:
        r64[(0,) * (x64.ndim - 1)] = 0.0
        r = jnp.asarray(r64.astype(np.float32)).astype(dtype)
    gamma = rand(rng, (h,), pdt, 0.5 if zc else 1.0)
    beta = rand(rng, (h,), pdt, 0.5)
    return (x, x64), (r, r64), gamma, beta


@fuzz(40)
@given(**NORM_ARGS)
def test_norm_forward_backward(kind, lead, h, dtype, param_dtype, residual, zc, eps, row, seed):
    rng = np.random.default_rng(seed)
    shape = (*lead, h)
    pdt = param_dtype or dtype
    (x, x64), (r, r64), (gamma, gamma64), (beta, beta64) = norm_inputs(rng, lead, h, dtype, param_dtype, residual,
                                                                        zc, row)  # fmt: skip

    if kind == "rms":
        fn = lambda a, g_, b_, r_: te_ops.rms_norm(  # noqa: E731
            a, g_, residual=r_, eps=eps, zero_centered_gamma=zc, implementation=IMPL
        )
    else:
        fn = lambda a, g_, b_, r_: te_ops.layer_norm(  # noqa: E731
            a, g_, b_, residual=r_, eps=eps, zero_centered_gamma=zc, implementation=IMPL
        )
    out, vjp = jax.vjp(fn, x, gamma, beta, r)
    y_exp, h_exp, xhat, rstd, w = np_norm(kind, x64, r64, gamma64, beta64, eps, zc, dtype)
    if residual:
        y, hh = out
        assert hh.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(hh.astype(jnp.float32)), h_exp.astype(np.float32), "h = x + residual")
    else:
        y = out
    assert y.dtype == jnp.dtype(dtype) and y.shape == shape
    check_close(y, y_exp, dtype, what=f"{kind}_norm y")

    dy, dy64 = rand(rng, shape, dtype)
    if residual:
        dh, dh64 = rand(rng, shape, dtype)
        cot = (dy, dh)
    else:
        dh64, cot = None, dy
    if residual:
        cot = type(out)(*cot)
    dx, dgamma, dbeta, dres = vjp(cot)
    dx_exp, dg_exp, db_exp = np_norm_grad(kind, xhat, rstd, w, dy64, dh64)
    assert dx.dtype == jnp.dtype(dtype) and dgamma.dtype == jnp.dtype(pdt)
    check_close(dx, dx_exp, dtype, what=f"{kind}_norm dx")
    if residual:
        check_close(dres, dx_exp, dtype, what=f"{kind}_norm dresidual")
    # Parameter gradients are float32 sums over the rows, then cast to the parameter's dtype.
    check_close(dgamma, dg_exp, pdt, what=f"{kind}_norm dgamma")
    if kind == "layer":
        check_close(dbeta, db_exp, pdt, what="layer_norm dbeta")
