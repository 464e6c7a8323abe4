"""Shared benchmark helpers: timing (warm-up, block_until_ready, median of repeats), rotation of
inputs larger than L2, a printed table and a JSON record per op and device.

Results live in ``benchmarks/results/<device>/<op>.json`` (``<device>`` from the GPU name, e.g.
``h200``), one file per op, overwritten by each run; each carries the date, the commit and the
versions it was measured with. ``$TE_BENCH_OUT`` (a folder) overrides the location.
``scripts/perf_table.py`` turns these files into the performance table of README.md and the docs.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
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


def device_folder(device_kind: str) -> str:
    """The results folder name of a device: its name without the vendor and the memory / form-factor
    words, lower case, e.g. "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100", "cpu" -> "cpu"."""
    words = [w for w in re.split(r"[^0-9a-z]+", device_kind.lower()) if w]
    skip = re.compile(r"^(nvidia|amd|\d+gb|hbm\d*e?|pcie|sxm\d*|nvl)$")
    kept = [w for w in words if not skip.match(w)]
    return "-".join(kept) or "unknown"


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(cmd: list[str], cwd: str | None = None) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0].strip() if out.strip() else None


def commit() -> str | None:
    """The commit being measured: ``$TE_BENCH_COMMIT`` when set (a copied tree without ``.git``),
    else ``git rev-parse --short HEAD`` of this checkout, with ``+dirty`` when tracked files differ."""
    if os.environ.get("TE_BENCH_COMMIT"):
        return os.environ["TE_BENCH_COMMIT"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = _command_output(["git", "rev-parse", "--short", "HEAD"], cwd=repo)
    if head is None:
        return None
    dirty = _command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return head + ("+dirty" if dirty else "")


def environment() -> dict[str, Any]:
    """Date, commit, device and versions of this process (the header of every results file)."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    driver = None
    if dev.platform == "gpu":
        driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "device": kind,
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": _package_version("jaxlib"),
            "triton": _package_version("triton"),
            "torch": _package_version("torch"),
            "cuda_driver": driver,
            "platform_version": getattr(dev.client, "platform_version", None),
        },
        "platform": dev.platform,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def results_dir() -> str:
    """``$TE_BENCH_OUT`` when set, else ``benchmarks/results/<device folder>``."""
    if os.environ.get("TE_BENCH_OUT"):
        return os.environ["TE_BENCH_OUT"]
    dev = jax.devices()[0]
    return os.path.join(RESULTS_DIR, device_folder(getattr(dev, "device_kind", dev.platform)))


def print_table(title: str, rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    print(f"\n== {title} ==")
    widths = [max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns]
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
    """Writes ``<out_dir>/<name>.json`` (default :func:`results_dir`), replacing an earlier run's file:
    ``{"op", "date", "commit", "device", "versions", "platform", "xla_flags", "source", **payload}``."""
    out_dir = out_dir or results_dir()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(os.path.dirname(RESULTS_DIR)))
    record = {"op": name, **environment(), "source": " ".join(["python", script, *sys.argv[1:]]), **payload}
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {path}")
    return path
