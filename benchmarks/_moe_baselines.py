"""The plain-JAX baselines of benchmarks/train_moe.py (``StrongBlock``, ``RaggedDotBlock``; both plug into
examples/train_moe.py's ``MoELM`` as ``block=``), and the model FLOP count the benchmark reports.

``StrongBlock`` is the te_layers decoder block (examples/train_moe.py ``Block``) written the way a
strong JAX engineer would write it without te_ops:

* attention: cuDNN flash attention through ``jax.nn.dot_product_attention(..., implementation="cudnn")``
  (bf16/f16 inputs in the ``[B, S, H, D]`` layout, GQA by passing fewer K/V heads); on CPU, or with
  float32, ``implementation=None`` (XLA) so the same code runs in the CPU smoke test;
* experts: GShard-style capacity padding. Top-k routing; every (token, choice) pair gets a slot
  ``e * C + rank`` in a ``[E, C]`` buffer, where ``rank`` counts the earlier pairs of the same expert
  (all first choices before all second choices, tokens in order within a choice, as GShard gives the
  top-1 assignment priority); pairs with ``rank >= C`` are dropped (their contribution is 0, the
  residual carries the token). ``C = ceil(capacity_factor * T * topk / E)``. The FFN is two batched
  einsums ``[E, C, D] x [E, D, 2F]`` and ``[E, C, F] x [E, F, D]`` (cuBLAS batched GEMMs on GPU).
* dispatch and combine are index gathers in both directions (``custom_vjp``): the backward of the
  dispatch gather is a gather-and-sum over each token's k slots, the backward of the combine gather
  is a gather over each slot's token, so no scatter-add (slow on GPU) and no one-hot ``[T, E, C]``
  dispatch einsum (``2 T E C D`` extra FLOPs) appears anywhere. The slot maps come from one stable
  argsort of the ``T * k`` expert ids.

Router and aux loss are te_layers' defaults (softmax over the top-k logits; switch load-balancing
loss ``E * coeff / (k T^2) * sum_e (sum_t p_te) * n_e`` from the softmax scores).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device kind (jax's device_kind, lower case,
# first matching substring wins); MFU is reported against it, None for other devices and CPUs.
PEAK_BF16_TFLOPS = (("h200", 989.0), ("h100 pcie", 756.0), ("h100", 989.0), ("h800", 989.0), ("a100", 312.0))


def peak_tflops(device_kind: str) -> float | None:
    """Dense bf16 peak of the device (``PEAK_BF16_TFLOPS``), e.g. "NVIDIA H200" -> 989; None if unlisted."""
    kind = device_kind.lower()
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in kind), None)


def train_flops_per_token(cfg: dict, seq: int, vocab: int = 256) -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward) per token, PaLM/Megatron convention.

    With ``d = d_model``, ``H`` query heads and ``KV`` key/value heads of size ``hd = d / H``,
    ``E`` experts of which ``k`` are active per token, FFN width ``F`` (gated: ``wi`` is ``d x 2F``),
    ``L`` layers, sequence ``S`` and vocabulary ``V`` (tied embedding)::

        active matmul params N = L * (d*(H + 2 KV)*hd + H*hd*d     # qkv and output projections
                                      + d*E                         # router
                                      + k * 3*d*F)                  # k experts: d x 2F and F x d
                                 + d*V                              # output logits
        flops/token = 6 N  +  12 * L * S * H * hd

    ``6 N``: 2 FLOPs per multiply-add, times 3 for forward, input gradient and weight gradient.
    ``12 L S H hd``: the scores ``Q K^T`` and ``P V`` (``2 * 2 * S * H * hd`` per token and layer
    forward, times 3), counted over the full ``S x S`` matrix as PaLM's MFU does; causal attention
    needs only half of it. Embedding lookups, norms, softmax, routing and the optimizer are not
    counted. Capacity padding is not counted either: padded rows are not model FLOPs.
    """
    d, nh, nkv, e, k, f, n_layers = (cfg[n] for n in ("d_model", "heads", "kv_heads", "experts", "topk", "ffn",
                                                      "layers"))  # fmt: skip
    hd = d // nh
    per_layer = d * (nh + 2 * nkv) * hd + nh * hd * d + d * e + k * 3 * d * f
    active = n_layers * per_layer + d * vocab
    attention = 12 * n_layers * seq * nh * hd
    return {"active_params": float(active), "matmul": 6.0 * active, "attention": float(attention),
            "total": 6.0 * active + attention}  # fmt: skip


