"""compute-sanitizer driver: every te_ops CUDA and Triton/Gluon kernel at small odd shapes.

Each case runs ONE implementation of one op family (forward, and backward through ``jax.vjp`` where
the op has a custom VJP) on the GPU, and compares it loosely with ``implementation="reference"``
run on the CPU (so a wrong kernel is noticed too, not only a memory error). scripts/sanitize.sh
runs this module under compute-sanitizer (memcheck, racecheck, initcheck, synccheck)::

    python -m tests.gpu.sanitize_cases --list               # cases, implementation, kernels covered
    python -m tests.gpu.sanitize_cases --case NAME [--case 'softmax_*']   # fnmatch patterns
    python -m tests.gpu.sanitize_cases --all
    python -m tests.gpu.sanitize_cases --cpu-dry-run --all  # wiring check on a CPU: every GPU
                                                            # implementation replaced by "reference"
    python -m tests.gpu.sanitize_cases --canary             # (under memcheck) a deliberately bad
                                                            # Triton kernel: proves the kernel filter
    python -m tests.gpu.sanitize_cases --kernel-regex       # our Triton/Gluon kernel names, a regex
    python -m tests.gpu.sanitize_cases --report DIR         # scripts/sanitize.sh's summary table

Output protocol (read back by ``--remaining`` / ``--report``): ``SANITIZE-BEGIN <case>``, then
``SANITIZE-END <case> OK|FAIL|UNAVAILABLE|TIMEOUT <seconds> [reason]``, and ``SANITIZE-DONE ...``
once every selected case ran. A case that fails with a sticky CUDA error (illegal address, hardware
exception: :func:`context_lost`) ends the process after ``SANITIZE-ABORT <case>``, without
``SANITIZE-DONE``: the script resumes the cases not begun in a fresh process. Exit status: 0 all OK,
1 a case failed (or timed out: the watchdog of ``--case-timeout`` ends the process, so a hung kernel
cannot eat the whole budget), 4 only UNAVAILABLE cases (an implementation this build cannot run), 2
usage errors.

Only the standard library and NumPy are imported at module level: ``--list``, ``--kernel-regex``,
``--remaining`` and ``--report`` run without JAX (and without a working te_ops build); cases import
JAX and te_ops through :func:`_load`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fnmatch
import functools
import os
import pathlib
import re
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Filled by _load() (JAX and te_ops are imported only when a case runs).
jax: Any = None
jnp: Any = None
te_ops: Any = None
fp8: Any = None
tb: Any = None
native: Any = None

CANARY = "te_sanitize_canary_kernel"

# ----------------------------------------------------------------------------------------------
# Environment of the sanitized process
# ----------------------------------------------------------------------------------------------

# Command buffers (CUDA graphs) off: each kernel is then a plain launch that the sanitizer tracks on
# its own (graph replays are supported by the tools, but add another layer between a report and
# the launch that caused it). Autotuning off: XLA would otherwise time GEMM candidates (more
# kernels under the sanitizer, slower compiles) and the choice does not matter here.
XLA_FLAGS = ("--xla_gpu_enable_command_buffer=", "--xla_gpu_autotune_level=0")


def configure_environment() -> None:
    """Sets the process environment for sanitized runs; call before JAX creates its backends."""
    # The sanitizer must see real allocations: with JAX's default BFC allocator XLA sub-allocates
    # every buffer from one pre-allocated block, so memcheck would see one big allocation (an
    # overrun into the neighbouring buffer is "in bounds") and initcheck would treat bytes written
    # by an earlier, already freed buffer as initialised. "platform" gives every buffer its own
    # cuMemAlloc, freed when the buffer dies; preallocation off for the same reason.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    ours = {f.split("=")[0] for f in XLA_FLAGS}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in ours]
    os.environ["XLA_FLAGS"] = " ".join([*kept, *XLA_FLAGS])


def _load() -> None:
    global jax, jnp, te_ops, fp8, tb, native
    if jax is not None:
        return
    import jax as jax_
    import jax.numpy as jnp_

    import te_ops as te_ops_
    from te_ops import fp8 as fp8_
    from te_ops._core import native as native_
    from te_ops._core import triton_bridge as tb_

    jax, jnp, te_ops, fp8, tb, native = jax_, jnp_, te_ops_, fp8_, tb_, native_


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

NORM = "te_ops.normalization.triton_kernels."
GDT = "te_ops.grouped_dense.triton_kernels."
GDG = "te_ops.grouped_dense.gluon_kernels."
GDF = "te_ops.grouped_dense.gluon_ffn_kernels."
F8T = "te_ops.fp8.triton_kernels."
F8G = "te_ops.fp8.gluon_kernels."
PMT = "te_ops.permutation.triton_kernels."
PMG = "te_ops.permutation.gluon_kernels."


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    impl: str  # the implementation exercised
    run: Callable[[Ctx], None]
    native: tuple[str, ...] = ()  # __global__ kernels of csrc/ it runs (documentation, coverage test)
    triton: tuple[str, ...] = ()  # Triton/Gluon kernels (module.function) that must be launched
    targets: tuple[str, ...] = ()  # native FFI targets that must be in the lowered program
    library: tuple[str, ...] = ()  # library kernels it runs (not ours: cuBLASLt, cuDNN)

    def kernels(self) -> list[str]:
        return (
            list(self.native)
            + [t.rsplit(".", 2)[-2].split("_")[0] + ":" + t.rsplit(".", 1)[-1] for t in self.triton]
            + list(self.library)
        )


CASES: dict[str, Case] = {}


def case(name: str, family: str, impl: str, **kw: Any) -> Callable:
    def deco(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        if name in CASES:
            raise ValueError(f"case {name} defined twice")
        CASES[name] = Case(name, family, impl, fn, **{k: tuple(v) for k, v in kw.items()})
        return fn

    return deco


def bound(run: Callable[..., None], *args: Any, **kw: Any) -> Callable[[Ctx], None]:
    """The case function ``c -> run(c, *args, **kw)`` (for the rows of a table of cases)."""
    return lambda c: run(c, *args, **kw)


class CaseFailure(AssertionError):
    pass


class Ctx:
    """What a case uses: devices, inputs, and the run-and-compare helpers."""

    def __init__(self, name: str, dry: bool):
        self.name = name
        self.dry = dry
        self.cpu = jax.devices("cpu")[0]
        self.dev = self.cpu if dry else jax.devices("cuda")[0]
        self.rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.hlo: list[str] = []

    # --- inputs ---------------------------------------------------------------------------
    def impl(self, name: str) -> str:
        return "reference" if self.dry else name

    def normal(self, shape, dtype, scale: float = 1.0) -> np.ndarray:
        return np.asarray(self.rng.standard_normal(shape) * scale, np.float32).astype(jnp.dtype(dtype))

    def quantised(self, shape, dtype, lo=-32, hi=32, step=1 / 8) -> np.ndarray:
        """Values on a coarse grid (exact in bf16/f16): exact ties, no near-ties (router choices)."""
        return (self.rng.integers(lo, hi + 1, shape) * step).astype(np.float32).astype(jnp.dtype(dtype))

    # --- running ----------------------------------------------------------------------------
    def _jit(self, fn: Callable, args: tuple) -> Any:
        lowered = jax.jit(fn).lower(*args)
        if not self.dry:
            self.hlo.append(lowered.as_text())
        return jax.block_until_ready(lowered.compile()(*args))

    def fwd(self, make: Callable[[str], Callable], args: Iterable, impl: str, **cmp: Any) -> None:
        """``make(impl)(*args)`` on the device vs ``make("reference")(*args)`` on the CPU."""
        args = tuple(args)
        got = self._jit(make(self.impl(impl)), jax.device_put(args, self.dev))
        want = jax.jit(make("reference"))(*jax.device_put(args, self.cpu))
        compare(got, want, **cmp)

    def vjp(self, make: Callable[[str], Callable], args: Iterable, impl: str, argnums=None, **cmp: Any) -> None:
        """Forward (``jax.vjp``) and backward as two jitted programs on the device (so the residuals
        are program outputs and inputs: separate allocations the sanitizer bounds-checks), random
        cotangents, against the same on the CPU with the reference implementation."""
        args = tuple(args)
        argnums = tuple(range(len(args))) if argnums is None else tuple(argnums)

        def forward(name: str) -> Callable:
            f = make(name)

            def run(*a):
                def g(*d):
                    full = list(a)
                    for i, v in zip(argnums, d, strict=True):
                        full[i] = v
                    return f(*full)

                return jax.vjp(g, *(a[i] for i in argnums))

            return run

        out, pullback = self._jit(forward(self.impl(impl)), jax.device_put(args, self.dev))
        leaves, treedef = jax.tree.flatten(out)
        shapes = [tuple(leaf.shape) for leaf in leaves]
        cts = [
            self.normal(s, leaf.dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else None
            for s, leaf in zip(shapes, leaves, strict=True)
        ]

        def backward(pb, cts):
            full = [c if c is not None else np.zeros(s, jax.dtypes.float0) for c, s in zip(cts, shapes, strict=True)]
            return pb(jax.tree.unflatten(treedef, full))

        grads = self._jit(backward, (pullback, jax.device_put(cts, self.dev)))

        def reference(a, cts):
            o, pb = forward("reference")(*a)
            return o, backward(pb, cts)

        want = jax.jit(reference)(jax.device_put(args, self.cpu), jax.device_put(cts, self.cpu))
        compare((out, grads), want, **cmp)

    # --- expectations -------------------------------------------------------------------------
    def check_launched(self, c: Case, lowered: set[str]) -> None:
        if self.dry:
            return
        text = "\n".join(self.hlo)
        missing = [t for t in c.targets if t not in text]
        if missing:
            raise CaseFailure(f"native FFI targets {missing} are not in the lowered programs")
        missing = [k for k in c.triton if k not in lowered]
        if missing:
            raise CaseFailure(f"kernels {missing} were not launched (launched: {sorted(lowered)})")


_TOL = {"float64": 1e-6, "float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}
_FP8 = ("float8_e4m3fn", "float8_e5m2")


def compare(
    got, want, *, tol: float | None = None, l2: bool = False, fp8_frac: float = 0.01, int_frac: float = 0.0
) -> None:
    """Loose comparison, leaf by leaf: floats within ``tol`` times the reference's largest magnitude
    (``l2``: relative L2 error), NaN only where the reference has NaN; FP8 bytes and integer/bool
    leaves equal up to a fraction of elements (``fp8_frac``, ``int_frac``)."""
    g, gdef = jax.tree_util.tree_flatten_with_path(got)
    w, wdef = jax.tree_util.tree_flatten_with_path(want)
    if gdef != wdef:
        raise CaseFailure(f"result structure differs from the reference: {gdef} vs {wdef}")
    for (path, a), (_, e) in zip(g, w, strict=True):
        name = jax.tree_util.keystr(path) or "result"
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape or a.dtype != e.dtype:
            raise CaseFailure(f"{name}: {a.dtype}{list(a.shape)} vs reference {e.dtype}{list(e.shape)}")
        if a.size == 0:
            continue
        if a.dtype.name in _FP8:
            from te_ops._core.testing import fp8_byte_mismatch_fraction, fp8_nan_mismatches

            nan_moved = fp8_nan_mismatches(a, e)
            if nan_moved.size:
                raise CaseFailure(
                    f"{name}: FP8 NaN positions differ from the reference at {len(nan_moved)} elements "
                    f"(first at {nan_moved[0].tolist()})"
                )
            frac = fp8_byte_mismatch_fraction(a, e)  # the bytes of the elements that are not NaN
            if frac > fp8_frac:
                raise CaseFailure(f"{name}: {frac:.2%} of the FP8 bytes differ from the reference (> {fp8_frac:.2%})")
        elif jnp.issubdtype(a.dtype, jnp.floating):
            a32, e32 = a.astype(np.float64), e.astype(np.float64)
            na, ne = np.isnan(a32), np.isnan(e32)
            if (na & ~ne).any():
                idx = np.argwhere(na & ~ne)[0].tolist()
                raise CaseFailure(f"{name}: {int((na & ~ne).sum())} NaN where the reference has none (first at {idx})")
            if (ne & ~na).any():
                raise CaseFailure(f"{name}: {int((ne & ~na).sum())} reference NaN not reproduced")
            inf = (np.isinf(a32) | np.isinf(e32)) & ~na
            if (a32[inf] != e32[inf]).any():
                raise CaseFailure(f"{name}: infinities differ from the reference")
            fin = np.isfinite(e32) & np.isfinite(a32)
            t = tol if tol is not None else _TOL.get(a.dtype.name, 1e-3)
            d, r = a32[fin] - e32[fin], e32[fin]
            if l2:
                den = float(np.linalg.norm(r))
                err = float(np.linalg.norm(d)) / den if den else (0.0 if not d.any() else float("inf"))
                if err > t:
                    raise CaseFailure(f"{name}: relative L2 error {err:.3g} > {t}")
            else:
                scale = max(float(np.max(np.abs(r), initial=0.0)), 1e-6)
                err = float(np.max(np.abs(d), initial=0.0))
                if err > t * scale:
                    idx = np.argwhere(np.abs(a32 - e32) == err)
                    raise CaseFailure(f"{name}: max |error| {err:.3g} > {t} x {scale:.3g} (at {idx[0].tolist()})")
        else:
            bad = a != e
            if float(np.mean(bad)) > int_frac:
                idx = np.argwhere(bad)[0].tolist()
                raise CaseFailure(
                    f"{name}: {int(bad.sum())} of {a.size} elements differ (first at {idx}: "
                    f"{a[tuple(idx)]} vs {e[tuple(idx)]})"
                )


@contextlib.contextmanager
def patched(obj: Any, **attrs: Any):
    """Module switches read at trace time (e.g. te_ops.fp8.triton.GEMM_KERNEL), restored after."""
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def native_hook(c: Ctx, module: str, setter: str, value: tuple, reset: tuple):
    """A native benchmark/test hook (a process-wide launch choice read when a handler runs); a
    no-op in a CPU dry run, where the extension is not there."""
    if c.dry:
        yield
        return
    mod = native._loaded[module]
    getattr(mod, setter)(*value)
    try:
        yield
    finally:
        getattr(mod, setter)(*reset)


# --- dense (native: cuBLASLt GEMMs + our elementwise kernels) ----------------------------------

_DENSE_T = ("te_dense_fwd", "te_dense_bwd")
_DENSE_AUX_T = (*_DENSE_T, "te_dense_fwd_aux")
_ACT_BWD = ("ActBackwardKernel", "ReducePartialsKernel")
_ACT = ("ActForwardKernel", *_ACT_BWD)


def _dense(c: Ctx, x_shape, n, dtype, act, bias, tol=None):
    k = x_shape[-1]
    args = [c.normal(x_shape, dtype), c.normal((k, n), dtype, 1 / np.sqrt(k))]
    if bias:
        args.append(c.normal((n,), dtype))

    def make(impl):
        return lambda *a: te_ops.dense(*a, activation=act, implementation=impl)

    c.vjp(make, args, "native", tol=tol)


# fmt: off
DENSE_CASES = {  # name: (FFI targets, csrc kernels, cuBLASLt kernel, x shape, N, dtype, activation, bias)
    # exact-erf GELU: GEMM with the bias epilogue writing z, then our activation kernel; odd N: scalar path
    "dense_native_f32_gelu_bias":
        (_DENSE_AUX_T, (*_ACT, "FillUniformKernel"), "cuBLASLt", (37, 72), 53, "float32", "gelu", True),
    "dense_native_bf16_silu_bias_3d":  # N % 8 == 0: 16-byte vector path
        (_DENSE_AUX_T, _ACT, "cuBLASLt", (3, 13, 64), 48, "bfloat16", "silu", True),
    "dense_native_bf16_gelu_tanh_bias":
        (_DENSE_AUX_T, _ACT_BWD, "cuBLASLt GELU_AUX_BIAS", (37, 96), 64, "bfloat16", "gelu_tanh", True),
    "dense_native_f16_relu_rank1":
        (_DENSE_T, ("ActBackwardKernel",), "cuBLASLt RELU", (29,), 7, "float16", "relu", False),
    "dense_native_f32_bias_only":
        (_DENSE_T, (), "cuBLASLt BIAS/BGRADA", (9, 40), 24, "float32", None, True),
}
# fmt: on
for _name, (_targets, _kernels, _library, *_args) in DENSE_CASES.items():
    case(_name, "dense", "native", targets=_targets, native=_kernels, library=(_library,))(bound(_dense, *_args))


@case(
    "dense_native_split_forward_smem_bwd_f16", "dense", "native", targets=_DENSE_T, native=_ACT, library=("cuBLASLt",)
)
def _dense_split_smem(c):
    # benchmark hooks: the split training forward (BIAS GEMM + our relu kernel in place) and backward
    # block shape 0 (32 x 8 threads: the dbias partial sums meet in shared memory)
    with native_hook(c, "_native_cublaslt", "dense_set_forward_split", (True,), (False,)):
        with native_hook(c, "_native_cublaslt", "dense_set_backward_variant", (0,), (1,)):
            _dense(c, (37, 29), 53, "float16", "relu", True)


# --- softmax (native) -------------------------------------------------------------------------

_SOFTMAX_OPS = {  # mode: (te_ops function, FFI targets)
    "none": ("scaled_softmax", ("te_softmax_fwd", "te_softmax_bwd")),
    "causal": ("scaled_upper_triang_masked_softmax", ("te_softmax_fwd", "te_softmax_bwd")),
    "mask": ("scaled_masked_softmax", ("te_masked_softmax_fwd", "te_masked_softmax_bwd")),
}


def _softmax_config(c: Ctx, dtype, rows, cols, mode, scale, kernel, long=False):
    if c.dry:
        return
    from te_ops.softmax import native as sm

    cfg = sm.launch_config(dtype, rows, cols, mode, scale)
    if cfg["kernel"] != kernel or (cfg["threads_per_row"] == 0) != long:
        raise CaseFailure(f"softmax launch is {cfg}, expected kernel {kernel} (long row kernel: {long})")


def _softmax(c: Ctx, mode, shape, dtype, scale, launch=None, long=False, mask=None, tuning=None):
    """The softmax of ``mode`` (fwd + bwd) on x of ``shape`` (values of scale 3). ``launch``: the
    forward kernel the launch config must choose (``long``: the long-row kernel); ``mask``: (fraction
    masked out, a row masked entirely), broadcast over heads; ``tuning``: softmax_set_tuning's values."""
    extra = []
    if mask is not None:
        fraction, row = mask
        m = c.rng.random((shape[0], 1, *shape[2:])) < fraction
        m[row] = True
        extra.append(m)
    fn = getattr(te_ops, _SOFTMAX_OPS[mode][0])
    hook = native_hook(c, "_native", "softmax_set_tuning", tuning, (0, 0)) if tuning else contextlib.nullcontext()
    with hook:
        if launch is not None:
            _softmax_config(c, dtype, int(np.prod(shape[:-1])), shape[-1], mode, scale, launch, long)
        x = c.normal(shape, dtype, 3)
        c.vjp(lambda impl: lambda x, *m: fn(x, *m, scale, implementation=impl), [x, *extra], "native", argnums=(0,))


