"""Our JAX-Triton bridge: compiles ``@triton.jit`` and ``@gluon.jit`` kernels and launches them from
jitted JAX code through jaxlib's ``gpu_triton`` and the ``triton_kernel_call_ffi`` XLA-FFI target.

Usage (inside any jitted function; positional arguments in the kernel's parameter order, then the
kernel's output pointers, then its constexprs by keyword)::

    out = triton_call(add_kernel, x, y, np.int32(n), out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
                      grid=(pl.cdiv(n, 1024),), constexprs=dict(BLOCK=1024))[0]

Design decisions (and why)
--------------------------
* **Launcher: jaxlib's gpu_triton, not a launcher of our own.** Read from the jax-cuda13-plugin
  0.11.2 wheel (its ``_triton`` module imports without a GPU, so the exact signatures were checked
  here): ``TritonKernel(kernel_name, num_warps, num_ctas, shared_mem_bytes, ptx, ttir,
  compute_capability, global_scratch_size=None, global_scratch_align=None)``,
  ``TritonKernelCall(kernel, grid_0, grid_1, grid_2, params)``, ``create_array_parameter(bytes_to_zero,
  ptr_divisibility)``, ``create_scalar_parameter(value, "i32"|"u32"|"i64"|"u64"|"fp32"|"fp64"|"i1")``,
  and ``registrations() == {"triton_kernel_call_ffi": {instantiate, initialize, execute}}``. The FFI
  handler compiles the PTX in ``instantiate`` (at XLA compile time, cached by (name, smem, ptx, cc)),
  builds the ``KernelCall`` in ``initialize`` (cached per opaque string under a mutex) and
  launches in ``execute``, which is declared ``kCmdBufferCompatible``: XLA can capture it in CUDA
  graphs (see "Command buffers" below). It appends the two hidden pointer parameters Triton >= 3.3
  kernels take (global scratch, profile scratch); ``global_scratch_size`` is forwarded from the
  metadata.
  jaxlib's known loader race is in the ROCm path (an HSACO file read and then deleted); the CUDA
  path takes the PTX by value. So gpu_triton is robust enough for CUDA and we do not add a native
  launcher; one could replace it without touching the ops (only :func:`_launcher_call` would change).
  :func:`_make_kernel` calls the constructor with jaxlib 0.11.2's keyword signature and, if a
  later release changes it, raises with the signature it found.
  Module loading: jaxlib loads the CUDA module lazily on the first launch in a context
  (``ModuleImage::GetFunctionForContext``); its ``initialize`` stage only builds the cached
  ``KernelCall``. If a command-buffer run ever fails with a capture error from that load, the
  fallback is a native launcher of our own (load the cubin in our ``initialize`` under our
  lock, warm once per key); only :func:`_launcher_call` and :data:`FFI_TARGET` would change.
* **Command buffers (CUDA graphs).** See docs/triton_bridge.md for the evidence. Each launch is
  a *typed FFI* custom call (``custom_call_target="triton_kernel_call_ffi"``,
  ``api_version=API_VERSION_TYPED_FFI``, attributes ``{opaque = ...}``), never the legacy
  ``triton_kernel_call`` target (API version 2, opaque string). XLA in jax 0.11.2 forms command
  buffers on the *thunk sequence* after compilation (``CommandBufferConversionPass``); the old
  HLO pass (``CommandBufferScheduling``, the one that created ``command_buffer`` computations) is
  gone, and so is its ``legacy_command_buffer_custom_call_targets`` option (the only way legacy
  custom calls got in). The thunk pass converts a custom call only if ``CUSTOM_CALL`` is in
  ``--xla_gpu_enable_command_buffer`` and the target has an FFI handler whose ``execute``
  metadata carries ``kCmdBufferCompatible``; legacy calls are never converted. jaxlib 0.11.2's
  ``triton_kernel_call_ffi`` execute handler reports FFI API 0.4 with that trait (read with XLA's
  metadata query; tests/te_ops/test_triton_bridge.py). Consequence: ``compiled.as_text()`` never
  shows a command buffer, for our Triton launches and native handlers alike; check the thunk
  dump instead (:func:`command_buffer_report`).
* **Compile at lowering time, not trace time.** ``triton_call`` binds a primitive whose lowering
  rule is registered for "cuda" and "rocm" only, so CPU lowering of a ``platform_dependent`` branch
  never compiles a kernel, and the target is that of the device being lowered for.
* **Compile cache** keyed by (kernel source hash incl. dependencies (``JITFunction.cache_key``),
  Triton version, triton/gluon, signature, constexprs, num_warps, num_stages, target), with one lock
  per key: N threads lowering one kernel compile it once, different kernels compile concurrently.
  ``os.register_at_fork`` gives a forked child fresh locks (a lock held by another thread at fork
  time would otherwise stay locked forever in the child).
* **Sizes are runtime scalars**: scalar arguments go into the launch (the ``TritonKernelCall``), not
  the compiled kernel, and integer arguments are not value-specialised, so a new token count reuses
  the compiled kernel. The one opt-in exception: ``divisible_by_16=("H",)`` promises the compiler
  that a (checked) size is a multiple of 16, so row accesses ``ptr + row * H`` become 16-byte
  vectors (measured in the PTX: without it Triton 3.6 emits 2-byte accesses for bf16 rows).
* **Pointer alignment**: all pointer arguments are compiled with ``tt.divisibility=16`` and launched
  with ``ptr_divisibility=16`` (XLA buffers are at least 16-byte aligned; jaxlib checks at launch and
  returns an error rather than running misaligned).
* **No module-scope import of triton**: ``import te_ops`` works without Triton;
  :func:`unavailable_reason` says why Triton kernels cannot run.
* **Poisoning**: under :class:`te_ops._core.native.poisoned_outputs`, each output a kernel writes
  (not aliased to an input) gets a NaN-filled input buffer aliased to it, so an element the kernel
  does not write stays NaN.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import os
import pathlib
import re
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax._src.interpreters import mlir
from jax.extend import core as jex_core

from te_ops._core import triton_backend
from te_ops._core.validation import poison_like

REQUIRED_TRITON = (3, 6)
FFI_TARGET = "triton_kernel_call_ffi"
# Typed XLA FFI (HLO api_version=API_VERSION_TYPED_FFI, attributes as a dictionary). The legacy
# API versions (1-3, an opaque string, jaxlib's "triton_kernel_call") are never put in command
# buffers by XLA >= the jax 0.11 line: its thunk pass looks the target up in the FFI registry.
FFI_API_VERSION = 4

# ----------------------------------------------------------------------------------------------
# Availability
# ----------------------------------------------------------------------------------------------


@functools.cache
def triton_unavailable_reason() -> str | None:
    """None when Triton (>= 3.6, with its NVIDIA or AMD backend) imports, else why not."""
    try:
        import triton
        from triton.backends import backends
    except Exception as e:  # ImportError, or a Triton built for another platform failing to load
        return f"Triton is not importable ({type(e).__name__}: {e}); install it with `pip install triton==3.6.0`"
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version < REQUIRED_TRITON:
        return f"Triton {triton.__version__} is too old; te_ops needs triton >= 3.6"
    if "nvidia" not in backends and "amd" not in backends:
        return f"this Triton has neither the NVIDIA nor the AMD backend (has {sorted(backends)})"
    return None


@functools.cache
def gluon_unavailable_reason() -> str | None:
    why = triton_unavailable_reason()
    if why:
        return why
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except Exception as e:
        return f"this Triton has no Gluon front end ({type(e).__name__}: {e})"
    return None


def hardware_conversions() -> bool:
    """Whether kernels may use the GPU's float32 -> bf16 / f16 / FP8 conversions: not under Triton's
    CPU interpreter (TRITON_INTERPRET=1), whose conversions truncate or round wrongly at binade edges;
    the kernels then round with integer arithmetic (a ``HW`` constexpr)."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _launcher_module() -> Any:
    """jaxlib's gpu_triton module (tests may substitute another with the same API)."""
    from jax._src.lib import gpu_triton

    return gpu_triton


