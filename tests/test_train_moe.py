"""examples/train_moe.py at tiny sizes (the loss falls; PNG and checkpoint appear) and
benchmarks/train_moe.py: the capacity-padded MoE of the strong baseline against a dense reference, the
FLOP count, the trace classifier of --profile on a hand-built trace, and a --tiny --profile run on CPU."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_moe_loss_falls(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "examples/train_moe.py", "--steps", "60", "--batch", "8", "--seq", "32", "--d-model", "32",
           "--layers", "1", "--heads", "4", "--kv-heads", "2", "--experts", "4", "--topk", "2", "--ffn", "32",
           "--lr", "1e-2", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary  # from ~5.5 (uniform over bytes)
    assert (out / "loss.png").stat().st_size > 1000
    assert summary["checkpoint"] and os.path.exists(summary["checkpoint"])
    assert "tokens/s" in proc.stdout


def _restore_tree(path):
    """An orbax tree (a checkpoint sub-directory) as ``{"a/b/c": numpy array}``."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(str(path))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): np.asarray(v) for p, v in flat}


def test_train_moe_fp8_delayed_resume_reproduces_the_run(tmp_path):
    """--fp8 delayed: a run resumed from its step-3 checkpoint gives the uninterrupted run's losses, and its final
    params, optimizer state and FP8 state, bit for bit (CPU); the FP8 state is the restored one, not a fresh one.
    ``--stop-at 3`` ends the same run after step 3 with that run's losses and step-3 state."""
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_moe

    tiny = ["--steps", "6", "--batch", "4", "--seq", "32", "--d-model", "32", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--experts", "4", "--topk", "2", "--ffn", "32", "--lr", "1e-2", "--eval-every", "100",
            "--eval-tokens", "128", "--fp8", "delayed"]  # fmt: skip
    full = train_moe.main(tiny + ["--save-every", "3", "--out", str(tmp_path / "full")])
    step3 = tmp_path / "full" / "checkpoints" / "step_3"
    assert sorted(os.listdir(step3)) == ["config.json", "fp8_state", "opt_state", "params"]
    resumed = train_moe.main(tiny + ["--resume", str(step3), "--out", str(tmp_path / "resumed")])
    assert resumed["start_step"] == 3 and len(full["losses"]) == 6
    assert resumed["losses"] == full["losses"][3:], (resumed["losses"], full["losses"])  # exact
    assert resumed["val_curve"][-1] == full["val_curve"][-1]
    for tree in ("params", "opt_state", "fp8_state"):
        a = _restore_tree(tmp_path / "full" / "checkpoint" / tree)
        b = _restore_tree(tmp_path / "resumed" / "checkpoint" / tree)
        assert a.keys() == b.keys() and a, tree
        bad = [k for k in a if not np.array_equal(a[k], b[k])]
        assert not bad, (tree, bad)

    # The state saved at step 3 is a real one (3 amaxes recorded per tensor, scales off 1) and the resumed run
    # continued it: after step 6 every history holds 6 amaxes. A state started fresh at step 3 would hold 3.
    st3, st6 = _restore_tree(step3 / "fp8_state"), _restore_tree(tmp_path / "resumed" / "checkpoint" / "fp8_state")
    hist = [k for k in st3 if k.endswith("amax_history")]
    # attn/{qkv,out} and moe/{wi,wo}, each x, w, g (the expert kernels' w: one history per expert)
    assert len(hist) == 12 and st3["block0/moe/wi/w/amax_history"].shape == (4, 1024), list(st3)
    for k in hist:
        assert (st3[k][..., :3] > 0).all() and (st3[k][..., 3:] == 0).all(), (k, st3[k][..., :5])
        assert (st6[k][..., :6] > 0).all() and (st6[k][..., 6:] == 0).all(), (k, st6[k][..., :8])
        np.testing.assert_array_equal(st6[k][..., 3:6], st3[k][..., :3], err_msg=k)  # step 3's, shifted by 3
    assert all((st3[k.replace("amax_history", "scale")] != 1).any() for k in hist)

    # --stop-at 3: the first 3 steps of the 6-step run (its schedule), validated and checkpointed at step 3; the
    # checkpoint is the full run's step-3 one, bit for bit
    stopped = train_moe.main(tiny + ["--stop-at", "3", "--out", str(tmp_path / "stopped")])
    assert stopped["losses"] == full["losses"][:3] and stopped["steps"] == 6 and stopped["end_step"] == 3
    assert stopped["val_curve"][-1][0] == 3 and full["end_step"] == 6
    ckpt = tmp_path / "stopped" / "checkpoint"
    assert json.loads((ckpt / "config.json").read_text())["step"] == 3
    for tree in ("params", "opt_state", "fp8_state"):
        a, b = _restore_tree(step3 / tree), _restore_tree(ckpt / tree)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), tree


