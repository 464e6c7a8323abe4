"""The vendor-specific half of the Triton bridge (see ``triton_bridge.py``).

Everything that differs between NVIDIA (CUDA, cubin from PTX) and AMD (ROCm, HSACO) sits behind
the small :class:`VendorBackend` interface:

* ``target(device)``: the Triton ``GPUTarget`` triple ``(backend, arch, warp_size)`` of a JAX device;
* ``kernel_image(compiled)``: what jaxlib's ``gpu_triton.TritonKernel`` takes in its ``ptx`` slot;
* ``compute_capability(target)``: the integer jaxlib stores with the kernel.

CUDA hands jaxlib the PTX text. jaxlib's ``triton_kernel_call_ffi`` handler assembles it with ptxas
for the exact device in its ``instantiate`` stage (once per (kernel, PTX, compute capability), under
its own lock, cached process-wide), so the image always matches the device XLA runs on. Triton 3.6
emits PTX ISA 8.7 (its bundled ptxas is CUDA 12.8); the CUDA 13 ptxas that jax-cuda13-plugin uses
accepts it.

ROCm: jaxlib's loader expects a *path* to an HSACO file which it reads and then deletes. Two
lowerings handing it the same path would race (the second reader finds the file gone), so every
call to ``kernel_image`` writes a fresh uniquely named file. This half is written from jaxlib's
source but has never run: there is no AMD GPU to test it on.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Protocol

Target = tuple[str, Any, int]  # (backend, arch, warp_size), the fields of triton's GPUTarget


class VendorBackend(Protocol):
    name: str  # Triton backend name: "cuda" or "hip"
    jax_platform: str  # JAX platform name: "cuda" or "rocm"

    def target(self, device: Any) -> Target: ...

    def kernel_image(self, compiled: Any) -> str: ...

    def compute_capability(self, target: Target) -> int: ...


class CudaBackend:
    name = "cuda"
    jax_platform = "cuda"

    def target(self, device: Any) -> Target:
        cc = getattr(device, "compute_capability", None)
        if cc is None:
            raise RuntimeError(f"te_ops triton bridge: cannot read the compute capability of {device!r}")
        major, minor = str(cc).split(".")[:2]
        return ("cuda", int(major) * 10 + int(minor), 32)

    def kernel_image(self, compiled: Any) -> str:
        return compiled.asm["ptx"]

    def compute_capability(self, target: Target) -> int:
        return int(target[1])


class RocmBackend:  # pragma: no cover - cannot run here (no AMD GPU); see module docstring
    name = "hip"
    jax_platform = "rocm"

    def target(self, device: Any) -> Target:
        from jax._src.lib import gpu_triton

        arch = gpu_triton.get_arch_details(getattr(device, "local_hardware_id", 0) or 0).split(":")[0]
        return ("hip", arch, 64)

    def kernel_image(self, compiled: Any) -> str:
        fd, path = tempfile.mkstemp(prefix=f"te_ops_{compiled.name}_", suffix=".hsaco")
        with os.fdopen(fd, "wb") as f:
            f.write(compiled.asm["hsaco"])
        return path  # jaxlib reads, then deletes, this file

    def compute_capability(self, target: Target) -> int:
        return 0


_BACKENDS: dict[str, VendorBackend] = {"cuda": CudaBackend(), "rocm": RocmBackend()}


def for_platform(platform: str) -> VendorBackend:
    try:
        return _BACKENDS[platform]
    except KeyError:
        raise NotImplementedError(
            f"te_ops triton bridge: no vendor backend for JAX platform {platform!r}; expected 'cuda' or 'rocm'"
        ) from None
