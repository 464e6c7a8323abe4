"""Concurrency and CUDA graphs: every graph-safe op bit-identical with and without XLA command
buffers, native warm-up once per key, and the Triton bridge and the native warm-up under 8 threads.

1. Command buffers. Each graph-safe implementation (native dense with its fused epilogues, native
   softmax variants, native router top-k / aux scores / aux loss, cuDNN fused attention, Triton
   rms_norm / layer_norm, Triton grouped_dense (Gluon warp-specialized and Triton GEMM paths),
   Triton / Gluon token_dispatch + token_combine, Triton sort_chunks_by_index, Triton FP8 quantize
   (block, current, delayed), dact_dbias_quantize, fp8_dense and fp8_grouped_dense with block
   scaling) has a builder of a jitted fwd+bwd step (``jax.vjp`` with a fixed cotangent) on fixed
   random inputs. Two fresh child processes run every builder: one with command buffers OFF
   (``--xla_gpu_enable_command_buffer=``), one with them ON (``FUSION,CUSTOM_CALL``, minimum graph
   size 1, as tests/gpu/cmdbuf.py). Each child runs each step three times (the third time on fresh
   copies of the inputs, so a recorded graph is updated with new buffer addresses), writes every
   output leaf's bytes to an .npz and prints a JSON report with the native counters of each op.
   The test asserts, per op: run-to-run bit identity in each child, OFF == ON bit for bit, the
   native counters (ON: ``captured_executes >= 1``; both: ``warmups`` == the op's distinct
   (shape, config) keys, ``initialize_calls >= warmups``; OFF: nothing captured) and, for Triton
   ops, that XLA put the bridge's launches into command buffers (thunk dump of the ON child).
2. Eight threads, in process. 8 threads released at once by a ``threading.Barrier`` trace, jit
   and run a different shape each (plus one shape they all share, so the threads also race for
   the same warm-up key and the same kernel specialization) of (a) native dense fwd+bwd with the
   tanh-GELU + bias epilogue and native scaled_softmax fwd+bwd, (b) Triton rms_norm fwd+bwd,
   Triton grouped_dense fwd+bwd and the Triton FP8 block quantize. Each thread's outputs must
   equal, bit for bit, the same computation run serially afterwards with a fresh jit; the native
   counters must show one warm-up per distinct key (no double warm-up under the race) and the
   Triton bridge's counters one compile per distinct kernel specialization.

Both children run at once, each compiling its Triton steps on a thread pool; the whole file takes
about 2 minutes on an H200 (``-n 1``; with pytest-xdist every worker would start its own children).

CPU dry run of the wiring (no GPU): ``TE_CONCURRENCY_CPU_DRYRUN=1 python -m pytest --noconftest
tests/gpu/test_concurrency_gpu.py -q -p no:cacheprovider``: the builders run implementation
"reference" on the CPU, the command-buffer flags are ignored there, the bit-identity checks still
run and the counter checks are skipped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core import native
from te_ops._core import testing as T
from tests.gpu.cmdbuf import assert_triton_in_command_buffers

DRYRUN = os.environ.get("TE_CONCURRENCY_CPU_DRYRUN", "") not in ("", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CMDBUF_ON = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
CMDBUF_OFF = "--xla_gpu_enable_command_buffer="
# Both children: no timing-based choice may differ between the two processes, or OFF and ON could
# differ for a reason that has nothing to do with command buffers. XLA's GEMM autotuner picks the
# fastest algorithm it times (the grouped_dense dbias one-hot GEMM is an XLA dot), so it is off;
# native dense times its cuBLASLt candidates, so the child forces candidate 0 (dense_force_candidate).
COMMON_FLAGS = "--xla_gpu_autotune_level=0"
REPORT_TAG = "TE_CONCURRENCY_REPORT "
RUNS = 3  # per step and child: twice on the same buffers, then once on fresh copies of the inputs
CHILD_TIMEOUT_S = 480
N_THREADS = 8

_NO_GPU = None if DRYRUN else native.cuda_device_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_NO_GPU is not None, reason=f"GPU test: {_NO_GPU}")]


def _impl(gpu_impl: str) -> str:
    return "reference" if DRYRUN else gpu_impl


# ----------------------------------------------------------------------------------------------
# Availability (called only on the GPU path; imports of GPU-only modules stay inside)
# ----------------------------------------------------------------------------------------------


def _why_native(module: str, op: str) -> Callable[[], str | None]:
    return lambda: native.native_unavailable_reason(module, op)


def _why_attention() -> str | None:
    from te_ops.fused_attention import native as fa_native

    return native.native_unavailable_reason(fa_native.MODULE, "fused_attention")


def _why_triton() -> str | None:
    from te_ops._core import triton_bridge as tb

    return tb.unavailable_reason() or native.cuda_device_unavailable_reason()


def _why_gluon_permutation() -> str | None:
    from te_ops.permutation import api

    return api.DISPATCH.get("gluon").available() or native.cuda_device_unavailable_reason()


def _why_fp8() -> str | None:
    from te_ops.fp8.select import triton_fp8_unavailable_reason

    return triton_fp8_unavailable_reason()


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def _np(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _dev(a: Any, dtype: Any = None) -> jax.Array:
    """A host array on the default device, cast in numpy (ml_dtypes), so no XLA program runs."""
    a = np.asarray(a)
    if dtype is not None:
        a = a.astype(jnp.dtype(dtype))
    return jax.device_put(a)


def _routing(rng: np.random.Generator, t: int, e: int, k: int) -> np.ndarray:
    scores = rng.standard_normal((t, e)) + np.linspace(0, 2, e)
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, np.argsort(-scores, axis=1)[:, :k], True, axis=1)
    return rm


# ----------------------------------------------------------------------------------------------
# The ops: a builder per op family (a table of shapes and options) or per special op, returning
# the step, its inputs and the native keys it warms
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    step: Callable[..., Any]  # jit-able fwd+bwd (or forward-only for quantizers) step
    args: tuple  # None entries are empty pytrees: no input buffer
    keys: dict[str, int]  # native handler -> distinct (shape, config) keys the step warms
    loose: frozenset[int] = frozenset()  # output leaves compared within the tolerance table


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    kind: str  # "native" (counted handlers) or "triton" (launches through the Triton bridge)
    why: Callable[[], str | None]  # why the GPU implementation cannot run here (None: it can)
    gpu_impl: str
    build: Callable[[str], Case]


OPS: dict[str, OpSpec] = {}


def _op(name: str, kind: str, why: Callable[[], str | None], gpu_impl: str):
    def register(build: Callable[[str], Case]) -> Callable[[str], Case]:
        assert name not in OPS, name
        OPS[name] = OpSpec(name, kind, why, gpu_impl, build)
        return build

    return register


def _ops(kind: str, why: Callable[[], str | None], gpu_impl: str, build: Callable[..., Case], table: dict) -> None:
    """One op per row of ``table`` (name: the arguments of ``build`` before ``impl``), in the table's order."""
    for name, cfg in table.items():
        _op(name, kind, why, gpu_impl)(functools.partial(build, *cfg))


