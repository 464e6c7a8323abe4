"""The cuBLASLt route of te_ops.fp8's dense block-scaled GEMM (te_ops/fp8/cublaslt.py), on the CPU:
which calls it refuses and why, the scale padding, that the route falls back to the Gluon kernel
where it cannot run (this machine: no native module), and, with the route declared available, the
FFI call it lowers to for CUDA (operands, scale layouts, no Triton GEMM). The GEMM itself runs in
tests/gpu/test_fp8_cublaslt_gpu.py."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops import fp8
from te_ops._core import native
from te_ops.fp8 import cublaslt

E4, E5 = fp8.E4M3, fp8.E5M2
CALL = {"m": 1024, "n": 768, "k": 640, "a_e5m2": 0, "b_e5m2": 0, "out_bytes": 2}  # rule values of a call it takes
OK_VERSIONS = {"header": 130100, "runtime": 130100}  # of a cuBLASLt with the block scale modes
# (change to CALL, what the reason holds; None: no rule refuses the call)
RULE_CASES = [
    ({}, None),
    ({"a_e5m2": 1}, None),  # E5M2 x E4M3 and E4M3 x E5M2 exist in cuBLASLt
    ({"b_e5m2": 1}, None),
    ({"out_bytes": 4, "n": 1032}, None),
    ({"m": 0}, "an empty operand (M=0, N=768, K=640)"),
    ({"n": 0}, "an empty operand"),
    ({"k": 0}, "an empty operand"),
    ({"a_e5m2": 1, "b_e5m2": 1}, "no E5M2 x E5M2"),
    ({"k": 1000}, "K % 16 == 0"),
    ({"m": 1002}, "takes M % 8 == 0 and N % 8 == 0 (TransformerEngine found cuBLASLt failing"),
    ({"m": 1020}, "got M=1020, N=768"),  # a multiple of 4 (the scale layouts' rule), not of 8
    ({"n": 1030}, "got M=1024, N=1030"),
    ({"n": 1028, "out_bytes": 4}, "got M=1024, N=1028"),
    ({"m": 0, "k": 1000}, "an empty operand"),  # the first rule that holds
]
VERSION_CASES = [
    ({"header": 120800}, "headers 12.8.0, which have no FP8 block scale modes"),
    ({"runtime": 120805}, "the loaded cuBLASLt is 12.8.5 (built against 13.1.0)"),
    ({"header": 120800, "k": 1000}, "K % 16 == 0"),  # the size rules come first
    ({"header": 120900, "runtime": 120900}, None),
]


@pytest.fixture(autouse=True)
def _fresh_traces():
    """No trace, route choice or cached verdict outlives a test (several monkeypatch what they see)."""
    from te_ops.fp8 import triton as tri

    def clear():
        tri._sharded_block_gemm.cache_clear()
        for cached in (cublaslt._device_reason, cublaslt.query, cublaslt.versions):
            cached.cache_clear()
        jax.clear_caches()

    clear()
    yield
    clear()


@pytest.mark.parametrize("change, want", RULE_CASES + VERSION_CASES)
def test_rules_reason(change, want):
    """The rule table (te_ops/fp8/cublaslt_rules.def) as Python reads it, with the versions known."""
    why = cublaslt.rules_reason({**CALL, **OK_VERSIONS, **change})
    if want is None:
        assert why is None
    else:
        assert why is not None and want in why, why


@pytest.mark.parametrize("change, want", RULE_CASES)
def test_rules_reason_stops_before_the_version_rules(change, want):
    """Without the versions (no native module) the reading gives the size rules' verdict and stops."""
    why = cublaslt.rules_reason({**CALL, **change})
    assert why == cublaslt.rules_reason({**CALL, **OK_VERSIONS, **change})
    assert cublaslt.rules_reason({**CALL, "header": 120800}) is not None  # would have refused
    assert cublaslt.rules_reason(CALL) is None


def test_rules_file_reads_every_rule():
    """Every TE_FP8_BLOCK_RULE line of the table is a rule Python read (a line the pattern misses
    would raise); the C++ side compiles the same lines."""
    lines = [ln for ln in cublaslt.RULES_FILE.read_text().splitlines() if ln.startswith("TE_FP8_BLOCK_RULE(")]
    assert len(cublaslt.rules()) == len(lines) == 6
    for _, _, msg in cublaslt.rules():  # every {field} is a rule value
        names = {f.split(":")[0] for f in re.findall(r"{([^}]*)}", msg)}
        assert names <= {*cublaslt.VALUES, *cublaslt.VERSIONS}, msg