@functools.cache
def launcher_unavailable_reason() -> str | None:
    """None when jaxlib can launch Triton kernels (CUDA plugin with triton_kernel_call_ffi)."""
    try:
        mod = _launcher_module()
    except Exception as e:
        return f"jaxlib's gpu_triton is not importable ({e})"
    missing = [
        n
        for n in ("TritonKernel", "TritonKernelCall", "create_array_parameter", "create_scalar_parameter")
        if not hasattr(mod, n)
    ]
    if missing:
        return (
            f"jaxlib's gpu_triton lacks {missing}: the jax CUDA plugin (pip install 'jax[cuda13]') is not "
            "installed or does not match jaxlib"
        )
    return None


def unavailable_reason(*, gluon: bool = False) -> str | None:
    """Why Triton (or Gluon) kernels cannot run in this process, or None."""
    return (gluon_unavailable_reason() if gluon else triton_unavailable_reason()) or launcher_unavailable_reason()


# ----------------------------------------------------------------------------------------------
# Compile cache
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What is compiled: a kernel with its signature, constexprs and launch options."""

    fn: Any  # triton JITFunction or gluon GluonJITFunction
    signature: tuple[tuple[str, str], ...]  # (arg name, triton type or "constexpr") in kernel order
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    divisible_by_16: tuple[str, ...] = ()  # integer parameters promised to be multiples of 16
    maxnreg: int | None = None  # register limit per thread (warp-specialized kernels redistribute it)
    # not None: the kernel's global scratch (device-side TMA descriptors) is the XLA buffer passed as
    # its last runtime parameter ``te_scratch``, this many bytes per program (see triton_call)
    scratch_bytes_per_program: int | None = None

    @property
    def gluon(self) -> bool:
        return bool(getattr(self.fn, "is_gluon", lambda: False)())


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    name: str
    asm: dict[str, Any]
    shared: int
    num_warps: int
    num_ctas: int
    global_scratch_size: int
    global_scratch_align: int
    target: tuple
    metadata: Any = dataclasses.field(compare=False, repr=False)


def _source_hash(fn: Any) -> str:
    key = getattr(fn, "cache_key", None)  # includes the sources of called @jit functions
    if key is None:
        key = hashlib.sha256(inspect.getsource(getattr(fn, "fn", fn)).encode()).hexdigest()
    return str(key)


def cache_key(spec: KernelSpec, target: tuple) -> tuple:
    import triton

    return (
        _source_hash(spec.fn),
        triton.__version__,
        "gluon" if spec.gluon else "triton",
        spec.signature,
        tuple((k, repr(v)) for k, v in spec.constexprs),
        spec.num_warps,
        spec.num_stages,
        spec.divisible_by_16,
        spec.maxnreg,
        spec.scratch_bytes_per_program,
        tuple(target),
    )


_compiled: dict[tuple, CompiledKernel] = {}
_key_locks: dict[tuple, threading.Lock] = {}
_registry_lock = threading.Lock()
_counter_lock = threading.Lock()
_counters: dict[str, float] = {}


def _zero_counters() -> None:
    _counters.update(compiles=0, cache_hits=0, lowerings=0, in_flight=0, max_concurrent_compiles=0, compile_seconds=0.0)


_zero_counters()


def _after_fork_in_child() -> None:
    global _registry_lock, _counter_lock
    _registry_lock = threading.Lock()
    _counter_lock = threading.Lock()
    _key_locks.clear()
    _counters["in_flight"] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def counters() -> dict[str, float]:
    """compiles (triton.compile calls), cache_hits, lowerings, max_concurrent_compiles, compile_seconds."""
    with _counter_lock:
        return dict(_counters)


def reset_counters() -> None:
    with _counter_lock:
        in_flight = _counters["in_flight"]
        _zero_counters()
        _counters["in_flight"] = in_flight


def clear_cache() -> None:
    """Forgets compiled kernels (tests)."""
    with _registry_lock:
        _compiled.clear()
        _key_locks.clear()


def _bump(name: str, by: float = 1) -> None:
    with _counter_lock:
        _counters[name] += by


def compile_kernel(spec: KernelSpec, target: tuple) -> CompiledKernel:
    """Compiles ``spec`` for ``target`` = (backend, arch, warp_size), once per cache key."""
    key = cache_key(spec, target)
    hit = _compiled.get(key)
    if hit is not None:
        _bump("cache_hits")
        return hit
    with _registry_lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        hit = _compiled.get(key)
        if hit is not None:
            _bump("cache_hits")
            return hit
        with _counter_lock:
            _counters["in_flight"] += 1
            _counters["max_concurrent_compiles"] = max(_counters["max_concurrent_compiles"], _counters["in_flight"])
        t0 = time.perf_counter()
        try:
            result = _compile_uncached(spec, target)
        finally:
            with _counter_lock:
                _counters["in_flight"] -= 1
        with _counter_lock:
            _counters["compiles"] += 1
            _counters["compile_seconds"] += time.perf_counter() - t0
        _compiled[key] = result
        return result


def _compile_uncached(spec: KernelSpec, target: tuple) -> CompiledKernel:
    why = unavailable_reason_for_compile(spec.gluon)
    if why:
        raise RuntimeError(f"te_ops triton bridge: cannot compile {getattr(spec.fn, '__name__', spec.fn)}: {why}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if spec.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    else:
        source_cls = ASTSource
    signature = dict(spec.signature)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, ty) in enumerate(spec.signature)
        if ty.startswith("*") or name in spec.divisible_by_16
    }
    src = source_cls(spec.fn, signature, constexprs=dict(spec.constexprs), attrs=attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if spec.maxnreg is not None:
        options["maxnreg"] = spec.maxnreg
    k = triton.compile(src, target=GPUTarget(*target), options=options)
    md = k.metadata
    unsupported = [n for n in ("launch_cooperative_grid", "launch_pdl") if getattr(md, n, False)]
    if getattr(md, "tmem_size", 0) or getattr(md, "tensordesc_meta", None) or unsupported:
        raise NotImplementedError(
            f"te_ops triton bridge: kernel {md.name} needs launch features jaxlib's launcher lacks "
            f"({unsupported or 'host tensor descriptors / tensor memory'})"
        )
    asm = dict(k.asm)
    scratch_size, scratch_align = int(md.global_scratch_size), int(md.global_scratch_align)
    if spec.scratch_bytes_per_program is not None:
        if scratch_size and (
            scratch_size > spec.scratch_bytes_per_program or spec.scratch_bytes_per_program % max(scratch_align, 1)
        ):
            raise ValueError(
                f"te_ops triton bridge: kernel {md.name} needs {scratch_size} bytes of global scratch per "
                f"program aligned to {scratch_align}; the caller reserved scratch_bytes_per_program="
                f"{spec.scratch_bytes_per_program}"
            )
        if scratch_size:
            asm["ptx"] = redirect_global_scratch(asm["ptx"], md.name)
        scratch_size, scratch_align = 0, 0  # jaxlib must not allocate it (cuMemAllocAsync per launch)
    return CompiledKernel(
        name=md.name,
        asm=asm,
        shared=int(md.shared),
        num_warps=int(md.num_warps),
        num_ctas=int(md.num_ctas),
        global_scratch_size=scratch_size,
        global_scratch_align=scratch_align,
        target=tuple(target),
        metadata=md,
    )


def redirect_global_scratch(ptx: str, kernel_name: str) -> str:
    """PTX of ``kernel_name`` whose global-scratch base is read from its last user parameter
    (``te_scratch``, an XLA buffer) instead of the hidden global-scratch parameter.

    Triton kernels end with two hidden pointers, global scratch and profile scratch, which jaxlib's
    launcher fills. For global scratch it calls ``cuMemAllocAsync`` / ``cuMemFreeAsync`` around every
    launch, and XLA cannot put such a launch into a command buffer (a child graph with memory nodes:
    CUDA_ERROR_NOT_SUPPORTED, seen on the H200 2026-12-04). The kernel computes its per-program
    scratch address from the base it loads once from that parameter; pointing that load at the
    ``te_scratch`` parameter (the third from last) makes the launch allocation-free. jaxlib then
    passes a null hidden pointer that nothing reads.
    """
    head = ptx.index(f".entry {kernel_name}(")
    params = re.findall(rf"\b{re.escape(kernel_name)}_param_(\d+)\b", ptx[head : ptx.index(")", head)])
    n = len(params)
    if n < 3:
        raise ValueError(f"te_ops triton bridge: {kernel_name} has {n} PTX parameters; expected te_scratch + 2 hidden")
    hidden, mine = f"{kernel_name}_param_{n - 2}", f"{kernel_name}_param_{n - 3}"
    body_at = ptx.index(")", head)
    body = re.sub(rf"\[{re.escape(hidden)}\]", f"[{mine}]", ptx[body_at:])
    if re.search(rf"\b{re.escape(hidden)}\b", body):
        raise ValueError(f"te_ops triton bridge: {kernel_name} uses its global-scratch parameter in an unexpected way")
    return ptx[:body_at] + body


def unavailable_reason_for_compile(gluon: bool) -> str | None:
    return gluon_unavailable_reason() if gluon else triton_unavailable_reason()


# ----------------------------------------------------------------------------------------------
# Target selection
# ----------------------------------------------------------------------------------------------

_target_override = threading.local()


@contextlib.contextmanager
def target_override(target: tuple) -> Any:
    """Lower for ``target`` = (backend, arch, warp_size) instead of the local device (tests that
    lower for CUDA on a machine without a GPU)."""
    prev = getattr(_target_override, "value", None)
    _target_override.value = tuple(target)
    try:
        yield
    finally:
        _target_override.value = prev


def current_target(backend: triton_backend.VendorBackend) -> tuple:
    override = getattr(_target_override, "value", None)
    if override is not None:
        return override
    try:
        device = jax.local_devices(backend=backend.jax_platform)[0]
    except RuntimeError as e:
        raise RuntimeError(f"te_ops triton bridge: no {backend.jax_platform} device to compile for ({e})") from None
    return backend.target(device)


# ----------------------------------------------------------------------------------------------
# jaxlib launcher
# ----------------------------------------------------------------------------------------------


def _make_kernel(mod: Any, compiled: CompiledKernel, backend: triton_backend.VendorBackend) -> Any:
    image = backend.kernel_image(compiled)
    cc = backend.compute_capability(compiled.target)
    ttir = ""  # only used by jaxlib for debugging; keep the opaque attribute small
    try:
        return mod.TritonKernel(
            kernel_name=compiled.name,
            num_warps=compiled.num_warps,
            num_ctas=compiled.num_ctas,
            shared_mem_bytes=compiled.shared,
            ptx=image,
            ttir=ttir,
            compute_capability=cc,
            global_scratch_size=compiled.global_scratch_size or None,
            global_scratch_align=compiled.global_scratch_align if compiled.global_scratch_size else None,
        )
    except TypeError as e:
        sig = getattr(getattr(mod.TritonKernel, "__init__", None), "__doc__", "?")
        raise RuntimeError(
            "te_ops triton bridge: unsupported jaxlib gpu_triton.TritonKernel signature "
            f"{sig!r}; supported: jaxlib >= 0.11.2 (kernel_name, num_warps, num_ctas, shared_mem_bytes, "
            "ptx, ttir, compute_capability, global_scratch_size, global_scratch_align)"
        ) from e


_SCALAR_TYPES = {"i1", "i32", "u32", "i64", "u64", "fp32", "fp64"}


def _launcher_call(
    kernel_params: Sequence[tuple],
    compiled: CompiledKernel,
    grid: tuple[int, int, int],
    platform: str,
    name: str,
) -> bytes:
    """The zlib-compressed TritonAnyKernelCall proto for the FFI target's ``opaque`` attribute."""
    mod = _launcher_module()
    backend = triton_backend.for_platform(platform)
    kernel = _make_kernel(mod, compiled, backend)
    params = []
    for p in kernel_params:
        if p[0] == "array":
            params.append(mod.create_array_parameter(p[1], 16))
        else:
            _, value, ty = p
            params.append(mod.create_scalar_parameter(value, ty))
    call = mod.TritonKernelCall(kernel, grid[0], grid[1], grid[2], params)
    return zlib.compress(call.to_proto(name, b""))


