"""End-to-end benchmark: training speed of the te_layers MoE language model (examples/train_moe.py)
against the same architecture in plain JAX, all in one process on the same batches.

Models (same config, same optimizer ``train_moe.make_optimizer``, same data batches in the same order):

* ``te_layers``: examples/train_moe.py ``MoELM`` (te_ops attention, router, token dispatch/combine,
  grouped GEMM experts).
* ``strong_cf<f>``: the strongest plain-JAX formulation we know (benchmarks/_moe_baselines.py
  ``StrongBlock``): cuDNN attention via ``jax.nn.dot_product_attention(implementation="cudnn")`` and
  GShard-style capacity-padded experts (batched einsums, index-gather dispatch/combine), for each
  capacity factor in ``--capacity-factors`` (default 1.25 and 1.0; pairs past capacity are dropped).
* ``ragged_dot``: ``_moe_baselines.RaggedDotBlock`` (XLA attention, argsort dispatch,
  ``jax.lax.ragged_dot`` experts, scatter-add combine).

Each model compiles and runs ``--warmup`` steps, then ``--rounds`` rounds of ``--steps`` back-to-back
steps each (block_until_ready at the end of a round, one untimed step before it), the model order
reversed every other round so clock drift falls on all alike. Reported per model: median ms/step,
tokens/s, model TFLOP/s (``_moe_baselines.train_flops_per_token``), MFU against the device's dense
bf16 peak, the mean loss of the last round (the same batches for every model) and, for the
capacity baselines, the fraction of (token, expert) pairs dropped; then te_layers' speedup over each.

    python benchmarks/train_moe.py                 # d1024 L4 16/4 heads E16 top-2 ffn2048 bf16, 16 x 1024 tokens
    python benchmarks/train_moe.py --batch 64      # 64 x 1024 tokens per step
    python benchmarks/train_moe.py --profile       # also: GPU time per step by kernel category, per model
    python benchmarks/train_moe.py --tiny          # CPU smoke test of this script

Writes results/<device>/train_moe.json (``--profile``: train_moe_profile.json, with the breakdowns;
command buffers are off in that process so the trace lists every kernel).
"""

from __future__ import annotations

import os
import sys

if "--profile" in sys.argv[1:] and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import _moe_baselines as mb  # noqa: E402
import _profile  # noqa: E402
import _timing  # noqa: E402
import train_moe as ex  # noqa: E402

# A small Mixtral-like decoder: 4 layers, d_model 1024, 16 query / 4 KV heads (head dim 64),
# 16 experts top-2 with FFN 2048 (gated SiLU), bf16.
GPU_CONFIG = dict(d_model=1024, layers=4, heads=16, kv_heads=4, experts=16, topk=2, ffn=2048, dtype="bfloat16")
TINY_CONFIG = dict(d_model=32, layers=1, heads=4, kv_heads=2, experts=4, topk=2, ffn=32, dtype="float32")
RAGGED_LABEL = "plain Flax + jnp (XLA attention, argsort dispatch, ragged_dot)"


def strong_name(cf: float) -> str:
    return f"strong_cf{float(cf)}"


