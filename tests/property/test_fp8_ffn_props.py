"""te_ops.fp8.fp8_dispatch_ffn (the FP8 block-scaled expert FFN) against a numpy formulation of
docs/semantics.md ("FP8 expert FFN as one op"): tokens quantized in 1 x 128 row tiles, dispatched
expert-major in token order, the first GEMM on the dequantized FP8 operands rounded to x's dtype, the
activation in float32 rounded to x's dtype, quantized in 1 x 128 row tiles, the second GEMM rounded
to x's dtype; rows that hold no token are zero. Random token counts (1, odd, routed nowhere),
widths that are not multiples of 128, 1 to 4 experts, gated or not, three activations."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from te_ops import fp8
from tests.property._common import fuzz, seeds, size
from tests.property.test_fp8_props import np_amax, np_cast, np_scale

BF16 = ml_dtypes.bfloat16


def _q_rows(a32: np.ndarray) -> np.ndarray:
    """a [R, C] quantized in 1 x 128 row tiles (E4M3, power-of-two scales) and dequantized (float64)."""
    out = np.zeros(a32.shape, np.float64)
    for j in range(0, a32.shape[1], 128):
        blk = a32[:, j : j + 128]
        s = np_scale(np_amax(blk, axis=1), "e4m3", 0, True)[:, None]
        out[:, j : j + 128] = np_cast(blk, s, "e4m3").astype(np.float64) / s
    return out


def _q_blocks(w32: np.ndarray) -> np.ndarray:
    """w [..., R, C] in 128 x 128 blocks (E4M3, power-of-two scales), dequantized (float64)."""
    out = np.zeros(w32.shape, np.float64)
    for i in range(0, w32.shape[-2], 128):
        for j in range(0, w32.shape[-1], 128):
            blk = w32[..., i : i + 128, j : j + 128]
            s = np_scale(np_amax(blk, axis=(-2, -1)), "e4m3", 0, True)[..., None, None]
            out[..., i : i + 128, j : j + 128] = np_cast(blk, s, "e4m3").astype(np.float64) / s
    return out


def _act(z: np.ndarray, activation) -> np.ndarray:
    if activation == "relu":
        return np.maximum(z, 0)
    if activation == "silu":
        return z / (1 + np.exp(-z))
    return z


@fuzz(3)
@example(t=33, h=200, e=3, f=136, gated=True, activation="silu", seed=5)  # always: gated SiLU, partial tiles
@example(t=7, h=64, e=4, f=64, gated=False, activation="relu", seed=6)
@given(
    t=size(40),
    h=st.sampled_from([64, 128, 200]),
    e=st.integers(1, 4),
    f=st.sampled_from([64, 128, 136]),
    gated=st.booleans(),
    activation=st.sampled_from([None, "relu", "silu"]),
    seed=seeds,
)
def test_fp8_dispatch_ffn_forward_against_numpy(t, h, e, f, gated, activation, seed):
    rng = np.random.default_rng(seed)
    k = min(2, e)
    x32 = rng.standard_normal((t, h)).astype(BF16).astype(np.float32)
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k], True, axis=1)
    rm[rng.random(t) < 0.2] = False  # tokens routed nowhere
    wi32 = (rng.standard_normal((e, h, 2 * f if gated else f)) / np.sqrt(h)).astype(BF16).astype(np.float32)
    wo32 = (rng.standard_normal((e, f, h)) / np.sqrt(f)).astype(BF16).astype(np.float32)
    n = t * k
    got = fp8.fp8_dispatch_ffn(jnp.asarray(x32, jnp.bfloat16), jnp.asarray(rm), n, jnp.asarray(wi32, jnp.bfloat16),
                               jnp.asarray(wo32, jnp.bfloat16), activation=activation, gated=gated,
                               implementation="reference")  # fmt: skip
    # numpy: quantize the tokens once, dispatch expert-major in token order, two GEMMs per expert
    xq = _q_rows(x32)
    wiq, woq = _q_blocks(wi32), _q_blocks(wo32)
    want = np.zeros((n, h), np.float32)
    row = 0
    for ex in range(e):
        tok = np.flatnonzero(rm[:, ex])
        hh = (xq[tok] @ wiq[ex]).astype(np.float32).astype(BF16).astype(np.float32)
        a = _act(hh[:, :f], activation) * hh[:, f:] if gated else _act(hh, activation)
        a = a.astype(np.float32).astype(BF16).astype(np.float32)
        want[row : row + tok.size] = (_q_rows(a) @ woq[ex]).astype(np.float32).astype(BF16).astype(np.float32)
        row += tok.size
    got32 = np.asarray(got.out, np.float32)
    assert got.out.shape == (n, h) and got.out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.tokens_per_expert), rm.sum(0))
    assert not got32[row:].any(), "rows that hold no token must be zero"
    # the GEMMs' float32 summation order may move a bf16 rounding of h, and with it one FP8 step of
    # an element of a: a few percent of one term, within 2% of the output's scale
    err = float(np.max(np.abs(got32 - want))) if n else 0.0
    assert err <= 2e-2 * max(float(np.max(np.abs(want))) if n else 0.0, 1e-6), err
