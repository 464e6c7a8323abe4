"""te_ops.fp8.dact_dbias_quantize, token_dispatch_quantized and fp8_dispatch_grouped_dense
(implementation="reference") against a numpy formulation of docs/semantics.md ("FP8 quantization": fp8_dense's
``activation=`` paragraph; "FP8 token dispatch"; "Token permutation"), with the scale and cast helpers of
test_fp8_props.py, the capacity rule of test_permutation_props.py and the GEMM-operand quantization of
test_fp8_gemm_props.py.

dact_dbias_quantize: dz = dy * act'(z) in float32 for every activation, quantized as the gradient (role "g": act_block
tiles or one scale), dz^T in weight blocks (block scaling) or the exact FP8 transpose (per tensor), and dbias = the
float32 column sum of dz in dy's dtype. Without an activation and with ReLU dz is exact, and the FP8 bytes and float32
inverse scales are compared byte for byte (NaN / Inf / zeros / all-zero tiles / outliers in dy and z). The smooth
derivatives (GELU, tanh-GELU, SiLU) are evaluated by XLA in float32 (within a few ulps of (1 + |z|) of the float64
derivative, as test_fp8_gemm_props.py measured), so there numpy bounds dz elementwise: each block's inverse scale must
be byte-equal where that interval fixes it (within the scales of its smallest and largest possible amax elsewhere),
and each byte must be byte-equal where every dz in its interval and every possible scale give the same byte, and lie
between the extreme bytes elsewhere (FP8 rounding is monotone).

token_dispatch_quantized: the dispatched FP8 rows and scale rows byte for byte: equal to the numpy quantization of the
dispatched high-precision tensor (1 x 128 tiles; per tensor with x's scale), padding and unused rows FP8 zeros with
inverse scale 1, every kept row's bytes and scales moved unchanged (also for raw random bytes, NaN patterns and any
float32 scale value included), and token_dispatch's row_id_map, tokens_per_expert, pad_offsets and num_dropped.

fp8_dispatch_grouped_dense: y, dx, dkernels (and the delayed state) against numpy: x quantized once before the
dispatch (1 x 128 tiles, or one scale from the amax over all T tokens, dropped and unrouted ones included), the
grouped GEMM over tokens_per_expert, dy in 1 x 128 tiles (or one scale over all N rows), dx summed over each token's
kept rows, dW from x^T requantized in 1 x 128 tiles along N from the dequantized dispatched rows (block) or the exact
FP8 transpose (per tensor) and dy^T in 128 x 128 blocks. GEMMs multiply the dequantized operands in float64 and are
compared with the project's tolerance for the dtype they are returned in.

Shapes: M, N, T, H and the output width 0, 1, odd, prime, > 128, non-multiples of 128; routing maps with E 0..16,
empty experts, every token on one expert, tokens routed to no expert, top-k 1..E, capacities exact / short (drops) /
long / 0, align_size padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from te_ops import fp8
from te_ops.fp8.reference import QuantizedTensor
from tests.property._common import ACTIVATIONS, as64, check_close, fuzz, np_dtype, rand, seeds, size
from tests.property.test_dense_props import _group_bounds
from tests.property.test_fp8_gemm_props import (
    ACT_ULPS,
    BLOCK_RECIPES,
    CURRENT_RECIPES,
    DEFAULT_BLOCK_RECIPES,
    DELAYED_RECIPES,
    DTYPES,
    Spec,
    _amax,
    _block_amax,
    _specs,
    _spread,
    check_state,
    make_state,
    np_quantize,
)
from tests.property.test_fp8_props import (
    FMAX,
    NP_FMT,
    assert_same_f32,
    assert_same_fp8,
    fmt_name,
    make_x,
    np_amax,
    np_cast,
    np_scale,
)
from tests.property.test_permutation_props import CAPACITIES, np_dispatch, routing

IMPL = "reference"
F32 = np.float32
F64 = np.float64
FLT_MIN = F32(np.finfo(F32).tiny)
SPECIALS = ("plain", "zeros", "all_zero", "nonfinite", "outlier", "small")


def _inputs(rng, shape, dtype, special):
    """make_x (values over 2^-60 .. 2^60, the requested special values) with float32 subnormals flushed to 0: XLA:CPU
    reads them as 0 (docs/semantics.md, "Float32 subnormals"), which the tests of test_fp8_props.py pin down."""
    x, x32 = make_x(rng, shape, dtype, special)
    if np.any((x32 != 0) & (np.abs(x32) < FLT_MIN)):
        x32 = np.where(np.abs(x32) < FLT_MIN, F32(0) * x32, x32).astype(F32)
        x = jnp.asarray(x32).astype(dtype)
    return x, x32


def _ftz_amax(fmt: str) -> F32:
    """Below this amax 1 / scale is a float32 subnormal, which XLA:CPU stores as 0 (docs, "Float32 subnormals")."""
    return F32(FMAX[fmt] * 2.0**-125)


# ----------------------------------------------------------------------------------------------
# Quantization of a tensor known exactly or within an elementwise interval
# ----------------------------------------------------------------------------------------------


def check_quantized(q, c, lo, hi, amb, block, fmt, margin, power_of_2, what) -> float:
    """The op's quantized ``q`` of a float32 [R, C] tensor d with lo <= d <= hi elementwise (c: the centre, NaN where
    d is NaN; lo == hi bit for bit: d known exactly) in ``block`` tiles (None: one scale). ``amb``: elements that
    are NaN or +-Inf, either (not compared; their tile's amax is not finite either way). Returns the fraction of the
    compared bytes that the interval fixed (1.0 when d is exact: then every byte and scale is compared exactly)."""
    r, cc = c.shape
    blk = block or (max(r, 1), max(cc, 1))
    assert q.data.shape == c.shape and q.data.dtype == NP_FMT[fmt], f"{what}: data {q.data.dtype} {q.data.shape}"
    sinv = np.asarray(q.scale_inv, F32)
    if block is None:
        assert sinv.shape == (), f"{what}: per-tensor scale_inv has shape {sinv.shape}"
        sinv = sinv.reshape(1, 1)
    else:
        nb = (-(-r // blk[0]), -(-cc // blk[1]))
        assert q.block == tuple(block) and sinv.shape == nb, f"{what}: block {q.block}, scale_inv {sinv.shape}"
    if not c.size:
        if block is None:  # an empty tensor has amax 0: scale 1
            assert_same_f32(sinv, np.ones((1, 1), F32), f"{what}: empty tensor's scale_inv")
        return 1.0
    # Each tile's amax lies between the amaxes of the smallest and largest possible magnitudes; its scale between
    # their scales (the same scale where d is exact).
    big = np.where(amb, F32(np.inf), np.maximum(np.abs(lo), np.abs(hi)))
    small = np.where(amb, F32(np.inf), np.where((lo <= 0) & (hi >= 0), F32(0), np.minimum(np.abs(lo), np.abs(hi))))
    a_hi, a_lo = _block_amax(big, blk), _block_amax(small, blk)
    s_a, s_b = np_scale(a_hi, fmt, margin, power_of_2), np_scale(a_lo, fmt, margin, power_of_2)
    unknown = (a_lo == 0) & (a_hi > 0)  # amax 0 (scale 1) or not (fmax / amax): not compared
    ftz = (a_lo > 0) & (a_lo < _ftz_amax(fmt))  # 1 / scale may be subnormal: XLA:CPU stores 0 (docs); bytes compared
    fixed = (s_a == s_b) & ~unknown & ~ftz
    want = (F32(1) / s_a).astype(F32)
    np.testing.assert_array_equal(sinv[fixed].view(np.uint32), want[fixed].view(np.uint32), f"{what}: scale_inv")
    lo_s, hi_s = (F32(1) / np.maximum(s_a, s_b)).astype(F32), (F32(1) / np.minimum(s_a, s_b)).astype(F32)
    bad = ~unknown & ~ftz & ~((lo_s <= sinv) & (sinv <= hi_s))
    assert not bad.any(), f"{what}: scale_inv {sinv[bad][:4]} outside [{lo_s[bad][:4]}, {hi_s[bad][:4]}]"
    # Each byte lies between the bytes of the corners (lo or hi) x (smallest or largest scale): rounding to FP8 is
    # monotone. Where the four corners give one byte, that byte is the op's.
    s_min, s_max = (_spread(f(s_a, s_b), blk, c.shape) for f in (np.minimum, np.maximum))
    cands = [np_cast(d, s, fmt) for d in (lo, hi) for s in (s_min, s_max)]
    vals = np.stack([v.astype(F64) for v in cands])
    byts = np.stack([v.view(np.uint8) for v in cands])
    got = np.asarray(q.data)
    gv, gb = got.astype(F64), got.view(np.uint8)
    use = ~_spread(unknown, blk, c.shape) & ~amb
    nan = np.isnan(c)
    np.testing.assert_array_equal(np.isnan(gv)[use], nan[use], f"{what}: NaN positions")
    use &= ~nan
    with np.errstate(invalid="ignore"):
        inside = (vals.min(0) <= gv) & (gv <= vals.max(0))
    out = use & ~inside
    assert not out.any(), f"{what}: {out.sum()} bytes outside their interval, {gv[out][:4]} at {np.argwhere(out)[:4]}"
    one = (byts == byts[0]).all(0) & use
    np.testing.assert_array_equal(gb[one], byts[0][one], f"{what}: bytes")
    if np.array_equal(lo.view(np.uint32), hi.view(np.uint32)) and not amb.any():
        assert np.array_equal(one, use), f"{what}: an exact tensor left bytes unfixed"
    return float(one.sum() / max(use.sum(), 1))


# ----------------------------------------------------------------------------------------------
# dact_dbias_quantize
# ----------------------------------------------------------------------------------------------


def act_grad(activation, z32: np.ndarray) -> np.ndarray:
    """act'(z) in float64 (the formulas of docs/semantics.md); tanh-GELU as written there, in float32: z^2 overflows
    for |z| > 1.8e19 and (1 - t^2) * inf is NaN there."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        a = ACTIVATIONS[activation][1](z32.astype(F64))
        if activation == "gelu_tanh":
            a = np.where(np.isinf(z32 * z32), np.nan, a)
    return a


def dz_interval(dy32, z32, activation):
    """(centre, lo, hi, amb) float32: the op's dz = dy * act'(z) lies in [lo, hi]; ``amb``: NaN or +-Inf, either
    (a non-finite dy times an act' that float32 may flush to 0). ReLU and no activation: exact."""
    a = act_grad(activation, z32)
    with np.errstate(over="ignore", invalid="ignore"):
        if activation in (None, "relu"):  # act' is 0 or 1 exactly: the float32 product is the op's
            c = (dy32 * a.astype(F32)).astype(F32)
            return c, c, c, np.zeros(c.shape, bool)
        dy = dy32.astype(F64)
        c = (dy * a).astype(F32)
        slack = np.abs(dy) * ACT_ULPS * (1.0 + np.minimum(np.abs(z32.astype(F64)), 32.0))  # saturated past 32
        lo = np.nextafter((dy * a - slack).astype(F32), F32(-np.inf))
        hi = np.nextafter((dy * a + slack).astype(F32), F32(np.inf))
    tiny = np.minimum(np.abs(lo), np.abs(hi)) < FLT_MIN  # XLA:CPU flushes a subnormal product to 0
    lo, hi = np.where(tiny, np.minimum(lo, F32(0)), lo), np.where(tiny, np.maximum(hi, F32(0)), hi)
    zero = dy32 == 0  # dz is a zero of either sign (act' in float32 may be -0, +0 or tiny where float64 differs)
    lo, hi = np.where(zero, F32(-0.0), lo), np.where(zero, F32(0.0), hi)
    nonfinite = ~np.isfinite(c)  # NaN, or +-Inf times an act' far from 0: the same in float32
    lo, hi = np.where(nonfinite, c, lo).astype(F32), np.where(nonfinite, c, hi).astype(F32)
    amb = ~np.isfinite(dy32) & np.isfinite(a) & (np.abs(a) < 1e-30)
    return c, lo, hi, amb


def _z(rng, shape, dtype, kind):
    """z: "wide" as make_x (2^-60 .. 2^60); otherwise sigma * N(0, 1), sigma 1/8 .. 4, with zeros, NaN / Inf or an
    outlier (x 1e4) for those kinds."""
    if kind == "wide":
        return _inputs(rng, shape, dtype, "plain")
    v = rng.standard_normal(shape) * rng.choice([0.125, 1.0, 4.0])
    if kind == "zeros":
        v[rng.random(shape) < 0.7] = 0.0
    elif kind == "nonfinite":
        u = rng.random(shape)
        v[u < 0.05], v[(u >= 0.05) & (u < 0.1)], v[(u >= 0.1) & (u < 0.13)] = np.inf, -np.inf, np.nan
    elif kind == "outlier" and v.size:
        v.flat[rng.integers(v.size)] *= 1e4
    with np.errstate(over="ignore"):  # an outlier may overflow float16 to inf
        z32 = np.asarray(np.asarray(v, F32).astype(np_dtype(dtype)), F32)
    return jnp.asarray(z32).astype(dtype), z32


DACT_SIZES_M = (0, 1, 2, 3, 7, 13, 31, 127, 128, 129, 131, 200, 257)
DACT_SIZES_N = (0, 1, 2, 5, 17, 37, 127, 128, 129, 200, 300)
# The strategies of each test, importable (tests/gpu can draw from them as from test_fp8_props.py's).
DACT_ARGS = dict(
    recipe={"block": BLOCK_RECIPES, "current": CURRENT_RECIPES},
    m=size(257, min_size=0, sizes=DACT_SIZES_M),
    n=size(300, min_size=0, sizes=DACT_SIZES_N),
    dtype=DTYPES,
    special=st.sampled_from(SPECIALS),  # dy's
    z_kind=st.sampled_from(["moderate", "wide", "zeros", "nonfinite", "outlier"]),
    seed=seeds,
)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dact(dy, z, recipe, activation):
    return fp8.dact_dbias_quantize(dy, z, recipe, activation=activation, implementation=IMPL)


def check_dact(recipe, activation, m, n, dtype, special, z_kind, seed):
    rng = np.random.default_rng(seed)
    dy, dy32 = _inputs(rng, (m, n), dtype, special)
    z, z32 = _z(rng, (m, n), dtype, z_kind)
    q, qt, db = _dact(dy, z, recipe, activation)
    c, lo, hi, amb = dz_interval(dy32, z32, activation)
    fmt = fmt_name(recipe.formats, "g")
    tag = f"{recipe}, {activation}, dy {jnp.dtype(dtype).name} [{m}, {n}] {special}, z {z_kind}"
    if isinstance(recipe, fp8.BlockScaling):
        p2, margin = recipe.power_of_2, 0
        fixed = check_quantized(q, c, lo, hi, amb, recipe.act_block, fmt, margin, p2, f"dz ({tag})")
        check_quantized(qt, c.T, lo.T, hi.T, amb.T, recipe.weight_block, fmt, margin, p2, f"dz^T ({tag})")
    else:
        fixed = check_quantized(q, c, lo, hi, amb, None, fmt, recipe.margin, recipe.power_of_2, f"dz ({tag})")
        assert qt.block is None and qt.data.shape == (n, m), f"dz^T {qt.block} {qt.data.shape}"
        np.testing.assert_array_equal(np.asarray(qt.data).view(np.uint8), np.asarray(q.data).view(np.uint8).T,
                                      f"dz^T is the exact FP8 transpose ({tag})")  # fmt: skip
        assert_same_f32(qt.scale_inv, np.asarray(q.scale_inv, F32), f"dz^T's scale_inv is dz's ({tag})")
    # dbias: the float32 column sum of dz, in dy's dtype; columns holding an element that is NaN or Inf either way
    # are not compared
    assert db.dtype == dy.dtype and db.shape == (n,), f"dbias {db.dtype} {db.shape}"
    with np.errstate(invalid="ignore", over="ignore"):
        e = c.astype(F64).sum(0)
        extra = (hi.astype(F64) - lo).sum(0)
    got = as64(db)
    keep = ~amb.any(0)
    if keep.any():
        with np.errstate(invalid="ignore"):
            e = np.where(np.isfinite(e) & np.isfinite(got), e + np.clip(got - e, -extra, extra), e)
            e = np.asarray(np.asarray(e, F32).astype(np_dtype(dtype)), F64)  # the op's sum is rounded to dy's dtype
        check_close(got[keep], e[keep], dtype, what=f"dbias ({tag})")
    return fixed


@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=str)
@pytest.mark.parametrize("family", ["block", "current"])
@fuzz(5)
@given(data=st.data())
def test_dact_dbias_quantize(family, activation, data):
    args = {name: data.draw(s[family] if isinstance(s, dict) else s, label=name) for name, s in DACT_ARGS.items()}
    check_dact(activation=activation, **args)


