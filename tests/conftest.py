"""Test configuration: 8 virtual CPU devices for sharding tests; GPU tests skipped with a reason
when no CUDA device or native extension is present (they are always collected)."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    from te_ops._core.native import native_unavailable_reason

    why = native_unavailable_reason()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
