// Router row kernels instantiated for float (one file per dtype so they compile in parallel).
#include "router/router_launch.cuh"

namespace te::router {

cudaError_t LaunchRowF32(const RowParams& p, cudaStream_t s, bool backward) {
  return LaunchRowTyped<float>(p, s, backward);
}

}  // namespace te::router
