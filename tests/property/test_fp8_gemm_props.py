"""te_ops.fp8.fp8_dense and fp8_grouped_dense (implementation="reference") against a numpy formulation of
docs/semantics.md ("FP8 quantization": ``fp8_dense``, ``fp8_grouped_dense``), forward and backward.

The numpy side quantizes every GEMM operand as the page says (which tensor, which role and format, which
block orientation: x in act_block tiles, w^T in weight blocks, dz in act_block tiles, x^T in act_block tiles
along M, dz^T in weight blocks; one scale per tensor, per expert for grouped kernels, with current scaling;
the state's scales with delayed scaling), with the scale and cast helpers of test_fp8_props.py, so its FP8
operands are bit-equal to the op's. Each GEMM then multiplies the dequantized operands in float64 where the op
sums in float32, and y, dx, dkernel(s) and dbias are compared with the project's tolerance for the dtype they
are returned in. Delayed scaling also checks the updated state (the cotangent of ``state``): each tensor's amax
at the head of its history, the rest shifted, the next scale from the history.

One place cannot be bit-equal: with an activation, dz = dy * act'(z) comes from the op's float32 GEMM output z
rounded to x's dtype, and act' is evaluated in float32. The numpy backward takes the op's z (the same call
with activation=None, itself compared with the float64 z), which makes ReLU's dz bit-equal; for the smooth
activations it bounds the op's dz elementwise (act' within a few float32 ulps) and carries that interval
through the quantization (the scale from the amax of any dz in it, every rounding either way): each gradient
element gets an extra allowance of |dequantized dz interval| @ |other operand|, zero without an activation.

Shapes: leading axes of x of size 0, 1, odd and > 128; K and N 0, 1, odd, prime, non-multiples of 128 up to
300; G 1 to 6 with empty groups, all rows on one group, sizes summing to less or more than M, negative sizes
and int32 extremes (rows past the groups: 0 in y and dx). Recipes: BlockScaling (1 x 128 / 128 x 128 and
other block shapes, power_of_2 both, e4m3 and hybrid), CurrentScaling (margins, power_of_2), DelayedScaling
(history lengths, both amax algorithms, saturating and initial states); x float32 / bfloat16 / float16;
float32 master kernels; bias None / x's dtype / float32; every activation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from te_ops import fp8
from tests.property._common import ACTIVATIONS, as64, check_close, fuzz, rand, seeds, size
from tests.property.test_dense_props import GROUP_KINDS, _group_bounds, group_sizes
from tests.property.test_fp8_props import DELAYED_ALGOS, FMAX, fmt_name, np_amax, np_cast, np_scale

IMPL = "reference"
F32 = np.float32
F64 = np.float64
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
FORMATS = st.sampled_from(["e4m3", "hybrid"])

# (act_block, weight_block): the DeepSeek-V3 default twice as often, then other legal shapes (fp8_dense needs a
# square weight block; fp8_grouped_dense takes the default only).
BLOCK_SHAPES = (
    ((1, 128), (128, 128)),
    ((1, 128), (128, 128)),
    ((1, 32), (32, 32)),
    ((2, 16), (8, 8)),
    ((3, 5), (64, 64)),
    ((128, 1), (7, 7)),
)
BLOCK_RECIPES = st.tuples(FORMATS, st.sampled_from(BLOCK_SHAPES), st.booleans()).map(
    lambda t: fp8.BlockScaling(formats=t[0], act_block=t[1][0], weight_block=t[1][1], power_of_2=t[2])
)
DEFAULT_BLOCK_RECIPES = st.builds(fp8.BlockScaling, formats=FORMATS, power_of_2=st.booleans())
CURRENT_RECIPES = st.builds(fp8.CurrentScaling, formats=FORMATS, margin=st.sampled_from([0, 0, 1, 3]),
                            power_of_2=st.booleans(), fast_accumulation=st.booleans())  # fmt: skip
DELAYED_RECIPES = st.builds(fp8.DelayedScaling, formats=FORMATS, history_len=st.sampled_from([1, 2, 5]),
                            margin=st.sampled_from([0, 1]),
                            amax_compute_algo=st.sampled_from(DELAYED_ALGOS))  # fmt: skip
FAMILIES = ("block", "current", "delayed")

# The strategies of each test.
DENSE_ARGS = dict(
    recipe={"block": BLOCK_RECIPES, "current": CURRENT_RECIPES, "delayed": DELAYED_RECIPES},
    lead=st.one_of(
        st.lists(size(9, min_size=0, sizes=(0, 1, 2, 3, 5, 7)), min_size=0, max_size=2),
        st.tuples(st.sampled_from([129, 131, 200])),  # more than one 128-row tile of x^T and dz^T
    ),
    k=size(300, min_size=0, sizes=(0, 1, 2, 3, 7, 13, 31, 127, 128, 129, 131, 200, 257, 300)),
    n=size(300, min_size=0, sizes=(0, 1, 2, 5, 17, 37, 128, 129, 200, 300)),
    dtype=DTYPES,
    master=st.booleans(),  # float32 kernel with a bfloat16 / float16 x
    bias=st.sampled_from([None, "x", "float32"]),  # bias dtype: x's or float32
    activation=st.sampled_from(list(ACTIVATIONS)),
    outlier=st.booleans(),  # one element of x times 256
    state=st.sampled_from(["random", "random", "initial"]),  # delayed scaling's incoming state
    seed=seeds,
)
GROUPED_ARGS = dict(
    recipe={"block": DEFAULT_BLOCK_RECIPES, "current": CURRENT_RECIPES, "delayed": DELAYED_RECIPES},
    m=size(257, min_size=0, sizes=(0, 1, 2, 7, 31, 129, 200, 257)),
    k=size(300, min_size=0, sizes=(0, 1, 3, 13, 127, 129, 200, 300)),
    n=size(200, min_size=0, sizes=(0, 1, 5, 17, 129, 200)),
    g=st.integers(1, 6),
    kind=st.sampled_from(GROUP_KINDS),
    dtype=DTYPES,
    master=st.booleans(),
    tail=st.sampled_from([1.0, 1.0, 128.0]),  # rows past the groups scaled: they still count in x's and dy's amax
    state=st.sampled_from(["random", "random", "initial"]),
    seed=seeds,
)


# ----------------------------------------------------------------------------------------------
# The numpy formulation of the quantization of one GEMM operand
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one operand is quantized: its format; its block of the last two axes (None: one scale for the whole
    matrix of the last two axes, i.e. per tensor, or per expert for [G, N, K] kernels); margin and power_of_2
    (current / block scaling); or delayed scaling's fixed float32 scale (scalar, or one per expert)."""

    fmt: str
    block: tuple[int, int] | None
    margin: int = 0
    power_of_2: bool = False
    scale: np.ndarray | None = None