def attention_implementation(dtype) -> str | None:
    """``"cudnn"`` on GPU for bf16/f16 (what cuDNN's fused attention takes), else None (XLA)."""
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


def capacity(capacity_factor: float, tokens: int, topk: int, experts: int) -> int:
    """Slots per expert: ``ceil(capacity_factor * tokens * topk / experts)`` (at least 1)."""
    return max(1, math.ceil(capacity_factor * tokens * topk / experts))


class Slots(NamedTuple):
    """Where each (token, choice) pair goes in the ``[E * C]`` slot buffer and back.

    ``slot_src [E*C]``: source token of each slot, ``T`` for an empty slot (reads a zero row).
    ``slot_of [T, k]``: slot of each pair, ``E*C`` when dropped (reads a zero row).
    ``slot_pair [E*C]``: flat pair index ``j * T + t`` of each slot, ``T*k`` for an empty slot.
    ``kept``: number of pairs that found a slot.
    """

    slot_src: jax.Array
    slot_of: jax.Array
    slot_pair: jax.Array
    kept: jax.Array


def capacity_slots(idx: jax.Array, num_experts: int, cap: int) -> Slots:
    """Slot maps for top-k expert ids ``idx [T, k]``: first choices before second choices, tokens in
    order within a choice, the first ``cap`` pairs of each expert kept."""
    t, k = idx.shape
    n, s = t * k, num_experts * cap
    flat_e = idx.T.reshape(-1).astype(jnp.int32)  # pair p = j * T + t
    order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)
    sorted_e = flat_e[order]
    counts = jax.nn.one_hot(flat_e, num_experts, dtype=jnp.int32).sum(0)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(n, dtype=jnp.int32) - starts[sorted_e]
    keep = rank < cap
    dest = jnp.where(keep, sorted_e * cap + rank, s)  # s: out of range, dropped by the scatters below
    slot_pair = jnp.full((s,), n, jnp.int32).at[dest].set(order, mode="drop")
    slot_src = jnp.where(slot_pair < n, slot_pair % t, t)
    slot_of = jnp.zeros((n,), jnp.int32).at[order].set(dest, unique_indices=True).reshape(k, t).T  # a permutation
    return Slots(slot_src, slot_of, slot_pair, keep.sum())


def _take(x, idx):
    """Rows ``x[idx]``, zero rows where ``idx`` is out of range (empty slots, dropped pairs)."""
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def dispatch(x: jax.Array, slot_src: jax.Array, slot_of: jax.Array) -> jax.Array:
    """``[T, D] -> [E*C, D]``: each slot's token row (zeros for empty slots)."""
    return _take(x, slot_src)


def _dispatch_fwd(x, slot_src, slot_of):
    return _take(x, slot_src), slot_of


def _dispatch_bwd(slot_of, g):
    # Each token's gradient is the sum over its k slots: a gather and a sum, not a scatter-add.
    return _take(g, slot_of).astype(jnp.float32).sum(1).astype(g.dtype), None, None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine(y: jax.Array, w: jax.Array, slot_of: jax.Array, slot_src: jax.Array, slot_pair: jax.Array) -> jax.Array:
    """``[E*C, D], w [T, k] -> [T, D]``: ``out[t] = sum_j w[t, j] * y[slot_of[t, j]]`` (dropped pairs: 0)."""
    return _combine(y, w, slot_of)


def _combine(y, w, slot_of):
    # Multiply and sum over k (a reduction fusion), not an einsum: XLA could make that a K=k GEMM.
    yk = _take(y, slot_of).astype(jnp.float32)
    return (w.astype(jnp.float32)[:, :, None] * yk).sum(1).astype(y.dtype)


def _combine_fwd(y, w, slot_of, slot_src, slot_pair):
    return _combine(y, w, slot_of), (y, w, slot_of, slot_src, slot_pair)


