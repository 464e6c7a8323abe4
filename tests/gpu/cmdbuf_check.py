"""Runs a jitted step in THIS process with XLA command buffers on (set by the caller through
XLA_FLAGS) and prints a JSON report: max error against the reference and the native counters.

Usage: python -m tests.gpu.cmdbuf_check <module:function>  where the function returns
(step_fn, reference_fn, list_of_input_tuples, expected_keys: dict handler -> distinct keys).
"""

import importlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    mod_name, fn_name = sys.argv[1].split(":")
    builder = getattr(importlib.import_module(mod_name), fn_name)
    from te_ops._core import native

    step, reference, inputs, expected_keys = builder()
    native.reset_counters()
    step_j = jax.jit(step)
    ref_j = jax.jit(reference)
    errors = []
    for args in inputs:
        out = jax.block_until_ready(step_j(*args))
        ref = ref_j(*args)
        for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
            o = np.asarray(jnp.asarray(o, jnp.float32))
            r = np.asarray(jnp.asarray(r, jnp.float32))
            errors.append(float(np.max(np.abs(o - r)) / (np.max(np.abs(r)) + 1e-30)))
    report = {
        "xla_flags_ok": "CUSTOM_CALL" in __import__("os").environ.get("XLA_FLAGS", ""),
        "max_rel_error": max(errors),
        "any_nan": bool(any(np.isnan(errors))),
        "calls": len(inputs),
        "counters": native.counters(),
        "expected_keys": expected_keys,
    }
    print("CMDBUF_REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
