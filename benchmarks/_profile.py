"""Kernel-level profiles from a jax.profiler trace (CUPTI): every GPU kernel a jitted function runs,
with its mean time per step, for the *_profile.py benchmarks. Command buffers should be off in the
traced process (set XLA_FLAGS before importing jax) so each kernel shows up on its own."""

from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax

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


def profile(fn, args, steps: int, arg_sets=None) -> dict:
    """Traces ``steps`` back-to-back calls of ``fn`` (after 3 untimed ones): each kernel's mean ms per
    step, the busy time (sum of kernel durations) and the span (first start to last end) per step;
    span - busy is the GPU's idle time between kernels. ``arg_sets`` (optional) rotates several
    argument tuples call by call, as the timing benchmarks do; otherwise every call gets ``args``."""
    sets = list(arg_sets) if arg_sets else [args]
    for i in range(3):
        jax.block_until_ready(fn(*sets[i % len(sets)]))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for i in range(steps):
                out = fn(*sets[i % len(sets)])
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


def print_profile(title: str, r: dict) -> None:
    busy = "-" if r["busy_ms"] is None else f"{r['busy_ms']:.3f}"
    span = "-" if r["span_ms"] is None else f"{r['span_ms']:.3f}"
    print(f"\n== {title}: kernels busy {busy} ms/step, span {span} ms/step ==")
    for kr in r["kernels"]:
        print(f"  {kr['ms_per_step']:8.3f} ms  x{kr['calls_per_step']:.1f}  {kr['kernel'][:150]}")
