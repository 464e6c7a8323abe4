// cuBLASLt plans for dense (see dense_gemm.h).
#include "dense/dense_gemm.h"

#include "dense/dense.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

namespace te::dense {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation for Hopper
constexpr int kMaxCandidates = 24;
constexpr uint32_t kAllowedReductionSchemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;  // (NONE always)
// Timing scratch is cudaMalloc'd and freed in the initialize stage; above this we take the
// heuristic's first choice instead of timing.
constexpr size_t kMaxTimingScratchBytes = size_t{4} << 30;

ffi::Error LtError(const char* op, cublasStatus_t st, const std::string& what) {
  // No iostreams in csrc/ (see common/ffi_util.h): plain string concatenation only.
  std::string msg = std::string("te_ops.") + op + ": cuBLASLt error " + cublasLtGetStatusName(st) + " (" +
                    cublasLtGetStatusString(st) + ") in " + what;
  return ffi::Error(ffi::ErrorCode::kInternal, msg);
}

#define TE_LT_CHECK(op, expr, what)                                   \
  do {                                                                \
    cublasStatus_t te_lt_st_ = (expr);                                \
    if (te_lt_st_ != CUBLAS_STATUS_SUCCESS) {                         \
      return LtError((op), te_lt_st_, std::string(#expr) + " for " + (what)); \
    }                                                                 \
  } while (0)

std::mutex& StateMutex() {
  static std::mutex m;
  return m;
}
std::map<int, DeviceState*>& Devices() {
  static auto* m = new std::map<int, DeviceState*>();
  return *m;
}
std::map<std::string, std::unique_ptr<GemmPlan>>& Plans() {
  static auto* m = new std::map<std::string, std::unique_ptr<GemmPlan>>();
  return *m;
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool restore_ = false;
  bool ok_ = true;
};

size_t ElementBytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16BF:
    case CUDA_R_16F: return 2;
    case CUDA_R_8F_E4M3:
    case CUDA_R_8F_E5M2: return 1;
    default: return 4;
  }
}

bool HasBias(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_BIAS:
    case CUBLASLT_EPILOGUE_RELU_BIAS:
    case CUBLASLT_EPILOGUE_GELU_BIAS:
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
    case CUBLASLT_EPILOGUE_BGRADA:
    case CUBLASLT_EPILOGUE_BGRADB: return true;
    default: return false;
  }
}

bool HasAux(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}

// The epilogues `e` extends (dropping its aux output, then its activation, then its bias), most
// similar first: their heuristic lists widen the candidates for `e`.
std::vector<cublasLtEpilogue_t> SimplerEpilogues(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
      return {CUBLASLT_EPILOGUE_GELU_BIAS, CUBLASLT_EPILOGUE_BIAS, CUBLASLT_EPILOGUE_DEFAULT};
    case CUBLASLT_EPILOGUE_GELU_AUX: return {CUBLASLT_EPILOGUE_GELU, CUBLASLT_EPILOGUE_DEFAULT};
    case CUBLASLT_EPILOGUE_GELU_BIAS:
    case CUBLASLT_EPILOGUE_RELU_BIAS: return {CUBLASLT_EPILOGUE_BIAS, CUBLASLT_EPILOGUE_DEFAULT};
    case CUBLASLT_EPILOGUE_GELU:
    case CUBLASLT_EPILOGUE_RELU:
    case CUBLASLT_EPILOGUE_BIAS:
    case CUBLASLT_EPILOGUE_BGRADA:
    case CUBLASLT_EPILOGUE_BGRADB: return {CUBLASLT_EPILOGUE_DEFAULT};
    default: return {};
  }
}

// Rows/cols of the stored (column-major) A and B.
void StoredA(const GemmSpec& s, uint64_t* rows, uint64_t* cols) {
  *rows = s.trans_a ? s.k : s.m;
  *cols = s.trans_a ? s.m : s.k;
}
void StoredB(const GemmSpec& s, uint64_t* rows, uint64_t* cols) {
  *rows = s.trans_b ? s.n : s.k;
  *cols = s.trans_b ? s.k : s.n;
}

