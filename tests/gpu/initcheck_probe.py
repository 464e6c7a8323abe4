"""One GEMM + SiLU, through XLA or through te_ops.dense's native split path, for compute-sanitizer's
initcheck (scripts/initcheck_probe.sh runs both).

On the H200 (2026-12-06) initcheck reported reads of uninitialized memory by our ActForwardKernel in the
sanitize case dense_native_bf16_silu_bias_3d: it reads z, which the cuBLASLt GEMM (bias epilogue) wrote
just before on the same stream, and only rows 1 and up of z were flagged. If XLA's fusion reading XLA's
own cuBLAS output is flagged the same way ("xla"), the sanitizer does not track the GEMM's stores; if
only "te" is flagged, our split path reads z too early.

    python tests/gpu/initcheck_probe.py {xla,te}
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_ops


def main(which: str) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((39, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 48)) / 8, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((48,)), jnp.bfloat16)
    if which == "xla":
        f = jax.jit(lambda x, w, b: jax.nn.silu(jnp.dot(x, w) + b) * 1.5)
    elif which == "te":
        f = jax.jit(lambda x, w, b: te_ops.dense(x, w, b, activation="silu", implementation="native"))
    else:
        raise SystemExit(f"usage: initcheck_probe.py {{xla,te}}, got {which!r}")
    y = f(x, w, b).block_until_ready()
    print("PROBE", which, float(jnp.sum(y.astype(jnp.float32))))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