def _block(shape, spec: Spec) -> tuple[int, int]:
    return spec.block or (max(shape[-2], 1), max(shape[-1], 1))


def _block_amax(a32: np.ndarray, block) -> np.ndarray:
    """max |a| per block of the last two axes, [..., nR, nC] (partial edge blocks: their own elements)."""
    (r, c), (br, bc) = a32.shape[-2:], block
    nr, nc = -(-r // br), -(-c // bc)
    pad = [(0, 0)] * (a32.ndim - 2) + [(0, nr * br - r), (0, nc * bc - c)]
    ab = np.pad(np.abs(a32), pad).reshape(*a32.shape[:-2], nr, br, nc, bc)
    return np_amax(ab, axis=(-3, -1)) if ab.size else np.zeros((*a32.shape[:-2], nr, nc), F32)


def _spread(per_block: np.ndarray, block, shape) -> np.ndarray:
    """A [..., nR, nC] per-block array as one value per element of ``shape``."""
    br, bc = block
    return np.repeat(np.repeat(per_block, br, axis=-2), bc, axis=-1)[..., : shape[-2], : shape[-1]]


def _scale_of(amax: np.ndarray, spec: Spec) -> np.ndarray:
    return np_scale(amax, spec.fmt, spec.margin, spec.power_of_2)


def _elem_scale(a32: np.ndarray, spec: Spec) -> np.ndarray:
    """The float32 scale each element of a is quantized with."""
    if spec.scale is not None:
        s = np.asarray(spec.scale, F32)
        return np.broadcast_to(s.reshape(s.shape + (1, 1)), a32.shape).astype(F32)
    block = _block(a32.shape, spec)
    return _spread(_scale_of(_block_amax(a32, block), spec), block, a32.shape)


def _deq(data: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """data * (1 / scale), the product in float32 (as dequantize computes it), as float64."""
    return (data.astype(F32) * (F32(1) / scale).astype(F32)).astype(F32).astype(F64)


def np_quantize(a32: np.ndarray, spec: Spec) -> np.ndarray:
    """dequantize(quantize(a)) as float64, from the bytes and inverse scales the spec defines."""
    s = _elem_scale(a32, spec)
    return _deq(np_cast(a32, s, spec.fmt), s)


def np_quantize_interval(c32, lo32, hi32, spec: Spec) -> tuple[np.ndarray, np.ndarray]:
    """(dequantize(quantize(c)), allowance): for any float32 tensor d with lo <= d <= hi elementwise,
    |dequantize(quantize(d)) - dequantize(quantize(c))| <= allowance. Without a fixed scale the scale of a
    block lies between those of the block's smallest and largest possible amax; rounding is monotone, so the
    extremes of q(d * s) * (1 / s) are at the corners of (d, s). A block whose amax may be 0 or not (scale 1,
    or fmax / amax) gets |c| + 2 max|d|: rounding to FP8 at most doubles a magnitude (a subnormal step)."""
    deq_c = np_quantize(c32, spec)
    if np.array_equal(lo32, hi32):
        return deq_c, np.zeros_like(deq_c)
    if spec.scale is not None:
        s_lo = s_hi = _elem_scale(c32, spec)
        unknown = np.zeros(c32.shape, bool)
    else:
        block = _block(c32.shape, spec)
        big = np.maximum(np.abs(lo32), np.abs(hi32))
        small = np.where((lo32 <= 0) & (hi32 >= 0), F32(0), np.minimum(np.abs(lo32), np.abs(hi32)))
        amax_hi, amax_lo = _block_amax(big, block), _block_amax(small, block)
        sa, sb = _scale_of(amax_hi, spec), _scale_of(amax_lo, spec)
        s_lo = _spread(np.minimum(sa, sb), block, c32.shape)
        s_hi = _spread(np.maximum(sa, sb), block, c32.shape)
        unknown = _spread((amax_lo == 0) & (amax_hi > 0), block, c32.shape)
    cands = [_deq(np_cast(d, s, spec.fmt), s2) for d in (lo32, hi32) for s in (s_lo, s_hi) for s2 in (s_lo, s_hi)]
    allow = np.maximum(np.max(cands, axis=0) - deq_c, deq_c - np.min(cands, axis=0))
    if unknown.any():
        big = np.maximum(np.abs(lo32), np.abs(hi32)).astype(F64)
        allow = np.where(unknown, np.abs(deq_c) + 2.0 * big, allow)
    return deq_c, allow


def _specs(recipe, scales=None) -> dict[str, Spec]:
    """The spec of each operand: x, x^T, the kernel(s) transposed (w: [N, K] per expert), dz and dz^T.
    ``scales``: delayed scaling's incoming state scales {"x", "w", "g"}."""
    fx, fw, fg = (fmt_name(recipe.formats, role) for role in ("x", "w", "g"))
    if isinstance(recipe, fp8.BlockScaling):
        ab, wb, p2 = recipe.act_block, recipe.weight_block, recipe.power_of_2
        return dict(x=Spec(fx, ab, 0, p2), xT=Spec(fx, ab, 0, p2), w=Spec(fw, wb, 0, p2),
                    g=Spec(fg, ab, 0, p2), gT=Spec(fg, wb, 0, p2))  # fmt: skip
    if isinstance(recipe, fp8.CurrentScaling):
        mk = lambda f: Spec(f, None, recipe.margin, recipe.power_of_2)  # noqa: E731
        return dict(x=mk(fx), xT=mk(fx), w=mk(fw), g=mk(fg), gT=mk(fg))
    return dict(x=Spec(fx, None, scale=scales["x"]), xT=Spec(fx, None, scale=scales["x"]),
                w=Spec(fw, None, scale=scales["w"]), g=Spec(fg, None, scale=scales["g"]),
                gT=Spec(fg, None, scale=scales["g"]))  # fmt: skip


# With an activation the op forms dz = dy * act'(z) (float32) from z, its float32 GEMM output rounded to x's
# dtype. A float64 z cannot reproduce that rounding (the float32 sum's order is XLA's), and a z one ulp off
# moves act'(z) enough to move FP8 bytes of dz. So the backward's numpy formulation takes the op's z: the
# output of the same call with activation=None (the same quantized operands, the same GEMM and bias add),
# itself checked against the float64 z. ReLU's derivative is then exact (dz bit-equal); the smooth ones are
# evaluated by XLA in float32: measured within 5.5 float32 ulps of (1 + |z|) of the float64 derivative over
# z in [-30, 30] (tanh-GELU's 1 - t^2 cancels; GELU 1.3, SiLU 1.8), bounded here by 16 ulps.
ACT_ULPS = 2.0**-20


def dz_bounds(dy32: np.ndarray, z: np.ndarray | None, activation):
    """(centre, lo, hi) float32 of the op's dz from the op's z (None without an activation): lo <= dz <= hi."""
    if activation is None:
        return dy32, dy32, dy32
    dy = dy32.astype(F64)
    with np.errstate(over="ignore"):  # SiLU's exp(-z) overflows to inf for z << 0: the sigmoid is then 0
        a = ACTIVATIONS[activation][1](z)
    c = (dy * a).astype(F32)
    if activation == "relu":  # 0 or 1: dz is dy or 0, exactly
        return c, c, c
    slack = np.abs(dy) * ACT_ULPS * (1.0 + np.abs(z))
    lo, hi = dy * a - slack, dy * a + slack  # then the float32 product's rounding, outwards
    return c, np.nextafter(lo.astype(F32), F32(-np.inf)), np.nextafter(hi.astype(F32), F32(np.inf))


def check_within(actual, expected, extra, dtype, what: str) -> None:
    """check_close (the dtype's tolerance, atol relative to max|expected|) after moving each expected value
    towards the actual one by at most ``extra`` (the allowance for FP8 bytes of dz that may round either way)."""
    e = np.asarray(expected, F64)
    a = as64(actual)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    scale = max(1.0, float(np.max(np.abs(e), initial=0.0)))
    e = e + np.clip(a - e, -extra, extra)
    check_close(actual, e, dtype, what=what, scale=scale)


# ----------------------------------------------------------------------------------------------
# Delayed scaling's state
# ----------------------------------------------------------------------------------------------


def make_state(rng, recipe, kind, tensors, groups=None):
    """(DenseScalingState, its scales as float32 numpy {"x", "w", "g"}, its histories). "initial": the
    documented fresh state (zero histories, scale 1); "random": histories of random amaxes (sometimes an
    +inf entry) and scales around fmax / amax(tensor) times 2^-2 .. 2^1 (2: the largest elements saturate).
    ``groups``: one kernel state per expert."""
    if kind == "initial":
        st_ = fp8.initial_dense_state(recipe) if groups is None else fp8.initial_grouped_state(recipe, groups)
    else:

        def one(t64, role, lead=()):
            amax = np.max(np.abs(t64).reshape(*lead, -1), axis=-1, initial=0.0)
            s = FMAX[fmt_name(recipe.formats, role)] / np.maximum(amax, 1e-3) * np.exp2(rng.integers(-2, 2, lead))
            hist = np.abs(rng.standard_normal((*lead, recipe.history_len))) * np.exp2(rng.integers(-4, 4))
            hist[rng.random(hist.shape) < 0.1] = np.inf
            return fp8.DelayedScalingState(jnp.asarray(hist, jnp.float32), jnp.asarray(s, jnp.float32))

        x64, w64, dy64 = tensors
        st_ = fp8.DenseScalingState(one(x64, "x"), one(w64, "w", () if groups is None else (groups,)), one(dy64, "g"))
    scales = {r: np.asarray(getattr(st_, r).scale, F32) for r in ("x", "w", "g")}
    hists = {r: np.asarray(getattr(st_, r).amax_history, F32) for r in ("x", "w", "g")}
    return st_, scales, hists


def check_state(new, recipe, hists, scales, amaxes, what: str) -> None:
    """The updated state (per role): the new amax at index 0 of the history (within [lo, hi] of ``amaxes``;
    lo == hi but for dz with an activation), the rest shifted by one; the next scale from the history's largest
    finite amax ("max") or its newest ("most_recent"), the previous scale where that is 0 or not finite."""
    for role in ("x", "w", "g"):
        got_h = np.asarray(getattr(new, role).amax_history, F32)
        got_s = np.asarray(getattr(new, role).scale, F32)
        lo, hi = (np.asarray(v, F32) for v in amaxes[role])
        assert got_h.shape == hists[role].shape and got_s.shape == scales[role].shape, f"{what} state.{role} shape"
        np.testing.assert_array_equal(got_h[..., 1:], hists[role][..., :-1], f"{what} state.{role} history shift")
        head = got_h[..., 0]
        assert np.all((lo <= head) & (head <= hi)), f"{what} state.{role} amax {head} not in [{lo}, {hi}]"
        if recipe.amax_compute_algo == "max":
            ref = np.max(np.where(np.isfinite(got_h), got_h, F32(0)), axis=-1)
        else:
            ref = head
        ok = np.isfinite(ref) & (ref > 0)
        fmt = fmt_name(recipe.formats, role)
        want = np.where(ok, np_scale(ref, fmt, recipe.margin, False), scales[role]).astype(F32)
        np.testing.assert_array_equal(got_s.view(np.uint32), want.view(np.uint32), f"{what} state.{role} scale")


def _amax(a32: np.ndarray, lead=()) -> np.ndarray:
    return np_amax(a32.reshape(*lead, -1), axis=-1) if a32.size else np.zeros(lead, F32)


# ----------------------------------------------------------------------------------------------
# fp8_dense
# ----------------------------------------------------------------------------------------------


def dense_expected(recipe, x32, w32, b64, dy32, z_op, activation, scales=None):
    """float64 z and y, (expected, allowance) of dx, dw and dbias, and the dz interval (centre, lo, hi).
    ``z_op``: the op's pre-activation (float64 values of x's dtype) with an activation, else None."""
    sp = _specs(recipe, scales)
    qx, qx_t, qw_t = np_quantize(x32, sp["x"]), np_quantize(x32.T, sp["xT"]), np_quantize(w32.T, sp["w"])
    z = qx @ qw_t.T + b64  # [M, N]: the forward GEMM on the dequantized operands, bias added
    dz = dz_bounds(dy32, z_op, activation)
    c, lo, hi = dz
    qdz, a = np_quantize_interval(c, lo, hi, sp["g"])  # dz in act_block tiles (role g)
    qdz_t, a_t = np_quantize_interval(c.T, lo.T, hi.T, sp["gT"])  # dz^T [N, M] in weight blocks
    dx = (qdz @ qw_t, a @ np.abs(qw_t))  # the same w^T blocks, transposed
    dw = (qx_t @ qdz_t.T, np.abs(qx_t) @ a_t.T)  # x^T [K, M] in act_block tiles (x's columns)
    db = (c.astype(F64).sum(0), (hi.astype(F64) - lo).sum(0))
    with np.errstate(over="ignore"):
        y = ACTIVATIONS[activation][0](z)
    return z, y, dx, dw, db, dz


def run_dense(recipe, activation, x, w, b, state, dy):
    """jit(vjp) of fp8_dense: y, the cotangents of (x, kernel, bias[, state]), and with an activation the
    pre-activation z (the same call with activation=None)."""

    def f(x, w, b, state, dy):
        call = lambda x, w, b, s, act: fp8.fp8_dense(x, w, recipe, bias=b, state=s, activation=act,  # noqa: E731
                                                     implementation=IMPL)  # fmt: skip
        if state is None:
            y, vjp = jax.vjp(lambda x, w, b: call(x, w, b, None, activation), x, w, b)
        else:
            y, vjp = jax.vjp(lambda x, w, b, s: call(x, w, b, s, activation), x, w, b, state)
        return y, vjp(dy), (None if activation is None else call(x, w, b, state, None))

    return jax.jit(f)(x, w, b, state, dy)


def check_dense(recipe, lead, k, n, dtype, master, bias, activation, outlier, state_kind, seed):
    rng = np.random.default_rng(seed)
    lead = tuple(lead)
    m = int(np.prod(lead))
    half = jnp.dtype(dtype) != jnp.float32
    w_dtype = jnp.float32 if master and half else dtype
    x, x64 = rand(rng, (*lead, k), dtype)
    if outlier and x64.size:
        x64.flat[rng.integers(x64.size)] *= 256.0  # exact in every dtype
        x = jnp.asarray(x64.astype(F32)).astype(dtype)
    w, w64 = rand(rng, (k, n), w_dtype, 1.0 / np.sqrt(max(k, 1)))
    b_dtype = {None: None, "x": dtype, "float32": jnp.float32}[bias]
    b, b64 = rand(rng, (n,), b_dtype) if bias else (None, np.zeros((n,)))
    dy, dy64 = rand(rng, (*lead, n), dtype)
    state, scales, hists = None, None, None
    if isinstance(recipe, fp8.DelayedScaling):
        state, scales, hists = make_state(rng, recipe, state_kind, (x64, w64, dy64))

    y, grads, z_op = run_dense(recipe, activation, x, w, b, state, dy)
    x32, w32, dy32 = (v.astype(F32) for v in (x64.reshape(m, k), w64, dy64.reshape(m, n)))
    z_op = None if z_op is None else as64(z_op).reshape(m, n)
    z_e, y_e, dx_e, dw_e, db_e, (c, lo, hi) = dense_expected(recipe, x32, w32, b64, dy32, z_op, activation, scales)
    tag = f"{recipe}, {activation}, bias {bias}, x {jnp.dtype(dtype).name} {lead + (k,)}, w {jnp.dtype(w_dtype).name}"

    assert y.dtype == jnp.dtype(dtype) and y.shape == (*lead, n), f"y {y.dtype} {y.shape}"
    check_close(y, y_e.reshape(*lead, n), dtype, what=f"fp8_dense y ({tag})")
    if z_op is not None:
        check_close(z_op, z_e, dtype, what=f"fp8_dense z, activation=None ({tag})")
    dx, dw, db = grads[:3]
    assert dx.dtype == x.dtype and dw.dtype == w.dtype, f"dx {dx.dtype}, dw {dw.dtype}"
    check_within(dx, dx_e[0].reshape(*lead, k), dx_e[1].reshape(*lead, k), dtype, f"fp8_dense dx ({tag})")
    check_within(dw, *dw_e, w_dtype, f"fp8_dense dkernel ({tag})")
    if bias is None:
        assert db is None
    else:
        assert db.dtype == jnp.dtype(b_dtype)
        check_within(db, *db_e, b_dtype, f"fp8_dense dbias ({tag})")
    if state is not None:  # the updated state is the state's cotangent; the op's amax(dz) lies between the
        # amaxes of the dz bounds' smallest and largest magnitudes (both amax(dy) without an activation)
        small = np.where((lo <= 0) & (hi >= 0), F32(0), np.minimum(np.abs(lo), np.abs(hi)))
        big = np.maximum(np.abs(lo), np.abs(hi))
        amaxes = dict(x=(_amax(x32),) * 2, w=(_amax(w32),) * 2, g=(_amax(small), _amax(big)))
        check_state(grads[3], recipe, hists, scales, amaxes, f"fp8_dense ({tag})")


@pytest.mark.parametrize("family", FAMILIES)
@fuzz(14)
@given(data=st.data())
def test_fp8_dense(family, data):
    args = {name: data.draw(s[family] if isinstance(s, dict) else s, label=name) for name, s in DENSE_ARGS.items()}
    args["state_kind"] = args.pop("state")
    check_dense(**args)


# Every edge, whatever the draws: empty rows / contraction / output, one element, tiles of 128 crossed in
# every direction, float16 with master kernels, a saturating delayed state.
DENSE_EDGES = [
    (fp8.BlockScaling(), (3, 0), 129, 5, jnp.bfloat16, False, "x", "gelu", False, "random"),
    (fp8.BlockScaling(formats="hybrid"), (1,), 0, 7, jnp.bfloat16, False, "float32", "gelu", False, "random"),
    (fp8.CurrentScaling(), (4,), 0, 3, jnp.float32, False, None, "relu", False, "random"),
    (fp8.CurrentScaling(margin=1), (4,), 5, 0, jnp.float32, False, "x", None, False, "random"),
    (fp8.DelayedScaling(history_len=3), (2, 3), 0, 4, jnp.float32, False, "x", "silu", False, "random"),
    (fp8.DelayedScaling(history_len=2), (0,), 7, 4, jnp.bfloat16, True, "x", None, False, "initial"),
    (fp8.BlockScaling(formats="hybrid", power_of_2=False), (130,), 300, 200, jnp.float32, False, "x", "silu",
     True, "random"),
    (fp8.BlockScaling(act_block=(2, 16), weight_block=(16, 16)), (5, 7), 131, 37, jnp.float16, True, "float32",
     "gelu_tanh", False, "random"),
    (fp8.CurrentScaling(margin=2, power_of_2=True), (1,), 1, 1, jnp.bfloat16, False, "x", "relu", False, "random"),
    (fp8.CurrentScaling(formats="e4m3"), (), 200, 129, jnp.float16, True, None, "gelu", True, "random"),
    (fp8.DelayedScaling(formats="e4m3", amax_compute_algo="most_recent", history_len=2), (129,), 200, 129,
     jnp.bfloat16, True, "float32", "gelu_tanh", True, "random"),
]  # fmt: skip


@pytest.mark.parametrize("case", DENSE_EDGES, ids=lambda c: f"{type(c[0]).__name__}-{c[1]}x{c[2]}x{c[3]}")
def test_fp8_dense_edges(case):
    check_dense(*case, seed=11)


def test_fp8_dense_rejects_non_square_weight_block():
    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8, 8), jnp.float32)
    with pytest.raises(ValueError, match="weight_block must be square"):
        fp8.fp8_dense(x, w, fp8.BlockScaling(weight_block=(4, 8)), implementation=IMPL)