ffi::Error SetPointers(const char* op, GemmPlan& plan, const GemmPtrs& p) {
  if (HasBias(plan.spec.epilogue)) {
    TE_LT_CHECK(op,
                cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof(p.bias)),
                plan.spec.Describe());
  }
  if (HasAux(plan.spec.epilogue)) {
    TE_LT_CHECK(op,
                cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux,
                                               sizeof(p.aux)),
                plan.spec.Describe());
  }
  if (plan.spec.scale_mode_a >= 0) {
    TE_LT_CHECK(op,
                cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.scale_a,
                                               sizeof(p.scale_a)),
                plan.spec.Describe());
  }
  if (plan.spec.scale_mode_b >= 0) {
    TE_LT_CHECK(op,
                cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.scale_b,
                                               sizeof(p.scale_b)),
                plan.spec.Describe());
  }
  return ffi::Error::Success();
}

cublasStatus_t Matmul(DeviceState& dev, GemmPlan& plan, const GemmPtrs& p, const cublasLtMatmulAlgo_t& algo,
                      cudaStream_t stream, void* workspace, size_t workspace_bytes) {
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(dev.handle, plan.desc, &alpha, p.a, plan.la, p.b, plan.lb, &beta, p.d, plan.ld, p.d,
                        plan.ld, &algo, workspace, workspace_bytes, stream);
}