_SM = ("SoftmaxForwardKernel", "SoftmaxBackwardKernel")
_SM_WR = ("SoftmaxForwardWarpRowKernel", "SoftmaxBackwardKernel")
_SM_LONG = ("SoftmaxForwardLongKernel", "SoftmaxBackwardLongKernel")

# fmt: off
SOFTMAX_CASES = {  # name: (csrc kernels, mode, x shape, dtype, scale[, launch kernel, long-row kernel, mask, tuning])
    "softmax_native_f32_short_rows":
        (_SM, "none", (7, 33), "float32", 0.7, "register"),
    # odd length (no vectors), > 128 elements: 256 threads per row reduce across warps in shared memory
    "softmax_native_bf16_cross_warp_rows":
        (_SM, "none", (3, 1001), "bfloat16", 1.0, "register"),
    "softmax_native_f32_long_rows":
        (_SM_LONG, "none", (2, 8201), "float32", 0.5, "register", True),
    "softmax_native_f16_masked":  # one row fully masked
        (_SM, "mask", (2, 3, 9, 37), "float16", 0.9, None, False, (0.35, (0, 0, 1))),
    "softmax_native_bf16_causal":
        (_SM, "causal", (2, 3, 37, 37), "bfloat16", 0.5),
    # rows of 2048 bf16 (256 vectors): the default forward is warp-per-row, the backward 64 threads per row
    "softmax_native_bf16_warp_row":
        (_SM_WR, "none", (5, 2048), "bfloat16", 0.7, "warp-row"),
    "softmax_native_f32_warp_row_masked_tuned":  # tuning (32, 16) forces warp-per-row
        (_SM_WR, "mask", (2, 2, 9, 64), "float32", 0.9, "warp-row", False, (0.3, (1, 0, 2)), (32, 16)),
    "softmax_native_bf16_warp_row_packed_causal_tuned":  # tuning (32, -16) forces the packed bf16 variant
        (_SM_WR, "causal", (2, 2, 40, 40), "bfloat16", 0.5, "warp-row-packed", False, None, (32, -16)),
}
# fmt: on
for _name, (_kernels, *_args) in SOFTMAX_CASES.items():
    case(_name, "softmax", "native", targets=_SOFTMAX_OPS[_args[0]][1], native=_kernels)(bound(_softmax, *_args))