# ----------------------------------------------------------------------------------------------
# fp8_grouped_dense
# ----------------------------------------------------------------------------------------------


def grouped_expected(recipe, x32, w32, dy32, sizes, scales=None):
    """float64 y, dx, dkernels. Block scaling: x and dy in 1 x 128 tiles, each expert's W^T in 128 x 128
    blocks; x^T and dy^T tiled from row 0 of the whole tensor (a tile straddling two groups has one scale).
    Current scaling: one scale for x and for dy over all M rows, one per expert for the kernels."""
    sp = _specs(recipe, scales)
    m = x32.shape[0]
    qx, qx_t = np_quantize(x32, sp["x"]), np_quantize(x32.T, sp["xT"])
    qw_t = np_quantize(np.swapaxes(w32, 1, 2), sp["w"])  # [G, N, K], per expert
    qdy, qdy_t = np_quantize(dy32, sp["g"]), np_quantize(dy32.T, sp["gT"])
    y, dx, dw = np.zeros((m, w32.shape[2])), np.zeros(x32.shape), np.zeros(w32.shape)
    for i, (s, e) in enumerate(zip(*_group_bounds(sizes, m), strict=True)):
        y[s:e] = qx[s:e] @ qw_t[i].T
        dx[s:e] = qdy[s:e] @ qw_t[i]
        dw[i] = qx_t[:, s:e] @ qdy_t[:, s:e].T
    return y, dx, dw


