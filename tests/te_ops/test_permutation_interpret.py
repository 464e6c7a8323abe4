"""Runs the Triton permutation kernels' logic on the CPU under TRITON_INTERPRET=1 (no GPU, no torch:
tests/te_ops/_triton_interpret.py wraps NumPy buffers in a minimal torch-like shim) and compares
them with the reference. Gluon has no interpreter; its kernels are covered by the GPU tests."""

import os
import subprocess
import sys

import pytest

from te_ops._core import triton_bridge

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(
    triton_bridge.triton_unavailable_reason() is not None,
    reason=f"needs Triton: {triton_bridge.triton_unavailable_reason()}",
)
def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "_triton_interpret.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=root,
    )
    assert r.returncode == 0 and "interpret failures: 0" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