# --- rms_norm / layer_norm (Triton) ---------------------------------------------------------------


def _norm(c: Ctx, kind, shape, dtype, res, zc=False, param_dtype="float32"):
    h = shape[-1]
    args = [c.normal(shape, dtype, 2.0), (1 + 0.3 * c.normal((h,), "float32")).astype(jnp.dtype(param_dtype))]
    if kind == "layer":
        args.append(c.normal((h,), param_dtype, 0.3))
    if res:
        args.append(c.normal(shape, dtype))

    def make(impl):
        def f(x, gamma, *rest):
            r = rest[-1] if res else None
            if kind == "rms":
                return te_ops.rms_norm(x, gamma, residual=r, zero_centered_gamma=zc, implementation=impl)
            return te_ops.layer_norm(x, gamma, rest[0], residual=r, zero_centered_gamma=zc, implementation=impl)

        return f

    c.vjp(make, args, "triton")


_FUSED = (NORM + "norm_fwd_kernel", NORM + "norm_bwd_kernel")
_LOOPED = (NORM + "norm_fwd_looped_kernel", NORM + "norm_bwd_looped_kernel", NORM + "norm_dparam_kernel")

# fmt: off
NORM_CASES = {  # name: (Triton kernels, rms | layer, x shape, dtype, residual[, zero-centered gamma, gamma dtype])
    "rms_norm_triton_residual_bf16": (_FUSED, "rms", (37, 72), "bfloat16", True, True),
    "layer_norm_triton_f32_bf16_params": (_FUSED, "layer", (5, 7, 33), "float32", False, False, "bfloat16"),
    # rows longer than MAX_FUSED_H, a partial last chunk
    "layer_norm_triton_looped_residual_f16": (_LOOPED, "layer", (3, 8200), "float16", True),
    "rms_norm_triton_looped_bf16": (_LOOPED, "rms", (2, 8208), "bfloat16", False),  # H % 16 == 0: vectorised variant
}
# fmt: on
for _name, (_kernels, *_args) in NORM_CASES.items():
    case(_name, "normalization", "triton", triton=_kernels)(bound(_norm, *_args))


# --- grouped_dense (Triton / Gluon) -----------------------------------------------------------------


def _grouped(c: Ctx, m, k, n, sizes, dtype, bias, tol=None):
    g = len(sizes)
    args = [c.normal((m, k), dtype), c.normal((g, k, n), dtype, 1 / np.sqrt(k)), np.asarray(sizes, np.int32)]
    if bias:
        args.append(c.normal((g, n), dtype))

    def make(impl):
        return lambda x, w, s, *b: te_ops.grouped_dense(x, w, s, *b, implementation=impl)

    c.vjp(make, args, "triton", argnums=(0, 1, 3) if bias else (0, 1), tol=tol)


_GD_TRITON = (GDT + "grouped_gemm_kernel", GDT + "grouped_wgrad_kernel")
_GD_WS = (GDG + "grouped_gemm_ws_kernel", GDT + "grouped_wgrad_kernel")

# fmt: off
GROUPED_CASES = {  # name: (implementation label, Triton/Gluon kernels, M, K, N, group sizes, dtype, bias)
    # K = 72 and N = 40 are not multiples of BK: the masked K loop; an empty group; rows past the groups
    "grouped_dense_triton_odd_k_bias_bf16":
        ("triton", _GD_TRITON, 37, 72, 40, [10, 0, 20, 5], "bfloat16", True),
    "grouped_dense_gluon_ws_f16":  # the default forward and dx kernel on Hopper
        ("triton (Gluon warp-specialized)", _GD_WS, 37, 128, 192, [0, 30, 7], "float16", False),
}
# fmt: on
for _name, (_label, _kernels, *_args) in GROUPED_CASES.items():
    case(_name, "grouped_dense", _label, triton=_kernels)(bound(_grouped, *_args))


@case(
    "grouped_dense_gluon_pingpong_bf16",
    "grouped_dense",
    "triton (Gluon ping-pong)",
    triton=(GDG + "grouped_gemm_pingpong_kernel", GDT + "grouped_wgrad_kernel"),
)
def _gd_pingpong(c):
    from te_ops.grouped_dense import triton as gd

    cfg = gd.GemmConfig(BN=128, num_stages=4, GLUON_WS=True, PINGPONG=True)
    with gd.config_override(cfg, cfg, None):
        _grouped(c, 45, 128, 128, [5, 0, 33, 0], "bfloat16", False)


@case("grouped_dense_triton_tma_bias_bf16", "grouped_dense", "triton (TMA descriptors)", triton=_GD_TRITON)
def _gd_tma(c):
    from te_ops.grouped_dense import triton as gd

    cfg = gd.GemmConfig(USE_TMA=True)
    with gd.config_override(cfg, cfg, gd.WgradConfig(USE_TMA=True)):
        _grouped(c, 37, 128, 64, [12, 25, 0], "bfloat16", True)  # the last group ends at M


@case(
    "grouped_ffn_triton_gated_silu_bf16",
    "grouped_ffn",
    "triton (activation in the GEMM epilogues)",
    triton=(GDT + "grouped_gemm_act_kernel", GDT + "grouped_gemm_dact_kernel", GDG + "grouped_gemm_ws_kernel",
            GDT + "grouped_wgrad_kernel"),
)  # fmt: skip
def _gffn(c):
    # H = 72 is not a multiple of BK and F = 64 not one of BN (masked K loop and columns); an empty group;
    # rows past the groups; the wo and wi dx GEMMs are grouped_dense's (Gluon where K % BK == 0)
    m, h, f, o, sizes = 45, 72, 64, 128, [10, 0, 20, 5]
    g = len(sizes)
    args = [c.normal((m, h), "bfloat16"), c.normal((g, h, 2 * f), "bfloat16", 1 / np.sqrt(h)),
            c.normal((g, f, o), "bfloat16", 1 / np.sqrt(f)), np.asarray(sizes, np.int32)]  # fmt: skip

    def make(impl):
        return lambda x, wi, wo, s: te_ops.grouped_ffn(x, wi, wo, s, implementation=impl)

    c.vjp(make, args, "triton", argnums=(0, 1, 2))


@case(
    "grouped_ffn_gluon_ws_gated_silu_bf16",
    "grouped_ffn",
    "triton (Gluon warp-specialized act / dact GEMMs, opt-in)",
    triton=(GDF + "grouped_gemm_act_ws_kernel", GDF + "grouped_gemm_dact_ws_kernel", GDT + "grouped_gemm_kernel",
            GDT + "grouped_wgrad_kernel"),
)  # fmt: skip
def _gffn_gluon(c):
    # H = O = 128 (multiples of BK: the Gluon route); F = 72 not a multiple of BN (the masked last column
    # tile of each half) and M = 45 (a partial row tile); an empty group; rows past the groups. The wo
    # GEMM (K = F) and the wi dx GEMM (K = 2F) run the Triton kernel (K not a multiple of BK)
    from te_ops.grouped_dense import triton as gd

    m, h, f, o, sizes = 45, 128, 72, 128, [10, 0, 20, 5]
    g = len(sizes)
    args = [c.normal((m, h), "bfloat16"), c.normal((g, h, 2 * f), "bfloat16", 1 / np.sqrt(h)),
            c.normal((g, f, o), "bfloat16", 1 / np.sqrt(f)), np.asarray(sizes, np.int32)]  # fmt: skip

    def make(impl):
        return lambda x, wi, wo, s: te_ops.grouped_ffn(x, wi, wo, s, implementation=impl)

    ws = gd.GemmConfig(BN=128, GLUON_WS=True)
    with gd.config_override(ffn_act=ws, ffn_dact=ws):
        c.vjp(make, args, "triton", argnums=(0, 1, 2))


