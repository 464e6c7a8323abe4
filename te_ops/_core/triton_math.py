"""Elementwise Triton helpers shared by the kernels of several ops (imported only by kernel modules:
this module imports triton at module scope): rounding float32 to a narrower float grid, and the
activations of the fused expert FFN kernels with their derivatives."""

import triton
import triton.language as tl


@triton.jit
def round_to_fp8_grid(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """``v`` (float32, |v| <= the format's max, or NaN) rounded to the nearest value of an FP8
    format with MBITS mantissa bits and smallest normal exponent EMIN, ties to even; NaN kept."""
    SHIFT: tl.constexpr = 23 - MBITS
    bits = v.to(tl.uint32, bitcast=True)
    lsb = (bits >> SHIFT) & 1
    half_minus_one = (1 << (SHIFT - 1)) - 1
    keep = ~((1 << SHIFT) - 1)
    normal = ((bits + half_minus_one + lsb) & keep).to(tl.float32, bitcast=True)
    # below 2**EMIN the grid step is 2**(EMIN - MBITS): scale it to 1 (exact) and round to an integer
    # with the 1.5 * 2**23 trick (one round-to-nearest-even float32 addition)
    # (on the magnitude, then the sign put back: a negative value that rounds to zero is -0, as the
    # float32 -> FP8 conversion gives)
    up = tl.abs(v) * (2.0 ** (MBITS - EMIN))
    mag = ((up + 12582912.0) - 12582912.0) * (2.0 ** (EMIN - MBITS))
    # OR the sign bit in (-mag is 0 - mag in Triton: +0, not -0, for mag = 0)
    sub = (mag.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    out = tl.where(tl.abs(v) < 2.0**EMIN, sub, normal)
    return tl.where(v != v, v, out)


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    """act'(z) in float32 (the formulas of reference.act_grad): ACT 1 GELU (erf), 2 GELU (tanh
    approximation), 3 ReLU (0 at z <= 0), 4 SiLU; 0 (no activation) is 1."""
    if ACT == 1:
        d = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * (tl.exp(-0.5 * z * z) * 0.3989422804014327)
    elif ACT == 2:
        t = 1.0 - 2.0 / (tl.exp(2.0 * (0.7978845608028654 * (z + 0.044715 * (z * z * z)))) + 1.0)  # tanh
        d = 0.5 * (1.0 + t) + (0.5 * z) * ((1.0 - t * t) * (0.7978845608028654 * (1.0 + 0.134145 * (z * z))))
    elif ACT == 3:
        d = tl.where(z > 0.0, 1.0, 0.0)
    elif ACT == 4:
        sg = 1.0 / (1.0 + tl.exp(-z))
        d = sg * (1.0 + z * (1.0 - sg))
    else:
        d = tl.full(z.shape, 1.0, tl.float32)
    return d


@triton.jit
def _dact(d, z, ACT: tl.constexpr):
    """d * act'(z) in float32 as automatic differentiation gives it: for ReLU a select (where(z > 0,
    d, 0): a NaN or Inf d at z <= 0 gives 0), a product otherwise."""
    if ACT == 3:
        r = tl.where(z > 0.0, d, 0.0)
    else:
        r = d * _act_grad(z, ACT)
    return r


@triton.jit
def _act(z, ACT: tl.constexpr):
    """act(z) in float32 for the fused FFN kernels (ACT as _act_grad's): ReLU (NaN kept), SiLU
    z / (1 + exp(-z)), 0: z. (The GELUs are not fused: ``1 + erf`` and ``1 + tanh`` cancel for very
    negative z, where XLA's erfc and clamped tanh give other values; those run unfused.)"""
    if ACT == 3:
        a = tl.where(z > 0.0, z, tl.where(z != z, z, 0.0))
    elif ACT == 4:
        a = z / (1.0 + tl.exp(-z))
    else:
        a = z
    return a


@triton.jit
def _round_to(x, dt: tl.constexpr, HW: tl.constexpr):
    """float32 ``x`` rounded to ``dt`` (bfloat16, float16 or float32) to nearest even, as float32.
    HW: the GPU's conversion; otherwise integer arithmetic (Triton's interpreter truncates, and
    its round-to-nearest mode misses the carry into the exponent)."""
    if HW:
        r = x.to(dt).to(tl.float32)
    elif dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        r = tl.where(x != x, x, r)
    elif dt == tl.float16:
        r = round_to_fp8_grid(x, 10, -14)  # float16's grid: 10 mantissa bits, normals from 2**-14
        r = tl.where(tl.abs(r) >= 65536.0, tl.where(x > 0.0, float("inf"), float("-inf")), r)  # past 65504
    else:
        r = x
    return r