# ---- native dense: every (activation, bias) has its own shape, so each op warms its own keys ----

DENSE_CASES = {  # name: (seed, x shape, N, dtype, activation, bias)
    "dense_gelu_tanh_bias_bf16": (1, (3, 41, 72), 136, jnp.bfloat16, "gelu_tanh", True),  # GELU_AUX_BIAS
    "dense_gelu_bias_f16": (2, (53, 88), 40, jnp.float16, "gelu", True),  # BIAS epilogue + our erf-GELU
    "dense_relu_bias_f16": (3, (37, 29), 53, jnp.float16, "relu", True),  # odd M, K, N
    "dense_silu_nobias_f32": (4, (2, 33, 48), 24, jnp.float32, "silu", False),
    "dense_bias_bf16": (5, (61, 64), 96, jnp.bfloat16, None, True),  # BGRADA dbias in the wgrad GEMM
}


def _dense_args(seed, x_shape, n, dtype, with_bias):
    """x, kernel [K, N], bias (or None) and the output cotangent of a dense case, on the device."""
    rng = np.random.default_rng(seed)
    k = x_shape[-1]
    x = _dev(_np(rng, x_shape), dtype)
    w = _dev(_np(rng, (k, n), 1 / np.sqrt(k)), dtype)
    b = _dev(_np(rng, (n,)), dtype) if with_bias else None
    return x, w, b, _dev(_np(rng, (*x_shape[:-1], n)), dtype)


def _build_dense(seed, x_shape, n, dtype, act, with_bias, impl: str) -> Case:
    from te_ops.dense import dense
    from te_ops.dense.reference import SAVES_PRE_ACTIVATION

    x, w, b, ct = _dense_args(seed, x_shape, n, dtype, with_bias)

    def step(x, w, b, ct):
        primals = (x, w) if b is None else (x, w, b)
        y, vjp = jax.vjp(lambda *a: dense(*a, activation=act, implementation=impl), *primals)
        return y, vjp(ct)

    fwd = "dense_fwd_aux" if act in SAVES_PRE_ACTIVATION else "dense_fwd"
    return Case(step, (x, w, b, ct), {fwd: 1, "dense_bwd": 1})


_ops("native", _why_native("_native_cublaslt", "dense"), "native", _build_dense, DENSE_CASES)


# ---- native softmax ----------------------------------------------------------------------------

SOFTMAX_CASES = {  # name: (seed, te_ops function, x shape, dtype, scale)
    "scaled_softmax_bf16": (11, "scaled_softmax", (3, 5, 37, 77), jnp.bfloat16, 0.37),
    "scaled_masked_softmax_f16": (12, "scaled_masked_softmax", (2, 3, 29, 83), jnp.float16, 0.5),
    "scaled_upper_triang_softmax_f32": (13, "scaled_upper_triang_masked_softmax", (2, 3, 45, 45), jnp.float32, 1.3),
}


def _build_softmax(seed, function, shape, dtype, scale, impl: str) -> Case:
    import te_ops

    softmax = getattr(te_ops, function)
    masked = function == "scaled_masked_softmax"
    rng = np.random.default_rng(seed)
    x = _dev(_np(rng, shape, 3.0), dtype)
    # True = masked out; broadcast over heads
    mask = _dev(rng.random((shape[0], 1, *shape[2:])) < 0.3) if masked else None
    g = _dev(_np(rng, shape), dtype)

    def step(x, mask, g):
        m = () if mask is None else (mask,)
        y, vjp = jax.vjp(lambda x: softmax(x, *m, scale, implementation=impl), x)
        return y, vjp(g)

    # the causal launch shares the scaled_softmax handlers (mode is part of the key)
    handler = "scaled_masked_softmax" if masked else "scaled_softmax"
    return Case(step, (x, mask, g), {f"{handler}_fwd": 1, f"{handler}_bwd": 1})


_ops("native", _why_native("_native", "softmax"), "native", _build_softmax, SOFTMAX_CASES)


# ---- native router -----------------------------------------------------------------------------

# DeepSeek-V3-like grouped selection
_GROUPED_TOPK = dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, compact_routing_map=True)
TOPK_CASES = {  # name: (seed, tokens, experts, dtype, topk, expert bias, options)
    "router_topk_softmax_f32": (21, 203, 64, jnp.float32, 6, False, dict(score_function="softmax")),
    "router_topk_grouped_sigmoid_bias_bf16": (22, 150, 128, jnp.bfloat16, 8, True, _GROUPED_TOPK),
}


def _build_topk(seed, t, e, dtype, topk, with_bias, options, impl: str) -> Case:
    from te_ops import fused_topk_with_score_function

    rng = np.random.default_rng(seed)
    logits = _dev(_np(rng, (t, e), 2.0), dtype)
    bias = _dev(_np(rng, (e,), 0.1)) if with_bias else None
    ct = _dev(_np(rng, (t, e)), dtype)

    def step(logits, bias, ct):
        def f(z):
            return fused_topk_with_score_function(z, topk, expert_bias=bias, implementation=impl, **options)

        probs, vjp, rmap = jax.vjp(f, logits, has_aux=True)  # (probs, routing_map): the map is aux
        return probs, rmap, vjp(ct)

    return Case(step, (logits, bias, ct), {"router_topk_fwd": 1, "router_topk_bwd": 1})


_ops("native", _why_native("_native", "router"), "native", _build_topk, TOPK_CASES)


