"""Shared benchmark helper: examples/train_moe.py, and benchmarks/train_moe.py (which imports it as
``train_moe``), loaded as modules for the scripts that run the example in-process (fp8_accuracy.py,
long_run.py).

The name ``train_moe`` is ambiguous on these scripts' sys.path (benchmarks/train_moe.py and
examples/train_moe.py), so both are loaded from their paths, and the sys.modules entries are managed here.
"""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "train_moe.py")
BENCHMARK = os.path.join(HERE, "train_moe.py")


def _exec_file(name: str, path: str):
    """Runs the file ``path`` as the module ``sys.modules[name]`` (entry removed again when it raises)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def load_example():
    """examples/train_moe.py as a module: the one already imported as ``train_moe`` when it is that file,
    else loaded from its path (as ``train_moe``, or under another name when ``train_moe`` is another file,
    e.g. benchmarks/train_moe.py imported with benchmarks/ first on sys.path)."""
    path = os.path.realpath(EXAMPLE)
    for name in ("train_moe", "_te_examples_train_moe"):
        mod = sys.modules.get(name)
        if mod is None:
            return _exec_file(name, path)
        if os.path.realpath(getattr(mod, "__file__", None) or "") == path:
            return mod
    raise ImportError(f"cannot import {path}: the module names train_moe and _te_examples_train_moe are taken")


def load_benchmark(ex=None):
    """benchmarks/train_moe.py as a module (``_te_benchmarks_train_moe``); its ``import train_moe`` gets the
    example ``ex`` (default :func:`load_example`) whatever ``train_moe`` names in sys.modules."""
    name = "_te_benchmarks_train_moe"
    if name in sys.modules:
        return sys.modules[name]
    ex = load_example() if ex is None else ex
    saved = sys.modules.get("train_moe")
    sys.modules["train_moe"] = ex
    try:
        return _exec_file(name, BENCHMARK)
    finally:
        if saved is None:
            sys.modules.pop("train_moe", None)
        else:
            sys.modules["train_moe"] = saved
