"""Softmax family on CPU: reference vs jax.nn.softmax, gradients, jit, vmap, sharding, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as Ps

import te_ops
from te_ops._core import testing as T

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _key(seed):
    return jax.random.key(seed)


def _x(seed, shape, dtype):
    return (3.0 * jax.random.normal(_key(seed), shape, jnp.float32)).astype(dtype)


def _expected(x, scale, keep=None):
    """jax.nn.softmax with `where`, rows with nothing kept -> 0 (the documented semantics)."""
    z = scale * x.astype(jnp.float32)
    if keep is None:
        return jax.nn.softmax(z, axis=-1)
    keep = jnp.broadcast_to(keep, z.shape)
    y = jax.nn.softmax(z, axis=-1, where=keep)
    return jnp.where(keep.any(-1, keepdims=True) & keep, y, 0.0)


def _causal_keep(s):
    return jnp.tril(jnp.ones((s, s), bool))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 33), (2, 3, 5, 130)])
def test_scaled_softmax_matches_jax(dtype, shape):
    x = _x(0, shape, dtype)
    y = te_ops.scaled_softmax(x, 0.37)
    assert y.dtype == dtype and y.shape == x.shape
    T.assert_close(y, _expected(x, 0.37), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [(2, 1, 6, 40), (1, 1, 6, 40), (2, 1, 1, 40), (6, 40), (2, 3, 6, 40)])
def test_scaled_masked_softmax_matches_jax(dtype, mask_shape):
    x = _x(1, (2, 3, 6, 40), dtype)
    mask = jax.random.bernoulli(_key(2), 0.4, mask_shape)
    y = te_ops.scaled_masked_softmax(x, mask, 0.5)
    exp = _expected(x, 0.5, keep=~mask.reshape((1,) * (4 - mask.ndim) + mask.shape))
    T.assert_close(y, exp, dtype)
    # masked positions are exactly zero
    m = jnp.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), x.shape)
    assert bool(jnp.all(jnp.where(m, y, 0) == 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_upper_triang_matches_jax(dtype):
    x = _x(3, (2, 2, 17, 17), dtype)
    y = te_ops.scaled_upper_triang_masked_softmax(x, 1.3)
    T.assert_close(y, _expected(x, 1.3, keep=_causal_keep(17)), dtype)
    assert bool(jnp.all(jnp.triu(y.astype(jnp.float32), k=1) == 0))


def test_fully_masked_rows_give_zeros_and_zero_grad():
    x = _x(4, (1, 2, 4, 16), jnp.float32)
    mask = jax.random.bernoulli(_key(5), 0.3, (1, 1, 4, 16)).at[0, 0, 2].set(True)
    y = te_ops.scaled_masked_softmax(x, mask, 1.0)
    assert bool(jnp.all(y[:, :, 2] == 0)) and not bool(jnp.isnan(y).any())
    g = jax.grad(lambda x: jnp.sum(te_ops.scaled_masked_softmax(x, mask, 1.0) * jnp.arange(16.0)))(x)
    assert bool(jnp.all(g[:, :, 2] == 0)) and not bool(jnp.isnan(g).any())
    assert float(jnp.abs(g).sum()) > 0  # other rows do get a gradient


def _cotangent(seed, shape):
    return jax.random.normal(_key(seed), shape, jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["plain", "masked", "causal"])
def test_gradients_match_jax(dtype, variant):
    shape = (2, 2, 9, 9)
    x = _x(6, shape, dtype)
    ct = _cotangent(7, shape)
    mask = jax.random.bernoulli(_key(8), 0.3, (2, 1, 9, 9))
    scale = 0.8
    if variant == "plain":
        ours = lambda x: te_ops.scaled_softmax(x, scale)
        keep = None
    elif variant == "masked":
        ours = lambda x: te_ops.scaled_masked_softmax(x, mask, scale)
        keep = ~mask
    else:
        ours = lambda x: te_ops.scaled_upper_triang_masked_softmax(x, scale)
        keep = _causal_keep(9)
    g = jax.grad(lambda x: jnp.sum(ours(x).astype(jnp.float32) * ct))(x)
    x32 = x.astype(jnp.float32)
    g_ref = jax.grad(lambda x: jnp.sum(_expected(x, scale, keep) * ct))(x32)
    assert g.dtype == dtype
    T.assert_close(g, g_ref, dtype, scale=float(jnp.abs(g_ref).max()))


def test_backward_formula():
    """dx = scale * y * (dy - sum(dy * y)) exactly as the spec writes it."""
    x = _x(9, (3, 11), jnp.float32)
    dy = _cotangent(10, (3, 11))
    y, vjp = jax.vjp(lambda x: te_ops.scaled_softmax(x, 2.0), x)
    (dx,) = vjp(dy)
    T.assert_close(dx, 2.0 * y * (dy - jnp.sum(dy * y, -1, keepdims=True)), jnp.float32)


def test_jit_and_vmap():
    x = _x(11, (3, 2, 2, 8, 8), jnp.bfloat16)
    mask = jax.random.bernoulli(_key(12), 0.3, (2, 1, 8, 8))
    f = jax.jit(jax.vmap(lambda x: te_ops.scaled_masked_softmax(x, mask, 0.7)))
    y = f(x)
    T.assert_close(y, jax.vmap(lambda x: _expected(x, 0.7, ~mask))(x), jnp.bfloat16)
    # vmapped mask too (batched over the same axis)
    masks = jax.random.bernoulli(_key(13), 0.3, (3, 1, 1, 8, 8))
    y2 = jax.vmap(lambda x, m: te_ops.scaled_masked_softmax(x, m, 0.7))(x, masks)
    T.assert_close(y2, jax.vmap(lambda x, m: _expected(x, 0.7, ~m))(x, masks), jnp.bfloat16)
    # vmap of the gradient of the causal variant
    gx = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(te_ops.scaled_upper_triang_masked_softmax(x, 0.7) ** 2))))(
        x.astype(jnp.float32)
    )
    gr = jax.vmap(jax.grad(lambda x: jnp.sum(_expected(x, 0.7, _causal_keep(8)) ** 2)))(x.astype(jnp.float32))
    T.assert_close(gx, gr, jnp.float32, scale=float(jnp.abs(gr).max()))


def test_scaled_softmax_vmap_over_non_leading_axis():
    x = _x(14, (4, 5, 6), jnp.float32)
    y = jax.vmap(lambda r: te_ops.scaled_softmax(r, 1.5), in_axes=1, out_axes=1)(x)
    T.assert_close(y, _expected(x, 1.5), jnp.float32)


# ------------------------------------------------------------------------------------------------
# Sharding on 8 virtual CPU devices
# ------------------------------------------------------------------------------------------------


def test_sharded_batch_heads_query_no_collectives():
    mesh = T.cpu_mesh((2, 2, 2), ("b", "n", "q"))
    x = _x(15, (4, 4, 8, 32), jnp.float32)
    mask = jax.random.bernoulli(_key(16), 0.3, (4, 1, 8, 32))
    fn = lambda x, m: te_ops.scaled_masked_softmax(x, m, 0.3)
    spec = Ps("b", "n", "q", None)
    out, ref, counts = T.run_sharded(fn, (x, mask), (spec, Ps("b", None, "q", None)), spec, mesh=mesh)
    T.assert_close(out, ref, jnp.float32)
    assert sum(counts.values()) == 0, counts


def test_sharded_grad_no_collectives():
    mesh = T.cpu_mesh((8,), ("b",))
    x = _x(17, (8, 2, 8, 16), jnp.float32)
    fn = jax.grad(lambda x: jnp.sum(te_ops.scaled_softmax(x, 0.9) ** 2))
    out, ref, counts = T.run_sharded(fn, (x,), (Ps("b"),), Ps("b"), mesh=mesh)
    T.assert_close(out, ref, jnp.float32, scale=float(jnp.abs(ref).max()))
    assert sum(counts.values()) == 0, counts


def test_sharded_softmax_axis_is_gathered():
    mesh = T.cpu_mesh((8,), ("k",))
    x = _x(18, (2, 2, 4, 64), jnp.float32)
    fn = lambda x: te_ops.scaled_softmax(x, 1.0)
    out, ref, counts = T.run_sharded(fn, (x,), (Ps(None, None, None, "k"),), None, mesh=mesh)
    T.assert_close(out, ref, jnp.float32)
    assert counts["all-gather"] + counts["all-to-all"] + counts["collective-permute"] >= 1, counts


def test_sharded_causal_query_axis():
    """The causal kernel reads the query index from the local row: a sharded Sq must be gathered."""
    mesh = T.cpu_mesh((4, 2), ("b", "q"))
    x = _x(19, (4, 2, 16, 16), jnp.float32)
    fn = lambda x: te_ops.scaled_upper_triang_masked_softmax(x, 1.0)
    out, ref, _ = T.run_sharded(fn, (x,), (Ps("b", None, "q", None),), None, mesh=mesh)
    T.assert_close(out, ref, jnp.float32)
    T.assert_close(ref, _expected(x, 1.0, _causal_keep(16)), jnp.float32)


# ------------------------------------------------------------------------------------------------
# Implementation selection and errors
# ------------------------------------------------------------------------------------------------


def test_named_native_raises_with_reason_on_cpu():
    if te_ops.native_unavailable_reason() is None:
        pytest.skip("a CUDA device is present: native can run here")
    x = _x(20, (2, 8), jnp.float32)
    with pytest.raises(te_ops.ImplementationUnavailableError, match="native.*cannot run"):
        te_ops.scaled_softmax(x, 1.0, implementation="native")
    with te_ops.use_implementation(softmax="native"):
        with pytest.raises(te_ops.ImplementationUnavailableError):
            te_ops.scaled_softmax(x, 1.0)


def test_reference_by_name_and_context_manager():
    x = _x(21, (2, 8), jnp.float32)
    y1 = te_ops.scaled_softmax(x, 1.0, implementation="reference")
    with te_ops.use_implementation("reference"):
        y2 = te_ops.scaled_softmax(x, 1.0)
    T.assert_close(y1, y2, jnp.float32)
    with pytest.raises(ValueError, match="unknown implementation='cutlass'"):
        te_ops.scaled_softmax(x, 1.0, implementation="cutlass")


def test_one_jitted_function_has_no_ffi_call_in_cpu_hlo():
    x = _x(22, (2, 8, 8), jnp.float32)
    text = jax.jit(lambda x: te_ops.scaled_upper_triang_masked_softmax(x, 1.0)).lower(x).as_text()
    assert "te_softmax" not in text


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: te_ops.scaled_softmax(jnp.ones((2, 3), jnp.int32)), TypeError, "x must be float32.*int32"),
        (lambda: te_ops.scaled_softmax(jnp.ones((2, 3)), jnp.float32(2.0)), TypeError, "scale must be a static"),
        (lambda: te_ops.scaled_softmax(jnp.ones((2, 3)), float("nan")), ValueError, "scale must be finite"),
        (lambda: te_ops.scaled_masked_softmax(jnp.ones((2, 3, 4)), jnp.zeros((4,), bool)), ValueError, "rank 4"),
        (
            lambda: te_ops.scaled_masked_softmax(jnp.ones((2, 3, 4, 5)), jnp.zeros((2, 1, 4, 5), jnp.int32)),
            TypeError,
            "mask must be a bool",
        ),
        (
            lambda: te_ops.scaled_masked_softmax(jnp.ones((2, 3, 4, 5)), jnp.zeros((3, 1, 4, 5), bool)),
            ValueError,
            "not broadcastable",
        ),
        (lambda: te_ops.scaled_upper_triang_masked_softmax(jnp.ones((2, 3, 4))), ValueError, "square"),
        (lambda: te_ops.scaled_upper_triang_masked_softmax(jnp.ones((4,))), ValueError, "rank >= 2"),
    ],
)
def test_bad_input_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_traced_scale_rejected_under_jit():
    with pytest.raises(TypeError, match="scale must be a static"):
        jax.jit(lambda x, s: te_ops.scaled_softmax(x, s))(jnp.ones((2, 3)), 2.0)


def test_large_row_and_extreme_values():
    """Rows longer than one block and logits far apart stay finite and normalised."""
    x = jnp.concatenate([jnp.full((2, 1), 80.0), _x(23, (2, 9000), jnp.float32)], axis=1)
    y = te_ops.scaled_softmax(x, 1.0)
    np.testing.assert_allclose(np.asarray(y.sum(-1)), 1.0, rtol=1e-5)
    T.assert_close(y, _expected(x, 1.0), jnp.float32)
    assert math.isclose(float(y[0, 0]), 1.0, rel_tol=1e-6)


# ---- launch choices of the native forward (host logic only; the kernels run in tests/gpu) ------


def _native_module_or_skip():
    from te_ops._core import native

    if native.extension_unavailable_reason() is not None:
        pytest.skip(f"te_ops._native not built: {native.extension_unavailable_reason()}")
    return native.module()


@pytest.mark.parametrize("nv", [16, -16])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_warp_row_tuning_pairs_select_one_warp_per_row(nv, mode):
    mod = _native_module_or_skip()
    default = mod.softmax_config(1, 1000, 4096, mode)
    try:
        mod.softmax_set_tuning(32, nv)
        for cols, want_nv in [(4096, 16), (4088, 16), (2048, 8), (1032, 8), (1000, 4), (8, 4)]:
            c = mod.softmax_config(1, 1001, cols, mode)  # bf16
            assert (c["threads_per_row"], c["vectors_per_thread"], c["vec"]) == (32, want_nv, 8), (cols, c)
            assert c["block"] == 128 and c["grid"] == 251, c  # 4 rows (warps) per block
        # not covered: odd length (no 16-byte vectors) and > 512 vectors fall back to the heuristic
        for cols in (4097, 4104, 8192):
            mod.softmax_set_tuning(0, 0)
            want = mod.softmax_config(1, 1000, cols, mode)
            mod.softmax_set_tuning(32, nv)
            assert mod.softmax_config(1, 1000, cols, mode) == want, cols
        # float32: rows up to 2048 for the exact variant; the packed one is bf16 only (a float32 row
        # under the packed pair gets the default launch, which for 2048 columns is the exact variant)
        mod.softmax_set_tuning(32, nv)
        c = mod.softmax_config(0, 1000, 2048, mode)
        assert (c["threads_per_row"], c["vectors_per_thread"], c["vec"], c["block"]) == (32, 16, 4, 128), c
        assert c["kernel"] == "warp-row", c
        c = mod.softmax_config(0, 1000, 1000, mode)  # 250 vectors: warp-row either way (8 per lane)
        assert (c["kernel"], c["vectors_per_thread"]) == ("warp-row", 8), c
        c = mod.softmax_config(0, 1000, 500, mode)  # 125 vectors: the pair forces warp-row, else register
        assert c["kernel"] == ("warp-row" if nv > 0 else "register"), c
    finally:
        mod.softmax_set_tuning(0, 0)
    assert mod.softmax_config(1, 1000, 4096, mode) == default


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_default_forward_kernel_rule(mode):
    """Without a tuning pair: the register kernel up to 128 16-byte vectors per row (one warp x 4
    vectors), the exact warp-per-row kernel for longer rows up to 512 vectors, the register or the
    long-row kernel beyond, and the register kernel wherever the warp-row kernel does not apply (no
    16-byte vectors, scale 0 or not finite)."""
    mod = _native_module_or_skip()
    mod.softmax_set_tuning(0, 0)
    cases = [  # (dtype, cols, scale) -> kernel
        ((1, 1024, 0.125), "register"),
        ((1, 1032, 0.125), "warp-row"),
        ((1, 4096, 0.125), "warp-row"),
        ((2, 2048, -0.5), "warp-row"),
        ((0, 512, 1.0), "register"),
        ((0, 516, 1.0), "warp-row"),
        ((0, 2048, 1.0), "warp-row"),
        ((0, 2052, 1.0), "register"),
        ((1, 4104, 0.125), "register"),
        ((1, 4097, 0.125), "register"),
        ((1, 4096, 0.0), "register"),
        ((1, 4096, float("inf")), "register"),
    ]
    for (dtype, cols, scale), want in cases:
        c = mod.softmax_config(dtype, 1000, cols, mode, scale)
        assert c["kernel"] == want, (dtype, cols, scale, c)
        assert c["threads_per_row"] * c["vectors_per_thread"] * c["vec"] >= cols or c["threads_per_row"] == 0


# ------------------------------------------------------------------------------------------------
# Non-finite inputs (the semantics every implementation shares; tests/gpu checks the kernels)
# ------------------------------------------------------------------------------------------------


def _sprinkle(x, seed, scale, frac=0.02):
    """x with NaN, +inf and -inf at random positions, plus rows 0..3 of the flattened [rows, S]
    view set so that z = scale * x is: all -inf, one NaN among -infs, one +inf, one -inf."""
    rows = x.reshape(-1, x.shape[-1])
    ka, kb, kc = jax.random.split(_key(seed), 3)
    hit = jax.random.bernoulli(ka, frac, rows.shape)
    vals = jnp.array([jnp.nan, jnp.inf, -jnp.inf], rows.dtype)[jax.random.randint(kb, rows.shape, 0, 3)]
    rows = jnp.where(hit, vals, rows)
    col = int(jax.random.randint(kc, (), 0, x.shape[-1]))
    low = -jnp.inf if scale > 0 else jnp.inf  # the x whose z is -inf
    rows = rows.at[0].set(low)
    rows = rows.at[1].set(low).at[1, col].set(jnp.nan)
    rows = rows.at[2, col].set(-low)
    rows = rows.at[3, col].set(low)
    return rows.reshape(x.shape)


def _expected_nonfinite(x, scale, keep=None):
    """The documented rule, written with jax.nn.softmax(where=...): NaN/+inf on a kept position
    -> NaN on every kept position, masked -> 0, no finite kept element -> zeros."""
    z = x.astype(jnp.float32) * jnp.float32(scale)
    keep = jnp.ones(z.shape, bool) if keep is None else jnp.broadcast_to(keep, z.shape)
    y = jnp.where(keep, jax.nn.softmax(z, axis=-1, where=keep), 0.0)
    empty = ~jnp.any(keep & ~jnp.isneginf(z), axis=-1, keepdims=True)
    return jnp.where(empty, 0.0, y)


def _grad_rule(y, dy, scale):
    """dx = scale*y*(dy - sum over y != 0 of y*dy) where y != 0, else 0 (float64)."""
    y, dy = np.asarray(y, np.float64), np.asarray(dy, np.float64)
    live = y != 0
    dot = np.where(live, y * dy, 0.0).sum(-1, keepdims=True)
    return np.where(live, scale * y * (dy - dot), 0.0)


def _assert_same_with_nan(got, want, dtype, msg=""):
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"NaN positions differ {msg}")
    np.testing.assert_allclose(g, w, equal_nan=True, err_msg=msg, **T.tolerance(dtype))


def _nonfinite_case(variant, dtype, scale, seed):
    x = _sprinkle(_x(seed, (2, 3, 12, 24), dtype), seed + 1, scale)
    if variant == "plain":
        return x, (lambda x: te_ops.scaled_softmax(x, scale)), None
    if variant == "causal":
        x = _sprinkle(_x(seed, (2, 3, 24, 24), dtype), seed + 1, scale)
        return x, (lambda x: te_ops.scaled_upper_triang_masked_softmax(x, scale)), _causal_keep(24)
    mask = jax.random.bernoulli(_key(seed + 2), 0.3, (2, 1, 12, 24)).at[0, 0, 5].set(True)  # one row all masked
    mask = mask.at[0, 0, 6].set(True).at[0, 0, 6, 3].set(False)  # one visible element
    return x, (lambda x: te_ops.scaled_masked_softmax(x, mask, scale)), ~mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["plain", "masked", "causal"])
@pytest.mark.parametrize("scale", [0.7, -1.3])
def test_nonfinite_inputs_forward_and_backward(variant, dtype, scale):
    x, fn, keep = _nonfinite_case(variant, dtype, scale, seed=40)
    dy = _cotangent(41, x.shape).at[..., ::5].set(jnp.nan)  # NaN cotangents, some at zero-probability spots
    y, vjp = jax.jit(lambda x: jax.vjp(fn, x))(x)
    (dx,) = vjp(dy.astype(dtype))
    want = _expected_nonfinite(x, scale, keep)
    assert bool(jnp.isnan(want).any()) and bool((want == 0).all(-1).any()), "the case must hold NaN and zero rows"
    _assert_same_with_nan(y, want, dtype, variant)
    _assert_same_with_nan(
        dx, _grad_rule(y.astype(jnp.float32), dy.astype(dtype).astype(jnp.float32), scale), dtype, variant
    )


def test_nonfinite_rules_row_by_row():
    x = jnp.array(
        [
            [1.0, jnp.nan, 2.0, 3.0],  # NaN -> whole row NaN
            [1.0, jnp.inf, 2.0, 3.0],  # +inf -> whole row NaN
            [-jnp.inf, 0.0, -jnp.inf, 0.0],  # -inf -> probability 0
            [-jnp.inf] * 4,  # nothing finite -> zeros
            [-jnp.inf, jnp.nan, -jnp.inf, -jnp.inf],  # NaN wins over "nothing finite"
        ]
    )
    y = np.asarray(te_ops.scaled_softmax(x, 1.0))
    assert np.isnan(y[0]).all() and np.isnan(y[1]).all()
    np.testing.assert_array_equal(y[2], [0.0, 0.5, 0.0, 0.5])
    np.testing.assert_array_equal(y[3], 0.0)
    assert np.isnan(y[4]).all()
    # masked positions stay exactly 0 in a NaN row; a masked NaN does not matter
    mask = jnp.array([False, False, True, False])
    ym = np.asarray(te_ops.scaled_masked_softmax(x[None, None], mask, 1.0))[0, 0]
    assert np.isnan(ym[0, [0, 1, 3]]).all() and ym[0, 2] == 0
    xm = x[2:3].at[0, 2].set(jnp.nan)  # NaN at the masked position
    np.testing.assert_array_equal(
        np.asarray(te_ops.scaled_masked_softmax(xm[None, None], mask, 1.0))[0, 0, 0], [0.0, 0.5, 0.0, 0.5]
    )
    # zero gradient on rows without a finite element, whatever dy holds
    g = jax.grad(lambda x: jnp.sum(te_ops.scaled_softmax(x, 1.0) * jnp.array([1.0, jnp.nan, 2.0, 3.0])))(x[3:4])
    np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_zero_scale_with_infinities_is_nan():
    """z = scale * x: 0 * inf is NaN, so scale 0 turns an infinite x into a NaN row."""
    x = _x(42, (3, 10), jnp.float32).at[1, 4].set(jnp.inf)
    y = np.asarray(te_ops.scaled_softmax(x, 0.0))
    np.testing.assert_allclose(y[[0, 2]], 0.1, rtol=1e-6)
    assert np.isnan(y[1]).all()