# ----------------------------------------------------------------------------------------------
# The primitive
# ----------------------------------------------------------------------------------------------

_POINTER_TYPES = {
    jnp.dtype(jnp.float32): "*fp32",
    jnp.dtype(jnp.bfloat16): "*bf16",
    jnp.dtype(jnp.float16): "*fp16",
    jnp.dtype(jnp.float64): "*fp64",
    jnp.dtype(jnp.int32): "*i32",
    jnp.dtype(jnp.int64): "*i64",
    jnp.dtype(jnp.int8): "*i8",
    jnp.dtype(jnp.uint8): "*u8",
    jnp.dtype(jnp.bool_): "*i8",
    jnp.dtype(jnp.int16): "*i16",
    jnp.dtype(jnp.uint32): "*u32",
    jnp.dtype(jnp.float8_e4m3fn): "*fp8e4nv",
    jnp.dtype(jnp.float8_e5m2): "*fp8e5",
}


def _scalar_type(v: Any) -> tuple[Any, str]:
    if isinstance(v, (bool, np.bool_)):
        return bool(v), "i1"
    if isinstance(v, np.int32):
        return int(v), "i32"
    if isinstance(v, np.int64):
        return int(v), "i64"
    if isinstance(v, np.uint32):
        return int(v), "u32"
    if isinstance(v, np.float32):
        return float(v), "fp32"
    if isinstance(v, np.float64):
        return float(v), "fp64"
    if isinstance(v, int):
        return v, ("i32" if -(2**31) <= v < 2**31 else "i64")
    if isinstance(v, float):
        return v, "fp32"
    raise TypeError(
        f"te_ops triton bridge: unsupported scalar argument {v!r} ({type(v).__name__}); pass "
        "np.int32 / np.int64 / np.float32 values or Python int/float/bool"
    )


