"""GPU tests of the permutation ops (Triton and Gluon kernels through our Triton bridge).

Triton/Gluon vs the reference (run on the same GPU through XLA), forward and backward, with and
without probs and padding, E in {8, 64, 256}, uneven routing with empty experts, capacity overflow
(more routed pairs than num_out_tokens: every TokenDispatchResult field, the combine and the
gradients, eagerly and under jit) and empty sizes; every output the kernels write starts
NaN-poisoned (native.poisoned_outputs is honoured by the bridge). Also: command
buffers (subprocess with XLA_FLAGS), and the bridge's compile-once / compile-in-parallel counters
when lowering from 8 threads.
"""

import functools
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core import native
from te_ops._core import triton_bridge as tb
from te_ops._core.testing import assert_close
from te_ops.permutation import api, sort_chunks_by_index, token_combine, token_dispatch
from te_ops.permutation import reference as ref
from tests.gpu.cmdbuf import run_script_under_command_buffers

pytestmark = pytest.mark.gpu


def _reason(impl):
    why = api.DISPATCH.get(impl).available()
    return why or native.cuda_device_unavailable_reason()


IMPLS = [
    pytest.param(i, marks=pytest.mark.skipif(_reason(i) is not None, reason=f"{i}: {_reason(i)}"))
    for i in ("triton", "gluon")
]


