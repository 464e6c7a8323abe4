// Building blocks of the router row kernels (router_kernels.cuh): order-preserving keys, warp
// reductions, a lane's slice of a row (loads, stores, routing-map bits) and the warp top-k.
//
// Layout. The warp that owns a token row gives lane l the EPT CONTIGUOUS experts
// [l * EPT, l * EPT + EPT), EPT = ElementsPerLane(E) (the smallest power of two with 32 * EPT >= E).
// Contiguous slices give
//  * vector memory access: with E % EPT == 0 and 16-byte aligned buffers ("kVec") a lane moves its
//    slice with loads/stores of up to 16 bytes (E=256 fp32: two 16-byte loads per lane instead of
//    eight 4-byte ones); otherwise element by element with bounds checks (same results);
//  * a free tie-break: every expert of lane l has a smaller index than every expert of lane l + 1,
//    so among lanes offering the same best key the LOWEST LANE holds the smallest expert index
//    (ballot + find-first-set instead of a second warp reduction).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/convert.cuh"
#include "router/router.h"

namespace te::router {

constexpr unsigned kFull = 0xffffffffu;
constexpr float kSigmoidEps = 1e-20f;

// ---- keys ---------------------------------------------------------------------------------------

// Order-preserving float -> uint32 map (a < b  <=>  Key(a) < Key(b) for non-NaN floats; -0 < +0).
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t b = __float_as_uint(f);
  return b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) | 0x80000000u);
}

// Inverse of OrderedKey.
__device__ __forceinline__ float KeyFloat(uint32_t k) {
  return __uint_as_float(k ^ (static_cast<uint32_t>(~(static_cast<int32_t>(k) >> 31)) | 0x80000000u));
}

// Selection key: valid experts get keys >= 1; 0 marks "not selectable" (outside the row, masked group).
__device__ __forceinline__ uint32_t SelectKey(float f) { return max(OrderedKey(f), 1u); }

// ---- warp reductions ----------------------------------------------------------------------------

__device__ __forceinline__ uint32_t WarpMaxU(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFull, v);  // one redux.sync
#else
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFull, v, o));
  return v;
#endif
}