// Times the candidates on scratch buffers; returns the index of the fastest, 0 when timing is not
// possible (e.g. the scratch does not fit), or -1 when every candidate failed to run (cuBLASLt
// offered an algorithm it then refused: the caller treats the spec as unsupported and falls back).
// Never touches XLA's buffers.
int TimeCandidates(DeviceState& dev, GemmPlan& plan, const std::vector<cublasLtMatmulHeuristicResult_t>& cands,
                   float* best_ms, std::vector<float>* all_ms) {
  *best_ms = -1.0f;
  all_ms->assign(cands.size(), -1.0f);
  if (cands.empty()) return -1;
  const GemmSpec& s = plan.spec;
  uint64_t ar, ac, br, bc;
  StoredA(s, &ar, &ac);
  StoredB(s, &br, &bc);
  const size_t eab = ElementBytes(s.ab_type), ebb = ElementBytes(s.BType()), ed = ElementBytes(s.d_type);
  const size_t bytes_a = static_cast<size_t>(s.lda) * ac * eab;
  const size_t bytes_b = static_cast<size_t>(s.ldb) * bc * ebb;
  const size_t bytes_d = static_cast<size_t>(s.ldd) * s.n * ed;
  const size_t bytes_bias = HasBias(s.epilogue) ? s.m * ed + 256 : 0;
  const size_t bytes_aux = HasAux(s.epilogue) ? static_cast<size_t>(s.aux_ld) * s.n * ed : 0;
  // FP8 block scaling: scratch scale tensors of the sizes cuBLASLt reads (0 bytes otherwise)
  const size_t bytes_sa = static_cast<size_t>(ScaleShape(s.scale_mode_a, s.m, s.k).Elements()) * sizeof(float);
  const size_t bytes_sb = static_cast<size_t>(ScaleShape(s.scale_mode_b, s.n, s.k).Elements()) * sizeof(float);
  if (bytes_a + bytes_b + bytes_d + bytes_bias + bytes_aux + bytes_sa + bytes_sb > kMaxTimingScratchBytes) return 0;

  // Timing gets its own workspace of the same size as the execute path's: the device workspace may
  // still be in use by GEMMs queued on XLA's stream, and candidates that need a workspace (split-K,
  // stream-K) must be timed with one, or they fail here and are never chosen.
  void *a = nullptr, *b = nullptr, *d = nullptr, *bias = nullptr, *aux = nullptr, *ws = nullptr;
  void *sa = nullptr, *sb = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  int best = 0;
  auto cleanup = [&] {
    if (a) cudaFree(a);
    if (b) cudaFree(b);
    if (d) cudaFree(d);
    if (bias) cudaFree(bias);
    if (aux) cudaFree(aux);
    if (sa) cudaFree(sa);
    if (sb) cudaFree(sb);
    if (ws) cudaFree(ws);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    cudaGetLastError();  // a failed allocation must not leave a sticky error behind
  };
  bool ok = cudaMalloc(&a, bytes_a) == cudaSuccess && cudaMalloc(&b, bytes_b) == cudaSuccess &&
            cudaMalloc(&d, bytes_d) == cudaSuccess &&
            (bytes_bias == 0 || cudaMalloc(&bias, bytes_bias) == cudaSuccess) &&
            (bytes_aux == 0 || cudaMalloc(&aux, bytes_aux) == cudaSuccess) &&
            (bytes_sa == 0 || cudaMalloc(&sa, bytes_sa) == cudaSuccess) &&
            (bytes_sb == 0 || cudaMalloc(&sb, bytes_sb) == cudaSuccess) &&
            cudaMalloc(&ws, dev.workspace_bytes) == cudaSuccess &&
            cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
            cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess;
  // Pseudo-random values in [-1, 1), so the candidates draw power (and the clock behaves) as with
  // real data; a constant pattern let the clock run higher than in training and ranked differently.
  auto fill = [&](void* ptr, size_t bytes, cudaDataType_t t, uint32_t seed) {
    if (t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2) {  // FP8 operands: random FP8 values of either sign
      return LaunchFillFp8Uniform(t == CUDA_R_8F_E5M2, ptr, static_cast<int64_t>(bytes), seed, stream) == cudaSuccess;
    }
    const DType dt = t == CUDA_R_32F ? DType::kF32 : (t == CUDA_R_16BF ? DType::kBF16 : DType::kF16);
    return LaunchFillUniform(dt, ptr, static_cast<int64_t>(bytes / ElementBytes(t)), seed, stream) == cudaSuccess;
  };
  ok = ok && fill(a, bytes_a, s.ab_type, 1) && fill(b, bytes_b, s.BType(), 2) &&
       (bytes_bias == 0 || fill(bias, bytes_bias, s.d_type, 3)) &&
       (bytes_sa == 0 || fill(sa, bytes_sa, CUDA_R_32F, 4)) && (bytes_sb == 0 || fill(sb, bytes_sb, CUDA_R_32F, 5));
  if (!ok) {
    cleanup();
    return 0;
  }
  GemmPtrs p{a, b, d, bias, aux, sa, sb};
  if (SetPointers("dense", plan, p).failure()) {
    cleanup();
    return 0;
  }
  // Ranking must hold in training, where GEMMs run back to back at the power-limited sustained clock,
  // not in a short burst at boost clock (short bursts rank tiles differently; benchmarks/dense_profile.py
  // shows it). So: one probe call per candidate (cuBLASLt may refuse one it
  // offered), ~100 ms of continuous work to reach the sustained clock, then kRounds rounds in which
  // every candidate runs ~3 ms between its own pair of events, all enqueued back to back with no host
  // synchronisation inside a round (the GPU never idles), the order rotated each round so no
  // candidate always follows the same one; a candidate's time is its median over the rounds.
  constexpr int kRounds = 4;
  const size_t nc = cands.size();
  std::vector<float> t(nc, -1.0f);
  std::vector<char> runs(nc, 0);
  for (size_t i = 0; i < nc; ++i) {
    runs[i] = Matmul(dev, plan, p, cands[i].algo, stream, ws, dev.workspace_bytes) == CUBLAS_STATUS_SUCCESS;
  }
  size_t first = 0;
  while (first < nc && !runs[first]) ++first;
  // Mean ms of n calls of candidate i, or -1 when refused, -2 on an event error.
  auto run_n = [&](size_t i, int n) -> float {
    if (cudaEventRecord(start, stream) != cudaSuccess) return -2.0f;
    bool failed = false;
    for (int r = 0; r < n && !failed; ++r) {
      failed = Matmul(dev, plan, p, cands[i].algo, stream, ws, dev.workspace_bytes) != CUBLAS_STATUS_SUCCESS;
    }
    float ms = 0.0f;
    if (cudaEventRecord(stop, stream) != cudaSuccess || cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
      return -2.0f;
    }
    return failed ? -1.0f : ms / n;
  };
  const float est = first < nc ? run_n(first, 1) : -1.0f;
  const bool untimed = est == -2.0f;  // events failed: keep the heuristic's first choice
  std::vector<cudaEvent_t> ev(2 * nc, nullptr);
  bool events_ok = true;
  for (auto& e : ev) events_ok = events_ok && cudaEventCreate(&e) == cudaSuccess;
  if (est > 0.0f && events_ok) {
    const int warm = static_cast<int>(std::min(4000.0f, std::ceil(100.0f / est)));
    const int reps = static_cast<int>(std::max(3.0f, std::min(200.0f, std::ceil(3.0f / est))));
    std::vector<std::vector<float>> samples(nc);
    bool ok = run_n(first, warm) > 0.0f;
    for (int round = 0; round < kRounds && ok; ++round) {
      for (size_t j = 0; j < nc && ok; ++j) {
        const size_t i = (j + round) % nc;
        if (!runs[i]) continue;
        ok = cudaEventRecord(ev[2 * i], stream) == cudaSuccess;
        for (int r = 0; r < reps && ok && runs[i]; ++r) {
          runs[i] = Matmul(dev, plan, p, cands[i].algo, stream, ws, dev.workspace_bytes) == CUBLAS_STATUS_SUCCESS;
        }
        ok = ok && cudaEventRecord(ev[2 * i + 1], stream) == cudaSuccess;
      }
      ok = ok && cudaStreamSynchronize(stream) == cudaSuccess;
      for (size_t i = 0; i < nc && ok; ++i) {
        float ms = 0.0f;
        if (runs[i] && cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]) == cudaSuccess) {
          samples[i].push_back(ms / reps);
        }
      }
    }
    for (size_t i = 0; i < nc; ++i) {
      auto& v = samples[i];
      if (!runs[i] || v.empty()) continue;
      std::sort(v.begin(), v.end());
      const size_t h = v.size() / 2;
      t[i] = v.size() % 2 == 1 ? v[h] : 0.5f * (v[h - 1] + v[h]);
    }
  }
  for (auto& e : ev) {
    if (e) cudaEventDestroy(e);
  }
  // Within timing noise, trust cuBLASLt's order: the earliest candidate within kTieMargin of the
  // fastest wins (near-ties otherwise flip between processes: candidates that time within 1% here
  // can differ by several percent inside a training step).
  constexpr float kTieMargin = 0.02f;
  float fastest = -1.0f;
  for (size_t i = 0; i < nc; ++i) {
    if (t[i] > 0.0f && (fastest < 0.0f || t[i] < fastest)) fastest = t[i];
  }
  float best_t = -1.0f;
  for (size_t i = 0; i < nc && fastest > 0.0f; ++i) {
    if (t[i] > 0.0f && t[i] <= fastest * (1.0f + kTieMargin)) {
      best_t = t[i];
      best = static_cast<int>(i);
      break;
    }
  }
  if (best_t < 0.0f && est > 0.0f) {  // only the first timed run succeeded: keep it, with that time
    best = static_cast<int>(first);
    best_t = t[first] = est;
  }
  *all_ms = t;
  const bool synced = cudaStreamSynchronize(stream) == cudaSuccess;
  cleanup();
  *best_ms = best_t;
  if (untimed) return 0;
  if (best_t < 0.0f && synced) return -1;  // none ran
  return best;
}

}  // namespace

int Alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  if (v == 0) return 16;
  int a = 1;
  while (a < 16 && (v % (2 * a)) == 0) a *= 2;
  return a;
}

namespace {
std::string I(long long v) { return std::to_string(v); }
std::string U(unsigned long long v) { return std::to_string(v); }
}  // namespace

std::string GemmSpec::Key() const {
  return I(ab_type) + "/" + I(d_type) + "|" + I(trans_a) + I(trans_b) + "|" + U(m) + "x" + U(n) + "x" + U(k) + "|" +
         I(lda) + "," + I(ldb) + "," + I(ldd) + "|e" + I(static_cast<int>(epilogue)) + "|aux" + I(aux_ld) + "|al" +
         I(align_a) + "," + I(align_b) + "," + I(align_d) + "," + I(align_bias) + "," + I(align_aux) +
         (b_type >= 0 ? "|b" + I(b_type) : "") + (Scaled() ? "|s" + I(scale_mode_a) + "," + I(scale_mode_b) : "");
}

std::string GemmSpec::Describe() const {
  return "GEMM m=" + U(m) + " n=" + U(n) + " k=" + U(k) + " (column-major, transa=" + (trans_a ? "T" : "N") +
         " transb=" + (trans_b ? "T" : "N") + ", lda=" + I(lda) + " ldb=" + I(ldb) + " ldd=" + I(ldd) +
         ", epilogue=" + I(static_cast<int>(epilogue)) + ", cudaDataType A/B=" + I(ab_type) + " D=" + I(d_type) +
         (b_type >= 0 ? " B=" + I(b_type) : "") +
         (Scaled() ? ", scale modes A/B=" + I(scale_mode_a) + "/" + I(scale_mode_b) : "") + ")";
}

ScaleDims ScaleShape(int32_t mode, uint64_t outer, uint64_t k) {
  const int64_t kb = static_cast<int64_t>((k + 127) / 128);
#if TE_CUBLASLT_BLOCK_SCALING
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) return {kb, static_cast<int64_t>(outer)};
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F) {
    return {static_cast<int64_t>((outer + 127) / 128), (kb + 3) / 4 * 4};
  }
#else
  (void)mode;
  (void)outer;
  (void)kb;
#endif
  return {};
}

GemmPlan::~GemmPlan() {
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (ld) cublasLtMatrixLayoutDestroy(ld);
  if (desc) cublasLtMatmulDescDestroy(desc);
}

