"""FP8 under sharding on 8 CPU devices: sharded vs unsharded results and collective counts.

Two layers are checked:

* the partitioning of every FP8 kernel (:mod:`te_ops.fp8.sharding`), driven with reference local
  functions in place of the Triton launches (the same rules and plans the GPU runs);
* the whole ``implementation="triton"`` orchestration of ``fp8_dense`` / ``fp8_grouped_dense``
  with the kernel launches of :mod:`te_ops.fp8.triton` replaced by reference functions, and the
  ``"reference"`` implementation (plain jnp, partitioned by XLA).

Quantization must be bit-identical sharded and unsharded (an amax reduced over exactly the sharded
mesh axes gives the same scale); GEMMs agree within float32 summation-order noise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from te_ops import fp8
from te_ops._core import testing as T
from te_ops.fp8 import reference as ref
from te_ops.fp8 import sharding as fsh
from te_ops.fp8.recipes import E4M3, E5M2, format_max
from te_ops.grouped_dense import reference as gd_ref

F32 = jnp.float32


def _x(seed, shape, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[rng.choice(x.size, max(1, x.size // 200), replace=False)] *= 100.0  # outliers
    return jnp.asarray(x, dtype)


def _data_scale(q):
    return q.data, q.scale_inv


def _nonzero(counts):
    return {k: v for k, v in counts.items() if v}


# ----------------------------------------------------------------------------------------------
# Reference stand-ins for the kernel launches (same signatures as te_ops.fp8.triton's locals)
# ----------------------------------------------------------------------------------------------


def ref_amax_local(x, batch, vector=False):
    return ref.amax(x) if batch == 1 and not vector else jax.vmap(ref.amax)(x.reshape(batch, -1))


def ref_cast_local(x, scale, fmt, with_amax, from_amax, margin, power_of_2, batch, vector=False):
    xb = x.reshape(batch, -1)
    s = jnp.asarray(scale, F32).reshape(batch)
    if from_amax:
        s = ref.compute_scale(s, format_max(fmt), margin, power_of_2)
    q = jax.vmap(lambda a, sc: ref.cast_scaled(a, sc, fmt))(xb, s).reshape(x.shape)
    amax = jax.vmap(ref.amax)(xb) if with_amax else None
    vec = () if batch == 1 and not vector else (batch,)
    return q, (None if amax is None else amax.reshape(vec)), (1.0 / s).astype(F32).reshape(vec)


def ref_block_local(x, block, fmt, power_of_2, margin):
    return ref.quantize_blocks(x, block, fmt, power_of_2=power_of_2)


def ref_dual_local(x, block, fmt, power_of_2, margin, wide=False, t_square=False):
    return (
        ref.quantize_blocks(x, (1, block), fmt, power_of_2=power_of_2),
        ref.quantize_blocks(x.T, (block, block) if t_square else (1, block), fmt, power_of_2=power_of_2),
    )


def _deq(data, sinv, block):
    return ref.dequantize(ref.QuantizedTensor(data, sinv, block, jnp.dtype(F32)), F32)


def ref_gemm_local(a, sa, b, sb, out_dtype, config=None, bias=None, kernels=None, gluon=None):
    y = jnp.dot(_deq(a, sa, (1, 128)), _deq(b, sb, (128, 128)).T, precision=jax.lax.Precision.HIGHEST)
    return (y if bias is None else y + bias).astype(out_dtype)


def ref_grouped_local(a, sa, b, sb, gs, out_dtype, num_programs=None, config=None, bias=None, kernel=None, gluon=None):
    da = _deq(a, sa, (1, 128))
    db = jax.vmap(lambda d, s: _deq(d, s, (128, 128)))(b, sb)
    y, _ = gd_ref.forward(da, jnp.swapaxes(db, 1, 2), gs, has_bias=False)
    return y.astype(out_dtype)


# ----------------------------------------------------------------------------------------------
# The kernel partitioning (te_ops.fp8.sharding) with reference local functions
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, n_allreduce",
    [(P("a", "b"), 1), (P(None, ("a", "b")), 1), (P("a"), 1), (P(), 0)],
    ids=["2d", "cols", "rows", "replicated"],
)
def test_amax_reduces_over_exactly_the_sharded_axes(spec, n_allreduce):
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    x = _x(1, (64, 256))
    f = fsh.amax(lambda a: ref_amax_local(a, 1))
    out, expect, counts = T.run_sharded(f, [x], [spec], P(), mesh=mesh)
    T.assert_same_bytes(out, expect)
    assert float(out) == float(jnp.max(jnp.abs(x)))
    assert _nonzero(counts) == ({"all-reduce": n_allreduce} if n_allreduce else {})


def test_batched_amax_keeps_the_leading_axis_sharded():
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    x = _x(2, (8, 32, 256))
    f = fsh.amax(lambda a: ref_amax_local(a, a.shape[0]), batched=True)
    out, expect, counts = T.run_sharded(f, [x], [P("a", None, "b")], P("a"), mesh=mesh)
    T.assert_same_bytes(out, expect)
    np.testing.assert_array_equal(np.asarray(out), np.max(np.abs(np.asarray(x)), axis=(1, 2)))
    assert _nonzero(counts) == {"all-reduce": 1}  # over "b" only


@pytest.mark.parametrize("with_amax", [True, False])
def test_tensor_cast_is_elementwise_and_its_amax_global(with_amax):
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    x = _x(3, (64, 256), jnp.bfloat16)
    amax = jnp.max(jnp.abs(x.astype(F32)))

    def local(a, s):
        q, am, sinv = ref_cast_local(a, s, E4M3, with_amax, True, 0, False, 1)
        return (q, am, sinv) if with_amax else (q, sinv)

    f = fsh.tensor_cast(local, with_amax=with_amax)
    out, expect, counts = T.run_sharded(f, [x, amax], [P("a", "b"), P()], None, mesh=mesh)
    T.assert_same_bytes(out, expect)
    assert _nonzero(counts) == ({"all-reduce": 1} if with_amax else {})


@pytest.mark.parametrize(
    "block, shape, spec, gathers",
    [
        ((1, 128), (64, 1024), P("a", "b"), False),
        ((128, 128), (512, 1024), P("a", "b"), False),
        ((128, 128), (256, 1024), P("a", "b"), True),  # 2 row blocks cannot split over 4 devices
        ((1, 128), (64, 1000), P(None, "a"), True),  # 1000 is not a multiple of 128
    ],
)
def test_block_quantize_shards_whole_blocks(block, shape, spec, gathers):
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    x = _x(4, shape, jnp.bfloat16)
    f = fsh.block_quantize(lambda a: _data_scale(ref_block_local(a, block, E4M3, False, 0)), block)
    out, expect, counts = T.run_sharded(f, [x], [spec], None, mesh=mesh)
    T.assert_same_bytes(out, expect)
    if gathers:
        assert _nonzero(counts), "a shard boundary inside a block must gather"
    else:
        assert _nonzero(counts) == {}


@pytest.mark.parametrize("t_square", [False, True])
def test_dual_quantize_no_collective_on_block_boundaries(t_square):
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    x = _x(5, (512, 1024), jnp.bfloat16)

    def local(a):
        q, qt = ref_dual_local(a, 128, E4M3, False, 0, t_square=t_square)
        return q.data, q.scale_inv, qt.data, qt.scale_inv

    sharded = fsh.dual_quantize(local, 128, t_square)
    out, expect, counts = T.run_sharded(sharded, [x], [P("a", "b")], None, mesh=mesh)
    T.assert_same_bytes(out, expect)
    assert _nonzero(counts) == {}


@pytest.mark.parametrize(
    "rows, spec, gathers",
    [(1024, P("a", "b"), False), (1024, P("b", "a"), False), (1024, P(None, "a"), False), (512, P(("a", "b")), True)],
)
def test_requantize_t_partitions(rows, spec, gathers):
    """FP8 row tiles -> 1 x 128 tiles of the transpose (te_ops.fp8.triton.requantize_t): bit-identical
    sharded and unsharded, no collective when every shard holds whole 128 x 128 tiles (a gather when
    a shard boundary cuts a tile: 512 rows over 8 shards)."""
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    q = ref.quantize_blocks(_x(7, (rows, 512), jnp.bfloat16), (1, 128), E4M3, power_of_2=True)

    def local(data, sinv):
        return ref_requantize_t_local(data, sinv, E4M3, 128, E4M3, True)

    sharded = fsh.requantize_t(local, 128)
    data = jax.lax.bitcast_convert_type(q.data, jnp.uint8)
    out, expect, counts = T.run_sharded(sharded, [data, q.scale_inv], [spec, spec], None, mesh=mesh)
    T.assert_same_bytes(out, expect)
    assert bool(gathers) == bool(_nonzero(counts)), counts


@pytest.mark.parametrize("spec, gathers", [(P("a"), False), (P(("a", "b")), False), (P(None, "a"), True)],
                         ids=["rows", "rows8", "columns"])  # fmt: skip
def test_ffn_fused_kernels_partition_by_rows(spec, gathers):
    """The fused FFN activation (+ backward) quantize kernels (te_ops.fp8.fp8_dispatch_ffn):
    bit-identical sharded and unsharded; rows in whole 128-row blocks need no collective, sharded
    columns are gathered (a gated row's two halves belong together)."""
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    h = _x(8, (1024, 512), jnp.bfloat16)
    da = _x(9, (1024, 256), jnp.bfloat16)
    act = fsh.ffn_act_quantize(lambda h: ref_ffn_act_local(h, 4, True, E4M3, True), 128)
    out, expect, counts = T.run_sharded(act, [h], [spec], None, mesh=mesh)
    T.assert_same_bytes(out, expect)
    assert bool(gathers) == bool(_nonzero(counts)), counts
    dact = fsh.ffn_dact_quantize(lambda d, h: ref_ffn_dact_local(d, h, 4, True, E5M2, True), 128)
    out, expect, counts = T.run_sharded(dact, [da, h], [spec, spec], None, mesh=mesh)
    T.assert_same_bytes(out, expect)
    assert bool(gathers) == bool(_nonzero(counts)), counts


def _gemm_operands(seed, m, k, n):
    qa = ref.quantize_blocks(_x(seed, (m, k), jnp.bfloat16), (1, 128), E4M3, power_of_2=False)
    qb = ref.quantize_blocks(_x(seed + 1, (n, k), jnp.bfloat16), (128, 128), E4M3, power_of_2=False)
    return [qa.data, qa.scale_inv, qb.data, qb.scale_inv]


@pytest.mark.parametrize(
    "specs, expect",
    [
        ((P("a"), P("a"), P(), P()), {}),  # data parallel
        ((P(), P(), P("a"), P("a")), {}),  # column parallel
        ((P(None, "a"), P(None, "a"), P(None, "a"), P(None, "a")), {"all-reduce": 1}),  # row parallel
        ((P("b", "a"), P("b", "a"), P(None, "a"), P(None, "a")), {"all-reduce": 1}),  # data + row
    ],
    ids=["data", "column", "row", "data+row"],
)
def test_block_scaled_gemm_partitions(specs, expect):
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    f = fsh.block_scaled_gemm(lambda *a, dtype: ref_gemm_local(*a[:4], dtype, bias=a[4] if a[4:] else None),
                              jnp.bfloat16)  # fmt: skip
    out, want, counts = T.run_sharded(f, _gemm_operands(6, 64, 1024, 512), list(specs), None, mesh=mesh)
    T.assert_close(out, want, jnp.bfloat16)
    assert _nonzero(counts) == expect
    # with a bias [N]: sharded with N, added once after the row-parallel reduction
    fb = fsh.block_scaled_gemm(lambda *a, dtype: ref_gemm_local(*a[:4], dtype, bias=a[4] if a[4:] else None),
                               jnp.bfloat16, has_bias=True)  # fmt: skip
    bias = _x(9, (512,)) * 10.0
    b_spec = P(specs[2][0]) if len(specs[2]) else P()
    out, want, counts = T.run_sharded(fb, _gemm_operands(6, 64, 1024, 512) + [bias], list(specs) + [b_spec], None,
                                      mesh=mesh)  # fmt: skip
    T.assert_close(out, want, jnp.bfloat16)
    assert _nonzero(counts) == expect


def test_grouped_gemm_column_and_expert_parallel():
    mesh = T.cpu_mesh((4, 2), ("e", "t"))
    g, m, k, n = 4, 256, 256, 512
    qa = ref.quantize_blocks(_x(7, (m, k), jnp.bfloat16), (1, 128), E4M3, power_of_2=False)
    qb = ref.quantize_blocks(_x(8, (g, n, k), jnp.bfloat16), (128, 128), E4M3, power_of_2=False)
    f = fsh.grouped_block_scaled_gemm(ref_grouped_local, jnp.bfloat16)
    # column parallel: each shard its N slice of every expert, no collective
    gs = jnp.asarray([100, 0, 60, 90], jnp.int32)
    args = [qa.data, qa.scale_inv, qb.data, qb.scale_inv, gs]
    out, want, counts = T.run_sharded(f, args, [P(), P(), P(None, "t"), P(None, "t"), P()], None, mesh=mesh)
    T.assert_close(out, want, jnp.bfloat16)
    assert _nonzero(counts) == {}
    # expert parallel: one expert's rows per shard of 64 rows, local sizes
    gs_local = jnp.asarray([64, 10, 0, 33], jnp.int32)
    args = [qa.data, qa.scale_inv, qb.data, qb.scale_inv, gs_local]
    specs = [P("e"), P("e"), P("e"), P("e"), P("e")]
    sharded, _, counts = T.run_sharded(f, args, specs, None, mesh=mesh)
    assert _nonzero(counts) == {}
    for s in range(g):  # shard s = expert s on its own rows
        rows = slice(64 * s, 64 * (s + 1))
        local = ref_grouped_local(
            qa.data[rows], qa.scale_inv[rows], qb.data[s : s + 1], qb.scale_inv[s : s + 1], gs_local[s : s + 1],
            jnp.bfloat16,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(sharded[rows], np.float32), np.asarray(local, np.float32))


# ----------------------------------------------------------------------------------------------
# fp8_dense / fp8_grouped_dense end to end
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """te_ops.fp8.triton with every kernel launch replaced by its reference stand-in."""
    pytest.importorskip("triton", reason="te_ops.fp8.triton imports the Triton bridge")
    from te_ops.fp8 import triton as tri

    monkeypatch.setattr(tri, "_amax_local", ref_amax_local)
    monkeypatch.setattr(tri, "_tensor_cast_local", ref_cast_local)
    monkeypatch.setattr(tri, "_block_quantize_local", ref_block_local)
    monkeypatch.setattr(tri, "_dual_quantize_local", ref_dual_local)
    monkeypatch.setattr(tri, "_block_gemm_local", ref_gemm_local)
    monkeypatch.setattr(tri, "_grouped_gemm_local", ref_grouped_local)
    monkeypatch.setattr(tri, "_wgrad_local", ref_wgrad_local)
    monkeypatch.setattr(tri, "_dact_local", ref_dact_local)
    monkeypatch.setattr(tri, "_requantize_t_local", ref_requantize_t_local)
    monkeypatch.setattr(tri, "_ffn_act_local", ref_ffn_act_local)
    monkeypatch.setattr(tri, "_ffn_dact_local", ref_ffn_dact_local)
    caches = [tri._sharded_amax, tri._sharded_cast, tri._sharded_block_quantize, tri._sharded_dual_quantize,
              tri._sharded_block_gemm, tri._sharded_grouped_gemm, tri._sharded_wgrad, tri._sharded_dact,
              tri._sharded_requantize_t, tri._sharded_ffn_act, tri._sharded_ffn_dact]  # fmt: skip
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def ref_requantize_t_local(data, sinv, in_fmt, block, fmt, power_of_2, margin=0):
    """requantize_t's kernel outputs (bytes) from the reference: dequantize, transpose, quantize."""
    assert margin == 0
    qd = ref.QuantizedTensor(jax.lax.bitcast_convert_type(data, in_fmt), sinv, (1, block), jnp.dtype(jnp.bfloat16))
    qt = ref.quantize_blocks(ref.dequantize(qd, F32).T, (1, block), fmt, power_of_2=power_of_2)
    return jax.lax.bitcast_convert_type(qt.data, jnp.uint8), qt.scale_inv


def _u8(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint8)


def ref_ffn_act_local(h, act, gated, fmt, power_of_2, margin=0):
    """The fused FFN activation + dual quantize kernel's outputs (bytes) from the reference."""
    from te_ops.grouped_dense.reference import ffn_activation

    assert margin == 0
    a = ffn_activation(h, _ACT_NAMES[act], gated)
    q = ref.quantize_blocks(a, (1, 128), fmt, power_of_2=power_of_2)
    qt = ref.quantize_blocks(a.T, (1, 128), fmt, power_of_2=power_of_2)
    return _u8(q.data), q.scale_inv, _u8(qt.data), qt.scale_inv


def ref_ffn_dact_local(da, h, act, gated, fmt, power_of_2, margin=0):
    """The fused FFN activation backward + dual quantize kernel's outputs (bytes) from the reference."""
    from te_ops.grouped_dense.reference import ffn_activation

    assert margin == 0
    dh = jax.vjp(lambda h: ffn_activation(h, _ACT_NAMES[act], gated), h)[1](da.astype(h.dtype))[0]
    q = ref.quantize_blocks(dh, (1, 128), fmt, power_of_2=power_of_2)
    qt = ref.quantize_blocks(dh.T, (128, 128), fmt, power_of_2=power_of_2)
    return _u8(q.data), q.scale_inv, _u8(qt.data), qt.scale_inv


_ACT_NAMES = {0: None, 1: "gelu", 2: "gelu_tanh", 3: "relu", 4: "silu"}


def ref_dact_local(dy, z, act, block, fmt, power_of_2):
    """The fused kernel's outputs from the reference (dbias as per-row-block float32 partials)."""
    dz = dy.astype(F32) * ref.act_grad(z, _ACT_NAMES[act])
    q = ref.quantize_blocks(dz, (1, block), fmt, power_of_2=power_of_2)
    qt = ref.quantize_blocks(dz.T, (block, block), fmt, power_of_2=power_of_2)
    r, c = dz.shape
    nrb = -(-r // block)
    dbp = jnp.pad(dz, ((0, nrb * block - r), (0, 0))).reshape(nrb, block, c).sum(axis=1)
    return q.data, q.scale_inv, qt.data, qt.scale_inv, dbp


@pytest.mark.parametrize(
    "spec, reduces",
    [(P("d"), 1), (P(None, "d"), 0), (P("a", "b"), 1)],
    ids=["rows", "columns", "both"],
)
def test_dact_dbias_quantize_sharded(triton_on_cpu, spec, reduces):
    """The fused activation backward sharded on whole 128-blocks: the unsharded bytes, scales and
    dbias; the only collective is dbias's sum over row shards (one all-reduce, none when only the
    columns are sharded)."""
    mesh = T.cpu_mesh((8,), ("d",)) if "d" in spec else T.cpu_mesh((4, 2), ("a", "b"))
    dy = _x(21, (1024, 1024), jnp.bfloat16)  # 8 blocks of 128 both ways
    z = _x(22, (1024, 1024), jnp.bfloat16)

    def f(dy, z):
        q, qt, db = fp8.dact_dbias_quantize(dy, z, fp8.BlockScaling(), activation="gelu", implementation="triton")
        return q.data, q.scale_inv, qt.data, qt.scale_inv, db

    out, expect, counts = T.run_sharded(f, [dy, z], [spec, spec], None, mesh=mesh)
    T.assert_same_bytes(out[:4], expect[:4])
    np.testing.assert_allclose(np.asarray(out[4], F32), np.asarray(expect[4], F32), rtol=1e-2, atol=1e-2)
    assert counts.get("all-reduce", 0) == reduces, counts
    assert counts.get("all-gather", 0) == 0 and counts.get("all-to-all", 0) == 0, counts


def _dense_loss(recipe, impl):
    def f(x, w, b):
        y = fp8.fp8_dense(x, w, recipe, bias=b, implementation=impl)
        return jnp.sum(y.astype(F32) ** 2) / y.size, y

    return lambda x, w, b: jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, b)


DENSE_CASES = [
    # (name, x spec, w spec, all-reduces of loss + gradients with current / block scaling; XLA
    # combines the reductions that are ready at the same point into one)
    ("data", P("d"), P(), (3, 1)),  # amax(x), amax(dy), loss and dw (summed over the data shards)
    ("column", P(), P(None, "d"), (3, 1)),  # amax(w), amax(dy), loss and dx (summed over the N shards)
]


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.BlockScaling()], ids=["current", "block"])
@pytest.mark.parametrize("case", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp8_dense_sharded_equals_unsharded(request, impl, case, recipe):
    """Both implementations: the same results as unsharded, no gathered operand, and the same
    all-reduces (the Triton kernels' rules communicate no more than XLA's partitioning of jnp)."""
    if impl == "triton":
        request.getfixturevalue("triton_on_cpu")
    _, xs, ws, n_reduce = case
    mesh = T.cpu_mesh((8,), ("d",))
    x, w = _x(10, (1024, 256), jnp.bfloat16), _x(11, (256, 1024), jnp.bfloat16) * 0.05
    b = _x(19, (1024,), jnp.bfloat16)
    bs = P(ws[1]) if len(ws) > 1 else P()
    out, want, counts = T.run_sharded(_dense_loss(recipe, impl), [x, w, b], [xs, ws, bs], None, mesh=mesh)
    (loss, y), (dx, dw, db) = out
    (loss_u, y_u), (dx_u, dw_u, db_u) = want
    T.assert_close(db, db_u, jnp.bfloat16)
    T.assert_close(y, y_u, jnp.bfloat16)
    T.assert_close(dx, dx_u, jnp.bfloat16)
    T.assert_close(dw, dw_u, jnp.bfloat16, scale=2.0)
    expect = {"all-reduce": n_reduce[0] if isinstance(recipe, fp8.CurrentScaling) else n_reduce[1]}
    assert _nonzero(counts) == expect, f"collectives of the sharded FP8 dense step: {counts}"


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.BlockScaling()], ids=["current", "block"])
def test_fp8_dense_triton_data_parallel_collectives(triton_on_cpu, recipe):
    """Data parallel: per-tensor scaling all-reduces one amax per quantized activation (x, dy) and the
    weight gradient; block scaling needs only the weight-gradient reduction (and the loss)."""
    mesh = T.cpu_mesh((8,), ("d",))
    x, w = _x(12, (1024, 256), jnp.bfloat16), _x(13, (256, 512), jnp.bfloat16) * 0.05

    def grads(x, w):
        def loss(x, w):
            return jnp.sum(fp8.fp8_dense(x, w, recipe, implementation="triton").astype(F32) ** 2)

        return jax.grad(loss, (0, 1))(x, w)

    out, want, counts = T.run_sharded(grads, [x, w], [P("d"), P()], None, mesh=mesh)
    T.assert_close(out[0], want[0], jnp.bfloat16)
    T.assert_close(out[1], want[1], jnp.bfloat16, scale=2.0)
    got = _nonzero(counts)
    n_amax = 2 if isinstance(recipe, fp8.CurrentScaling) else 0  # amax(x), amax(dy)
    assert got == {"all-reduce": n_amax + 1}, got