def _combine_bwd(res, g):
    y, w, slot_of, slot_src, slot_pair = res
    gf = g.astype(jnp.float32)
    dw = (gf[:, None, :] * _take(y, slot_of).astype(jnp.float32)).sum(-1).astype(w.dtype)
    w_slot = _take(w.T.reshape(-1), slot_pair)  # the weight of each slot's pair, 0 for empty slots
    dy = (_take(gf, slot_src) * w_slot[:, None].astype(jnp.float32)).astype(y.dtype)
    return dy, dw, None, None, None


combine.defvjp(_combine_fwd, _combine_bwd)


def route(h: jax.Array, router_kernel: jax.Array, topk: int, aux_coeff: float):
    """fp32 router: ``(weights [T, k], expert ids [T, k], aux loss)``, as te_layers' MoEBlock defaults."""
    logits = h.astype(jnp.float32) @ router_kernel.astype(jnp.float32)
    vals, idx = jax.lax.top_k(logits, topk)
    w = jax.nn.softmax(vals, -1)
    t, e = logits.shape
    scores = jax.nn.softmax(logits, -1)
    _, aux_idx = jax.lax.top_k(scores, topk)
    tpe = jax.nn.one_hot(aux_idx, e, dtype=jnp.float32).sum((0, 1))  # a reduction, not a contended scatter-add
    aux = e * aux_coeff / (topk * t * t) * jnp.sum(scores.sum(0) * tpe)
    return w, idx, aux


def capacity_moe(h, router_kernel, wi, wo, *, topk: int, capacity_factor: float, aux_coeff: float = 0.0):
    """Capacity-padded MoE FFN of ``h [T, D]``: ``(out [T, D], aux loss, fraction of pairs dropped)``.

    ``wi [E, D, 2F]`` (gated SiLU: ``silu(x wi[..., :F]) * (x wi[..., F:])``), ``wo [E, F, D]``, both
    in ``h``'s dtype; router in fp32.
    """
    t, d = h.shape
    e, _, f2 = wi.shape
    f = f2 // 2
    cap = capacity(capacity_factor, t, topk, e)
    with jax.named_scope("router"):
        w, idx, aux = route(h, router_kernel, topk, aux_coeff)
    with jax.named_scope("dispatch"):
        slots = capacity_slots(idx, e, cap)
        xe = dispatch(h, slots.slot_src, slots.slot_of).reshape(e, cap, d)
    with jax.named_scope("experts"):
        z = jnp.einsum("ecd,edf->ecf", xe, wi)
        a = (jax.nn.silu(z[..., :f].astype(jnp.float32)) * z[..., f:].astype(jnp.float32)).astype(h.dtype)
        y = jnp.einsum("ecf,efd->ecd", a, wo).reshape(e * cap, d)
    with jax.named_scope("combine"):
        out = combine(y, w, slots.slot_of, slots.slot_src, slots.slot_pair)
    return out, aux, (t * topk - slots.kept) / (t * topk)


def rope(x, theta=10000.0):
    """Rotary embedding of ``x [B, S, N, D]`` (halves rotated), computed in fp32."""
    _, s, _, d = x.shape
    half = d // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = jnp.arange(s, dtype=jnp.float32)[:, None, None] * freq
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)],
                           -1).astype(x.dtype)  # fmt: skip


class StrongBlock(nn.Module):
    """Pre-norm decoder block: cuDNN attention (GQA, RoPE, causal) and the capacity-padded MoE FFN.

    ``cfg`` as examples/train_moe.py's, plus ``capacity_factor``. Sows ``aux_loss`` and
    ``dropped_fraction`` into ``"intermediates"``.
    """

    cfg: dict

    @nn.compact
    def __call__(self, x, deterministic=True):
        c = self.cfg
        dt, nh, nkv = c["dtype"], c["heads"], c["kv_heads"]
        d = c["d_model"] // nh
        b, s, hdim = x.shape
        h = nn.RMSNorm(dtype=dt, name="ln1")(x)
        qkv = nn.Dense((nh + 2 * nkv) * d, use_bias=False, dtype=dt, name="qkv")(h)
        q, k, v = jnp.split(qkv, [nh * d, (nh + nkv) * d], -1)
        q, k, v = q.reshape(b, s, nh, d), k.reshape(b, s, nkv, d), v.reshape(b, s, nkv, d)
        with jax.named_scope("sdpa"):
            o = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True,
                                             implementation=attention_implementation(dt))  # fmt: skip
        x = x + nn.Dense(hdim, use_bias=False, dtype=dt, name="out")(o.reshape(b, s, nh * d))
        h = nn.RMSNorm(dtype=dt, name="ln2")(x).reshape(-1, hdim)
        e, f = c["experts"], c["ffn"]
        router = self.param("router", nn.initializers.lecun_normal(), (hdim, e), jnp.float32)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", -2, -1, (0,))
        wi = self.param("wi", init, (e, hdim, 2 * f), jnp.float32).astype(dt)
        wo = self.param("wo", init, (e, f, hdim), jnp.float32).astype(dt)
        out, aux, dropped = capacity_moe(h.astype(dt), router, wi, wo, topk=c["topk"],
                                         capacity_factor=c["capacity_factor"], aux_coeff=c["aux_coeff"])  # fmt: skip
        self.sow("intermediates", "aux_loss", aux)
        self.sow("intermediates", "dropped_fraction", dropped)
        return x + out.reshape(b, s, hdim)


