// Softmax kernels instantiated for __nv_bfloat16 (one file per dtype so they compile in parallel).
#include "softmax/softmax_launch.cuh"

namespace te::softmax {

cudaError_t LaunchBF16(const Params& p, cudaStream_t s, bool backward) {
  return backward ? LaunchTyped<__nv_bfloat16, true>(p, s) : LaunchTyped<__nv_bfloat16, false>(p, s);
}

}  // namespace te::softmax
