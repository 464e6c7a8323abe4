// Softmax kernels instantiated for __half (one file per dtype so they compile in parallel).
#include "softmax/softmax_launch.cuh"

namespace te::softmax {

cudaError_t LaunchF16(const Params& p, cudaStream_t s, bool backward) {
  return backward ? LaunchTyped<__half, true>(p, s) : LaunchTyped<__half, false>(p, s);
}

}  // namespace te::softmax
