"""Loading of the native extension ``te_ops._native`` and registration of its XLA-FFI targets.

The extension is optional: it exists only when the package was built with a CUDA compiler. Without
it every op runs its pure-JAX reference implementation, and asking for ``implementation="native"``
raises with the reason recorded here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import threading
from typing import Any

import jax

_lock = threading.Lock()
_registered = False

# The extension modules: _native (CUDA runtime only) and one per optional library, built only
# when that library's headers were found (see CMakeLists.txt).
MODULES = ("_native", "_native_cublaslt", "_native_cudnn")
_loaded: dict[str, Any] = {}
_errors: dict[str, str] = {}
for _name in MODULES:
    try:  # pragma: no cover - depends on how the package was built
        _loaded[_name] = importlib.import_module(f"te_ops.{_name}")
    except ImportError as e:
        _errors[_name] = (
            f"the native extension te_ops.{_name} is not available ({e}). It is built only when a CUDA "
            "compiler (and, for _native_cublaslt/_native_cudnn, that library's headers) is found at "
            "install time; reinstall on such a machine (see docs/install.md)."
        )
_native = _loaded.get("_native")
_IMPORT_ERROR = _errors.get("_native")


def module() -> Any:
    """The loaded ``te_ops._native`` module, or raise with the reason it is missing."""
    if _native is None:
        raise RuntimeError(_IMPORT_ERROR)
    return _native


def extension_unavailable_reason(name: str = "_native") -> str | None:
    """None when extension module ``name`` is loaded, else why not."""
    return None if name in _loaded else _errors.get(name, f"unknown extension module {name!r}")


@functools.cache
def cuda_device_unavailable_reason() -> str | None:
    """None when JAX sees at least one CUDA device, else why not."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError as e:
        return f"JAX sees no CUDA device ({str(e).splitlines()[0]})"
    if not devices:
        return "JAX sees no CUDA device"
    return None


def built_ops(name: str = "_native") -> tuple[str, ...]:
    """The op folders of csrc/ whose handlers extension module ``name`` was built with (a build may
    leave some out: TE_OPS_ONLY / TE_OPS_EXCLUDE at install time); () when it is not loaded."""
    mod = _loaded.get(name)
    if mod is None:
        return ()
    return tuple(o for o in str(mod.build_info().get("enabled_ops", "")).split(",") if o)


def op_unavailable_reason(name: str, op: str) -> str | None:
    """None when extension module ``name`` is loaded and holds op ``op``'s handlers, else why not."""
    reason = extension_unavailable_reason(name)
    if reason is not None:
        return reason
    ops = built_ops(name)
    if op in ops:
        return None
    return (
        f"te_ops.{name} was built without the {op} handlers (it has: {', '.join(ops) or 'none'}; "
        "TE_OPS_ONLY / TE_OPS_EXCLUDE at install time left them out); reinstall without that restriction"
    )


def native_unavailable_reason(name: str = "_native", op: str | None = None) -> str | None:
    """None when the handlers of extension module ``name`` (of op ``op``, when given) can run in
    this process, else why not."""
    reason = extension_unavailable_reason(name) if op is None else op_unavailable_reason(name, op)
    return reason or cuda_device_unavailable_reason()


@functools.cache
def ctypes_library(name: str) -> ctypes.CDLL:
    """Extension module ``te_ops.<name>`` opened with ctypes, for its exported C symbols (support
    queries that XLA-FFI cannot express). Raises ImportError / OSError when it cannot be loaded."""
    return ctypes.CDLL(importlib.import_module(f"te_ops.{name}").__file__)


@functools.cache
def _query_function(lib: ctypes.CDLL, symbol: str, extra_types: tuple) -> Any:
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int, *extra_types, ctypes.c_char_p, ctypes.c_int]
    return fn


def ctypes_query(name: str, symbol: str, ints, extra: tuple = ()) -> tuple[int, str]:
    """Calls the exported query ``int symbol(const int64_t* ints, int n_ints, <extra>..., char* err,
    int err_len)`` of extension module ``te_ops.<name>`` (the convention of every te_ops query symbol:
    0 when supported, else a code and the reason written to err; see te::CopyError in
    csrc/common/ffi_util.h). ``extra``: (ctypes type, value) pairs passed between n_ints and err.

    Returns (0, "") or (code, reason); (-1, why) when the module or the symbol cannot be reached."""
    try:
        fn = _query_function(ctypes_library(name), symbol, tuple(t for t, _ in extra))
    except (ImportError, OSError, AttributeError) as e:
        return -1, f"cannot reach {symbol} in te_ops.{name}: {e}"
    ints = tuple(int(i) for i in ints)
    arr = (ctypes.c_int64 * len(ints))(*ints)
    err = ctypes.create_string_buffer(4096)
    rc = fn(arr, len(ints), *(v for _, v in extra), err, len(err))
    if rc == 0:
        return 0, ""
    return rc, err.value.decode(errors="replace") or f"{symbol} returned {rc}"


def ensure_registered() -> None:
    """Registers every FFI target of the extension with XLA for the CUDA platform (once)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        for mod in _loaded.values():
            for name, stages in mod.registrations().items():
                jax.ffi.register_ffi_target(name, dict(stages), platform="CUDA", api_version=1)
        _registered = True


def counters() -> dict[str, dict[str, int]]:
    """Per-handler counters from the native module: initialize_calls, warmups, executes,
    captured_executes (execute calls made while XLA was capturing a CUDA graph)."""
    out: dict[str, dict[str, int]] = {}
    for mod in _loaded.values():
        out.update({k: dict(v) for k, v in mod.counters().items()})
    return out


def reset_counters() -> None:
    for mod in _loaded.values():
        mod.reset_counters()


_poison = threading.local()


class poisoned_outputs:  # noqa: N801 - used as a context manager
    """Inside this block, native calls traced get NaN-filled output buffers (aliased to their
    results), so any element a kernel fails to write stays NaN (bool outputs: True, integers: the
    dtype's max). For tests. It is a trace-time setting, and JAX caches traces of an op's inner
    functions per configuration and shape, so entering and leaving the block clears JAX's caches:
    traces made outside are not reused inside, and poisoned traces do not leak out."""

    def __enter__(self):
        self._prev = getattr(_poison, "on", False)
        _poison.on = True
        if not self._prev:
            jax.clear_caches()
        return self

    def __exit__(self, *exc):
        _poison.on = self._prev
        if not self._prev:
            jax.clear_caches()
        return False


def ffi_call(
    target: str,
    result_shape_dtypes: Any,
    *args: jax.Array,
    vmap_method: str = "sequential",
    **attrs: Any,
) -> Any:
    """``jax.ffi.ffi_call`` for a te_ops native target (registers targets on first use).

    Honours :class:`poisoned_outputs`: the handlers take trailing operands they ignore, which are
    aliased to the results.
    """
    ensure_registered()
    multiple = isinstance(result_shape_dtypes, (list, tuple))
    results = list(result_shape_dtypes) if multiple else [result_shape_dtypes]
    operands = list(args)
    aliases = {}
    if getattr(_poison, "on", False):
        import jax.numpy as jnp

        from te_ops._core.validation import poison_value

        for i, r in enumerate(results):
            aliases[len(operands)] = i
            fill = poison_value(r.dtype)
            operands.append(jnp.full(r.shape, fill, r.dtype))
    call = jax.ffi.ffi_call(
        target,
        results if multiple else results[0],
        vmap_method=vmap_method,
        input_output_aliases=aliases or None,
    )
    return call(*operands, **attrs)
