"""Kernel-level profile of the dense MLP case: every GPU kernel of te_ops.dense's forward and
forward+backward next to XLA's jnp formulation, from a jax.profiler trace (CUPTI), in steady state.

Where benchmarks/dense.py says which side is faster end to end, this says why: each kernel's mean
time per step (the GEMMs, the activation/dbias passes, XLA's fusions) and the gaps between them.
Command buffers are turned off for the traced process (unless XLA_FLAGS already sets them) so each
kernel shows up on its own; kernel durations do not depend on that.

    python benchmarks/dense_profile.py [--m 16384 --k 4096 --n 14336] [--steps 10]

Prints one table per (side, stage) and writes benchmarks/results/dense_profile.json.
"""

from __future__ import annotations

import os

if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import dense as dense_bench  # noqa: E402

from te_ops._core import native as _native  # noqa: E402

# Lines of the GPU plane that summarise rather than list kernels.
_SUMMARY_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Launch Stats", "Steps", "Source code", "Framework")


def kernel_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(kernel name, start ns, duration ns) of every activity on the GPU streams of the trace."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"no xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(paths[0])
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if any(line.name.startswith(s) for s in _SUMMARY_LINES):
                continue
            for ev in line.events:
                out.append((ev.name, float(ev.start_ns), float(ev.duration_ns)))
    return out


def profile(fn, args, steps: int) -> dict:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(steps):
                out = fn(*args)
            jax.block_until_ready(out)
        events = kernel_events(d)
    if not events:
        return {"kernels": [], "busy_ms": None, "span_ms": None}
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in events:
        per[name][0] += 1
        per[name][1] += dur
    t0 = min(s for _, s, _ in events)
    t1 = max(s + d for _, s, d in events)
    kernels = sorted(
        (
            {
                "kernel": name,
                "calls_per_step": c / steps,
                "ms_per_step": tot / steps / 1e6,
                "ms_per_call": tot / c / 1e6,
            }
            for name, (c, tot) in per.items()
        ),
        key=lambda r: -r["ms_per_step"],
    )
    busy = sum(d for _, _, d in events) / steps / 1e6
    return {"kernels": kernels, "busy_ms": busy, "span_ms": (t1 - t0) / steps / 1e6}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if _native.native_unavailable_reason("_native_cublaslt", "dense") is not None:
        print(f"native dense unavailable: {_native.native_unavailable_reason('_native_cublaslt', 'dense')}")
        return
    m, k, n = args.m, args.k, args.n
    ((x, w, b, dy),) = dense_bench.make_args(m, k, n, jnp.bfloat16, n_sets=1)
    act = "gelu_tanh"
    sides = {
        "ours": dense_bench.ours_fn(act, True, "native"),
        "xla": dense_bench.xla_fn(act, True),
    }
    mod = _native._loaded["_native_cublaslt"]
    info = mod.dense_backward_variants()
    runs = [("forward", "ours", None), ("forward", "xla", None), ("forward+backward", "xla", None)]
    # ours forward+backward once per compiled block shape of the dz/dbias kernel, the default last
    order = [v for v in range(len(info["variants"])) if v != info["active"]] + [info["active"]]
    runs += [("forward+backward", "ours", v) for v in order]
    # the training forward's split path (hook) vs the fused epilogue, alternated twice (GEMM kernel
    # times drift by a few % between profiles), with the default dz kernel
    runs += [("forward+backward", "ours", "split"), ("forward+backward", "ours", "fused")] * 2
    results = []
    for stage, side, variant in runs:
        f = sides[side]
        fn = jax.jit(f) if stage == "forward" else jax.jit(dense_bench.fwd_bwd(f))
        a = (x, w, b) if stage == "forward" else (x, w, b, dy)
        if variant in ("split", "fused"):
            mod.dense_set_forward_split(variant == "split")
            side = f"ours, {variant} training forward"
        elif variant is not None:
            mod.dense_set_backward_variant(variant)
            side = f"ours, dz kernel block {tuple(info['variants'][variant])}" + (
                " (default)" if variant == info["active"] else ""
            )
        r = profile(fn, a, args.steps)
        r.update(side=side, stage=stage)
        results.append(r)
        print(f"\n== {side} {stage}: kernels busy {r['busy_ms']:.3f} ms/step, span {r['span_ms']:.3f} ms/step ==")
        for kr in r["kernels"]:
            print(f"  {kr['ms_per_step']:8.3f} ms  x{kr['calls_per_step']:.1f}  {kr['kernel'][:150]}")
    mod.dense_set_forward_split(False)
    _timing.write_json(
        "dense_profile",
        {
            "shape": {"m": m, "k": k, "n": n},
            "profiles": results,
            "plans": _native._loaded["_native_cublaslt"].dense_plans(),
        },
    )


if __name__ == "__main__":
    main()
