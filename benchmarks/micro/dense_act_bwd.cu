// Standalone sweep of dense's backward elementwise pass (dz = dy * gelu_tanh'(z) + dbias partials,
// csrc/dense/dense_act.cuh) over block shapes, load-batch depth and rows per chunk, on bf16
// [M, N] = [16384, 14336] (the dense benchmark's MLP), next to a device-to-device copy of the same
// bytes (the bandwidth ceiling). Every variant's dz must equal the first variant's bit for bit and
// its dbias (after the reduction kernel) must match to float32 rounding: a fast wrong kernel fails.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc benchmarks/micro/dense_act_bwd.cu -o /tmp/act_bwd && /tmp/act_bwd
//
// Prints one line per (variant, rows per chunk): ms, effective TB/s (3 x M x N x 2 bytes: read dy
// and z, write dz; the partials are < 2% of that) and the dbias reduction's own ms.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dense/dense_act.cuh"

using T = __nv_bfloat16;
constexpr int kAct = static_cast<int>(te::dense::Act::kGeluTanh);
constexpr int kVec = 8;

#define CHECK(x)                                                                                \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

struct Buffers {
  int64_t m, n;
  T *dy, *z, *dz;
  float* partials;
  T* db;
};

template <int BX, int BY, int U>
float Run(const Buffers& b, int64_t rows_per_chunk, int reps, cudaStream_t s, float* reduce_ms) {
  const int64_t chunks = (b.m + rows_per_chunk - 1) / rows_per_chunk;
  dim3 grid(static_cast<unsigned>((b.n + BX * kVec - 1) / (BX * kVec)), static_cast<unsigned>(chunks));
  auto launch = [&] {
    te::dense::act::ActBackwardKernel<T, kAct, kVec, BX, BY, U>
        <<<grid, dim3(BX, BY), 0, s>>>(b.dy, b.z, b.dz, b.partials, b.m, b.n, rows_per_chunk);
  };
  auto reduce = [&] {
    te::dense::act::ReducePartialsKernel<T, 8>
        <<<static_cast<unsigned>((b.n + 31) / 32), dim3(32, 8), 0, s>>>(b.partials, chunks, b.n, b.db);
  };
  cudaEvent_t e0, e1, e2;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventCreate(&e2));
  for (int i = 0; i < 3; ++i) launch();
  CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < reps; ++i) launch();
  CHECK(cudaEventRecord(e1, s));
  for (int i = 0; i < reps; ++i) reduce();
  CHECK(cudaEventRecord(e2, s));
  CHECK(cudaEventSynchronize(e2));
  CHECK(cudaGetLastError());
  float ms = 0, rms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CHECK(cudaEventElapsedTime(&rms, e1, e2));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaEventDestroy(e2);
  *reduce_ms = rms / reps;
  return ms / reps;
}

struct Result {
  std::vector<uint16_t> dz_sample;
  std::vector<float> db;
};