DACT_EDGES = [  # (recipe, activation, M, N, dtype, dy special, z kind)
    (fp8.BlockScaling(), "gelu", 0, 129, jnp.bfloat16, "plain", "moderate"),
    (fp8.CurrentScaling(), "silu", 5, 0, jnp.float32, "plain", "moderate"),
    (fp8.CurrentScaling(margin=2), None, 0, 0, jnp.float16, "plain", "moderate"),
    (fp8.BlockScaling(), "relu", 1, 1, jnp.float32, "nonfinite", "nonfinite"),
    (fp8.BlockScaling(formats="hybrid", power_of_2=False), "relu", 257, 300, jnp.bfloat16, "zeros", "wide"),
    (fp8.BlockScaling(), None, 131, 257, jnp.float32, "outlier", "moderate"),  # one 128 x 128 tile holds it
    (fp8.BlockScaling(), "gelu_tanh", 129, 131, jnp.float32, "all_zero", "moderate"),  # scale 1 everywhere
    (fp8.CurrentScaling(formats="e4m3", power_of_2=True), "gelu", 200, 129, jnp.float16, "nonfinite", "zeros"),
    (fp8.BlockScaling(act_block=(3, 5), weight_block=(64, 64)), "silu", 13, 200, jnp.float32, "small", "outlier"),
    (fp8.BlockScaling(act_block=(128, 1), weight_block=(7, 7)), "gelu", 130, 9, jnp.bfloat16, "plain", "wide"),
]


