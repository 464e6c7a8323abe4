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
    reason="needs Triton and the jax CUDA plugin's _triton module "
    "(pip install --no-deps jax-cuda13-plugin==0.11.2)",
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
            out, pp, m, _, _ = token_dispatch(x, rm, t * k, probs=p, align_size=4, implementation=impl)
            return (
                jnp.sum(token_combine(out, m, merging_probs=p, implementation=impl).astype(jnp.float32))
                + pp.sum()
            )

        fn = jax.jit(lambda x, p: (loss(x, p), jax.grad(loss, argnums=(0, 1))(x, p)))
        with tb.target_override(TARGET):
            if poison:
                with native.poisoned_outputs():
                    return (
                        fn.trace(jnp.ones((t, h), jnp.bfloat16), p)
                        .lower(lowering_platforms=("cuda",))
                        .as_text()
                    )
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
