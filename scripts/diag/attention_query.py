"""Diagnose a crash in te_fused_attention_query: print the loaded libraries, then query one config."""

import ctypes
import sys

import jax
import jax.numpy as jnp

import te_ops  # noqa: F401
from te_ops._core import native
from te_ops.fused_attention import native as fa

native.ensure_registered()
mod = __import__("te_ops._native_cudnn", fromlist=["x"])
print("module:", mod.__file__, flush=True)
KEYS = ("cudnn", "stdc++", "nvrtc", "libcuda", "_native", "pjrt", "xla_cuda", "libc++")
with open("/proc/self/maps") as f:
    libs = sorted({line.split()[-1] for line in f if any(s in line for s in KEYS)})
print("\n".join(libs), flush=True)
try:
    cud = ctypes.CDLL("libcudnn.so.9")
    cud.cudnnGetVersion.restype = ctypes.c_size_t
    print("cudnnGetVersion:", cud.cudnnGetVersion(), flush=True)
except OSError as e:
    print("libcudnn.so.9:", e)
print(jax.devices(), flush=True)
mask_type = sys.argv[1] if len(sys.argv) > 1 else "none"
shape = (2, 128, 4, 64)
cfg = fa._graph_config(dtype=jnp.bfloat16, q_shape=shape, k_shape=shape, v_shape=shape, bias_shape=None,
                       has_segments=False, mask_type=mask_type, window=None)  # fmt: skip
for bwd in (False, True):
    print("query", "bwd" if bwd else "fwd", fa.query(fa._ints(cfg, bwd), 0.125, 0.0), flush=True)