# --- fused_attention (native: cuDNN graphs; the kernels are cuDNN's) --------------------------------


def _attention(c: Ctx, b, sq, sk, hq, hk, d, dtype, bias_shape=None, **kw):
    args = [c.normal((b, sq, hq, d), dtype), c.normal((b, sk, hk, d), dtype), c.normal((b, sk, hk, d), dtype)]
    if bias_shape is not None:
        args.append(c.normal(bias_shape, dtype))
    extra = {k: np.asarray(v, np.int32) for k, v in kw.pop("ints", {}).items()}
    names = list(extra)
    args += [extra[k] for k in names]
    n_diff = 4 if bias_shape is not None else 3

    def make(impl):
        def f(q, k, v, *rest):
            bias = rest[0] if bias_shape is not None else None
            ints = dict(zip(names, rest[n_diff - 3 :], strict=True))
            if impl == "reference":  # in float32 (cuDNN's error alone is what the tolerance is for)
                f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
                out = te_ops.fused_attention(f32(q), f32(k), f32(v), bias=f32(bias), implementation=impl, **ints, **kw)
                return out.astype(q.dtype)
            return te_ops.fused_attention(q, k, v, bias=bias, implementation=impl, **ints, **kw)

        return f

    c.vjp(make, args, "native", argnums=tuple(range(n_diff)), tol=1e-1, l2=True)  # cuDNN: bf16 P, fp32 sums


_SEGMENTS = np.zeros((2, 45), np.int32)  # 3 segments (13, 18, 14 tokens); 4 segments (12, 12, 12, 9 tokens)
_SEGMENTS[0, :13], _SEGMENTS[0, 13:31], _SEGMENTS[0, 31:] = 1, 2, 3
_SEGMENTS[1] = np.repeat(np.arange(4), 12)[:45] + 10

# fmt: off
ATTENTION_CASES = {  # name: (B, Sq, Skv, Hq, Hkv, D, dtype, options of _attention)
    "fused_attention_native_padding_causal_bf16":
        (2, 37, 29, 4, 4, 64, "bfloat16",
         dict(mask_type="padding_causal", ints=dict(q_seqlens=[37, 21], kv_seqlens=[11, 29]))),
    "fused_attention_native_bias_causal_f16":
        (2, 40, 40, 4, 4, 64, "float16", dict(bias_shape=(1, 4, 40, 40), mask_type="causal")),
    "fused_attention_native_gqa_segments_bf16":
        (2, 45, 45, 4, 2, 64, "bfloat16", dict(ints=dict(q_segment_ids=_SEGMENTS, kv_segment_ids=_SEGMENTS))),
}
# fmt: on
_FA = dict(targets=("te_fused_attention_fwd", "te_fused_attention_bwd"), library=("cuDNN SDPA",))
for _name, (*_args, _options) in ATTENTION_CASES.items():
    case(_name, "fused_attention", "native", **_FA)(bound(_attention, *_args, **_options))


# --- router (native) ------------------------------------------------------------------------------


def _topk(c: Ctx, logits, bias=None, **kw):
    args = [logits] + ([bias] if bias is not None else [])

    def make(impl):
        return lambda x, *b: te_ops.fused_topk_with_score_function(
            x, expert_bias=b[0] if b else None, implementation=impl, **kw
        )

    c.vjp(make, args, "native", argnums=(0,))


_TOPK = dict(targets=("te_router_topk_fwd", "te_router_topk_bwd"), native=("RowForwardKernel", "RowBackwardKernel"))


@case("router_topk_native_softmax_f32", "router", "native", **_TOPK)
def _router_softmax(c):
    _topk(c, c.quantised((37, 72), "float32"), topk=5, score_function="softmax")


@case("router_topk_native_grouped_sigmoid_bias_bf16", "router", "native", **_TOPK)
def _router_grouped(c):
    # DeepSeek-V3-like grouped selection on "planted" logits (tests/gpu/test_router_gpu.py): equal
    # group scores are exact ties, different ones far apart, so both implementations choose alike
    t, e, groups = 37, 64, 8
    palette = np.arange(1, 7) * 0.5
    logits = c.rng.integers(-32, -7, (t, e)) / 8.0
    gsize = e // groups
    zero_bias = [j for j in range(gsize) if j % 4 != 0]
    for r in range(t):
        for g in range(groups):
            pos = c.rng.choice(zero_bias, 3, replace=False)
            logits[r, g * gsize + pos] = np.sort(c.rng.choice(palette, 3, replace=True))[::-1]
    bias = np.where(np.arange(e) % 4 == 0, c.rng.integers(-2, 3, e) / 64.0, 0.0).astype(np.float32)
    _topk(
        c,
        logits.astype(np.float32).astype(jnp.dtype("bfloat16")),
        bias,
        topk=8,
        score_function="sigmoid",
        num_groups=8,
        group_topk=4,
        scaling_factor=2.5,
        compact_routing_map=True,
    )


@case("router_topk_native_pre_softmax_e1024_f16", "router", "native", **_TOPK)
def _router_e1024(c):
    _topk(
        c, c.quantised((9, 1024), "float16", -64, 64, 1 / 16), topk=32, score_function="softmax", use_pre_softmax=True
    )


def _scores(c: Ctx, logits, topk, score_function, compact):
    def make(impl):
        return lambda x: te_ops.compute_routing_scores_for_aux_loss(
            x, topk, score_function=score_function, compact_routing_map=compact, implementation=impl
        )

    c.vjp(make, [logits], "native")


_SCORES = dict(
    targets=("te_router_scores_fwd", "te_router_scores_bwd"), native=("RowForwardKernel", "RowBackwardKernel")
)


@case("router_aux_scores_native_sigmoid_f16", "router", "native", **_SCORES)
def _router_scores_sigmoid(c):
    _scores(c, c.quantised((37, 33), "float16"), 3, "sigmoid", False)


@case("router_aux_scores_native_softmax_compact_bf16", "router", "native", **_SCORES)
def _router_scores_softmax(c):
    _scores(c, c.quantised((29, 72), "bfloat16"), 4, "softmax", True)


@case(
    "router_aux_loss_native_bf16",
    "router",
    "native",
    targets=("te_router_aux_loss_fwd", "te_router_aux_loss_bwd"),
    native=("LossPartialKernel", "LossFinalKernel", "LossBackwardKernel"),
)
def _router_loss(c):
    logits = c.rng.standard_normal((37, 12))
    probs = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32).astype(jnp.dtype("bfloat16"))
    tpe = c.rng.integers(0, 100, (12,)).astype(np.int32)

    def make(impl):
        return lambda p, t: te_ops.fused_moe_aux_loss(p, t, topk=2, coeff=0.01, implementation=impl)

    c.vjp(make, [probs, tpe], "native", argnums=(0,))


# --- token_dispatch / token_combine / sort_chunks_by_index (Triton, Gluon) -------------------------


def _routing_map(c: Ctx, t, e, k):
    rm = np.zeros((t, e), bool)
    top = np.argsort(-c.rng.standard_normal((t, e)), axis=1)[:, :k]
    rm[np.arange(t)[:, None], top] = True
    rm[3] = False  # a token routed nowhere
    return rm


def _permute(c: Ctx, impl, t, e, h, k, dtype, capacity, align=None, probs=True):
    rm = _routing_map(c, t, e, k)
    args = [c.normal((t, h), dtype), rm]
    if probs:
        args += [c.rng.random((t, e)).astype(np.float32) * rm, c.rng.random((t, e)).astype(np.float32) * rm]

    def make(name):
        def f(x, rm, *p):
            d = te_ops.token_dispatch(x, rm, capacity, probs=p[0] if p else None, align_size=align, implementation=name)
            y = te_ops.token_combine(d.out, d.row_id_map, merging_probs=p[1] if p else None, implementation=name)
            return y, d

        return f

    c.vjp(make, args, impl, argnums=(0, 2, 3) if probs else (0,))


_PERM_ROUTING = (
    PMT + "count_kernel",
    PMT + "scan_kernel",
    PMT + "rowmap_kernel",
    PMT + "zero_holes_kernel",
    PMT + "inv_kernel",
)
_PERM_TRITON = (*_PERM_ROUTING, PMT + "dispatch_kernel", PMT + "combine_kernel")
_PERM_GLUON = (*_PERM_ROUTING, PMG + "dispatch_kernel", PMG + "combine_kernel")
_PERM_BWD = (PMT + "dispatch_bwd_kernel", PMT + "combine_bwd_kernel")

# fmt: off
# name: (Triton/Gluon kernels, implementation, tokens, experts, H, topk, dtype, capacity[, align, probs])
PERMUTE_CASES = {
    "permute_triton_probs_drops_bf16":  # 72 routed pairs, 12 dropped
        ((*_PERM_TRITON, *_PERM_BWD), "triton", 37, 6, 72, 2, "bfloat16", 60),
    "permute_triton_align_no_probs_f32":  # odd H, padded blocks
        ((*_PERM_TRITON, PMT + "combine_bwd_noprobs_kernel"), "triton", 29, 5, 33, 2, "float32", 58, 8, False),
    "permute_gluon_probs_f16":  # 4 tokens per program, a partial last one
        ((*_PERM_GLUON, *_PERM_BWD), "gluon", 37, 4, 136, 2, "float16", 70),
}
# fmt: on
for _name, (_kernels, *_args) in PERMUTE_CASES.items():
    case(_name, "permutation", _args[0], triton=_kernels)(bound(_permute, *_args))


