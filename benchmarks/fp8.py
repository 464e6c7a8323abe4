"""FP8 quantization benchmark: the Triton block-quantize kernel (te_ops/fp8/triton.py) vs the same
quantization written in jnp and jitted by XLA (te_ops/fp8/reference.py), side by side in one
process, with a plain cast of the same bytes (no scaling: XLA's fused convert, a practical
ceiling). Prints a table and writes
benchmarks/results/<device>/fp8.json (with a ``summary`` for scripts/perf_table.py).

    python benchmarks/fp8.py

Bytes moved = input read + FP8 bytes written + float32 scales written. Target (issue "[3 of 5] FP8
on Hopper"): quantize kernels at >= 3.8 TB/s (90% of the copy ceiling measured on the H200).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

from te_ops import fp8  # noqa: E402
from te_ops._core import triton_bridge as tb  # noqa: E402
from te_ops.fp8 import reference as ref  # noqa: E402

TARGET_TBPS = 3.8
L2_BYTES = 60 * 2**20
CASES = [  # (name, shape, block)
    ("activations 1x128", (16384, 7168), (1, 128)),
    ("weights 128x128", (7168, 4096), (128, 128)),
    ("activations 1x128 (MoE rows)", (65536, 2048), (1, 128)),
]


def _arg_sets(shape, dtype):
    nbytes = shape[0] * shape[1] * jnp.dtype(dtype).itemsize
    n = max(2, -(-2 * L2_BYTES // nbytes))
    keys = jax.random.split(jax.random.key(0), n)
    return [(jax.random.normal(k, shape, jnp.float32).astype(dtype),) for k in keys]


def main():
    why = tb.unavailable_reason()
    if why or jax.devices()[0].platform != "gpu":
        print(f"fp8 benchmark needs the Triton GPU path: {why or 'no GPU'}")
        return
    from te_ops.fp8 import triton as tri

    rows, summary = [], []
    for name, shape, block in CASES:
        dtype = jnp.bfloat16
        sets = _arg_sets(shape, dtype)
        r, c = shape
        nblocks = -(-r // block[0]) * -(-c // block[1])
        moved = r * c * (jnp.dtype(dtype).itemsize + 1) + 4 * nblocks
        fns = {
            "triton": jax.jit(lambda x, block=block: tri.block_quantize(x, block, fp8.E4M3, power_of_2=True)),
            "xla": jax.jit(lambda x, block=block: ref.quantize_blocks(x, block, fp8.E4M3, power_of_2=True)),
            "cast": jax.jit(lambda x: (x.astype(jnp.float8_e4m3fn), x[:, ::128].astype(jnp.float32))),
        }
        times, _ = _timing.time_interleaved(fns, sets)
        got = fns["triton"](sets[0][0])
        want = fns["xla"](sets[0][0])
        same = bool(jnp.array_equal(jax.lax.bitcast_convert_type(got.data, jnp.uint8),
                                    jax.lax.bitcast_convert_type(want.data, jnp.uint8)))  # fmt: skip
        row = {"case": name, "shape": f"{r}x{c}", "block": f"{block[0]}x{block[1]}", "dtype": "bfloat16",
               "ours_ms": times["triton"], "xla_ms": times["xla"], "cast_ms": times["cast"],
               "ours_TBps": moved / times["triton"] / 1e9, "xla_TBps": moved / times["xla"] / 1e9,
               "speedup": times["xla"] / times["triton"], "bytes_equal_to_xla": same,
               "meets_target": moved / times["triton"] / 1e9 >= TARGET_TBPS}  # fmt: skip
        rows.append(row)
        summary.append({"workload": f"block quantize {name} {r}x{c} bf16 -> e4m3", "ours_ms": times["triton"],
                        "alternative": "XLA (jnp reference, jitted)", "alternative_ms": times["xla"],
                        "headline": False})  # fmt: skip
    # one read, two outputs: 1 x 128 row tiles of x and of x^T (the forward and weight-gradient operands)
    shape = (16384, 7168)
    sets = _arg_sets(shape, jnp.bfloat16)
    r, c = shape
    moved = r * c * (2 + 2) + 4 * (r * (c // 128) + c * (r // 128))
    fns = {
        "triton": jax.jit(lambda x: tri.dual_quantize(x, 128, fp8.E4M3, power_of_2=True)),
        "xla": jax.jit(
            lambda x: (
                ref.quantize_blocks(x, (1, 128), fp8.E4M3, power_of_2=True),
                ref.quantize_blocks(x.T, (1, 128), fp8.E4M3, power_of_2=True),
            )
        ),  # fmt: skip
        "cast": jax.jit(lambda x: (x.astype(jnp.float8_e4m3fn), x.T.astype(jnp.float8_e4m3fn))),
    }
    times, _ = _timing.time_interleaved(fns, sets)
    rows.append({"case": "dual 1x128 (x and x^T)", "shape": f"{r}x{c}", "block": "1x128 + 128x1", "dtype": "bfloat16",
                 "ours_ms": times["triton"], "xla_ms": times["xla"], "cast_ms": times["cast"],
                 "ours_TBps": moved / times["triton"] / 1e9, "xla_TBps": moved / times["xla"] / 1e9,
                 "speedup": times["xla"] / times["triton"], "bytes_equal_to_xla": None,
                 "meets_target": moved / times["triton"] / 1e9 >= TARGET_TBPS})  # fmt: skip
    summary.append(
        {
            "workload": f"dual quantize x and x^T 1x128 {r}x{c} bf16 -> e4m3",
            "ours_ms": times["triton"],
            "alternative": "XLA (jnp reference, jitted)",
            "alternative_ms": times["xla"],
            "headline": False,
        }
    )
    # the block-scaled FP8 GEMM (forward), operands pre-quantized, vs XLA's bf16 GEMM of the same shape
    gemm_rows = []
    for m, k, n in [(16384, 4096, 14336), (8192, 7168, 4096)]:
        kx, kw = jax.random.split(jax.random.key(1))
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w_t = (jax.random.normal(kw, (n, k), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        qa = jax.jit(lambda x: ref.quantize_blocks(x, (1, 128), fp8.E4M3, power_of_2=True))(x)
        qb = jax.jit(lambda w: ref.quantize_blocks(w, (128, 128), fp8.E4M3, power_of_2=True))(w_t)
        fns = {
            "fp8 block-scaled (triton)": jax.jit(lambda a, b, x, w: tri.block_scaled_gemm(a, b, jnp.bfloat16)),
            "bf16 (XLA)": jax.jit(lambda a, b, x, w: jnp.dot(x, w.T)),
        }
        times, _ = _timing.time_interleaved(fns, [(qa, qb, x, w_t)], repeats=5, calls=10)
        flops = 2.0 * m * k * n
        for name, t in times.items():
            gemm_rows.append({"gemm": f"{m}x{k}x{n}", "impl": name, "ms": t, "TFLOPs": flops / t / 1e9})
        summary.append({"workload": f"block-scaled FP8 GEMM fwd {m}x{k}x{n} (operands quantized)",
                        "ours_ms": times["fp8 block-scaled (triton)"], "alternative": "bf16 GEMM (XLA)",
                        "alternative_ms": times["bf16 (XLA)"], "headline": False})  # fmt: skip
    # the grouped block-scaled FP8 GEMM (MoE experts) at the shapes: K7168 N4096, 8 / 32 / 128 groups
    import numpy as np

    for m, g in [(32768, 8), (65536, 32), (65536, 128)]:
        k, n = 7168, 4096
        rng = np.random.default_rng(g)
        sizes = jnp.asarray(np.full(g, m // g, np.int32))
        x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
        w_t = jnp.asarray(rng.standard_normal((g, n, k), np.float32) / k**0.5, jnp.bfloat16)
        qa = jax.jit(lambda x: ref.quantize_blocks(x, (1, 128), fp8.E4M3, power_of_2=True))(x)
        qb = jax.jit(lambda w: ref.quantize_blocks(w, (128, 128), fp8.E4M3, power_of_2=True))(w_t)
        del w_t
        fn = jax.jit(lambda a, b, s: tri.grouped_block_scaled_gemm(a, b, s, jnp.bfloat16))
        t = _timing.time_fn(fn, [(qa, qb, sizes)], repeats=5, calls=10)
        target = 1100.0 if g == 32 else None
        gemm_rows.append({"gemm": f"grouped K{k} N{n} G{g} M{m}", "impl": "fp8 block-scaled (triton)", "ms": t,
                          "TFLOPs": 2.0 * m * k * n / t / 1e9, "target_TFLOPs": target})  # fmt: skip
        del qa, qb, x
    _timing.print_table("FP8 block-scaled GEMM", gemm_rows, ["gemm", "impl", "ms", "TFLOPs", "target_TFLOPs"])
    _timing.print_table("FP8 block quantization (bf16 -> e4m3)", rows,
                        ["case", "shape", "block", "ours_ms", "xla_ms", "cast_ms", "ours_TBps", "xla_TBps", "speedup",
                         "bytes_equal_to_xla", "meets_target"])  # fmt: skip
    _timing.write_json("fp8", {"rows": rows, "gemm_rows": gemm_rows, "summary": summary, "target_TBps": TARGET_TBPS})


if __name__ == "__main__":
    main()