def build_models(cfg: dict, names: list[str]) -> dict[str, tuple]:
    """``{name: (flax module, label, extra JSON fields)}`` for the requested model names."""
    out = {}
    for name in names:
        if name == "te_layers":
            out[name] = (ex.MoELM(dict(cfg, norm="te")), "te_layers (te_ops fused ops)", {})
        elif name in GROUPED_GEMM_VARIANTS:  # te_layers with another grouped GEMM kernel configuration
            out[name] = (ex.MoELM(dict(cfg, norm="te")), f"te_layers, {GROUPED_GEMM_VARIANTS[name]} grouped GEMM",
                         {"grouped_gemm": name.removeprefix("te_layers_")})  # fmt: skip
        elif name in ("te_layers_fp8_block_fused", "te_layers_fp8_block_experts", "te_layers_fp8_block_experts_fused"):
            # FP8 block scaling with the experts as one op (te_ops.fp8.fp8_dispatch_ffn) and / or the
            # attention projections kept in bf16 (FP8 where K is small may not pay)
            fused, experts_only = name.endswith("_fused"), "_experts" in name
            label = "te_layers, FP8 block scaling" + (" (experts only)" if experts_only else "")
            label += ", fused expert FFN (activation fused into the quantizations)" if fused else ""
            mcfg = dict(cfg, norm="te", fp8="block", fp8_attention=not experts_only)
            out[name] = (ex.MoELM(mcfg), label, {"fp8": "block", "fused_ffn": fused, "fp8_attention": not experts_only})
        elif name.startswith("te_layers_fp8_"):  # te_layers with FP8 projections and experts (stateless recipes)
            recipe = name.removeprefix("te_layers_fp8_")
            if recipe not in ("current", "block"):
                raise SystemExit(f"train_moe benchmark: {name!r}: the FP8 models are te_layers_fp8_current "
                                 "and te_layers_fp8_block (delayed scaling's state is not threaded here)")  # fmt: skip
            out[name] = (ex.MoELM(dict(cfg, norm="te", fp8=recipe)), f"te_layers, FP8 {recipe} scaling "
                         "(attention projections and experts)", {"fp8": recipe})  # fmt: skip
        elif name == "te_layers_master":  # float32 master expert kernels (te_layers._common.BF16_MASTER_KERNELS)
            out[name] = (ex.MoELM(dict(cfg, norm="te")), "te_layers, float32 master expert kernels (float32 expert "
                         "gradients)", {"master_kernels": True})  # fmt: skip
        elif name in ("te_layers_fused_ffn", "te_layers_fused_ffn_gluon"):
            # the bf16 experts as one op (te_layers._common.BF16_FUSED_FFN); _gluon: its act and dact GEMMs
            # as the Gluon warp-specialized kernels (te_ops.grouped_dense.gluon_ffn_kernels)
            gluon = name.endswith("_gluon")
            label = "te_layers, fused expert FFN (activation in the grouped GEMM epilogues"
            label += ", Gluon warp-specialized kernels)" if gluon else ")"
            out[name] = (ex.MoELM(dict(cfg, norm="te")), label,
                         {"bf16_fused_ffn": True, **({"ffn_kernel": "gluon"} if gluon else {})})  # fmt: skip
        elif name == "te_layers_flax_norm":  # the same with flax.linen.RMSNorm: what the fused norms bring
            out[name] = (ex.MoELM(dict(cfg, norm="flax")), "te_layers with flax RMSNorm", {})
        elif name == "ragged_dot":
            out[name] = (ex.MoELM(dict(cfg, norm="flax"), block=mb.RaggedDotBlock), RAGGED_LABEL, {"attention": "xla"})
        elif name.startswith("strong_cf"):
            cf = float(name[len("strong_cf") :])
            impl = mb.attention_implementation(cfg["dtype"]) or "xla"
            label = f"plain JAX: {'cuDNN' if impl == 'cudnn' else 'XLA'} attention + capacity-padded einsum experts "
            label += f"(GShard), capacity factor {cf}"
            out[name] = (ex.MoELM(dict(cfg, capacity_factor=cf, norm="flax"), block=mb.StrongBlock), label,
                         {"attention": impl, "capacity_factor": cf})  # fmt: skip
        else:
            raise SystemExit(f"train_moe benchmark: unknown model {name!r} in --models; known: te_layers, "
                             "te_layers_flax_norm, te_layers_ws, te_layers_pp, te_layers_tma, te_layers_fp8_current, "
                             "te_layers_fp8_block, te_layers_fp8_block_fused, te_layers_fp8_block_experts, "
                             "te_layers_fp8_block_experts_fused, te_layers_master, te_layers_fused_ffn, "
                             "te_layers_fused_ffn_gluon, ragged_dot, "
                             "strong_cf<factor>")  # fmt: skip
    return out


