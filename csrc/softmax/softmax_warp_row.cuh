// Warp-per-row softmax forward. kWarpRow is the default forward for rows of 129..512 16-byte vectors
// (ChooseConfigFor); kWarpRowPacked is a SetTuning choice (see softmax.h). The backward is the
// register kernel's (softmax_kernels.cuh), whose header also states the semantics, non-finite
// inputs included.
//
// One warp owns one row of up to 32 * NV 16-byte vectors (NV = 16: a 4096-wide bf16/f16 row, a
// 2048-wide f32 row). The row stays in registers as raw 32-bit words (NV * 4 of them), never as
// fp32, so a thread holds 64 data registers for a 4096-wide bf16 row instead of the register
// kernel's 32 fp32 values per thread at 4x the threads. All reductions are warp shuffles: no shared
// memory, no barrier, and the four warps of a block are independent rows.
//
//   kWarpRow       exp2 is computed twice (once for the sum, once for the output): exact fp32
//                  maths, any of f32/bf16/f16.
//   kWarpRowPacked bf16 only: the exponentials, offset by 2^14 so that they stay normal fp16
//                  numbers, overwrite the raw words as packed half2 (one exp2 per element). fp16
//                  keeps 11 bits, three more than the bf16 output; the 2^14 offset cancels in
//                  e / sum because the sum uses the same (fp32) values.
//
// Masking happens once, on the raw words: every masked element inside a loaded vector is replaced
// by the input value that maps to -inf (-inf if scale > 0, +inf if scale < 0), so the max, sum and
// write passes need no per-element mask test; vectors that are masked everywhere are not read
// and not computed (their output is stored as zeros). The host falls back to the register kernel
// for scale == 0.
//
// Non-finite inputs: the packed max ignores NaN. A row whose max scaled logit is +inf, or whose sum
// is NaN (a NaN input), or whose max is -inf while a live element is NaN, is a NaN row: it leaves
// the fast path and is written by WriteNanRow (NaN where unmasked, 0 where masked).
#pragma once

#include "softmax/softmax_kernels.cuh"

namespace te::softmax {

constexpr int kWarpRowThreads = 128;  // 4 rows (warps) per block
// At most 65536 / (128 * 5) = 102 registers per thread: 5 blocks = 20 warps (20 rows) per SM.
constexpr int kWarpRowMinBlocks = 6;

// Reinterprets the bits of a 16- or 32-bit value (memcpy: no aliasing UB; compiles to a move).
template <typename To, typename From>
__device__ __forceinline__ To BitCast(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "BitCast needs equal sizes");
  To r;
  memcpy(&r, &v, sizeof(To));
  return r;
}

// 32-bit words of the raw row: 2 x 16-bit or 1 x f32 element.
template <typename T>
struct Words;

// The two 16-bit specialisations share the packed min/max of a word's two elements.
template <typename T2>
struct HalfPairWords {
  static constexpr int kPerWord = 2;
  template <bool kMin>
  __device__ static __forceinline__ uint32_t Max(uint32_t a, uint32_t b) {
    const T2 x = BitCast<T2>(a), y = BitCast<T2>(b);
    return BitCast<uint32_t>(kMin ? __hmin2(x, y) : __hmax2(x, y));
  }
};

template <>
struct Words<__nv_bfloat16> : HalfPairWords<__nv_bfloat162> {
  static constexpr uint32_t kNegInf = 0xFF80FF80u;
  static constexpr uint32_t kPosInf = 0x7F807F80u;
  __device__ static __forceinline__ float Elem(uint32_t w, int e) {
    return __uint_as_float(e == 0 ? (w << 16) : (w & 0xFFFF0000u));
  }
  __device__ static __forceinline__ uint32_t Pack(float lo, float hi) {
    return BitCast<uint32_t>(__floats2bfloat162_rn(lo, hi));
  }
  __device__ static __forceinline__ bool HasNaN(uint32_t w) {
    return (w & 0x7FFFu) > 0x7F80u || ((w >> 16) & 0x7FFFu) > 0x7F80u;
  }
};

template <>
struct Words<__half> : HalfPairWords<__half2> {
  static constexpr uint32_t kNegInf = 0xFC00FC00u;
  static constexpr uint32_t kPosInf = 0x7C007C00u;
  __device__ static __forceinline__ float Elem(uint32_t w, int e) {
    const unsigned short s = static_cast<unsigned short>(e == 0 ? (w & 0xFFFFu) : (w >> 16));
    return __half2float(BitCast<__half>(s));
  }
  __device__ static __forceinline__ uint32_t Pack(float lo, float hi) {
    return BitCast<uint32_t>(__floats2half2_rn(lo, hi));
  }
  __device__ static __forceinline__ bool HasNaN(uint32_t w) {
    return (w & 0x7FFFu) > 0x7C00u || ((w >> 16) & 0x7FFFu) > 0x7C00u;
  }
};