def test_fp8_dense_quantization_bit_identical_when_sharded(triton_on_cpu):
    """The quantized x of a data-parallel current-scaling step is byte for byte the unsharded one."""
    from te_ops.fp8 import triton as tri

    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    x = _x(14, (128, 512), jnp.bfloat16)
    for fmt in (E4M3, E5M2):
        f = lambda a, fmt=fmt: _data_scale(tri.quantize_tensor(a, fmt))  # noqa: E731
        out, want, counts = T.run_sharded(f, [x], [P("a", "b")], None, mesh=mesh)
        T.assert_same_bytes(out, want)
        assert _nonzero(counts) == {"all-reduce": 1}


def test_fp8_grouped_dense_triton_column_parallel(triton_on_cpu):
    mesh = T.cpu_mesh((8,), ("t",))
    g, m, k, n = 4, 256, 256, 1024
    x = _x(15, (m, k), jnp.bfloat16)
    kernels = _x(16, (g, k, n), jnp.bfloat16) * 0.05
    gs = jnp.asarray([70, 0, 100, 50], jnp.int32)

    def fwd(x, kernels, gs):
        return fp8.fp8_grouped_dense(x, kernels, gs, fp8.BlockScaling(), implementation="triton")

    out, want, counts = T.run_sharded(fwd, [x, kernels, gs], [P(), P(None, None, "t"), P()], None, mesh=mesh)
    T.assert_close(out, want, jnp.bfloat16)
    assert _nonzero(counts) == {}


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp8_dense_delayed_state_identical_when_sharded(request, impl):
    """Data parallel delayed scaling: the recorded amaxes (reduced over the data shards) and the next
    scales are bit-identical to the unsharded step's."""
    if impl == "triton":
        request.getfixturevalue("triton_on_cpu")
    recipe = fp8.DelayedScaling(history_len=4)
    mesh = T.cpu_mesh((8,), ("d",))
    x, w = _x(17, (1024, 256), jnp.bfloat16), _x(18, (256, 512), jnp.bfloat16) * 0.05
    state = fp8.initial_dense_state(recipe)
    state = jax.tree.map(lambda a: a.at[...].set(0.5) if a.ndim == 0 else a, state)  # a non-trivial scale

    def step(x, w, state):
        def loss(x, w, state):
            y = fp8.fp8_dense(x, w, recipe, state=state, implementation=impl)
            return jnp.sum(y.astype(F32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(x, w, state)

    out, want, _ = T.run_sharded(step, [x, w, state], [P("d"), P(), P()], None, mesh=mesh)
    T.assert_same_bytes(out[2], want[2])
    T.assert_close(out[0], want[0], jnp.bfloat16)


def ref_wgrad_local(at, sat, bt, sbt, gs, g, out_dtype, config=None):
    x = _deq(at, sat, (1, 128)).T
    dy = _deq(bt, sbt, (128, 128)).T
    w_proto = jnp.zeros((g, x.shape[1], dy.shape[1]), F32)
    return gd_ref.backward(gd_ref.Residuals(x, w_proto, gs), dy, has_bias=False)[1].astype(out_dtype)


def test_grouped_wgrad_partitions():
    """K and N sharded: each shard its slice of every expert's gradient; expert parallel: each shard
    its local experts from its own rows. No collective in any of them."""
    mesh = T.cpu_mesh((4, 2), ("e", "t"))
    g, m, k, n = 4, 512, 256, 512
    qxt = ref.quantize_blocks(_x(20, (k, m), jnp.bfloat16), (1, 128), E4M3, power_of_2=False)
    qdyt = ref.quantize_blocks(_x(21, (n, m), jnp.bfloat16), (128, 128), E5M2, power_of_2=False)
    f = fsh.grouped_block_scaled_wgrad(lambda *a: ref_wgrad_local(*a, a[-1].shape[0], jnp.float32))
    gs = jnp.asarray([130, 0, 250, 90], jnp.int32)
    args = [qxt.data, qxt.scale_inv, qdyt.data, qdyt.scale_inv, gs]
    out, want, counts = T.run_sharded(f, args, [P("e"), P("e"), P("t"), P("t"), P()], None, mesh=mesh)
    # the same products summed in another order: float32 noise relative to the largest entry
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    assert _nonzero(counts) == {}
    gs_local = jnp.asarray([128, 5, 0, 77], jnp.int32)  # one expert per 128-row shard
    args[-1] = gs_local
    out, _, counts = T.run_sharded(f, args, [P(None, "e"), P(None, "e"), P(None, "e"), P(None, "e"), P("e")], None,
                                   mesh=mesh)  # fmt: skip
    assert _nonzero(counts) == {}
    for s in range(g):
        rows = slice(128 * s, 128 * (s + 1))
        local = ref_wgrad_local(qxt.data[:, rows], qxt.scale_inv[:, s : s + 1], qdyt.data[:, rows],
                                qdyt.scale_inv[:, s : s + 1], gs_local[s : s + 1], 1, jnp.float32)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out[s : s + 1]), np.asarray(local))


