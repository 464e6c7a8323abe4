"""Native CUDA softmax vs the reference on the GPU (outputs poisoned), and under command buffers."""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_ops
from te_ops._core import native
from te_ops._core import testing as T
from te_ops.softmax import native as softmax_native
from tests.gpu.cmdbuf import assert_graph_captured_and_warmed_once, run_under_command_buffers

_WHY = native.native_unavailable_reason("_native", "softmax")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=f"GPU test: {_WHY}")]

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _x(seed, shape, dtype):
    return (3.0 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def _run(fn, x, ct, impl):
    def loss_and_grad(x):
        y, vjp = jax.vjp(lambda x: fn(x, impl), x)
        return y, vjp(ct.astype(y.dtype))[0]

    with native.poisoned_outputs():
        return jax.jit(loss_and_grad)(x)


def _compare(fn, shape, dtype, seed=0):
    x = _x(seed, shape, dtype)
    ct = jax.random.normal(jax.random.key(seed + 1), shape, jnp.float32)
    y, dx = _run(fn, x, ct, "native")
    y_ref, dx_ref = _run(fn, x, ct, "reference")
    assert not bool(jnp.isnan(y.astype(jnp.float32)).any()), "unwritten (NaN-poisoned) output element"
    assert not bool(jnp.isnan(dx.astype(jnp.float32)).any()), "unwritten (NaN-poisoned) gradient element"
    T.assert_close(y, y_ref, dtype)
    T.assert_close(dx, dx_ref, dtype, scale=float(jnp.abs(dx_ref.astype(jnp.float32)).max()) + 1e-6)
    return y


# Row lengths cover: tiny rows (4 threads per row), a vector path, odd lengths (scalar path),
# a full-block row, and rows longer than the register capacity (long-row kernel).
SHAPES = [(3, 5, 16), (2, 4, 128), (7, 33), (2, 3, 1000), (4, 4096), (2, 8200), (2, 70000)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_scaled_softmax_native(dtype, shape):
    _compare(lambda x, impl: te_ops.scaled_softmax(x, 0.7, implementation=impl), shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [1, 8, 37, 128, 1024, 2048])
def test_upper_triang_native(dtype, s):
    y = _compare(
        lambda x, impl: te_ops.scaled_upper_triang_masked_softmax(x, 0.5, implementation=impl), (2, 3, s, s), dtype
    )
    assert bool(jnp.all(jnp.triu(y.astype(jnp.float32), k=1) == 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "x_shape, mask_shape",
    [
        ((2, 3, 16, 64), (2, 1, 16, 64)),
        ((2, 3, 16, 64), (1, 1, 16, 64)),
        ((2, 3, 16, 64), (2, 1, 1, 64)),
        ((2, 3, 16, 64), (2, 3, 16, 64)),
        ((2, 2, 9, 37), (2, 1, 9, 37)),
        ((1, 2, 4, 9000), (1, 1, 4, 9000)),
        ((2, 4, 256, 256), (1, 1, 256, 256)),
    ],
)
def test_masked_native(dtype, x_shape, mask_shape):
    mask = jax.random.bernoulli(jax.random.key(3), 0.35, mask_shape)
    # one fully masked row where the mask has a query axis
    if mask_shape[2] > 1:
        mask = mask.at[0, 0, 1].set(True)
    y = _compare(lambda x, impl: te_ops.scaled_masked_softmax(x, mask, 0.9, implementation=impl), x_shape, dtype)
    assert bool(jnp.all(jnp.where(jnp.broadcast_to(mask, x_shape), y.astype(jnp.float32), 0) == 0))


def test_causal_mask_native_matches_upper_triang():
    x = _x(5, (2, 4, 512, 512), jnp.bfloat16)
    causal = ~jnp.tril(jnp.ones((512, 512), bool))[None, None]
    a = jax.jit(lambda x: te_ops.scaled_masked_softmax(x, causal, 0.125, implementation="native"))(x)
    b = jax.jit(lambda x: te_ops.scaled_upper_triang_masked_softmax(x, 0.125, implementation="native"))(x)
    T.assert_close(a, b, jnp.bfloat16)


def test_default_implementation_is_native_on_gpu():
    x = _x(6, (4, 256), jnp.float32)
    text = jax.jit(lambda x: te_ops.scaled_softmax(x, 1.0)).lower(x).as_text()
    assert "te_softmax_fwd" in text


def test_vmap_native():
    x = _x(7, (3, 2, 2, 16, 16), jnp.bfloat16)
    mask = jax.random.bernoulli(jax.random.key(8), 0.3, (2, 1, 16, 16))
    f = lambda impl: jax.jit(jax.vmap(lambda x: te_ops.scaled_masked_softmax(x, mask, 0.5, implementation=impl)))
    T.assert_close(f("native")(x), f("reference")(x), jnp.bfloat16)


# ---- warp-per-row forward variants (launch choices selected through softmax_set_tuning) --------

# (threads_per_row, vectors_per_thread) pairs of csrc/softmax/softmax.h; the backward keeps the
# register kernel.
WARP_ROW = {"warp-row": (32, 16), "warp-row-packed": (32, -16)}


def _variant_cases(items, cols_of):
    """(kernel, dtype, item) for every kernel, the dtypes it claims, and the items whose row length
    it accepts: a multiple of the 16-byte vector (8 for 16-bit, 4 for f32) of at most 512 vectors."""
    out = []
    for kernel in WARP_ROW:
        for dtype in [jnp.bfloat16] if kernel == "warp-row-packed" else DTYPES:
            item = jnp.dtype(dtype).itemsize
            out += [
                (kernel, dtype, it) for it in items if cols_of(it) % (16 // item) == 0 and cols_of(it) * item <= 8192
            ]
    return out


@contextlib.contextmanager
def _tuning(pair):
    mod = native.module()
    mod.softmax_set_tuning(*pair)
    try:
        yield
    finally:
        mod.softmax_set_tuning(0, 0)


# (handler, tag, shape, dtype, kernel) keys already warmed in this process. The handler's warm-up key
# (csrc/softmax/softmax_ffi.cc Key) is dtype | mode | x shape | launch configuration: the mask's shape is
# not part of it, so the tag names the mode only.
_WARMED = set()


def _warmups(handler):
    return native.counters().get(handler, {}).get("warmups", 0)


# A register-kernel launch that covers any row the warp-row kernels take (<= 512 vectors): the
# baseline below.
_REGISTER_PAIR = (128, 4)


def _chosen_kernel(dtype, rows, cols, mode, scale=1.0):
    """The forward kernel the launch chooser picks (te_ops._native.softmax_config) under the current
    tuning pair; mode is "none", "mask" or "causal"."""
    return softmax_native.launch_config(dtype, rows, cols, mode, scale)["kernel"]


def _compare_variant(kernel, fn, shape, dtype, handler, tag, seed=0):
    """Compares the variant's forward (and the register kernel's backward on its output) with the
    reference, and checks that the variant really ran: its warm-up key (csrc/softmax/softmax_ffi.cc
    Key) differs from the register kernel's, so the first call under the variant, after one under a
    forced register-kernel launch, performs one more warm-up."""
    x = _x(seed, shape, dtype)
    f = jax.jit(lambda x: fn(x, "native"))
    with _tuning(_REGISTER_PAIR):
        jax.block_until_ready(f(x))  # register-kernel launch: its key is warmed now
    key = (handler, tag, shape, jnp.dtype(dtype).name, kernel)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    # Where the default launch is this very kernel, other tests in this process (default launches of
    # the same shape) may have warmed its key already: the chooser check below is the proof there.
    default_is_variant = _chosen_kernel(dtype, rows, cols, tag) == kernel
    with _tuning(WARP_ROW[kernel]):
        assert _chosen_kernel(dtype, rows, cols, tag) == kernel, (shape, dtype)
        before = _warmups(handler)
        y = _compare(fn, shape, dtype, seed)
        jax.block_until_ready(f(x))
        if key not in _WARMED and not default_is_variant:
            assert _warmups(handler) == before + 1, f"{kernel} did not run for {shape} {dtype}"
            _WARMED.add(key)
    return y


# Row lengths: non-powers of two and rows that leave lanes without a vector, up to 512 vectors.
VARIANT_ROWS = [(3, 5, 8), (2, 3, 24), (2, 3, 1000), (4, 1032), (3, 2056), (2, 2048), (2, 3, 4088), (2, 4096)]
VARIANT_CAUSAL = [8, 40, 264, 1000, 2048, 4096]
VARIANT_MASKED = [
    ((2, 3, 16, 64), (2, 1, 16, 64)),
    ((2, 3, 16, 64), (1, 1, 16, 64)),
    ((2, 3, 16, 64), (2, 1, 1, 64)),
    ((2, 3, 16, 64), (2, 3, 16, 64)),
    ((2, 2, 9, 1000), (2, 1, 9, 1000)),
    ((1, 2, 8, 2048), (1, 1, 8, 2048)),
    ((1, 2, 6, 4096), (1, 1, 6, 4096)),
    ((2, 4, 256, 256), (1, 1, 256, 256)),
]


@pytest.mark.parametrize("kernel, dtype, shape", _variant_cases(VARIANT_ROWS, lambda s: s[-1]))
def test_warp_row_scaled_softmax(kernel, dtype, shape):
    fn = lambda x, impl: te_ops.scaled_softmax(x, 0.7, implementation=impl)
    _compare_variant(kernel, fn, shape, dtype, "scaled_softmax_fwd", "none")


@pytest.mark.parametrize("kernel, dtype, s", _variant_cases(VARIANT_CAUSAL, lambda s: s))
@pytest.mark.parametrize("scale", [0.5, -0.3])
def test_warp_row_upper_triang(kernel, dtype, s, scale):
    fn = lambda x, impl: te_ops.scaled_upper_triang_masked_softmax(x, scale, implementation=impl)
    y = _compare_variant(kernel, fn, (1, 2, s, s) if s > 1000 else (2, 3, s, s), dtype, "scaled_softmax_fwd", "causal")
    assert bool(jnp.all(jnp.triu(y.astype(jnp.float32), k=1) == 0))


@pytest.mark.parametrize("kernel, dtype, shapes", _variant_cases(VARIANT_MASKED, lambda s: s[0][-1]))
@pytest.mark.parametrize("scale", [0.9, -0.6])
def test_warp_row_masked(kernel, dtype, shapes, scale):
    x_shape, mask_shape = shapes
    mask = jax.random.bernoulli(jax.random.key(3), 0.35, mask_shape)
    if mask_shape[2] > 1:
        mask = mask.at[0, 0, 1].set(True)  # one fully masked row
        # one row masked everywhere but its last element, and one with a masked run across vectors
        mask = mask.at[0, 0, 0].set(True).at[0, 0, 0, -1].set(False)
        mask = mask.at[0, 0, 2, : x_shape[-1] // 2 + 3].set(True)
    fn = lambda x, impl: te_ops.scaled_masked_softmax(x, mask, scale, implementation=impl)
    y = _compare_variant(kernel, fn, x_shape, dtype, "scaled_masked_softmax_fwd", "mask")
    assert bool(jnp.all(jnp.where(jnp.broadcast_to(mask, x_shape), y.astype(jnp.float32), 0) == 0))


@pytest.mark.parametrize("kernel", list(WARP_ROW))
def test_warp_row_causal_mask_matches_upper_triang(kernel):
    x = _x(5, (2, 4, 512, 512), jnp.bfloat16)
    causal = ~jnp.tril(jnp.ones((512, 512), bool))[None, None]
    with _tuning(WARP_ROW[kernel]):
        a = jax.jit(lambda x: te_ops.scaled_masked_softmax(x, causal, 0.125, implementation="native"))(x)
        b = jax.jit(lambda x: te_ops.scaled_upper_triang_masked_softmax(x, 0.125, implementation="native"))(x)
    c = jax.jit(lambda x: te_ops.scaled_upper_triang_masked_softmax(x, 0.125, implementation="native"))(x)
    T.assert_close(a, b, jnp.bfloat16)
    T.assert_close(a, c, jnp.bfloat16)


@pytest.mark.parametrize("kernel", list(WARP_ROW))
def test_warp_row_falls_back_where_it_does_not_apply(kernel):
    # odd row length (no 16-byte vectors), a row longer than 512 vectors, scale 0: the register kernel
    # runs instead.
    for shape, scale in [((3, 1001), 0.7), ((2, 4104), 0.7), ((2, 256), 0.0)]:
        fn = lambda x, impl, s=scale: te_ops.scaled_softmax(x, s, implementation=impl)
        x = _x(0, shape, jnp.bfloat16)
        jax.block_until_ready(jax.jit(lambda x, fn=fn: fn(x, "native"))(x))  # register kernel: key warmed
        with _tuning(WARP_ROW[kernel]):
            before = _warmups("scaled_softmax_fwd")
            _compare(fn, shape, jnp.bfloat16)
            assert _warmups("scaled_softmax_fwd") == before, f"{kernel} should fall back to register for {shape}"


# ---- command buffers --------------------------------------------------------------------------


def build_cmdbuf_step():
    """A training-like step using all three ops, fwd+bwd; 4 calls with fresh inputs."""
    shape = (2, 4, 128, 128)
    mask = jax.random.bernoulli(jax.random.key(0), 0.3, (2, 1, 128, 128))

    def make(impl):
        def step(x, ct):
            def f(x):
                a = te_ops.scaled_softmax(x, 0.5, implementation=impl)
                b = te_ops.scaled_masked_softmax(x, mask, 0.5, implementation=impl)
                c = te_ops.scaled_upper_triang_masked_softmax(x, 0.5, implementation=impl)
                return a + b + c

            y, vjp = jax.vjp(f, x)
            return y, vjp(ct)[0]

        return step

    inputs = []
    for i in range(4):
        x = (3 * jax.random.normal(jax.random.key(10 + i), shape)).astype(jnp.bfloat16)
        ct = jax.random.normal(jax.random.key(20 + i), shape).astype(jnp.bfloat16)
        inputs.append((x, ct))
    keys = {
        "scaled_softmax_fwd": 2,
        "scaled_softmax_bwd": 2,
        "scaled_masked_softmax_fwd": 1,
        "scaled_masked_softmax_bwd": 1,
    }
    return make("native"), make("reference"), inputs, keys


def test_under_command_buffers_graph_captured_and_warmed_once():
    report = run_under_command_buffers("tests.gpu.test_softmax_gpu:build_cmdbuf_step")
    assert report["xla_flags_ok"]
    assert not report["any_nan"]
    assert report["max_rel_error"] < 2e-2, report
    # scaled_softmax_* serve two keys each: the plain and the causal launch of the same shape.
    assert_graph_captured_and_warmed_once(report, report["expected_keys"])


def test_without_command_buffers_executes_eagerly():
    report = run_under_command_buffers(
        "tests.gpu.test_softmax_gpu:build_cmdbuf_step", flags="--xla_gpu_enable_command_buffer="
    )
    c = report["counters"]["scaled_softmax_fwd"]
    assert c["executes"] >= 4 and c["captured_executes"] == 0, c
    assert c["warmups"] == 2 and c["initialize_calls"] >= c["executes"], c
    assert report["max_rel_error"] < 2e-2, report


@pytest.mark.parametrize("dtype, cols", [(jnp.bfloat16, 4096), (jnp.float16, 2056), (jnp.float32, 1000)])
def test_default_forward_is_warp_row_for_long_rows(dtype, cols):
    """The default launch (no tuning pair) of a row longer than 128 vectors is the warp-row forward:
    the benchmark's causal case runs it. Checked through the chooser, the warm-up key (a forced
    register-kernel launch warms a different key), and against the reference (forward and backward)."""
    assert _chosen_kernel(dtype, 64, cols, "causal", 0.125) == "warp-row"
    causal = ~jnp.tril(jnp.ones((16, cols), bool), k=cols - 16)[None, None]
    fn = lambda x, impl: te_ops.scaled_masked_softmax(x, causal, 0.125, implementation=impl)
    x = _x(11, (2, 2, 16, cols), dtype)
    f = jax.jit(lambda x: fn(x, "native"))
    with _tuning(_REGISTER_PAIR):
        y_register = jax.block_until_ready(f(x))
    before = _warmups("scaled_masked_softmax_fwd")
    y = _compare(fn, (2, 2, 16, cols), dtype, 11)
    assert _warmups("scaled_masked_softmax_fwd") >= before + 1  # a key the register kernel did not warm
    T.assert_close(y, y_register, dtype)


# ---- non-finite inputs: NaN / +inf / -inf in random positions, every kernel path ---------------


def _sprinkle(x, seed, scale, frac=0.01):
    """x with NaN, +inf and -inf at random positions, plus rows 0..3 of the [rows, S] view set so
    that z = scale * x is: all -inf, one NaN among -infs, one +inf, one -inf among finite values."""
    rows = x.reshape(-1, x.shape[-1])
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    hit = jax.random.bernoulli(ka, frac, rows.shape)
    vals = jnp.array([jnp.nan, jnp.inf, -jnp.inf], rows.dtype)[jax.random.randint(kb, rows.shape, 0, 3)]
    rows = jnp.where(hit, vals, rows)
    col = int(jax.random.randint(kc, (), 0, x.shape[-1]))
    low = -jnp.inf if scale > 0 else jnp.inf
    rows = rows.at[0].set(low).at[1].set(low).at[1, col].set(jnp.nan).at[2, col].set(-low).at[3, col].set(low)
    return rows.reshape(x.shape)


def _assert_same_with_nan(got, want, dtype, scale=1.0, msg=""):
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"NaN positions differ {msg}")
    tol = T.tolerance(dtype)
    np.testing.assert_allclose(g, w, rtol=tol["rtol"], atol=tol["atol"] * scale, equal_nan=True, err_msg=msg)


def _compare_nonfinite(fn, x, dtype, seed):
    dy = jax.random.normal(jax.random.key(seed + 7), x.shape, jnp.float32).at[..., ::7].set(jnp.nan)
    y, dx = _run(fn, x, dy, "native")
    y_ref, dx_ref = _run(fn, x, dy, "reference")
    assert bool(jnp.isnan(y_ref.astype(jnp.float32)).any()), "the case must hold NaN rows"
    assert bool((y_ref == 0).all(-1).any()), "the case must hold all-zero rows"
    _assert_same_with_nan(y, y_ref, dtype, msg="forward")
    # Documented rule: a position whose own y is 0 gets a zero gradient. y within rounding of the
    # reference can still be 0 on one side only (a float16 probability at the subnormal edge), where
    # the two sides then differ by the rule itself: check the rule there and compare elsewhere.
    y32, yr32 = y.astype(jnp.float32), y_ref.astype(jnp.float32)
    assert bool((jnp.where(y32 == 0, dx.astype(jnp.float32), 0) == 0).all()), "nonzero gradient where y == 0"
    edge = (y32 == 0) != (yr32 == 0)
    dx, dx_ref = jnp.where(edge, 0, dx), jnp.where(edge, 0, dx_ref)
    finite = jnp.where(jnp.isfinite(dx_ref.astype(jnp.float32)), jnp.abs(dx_ref.astype(jnp.float32)), 0)
    _assert_same_with_nan(dx, dx_ref, dtype, scale=float(finite.max()) + 1e-6, msg="backward")


# Rows of each forward kernel: register (tiny rows, vectors, odd lengths), warp-row (1032..4096
# 2-byte elements), and the long-row kernel (more than 16384 2-byte / 8192 4-byte elements).
NONFINITE_ROWS = [(6, 16), (5, 200), (4, 37), (4, 1032), (4, 4096), (4, 20000)]
NONFINITE_CAUSAL = [24, 264, 2048]
NONFINITE_MASKED = [
    ((2, 2, 16, 64), (2, 1, 16, 64)),
    ((2, 2, 9, 37), (1, 1, 9, 37)),
    ((1, 2, 8, 4096), (1, 1, 8, 4096)),
    ((1, 1, 6, 20000), (1, 1, 6, 20000)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NONFINITE_ROWS)
@pytest.mark.parametrize("scale", [0.7, -0.4])
def test_nonfinite_scaled_softmax_native(dtype, shape, scale):
    x = _sprinkle(_x(50, shape, dtype), 51, scale)
    _compare_nonfinite(lambda x, impl: te_ops.scaled_softmax(x, scale, implementation=impl), x, dtype, 52)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", NONFINITE_CAUSAL)
@pytest.mark.parametrize("scale", [0.5, -0.3])
def test_nonfinite_upper_triang_native(dtype, s, scale):
    x = _sprinkle(_x(53, (1, 2, s, s), dtype), 54, scale)
    fn = lambda x, impl: te_ops.scaled_upper_triang_masked_softmax(x, scale, implementation=impl)
    _compare_nonfinite(fn, x, dtype, 55)


def _nonfinite_mask(mask_shape, seed):
    mask = jax.random.bernoulli(jax.random.key(seed), 0.3, mask_shape)
    # row 4: masked everywhere (x there holds NaN/inf from the sprinkling below: still zeros);
    # row 5: one unmasked element
    return mask.at[0, 0, 4].set(True).at[0, 0, 5].set(True).at[0, 0, 5, 2].set(False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", NONFINITE_MASKED)
@pytest.mark.parametrize("scale", [0.9, -0.6])
def test_nonfinite_masked_native(dtype, shapes, scale):
    x_shape, mask_shape = shapes
    mask = _nonfinite_mask(mask_shape, 56)
    x = _sprinkle(_x(57, x_shape, dtype), 58, scale)
    x = x.at[0, 0, 4, ::3].set(jnp.nan).at[0, 0, 4, 1::3].set(jnp.inf)
    fn = lambda x, impl: te_ops.scaled_masked_softmax(x, mask, scale, implementation=impl)
    _compare_nonfinite(fn, x, dtype, 59)


@pytest.mark.parametrize("kernel", list(WARP_ROW))
@pytest.mark.parametrize("mode", ["none", "causal", "mask"])
@pytest.mark.parametrize("scale", [0.8, -0.5])
def test_nonfinite_warp_row_variants(kernel, mode, scale):
    """The warp-row forwards (forced through the tuning pair) on non-finite inputs: the +inf-max,
    NaN-sum and NaN-among-(-inf) exits, with positive and negative scale."""
    dtype, s = jnp.bfloat16, 1024
    x = _sprinkle(_x(60, (1, 2, 16, s) if mode != "causal" else (1, 1, s, s), dtype), 61, scale)
    if mode == "none":
        fn = lambda x, impl: te_ops.scaled_softmax(x, scale, implementation=impl)
    elif mode == "causal":
        fn = lambda x, impl: te_ops.scaled_upper_triang_masked_softmax(x, scale, implementation=impl)
    else:
        mask = _nonfinite_mask((1, 1, 16, s), 62)
        x = x.at[0, 0, 4, ::3].set(jnp.nan)
        fn = lambda x, impl: te_ops.scaled_masked_softmax(x, mask, scale, implementation=impl)
    rows = math.prod(x.shape[:-1])
    with _tuning(WARP_ROW[kernel]):
        assert _chosen_kernel(dtype, rows, s, mode, scale) == kernel
        _compare_nonfinite(fn, x, dtype, 63)