def routing(t, e, k, seed):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((t, e)) + np.linspace(0, 3, e)
    scores[:, : max(1, e // 4)] -= 100.0  # a quarter of the experts gets no token
    top = np.argsort(-scores, axis=1)[:, :k]
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, top, True, axis=1)
    return jnp.asarray(rm)


def run(impl, x, rm, probs, align, k, g_seed=0, num_out_tokens=None, use_jit=True):
    """Forward outputs and all gradients of dispatch -> scale -> combine, traced fresh (poisoning
    is a trace-time setting). ``num_out_tokens`` defaults to T * k; smaller values overflow."""
    t, h = x.shape
    n0 = t * k if num_out_tokens is None else num_out_tokens
    n = ref.out_rows(n0, rm.shape[1], align)
    w = jax.random.normal(jax.random.PRNGKey(g_seed), (n, h), jnp.float32).astype(x.dtype)
    g = jax.random.normal(jax.random.PRNGKey(g_seed + 1), (t, h), x.dtype)
    gpp = jax.random.normal(jax.random.PRNGKey(g_seed + 2), (n,), jnp.float32)

    def f(x, probs, rm):
        res = token_dispatch(x, rm, n0, probs=probs, align_size=align, implementation=impl)
        y = token_combine(res.out * w, res.row_id_map, merging_probs=probs, implementation=impl)
        return res, y

    g_out = jax.random.normal(jax.random.PRNGKey(g_seed + 3), (n, h), x.dtype)

    def ct_like(v):
        if v is None:
            return None
        if jnp.issubdtype(v.dtype, jnp.integer):
            return np.zeros(v.shape, jax.dtypes.float0)
        return jnp.zeros_like(v)

    def step(x, probs, rm):
        fwd, vjp = jax.vjp(lambda x, p: f(x, p, rm), x, probs)
        cts = [ct_like(v) for v in fwd[0]]
        cts[0] = g_out
        if probs is not None:
            cts[1] = gpp.astype(probs.dtype)
        return fwd, vjp((type(fwd[0])(*cts), g))

    with native.poisoned_outputs():
        return (jax.jit(step) if use_jit else step)(x, probs, rm)


def _inputs(e, with_probs):
    t, h, k = 384, 320, 4
    rm = routing(t, e, k, seed=e)
    x = jax.random.normal(jax.random.PRNGKey(e), (t, h), jnp.bfloat16)
    probs = (jax.random.uniform(jax.random.PRNGKey(e + 1), (t, e)) * rm) if with_probs else None
    return x, rm, probs, k


@functools.cache
def _reference(e, with_probs, align):  # shared by the triton and gluon cases (saves compiles)
    x, rm, probs, k = _inputs(e, with_probs)
    return run("reference", x, rm, probs, align, k)


CONFIGS = [
    (8, False, None),
    (8, True, 16),
    (64, True, None),
    (256, True, 16),
    (256, False, None),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("e,with_probs,align", CONFIGS)
def test_matches_reference(impl, e, with_probs, align):
    x, rm, probs, k = _inputs(e, with_probs)
    (fwd, y), grads = run(impl, x, rm, probs, align, k)
    (rfwd, ry), rgrads = _reference(e, with_probs, align)
    _assert_same(impl, (fwd, y), grads, (rfwd, ry), rgrads)


def _assert_same(impl, got, grads, want, rgrads):
    """Dispatch outputs bit-identical (every field), combine and gradients within bf16 tolerance."""
    (fwd, y), (rfwd, ry) = got, want
    for name, a, b in zip(rfwd._fields, fwd, rfwd, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (impl, name, a.shape, b.shape)
        np.testing.assert_array_equal(
            np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), err_msg=f"{impl} {name}"
        )
    assert_close(y, ry, jnp.bfloat16, scale=4, err_msg=f"{impl} combine")
    for i, (a, b) in enumerate(zip(grads, rgrads, strict=True)):
        if b is None:
            continue
        assert_close(a, b, a.dtype, scale=8, err_msg=f"{impl} grad {i}")


# (E, with_probs, align, num_out_tokens): every case has more routed pairs (T * K = 1536) than the
# buffer holds, so the expert-major tail is dropped
OVERFLOW = [(8, True, None, 1000), (8, False, 16, 1000), (64, True, 16, 700), (256, True, None, 1)]


@functools.cache
def _overflow_reference(e, with_probs, align, n0, use_jit):  # shared by the triton and gluon cases
    x, rm, probs, k = _inputs(e, with_probs)
    return run("reference", x, rm, probs, align, k, num_out_tokens=n0, use_jit=use_jit)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("e,with_probs,align,n0", OVERFLOW)
def test_overflow_matches_reference(impl, use_jit, e, with_probs, align, n0):
    x, rm, probs, k = _inputs(e, with_probs)
    (fwd, y), grads = run(impl, x, rm, probs, align, k, num_out_tokens=n0, use_jit=use_jit)
    (rfwd, ry), rgrads = _overflow_reference(e, with_probs, align, n0, use_jit)
    assert int(rfwd.num_dropped) > 0
    assert int(rfwd.tokens_per_expert.sum()) <= rfwd.out.shape[0]
    _assert_same(impl, (fwd, y), grads, (rfwd, ry), rgrads)
    if with_probs:  # dropped pairs get no gradient (rows of row_id_map marked -2)
        m = np.asarray(fwd.row_id_map)
        e_ = rm.shape[1]
        dropped = np.zeros(rm.shape, bool)
        for t in range(m.shape[0]):
            dropped[t, m[t, e_ : 2 * e_][m[t, :e_] == -2]] = True
        assert dropped.sum() == int(fwd.num_dropped)
        np.testing.assert_array_equal(np.asarray(grads[1], np.float32)[dropped], 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,e,h,n0", [(0, 8, 64, 16), (16, 8, 0, 32), (16, 8, 64, 0)])
def test_empty_sizes_with_named_implementation(impl, t, e, h, n0):
    """Empty calls run the reference whatever the implementation asked for (nothing to launch)."""
    rm = routing(t, e, 2, seed=5) if t else jnp.zeros((0, e), bool)
    x = jax.random.normal(jax.random.PRNGKey(5), (t, h), jnp.bfloat16)
    probs = jax.random.uniform(jax.random.PRNGKey(6), (t, e)) * rm
    for use_jit in (False, True):
        (fwd, y), grads = run(impl, x, rm, probs, None, 2, num_out_tokens=n0, use_jit=use_jit)
        (rfwd, ry), rgrads = run("reference", x, rm, probs, None, 2, num_out_tokens=n0, use_jit=use_jit)
        _assert_same(impl, (fwd, y), grads, (rfwd, ry), rgrads)


@pytest.mark.parametrize("impl", IMPLS)
def test_dropped_pairs_and_zero_tail(impl):
    t, e, h, k = 64, 8, 100, 2  # H not a multiple of 16: the unhinted (scalar-access) kernels
    rm = routing(t, e, k, seed=3)
    x = jax.random.normal(jax.random.PRNGKey(3), (t, h), jnp.float32)
    for n0 in (40, 200):  # fewer rows than pairs (tail dropped), more rows (zero tail)
        with native.poisoned_outputs():
            got = jax.jit(lambda x, rm, n0=n0: token_dispatch(x, rm, n0, implementation=impl))(x, rm)
        want = jax.jit(lambda x, rm, n0=n0: token_dispatch(x, rm, n0, implementation="reference"))(x, rm)
        for name, a, b in zip(want._fields, got, want, strict=True):
            if b is None:
                assert a is None, name
                continue
            np.testing.assert_array_equal(a, b, err_msg=f"{impl} {name} n0={n0}")
        assert (int(want.num_dropped) > 0) == (n0 < t * k)


def test_sort_chunks_triton():
    if _reason("triton"):
        pytest.skip(_reason("triton"))
    n, h = 1000, 256
    x = jax.random.normal(jax.random.PRNGKey(0), (n, h), jnp.bfloat16)
    sizes, idx = jnp.array([100, 0, 300, 250, 7], jnp.int32), jnp.array([3, 1, 4, 0, 2], jnp.int32)
    g = jax.random.normal(jax.random.PRNGKey(1), (n, h), jnp.bfloat16)

    def f(impl):
        def step(x):
            (out, m), vjp = jax.vjp(lambda x: sort_chunks_by_index(x, sizes, idx, implementation=impl), x)
            return out, m, vjp((g, np.zeros(m.shape, jax.dtypes.float0)))[0]

        with native.poisoned_outputs():
            return jax.jit(step)(x)

    for a, b in zip(f("triton"), f("reference"), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_lowering_threads_compile_once_and_in_parallel():
    if _reason("triton"):
        pytest.skip(_reason("triton"))
    from te_ops.permutation import triton_kernels as K

    def lower_scale(block_h):
        x = jnp.ones((4096,), jnp.float32)
        fn = jax.jit(
            lambda x: tb.triton_call(
                K.row_gather_kernel,
                x.reshape(64, 64),
                jnp.arange(64, dtype=jnp.int32),
                np.int32(64),
                np.int32(64),
                out_shape=[jax.ShapeDtypeStruct((64, 64), jnp.float32)],
                grid=(16,),
                constexprs=dict(ROWS=4, BLOCK_H=block_h),
            )[0]
        )
        return fn.lower(x).compile()

    for blocks, want in (([64] * 8, 1), ([32, 64, 128, 256, 512, 1024, 2048, 4096], 8)):
        tb.clear_cache()
        tb.reset_counters()
        barrier = threading.Barrier(8)
        errors = []

        def work(b, barrier=barrier, errors=errors):
            try:
                barrier.wait()
                lower_scale(b)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(b,)) for b in blocks]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        c = tb.counters()
        assert c["compiles"] == want, c
        if want == 8:
            assert c["max_concurrent_compiles"] > 1, c


_CMD_BUFFER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    from te_ops._core import triton_bridge as tb
    from te_ops.permutation import token_dispatch, token_combine, api
    from tests.gpu.cmdbuf import assert_triton_in_command_buffers
    dump_dir = os.environ["TE_CMDBUF_DUMP_DIR"]
    t, e, h, k = 512, 64, 256, 4

    def inputs(seed):
        rng = np.random.default_rng(seed)
        top = np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k]
        rm = np.zeros((t, e), bool); np.put_along_axis(rm, top, True, axis=1); rm = jnp.asarray(rm)
        x = jax.random.normal(jax.random.PRNGKey(seed), (t, h), jnp.bfloat16)
        p = jax.random.uniform(jax.random.PRNGKey(seed + 1), (t, e)) * rm
        return x, p, rm

    def loss(impl):
        def f(x, p, rm):
            out, pp, m, *_ = token_dispatch(x, rm, t * k, probs=p, align_size=16, implementation=impl)
            y = token_combine(out * 2, m, merging_probs=p, implementation=impl)
            return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(pp)
        def step(x, p, rm):
            return jax.value_and_grad(f, argnums=(0, 1))(x, p, rm)
        step.__name__ = f"perm_cmdbuf_{impl}"  # -> XLA module jit_perm_cmdbuf_<impl> in the dump
        return jax.jit(step)

    datasets = [inputs(0), inputs(1)]
    ref = loss("reference")
    wants = [ref(*d) for d in datasets]
    impls = ["triton"] + (["gluon"] if api.DISPATCH.get("gluon").available() is None else [])
    for impl in impls:
        fn = loss(impl)
        hlo = fn.lower(*datasets[0]).compile().as_text()
        # XLA (jax 0.11.2) forms command buffers on the thunk sequence, after the HLO passes: the
        # optimized HLO never has a command_buffer computation; the thunk dump shows them.
        rep = tb.command_buffer_report(hlo, tb.find_thunk_dump(dump_dir, f"jit_perm_cmdbuf_{impl}"))
        print("CMDBUF " + json.dumps(dict(impl=impl, **rep)))
        assert_triton_in_command_buffers(rep, impl, "dump: " + str(sorted(os.listdir(dump_dir))[-20:]))
        for _ in range(3):  # replays of the recorded graph, then new data through the same graph
            for d, want in zip(datasets, wants):
                got = fn(*d)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                               rtol=3e-2, atol=3e-2)
        print("OK", impl)
""")


def test_under_command_buffers(tmp_path):
    """The Triton (and Gluon) launches run inside XLA command buffers and replay correctly.

    jax 0.11.2's XLA converts thunks to command buffers after compilation
    (CommandBufferConversionPass), so the proof is the thunk dump (--xla_dump_to), read by
    triton_bridge.command_buffer_report, not the optimized HLO text (see docs/triton_bridge.md).
    """
    if _reason("triton"):
        pytest.skip(_reason("triton"))
    r = run_script_under_command_buffers(_CMD_BUFFER_SCRIPT, tmp_path, preallocate=None)
    assert r.returncode == 0 and "OK triton" in r.stdout, (r.stdout[-3000:], r.stderr[-5000:])