@_op("router_aux_scores_sigmoid_f16", "native", _why_native("_native", "router"), "native")
def _build_aux_scores(impl: str) -> Case:
    from te_ops import compute_routing_scores_for_aux_loss

    rng = np.random.default_rng(23)
    logits = _dev(_np(rng, (211, 40), 2.0), jnp.float16)
    ct = _dev(_np(rng, (211, 40)), jnp.float16)

    def step(logits, ct):
        def f(z):
            rmap, scores = compute_routing_scores_for_aux_loss(z, 4, score_function="sigmoid", implementation=impl)
            return scores, rmap

        scores, vjp, rmap = jax.vjp(f, logits, has_aux=True)
        return scores, rmap, vjp(ct)

    return Case(step, (logits, ct), {"router_scores_fwd": 1, "router_scores_bwd": 1})


@_op("router_aux_loss_bf16", "native", _why_native("_native", "router"), "native")
def _build_aux_loss(impl: str) -> Case:
    from te_ops import fused_moe_aux_loss

    rng = np.random.default_rng(24)
    probs = _dev(rng.random((187, 48)).astype(np.float32), jnp.bfloat16)
    tpe = _dev(rng.integers(0, 40, 48).astype(np.int32))
    g = _dev(np.float32(1.7), jnp.bfloat16)

    def step(probs, tpe, g):
        loss, vjp = jax.vjp(lambda p: fused_moe_aux_loss(p, tpe, topk=4, coeff=0.01, implementation=impl), probs)
        return loss, vjp(g)

    return Case(step, (probs, tpe, g), {"router_aux_loss_fwd": 1, "router_aux_loss_bwd": 1})


# ---- cuDNN fused attention ---------------------------------------------------------------------
# The backward graph is built without cudnn-frontend's set_deterministic_algorithm(true) (its
# default is the non-deterministic algorithm: on Hopper dQ is accumulated with float32 atomics,
# and with GQA/MQA the K/V heads' gradients are sums over query heads), so the gradients may differ
# run to run in the last bits: they are compared within the tolerance table. The forward is exact.

ATTENTION_CASES = {  # name: (seed, (B, Sq, Skv, Hq, Hkv, D), dtype, mask type, bias, q_seqlens, kv_seqlens)
    "fused_attention_gqa_causal_bf16": (31, (2, 100, 100, 4, 2, 64), jnp.bfloat16, "causal", False, None, None),
    "fused_attention_bias_padding_f16": (32, (2, 80, 120, 2, 2, 64), jnp.float16, "padding", True, [80, 43], [57, 120]),
}


def _build_attention(seed, dims, dtype, mask_type, with_bias, q_seqlens, kv_seqlens, impl: str) -> Case:
    from te_ops import fused_attention

    b, sq, skv, hq, hkv, d = dims
    rng = np.random.default_rng(seed)
    q = _dev(_np(rng, (b, sq, hq, d)), dtype)
    k = _dev(_np(rng, (b, skv, hkv, d)), dtype)
    v = _dev(_np(rng, (b, skv, hkv, d)), dtype)
    bias = _dev(_np(rng, (b, 1, sq, skv)), dtype) if with_bias else None
    g = _dev(_np(rng, (b, sq, hq, d)), dtype)
    q_len, kv_len = (None if s is None else _dev(np.array(s, np.int32)) for s in (q_seqlens, kv_seqlens))

    def step(q, k, v, bias, g, q_len, kv_len):
        kw = dict(mask_type=mask_type, q_seqlens=q_len, kv_seqlens=kv_len, implementation=impl)
        f = lambda q, k, v, *b: fused_attention(q, k, v, bias=b[0] if b else None, **kw)
        out, vjp = jax.vjp(f, q, k, v, *(() if bias is None else (bias,)))
        return out, vjp(g)

    keys = {"fused_attention_fwd": 1, "fused_attention_bwd": 1}
    loose = {1, 2, 3} if bias is None else {1, 2, 3, 4}  # the gradients
    return Case(step, (q, k, v, bias, g, q_len, kv_len), keys, loose=frozenset(loose))


_ops("native", _why_attention, "native", _build_attention, ATTENTION_CASES)


# ---- Triton normalization ----------------------------------------------------------------------

NORM_CASES = {  # name: (seed, te_ops function, x shape, x scale, dtype, gamma/beta dtype, residual, zero-centered)
    "rms_norm_residual_bf16": (41, "rms_norm", (3, 37, 320), 1.0, jnp.bfloat16, jnp.float32, True, False),
    # H not a multiple of 16: scalar accesses
    "layer_norm_zero_centered_f16": (42, "layer_norm", (129, 200), 2.0, jnp.float16, jnp.float16, False, True),
    # H > MAX_FUSED_H: the looped kernels and the dparam kernel
    "rms_norm_long_rows_f32": (43, "rms_norm", (7, 9000), 1.0, jnp.float32, jnp.bfloat16, False, False),
}


def _build_norm(seed, function, shape, x_scale, dtype, param_dtype, with_residual, zero_centered, impl: str) -> Case:
    import te_ops

    norm = getattr(te_ops, function)
    rng = np.random.default_rng(seed)
    h = shape[-1]
    x = _dev(_np(rng, shape, x_scale), dtype)
    r = _dev(_np(rng, shape), dtype) if with_residual else None
    gamma = _np(rng, (h,), 0.1)
    gamma = _dev(gamma if zero_centered else 1 + gamma, param_dtype)
    beta = _dev(_np(rng, (h,), 0.1), param_dtype) if function == "layer_norm" else None
    gy = _dev(_np(rng, shape), dtype)
    gh = _dev(_np(rng, shape), dtype) if with_residual else None

    def step(x, r, gamma, beta, gy, gh):
        def f(x, r, gamma, beta):
            params = (gamma,) if beta is None else (gamma, beta)
            out = norm(x, *params, residual=r, zero_centered_gamma=zero_centered, implementation=impl)
            return out if r is None else tuple(out)  # (y, h)

        # a None primal (no residual, no beta) is an empty pytree: no gradient leaf
        out, vjp = jax.vjp(f, x, r, gamma, beta)
        return out, vjp(gy if gh is None else (gy, gh))

    return Case(step, (x, r, gamma, beta, gy, gh), {})


_ops("triton", _why_triton, "triton", _build_norm, NORM_CASES)


# ---- Triton grouped_dense ----------------------------------------------------------------------

# K a multiple of 64: the Gluon warp-specialized kernel on Hopper; K = 200: the Triton kernel.
# An empty group and rows past the groups (sum < M) in the first.
GROUPED_CASES = {  # name: (seed, M, K, N, group sizes, dtype, bias)
    "grouped_dense_bias_bf16": (51, 301, 192, 160, [60, 0, 97, 81, 40], jnp.bfloat16, True),
    "grouped_dense_k200_f16": (52, 257, 200, 136, [100, 120, 37], jnp.float16, False),
}


