// Router row kernels instantiated for __nv_bfloat16 (one file per dtype so they compile in parallel).
#include "router/router_launch.cuh"

namespace te::router {

cudaError_t LaunchRowBF16(const RowParams& p, cudaStream_t s, bool backward) {
  return LaunchRowTyped<__nv_bfloat16>(p, s, backward);
}

}  // namespace te::router