triton_call_p = jex_core.Primitive("te_triton_call")
triton_call_p.multiple_results = True


def _abstract_eval(*avals, out_avals, **_):
    return list(out_avals)


triton_call_p.def_abstract_eval(_abstract_eval)
# Eager (un-jitted) calls: compile the single primitive with XLA and run it, like any jax primitive
# without a Python implementation. Without this, calling an op with implementation="triton" outside
# jit fails with "Evaluation rule for 'te_triton_call' not implemented".
triton_call_p.def_impl(functools.partial(dispatch.apply_primitive, triton_call_p))


def _batch_rule(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    moved = [
        jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
        for a, d in zip(args, dims, strict=True)
    ]
    outs = jax.lax.map(lambda xs: triton_call_p.bind(*xs, **params), moved)
    return list(outs), [0] * len(outs)


jax.interpreters.batching.primitive_batchers[triton_call_p] = _batch_rule


def _lowering(ctx, *operands, spec, kernel_params, grid, out_avals, aliases, name, platform):
    _bump("lowerings")
    backend = triton_backend.for_platform(platform)
    compiled = compile_kernel(spec, current_target(backend))
    opaque = _launcher_call(kernel_params, compiled, grid, platform, name)
    # jaxlib hands the kernel [operands..., results...] in order; array parameters consume them in
    # order, so results that are aliased to an operand are moved after the ones the kernel writes.
    aliased_outs = {o for _, o in aliases}
    order = [i for i in range(len(out_avals)) if i not in aliased_outs] + sorted(aliased_outs)
    pos = {o: k for k, o in enumerate(order)}
    sub_ctx = ctx.replace(avals_out=[ctx.avals_out[i] for i in order])
    rule = jax.ffi.ffi_lowering(
        FFI_TARGET, api_version=FFI_API_VERSION, operand_output_aliases={i: pos[o] for i, o in aliases}
    )
    results = rule(sub_ctx, *operands, opaque=opaque)
    return [results[pos[i]] for i in range(len(out_avals))]


for _platform in ("cuda", "rocm"):
    mlir.register_lowering(triton_call_p, functools.partial(_lowering, platform=_platform), platform=_platform)


def _is_array(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, (np.generic, int, float))


def _poison_on() -> bool:
    from te_ops._core import native

    return bool(getattr(native._poison, "on", False))


def triton_call(
    kernel: Any,
    *args: Any,
    out_shape: Sequence[jax.ShapeDtypeStruct],
    grid: Sequence[int],
    constexprs: dict[str, Any] | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    input_output_aliases: dict[int, int] | None = None,
    zeroed_outputs: Sequence[int] = (),
    divisible_by_16: Sequence[str] = (),
    name: str | None = None,
    maxnreg: int | None = None,
    scratch_bytes_per_program: int | None = None,
) -> list[jax.Array]:
    """Launches ``kernel`` on ``grid`` from JAX.

    Args:
      kernel: a ``@triton.jit`` or ``@gluon.jit`` function. Its parameters, in order, are: ``args``
        (arrays become pointers, scalars stay scalars), then one pointer per output that is not
        aliased to an input, then the constexprs (``constexprs`` by name).
      out_shape: the outputs.
      grid: up to three grid dimensions (static Python ints).
      input_output_aliases: {index in args: output index}: the output is that input's buffer (the
        kernel writes through the input's pointer; use it to update a buffer in place).
      zeroed_outputs: outputs (not aliased) that jaxlib sets to zero before the launch.
      divisible_by_16: names of integer parameters whose value is a multiple of 16 (checked). The
        kernel is compiled with that promise (``tt.divisibility``), which lets Triton vectorise
        row accesses such as ``ptr + row * H``; a value that is not a multiple of 16 must not be
        named (it would select a different compiled kernel, not a wrong one). Other integer
        parameters are not value-specialised at all.
      maxnreg: registers per thread the kernel may use (Triton's ``maxnreg``). A warp-specialized
        Gluon kernel needs it: its partitions' ``setmaxnreg`` budgets are carved out of it, and the
        default (255) would not fit the register file with a producer warpgroup added.
      scratch_bytes_per_program: set (an int >= 0) for kernels that may build TMA descriptors on the
        device (their "global scratch"; 0 where the configuration needs none, e.g. without TMA).
        The kernel must end its runtime parameters with a pointer ``te_scratch``
        (after its outputs); the bridge passes an XLA buffer of grid x this many bytes there and
        points the kernel's scratch at it (:func:`redirect_global_scratch`), so the launch allocates
        nothing and stays command-buffer safe. Compiling fails with a clear error if the kernel
        needs more per program.

    Returns:
      The list of outputs.
    """
    constexprs = dict(constexprs or {})
    aliases = dict(input_output_aliases or {})
    out_shape = list(out_shape)
    arg_names = list(kernel.arg_names)
    runtime_names = [n for n in arg_names if n not in constexprs]
    n_user_outputs = len(out_shape)
    if scratch_bytes_per_program is not None:
        if not runtime_names or runtime_names[-1] != "te_scratch":
            raise TypeError(
                f"te_ops triton bridge: scratch_bytes_per_program needs kernel {kernel.__name__} to end its "
                f"runtime parameters with te_scratch, got {runtime_names}"
            )
        programs = int(np.prod([int(g) for g in grid]))
        out_shape.append(jax.ShapeDtypeStruct((max(16, programs * int(scratch_bytes_per_program)),), jnp.uint8))
    written = [i for i in range(len(out_shape)) if i not in aliases.values()]
    if len(runtime_names) != len(args) + len(written):
        raise TypeError(
            f"te_ops triton bridge: kernel {kernel.__name__} has {len(runtime_names)} runtime parameters "
            f"{runtime_names}, got {len(args)} arguments + {len(written)} written outputs"
        )
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if min(grid) == 0:  # nothing to launch: zero-size work, outputs are empty or zero
        outs = [jnp.zeros(s.shape, s.dtype) for s in out_shape]
        for i, o in aliases.items():
            outs[o] = args[i]
        return outs[:n_user_outputs]

    signature, kernel_params, operands = [], [], []
    names = iter(runtime_names)
    for a in args:
        n = next(names)
        if _is_array(a):
            signature.append((n, _POINTER_TYPES[jnp.dtype(a.dtype)]))
            kernel_params.append(("array", 0))
            operands.append(a)
        else:
            value, ty = _scalar_type(a)
            if n in divisible_by_16 and (ty not in ("i32", "i64", "u32") or value % 16):
                raise ValueError(f"te_ops triton bridge: {n}={value!r} was declared divisible by 16 but is not")
            signature.append((n, ty))
            kernel_params.append(("scalar", value, ty))
    poison = _poison_on()
    poison_ops = []
    for i in written:
        n = next(names)
        s = out_shape[i]
        signature.append((n, _POINTER_TYPES[jnp.dtype(s.dtype)]))
        zero = int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize if i in zeroed_outputs else 0
        kernel_params.append(("array", zero))
        if poison and i < n_user_outputs:  # never the scratch buffer
            poison_ops.append((i, poison_like(s)))
    full_sig = dict(signature)
    sig = tuple((n, full_sig.get(n, "constexpr")) for n in arg_names)
    spec = KernelSpec(
        kernel,
        sig,
        tuple(sorted(constexprs.items())),
        int(num_warps),
        int(num_stages),
        tuple(sorted(divisible_by_16)),
        None if maxnreg is None else int(maxnreg),
        None if scratch_bytes_per_program is None else int(scratch_bytes_per_program),
    )
    # map operand positions: args that are arrays, in order
    array_arg_pos = [k for k, a in enumerate(args) if _is_array(a)]
    op_index = {k: j for j, k in enumerate(array_arg_pos)}
    alias_pairs = [(op_index[i], o) for i, o in aliases.items()]
    for i, buf in poison_ops:
        alias_pairs.append((len(operands), i))
        operands.append(buf)
    out_avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in out_shape)
    outs = triton_call_p.bind(
        *operands,
        spec=spec,
        kernel_params=tuple(kernel_params),
        grid=grid,
        out_avals=out_avals,
        aliases=tuple(alias_pairs),
        name=name or kernel.__name__,
    )
    return list(outs[:n_user_outputs])


