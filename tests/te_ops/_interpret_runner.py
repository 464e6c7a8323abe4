"""Running a test module's ``--interpret`` main in a subprocess under Triton's CPU interpreter, and
the preamble every such main needs. Importing this module does not set TRITON_INTERPRET (the pytest
process keeps its normal Triton); ``interpreter_setup`` runs inside the subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(path: str, flag: str = "--interpret", timeout: int = 900) -> None:
    """``python path flag`` with TRITON_INTERPRET=1 on the CPU; asserts it printed
    "interpret failures: 0" and exited 0 (skips without Triton)."""
    import pytest

    from te_ops._core import triton_bridge as tb

    if tb.triton_unavailable_reason() is not None:
        pytest.skip(f"needs Triton: {tb.triton_unavailable_reason()}")
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.abspath(path), flag], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0 and "interpret failures: 0" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])


def interpreter_setup():
    """Inside the subprocess: TRITON_INTERPRET set before Triton loads, JAX on the CPU, the kernel
    launches of te_ops.fp8.triton run eagerly by the interpreter (no sharding wrappers). Returns
    (te_ops.fp8.reference, te_ops.fp8.triton)."""
    sys.path.insert(0, ROOT)
    import jax

    from tests.te_ops import _triton_interpret as ti  # sets TRITON_INTERPRET=1 before triton loads

    jax.config.update("jax_platforms", "cpu")
    ti._fix_interpreter_for_numpy2()
    from te_ops.fp8 import reference as ref
    from te_ops.fp8 import triton as tri

    tri.tb.triton_call = ti.interpreted_call
    tri.PARTITION = False  # the interpreter runs kernels eagerly; sharding: test_fp8_sharding.py
    return ref, tri
