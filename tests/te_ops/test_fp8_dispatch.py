"""FP8 token dispatch (``te_ops.fp8.token_dispatch_quantized`` and ``fp8_dispatch_grouped_dense``).

* Moving FP8 rows through the dispatch kernels keeps every bit pattern; the dispatched quantization
  is bit-identical to quantizing after the dispatch (block and current scaling; padding, drops,
  odd H).
* The fused op's forward output and dx are bit-identical to the unfused FP8 path (token_dispatch
  then fp8_grouped_dense), its delayed state too; dW as documented (identical with one scale per
  tensor, within the second-rounding bound with block scaling).
* Gradients against a float32 NumPy formulation (dispatch, per-expert GEMMs, un-permute).
* The "triton" orchestration on the CPU (kernel launches replaced by reference stand-ins), token
  sharding on 8 CPU devices, and errors that name the argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from te_ops import fp8
from te_ops._core import testing as T
from te_ops.fp8 import dispatch as fd
from te_ops.fp8 import reference as ref
from te_ops.permutation import token_dispatch
from tests.te_ops.test_fp8_sharding import triton_on_cpu  # noqa: F401 - a fixture

F32 = jnp.float32
DREC = fp8.DelayedScaling(history_len=4)
RECIPES = [fp8.BlockScaling(), fp8.BlockScaling(power_of_2=False, formats="hybrid"), fp8.CurrentScaling(), DREC]
IDS = ["block", "block-hybrid-nonpow2", "current", "delayed"]


def _routing(rng, t, e, k):
    top = np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k]
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, top, True, axis=1)
    return jnp.asarray(rm)


def _inputs(seed, t=96, h=300, e=4, n=256, k=2, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h)).astype(np.float32)
    x[rng.integers(0, t, 3), rng.integers(0, h, 3)] *= 50.0  # a few outliers
    w = (rng.standard_normal((e, h, n)) / np.sqrt(h)).astype(np.float32)
    return jnp.asarray(x, dtype), _routing(rng, t, e, k), jnp.asarray(w, dtype)


def _state(recipe, e):
    if not isinstance(recipe, fp8.DelayedScaling):
        return None
    st = fp8.initial_grouped_state(recipe, e)  # non-trivial scales, so a wrong one shows
    return fp8.DenseScalingState(
        fp8.DelayedScalingState(st.x.amax_history, jnp.float32(4.0)),
        fp8.DelayedScalingState(st.w.amax_history, jnp.full_like(st.w.scale, 64.0)),
        fp8.DelayedScalingState(st.g.amax_history, jnp.float32(1024.0)),
    )


# ----------------------------------------------------------------------------------------------
# Moving FP8 rows
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_every_byte_pair_survives_the_dispatch(jit):
    """All 65536 (first, second) FP8 byte pairs, E4M3 NaNs and bfloat16 subnormal/NaN patterns
    included, come out of the dispatch unchanged (a row routed to two experts, others to one)."""
    data = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(256, 512)
    q = fp8.QuantizedTensor(jnp.asarray(data).view(jnp.float8_e4m3fn), jnp.float32(0.5), None, jnp.dtype(F32))
    rm = jnp.zeros((256, 3), bool).at[:, 1].set(True).at[::5, 2].set(True)
    n = int(rm.sum())
    f = jax.jit(fp8.token_dispatch_quantized, static_argnums=2) if jit else fp8.token_dispatch_quantized
    r = f(q, rm, n)
    src = np.concatenate([np.arange(256), np.arange(0, 256, 5)])
    T.assert_same_bytes(r.out.data, data[src])
    assert float(r.out.scale_inv) == 0.5


@pytest.mark.parametrize("h", [300, 257, 128], ids=["partial-tile", "odd", "one-tile"])
@pytest.mark.parametrize("align, cap", [(None, 1.0), (16, 1.0), (None, 0.6)], ids=["plain", "aligned", "drops"])
def test_block_dispatch_is_quantize_after_dispatch(h, align, cap):
    """1 x 128 tiles: quantize then move = move then quantize, bytes and scales (padding rows,
    the unused tail and dropped pairs included)."""
    x, rm, _ = _inputs(1, h=h)
    n = int(96 * 2 * cap)
    rec = fp8.BlockScaling()
    q = ref.quantize_blocks(x, (1, 128), rec.format("x"), power_of_2=True)
    got = fp8.token_dispatch_quantized(q, rm, n, align_size=align)
    d = token_dispatch(x, rm, n, align_size=align)
    want = ref.quantize_blocks(d.out, (1, 128), rec.format("x"), power_of_2=True)
    T.assert_same_bytes((got.out.data, got.out.scale_inv), (want.data, want.scale_inv))
    T.assert_same_bytes(
        (got.row_id_map, got.tokens_per_expert, got.num_dropped), (d.row_id_map, d.tokens_per_expert, d.num_dropped)
    )
    if cap < 1:
        assert int(got.num_dropped) > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_current_dispatch_is_quantize_after_dispatch(dtype):
    """One scale: the dispatched bytes are the dispatched tensor's quantization with that scale
    (the same amax: every token routed, nothing dropped)."""
    x, rm, _ = _inputs(2, dtype=dtype)
    q = ref.quantize_tensor(x, fp8.E4M3)
    got = fp8.token_dispatch_quantized(q, rm, 192)
    want = ref.quantize_tensor(token_dispatch(x, rm, 192).out, fp8.E4M3)
    T.assert_same_bytes((got.out.data, got.out.scale_inv), (want.data, want.scale_inv))


# ----------------------------------------------------------------------------------------------
# The fused op against the unfused FP8 path
# ----------------------------------------------------------------------------------------------


def _losses(recipe, rm, n, dy, align=None, impl=None):
    def fused(x, w, st):
        r = fp8.fp8_dispatch_grouped_dense(x, rm, n, w, recipe, align_size=align, state=st, implementation=impl)
        return jnp.sum(r.out.astype(F32) * dy), r

    def unfused(x, w, st):
        d = token_dispatch(x, rm, n, align_size=align)
        y = fp8.fp8_grouped_dense(d.out, w, d.tokens_per_expert, recipe, state=st, implementation=impl)
        return jnp.sum(y.astype(F32) * dy), d

    def grads(f):
        return jax.jit(jax.grad(lambda *a: f(*a)[0], argnums=(0, 1, 2)))

    return fused, unfused, grads


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("align", [None, 32])
def test_forward_dx_and_state_equal_the_unfused_path(recipe, align):
    x, rm, w = _inputs(3)
    n = 192
    st = _state(recipe, 4)
    rows = token_dispatch(x, rm, n, align_size=align).out.shape[0]
    dy = jnp.asarray(np.random.default_rng(4).standard_normal((rows, 256)), F32)
    fused, unfused, grads = _losses(recipe, rm, n, dy, align)
    r = fused(x, w, st)[1]
    y = fp8.fp8_grouped_dense(token_dispatch(x, rm, n, align_size=align).out, w, r.tokens_per_expert, recipe, state=st)
    T.assert_same_bytes(r.out, y)
    g1, g2 = grads(fused)(x, w, st), grads(unfused)(x, w, st)
    T.assert_same_bytes(g1[0], g2[0])  # dx
    T.assert_same_bytes(g1[2], g2[2])  # delayed: the state (None otherwise)
    if isinstance(recipe, fp8.BlockScaling):  # the second rounding of x^T (subnormals only with 2^k scales)
        T.assert_close(g1[1], g2[1], jnp.bfloat16, scale=float(jnp.max(jnp.abs(g2[1].astype(F32)))) * 8)
        differ = np.mean(T.fp8_bytes(g1[1]) != T.fp8_bytes(g2[1]))
        assert (differ < 1e-3) if recipe.power_of_2 else (differ > 1e-2), differ
    else:
        T.assert_same_bytes(g1[1], g2[1])  # one scale per tensor: x^T is the exact FP8 transpose either way


def test_wgrad_operand_within_the_second_rounding_bound():
    """Block scaling: x^T from the dispatched FP8 rows. With power-of-2 scales it equals the
    unfused operand (x^T quantized from high precision) wherever x * scale is normal in both tiles;
    everywhere |deq - x| <= 2^-4 |x| + 2^-10 (sinv_row + sinv_col) (E4M3). Without power-of-2
    scales: two half-ulp roundings."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 384)).astype(np.float32)
    x *= np.exp2(rng.integers(-20, 4, x.shape))  # a wide range: many elements among the subnormals
    x = jnp.asarray(x)
    rm = _routing(rng, 256, 4, 2)
    d = token_dispatch(x, rm, 512).out
    for p2 in (True, False):
        rec = fp8.BlockScaling(power_of_2=p2)
        q = ref.quantize_blocks(x, (1, 128), fp8.E4M3, power_of_2=p2)
        qd = fp8.token_dispatch_quantized(q, rm, 512).out
        got = np.asarray(ref.dequantize(fd.wgrad_operand(qd, rec), F32))
        direct_q = ref.quantize_blocks(d.T, (1, 128), fp8.E4M3, power_of_2=p2)
        direct = np.asarray(ref.dequantize(direct_q, F32))
        xt = np.asarray(d.T)
        s_row = np.repeat(np.asarray(qd.scale_inv), 128, axis=1)[:, :384].T  # [H, N]
        s_col = np.repeat(np.asarray(fd.wgrad_operand(qd, rec).scale_inv), 128, axis=1)[:, : xt.shape[1]]
        rel = 2.0**-4 if p2 else 2.0**-4 + 2.0**-4 + 2.0**-8
        assert np.all(np.abs(got - xt) <= rel * np.abs(xt) + 2.0**-10 * (s_row + s_col) * 1.0001)
        if p2:  # equal where the element is normal in its row tile and in both column tiles
            s_dir = np.repeat(np.asarray(direct_q.scale_inv), 128, axis=1)[:, : xt.shape[1]]
            normal = (np.abs(xt) / s_row >= 2.0**-6) & (np.abs(xt) / np.maximum(s_col, s_dir) >= 2.0**-6)
            assert normal.mean() > 0.5 and (~normal).sum() > 100
            np.testing.assert_array_equal(got[normal], direct[normal])
        else:
            assert np.mean(got != direct) > 0.01