template <>
struct Words<float> {
  static constexpr int kPerWord = 1;
  static constexpr uint32_t kNegInf = 0xFF800000u;
  static constexpr uint32_t kPosInf = 0x7F800000u;
  __device__ static __forceinline__ float Elem(uint32_t w, int) { return __uint_as_float(w); }
  __device__ static __forceinline__ uint32_t Pack(float lo, float) { return __float_as_uint(lo); }
  __device__ static __forceinline__ bool HasNaN(uint32_t w) { return (w & 0x7FFFFFFFu) > 0x7F800000u; }
  template <bool kMin>
  __device__ static __forceinline__ uint32_t Max(uint32_t a, uint32_t b) {
    return __float_as_uint(kMin ? fminf(__uint_as_float(a), __uint_as_float(b))
                                : fmaxf(__uint_as_float(a), __uint_as_float(b)));
  }
};

// prmt.b32 with sign replication (selector nibble bit 3): each result byte is 0xFF or 0x00 by the
// top bit of the selected source byte. __byte_perm ignores that bit, hence the asm.
__device__ __forceinline__ uint32_t PrmtSign(uint32_t a, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(a), "r"(sel));
  return r;
}

// Bit 7 of each byte of the result is set iff that byte of `m` is non-zero (a bool mask byte).
__device__ __forceinline__ uint32_t MaskByteFlags(uint32_t m) {
  return (((m & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | m) & 0x80808080u;
}

// Replaces, in the 4 raw words of one 16-byte vector, every element whose flag is set by
// `sentinel`. `f[h]` holds the flags of elements 4h..4h+3 in bit 7 of bytes 0..3.
template <int kPerWord>
__device__ __forceinline__ void ApplyFlags(uint32_t (&w)[4], const uint32_t* f, uint32_t sentinel) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t sel;
    uint32_t flags;
    if constexpr (kPerWord == 2) {
      flags = f[j / 2];
      sel = (j % 2 == 0) ? 0x9988u : 0xBBAAu;  // elements (0,1) resp. (2,3) of the flag word
    } else {
      flags = f[0];
      sel = 0x8888u + 0x1111u * j;  // element j
    }
    const uint32_t hm = PrmtSign(flags, sel);
    w[j] = (w[j] & ~hm) | (sentinel & hm);
  }
}

// 2^x on the MUFU unit, flushing results below 2^-126 to zero (exp2f adds a denormal fix-up of
// three instructions per call; a probability below 1.2e-38 is zero in any output here).
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// min(a, b) that returns NaN when either is NaN (fminf would drop it).
__device__ __forceinline__ float MinNaN(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Writes a NaN row (see the header): every existing vector of this lane, NaN on unmasked elements,
// exactly 0 on masked ones. `first_col` is this lane's first column, `mrow` the row's mask (kMask),
// `q` its query position (kCausal). Not inlined: it stays out of the fast path's code and registers.
template <typename T, int NV, MaskMode MODE>
__device__ __noinline__ void WriteNanRow(uint4* ov, const uint8_t* mrow, int q, int first_col, int cols) {
  using W = Words<T>;
  constexpr int kEpw = W::kPerWord;
  constexpr int VEC = 4 * kEpw;
  for (int i = 0; i < NV; ++i) {
    const int col = first_col + 32 * VEC * i;
    if (col >= cols) break;
    uint32_t ow[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float lo = NanRowValue<MODE>(mrow, q, col + j * kEpw);
      const float hi = kEpw == 2 ? NanRowValue<MODE>(mrow, q, col + j * kEpw + 1) : 0.f;
      ow[j] = W::Pack(lo, hi);
    }
    StoreStream(ov + 32 * i, make_uint4(ow[0], ow[1], ow[2], ow[3]));
  }
}

// Whole-warp max / sum: softmax_kernels.cuh's row-group reduction with a group of one warp (no
// shared memory is touched for groups of <= 32 threads).
__device__ __forceinline__ float WarpMax(float v) { return GroupReduce<true>(v, 32, nullptr); }
__device__ __forceinline__ float WarpSum(float v) { return GroupReduce<false>(v, 32, nullptr); }

// Makes the compiler forget what it knows about the raw words, so it recomputes conversions in
// the next pass instead of keeping 2 * NV * 4 fp32 values live across the warp reduction (that is
// what made the register-kernel-layout recompute variant grow to 74-88 registers).
template <int NV>
__device__ __forceinline__ void Opaque(uint32_t (&w)[NV][4]) {
#pragma unroll
  for (int i = 0; i < NV; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(w[i][j]));
  }
}

