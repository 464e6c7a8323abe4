"""CPU tests of the Triton bridge: import without Triton, compile cache keyed and locked per kernel
(8 threads / 1 kernel -> 1 compile; 8 kernels compile concurrently), fork safety, metadata, and
lowering for CUDA without a GPU (compiling for an explicit sm_90 target)."""

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core import triton_bridge as tb

TARGET = ("cuda", 90, 32)
HAS_TRITON = tb.triton_unavailable_reason() is None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=f"needs Triton: {tb.triton_unavailable_reason()}")


def _plugin_triton_module():
    """jaxlib's CUDA plugin `_triton` module; it imports without a GPU. CI can unpack the wheel
    (``pip download --no-deps jax-cuda13-plugin==0.11.2`` + unzip) into a folder named by
    $TE_JAX_CUDA_PLUGIN_DIR instead of installing it next to a CPU-only jaxlib."""
    extra = os.environ.get("TE_JAX_CUDA_PLUGIN_DIR")
    if extra and extra not in sys.path:
        sys.path.append(extra)
    for name in ("jax_cuda13_plugin._triton", "jax_cuda12_plugin._triton"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


PLUGIN = _plugin_triton_module()
needs_plugin = pytest.mark.skipif(
    PLUGIN is None or not HAS_TRITON,
    reason="needs Triton and the jax CUDA plugin's _triton module (pip install --no-deps jax-cuda13-plugin==0.11.2)",
)


def test_te_ops_imports_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None          # make `import triton` fail
        import te_ops, te_ops.permutation
        from te_ops._core import triton_bridge
        from te_ops.permutation import api
        why = api.DISPATCH.get("triton").available()
        assert why and "Triton is not importable" in why, why
        assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None and m == "triton"]
        print("ok")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_kernel(x_ptr, n, y_ptr, BLOCK: tl.constexpr, FACTOR: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * FACTOR, mask=m)

    return scale_kernel


def _spec(kernel, factor=2, num_warps=4):
    sig = (
        ("x_ptr", "*fp32"),
        ("n", "i32"),
        ("y_ptr", "*fp32"),
        ("BLOCK", "constexpr"),
        ("FACTOR", "constexpr"),
    )
    return tb.KernelSpec(kernel, sig, (("BLOCK", 128), ("FACTOR", factor)), num_warps, 2)


@needs_triton
def test_compile_once_for_eight_threads():
    kernel = _kernels()
    tb.clear_cache()
    tb.reset_counters()
    barrier = threading.Barrier(8)
    results = []

    def work():
        barrier.wait()
        results.append(tb.compile_kernel(_spec(kernel), TARGET))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = tb.counters()
    assert c["compiles"] == 1 and c["cache_hits"] == 7, c
    assert all(r is results[0] for r in results)


@needs_triton
def test_different_kernels_compile_concurrently():
    kernel = _kernels()
    tb.clear_cache()
    tb.reset_counters()
    barrier = threading.Barrier(8)

    def work(i):
        barrier.wait()
        tb.compile_kernel(_spec(kernel, factor=i + 3), TARGET)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = tb.counters()
    assert c["compiles"] == 8, c
    # per-key locks: several compiles were in flight at once (a global lock would give 1)
    assert c["max_concurrent_compiles"] > 1, c


@needs_triton
def test_cache_key_and_metadata():
    kernel = _kernels()
    k1 = tb.cache_key(_spec(kernel), TARGET)
    assert k1 == tb.cache_key(_spec(kernel), TARGET)
    assert k1 != tb.cache_key(_spec(kernel, num_warps=8), TARGET)
    assert k1 != tb.cache_key(_spec(kernel, factor=5), TARGET)
    assert k1 != tb.cache_key(_spec(kernel), ("cuda", 80, 32))
    compiled = tb.compile_kernel(_spec(kernel, num_warps=2), TARGET)
    assert compiled.num_warps == 2 == compiled.metadata.num_warps
    assert compiled.shared == compiled.metadata.shared
    assert ".target sm_90a" in compiled.asm["ptx"]
    assert compiled.global_scratch_size == 0 and compiled.num_ctas == 1


@needs_triton
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::DeprecationWarning")
def test_fork_gets_fresh_locks():
    tb._registry_lock.acquire()  # as if another thread were compiling when we fork
    try:
        pid = os.fork()
        if pid == 0:  # child: the lock must be usable
            ok = tb._registry_lock.acquire(timeout=2) and not tb._key_locks
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        tb._registry_lock.release()
    assert os.WEXITSTATUS(status) == 0


