"""Diagnose a crash in te_fused_attention_query: print the loaded libraries, then query one config."""
import ctypes, os, sys
import te_ops  # noqa: F401
from te_ops.fused_attention import native as fa
from te_ops._core import native
native.ensure_registered()
mod = __import__("te_ops._native_cudnn", fromlist=["x"])
print("module:", mod.__file__, flush=True)
lib = ctypes.CDLL(mod.__file__)
with open("/proc/self/maps") as f:
    libs = sorted({l.split()[-1] for l in f if any(s in l for s in ("cudnn", "stdc++", "nvrtc", "libcuda", "_native", "pjrt", "xla_cuda", "libc++"))})
print("\n".join(libs), flush=True)
try:
    cud = ctypes.CDLL("libcudnn.so.9")
    cud.cudnnGetVersion.restype = ctypes.c_size_t
    print("cudnnGetVersion:", cud.cudnnGetVersion(), flush=True)
except OSError as e:
    print("libcudnn.so.9:", e)
import jax, jax.numpy as jnp
print(jax.devices(), flush=True)
cfg = fa._graph_config(dtype=jnp.bfloat16, q_shape=(2, 128, 4, 64), k_shape=(2, 128, 4, 64), v_shape=(2, 128, 4, 64),
                       bias_shape=None, has_segments=False, mask_type=sys.argv[1] if len(sys.argv) > 1 else "none", window=None)
for bwd in (False, True):
    print("query", "bwd" if bwd else "fwd", fa.query(fa._ints(cfg, bwd), 0.125, 0.0), flush=True)
