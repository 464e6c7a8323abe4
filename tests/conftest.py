"""Test configuration: 8 virtual CPU devices for sharding tests; GPU tests are always collected and
skipped with a reason where they cannot run.

Two levels of skipping: here, every test marked ``gpu`` is skipped when JAX sees no CUDA device;
each GPU test file then skips on its own op's reason (its native extension not built, Triton
missing), so one op's missing build never hides another op's tests.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    from te_ops._core.native import cuda_device_unavailable_reason

    why = cuda_device_unavailable_reason()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
