"""GPU tests of the cuBLASLt route of te_ops.fp8's dense block-scaled GEMM (te_ops/fp8/cublaslt.py,
FFI target te_fp8_cublaslt_block_gemm in csrc/dense/fp8_block_gemm_ffi.cc): against the reference
(dequantized operands, float32 GEMM) and against the Gluon route on fresh random inputs, with
NaN-poisoned outputs; partial 128-blocks in M, N and K and K-block counts that are not multiples of
4 (padded 128 x 128 scale columns); outlier rows and blocks (scales spread over many binades); E5M2
operands; bfloat16 and float32 outputs; fp8_dense's three GEMMs (forward, dgrad, wgrad) through the
route vs the reference path; the handler's input checks; and a run under XLA command buffers (CUDA
graphs) with the handler counters.

Skipped with the reason where the route cannot exist in this process (no te_ops._native_cublaslt, no
GPU, cuBLASLt older than 12.9, not Hopper). Where it can, a shape the route should take but cuBLASLt
refuses FAILS (it is not skipped)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops import fp8
from te_ops._core import native
from te_ops._core import testing as T
from te_ops.fp8 import cublaslt
from te_ops.fp8 import reference as ref

E4, E5 = fp8.E4M3, fp8.E5M2


def _env_reason():
    """Why the route cannot run in this process at all (module, GPU, cuBLASLt version, Hopper)."""
    why = native.native_unavailable_reason(cublaslt.MODULE, "dense")
    if why:
        return why
    why = cublaslt.static_unavailable_reason(1024, 1024, 1024, jnp.bfloat16, a_dtype=E4, b_dtype=E4)
    return why or cublaslt._device_reason()


_WHY = _env_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=f"cuBLASLt FP8 route: {_WHY}")]

CPU = jax.devices("cpu")[0]


def on_cpu(fn, *args):
    """``jax.jit(fn)`` on the CPU: the reference's numbers (docs/semantics.md)."""
    return jax.jit(fn)(*jax.device_put(args, CPU))


