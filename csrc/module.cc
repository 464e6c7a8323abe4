// te_ops._native: exposes the FFI handlers (as capsules per execution stage), the handler
// counters, and a few introspection helpers to Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include <cuda_runtime.h>

#include "common/runtime.h"
#include "common/targets.h"
#ifdef TE_WITH_SOFTMAX
#include "softmax/softmax.h"
#endif
#ifdef TE_WITH_DENSE
#include <nanobind/stl/vector.h>

#include "dense/dense.h"
#include "dense/dense_gemm.h"
#endif

namespace nb = nanobind;

namespace {

nb::dict Registrations() {
  nb::dict out;
  for (const te::Target& t : te::AllTargets()) {
    nb::dict stages;
    if (t.initialize) stages["initialize"] = nb::capsule(reinterpret_cast<void*>(t.initialize));
    stages["execute"] = nb::capsule(reinterpret_cast<void*>(t.execute));
    out[t.name.c_str()] = stages;
  }
  return out;
}

#ifdef TE_WITH_SOFTMAX
nb::dict SoftmaxConfig(int dtype, int64_t rows, int64_t cols, int mode, float scale) {
  te::softmax::Params p;
  p.scale = scale;
  p.dtype = static_cast<te::softmax::DType>(dtype);
  p.rows = rows;
  p.cols = cols;
  p.mode = static_cast<te::softmax::MaskMode>(mode);
  const auto c = te::softmax::ChooseConfig(p);
  nb::dict d;
  d["vec"] = c.vec;
  d["vectors_per_thread"] = c.vectors_per_thread;
  d["threads_per_row"] = c.threads_per_row;
  d["block"] = c.block;
  d["grid"] = c.grid;
  static const char* kNames[] = {"v2", "warp-row", "warp-row-packed"};
  d["kernel"] = kNames[static_cast<int>(c.kernel)];  // forward kernel (the backward is always v2)
  return d;
}
#endif

#ifdef TE_WITH_DENSE
nb::list DensePlans() {
  nb::list out;
  for (const auto& p : te::dense::PlanSnapshot()) {
    nb::dict d;
    d["device"] = p.device;
    d["describe"] = p.describe;
    d["m"] = p.m;
    d["n"] = p.n;
    d["k"] = p.k;
    d["trans_a"] = p.trans_a;
    d["trans_b"] = p.trans_b;
    d["epilogue"] = p.epilogue;
    d["candidates"] = p.candidates;
    d["own_candidates"] = p.own_candidates;
    d["forced"] = p.forced;
    d["chosen"] = p.chosen;
    d["best_ms"] = p.best_ms;
    d["candidate_ms"] = p.candidate_ms;
    nb::dict a;
    a["id"] = p.algo.id;
    a["tile"] = p.algo.tile;
    a["stages"] = p.algo.stages;
    a["split_k"] = p.algo.split_k;
    a["reduction_scheme"] = p.algo.reduction_scheme;
    a["swizzle"] = p.algo.swizzle;
    a["custom"] = p.algo.custom;
    a["cluster_shape"] = p.algo.cluster_shape;
    d["algo"] = a;
    out.append(d);
  }
  return out;
}
#endif

nb::dict BuildInfo() {
  nb::dict d;
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  d["cuda_runtime_version"] = rt;
  d["jaxlib_headers_version"] = TE_JAXLIB_HEADERS_VERSION;
  d["enabled_ops"] = TE_OPS_ENABLED;
#ifdef TE_OPS_CUDA_ARCHITECTURES
  d["cuda_architectures"] = TE_OPS_CUDA_ARCHITECTURES;
#endif
  return d;
}

}  // namespace

NB_MODULE(TE_MODULE_NAME, m) {
  m.doc() = "te_ops native CUDA/XLA-FFI handlers";
  m.def("registrations", &Registrations,
        "{target name: {stage name: PyCapsule}} for jax.ffi.register_ffi_target(..., platform='CUDA').");
  m.def("counters", &te::CountersSnapshot,
        "Per-handler counters: initialize_calls, warmups, executes, captured_executes.");
  m.def("reset_counters", &te::ResetCounters);
#ifdef TE_WITH_SOFTMAX
  m.def("softmax_set_tuning", &te::softmax::SetTuning, nb::arg("threads_per_row"), nb::arg("vectors_per_thread"),
        "Benchmark hook: force the softmax register-kernel shape (0, 0 = heuristic).");
  m.def("softmax_config", &SoftmaxConfig, nb::arg("dtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("mode"), nb::arg("scale") = 1.0f,
        "Launch configuration the softmax kernels choose (dtype 0=f32 1=bf16 2=f16; mode 0 none 1 mask 2 causal).");
#endif
#ifdef TE_WITH_DENSE
  m.def(
      "dense_set_backward_variant",
      [](int i) {
        if (!te::dense::SetBackwardVariant(i)) {
          throw nb::value_error(("variant must be in [0, " + std::to_string(te::dense::NumBackwardVariants()) +
                                 "), got " + std::to_string(i))
                                    .c_str());
        }
      },
      nb::arg("variant"), "Benchmark hook: the block shape of dense's backward dz/dbias kernel (process-wide).");
  m.def(
      "dense_backward_variants",
      [] {
        nb::dict d;
        nb::list shapes;
        for (int i = 0; i < te::dense::NumBackwardVariants(); ++i) {
          const auto v = te::dense::BackwardVariantAt(i);
          shapes.append(nb::make_tuple(v.bx, v.by, v.unroll));
        }
        d["variants"] = shapes;
        d["active"] = te::dense::BackwardVariant();
        return d;
      },
      "The compiled (threads x, threads y, rows per batch) shapes of dense's backward kernel and the active one.");
  m.def("dense_set_forward_split", &te::dense::SetTrainForwardSplit, nb::arg("split"),
        "Benchmark hook: training forwards with an activation take the split path (BIAS-epilogue GEMM + our "
        "activation kernel) instead of the fused epilogue (process-wide; default False).");
  m.def("dense_force_candidate", &te::dense::SetForcedCandidate, nb::arg("index"),
        "Test hook: plans created from now on take candidate min(index, candidates - 1) of their list "
        "instead of the fastest, cached under their own key (process-wide; -1, the default, restores timing).");
  m.def("dense_plans", &DensePlans,
        "The cached cuBLASLt plans (column-major m, n, k, op flags, epilogue, the candidates' timed ms and "
        "the chosen one with its cuBLASLt algo config) for diagnostics.");
#endif
  m.def("build_info", &BuildInfo);
}