def _build_grouped(seed, m, k, n, sizes, dtype, with_bias, impl: str) -> Case:
    from te_ops import grouped_dense

    rng = np.random.default_rng(seed)
    g = len(sizes)
    x = _dev(_np(rng, (m, k)), dtype)
    kernels = _dev(_np(rng, (g, k, n), 1 / np.sqrt(k)), dtype)
    bias = _dev(_np(rng, (g, n)), dtype) if with_bias else None
    gs = _dev(np.asarray(sizes, np.int32))
    ct = _dev(_np(rng, (m, n)), dtype)

    def step(x, kernels, bias, gs, ct):
        primals = (x, kernels) if bias is None else (x, kernels, bias)
        y, vjp = jax.vjp(lambda x, kk, *b: grouped_dense(x, kk, gs, *b, implementation=impl), *primals)
        return y, vjp(ct)

    return Case(step, (x, kernels, bias, gs, ct), {})


_ops("triton", _why_triton, "triton", _build_grouped, GROUPED_CASES)


@_op("grouped_ffn_silu_bf16", "triton", _why_triton, "triton")
def _build_grouped_ffn(impl: str) -> Case:
    """The bf16 expert FFN as one op (grouped_ffn: the act and dact epilogue GEMMs, the Gluon wo GEMMs,
    two wgrads), forward and backward; an empty group and rows past the groups."""
    from te_ops import grouped_ffn

    rng = np.random.default_rng(53)
    m, h, f, sizes = 300, 128, 96, [70, 0, 130, 60]
    g = len(sizes)
    x = _dev(_np(rng, (m, h)), jnp.bfloat16)
    wi = _dev(_np(rng, (g, h, 2 * f), 1 / np.sqrt(h)), jnp.bfloat16)
    wo = _dev(_np(rng, (g, f, h), 1 / np.sqrt(f)), jnp.bfloat16)
    gs = _dev(np.asarray(sizes, np.int32))
    ct = _dev(_np(rng, (m, h)), jnp.bfloat16)

    def step(x, wi, wo, gs, ct):
        y, vjp = jax.vjp(lambda *a: grouped_ffn(*a, gs, implementation=impl), x, wi, wo)
        return y, vjp(ct)

    return Case(step, (x, wi, wo, gs, ct), {})


# ---- Triton / Gluon permutation ----------------------------------------------------------------

PERMUTATION_CASES = {  # name: (GPU implementation, seed, tokens, experts, H, topk, num_out_tokens, align_size)
    "token_dispatch_combine_triton": ("triton", 61, 203, 16, 96, 3, 609, 16),  # padded expert blocks, every pair kept
    # H not a multiple of 16, 760 routed pairs into 500 rows (the expert-major tail dropped)
    "token_dispatch_combine_gluon": ("gluon", 62, 190, 24, 136, 4, 500, None),
}


def _build_permutation(seed, t, e, h, k, n0, align, impl: str) -> Case:
    from te_ops import token_combine, token_dispatch
    from te_ops.permutation import reference as pref

    rng = np.random.default_rng(seed)
    rm = _routing(rng, t, e, k)
    n = pref.out_rows(n0, e, align)
    x = _dev(_np(rng, (t, h)), jnp.bfloat16)
    probs = _dev((rng.random((t, e)) * rm).astype(np.float32))
    w = _dev(_np(rng, (n, h)), jnp.bfloat16)
    g_out = _dev(_np(rng, (n, h)), jnp.bfloat16)
    g_pp = _dev(_np(rng, (n,)))
    g_y = _dev(_np(rng, (t, h)), jnp.bfloat16)

    def step(x, probs, rm, w, g_out, g_pp, g_y):
        def f(x, p):
            res = token_dispatch(x, rm, n0, probs=p, align_size=align, implementation=impl)
            y = token_combine(res.out * w, res.row_id_map, merging_probs=p, implementation=impl)
            aux = (res.row_id_map, res.pad_offsets, res.tokens_per_expert, res.num_dropped)
            return (res.out, res.permuted_probs, y), aux

        outs, vjp, aux = jax.vjp(f, x, probs, has_aux=True)
        return outs, aux, vjp((g_out, g_pp, g_y))

    return Case(step, (x, probs, _dev(rm), w, g_out, g_pp, g_y), {})


for _name, (_gpu_impl, *_cfg) in PERMUTATION_CASES.items():
    _why = _why_triton if _gpu_impl == "triton" else _why_gluon_permutation
    _op(_name, "triton", _why, _gpu_impl)(functools.partial(_build_permutation, *_cfg))


@_op("sort_chunks_by_index_triton", "triton", _why_triton, "triton")
def _build_sort_chunks(impl: str) -> Case:
    from te_ops import sort_chunks_by_index

    rng = np.random.default_rng(63)
    x = _dev(_np(rng, (700, 136)), jnp.bfloat16)
    sizes = _dev(np.array([100, 0, 300, 250, 7], np.int32))  # 43 rows past the chunks stay in place
    order = _dev(np.array([3, 1, 4, 0, 2], np.int32))
    g = _dev(_np(rng, (700, 136)), jnp.bfloat16)

    def step(x, sizes, order, g):
        f = lambda x: sort_chunks_by_index(x, sizes, order, implementation=impl)
        out, vjp, row_id_map = jax.vjp(f, x, has_aux=True)
        return out, row_id_map, vjp(g)

    return Case(step, (x, sizes, order, g), {})


# ---- Triton FP8 --------------------------------------------------------------------------------

FP8_QUANTIZE_CASES = {  # name: (seed, x shape, x scale, dtype, recipe, the two roles quantized)
    # partial edge blocks in both directions; "x": 1 x 128 tiles, "w": 128 x 128 blocks
    "fp8_quantize_block_bf16": (71, (200, 300), 3.0, jnp.bfloat16, "BlockScaling", ("x", "w")),
    # "x": E4M3, "g": E5M2 (hybrid formats)
    "fp8_quantize_current_f32": (72, (130, 257), 5.0, jnp.float32, "CurrentScaling", ("x", "g")),
}


