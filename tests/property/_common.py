"""Shared pieces of the property-based tests: hypothesis settings, shape strategies, random arrays
drawn from a hypothesis-chosen seed, dtype rounding in numpy, and the comparison helper.

The expected values in tests/property are written in plain numpy (float64) from docs/semantics.md,
independently of te_ops' reference modules. Comparisons use the project's one tolerance table
(te_ops._core.testing.TOLERANCES) for the dtype the op ran in.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from te_ops._core.testing import TOLERANCES

# Deterministic in CI: no example database, derandomized generation, no per-example deadline (each new
# shape compiles a new XLA program on the CPU).
SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def fuzz(max_examples: int = 20):
    """The hypothesis settings every property test uses, with a fixed small number of examples."""
    return settings(max_examples=max_examples, **SETTINGS)


# Sizes that hit the usual tail cases: 1, odd, prime, around powers of two, not multiples of 128.
EDGE_SIZES = (1, 2, 3, 5, 7, 8, 13, 16, 31, 33, 63, 64)
WIDE_SIZES = EDGE_SIZES + (127, 129)


def size(max_size: int = 64, *, min_size: int = 1, sizes=EDGE_SIZES):
    """A dimension: mostly from the edge list, sometimes any integer in range."""
    edge = [s for s in sizes if min_size <= s <= max_size]
    return st.one_of(st.sampled_from(edge), st.integers(min_size, max_size))


seeds = st.integers(0, 2**32 - 1)
float_dtypes = st.sampled_from([jnp.float32, jnp.bfloat16])


def np_dtype(dtype):
    """The numpy (ml_dtypes) dtype of a jnp float dtype."""
    return {
        jnp.dtype(jnp.float32): np.dtype(np.float32),
        jnp.dtype(jnp.bfloat16): np.dtype(ml_dtypes.bfloat16),
        jnp.dtype(jnp.float16): np.dtype(np.float16),
    }[jnp.dtype(dtype)]


def round_to(a, dtype) -> np.ndarray:
    """``a`` rounded (to nearest even) to ``dtype`` via float32, returned as float64."""
    return np.asarray(np.asarray(a, np.float32).astype(np_dtype(dtype)), np.float64)


def rand(rng: np.random.Generator, shape, dtype, scale: float = 1.0):
    """Normal random values rounded to ``dtype``: (jnp array of dtype, the same values as float64)."""
    v = round_to(scale * rng.standard_normal(shape), dtype)
    return jnp.asarray(v.astype(np.float32)).astype(dtype), v


def as64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def check_close(actual, expected, dtype, *, what: str = "", scale: float | None = None) -> None:
    """``actual`` (op output) against the float64 numpy ``expected`` with the tolerance of ``dtype``.

    atol is multiplied by the magnitude of the expected values (at least 1), so unnormalised outputs
    (GEMMs, gradients) are compared relative to their size. NaNs must sit exactly where expected."""
    a = as64(actual)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    rtol, atol = TOLERANCES[jnp.dtype(dtype)]
    if scale is None:
        finite = e[np.isfinite(e)]
        scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN positions differ")
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * scale, equal_nan=True, err_msg=what)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(z):
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def gelu_grad(z):
    return 0.5 * (1.0 + _erf(z / math.sqrt(2.0))) + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(z):
    return 0.5 * z * (1.0 + np.tanh(_C * (z + 0.044715 * z**3)))


def gelu_tanh_grad(z):
    t = np.tanh(_C * (z + 0.044715 * z**3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * z * z)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


# name -> (f, f') in float64
ACTIVATIONS = {
    None: (lambda z: z, lambda z: np.ones_like(z)),
    "relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(np.float64)),
    "silu": (lambda z: z * sigmoid(z), lambda z: sigmoid(z) * (1.0 + z * (1.0 - sigmoid(z)))),
    "gelu": (gelu, gelu_grad),
    "gelu_tanh": (gelu_tanh, gelu_tanh_grad),
}