def test_fp8_grouped_dense_triton_backward_column_parallel(triton_on_cpu):
    """Gradients of the FP8 experts with the kernels sharded on N: dx is one all-reduce over the N
    shards (plus the loss), dkernels stay sharded."""
    mesh = T.cpu_mesh((8,), ("t",))
    g, m, k, n = 4, 256, 256, 1024
    x = _x(22, (m, k), jnp.bfloat16)
    kernels = _x(23, (g, k, n), jnp.bfloat16) * 0.05
    gs = jnp.asarray([70, 0, 100, 50], jnp.int32)

    def grads(x, kernels):
        def loss(x, kernels):
            y = fp8.fp8_grouped_dense(x, kernels, gs, fp8.BlockScaling(), implementation="triton")
            return jnp.sum(y.astype(F32) ** 2)

        return jax.grad(loss, (0, 1))(x, kernels)

    out, want, counts = T.run_sharded(grads, [x, kernels], [P(), P(None, None, "t")], None, mesh=mesh)
    T.assert_close(out[0], want[0], jnp.bfloat16)
    T.assert_close(out[1], want[1], jnp.bfloat16, scale=2.0)
    assert _nonzero(counts) == {"all-reduce": 1}, counts  # dx summed over the N shards (with the loss)


def _scalar_reduce_axes(fn, args, specs, mesh):
    """The mesh axes of every all-reduce of float32 scalars (the amaxes) in the compiled program."""
    import re

    shardings = tuple(jax.sharding.NamedSharding(mesh, s) for s in specs)
    hlo = jax.jit(fn, in_shardings=shardings).lower(*args).compile().as_text()
    axes = []
    for line in hlo.splitlines():
        m = re.match(r"\s*%\S+ = (\(?f32\[\](?:, f32\[\])*\)?) all-reduce\(", line)
        if m:
            axes.append(re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line).group(1))
    return axes


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp8_grouped_dense_delayed_amax_reduced_over_the_row_axis(request, impl):
    """Delayed-scaling experts with x's rows sharded over mesh axis "a" of an ("a", "b") mesh (the
    kernels and the state replicated): the recorded amaxes of x and dy and the next scales are
    bit-identical to the unsharded step's, the gradients agree, and the amaxes are max-reduced over
    "a" only (one all-reduce of the two scalars). The Triton path gathers the rows for its grouped
    GEMMs (group boundaries are global); the reference's dW is summed over the row shards."""
    if impl == "triton":
        request.getfixturevalue("triton_on_cpu")
    recipe = fp8.DelayedScaling(history_len=4)
    mesh = T.cpu_mesh((4, 2), ("a", "b"))
    x, kernels = _x(30, (1024, 256), jnp.bfloat16), _x(31, (4, 256, 256), jnp.bfloat16) * 0.05
    gs = jnp.asarray([300, 0, 400, 200], jnp.int32)  # 124 rows past the groups
    st = fp8.initial_grouped_state(recipe, 4)  # non-trivial scales: 0.5
    state = fp8.DenseScalingState(*(fp8.DelayedScalingState(s.amax_history, jnp.full_like(s.scale, 0.5))
                                    for s in (st.x, st.w, st.g)))  # fmt: skip

    def step(x, kernels, state):
        def loss(x, kernels, state):
            y = fp8.fp8_grouped_dense(x, kernels, gs, recipe, state=state, implementation=impl)
            return jnp.sum(y.astype(F32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(x, kernels, state)

    specs = [P("a"), P(), P()]
    out, want, counts = T.run_sharded(step, [x, kernels, state], specs, None, mesh=mesh)
    T.assert_same_bytes(out[2], want[2])
    assert float(out[2].x.amax_history[0]) == float(jnp.max(jnp.abs(x.astype(F32))))
    T.assert_close(out[0], want[0], jnp.bfloat16)
    T.assert_close(out[1], want[1], jnp.bfloat16, scale=2.0)
    expect = {"all-reduce": 1, "all-gather": 4} if impl == "triton" else {"all-reduce": 2}
    assert _nonzero(counts) == expect, counts
    assert _scalar_reduce_axes(step, [x, kernels, state], specs, mesh) == ["'a'"]


@pytest.mark.parametrize("mesh_shape", [(4, 2), (2, 4)], ids=["two-experts-per-shard", "one-expert-per-shard"])
def test_fp8_grouped_dense_delayed_expert_parallel_triton(triton_on_cpu, mesh_shape):
    """Expert parallel (the rows and the experts on mesh axis "b", two experts or one per shard):
    each expert's kernel amax comes from its own shard, x's and dy's are max-reduced over "b"; the
    state is bit-identical to the unsharded step's. (One expert per shard: each shard's batched
    per-expert cast still returns [1]-shaped amaxes and scales, which concatenate.)"""
    recipe = fp8.DelayedScaling(history_len=3)
    mesh = T.cpu_mesh(mesh_shape, ("a", "b"))
    x, kernels = _x(32, (1024, 256), jnp.bfloat16), _x(33, (4, 256, 256), jnp.bfloat16) * 0.05
    gs = jnp.asarray([256, 256, 256, 256], jnp.int32)  # each shard's rows are its experts' rows

    def step(x, kernels, state):
        def loss(x, kernels, state):
            y = fp8.fp8_grouped_dense(x, kernels, gs, recipe, state=state, implementation="triton")
            return jnp.sum(y.astype(F32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(x, kernels, state)

    specs = [P("b"), P("b"), P()]
    out, want, _ = T.run_sharded(step, [x, kernels, fp8.initial_grouped_state(recipe, 4)], specs, None, mesh=mesh)
    T.assert_same_bytes(out[2], want[2])
    T.assert_close(out[0], want[0], jnp.bfloat16)
    T.assert_close(out[1], want[1], jnp.bfloat16, scale=2.0)