# te_layers model variants that trace with another grouped GEMM configuration (te_ops.grouped_dense.
# triton.config_override): name -> label. All build TMA descriptors on the device (graph-safe scratch).
GROUPED_GEMM_VARIANTS = {
    "te_layers_ws": "Gluon warp-specialized",
    "te_layers_pp": "Gluon ping-pong",
    "te_layers_tma": "Triton TMA (forward, dx and dkernels)",
}


# te_layers._common switches a model variant turns on while its step traces (read at trace time):
# its extra JSON field -> the switch
SWITCHES = {
    "fused_ffn": "FP8_FUSED_FFN",  # FP8 block-scaled experts as one op (te_ops.fp8.fp8_dispatch_ffn)
    "master_kernels": "BF16_MASTER_KERNELS",  # bf16 experts take float32 master kernels
    "bf16_fused_ffn": "BF16_FUSED_FFN",  # bf16 experts as one op (te_ops.grouped_ffn)
}


def _switch(flag: str):
    """A context manager that sets ``te_layers._common.<flag>`` to True while the step traces."""

    @contextlib.contextmanager
    def on():
        from te_layers import _common as C

        prev = getattr(C, flag)
        setattr(C, flag, True)
        try:
            yield
        finally:
            setattr(C, flag, prev)

    return on


def _context(extra: dict):
    """The trace-time setting a model variant needs (a switch of SWITCHES, ``extra["grouped_gemm"]``
    or ``extra["ffn_kernel"]``), else None."""
    for field, flag in SWITCHES.items():
        if extra.get(field):
            if extra.get("ffn_kernel") == "gluon":
                from te_ops.grouped_dense import triton as tri

                ws = tri.GemmConfig(BN=128, GLUON_WS=True)
                return lambda: _both(_switch(flag)(), tri.config_override(ffn_act=ws, ffn_dact=ws))
            return _switch(flag)
    kind = extra.get("grouped_gemm")
    if kind is None:
        return None
    from te_ops.grouped_dense import triton as tri

    if kind == "ws":
        cfgs = (tri.GemmConfig(GLUON_WS=True),) * 2 + (None,)
    elif kind == "pp":
        cfgs = (tri.GemmConfig(BN=128, num_stages=4, GLUON_WS=True, PINGPONG=True),) * 2 + (None,)
    else:
        cfgs = (tri.GemmConfig(USE_TMA=True),) * 2 + (tri.WgradConfig(USE_TMA=True),)
    return lambda: tri.config_override(*cfgs)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


