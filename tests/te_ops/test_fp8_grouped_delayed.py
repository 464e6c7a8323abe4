"""``fp8_grouped_dense`` with DelayedScaling (MoE experts): one delayed scale for x and for dy, one
per expert for the kernels; the updated state comes back as the cotangent of ``state``.

Checked against a float32 NumPy formulation of the dequantized operands (uneven groups, an empty
group, rows past the groups), the state update against ``fp8.quantize`` tensor by tensor over three
steps, a forward-only call, the staged default implementation, and the error messages. The
``"triton"`` orchestration runs on the CPU with the kernel launches replaced by their reference
stand-ins (the fixture of test_fp8_sharding.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from te_ops import fp8
from tests.te_ops.test_fp8_sharding import triton_on_cpu  # noqa: F401 - a fixture

NP_FMT = {jnp.dtype(jnp.float8_e4m3fn): ml_dtypes.float8_e4m3fn, jnp.dtype(jnp.float8_e5m2): ml_dtypes.float8_e5m2}
REC = fp8.DelayedScaling(history_len=4, margin=1)
G, M, K, N = 4, 300, 256, 130
SIZES = np.array([100, 0, 120, 50], np.int32)  # an empty group; 30 rows past the groups


def _np_deq(a32, scale, fmt):
    """fp8(clip(a * scale)) / scale in float32 with NumPy / ml_dtypes (an independent formulation)."""
    fmax = np.float32(fp8.format_max(fmt))
    q = np.clip(a32 * np.float32(scale), -fmax, fmax).astype(NP_FMT[jnp.dtype(fmt)])
    return q.astype(np.float32) * (np.float32(1.0) / np.float32(scale))


def _start_state():
    """Non-trivial scales (so the test sees which scale quantized what) and some history."""
    st = fp8.initial_grouped_state(REC, G)
    return fp8.DenseScalingState(
        fp8.DelayedScalingState(st.x.amax_history.at[1].set(3.0), jnp.float32(32.0)),
        fp8.DelayedScalingState(st.w.amax_history.at[:, 2].set(0.2), jnp.asarray([900.0, 500.0, 1300.0, 700.0])),
        fp8.DelayedScalingState(st.g.amax_history, jnp.float32(2048.0)),
    )


def _step_inputs(rng, step):
    x = (rng.standard_normal((M, K)) * (1 + step)).astype(np.float32)
    x[M - 7, 11] = 60.0 * (1 + step)  # the largest |x| sits in a row past the groups
    w = (rng.standard_normal((G, K, N)) / 16 * np.array([1, 3, 0.5, 2])[:, None, None]).astype(np.float32)
    dy = (rng.standard_normal((M, N)) * 0.01).astype(np.float32)
    dy[M - 3, 5] = 0.5  # dy's amax too
    return x, w, dy


def _want(x, w, dy, st):
    """y, dx, dW per group from the dequantized operands in float32 (rows past the groups zero)."""
    sx, sg, sw = np.float32(st.x.scale), np.float32(st.g.scale), np.asarray(st.w.scale, np.float32)
    xq, dyq = _np_deq(x, sx, fp8.E4M3), _np_deq(dy, sg, REC.format("g"))
    y, dx, dw, r0 = np.zeros((M, N), np.float32), np.zeros((M, K), np.float32), np.zeros((G, K, N), np.float32), 0
    for g, size in enumerate(SIZES):
        wq = _np_deq(w[g], sw[g], fp8.E4M3)
        rows = slice(r0, r0 + size)
        y[rows] = xq[rows] @ wq
        dx[rows] = dyq[rows] @ wq.T
        dw[g] = xq[rows].T @ dyq[rows]
        r0 += size
    return y, dx, dw


def _step_fn(impl):
    def step(x, w, st, dy):
        y, vjp = jax.vjp(lambda x, w, st: fp8.fp8_grouped_dense(x, w, jnp.asarray(SIZES), REC, state=st,
                                                                implementation=impl), x, w, st)  # fmt: skip
        return (y, *vjp(dy))

    return jax.jit(step)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_grouped_delayed_matches_float32_reference_over_three_steps(request, impl):
    """Three training steps with fresh inputs: y, dx and dW equal the float32 GEMMs of the operands
    quantized with the *incoming* state's scales (x and dy one scale each, each expert its own), and
    the returned state is, tensor by tensor, what ``fp8.quantize`` with delayed scaling returns for x,
    each expert's kernel and dy. The amaxes of x and dy include the rows past the groups."""
    if impl == "triton":
        request.getfixturevalue("triton_on_cpu")
    rng = np.random.default_rng(2024)
    f = _step_fn(impl)
    st = _start_state()
    for step in range(3):
        x, w, dy = _step_inputs(rng, step)
        y, dx, dw, new = f(jnp.asarray(x), jnp.asarray(w), st, jnp.asarray(dy))
        for name, got, want in zip(("y", "dx", "dw"), (y, dx, dw), _want(x, w, dy, st), strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.max(np.abs(want)), err_msg=name)
        assert not np.any(np.asarray(y)[SIZES.sum() :]) and not np.any(np.asarray(dx)[SIZES.sum() :])
        assert not np.any(np.asarray(dw)[1]), "the empty group's kernel gradient is zero"
        # the state update, tensor by tensor, from te_ops.fp8.quantize
        _, want_x = fp8.quantize(jnp.asarray(x), REC, "x", st.x)
        _, want_g = fp8.quantize(jnp.asarray(dy), REC, "g", st.g)
        for got_st, want_st in ((new.x, want_x), (new.g, want_g)):
            np.testing.assert_array_equal(np.asarray(got_st.amax_history), np.asarray(want_st.amax_history))
            np.testing.assert_array_equal(np.asarray(got_st.scale), np.asarray(want_st.scale))
        assert float(new.x.amax_history[0]) == float(np.max(np.abs(x))) == 60.0 * (1 + step)  # a row past the groups
        assert float(new.g.amax_history[0]) == float(np.float32(0.5))
        for g in range(G):
            st_g = fp8.DelayedScalingState(st.w.amax_history[g], st.w.scale[g])
            _, want_w = fp8.quantize(jnp.asarray(w[g]), REC, "w", st_g)
            np.testing.assert_array_equal(np.asarray(new.w.amax_history[g]), np.asarray(want_w.amax_history))
            np.testing.assert_array_equal(np.asarray(new.w.scale[g]), np.asarray(want_w.scale))
        assert len(set(np.asarray(new.w.scale).tolist())) == G, "one scale per expert"
        st = new