@needs_plugin
def test_lowering_for_cuda_without_gpu(monkeypatch):
    """Lowers dispatch + combine (fwd and bwd) for CUDA on this CPU machine: kernels compile for
    sm_90, jaxlib's TritonKernel/TritonKernelCall accept our parameters, the HLO has the FFI calls;
    a second token count reuses every compiled kernel."""
    from te_ops._core import native
    from te_ops.permutation import token_combine, token_dispatch

    monkeypatch.setattr(tb, "_launcher_module", lambda: PLUGIN)
    tb.launcher_unavailable_reason.cache_clear()
    monkeypatch.setattr(native, "cuda_device_unavailable_reason", lambda: None)

    def lower(t, impl, poison=False):
        e, h, k = 8, 64, 2
        rm = (
            jnp.zeros((t, e), bool)
            .at[jnp.arange(t)[:, None], jnp.stack([jnp.arange(t) % e, (jnp.arange(t) + 1) % e], 1)]
            .set(True)
        )
        p = rm.astype(jnp.float32) / 2

        def loss(x, p):
            out, pp, m, *_ = token_dispatch(x, rm, t * k, probs=p, align_size=4, implementation=impl)
            return jnp.sum(token_combine(out, m, merging_probs=p, implementation=impl).astype(jnp.float32)) + pp.sum()

        fn = jax.jit(lambda x, p: (loss(x, p), jax.grad(loss, argnums=(0, 1))(x, p)))
        with tb.target_override(TARGET):
            if poison:
                with native.poisoned_outputs():
                    return fn.trace(jnp.ones((t, h), jnp.bfloat16), p).lower(lowering_platforms=("cuda",)).as_text()
            return fn.trace(jnp.ones((t, h), jnp.bfloat16), p).lower(lowering_platforms=("cuda",)).as_text()

    for impl in ("triton", "gluon"):
        txt = lower(32, impl)
        assert txt.count("@triton_kernel_call_ffi") >= 8
        before = tb.counters()["compiles"]
        lower(48, impl)
        assert tb.counters()["compiles"] == before, "a new token count must not recompile"
    txt = lower(40, "triton", poison=True)
    assert "output_operand_alias" in txt and "0x7FC0" in txt  # NaN-filled buffers aliased to outputs


def test_zero_grid_returns_zeros():
    if not HAS_TRITON:
        pytest.skip(f"needs Triton: {tb.triton_unavailable_reason()}")
    kernel = _kernels()
    out = tb.triton_call(
        kernel,
        jnp.ones((0,)),
        np.int32(0),
        out_shape=[jax.ShapeDtypeStruct((0,), jnp.float32)],
        grid=(0,),
        constexprs=dict(BLOCK=128, FACTOR=2),
    )
    assert out[0].shape == (0,)


# ----------------------------------------------------------------------------------------------
# Command buffers: what we emit, what jaxlib registers, and how a thunk dump is read
# ----------------------------------------------------------------------------------------------


def _ffi_metadata(capsule):
    """(FFI API version, traits) of an XLA FFI handler, asked the way XLA's registry asks at
    registration (xla/ffi/ffi_api.cc RegisterHandler -> GetMetadata(bundle.execute)): a call frame
    whose extension_start is an XLA_FFI_Metadata_Extension. Layouts from jaxlib 0.11.2's
    include/xla/ffi/api/c_api.h; the struct sizes are the ones its handlers check."""
    import ctypes

    class Ext(ctypes.Structure):  # XLA_FFI_InternalExtension
        _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.c_void_p)]

    class ApiVersion(ctypes.Structure):
        _fields_ = [
            ("struct_size", ctypes.c_size_t),
            ("extension_start", ctypes.c_void_p),
            ("major", ctypes.c_int),
            ("minor", ctypes.c_int),
        ]

    class Metadata(ctypes.Structure):
        _fields_ = [
            ("struct_size", ctypes.c_size_t),
            ("api_version", ApiVersion),
            ("traits", ctypes.c_uint32),
            ("state_type_id", ctypes.c_int64),
        ]

    class MetadataExt(ctypes.Structure):
        _fields_ = [("base", Ext), ("metadata", ctypes.POINTER(Metadata))]

    span = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
    ]
    Args = type("Args", (ctypes.Structure,), {"_fields_": span})  # XLA_FFI_Args / XLA_FFI_Rets
    Attrs = type("Attrs", (ctypes.Structure,), {"_fields_": [*span, ("names", ctypes.c_void_p)]})

    class CallFrame(ctypes.Structure):
        _fields_ = [
            ("struct_size", ctypes.c_size_t),
            ("extension_start", ctypes.c_void_p),
            ("api", ctypes.c_void_p),
            ("ctx", ctypes.c_void_p),
            ("stage", ctypes.c_int),
            ("args", Args),
            ("rets", Args),
            ("attrs", Attrs),
            ("future", ctypes.c_void_p),
        ]

    # XLA_FFI_STRUCT_SIZE(type, last_field): CallFrame ends at attrs, Metadata at traits.
    assert CallFrame.future.offset == 168 and Metadata.traits.offset + 4 == 36
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(CallFrame))(get(capsule, name(capsule)))
    md = Metadata(struct_size=Metadata.traits.offset + 4)
    ext = MetadataExt(base=Ext(struct_size=ctypes.sizeof(MetadataExt), type=1), metadata=ctypes.pointer(md))
    frame = CallFrame(struct_size=CallFrame.future.offset, extension_start=ctypes.addressof(ext))
    assert not handler(ctypes.byref(frame)), "the handler returned an error for the metadata query"
    return (md.api_version.major, md.api_version.minor), md.traits