def grouped_vjp(recipe, impl):
    """``f(x, w, gs, state, dy) -> (y, gradients)`` of fp8_grouped_dense with ``impl`` (state None
    unless DelayedScaling); tests/gpu/test_property_gpu.py builds its implementations with it."""

    def f(x, w, gs, state, dy):
        if state is None:
            fn = lambda x, w: fp8.fp8_grouped_dense(x, w, gs, recipe, implementation=impl)  # noqa: E731
            y, vjp = jax.vjp(fn, x, w)
        else:
            fn = lambda x, w, s: fp8.fp8_grouped_dense(x, w, gs, recipe, state=s, implementation=impl)  # noqa: E731
            y, vjp = jax.vjp(fn, x, w, state)
        return y, vjp(dy)

    return f


def run_grouped(recipe, x, w, gs, state, dy):
    return jax.jit(grouped_vjp(recipe, IMPL))(x, w, gs, state, dy)


def check_grouped(recipe, m, k, n, g, sizes, dtype, master, tail, state_kind, seed):
    rng = np.random.default_rng(seed)
    w_dtype = jnp.float32 if master and jnp.dtype(dtype) != jnp.float32 else dtype
    starts, ends = _group_bounds(sizes, m)
    covered = ends[-1]  # rows [covered, M) belong to no group
    x, x64 = rand(rng, (m, k), dtype)
    dy, dy64 = rand(rng, (m, n), dtype)
    if tail != 1.0:  # large rows past the groups: no output, but x's and dy's scales (current, delayed) drop
        x64[covered:] *= tail
        dy64[covered:] *= tail
        x, dy = (jnp.asarray(v.astype(F32)).astype(dtype) for v in (x64, dy64))
    w, w64 = rand(rng, (g, k, n), w_dtype, 1.0 / np.sqrt(max(k, 1)))
    gs = jnp.asarray(np.asarray(sizes, np.int64).astype(np.int32))
    state, scales, hists = None, None, None
    if isinstance(recipe, fp8.DelayedScaling):
        state, scales, hists = make_state(rng, recipe, state_kind, (x64, w64, dy64), groups=g)

    y, grads = run_grouped(recipe, x, w, gs, state, dy)
    x32, w32, dy32 = (v.astype(F32) for v in (x64, w64, dy64))
    y_e, dx_e, dw_e = grouped_expected(recipe, x32, w32, dy32, sizes, scales)
    tag = f"{recipe}, sizes {sizes}, M {m} K {k} N {n}, x {jnp.dtype(dtype).name}, w {jnp.dtype(w_dtype).name}"

    assert y.dtype == jnp.dtype(dtype) and y.shape == (m, n), f"y {y.dtype} {y.shape}"
    dx, dw = grads[:2]
    assert dx.dtype == x.dtype and dx.shape == x.shape and dw.dtype == w.dtype and dw.shape == w.shape
    check_close(y, y_e, dtype, what=f"fp8_grouped_dense y ({tag})")
    check_close(dx, dx_e, dtype, what=f"fp8_grouped_dense dx ({tag})")
    check_close(dw, dw_e, w_dtype, what=f"fp8_grouped_dense dkernels ({tag})")
    # exactly zero: rows of no group in y and dx, the kernel gradient of an empty group
    assert not np.any(as64(y)[covered:]) and not np.any(as64(dx)[covered:]), "rows past the groups"
    empty = [i for i in range(g) if starts[i] == ends[i]]
    assert not np.any(as64(dw)[empty]), f"dkernels of the empty groups {empty}"
    if state is not None:  # x's and dy's amaxes over all M rows, one amax per expert kernel
        amaxes = dict(x=(_amax(x32),) * 2, w=(_amax(w32, (g,)),) * 2, g=(_amax(dy32),) * 2)
        check_state(grads[2], recipe, hists, scales, amaxes, f"fp8_grouped_dense ({tag})")