def _static(m=1024, n=768, k=640, out=jnp.bfloat16, a=E4, b=E4, bias=False):
    return cublaslt.static_unavailable_reason(m, n, k, out, a_dtype=a, b_dtype=b, has_bias=bias)


@pytest.mark.parametrize(
    "kw, want",
    [
        ({"bias": True}, "takes no bias"),
        ({"a": jnp.bfloat16}, "got a bfloat16"),
        ({"b": jnp.int8}, "got b int8"),
        ({"out": jnp.float16}, "bfloat16 or float32, got float16"),
        ({"bias": True, "k": 1000}, "takes no bias"),  # Python's own rules come before the table
    ],
)
def test_static_unavailable_reason_python_rules(kw, want):
    """What only Python knows (the bias, the dtypes) is checked before the rule table."""
    why = _static(**kw)
    assert why is not None and want in why, why


@pytest.mark.parametrize("change, want", RULE_CASES)
def test_static_unavailable_reason_asks_the_table(change, want):
    """The dtypes become the rule values; a call the table refuses gets the table's reason (from the
    native module where it is loaded, else from Python's reading), one it takes gets the module's
    verdict (here: None) or the module's absence."""
    v = {**CALL, **change}
    out = {2: jnp.bfloat16, 4: jnp.float32}[v["out_bytes"]]
    a, b = (E5 if v["a_e5m2"] else E4), (E5 if v["b_e5m2"] else E4)
    why = _static(v["m"], v["n"], v["k"], out, a, b)
    missing = native.op_unavailable_reason(cublaslt.MODULE, "dense")
    if want is not None:
        assert why is not None and want in why, why
    elif missing is not None:
        assert why == missing
    else:
        assert why is None or "cuBLASLt" in why, why  # a module built against old cuBLASLt refuses all


@functools.cache
def _built_library() -> ctypes.CDLL | None:
    """te_ops._native_cublaslt as ctypes opens it: the one built by scripts/native_build_check.sh when
    TE_NATIVE_CHECK_BUILD names its build folder, else the installed one; None when neither exists."""
    build = os.environ.get("TE_NATIVE_CHECK_BUILD")
    if build:
        found = sorted(pathlib.Path(build).glob("_native_cublaslt*.so"))
        assert found, f"TE_NATIVE_CHECK_BUILD={build} holds no _native_cublaslt module"
        return ctypes.CDLL(str(found[0]))
    if native.extension_unavailable_reason(cublaslt.MODULE) is not None:
        return None
    return native.ctypes_library(cublaslt.MODULE)


@pytest.mark.parametrize("change, want", RULE_CASES)
def test_native_rules_match_python_reading(monkeypatch, change, want):
    """The rule table as compiled into the native module (te_fp8_cublaslt_block_gemm_static_reason, no
    GPU) gives exactly Python's reading of it, message included, with the module's cuBLASLt versions.
    Needs the module: scripts/native_build_check.sh runs this on the module it builds."""
    lib = _built_library()
    if lib is None:
        pytest.skip(f"needs te_ops.{cublaslt.MODULE} (or TE_NATIVE_CHECK_BUILD): not built here")
    monkeypatch.setattr(native, "ctypes_library", lambda name: lib)
    header, runtime = cublaslt.versions()
    values = {**CALL, **change}
    got = cublaslt.native_static_reason(tuple(values[name] for name in cublaslt.VALUES))
    assert got == cublaslt.rules_reason({**values, "header": header, "runtime": runtime})
    if header >= 120900 and runtime >= 120900:
        assert got is None if want is None else want in got, got
    rc, why = native.ctypes_query(cublaslt.MODULE, "te_fp8_cublaslt_block_gemm_static_reason", (1, 2, 3, 0, 0, 3))
    assert rc == 2 and "output 2 (bfloat16) or 4 (float32) bytes" in why, (rc, why)