ffi::Error GetDeviceState(const char* op, int device, bool create, DeviceState** out) {
  std::lock_guard<std::mutex> lock(StateMutex());
  auto it = Devices().find(device);
  if (it != Devices().end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  if (!create) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("te_ops.") + op + ": no cuBLASLt state for device " + std::to_string(device) +
                          " (the handler's initialize stage did not run)");
  }
  DeviceGuard guard(device);
  if (!guard.ok()) return CudaError(op, cudaGetLastError(), "cudaSetDevice(" + std::to_string(device) + ")");
  auto* st = new DeviceState();
  cublasStatus_t s = cublasLtCreate(&st->handle);
  if (s != CUBLAS_STATUS_SUCCESS) {
    delete st;
    return LtError(op, s, "cublasLtCreate on device " + std::to_string(device));
  }
  cudaError_t e = cudaMalloc(&st->workspace, kWorkspaceBytes);
  if (e != cudaSuccess) {
    cublasLtDestroy(st->handle);
    delete st;
    return CudaError(op, e, "cudaMalloc of the " + std::to_string(kWorkspaceBytes >> 20) +
                                " MiB cuBLASLt workspace on device " + std::to_string(device));
  }
  st->workspace_bytes = kWorkspaceBytes;
  Devices()[device] = st;  // lives for the process (handles outlive every XLA executable)
  *out = st;
  return ffi::Error::Success();
}

namespace {
std::atomic<int> g_forced_candidate{-1};
}  // namespace

int ForcedCandidate() { return g_forced_candidate.load(std::memory_order_relaxed); }
void SetForcedCandidate(int i) { g_forced_candidate.store(i < 0 ? -1 : i, std::memory_order_relaxed); }

namespace {
// The matmul descriptor of `spec` (compute type float32, op flags, epilogue, aux leading dimension,
// FP8 scale modes) and its A, B and D layouts, into p (freed by ~GemmPlan).
ffi::Error CreateDescriptors(const char* op, const GemmSpec& spec, GemmPlan* p) {
  const std::string what = spec.Describe();
  TE_LT_CHECK(op, cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
  const int32_t ta = spec.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t tb = spec.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  TE_LT_CHECK(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), what);
  TE_LT_CHECK(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), what);
  const cublasLtEpilogue_t epi = spec.epilogue;
  TE_LT_CHECK(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), what);
  if (HasAux(epi)) {
    const int64_t aux_ld = spec.aux_ld;
    TE_LT_CHECK(op,
                cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)),
                what);
  }
  if (spec.Scaled()) {
#if TE_CUBLASLT_BLOCK_SCALING
    // FP8 block scaling: only the modes are set here, the scale pointers per call (SetPointers).
    // No fast accumulation (cuBLASLt refuses it with these modes; CUBLASLT_MATMUL_DESC_FAST_ACCUM
    // stays at its default 0): partial sums are promoted to float32 every 128 of K.
    if (spec.scale_mode_a >= 0) {
      const int32_t mode = spec.scale_mode_a;
      TE_LT_CHECK(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode)),
                  what);
    }
    if (spec.scale_mode_b >= 0) {
      const int32_t mode = spec.scale_mode_b;
      TE_LT_CHECK(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode)),
                  what);
    }
#else
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string("te_ops.") + op + ": built against cuBLASLt headers older than 12.9 (" +
                          "CUBLAS_VERSION " + std::to_string(CUBLAS_VERSION) +
                          "), which have no FP8 block scale modes, for " + what);
#endif
  }
  uint64_t ar, ac, br, bc;
  StoredA(spec, &ar, &ac);
  StoredB(spec, &br, &bc);
  TE_LT_CHECK(op, cublasLtMatrixLayoutCreate(&p->la, spec.ab_type, ar, ac, spec.lda), what);
  TE_LT_CHECK(op, cublasLtMatrixLayoutCreate(&p->lb, spec.BType(), br, bc, spec.ldb), what);
  TE_LT_CHECK(op, cublasLtMatrixLayoutCreate(&p->ld, spec.d_type, spec.m, spec.n, spec.ldd), what);
  return ffi::Error::Success();
}