@pytest.mark.skipif(PLUGIN is None, reason="needs the jax CUDA plugin's _triton module")
def test_jaxlib_triton_handler_is_command_buffer_compatible():
    """XLA's thunk pass puts a custom call into a command buffer only if its FFI handler's execute
    metadata has kCmdBufferCompatible (bit 0); jaxlib 0.11.2's triton_kernel_call_ffi has it."""
    from jaxlib.cpu import _lapack

    regs = PLUGIN.registrations()
    assert set(regs[tb.FFI_TARGET]) >= {"instantiate", "initialize", "execute"}, regs
    version, traits = _ffi_metadata(regs[tb.FFI_TARGET]["execute"])
    assert version[0] == 0 and version[1] >= 1 and traits & 1, (version, traits)
    # negative control: a jaxlib handler without the trait reads as 0 (the probe discriminates)
    lapack = next(iter(_lapack.registrations().values()))
    assert _ffi_metadata(lapack if not isinstance(lapack, dict) else lapack["execute"])[1] == 0


@needs_plugin
def test_launch_is_a_typed_ffi_custom_call(monkeypatch):
    """The lowering emits the FFI target with API_VERSION_TYPED_FFI and dictionary attributes, not
    jaxlib's legacy "triton_kernel_call" (API version 2, opaque string), which XLA never captures."""
    monkeypatch.setattr(tb, "_launcher_module", lambda: PLUGIN)
    tb.launcher_unavailable_reason.cache_clear()
    kernel = _kernels()
    fn = jax.jit(
        lambda x: tb.triton_call(
            kernel,
            x,
            np.int32(x.size),
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
            grid=(4,),
            constexprs=dict(BLOCK=128, FACTOR=2),
        )[0]
    )
    with tb.target_override(TARGET):
        hlo = fn.trace(jnp.ones((512,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    calls = [ln for ln in hlo.splitlines() if "custom-call(" in ln]
    assert len(calls) == 1 and len(tb.triton_launch_names(hlo)) == 1, calls
    assert f'custom_call_target="{tb.FFI_TARGET}"' in calls[0]
    assert "api_version=API_VERSION_TYPED_FFI" in calls[0]
    assert "backend_config={opaque = " in calls[0]
    assert 'custom_call_target="triton_kernel_call"' not in hlo


_HLO = """\
HloModule jit_step, entry_computation_layout={(f32[64]{0})->f32[64]{0}}

ENTRY %main.9 (x.1: f32[64]) -> f32[64] {
  %x.1 = f32[64]{0} parameter(0)
  %te_triton_call.3 = f32[64]{0} custom-call(%x.1), custom_call_target="triton_kernel_call_ffi"
  %loop_fusion = f32[64]{0} fusion(%te_triton_call.3), kind=kLoop, calls=%fused
  %te_triton_call.12 = f32[64]{0} custom-call(%loop_fusion), custom_call_target="triton_kernel_call_ffi"
  %sort.1 = f32[64]{0} sort(%te_triton_call.12), dimensions={0}, to_apply=%compare
  ROOT %te_triton_call.1 = f32[64]{0} custom-call(%sort.1), custom_call_target="triton_kernel_call_ffi"
}
"""

# The layout of jax 0.11.2's ThunkSequence::ToString ("%s%03d: %-*s [%-*s | %-*s] %s"; a
# kCommandBuffer thunk prints its thunks one level deeper).
_THUNKS_NAMED = """\
000: kCommandBuffer [0 | command_buffer_000]
    001: kCustomCall [0 | te_triton_call.3  ]
    002: kKernel     [0 | loop_fusion       ]
    003: kCustomCall [0 | te_triton_call.12 ]
004: kCustomCall    [0 | sort.1            ]
005: kCustomCall    [0 | te_triton_call.1  ]
"""

# Older layout (kind, tab, no id or names).
_THUNKS_UNNAMED = "kCommandBuffer\t\n  kCustomCall\t\n  kKernel\t\n  kCustomCall\t\nkCustomCall\t\n"


def test_command_buffer_report_reads_thunk_dumps():
    rep = tb.command_buffer_report(_HLO, _THUNKS_NAMED)
    assert rep["mode"] == "thunk_names" and rep["command_buffers"] == 1, rep
    assert rep["launches"] == ["te_triton_call.3", "te_triton_call.12", "te_triton_call.1"]
    assert rep["captured"] == ["te_triton_call.3", "te_triton_call.12"]
    assert rep["not_captured"] == ["te_triton_call.1"]  # .1 is not mistaken for .12 or .3
    assert (rep["custom_calls_inside"], rep["custom_calls_outside"]) == (2, 2)

    rep = tb.command_buffer_report(_HLO, _THUNKS_UNNAMED)
    assert rep["mode"] == "thunk_kinds" and rep["custom_calls_inside"] == 2, rep
    assert rep["custom_calls_outside"] == 1

    rep = tb.command_buffer_report(_HLO, None)  # XLA wrote no dump: nothing was converted
    assert rep["mode"] == "none" and rep["not_captured"] == rep["launches"] and len(rep["launches"]) == 3


def test_command_buffer_report_reads_old_hlo_command_buffers():
    """XLA versions with the HLO pass (CommandBufferScheduling) outline command_buffer computations."""
    hlo = """\
HloModule jit_step

%command_buffer (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %te_triton_call.3 = f32[64]{0} custom-call(%p), custom_call_target="triton_kernel_call_ffi"
}

ENTRY %main.9 (x.1: f32[64]) -> f32[64] {
  %x.1 = f32[64]{0} parameter(0)
  %call = f32[64]{0} call(%x.1), to_apply=%command_buffer
  ROOT %te_triton_call.1 = f32[64]{0} custom-call(%call), custom_call_target="triton_kernel_call_ffi"
}
"""
    rep = tb.command_buffer_report(hlo)
    assert rep["mode"] == "hlo" and rep["captured"] == ["te_triton_call.3"], rep
    assert rep["not_captured"] == ["te_triton_call.1"]


def test_find_thunk_dump_picks_the_module(tmp_path):
    (tmp_path / "module_0003.jit_a.thunk_sequence_after_thunk_passes.txt").write_text("A")
    (tmp_path / "module_0004.jit_ab.thunk_sequence_after_thunk_passes.txt").write_text("AB")
    (tmp_path / "module_0003.jit_a.thunk_sequence.txt").write_text("before")
    assert tb.find_thunk_dump(tmp_path, "jit_a") == "A"
    assert tb.find_thunk_dump(tmp_path, "jit_b") is None


def test_redirect_global_scratch_points_the_scratch_load_at_te_scratch():
    """The hidden global-scratch parameter (second from last) is read from te_scratch (third from
    last) instead: jaxlib then allocates nothing per launch, which keeps the launch graph-capturable."""
    ptx = (
        ".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
        "\t.param .u64 .ptr .global .align 1 k_param_2,\n\t.param .u64 .ptr .global .align 1 k_param_3,\n"
        "\t.param .u64 .ptr .global .align 1 k_param_4\n)\n{\n\tld.param.b64 %rd1, [k_param_0];\n"
        "\tld.param.b64 %rd9, [k_param_3];\n\tmad.wide.u32 %rd10, %r1, 384, %rd9;\n}\n"
    )
    out = tb.redirect_global_scratch(ptx, "k")
    assert "ld.param.b64 %rd9, [k_param_2];" in out and "[k_param_3]" not in out
    assert out.count("k_param_3") == 1  # only its declaration is left
    assert "ld.param.b64 %rd1, [k_param_0];" in out  # other parameters untouched
    with pytest.raises(ValueError, match="unexpected way"):
        tb.redirect_global_scratch(ptx.replace("[k_param_3]", "k_param_3"), "k")


def test_recorded_kernel_names_sees_each_lowered_kernel_and_still_lowers(monkeypatch, stub_triton_launcher):
    """te_ops._core.testing.recorded_kernel_names (the GPU tests' check of which kernel a route took)
    records every kernel the bridge lowers, in order, and passes the launch on (here to the stub)."""
    from te_ops import fp8
    from te_ops._core import testing as T
    from te_ops.fp8 import triton as tri

    names = T.recorded_kernel_names(monkeypatch)
    fn = jax.jit(lambda x: tri.block_quantize(x, (1, 128), fp8.E4M3, power_of_2=True))
    with tb.target_override(("cuda", 90, 32)):
        fn.trace(jnp.ones((2, 64, 256), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    assert len(stub_triton_launcher) == 1 and names == [stub_triton_launcher[0].name], (names, stub_triton_launcher)
