"""The cuBLASLt route of te_ops.fp8's dense block-scaled GEMM (te_ops/fp8/cublaslt.py), on the CPU:
which calls it refuses and why, the scale padding, that the route falls back to the Gluon kernel
where it cannot run (this machine: no native module), and, with the route declared available, the
FFI call it lowers to for CUDA (operands, scale layouts, no Triton GEMM). The GEMM itself runs in
tests/gpu/test_fp8_cublaslt_gpu.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops import fp8
from te_ops._core import native
from te_ops.fp8 import cublaslt

E4, E5 = fp8.E4M3, fp8.E5M2
OK_VERSIONS = (131000, 131000)  # (headers, loaded library) of a cuBLASLt with the block scale modes


@pytest.mark.parametrize(
    "change, want",
    [
        ({}, None),
        ({"a_dtype": E5}, None),  # E5M2 x E4M3 and E4M3 x E5M2 exist in cuBLASLt
        ({"b_dtype": E5}, None),
        ({"out_dtype": jnp.float32, "n": 1028}, None),  # 1028 float32 = 16-byte rows
        ({"has_bias": True}, "takes no bias"),
        ({"m": 0}, "an empty operand (M=0, N=768, K=640)"),
        ({"n": 0}, "an empty operand"),
        ({"k": 0}, "an empty operand"),
        ({"a_dtype": jnp.bfloat16}, "got a bfloat16"),
        ({"b_dtype": jnp.int8}, "got b int8"),
        ({"a_dtype": E5, "b_dtype": E5}, "no E5M2 x E5M2"),
        ({"out_dtype": jnp.float16}, "bfloat16 or float32, got float16"),
        ({"k": 1000}, "K % 16 == 0"),
        ({"m": 1002}, "M % 4 == 0 and N % 4 == 0, got M=1002"),
        ({"n": 1030}, "got M=1024, N=1030"),
        ({"n": 1028}, "16-byte output rows, got N=1028 of bfloat16"),
        ({"cublaslt_versions": (120800, 131000)}, "headers 12.8.0"),
        ({"cublaslt_versions": (131000, 120805)}, "the loaded cuBLASLt is 12.8.5"),
        ({"cublaslt_versions": "cannot reach te_cublaslt_version"}, "cannot reach te_cublaslt_version"),
    ],
)
def test_static_unavailable_reason(change, want):
    args = {"m": 1024, "n": 768, "k": 640, "out_dtype": jnp.bfloat16, "a_dtype": E4, "b_dtype": E4,
            "has_bias": False, "cublaslt_versions": OK_VERSIONS, **change}  # fmt: skip
    m, n, k, out = args.pop("m"), args.pop("n"), args.pop("k"), args.pop("out_dtype")
    why = cublaslt.static_unavailable_reason(m, n, k, out, **args)
    if want is None:
        assert why is None
    else:
        assert why is not None and want in why, why


@pytest.mark.skipif(
    native.extension_unavailable_reason(cublaslt.MODULE) is None, reason="te_ops._native_cublaslt is built here"
)
def test_unavailable_without_the_native_module():
    """Without the dense native module every query answers with the module's import error (no GPU
    needed to ask), so the route is never taken."""
    why = cublaslt.unavailable_reason(1024, 768, 640, jnp.bfloat16, a_dtype=E4, b_dtype=E4)
    assert why is not None and "te_ops._native_cublaslt" in why, why
    assert isinstance(cublaslt.versions(), str)
    assert cublaslt.query(1024, 768, 640, 0, 0, 0).startswith("cannot reach te_fp8_cublaslt_block_gemm_query")
    from te_ops.fp8 import triton as tri

    assert tri.cublaslt_gemm_unavailable_reason(1024, 768, 640, jnp.bfloat16, a_dtype=E4, b_dtype=E4) == why


@pytest.mark.parametrize("kb", [1, 4, 5, 8, 11])
def test_block_scales_padded_to_a_multiple_of_four_columns(kb):
    sb = jax.random.uniform(jax.random.key(kb), (3, kb), jnp.float32) + 0.5
    got = np.asarray(cublaslt.padded_block_scales(sb))
    assert got.shape == (3, -(-kb // 4) * 4) and got.dtype == np.float32
    np.testing.assert_array_equal(got[:, :kb], np.asarray(sb))
    assert not got[:, kb:].any()


def _lower_block_dense(monkeypatch, route_available: bool, bias: bool):
    """fp8_dense (block recipe) forward + backward traced under kernel_override(dense="cublaslt") and
    lowered for sm_90 (Triton launcher stubbed): (Triton kernel names launched, lowered text)."""
    from te_ops._core import triton_bridge as tb

    if tb.triton_unavailable_reason() is not None:
        pytest.skip(f"needs Triton: {tb.triton_unavailable_reason()}")
    from te_ops.fp8 import triton as tri

    launches = []
    monkeypatch.setattr(native, "cuda_device_unavailable_reason", lambda: None)
    monkeypatch.setattr(tb, "launcher_unavailable_reason", lambda: None)
    monkeypatch.setattr(
        tb, "_launcher_call", lambda params, compiled, grid, platform, name: launches.append(name) or b"x"
    )
    if route_available:
        available = lambda *a, has_bias=False, **k: "bias" if has_bias else None  # noqa: E731
        monkeypatch.setattr(cublaslt, "unavailable_reason", available)
    # the route is chosen when the sharded GEMM callable traces, and its traces are cached per shape:
    # start from fresh ones (and leave none behind, see _fresh_traces)
    tri._sharded_block_gemm.cache_clear()
    jax.clear_caches()
    S = jax.ShapeDtypeStruct
    m, k, n = 1024, 640, 768  # cdiv(K, 128) = 5 and cdiv(N, 128) = 6: padded scale columns

    def run(x, w, b, dy):
        if bias:
            y, vjp = jax.vjp(lambda x, w, b: fp8.fp8_dense(x, w, fp8.BlockScaling(), bias=b, implementation="triton"),
                             x, w, b)  # fmt: skip
        else:
            y, vjp = jax.vjp(lambda x, w: fp8.fp8_dense(x, w, fp8.BlockScaling(), implementation="triton"), x, w)
        return (y, *vjp(dy))

    with tb.target_override(("cuda", 90, 32)), tri.kernel_override(dense="cublaslt"):
        traced = jax.jit(run).trace(S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16), S((n,), jnp.float32),
                                    S((m, n), jnp.bfloat16))  # fmt: skip
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    return launches, text


@pytest.fixture(autouse=True)
def _fresh_traces():
    yield
    from te_ops.fp8 import triton as tri

    tri._sharded_block_gemm.cache_clear()
    jax.clear_caches()


def _ffi_signatures(text):
    """The operand and result types of every te_fp8_cublaslt_block_gemm custom call in StableHLO text."""
    sigs = []
    for line in text.splitlines():
        if "@te_fp8_cublaslt_block_gemm" in line:
            sig = re.search(r":\s*\((.*)\)\s*->\s*tensor<([^>]*)>", line)
            assert sig, line
            sigs.append((re.findall(r"tensor<([^>]*)>", sig.group(1)), sig.group(2)))
    return sigs


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_route_falls_back_to_gluon_where_cublaslt_cannot_run(monkeypatch, bias):
    """On this machine (no te_ops._native_cublaslt) kernel_override(dense="cublaslt") gives all three
    GEMMs of fp8_dense to the Gluon kernel, with or without a bias; no cuBLASLt call is lowered."""
    if native.extension_unavailable_reason(cublaslt.MODULE) is None:
        pytest.skip("te_ops._native_cublaslt is built here: the route may apply")
    launches, text = _lower_block_dense(monkeypatch, route_available=False, bias=bias)
    assert [nm for nm in launches if "gemm" in nm] == ["te_fp8_grouped_block_gemm_ws"] * 3, launches
    assert not _ffi_signatures(text)


def test_route_lowers_to_the_cublaslt_ffi_call(monkeypatch):
    """With the route available, fp8_dense's three GEMMs (forward, dgrad, wgrad) are one
    te_fp8_cublaslt_block_gemm call each: a [M, K] and b [N, K] FP8 as stored, a's scales transposed
    ([cdiv(K, 128), M]), b's scales with their columns padded to a multiple of 4; no Triton GEMM."""
    launches, text = _lower_block_dense(monkeypatch, route_available=True, bias=False)
    assert not [nm for nm in launches if "gemm" in nm], launches
    sigs = _ffi_signatures(text)
    e4 = "f8E4M3FN"
    want = [  # (operands, result) of y = x @ w, dx = dy @ w^T, dw = x^T @ dy
        ([f"1024x640x{e4}", "5x1024xf32", f"768x640x{e4}", "6x8xf32"], "1024x768xbf16"),
        ([f"1024x768x{e4}", "6x1024xf32", f"640x768x{e4}", "5x8xf32"], "1024x640xbf16"),
        ([f"640x1024x{e4}", "8x640xf32", f"768x1024x{e4}", "6x8xf32"], "640x768xbf16"),
    ]
    assert sorted((ops[:4], res) for ops, res in sigs) == sorted(want), sigs


def test_route_keeps_the_gemm_with_a_bias_on_gluon(monkeypatch):
    """A bias keeps the forward GEMM on the Gluon kernel (float32 bias, one rounding); dgrad and
    wgrad still take cuBLASLt."""
    launches, text = _lower_block_dense(monkeypatch, route_available=True, bias=True)
    assert [nm for nm in launches if "gemm" in nm] == ["te_fp8_grouped_block_gemm_ws"], launches
    assert len(_ffi_signatures(text)) == 2