// The search preference of `spec`: workspace limit, pointer alignments, reduction schemes.
cublasStatus_t SetPreference(const GemmSpec& spec, uint64_t ws, cublasLtMatmulPreference_t pref) {
  // Alignment the kernels may assume: the pointer's, but no more than the row pitch allows (an odd
  // leading dimension in a 16-bit type makes every other column only 2-byte aligned).
  auto pitch = [](int64_t ld, cudaDataType_t t) { return Alignment(reinterpret_cast<const void*>(ld * ElementBytes(t))); };
  const uint32_t al_a = std::min(spec.align_a, pitch(spec.lda, spec.ab_type));
  const uint32_t al_b = std::min(spec.align_b, pitch(spec.ldb, spec.BType()));
  const uint32_t al_d = std::min(spec.align_d, pitch(spec.ldd, spec.d_type));
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d));
  // Split-K partial sums only in the compute type (float32): INPLACE and OUTPUT_TYPE reductions add
  // the parts in the output type (bf16/f16), which breaks the float32-accumulation contract (ReLU
  // masks flip near zero on small odd shapes).
  const uint32_t reduction = kAllowedReductionSchemes;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                              sizeof(reduction));
  return st;
}

// A search preference for `spec` with a workspace of `ws` bytes (SetPreference), destroyed with it.
class Preference {
 public:
  Preference(const GemmSpec& spec, uint64_t ws) {
    status_ = cublasLtMatmulPreferenceCreate(&pref_);
    if (status_ == CUBLAS_STATUS_SUCCESS) status_ = SetPreference(spec, ws, pref_);
  }
  ~Preference() {
    if (pref_ != nullptr) cublasLtMatmulPreferenceDestroy(pref_);
  }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
  cublasLtMatmulPreference_t get() const { return pref_; }
  cublasStatus_t status() const { return status_; }

 private:
  cublasLtMatmulPreference_t pref_ = nullptr;
  cublasStatus_t status_ = CUBLAS_STATUS_NOT_INITIALIZED;
};

// cuBLASLt's heuristic results (up to kMaxCandidates, in its order, state SUCCESS only) for p's
// descriptor and layouts as they are now, into *out; returns cuBLASLt's status.
cublasStatus_t Heuristic(cublasLtHandle_t handle, const GemmPlan& p, cublasLtMatmulPreference_t pref,
                         std::vector<cublasLtMatmulHeuristicResult_t>* out) {
  out->clear();
  std::vector<cublasLtMatmulHeuristicResult_t> results(kMaxCandidates);
  int returned = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.la, p.lb, p.ld, p.ld, pref,
                                                           kMaxCandidates, results.data(), &returned);
  for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) out->push_back(results[i]);
  }
  return st;
}

// Whether `algo` is a candidate for p as its descriptor is now: cublasLtMatmulAlgoCheck accepts it
// with a workspace of at most `ws` bytes. *checked: the check's result, with the algorithm.
bool Usable(cublasLtHandle_t handle, const GemmPlan& p, const cublasLtMatmulAlgo_t& algo, uint64_t ws,
            cublasLtMatmulHeuristicResult_t* checked) {
  *checked = {};
  if (cublasLtMatmulAlgoCheck(handle, p.desc, p.la, p.lb, p.ld, p.ld, &algo, checked) != CUBLAS_STATUS_SUCCESS ||
      checked->state != CUBLAS_STATUS_SUCCESS || checked->workspaceSize > ws) {
    return false;
  }
  checked->algo = algo;
  return true;
}

// The candidates for p (descriptor and layouts of p.spec, pointers set) under `pref` (a workspace of
// `ws` bytes): the heuristic's results that Usable accepts, in the heuristic's order, into *cands.
// Empty, and Success, when cuBLASLt has none (NOT_SUPPORTED / INVALID_VALUE). The one filter of both
// GetPlan and the support query (CountAlgorithms), so a shape the query approves has a candidate here.
ffi::Error Candidates(const char* op, cublasLtHandle_t handle, const GemmPlan& p, const Preference& pref, uint64_t ws,
                      std::vector<cublasLtMatmulHeuristicResult_t>* cands) {
  cands->clear();
  std::vector<cublasLtMatmulHeuristicResult_t> offered;
  cublasStatus_t st = pref.status();
  if (st == CUBLAS_STATUS_SUCCESS) st = Heuristic(handle, p, pref.get(), &offered);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) return ffi::Error::Success();
  if (st != CUBLAS_STATUS_SUCCESS) {
    return LtError(op, st, "the algorithm search (preference, heuristic) for " + p.spec.Describe());
  }
  for (const auto& r : offered) {
    cublasLtMatmulHeuristicResult_t checked;
    if (Usable(handle, p, r.algo, ws, &checked)) cands->push_back(checked);
  }
  return ffi::Error::Success();
}
}  // namespace