@pytest.mark.parametrize("case", DACT_EDGES, ids=lambda c: f"{type(c[0]).__name__}-{c[1]}-{c[2]}x{c[3]}-{c[5]}")
def test_dact_dbias_quantize_edges(case):
    recipe, activation, m, n, dtype, special, z_kind = case
    check_dact(recipe, activation, m, n, dtype, special, z_kind, seed=13)


def test_dact_smooth_activations_fix_most_bytes():
    """The interval check is not vacuous: on ordinary inputs nearly every byte of dz is fixed."""
    for activation in ("gelu", "gelu_tanh", "silu"):
        for recipe in (fp8.BlockScaling(), fp8.BlockScaling(power_of_2=False), fp8.CurrentScaling()):
            fixed = check_dact(recipe, activation, 64, 256, jnp.float32, "plain", "moderate", seed=5)
            assert fixed > 0.98, f"{recipe}, {activation}: only {fixed:.1%} of the bytes fixed"


def test_dact_dbias_quantize_rejects():
    dy = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(TypeError, match="dact_dbias_quantize: recipe must be a te_ops.fp8 BlockScaling or Current"):
        fp8.dact_dbias_quantize(dy, dy, fp8.DelayedScaling(), implementation=IMPL)
    with pytest.raises(ValueError, match="dact_dbias_quantize: z must have dy's shape and dtype"):
        fp8.dact_dbias_quantize(dy, dy.astype(jnp.bfloat16), fp8.BlockScaling(), implementation=IMPL)
    with pytest.raises(ValueError, match="dact_dbias_quantize: z must have dy's shape"):
        fp8.dact_dbias_quantize(dy, dy[:3], fp8.BlockScaling(), implementation=IMPL)
    with pytest.raises(ValueError, match="dact_dbias_quantize: activation must be one of"):
        fp8.dact_dbias_quantize(dy, dy, fp8.BlockScaling(), activation="tanh", implementation=IMPL)
    with pytest.raises(ValueError, match="dact_dbias_quantize: dy"):
        fp8.dact_dbias_quantize(dy[0], dy[0], fp8.BlockScaling(), implementation=IMPL)


