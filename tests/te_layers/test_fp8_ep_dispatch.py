"""MoEBlock with FP8 token dispatch under expert parallelism (``expert_axis``): the FP8 rows (uint16
byte pairs, with their 1 x 128 scale rows for block scaling) cross the all-to-all, and the block
equals the unsharded FP8-dispatch block (forward and gradients) on 8 CPU devices."""

from __future__ import annotations

import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_ops._core.testing import assert_close
from te_ops.fp8 import BlockScaling, CurrentScaling, DelayedScaling

E, K, F, H = 16, 2, 16, 32
RECIPES = {"block": BlockScaling(), "current": CurrentScaling(), "delayed": DelayedScaling(history_len=3)}


def _mesh(n=8):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (tests/conftest.py sets 8 virtual CPU devices), got {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:n]), ("ep",))


def _x(seed=0):
    x = jax.random.normal(jax.random.key(seed), (4, 16, H), jnp.float32) * 2.0  # 64 tokens, 8 per shard
    return x.at[0, 3, 5].set(40.0).at[1, 2, 7].set(-1e-9)  # an outlier; a value quantizing to -0


def _loss(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))


def _a2a_operands(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, shape) of the first operand of every all-to-all in compiled HLO text (XLA:CPU
    splits an exchange into one tuple operand per peer, all of one type)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"^\s*%\S+ = \(?(\w+)\[([\d,]*)\].* all-to-all\(", line)
        if m:
            found.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)))
    return found


