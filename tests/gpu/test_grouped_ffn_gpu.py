"""GPU tests of te_ops.grouped_ffn: the Triton path (activation fused into the grouped GEMM
epilogues for None / relu / silu, plain GEMMs around XLA for the GELUs) against the reference (the
unfused composition run on the same GPU through XLA), forward and backward, random uneven group
sizes with empty groups and rows past the groups, bf16 and fp16, float32 master kernels, every kernel
output NaN-poisoned; the fused intermediates h and act against their unfused values; the tile
configurations the benchmark may pick; and the opt-in Gluon warp-specialized act / dact kernels
(GLUON_WS) against the reference at odd shapes and group sizes and against the Triton kernels.
Budget: < 60 s on an H200 before the Gluon cases were added (those not yet run on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core import native
from te_ops._core import testing as T
from te_ops.grouped_dense import ffn as F
from te_ops.grouped_dense import grouped_ffn
from te_ops.grouped_dense import reference as ref
from te_ops.grouped_dense import triton as tri

pytestmark = pytest.mark.gpu


def _reason():
    return F.FAMILY.get("triton").available() or native.cuda_device_unavailable_reason()


needs_triton = pytest.mark.skipif(_reason() is not None, reason=f"triton: {_reason()}")
BF16, F16 = jnp.bfloat16, jnp.float16


def make(seed, m, h, f, o, g, gated, dtype, kdtype=None):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (m, h), jnp.float32).astype(dtype)
    wi = (jax.random.normal(ks[1], (g, h, 2 * f if gated else f), jnp.float32) / np.sqrt(h)).astype(kdtype or dtype)
    wo = (jax.random.normal(ks[2], (g, f, o), jnp.float32) / np.sqrt(f)).astype(kdtype or dtype)
    dy = jax.random.normal(ks[3], (m, o), jnp.float32).astype(dtype)
    rng = np.random.default_rng(seed)
    sizes = np.floor(rng.dirichlet(np.full(g, 0.6)) * m * 0.85).astype(np.int32)
    sizes[rng.choice(g, size=min(2, g - 1), replace=False)] = 0
    return x, wi, wo, jnp.asarray(sizes), dy


def run(impl, x, wi, wo, s, dy, activation, gated):
    def step(x, wi, wo, s, dy):
        y, vjp = jax.vjp(lambda *a: grouped_ffn(*a, s, activation=activation, gated=gated, implementation=impl),
                         x, wi, wo)  # fmt: skip
        return (y, *vjp(dy))

    with native.poisoned_outputs():
        return jax.jit(step)(x, wi, wo, s, dy)


def check(got, want, dtype, names=("y", "dx", "dwi", "dwo")):
    for name, a, e in zip(names, got, want, strict=True):
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        a32 = np.asarray(jnp.asarray(a, jnp.float32))
        assert not np.isnan(a32).any(), f"{name}: unwritten (NaN-poisoned) element"
        scale = float(np.abs(np.asarray(jnp.asarray(e, jnp.float32))).max(initial=0.0)) + 1e-6
        T.assert_close(a, e, dtype, scale=max(1.0, scale), err_msg=name)


# (M, H, F, O, G): the MoE training shape scaled down; H / F not multiples of the tiles; one group
CASES = [
    ((4096, 1024, 512, 1024, 8), BF16),
    ((2000, 264, 200, 136, 5), BF16),
    ((2000, 264, 200, 136, 5), F16),
    ((777, 64, 128, 64, 1), BF16),
]
ACTS = [("silu", True), ("relu", False), ("relu", True), (None, False), ("gelu_tanh", True)]


@needs_triton
@pytest.mark.parametrize("shape,dtype", CASES)
@pytest.mark.parametrize("activation,gated", ACTS)
def test_triton_matches_reference(shape, dtype, activation, gated):
    m, h, f, o, g = shape
    x, wi, wo, s, dy = make(sum(shape), m, h, f, o, g, gated, dtype)
    got = run("triton", x, wi, wo, s, dy, activation, gated)
    want = run("reference", x, wi, wo, s, dy, activation, gated)
    check(got, want, dtype)
    used = int(np.minimum(np.cumsum(np.maximum(np.asarray(s), 0)), m)[-1])
    assert np.all(np.asarray(got[0][used:], np.float32) == 0), "tail rows of y must be zero"
    assert np.all(np.asarray(got[1][used:], np.float32) == 0), "tail rows of dx must be zero"


@needs_triton
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(
    "cfg",
    [None, tri.GemmConfig(BN=64), tri.GemmConfig(BN=128, num_stages=4), tri.GemmConfig(BN=128, GLUON_WS=True)],
    ids=["default", "bn64", "stages4", "gluon"],
)
def test_fused_intermediates_match_unfused(gated, cfg):
    """h and act of the act GEMM, dh of the dact GEMM, each against the unfused computation on the
    same inputs (grouped_dense's Triton GEMM and the activation in XLA), in the default and the
    alternative tile configurations (GLUON_WS: the Gluon warp-specialized kernels on sm_90)."""
    m, h, f, o, g = 4096, 512, 384, 256, 6
    x, wi, wo, s, dy = make(7, m, h, f, o, g, gated, BF16)
    with native.poisoned_outputs():
        hh, a = jax.jit(lambda *v: tri.ffn_act_gemm(*v, activation="silu", gated=gated, cfg=cfg))(x, wi, s)
        dh = jax.jit(lambda *v: tri.ffn_dact_gemm(*v, activation="silu", gated=gated, cfg=cfg))(dy, wo, hh, s)
    h_want = jax.jit(lambda *v: tri.grouped_gemm(*v, None, trans_b=False, cfg=tri.GemmConfig()))(x, wi, s)
    a_want = ref.ffn_activation(hh, "silu", gated)
    da = jax.jit(lambda *v: tri.grouped_gemm(*v, None, trans_b=True, cfg=tri.GemmConfig()))(dy, wo, s)
    dh_want = jax.vjp(lambda v: ref.ffn_activation(v, "silu", gated), hh)[1](da)[0]
    for name, got, want in (("h", hh, h_want), ("act", a, a_want), ("dh", dh, dh_want)):
        got32 = np.asarray(got, np.float32)
        assert not np.isnan(got32).any(), f"{name}: unwritten (NaN-poisoned) element"
        T.assert_close(got, want, BF16, scale=max(1.0, float(np.abs(np.asarray(want, np.float32)).max())),
                       err_msg=name)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_float32_master_kernels(dtype):
    """float32 kernels with a 16-bit x: y and dx bit-equal to the call with cast kernels, kernel
    gradients float32 and close to the cast call's."""
    x, wi, wo, s, dy = make(11, 2048, 256, 256, 512, 4, True, dtype, jnp.float32)
    got = run("triton", x, wi, wo, s, dy, "silu", True)
    cast = run("triton", x, wi.astype(dtype), wo.astype(dtype), s, dy, "silu", True)
    assert got[2].dtype == jnp.float32 and got[3].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(cast[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(cast[1], np.float32))
    T.assert_close(got[2], cast[2], dtype, scale=4)
    T.assert_close(got[3], cast[3], dtype, scale=4)


# ----------------------------------------------------------------------------------------------
# The Gluon warp-specialized FFN kernels (opt-in: ffn_act / ffn_dact GemmConfig with GLUON_WS=True)
# ----------------------------------------------------------------------------------------------

GLUON = tri.GemmConfig(BN=128, GLUON_WS=True)
needs_gluon = pytest.mark.skipif(
    _reason() is not None or tri.gluon_ws_unavailable_reason() is not None,
    reason=f"Gluon ws FFN kernels: {_reason() or tri.gluon_ws_unavailable_reason()}",
)


def _run_gluon(monkeypatch, x, wi, wo, s, dy, activation, gated):
    """``run("triton", ...)`` with the Gluon act and dact kernels, checking that they were lowered (the
    bridge's launcher call, made once per kernel each time a new jitted step is lowered)."""
    with monkeypatch.context() as mp, tri.config_override(ffn_act=GLUON, ffn_dact=GLUON):
        names = T.recorded_kernel_names(mp)
        got = run("triton", x, wi, wo, s, dy, activation, gated)
    assert "te_grouped_gemm_act_ws" in names and "te_grouped_gemm_dact_ws" in names, names
    return got


def _check_tail(got, s, m):
    used = int(np.minimum(np.cumsum(np.maximum(np.asarray(s), 0)), m)[-1])
    assert np.all(np.asarray(got[0][used:], np.float32) == 0), "tail rows of y must be zero"
    assert np.all(np.asarray(got[1][used:], np.float32) == 0), "tail rows of dx must be zero"


# (M, H, F, O, G): H and O multiples of BK = 64 (the route's condition); M not a multiple of 128; F
# not a multiple of BN = 128 (the last column tile of each half masked) or a multiple of it. Every
# fused activation at the first shape, gated SiLU and ReLU at the others.
_ODD = (2000, 320, 200, 192, 5)
GLUON_CASES = [(_ODD, BF16, act, gated) for act, gated in
               [("silu", True), ("relu", False), ("relu", True), (None, False), (None, True), ("silu", False)]] + [
    (shape, dtype, act, gated)
    for shape, dtype in [(_ODD, F16), ((4096, 1024, 512, 1024, 8), BF16), ((777, 64, 128, 64, 1), BF16)]
    for act, gated in [("silu", True), ("relu", False)]
]  # fmt: skip


@needs_gluon
@pytest.mark.parametrize("shape,dtype,activation,gated", GLUON_CASES)
def test_gluon_route_matches_reference(shape, dtype, activation, gated, monkeypatch):
    """The Gluon act and dact kernels inside the op against the reference, forward and backward:
    uneven random groups with two empty ones, rows past the groups (zero in y and dx), every output
    NaN-poisoned (an element no kernel writes shows up)."""
    m, h, f, o, g = shape
    x, wi, wo, s, dy = make(sum(shape) + 1, m, h, f, o, g, gated, dtype)
    got = _run_gluon(monkeypatch, x, wi, wo, s, dy, activation, gated)
    want = run("reference", x, wi, wo, s, dy, activation, gated)
    check(got, want, dtype)
    _check_tail(got, s, m)


@needs_gluon
@pytest.mark.parametrize(
    "sizes",
    [
        [0, 0, 640, 0, 0, 0],
        [0] * 6,  # no group rows: every tile is a zero tile
        [300, 300, 300, 0, 0, 0],  # clipped at M: group 2 is rows [600, 640)
        [1, 2, 3, 4, 5, 6],
        [128, 128, 0, 129, 1, 200],  # whole tiles, a group ending one row into a tile
        [5, -3, 20, 30, 0, 1],  # a negative size counts as 0
    ],
)
def test_gluon_route_edge_sizes(sizes, monkeypatch):
    """Group sizes at the tile edges (M = 640, BM = 128): the Gluon kernels' TMA-store tiles, masked
    partial tiles and zero tiles never write another group's rows; against the reference."""
    m, h, f, o = 640, 192, 136, 128
    x, wi, wo, _, dy = make(3, m, h, f, o, len(sizes), True, BF16)
    s = jnp.asarray(sizes, jnp.int32)
    for activation, gated in (("silu", True), ("relu", False)):
        wi_ = wi if gated else wi[:, :, :f]
        got = _run_gluon(monkeypatch, x, wi_, wo, s, dy, activation, gated)
        want = run("reference", x, wi_, wo, s, dy, activation, gated)
        check(got, want, BF16)
        _check_tail(got, s, m)


@needs_gluon
@pytest.mark.parametrize("gated", [True, False])
def test_gluon_intermediates_match_triton_kernels(gated):
    """h, act and dh of the Gluon kernels against the Triton fused kernels' on the same inputs (the
    same tiles, roundings and activation formulas: equal up to the float32 accumulation order), at
    odd sizes (M = 3001, F = 328: masked rows and columns), with a zero-size group."""
    m, h, f, o, g = 3001, 256, 328, 192, 6
    x, wi, wo, s, dy = make(19, m, h, f, o, g, gated, BF16)
    s = s.at[2].set(0)
    out = {}
    for tag, cfg in (("triton", tri.GemmConfig(BN=128)), ("gluon", GLUON)):
        with native.poisoned_outputs():
            hh, a = jax.jit(lambda *v, cfg=cfg: tri.ffn_act_gemm(*v, activation="silu", gated=gated, cfg=cfg))(x, wi, s)
            # both dact kernels on the Triton kernel's h
            h_in = out["triton"][0] if out else hh
            dh = jax.jit(lambda *v, cfg=cfg: tri.ffn_dact_gemm(*v, activation="silu", gated=gated, cfg=cfg))(
                dy, wo, h_in, s
            )
        out[tag] = (hh, a, dh)
    for name, got, want in zip(("h", "act", "dh"), out["gluon"], out["triton"], strict=True):
        got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert not np.isnan(got32).any(), f"{name}: unwritten (NaN-poisoned) element"
        used = int(np.minimum(np.cumsum(np.maximum(np.asarray(s), 0)), m)[-1])
        assert np.all(got32[used:] == 0), f"{name}: rows past the groups must be zero"
        T.assert_close(got, want, BF16, scale=max(1.0, float(np.abs(want32).max())), err_msg=name)