# ----------------------------------------------------------------------------------------------
# token_dispatch_quantized
# ----------------------------------------------------------------------------------------------

TILE = 128


def _raw_q(rng, t, h, fmt, block, dtype):
    """A QuantizedTensor of random bytes (NaN patterns included) and random float32 scale rows (0, -0, subnormal,
    Inf, NaN and negative values included): the dispatch must move all of them unchanged."""
    data = rng.integers(0, 256, (t, h)).astype(np.uint8)
    nc = -(-h // TILE)
    s = (np.abs(rng.standard_normal((t, nc) if block else ())) * np.exp2(rng.integers(-20, 20))).astype(F32)
    odd = np.array([0.0, -0.0, 1e-40, np.inf, np.nan, -3.0], F32)
    if block and s.size:
        pick = rng.random(s.shape) < 0.3
        s[pick] = odd[rng.integers(0, len(odd), int(pick.sum()))]
    q = QuantizedTensor(jnp.asarray(data.view(NP_FMT[fmt])), jnp.asarray(s), (1, TILE) if block else None,
                        jnp.dtype(dtype))  # fmt: skip
    return q, data, s


@functools.partial(jax.jit, static_argnums=(2, 3))
def _tdq(q, rmap, num_out, align):
    return fp8.token_dispatch_quantized(q, rmap, num_out, align_size=align, implementation=IMPL)


TDQ_ARGS = dict(
    rk=routing(),
    capacity=st.sampled_from(CAPACITIES),
    h=size(300, min_size=0, sizes=(0, 1, 2, 3, 7, 127, 128, 129, 200, 257, 300)),
    scaling=st.sampled_from(["block", "block", "current", "delayed", "raw_block", "raw_tensor"]),
    formats=st.sampled_from(["e4m3", "hybrid"]),
    role=st.sampled_from(["x", "g"]),  # hybrid "g": E5M2 rows
    power_of_2=st.booleans(),
    align=st.sampled_from([None, None, 1, 2, 8, 16]),
    dtype=DTYPES,
    special=st.sampled_from(SPECIALS),
    tail=st.sampled_from([1.0, 128.0]),  # tokens with no kept row scaled up: they still set a per-tensor scale
    seed=seeds,
)


def check_tdq(rk, capacity, h, scaling, formats, role, power_of_2, align, dtype, special, tail, seed):
    rmap, topk = rk
    t, e = rmap.shape
    rng = np.random.default_rng(seed)
    fmt = fmt_name(formats, role)
    routed = int(rmap.sum())
    num_out = {"exact": t * topk, "short": routed // 2, "long": routed + 5, "zero": 0}[capacity]
    x32 = None
    if scaling.startswith("raw"):
        q, raw, raw_s = _raw_q(rng, t, h, fmt, scaling == "raw_block", dtype)
    else:
        x, x32 = _inputs(rng, (t, h), dtype, special)
        if tail != 1.0:  # tokens with no kept row: not dispatched, but in the per-tensor amax
            kept = {tok for tok, _ in np_dispatch(rmap, num_out, align)[1]}
            with np.errstate(over="ignore"):
                x32[[tok for tok in range(t) if tok not in kept]] *= F32(tail)
                x32 = np.asarray(x32.astype(np_dtype(dtype)), F32)
            x = jnp.asarray(x32).astype(dtype)
        if scaling == "block":
            recipe, state = fp8.BlockScaling(formats=formats, power_of_2=power_of_2), None
        elif scaling == "current":
            recipe = fp8.CurrentScaling(formats=formats, power_of_2=power_of_2, margin=int(rng.integers(0, 3)))
            state = None
        else:
            recipe = fp8.DelayedScaling(formats=formats, history_len=2)
            prev = F32(np.exp2(rng.integers(-30, 30)) * rng.uniform(1, 2))
            state = fp8.DelayedScalingState(jnp.zeros((2,), jnp.float32), jnp.asarray(prev))
        q = jax.jit(lambda x, st: fp8.quantize(x, recipe, role, st, implementation=IMPL))(x, state)
        q = q[0] if state is not None else q
        raw, raw_s = np.asarray(q.data).view(np.uint8), np.asarray(q.scale_inv, F32)
    res = _tdq(q, jnp.asarray(rmap), num_out, align)
    n, rows, tpe, pad, dropped, rid = np_dispatch(rmap, num_out, align)
    out = res.out
    tag = f"{scaling} {fmt}, T {t} E {e} H {h}, N {n} ({capacity}, align {align}), {special}"

    # token_dispatch's bookkeeping
    np.testing.assert_array_equal(np.asarray(res.row_id_map), rid, err_msg=f"row_id_map ({tag})")
    np.testing.assert_array_equal(np.asarray(res.tokens_per_expert), tpe, err_msg=f"tokens_per_expert ({tag})")
    assert int(res.num_dropped) == dropped, f"num_dropped {int(res.num_dropped)} != {dropped} ({tag})"
    if align is None:
        assert res.pad_offsets is None
    else:
        np.testing.assert_array_equal(np.asarray(res.pad_offsets), pad, err_msg=f"pad_offsets ({tag})")

    # The moved rows, bit for bit: each kept pair's row holds its token's bytes and scale row; every other row
    # holds FP8 zeros and inverse scale 1.
    block = q.block is not None
    assert isinstance(out, QuantizedTensor) and out.block == q.block and out.dtype == q.dtype
    assert out.data.dtype == q.data.dtype and out.data.shape == (n, h), f"out {out.data.dtype} {out.data.shape}"
    want = np.zeros((n, h), np.uint8)
    want_s = np.ones((n, -(-h // TILE)), F32) if block else raw_s
    for (tok, _), r in rows.items():
        want[r] = raw[tok]
        if block:
            want_s[r] = raw_s[tok]
    np.testing.assert_array_equal(np.asarray(out.data).view(np.uint8), want, err_msg=f"moved FP8 bytes ({tag})")
    np.testing.assert_array_equal(np.asarray(out.scale_inv, F32).view(np.uint32), want_s.view(np.uint32),
                                  err_msg=f"moved scale_inv ({tag})")  # fmt: skip
    if x32 is None:
        return
    # ... and they are the quantization of the dispatched high-precision tensor (block: its 1 x 128 tiles; per
    # tensor: x's scale). The inverse scales of tiles in XLA:CPU's flush-to-zero range are not compared (docs,
    # "Float32 subnormals"); the bytes are.
    if not n * h:
        return
    xd = np.zeros((n, h), F32)
    for (tok, _), r in rows.items():
        xd[r] = x32[tok]
    if block:
        blk, amax = (1, TILE), _block_amax(xd, (1, TILE))
        scale = np_scale(amax, fmt, 0, power_of_2)
    else:
        blk, amax = (n, h), np.full((1, 1), np_amax(x32) if x32.size else F32(0))
        scale = np_scale(amax, fmt, recipe.margin, power_of_2) if scaling == "current" else np.full((1, 1), prev, F32)
    if scaling == "delayed":
        amax = np.ones((1, 1), F32)  # the state's scale: a normal 1 / scale
    assert_same_fp8(out.data, np_cast(xd, _spread(scale, blk, xd.shape), fmt),
                    f"dispatched bytes = quantize(dispatched x) ({tag})")  # fmt: skip
    ok = ~((amax > 0) & (amax < _ftz_amax(fmt)))
    got_s = np.asarray(out.scale_inv, F32).reshape(scale.shape)
    assert_same_f32(got_s[ok], (F32(1) / scale).astype(F32)[ok], f"dispatched scale_inv = quantize's ({tag})")


@fuzz(14)
@given(args=st.fixed_dictionaries(TDQ_ARGS))
def test_token_dispatch_quantized(args):
    check_tdq(**args)


TDQ_EDGES = [  # (T, E, routing, capacity, H, scaling, formats, role, power_of_2, align, dtype, special, tail)
    (0, 3, "one", "long", 129, "block", "e4m3", "x", True, None, jnp.bfloat16, "plain", 1.0),  # T = 0
    (5, 4, "mixed", "zero", 7, "block", "hybrid", "g", False, None, jnp.float32, "plain", 1.0),  # N = 0
    (5, 4, "mixed", "zero", 7, "raw_block", "hybrid", "g", False, 16, jnp.float32, "plain", 1.0),  # padding only
    (9, 3, "mixed", "short", 300, "current", "e4m3", "x", False, 8, jnp.float32, "outlier", 128.0),
    (6, 2, "none", "long", 257, "current", "hybrid", "x", True, None, jnp.float16, "plain", 128.0),  # no token routed
    (7, 9, "topk_all", "exact", 3, "delayed", "hybrid", "g", False, 2, jnp.bfloat16, "nonfinite", 1.0),  # top-k = E
    (4, 1, "one", "exact", 0, "block", "e4m3", "x", True, 8, jnp.float32, "plain", 1.0),  # H = 0
    (13, 2, "mixed", "short", 129, "raw_tensor", "hybrid", "g", False, None, jnp.float16, "plain", 1.0),  # E5M2 NaNs
    (8, 3, "mixed", "long", 201, "raw_block", "e4m3", "x", False, 8, jnp.float32, "plain", 1.0),
]


@pytest.mark.parametrize("case", TDQ_EDGES, ids=lambda c: f"T{c[0]}E{c[1]}{c[2]}-{c[3]}-H{c[4]}-{c[5]}")
def test_token_dispatch_quantized_edges(case):
    t, e, kind, *rest = case
    check_tdq(_rmap(t, e, kind), *rest, seed=15)


def test_token_dispatch_quantized_keeps_a_zero_scale_row():
    """A kept row's inverse scale moves unchanged, 0 included: the CPU stores 1 / scale of a row of amax below
    fmax / 2^126 as 0 (docs, "Float32 subnormals"), and the dispatched row must dequantize as the token's does
    (not as FP8 bytes times 1)."""
    x = jnp.asarray(np.array([[1e-37, -2e-37, 3e-37], [1.0, 2.0, 3.0]], F32))
    q = jax.jit(lambda x: fp8.quantize(x, fp8.BlockScaling(power_of_2=False), "x", implementation=IMPL))(x)
    rmap = jnp.asarray(np.array([[False, True], [True, True]]))
    res = _tdq(q, rmap, 4, None)
    sinv = np.asarray(q.scale_inv, F32)
    want = np.stack([sinv[1], sinv[0], sinv[1], np.ones(1, F32)])  # expert 0: token 1; expert 1: tokens 0, 1
    np.testing.assert_array_equal(np.asarray(res.out.scale_inv, F32).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(res.out))[1], np.asarray(fp8.dequantize(q))[0])


def test_token_dispatch_quantized_rejects():
    rmap = jnp.ones((4, 2), bool)
    data = jnp.zeros((4, 256), jnp.float8_e4m3fn)
    qb = QuantizedTensor(data, jnp.ones((1, 2), jnp.float32), (128, 128))  # role "w": 128 x 128 blocks
    with pytest.raises(ValueError, match=r"token_dispatch_quantized: q must be quantized per tensor or in \(1, 128\)"):
        fp8.token_dispatch_quantized(qb, rmap, 8)
    qs = QuantizedTensor(data, jnp.ones((4,), jnp.float32), None)
    with pytest.raises(ValueError, match=r"token_dispatch_quantized: q.scale_inv must be a scalar without blocks"):
        fp8.token_dispatch_quantized(qs, rmap, 8)
    q3 = QuantizedTensor(data[None], jnp.ones((1, 4, 2), jnp.float32), (1, 128))
    with pytest.raises(ValueError, match=r"token_dispatch_quantized: q must be a \[T, H\] quantized tensor"):
        fp8.token_dispatch_quantized(q3, rmap, 8)
    with pytest.raises(TypeError, match="token_dispatch_quantized: q must be a te_ops.fp8.QuantizedTensor"):
        fp8.token_dispatch_quantized(jnp.ones((4, 8)), rmap, 8)
    # token_dispatch's checks (the message names te_ops.token_dispatch, and the argument)
    q = QuantizedTensor(data, jnp.ones((4, 2), jnp.float32), (1, 128))
    for args, exc, name in [
        ((jnp.ones((5, 2), bool), 8), ValueError, "routing_map must have shape"),
        ((jnp.ones((4, 2), jnp.int32), 8), TypeError, "routing_map must be a bool array"),
        ((rmap, -1), ValueError, "num_out_tokens must be >= 0"),
        ((rmap, jnp.int32(8)), TypeError, "num_out_tokens must be a static Python int"),
    ]:
        with pytest.raises(exc, match=name):
            fp8.token_dispatch_quantized(q, *args)
    with pytest.raises(ValueError, match="align_size must be >= 1"):
        fp8.token_dispatch_quantized(q, rmap, 8, align_size=0)


# ----------------------------------------------------------------------------------------------
# fp8_dispatch_grouped_dense
# ----------------------------------------------------------------------------------------------

FUSED_ARGS = dict(
    recipe={"block": DEFAULT_BLOCK_RECIPES, "current": CURRENT_RECIPES, "delayed": DELAYED_RECIPES},
    rk=routing(),
    capacity=st.sampled_from(CAPACITIES),
    h=size(300, min_size=0, sizes=(0, 1, 3, 13, 127, 129, 200, 300)),
    n_out=size(200, min_size=0, sizes=(0, 1, 5, 17, 129, 200)),
    align=st.sampled_from([None, None, 2, 8, 16]),
    dtype=DTYPES,
    master=st.booleans(),  # float32 kernels with a bfloat16 / float16 x
    tail=st.sampled_from([1.0, 1.0, 128.0]),  # tokens with no kept row and dy rows past the groups scaled up
    state=st.sampled_from(["random", "random", "initial"]),
    seed=seeds,
)


def fused_expected(recipe, x32, w32, dy32, rows, n, tpe, scales):
    """float64 y [N, N_out], dx [T, H], dW [E, H, N_out] of the spec's formulation."""
    sp = _specs(recipe, scales)
    block = isinstance(recipe, fp8.BlockScaling)
    qx = np_quantize(x32, sp["x"])  # once, before the dispatch: 1 x 128 tiles, or one scale over all T tokens
    xd = np.zeros((n, x32.shape[1]))
    for (tok, _), r in rows.items():
        xd[r] = qx[tok]
    qw_t = np_quantize(np.swapaxes(w32, 1, 2), sp["w"])  # [E, N_out, H]: 128 x 128 blocks or one scale per expert
    qdy = np_quantize(dy32, sp["g"])  # 1 x 128 tiles, or one scale over all N rows
    if block:  # x^T requantized from the dequantized dispatched rows, 1 x 128 tiles along N; dy^T in 128 blocks
        qx_t = np_quantize(xd.astype(F32).T, Spec(sp["x"].fmt, (1, TILE), 0, recipe.power_of_2))
        qdy_t = np_quantize(dy32.T, sp["gT"])
    else:  # the exact FP8 transposes
        qx_t, qdy_t = xd.T, qdy.T
    y, dxd, dw = np.zeros(dy32.shape), np.zeros(xd.shape), np.zeros(w32.shape)
    for i, (s, e) in enumerate(zip(*_group_bounds(tpe, n), strict=True)):
        y[s:e] = xd[s:e] @ qw_t[i].T
        dxd[s:e] = qdy[s:e] @ qw_t[i]
        dw[i] = qx_t[:, s:e] @ qdy_t[:, s:e].T
    dx = np.zeros(x32.shape)
    for (tok, _), r in rows.items():
        dx[tok] += dxd[r]
    return y, dx, dw


def run_fused(recipe, x, rmap, num_out, w, align, state, dy):
    def f(x, w, state, dy):
        def call(x, w, s=None):
            r = fp8.fp8_dispatch_grouped_dense(x, rmap, num_out, w, recipe, align_size=align, state=s,
                                               implementation=IMPL)  # fmt: skip
            return r.out, r

        if state is None:
            y, vjp, r = jax.vjp(call, x, w, has_aux=True)
        else:
            y, vjp, r = jax.vjp(call, x, w, state, has_aux=True)
        return y, vjp(dy), r

    return jax.jit(f)(x, w, state, dy)


def check_fused(recipe, rk, capacity, h, n_out, align, dtype, master, tail, state_kind, seed):
    rmap, topk = rk
    t, e = rmap.shape
    rng = np.random.default_rng(seed)
    routed = int(rmap.sum())
    num_out = {"exact": t * topk, "short": routed // 2, "long": routed + 5, "zero": 0}[capacity]
    n, rows, tpe, _, _, _ = np_dispatch(rmap, num_out, align)
    w_dtype = jnp.float32 if master and jnp.dtype(dtype) != jnp.float32 else dtype
    x, x64 = rand(rng, (t, h), dtype)
    dy, dy64 = rand(rng, (n, n_out), dtype)
    covered = int(np.sum(tpe))
    kept_tokens = {tok for tok, _ in rows}
    if tail != 1.0:  # no output from them, but they count in x's and dy's amax (current, delayed)
        x64[[tok for tok in range(t) if tok not in kept_tokens]] *= tail
        dy64[covered:] *= tail
        x, dy = (jnp.asarray(v.astype(F32)).astype(dtype) for v in (x64, dy64))
    w, w64 = rand(rng, (e, h, n_out), w_dtype, 1.0 / np.sqrt(max(h, 1)))
    state, scales, hists = None, None, None
    if e == 0:  # no experts: fp8_grouped_dense's rule (G >= 1)
        with pytest.raises(ValueError, match=r"fp8_dispatch_grouped_dense: kernels must have at least one expert"):
            fp8.fp8_dispatch_grouped_dense(x, jnp.asarray(rmap), num_out, w, recipe, implementation=IMPL)
        return
    if isinstance(recipe, fp8.DelayedScaling):
        state, scales, hists = make_state(rng, recipe, state_kind, (x64, w64, dy64), groups=e)

    y, grads, res = run_fused(recipe, x, jnp.asarray(rmap), num_out, w, align, state, dy)
    x32, w32, dy32 = (v.astype(F32) for v in (x64, w64, dy64))
    y_e, dx_e, dw_e = fused_expected(recipe, x32, w32, dy32, rows, n, tpe, scales)
    tag = (f"{recipe}, T {t} E {e} H {h} N_out {n_out}, N {n} ({capacity}, align {align}), x {jnp.dtype(dtype).name}, "
           f"w {jnp.dtype(w_dtype).name}")  # fmt: skip

    np.testing.assert_array_equal(np.asarray(res.tokens_per_expert), tpe, err_msg=f"tokens_per_expert ({tag})")
    assert y.dtype == jnp.dtype(dtype) and y.shape == (n, n_out), f"y {y.dtype} {y.shape}"
    dx, dw = grads[:2]
    assert dx.dtype == x.dtype and dx.shape == x.shape and dw.dtype == w.dtype and dw.shape == w.shape
    check_close(y, y_e, dtype, what=f"fp8_dispatch_grouped_dense y ({tag})")
    check_close(dx, dx_e, dtype, what=f"fp8_dispatch_grouped_dense dx ({tag})")
    check_close(dw, dw_e, w_dtype, what=f"fp8_dispatch_grouped_dense dkernels ({tag})")
    # exactly zero: rows past the groups, tokens with no kept row, the kernels of experts with no row
    assert not np.any(as64(y)[covered:]), "y rows past the groups"
    lost = [tok for tok in range(t) if tok not in kept_tokens]
    assert not np.any(as64(dx)[lost]), f"dx of the tokens with no kept row {lost}"
    assert not np.any(as64(dw)[np.asarray(tpe) == 0]), "dkernels of the experts with no row"
    if state is not None:  # x's amax over all T tokens, one per expert kernel, dy's over all N rows
        amaxes = dict(x=(_amax(x32),) * 2, w=(_amax(w32, (e,)),) * 2, g=(_amax(dy32),) * 2)
        check_state(grads[2], recipe, hists, scales, amaxes, f"fp8_dispatch_grouped_dense ({tag})")


@pytest.mark.parametrize("family", ["block", "current", "delayed"])
@fuzz(6)
@given(data=st.data())
def test_fp8_dispatch_grouped_dense(family, data):
    args = {name: data.draw(s[family] if isinstance(s, dict) else s, label=name) for name, s in FUSED_ARGS.items()}
    args["state_kind"] = args.pop("state")
    check_fused(**args)


def _rmap(t, e, kind):
    m = np.zeros((t, e), bool)
    if kind == "one":
        m[:, e - 1] = True
    elif kind == "topk_all":
        m[:] = True
    elif kind == "none":
        pass
    else:  # token i on expert i % e, and every third token on no expert
        m[np.arange(t), np.arange(t) % e] = True
        m[::3] = False
    return m, max(1, int(m.sum(1).max(initial=0)))


FUSED_EDGES = [  # (recipe, (T, E, routing), capacity, H, N_out, align, dtype, master, tail, state)
    (fp8.BlockScaling(), (0, 3, "one"), "long", 129, 5, None, jnp.bfloat16, False, 1.0, "random"),  # T = 0
    (fp8.BlockScaling(), (7, 2, "one"), "exact", 200, 17, 8, jnp.float32, False, 1.0, "random"),
    (fp8.BlockScaling(formats="hybrid", power_of_2=False), (9, 9, "topk_all"), "exact", 131, 129, None, jnp.float32,
     False, 1.0, "random"),  # top-k = E
    (fp8.BlockScaling(), (5, 4, "mixed"), "zero", 13, 5, None, jnp.bfloat16, False, 1.0, "random"),  # N = 0
    (fp8.BlockScaling(), (5, 4, "mixed"), "zero", 13, 5, 16, jnp.bfloat16, True, 1.0, "random"),  # padding only
    (fp8.CurrentScaling(), (13, 5, "mixed"), "short", 0, 7, 2, jnp.float16, True, 128.0, "random"),  # H = 0
    (fp8.CurrentScaling(margin=1, power_of_2=True), (6, 3, "none"), "long", 7, 3, None, jnp.float32, False, 128.0,
     "random"),  # no token routed: the amax still covers them
    (fp8.CurrentScaling(formats="e4m3"), (4, 2, "mixed"), "exact", 5, 0, None, jnp.float32, False, 1.0, "random"),
    (fp8.DelayedScaling(history_len=2), (11, 3, "mixed"), "short", 130, 129, 8, jnp.bfloat16, True, 128.0, "random"),
    (fp8.DelayedScaling(amax_compute_algo="most_recent"), (1, 1, "one"), "exact", 1, 1, None, jnp.float32, False, 1.0,
     "initial"),
    (fp8.BlockScaling(), (3, 0, "none"), "long", 5, 5, None, jnp.float32, False, 1.0, "random"),  # E = 0
]  # fmt: skip


@pytest.mark.parametrize("case", FUSED_EDGES, ids=lambda c: f"{type(c[0]).__name__}-T{c[1][0]}E{c[1][1]}{c[1][2]}")
def test_fp8_dispatch_grouped_dense_edges(case):
    recipe, (t, e, kind), capacity, h, n_out, align, dtype, master, tail, state_kind = case
    check_fused(recipe, _rmap(t, e, kind), capacity, h, n_out, align, dtype, master, tail, state_kind, seed=14)


def test_fp8_dispatch_grouped_dense_rejects_other_blocks():
    x, w, rmap = jnp.ones((4, 8), jnp.float32), jnp.ones((2, 8, 8), jnp.float32), jnp.ones((4, 2), bool)
    with pytest.raises(ValueError, match="fp8_dispatch_grouped_dense: recipe must be"):
        fp8.fp8_dispatch_grouped_dense(x, rmap, 8, w, fp8.BlockScaling(act_block=(1, 32), weight_block=(32, 32)),
                                       implementation=IMPL)  # fmt: skip