# ----------------------------------------------------------------------------------------------
# Against float32
# ----------------------------------------------------------------------------------------------


def _np_f32(x, rm, w, dy):
    """Dispatch, per-expert GEMMs and the un-permuting sum in float32 NumPy (no capacity limit)."""
    x, rm, w = (np.asarray(a, np.float32) for a in (x, rm, w))
    pairs = [(t, e) for e in range(rm.shape[1]) for t in range(rm.shape[0]) if rm[t, e]]
    xd = np.stack([x[t] for t, _ in pairs])
    y = np.stack([x[t] @ w[e] for t, e in pairs])
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    for i, (t, e) in enumerate(pairs):
        dx[t] += dy[i] @ w[e].T
        dw[e] += np.outer(xd[i], dy[i])
    return y, dx, dw


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_gradients_against_float32(recipe):
    """Relative Frobenius errors against float32: y and dx <= 4.5% (E4M3), dW <= 4.5% (E4M3) /
    7% (E5M2 gradients, hybrid formats); the documented bounds of the FP8 GEMMs."""
    x, rm, w = _inputs(6, t=128, h=256, e=4, n=128, dtype=jnp.float32)
    rng = np.random.default_rng(7)
    dy = rng.standard_normal((256, 128)).astype(np.float32)
    st = _state(recipe, 4)
    if st is not None:  # scales a current-scaling step would pick (delayed: from the history)
        st = fp8.DenseScalingState(
            fp8.DelayedScalingState(st.x.amax_history, jnp.float32(448.0 / float(jnp.max(jnp.abs(x))))),
            fp8.DelayedScalingState(st.w.amax_history, 448.0 / jnp.max(jnp.abs(w), axis=(1, 2))),
            fp8.DelayedScalingState(st.g.amax_history, jnp.float32(57344.0 / float(np.abs(dy).max()))),
        )
    fused, _, grads = _losses(recipe, rm, 256, jnp.asarray(dy))
    y = fused(x, w, st)[1].out
    dx, dw, _ = grads(fused)(x, w, st)
    y32, dx32, dw32 = _np_f32(x, rm, w, dy)
    hybrid = recipe.format("g") == fp8.E5M2
    assert _rel(y, y32) <= 0.045
    assert _rel(dx, dx32) <= (0.07 if hybrid else 0.045)
    assert _rel(dw, dw32) <= (0.07 if hybrid else 0.045)


