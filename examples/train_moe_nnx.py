"""Train the MoE language model of train_moe.py with te_layers' Flax NNX modules (``te_layers.nnx``) and optax.

The same decoder-only byte-level model as examples/train_moe.py (Flax Linen): each block RMSNorm ->
MultiHeadAttention (causal, GQA, RoPE) -> RMSNorm (residual add fused in) -> MoEBlock, tied byte
embedding; the same data, optimizer, validation windows, progress output, loss.png and summary.json
(imported from train_moe.py), and the same flags for the model size, batch, seq, steps, lr, dtype,
eval-every and ``--fp8 {none,current,delayed,block}``. What is NNX-specific is all in this file:

* the model is built eagerly from ``nnx.Rngs``; ``deterministic`` (dropout off) is a module attribute,
  set for validation on ``nnx.view(model, deterministic=True)``, a view that shares the model's variables;
* the MoE aux losses are sown as ``te_layers.nnx.AuxLoss``: the loss captures them with ``nnx.capture``
  and sums them with ``te_layers.nnx.collect_aux_loss``;
* ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and an ``nnx.jit`` step that updates model and optimizer
  in place;
* ``--fp8``: the attention projections and the experts get the recipe as their ``fp8=`` argument. With
  ``delayed`` they hold ``te_layers.nnx.FP8State`` variables (amax histories and scales; not
  ``nnx.Param``, so the optimizer never sees them). ``te_layers.nnx.fp8_value_and_grad`` differentiates
  the loss with respect to the params and the FP8State, writes the new state into the model and returns
  the params' gradients only (without FP8State it is ``nnx.value_and_grad``).

Not here (see train_moe.py): checkpoints, ``--save-every``, ``--resume``, ``--stop-at``, sampling
(examples/sample.py reads train_moe.py's checkpoints), ``--expert-parallel`` and ``--norm flax``.

    python examples/train_moe_nnx.py                            # default: as long as train_moe.py on a CPU
    python examples/train_moe_nnx.py --steps 60 --fp8 delayed   # FP8 (slower on a CPU)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_moe, also when imported from elsewhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train_moe as tm  # noqa: E402  (puts the checkout on sys.path too)
from flax import nnx  # noqa: E402

from te_layers import nnx as ten  # noqa: E402

FP8_STATE = "te_layers.nnx.FP8State variables"  # where --fp8 delayed keeps its state (the --help and header text)

class Block(nnx.Module):
    def __init__(self, c: dict, *, rngs: nnx.Rngs):
        d, dtype = c["d_model"], c["dtype"]
        self.ln1 = ten.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.attn = ten.MultiHeadAttention(
            d, c["heads"], d // c["heads"], num_kv_heads=c["kv_heads"], mask_type="causal", use_rope=True,
            dropout_rate=c["dropout"], dtype=dtype, fp8=c["fp8"], rngs=rngs,
        )  # fmt: skip
        self.ln2 = ten.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.moe = ten.MoEBlock(d, c["experts"], c["topk"], c["ffn"], aux_loss_coeff=c["aux_coeff"], dtype=dtype,
                                fp8=c["fp8"], rngs=rngs)  # fmt: skip

    def __call__(self, x):
        h, x = self.ln2(self.attn(self.ln1(x)), residual=x)  # h = norm(x + attn), x = x + attn
        return x + self.moe(h)  # the aux loss is sown (AuxLoss)


class MoELM(nnx.Module):
    def __init__(self, c: dict, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, c["d_model"], embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c["layers"])])
        self.ln_f = ten.RMSNorm(c["d_model"], dtype=c["dtype"], rngs=rngs)
        self.dtype = c["dtype"]

    def __call__(self, tokens):
        x = self.embed(tokens).astype(self.dtype)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln_f(x).astype(jnp.float32))  # tied output embedding, fp32 logits


def loss_fn(model, x, y):
    logits, sown = nnx.capture(model, ten.AuxLoss)(x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    aux = ten.collect_aux_loss(sown)
    return ce + aux, (ce, aux)


@nnx.jit
def train_step(model, optimizer, x, y):
    (_, (ce, aux)), grads = ten.fp8_value_and_grad(loss_fn, has_aux=True)(model, x, y)  # FP8State updated
    optimizer.update(model, grads)  # grads: nnx.Param only
    return ce, aux


@nnx.jit
def eval_loss(model, w):
    """Mean cross-entropy of the windows ``w [B, S + 1]`` (no backward: the FP8State is read, not updated)."""
    return loss_fn(model, w[:, :-1], w[:, 1:])[1][0]


def train(argv=None):
    """Runs the training; returns ``(summary, model)`` (the trained model with its FP8State, if any)."""
    args, it, windows, corpus, cfg = tm.frontend_setup(__doc__.split("\n")[0], "train_moe_nnx", FP8_STATE, argv)
    model = MoELM(cfg, rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, tm.make_optimizer(args.lr, args.steps, args.warmup), wrt=nnx.Param)
    n_params = sum(int(p.size) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tm.print_header(args, n_params, corpus, windows, fp8_state=FP8_STATE)

    eval_model = nnx.view(model, deterministic=True)  # dropout off; shares the (trained) variables

    def evaluate():
        return float(np.mean([float(eval_loss(eval_model, w)) for w in windows]))

    run = tm.train_loop(args, it, lambda i, x, y: train_step(model, optimizer, x, y), evaluate)
    title = "te_layers MoE LM, Flax NNX (byte level)" + ("" if args.fp8 == "none" else f", fp8 {args.fp8}")
    return tm.finish(args, run, corpus, n_params, title), model


def main(argv=None):
    return train(argv)[0]


if __name__ == "__main__":
    main()