class Runner:
    """One model's training state and jitted step; every runner walks the same batch list in order."""

    def __init__(self, model, batches, keys, tx, seed: int, context=None):
        self.model, self.batches, self.keys = model, batches, keys
        self.context = context or contextlib.nullcontext  # trace-time settings (kernel configs)
        self.params = jax.jit(model.init)(jax.random.key(seed), batches[0][0])["params"]
        self.opt_state = tx.init(self.params)
        self.step = ex.make_train_step(model, tx, donate=jax.default_backend() != "cpu")  # CPU cannot donate
        self.i = 0
        self.ces: list[jax.Array] = []

    def run(self, n: int):
        """``n`` steps, not synchronised; returns the last loss (ready once every step is done)."""
        ce = None
        for _ in range(n):
            x, y = self.batches[self.i % len(self.batches)]
            with self.context():
                self.params, self.opt_state, ce, _ = self.step(self.params, self.opt_state, x, y,
                                                               self.keys[self.i % len(self.keys)])  # fmt: skip
            self.ces.append(ce)
            self.i += 1
        return ce

    def timed(self, n: int) -> float:
        """ms per step of ``n`` back-to-back steps."""
        t0 = time.perf_counter()
        jax.block_until_ready((self.run(n), self.params))
        return (time.perf_counter() - t0) * 1e3 / n

    def dropped_fraction(self) -> float | None:
        """Mean sown ``dropped_fraction`` over the layers on the first batch (capacity models), else None."""
        fwd = jax.jit(lambda p, x: self.model.apply({"params": p}, x, mutable=["intermediates"])[1])
        inter = fwd(self.params, self.batches[0][0])
        vals = [v for path, v in jax.tree_util.tree_leaves_with_path(inter)
                if any(getattr(k, "key", None) == "dropped_fraction" for k in path)]  # fmt: skip
        return float(np.mean([float(v) for v in vals])) if vals else None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, float32, 4 x 32 tokens")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; --tiny: 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; --tiny: 32)")
    ap.add_argument(
        "--models",
        default=None,
        help="comma-separated subset of te_layers, strong_cf<f> (one per --capacity-factors), ragged_dot; "
        "also te_layers_flax_norm (te_layers with flax.linen.RMSNorm) and te_layers_ws (the Gluon "
        "warp-specialized grouped GEMM), te_layers_fp8_current / te_layers_fp8_block (FP8 attention "
        "projections and experts), not in the default set",
    )
    ap.add_argument("--capacity-factors", default="1.25,1.0")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per model after the compile step")
    ap.add_argument("--rounds", type=int, default=6, help="timing rounds (model order reversed every other round)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per model per round")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after timing, trace --profile-steps steps of each model and print GPU time per step by "
        "kernel category (writes train_moe_profile.json instead of train_moe.json)",
    )
    ap.add_argument("--profile-steps", type=int, default=3)
    args = ap.parse_args(argv)
    for name in ("warmup", "rounds", "steps", "profile_steps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}, got {getattr(args, name)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    base = TINY_CONFIG if args.tiny else GPU_CONFIG
    batch = args.batch or (4 if args.tiny else 16)
    seq = args.seq or (32 if args.tiny else 1024)
    cfg = dict(base, aux_coeff=1e-2, dropout=0.0, dtype=jnp.dtype(base["dtype"]))
    cfs = [float(c) for c in args.capacity_factors.split(",") if c.strip()]
    names = args.models.split(",") if args.models else ["te_layers", *map(strong_name, cfs), "ragged_dot"]
    models = build_models(cfg, names)

    train = ex.load_data(None, seq)[0]
    it = ex.batches(train, batch, seq, args.seed + 1)
    batches = [tuple(jax.device_put(a) for a in next(it)) for _ in range(16)]
    keys = [jax.random.key(i) for i in range(16)]
    total_steps = 1 + args.warmup + args.rounds * (args.steps + 1) + (args.profile_steps if args.profile else 0)
    tx = ex.make_optimizer(args.lr, total_steps, 30)
    tokens = batch * seq
    flops = mb.train_flops_per_token(cfg, seq)
    kind = jax.devices()[0].device_kind
    peak = mb.peak_tflops(kind)
    print(f"train_moe benchmark on {kind} ({jax.default_backend()}): {batch} x {seq} tokens per step, "
          f"{flops['total'] * tokens / 1e12:.3f} model TFLOP per step; peak {peak} TFLOP/s")  # fmt: skip

    runners, records = {}, {}
    for name, (model, label, extra) in models.items():
        rec = records[name] = {"name": name, "label": label, **extra, "error": None}
        try:
            t0 = time.perf_counter()
            r = Runner(model, batches, keys, tx, args.seed, context=_context(extra))
            jax.block_until_ready(r.run(1))
            rec["compile_s"] = time.perf_counter() - t0
            jax.block_until_ready(r.run(args.warmup))
            runners[name] = r
            print(f"  {name}: compiled and warmed up in {time.perf_counter() - t0:.1f}s")
        except Exception as e:  # one failing model (OOM, an unsupported cuDNN config) must not hide the others
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"  {name}: FAILED {rec['error']}")

    samples: dict[str, list[float]] = {n: [] for n in runners}
    for rnd in range(args.rounds):
        for name in list(runners) if rnd % 2 == 0 else reversed(list(runners)):
            jax.block_until_ready(runners[name].run(1))  # untimed: the switch from the other model
            samples[name].append(runners[name].timed(args.steps))

    for name, r in runners.items():
        rec = records[name]
        ms = statistics.median(samples[name])
        tflops = flops["total"] * tokens / (ms / 1e3) / 1e12
        last = r.ces[-args.steps :]
        rec.update(ms_per_step=ms, tokens_per_s=tokens / (ms / 1e3), model_tflops=tflops,
                   mfu=tflops / peak if peak else None, final_loss=float(np.mean([float(c) for c in last])),
                   round_ms=samples[name], steps_done=r.i)  # fmt: skip
        if "capacity_factor" in rec:
            rec["capacity"] = mb.capacity(rec["capacity_factor"], tokens, cfg["topk"], cfg["experts"])
            rec["dropped_fraction"] = r.dropped_fraction()

    ours = records.get("te_layers", {}).get("ms_per_step")
    rows = []
    for name, rec in records.items():
        if name == "te_layers":
            continue
        alt = rec.get("ms_per_step")
        rows.append(
            {
                "baseline": name,
                "alternative": rec["label"],
                "ours_ms": ours,
                "alternative_ms": alt,
                "speedup": alt / ours if alt and ours else None,
                "headline": name.startswith("strong_cf"),
            }
        )
    _print_results(records, rows, batch, seq)

    payload = {
        "config": {k: (jnp.dtype(v).name if k == "dtype" else v) for k, v in cfg.items()},
        "batch": batch, "seq": seq, "tokens_per_step": tokens,
        "flops": {"per_token": flops, "per_step": flops["total"] * tokens,
                  "formula": "6 * active params + 12 * layers * seq * heads * head_dim per token "
                             "(_moe_baselines.train_flops_per_token)"},
        "peak_tflops": peak,
        "timing": {"warmup_steps": 1 + args.warmup, "rounds": args.rounds, "steps_per_round": args.steps,
                   "order": "model order reversed every other round, one untimed step before each round",
                   "statistic": "median over rounds of ms per step"},
        "models": list(records.values()),
        "rows": rows,
    }  # fmt: skip
    name = "train_moe" if batch == 16 or args.tiny else f"train_moe_b{batch}"  # one file per batch size
    if args.profile:
        name = "train_moe_profile"
        payload["profiles"] = {}
        for n, r in runners.items():
            # Block on the params too: the last step's optimizer update runs after its loss is ready.
            events = _profile.trace_kernels(lambda r=r: (r.run(args.profile_steps), r.params), args.profile_steps)
            bd = payload["profiles"][n] = _profile.breakdown(events, args.profile_steps)
            _profile.print_breakdown(f"{n} (timed {records[n]['ms_per_step']:.3f} ms/step untraced)", bd)
    _timing.write_json(name, payload, out_dir=os.environ.get("TE_BENCH_OUT") or ("/tmp" if args.tiny else None))
    return payload


def _print_results(records, rows, batch, seq):
    print(f"\nMoE LM training, {batch} x {seq} tokens per step, median over rounds:")
    print(f"  {'model':<16}{'ms/step':>10}{'tokens/s':>14}{'TFLOP/s':>10}{'MFU':>8}{'loss':>9}{'dropped':>9}")
    for name, rec in records.items():
        if rec.get("error"):
            print(f"  {name:<16}FAILED: {rec['error'][:100]}")
            continue
        mfu = "-" if rec["mfu"] is None else f"{100 * rec['mfu']:.1f}%"
        drop = "-" if rec.get("dropped_fraction") is None else f"{100 * rec['dropped_fraction']:.2f}%"
        print(f"  {name:<16}{rec['ms_per_step']:>10.3f}{rec['tokens_per_s']:>14,.0f}{rec['model_tflops']:>10.1f}"
              f"{mfu:>8}{rec['final_loss']:>9.4f}{drop:>9}")  # fmt: skip
    for row in rows:
        sp = "-" if row["speedup"] is None else f"{row['speedup']:.3f}x"
        print(f"  te_layers / {row['baseline']:<14} {sp}   ({row['alternative']})")


if __name__ == "__main__":
    main()
