"""How ``implementation=None`` picks an FP8 implementation.

On a CUDA GPU with FP8 tensor cores (compute capability >= 8.9; the kernels are tuned for Hopper)
and a usable Triton, ``None`` stages the Triton path for CUDA and the reference for every other
platform with :func:`jax.lax.platform_dependent`, so one jitted function runs on CPU and GPU.
Elsewhere ``None`` is the reference. Both compute the same numbers (docs/semantics.md, "FP8
quantization"): the quantized bytes exactly, the GEMMs up to float32 summation order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

MIN_CAPABILITY = (8, 9)


@functools.cache
def triton_fp8_unavailable_reason() -> str | None:
    """None when the Triton FP8 kernels can run in this process, else why not."""
    from te_ops._core import native
    from te_ops._core import triton_bridge as tb

    why = native.cuda_device_unavailable_reason() or tb.unavailable_reason()
    if why:
        return why
    dev = jax.devices("cuda")[0]
    cc = str(getattr(dev, "compute_capability", "0.0"))
    try:
        major, minor = (int(p) for p in cc.split(".")[:2])
    except ValueError:
        return f"unknown compute capability {cc!r}"
    if (major, minor) < MIN_CAPABILITY:
        return f"FP8 tensor cores need compute capability >= 8.9, the GPU has {cc}"
    return None


def resolve(implementation: str | None) -> str:
    """``"auto"`` for None where the Triton path can run, else the name asked for (None: reference)."""
    if implementation is not None:
        return implementation
    return "auto" if triton_fp8_unavailable_reason() is None else "reference"


def staged(fn: Callable[[str], Callable[..., Any]], implementation: str) -> Callable[..., Any]:
    """``fn(name)`` for a concrete implementation; for ``"auto"`` the Triton function on CUDA and
    the reference elsewhere (both must return the same pytree of the same shapes and dtypes)."""
    if implementation != "auto":
        return fn(implementation)

    def run(*args):
        return jax.lax.platform_dependent(*args, cuda=fn("triton"), default=fn("reference"))

    return run