def _build_fp8_quantize(seed, shape, scale, dtype, recipe, roles, impl: str) -> Case:
    from te_ops import fp8

    rng = np.random.default_rng(seed)
    x = _dev(_np(rng, shape, scale), dtype)

    def step(x):
        r = getattr(fp8, recipe)()
        q1, q2 = (fp8.quantize(x, r, role, implementation=impl) for role in roles)
        return q1.data, q1.scale_inv, q2.data, q2.scale_inv

    return Case(step, (x,), {})


_ops("triton", _why_fp8, "triton", _build_fp8_quantize, FP8_QUANTIZE_CASES)


@_op("fp8_quantize_delayed_f16", "triton", _why_fp8, "triton")
def _build_fp8_delayed(impl: str) -> Case:
    from te_ops import fp8

    rng = np.random.default_rng(73)
    x = _dev(_np(rng, (3, 5, 256), 2.0), jnp.float16)
    history = _dev((rng.random(16) * 4).astype(np.float32))
    scale = _dev(np.float32(8.0))

    def step(x, history, scale):
        recipe = fp8.DelayedScaling(history_len=16)
        q, state = fp8.quantize(x, recipe, "x", fp8.DelayedScalingState(history, scale), implementation=impl)
        return q.data, q.scale_inv, state.amax_history, state.scale

    return Case(step, (x, history, scale), {})


@_op("fp8_dact_dbias_quantize_gelu_bf16", "triton", _why_fp8, "triton")
def _build_fp8_dact(impl: str) -> Case:
    from te_ops import fp8

    rng = np.random.default_rng(74)
    dy = _dev(_np(rng, (160, 384)), jnp.bfloat16)
    z = _dev(_np(rng, (160, 384), 2.0), jnp.bfloat16)

    def step(dy, z):
        q_dz, q_dz_t, dbias = fp8.dact_dbias_quantize(dy, z, fp8.BlockScaling(), activation="gelu", implementation=impl)
        return q_dz.data, q_dz.scale_inv, q_dz_t.data, q_dz_t.scale_inv, dbias

    return Case(step, (dy, z), {})


# K % 16 == 0 and N % 8 == 0: the Gluon block-scaled GEMM on Hopper for y (the wgrad GEMM reduces
# over M = 150 and takes the Triton kernel); K = 200: the Triton GEMM for y and dx.
FP8_DENSE_CASES = {  # name: (seed, x shape, N, dtype, activation, bias), block scaling
    "fp8_dense_block_gelu_tanh_bias_bf16": (75, (3, 50, 384), 200, jnp.bfloat16, "gelu_tanh", True),
    "fp8_dense_block_k200_f16": (76, (77, 200), 136, jnp.float16, None, False),
}


def _build_fp8_dense(seed, x_shape, n, dtype, act, with_bias, impl: str) -> Case:
    from te_ops import fp8

    x, w, b, ct = _dense_args(seed, x_shape, n, dtype, with_bias)

    def step(x, w, b, ct):
        def f(x, w, *bb):
            bias = bb[0] if bb else None
            return fp8.fp8_dense(x, w, fp8.BlockScaling(), bias=bias, activation=act, implementation=impl)

        y, vjp = jax.vjp(f, *((x, w) if b is None else (x, w, b)))
        return y, vjp(ct)

    return Case(step, (x, w, b, ct), {})


_ops("triton", _why_fp8, "triton", _build_fp8_dense, FP8_DENSE_CASES)


@_op("fp8_grouped_dense_block_bf16", "triton", _why_fp8, "triton")
def _build_fp8_grouped(impl: str) -> Case:
    from te_ops import fp8

    rng = np.random.default_rng(77)
    x = _dev(_np(rng, (300, 256)), jnp.bfloat16)
    kernels = _dev(_np(rng, (4, 256, 192), 1 / 16), jnp.bfloat16)
    gs = _dev(np.array([70, 0, 110, 90], np.int32))  # an empty group, 30 rows past the groups
    ct = _dev(_np(rng, (300, 192)), jnp.bfloat16)

    def step(x, kernels, gs, ct):
        f = lambda x, kk: fp8.fp8_grouped_dense(x, kk, gs, fp8.BlockScaling(), implementation=impl)
        y, vjp = jax.vjp(f, x, kernels)
        return y, vjp(ct)

    return Case(step, (x, kernels, gs, ct), {})


@_op("fp8_dispatch_ffn_block_bf16", "triton", _why_fp8, "triton")
def _build_fp8_dispatch_ffn(impl: str) -> Case:
    """The fused FP8 expert FFN (token dispatch of FP8 rows, the requantized wgrad operand, the fused
    activation kernels, both grouped GEMMs), forward and backward."""
    from te_ops import fp8

    rng = np.random.default_rng(78)
    t, h, e, f = 96, 256, 4, 128
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :2], True, axis=1)
    x = _dev(_np(rng, (t, h)), jnp.bfloat16)
    wi = _dev(_np(rng, (e, h, 2 * f), 1 / 16), jnp.bfloat16)
    wo = _dev(_np(rng, (e, f, h), 1 / 11), jnp.bfloat16)
    ct = _dev(_np(rng, (2 * t, h)), jnp.bfloat16)
    rmd = _dev(rm)

    def step(x, wi, wo, rmd, ct):
        def fn(x, wi, wo):
            return fp8.fp8_dispatch_ffn(x, rmd, 2 * t, wi, wo, activation="silu", implementation=impl).out

        y, vjp = jax.vjp(fn, x, wi, wo)
        return y, vjp(ct)

    return Case(step, (x, wi, wo, rmd, ct), {})


# ----------------------------------------------------------------------------------------------
# The child process: runs every builder, writes the outputs' bytes and prints the report
# ----------------------------------------------------------------------------------------------


def _leaf_key(op: str, run: int, i: int) -> str:
    return f"{op}__{run}__{i}"


def _host(a: Any) -> np.ndarray:
    return np.asarray(jax.device_get(a))


