"""Benchmark of te_ops.grouped_ffn: the MoE experts' FFN forward + backward with the activation fused
into the grouped GEMM epilogues, against the unfused path te_layers runs today (two grouped_dense
calls, the Gluon / Triton grouped GEMMs, with the gated SiLU in XLA between them), side by side in
one process, rounds interleaved, on the same inputs.

Shapes: the train_moe benchmark's experts (H 1024, F 2048 gated, 16 experts, uneven groups) at its
16 x 1024 and 64 x 1024 tokens per step, top-2 (32768 and 131072 rows). Also times the fused path
with 128 x 64 dact tiles (no register spill; tests/te_ops/test_grouped_ffn.py) and with the Gluon
warp-specialized act and dact kernels (``GemmConfig(BN=128, GLUON_WS=True)`` for ffn_act and
ffn_dact through config_override; te_ops/grouped_dense/gluon_ffn_kernels.py, Hopper only: elsewhere
the row repeats the Triton kernels), and checks the fused results against the unfused ones.

    python benchmarks/grouped_ffn.py [--repeats 6] [--calls 10] [--only 32768]

Writes ``benchmarks/results/<device>/grouped_ffn.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
from grouped_dense import rel_err, uneven_sizes  # noqa: E402

from te_ops.grouped_dense import ffn_activation, grouped_dense, grouped_ffn  # noqa: E402
from te_ops.grouped_dense import triton as tri  # noqa: E402

CASES = [(32768, 1024, 2048, 16), (131072, 1024, 2048, 16)]  # (rows, H, F, experts)
# the Gluon warp-specialized act and dact kernels (opt-in until this benchmark has timed them)
GLUON_FFN = tri.GemmConfig(BN=128, GLUON_WS=True)


def make(m, h, f, g, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (m, h), jnp.float32).astype(jnp.bfloat16)
    wi = (jax.random.normal(ks[1], (g, h, 2 * f), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    wo = (jax.random.normal(ks[2], (g, f, h), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[3], (m, h), jnp.float32).astype(jnp.bfloat16)
    return jax.block_until_ready((x, wi, wo, dy))


def unfused(x, wi, wo, s):
    h = grouped_dense(x, wi, s, implementation="triton")
    return grouped_dense(ffn_activation(h, "silu", True), wo, s, implementation="triton")


def fused(x, wi, wo, s):
    return grouped_ffn(x, wi, wo, s, implementation="triton")


def step_of(f, dact_cfg=None, act_cfg=None):
    """The jitted fwd+bwd step; ``dact_cfg`` / ``act_cfg``: the dact and act GEMMs' tiles (through
    config_override, which grouped_ffn keys its cached build on: a new configuration is a new trace)."""

    def run(x, wi, wo, s, dy):
        overridden = dact_cfg is not None or act_cfg is not None
        ctx = tri.config_override(ffn_act=act_cfg, ffn_dact=dact_cfg) if overridden else contextlib.nullcontext()
        with ctx:
            y, vjp = jax.vjp(lambda *a: f(*a, s), x, wi, wo)
            return (y, *vjp(dy))

    return jax.jit(run)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--only", default=None, help="substring of a case name")
    p.add_argument("--skip", default=None, help="leave out the implementations whose name holds this substring")
    a = p.parse_args()
    rows = []
    for m, h, f, g in CASES:
        case = f"M{m} H{h} F{f} G{g}"
        if a.only and a.only not in case:
            continue
        x, wi, wo, dy = make(m, h, f, g)
        s = uneven_sizes(m, g)
        fns = {
            "unfused (grouped_dense x2, XLA SwiGLU)": step_of(unfused),
            "grouped_ffn (fused epilogues)": step_of(fused),
            "grouped_ffn, 128x64 dact tiles": step_of(fused, tri.GemmConfig(BN=64)),
            "grouped_ffn, Gluon ws act+dact": step_of(fused, GLUON_FFN, GLUON_FFN),
        }
        if a.skip:
            fns = {n: fn for n, fn in fns.items() if a.skip not in n or n.startswith("unfused")}
        outs = {n: jax.block_until_ready(fn(x, wi, wo, s, dy)) for n, fn in fns.items()}
        ref = outs["unfused (grouped_dense x2, XLA SwiGLU)"]
        ms, _ = _timing.time_interleaved(fns, [(x, wi, wo, s, dy)], repeats=a.repeats, calls=a.calls)
        flops = 3 * 2 * m * h * (2 * f) + 3 * 2 * m * f * h  # fwd + dx + dkernels of both GEMMs
        base = ms["unfused (grouped_dense x2, XLA SwiGLU)"]
        for name, t in ms.items():
            err = max(rel_err(o, r) for o, r in zip(outs[name], ref, strict=True))
            rows.append({"case": case, "impl": name, "ms": round(t, 3), "TFLOPs": round(flops / t / 1e9, 1),
                         "speedup_vs_unfused": round(base / t, 3), "max_rel_err_vs_unfused": err})  # fmt: skip
        _timing.print_table("grouped_ffn fwd+bwd (bf16, gated SiLU)", rows, list(rows[0]))
    _timing.write_json("grouped_ffn", {"dtype": "bfloat16", "activation": "silu", "gated": True, "rows": rows})


if __name__ == "__main__":
    main()