@pytest.mark.skipif(
    native.extension_unavailable_reason(cublaslt.MODULE) is None, reason="te_ops._native_cublaslt is built here"
)
def test_unavailable_without_the_native_module():
    """Without the dense native module every query answers with the module's import error (no GPU
    needed to ask), so the route is never taken."""
    why = cublaslt.unavailable_reason(1024, 768, 640, jnp.bfloat16, a_dtype=E4, b_dtype=E4)
    assert why is not None and "te_ops._native_cublaslt" in why, why
    assert isinstance(cublaslt.versions(), str)
    assert cublaslt.query((1024, 768, 640, 0, 0, 2)).startswith("cannot reach te_fp8_cublaslt_block_gemm_query")
    assert cublaslt.native_static_reason(tuple(CALL.values())).startswith("cannot reach")


@pytest.mark.parametrize("kb", [1, 4, 5, 8, 11])
def test_block_scales_padded_to_a_multiple_of_four_columns(kb):
    sb = jax.random.uniform(jax.random.key(kb), (3, kb), jnp.float32) + 0.5
    got = np.asarray(cublaslt.padded_block_scales(sb))
    assert got.shape == (3, -(-kb // 4) * 4) and got.dtype == np.float32
    np.testing.assert_array_equal(got[:, :kb], np.asarray(sb))
    assert not got[:, kb:].any()


def _lower_block_dense(launches, monkeypatch, route_available: bool, bias: bool):
    """fp8_dense (block recipe) forward + backward traced under kernel_override(dense="cublaslt") and
    lowered for sm_90 (``launches`` from the stub_triton_launcher fixture): (Triton kernel names
    launched, lowered text)."""
    from te_ops._core import triton_bridge as tb
    from te_ops.fp8 import triton as tri

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
    return [launch.name for launch in launches], text


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
def test_route_falls_back_to_gluon_where_cublaslt_cannot_run(monkeypatch, stub_triton_launcher, bias):
    """On this machine (no te_ops._native_cublaslt) kernel_override(dense="cublaslt") gives all three
    GEMMs of fp8_dense to the Gluon kernel, with or without a bias; no cuBLASLt call is lowered."""
    if native.extension_unavailable_reason(cublaslt.MODULE) is None:
        pytest.skip("te_ops._native_cublaslt is built here: the route may apply")
    launches, text = _lower_block_dense(stub_triton_launcher, monkeypatch, route_available=False, bias=bias)
    assert [nm for nm in launches if "gemm" in nm] == ["te_fp8_grouped_block_gemm_ws"] * 3, launches
    assert not _ffi_signatures(text)


def test_route_lowers_to_the_cublaslt_ffi_call(monkeypatch, stub_triton_launcher):
    """With the route available, fp8_dense's three GEMMs (forward, dgrad, wgrad) are one
    te_fp8_cublaslt_block_gemm call each: a [M, K] and b [N, K] FP8 as stored, a's scales transposed
    ([cdiv(K, 128), M]), b's scales with their columns padded to a multiple of 4; no Triton GEMM."""
    launches, text = _lower_block_dense(stub_triton_launcher, monkeypatch, route_available=True, bias=False)
    assert not [nm for nm in launches if "gemm" in nm], launches
    sigs = _ffi_signatures(text)
    e4 = "f8E4M3FN"
    want = [  # (operands, result) of y = x @ w, dx = dy @ w^T, dw = x^T @ dy
        ([f"1024x640x{e4}", "5x1024xf32", f"768x640x{e4}", "6x8xf32"], "1024x768xbf16"),
        ([f"1024x768x{e4}", "6x1024xf32", f"640x768x{e4}", "5x8xf32"], "1024x640xbf16"),
        ([f"640x1024x{e4}", "8x640xf32", f"768x1024x{e4}", "6x8xf32"], "640x768xbf16"),
    ]
    assert sorted((ops[:4], res) for ops, res in sigs) == sorted(want), sigs


def test_route_keeps_the_gemm_with_a_bias_on_gluon(monkeypatch, stub_triton_launcher):
    """A bias keeps the forward GEMM on the Gluon kernel (float32 bias, one rounding); dgrad and
    wgrad still take cuBLASLt."""
    launches, text = _lower_block_dense(stub_triton_launcher, monkeypatch, route_available=True, bias=True)
    assert [nm for nm in launches if "gemm" in nm] == ["te_fp8_grouped_block_gemm_ws"], launches
    assert len(_ffi_signatures(text)) == 2