# ----------------------------------------------------------------------------------------------
# Command-buffer diagnostics
# ----------------------------------------------------------------------------------------------

_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=")
_THUNK_LINE = re.compile(r"^(?P<indent>[ \t]*)(?:\d+:\s+)?(?P<kind>k[A-Z]\w*)(?P<rest>.*)$")


def _launches_by_computation(hlo_text: str) -> dict[str, list[str]]:
    """HLO computation name -> names of its instructions that launch a kernel through the bridge."""
    comp, comps = None, {}
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            comp = (line.split()[1] if line.startswith("ENTRY") else line.split()[0]).lstrip("%")
            comps[comp] = []
        elif comp is not None and f'custom_call_target="{FFI_TARGET}"' in line and (m := _HLO_INSTR.match(line)):
            comps[comp].append(m["name"])
    return comps


def triton_launch_names(hlo_text: str) -> list[str]:
    """Names of the instructions of an HLO module (text) that launch a kernel through the bridge."""
    return [n for names in _launches_by_computation(hlo_text).values() for n in names]


def find_thunk_dump(dump_dir: str | os.PathLike, module_name: str) -> str | None:
    """Text of ``module_*.<module_name>.thunk_sequence_after_thunk_passes.txt`` in an
    ``--xla_dump_to`` folder (the newest one), or None. XLA writes it only when a thunk pass changed
    the thunk sequence, so None also means "no command buffer was formed"."""
    paths = sorted(
        pathlib.Path(dump_dir).glob(f"*.{module_name}.thunk_sequence_after_thunk_passes*"),
        key=lambda p: p.stat().st_mtime,
    )
    return paths[-1].read_text() if paths else None


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w.\-]){re.escape(name)}(?![\w.\-])", text) is not None


