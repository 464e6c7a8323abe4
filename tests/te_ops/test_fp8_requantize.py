"""``te_ops.fp8.triton.requantize_t``: FP8 rows in 1 x 128 tiles dequantized and quantized again
transposed (the weight-gradient operand of the FP8 token dispatch), under Triton's CPU interpreter,
byte for byte against the reference's ``quantize_blocks(dequantize(q, float32).T, (1, b))``."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops import fp8
from te_ops._core import testing as T
from tests.te_ops._interpret_runner import run_interpreted

# (shape, block, input format, output format, power_of_2, margin): partial tiles both ways
_CASES = [
    ((300, 200), 128, fp8.E4M3, fp8.E4M3, True, 0),
    ((130, 260), 128, fp8.E4M3, fp8.E4M3, False, 0),
    ((64, 96), 32, fp8.E5M2, fp8.E5M2, True, 0),
    ((200, 130), 64, fp8.E5M2, fp8.E4M3, False, 1),
    ((256, 256), 128, fp8.E4M3, fp8.E5M2, True, 0),
    ((1, 5), 128, fp8.E4M3, fp8.E4M3, True, 0),
]


def _input(shape, block, fmt, pow2, seed):
    """A quantized tensor with every byte code of the format in its first rows (NaN, Inf, zeros,
    subnormals), random row scales (power-of-two or not), and an all-zero row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-6, 6, (shape[0], 1))).astype(np.float32)
    q = fp8.reference.quantize_blocks(jnp.asarray(x), (1, block), fmt, power_of_2=pow2)
    data = T.fp8_bytes(q.data).copy()
    codes = np.arange(256, dtype=np.uint8)
    flat = data.reshape(-1)
    n = min(256, flat.size)
    flat[:n] = codes[:n]  # every code, row-major from the first row
    if shape[0] > 3:
        data[3] = 0
    sinv = np.asarray(q.scale_inv).copy()
    sinv[: min(2, shape[0])] = 1.0  # the rows holding the codes: their values as coded
    data = jax.lax.bitcast_convert_type(jnp.asarray(data), fmt)
    return fp8.reference.QuantizedTensor(data, jnp.asarray(sinv), (1, block), jnp.dtype(jnp.bfloat16))


def _main() -> int:
    from tests.te_ops._interpret_runner import interpreter_setup

    ref, tri = interpreter_setup()
    failures = 0
    for i, (shape, block, fin, fout, pow2, margin) in enumerate(_CASES):
        q = _input(shape, block, fin, pow2, 300 + i)
        got = tri.requantize_t(q, fout, power_of_2=pow2, margin=margin)
        deq_t = ref.dequantize(q, jnp.float32).T
        if margin == 0:
            want = ref.quantize_blocks(deq_t, (1, block), fout, power_of_2=pow2)
            want_data, want_sinv = np.asarray(want.data), np.asarray(want.scale_inv)
        else:  # the reference's block rule with the margin: scale / 2**margin
            xb, _ = ref._blocked(deq_t, (1, block))
            nan = jnp.any(jnp.isnan(xb), axis=(-3, -1))
            amax = jnp.max(jnp.abs(jnp.where(jnp.isnan(xb), 0, xb)), axis=(-3, -1))
            scale = jnp.where(nan, 1.0, ref.compute_scale(amax, fp8.format_max(fout), margin, pow2))
            wq = ref.cast_scaled(xb, scale[..., :, None, :, None], fout)
            want_data = np.asarray(wq.reshape(xb.shape[-4], xb.shape[-2] * block)[:, : deq_t.shape[1]])
            want_sinv = np.asarray(1.0 / scale)
        ok = got.data.shape == want_data.shape == (shape[1], shape[0]) and got.block == (1, block)
        ok = ok and T.same_fp8_bytes(got.data, want_data)
        ok = ok and np.array_equal(np.asarray(got.scale_inv), want_sinv)
        name = f"{shape} 1x{block} {jnp.dtype(fin).name} -> {jnp.dtype(fout).name} pow2={pow2} margin={margin}"
        print(f"requantize_t case {i} {name}: {'ok' if ok else 'MISMATCH'}")
        failures += not ok
    # the dispatch's weight-gradient operand through the Triton path equals the reference path's
    from te_ops.fp8 import dispatch as fd

    rec = fp8.BlockScaling()
    q = _input((260, 200), 128, fp8.E4M3, True, 399)
    fd.REQUANTIZE_KERNEL = True  # the kernel (default off until its GPU test has run) ...
    a, b = fd.wgrad_operand(q, rec, "triton"), fd.wgrad_operand(q, rec, "reference")
    fd.REQUANTIZE_KERNEL = False  # ... and the XLA dequantize + block_quantize it replaces: the same bytes
    c = fd.wgrad_operand(q, rec, "triton")
    ok = np.array_equal(T.fp8_bytes(a.data), T.fp8_bytes(c.data))
    ok = ok and np.array_equal(np.asarray(a.scale_inv), np.asarray(c.scale_inv)) and a.dtype == c.dtype
    print(f"wgrad_operand kernel vs block_quantize path: {'ok' if ok else 'MISMATCH'}")
    failures += not ok
    ok = T.same_fp8_bytes(a.data, b.data)  # NaN positions, the other bytes
    ok = ok and np.array_equal(np.asarray(a.scale_inv), np.asarray(b.scale_inv))
    print(f"wgrad_operand triton vs reference: {'ok' if ok else 'MISMATCH'}")
    failures += not ok
    print(f"interpret failures: {failures}")
    return failures


def test_requantize_t_under_interpreter():
    run_interpreted(__file__)


def test_requantize_t_rejects_other_blocks():
    from te_ops.fp8 import triton as tri

    q = fp8.reference.quantize_blocks(jnp.ones((128, 128)), (128, 128), fp8.E4M3, power_of_2=True)
    with pytest.raises(ValueError, match="1 x b row tiles"):
        tri.requantize_t(q, fp8.E4M3, power_of_2=True)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(_main())
