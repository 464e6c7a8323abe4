"""Test configuration: 8 virtual CPU devices for sharding tests; GPU tests are always collected and
skipped with a reason where they cannot run.

Two levels of skipping: here, every test marked ``gpu`` is skipped when JAX sees no CUDA device;
each GPU test file then skips on its own op's reason (its native extension not built, Triton
missing), so one op's missing build never hides another op's tests.
"""

import collections
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


# one kernel launch recorded by the stub_triton_launcher fixture
TritonLaunch = collections.namedtuple("TritonLaunch", "name compiled grid")


@pytest.fixture
def stub_triton_launcher(monkeypatch):
    """Lower Triton/Gluon ops for CUDA on this machine: a CUDA device and jaxlib's Triton launcher are
    pretended present, every kernel is compiled for the target set with ``triton_bridge.target_override``,
    and each launch is recorded (a ``TritonLaunch``) instead of being serialised for jaxlib. Returns the
    list of launches, in trace order. Skips where Triton itself is missing."""
    from te_ops._core import native
    from te_ops._core import triton_bridge as tb

    if tb.triton_unavailable_reason() is not None:
        pytest.skip(f"needs Triton: {tb.triton_unavailable_reason()}")
    launches: list[TritonLaunch] = []

    def record(params, compiled, grid, platform, name):
        launches.append(TritonLaunch(name, compiled, tuple(grid)))
        return b"x"

    monkeypatch.setattr(native, "cuda_device_unavailable_reason", lambda: None)
    monkeypatch.setattr(tb, "launcher_unavailable_reason", lambda: None)
    monkeypatch.setattr(tb, "_launcher_call", record)
    return launches
