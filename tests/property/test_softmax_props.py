"""Softmax family against a numpy formulation of docs/semantics.md ("Softmax family"), forward and
backward, on fuzzed shapes, masks, scales and non-finite inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import te_ops
from tests.property._common import as64, check_close, float_dtypes, fuzz, rand, seeds, size

IMPL = "reference"
scales = st.sampled_from([1.0, 0.125, 0.37, 2.0, -0.5, 0.0])


def np_softmax(x64: np.ndarray, removed: np.ndarray, scale: float) -> np.ndarray:
    """Rules 1-5 of the spec, row by row over the last axis, in float64 (z from float32 x)."""
    with np.errstate(invalid="ignore"):
        z = np.float64(scale) * x64  # 0 * inf is NaN, as in float32
    live = ~np.broadcast_to(removed, z.shape)
    diverge = np.any(live & (np.isnan(z) | (z == np.inf)), axis=-1, keepdims=True)
    fin = live & np.isfinite(z)
    empty = ~np.any(fin, axis=-1, keepdims=True)
    zz = np.where(fin, z, -np.inf)
    m = np.max(np.where(empty, 0.0, zz), axis=-1, keepdims=True)
    e = np.where(fin, np.exp(np.where(fin, z, 0.0) - np.where(empty, 0.0, m)), 0.0)
    y = e / np.where(empty, 1.0, e.sum(-1, keepdims=True))
    y = np.where(diverge & live, np.nan, y)
    return np.where(empty & ~diverge, 0.0, y)


def np_softmax_grad(y: np.ndarray, g: np.ndarray, scale: float) -> np.ndarray:
    """dx = scale * y * (g - sum(y * g)) where y != 0; 0 (and left out of the sum) where y == 0."""
    nz = y != 0
    gy = np.where(nz, g * y, 0.0)
    return np.where(nz, scale * y * (np.where(nz, g, 0.0) - gy.sum(-1, keepdims=True)), 0.0)


def _poison(rng, x64, frac_neginf, frac_nan):
    x64 = x64.copy()
    u = rng.random(x64.shape)
    x64[u < frac_neginf] = -np.inf
    x64[(u >= frac_neginf) & (u < frac_neginf + frac_nan)] = np.nan
    return x64


# The strategies of each test and the helpers that draw a case's inputs (*_softmax_inputs), importable:
# tests/gpu/test_property_gpu.py draws from them too.
SCALED_SOFTMAX_ARGS = dict(
    lead=st.lists(size(5), min_size=0, max_size=2),
    s=size(129, sizes=(1, 2, 3, 7, 13, 31, 64, 127, 129)),
    dtype=float_dtypes,
    scale=scales,
    special=st.sampled_from(["finite", "neginf", "nan_inf"]),
    seed=seeds,
)


def scaled_softmax_inputs(rng, lead, s, dtype, special):
    """x and the cotangent g of one drawn scaled_softmax case, each as (jnp array, float64 values).
    ``special`` "neginf": -inf entries (acting as removed), the first row entirely -inf; "nan_inf":
    NaN, -inf and +inf entries."""
    shape = (*lead, s)
    _, x64 = rand(rng, shape, dtype, 3.0)
    if special == "neginf":  # -inf acts as removed; some rows entirely -inf -> 0
        x64 = _poison(rng, x64, 0.3, 0.0)
        if x64.ndim > 1:
            x64[(0,) * (x64.ndim - 1)] = -np.inf
    elif special == "nan_inf":
        x64 = _poison(rng, x64, 0.1, 0.02)
        x64[rng.random(shape) < 0.02] = np.inf
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    return (x, x64), rand(rng, shape, dtype)


@fuzz(30)
@given(**SCALED_SOFTMAX_ARGS)
def test_scaled_softmax(lead, s, dtype, scale, special, seed):
    rng = np.random.default_rng(seed)
    shape = (*lead, s)
    (x, x64), (g, g64) = scaled_softmax_inputs(rng, lead, s, dtype, special)
    y = te_ops.scaled_softmax(x, scale, implementation=IMPL)
    assert y.dtype == jnp.dtype(dtype) and y.shape == shape
    exp = np_softmax(x64, np.zeros(shape, bool), scale)
    check_close(y, exp, dtype, what="scaled_softmax forward")

    if special == "nan_inf":
        return  # gradients of diverging rows are NaN by rule 2; checked on the finite cases
    _, vjp = jax.vjp(lambda a: te_ops.scaled_softmax(a, scale, implementation=IMPL), x)
    (dx,) = vjp(g)
    assert dx.dtype == jnp.dtype(dtype)
    check_close(dx, np_softmax_grad(as64(y), g64, scale), dtype, what="scaled_softmax dx")


MASKED_SOFTMAX_ARGS = dict(
    b=size(3),
    n=size(3),
    sq=size(17, sizes=(1, 2, 3, 7, 13, 17)),
    sk=size(129, sizes=(1, 2, 3, 7, 31, 64, 127, 129)),
    bcast=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    mask_rank=st.integers(1, 4),
    density=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    dtype=float_dtypes,
    scale=scales,
    nan_masked=st.booleans(),
    seed=seeds,
)


def masked_softmax_inputs(rng, b, n, sq, sk, bcast, mask_rank, density, dtype, nan_masked):
    """mask_in (the mask passed to the op: rank ``mask_rank`` where its leading axes are 1, else
    rank 4), full (the mask broadcast to x's shape), x and the cotangent g of one drawn
    scaled_masked_softmax case, each as (jnp array, float64 values). With ``sq > 1`` and no broadcast
    over Sq the first row is entirely removed; with ``nan_masked`` removed positions of x hold NaN /
    +inf; g is NaN at every removed position."""
    shape = (b, n, sq, sk)
    mshape4 = tuple(1 if bc else d for bc, d in zip(bcast, shape[:3], strict=True)) + (sk,)
    mask = rng.random(mshape4) < density
    if sq > 1 and not bcast[2]:
        mask[..., 0, :] = True  # a fully removed row
    mask_in = mask.reshape(mshape4[4 - mask_rank :]) if all(d == 1 for d in mshape4[: 4 - mask_rank]) else mask
    x, x64 = rand(rng, shape, dtype, 3.0)
    full = np.broadcast_to(mask, shape)
    if nan_masked:  # rule 1: whatever x holds at a removed position (NaN, +inf) does not matter
        x64 = np.where(full & (rng.random(shape) < 0.5), np.nan, x64)
        x64 = np.where(full & (rng.random(shape) < 0.2), np.inf, x64)
        x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    # NaN in g at positions whose output is 0 must not leak (left out of the row sum).
    _, g64 = rand(rng, shape, dtype)
    g64 = np.where(full, np.nan, g64)
    g = jnp.asarray(g64.astype(np.float32)).astype(dtype)
    return mask_in, full, (x, x64), (g, g64)


@fuzz(30)
@given(**MASKED_SOFTMAX_ARGS)
def test_scaled_masked_softmax(b, n, sq, sk, bcast, mask_rank, density, dtype, scale, nan_masked, seed):
    rng = np.random.default_rng(seed)
    mask_in, full, (x, x64), (g, g64) = masked_softmax_inputs(rng, b, n, sq, sk, bcast, mask_rank, density, dtype,
                                                              nan_masked)  # fmt: skip
    y = te_ops.scaled_masked_softmax(x, jnp.asarray(mask_in), scale, implementation=IMPL)
    exp = np_softmax(x64, full, scale)
    check_close(y, exp, dtype, what="scaled_masked_softmax forward")
    assert np.all(as64(y)[full] == 0), "removed positions must be exactly 0"

    # Backward: g is NaN where the output is 0 (must not leak).
    _, vjp = jax.vjp(lambda a: te_ops.scaled_masked_softmax(a, jnp.asarray(mask_in), scale, implementation=IMPL), x)
    (dx,) = vjp(g)
    check_close(dx, np_softmax_grad(as64(y), g64, scale), dtype, what="scaled_masked_softmax dx")


CAUSAL_SOFTMAX_ARGS = dict(
    lead=st.lists(size(4), min_size=0, max_size=2),
    s=size(65, sizes=(1, 2, 3, 5, 7, 13, 31, 33, 64, 65)),
    dtype=float_dtypes,
    scale=scales,
    neginf=st.booleans(),
    seed=seeds,
)


def causal_softmax_inputs(rng, lead, s, dtype, neginf):
    """causal_removed ([s, s], True above the diagonal), x and the cotangent g of one drawn
    scaled_upper_triang_masked_softmax case, each as (jnp array, float64 values). x holds NaN at
    random removed positions, and -inf entries with ``neginf``."""
    shape = (*lead, s, s)
    _, x64 = rand(rng, shape, dtype, 3.0)
    causal_removed = np.triu(np.ones((s, s), bool), k=1)
    # Garbage above the diagonal must not matter (rule 1).
    x64 = np.where(causal_removed & (rng.random(shape) < 0.5), np.nan, x64)
    if neginf:
        x64 = _poison(rng, x64, 0.3, 0.0)
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype)
    return causal_removed, (x, x64), rand(rng, shape, dtype)


@fuzz(25)
@given(**CAUSAL_SOFTMAX_ARGS)
def test_scaled_upper_triang_masked_softmax(lead, s, dtype, scale, neginf, seed):
    rng = np.random.default_rng(seed)
    causal_removed, (x, x64), (g, g64) = causal_softmax_inputs(rng, lead, s, dtype, neginf)
    y = te_ops.scaled_upper_triang_masked_softmax(x, scale, implementation=IMPL)
    exp = np_softmax(x64, causal_removed, scale)
    check_close(y, exp, dtype, what="scaled_upper_triang_masked_softmax forward")

    _, vjp = jax.vjp(lambda a: te_ops.scaled_upper_triang_masked_softmax(a, scale, implementation=IMPL), x)
    (dx,) = vjp(g)
    check_close(dx, np_softmax_grad(as64(y), g64, scale), dtype, what="causal softmax dx")


EMPTY_SOFTMAX_ARGS = dict(shape=st.sampled_from([(0,), (3, 0), (0, 5), (2, 0, 7)]), dtype=float_dtypes)


@fuzz(10)
@given(**EMPTY_SOFTMAX_ARGS)
def test_softmax_empty_axes(shape, dtype):
    x = jnp.zeros(shape, dtype)
    y = te_ops.scaled_softmax(x, 0.5, implementation=IMPL)
    assert y.shape == shape and y.dtype == jnp.dtype(dtype)
