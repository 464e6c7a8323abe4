// Router row kernels instantiated for __half (one file per dtype so they compile in parallel).
#include "router/router_launch.cuh"

namespace te::router {

cudaError_t LaunchRowF16(const RowParams& p, cudaStream_t s, bool backward) {
  return LaunchRowTyped<__half>(p, s, backward);
}

}  // namespace te::router