// The mask row for WriteNanRow, recomputed from the row index (made opaque, so the compiler does
// not keep the first computation's registers alive through the whole kernel for this rare path).
__device__ __forceinline__ const uint8_t* NanRowMask(const Params& p, int64_t row, MaskMode mode) {
  if (mode != MaskMode::kMask) return nullptr;
  asm("" : "+l"(row));
  return p.mask + MakeRow(p, row, mode).mask_offset;
}

template <typename T, int NV, MaskMode MODE, bool kPacked>
__global__ void __launch_bounds__(kWarpRowThreads, kWarpRowMinBlocks) SoftmaxForwardWarpRowKernel(Params p) {
  using W = Words<T>;
  constexpr int kEpw = W::kPerWord;
  constexpr int VEC = 4 * kEpw;          // elements per 16-byte vector
  constexpr int kFpv = VEC / 4;          // flag words per vector (4 elements each)
  constexpr int kNr = (NV * kFpv + 7) / 8;  // registers of packed flags (8 flag words each)
  static_assert(!kPacked || kEpw == 2, "packed exponentials need 16-bit elements");

  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kWarpRowThreads / 32) + threadIdx.x / 32;
  if (row >= p.rows) return;  // whole warp
  const RowInfo r = MakeRow(p, row, MODE);
  const int cols = static_cast<int>(p.cols);  // <= 32 * NV * VEC (host check)
  const int q = static_cast<int>(r.q);
  const float s2 = p.scale * kLog2e;  // != 0 (host check)
  const bool neg = s2 < 0.f;
  const uint32_t sentinel = neg ? W::kPosInf : W::kNegInf;  // the input whose scaled logit is -inf
  // Lane-based pointers: vector i of this lane is at [32 * i], an immediate offset.
  const uint4* xv = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + row * p.cols) + lane;
  uint4* ov = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row * p.cols) + lane;
  // (Opaque to the compiler: otherwise it folds lane + 32 * i into a 32-bit index and keeps one
  // 64-bit address per vector, 32 registers for NV = 16, instead of immediate offsets.)
  asm("" : "+l"(xv));
  asm("" : "+l"(ov));
  // Vector i of this lane starts at column lane * VEC + 32 * VEC * i: every test below compares a
  // per-lane value with a constant, so no per-vector column or predicate has to stay live.
  const int cols_rel = cols - lane * VEC;  // vector i exists iff 32 * VEC * i < cols_rel
  const int q_rel = q - lane * VEC;        // causal: vector i is live iff 32 * VEC * i <= q_rel
  auto exists = [&](int i) { return 32 * VEC * i < cols_rel; };

  // Which vectors hold an unmasked element; explicit masks keep their flags packed (see ApplyFlags).
  uint32_t live_bits = 0;
  uint32_t packed_flags[kNr];