@case("sort_chunks_triton_f16", "permutation", "triton", triton=(PMT + "chunk_src_kernel", PMT + "row_gather_kernel"))
def _sort_chunks(c):
    args = [
        c.normal((37, 40), "float16"),
        np.asarray([5, 0, 12, 9, 11], np.int32),
        np.asarray([3, 0, 4, 2, 1], np.int32),
    ]

    def make(impl):
        return lambda x, s, i: te_ops.sort_chunks_by_index(x, s, i, implementation=impl)

    c.vjp(make, args, "triton", argnums=(0,))


# --- FP8 (Triton / Gluon) ---------------------------------------------------------------------------


@case("fp8_block_quantize_triton", "fp8", "triton", triton=(F8T + "block_quantize_kernel",))
def _fp8_block_quantize(c):
    args = [
        c.normal((37, 300), "bfloat16", 3),
        c.normal((200, 136), "bfloat16"),
        c.normal((67, 129), "float16", 3),
        c.normal((3, 5, 130), "float32", 3),
    ]

    def make(impl):
        def f(x, w, x2, x3):
            q = fp8.quantize
            return (
                q(x, fp8.BlockScaling(), "x", implementation=impl),  # 1 x 128 tiles
                q(w, fp8.BlockScaling(), "w", implementation=impl),  # 128 x 128 blocks
                q(x2, fp8.BlockScaling(act_block=(64, 64), power_of_2=False), "x", implementation=impl),
                q(x3, fp8.BlockScaling(formats="hybrid"), "g", implementation=impl),
            )  # E5M2, batched

        return f

    c.fwd(make, args, "triton")


@case("fp8_per_tensor_quantize_triton", "fp8", "triton", triton=(F8T + "amax_kernel", F8T + "tensor_cast_kernel"))
def _fp8_per_tensor(c):
    rec = fp8.DelayedScaling(history_len=4)
    state = fp8.DelayedScalingState(np.zeros(4, np.float32), np.float32(8.0))

    def make(impl):
        def f(x, st):
            q = fp8.quantize
            return (
                q(x, fp8.CurrentScaling(), "x", implementation=impl),  # amax pass + cast pass
                q(x, fp8.CurrentScaling(formats="e4m3", margin=1, power_of_2=True), "g", implementation=impl),
                # one pass with the state's scale, the amax recorded
                q(x, rec, "x", st, implementation=impl),
            )

        return f

    c.fwd(make, [c.normal((37, 129), "bfloat16", 3), state], "triton")


@case("fp8_dual_quantize_triton", "fp8", "triton", triton=(F8T + "dual_quantize_kernel",))
def _fp8_dual(c):
    from te_ops.fp8 import reference as ref

    def make(impl):
        def f(x, y):
            if impl == "reference":
                blocks = lambda a, b, fmt, p2: ref.quantize_blocks(a, b, fmt, power_of_2=p2)  # noqa: E731
                return (
                    (blocks(x, (1, 128), fp8.E4M3, True), blocks(x.T, (1, 128), fp8.E4M3, True)),
                    (blocks(x, (1, 128), fp8.E4M3, True), blocks(x.T, (128, 128), fp8.E4M3, True)),
                    (blocks(y, (1, 64), fp8.E5M2, False), blocks(y.T, (1, 64), fp8.E5M2, False)),
                )
            from te_ops.fp8 import triton as tri

            return (
                tri.dual_quantize(x, 128, fp8.E4M3, power_of_2=True),
                tri.dual_quantize(x, 128, fp8.E4M3, power_of_2=True, trans_wide=True, t_square=True),
                tri.dual_quantize(y, 64, fp8.E5M2, power_of_2=False),
            )

        return f

    c.fwd(make, [c.normal((130, 200), "bfloat16", 3), c.normal((37, 72), "float32", 3)], "triton")


@case(
    "fp8_dual_quantize_gluon_tma",
    "fp8",
    "triton (Gluon, TMA ring; te_ops.fp8.triton.DUAL_KERNEL = 'gluon')",
    triton=("te_ops.fp8.gluon_quantize.dual_quantize_tma_kernel",),
)
def _fp8_dual_gluon(c):
    """The Gluon dual quantize at partial tiles (272 x 400: R and C multiples of 16, not of 128), x^T
    in 1 x 128 tiles and in 128 x 128 blocks, E4M3 and E5M2."""
    from te_ops.fp8 import reference as ref

    def make(impl):
        def f(x):
            if impl == "reference":
                blocks = lambda a, b, fmt, p2: ref.quantize_blocks(a, b, fmt, power_of_2=p2)  # noqa: E731
                return (
                    (blocks(x, (1, 128), fp8.E4M3, True), blocks(x.T, (1, 128), fp8.E4M3, True)),
                    (blocks(x, (1, 128), fp8.E5M2, False), blocks(x.T, (128, 128), fp8.E5M2, False)),
                )
            from te_ops.fp8 import triton as tri

            with patched(tri, DUAL_KERNEL="gluon"):  # read when the call traces
                return (
                    tri.dual_quantize(x, 128, fp8.E4M3, power_of_2=True),
                    tri.dual_quantize(x, 128, fp8.E5M2, power_of_2=False, t_square=True),
                )

        return f

    c.fwd(make, [c.normal((272, 400), "bfloat16", 3)], "triton")


@case("fp8_requantize_t_triton", "fp8", "triton", triton=(F8T + "requantize_t_kernel",))
def _fp8_requantize(c):
    """FP8 rows in 1 x 128 tiles -> 1 x 128 tiles of the transpose (the FP8 dispatch's wgrad operand),
    partial tiles both ways, E4M3 with power-of-two scales and E5M2 without."""
    from te_ops.fp8 import reference as ref

    def make(impl):
        def f(x):
            out = []
            for fmt, p2 in ((fp8.E4M3, True), (fp8.E5M2, False)):
                q = ref.quantize_blocks(x, (1, 128), fmt, power_of_2=p2)
                if impl == "reference":
                    out.append(ref.quantize_blocks(ref.dequantize(q, jnp.float32).T, (1, 128), fmt, power_of_2=p2))
                else:
                    from te_ops.fp8 import triton as tri

                    out.append(tri.requantize_t(q, fmt, power_of_2=p2))
            return tuple(out)

        return f

    c.fwd(make, [c.normal((130, 200), "bfloat16", 3)], "triton")


@case(
    "fp8_dispatch_ffn_triton",
    "fp8",
    "triton (fused FFN activation kernels, requantize, Gluon / Triton grouped GEMMs)",
    triton=(F8T + "ffn_act_dual_quantize_kernel", F8T + "ffn_dact_dual_quantize_kernel", F8T + "requantize_t_kernel"),
)
def _fp8_dispatch_ffn(c):
    """te_ops.fp8.fp8_dispatch_ffn forward and backward (gated SiLU, F = 128, 4 experts top-2, 64
    tokens, one routed nowhere): every kernel of the fused expert FFN."""
    rng = np.random.default_rng(5)
    t, h, e, f = 64, 128, 4, 128
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :2], True, axis=1)
    rm[0] = False
    args = [c.normal((t, h), "bfloat16"), c.normal((e, h, 2 * f), "bfloat16", 1 / np.sqrt(h)),
            c.normal((e, f, h), "bfloat16", 1 / np.sqrt(f))]  # fmt: skip

    def make(impl):
        def fn(x, wi, wo):
            from te_ops.fp8 import dispatch as fd

            with patched(fd, REQUANTIZE_KERNEL=True):  # read when the call traces
                return fp8.fp8_dispatch_ffn(x, rm, 2 * t, wi, wo, activation="silu", implementation=impl).out

        return fn

    c.vjp(make, args, "triton", tol=5e-2, l2=True)


@case("fp8_dact_dbias_quantize_triton", "fp8", "triton", triton=(F8T + "dact_dbias_quantize_kernel",))
def _fp8_dact(c):
    dy = c.normal((37, 200), "bfloat16", 3)
    dy[:, 130:140] = 0  # a zero column run across tiles

    def make(impl):
        def f(dy, z):
            return tuple(
                fp8.dact_dbias_quantize(dy, z, fp8.BlockScaling(), activation=a, implementation=impl)
                for a in ("gelu", "relu")
            )

        return f

    c.fwd(make, [dy, c.normal((37, 200), "bfloat16", 2)], "triton", tol=3e-2)


def _fp8_dense(c: Ctx, x_shape, n, dtype, recipe, bias=False, act=None, state=None, tol=5e-2):
    k = x_shape[-1]
    args = [c.normal(x_shape, dtype), c.normal((k, n), dtype, 1 / np.sqrt(k))]
    if bias:
        args.append(c.normal((n,), dtype))
    if state is not None:
        args.append(state)

    def make(impl):
        def f(x, w, *rest):
            b = rest[0] if bias else None
            st = rest[-1] if state is not None else None
            return fp8.fp8_dense(x, w, recipe, bias=b, state=st, activation=act, implementation=impl)

        return f

    c.vjp(make, args, "triton", tol=tol, l2=True)


