"""Train the MoE language model of train_moe.py with te_layers' Equinox modules (``te_layers.eqx``) and optax.

The same decoder-only byte-level model as examples/train_moe.py (Flax Linen): each block RMSNorm ->
MultiHeadAttention (causal, GQA, RoPE) -> RMSNorm (residual add fused in) -> MoEBlock, tied byte
embedding; the same data, optimizer, validation windows, progress output, loss.png and summary.json
(imported from train_moe.py), and the same flags for the model size, batch, seq, steps, lr, dtype,
eval-every and ``--fp8 {none,current,delayed,block}``. What is Equinox-specific is all in this file:

* the model is a pytree built from a ``jax.random`` key; the training step is an ``eqx.filter_jit``
  function that returns the new model, state and optimizer state; dropout takes a key per call and is
  switched off for validation with ``eqx.nn.inference_mode``;
* the MoE blocks return their aux loss (``(out, MoEAux(aux_loss, tokens_per_expert))``), which the model
  sums and returns with the logits;
* ``--fp8``: the attention projections and the experts get the recipe as their ``fp8=`` argument. With
  ``delayed`` they hold ``eqx.nn.StateIndex`` entries (amax histories and scales) of the ``eqx.nn.State``
  that ``eqx.nn.make_with_state`` returns; the model threads that state through every layer
  (``out, state = layer(x, state)``), and ``te_layers.eqx.fp8_value_and_grad`` differentiates the loss
  with respect to the model and the state and returns the new state, never given to the optimizer.
  Without delayed scaling the state is empty and passes through unchanged.

Not here (see train_moe.py): checkpoints, ``--save-every``, ``--resume``, ``--stop-at``, sampling
(examples/sample.py reads train_moe.py's checkpoints), ``--expert-parallel`` and ``--norm flax``.

    python examples/train_moe_eqx.py                            # default: as long as train_moe.py on a CPU
    python examples/train_moe_eqx.py --steps 60 --fp8 delayed   # FP8 (slower on a CPU)
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_moe, also when imported from elsewhere

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train_moe as tm  # noqa: E402  (puts the checkout on sys.path too)

from te_layers import eqx as tee  # noqa: E402

FP8_STATE = "an eqx.nn.State"  # where --fp8 delayed keeps its state (the --help and header text)

class Block(eqx.Module):
    ln1: tee.RMSNorm
    attn: tee.MultiHeadAttention
    ln2: tee.RMSNorm
    moe: tee.MoEBlock

    def __init__(self, c: dict, *, key: jax.Array):
        d, dtype = c["d_model"], c["dtype"]
        ka, km = jax.random.split(key)
        self.ln1 = tee.RMSNorm(d, dtype=dtype)
        self.attn = tee.MultiHeadAttention(
            d, c["heads"], d // c["heads"], num_kv_heads=c["kv_heads"], mask_type="causal", use_rope=True,
            dropout_rate=c["dropout"], dtype=dtype, fp8=c["fp8"], key=ka,
        )  # fmt: skip
        self.ln2 = tee.RMSNorm(d, dtype=dtype)
        self.moe = tee.MoEBlock(d, c["experts"], c["topk"], c["ffn"], aux_loss_coeff=c["aux_coeff"], dtype=dtype,
                                fp8=c["fp8"], key=km)  # fmt: skip

    def __call__(self, x, state: eqx.nn.State, *, key=None):
        a, state = self.attn(self.ln1(x), state, key=key)
        h, x = self.ln2(a, residual=x)  # h = norm(x + a), x = x + a
        (y, aux), state = self.moe(h, state)
        return x + y, aux.aux_loss, state


class MoELM(eqx.Module):
    embed: jax.Array  # [256, d_model]: the byte embedding, also the (tied) output projection
    blocks: list[Block]
    ln_f: tee.RMSNorm
    dtype: Any = eqx.field(static=True)

    def __init__(self, c: dict, *, key: jax.Array):
        ke, *kb = jax.random.split(key, c["layers"] + 1)
        self.embed = 0.02 * jax.random.normal(ke, (256, c["d_model"]))
        self.blocks = [Block(c, key=k) for k in kb]
        self.ln_f = tee.RMSNorm(c["d_model"], dtype=c["dtype"])
        self.dtype = c["dtype"]

    def __call__(self, tokens, state: eqx.nn.State, *, key=None):
        """``(logits [B, S, 256] float32, aux loss, state)``; ``key``: dropout (None: no dropout)."""
        x = self.embed[tokens].astype(self.dtype)
        keys = [None] * len(self.blocks) if key is None else list(jax.random.split(key, len(self.blocks)))
        aux = jnp.zeros((), jnp.float32)
        for block, k in zip(self.blocks, keys, strict=True):
            x, a, state = block(x, state, key=k)
            aux = aux + a
        return self.ln_f(x).astype(jnp.float32) @ self.embed.T, aux, state


def loss_fn(model, state, x, y, key):
    logits, aux, _ = model(x, state, key=key)  # the forward leaves the state as it is; its update is the gradient
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return ce + aux, (ce, aux)


def make_train_step(tx):
    @eqx.filter_jit
    def train_step(model, state, opt_state, x, y, key):
        (_, (ce, aux)), grads, state = tee.fp8_value_and_grad(loss_fn, has_aux=True)(model, state, x, y, key)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt_state, ce, aux

    return train_step


@eqx.filter_jit
def eval_loss(model, state, w):
    """Mean cross-entropy of the windows ``w [B, S + 1]`` (no backward: the FP8 state is read, not updated)."""
    logits, _, _ = model(w[:, :-1], state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, w[:, 1:]).mean()


def train(argv=None):
    """Runs the training; returns ``(summary, model, state)`` (the trained model and its eqx.nn.State)."""
    args, it, windows, corpus, cfg = tm.frontend_setup(__doc__.split("\n")[0], "train_moe_eqx", FP8_STATE, argv)
    model, state = eqx.nn.make_with_state(MoELM)(cfg, key=jax.random.key(args.seed))
    tx = tm.make_optimizer(args.lr, args.steps, args.warmup)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    train_step = make_train_step(tx)
    n_params = sum(int(p.size) for p in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    tm.print_header(args, n_params, corpus, windows, fp8_state=FP8_STATE)

    def step(i, x, y):
        nonlocal model, state, opt_state
        key = jax.random.fold_in(jax.random.key(args.seed), i)  # dropout
        model, state, opt_state, ce, aux = train_step(model, state, opt_state, x, y, key)
        return ce, aux

    def evaluate():
        eval_model = eqx.nn.inference_mode(model)  # dropout off
        return float(np.mean([float(eval_loss(eval_model, state, w)) for w in windows]))

    run = tm.train_loop(args, it, step, evaluate)
    title = "te_layers MoE LM, Equinox (byte level)" + ("" if args.fp8 == "none" else f", fp8 {args.fp8}")
    return tm.finish(args, run, corpus, n_params, title), model, state


def main(argv=None):
    return train(argv)[0]


if __name__ == "__main__":
    main()
