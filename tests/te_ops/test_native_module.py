"""The native extension's host-side logic, testable without a GPU wherever it was built (CI builds
it with nvcc): registrations, build info, and the softmax launch-shape choice."""

import pytest

from te_ops._core import native

pytestmark = pytest.mark.skipif(
    native.extension_unavailable_reason() is not None,
    reason=f"te_ops._native not built: {native.extension_unavailable_reason()}",
)


def test_build_info_and_registrations():
    mod = native.module()
    info = mod.build_info()
    assert info["jaxlib_headers_version"] == "0.11.2"  # built against the oldest supported jaxlib
    assert "softmax" in info["enabled_ops"].split(",")
    regs = mod.registrations()
    for name in ("te_softmax_fwd", "te_softmax_bwd", "te_masked_softmax_fwd", "te_masked_softmax_bwd"):
        assert set(regs[name]) == {"initialize", "execute"}, regs[name]


@pytest.mark.parametrize("dtype, elem", [(0, 4), (1, 2), (2, 2)])
@pytest.mark.parametrize("cols", [1, 7, 16, 100, 128, 1000, 4096, 8192, 16384, 16385, 70000])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_softmax_launch_shape_covers_the_row(dtype, elem, cols, mode):
    rows = 1000
    c = native.module().softmax_config(dtype, rows, cols, mode)
    if c["threads_per_row"] == 0:  # long-row kernel: one block per row
        assert c["grid"] == rows and c["block"] == 1024
        assert cols * elem > 16384 * 2 or cols % (16 // elem) != 0
        return
    tpr, nv, vec = c["threads_per_row"], c["vectors_per_thread"], c["vec"]
    nvec = -(-cols // (16 // elem))
    if c["kernel"] == "warp-row":  # default forward for rows longer than 128 16-byte vectors
        assert vec == 16 // elem and cols % vec == 0 and 128 < nvec <= 512
        assert tpr == 32 and nv in (8, 16) and tpr * nv * vec >= cols and c["block"] == 128
        assert c["grid"] * 4 >= rows
        return
    assert c["kernel"] == "register"
    # the register kernel keeps rows that 32 lanes x 4 vectors cover, and rows the warp-row kernel cannot take
    assert nvec <= 128 or vec == 1 or nvec > 512
    assert tpr & (tpr - 1) == 0 and 4 <= tpr <= 1024  # power of two (shuffle reductions)
    assert vec in (1, 16 // elem) and (vec == 1 or cols % vec == 0)
    assert tpr * nv * vec >= cols  # the row fits in registers
    # registers: more vectors per thread -> smaller blocks (no spills under __launch_bounds__)
    assert tpr <= {1: 1024, 2: 1024, 4: 512, 8: 256}[nv]
    assert c["block"] % tpr == 0
    assert c["grid"] * (c["block"] // tpr) >= rows


def test_softmax_tuning_hook_round_trip():
    mod = native.module()
    default = mod.softmax_config(1, 10, 4096, 2)
    try:
        mod.softmax_set_tuning(256, 2)
        forced = mod.softmax_config(1, 10, 4096, 2)
        assert (forced["threads_per_row"], forced["vectors_per_thread"]) == (256, 2)
        mod.softmax_set_tuning(32, 1)  # does not cover a 4096-wide row: ignored
        assert mod.softmax_config(1, 10, 4096, 2) == default
    finally:
        mod.softmax_set_tuning(0, 0)
    assert mod.softmax_config(1, 10, 4096, 2) == default


def test_softmax_launch_config_maps_names_to_the_module_codes():
    """te_ops.softmax.native.launch_config (used by the GPU tests and the benchmark) passes the same
    codes as the raw module call and rejects unknown dtypes and modes by name."""
    import jax.numpy as jnp

    from te_ops.softmax import native as softmax_native

    for (dtype, code), (mode, mcode) in zip(
        [(jnp.float32, 0), (jnp.bfloat16, 1), (jnp.float16, 2)], [("none", 0), ("mask", 1), ("causal", 2)], strict=True
    ):
        got = softmax_native.launch_config(dtype, 300, 1000, mode, 0.5)
        assert got == dict(native.module().softmax_config(code, 300, 1000, mcode, 0.5))
    with pytest.raises(ValueError, match="dtype must be one of"):
        softmax_native.launch_config(jnp.int32, 4, 4, "none")
    with pytest.raises(ValueError, match="mode must be one of.*'upper'"):
        softmax_native.launch_config(jnp.float32, 4, 4, "upper")