@st.composite
def grouped_case(draw, family):
    a = {name: draw(s[family] if isinstance(s, dict) else s) for name, s in GROUPED_ARGS.items()}
    kind, state_kind = a.pop("kind"), a.pop("state")
    return dict(a, sizes=draw(group_sizes(a["m"], a["g"], kind)), state_kind=state_kind)


@pytest.mark.parametrize("family", FAMILIES)
@fuzz(14)
@given(data=st.data())
def test_fp8_grouped_dense(family, data):
    check_grouped(**data.draw(grouped_case(family), label="case"))


GROUPED_EDGES = [  # (recipe, M, K, N, sizes, dtype, master, tail, state)
    (fp8.BlockScaling(), 0, 129, 5, [0, 0, 0], jnp.bfloat16, False, 1.0, "random"),
    (fp8.BlockScaling(formats="hybrid", power_of_2=False), 200, 131, 129, [0, 200, 0, 0], jnp.float32, False,
     1.0, "random"),  # every row on one group
    (fp8.BlockScaling(), 257, 200, 17, [100, -3, 57, 0, 29], jnp.float32, False, 128.0, "random"),  # sum < M
    (fp8.CurrentScaling(margin=1), 31, 0, 4, [10, 30], jnp.bfloat16, True, 1.0, "random"),  # K = 0, sum > M
    (fp8.CurrentScaling(power_of_2=True), 7, 3, 0, [3, 3], jnp.float32, False, 1.0, "random"),  # N = 0
    (fp8.CurrentScaling(), 200, 13, 17, [19, 2, 31], jnp.float32, False, 128.0, "random"),  # the tail in the amaxes
    (fp8.CurrentScaling(formats="e4m3"), 131, 129, 200, [2**31 - 1, 2**31 - 1, 1], jnp.float16, True, 128.0,
     "random"),
    (fp8.DelayedScaling(history_len=2), 129, 200, 129, [64, 0, 60], jnp.bfloat16, True, 128.0, "random"),
    (fp8.DelayedScaling(amax_compute_algo="most_recent"), 1, 1, 1, [1], jnp.float32, False, 1.0, "initial"),
]  # fmt: skip