@case(
    "fp8_dense_block_gluon_bias_bf16",
    "fp8",
    "triton (Gluon GEMM)",
    triton=(
        F8T + "dual_quantize_kernel",
        F8T + "block_quantize_kernel",
        F8G + "grouped_block_scaled_gemm_split_kernel",
        F8T + "block_scaled_gemm_kernel",
    ),
)
def _fp8_dense_gluon(c):
    # forward through the Gluon kernel (one group); dx (reduction N = 136) and dw (reduction M = 37)
    # are not 16-byte TMA rows: the tiled Triton kernel
    _fp8_dense(c, (37, 256), 136, "bfloat16", fp8.BlockScaling(), bias=True)


@case(
    "fp8_dense_block_tiled_gelu_f16",
    "fp8",
    "triton (tiled GEMM)",
    triton=(
        F8T + "dual_quantize_kernel",
        F8T + "block_quantize_kernel",
        F8T + "block_scaled_gemm_kernel",
        F8T + "dact_dbias_quantize_kernel",
    ),
)
def _fp8_dense_tiled(c):
    from te_ops.fp8 import triton as tri

    with tri.kernel_override(dense="tiled"):
        _fp8_dense(c, (37, 200), 130, "float16", fp8.BlockScaling(), bias=True, act="gelu")


@case(
    "fp8_dense_block_persistent_bf16",
    "fp8",
    "triton (persistent GEMM)",
    triton=(F8T + "dual_quantize_kernel", F8T + "block_quantize_kernel", F8T + "grouped_block_scaled_gemm_kernel"),
)
def _fp8_dense_persistent(c):
    from te_ops.fp8 import triton as tri

    with tri.kernel_override(dense="persistent"):
        _fp8_dense(c, (3, 13, 256), 72, "bfloat16", fp8.BlockScaling())


@case(
    "fp8_dense_block_cublaslt_hybrid_bf16",
    "fp8",
    "triton (cuBLASLt block-scaled GEMM)",
    triton=(F8T + "dual_quantize_kernel", F8T + "block_quantize_kernel"),
    targets=("te_fp8_cublaslt_block_gemm",),
    native=("FillFp8UniformKernel", "FillUniformKernel"),  # scratch operands / scales of the plan timing
    library=("cuBLASLt FP8 block-scaled GEMM (VEC128 x BLK128x128)",),
)
def _fp8_dense_cublaslt(c):
    # all three GEMMs through cuBLASLt (M, N multiples of 4, every reduction a multiple of 16:
    # forward K 640 (5 scale columns, padded to 8), dgrad K 144, wgrad K 48); hybrid: E5M2 gradients
    from te_ops._core.registry import ImplementationUnavailableError
    from te_ops.fp8 import cublaslt
    from te_ops.fp8 import triton as tri

    why = None if c.dry else cublaslt.unavailable_reason(48, 144, 640, jnp.bfloat16, a_dtype=fp8.E4M3,
                                                         b_dtype=fp8.E4M3)  # fmt: skip
    if why:
        raise ImplementationUnavailableError(f"the cuBLASLt block-scaled GEMM route: {why}")
    with tri.kernel_override(dense="cublaslt"):
        _fp8_dense(c, (48, 640), 144, "bfloat16", fp8.BlockScaling(formats="hybrid"))


@case(
    "fp8_dense_current_triton_quant_bf16",
    "fp8",
    "triton (per-tensor kernels)",
    triton=(F8T + "amax_kernel", F8T + "tensor_cast_kernel"),
    library=("cuBLASLt FP8 GEMM (XLA)",),
)
def _fp8_dense_current(c):
    from te_ops.fp8 import dense as fd

    with patched(fd, CURRENT_TRITON_QUANT=True):  # our amax + cast kernels instead of XLA's fusion
        _fp8_dense(c, (48, 64), 32, "bfloat16", fp8.CurrentScaling())


@case(
    "fp8_dense_delayed_triton_cast_bf16",
    "fp8",
    "triton (per-tensor kernels)",
    triton=(F8T + "tensor_cast_kernel",),
    library=("cuBLASLt FP8 GEMM (XLA)",),
)
def _fp8_dense_delayed(c):
    from te_ops.fp8 import dense as fd

    rec = fp8.DelayedScaling(history_len=4)
    st = fp8.initial_dense_state(rec)
    st = fp8.DenseScalingState(
        *(
            fp8.DelayedScalingState(np.asarray(s.amax_history), np.float32(v))
            for s, v in zip((st.x, st.w, st.g), (16.0, 64.0, 32.0), strict=True)
        )
    )
    with patched(fd, DELAYED_TRITON_CAST=True):  # our one-pass cast kernel instead of XLA's fusion
        _fp8_dense(c, (32, 64), 48, "bfloat16", rec, state=st)


def _fp8_grouped(c: Ctx, m, k, n, sizes, dtype, recipe, state=None, tol=5e-2):
    g = len(sizes)
    args = [c.normal((m, k), dtype), c.normal((g, k, n), dtype, 1 / np.sqrt(k)), np.asarray(sizes, np.int32)]
    if state is not None:
        args.append(state)

    def make(impl):
        def f(x, w, s, *st):
            return fp8.fp8_grouped_dense(x, w, s, recipe, state=st[0] if st else None, implementation=impl)

        return f

    c.vjp(make, args, "triton", argnums=(0, 1, 3) if state is not None else (0, 1), tol=tol, l2=True)


@case(
    "fp8_grouped_dense_block_bf16",
    "fp8",
    "triton (Gluon + Triton grouped GEMMs)",
    triton=(
        F8T + "dual_quantize_kernel",
        F8T + "block_quantize_kernel",
        F8G + "grouped_block_scaled_gemm_split_kernel",
        F8T + "grouped_block_scaled_gemm_kernel",
        F8T + "grouped_block_scaled_wgrad_kernel",
    ),
)
def _fp8_grouped_block(c):
    # forward through the Gluon kernel; dx (reduction N = 136, not 16-byte TMA rows) through the Triton one
    _fp8_grouped(c, 45, 256, 136, [20, 0, 17], "bfloat16", fp8.BlockScaling())


@case(
    "fp8_grouped_dense_current_f16",
    "fp8",
    "triton (per-tensor kernels, Gluon GEMM)",
    triton=(
        F8T + "amax_kernel",
        F8T + "tensor_cast_kernel",
        F8G + "grouped_block_scaled_gemm_split_kernel",
        F8T + "grouped_block_scaled_wgrad_kernel",
    ),
)
def _fp8_grouped_current(c):
    _fp8_grouped(c, 37, 128, 64, [30, 5], "float16", fp8.CurrentScaling())  # one scale per expert (batched)


@case(
    "fp8_grouped_dense_delayed_bf16",
    "fp8",
    "triton (per-tensor kernels, Gluon GEMM)",
    triton=(
        F8T + "tensor_cast_kernel",
        F8G + "grouped_block_scaled_gemm_split_kernel",
        F8T + "grouped_block_scaled_wgrad_kernel",
    ),
)
def _fp8_grouped_delayed(c):
    rec = fp8.DelayedScaling(history_len=4)
    st = jax.tree.map(np.asarray, fp8.initial_grouped_state(rec, 3))
    _fp8_grouped(c, 37, 128, 80, [0, 20, 10], "bfloat16", rec, state=st)


def _fp8_grouped_gluon(c, scales_tma):
    from te_ops.fp8 import grouped as fg
    from te_ops.fp8 import reference as ref

    sizes = np.asarray([0, 19, 20], np.int32)  # sum 39 < M = 45: rows past the groups are zero
    x, w_t = jax.device_put((c.normal((45, 272), "bfloat16"), c.normal((3, 136, 272), "bfloat16", 1 / 16)), c.cpu)
    qa = jax.jit(lambda x: ref.quantize_blocks(x, (1, 128), fp8.E5M2, power_of_2=True))(x)  # on the CPU
    qb = jax.jit(lambda w: ref.quantize_blocks(w, (128, 128), fp8.E4M3, power_of_2=True))(w_t)
    qa, qb = jax.tree.map(np.asarray, (qa, qb))

    def make(impl):
        def f(qa, qb, s):
            if impl == "reference":
                return fg._grouped_reference(qa, qb, s, jnp.float32)
            from te_ops.fp8 import triton as tri

            cfg = ("gluon", *tri.GLUON_GEMM_CONFIG, scales_tma)  # E5M2 activations, partial tiles
            return tri.grouped_block_scaled_gemm(qa, qb, s, jnp.float32, config=cfg)

        return f

    c.fwd(make, [qa, qb, sizes], "triton", tol=1e-2)


@case(
    "fp8_grouped_gemm_gluon_e5m2",
    "fp8",
    "triton (Gluon warp-specialized)",
    triton=(F8G + "grouped_block_scaled_gemm_split_kernel",),
)
def _fp8_grouped_gluon_e5m2(c):
    _fp8_grouped_gluon(c, scales_tma=False)


@case(
    "fp8_grouped_gemm_gluon_scales_tma_e5m2",
    "fp8",
    "triton (Gluon warp-specialized, A scales through the TMA ring: rank-1 descriptor, zero fill past M)",
    triton=(F8G + "grouped_block_scaled_gemm_split_kernel",),
)
def _fp8_grouped_gluon_scales_tma_e5m2(c):
    _fp8_grouped_gluon(c, scales_tma=True)


# ----------------------------------------------------------------------------------------------
# Canary: proves that a --kernel-name filter matches Triton kernels launched through jaxlib
# ----------------------------------------------------------------------------------------------