// Exact float max over the warp through the integer keys (one redux.sync instead of 5 shuffles).
__device__ __forceinline__ float WarpMaxF(float v) { return KeyFloat(WarpMaxU(OrderedKey(v))); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Two independent sums, interleaved so that their shuffle latencies overlap.
__device__ __forceinline__ void WarpSum2(float& a, float& b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ta = __shfl_xor_sync(kFull, a, o);
    const float tb = __shfl_xor_sync(kFull, b, o);
    a += ta;
    b += tb;
  }
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// exp(d) for d = x - max <= 0, the softmax weights over the chosen logits: ex2.approx of
// d * log2(e), 3 instructions instead of expf's 9, branch-free. Relative error <= ~2 ulp +
// |d| * 2^-24 (d is exact or nearly so for the logits close to the max, which carry the weight);
// results below 2^-126 flush to 0.
__device__ __forceinline__ float ExpNonPos(float d) {
  const float a = d * 1.4426950408889634f;
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
#else
  return exp2f(a);
#endif
}

// ---- element bits -------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float BitsToF(uint32_t b);
template <>
__device__ __forceinline__ float BitsToF<float>(uint32_t b) { return __uint_as_float(b); }
template <>
__device__ __forceinline__ float BitsToF<__nv_bfloat16>(uint32_t b) { return __uint_as_float(b << 16); }
template <>
__device__ __forceinline__ float BitsToF<__half>(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}

template <typename T>
__device__ __forceinline__ uint32_t FToBits(float f);
template <>
__device__ __forceinline__ uint32_t FToBits<float>(float f) { return __float_as_uint(f); }
template <>
__device__ __forceinline__ uint32_t FToBits<__nv_bfloat16>(float f) {
  return __bfloat16_as_ushort(__float2bfloat16(f));
}
template <>
__device__ __forceinline__ uint32_t FToBits<__half>(float f) { return __half_as_ushort(__float2half(f)); }

// Loads (read-only path) and stores of 1, 2, 4, 8 or 16 bytes as 32-bit words (a 1- or 2-byte
// value lands in the low bits of w[0], the rest of the word zero). kStream: evict-first stores
// (cache-streaming) for the large dense outputs, so they do not push the routing map out of L2.
template <int kBytes>
struct Vec;
template <>
struct Vec<16> {
  static __device__ __forceinline__ void Load(const void* p, uint32_t* w) {
    const uint4 v = __ldg(static_cast<const uint4*>(p));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  }
  template <bool kStream>
  static __device__ __forceinline__ void Store(void* p, const uint32_t* w) {
    const uint4 v = make_uint4(w[0], w[1], w[2], w[3]);
    if constexpr (kStream) __stcs(static_cast<uint4*>(p), v);
    else *static_cast<uint4*>(p) = v;
  }
};
template <>
struct Vec<8> {
  static __device__ __forceinline__ void Load(const void* p, uint32_t* w) {
    const uint2 v = __ldg(static_cast<const uint2*>(p));
    w[0] = v.x, w[1] = v.y;
  }
  template <bool kStream>
  static __device__ __forceinline__ void Store(void* p, const uint32_t* w) {
    const uint2 v = make_uint2(w[0], w[1]);
    if constexpr (kStream) __stcs(static_cast<uint2*>(p), v);
    else *static_cast<uint2*>(p) = v;
  }
};
// 4- and 2-byte accesses: one scalar U in the low bits of w[0].
template <typename U>
struct ScalarVec {
  static __device__ __forceinline__ void Load(const void* p, uint32_t* w) { w[0] = __ldg(static_cast<const U*>(p)); }
  template <bool kStream>
  static __device__ __forceinline__ void Store(void* p, const uint32_t* w) {
    const auto v = static_cast<U>(w[0]);
    if constexpr (kStream) __stcs(static_cast<U*>(p), v);
    else *static_cast<U*>(p) = v;
  }
};
template <>
struct Vec<4> : ScalarVec<unsigned int> {};
template <>
struct Vec<2> : ScalarVec<unsigned short> {};
template <>
struct Vec<1> {
  static __device__ __forceinline__ void Load(const void* p, uint32_t* w) {
    w[0] = __ldg(static_cast<const unsigned char*>(p));
  }
  template <bool kStream>
  static __device__ __forceinline__ void Store(void* p, const uint32_t* w) {
    *static_cast<unsigned char*>(p) = static_cast<unsigned char>(w[0]);
  }
};

// ---- a lane's slice of a row --------------------------------------------------------------------

// The EPT elements [e0, e0 + EPT) of one row, T = float / bf16 / fp16 / uint8 (map bytes), held as
// RAW 32-bit words and converted only when read: a prefetched slice therefore stays in flight
// until its first use. kVec: packed as in memory (4 / sizeof(T) elements per word) and moved with
// vectors of up to 16 bytes; otherwise one element per word (packing would wait for the loads).
// Slots past the row (e0 + j >= E) hold arbitrary values (zeros, or a copy of element E - 1):
// every user masks them (Slots, the chosen mask, or the valid mask of the map bits).
template <typename T, int EPT, bool kVec>
struct Slice {
  static constexpr int kSize = static_cast<int>(sizeof(T));
  static constexpr int kPerWord = kVec ? 4 / kSize : 1;
  static constexpr int kWords = (EPT + kPerWord - 1) / kPerWord;
  static constexpr int kBytes = EPT * kSize;
  static constexpr int kChunk = kBytes < 16 ? kBytes : 16;  // bytes per vector access
  static constexpr int kChunks = kBytes / kChunk;
  static constexpr uint32_t kMask = kSize == 4 ? 0xffffffffu : (1u << (8 * kSize)) - 1u;

  uint32_t w[kWords];

  // row: the row's first element; e0 = lane * EPT.
  __device__ __forceinline__ void Load(const T* row, int e0, int E) {
    if constexpr (kVec) {
      if (e0 < E) {  // E % EPT == 0: the slice is entirely inside the row or entirely outside
        const char* src = reinterpret_cast<const char*>(row + e0);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) Vec<kChunk>::Load(src + c * kChunk, w + c * kChunk / 4);
      } else {
#pragma unroll
        for (int i = 0; i < kWords; ++i) w[i] = 0u;
      }
    } else {
      // Clamped indices instead of predicates: every load is valid and unconditional; slots past
      // the row re-read element E - 1 (per-slot predicates would be loop-invariant, hoisted,
      // and spilled).
#pragma unroll
      for (int j = 0; j < EPT; ++j) Vec<kSize>::Load(row + min(e0 + j, E - 1), &w[j]);
    }
  }

  // Load when `pred` (a lane-varying condition), zeros otherwise.
  __device__ __forceinline__ void LoadIf(bool pred, const T* row, int e0, int E) {
    if (pred) {
      Load(row, e0, E);
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = 0u;
    }
  }

  __device__ __forceinline__ uint32_t Bits(int j) const {
    if constexpr (kPerWord == 1) {
      return w[j];
    } else {
      return (w[j / kPerWord] >> (8 * kSize * (j % kPerWord))) & kMask;
    }
  }

  __device__ __forceinline__ float Get(int j) const { return BitsToF<T>(Bits(j)); }
};

