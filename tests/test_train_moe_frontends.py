"""examples/train_moe_nnx.py and examples/train_moe_eqx.py (the model of examples/train_moe.py in Flax NNX and in
Equinox) at tiny sizes: the same parameters give train_moe.MoELM's logits and aux loss; a ``--fp8 delayed`` run's
loss falls and stays finite, and its delayed-scaling state records one amax per step in every history."""

import json
import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

STEPS = 12
TINY = ["--steps", str(STEPS), "--batch", "4", "--seq", "32", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--experts", "4", "--topk", "2", "--ffn", "32", "--lr", "1e-2", "--eval-every", "5",
        "--eval-tokens", "256"]  # fmt: skip


def _fp8_states(framework, trained):
    """``{layer: state tree}`` of the delayed-scaling layers of the (one-block) trained model."""
    if framework == "nnx":
        (model,) = trained
        blk = model.blocks[0]
        return {"qkv": blk.attn.qkv.fp8_state.get_value(), "out": blk.attn.out.fp8_state.get_value(),
                "moe": blk.moe.fp8_state.get_value()}  # fmt: skip
    model, state = trained
    blk = model.blocks[0]
    return {"qkv": state.get(blk.attn.qkv.fp8_index), "out": state.get(blk.attn.out.fp8_index),
            "moe": state.get(blk.moe.fp8_index)}  # fmt: skip


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = np.asarray(v)
    return out


@pytest.mark.parametrize("framework", ["nnx", "eqx"])
def test_frontend_fp8_delayed_trains_and_updates_its_state(framework, tmp_path, capsys):
    import importlib

    script = importlib.import_module(f"train_moe_{framework}")
    out = tmp_path / framework
    summary, *trained = script.train(TINY + ["--fp8", "delayed", "--out", str(out)])

    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (out / "loss.png").stat().st_size > 1000
    assert summary["fp8"] == "delayed" and summary["end_step"] == STEPS and len(summary["losses"]) == STEPS
    assert all(math.isfinite(v) for v in summary["losses"]), summary["losses"]
    curve = summary["val_curve"]
    assert [s for s, _ in curve] == [0, 5, 10, 12] and all(math.isfinite(v) for _, v in curve), curve
    assert abs(curve[0][1] - math.log(256)) < 0.3, curve  # untrained: close to uniform over the 256 bytes
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary  # ~5.5 -> ~3.9
    assert curve[-1][1] < curve[0][1] - 1.0, curve
    stdout = capsys.readouterr().out
    assert "(state in " in stdout and stdout.count("validation loss") == 4 + 1, stdout  # + the closing line

    # The state moved: every amax history holds one amax per training step (validation adds none), newest first;
    # the scales left 1. attn/{qkv,out} and moe/{wi,wo}, each x, w, g (the expert kernels: one per expert).
    st = {f"{layer}/{k}": v for layer, tree in _fp8_states(framework, trained).items() for k, v in _flat(tree).items()}
    hist = [k for k in st if k.endswith("amax_history")]
    assert len(hist) == 12 and st["moe/wi/w/amax_history"].shape == (4, 1024), sorted(st)
    for k in hist:
        assert (st[k][..., :STEPS] > 0).all() and (st[k][..., STEPS:] == 0).all(), (k, st[k][..., : STEPS + 2])
        assert np.isfinite(st[k]).all(), k
    assert all((st[k.replace("amax_history", "scale")] != 1).any() for k in hist)


def test_frontends_build_the_linen_model():
    """The same parameters (train_moe.MoELM's init, loaded into the NNX and the Equinox model) give the same
    logits and aux loss: the three scripts train one architecture."""
    import equinox as eqx
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import train_moe
    import train_moe_eqx
    import train_moe_nnx
    from flax import nnx

    from te_layers import nnx as ten
    from tests.te_layers._adapters import load_eqx, load_nnx

    c = dict(d_model=32, layers=2, heads=4, kv_heads=2, experts=4, topk=2, ffn=32, aux_coeff=1e-2, dropout=0.0,
             dtype=jnp.dtype("float32"))  # fmt: skip
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    linen = train_moe.MoELM(dict(c, fp8="none"))
    params = nn.meta.unbox(jax.jit(linen.init)(jax.random.key(0), x))["params"]
    ref, st = jax.jit(lambda p, x: linen.apply({"params": p}, x, mutable=["intermediates"]))(params, x)
    ref_aux = train_moe.tel.collect_aux_loss(st["intermediates"])

    c["fp8"] = None
    m = train_moe_nnx.MoELM(c, rngs=nnx.Rngs(0))
    m.embed.embedding[...] = params["embed"]["embedding"]
    m.ln_f.scale[...] = params["ln_f"]["scale"]
    for i, block in enumerate(m.blocks):
        load_nnx(block, params[f"block{i}"])
    logits, sown = nnx.jit(lambda m, x: nnx.capture(m, ten.AuxLoss)(x))(m, x)
    np.testing.assert_allclose(logits, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ten.collect_aux_loss(sown), ref_aux, rtol=1e-6)

    e, state = eqx.nn.make_with_state(train_moe_eqx.MoELM)(c, key=jax.random.key(0))
    e = eqx.tree_at(lambda t: (t.embed, t.ln_f.scale), e, (params["embed"]["embedding"], params["ln_f"]["scale"]))
    for i in range(c["layers"]):
        e = eqx.tree_at(lambda t, i=i: t.blocks[i], e, load_eqx(e.blocks[i], params[f"block{i}"]))
    logits, aux, _ = eqx.filter_jit(lambda e, x, state: e(x, state))(e, x, state)
    np.testing.assert_allclose(logits, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(aux, ref_aux, rtol=1e-6)
