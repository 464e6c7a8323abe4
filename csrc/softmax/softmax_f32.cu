// Softmax kernels instantiated for float (one file per dtype so they compile in parallel).
#include "softmax/softmax_launch.cuh"

namespace te::softmax {

cudaError_t LaunchF32(const Params& p, cudaStream_t s, bool backward) {
  return backward ? LaunchTyped<float, true>(p, s) : LaunchTyped<float, false>(p, s);
}

}  // namespace te::softmax