// Stores v[0..EPT) (converted to T) at row[e0 ..], slots past the row skipped.
template <typename T, int EPT, bool kVec, bool kStream>
__device__ __forceinline__ void StoreSlice(T* row, int e0, int E, const float (&v)[EPT]) {
  using S = Slice<T, EPT, kVec>;
  if constexpr (kVec) {
    if (e0 >= E) return;
    uint32_t w[S::kWords];
#pragma unroll
    for (int i = 0; i < S::kWords; ++i) w[i] = 0u;
#pragma unroll
    for (int j = 0; j < EPT; ++j) w[j / S::kPerWord] |= FToBits<T>(v[j]) << (8 * S::kSize * (j % S::kPerWord));
    char* dst = reinterpret_cast<char*>(row + e0);
#pragma unroll
    for (int c = 0; c < S::kChunks; ++c) {
      Vec<S::kChunk>::template Store<kStream>(dst + c * S::kChunk, w + c * S::kChunk / 4);
    }
  } else {
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const uint32_t b = FToBits<T>(v[j]);
      if (e0 + j < E) Vec<S::kSize>::template Store<kStream>(row + e0 + j, &b);
    }
  }
}

// ---- routing-map slices -------------------------------------------------------------------------
// Bool map: [T, E] bytes (0/1). Compact map: [T, ceil(E/8)] bytes, expert e in bit e % 8 of byte
// e / 8. A lane's map content is an EPT-bit mask (bit j: expert e0 + j).

// 4 bytes, each 0 or 1, -> 4 bits (byte i -> bit i).
__device__ __forceinline__ uint32_t GatherBytes4(uint32_t w) { return ((w * 0x01020408u) >> 24) & 0xfu; }

// 4 bits -> 4 bytes of 0/1 (bit i -> byte i): the four shifted copies do not overlap.
__device__ __forceinline__ uint32_t SpreadBits4(uint32_t nib) { return (nib * 0x00204081u) & 0x01010101u; }

template <int EPT, bool kVec>
struct MapSlice {
  static constexpr int kPackedBytes = EPT >= 8 ? EPT / 8 : 1;
  Slice<uint8_t, EPT, kVec> bytes;  // bool map
  uint32_t packed;                  // compact map: the byte(s) holding this lane's bits

  __device__ __forceinline__ void Load(const uint8_t* map, int64_t row, int e0, int E, bool compact) {
    if (!compact) {
      bytes.Load(map + row * E, e0, E);
      return;
    }
    const int nb = (E + 7) >> 3;
    const uint8_t* src = map + row * nb + (e0 >> 3);
    packed = 0u;
    if (e0 >= E) return;
    if constexpr (kVec) {
      Vec<kPackedBytes>::Load(src, &packed);  // E % EPT == 0: aligned and inside the row
    } else {
#pragma unroll
      for (int b = 0; b < kPackedBytes; ++b) {
        if ((e0 >> 3) + b < nb) packed |= static_cast<uint32_t>(__ldg(src + b)) << (8 * b);
      }
    }
  }

  // Bit j: expert e0 + j is routed (only within `valid`).
  __device__ __forceinline__ uint32_t Bits(int e0, uint32_t valid, bool compact) const {
    uint32_t bits = 0u;
    if (compact) {
      bits = EPT >= 8 ? packed : packed >> (e0 & 7);
    } else if constexpr (kVec) {
#pragma unroll
      for (int i = 0; i < (EPT + 3) / 4; ++i) bits |= GatherBytes4(__vsetne4(bytes.w[i], 0u)) << (4 * i);
    } else {
#pragma unroll
      for (int j = 0; j < EPT; ++j) bits |= (bytes.w[j] != 0u ? 1u : 0u) << j;
    }
    return bits & valid;
  }
};

