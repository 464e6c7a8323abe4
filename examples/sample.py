"""Restore a checkpoint written by examples/train_moe.py and sample bytes from it.

Rebuilds the model from ``<checkpoint>/config.json`` (its FP8 recipe included), restores
``<checkpoint>/params`` (and ``fp8_state``, the delayed-scaling state of an ``--fp8 delayed`` run) with orbax onto
one device (CPU unless ``--platform`` says otherwise, so a checkpoint trained on a GPU, expert-parallel
or not, samples on a laptop) and extends ``--prompt`` one byte at a time: softmax of the last
position's logits divided by ``--temperature``, restricted to the ``--top-k`` most likely bytes
(``--temperature 0``: greedy). The model sees the last ``seq`` bytes (the training sequence length).
The text goes to stdout, the rest to stderr.

    python examples/sample.py --prompt "The import statement" --bytes 400 --temperature 0.8 --top-k 40
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=os.path.join(HERE, "out", "train_moe", "checkpoint"),
                    help="directory written by train_moe.py (holds config.json and params/)")
    ap.add_argument("--prompt", default="The ")
    ap.add_argument("--bytes", type=int, default=300, help="number of bytes to generate")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely byte (greedy)")
    ap.add_argument("--top-k", type=int, default=40, help="sample among the k most likely bytes (0: all 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--platform", default="cpu",
                    help="JAX platform to run on (sets JAX_PLATFORMS); '' lets JAX pick its default")
    args = ap.parse_args(argv)
    if not args.prompt:
        ap.error("--prompt must hold at least one character (the model predicts the byte after it), got ''")
    if args.bytes < 0:
        ap.error(f"--bytes must be >= 0, got {args.bytes}")
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 <= args.top_k <= 256:
        ap.error(f"--top-k must be in [0, 256], got {args.top_k}")
    return args


def restore(ckpt_dir: str):
    """``(model, variables, meta)`` from a train_moe.py checkpoint directory, on the default device:
    ``variables`` holds ``"params"`` and, for a delayed-scaling FP8 model, ``"fp8_state"``."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    sys.path.insert(0, HERE)
    import train_moe

    ckpt_dir = os.path.abspath(ckpt_dir)
    cfg_path = os.path.join(ckpt_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise SystemExit(f"sample.py: --checkpoint must be a directory written by train_moe.py (with config.json "
                         f"and params/), got {ckpt_dir}; run examples/train_moe.py first")  # fmt: skip
    with open(cfg_path) as f:
        meta = json.load(f)
    cfg = dict(meta["model"], dtype=jnp.dtype(meta["model"]["dtype"]))
    model = train_moe.MoELM(cfg)
    dummy = jnp.zeros((1, meta["seq"]), jnp.int32)
    shapes = jax.eval_shape(lambda: train_moe.nn.meta.unbox(model.init(jax.random.key(0), dummy)))
    # newer jax deprecates the SingleDeviceSharding constructor for this factory; older jax may lack it
    one_device = getattr(jax.sharding, "make_single_device_sharding", None)
    device = (one_device or jax.sharding.SingleDeviceSharding)(jax.devices()[0])
    variables = {}
    with ocp.StandardCheckpointer() as ckptr:
        for name in ("params", train_moe.tel.FP8_COLLECTION):
            if name in shapes:
                target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes[name])
                variables[name] = ckptr.restore(os.path.join(ckpt_dir, name), target)
    return model, variables, meta


def generate(model, variables, prompt: bytes, n: int, seq: int, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0) -> bytes:  # fmt: skip
    """``n`` bytes continuing ``prompt``, one forward pass over the last ``seq`` bytes per byte."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    @jax.jit
    def next_logits(v, window, pos):
        return model.apply(v, window)[0, pos]

    rng = np.random.default_rng(seed)
    ctx = list(prompt)
    for _ in range(n):
        tail = ctx[-seq:]
        window = np.zeros((1, seq), np.int32)  # causal: the padding after ``tail`` does not reach it
        window[0, : len(tail)] = tail
        logits = np.asarray(next_logits(variables, jnp.asarray(window), len(tail) - 1), np.float64)
        if temperature == 0:
            nxt = int(np.argmax(logits))
        else:
            logits = logits / temperature
            if 0 < top_k < logits.size:
                logits[logits < np.sort(logits)[-top_k]] = -np.inf
            p = np.exp(logits - logits.max())
            nxt = int(rng.choice(logits.size, p=p / p.sum()))
        ctx.append(nxt)
    return bytes(ctx[len(prompt) :])


def main(argv=None) -> bytes:
    args = parse_args(argv)
    if args.platform:
        os.environ["JAX_PLATFORMS"] = args.platform  # before jax is imported
    model, variables, meta = restore(args.checkpoint)
    import jax

    print(f"restored {args.checkpoint} (step {meta['step']}, validation loss {meta['val_loss']:.4f} nats/byte) "
          f"on {jax.devices()[0].platform}", file=sys.stderr)  # fmt: skip
    prompt = args.prompt.encode("utf-8")
    t0 = time.perf_counter()
    out = generate(model, variables, prompt, args.bytes, meta["seq"], args.temperature, args.top_k, args.seed)
    dt = time.perf_counter() - t0
    sys.stdout.write((prompt + out).decode("utf-8", errors="replace") + "\n")
    sys.stdout.flush()
    print(f"generated {len(out)} bytes in {dt:.1f}s", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