ffi::Error GetPlan(const char* op, int device, DeviceState& dev, const GemmSpec& spec, const GemmPtrs& ptrs,
                   bool create, bool time_candidates, GemmPlan** plan) {
  const int forced = ForcedCandidate();
  const std::string key =
      std::to_string(device) + "|" + spec.Key() + (forced >= 0 ? "|forced" + std::to_string(forced) : "");
  {
    std::lock_guard<std::mutex> lock(StateMutex());
    auto it = Plans().find(key);
    if (it != Plans().end()) {
      *plan = it->second.get();  // null: no algorithm for this spec (cached)
      return ffi::Error::Success();
    }
  }
  if (!create) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("te_ops.") + op + ": no cuBLASLt plan prepared for " + spec.Describe() +
                          " (the handler's initialize stage did not run for this shape)");
  }
  DeviceGuard guard(device);
  const std::string what = spec.Describe();
  auto p = std::make_unique<GemmPlan>();
  p->spec = spec;
  p->device = device;
  TE_RETURN_IF_ERROR(CreateDescriptors(op, spec, p.get()));
  // Pointers the heuristic sees (it reads their alignment): the real ones of this call.
  TE_RETURN_IF_ERROR(SetPointers(op, *p, ptrs));

  const uint64_t ws = dev.workspace_bytes;
  const Preference pref(spec, ws);
  const cublasLtEpilogue_t epi = spec.epilogue;
  std::vector<cublasLtMatmulHeuristicResult_t> cands;
  TE_RETURN_IF_ERROR(Candidates(op, dev.handle, *p, pref, ws, &cands));
  // The heuristic offers few tile configurations for fused epilogues (for GELU_AUX_BIAS on a large
  // MLP shape, a handful, without the tile it ranks first for BIAS). So also ask it for
  // the simpler epilogues this one extends (same shapes and preference) and keep, after cuBLASLt's own
  // list, each new algorithm that cublasLtMatmulAlgoCheck accepts for the real epilogue: the timing
  // below then decides among all of them.
  if (!cands.empty()) p->own_candidates = static_cast<int>(cands.size());
  for (const cublasLtEpilogue_t sibling : SimplerEpilogues(epi)) {
    if (cands.empty() || cands.size() >= static_cast<size_t>(kMaxCandidates)) break;
    std::vector<cublasLtMatmulHeuristicResult_t> more;
    const bool ok = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &sibling,
                                                   sizeof(sibling)) == CUBLAS_STATUS_SUCCESS &&
                    Heuristic(dev.handle, *p, pref.get(), &more) == CUBLAS_STATUS_SUCCESS;
    const cublasStatus_t reset =
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    if (reset != CUBLAS_STATUS_SUCCESS) return LtError(op, reset, "restoring the epilogue of " + what);
    for (size_t i = 0; ok && i < more.size() && cands.size() < static_cast<size_t>(kMaxCandidates); ++i) {
      bool seen = false;
      for (const auto& c : cands) seen = seen || std::memcmp(&c.algo, &more[i].algo, sizeof(c.algo)) == 0;
      cublasLtMatmulHeuristicResult_t checked;
      if (!seen && Usable(dev.handle, *p, more[i].algo, ws, &checked)) cands.push_back(checked);
    }
  }
  GemmPlan* raw = nullptr;
  if (!cands.empty()) {
    float best_ms = -1.0f;
    p->candidate_ms.assign(cands.size(), -1.0f);  // stays -1 where not timed
    int best = -1;
    if (forced >= 0) {  // test hook: this one candidate (still probed: one cuBLASLt refuses -> no plan)
      const size_t i = std::min(static_cast<size_t>(forced), cands.size() - 1);
      std::vector<float> ms;
      const int ran = time_candidates ? TimeCandidates(dev, *p, {cands[i]}, &best_ms, &ms) : 0;
      if (ran == 0) {
        best = static_cast<int>(i);
        p->candidate_ms[i] = best_ms;
      }
      p->forced = forced;
    } else {
      best = time_candidates ? TimeCandidates(dev, *p, cands, &best_ms, &p->candidate_ms) : 0;
    }
    if (best >= 0) {
      p->algo = cands[best].algo;
      p->workspace_bytes = dev.workspace_bytes;  // any size >= the algorithm's need is allowed
      p->candidates = static_cast<int>(cands.size());
      p->best_ms = best_ms;
      p->chosen = best;
      raw = p.get();
    }
  }
  std::lock_guard<std::mutex> lock(StateMutex());
  auto& slot = Plans()[key];
  if (slot == nullptr && raw != nullptr) slot = std::move(p);
  *plan = slot.get();
  return ffi::Error::Success();
}