#pragma unroll
  for (int k = 0; k < kNr; ++k) packed_flags[k] = 0;
  if constexpr (MODE == MaskMode::kMask) {
    const uint8_t* mrow = p.mask + r.mask_offset + lane * VEC;
    asm("" : "+l"(mrow));
    uint32_t mw[NV][kFpv];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (exists(i)) {
        if constexpr (kFpv == 2) {
          const uint2 m = __ldg(reinterpret_cast<const uint2*>(mrow) + 32 * i);
          mw[i][0] = m.x;
          mw[i][1] = m.y;
        } else {
          mw[i][0] = __ldg(reinterpret_cast<const unsigned int*>(mrow) + 32 * i);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (!exists(i)) continue;
      uint32_t all = 0x80808080u;
#pragma unroll
      for (int h = 0; h < kFpv; ++h) {
        const uint32_t f = MaskByteFlags(mw[i][h]);
        all &= f;
        const int g = i * kFpv + h;
        packed_flags[g / 8] |= f >> (g % 8);
      }
      if (all != 0x80808080u) live_bits |= 1u << i;
    }
  }
  auto is_live = [&](int i) -> bool {
    if constexpr (MODE == MaskMode::kCausal) return 32 * VEC * i <= q_rel;  // q < cols
    else if constexpr (MODE == MaskMode::kMask) return (live_bits >> i) & 1u;
    else return exists(i);
  };

  // Load the live vectors (all loads issued before any use), then mask on the raw words. Vectors
  // that are not read hold the sentinel, so the max pass runs over all NV vectors unpredicated.
  uint32_t w[NV][4];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    uint4 v = make_uint4(sentinel, sentinel, sentinel, sentinel);
    if (is_live(i)) v = LoadStream(xv + 32 * i);
    w[i][0] = v.x;
    w[i][1] = v.y;
    w[i][2] = v.z;
    w[i][3] = v.w;
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (!is_live(i)) continue;
    if constexpr (MODE == MaskMode::kMask) {
      uint32_t f[kFpv];
#pragma unroll
      for (int h = 0; h < kFpv; ++h) {
        const int g = i * kFpv + h;
        f[h] = packed_flags[g / 8] << (g % 8);
      }
      ApplyFlags<kEpw>(w[i], f, sentinel);
    } else if constexpr (MODE == MaskMode::kCausal) {
      const int d = q_rel + 1 - 32 * VEC * i;  // live elements of this vector (>= 1 here)
      if (d < VEC) {                    // the one vector of the row that straddles the diagonal
        uint32_t f[kFpv];
#pragma unroll
        for (int h = 0; h < kFpv; ++h) {
          const int dh = d - 4 * h;  // live elements of this flag word
          f[h] = dh >= 4 ? 0u : (0x80808080u << (8 * (dh < 0 ? 0 : dh)));
        }
        ApplyFlags<kEpw>(w[i], f, sentinel);
      }
    }
  }

  // Pass 1: max of the scaled logits = scale * (max or min of x), on packed words.
  float m;
  {
    uint32_t acc = sentinel;
    if (!neg) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc = W::template Max<false>(acc, w[i][j]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc = W::template Max<true>(acc, w[i][j]);
      }
    }
    float mx = W::Elem(acc, 0);
    if constexpr (kEpw == 2) mx = neg ? fminf(mx, W::Elem(acc, 1)) : fmaxf(mx, W::Elem(acc, 1));
    m = WarpMax(mx * s2);  // -inf for a lane/row with no unmasked element above -inf
  }
  if (m == -INFINITY) {  // masked everywhere (or all -inf): zeros, unless a live element is NaN
    bool nan = false;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (!is_live(i)) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) nan = nan || W::HasNaN(w[i][j]);
    }
    if (__any_sync(0xffffffffu, nan)) {
      WriteNanRow<T, NV, MODE>(ov, NanRowMask(p, row, MODE), q, lane * VEC, cols);
      return;
    }
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (exists(i)) StoreStream(ov + 32 * i, make_uint4(0, 0, 0, 0));
    return;
  }
  if (m == INFINITY) {  // a +inf logit
    WriteNanRow<T, NV, MODE>(ov, NanRowMask(p, row, MODE), q, lane * VEC, cols);
    return;
  }
  Opaque<NV>(w);

  // Pass 2: sum of exp2(s2 * x - m) (kPacked: exponentials kept as half2, offset by 2^14).
  float sum = 0.f;
  const float c = kPacked ? 14.f - m : -m;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (!is_live(i)) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (kPacked) {
        // The clamp only matters for |scale * x| > 2^25 (rounding of 14 - m); 2^15.9 < 65504. It
        // keeps NaN (a NaN input), so the sum below turns NaN.
        const float e0 = Exp2Ftz(MinNaN(fmaf(W::Elem(w[i][j], 0), s2, c), 15.9f));
        const float e1 = Exp2Ftz(MinNaN(fmaf(W::Elem(w[i][j], 1), s2, c), 15.9f));
        sum += e0 + e1;
        w[i][j] = BitCast<uint32_t>(__floats2half2_rn(e0, e1));
      } else {
#pragma unroll
        for (int e = 0; e < kEpw; ++e) sum += Exp2Ftz(fmaf(W::Elem(w[i][j], e), s2, c));
      }
    }
  }
  sum = WarpSum(sum);
  // sum >= ~1 (kPacked: ~2^14): the max element contributes; so a sum that is not > 0 is NaN (a
  // NaN input).
  if (!(sum > 0.f)) {
    WriteNanRow<T, NV, MODE>(ov, NanRowMask(p, row, MODE), q, lane * VEC, cols);
    return;
  }
  const float inv = 1.f / sum;
  if constexpr (!kPacked) Opaque<NV>(w);

  // Pass 3: write the whole row (masked-everywhere vectors as zeros).
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (!exists(i)) continue;
    uint4 o = make_uint4(0, 0, 0, 0);
    if (is_live(i)) {
      uint32_t ow[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (kPacked) {
          const float2 e = __half22float2(BitCast<__half2>(w[i][j]));
          ow[j] = W::Pack(e.x * inv, e.y * inv);
        } else {
          const float y0 = Exp2Ftz(fmaf(W::Elem(w[i][j], 0), s2, c)) * inv;
          const float y1 = kEpw == 2 ? Exp2Ftz(fmaf(W::Elem(w[i][j], 1), s2, c)) * inv : 0.f;
          ow[j] = W::Pack(y0, y1);
        }
      }
      o = make_uint4(ow[0], ow[1], ow[2], ow[3]);
    }
    StoreStream(ov + 32 * i, o);
  }
}

}  // namespace te::softmax
