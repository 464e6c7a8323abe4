// FFI targets exported to Python: each op folder appends its (name, stage handlers) entries.
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

void AppendSoftmaxTargets(std::vector<Target>& out);

}  // namespace te