# ----------------------------------------------------------------------------------------------
# Delayed scaling: the state over steps; amax over every token
# ----------------------------------------------------------------------------------------------


def test_delayed_state_over_three_steps_and_dropped_tokens_in_the_amax():
    """Three steps threading the state: each step's state equals the unfused path's (no drops).
    With a capacity that drops pairs, x's recorded amax is the max over all T tokens (the largest
    |x| sits in a dropped token), where the unfused path records only the kept rows'."""
    x, rm, w = _inputs(8)
    st_a = st_b = _state(DREC, 4)
    for step in range(3):
        xs = x * (1 + step)
        dy = jnp.asarray(np.random.default_rng(10 + step).standard_normal((192, 256)), F32)
        fused, unfused, grads = _losses(DREC, rm, 192, dy)
        st_a, st_b = grads(fused)(xs, w, st_a)[2], grads(unfused)(xs, w, st_b)[2]
        T.assert_same_bytes(st_a, st_b)
        assert float(st_a.x.amax_history[0]) == float(jnp.max(jnp.abs(xs.astype(F32))))
    # drops: a token none of whose pairs fit gets the largest value
    dropped = np.flatnonzero(np.asarray(token_dispatch(x, rm, 120).row_id_map[:, -1]) == 0)
    assert dropped.size
    x2 = x.at[int(dropped[0]), 7].set(1000.0)
    dy = jnp.zeros((120, 256), F32)
    fused, unfused, grads = _losses(DREC, rm, 120, dy)
    sa, sb = grads(fused)(x2, w, _state(DREC, 4))[2], grads(unfused)(x2, w, _state(DREC, 4))[2]
    assert float(sa.x.amax_history[0]) == 1000.0
    assert float(sb.x.amax_history[0]) < 1000.0