Result Snapshot(const Buffers& b) {
  Result r;
  const int64_t total = b.m * b.n;
  r.dz_sample.resize(1 << 20);
  // 2 MiB of dz from the middle of the tensor, plus the whole dbias
  CHECK(cudaMemcpy(r.dz_sample.data(), b.dz + (total - (1 << 20)) / 2, (1 << 20) * sizeof(uint16_t),
                   cudaMemcpyDeviceToHost));
  std::vector<uint16_t> db(b.n);
  CHECK(cudaMemcpy(db.data(), b.db, b.n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  r.db.resize(b.n);
  for (int64_t i = 0; i < b.n; ++i) {
    uint32_t bits = static_cast<uint32_t>(db[i]) << 16;
    std::memcpy(&r.db[i], &bits, 4);
  }
  return r;
}

int main(int argc, char** argv) {
  const int64_t m = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : 14336;
  const int reps = 20;
  Buffers b{m, n};
  const size_t bytes = static_cast<size_t>(m * n) * sizeof(T);
  CHECK(cudaMalloc(&b.dy, bytes));
  CHECK(cudaMalloc(&b.z, bytes));
  CHECK(cudaMalloc(&b.dz, bytes));
  CHECK(cudaMalloc(&b.partials, static_cast<size_t>(m) * n * sizeof(float) / 16 + 1024));  // >= m/16 chunks
  CHECK(cudaMalloc(&b.db, n * sizeof(T)));
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  te::dense::act::FillUniformKernel<T><<<1024, 256, 0, s>>>(b.dy, m * n, 1, 1.0f);
  te::dense::act::FillUniformKernel<T><<<1024, 256, 0, s>>>(b.z, m * n, 2, 3.0f);
  CHECK(cudaStreamSynchronize(s));

  // Copy ceiling: one read + one write of 1.5 x the tensor, i.e. the same 3 x M x N x 2 bytes moved.
  {
    T* tmp;
    CHECK(cudaMalloc(&tmp, bytes * 3 / 2));
    T* src;
    CHECK(cudaMalloc(&src, bytes * 3 / 2));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) CHECK(cudaMemcpyAsync(tmp, src, bytes * 3 / 2, cudaMemcpyDeviceToDevice, s));
    CHECK(cudaEventRecord(e0, s));
    for (int i = 0; i < reps; ++i) CHECK(cudaMemcpyAsync(tmp, src, bytes * 3 / 2, cudaMemcpyDeviceToDevice, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    ms /= reps;
    std::printf("copy ceiling (cudaMemcpy D2D of %.2f GB read + write): %.3f ms, %.2f TB/s\n", 3.0 * bytes / 1e9, ms,
                3.0 * bytes / ms / 1e9);
    cudaFree(tmp);
    cudaFree(src);
  }

  Result ref;
  bool have_ref = false;
  int failures = 0;
  auto sweep = [&](const char* name, auto run) {
    for (int64_t rpc : {16, 32, 64, 128, 256, 512, 1024}) {
      if ((m + rpc - 1) / rpc > m / 16 + 1) continue;  // partials buffer holds m / 16 chunks
      CHECK(cudaMemset(b.dz, 0xff, bytes));
      float rms = 0;
      const float ms = run(rpc, &rms);
      Result r = Snapshot(b);
      bool ok = true;
      if (!have_ref) {
        ref = r;
        have_ref = true;
      } else {
        ok = std::memcmp(r.dz_sample.data(), ref.dz_sample.data(), r.dz_sample.size() * 2) == 0;
        for (int64_t i = 0; i < n && ok; ++i) {
          ok = std::fabs(r.db[i] - ref.db[i]) <= 2e-2f * (1.0f + std::fabs(ref.db[i]));
        }
      }
      failures += !ok;
      std::printf("%-22s rows/chunk %5lld  chunks %5lld  %.3f ms  %.2f TB/s  reduce %.4f ms  %s\n", name,
                  static_cast<long long>(rpc), static_cast<long long>((m + rpc - 1) / rpc), ms,
                  3.0 * bytes / ms / 1e9, rms, ok ? "ok" : "MISMATCH");
    }
  };
#define VARIANT(BX, BY, U) \
  sweep("block " #BX "x" #BY " unroll " #U, [&](int64_t rpc, float* rms) { return Run<BX, BY, U>(b, rpc, reps, s, rms); })
  VARIANT(32, 8, 4);
  VARIANT(32, 8, 2);
  VARIANT(32, 8, 1);
  VARIANT(64, 4, 4);
  VARIANT(64, 4, 2);
  VARIANT(128, 2, 2);
  VARIANT(128, 2, 4);
  VARIANT(128, 1, 4);
  VARIANT(256, 1, 1);
  VARIANT(256, 1, 2);
  VARIANT(256, 1, 4);
  VARIANT(64, 2, 4);
  VARIANT(32, 4, 4);
  std::printf("%s\n", failures == 0 ? "all variants agree" : "SOME VARIANTS MISMATCH");
  return failures == 0 ? 0 : 1;
}