def _child(mode: str, out_dir: str) -> None:
    from te_ops._core import registry

    report: dict[str, Any] = dict(mode=mode, dryrun=DRYRUN, xla_flags=os.environ.get("XLA_FLAGS", ""), ops={})
    cublaslt = native._loaded.get("_native_cublaslt")
    if not DRYRUN and hasattr(cublaslt, "dense_force_candidate"):
        cublaslt.dense_force_candidate(0)  # the same cuBLASLt algorithm in both children: see COMMON_FLAGS
    dump_dir = os.environ.get("TE_CONCURRENCY_DUMP_DIR")
    cases: dict[str, Case] = {}
    for name, spec in OPS.items():
        entry = report["ops"][name] = dict(kind=spec.kind, status="error")
        try:
            why = None if DRYRUN else spec.why()
            if why is not None:
                entry.update(status="skip", reason=why)
                continue
            cases[name] = spec.build(_impl(spec.gpu_impl))
        except Exception:
            entry["error"] = traceback.format_exc()

    def compile_step(name: str) -> Any:
        case = cases[name]
        step = case.step
        step.__name__ = step.__qualname__ = f"te_cc_{name}"  # XLA module jit_te_cc_<name> in the dump
        return jax.jit(step).lower(*case.args).compile()

    # Triton steps compile on a thread pool (the bridge compiles distinct kernels concurrently);
    # native ones (fast XLA compiles, cuDNN support queries) one at a time on this thread meanwhile.
    compiled: dict[str, Any] = {}
    triton_names = [n for n in cases if OPS[n].kind == "triton"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = {n: pool.submit(compile_step, n) for n in triton_names}
        for name in cases:
            if name in futures:
                continue
            futures[name] = concurrent.futures.Future()
            try:
                futures[name].set_result(compile_step(name))
            except BaseException as e:  # noqa: B036 - reported below
                futures[name].set_exception(e)
        for name in cases:
            entry = report["ops"][name]
            try:
                compiled[name] = futures[name].result()
            except registry.ImplementationUnavailableError as e:
                entry.update(status="skip", reason=str(e))
            except Exception:
                entry["error"] = traceback.format_exc()

    arrays: dict[str, np.ndarray] = {}
    for name, exe in compiled.items():
        entry, case = report["ops"][name], cases[name]
        try:
            native.reset_counters()  # per-op counters; warmed keys stay warmed (per process)
            runs = []
            for run in range(RUNS):
                args = case.args
                if run == RUNS - 1:  # the same values in new buffers: a recorded graph gets new addresses
                    args = jax.tree.map(lambda a: jnp.array(a, copy=True), case.args)
                runs.append([_host(leaf) for leaf in jax.tree.leaves(exe(*args))])
            entry.update(
                status="ok",
                counters={h: c for h, c in native.counters().items() if any(c.values())},
                keys=case.keys,
                loose=sorted(case.loose),
                leaves=[[str(a.dtype), list(a.shape)] for a in runs[0]],
            )
            for run, leaves in enumerate(runs):
                for i, a in enumerate(leaves):
                    arrays[_leaf_key(name, run, i)] = np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8)
            if dump_dir and OPS[name].kind == "triton":
                from te_ops._core import triton_bridge as tb

                thunks = tb.find_thunk_dump(dump_dir, f"jit_te_cc_{name}")
                entry["cmdbuf"] = tb.command_buffer_report(exe.as_text(), thunks)
                if thunks is None:
                    entry["cmdbuf"]["dump_files"] = sorted(os.listdir(dump_dir))[-10:]
        except Exception:
            entry.update(status="error", error=traceback.format_exc())
    np.savez(os.path.join(out_dir, f"{mode}.npz"), **arrays)
    print(REPORT_TAG + json.dumps(report), flush=True)


# ----------------------------------------------------------------------------------------------
# The two children (one per mode), started once per session and run side by side
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ChildResult:
    mode: str
    report: dict | None
    arrays: dict[str, np.ndarray] | None
    failure: str | None

    def entry(self, op: str) -> dict:
        assert self.report is not None, self.failure
        return self.report["ops"][op]

    def leaf(self, op: str, run: int, i: int) -> np.ndarray:
        dtype, shape = self.entry(op)["leaves"][i]
        raw = self.arrays[_leaf_key(op, run, i)]
        return np.frombuffer(raw.tobytes(), jnp.dtype(dtype)).reshape(shape)


@pytest.fixture(scope="session")
def cmdbuf_children(tmp_path_factory) -> dict[str, ChildResult]:
    out = tmp_path_factory.mktemp("te_concurrency")
    procs = {}
    for mode in ("off", "on"):
        env = dict(os.environ)
        flags = [COMMON_FLAGS, CMDBUF_ON if mode == "on" else CMDBUF_OFF]
        if mode == "on" and not DRYRUN:
            dump = out / "dump"
            flags.append(f"--xla_dump_to={dump}")
            env["TE_CONCURRENCY_DUMP_DIR"] = str(dump)
        else:
            env.pop("TE_CONCURRENCY_DUMP_DIR", None)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + " ".join(flags)).strip()
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        if DRYRUN:
            env["JAX_PLATFORMS"] = "cpu"
        # Output to files, not pipes: a child blocked on a full pipe would stall while the other runs.
        stdout, stderr = open(out / f"{mode}.stdout", "w"), open(out / f"{mode}.stderr", "w")
        cmd = [sys.executable, "-m", "tests.gpu.test_concurrency_gpu", "--child", mode, str(out)]
        procs[mode] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr), stdout, stderr)
    results = {}
    for mode, (proc, stdout, stderr) in procs.items():
        try:
            rc = proc.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = f"killed after {CHILD_TIMEOUT_S} s"
        stdout.close()
        stderr.close()
        text = (out / f"{mode}.stdout").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(REPORT_TAG)]
        report = json.loads(lines[-1][len(REPORT_TAG) :]) if lines else None
        npz = out / f"{mode}.npz"
        arrays = dict(np.load(npz)) if report is not None and npz.exists() else None
        failure = None
        if report is None or arrays is None:
            err = (out / f"{mode}.stderr").read_text()
            failure = f"command-buffers-{mode} child gave no report (rc={rc}):\n{text[-3000:]}\n{err[-6000:]}"
        results[mode] = ChildResult(mode, report, arrays, failure)
    return results


# ----------------------------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------------------------