# ------------------------------------------------------------------------------------------------
# benchmarks/train_moe.py: the strong plain-JAX baseline, the FLOP count, the profile classifier
# ------------------------------------------------------------------------------------------------

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _moe_inputs(t=24, d=16, e=4, f=8, seed=0):
    import jax

    ks = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(ks[0], (t, d))
    router = jax.random.normal(ks[1], (d, e))
    wi = jax.random.normal(ks[2], (e, d, 2 * f)) * 0.3
    wo = jax.random.normal(ks[3], (e, f, d)) * 0.3
    return h, router, wi, wo


def _dense_moe_reference(h, router, wi, wo, topk, keep=None):
    """Every expert on every token (dense per-expert FFN), then the router-weighted sum of each token's
    top-k experts; ``keep [T, k]`` (optional) zeroes the dropped (token, choice) pairs."""
    import _moe_baselines as mb
    import jax
    import jax.numpy as jnp

    f = wo.shape[1]
    w, idx, aux = mb.route(h, router, topk, 0.01)
    z = jnp.einsum("td,edf->tef", h, wi)
    y = jnp.einsum("tef,efd->ted", jax.nn.silu(z[..., :f]) * z[..., f:], wo)
    sel = jnp.take_along_axis(y, idx[:, :, None], 1)
    if keep is not None:
        w = w * keep
    return (w[:, :, None] * sel).sum(1), aux


def test_capacity_moe_equals_dense_reference_without_drops():
    import _moe_baselines as mb
    import jax
    import numpy as np

    h, router, wi, wo = _moe_inputs()
    topk, e = 2, wi.shape[0]
    cf = e / topk  # capacity = T: no expert can overflow

    def ours(*a):
        out, aux, dropped = mb.capacity_moe(*a, topk=topk, capacity_factor=cf, aux_coeff=0.01)
        return out, aux, dropped

    out, aux, dropped = jax.jit(ours)(h, router, wi, wo)
    ref, ref_aux = jax.jit(lambda *a: _dense_moe_reference(*a, topk))(h, router, wi, wo)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux, ref_aux, rtol=1e-6)
    assert float(dropped) == 0.0

    # Gradients through the custom-VJP gathers (dispatch, combine) and the router weights.
    def loss(fn):
        return lambda *a: (fn(*a)[0] ** 2).sum() + fn(*a)[1]

    g_ours = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(h, router, wi, wo)
    g_ref = jax.jit(jax.grad(loss(lambda *a: _dense_moe_reference(*a, topk)), argnums=(0, 1, 2, 3)))(h, router, wi, wo)
    for name, a, b in zip(("h", "router", "wi", "wo"), g_ours, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()), err_msg=name)


def test_capacity_moe_drops_pairs_past_capacity_first_choices_first():
    import _moe_baselines as mb
    import jax
    import numpy as np

    h, router, wi, wo = _moe_inputs(t=40, seed=1)
    topk, e, t = 2, wi.shape[0], h.shape[0]
    cf = 0.6
    cap = mb.capacity(cf, t, topk, e)
    idx = np.asarray(jax.jit(lambda h, r: mb.route(h, r, topk, 0.0)[1])(h, router))
    # GShard priority: all first choices (tokens in order), then all second choices; first cap per expert kept.
    keep = np.zeros((t, topk), np.float32)
    used = np.zeros(e, int)
    for j in range(topk):
        for i in range(t):
            if used[idx[i, j]] < cap:
                keep[i, j] = 1.0
                used[idx[i, j]] += 1
    assert 0 < keep.sum() < t * topk  # the case drops some pairs and keeps others
    out, _, dropped = jax.jit(lambda *a: mb.capacity_moe(*a, topk=topk, capacity_factor=cf))(h, router, wi, wo)
    ref, _ = jax.jit(lambda *a: _dense_moe_reference(*a, topk, keep=keep))(h, router, wi, wo)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(dropped), 1 - keep.sum() / (t * topk), rtol=1e-6)