# ----------------------------------------------------------------------------------------------
# The "triton" orchestration on the CPU; sharding
# ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("triton_on_cpu")
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_triton_orchestration_matches_reference(recipe):
    x, rm, w = _inputs(11)
    st = _state(recipe, 4)
    dy = jnp.asarray(np.random.default_rng(12).standard_normal((192, 256)), F32)
    f_ref, _, grads = _losses(recipe, rm, 192, dy, impl="reference")
    f_tri, _, _ = _losses(recipe, rm, 192, dy, impl="triton")
    T.assert_close(f_tri(x, w, st)[1].out, f_ref(x, w, st)[1].out, jnp.bfloat16, scale=4.0)
    g_tri, g_ref = grads(f_tri)(x, w, st), grads(f_ref)(x, w, st)
    T.assert_close(g_tri[0], g_ref[0], jnp.bfloat16, scale=4.0)
    T.assert_close(g_tri[1], g_ref[1], jnp.bfloat16, scale=float(jnp.max(jnp.abs(g_ref[1].astype(F32)))))
    T.assert_same_bytes(g_tri[2], g_ref[2])


@pytest.mark.parametrize("recipe", [fp8.BlockScaling(), fp8.CurrentScaling()], ids=["block", "current"])
def test_row_sharded_quantized_dispatch_matches(recipe):
    """Tokens sharded over 8 devices: token_dispatch_quantized shards like token_dispatch (a buffer
    per shard), bit-identical to quantizing the sharded high-precision dispatch (current: with the
    global scale); the only collective is token_dispatch's count all-reduce (plus the amax's)."""
    x, rm, _ = _inputs(13, t=128, h=256)
    mesh = T.cpu_mesh((8,), ("d",))

    def quantize(a):
        if isinstance(recipe, fp8.BlockScaling):
            return ref.quantize_blocks(a, (1, 128), fp8.E4M3, power_of_2=True)
        return ref.quantize_tensor(a, fp8.E4M3)

    def moved(x, rm):
        r = fp8.token_dispatch_quantized(quantize(x), rm, 256)
        return r.out.data, r.out.scale_inv, r.row_id_map, r.tokens_per_expert

    def high(x, rm):
        d = token_dispatch(x, rm, 256)
        q = quantize(d.out)
        if isinstance(recipe, fp8.CurrentScaling):  # the scale of all tokens, not of the buffer
            q = ref.QuantizedTensor(ref.cast_scaled(d.out, 1.0 / quantize(x).scale_inv, fp8.E4M3),
                                    quantize(x).scale_inv, None, q.dtype)  # fmt: skip
        return q.data, q.scale_inv, d.row_id_map, d.tokens_per_expert

    outs = (P("d"), P() if isinstance(recipe, fp8.CurrentScaling) else P("d"), P("d"), P())
    got, _, counts = T.run_sharded(moved, [x, rm], [P("d"), P("d")], outs, mesh=mesh)
    want, _, want_counts = T.run_sharded(high, [x, rm], [P("d"), P("d")], outs, mesh=mesh)
    T.assert_same_bytes(got, want)
    assert counts == want_counts, (counts, want_counts)
    assert {k: v for k, v in counts.items() if v} == {"all-reduce": 2 if isinstance(recipe, fp8.CurrentScaling) else 1}


