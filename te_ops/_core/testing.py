"""Test helpers shared by every op's tests: the dtype tolerance table, byte-for-byte comparison of
FP8 arrays, sharded-vs-unsharded runs on virtual CPU devices with collective counts from the
compiled HLO, and output poisoning."""

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


def fp8_bytes(a: Any) -> np.ndarray:
    """``a`` on the host as a NumPy array (``jax.device_get``); viewed as uint8 when its elements are
    one byte wide (FP8, int8, bool), so equal means the same bytes; other dtypes as they are."""
    a = np.asarray(jax.device_get(a))
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def assert_same_bytes(actual: Any, expected: Any, err_msg: str = "") -> None:
    """Every leaf of ``actual`` equals the leaf of ``expected`` in the same place (leaves zipped
    strictly), one-byte leaves compared as bytes (``fp8_bytes``: FP8 NaN payloads and the sign of
    zero count; a one-byte leaf against a wider one fails), the others by
    ``np.testing.assert_array_equal`` (NaN equal to NaN)."""
    leaves, want = jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)
    if len(leaves) != len(want):
        problem = f"{len(leaves)} leaves, expected {len(want)}"
        raise AssertionError(f"{err_msg}: {problem}" if err_msg else problem)
    for (path, a), e in zip(leaves, want, strict=True):
        where = " ".join(filter(None, (err_msg, f"leaf {jax.tree_util.keystr(path)}" if len(leaves) > 1 else "")))
        a, e = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(e))
        if (a.dtype.itemsize == 1) != (e.dtype.itemsize == 1):  # bytes against values: never equal
            problem = f"{a.dtype} vs expected {e.dtype}: bytes against values"
            raise AssertionError(f"{where}: {problem}" if where else problem)
        np.testing.assert_array_equal(fp8_bytes(a), fp8_bytes(e), err_msg=where)


def fp8_nan_mismatches(got: Any, want: Any) -> np.ndarray:
    """Indices (``np.argwhere`` rows) of the elements NaN in exactly one of ``got`` / ``want`` (FP8
    arrays of one shape); empty when their NaN positions agree."""
    g, w = (np.asarray(jax.device_get(a)) for a in (got, want))
    if g.shape != w.shape:
        raise ValueError(f"shapes differ: {g.shape} vs {w.shape}")
    return np.argwhere(np.isnan(g.astype(np.float32)) != np.isnan(w.astype(np.float32)))


def _fp8_difference(got: Any, want: Any) -> str | None:
    """None when ``got`` and ``want`` have one dtype and shape, NaN in the same places and the same
    bytes everywhere else; else what differs first."""
    g, w = (np.asarray(jax.device_get(a)) for a in (got, want))
    if g.dtype != w.dtype or g.shape != w.shape:
        return f"{g.dtype}{list(g.shape)} vs expected {w.dtype}{list(w.shape)}"
    nan = fp8_nan_mismatches(g, w)
    if nan.size:
        i = tuple(int(k) for k in nan[0])
        return f"NaN positions differ at {len(nan)} of {g.size} elements; first at {i}: got {g[i]}, expected {w[i]}"
    gb, wb = fp8_bytes(g), fp8_bytes(w)
    bad = np.argwhere((gb != wb) & ~np.isnan(w.astype(np.float32)))
    if bad.size:
        i = tuple(int(k) for k in bad[0])
        return (
            f"{len(bad)} of {g.size} bytes differ; first at {i}: got 0x{int(gb[i]):02x} ({g[i]}), expected "
            f"0x{int(wb[i]):02x} ({w[i]}); first indices {bad[:5].tolist()}"
        )
    return None


def same_fp8_bytes(got: Any, want: Any) -> bool:
    """Whether ``got`` and ``want`` (FP8 arrays) have one dtype and shape, NaN in the same places and
    the same bytes everywhere else. NaN bytes are not compared: E4M3 has two NaN codes (either
    sign) and E5M2 six, and which one a NaN input becomes depends on the cast (XLA's convert, a
    Triton kernel and ml_dtypes need not agree on the sign or payload); the semantics only require
    that a NaN stays NaN."""
    return _fp8_difference(got, want) is None


def assert_same_fp8_bytes(actual: Any, expected: Any, err_msg: str = "") -> None:
    """``same_fp8_bytes`` as an assertion; the message names the first differing element (index,
    bytes, values) and how many differ."""
    problem = _fp8_difference(actual, expected)
    if problem is not None:
        raise AssertionError(f"{err_msg}: {problem}" if err_msg else problem)


def fp8_byte_mismatch_fraction(got: Any, want: Any, *, ignore_zero_sign: bool = False) -> float:
    """The fraction of the elements of ``got`` and ``want`` (FP8 arrays of one shape) whose bytes
    differ, among those that are not NaN in both (0.0 when there are none); an element NaN in one
    only counts as differing, NaN bytes are not compared (``same_fp8_bytes`` says why). Callers
    that require equal NaN positions check ``fp8_nan_mismatches`` as well: this fraction may stay
    small with a NaN moved. ``ignore_zero_sign``: -0 (0x80) counts as +0."""
    g, w = (np.asarray(jax.device_get(a)) for a in (got, want))
    if g.shape != w.shape:
        raise ValueError(f"shapes differ: {g.shape} vs {w.shape}")
    gn, wn = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    gb, wb = fp8_bytes(g), fp8_bytes(w)
    if ignore_zero_sign:
        gb, wb = (np.where(b == 0x80, 0, b) for b in (gb, wb))
    counted = ~(gn & wn)
    if not counted.any():
        return 0.0
    differ = (gn != wn) | (gb != wb)
    return float(np.mean(differ[counted]))


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


def bundled_ptxas() -> str | None:
    """Path of the ptxas that ships with Triton (None when Triton or its ptxas is missing): lets
    tests assemble the PTX of kernels lowered for sm_90a on a machine without a GPU."""
    import os

    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


def ptxas_report(ptxas: str, ptx: str, tag: str) -> str:
    """``ptxas -arch=sm_90a -v`` of ``ptx``: asserts it assembles, returns its report (registers,
    spill stores and loads, shared memory per kernel)."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, (tag, r.stderr[-2000:])
    return r.stderr


def spill_store_bytes(report: str) -> int:
    """The largest "N bytes spill stores" of a ptxas ``-v`` report (0 when it reports none)."""
    return max((int(v) for v in re.findall(r"(\d+) bytes spill stores", report)), default=0)


def recorded_kernel_names(monkeypatch: Any) -> list[str]:
    """Records the name of every Triton/Gluon kernel the bridge lowers from now on (its launcher call,
    made once per kernel each time a new jitted function is lowered), in order, and still lowers it:
    GPU tests check which kernel a route took. ``monkeypatch`` is pytest's fixture (or a
    ``monkeypatch.context()``), which undoes the spy."""
    from te_ops._core import triton_bridge as tb

    names: list[str] = []
    real = tb._launcher_call

    def spy(params, compiled, grid, platform, name):
        names.append(name)
        return real(params, compiled, grid, platform, name)

    monkeypatch.setattr(tb, "_launcher_call", spy)
    return names
