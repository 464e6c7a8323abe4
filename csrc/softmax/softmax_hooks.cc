// Python hooks of the softmax op: the launch configuration the kernels choose for a shape, and a
// benchmark switch that forces the register kernel's shape.
#include <nanobind/nanobind.h>

#include "common/hooks.h"
#include "softmax/softmax.h"

namespace nb = nanobind;

namespace {

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
  // Forward kernel family, indexed by te::softmax::FwdKernel (the backward always uses the first).
  static const char* kNames[] = {"register", "warp-row", "warp-row-packed"};
  d["kernel"] = kNames[static_cast<int>(c.kernel)];
  return d;
}

void Install(nb::module_& m) {
  m.def("softmax_set_tuning", &te::softmax::SetTuning, nb::arg("threads_per_row"), nb::arg("vectors_per_thread"),
        "Benchmark hook: force the softmax register-kernel shape (0, 0 = heuristic).");
  m.def("softmax_config", &SoftmaxConfig, nb::arg("dtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("mode"),
        nb::arg("scale") = 1.0f,
        "Launch configuration the softmax kernels choose (dtype 0=f32 1=bf16 2=f16; mode 0 none 1 mask 2 causal).");
}

const te::HookRegistrar kHooks(Install);

}  // namespace