namespace {
// The chosen algorithm's configuration (cuBLASLt algo config attributes; -1 where unreadable).
AlgoInfo AlgoConfig(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr, auto zero) -> int64_t {
    decltype(zero) v = zero;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return -1;
    return static_cast<int64_t>(v);
  };
  AlgoInfo a;
  a.id = get(CUBLASLT_ALGO_CONFIG_ID, int32_t{0});
  a.tile = get(CUBLASLT_ALGO_CONFIG_TILE_ID, uint32_t{0});
  a.stages = get(CUBLASLT_ALGO_CONFIG_STAGES_ID, uint32_t{0});
  a.split_k = get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, int32_t{0});
  a.reduction_scheme = get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, uint32_t{0});
  a.swizzle = get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, uint32_t{0});
  a.custom = get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, uint32_t{0});
  a.cluster_shape = get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, uint16_t{0});
  return a;
}
}  // namespace

std::vector<PlanInfo> PlanSnapshot() {
  std::lock_guard<std::mutex> lock(StateMutex());
  std::vector<PlanInfo> out;
  for (const auto& entry : Plans()) {
    const GemmPlan* plan = entry.second.get();
    if (plan == nullptr) continue;  // a spec without an algorithm
    PlanInfo info;
    info.device = plan->device;
    info.describe = plan->spec.Describe();
    info.m = plan->spec.m;
    info.n = plan->spec.n;
    info.k = plan->spec.k;
    info.trans_a = plan->spec.trans_a;
    info.trans_b = plan->spec.trans_b;
    info.epilogue = static_cast<int>(plan->spec.epilogue);
    info.candidates = plan->candidates;
    info.own_candidates = plan->own_candidates;
    info.forced = plan->forced;
    info.chosen = plan->chosen;
    info.best_ms = plan->best_ms;
    info.candidate_ms = plan->candidate_ms;
    info.algo = AlgoConfig(plan->algo);
    out.push_back(std::move(info));
  }
  return out;
}

ffi::Error RunGemm(const char* op, DeviceState& dev, GemmPlan& plan, const GemmPtrs& ptrs, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(plan.mu);
  TE_RETURN_IF_ERROR(SetPointers(op, plan, ptrs));
  cublasStatus_t st = Matmul(dev, plan, ptrs, plan.algo, stream, dev.workspace, plan.workspace_bytes);
  if (st != CUBLAS_STATUS_SUCCESS) return LtError(op, st, "cublasLtMatmul for " + plan.spec.Describe());
  return ffi::Error::Success();
}

ffi::Error CountAlgorithms(const char* op, int device, const GemmSpec& spec, int* count) {
  *count = 0;
  std::unique_ptr<DeviceGuard> guard;
  if (device >= 0) {
    guard = std::make_unique<DeviceGuard>(device);
    if (!guard->ok()) return CudaError(op, cudaGetLastError(), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  // One handle for queries (created once, kept for the process): a cuBLASLt handle is not tied to a
  // device, and the query needs no workspace, so no DeviceState (whose 32 MiB workspace XLA's
  // initialize stage allocates) is created on a device that may never run a GEMM.
  static std::mutex mu;
  static cublasLtHandle_t handle = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (handle == nullptr) TE_LT_CHECK(op, cublasLtCreate(&handle), "cublasLtCreate (support query)");
  GemmPlan p;  // descriptors only: never cached, never run
  p.spec = spec;
  TE_RETURN_IF_ERROR(CreateDescriptors(op, spec, &p));
  // Stand-in pointers, 256-byte aligned like XLA's buffers: the heuristic reads no device memory.
  void* const fake = reinterpret_cast<void*>(uintptr_t{256});
  const GemmPtrs ptrs{fake, fake, fake, HasBias(spec.epilogue) ? fake : nullptr, HasAux(spec.epilogue) ? fake : nullptr,
                      spec.scale_mode_a >= 0 ? fake : nullptr, spec.scale_mode_b >= 0 ? fake : nullptr};
  TE_RETURN_IF_ERROR(SetPointers(op, p, ptrs));
  // GetPlan's candidate list, before timing (the workspace of a DeviceState: kWorkspaceBytes)
  std::vector<cublasLtMatmulHeuristicResult_t> cands;
  TE_RETURN_IF_ERROR(Candidates(op, handle, p, Preference(spec, kWorkspaceBytes), kWorkspaceBytes, &cands));
  *count = static_cast<int>(cands.size());
  return ffi::Error::Success();
}

}  // namespace te::dense