def canary_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def te_sanitize_canary_kernel(x_ptr, far, out_ptr):
        # a 4-byte load one byte into x (misaligned) and one far outside every allocation: memcheck
        # reports them precisely when the kernel is checked (and a GPU without the sanitizer faults)
        p = (x_ptr.to(tl.pointer_type(tl.int8)) + 1).to(tl.pointer_type(tl.int32))
        tl.store(out_ptr, tl.load(p) + tl.load(x_ptr + far))

    return te_sanitize_canary_kernel


def run_canary() -> int:
    _load()
    kernel = canary_kernel()
    x = jax.device_put(np.arange(1024, dtype=np.int32), jax.devices("cuda")[0])
    fn = jax.jit(
        lambda x: tb.triton_call(
            kernel, x, np.int64(1 << 36), grid=(1,), num_warps=1, out_shape=[jax.ShapeDtypeStruct((1,), jnp.int32)]
        )[0]
    )
    print("SANITIZE-CANARY launching", CANARY, flush=True)
    try:
        jax.block_until_ready(fn(x))
        print("SANITIZE-CANARY returned", flush=True)
    except Exception as e:  # the sanitizer terminated the kernel (or the GPU faulted): expected
        print(f"SANITIZE-CANARY raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# Kernel inventory (source scan: no Triton, no build needed)
# ----------------------------------------------------------------------------------------------


@functools.cache
def triton_kernels() -> dict[str, str]:
    """{module.function: function} of every @triton.jit / @gluon.jit kernel of te_ops (entry points:
    the functions named ``*_kernel``; helpers start with "_" or have other names)."""
    out = {}
    for path in sorted((ROOT / "te_ops").rglob("*.py")):
        tree = ast.parse(path.read_text())
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not node.name.endswith("_kernel"):
                continue
            for d in node.decorator_list:
                if (
                    isinstance(d, ast.Attribute)
                    and d.attr == "jit"
                    and getattr(d.value, "id", "") in ("triton", "gluon")
                ):
                    out[f"{mod}.{node.name}"] = node.name
    return out


_GLOBAL = r"__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)"


def native_kernels() -> list[str]:
    """Names of the ``__global__`` functions in csrc/."""
    names = set()
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h", ".cc"):
            text = path.read_text()
            names.update(re.findall(_GLOBAL, text))
    return sorted(names)


# Our native kernels all live in namespace te (mangled names start with _ZN2te<n>); Triton/Gluon
# kernels keep their Python function name (optionally followed by a suffix).
NATIVE_REGEX = "^_ZN2te[0-9]"


@functools.cache
def triton_regex() -> str:
    names = sorted(set(triton_kernels().values()) | {CANARY})
    return "^(" + "|".join(names) + ")"


def is_ours(kernel: str) -> bool:
    """Whether a kernel name from a sanitizer report (mangled or demangled) is one of ours."""
    if re.match(NATIVE_REGEX, kernel) or re.search(r"(^|[\s(<,*&])te::", kernel):
        return True
    bare = re.split(r"[(<\s+]", kernel.strip(), maxsplit=1)[0]
    return re.match(triton_regex(), bare) is not None


# ----------------------------------------------------------------------------------------------
# Running cases
# ----------------------------------------------------------------------------------------------


def select(patterns: Iterable[str]) -> list[str]:
    pats = [p for pat in patterns for p in re.split(r"[,\s]+", pat) if p]
    names = []
    for p in pats:
        hit = [n for n in CASES if fnmatch.fnmatchcase(n, p)]
        if not hit:
            raise SystemExit(f"sanitize_cases: no case matches {p!r} (see --list)")
        names += [n for n in hit if n not in names]
    return [n for n in CASES if n in names]


def _record_launches() -> set[str]:
    """Wraps the bridge's compile_kernel (called for every launch it lowers) to record the kernels."""
    seen: set[str] = set()
    orig = tb.compile_kernel

    def recording(spec, target):
        fn = getattr(spec.fn, "fn", spec.fn)
        seen.add(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}")
        return orig(spec, target)

    tb.compile_kernel = recording
    return seen


# CUDA errors that leave the context unusable: every later launch in the process fails with them
_STICKY = re.compile(
    r"ILLEGAL_ADDRESS|illegal memory access|ILLEGAL_INSTRUCTION|illegal instruction|MISALIGNED_ADDRESS|"
    r"misaligned address|LAUNCH_FAILED|unspecified launch failure|hardware exception|HARDWARE_STACK_ERROR"
)


def context_lost(reason: str) -> bool:
    """Whether a failed case's error is a sticky CUDA error (the process must not run more cases)."""
    return _STICKY.search(reason) is not None


def run_cases(names: list[str], dry: bool, case_timeout: float) -> int:
    _load()
    from te_ops._core.registry import ImplementationUnavailableError

    print(f"SANITIZE-ENV jax {jax.__version__} devices {jax.devices()} dry_run={dry}", flush=True)
    env = {k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_PREALLOCATE")}
    print(f"SANITIZE-ENV {env}", flush=True)
    print(f"SANITIZE-ENV native {sorted(native._loaded)} missing {sorted(native._errors)}", flush=True)
    launched = _record_launches()
    counts = {"OK": 0, "FAIL": 0, "UNAVAILABLE": 0}
    t_all = time.perf_counter()
    for name in names:
        c = CASES[name]
        print(f"SANITIZE-BEGIN {name}", flush=True)
        t0 = time.perf_counter()
        timer = None
        if case_timeout > 0:
            timer = threading.Timer(case_timeout, _watchdog, (name, t0))
            timer.daemon = True
            timer.start()
        launched.clear()
        jax.clear_caches()  # trace-time switches (tunings, kernel overrides) must not reuse other cases' traces
        ctx = Ctx(name, dry)
        status, reason = "OK", ""
        try:
            c.run(ctx)
            ctx.check_launched(c, launched)
        except ImplementationUnavailableError as e:
            status, reason = "UNAVAILABLE", str(e)
        except Exception as e:
            status, reason = "FAIL", f"{type(e).__name__}: {e}"
            if not isinstance(e, CaseFailure):
                traceback.print_exc(file=sys.stdout)
        finally:
            if timer is not None:
                timer.cancel()
        counts[status] += 1
        reason = " ".join(reason.split())[:400]
        print(f"SANITIZE-END {name} {status} {time.perf_counter() - t0:.1f} {reason}".rstrip(), flush=True)
        if status == "FAIL" and context_lost(reason):
            # every later case in this process would fail on the sticky error (seen under racecheck on the
            # H200, 2026-12-06): stop without SANITIZE-DONE, so scripts/sanitize.sh resumes the cases not
            # begun in a fresh process and the report counts this case as the crash
            print(f"SANITIZE-ABORT {name}: the CUDA context is unusable after this failure", flush=True)
            return 1
    print(
        f"SANITIZE-DONE ok={counts['OK']} fail={counts['FAIL']} unavailable={counts['UNAVAILABLE']} "
        f"seconds={time.perf_counter() - t_all:.1f}",
        flush=True,
    )
    if counts["FAIL"]:
        return 1
    return 4 if counts["UNAVAILABLE"] else 0


def _watchdog(name: str, t0: float) -> None:
    print(f"SANITIZE-END {name} TIMEOUT {time.perf_counter() - t0:.1f} the case ran past --case-timeout", flush=True)
    sys.stdout.flush()
    os._exit(5)


# ----------------------------------------------------------------------------------------------
# Reading compute-sanitizer logs
# ----------------------------------------------------------------------------------------------

_PREFIX = re.compile(r"^=+ ?(.*)$")
_NOT_REPORTS = re.compile(
    r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Target application returned|"
    r"Saved host backtrace|Device Frame|Host Frame|Program hit .*cuGetProcAddress)"
)
_AT = re.compile(r"(?:^|\s)at (.+?)\+0x[0-9a-fA-F]+")  # "at kernel+0x1a0", "Write Thread (1,0,0) at kernel+0x2f0"
_RACE = re.compile(r"Race reported between \w+ access at (.+?)\+0x[0-9a-fA-F]+")


def summarize(text: str) -> dict[str, Any]:
    """Parses one log (compute-sanitizer's "=========" lines interleaved with the driver's output).

    Returns ``errors`` (ERROR SUMMARY, or racecheck's hazards when larger; None without a summary:
    the process did not finish under the tool), ``reports`` ([header, kernel or None, ours]),
    ``begun`` / ``ended`` ({case: [status, seconds, reason]}), ``done`` (SANITIZE-DONE seen),
    ``internal`` (sanitizer internal errors), ``canary`` (a precise report in the canary kernel)."""
    errors = hazards = None
    reports: list[list[Any]] = []
    begun: list[str] = []
    ended: dict[str, list[Any]] = {}
    done = False
    internal = 0
    current = None
    for line in text.splitlines():
        if line.startswith("SANITIZE-BEGIN "):
            begun.append(line.split()[1])
            continue
        if line.startswith("SANITIZE-END "):
            parts = line.split(maxsplit=4)
            if len(parts) >= 4:
                ended[parts[1]] = [
                    parts[2],
                    float(parts[3]) if _isfloat(parts[3]) else 0.0,
                    parts[4] if len(parts) > 4 else "",
                ]
            continue
        if line.startswith("SANITIZE-DONE"):
            done = True
            continue
        m = _PREFIX.match(line)
        if not m or not line.startswith("========="):
            continue
        body = m.group(1)
        if (s := re.search(r"ERROR SUMMARY: (\d+) error", body)) is not None:
            errors = int(s.group(1)) + (errors or 0)
            continue
        if (s := re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed", body)) is not None:
            hazards = int(s.group(1)) + (hazards or 0)
            continue
        if not body.strip():
            current = None
            continue
        if body.startswith((" ", "\t")):  # a detail line of the current report
            if current is not None and current[1] is None and (a := _AT.search(body)):
                current[1] = a.group(1).strip()
                current[2] = is_ours(current[1])
            continue
        if _NOT_REPORTS.match(body):
            continue
        if "Internal Sanitizer Error" in body:
            internal += 1
        current = [body.strip()[:200], None, False]
        if (r := _RACE.search(body)) is not None:
            current[1], current[2] = r.group(1).strip(), is_ours(r.group(1))
        reports.append(current)
    total = errors
    if hazards is not None:
        total = max(total or 0, hazards)
    canary = any(k and CANARY in k and re.search(r"Invalid __global__ (read|write)", h) for h, k, _ in reports)
    return dict(errors=total, reports=reports, begun=begun, ended=ended, done=done, internal=internal, canary=canary)


def _isfloat(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def remaining(logs: list[pathlib.Path], planned: list[str]) -> list[str]:
    """Planned cases that no log shows as begun (a crashed or timed-out run is resumed after them)."""
    begun = set()
    for log in logs:
        s = summarize(log.read_text(errors="replace"))
        if s["done"]:
            return []
        begun.update(s["begun"])
    return [n for n in planned if n not in begun]


def tool_logs(logdir: pathlib.Path, tool: str) -> list[pathlib.Path]:
    parts = sorted(logdir.glob(f"{tool}.part*.log"), key=lambda p: int(re.findall(r"part(\d+)", p.name)[0]))
    first = logdir / f"{tool}.log"
    return ([first] if first.exists() else []) + parts


def report(
    logdir: pathlib.Path,
    tools: list[str],
    planned: list[str],
    skipped: list[str],
    filtered: list[str],
    canary_log: pathlib.Path | None,
    deadline: str,
) -> int:
    """Prints the summary table of a sanitize.sh run; returns its exit status: 1 errors reported or a
    case failed, 2 a tool crashed or could not run, 3 incomplete (tools skipped or cut by the
    deadline, cases never reached or unavailable, or a kernel filter that could not be verified),
    0 clean."""
    canary = None
    if canary_log is not None:
        canary = canary_log.exists() and summarize(canary_log.read_text(errors="replace"))["canary"]
    rows, exit_code, details = [], 0, []

    def worst(code: int) -> None:
        nonlocal exit_code
        order = {0: 0, 3: 1, 2: 2, 1: 3}
        if order[code] > order[exit_code]:
            exit_code = code

    for tool in tools:
        if tool in skipped:
            rows.append([tool, "SKIPPED", f"0/{len(planned)}", "-", "-", f"deadline {deadline}s"])
            worst(3)
            continue
        logs = tool_logs(logdir, tool)
        meta = logdir / f"{tool}.meta"
        meta_lines = meta.read_text().splitlines() if meta.exists() else []
        fields = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in meta_lines]
        seconds = sum(float(f.get("seconds", 0)) for f in fields)
        rc_of = {int(f["part"]): int(f["rc"]) for f in fields if "part" in f and "rc" in f}
        timed_out = any(rc in (124, 137) for rc in rc_of.values())
        if not logs:
            rows.append([tool, "NOT RUN", f"0/{len(planned)}", "-", f"{seconds:.0f}", "no log"])
            worst(2)
            continue
        errors, ours, other, host, internal, crashed_parts = 0, 0, 0, 0, 0, 0
        ended: dict[str, list[Any]] = {}
        begun: set[str] = set()
        kernels: dict[str, int] = {}
        for log in logs:
            s = summarize(log.read_text(errors="replace"))
            begun.update(s["begun"])
            ended.update(s["ended"])
            internal += s["internal"]
            part = int(re.findall(r"part(\d+)", log.name)[0]) if "part" in log.name else 1
            watchdog = any(v[0] == "TIMEOUT" for n, v in s["ended"].items())
            # a process that neither finished its cases nor was stopped (deadline, case watchdog) crashed
            if not s["done"] and rc_of.get(part) not in (124, 137) and not watchdog:
                crashed_parts += 1
            errors += s["errors"] or 0
            for header, kernel, is_our in s["reports"]:
                if kernel is None:
                    host += 1
                elif is_our:
                    ours += 1
                else:
                    other += 1
                key = f"{kernel or '(no kernel: host/API)'} | {header[:90]}"
                kernels[key] = kernels.get(key, 0) + 1
        status_of = {n: v[0] for n, v in ended.items()}
        ok = sum(1 for n in planned if status_of.get(n) == "OK")
        failed = [n for n in planned if status_of.get(n) in ("FAIL", "TIMEOUT")]
        unavailable = [n for n in planned if status_of.get(n) == "UNAVAILABLE"]
        crashed = [n for n in planned if n in begun and n not in ended]
        not_run = [n for n in planned if n not in begun]
        if errors or failed:
            status, code = "ERRORS", 1
        elif crashed or crashed_parts or internal:
            status, code = "CRASH", 2
        elif not_run or timed_out:
            status, code = "INCOMPLETE", 3
        elif unavailable:
            status, code = "UNAVAILABLE", 3
        elif tool in filtered and canary is not True:
            status, code = "UNVERIFIED", 3
        else:
            status, code = "CLEAN", 0
        worst(code)
        note = []
        if tool in filtered:
            note.append("our kernels only" + ("" if canary else " (filter NOT verified)"))
        if timed_out:
            note.append("cut by the deadline")
        if crashed:
            note.append(f"crashed in {','.join(crashed)}")
        elif crashed_parts:
            note.append("a process ended before its cases did (see the log)")
        if not_run:
            note.append(f"{len(not_run)} cases not reached")
        if unavailable:
            note.append(f"unavailable: {','.join(unavailable)}")
        if internal:
            note.append(f"{internal} internal sanitizer errors")
        rows.append(
            [
                tool,
                status,
                f"{ok}/{len(planned)}",
                f"{errors} ({ours}/{other}/{host})",
                f"{seconds:.0f}",
                "; ".join(note),
            ]
        )
        for n in failed:
            details.append(f"{tool}: case {n} {status_of[n]}: {ended[n][2]}")
        slow = sorted(ended.items(), key=lambda kv: -kv[1][1])[:5]
        if slow:
            details.append(f"{tool}: slowest cases: " + ", ".join(f"{n} {v[1]:.0f}s" for n, v in slow))
        for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]):
            details.append(f"{tool}: {v} x {k}")
    head = ["tool", "status", "cases ok", "errors (ours/other/host)", "seconds", "notes"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print("=== compute-sanitizer summary ===")
    for r in [head, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    if canary_log is not None:
        print(
            f"kernel filter canary: {'matched (precise report in ' + CANARY + ')' if canary else 'NOT matched'}"
            f" ({canary_log.name})"
        )
    print(
        "errors: ours = in te_ops kernels (namespace te / our Triton and Gluon kernels); other = XLA, cuBLAS,"
        " cuDNN kernels; host = reports without a kernel (API calls, e.g. a device-to-host copy of unwritten"
        " bytes under initcheck)"
    )
    for d in details[:200]:
        print("  " + d)
    print(f"sanitize exit status {exit_code} (0 clean, 1 errors, 2 crash, 3 incomplete/skipped)")
    return exit_code


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.gpu.sanitize_cases", description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the cases with the kernels they cover")
    p.add_argument("--names", action="store_true", help="print the selected case names, one per line")
    p.add_argument(
        "--case", action="append", default=[], help="case name or fnmatch pattern (repeatable, comma-separated)"
    )
    p.add_argument("--all", action="store_true", help="every case")
    p.add_argument("--cpu-dry-run", action="store_true", help="run on the CPU with every implementation = reference")
    p.add_argument("--case-timeout", type=float, default=0.0, help="end the process when one case runs longer")
    p.add_argument("--canary", action="store_true", help="launch the deliberately bad canary kernel")
    p.add_argument("--kernel-regex", action="store_true", help="print the regex of our Triton/Gluon kernel names")
    p.add_argument("--remaining", nargs="+", metavar="LOG", help="print the selected cases no LOG shows as begun")
    p.add_argument("--report", metavar="DIR", help="print the summary table of the logs in DIR")
    p.add_argument("--tools", default="memcheck racecheck initcheck synccheck")
    p.add_argument("--skipped", default="", help="tools skipped for the deadline (--report)")
    p.add_argument("--filtered", default="", help="tools run with the kernel filter (--report)")
    p.add_argument("--canary-log", default=None)
    p.add_argument("--deadline", default="?")
    a = p.parse_args(argv)
    words = lambda s: [w for w in re.split(r"[,\s]+", s or "") if w]  # noqa: E731

    if a.kernel_regex:
        print(triton_regex())
        return 0
    names = select(a.case) if a.case else list(CASES)
    if a.list:
        for n in names:
            c = CASES[n]
            print(f"{n}\n    family={c.family} implementation={c.impl}\n    kernels: {', '.join(c.kernels())}")
        return 0
    if a.names:
        print("\n".join(names))
        return 0
    if a.remaining:
        rest = remaining([pathlib.Path(x) for x in a.remaining], names)
        if rest:
            print("\n".join(rest))
        return 0
    if a.report:
        return report(
            pathlib.Path(a.report),
            words(a.tools),
            names,
            words(a.skipped),
            words(a.filtered),
            pathlib.Path(a.canary_log) if a.canary_log else None,
            a.deadline,
        )
    if a.canary:
        configure_environment()
        return run_canary()
    if not (a.all or a.case):
        p.error("give --list, --case NAME, --all or --canary")
    if a.cpu_dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        configure_environment()
    return run_cases(names, a.cpu_dry_run, a.case_timeout)


if __name__ == "__main__":
    sys.exit(main())