def _operands(m, k, n, fa, fb, seed, outliers=False):
    """qa [M, K] in 1 x 128 tiles (format fa) and qb_t [N, K] in 128 x 128 blocks (format fb) from
    fresh normal data; with outliers, some rows, 128-blocks of K and single entries are scaled up or
    down by powers of two up to 2^12, so neighbouring scales differ by many binades."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    if outliers:
        x[rng.integers(0, m, 7)] *= 4096.0
        x[:, : min(k, 128)] *= 2.0**-10  # a whole K-block of tiny values
        x[rng.integers(0, m, 11), rng.integers(0, k, 11)] = 3.0e4  # single spikes in otherwise normal tiles
        w[: min(n, 128), -min(k, 128) :] *= 256.0  # one 128 x 128 weight block far above the others
        w[rng.integers(0, n, 5), rng.integers(0, k, 5)] *= -500.0
    qa = ref.quantize_blocks(jnp.asarray(x, jnp.bfloat16), (1, 128), fa, power_of_2=True)
    qb = ref.quantize_blocks(jnp.asarray(w, jnp.bfloat16), (128, 128), fb, power_of_2=True)
    return qa, qb


def _want(qa, qb, out_dtype):
    """The reference: dequantized operands, one float32 GEMM (HIGHEST precision), one rounding."""
    da, db = ref.dequantize(qa, jnp.float32), ref.dequantize(qb, jnp.float32)
    return jax.jit(lambda a, b: jnp.dot(a, b.T, precision="highest").astype(out_dtype))(da, db)


def _run(route, qa, qb, out_dtype):
    """block_scaled_gemm through ``route`` with NaN-poisoned outputs; also the lowered text (which
    custom calls ran)."""
    from te_ops.fp8 import triton as tri

    fn = jax.jit(lambda a, b: tri.block_scaled_gemm(a, b, out_dtype))
    with tri.kernel_override(dense=route), native.poisoned_outputs():
        text = fn.lower(qa, qb).as_text()
        got = fn(qa, qb)
    return np.asarray(got, np.float32), text


def _close(got, want, out_dtype, what):
    """The project's tolerance table, at bfloat16 for both outputs: the tensor cores sum each 128-block
    of K with a reduced-precision accumulator before the float32 promotion (docs/semantics.md)."""
    w = np.asarray(want, np.float32)
    assert not np.isnan(got).any(), f"NaN (unwritten or poisoned) in {what}"
    T.assert_close(got, w, jnp.bfloat16, scale=float(np.max(np.abs(w))) + 1.0, err_msg=what)


BF16, F32 = jnp.bfloat16, jnp.float32
# (M, K, N, a format, b format, output, outliers). K-block counts kb = cdiv(K, 128) that are not
# multiples of 4 pad the 128 x 128 scale columns; M and N not multiples of 128; K a partial block.
CASES = [
    (256, 512, 256, E4, E4, BF16, False),  # whole blocks, kb = 4: no padding
    (200, 640, 136, E4, E4, BF16, False),  # partial M and N blocks; kb = 5 -> 8
    (200, 640, 136, E4, E4, F32, True),
    (200, 640, 136, E5, E4, F32, True),  # E5M2 activations or gradients (the hybrid recipe)
    (200, 640, 136, E4, E5, BF16, True),  # E5M2 right operand (hybrid wgrad: dy^T blocks)
    (1000, 1152, 768, E4, E4, BF16, True),  # kb = 9 -> 12
    (1000, 1152, 768, E5, E4, BF16, False),
    (512, 304, 520, E4, E4, F32, False),  # K a partial block (2 x 128 + 48): kb = 3 -> 4
    (512, 304, 520, E4, E5, F32, True),
    (4096, 7168, 2048, E4, E4, BF16, False),  # training size, kb = 56
    (4096, 7168, 2048, E5, E4, F32, True),
]


def _case_id(c):
    m, k, n, fa, fb, out, outliers = c
    fmt = "x".join(jnp.dtype(f).name[7:] for f in (fa, fb))  # e4m3fnxe5m2
    return f"{m}x{k}x{n}-{fmt}-{jnp.dtype(out).name}" + "-outliers" * outliers


@pytest.mark.parametrize("m,k,n,fa,fb,out_dtype,outliers", CASES, ids=[_case_id(c) for c in CASES])
def test_cublaslt_route_matches_reference_and_gluon(m, k, n, fa, fb, out_dtype, outliers):
    from te_ops.fp8 import triton as tri

    why = cublaslt.unavailable_reason(m, n, k, out_dtype, a_dtype=fa, b_dtype=fb)
    assert why is None, f"the cuBLASLt route refuses a shape it should take: {why}"
    qa, qb = _operands(m, k, n, fa, fb, seed=m * 7 + k * 3 + n + 1000 * outliers, outliers=outliers)
    got, text = _run("cublaslt", qa, qb, out_dtype)
    assert "te_fp8_cublaslt_block_gemm" in text, "the cuBLASLt route was not taken"
    want = _want(qa, qb, out_dtype)
    _close(got, want, out_dtype, f"cuBLASLt vs reference {m}x{k}x{n}")
    if tri.gluon_gemm_unavailable_reason(k, n, out_dtype) is None:
        gluon, gtext = _run("gluon", qa, qb, out_dtype)
        assert "te_fp8_cublaslt_block_gemm" not in gtext
        _close(got, gluon, out_dtype, f"cuBLASLt vs Gluon {m}x{k}x{n}")


def test_cublaslt_route_is_not_worse_than_gluon():
    """On a large K, the cuBLASLt result's error against the float32 reference is within 2x of the
    Gluon kernel's (both promote to float32 every 128 of K; a route that accumulated all of K in the
    tensor cores' reduced precision would be several times worse)."""
    from te_ops.fp8 import triton as tri

    m, k, n = 2048, 14336, 1024
    if tri.gluon_gemm_unavailable_reason(k, n, jnp.float32) is not None:
        pytest.skip(f"no Gluon kernel to compare with: {tri.gluon_gemm_unavailable_reason(k, n, jnp.float32)}")
    from te_ops.fp8 import cublaslt

    why = cublaslt.unavailable_reason(m, n, k, jnp.float32, a_dtype=E4, b_dtype=E4)
    assert why is None, f"the cuBLASLt route must take {m}x{k}x{n}: {why}"
    qa, qb = _operands(m, k, n, E4, E4, seed=3)
    want = np.asarray(_want(qa, qb, jnp.float32), np.float64)
    got_lt, lt_text = _run("cublaslt", qa, qb, jnp.float32)
    assert "te_fp8_cublaslt_block_gemm" in lt_text, "the cuBLASLt route was not taken"
    err_lt = np.max(np.abs(got_lt - want))
    err_gl = np.max(np.abs(_run("gluon", qa, qb, jnp.float32)[0] - want))
    assert err_lt <= 2.0 * err_gl + 1e-6 * np.max(np.abs(want)), (err_lt, err_gl)


