// The native extension modules (te_ops._native, _native_cublaslt, _native_cudnn): expose the FFI
// handlers (as capsules per execution stage), the handler counters, the build information and the
// hooks each op folder registers (csrc/common/hooks.h). Nothing here is op-specific.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include <cuda_runtime.h>

#include "common/hooks.h"
#include "common/runtime.h"
#include "common/targets.h"

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
  // Each op folder adds its own hooks (csrc/common/hooks.h).
  for (te::HookInstaller install : te::AllHookInstallers()) install(m);
  m.def("build_info", &BuildInfo);
}
