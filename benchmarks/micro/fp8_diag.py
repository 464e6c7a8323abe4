"""Diagnostic (GPU): where do fp8_dense's Triton and reference paths part? Prints max |diff| of y
between the Triton path, the reference path jitted on the GPU, the reference path on the CPU and an
unquantized float32 GEMM, and which FP8/convert ops XLA kept in the optimized GPU reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from te_ops import fp8

cpu = jax.devices("cpu")[0]
k = jax.random.split(jax.random.key(5), 3)
x = jax.random.normal(k[0], (2048, 1024), jnp.bfloat16)
w = (jax.random.normal(k[1], (1024, 768), jnp.float32) / 32).astype(jnp.bfloat16)


def f(impl):
    return jax.jit(lambda x, w: fp8.fp8_dense(x, w, fp8.BlockScaling(), implementation=impl))


ys = {
    "triton": np.asarray(f("triton")(x, w), np.float32),
    "ref_gpu": np.asarray(f("reference")(x, w), np.float32),
    "ref_cpu": np.asarray(f("reference")(jax.device_put(x, cpu), jax.device_put(w, cpu)), np.float32),
    "f32": np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")),
}
names = list(ys)
print("max|y| =", float(np.max(np.abs(ys["f32"]))))
for i, a in enumerate(names):
    for b in names[i + 1 :]:
        print(f"max|{a} - {b}| = {float(np.max(np.abs(ys[a] - ys[b]))):.4g}")

hlo = f("reference").lower(x, w).compile().as_text()
print("optimized GPU reference HLO: lines with f8:", sum("f8" in ln for ln in hlo.splitlines()))
for ln in hlo.splitlines():
    if "custom_call_target" in ln or ("f8e4m3" in ln and "convert" in ln):
        print("  ", re.sub(r"\s+", " ", ln.strip())[:220])

# pieces: quantize on GPU (reference) vs CPU (reference)
from te_ops.fp8 import reference as ref  # noqa: E402

qg = jax.jit(lambda a: ref.quantize_blocks(a, (1, 128), fp8.E4M3, power_of_2=True))(x)
qc = jax.jit(lambda a: ref.quantize_blocks(a, (1, 128), fp8.E4M3, power_of_2=True))(jax.device_put(x, cpu))
print(
    "ref quantize bytes GPU vs CPU differ:",
    int(np.sum(np.asarray(qg.data).view(np.uint8) != np.asarray(qc.data).view(np.uint8))),
)
dq = jax.jit(lambda a: ref.dequantize(ref.quantize_blocks(a, (1, 128), fp8.E4M3, power_of_2=True), jnp.float32))
print(
    "ref quantize->dequantize in one jit, GPU vs CPU max diff:",
    float(np.max(np.abs(np.asarray(dq(x)) - np.asarray(dq(jax.device_put(x, cpu)))))),
)
print("  vs x itself (GPU):", float(np.max(np.abs(np.asarray(dq(x)) - np.asarray(x, np.float32)))))

# XLA's float32 division on the GPU vs correctly rounded (NumPy)
a = np.random.default_rng(0).uniform(1e-3, 1e3, 1 << 20).astype(np.float32)
for name, fn, want in (
    ("448 / a", lambda a: jnp.float32(448.0) / a, np.float32(448.0) / a),
    ("1 / a", lambda a: 1.0 / a, np.float32(1.0) / a),
):
    got = np.asarray(jax.jit(fn)(jnp.asarray(a)))
    print(f"XLA GPU {name}: {int(np.sum(got != want))} of {a.size} not correctly rounded")