@pytest.mark.parametrize(
    "m,k,n,fa,fb,bias,reason",
    [(256, 512, 256, E5, E5, False, "no E5M2 x E5M2"), (256, 520, 256, E4, E4, False, "K % 16 == 0"),
     (256, 512, 256, E4, E4, True, "takes no bias"), (260, 512, 256, E4, E4, False, "M % 8 == 0")],
    ids=["e5m2xe5m2", "k520", "bias", "m260"],
)  # fmt: skip
def test_unsupported_calls_fall_back_and_stay_correct(m, k, n, fa, fb, bias, reason):
    """Calls the route cannot take (both E5M2, K % 16, a bias, M % 8) run the Gluon / Triton kernels
    under kernel_override(dense="cublaslt") and give the reference's numbers."""
    from te_ops.fp8 import triton as tri

    why = cublaslt.unavailable_reason(m, n, k, jnp.float32, a_dtype=fa, b_dtype=fb, has_bias=bias)
    assert why is not None and reason in why, why
    qa, qb = _operands(m, k, n, fa, fb, seed=11)
    b = jnp.asarray(np.random.default_rng(1).standard_normal(n), jnp.float32) if bias else None
    fn = jax.jit(lambda a, q, c: tri.block_scaled_gemm(a, q, jnp.float32, bias=c))
    with tri.kernel_override(dense="cublaslt"), native.poisoned_outputs():
        assert "te_fp8_cublaslt_block_gemm" not in fn.lower(qa, qb, b).as_text()
        got = np.asarray(fn(qa, qb, b))
    want = _want(qa, qb, jnp.float32) + (0 if b is None else np.asarray(b))
    _close(got, want, jnp.float32, f"fallback ({reason})")


@pytest.mark.parametrize("recipe", [fp8.BlockScaling(), fp8.BlockScaling(formats="hybrid")], ids=["e4m3", "hybrid"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_dense_block_through_cublaslt_matches_reference(recipe, bias):
    """fp8_dense forward and both gradients (block scaling) with the GEMMs through the cuBLASLt route
    (the forward GEMM stays on Gluon when there is a bias) vs the reference path on the CPU; the
    lowered program holds the expected number of cuBLASLt calls, and the handler ran."""
    from te_ops.fp8 import triton as tri

    # M = 1008: not a multiple of 128 (partial row block) but of 16, since the weight gradient's K is M
    # (1000 would send the wgrad GEMM to the Triton kernel: K % 16 != 0). kb: 9 (fwd), 6 (dgrad), 8 (wgrad)
    m, k, n = 1008, 1152, 768
    ks = jax.random.split(jax.random.key(21), 4)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (k, n), jnp.float32) / 32).astype(jnp.bfloat16)
    b = jax.random.normal(ks[2], (n,), jnp.float32)
    dy = jax.random.normal(ks[3], (m, n), jnp.bfloat16)

    def fn(x, w, b, dy, impl):
        if bias:
            y, vjp = jax.vjp(lambda x, w, b: fp8.fp8_dense(x, w, recipe, bias=b, implementation=impl), x, w, b)
        else:
            y, vjp = jax.vjp(lambda x, w: fp8.fp8_dense(x, w, recipe, implementation=impl), x, w)
        return (y, *vjp(dy))

    native.reset_counters()
    run = jax.jit(lambda *a: fn(*a, "triton"))
    with tri.kernel_override(dense="cublaslt"), native.poisoned_outputs():
        text = run.lower(x, w, b, dy).as_text()
        got = run(x, w, b, dy)
    n_calls = sum("@te_fp8_cublaslt_block_gemm" in ln for ln in text.splitlines())
    assert n_calls == (2 if bias else 3), n_calls
    assert native.counters().get("fp8_cublaslt_block_gemm", {}).get("executes", 0) >= 1, native.counters()
    want = on_cpu(lambda *a: fn(*a, "reference"), x, w, b, dy)
    for name, a, c in zip(("y", "dx", "dw", "db"), got, want, strict=False):
        a32, c32 = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert not np.isnan(a32).any(), name
        T.assert_close(a32, c32, jnp.bfloat16, scale=float(np.max(np.abs(c32))) + 1.0, err_msg=name)