// Writes this lane's EPT map bits. Every lane of the warp must call it (compact maps with EPT < 8
// combine the bits of 8 / EPT lanes into one byte with shuffles).
template <int EPT, bool kVec>
__device__ __forceinline__ void StoreMap(uint8_t* map, int64_t row, int e0, int E, uint32_t bits, bool compact) {
  if (!compact) {
    uint8_t* dst = map + row * E + e0;
    if constexpr (kVec) {
      if (e0 >= E) return;
      constexpr int kWords = (EPT + 3) / 4;
      uint32_t w[kWords];
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = SpreadBits4((bits >> (4 * i)) & 0xfu);
      constexpr int kChunk = EPT < 16 ? EPT : 16;
#pragma unroll
      for (int c = 0; c < EPT / kChunk; ++c) Vec<kChunk>::template Store<false>(dst + c * kChunk, w + c * kChunk / 4);
    } else {
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        if (e0 + j < E) dst[j] = static_cast<uint8_t>((bits >> j) & 1u);
      }
    }
    return;
  }
  const int nb = (E + 7) >> 3;
  uint8_t* dst = map + row * nb + (e0 >> 3);
  if constexpr (EPT >= 8) {
    if (e0 >= E) return;
    if constexpr (kVec) {
      Vec<EPT / 8>::template Store<false>(dst, &bits);
    } else {
#pragma unroll
      for (int b = 0; b < EPT / 8; ++b) {
        if ((e0 >> 3) + b < nb) dst[b] = static_cast<uint8_t>(bits >> (8 * b));
      }
    }
  } else {
    uint32_t v = bits << (e0 & 7);  // the 8 / EPT lanes of one byte OR their bits together
#pragma unroll
    for (int o = 1; o < 8 / EPT; o <<= 1) v |= __shfl_xor_sync(kFull, v, o);
    if ((e0 & 7) == 0 && e0 < E) *dst = static_cast<uint8_t>(v);
  }
}

// ---- top-k --------------------------------------------------------------------------------------

// A lane's two best selectable slots: keys k1 >= k2 (0: none), ties to the smaller slot; the
// slots as one-bit masks (m1, m2), so that taking one is a single OR.
struct Best2 {
  uint32_t k1, k2;
  uint32_t m1, m2;
};

// LaneBest2(key, taken): the best two of the slots not in `taken`.
template <int EPT>
__device__ __forceinline__ Best2 LaneBest2(const uint32_t (&key)[EPT], uint32_t taken) {
  Best2 b{0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    const uint32_t k = (taken & (1u << j)) ? 0u : key[j];
    if (k > b.k1) {
      b.k2 = b.k1, b.m2 = b.m1, b.k1 = k, b.m1 = 1u << j;
    } else if (k > b.k2) {
      b.k2 = k, b.m2 = 1u << j;
    }
  }
  return b;
}

// Top-k of the row over the selection keys (0 = not selectable). b: the lane's LaneBest2(key, 0).
// Returns this lane's chosen slots as a bit mask; `first` gets the largest key (round 0's winner).
//
// Each round: one redux.sync gives the warp's best key; the ballot of the lanes whose current best
// equals it, reduced to its lowest set bit, gives the winner: the lowest such lane, i.e. the
// smallest expert index (ties: larger value first, then smaller index, exactly like
// jax.lax.top_k). The winner marks the slot taken and promotes its second best. Only a lane that
// wins again after such a promotion rescans its EPT slots: `rescan` (warp-uniform) has bit l set
// while lane l's second best is unknown, so the scan is a uniform branch that most rounds skip (the
// old kernel rescanned, and ran a second redux for the index, every round). ~20 instructions a
// round.
template <int EPT>
__device__ __forceinline__ uint32_t WarpTopK(const uint32_t (&key)[EPT], Best2 b, int k, int lane, uint32_t& first) {
  const uint32_t lane_bit = 1u << lane;
  uint32_t taken = 0u;
  uint32_t rescan = 0u;
  uint32_t best = WarpMaxU(b.k1);
  first = best;
  for (int r = 0;;) {
    const uint32_t tied = __ballot_sync(kFull, b.k1 == best);
    const uint32_t win = tied & (0u - tied);  // the lowest lane holding the best key
    const bool me = win == lane_bit;
    if (me) taken |= b.m1;
    if (rescan & win) {
      if (me) b = LaneBest2<EPT>(key, taken);
    } else if (me) {
      b.k1 = b.k2, b.m1 = b.m2;
    }
    rescan ^= win;
    if (++r == k) break;
    best = WarpMaxU(b.k1);
  }
  return taken;
}

}  // namespace te::router