def test_train_flops_formula_and_peak_table():
    import _moe_baselines as mb

    cfg = dict(d_model=1024, layers=4, heads=16, kv_heads=4, experts=16, topk=2, ffn=2048)
    fl = mb.train_flops_per_token(cfg, seq=1024)
    per_layer = 1024 * (16 + 8) * 64 + 1024 * 1024 + 1024 * 16 + 2 * 3 * 1024 * 2048
    assert fl["active_params"] == 4 * per_layer + 1024 * 256
    assert fl["total"] == 6 * fl["active_params"] + 12 * 4 * 1024 * 1024
    assert mb.peak_tflops("NVIDIA H200") == 989.0 and mb.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert mb.peak_tflops("cpu") is None
    assert mb.capacity(1.25, 16384, 2, 16) == 2560 and mb.capacity(1.0, 16384, 2, 16) == 2048


def _trace_fixture():
    """A Chrome trace-event dict shaped like jax.profiler's GPU trace: 2 steps of hand-placed kernels."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8"}},
        {"ph": "M", "pid": 1, "tid": 90, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
    ]
    kernels = [  # (name, scope, category, duration us), run back to back on stream 7 with 1 us gaps
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_execute_kernel__5x_cublas", "", "GEMM", 10),
        ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_TNT", "jit(step)/MoELM/block0/qkv/dot_general", "GEMM", 6),
        ("gemm_fusion_dot_42", "", "GEMM", 2),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64", "", "attention", 8),
        ("loop_exponential_fusion", "jit(step)/jvp(MoELM)/block0/sdpa/exp", "attention", 3),
        ("grouped_gemm_kernel", "", "grouped GEMM", 12),
        ("grouped_wgrad_kernel", "", "grouped GEMM", 9),
        ("grouped_block_scaled_gemm_split_kernel", "", "grouped GEMM", 7),
        ("block_scaled_gemm_kernel", "", "GEMM", 3),
        ("dual_quantize_kernel", "", "fp8 quantize", 2),
        ("tensor_cast_kernel", "", "fp8 quantize", 1),
        ("dispatch_kernel", "", "permutation", 2),
        ("combine_bwd_kernel", "", "permutation", 2),
        ("loop_gather_fusion", "jit(step)/transpose(jvp(MoELM))/block0/dispatch/gather", "permutation", 2),
        ("DeviceRadixSortOnesweepKernel", "", "permutation", 1),
        ("void te::router::RowForwardKernel<__nv_bfloat16, 1, 4>(te::router::RowParams)", "", "router", 1),
        ("input_reduce_fusion_3", "jit(step)/jvp(MoELM)/block0/router/reduce_max", "router", 1),
        ("loop_multiply_fusion", "jit(step)/transpose(jvp(MoELM))/block0/ln1/mul", "norms", 2),
        ("norm_fwd_kernel", "", "norms", 1),
        ("input_reduce_fusion", "jit(step)/jvp(MoELM)/ln_f/reduce_sum", "norms", 1),
        ("loop_add_fusion_12", "jit(step)/add", "optimizer/elementwise", 4),
        ("void te::dense::act::ActForwardKernel<float>(Params)", "", "optimizer/elementwise", 1),
        ("Memset", "", "other", 1),
    ]
    evs, t = [], 0.0
    for _ in range(2):
        for name, scope, _, dur in kernels:
            args = {"hlo_op": "fusion.1", "tf_op": scope} if scope else {}
            evs.append({"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": dur, "name": name, "args": args})
            t += dur + 1.0
        t += 20.0  # host gap between steps
    # A kernel overlapping on another stream (counts in its category, not twice in idle), and
    # events that are not kernels: the XLA Ops summary line and the host.
    evs.append({"ph": "X", "pid": 1, "tid": 8, "ts": 0.0, "dur": 5.0, "name": "loop_convert_fusion", "args": {}})
    evs.append({"ph": "X", "pid": 1, "tid": 90, "ts": 0.0, "dur": 50.0, "name": "fusion.1", "args": {}})
    evs.append({"ph": "X", "pid": 2, "tid": 1, "ts": 0.0, "dur": 500.0, "name": "PjitFunction(step)", "args": {}})
    return {"displayTimeUnit": "ns", "traceEvents": meta + evs}, kernels


def test_profile_classifier_on_hand_built_trace(tmp_path):
    import gzip
    import json

    import _profile

    assert {"grouped_gemm_kernel", "grouped_wgrad_kernel"} <= _profile.GROUPED_GEMM_KERNELS
    assert {"dispatch_kernel", "combine_kernel", "combine_bwd_kernel"} <= _profile.PERMUTATION_KERNELS
    assert "norm_fwd_kernel" in _profile.NORM_KERNELS
    quantizers = ["dual_quantize_kernel", "dual_quantize_tma_kernel", "ffn_act_dual_quantize_kernel"]
    for k in [*quantizers, "ffn_dact_dual_quantize_kernel", "requantize_t_kernel"]:
        assert _profile.classify_kernel(k) == "fp8 quantize", k  # every te_ops.fp8 quantize kernel, Gluon ones too
    trace, kernels = _trace_fixture()
    for name, scope, cat, _ in kernels:
        assert _profile.classify_kernel(name, scope) == cat, (name, scope)
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump(trace, f)
    events = _profile.trace_dir_events(str(tmp_path))
    assert len(events) == 2 * len(kernels) + 1  # stream kernels only
    r = _profile.breakdown(events, steps=2)
    expect = {c: sum(dur for _, _, cat, dur in kernels if cat == c) / 1e3 for c in _profile.CATEGORIES}
    expect["optimizer/elementwise"] += 5.0 / 2 / 1e3  # the overlapping convert fusion, once in two steps
    for c in _profile.CATEGORIES:
        assert abs(r["categories"][c] - expect[c]) < 1e-9, c
    busy = sum(dur for *_, dur in kernels) / 1e3  # per step; the overlap adds nothing to the union
    span = (2 * sum(dur + 1.0 for *_, dur in kernels) + 20.0 - 1.0) / 2 / 1e3
    assert abs(r["busy_ms"] - busy) < 1e-9 and abs(r["span_ms"] - span) < 1e-9
    assert abs(r["idle_ms"] - (span - busy)) < 1e-9
    assert r["top"]["grouped GEMM"][0]["kernel"] == "grouped_gemm_kernel"
    assert _profile.breakdown([], steps=3)["kernels"] == 0


def test_benchmark_tiny_profile_runs_on_cpu(tmp_path):
    cmd = [sys.executable, "benchmarks/train_moe.py", "--tiny", "--profile", "--models",
           "te_layers,strong_cf1.25,ragged_dot", "--rounds", "1", "--steps", "1", "--warmup", "0",
           "--profile-steps", "1"]  # fmt: skip
    env = dict(os.environ, TE_BENCH_OUT=str(tmp_path))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "no GPU kernels in the trace" in proc.stdout
    d = json.loads((tmp_path / "train_moe_profile.json").read_text())
    models = {m["name"]: m for m in d["models"]}
    assert set(models) == {"te_layers", "strong_cf1.25", "ragged_dot"}
    for m in models.values():
        assert m["error"] is None and m["tokens_per_s"] > 0 and m["final_loss"] > 0 and m["mfu"] is None
    assert models["strong_cf1.25"]["attention"] == "xla" and 0 <= models["strong_cf1.25"]["dropped_fraction"] < 1
    assert d["rows"][0]["baseline"] == "strong_cf1.25" and d["rows"][0]["speedup"] > 0
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import perf_table

    rows = list(perf_table.READERS["train_moe"](d))
    assert len(rows) == 2 and rows[0].alternative_ms == models["strong_cf1.25"]["ms_per_step"]


def test_model_variant_contexts_set_their_switches_and_kernels():
    """The benchmark's model variants trace under the switch / kernel configuration their name says
    (read back inside the context), and leave the defaults as they were after it."""
    import importlib.util

    from te_layers import _common as C
    from te_ops.grouped_dense import triton as tri

    spec = importlib.util.spec_from_file_location("bench_train_moe", os.path.join(ROOT, "benchmarks", "train_moe.py"))
    tm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tm)  # (not "import train_moe": examples/train_moe.py has that name)
    prev = C.BF16_FUSED_FFN
    names = ["te_layers", "te_layers_fused_ffn", "te_layers_fused_ffn_gluon", "te_layers_ws"]
    built = tm.build_models(tm.TINY_CONFIG, names)
    seen = {}
    for name, (_, _, extra) in built.items():
        ctx = tm._context(extra)
        if ctx is None:
            seen[name] = (C.BF16_FUSED_FFN, tri.ffn_configs(), tri.current_override())
            continue
        with ctx():
            seen[name] = (C.BF16_FUSED_FFN, tri.ffn_configs(), tri.current_override())
    default_ffn = (tri.DEFAULT_FFN_ACT, tri.DEFAULT_FFN_DACT)
    assert seen["te_layers"] == (prev, default_ffn, None)
    assert seen["te_layers_fused_ffn"][:2] == (True, default_ffn)
    ws = tri.GemmConfig(BN=128, GLUON_WS=True)
    assert seen["te_layers_fused_ffn_gluon"][:2] == (True, (ws, ws))
    assert seen["te_layers_ws"][2][:2] == (tri.GemmConfig(GLUON_WS=True),) * 2
    assert C.BF16_FUSED_FFN is prev and tri.current_override() is None
