// Host interface of the dense elementwise kernels (csrc/dense/dense_kernels.cu). The GEMMs themselves
// run in cuBLASLt (dense_ffi.cc); these kernels do what cuBLASLt's epilogues cannot:
//   * forward: y = act(z [+ bias]) for activations without a cuBLASLt epilogue (exact-erf GELU, SiLU),
//     or when the fused epilogue is not available for a shape (e.g. GELU_AUX needs N % 8 == 0);
//   * backward: dz = dy * act'(saved), fused with deterministic per-chunk column sums of dz (dbias).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace te::dense {

enum class Act : int { kNone = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3, kSilu = 4 };
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// y[M, N] = act(z[M, N] + bias[N]) (bias may be null). z and y may be the same buffer (in place).
// If z_out is non-null (and distinct from z), z + bias is written there too (the saved pre-activation).
cudaError_t LaunchActForward(DType dt, Act act, const void* z, const void* bias, void* y, void* z_out, int64_t m,
                             int64_t n, cudaStream_t stream);

// dz[M, N] = dy * act'(saved) (act kNone: dz = dy; kRelu: saved is y, others: saved is z).
// dz may be null (not written). If partials is non-null it receives, for each of *chunks_used
// consecutive row chunks (at most max_chunks, the scratch's rows), the float32 column sums of dz over
// the chunk: partials[*chunks_used, N] (LaunchReducePartials adds them up).
cudaError_t LaunchActBackward(DType dt, Act act, const void* dy, const void* saved, void* dz, float* partials,
                              int64_t max_chunks, int64_t m, int64_t n, cudaStream_t stream, int64_t* chunks_used);

// The backward kernel's block shape: bx x by threads, `unroll` rows per load batch. Several are
// compiled; one is active process-wide (a tuning hook: te_ops._native_cublaslt.dense_set_backward_variant).
struct BwdVariant {
  int bx, by, unroll;
};
int NumBackwardVariants();
BwdVariant BackwardVariantAt(int i);
int BackwardVariant();
bool SetBackwardVariant(int i);  // false when i is out of range

// Tuning hook (te_ops._native_cublaslt.dense_set_forward_split): when set, the training forward of an
// activation with a cuBLASLt epilogue takes the split path (GEMM + BIAS epilogue writes z, our kernel
// writes y = act(z)) instead of the fused GELU_AUX_BIAS / RELU_BIAS epilogue. Default: fused.
bool TrainForwardSplit();
void SetTrainForwardSplit(bool split);

// Row chunks of LaunchActBackward for [M, N] with vec-element vectors and blocks block_x threads
// wide: ~2048 blocks, >= 32 rows per chunk, <= max_chunks.
int64_t BackwardChunks(int64_t m, int64_t n, int vec, int block_x, int64_t max_chunks);

// out[N] = sum over chunks of partials[chunks, N], rounded to dt.
cudaError_t LaunchReducePartials(DType dt, const float* partials, int64_t chunks, int64_t n, void* out,
                                 cudaStream_t stream);

// Fills `count` elements of dt at p with pseudo-random values uniform in [-1, 1) (a hash of the index
// and `seed`): scratch data for timing GEMM candidates that draws power like real data does (a
// constant pattern toggles few tensor-core bits, lets the clock run higher than in real training and
// can rank algorithms differently).
cudaError_t LaunchFillUniform(DType dt, void* p, int64_t count, uint32_t seed, cudaStream_t stream);

// The same for FP8 GEMM timing data: `count` E4M3 (or E5M2) bytes of 256 * uniform[-1, 1).
cudaError_t LaunchFillFp8Uniform(bool e5m2, void* p, int64_t count, uint32_t seed, cudaStream_t stream);

}  // namespace te::dense