def test_fused_op_per_shard_in_shard_map():
    """Inside shard_map (tokens and experts' rows local, as MoEBlock runs it): every shard's result
    equals the op on that shard's tokens alone."""
    x, rm, w = _inputs(14, t=128, h=256, n=128)
    mesh = T.cpu_mesh((8,), ("d",))
    rec = fp8.BlockScaling()

    def body(x, rm, w):
        r = fp8.fp8_dispatch_grouped_dense(x, rm, x.shape[0] * 2, w, rec)
        return r.out, jax.grad(lambda x: jnp.sum(fp8.fp8_dispatch_grouped_dense(x, rm, 32, w, rec).out.astype(F32)))(x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d"), P()), out_specs=(P("d"), P("d"))))
    y, dx = f(x, rm, w)
    for s in range(8):
        sl = slice(16 * s, 16 * (s + 1))
        ys, dxs = jax.jit(body)(x[sl], rm[sl], w)
        T.assert_same_bytes(y[32 * s : 32 * (s + 1)], ys)
        T.assert_same_bytes(dx[sl], dxs)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def _call(**over):
    x, rm, w = _inputs(15, t=8, h=128, n=128)
    kw = dict(x=x, routing_map=rm, num_out_tokens=16, kernels=w, recipe=fp8.BlockScaling())
    kw.update(over)
    return lambda: fp8.fp8_dispatch_grouped_dense(**kw)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (_call(x=jnp.zeros((8,), jnp.bfloat16)), ValueError, "x"),
        (_call(x=jnp.zeros((8, 128), jnp.int32)), TypeError, "x"),
        (_call(routing_map=jnp.zeros((8, 4), jnp.int32)), TypeError, "routing_map"),
        (_call(routing_map=jnp.zeros((9, 4), bool)), ValueError, "routing_map"),
        (_call(kernels=jnp.zeros((3, 128, 128), jnp.bfloat16)), ValueError, "kernels"),
        (_call(kernels=jnp.zeros((4, 64, 128), jnp.bfloat16)), ValueError, "H"),
        (_call(kernels=jnp.zeros((4, 128, 128), jnp.float16)), TypeError, "kernels must have x's dtype, or be float32"),
        (_call(num_out_tokens=jnp.int32(16)), TypeError, "num_out_tokens"),
        (_call(num_out_tokens=-1), ValueError, "num_out_tokens"),
        (_call(align_size=0), ValueError, "align_size"),
        (_call(recipe=fp8.BlockScaling(act_block=(1, 64))), ValueError, "recipe"),
        (_call(recipe=DREC), TypeError, "state"),
        (_call(recipe=DREC, state=fp8.initial_grouped_state(DREC, 3)), ValueError, "state.w"),
        (_call(state=fp8.initial_grouped_state(DREC, 4)), ValueError, "state"),
        (_call(implementation="cuda"), ValueError, "implementation"),
        (lambda: fp8.token_dispatch_quantized(jnp.zeros((4, 4)), jnp.ones((4, 2), bool), 8), TypeError, "q must"),
        (
            lambda: fp8.token_dispatch_quantized(
                ref.quantize_blocks(jnp.ones((4, 256)), (1, 64), fp8.E4M3, power_of_2=True), jnp.ones((4, 2), bool), 8
            ),
            ValueError,
            "q must",
        ),  # fmt: skip
    ],
)
def test_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match) as e:
        call()
    assert "te_ops.fp8" in str(e.value)


@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[2], DREC], ids=["block", "current", "delayed"])
def test_default_implementation_is_staged_per_platform(monkeypatch, stub_triton_launcher, recipe):
    """Where the Triton FP8 path can run, ``implementation=None`` lowers Triton kernels for CUDA and
    only the reference for the CPU in one jitted function (forward and backward, the states passed
    through the staged calls); the CPU result is the reference's."""
    from te_ops._core import triton_bridge as tb
    from te_ops.fp8 import select

    monkeypatch.setattr(select, "triton_fp8_unavailable_reason", lambda: None)
    x, rm, w = _inputs(16, t=128, h=256, n=128)
    st = _state(recipe, 4)

    def loss(x, w, st, impl=None):
        r = fp8.fp8_dispatch_grouped_dense(x, rm, 256, w, recipe, state=st, implementation=impl)
        return jnp.sum(r.out.astype(F32) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    with tb.target_override(("cuda", 90, 32)):
        cuda_hlo = grad.trace(x, w, st).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda_hlo.count(tb.FFI_TARGET) >= 4
    assert tb.FFI_TARGET not in grad.lower(x, w, st).as_text()
    got = grad(x, w, st)
    want = jax.jit(jax.value_and_grad(lambda x, w, st: loss(x, w, st, "reference"), (0, 1, 2)))(x, w, st)
    T.assert_same_bytes(got, want)
