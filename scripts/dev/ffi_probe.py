"""Probe: register te_ops softmax handlers under fresh names with different stage sets and call them.
Usage: python scripts/dev/ffi_probe.py {exec_only|init_exec}"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from te_ops import _native

mode = sys.argv[1]
regs = _native.registrations()
st = regs["te_softmax_fwd"]
stages = {"execute": st["execute"]} if mode == "exec_only" else dict(st)
name = f"probe_{mode}"
jax.ffi.register_ffi_target(name, stages, platform="CUDA", api_version=1)
x = jax.random.normal(jax.random.key(0), (4, 256), jnp.float32)
f = jax.jit(
    lambda x: jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, scale=np.float32(1.0), mode=np.int32(0))
)
print("lowered ok", flush=True)
y = f(x)
print("ran", flush=True)
print(float(jnp.abs(y - jax.nn.softmax(x)).max()), flush=True)
print(_native.counters(), flush=True)
