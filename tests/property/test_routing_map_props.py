"""te_ops.pack_routing_map / unpack_routing_map against a numpy formulation of docs/semantics.md ("Router",
``compact_routing_map``): a bool map ``[..., E]`` packs to uint8 ``[..., ceil(E / 8)]`` with expert ``e`` in
bit ``e % 8`` of byte ``e // 8``; the padding bits past E in the last byte are 0 when packing and ignored
when unpacking. Compared byte for byte: the packed bytes (dtype, shape, every bit, padding included), the
unpacked map, both round trips, and the packed width that ``unpack_routing_map`` accepts for ``num_experts``.

Maps: any leading axes (none, several, of length 0), E from 0 to 72 (multiples of 8 and not), every density,
and the MoE routing kinds of test_permutation_props.py (empty experts, every token on one expert, tokens
routed to no expert, top-k from 1 to E)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import te_ops
from tests.property._common import fuzz, seeds, size
from tests.property.test_permutation_props import routing


def np_pack(m: np.ndarray) -> np.ndarray:
    """The spec's layout, bit by bit: expert e sets bit e % 8 of byte e // 8; nothing else is set."""
    e = m.shape[-1]
    out = np.zeros((*m.shape[:-1], -(-e // 8)), np.uint8)
    for ex in range(e):
        out[..., ex // 8] |= m[..., ex].astype(np.uint8) << np.uint8(ex % 8)
    return out


def np_unpack(p: np.ndarray, e: int) -> np.ndarray:
    """Expert ex is bit ex % 8 of byte ex // 8; the bits past E are not read."""
    out = np.zeros((*p.shape[:-1], e), bool)
    for ex in range(e):
        out[..., ex] = (p[..., ex // 8] >> np.uint8(ex % 8)) & np.uint8(1) == 1
    return out


def _map(rng, shape, density):
    if density == "alternating":  # every other expert: catches a reversed bit order on every byte
        return np.broadcast_to(np.arange(shape[-1]) % 2 == 0, shape).copy()
    return rng.random(shape) < density


# The strategies of each test, importable (as in the other property tests).
PACK_ARGS = dict(
    lead=st.lists(size(9, min_size=0, sizes=(0, 1, 2, 3, 7)), min_size=0, max_size=2),
    e=size(72, min_size=0, sizes=(0, 1, 2, 3, 5, 7, 8, 9, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 72)),
    density=st.sampled_from([0.0, 0.1, 0.5, 1.0, "alternating"]),
    jit=st.booleans(),
    seed=seeds,
)


@fuzz(20)
@given(**PACK_ARGS)
def test_pack_routing_map(lead, e, density, jit, seed):
    m = _map(np.random.default_rng(seed), (*lead, e), density)
    pack = jax.jit(te_ops.pack_routing_map) if jit else te_ops.pack_routing_map
    got = pack(jnp.asarray(m))
    want = np_pack(m)
    assert got.dtype == jnp.uint8 and got.shape == (*lead, -(-e // 8)), f"packed {got.dtype} {got.shape}"
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"packed bytes, E={e}")
    if e % 8:  # the padding bits past E in the last byte are 0
        assert not np.any(np.asarray(got)[..., -1] >> np.uint8(e % 8)), "padding bits set"
    back = te_ops.unpack_routing_map(got, e)
    assert back.dtype == jnp.bool_ and back.shape == m.shape
    np.testing.assert_array_equal(np.asarray(back), m, err_msg="unpack(pack(map)) != map")


UNPACK_ARGS = dict(
    lead=st.lists(size(9, min_size=0, sizes=(0, 1, 2, 5)), min_size=0, max_size=2),
    e=size(72, min_size=0, sizes=(0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 72)),
    fill=st.sampled_from(["random", "ones", "zeros", "padding_only"]),
    jit=st.booleans(),
    seed=seeds,
)


@fuzz(20)
@given(**UNPACK_ARGS)
def test_unpack_routing_map(lead, e, fill, jit, seed):
    """Any byte pattern, padding bits included (they are ignored whatever they hold)."""
    rng = np.random.default_rng(seed)
    shape = (*lead, -(-e // 8))
    p = {
        "random": lambda: rng.integers(0, 256, shape).astype(np.uint8),
        "ones": lambda: np.full(shape, 0xFF, np.uint8),
        "zeros": lambda: np.zeros(shape, np.uint8),
        "padding_only": lambda: np.zeros(shape, np.uint8),
    }[fill]()
    if fill == "padding_only" and e % 8:  # only the bits past E set: the map must be all False
        p[..., -1] = np.uint8(0xFF << (e % 8) & 0xFF)
    unpack = jax.jit(te_ops.unpack_routing_map, static_argnums=1) if jit else te_ops.unpack_routing_map
    got = unpack(jnp.asarray(p), e)
    assert got.dtype == jnp.bool_ and got.shape == (*lead, e), f"unpacked {got.dtype} {got.shape}"
    np.testing.assert_array_equal(np.asarray(got), np_unpack(p, e), err_msg=f"unpacked bits, E={e}")
    # pack(unpack(p)) is p with the padding bits cleared
    mask = np_pack(np.ones((e,), bool)) if e else np.zeros((0,), np.uint8)
    np.testing.assert_array_equal(np.asarray(te_ops.pack_routing_map(got)), p & mask, err_msg="pack(unpack(p))")


@fuzz(12)
@given(rk=routing(), seed=seeds)
def test_routing_kinds_round_trip(rk, seed):
    """MoE maps (empty experts, every token on one expert, tokens on no expert, top-k 1..E): the packed
    bytes, the number of set bits per token (its number of experts), the round trip; under vmap over tokens
    too (any leading axes)."""
    del seed
    rmap, _ = rk
    t, e = rmap.shape
    packed = te_ops.pack_routing_map(jnp.asarray(rmap))
    np.testing.assert_array_equal(np.asarray(packed), np_pack(rmap), err_msg="packed bytes")
    pops = np.unpackbits(np.asarray(packed), axis=-1).reshape(t, -1).sum(-1) if t else np.zeros(0)
    np.testing.assert_array_equal(pops, rmap.sum(-1), err_msg="set bits per token != experts per token")
    if t:
        vm = jax.vmap(te_ops.pack_routing_map)(jnp.asarray(rmap))
        np.testing.assert_array_equal(np.asarray(vm), np_pack(rmap), err_msg="vmap(pack) over tokens")
    np.testing.assert_array_equal(np.asarray(te_ops.unpack_routing_map(packed, e)), rmap, err_msg="round trip")


@fuzz(30)
@given(width=st.integers(0, 6), e=st.integers(0, 56), rows=size(3, min_size=0, sizes=(0, 1, 3)))
def test_unpack_accepts_exactly_the_matching_width(width, e, rows):
    """unpack_routing_map(packed [.., W], E) is accepted iff ceil(E / 8) == W; otherwise a ValueError names
    num_experts and the range of E that W fits."""
    p = jnp.zeros((rows, width), jnp.uint8)
    if -(-e // 8) == width:
        assert te_ops.unpack_routing_map(p, e).shape == (rows, e)
    else:
        lo, hi = max(8 * width - 7, 0), 8 * width
        with pytest.raises(ValueError, match=rf"unpack_routing_map: num_experts={e} .* must be in \[{lo}, {hi}\]"):
            te_ops.unpack_routing_map(p, e)
