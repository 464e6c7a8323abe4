// Python hooks (diagnostics, benchmark and test switches) exported by the native modules. Each
// op's folder installs its own functions with a static HookRegistrar, so adding an op's hooks
// never touches module.cc:
//
//   static void Install(nanobind::module_& m) { m.def("softmax_config", ...); }
//   static te::HookRegistrar kHooks(Install);
//
// A folder's files are compiled only into the module that holds the op, so a hook exists exactly
// where its op does.
#pragma once

#include <nanobind/nanobind.h>

#include <vector>

namespace te {

using HookInstaller = void (*)(nanobind::module_&);

inline std::vector<HookInstaller>& AllHookInstallers() {
  static std::vector<HookInstaller> installers;
  return installers;
}

struct HookRegistrar {
  explicit HookRegistrar(HookInstaller install) { AllHookInstallers().push_back(install); }
};

}  // namespace te
