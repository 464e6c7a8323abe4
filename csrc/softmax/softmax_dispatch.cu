#include "softmax/softmax_launch.cuh"

namespace te::softmax {

LaunchConfig ChooseConfig(const Params& p) {
  return ChooseConfigFor(p, p.dtype == DType::kF32 ? 4 : 2);
}

static cudaError_t Launch(const Params& p, cudaStream_t s, bool backward) {
  switch (p.dtype) {
    case DType::kF32: return LaunchF32(p, s, backward);
    case DType::kBF16: return LaunchBF16(p, s, backward);
    case DType::kF16: return LaunchF16(p, s, backward);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchForward(const Params& p, cudaStream_t s) { return Launch(p, s, false); }
cudaError_t LaunchBackward(const Params& p, cudaStream_t s) { return Launch(p, s, true); }

}  // namespace te::softmax
