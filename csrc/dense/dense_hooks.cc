// Python hooks of the dense op: the cached cuBLASLt plans (diagnostics), and benchmark/test
// switches for the backward kernel's block shape, the split training forward and forcing one
// cuBLASLt candidate.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "common/hooks.h"
#include "dense/dense.h"
#include "dense/dense_gemm.h"

namespace nb = nanobind;

namespace {

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

nb::dict BackwardVariants() {
  nb::dict d;
  nb::list shapes;
  for (int i = 0; i < te::dense::NumBackwardVariants(); ++i) {
    const auto v = te::dense::BackwardVariantAt(i);
    shapes.append(nb::make_tuple(v.bx, v.by, v.unroll));
  }
  d["variants"] = shapes;
  d["active"] = te::dense::BackwardVariant();
  return d;
}

void SetBackwardVariant(int i) {
  if (!te::dense::SetBackwardVariant(i)) {
    throw nb::value_error(("variant must be in [0, " + std::to_string(te::dense::NumBackwardVariants()) +
                           "), got " + std::to_string(i))
                              .c_str());
  }
}

void Install(nb::module_& m) {
  m.def("dense_set_backward_variant", &SetBackwardVariant, nb::arg("variant"),
        "Benchmark hook: the block shape of dense's backward dz/dbias kernel (process-wide).");
  m.def("dense_backward_variants", &BackwardVariants,
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
}

const te::HookRegistrar kHooks(Install);

}  // namespace
