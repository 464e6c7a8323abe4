"""Train a small decoder-only mixture-of-experts language model with te_layers (Flax Linen) and optax.

Byte-level language model on real English text with a held-out split, with no downloads: the
Python documentation and standard-library docstrings of this CPython installation (see
python_docs_corpus.py; assembled into examples/out/corpus on first run), or your own ``train.txt`` /
``valid.txt`` in ``--data-dir``. Each block: RMSNorm -> te_layers MultiHeadAttention (causal, GQA, RoPE,
fused attention) -> RMSNorm -> te_layers MoEBlock (top-k router with aux loss, token_dispatch, SwiGLU
experts on a grouped GEMM, token_combine). Reports the training loss per step and the validation loss
(nats and bits per byte) on the held-out split every ``--eval-every`` steps; writes a loss-curve PNG,
an orbax checkpoint with the model config (restore and sample with examples/sample.py) and
summary.json into --out.

``--fp8 {none,current,delayed,block}`` runs the GEMMs of the attention projections and the experts in
FP8 (te_ops.fp8 recipes through the ``te_layers.fp8_recipe`` context; embeddings, router, norms and
the attention core stay in high precision). ``delayed``: DelayedScaling for the attention projections
and the experts (per-expert kernel scales); the amax histories and scales live in the Linen
``"fp8_state"`` collection, carried by the training step and checkpointed, never given to the
optimizer. Checkpoints hold the params, the optimizer state and the
FP8 state; ``--save-every K`` keeps one every K steps and ``--resume DIR`` continues a run from one,
reproducing the uninterrupted run's losses. ``--stop-at N`` ends the run after step N of the ``--steps``
schedule (the first N steps of the full run, losses in summary.json; its checkpoint resumes).

    python examples/train_moe.py                      # default: 1-2 minutes on a 2-core CPU
    python examples/sample.py --prompt "The import statement"
    python examples/train_moe.py --steps 2000 --batch 64 --seq 256 --d-model 512 --layers 8 \
        --heads 8 --kv-heads 2 --experts 16 --topk 2 --ffn 1024 --dtype bfloat16   # GPU
    python examples/train_moe.py --dtype bfloat16 --fp8 block --save-every 100     # FP8, checkpoints
    python examples/train_moe.py --dtype bfloat16 --fp8 block --resume examples/out/train_moe/checkpoints/step_100

examples/train_moe_nnx.py and examples/train_moe_eqx.py train the same model with te_layers' Flax NNX and
Equinox modules (this file's data pipeline, optimizer, training loop and outputs; no checkpoints).

benchmarks/train_moe.py times this model against the same architecture written in plain JAX (cuDNN
attention with capacity-padded batched-einsum experts, and XLA attention with ``jax.lax.ragged_dot``
experts), in one process on the same batches.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing
sys.path.insert(0, HERE)  # python_docs_corpus, also when imported from elsewhere

import flax.linen as nn  # noqa: E402
import optax  # noqa: E402
import python_docs_corpus  # noqa: E402

import te_layers  # noqa: E402
from te_layers import linen as tel  # noqa: E402
from te_ops.fp8 import BlockScaling, CurrentScaling, DelayedScaling  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Model (te_layers)
# ----------------------------------------------------------------------------------------------

# --fp8: the recipe of the te_layers.fp8_recipe context around the whole model (te_ops.fp8 defaults).
FP8_RECIPES = {"none": None, "current": CurrentScaling(), "delayed": DelayedScaling(), "block": BlockScaling()}


def fp8_context(c: dict):
    """The ``te_layers.fp8_recipe`` context of ``c["fp8"]`` (a key of FP8_RECIPES); a no-op without FP8, so
    an outer context (if any) still applies."""
    recipe = FP8_RECIPES[c.get("fp8") or "none"]
    return te_layers.fp8_recipe(recipe) if recipe is not None else contextlib.nullcontext()


def rms_norm(c: dict, name: str) -> nn.Module:
    """The model's RMSNorm: te_layers' fused one (``norm="te"``, the default) or flax's (``"flax"``).
    Both hold one ``scale`` parameter [d_model], so checkpoints work with either."""
    if c.get("norm", "te") == "flax":
        return nn.RMSNorm(dtype=c["dtype"], name=name)
    return tel.RMSNorm(dtype=c["dtype"], name=name)


class Block(nn.Module):
    cfg: dict

    @nn.compact
    def __call__(self, x, deterministic=True):
        c = self.cfg
        h = rms_norm(c, "ln1")(x)
        a = tel.MultiHeadAttention(
            c["heads"], c["d_model"] // c["heads"], num_kv_heads=c["kv_heads"], mask_type="causal", use_rope=True,
            dropout_rate=c["dropout"], dtype=c["dtype"], name="attn",
            fp8=None if c.get("fp8_attention", True) else False,  # False: projections in --dtype under --fp8
        )(h, deterministic=deterministic)  # fmt: skip
        if c.get("norm", "te") == "flax":
            x = x + a
            h = rms_norm(c, "ln2")(x)
        else:  # residual add fused into the norm: h = norm(x + a), x = x + a
            h, x = rms_norm(c, "ln2")(a, residual=x)
        return x + tel.MoEBlock(
            c["experts"], c["topk"], c["ffn"], aux_loss_coeff=c["aux_coeff"], dtype=c["dtype"],
            expert_axis=c.get("expert_axis"), mesh=c.get("mesh"), name="moe",
        )(h, deterministic=deterministic)  # fmt: skip


class MoELM(nn.Module):
    cfg: dict
    block: type = Block

    @nn.compact
    def __call__(self, tokens, deterministic=True):
        c = self.cfg
        embed = nn.Embed(256, c["d_model"], embedding_init=nn.initializers.normal(0.02), name="embed")
        x = embed(tokens).astype(c["dtype"])
        with fp8_context(c):  # read when each layer is called: init, training step, evaluation, sampling
            for i in range(c["layers"]):
                x = self.block(c, name=f"block{i}")(x, deterministic)
        x = rms_norm(c, "ln_f")(x)
        return embed.attend(x.astype(jnp.float32))  # tied output embedding, fp32 logits


# ----------------------------------------------------------------------------------------------
# Data, training step, validation, checkpoint
# ----------------------------------------------------------------------------------------------


def load_data(data_dir: str | None, seq: int):
    """``(train, valid, info)`` byte arrays of the corpus (python_docs_corpus.load) checked against ``seq``."""
    train, valid, info = python_docs_corpus.load(data_dir)
    for name, arr in (("train.txt", train), ("valid.txt", valid)):
        if arr.size < seq + 2:
            raise SystemExit(f"train_moe: {name} in {info['dir']} must hold more than --seq + 1 = {seq + 1} bytes, "
                             f"got {arr.size}; add text or lower --seq")  # fmt: skip
    return train, valid, info


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    """Endless ``(inputs, targets)`` batches of ``seq`` bytes from random offsets in ``data``."""
    rng = np.random.default_rng(seed)
    n = data.size - seq - 1
    while True:
        starts = rng.integers(0, n, batch)
        chunk = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)
        yield chunk[:, :-1], chunk[:, 1:]


def eval_windows(data: np.ndarray, batch: int, seq: int, max_tokens: int) -> np.ndarray:
    """``[n_batches, batch, seq + 1]``: consecutive non-overlapping windows from the start of ``data``.

    Covers up to ``max_tokens`` predicted bytes (at least one batch), whole batches only, the same
    windows at every evaluation, so validation losses are comparable across steps and runs.
    """
    n_win = (data.size - 1) // seq
    n_win = min(n_win, max(max_tokens // seq, batch))
    n_batches = n_win // batch
    if n_batches == 0:
        raise SystemExit(f"train_moe: valid.txt must hold at least --batch x --seq + 1 = {batch * seq + 1} bytes "
                         f"for one validation batch, got {data.size}; lower --batch or --seq")  # fmt: skip
    idx = np.arange(n_batches * batch)[:, None] * seq + np.arange(seq + 1)[None, :]
    return data[idx].astype(np.int32).reshape(n_batches, batch, seq + 1)


def make_eval_fn(model, windows: np.ndarray):
    """``evaluate(params, fp8_state=None) -> mean cross-entropy (nats/byte)`` over ``windows``, dropout off,
    no aux loss; ``fp8_state``: the ``"fp8_state"`` collection of a delayed-scaling model (read, not updated:
    no backward pass, so the amax histories do not move)."""

    @jax.jit
    def batch_loss(variables, w):
        logits = model.apply(variables, w[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, w[:, 1:]).mean()

    def evaluate(params, fp8_state=None):
        variables = {"params": params} if fp8_state is None else {"params": params, tel.FP8_COLLECTION: fp8_state}
        return float(np.mean([float(batch_loss(variables, w)) for w in windows]))

    return evaluate


def make_optimizer(lr: float, steps: int, warmup: int):
    """The training optimizer: global-norm clipping at 1.0, then AdamW (weight decay 0.01) with a linear
    warm-up over ``min(warmup, steps // 4)`` steps and cosine decay to ``lr / 10`` at ``steps``."""
    warm = min(warmup, max(steps // 4, 1))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(steps, warm + 1), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))


def make_train_step(model, tx, donate: bool = False, fp8_state: bool = False):
    """Jitted ``step(params, opt_state, x, y, rng) -> (params, opt_state, ce, aux)``; ``donate`` lets XLA
    reuse the buffers of the old params and optimizer state (the caller must not touch them again).

    ``fp8_state=True`` (a model with delayed-scaling FP8 state): ``step(params, fp8_state, opt_state, x, y,
    rng) -> (params, fp8_state, opt_state, ce, aux)``. ``tel.fp8_value_and_grad`` differentiates the loss
    with respect to the ``"fp8_state"`` collection as well as the params; the state's "gradient" is the
    next state (the amaxes of this step pushed into the histories, new scales). Only the params'
    gradients reach the optimizer: the state never goes through clipping, Adam or weight decay.
    """

    def loss_fn(variables, x, y, rng):
        logits, st = model.apply(variables, x, deterministic=False, mutable=["intermediates"],
                                 rngs={"dropout": rng})  # fmt: skip
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        aux = tel.collect_aux_loss(st.get("intermediates", {}))
        return ce + aux, (ce, aux)

    if fp8_state:

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2) if donate else ())
        def fp8_step(params, state, opt_state, x, y, rng):
            variables = {"params": params, tel.FP8_COLLECTION: state}
            (_, (ce, aux)), grads, new = tel.fp8_value_and_grad(loss_fn, has_aux=True)(variables, x, y, rng)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new[tel.FP8_COLLECTION], opt_state, ce, aux

        return fp8_step

    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def step(params, opt_state, x, y, rng):
        grad_fn = jax.value_and_grad(lambda p, *a: loss_fn({"params": p}, *a), has_aux=True)
        (_, (ce, aux)), grads = grad_fn(params, x, y, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce, aux

    return step


MODEL_KEYS = ("d_model", "layers", "heads", "kv_heads", "experts", "topk", "ffn", "aux_coeff", "dropout", "dtype",
              "norm", "fp8", "fp8_attention")
# keys that older checkpoints may lack; fp8_attention False keeps the attention projections out of --fp8
MODEL_DEFAULTS = {"norm": "te", "fp8": "none", "fp8_attention": True}


def model_config(cfg: dict) -> dict:
    """The JSON-serialisable part of ``cfg`` that rebuilds the model (no mesh: restore picks its own)."""
    return {k: (jnp.dtype(cfg[k]).name if k == "dtype" else cfg.get(k, MODEL_DEFAULTS.get(k))) for k in MODEL_KEYS}


def describe_fp8(name: str, state: str = f"the {tel.FP8_COLLECTION!r} collection") -> str:
    """The run header's line for ``--fp8 name``: which recipe runs where (``state``: where the delayed-scaling
    state lives)."""
    if name == "none":
        return "fp8 none (every GEMM in the compute dtype)"
    recipe = FP8_RECIPES[name]
    where = f" (state in {state})" if name == "delayed" else ""
    return f"fp8 {name}: attention projections and experts {recipe!r}{where}"


CKPT_TREES = ("params", "opt_state", tel.FP8_COLLECTION)  # orbax sub-directories of a checkpoint


def save_checkpoint(ckpt_dir: str, params, meta: dict, opt_state=None, fp8_state=None) -> str:
    """Writes ``ckpt_dir/params`` (orbax, plain arrays), ``ckpt_dir/opt_state`` and ``ckpt_dir/fp8_state``
    (when given) and ``ckpt_dir/config.json`` (``meta``); returns ckpt_dir.

    Orbax (a dependency of flax) writes each array as a tensorstore file without gathering sharded
    arrays onto one host; the logical-partitioning boxes are removed so the checkpoint is a plain
    nested dict that examples/sample.py restores onto any device (CPU by default). The optimizer
    state and the delayed-scaling FP8 state (amax histories and scales) are what :func:`restore_checkpoint`
    needs to continue the run exactly where it stopped.
    """
    import shutil

    import orbax.checkpoint as ocp

    ckpt_dir = os.path.abspath(ckpt_dir)
    if os.path.exists(ckpt_dir):
        shutil.rmtree(ckpt_dir)
    os.makedirs(ckpt_dir)
    trees = dict(zip(CKPT_TREES, (params, opt_state, fp8_state), strict=True))
    with ocp.StandardCheckpointer() as ckptr:
        for name, tree in trees.items():
            if tree is not None:
                ckptr.save(os.path.join(ckpt_dir, name), nn.meta.unbox(tree))
        ckptr.wait_until_finished()
    with open(os.path.join(ckpt_dir, "config.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return ckpt_dir


def read_checkpoint_meta(ckpt_dir: str) -> dict:
    path = os.path.join(os.path.abspath(ckpt_dir), "config.json")
    if not os.path.exists(path):
        raise SystemExit(f"train_moe: --resume must be a checkpoint directory written by train_moe.py (with "
                         f"config.json, params/, opt_state/), got {ckpt_dir}")  # fmt: skip
    with open(path) as f:
        return json.load(f)


def restore_checkpoint(ckpt_dir: str, like: dict) -> dict:
    """The trees of ``ckpt_dir`` named in ``like`` (``{"params": ..., "opt_state": ..., "fp8_state": ...}``),
    each restored into the structure, dtypes and shardings of the given tree (e.g. a fresh init)."""
    import orbax.checkpoint as ocp

    ckpt_dir = os.path.abspath(ckpt_dir)
    out = {}
    with ocp.StandardCheckpointer() as ckptr:
        for name, tree in like.items():
            path = os.path.join(ckpt_dir, name)
            if not os.path.exists(path):
                raise SystemExit(f"train_moe: checkpoint {ckpt_dir} has no {name}/ (written by an older "
                                 "train_moe.py, or without it); cannot resume from it")  # fmt: skip
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
            out[name] = ckptr.restore(path, target)
    return out


class Progress:
    """tqdm when installed, else a plain line every few seconds; ``write`` prints above the bar."""

    def __init__(self, total, initial=0):
        self.total, self.last, self.first = total, 0.0, initial
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.val = None

    def update(self, i, loss, tok_s):
        post = dict(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        if self.val is not None:
            post["val"] = f"{self.val:.3f}"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(post)
        elif i == self.total - 1 or time.perf_counter() - self.last > 5 or i <= self.first:
            self.last = time.perf_counter()
            print(f"step {i + 1:5d}/{self.total}  loss {loss:.4f}  {tok_s:,.0f} tokens/s", flush=True)

    def write(self, msg):
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def plot_losses(path, steps, losses, val_curve, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, lw=1, alpha=0.4, label="train loss (per step)")
    if len(losses) >= 10:
        k = max(1, len(losses) // 25)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, lw=2, label=f"train, moving average ({k})")
    if val_curve:
        vs, vl = [c[0] for c in val_curve], [c[1] for c in val_curve]
        ax.plot(vs, vl, "o-", lw=2, label="validation loss (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_header(args, n_params: int, corpus: dict, windows: np.ndarray, fp8_state: str | None = None):
    """The run header: model and batch sizes, the --fp8 recipe (``fp8_state``: where delayed scaling keeps its
    state, see :func:`describe_fp8`), --stop-at, the corpus."""
    print(f"te_layers MoE LM: {n_params:,} parameters, {args.layers} layers, {args.experts} experts top-"
          f"{args.topk}, batch {args.batch} x seq {args.seq}, {args.dtype}, backend {jax.default_backend()}")
    print(describe_fp8(args.fp8) if fp8_state is None else describe_fp8(args.fp8, fp8_state))
    if args.end < args.steps:
        print(f"stopping after step {args.end} of the {args.steps}-step run (--stop-at)")
    print(f"corpus {corpus['dir']}: {corpus['train_bytes']:,} train bytes, {corpus['valid_bytes']:,} held-out bytes "
          f"({windows.shape[0] * windows.shape[1] * args.seq:,} scored per validation)")


def train_loop(args, it, train_step, evaluate, start: int = 0, after_step=None) -> dict:
    """Steps ``start`` .. ``args.end - 1``: ``train_step(i, x, y) -> (ce, aux)`` on the next batch of ``it`` (the
    step keeps its own state: params, optimizer state, FP8 state), with a progress bar (training loss, tokens/s).
    The validation loss ``evaluate() -> float`` is printed before the first step, every ``--eval-every`` steps and
    after the last; ``after_step(n_done, val_curve)`` (e.g. a checkpoint) runs after each step, its time (like
    validation's) not counted as training. Returns ``{"losses", "auxes", "val_curve": [(step, loss)], "seconds",
    "tokens_per_s"}`` (tokens/s without the first, compiling step)."""
    losses, auxes, val_curve = [], [], []
    prog = Progress(args.end, start)

    def validate(n_done):
        v = evaluate()
        val_curve.append((n_done, v))
        prog.val = v
        prog.write(f"step {n_done:5d}  validation loss {v:.4f} nats/byte ({v / math.log(2):.3f} bits/byte)")

    validate(start)
    t_start = time.perf_counter()
    t_steady, steady_tokens, paused_s = None, 0, 0.0  # paused: validation and checkpoints, not training
    for i in range(start, args.end):
        x, y = next(it)
        ce, aux = train_step(i, x, y)
        ce = float(ce)  # syncs: the bar shows real progress
        losses.append(ce)
        auxes.append(float(aux))
        if i == start:
            t_steady = time.perf_counter()  # exclude the compile step from tokens/s
        else:
            steady_tokens += args.batch * args.seq
        t_pause = time.perf_counter()
        if (i + 1) % args.eval_every == 0 or i + 1 == args.end:
            validate(i + 1)
        if after_step is not None:
            after_step(i + 1, val_curve)
        paused_s += time.perf_counter() - t_pause
        el = time.perf_counter() - t_steady - paused_s
        prog.update(i, ce, steady_tokens / el if el > 0 and steady_tokens else 0.0)
    prog.close()
    total = time.perf_counter() - t_start
    tok_s = steady_tokens / max(time.perf_counter() - t_steady - paused_s, 1e-9)
    return dict(losses=losses, auxes=auxes, val_curve=val_curve, seconds=total, tokens_per_s=tok_s)


def finish(args, run: dict, corpus: dict, n_params: int, title: str, start: int = 0, checkpoints=None, save=None):
    """The summary of a :func:`train_loop` ``run``: writes the loss curve (``--out/loss.png``), prints the
    train and validation losses, writes ``--out/summary.json`` and returns the summary dict.
    ``checkpoints`` (train_moe.py: the periodic checkpoints' paths) adds the keys ``checkpoint`` (what
    ``save()`` returns, called before the summary is printed) and ``checkpoints``."""
    losses, val_curve, total, tok_s = run["losses"], run["val_curve"], run["seconds"], run["tokens_per_s"]
    k = max(1, min(20, len(losses) // 5))
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    val_first, val_last = val_curve[0][1], val_curve[-1][1]
    png = os.path.join(args.out, "loss.png")
    plot_losses(png, np.arange(start + 1, args.end + 1), np.asarray(losses), val_curve, title)
    summary = dict(first_loss=first, last_loss=last, val_loss_initial=val_first, val_loss=val_last,
                   val_bits_per_byte=val_last / math.log(2), val_curve=val_curve, steps=args.steps,
                   start_step=start, end_step=args.end, losses=losses, fp8=args.fp8,
                   epochs=(args.end - start) * args.batch * args.seq / corpus["train_bytes"], tokens_per_s=tok_s,
                   seconds=total, params=n_params, corpus=corpus, loss_png=png)  # fmt: skip
    if checkpoints is not None:
        summary.update(checkpoint=save() if save is not None else None, checkpoints=checkpoints)
    print(f"train loss {first:.4f} -> {last:.4f} (mean of first/last {k} steps); validation loss {val_first:.4f} -> "
          f"{val_last:.4f} nats/byte ({val_last / math.log(2):.3f} bits/byte) on held-out text; {total:.1f}s, "
          f"{summary['epochs']:.2f} epochs; aux loss {run['auxes'][-1]:.4f}; {tok_s:,.0f} tokens/s")
    print(f"loss curve: {png}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


# ----------------------------------------------------------------------------------------------


def make_parser(description: str, out: str, linen: bool = True,
                fp8_state: str = f"the {tel.FP8_COLLECTION!r} collection") -> argparse.ArgumentParser:
    """This script's command line (``out``: the default --out). ``linen=False``: only the flags that
    train_moe_nnx.py and train_moe_eqx.py share with it (data, model size, training, validation, --fp8; no
    --norm, --expert-parallel, checkpoints or --stop-at); ``fp8_state``: where --fp8 delayed keeps its state."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--data-dir", default=None,
                    help="directory with train.txt and valid.txt; when they are missing the Python documentation "
                         f"corpus is assembled there (default: {python_docs_corpus.default_dir()})")
    ap.add_argument("--out", default=out)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--aux-coeff", type=float, default=1e-2)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    if linen:
        ap.add_argument("--norm", default="te", choices=["te", "flax"],
                        help="RMSNorm: te_layers' fused one (residual add fused in) or flax.linen.RMSNorm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50,
                    help="validation loss every this many steps (also before the first and after the last step)")
    ap.add_argument("--eval-tokens", type=int, default=16384,
                    help="held-out bytes scored per validation (whole batches of --batch x --seq, from the start "
                         "of valid.txt)")
    if linen:
        ap.add_argument("--expert-parallel", action="store_true",
                        help="shard the experts over all devices (mesh axis 'ep'); experts and tokens must divide")
    ap.add_argument("--fp8", default="none", choices=list(FP8_RECIPES),
                    help="FP8 GEMMs in the attention projections and the experts (te_ops.fp8 recipes with their "
                         "defaults): current = per-tensor current scaling, delayed = per-tensor delayed scaling (per "
                         f"expert for the expert kernels; state in {fp8_state}), block = 1x128 / "
                         "128x128 block scaling. Embeddings, router, norms and the attention core stay in --dtype")
    if not linen:
        return ap
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--save-every", type=int, default=0,
                    help="also write a checkpoint every this many steps into --out/checkpoints/step_<N> (0: never)")
    ap.add_argument("--resume", default=None,
                    help="checkpoint directory (checkpoint/ or checkpoints/step_<N>) to continue from: restores the "
                         "params, the optimizer state and the FP8 state and runs its step + 1 .. --steps on the "
                         "batches the uninterrupted run would have seen")
    ap.add_argument("--stop-at", type=int, default=None, metavar="N",
                    help="stop after step N of the --steps run: learning-rate schedule, batches and dropout keys "
                         "those of --steps, so the losses are that run's first N (validation and checkpoint at N, "
                         "--resume continues it); default: --steps")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked (``ap.error`` on a bad value), with ``args.end``: the last step this run trains."""
    for name in ("steps", "batch", "seq", "eval_every", "eval_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "save_every", 0) < 0:
        ap.error(f"--save-every must be >= 0 (0: no periodic checkpoints), got {args.save_every}")
    stop_at = getattr(args, "stop_at", None)
    if stop_at is not None and not 1 <= stop_at <= args.steps:
        ap.error(f"--stop-at must be in 1..--steps ({args.steps}), got {stop_at}")
    args.end = args.steps if stop_at is None else stop_at
    return args


def frontend_setup(description: str, out_name: str, fp8_state: str, argv=None):
    """What the NNX and Equinox versions of this example share before building their model: the parsed
    and checked ``args`` (``--out`` created), the training batch iterator, the validation windows, the
    corpus description and the model configuration ``cfg`` (dtype and FP8 recipe resolved)."""
    ap = make_parser(description, os.path.join(HERE, "out", out_name), linen=False, fp8_state=fp8_state)
    args = check_args(ap, ap.parse_args(argv))
    os.makedirs(args.out, exist_ok=True)
    train_text, valid_text, corpus = load_data(args.data_dir, args.seq)
    it = batches(train_text, args.batch, args.seq, args.seed + 1)
    windows = eval_windows(valid_text, args.batch, args.seq, args.eval_tokens)
    cfg = dict(d_model=args.d_model, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
               experts=args.experts, topk=args.topk, ffn=args.ffn, aux_coeff=args.aux_coeff, dropout=args.dropout,
               dtype=jnp.dtype(args.dtype), fp8=FP8_RECIPES[args.fp8])  # fmt: skip
    return args, it, windows, corpus, cfg


def parse_args(argv=None):
    ap = make_parser(__doc__.split("\n")[0], os.path.join(HERE, "out", "train_moe"))
    return check_args(ap, ap.parse_args(argv))


def resume_from(args, cfg: dict, trees: dict) -> tuple[int, dict]:
    """``(step, trees)`` restored from ``--resume`` into the structure of ``trees`` (the fresh init): the
    params and the optimizer state, and the FP8 state when both runs use delayed scaling (a run
    switching to ``--fp8 delayed`` from a checkpoint without that state starts it fresh, and says so)."""
    meta = read_checkpoint_meta(args.resume)
    saved, now = dict(MODEL_DEFAULTS, **meta["model"]), model_config(cfg)
    diff = {k: (saved.get(k), now[k]) for k in now if k != "fp8" and saved.get(k) != now[k]}
    if diff:
        raise SystemExit(f"train_moe: --resume {args.resume} holds another model; pass the flags it was trained with "
                         f"(checkpoint vs now: {diff})")  # fmt: skip
    step = int(meta["step"])
    if step >= args.end:
        what = "--steps" if args.stop_at is None else "--stop-at"
        raise SystemExit(f"train_moe: --resume {args.resume} is at step {step}; {what} must be larger to train "
                         f"on, got {args.end}")  # fmt: skip
    want = {k: v for k, v in trees.items() if v is not None}
    has_state = os.path.exists(os.path.join(os.path.abspath(args.resume), tel.FP8_COLLECTION))
    if tel.FP8_COLLECTION in want and not has_state:
        print(f"resume: checkpoint trained with --fp8 {saved['fp8']} has no delayed-scaling state; starting it fresh")
        del want[tel.FP8_COLLECTION]
    out = dict(trees, **restore_checkpoint(args.resume, want))
    train = meta.get("train", {})
    changed = {k: (train[k], getattr(args, k)) for k in train if train[k] != getattr(args, k)}
    if saved["fp8"] != cfg.get("fp8", "none"):
        changed["fp8"] = (saved["fp8"], cfg.get("fp8", "none"))
    print(f"resumed {os.path.abspath(args.resume)} at step {step}"
          + (f"; changed since (checkpoint, now): {changed}" if changed else ""))  # fmt: skip
    return step, out


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = dict(d_model=args.d_model, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
               experts=args.experts, topk=args.topk, ffn=args.ffn, aux_coeff=args.aux_coeff, dropout=args.dropout,
               dtype=jnp.dtype(args.dtype), norm=args.norm, fp8=args.fp8)  # fmt: skip
    if args.expert_parallel:
        cfg["mesh"] = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
        cfg["expert_axis"] = "ep"
    model = MoELM(cfg)
    train, valid, corpus = load_data(args.data_dir, args.seq)
    it = batches(train, args.batch, args.seq, args.seed + 1)
    windows = eval_windows(valid, args.batch, args.seq, args.eval_tokens)
    evaluate = make_eval_fn(model, windows)
    # Unboxed (plain arrays, no partitioning metadata): the trees a checkpoint holds and restores into. Placed
    # explicitly (one device, or replicated over the expert-parallel mesh), so that restored arrays land where
    # fresh ones do.
    # newer jax deprecates the SingleDeviceSharding constructor for this factory; older jax may lack it
    one_device = getattr(jax.sharding, "make_single_device_sharding", None)
    place = (one_device or jax.sharding.SingleDeviceSharding)(jax.devices()[0])
    if args.expert_parallel:
        place = jax.sharding.NamedSharding(cfg["mesh"], jax.sharding.PartitionSpec())
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(args.seed),
                                                  jnp.zeros((args.batch, args.seq), jnp.int32)))  # fmt: skip
    variables = jax.device_put(variables, place)
    params = variables["params"]
    fp8_state = variables.get(tel.FP8_COLLECTION)  # --fp8 delayed: amax histories and scales, not parameters
    n_params = sum(int(p.size) for p in jax.tree.leaves(params))
    tx = make_optimizer(args.lr, args.steps, args.warmup)
    opt_state = jax.device_put(tx.init(params), place)  # the optimizer sees the params only
    step = make_train_step(model, tx, fp8_state=fp8_state is not None)
    print_header(args, n_params, corpus, windows)
    start = 0
    if args.resume:
        start, r = resume_from(args, cfg, {"params": params, "opt_state": opt_state, tel.FP8_COLLECTION: fp8_state})
        params, opt_state, fp8_state = r["params"], r["opt_state"], r[tel.FP8_COLLECTION]
        for _ in range(start):  # the batches the first `start` steps consumed
            next(it)

    def train_step(i, x, y):
        nonlocal params, opt_state, fp8_state
        rng = jax.random.fold_in(jax.random.key(args.seed), i)
        if fp8_state is None:
            params, opt_state, ce, aux = step(params, opt_state, x, y, rng)
        else:
            params, fp8_state, opt_state, ce, aux = step(params, fp8_state, opt_state, x, y, rng)
        return ce, aux

    def checkpoint_meta(n_done, val_curve):
        return dict(model=model_config(cfg), seq=args.seq, step=n_done, val_loss=val_curve[-1][1],
                    val_step=val_curve[-1][0], corpus_dir=corpus["dir"],
                    train={k: getattr(args, k) for k in ("steps", "batch", "lr", "warmup", "seed")})  # fmt: skip

    saved = []

    def after_step(n_done, val_curve):
        if args.save_every and n_done % args.save_every == 0:
            d = os.path.join(args.out, "checkpoints", f"step_{n_done}")
            saved.append(save_checkpoint(d, params, checkpoint_meta(n_done, val_curve), opt_state, fp8_state))

    run = train_loop(args, it, train_step, lambda: evaluate(params, fp8_state), start, after_step)

    def save_final():
        if args.no_checkpoint:
            return None
        meta = checkpoint_meta(args.end, run["val_curve"])
        return save_checkpoint(os.path.join(args.out, "checkpoint"), params, meta, opt_state, fp8_state)

    title = "te_layers MoE LM (byte level)" + ("" if args.fp8 == "none" else f", fp8 {args.fp8}")
    summary = finish(args, run, corpus, n_params, title, start, checkpoints=saved, save=save_final)
    if summary["checkpoint"]:
        print(f"checkpoint: {summary['checkpoint']}  (sample: python examples/sample.py --checkpoint "
              f"{summary['checkpoint']})")
    return summary


if __name__ == "__main__":
    main()