def test_handler_rejects_bad_inputs_naming_the_argument():
    """The FFI handler's checks (Python never sends these): unpadded 128 x 128 scale columns, a
    non-FP8 operand, a wrong output dtype, a size the rule table refuses (its guard: the same table as
    te_ops.fp8.cublaslt's); each error names the argument and the expected value, or the rule."""
    m, k, n = 256, 640, 256  # kb = 5: the padded sb has 8 columns
    a = jnp.zeros((m, k), E4)
    b = jnp.zeros((n, k), E4)
    sa_t = jnp.ones((5, m), jnp.float32)
    sb_ok = jnp.ones((2, 8), jnp.float32)
    call = lambda out, *ops: native.ffi_call(cublaslt.TARGET, jax.ShapeDtypeStruct((m, n), out), *ops)  # noqa: E731
    cases = [
        ((jnp.bfloat16, a, sa_t, b, jnp.ones((2, 5), jnp.float32)), r"sb .*\[2, 8\].*pad the columns"),
        ((jnp.bfloat16, a.astype(jnp.bfloat16), sa_t, b, sb_ok), "a must be float8_e4m3fn or float8_e5m2"),
        ((jnp.float16, a, sa_t, b, sb_ok), "output y must be bfloat16 or float32"),
        ((jnp.bfloat16, a, jnp.ones((m, 5), jnp.float32), b, sb_ok), r"sa_t .*\[5, 256\]"),
        ((jnp.bfloat16, jnp.zeros((m, 520), E4), sa_t, jnp.zeros((n, 520), E4), sb_ok),
         r"K % 16 == 0 .*got K=520 \(a \[256, 520\]"),
    ]  # fmt: skip
    for (out, *ops), pattern in cases:
        with pytest.raises(Exception, match=pattern):
            jax.block_until_ready(jax.jit(lambda *o, out=out: call(out, *o))(*ops))


_CMD_BUFFER_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from te_ops import fp8
    from te_ops._core import native
    from te_ops.fp8 import reference as ref
    from te_ops.fp8 import triton as tri

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((512, 1152)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((384, 1152)) / 32, jnp.bfloat16)
    qa = ref.quantize_blocks(x, (1, 128), fp8.E4M3, power_of_2=True)
    qb = ref.quantize_blocks(w, (128, 128), fp8.E4M3, power_of_2=True)
    want = np.asarray(jnp.dot(ref.dequantize(qa, jnp.float32), ref.dequantize(qb, jnp.float32).T, precision="highest"))
    native.reset_counters()
    fn = jax.jit(lambda a, b: tri.block_scaled_gemm(a, b, jnp.float32) * 1.0)
    with tri.kernel_override(dense="cublaslt"):
        for _ in range(4):
            got = fn(qa, qb)
    got = np.asarray(got)
    err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1.0))
    c = {k: v for k, v in native.counters().items() if k.startswith("fp8_cublaslt")}
    print("RESULT " + json.dumps({"err": err, "nan": bool(np.isnan(got).any()), "counters": c}))
    """
)


def test_command_buffers_capture_and_warm_once():
    """Under XLA command buffers the handler runs inside the captured CUDA graph, warmed once for its
    key however often XLA calls the initialize stage, and gives the same numbers."""
    env = dict(os.environ)
    flags = " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + flags).strip()
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    proc = subprocess.run([sys.executable, "-c", _CMD_BUFFER_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT ") :])
    assert not res["nan"] and res["err"] < T.TOLERANCES[jnp.dtype(jnp.bfloat16)][1], res
    c = res["counters"]["fp8_cublaslt_block_gemm"]
    assert c["captured_executes"] >= 1, c
    assert c["warmups"] == 1, c
    assert c["initialize_calls"] >= c["warmups"], c