def _assert_bit_identical(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Same dtype, shape and bytes; NaN-aware: two NaNs count as equal whatever their payload."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    if a.tobytes() == b.tobytes():
        return
    bits = np.dtype(f"u{a.dtype.itemsize}")
    differ = a.reshape(-1).view(bits) != b.reshape(-1).view(bits)
    fa = fb = None
    if jnp.issubdtype(a.dtype, jnp.floating):
        fa, fb = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
        differ &= ~(np.isnan(fa) & np.isnan(fb))
    if not differ.any():
        return
    first = np.flatnonzero(differ)[:5]
    detail = ""
    if fa is not None:
        both = np.isfinite(fa) & np.isfinite(fb)
        detail = f"; max |difference| {np.max(np.abs(fa - fb)[both], initial=0.0):.3g}"
    raise AssertionError(
        f"{what}: {int(differ.sum())} of {a.size} elements differ in their bits (flat indices {first.tolist()}: "
        f"{a.reshape(-1)[first].tolist()} vs {b.reshape(-1)[first].tolist()}){detail}"
    )


def _assert_close_loose(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    e = np.asarray(b, np.float32)
    T.assert_close(a, b, a.dtype, scale=float(np.max(np.abs(e), initial=0.0)) + 1.0, err_msg=what)


def _compare(a: np.ndarray, b: np.ndarray, loose: bool, what: str) -> None:
    (_assert_close_loose if loose else _assert_bit_identical)(a, b, what)


# ----------------------------------------------------------------------------------------------
# 1. Command buffers: bit-identical, captured, warmed once per key
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(OPS))
def test_command_buffers_bit_identical(cmdbuf_children, op):
    entries = {}
    for mode in ("off", "on"):
        child = cmdbuf_children[mode]
        assert child.report is not None, child.failure
        e = child.entry(op)
        if e["status"] == "skip":
            pytest.skip(f"{op} ({OPS[op].gpu_impl}): {e['reason']}")
        assert e["status"] == "ok", f"{op} failed in the command-buffers-{mode} child:\n{e.get('error')}"
        entries[mode] = e
    off, on = cmdbuf_children["off"], cmdbuf_children["on"]
    assert entries["off"]["leaves"] == entries["on"]["leaves"], (entries["off"]["leaves"], entries["on"]["leaves"])
    loose = set(entries["on"]["loose"])
    for i in range(len(entries["on"]["leaves"])):
        want = off.leaf(op, 0, i)
        for child in (off, on):
            for run in range(RUNS):
                if child is off and run == 0:
                    continue
                what = f"{op} leaf {i}: command buffers {child.mode} run {run} vs off run 0"
                _compare(child.leaf(op, run, i), want, i in loose, what)

    if DRYRUN:
        return  # no native handlers, no command buffers on the CPU
    keys = entries["on"]["keys"]
    for mode, e in entries.items():
        counters = e["counters"]
        assert set(counters) == set(keys), f"{op} ({mode}): handlers that ran {sorted(counters)}, expected {keys}"
        for handler, n_keys in keys.items():
            c = counters[handler]
            # one throwaway warm-up capture per (shape, config) key, however often XLA initializes
            assert c["warmups"] == n_keys, f"{op} ({mode}) {handler}: {n_keys} warm-ups expected, {c}"
            assert c["initialize_calls"] >= c["warmups"], f"{op} ({mode}) {handler}: {c}"
            if mode == "on":
                assert c["captured_executes"] >= 1, f"{op} {handler} never ran inside a CUDA graph capture: {c}"
            else:
                assert c["captured_executes"] == 0, f"{op} {handler} was captured with command buffers off: {c}"
                assert c["executes"] >= RUNS and c["initialize_calls"] >= c["executes"], f"{op} {handler}: {c}"
    if OPS[op].kind == "triton":
        rep = entries["on"]["cmdbuf"]
        assert_triton_in_command_buffers(rep, op)


# ----------------------------------------------------------------------------------------------
# 2. Eight threads at once: results, native warm-ups, Triton compiles
# ----------------------------------------------------------------------------------------------


def _race(works: list[Callable[[], list[np.ndarray]]]) -> list[list[np.ndarray]]:
    """Runs each work on its own thread, all released at once; re-raises what any thread raised."""
    barrier = threading.Barrier(len(works))
    results: list[Any] = [None] * len(works)
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=300)
            results[i] = works[i]()
        except BaseException:  # noqa: B036 - every thread's exception is reported
            errors.append(f"thread {i}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=run, args=(i,), name=f"te-race-{i}", daemon=True) for i in range(len(works))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=500)
    assert not [t.name for t in threads if t.is_alive()], "threads still running after 500 s"
    assert not errors, "\n".join(errors)
    return results


def _assert_same_as_serial(threaded, serial, what: str, shared: slice | None = None) -> None:
    for i, (got, want) in enumerate(zip(threaded, serial, strict=True)):
        assert len(got) == len(want), (what, i)
        for j, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_bit_identical(a, b, f"{what}: thread {i} leaf {j} vs the serial rerun")
    if shared is not None:  # the shape every thread ran: the same bits on every thread
        for i, got in enumerate(threaded[1:], start=1):
            for j, (a, b) in enumerate(zip(got[shared], threaded[0][shared], strict=True)):
                _assert_bit_identical(a, b, f"{what}: shared shape, thread {i} leaf {j} vs thread 0")


SHARED = -1  # index of the shape all threads also run


def _native_inputs(i: int) -> dict[str, np.ndarray]:
    if i == SHARED:
        x_shape, n, s_shape = (3, 29, 72), 104, (2, 2, 31, 97)
    else:
        x_shape, n, s_shape = (2, 11 + 5 * i, 24 + 8 * i), 40 + 16 * i, (2, 3, 9 + 2 * i, 40 + 13 * i)
    rng = np.random.default_rng(900 + i)
    k = x_shape[-1]
    return dict(
        x=_np(rng, x_shape),
        w=_np(rng, (k, n), 1 / np.sqrt(k)),
        b=_np(rng, (n,)),
        ct=_np(rng, (*x_shape[:-1], n)),
        s=_np(rng, s_shape, 3.0),
        g=_np(rng, s_shape),
    )


def _native_work(own: dict, shared: dict, impl: str) -> Callable[[], list[np.ndarray]]:
    def work() -> list[np.ndarray]:
        from te_ops import dense, scaled_softmax

        def one(d):
            dense_fn = lambda x, w, b: dense(x, w, b, activation="gelu_tanh", implementation=impl)
            y, vjp = jax.vjp(dense_fn, d["x"], d["w"], d["b"])
            p, softmax_vjp = jax.vjp(lambda s: scaled_softmax(s, 0.7, implementation=impl), d["s"])
            return y, vjp(d["ct"]), p, softmax_vjp(d["g"])

        on_device = lambda d: {k: _dev(v, jnp.bfloat16) for k, v in d.items()}
        out = jax.jit(lambda a, b: (one(a), one(b)))(on_device(own), on_device(shared))  # a fresh jit: traced here
        return [_host(leaf) for leaf in jax.tree.leaves(out)]

    return work


NATIVE_THREAD_HANDLERS = ("dense_fwd_aux", "dense_bwd", "scaled_softmax_fwd", "scaled_softmax_bwd")


def test_eight_threads_native_warm_up_once_per_key():
    """dense (tanh-GELU + bias) fwd+bwd and scaled_softmax fwd+bwd: a shape of its own on each
    thread plus one shape on all of them. Each handler warms 9 keys exactly once (the 8 own
    shapes and the shared one, for which 8 threads race); results equal a serial rerun."""
    if not DRYRUN:
        why = native.native_unavailable_reason("_native_cublaslt", "dense") or native.native_unavailable_reason(
            "_native", "softmax"
        )
        if why:
            pytest.skip(f"native dense / softmax: {why}")
    impl = _impl("native")
    shared = _native_inputs(SHARED)
    works = [_native_work(_native_inputs(i), shared, impl) for i in range(N_THREADS)]
    native.reset_counters()
    threaded = _race(works)
    after_threads = native.counters()
    serial = [work() for work in works]  # fresh jits of the same computations, one at a time
    _assert_same_as_serial(threaded, serial, "native", shared=slice(6, 12))
    if DRYRUN:
        return
    after_serial = native.counters()
    active = {h for h, c in after_threads.items() if any(c.values())}
    assert active == set(NATIVE_THREAD_HANDLERS), (active, after_threads)
    for handler in NATIVE_THREAD_HANDLERS:
        c = after_threads[handler]
        # 8 own shapes + the shared one; a second warm-up of a key would show up here
        assert c["warmups"] == N_THREADS + 1, f"{handler}: {c}"
        assert c["initialize_calls"] >= c["warmups"] and c["executes"] >= N_THREADS, f"{handler}: {c}"
        # the serial rerun reuses every key: no new warm-up
        assert after_serial[handler]["warmups"] == N_THREADS + 1, f"{handler}: {after_serial[handler]}"


H_LIST = (96, 100, 200, 232, 320, 520, 1000, 1024)  # rms_norm rows (some share a kernel specialization)
K_LIST = (64, 72, 128, 136, 192, 200, 256, 264)  # grouped_dense K: Gluon WS kernel (K % 64 == 0) or Triton


def _triton_inputs(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(700 + i)
    rows, h = 5 + 3 * i, H_LIST[i]
    m, k, n, g = 150 + 37 * i, K_LIST[i], 64 + 8 * i, 4
    sizes = rng.multinomial(int(m * 0.9), [0.4, 0.1, 0.3, 0.2]).astype(np.int32)
    if i % 2:
        sizes[i % g] = 0  # an empty group
    return dict(
        nx=_np(rng, (rows, h)),
        ngamma=1 + _np(rng, (h,), 0.1),
        ny=_np(rng, (rows, h)),
        gx=_np(rng, (m, k)),
        gk=_np(rng, (g, k, n), 1 / np.sqrt(k)),
        gb=_np(rng, (g, n)) if i % 2 == 0 else None,
        gs=sizes,
        gy=_np(rng, (m, n)),
        qx=_np(rng, (20 + 7 * i, 100 + 45 * i), 3.0),
    )


def _triton_work(d: dict, impl: str, with_fp8: bool) -> Callable[[], list[np.ndarray]]:
    def work() -> list[np.ndarray]:
        from te_ops import fp8, grouped_dense, rms_norm

        bf = jnp.bfloat16
        arrays = dict(
            nx=_dev(d["nx"], bf),
            ngamma=_dev(d["ngamma"]),
            ny=_dev(d["ny"], bf),
            gx=_dev(d["gx"], bf),
            gk=_dev(d["gk"], bf),
            gb=None if d["gb"] is None else _dev(d["gb"], bf),
            gs=_dev(d["gs"]),
            gy=_dev(d["gy"], bf),
            qx=_dev(d["qx"], bf),
        )

        def step(a):
            y, vjp = jax.vjp(lambda x, w: rms_norm(x, w, implementation=impl), a["nx"], a["ngamma"])
            out = [y, vjp(a["ny"])]
            primals = (a["gx"], a["gk"]) if a["gb"] is None else (a["gx"], a["gk"], a["gb"])
            gy, gvjp = jax.vjp(lambda x, kk, *b: grouped_dense(x, kk, a["gs"], *b, implementation=impl), *primals)
            out += [gy, gvjp(a["gy"])]
            if with_fp8:
                q = fp8.quantize(a["qx"], fp8.BlockScaling(), "x", implementation=impl)
                out += [q.data, q.scale_inv]
            return out

        return [_host(leaf) for leaf in jax.tree.leaves(jax.jit(step)(arrays))]

    return work


def test_eight_threads_triton_bridge_compiles_once_per_specialization():
    """rms_norm fwd+bwd, grouped_dense fwd+bwd and the FP8 block quantize, a different shape on
    each of 8 threads released at once, from an empty bridge cache: every distinct kernel
    specialization compiles exactly once (threads that need the same one wait for it), and the
    results equal a serial rerun, which compiles nothing new."""
    with_fp8 = True
    if not DRYRUN:
        why = _why_triton()
        if why:
            pytest.skip(f"Triton: {why}")
        with_fp8 = _why_fp8() is None  # the quantize kernel needs FP8 tensor cores (sm_89+)
    from te_ops._core import triton_bridge as tb

    impl = _impl("triton")
    works = [_triton_work(_triton_inputs(i), impl, with_fp8) for i in range(N_THREADS)]
    tb.clear_cache()
    tb.reset_counters()
    threaded = _race(works)
    c = tb.counters()
    specs = set(tb._compiled)
    tb.reset_counters()
    serial = [work() for work in works]
    c_serial = tb.counters()
    _assert_same_as_serial(threaded, serial, "triton")
    if DRYRUN:
        return
    assert c["compiles"] >= 1, c
    # each distinct specialization compiled exactly once; every other lowering was a cache hit
    assert c["compiles"] == len(specs), (c, len(specs))
    assert c["compiles"] + c["cache_hits"] == c["lowerings"], c
    # the serial rerun finds every kernel it needs in the cache
    assert c_serial["compiles"] == 0 and c_serial["cache_hits"] == c_serial["lowerings"], c_serial
    assert set(tb._compiled) == specs


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: python -m tests.gpu.test_concurrency_gpu --child off|on OUT_DIR ({sys.argv[1:]})")