def command_buffer_report(hlo_text: str, thunk_text: str | None = None) -> dict[str, Any]:
    """Which of a compiled module's Triton launches XLA put into command buffers (CUDA graphs).

    Args:
      hlo_text: the optimized HLO, ``jitted.lower(...).compile().as_text()``.
      thunk_text: the module's thunk dump after the thunk passes (:func:`find_thunk_dump`; run
        with ``--xla_dump_to=DIR``), or None when XLA wrote none.

    Returns:
      ``mode``: ``"hlo"`` (an XLA with the old HLO pass: ``command_buffer`` computations),
      ``"thunk_names"`` (thunk lines name their HLO instruction), ``"thunk_kinds"`` (they do not:
      only counts of ``kCustomCall`` thunks inside / outside ``kCommandBuffer`` thunks) or
      ``"none"`` (no command buffer at all); ``launches``, ``captured``, ``not_captured`` (launch
      instruction names; the last two empty in ``thunk_kinds`` mode), ``command_buffers``,
      ``custom_calls_inside``, ``custom_calls_outside`` and ``other_custom_calls`` (custom calls of
      the module to other targets).
    """
    comps = _launches_by_computation(hlo_text)  # old XLA: command_buffer computations hold launches
    launches = [n for names in comps.values() for n in names]
    other = sum(1 for ln in hlo_text.splitlines() if "custom_call_target=" in ln) - len(launches)
    report: dict[str, Any] = dict(
        mode="none",
        launches=launches,
        captured=[],
        not_captured=list(launches),
        command_buffers=0,
        custom_calls_inside=0,
        custom_calls_outside=0,
        other_custom_calls=other,
    )
    cb_comps = [c for c in comps if "command_buffer" in c]
    if cb_comps:
        inside = [n for c in cb_comps for n in comps[c]]
        report.update(
            mode="hlo",
            command_buffers=len(cb_comps),
            captured=inside,
            not_captured=[n for n in launches if n not in inside],
        )
        report.update(custom_calls_inside=len(inside), custom_calls_outside=len(launches) - len(inside))
        return report
    if not thunk_text:
        return report
    stack: list[int] = []  # indentation of the enclosing kCommandBuffer thunks
    entries = []
    for line in thunk_text.splitlines():
        m = _THUNK_LINE.match(line)
        if not m:
            continue
        indent = len(m["indent"].expandtabs(8))
        while stack and indent <= stack[-1]:
            stack.pop()
        entries.append((m["kind"], bool(stack), m["rest"]))
        if m["kind"] == "kCommandBuffer":
            stack.append(indent)
    calls = [(inside, rest) for kind, inside, rest in entries if kind == "kCustomCall"]
    report.update(
        command_buffers=sum(1 for kind, _, _ in entries if kind == "kCommandBuffer"),
        custom_calls_inside=sum(1 for inside, _ in calls if inside),
        custom_calls_outside=sum(1 for inside, _ in calls if not inside),
    )
    named = {n: [inside for inside, rest in calls if _mentions(rest, n)] for n in launches}
    if any(named.values()):
        report.update(
            mode="thunk_names",
            captured=[n for n, where in named.items() if where and all(where)],
            not_captured=[n for n, where in named.items() if not where or not all(where)],
        )
    elif report["command_buffers"]:
        report.update(mode="thunk_kinds", not_captured=[])
    return report