class RaggedDotBlock(nn.Module):
    """The same block as plain Flax + jnp the straightforward way: XLA attention, argsort dispatch,
    ``jax.lax.ragged_dot`` experts (fp32 outputs), scatter-add combine. No tokens are dropped."""

    cfg: dict

    @nn.compact
    def __call__(self, x, deterministic=True):
        c = self.cfg
        dt, nh, nkv = c["dtype"], c["heads"], c["kv_heads"]
        d = c["d_model"] // nh
        b, s, hdim = x.shape
        h = nn.RMSNorm(dtype=dt, name="ln1")(x)
        qkv = nn.Dense((nh + 2 * nkv) * d, use_bias=False, dtype=dt, name="qkv")(h)
        q, k, v = jnp.split(qkv, [nh * d, (nh + nkv) * d], -1)
        q, k, v = q.reshape(b, s, nh, d), k.reshape(b, s, nkv, d), v.reshape(b, s, nkv, d)
        with jax.named_scope("sdpa"):  # scope names let benchmarks/_profile.py attribute XLA's kernels
            o = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True, implementation="xla")
        x = x + nn.Dense(hdim, use_bias=False, dtype=dt, name="out")(o.reshape(b, s, nh * d))
        h = nn.RMSNorm(dtype=dt, name="ln2")(x).reshape(-1, hdim)
        # router (fp32), top-k, switch aux loss
        e, kk, f = c["experts"], c["topk"], c["ffn"]
        logits = nn.Dense(e, use_bias=False, dtype=jnp.float32, name="router")(h.astype(jnp.float32))
        with jax.named_scope("router"):
            vals, idx = jax.lax.top_k(logits, kk)
            w = jax.nn.softmax(vals, -1)
            scores = jax.nn.softmax(logits, -1)
            _, aux_idx = jax.lax.top_k(scores, kk)
            tpe_aux = jnp.zeros((e,), jnp.float32).at[aux_idx.reshape(-1)].add(1.0)
            t = h.shape[0]
            aux = e * c["aux_coeff"] / (kk * t * t) * jnp.sum(scores.sum(0) * tpe_aux)
        self.sow("intermediates", "aux_loss", aux)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", -2, -1, (0,))
        wi = self.param("wi", init, (e, hdim, 2 * f), jnp.float32).astype(dt)
        wo = self.param("wo", init, (e, f, hdim), jnp.float32).astype(dt)
        with jax.named_scope("dispatch"):
            flat_e = idx.reshape(-1)
            order = jnp.argsort(flat_e, stable=True)
            tok = order // kk
            sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)
            rows = h[tok].astype(dt)
        with jax.named_scope("experts"):
            z = jax.lax.ragged_dot(rows, wi, sizes, preferred_element_type=jnp.float32)
            z = (jax.nn.silu(z[:, :f]) * z[:, f:]).astype(dt)
            y = jax.lax.ragged_dot(z, wo, sizes, preferred_element_type=jnp.float32)
        with jax.named_scope("combine"):
            y = y * w.reshape(-1)[order][:, None]
            out = jnp.zeros((t, hdim), jnp.float32).at[tok].add(y).astype(dt)
        return x + out.reshape(b, s, hdim)
