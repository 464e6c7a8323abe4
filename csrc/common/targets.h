// FFI targets exported to Python. Each op's handler file registers its targets with a static
// TargetRegistrar, so adding an op never touches module.cc:
//
//   static te::TargetRegistrar kRegister({{"te_softmax_fwd", kFwdInit, kFwdExec}, ...});
#pragma once

#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace te {

struct Target {
  std::string name;
  XLA_FFI_Handler* initialize = nullptr;  // may be null for handlers without warm-up
  XLA_FFI_Handler* execute = nullptr;
};

std::vector<Target>& AllTargets();

struct TargetRegistrar {
  explicit TargetRegistrar(std::initializer_list<Target> targets) {
    for (const Target& t : targets) AllTargets().push_back(t);
  }
};

}  // namespace te
