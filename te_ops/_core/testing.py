"""Test helpers shared by every op's tests: the dtype tolerance table, sharded-vs-unsharded runs on
virtual CPU devices with collective counts from the compiled HLO, and output poisoning."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# One table for every comparison against an fp32/fp64 reference: (rtol, atol) by the dtype the
# computation ran in. bf16 keeps 8 mantissa bits (relative step 2^-8 = 3.9e-3).
TOLERANCES: dict[Any, tuple[float, float]] = {
    jnp.dtype(jnp.float64): (1e-10, 1e-12),
    jnp.dtype(jnp.float32): (2e-5, 2e-6),
    jnp.dtype(jnp.float16): (4e-3, 1e-3),
    jnp.dtype(jnp.bfloat16): (2e-2, 8e-3),
}


def tolerance(dtype: Any) -> dict[str, float]:
    rtol, atol = TOLERANCES[jnp.dtype(dtype)]
    return {"rtol": rtol, "atol": atol}


def assert_close(actual: Any, expected: Any, dtype: Any = None, *, scale: float = 1.0, err_msg: str = "") -> None:
    """Compares in float64 with the tolerance of ``dtype`` (default: actual's dtype); atol is
    multiplied by ``scale`` (use the magnitude of the expected values for unnormalised outputs)."""
    dtype = jnp.dtype(dtype if dtype is not None else jnp.asarray(actual).dtype)
    tol = tolerance(dtype)
    a = np.asarray(jnp.asarray(actual, jnp.float32), dtype=np.float64)
    e = np.asarray(jnp.asarray(expected, jnp.float32), dtype=np.float64)
    assert not np.isnan(a).any() or np.isnan(e).any(), f"NaN in result {err_msg}"
    np.testing.assert_allclose(a, e, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=err_msg)


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Number of each collective in compiled HLO text (async start/done pairs count once)."""
    counts = {}
    for name in _COLLECTIVES:
        pattern = rf"\b{name}(-start)?\("
        counts[name] = len(re.findall(pattern, hlo_text))
    return counts


def cpu_mesh(shape: Sequence[int], names: Sequence[str]) -> jax.sharding.Mesh:
    devices = jax.devices("cpu")
    n = int(np.prod(shape))
    if len(devices) < n:
        raise RuntimeError(
            f"need {n} CPU devices, have {len(devices)}: set jax.config.update('jax_num_cpu_devices', {n}) "
            "right after importing jax (tests/conftest.py does)"
        )
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), tuple(names))


def run_sharded(
    fn: Callable[..., Any],
    args: Sequence[Any],
    in_specs: Sequence[PartitionSpec | None],
    out_specs: Any = None,
    *,
    mesh: jax.sharding.Mesh,
) -> tuple[Any, Any, dict[str, int]]:
    """Runs ``fn`` sharded over ``mesh`` and unsharded on one device.

    Returns (sharded_result, unsharded_result, collective_counts_of_the_sharded_program).
    """
    cpu0 = jax.devices("cpu")[0]
    local = [jax.device_put(a, cpu0) for a in args]
    unsharded = jax.jit(fn)(*local)

    in_shardings = tuple(NamedSharding(mesh, s if s is not None else PartitionSpec()) for s in in_specs)
    out_shardings = None
    if out_specs is not None:
        out_shardings = jax.tree.map(
            lambda s: NamedSharding(mesh, s), out_specs, is_leaf=lambda s: isinstance(s, PartitionSpec)
        )
    sharded_args = [jax.device_put(a, s) for a, s in zip(args, in_shardings, strict=True)]
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
    compiled = jitted.lower(*sharded_args).compile()
    counts = count_collectives(compiled.as_text())
    result = jitted(*sharded_args)
    return result, unsharded, counts