@pytest.mark.parametrize("name", list(RECIPES))
def test_linen_fp8_ep_matches_unsharded(name):
    recipe, mesh, x = RECIPES[name], _mesh(), _x()
    common = dict(num_experts=E, topk=K, ffn_dim=F, aux_loss_coeff=0.0, fp8=recipe)
    ref = te_linen.MoEBlock(**common)
    ep = te_linen.MoEBlock(**common, expert_axis="ep", mesh=mesh)
    ep_hp = te_linen.MoEBlock(**common, expert_axis="ep", mesh=mesh, fp8_dispatch=False)
    variables = nn.meta.unbox(jax.jit(ref.init)(jax.random.key(1), x))

    def run(m):
        # the cotangent of "fp8_state" (delayed scaling) is the updated state (te_ops.fp8's rule)
        return jax.jit(jax.value_and_grad(lambda v, x: _loss(m.apply(v, x)), argnums=(0, 1)))

    compiled = [jax.jit(m.apply).lower(variables, x).compile() for m in (ref, ep, ep_hp)]  # one compile each
    y0, y1, y2 = (c(variables, x) for c in compiled)
    if isinstance(recipe, CurrentScaling):  # the wo GEMM's input (and wi's kernels) take per-shard scales
        assert np.linalg.norm(np.asarray(y1) - np.asarray(y0)) <= 0.05 * np.linalg.norm(np.asarray(y0))
    else:  # the same scales everywhere: the unsharded result (summation order aside)
        np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-6)
    ref_norm = np.linalg.norm(np.asarray(y0))
    assert np.linalg.norm(np.asarray(y1) - np.asarray(y2)) <= 0.1 * ref_norm  # vs bf16-row EP: FP8 error
    v0, (g0, gx0) = run(ref)(variables, x)
    v1, (g1, gx1) = run(ep)(variables, x)
    if name != "current":  # (a sum of sines cancels: no relative check with per-shard scales)
        np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    # gradients: FP8 tolerance (a float32 ulp of a different summation order can flip an FP8
    # rounding of a backward operand); current scaling quantizes dy (E5M2) and the wo input per
    # shard, as the bf16-row EP path does (which measured 0.14 from the unsharded block here)
    rel = 0.15 if name == "current" else 1e-2
    for a, b in zip(jax.tree.leaves((g1["params"], gx1)), jax.tree.leaves((g0["params"], gx0)), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= rel * np.linalg.norm(b) + 1e-6
    if name == "delayed":  # the updated state: the global amaxes
        for a, b in zip(jax.tree.leaves(g1["fp8_state"]), jax.tree.leaves(g0["fp8_state"]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    _check_exchanges(compiled[1].as_text(), name == "block")
    hp = _a2a_operands(compiled[2].as_text())
    assert hp.count(("f32", (1, 16, H))) == 2, hp  # bf16-row EP: rows out, results back (float32 here)


def _check_exchanges(hlo, block):
    """The token rows cross as uint16 FP8 byte pairs ``[1, N, H / 2]`` (plus float32 1 x 128 scale rows
    ``[1, N, 1]`` for block scaling); the only exchange of float rows ``[1, N, H]`` is the return."""
    ops = _a2a_operands(hlo)
    n = 16  # 8 tokens per shard, top 2
    assert ops.count(("u16", (1, n, H // 2))) == 1, ops
    assert ops.count(("f32", (1, n, H))) == 1, ops
    assert ops.count(("f32", (1, n, 1))) == int(block), ops
    assert all(t in ("s32", "u16", "f32") for t, _ in ops), ops


def test_eqx_fp8_ep_matches_unsharded():
    """Equinox, block scaling: the same output and gradients (model and x) as the unsharded block."""
    mesh, x = _mesh(), _x(3)
    kw = dict(aux_loss_coeff=0.0, fp8=BlockScaling(), key=jax.random.key(0))
    ref = te_eqx.MoEBlock(H, E, K, F, **kw)
    ep = te_eqx.MoEBlock(H, E, K, F, **kw, expert_axis="ep", mesh=mesh)
    np.testing.assert_array_equal(np.asarray(ep.wi), np.asarray(ref.wi))  # the same parameters

    def run(m):  # value and gradients with respect to the model and x
        return eqx.filter_jit(eqx.filter_value_and_grad(lambda mx: _loss(mx[0](mx[1])[0])))((m, x))

    c_ep = jax.jit(lambda x: ep(x)[0]).lower(x).compile()
    _check_exchanges(c_ep.as_text(), block=True)
    # float32 arithmetic in a different order (each shard's dots are smaller: XLA's CPU dot may sum
    # them in another order, as jax 0.12.1's does), not bit for bit
    want = np.asarray(jax.jit(lambda x: ref(x)[0])(x))
    assert_close(c_ep(x), want, jnp.float32, scale=float(np.max(np.abs(want))))
    (v0, (g0, gx0)), (v1, (g1, gx1)) = run(ref), run(ep)
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    for key in ("wi", "wo"):
        a, b = np.asarray(getattr(g1, key)), np.asarray(getattr(g0, key))
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), key
    assert np.linalg.norm(np.asarray(gx1 - gx0)) <= 1e-2 * np.linalg.norm(np.asarray(gx0))


@pytest.mark.parametrize("name", ["block", "current"])
def test_fp8_rows_cross_bit_exact(name):
    """The FP8 rows the experts receive are, byte for byte (negative zero included) and scale for
    scale, the quantization of the high-precision rows the bf16 exchange delivers: block scaling
    per 1 x 128 row tile, current scaling with the scale of the amax over all shards' tokens."""
    from jax.sharding import PartitionSpec as P

    from te_layers import _common as C
    from te_ops.fp8 import dispatch as D
    from te_ops.fp8 import reference as ref
    from te_ops.fp8.recipes import format_max
    from te_ops.permutation import sort_chunks_by_index, token_dispatch
    from te_ops.router import fused_topk_with_score_function

    mesh, x = _mesh(), _x().reshape(-1, H)
    _, rmap = fused_topk_with_score_function(jax.random.normal(jax.random.key(7), (x.shape[0], E)), K)
    recipe = BlockScaling() if name == "block" else CurrentScaling()
    fmt = recipe.format("x")

    def body(xs, rm):
        n = xs.shape[0] * K
        if name == "block":
            q = ref.quantize_blocks(xs, (1, 128), fmt, power_of_2=recipe.power_of_2)
        else:
            q = C._ep_quantize_tokens(recipe, "reference", xs, None, "ep")[0]
        d = D._move(q, rm, n, None, None)
        lay = C._ep_layout(d.tokens_per_expert, E // 8, n, "ep")
        got = C._ep_send_quantized(d.out, lay, "ep")
        rows = token_dispatch(xs, rm, n).out  # the high-precision exchange
        recv = C._ep_send(rows, lay, "ep").reshape(8 * n, H)
        grouped, _ = sort_chunks_by_index(recv, lay.split, jnp.asarray(C._ep_order(8, E // 8)))
        if name == "block":
            want = ref.quantize_blocks(grouped, (1, 128), fmt, power_of_2=recipe.power_of_2)
            sg, sw = got.scale_inv, want.scale_inv
        else:
            scale = ref.compute_scale(jax.lax.pmax(ref.amax(xs), "ep"), format_max(fmt), 0, False)
            want = ref.QuantizedTensor(ref.cast_scaled(grouped, scale, fmt), 1.0 / scale, None, xs.dtype)
            sg, sw = jnp.reshape(got.scale_inv, (1, 1)), jnp.reshape(want.scale_inv, (1, 1))
        u8 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)  # noqa: E731
        return u8(got.data), u8(want.data), sg, sw

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
    got, want, sg, sw = (np.asarray(a) for a in f(x, rmap))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(sg, sw)
    assert (got == 0x80).any(), "the inputs should produce a negative zero"


@pytest.mark.parametrize("name", ["block", "delayed"])
def test_linen_fp8_ep_bfloat16_with_float32_master_kernels(name):
    """bfloat16 compute with float32 expert parameters (master kernels into the FP8 ops, also through
    the expert-parallel FP8 exchange): the sharded block equals the unsharded one, and the expert
    gradients are float32 sums (not bfloat16 values widened)."""
    recipe, mesh, x = RECIPES[name], _mesh(), _x(5).astype(jnp.bfloat16)
    common = dict(num_experts=E, topk=K, ffn_dim=F, aux_loss_coeff=0.0, fp8=recipe, dtype=jnp.bfloat16)
    ref = te_linen.MoEBlock(**common)
    ep = te_linen.MoEBlock(**common, expert_axis="ep", mesh=mesh)
    variables = nn.meta.unbox(jax.jit(ref.init)(jax.random.key(2), x))
    assert variables["params"]["wi"].dtype == jnp.float32

    def run(m):
        return jax.jit(jax.value_and_grad(lambda v, x: _loss(m.apply(v, x)), argnums=(0, 1)))(variables, x)

    (v0, (g0, _)), (v1, (g1, _)) = run(ref), run(ep)
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-2)
    for key in ("wi", "wo"):
        a, b = np.asarray(g1["params"][key]), np.asarray(g0["params"][key])
        assert a.dtype == b.dtype == np.float32, key
        assert np.any(b != np.asarray(jnp.asarray(b).astype(jnp.bfloat16), np.float32)), key
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b) + 1e-6, key
