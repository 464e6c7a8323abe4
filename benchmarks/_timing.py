"""Shared benchmark helpers: timing (warm-up, block_until_ready, median of repeats), rotation of
inputs larger than L2, a printed table and a JSON record under benchmarks/results/."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _mean_ms(fn: Callable[..., Any], arg_sets: Sequence[tuple], calls: int) -> float:
    """Mean ms per call of ``calls`` back-to-back calls (arg_sets rotated), ended by one block_until_ready."""
    t0 = time.perf_counter()
    out = None
    for i in range(calls):
        out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) * 1e3 / calls


def _warm(fn: Callable[..., Any], arg_sets: Sequence[tuple], warmup: int) -> None:
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))


def time_fn(
    fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int = 2, repeats: int = 5, calls: int = 20
) -> float:
    """Median over ``repeats`` of the mean time (ms) of ``calls`` back-to-back calls.

    ``arg_sets`` are rotated call by call (give several when one set fits in L2)."""
    _warm(fn, arg_sets, warmup)
    return statistics.median(_mean_ms(fn, arg_sets, calls) for _ in range(repeats))


def time_interleaved(
    fns: dict[str, Callable[..., Any]], arg_sets: Sequence[tuple], *, warmup: int = 2, repeats: int = 6, calls: int = 20
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Like :func:`time_fn` for several alternatives at once, their rounds interleaved.

    Round r times every alternative for ``calls`` back-to-back calls, in an order that is reversed
    every other round (A B, B A, ...), so clock drift (the GPU settling to its power-limited clock
    during long compute-bound runs) falls on all of them alike rather than on whichever ran last.
    Returns each alternative's median ms per call and its per-round samples."""
    names = list(fns)
    for name in names:
        _warm(fns[name], arg_sets, warmup)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            _warm(fns[name], arg_sets, 1)  # untimed: the switch from the other alternative is not timed
            samples[name].append(_mean_ms(fns[name], arg_sets, calls))
    return {n: statistics.median(v) for n, v in samples.items()}, samples


def environment() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def print_table(title: str, rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    print(f"\n== {title} ==")
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write_json(name: str, payload: dict[str, Any], out_dir: str | None = None) -> str:
    out_dir = out_dir or os.environ.get("TE_BENCH_OUT") or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"environment": environment(), **payload}, f, indent=2, default=str)
    print(f"wrote {path}")
    return path
