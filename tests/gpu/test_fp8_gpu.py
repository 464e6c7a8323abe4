"""GPU tests of the FP8 block-quantize Triton kernel (te_ops/fp8/triton.py) against the reference
(te_ops/fp8/reference.py) on the same GPU: the FP8 bytes (NaN positions compared as positions),
the inverse scales, odd and partial-block shapes, edge values, both formats, under jit with
NaN-poisoned outputs (every byte written). Budget: < 60 s on an H200."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops import fp8
from te_ops._core import native
from te_ops._core import testing as T
from te_ops._core import triton_bridge as tb
from te_ops.fp8 import reference as ref
from tests.gpu.cmdbuf import run_script_under_command_buffers

pytestmark = pytest.mark.gpu


def _reason():
    return tb.unavailable_reason() or native.cuda_device_unavailable_reason()


needs_triton = pytest.mark.skipif(_reason() is not None, reason=f"triton: {_reason()}")

CASES = [  # (shape, dtype, block, format, power_of_2)
    ((3, 300), jnp.bfloat16, (1, 128), fp8.E4M3, True),
    ((2, 5, 256), jnp.float32, (1, 128), fp8.E5M2, True),
    ((200, 300), jnp.bfloat16, (128, 128), fp8.E4M3, True),
    ((130, 129), jnp.float16, (64, 64), fp8.E4M3, False),
    ((4096, 7168), jnp.bfloat16, (1, 128), fp8.E4M3, True),
    ((7168, 4096), jnp.bfloat16, (128, 128), fp8.E4M3, True),
]


def _x(i, shape, dtype):
    x = np.random.default_rng(i).standard_normal(shape).astype(np.float32) * 3.0
    flat = x.reshape(-1, shape[-1])
    flat[0, 5] = np.nan
    flat[1, :32] = 0.0
    flat[1, 40] = np.inf
    flat[2, :16] = np.float32(1e-4) * np.arange(16)
    flat[2, 16:24] = [7.99, 15.97, 126.9, -126.2, 0.0078, 3.0, 5.0, -7.0]
    return jnp.asarray(x).astype(dtype)


CPU = jax.devices("cpu")[0]
GPU = (jax.devices("gpu") or [None])[0] if jax.default_backend() == "gpu" else None


def on_cpu(fn, *args):
    """``jax.jit(fn)`` on the CPU: the reference's numbers. XLA's float32 division on the GPU is not
    always correctly rounded (a scale_inv came out 1 ulp off on the H200), and XLA may rewrite a
    GPU graph; on the CPU the reference computes exactly what docs/semantics.md defines."""
    return jax.jit(fn)(*jax.device_put(args, CPU))


def _same(got, want):
    T.assert_same_fp8_bytes(got.data, want.data)  # format, shape, NaN positions, the other bytes
    np.testing.assert_array_equal(np.asarray(got.scale_inv), np.asarray(want.scale_inv))


@needs_triton
@pytest.mark.parametrize("i", range(len(CASES)))
def test_block_quantize_matches_reference_bytes(i):
    from te_ops.fp8 import triton as tri

    shape, dtype, block, fmt, pow2 = CASES[i]
    x = _x(i, shape, dtype)
    with native.poisoned_outputs():
        got = jax.jit(lambda x: tri.block_quantize(x, block, fmt, power_of_2=pow2))(x)
    want = on_cpu(lambda x: ref.quantize_blocks(x, block, fmt, power_of_2=pow2), x)
    _same(got, want)


@needs_triton
@pytest.mark.parametrize("wide,square,warps", [(False, False, None), (True, False, None), (False, True, None),
                                                (True, True, None), (False, False, 2), (False, True, 8)])  # fmt: skip
@pytest.mark.parametrize("shape,block", [((130, 200), 64), ((4096, 7168), 128), ((7168, 4096), 128)])
def test_dual_quantize_matches_reference_bytes(shape, block, wide, square, warps, monkeypatch):
    """Row tiles of x and row tiles (or square blocks) of x^T from one read, each equal to the
    reference of its own (both ways of transposing in the kernel; the default warps per tile and
    two others the benchmark times)."""
    from te_ops.fp8 import triton as tri

    if warps is not None:
        monkeypatch.setattr(tri, "DUAL_TILE_WARPS", warps)
    x = _x(7, shape, jnp.bfloat16)
    tb = (block, block) if square else (1, block)
    with native.poisoned_outputs():
        q, qt = jax.jit(lambda x: tri.dual_quantize(x, block, fp8.E4M3, power_of_2=True, trans_wide=wide,
                                                    t_square=square))(x)  # fmt: skip
    _same(q, on_cpu(lambda x: ref.quantize_blocks(x, (1, block), fp8.E4M3, power_of_2=True), x))
    _same(qt, on_cpu(lambda x: ref.quantize_blocks(x.T, tb, fp8.E4M3, power_of_2=True), x))


@needs_triton
@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "exact"])
@pytest.mark.parametrize("shape", [(300, 200), (32768, 1024), (4096, 7168)])
def test_requantize_t_matches_reference_bytes(shape, pow2, fmt):
    """FP8 row tiles dequantized and quantized again transposed (the FP8 dispatch's weight-gradient
    operand): the GPU's conversions give the reference's bytes; every output element written."""
    from te_ops.fp8 import triton as tri

    q = on_cpu(lambda x: ref.quantize_blocks(x, (1, 128), fmt, power_of_2=pow2), _x(8, shape, jnp.bfloat16))
    with native.poisoned_outputs():
        got = jax.jit(lambda q: tri.requantize_t(q, fmt, power_of_2=pow2))(jax.device_put(q, GPU))
    _same(got, on_cpu(lambda q: ref.quantize_blocks(ref.dequantize(q, jnp.float32).T, (1, 128), fmt,
                                                    power_of_2=pow2), q))  # fmt: skip


def _gluon_dual_reason():
    if _reason() is not None:
        return _reason()
    from te_ops.fp8 import triton as tri

    return tri.gluon_dual_unavailable_reason()


def _dual_x(seed, shape, dtype=jnp.bfloat16):
    """_x's edge values (a NaN, an Inf, zeros, tiny values, values on FP8 rounding edges) plus an all-zero
    128 x 128 tile, a column holding an Inf, outliers, values near bf16's range ends, and NaNs in
    the last (partial) tile where there is one."""
    x = np.array(_x(seed, shape, jnp.float32))
    r, c = shape
    x[128:256, 128:256] = 0.0  # a zero tile (scale 1): none where the tensor is smaller
    x[3:, 9] = 0.5
    if r > 70:
        x[70, 9] = -np.inf  # column 9: its column tile (and 128 x 128 block) gets scale 1
    x[5, 100:104] = [3e38, -1e30, 1e-30, -1e-38]  # outliers and subnormal-range values
    x[min(r - 1, 300), min(c - 1, 200)] = 6e4
    x[r - 1, c - 1] = np.nan  # the last tile (partial where R or C is not a multiple of 128)
    return jnp.asarray(x).astype(dtype)


@needs_triton
@pytest.mark.skipif(_gluon_dual_reason() is not None, reason=f"gluon dual quantize: {_gluon_dual_reason()}")
@pytest.mark.parametrize("square", [False, True], ids=["rows", "square"])
@pytest.mark.parametrize(
    "shape,fmt,pow2,kernel",
    [((272, 400), fp8.E4M3, True, "gluon"), ((272, 400), fp8.E5M2, False, "gluon"),
     ((16, 2064), fp8.E4M3, True, "gluon"), ((4096, 7168), fp8.E4M3, True, "gluon"),
     ((7168, 4096), fp8.E5M2, True, "gluon"), ((130, 200), fp8.E4M3, True, "triton")],
)  # fmt: skip
def test_gluon_dual_quantize_matches_reference_bytes(shape, fmt, pow2, kernel, square, monkeypatch):
    """The Gluon dual quantize (te_ops.fp8.triton.DUAL_KERNEL = "gluon": persistent, TMA load ring, TMA
    stores of both FP8 tiles) equal to the reference of each output, byte for byte and scale for
    scale, under jit with poisoned outputs: whole tiles, partial tiles in both dims (272 x 400: 16
    rows and columns past the last whole tile), fewer rows than a tile (16 x 2064), NaN / Inf / zero
    tiles / outliers, both formats, power-of-2 scales or not, x^T in 1 x 128 tiles or 128 x 128
    blocks. 130 x 200 (rows of 200 bytes: no TMA) takes the Triton kernel under the same flag. The
    launched kernel is checked by name."""
    from te_ops.fp8 import triton as tri

    monkeypatch.setattr(tri, "DUAL_KERNEL", "gluon")
    names = T.recorded_kernel_names(monkeypatch)
    x = _dual_x(11, shape)
    with native.poisoned_outputs():
        q, qt = jax.jit(lambda x: tri.dual_quantize(x, 128, fmt, power_of_2=pow2, t_square=square))(x)
    assert names and set(names) == {"te_fp8_dual_quantize_tma" if kernel == "gluon" else "te_fp8_dual_quantize"}, names
    t_block = (128, 128) if square else (1, 128)
    _same(q, on_cpu(lambda x: ref.quantize_blocks(x, (1, 128), fmt, power_of_2=pow2), x))
    _same(qt, on_cpu(lambda x: ref.quantize_blocks(x.T, t_block, fmt, power_of_2=pow2), x))


@needs_triton
@pytest.mark.skipif(_gluon_dual_reason() is not None, reason=f"gluon dual quantize: {_gluon_dual_reason()}")
@pytest.mark.parametrize("config", [(4, 16, 2), (2, 16, 2), (3, 16, 1), (3, 8, 2)], ids=str)
def test_gluon_dual_quantize_configs_match_reference_bytes(config, monkeypatch):
    """The other Gluon configurations benchmarks/fp8.py times (GLUON_DUAL_CONFIG: stages, warps, FP8
    output buffers) give the reference bytes too (partial tiles, NaN / Inf, x^T in 1 x 128 tiles)."""
    from te_ops.fp8 import triton as tri

    monkeypatch.setattr(tri, "DUAL_KERNEL", "gluon")
    monkeypatch.setattr(tri, "GLUON_DUAL_CONFIG", config)
    x = _dual_x(12, (1040, 1168))
    with native.poisoned_outputs():
        q, qt = jax.jit(lambda x: tri.dual_quantize(x, 128, fp8.E4M3, power_of_2=True))(x)
    _same(q, on_cpu(lambda x: ref.quantize_blocks(x, (1, 128), fp8.E4M3, power_of_2=True), x))
    _same(qt, on_cpu(lambda x: ref.quantize_blocks(x.T, (1, 128), fp8.E4M3, power_of_2=True), x))


_DUAL_CMD_BUFFER_SCRIPT = textwrap.dedent("""
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    from te_ops import fp8
    from te_ops._core import triton_bridge as tb
    from te_ops.fp8 import triton as tri
    from tests.gpu.cmdbuf import assert_triton_in_command_buffers
    def step(kernel):
        tri.DUAL_KERNEL = kernel  # read when the function below is traced (first call or lower)
        def f(x):
            q, qt = tri.dual_quantize(x, 128, fp8.E4M3, power_of_2=True)
            qs, qts = tri.dual_quantize(x, 128, fp8.E5M2, power_of_2=True, t_square=True)
            return [jax.lax.bitcast_convert_type(a, jnp.uint8) for a in (q.data, qt.data, qs.data, qts.data)] + [
                q.scale_inv, qt.scale_inv, qs.scale_inv, qts.scale_inv]
        f.__name__ = f"dq_cmdbuf_{kernel}"  # -> XLA module jit_dq_cmdbuf_<kernel> in the dump
        return jax.jit(f)
    x0 = jax.random.normal(jax.random.key(0), (1040, 1168), jnp.float32).astype(jnp.bfloat16)
    ref = step("triton")
    ref(x0)  # traced now, with the Triton kernel
    fn = step("gluon")
    hlo = fn.lower(x0).compile().as_text()
    rep = tb.command_buffer_report(hlo, tb.find_thunk_dump(os.environ["TE_CMDBUF_DUMP_DIR"], "jit_dq_cmdbuf_gluon"))
    print("CMDBUF " + json.dumps(rep))
    assert_triton_in_command_buffers(rep)
    for i in range(4):  # graph replays with new inputs
        x = (jax.random.normal(jax.random.key(i + 1), (1040, 1168), jnp.float32) * (i + 1)).astype(jnp.bfloat16)
        for a, e in zip(fn(x), ref(x)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    print("OK cmdbuf")
""")


@needs_triton
@pytest.mark.skipif(_gluon_dual_reason() is not None, reason=f"gluon dual quantize: {_gluon_dual_reason()}")
def test_gluon_dual_quantize_under_command_buffers(tmp_path):
    """The Gluon dual quantize (device-side TMA descriptors in an XLA scratch buffer) inside XLA's CUDA
    command buffers, replayed with new inputs: the same bytes and scales as the Triton kernel."""
    r = run_script_under_command_buffers(_DUAL_CMD_BUFFER_SCRIPT, tmp_path)
    assert r.returncode == 0 and "OK cmdbuf" in r.stdout, (r.stdout[-3000:], r.stderr[-5000:])


def _gemm_kernel(kernel, monkeypatch, k, n, out_dtype):
    """The GEMM kernel a test parameter names: "gluon_scales_tma" is the Gluon kernel with A's row
    scales through TMA (te_ops.fp8.triton.GLUON_SCALES_TMA, set here for the test). Skips where the
    Gluon kernel does not take the call; returns the kernel to route to ("gluon" for the variant)."""
    from te_ops.fp8 import triton as tri

    monkeypatch.setattr(tri, "GLUON_SCALES_TMA", kernel == "gluon_scales_tma")
    kernel = "gluon" if kernel == "gluon_scales_tma" else kernel
    if kernel == "gluon":
        why = tri.gluon_gemm_unavailable_reason(k, n, out_dtype)
        if why is not None:
            pytest.skip(f"the Gluon FP8 GEMM does not take this call here: {why}")
    return kernel


@needs_triton
@pytest.mark.parametrize("m,k,n,fmt", [(200, 300, 130, fp8.E4M3), (200, 304, 136, fp8.E4M3),
                                       (4096, 7168, 2048, fp8.E4M3), (1000, 1024, 4096, fp8.E5M2),
                                       (203, 1040, 264, fp8.E4M3)])  # fmt: skip
@pytest.mark.parametrize("kernel", ["tiled", "persistent", "gluon", "gluon_scales_tma"])
def test_block_scaled_gemm_matches_reference(m, k, n, fmt, kernel, monkeypatch):
    """FP8 wgmma with float32 promotion every 128 of K vs dequantized operands in a float32 GEMM
    (the same products; the tensor cores sum each 128-element block with ~14-bit accumulation), plus
    a bias; through the tiled kernel, the Triton grouped kernel with one group and the Gluon
    warp-specialized kernel with one group (partial M, N and K tiles; E5M2 x operand as the HYBRID
    recipe's gradients; M = 203 not a multiple of 4). "gluon_scales_tma": the Gluon kernel's variant
    whose producer TMA-loads A's row scales (te_ops.fp8.triton.GLUON_SCALES_TMA)."""
    from te_ops.fp8 import triton as tri

    if kernel.startswith("gluon") and (k % 16 or n % 8):
        pytest.skip("the Gluon kernel needs K % 16 == 0 and N % 8 == 0 (16-byte TMA rows)")
    monkeypatch.setattr(tri, "GEMM_KERNEL", _gemm_kernel(kernel, monkeypatch, k, n, jnp.float32))
    monkeypatch.setattr(tri, "GLUON_UNTESTED_OK", True)  # bias and E5M2 through the Gluon kernel too
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w_t = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    qa = ref.quantize_blocks(x, (1, 128), fmt, power_of_2=True)
    qb = ref.quantize_blocks(w_t, (128, 128), fp8.E4M3, power_of_2=True)
    with native.poisoned_outputs():
        got = jax.jit(lambda a, b, c: tri.block_scaled_gemm(a, b, jnp.float32, bias=c))(qa, qb, bias)
    want = jnp.dot(ref.dequantize(qa, jnp.float32), ref.dequantize(qb, jnp.float32).T, precision="highest") + bias
    g, w = np.asarray(got), np.asarray(want)
    assert not np.isnan(g).any()
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-3 * float(np.max(np.abs(w))))


@needs_triton
@pytest.mark.parametrize("recipe", [fp8.BlockScaling(), fp8.CurrentScaling(), fp8.DelayedScaling(history_len=4),
                                    fp8.CurrentScaling(fast_accumulation=True),
                                    fp8.DelayedScaling(history_len=4, fast_accumulation=True)],
                         ids=lambda r: f"{type(r).__name__}{'-fast' * getattr(r, 'fast_accumulation', 0)}")  # fmt: skip
@pytest.mark.parametrize("master", [False, True], ids=["bf16_kernel", "master_f32_kernel"])
def test_fp8_dense_triton_path_matches_reference(recipe, master):
    """fp8_dense forward and both gradients through the Triton path (block: our quantize and GEMM
    kernels; current and delayed: our quantize kernels and cuBLASLt's FP8 GEMM via XLA) vs the
    reference path on the CPU; with delayed scaling also the updated state (the state's cotangent);
    also with a float32 master kernel (quantized from float32, float32 dw from the wgrad GEMM)."""
    k = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(k[0], (2048, 1024), jnp.bfloat16)
    w = (jax.random.normal(k[1], (1024, 768), jnp.float32) / 32).astype(jnp.float32 if master else jnp.bfloat16)
    dy = jax.random.normal(k[2], (2048, 768), jnp.bfloat16)
    st = None
    if isinstance(recipe, fp8.DelayedScaling):
        st = fp8.initial_dense_state(recipe)
        st = fp8.DenseScalingState(*(fp8.DelayedScalingState(s.amax_history, jnp.float32(v)) for s, v in
                                     zip((st.x, st.w, st.g), (64.0, 2048.0, 4096.0), strict=True)))  # fmt: skip

    def fn(x, w, st, dy, impl):
        if st is None:
            y, vjp = jax.vjp(lambda x, w: fp8.fp8_dense(x, w, recipe, implementation=impl), x, w)
        else:
            y, vjp = jax.vjp(lambda x, w, st: fp8.fp8_dense(x, w, recipe, state=st, implementation=impl), x, w, st)
        return (y, *vjp(dy))

    outs = {
        "triton": jax.jit(lambda *a: fn(*a, "triton"))(x, w, st, dy),
        "reference": on_cpu(lambda *a: fn(*a, "reference"), x, w, st, dy),
    }
    for name, a, b in zip(("y", "dx", "dw"), outs["triton"], outs["reference"], strict=False):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.dtype == b.dtype, name
        assert not np.isnan(a32).any(), name
        np.testing.assert_allclose(a32, b32, rtol=0, atol=1e-2 * float(np.max(np.abs(b32))), err_msg=name)
    assert outs["triton"][2].dtype == w.dtype
    if st is not None:  # amax histories exact; the next scales from XLA's GPU division: within 1 ulp
        for a, b in zip(jax.tree.leaves(outs["triton"][3]), jax.tree.leaves(outs["reference"][3]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2.0**-23, atol=0)


@needs_triton
@pytest.mark.parametrize("dense_kernel", ["gluon", "persistent", "gluon_scales_tma"])
def test_fp8_dense_block_gemm_routes_match_reference(dense_kernel, monkeypatch):
    """fp8_dense forward and both gradients with block scaling and a bias, the three GEMMs through
    the Gluon warp-specialized kernel (or its variant with the A scales through TMA, or the Triton
    grouped kernel) with one group, vs the reference path on the CPU."""
    from te_ops.fp8 import triton as tri

    dense_kernel = _gemm_kernel(dense_kernel, monkeypatch, 1024, 768, jnp.bfloat16)
    monkeypatch.setattr(tri, "GLUON_UNTESTED_OK", True)  # the bias epilogue through the Gluon kernel too
    k = jax.random.split(jax.random.key(9), 4)
    x = jax.random.normal(k[0], (1000, 1024), jnp.bfloat16)
    w = (jax.random.normal(k[1], (1024, 768), jnp.float32) / 32).astype(jnp.bfloat16)
    b = jax.random.normal(k[2], (768,), jnp.float32)
    dy = jax.random.normal(k[3], (1000, 768), jnp.bfloat16)

    def fn(x, w, b, dy, impl):
        y, vjp = jax.vjp(lambda x, w, b: fp8.fp8_dense(x, w, fp8.BlockScaling(), bias=b, implementation=impl), x, w, b)
        return (y, *vjp(dy))

    with tri.kernel_override(dense=dense_kernel), native.poisoned_outputs():
        got = jax.jit(lambda *a: fn(*a, "triton"))(x, w, b, dy)
    want = on_cpu(lambda *a: fn(*a, "reference"), x, w, b, dy)
    for name, a, c in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        a32, c32 = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert not np.isnan(a32).any(), name
        np.testing.assert_allclose(a32, c32, rtol=0, atol=1e-2 * float(np.max(np.abs(c32))), err_msg=name)


@needs_triton
@pytest.mark.parametrize("m,k,n,g", [(300, 256, 130, 4), (300, 272, 136, 4), (32768, 1024, 4096, 16),
                                     (16384, 7168, 4096, 32), (301, 400, 264, 5)])  # fmt: skip
@pytest.mark.parametrize("kernel", ["triton", "gluon", "gluon_scales_tma"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_block_scaled_gemm_matches_reference(m, k, n, g, kernel, out_dtype, monkeypatch):
    """Experts in FP8 vs per-group dequantized float32 GEMMs; uneven groups with an empty one and
    rows past the groups (zero), outputs NaN-poisoned; the Triton kernel and the Gluon
    warp-specialized kernel (TMA-store and masked-store epilogues, partial K steps; M = 301 not a
    multiple of 4), also its variant with A's row scales through TMA ("gluon_scales_tma")."""
    from te_ops.fp8 import triton as tri

    if kernel != "triton" and (k % 16 or n % 8):
        pytest.skip("the Gluon kernel needs K % 16 == 0 and N % 8 == 0 (16-byte TMA rows)")
    kernel = _gemm_kernel(kernel, monkeypatch, k, n, out_dtype)
    rng = np.random.default_rng(m + g)
    sizes = np.floor(rng.dirichlet(np.full(g, 0.7)) * m * 0.9).astype(np.int32)
    sizes[1] = 0
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w_t = jnp.asarray(rng.standard_normal((g, n, k)) / np.sqrt(k), jnp.bfloat16)
    # quantized on the CPU (the reference's float32 blocks of the experts' weights take GBs: with four
    # test workers on one GPU they ran it out of memory on 2026-12-06), then moved to the GPU
    qa = jax.device_put(on_cpu(lambda x: ref.quantize_blocks(x, (1, 128), fp8.E4M3, power_of_2=True), x), GPU)
    qb = jax.device_put(on_cpu(lambda w: ref.quantize_blocks(w, (128, 128), fp8.E4M3, power_of_2=True), w_t), GPU)
    del w_t
    with native.poisoned_outputs(), tri.kernel_override(grouped=kernel):
        got = jax.jit(lambda a, b, s: tri.grouped_block_scaled_gemm(a, b, s, out_dtype))(qa, qb, sizes)
    got = np.asarray(got, np.float32)
    tol = 2e-3 if out_dtype == jnp.float32 else 8e-3  # + one bfloat16 rounding (2**-9 relative)
    xd, wd = np.asarray(ref.dequantize(qa, jnp.float32)), np.asarray(ref.dequantize(qb, jnp.float32))
    r0 = 0
    assert not np.isnan(got).any()
    for gi, size in enumerate(sizes):
        want = xd[r0 : r0 + size] @ wd[gi].T  # NumPy float32 on the host: no compile per group shape
        if size:
            np.testing.assert_allclose(got[r0 : r0 + size], want, rtol=0, atol=tol * float(np.max(np.abs(want))))
        r0 += size
    assert np.all(got[r0:] == 0), "rows past the groups must be zero"


@needs_triton
@pytest.mark.parametrize("m,k,n,g", [(300, 200, 130, 4), (32768, 1024, 4096, 16), (16384, 2048, 1024, 32)])
def test_grouped_block_scaled_wgrad_matches_reference(m, k, n, g):
    """FP8 expert weight gradients vs per-group dequantized float32 GEMMs: uneven groups straddling
    128-row chunks, an empty group (zero gradient), rows past the groups ignored; NaN-poisoned
    outputs (every element written)."""
    from te_ops.fp8 import triton as tri

    rng = np.random.default_rng(m + 3 * g)
    sizes = np.floor(rng.dirichlet(np.full(g, 0.7)) * m * 0.9).astype(np.int32)
    sizes[1] = 0
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    qxt = on_cpu(lambda x: ref.quantize_blocks(x.T, (1, 128), fp8.E4M3, power_of_2=False), x)
    qdyt = on_cpu(lambda d: ref.quantize_blocks(d.T, (128, 128), fp8.E5M2, power_of_2=False), dy)
    gpu = jax.devices("gpu")[0]
    a, b, s = jax.device_put((qxt, qdyt, jnp.asarray(sizes)), gpu)
    with native.poisoned_outputs():
        got = np.asarray(jax.jit(lambda a, b, s: tri.grouped_block_scaled_wgrad(a, b, s, g, jnp.float32))(a, b, s))
    xd, dd = np.asarray(ref.dequantize(qxt, jnp.float32)), np.asarray(ref.dequantize(qdyt, jnp.float32))
    assert not np.isnan(got).any()
    r0 = 0
    for gi, size in enumerate(sizes):
        want = xd[:, r0 : r0 + size] @ dd[:, r0 : r0 + size].T
        if size:
            np.testing.assert_allclose(got[gi], want, rtol=0, atol=2e-3 * float(np.max(np.abs(want))))
        else:
            assert np.all(got[gi] == 0), "an empty group's gradient must be zero"
        r0 += size


DELAYED = fp8.DelayedScaling(history_len=8)


@needs_triton
@pytest.mark.parametrize("shape", [(37, 129), (16384, 7168)])
def test_per_tensor_kernels_match_reference(shape):
    """Current scaling (amax pass + cast pass) and delayed scaling (one pass, amax recorded) through
    te_ops.fp8.quantize(implementation="triton") vs the reference on the CPU: bytes, scales, the new
    state. With edge values (a NaN: scale 1) and without (the scale from a finite amax)."""
    for x in (_x(3, shape, jnp.bfloat16), jax.random.normal(jax.random.key(4), shape, jnp.bfloat16) * 3):
        for recipe in (fp8.CurrentScaling(), fp8.CurrentScaling(formats="e4m3", margin=1, power_of_2=True)):
            for role in ("x", "g"):
                with native.poisoned_outputs():
                    got = jax.jit(lambda x, r=recipe, role=role: fp8.quantize(x, r, role, implementation="triton"))(x)
                _same(got, on_cpu(lambda x, r=recipe, role=role: fp8.quantize(x, r, role), x))
        st = fp8.initial_state(DELAYED)
        for _ in range(3):
            qa, sa = jax.jit(lambda x, s: fp8.quantize(x, DELAYED, "x", s, implementation="triton"))(x, st)
            qb, sb = on_cpu(lambda x, s: fp8.quantize(x, DELAYED, "x", s), x, st)
            _same(qa, qb)
            np.testing.assert_array_equal(np.asarray(sa.amax_history), np.asarray(sb.amax_history))
            # the next scale comes from XLA's float32 division on the GPU: within 1 ulp
            np.testing.assert_allclose(float(sa.scale), float(sb.scale), rtol=2.0**-23, atol=0)
            st = sa


@needs_triton
@pytest.mark.parametrize("master", [False, True], ids=["bf16_kernels", "master_f32_kernels"])
@pytest.mark.parametrize("recipe", [fp8.BlockScaling(), fp8.CurrentScaling()], ids=lambda r: type(r).__name__)
def test_fp8_grouped_dense_triton_path_matches_reference(recipe, master):
    """MoE experts: FP8 forward and dx through the grouped block-scaled kernel, dkernels through the
    grouped FP8 wgrad kernel, vs the reference path; also with float32 master kernels (quantized from
    float32 by our kernels, float32 dkernels written by the wgrad kernel)."""
    rng = np.random.default_rng(9)
    m, k, n, g = 8192, 1024, 2048, 8
    sizes = np.floor(rng.dirichlet(np.full(g, 0.7)) * m * 0.95).astype(np.int32)
    sizes[2] = 0
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / 32, jnp.float32 if master else jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)

    def fn(x, w, s, dy, impl):
        y, vjp = jax.vjp(lambda x, w: fp8.fp8_grouped_dense(x, w, s, recipe, implementation=impl), x, w)
        return (y, *vjp(dy))

    s = jnp.asarray(sizes)
    outs = {"triton": jax.jit(lambda *a: fn(*a, "triton"))(x, w, s, dy),
            "reference": on_cpu(lambda *a: fn(*a, "reference"), x, w, s, dy)}  # fmt: skip
    for name, a, b in zip(("y", "dx", "dkernels"), outs["triton"], outs["reference"], strict=True):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.dtype == b.dtype, name
        assert not np.isnan(a32).any(), name
        np.testing.assert_allclose(a32, b32, rtol=0, atol=1e-2 * float(np.max(np.abs(b32))), err_msg=name)
    assert outs["triton"][2].dtype == w.dtype


@needs_triton
def test_fp8_grouped_dense_delayed_triton_path_matches_reference():
    """Delayed-scaling MoE experts over two steps: the per-tensor cast kernel with the state's scales
    (x, dy; one batched launch for the kernels, one scale per expert) and the grouped block-scaled
    GEMM / wgrad kernels, vs the reference path on the CPU; the state updates too (amax histories
    exact, the next scales within 1 ulp: XLA's float32 division on the GPU)."""
    rng = np.random.default_rng(10)
    m, k, n, g = 4096, 1024, 2048, 8
    rec = fp8.DelayedScaling(history_len=4)
    sizes = np.floor(rng.dirichlet(np.full(g, 0.7)) * m * 0.95).astype(np.int32)
    sizes[3] = 0
    s = jnp.asarray(sizes)

    def fn(x, w, st, s, dy, impl):
        y, vjp = jax.vjp(lambda x, w, st: fp8.fp8_grouped_dense(x, w, s, rec, state=st, implementation=impl), x, w, st)
        return (y, *vjp(dy))

    st = fp8.initial_grouped_state(rec, g)
    for step in range(2):
        x = jnp.asarray(rng.standard_normal((m, k)) * (1 + step), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) / 32 * (1 + np.arange(g))[:, None, None], jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        got = jax.jit(lambda *a: fn(*a, "triton"))(x, w, st, s, dy)
        want = on_cpu(lambda *a: fn(*a, "reference"), x, w, st, s, dy)
        for name, a, b in zip(("y", "dx", "dkernels"), got[:3], want[:3], strict=True):
            a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert not np.isnan(a32).any(), name
            np.testing.assert_allclose(a32, b32, rtol=0, atol=1e-2 * float(np.max(np.abs(b32))), err_msg=name)
        for name in ("x", "w", "g"):
            sa, sb = getattr(got[3], name), getattr(want[3], name)
            np.testing.assert_array_equal(np.asarray(sa.amax_history), np.asarray(sb.amax_history), err_msg=name)
            np.testing.assert_allclose(np.asarray(sa.scale), np.asarray(sb.scale), rtol=2.0**-23, atol=0, err_msg=name)
        st = got[3]


def test_reference_rounds_on_the_gpu():
    """The jitted reference quantize -> dequantize must round to FP8 on the GPU as on the CPU (XLA:GPU
    once removed the round trip: te_ops.fp8.reference.cast_scaled)."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("no GPU")
    x = jax.random.normal(jax.random.key(1), (512, 1024), jnp.bfloat16)

    def rt(x):
        return ref.dequantize(ref.quantize_blocks(x, (1, 128), fp8.E4M3, power_of_2=True), jnp.float32)

    got = np.asarray(jax.jit(rt)(x))
    assert np.max(np.abs(got - np.asarray(x, np.float32))) > 0, "the FP8 rounding was optimized away"
    np.testing.assert_array_equal(got, np.asarray(on_cpu(rt, x)))


@needs_triton
def test_default_implementation_runs_the_triton_path():
    """On the H200, ``implementation=None`` is the Triton path: the same numbers, bit for bit."""
    from te_ops.fp8 import select

    assert select.triton_fp8_unavailable_reason() is None
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((1024, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 768)) / 16, jnp.bfloat16)
    for recipe in (fp8.BlockScaling(), fp8.CurrentScaling()):

        def fb(impl, recipe=recipe):
            def run(x, w):
                y, vjp = jax.vjp(lambda x, w: fp8.fp8_dense(x, w, recipe, implementation=impl), x, w)
                return (y, *vjp(y))

            return jax.jit(run)

        for a, b in zip(fb(None)(x, w), fb("triton")(x, w), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@needs_triton
@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh", "relu", "silu"], ids=str)
@pytest.mark.parametrize("shape", [(300, 200), (4096, 14336)])
@pytest.mark.parametrize("warps", [None, 8, 16], ids=lambda w: f"warps{w or 'default'}")
def test_dact_dbias_quantize_matches_reference(act, shape, warps, monkeypatch):
    """The fused activation backward on the GPU vs the reference on the CPU: bytes and scales of
    dz (1 x 128) and dz^T (128 x 128) equal for ReLU / None and all but a few last-ulp roundings of
    act' for GELU / SiLU (libdevice vs XLA's CPU math); dbias within bf16 rounding; NaN / Inf /
    zero blocks in dy; outputs NaN-poisoned. ``warps``: the kernel's warps per tile
    (QUANT_TILE_WARPS, timed in benchmarks/fp8.py), GELU and ReLU only."""
    if warps is not None:
        if act not in ("gelu", "relu"):
            pytest.skip("other warps per tile are checked with GELU and ReLU only")
        from te_ops.fp8 import triton as tri

        monkeypatch.setattr(tri, "QUANT_TILE_WARPS", warps)
    dy = _x(31, shape, jnp.bfloat16)
    z = jnp.asarray(np.random.default_rng(32).standard_normal(shape) * 2.0, jnp.bfloat16)
    rec = fp8.BlockScaling()

    def run(impl):
        return lambda d, zz: fp8.dact_dbias_quantize(d, zz, rec, activation=act, implementation=impl)

    with native.poisoned_outputs():
        got = jax.jit(run("triton"))(dy, z)
    want = on_cpu(run("reference"), dy, z)
    for g_, w_ in zip(got[:2], want[:2], strict=True):
        nan_moved = T.fp8_nan_mismatches(g_.data, w_.data)
        assert nan_moved.size == 0, f"NaN positions differ at {nan_moved[:3].tolist()}"
        frac = T.fp8_byte_mismatch_fraction(g_.data, w_.data)
        assert frac == 0.0 if act in (None, "relu") else frac < 1e-3, frac
        sg, sw = np.asarray(g_.scale_inv), np.asarray(w_.scale_inv)
        assert np.mean(sg != sw) < 1e-3, "scales differ"
    db_g, db_w = np.asarray(got[2], np.float32), np.asarray(want[2], np.float32)
    np.testing.assert_allclose(db_g, db_w, rtol=2e-2, atol=2e-2 * float(np.nanmax(np.abs(db_w[np.isfinite(db_w)]))),
                               equal_nan=True)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("recipe", [fp8.BlockScaling(), fp8.CurrentScaling()], ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_fp8_dense_activation_triton_matches_reference(recipe, act):
    """fp8_dense with bias and an activation through the Triton path (block scaling: the fused
    activation backward kernel) vs the reference on the CPU: y, dx, dw, dbias. The pre-activation
    keeps away from 0 (bias +-3, x @ w of std 0.25): the GPU's and the CPU's GEMMs round z
    differently, and a z within that rounding of 0 would flip ReLU's derivative and move a whole row
    of dx (seen on the H100, 2026-12-06: 0.1% of rows)."""
    k = jax.random.split(jax.random.key(9), 4)
    x = jax.random.normal(k[0], (2048, 1024), jnp.bfloat16)
    w = (jax.random.normal(k[1], (1024, 768), jnp.float32) / 128).astype(jnp.bfloat16)
    b = (3.0 * jnp.sign(jax.random.normal(k[2], (768,), jnp.float32))).astype(jnp.bfloat16)
    dy = jax.random.normal(k[3], (2048, 768), jnp.bfloat16)

    def fn(x, w, b, dy, impl):
        y, vjp = jax.vjp(lambda x, w, b: fp8.fp8_dense(x, w, recipe, bias=b, activation=act, implementation=impl),
                         x, w, b)  # fmt: skip
        return (y, *vjp(dy))

    with native.poisoned_outputs():
        got = jax.jit(lambda *a: fn(*a, "triton"))(x, w, b, dy)
    want = on_cpu(lambda *a: fn(*a, "reference"), x, w, b, dy)
    for name, a, c in zip(("y", "dx", "dw", "dbias"), got, want, strict=True):
        a32, c32 = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert not np.isnan(a32).any(), name
        np.testing.assert_allclose(a32, c32, rtol=0, atol=2e-2 * float(np.max(np.abs(c32))), err_msg=name)


@needs_triton
@pytest.mark.parametrize("act,gated", [("silu", True), ("silu", False), ("relu", True), (None, False)], ids=str)
@pytest.mark.parametrize("shape", [(300, 256), (16384, 2048)], ids=str)
def test_ffn_fused_kernels_match_reference(act, gated, shape):
    """The fused FFN activation (+ backward) and dual quantize kernels: the reference's bytes up to
    the GPU's exp in its last ulp moving an FP8 rounding (tests/te_ops/test_fp8_ffn._compare: a
    fraction <= 1e-3, every value within one FP8 step, NaN positions equal); all outputs written."""
    from te_ops.fp8 import ffn
    from te_ops.fp8 import triton as tri
    from tests.te_ops.test_fp8_ffn import _compare, _edge

    r, f = shape
    rng = np.random.default_rng(21)
    h = jnp.asarray(_edge(rng.standard_normal((r, 2 * f if gated else f)) * 2.0), jnp.bfloat16)
    da = jnp.asarray(_edge(rng.standard_normal((r, f))), jnp.bfloat16)
    with native.poisoned_outputs():
        got_a = jax.jit(lambda h: tri.ffn_act_dual_quantize(h, act, gated, fp8.E4M3, power_of_2=True))(h)
        got_d = jax.jit(lambda da, h: tri.ffn_dact_dual_quantize(da, h, act, gated, fp8.E5M2, power_of_2=True))(da, h)

    def want_a(h):
        a = ffn.ffn_activation(h, act, gated)
        return (ref.quantize_blocks(a, (1, 128), fp8.E4M3, power_of_2=True),
                ref.quantize_blocks(a.T, (1, 128), fp8.E4M3, power_of_2=True))  # fmt: skip

    def want_d(da, h):
        dh = jax.vjp(lambda h: ffn.ffn_activation(h, act, gated), h)[1](da)[0]
        return (ref.quantize_blocks(dh, (1, 128), fp8.E5M2, power_of_2=True),
                ref.quantize_blocks(dh.T, (128, 128), fp8.E5M2, power_of_2=True))  # fmt: skip

    for tag, got, want in (("act", got_a, on_cpu(want_a, h)), ("dact", got_d, on_cpu(want_d, da, h))):
        ok, msg = _compare(jax.device_get(got), want, tag)
        assert ok, msg


@needs_triton
@pytest.mark.parametrize("requantize", [False, True], ids=["xla_requantize", "requantize_kernel"])
def test_fp8_dispatch_ffn_triton_matches_reference(requantize, monkeypatch):
    """The fused expert FFN op on the GPU kernels vs its reference (forward and the three gradients),
    with the dispatch's wgrad operand from XLA + block_quantize or from requantize_t."""
    from te_ops.fp8 import dispatch as fd
    from tests.te_ops.test_fp8_ffn import _fused, _inputs, _value_and_grads

    monkeypatch.setattr(fd, "REQUANTIZE_KERNEL", requantize)

    x, rm, wi, wo = _inputs(22, t=2048, h=1024, e=8, f=512)
    n = 2 * x.shape[0]
    dy = jnp.asarray(np.random.default_rng(23).standard_normal((n, 1024)), jnp.bfloat16)
    got = jax.jit(lambda *a: _value_and_grads(_fused(rm, n, "silu", True, "triton"), *a, dy))(x, wi, wo)
    want = on_cpu(lambda *a: _value_and_grads(_fused(rm, n, "silu", True, "reference"), *a, dy), x, wi, wo)
    for name, a, b in zip(("y", "dx", "dwi", "dwo"), got, want, strict=True):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = float(np.max(np.abs(a32 - b32)) / np.max(np.abs(b32)))
        assert err < 3e-2 and not np.isnan(a32).any(), (name, err)  # a few FP8 roundings moved by an exp ulp