@pytest.mark.parametrize("case", GROUPED_EDGES, ids=lambda c: f"{type(c[0]).__name__}-{c[1]}x{c[2]}x{c[3]}-{c[4]}")
def test_fp8_grouped_dense_edges(case):
    recipe, m, k, n, sizes, dtype, master, tail, state_kind = case
    check_grouped(recipe, m, k, n, len(sizes), sizes, dtype, master, tail, state_kind, seed=12)


def test_fp8_grouped_dense_rejects_other_blocks():
    x, w, gs = jnp.ones((4, 8), jnp.float32), jnp.ones((2, 8, 8), jnp.float32), jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="recipe must be"):
        fp8.fp8_grouped_dense(x, w, gs, fp8.BlockScaling(act_block=(1, 32), weight_block=(32, 32)),
                              implementation=IMPL)  # fmt: skip


@pytest.mark.parametrize("recipe", [fp8.BlockScaling(), fp8.CurrentScaling()])
def test_fp8_grouped_dense_rejects_no_groups(recipe):
    """docs/semantics.md, "Grouped GEMM": G must be at least 1 (fp8_grouped_dense follows grouped_dense)."""
    x, w, gs = jnp.ones((4, 8), jnp.float32), jnp.ones((0, 8, 8), jnp.float32), jnp.zeros((0,), jnp.int32)
    with pytest.raises(ValueError, match=r"kernels must have at least one group \(G >= 1\)"):
        fp8.fp8_grouped_dense(x, w, gs, recipe, implementation=IMPL)