def test_grouped_delayed_forward_only_updates_nothing():
    """A forward-only call quantizes with the state's scales and returns only y: the state passed in
    is the state afterwards (no hidden update), and the next call gives the same y."""
    rng = np.random.default_rng(7)
    x, w, _ = _step_inputs(rng, 0)
    st = _start_state()
    before = jax.tree.map(np.asarray, st)
    f = jax.jit(lambda x, w, st: fp8.fp8_grouped_dense(x, w, jnp.asarray(SIZES), REC, state=st))
    y1 = f(jnp.asarray(x), jnp.asarray(w), st)
    y2 = f(jnp.asarray(x), jnp.asarray(w), st)
    assert isinstance(y1, jax.Array) and y1.shape == (M, N)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, st), before)
    want_y = _want(x, w, np.zeros((M, N), np.float32), st)[0]
    np.testing.assert_allclose(np.asarray(y1), want_y, rtol=0, atol=1e-5 * np.max(np.abs(want_y)))


def test_grouped_delayed_bf16_and_one_expert():
    """bfloat16 operands (outputs and gradients in bfloat16, the state in float32) and G = 1."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, 128, 256)) / 12, jnp.bfloat16)
    st = fp8.initial_grouped_state(REC, 1)
    y, vjp = jax.vjp(lambda x, w, st: fp8.fp8_grouped_dense(x, w, jnp.asarray([50]), REC, state=st), x, w, st)
    dx, dw, new = vjp(jnp.ones_like(y))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    assert new.w.amax_history.shape == (1, 4) and new.w.scale.dtype == jnp.float32
    assert float(new.w.amax_history[0, 0]) == float(jnp.max(jnp.abs(w.astype(jnp.float32))))


def test_grouped_delayed_default_implementation_is_staged(monkeypatch, stub_triton_launcher):
    """``implementation=None`` where the Triton FP8 path can run: the Triton launches in the CUDA
    lowering, the reference on the CPU, in one jitted step whose state output is the reference's."""
    from te_ops._core import triton_bridge as tb
    from te_ops.fp8 import select

    monkeypatch.setattr(select, "triton_fp8_unavailable_reason", lambda: None)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 256, 384)) / 16, jnp.bfloat16)
    gs = jnp.asarray([100, 0, 120], jnp.int32)
    rec = fp8.DelayedScaling(history_len=2)
    st = fp8.initial_grouped_state(rec, 3)

    def loss(x, w, st, impl=None):
        return jnp.sum(fp8.fp8_grouped_dense(x, w, gs, rec, state=st, implementation=impl).astype(jnp.float32) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    with tb.target_override(("cuda", 90, 32)):
        cuda_hlo = grad.trace(x, w, st).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda_hlo.count(tb.FFI_TARGET) >= 5  # casts of x, kernels, dy; GEMMs; wgrad
    assert tb.FFI_TARGET not in grad.lower(x, w, st).as_text()
    got = grad(x, w, st)
    want = jax.jit(jax.value_and_grad(lambda x, w, st: loss(x, w, st, "reference"), (0, 1, 2)))(x, w, st)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


_X, _W, _GS = jnp.ones((8, 16)), jnp.ones((3, 16, 4)), jnp.asarray([2, 0, 3], jnp.int32)
_DENSE_ST = fp8.initial_dense_state(fp8.DelayedScaling(history_len=5))


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: fp8.fp8_grouped_dense(_X, _W, _GS, fp8.DelayedScaling()), TypeError,
         r"DelayedScaling needs state=DenseScalingState .*initial_grouped_state\(recipe, num_groups=3\)\), got None"),
        (lambda: fp8.fp8_grouped_dense(_X, _W, _GS, fp8.DelayedScaling(history_len=5), state=_DENSE_ST), ValueError,
         r"state.w must hold amax_history \[3, 5\] and scale \[3\] .*got amax_history \[5\] and scale \[\]"),
        (lambda: fp8.fp8_grouped_dense(_X, _W, _GS, fp8.DelayedScaling(history_len=4),
                                       state=fp8.initial_grouped_state(fp8.DelayedScaling(history_len=5), 3)),
         ValueError, r"state.x must hold amax_history \[4\] and scale \[\] .*got amax_history \[5\]"),
        (lambda: fp8.fp8_grouped_dense(_X, _W, _GS, fp8.DelayedScaling(history_len=5),
                                       state=fp8.initial_grouped_state(fp8.DelayedScaling(history_len=5), 2)),
         ValueError, r"state.w must hold amax_history \[3, 5\] .*got amax_history \[2, 5\]"),
        (lambda: fp8.fp8_grouped_dense(_X, _W, _GS, fp8.CurrentScaling(),
                                       state=fp8.initial_grouped_state(fp8.DelayedScaling(), 3)),
         ValueError, "state is only for DelayedScaling; CurrentScaling takes state=None"),
        (lambda: fp8.initial_grouped_state(fp8.DelayedScaling(), 0), ValueError, "num_groups must be an int >= 1"),
        (lambda: fp8.initial_grouped_state(fp8.CurrentScaling(), 2), TypeError, "recipe must be a te_ops.fp8.Delayed"),
    ],
)  # fmt: skip
def test_grouped_delayed_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
