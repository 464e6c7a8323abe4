// Grouped selection (DeepSeek-V3) for the router forward: E splits into G contiguous groups of
// gsize experts; a group's score is the sum of its top m = topk / group_topk selection scores; only
// the best group_topk groups (ties: smaller group index) stay selectable.
//
// Fast path (m <= 2, every lane inside one group, 2^n lanes per group; DeepSeek-V3: gsize 32,
// EPT 8 -> 4 lanes per group): the lanes' best two keys (already computed for the top-k) are merged
// across the group's lanes with log2(lanes) xor-shuffles: no shared memory and no per-element scan.
// General path (its own kernel kind, FwdKind::kTopkGrouped, so that the fast kernels do not carry
// its registers): the row's selection scores go to shared memory, lane g scans group g keeping its
// top m (G <= 32 groups, m <= kMaxPerGroupTopk).
// Both sum the group's top m largest first, as the reference sums lax.top_k's output.
#pragma once

#include "router/router_rows.cuh"

namespace te::router {

// Fast path applies: m <= 2 and every lane inside one group of a power-of-two number of lanes.
// Host and device use the same rule (the launcher picks the kernel kind from it).
__host__ __device__ inline bool FastGroups(int experts, int num_groups, int topk, int group_topk, int ept) {
  const int gsize = experts / num_groups;
  const int lanes = gsize / ept;
  return topk / group_topk <= 2 && gsize % ept == 0 && (lanes & (lanes - 1)) == 0;
}

// Bit g of the result: group g is kept. gkey: lane g's group score key (0 for lanes >= G).
__device__ __forceinline__ uint32_t PickGroups(uint32_t gkey, int group_topk, int lane) {
  uint32_t gmask = 0u;
  for (int r = 0; r < group_topk; ++r) {
    const uint32_t best = WarpMaxU(gkey);
    const int win = __ffs(__ballot_sync(kFull, gkey == best)) - 1;  // lane == group index
    gmask |= 1u << win;
    if (lane == win) gkey = 0u;
  }
  return gmask;
}

// Fast path. Masks the experts of the groups that are not kept: their keys become 0 and b (the
// lane's best two keys, LaneBest2(key, 0)) becomes empty. Every lane of the warp must call it.
template <int EPT>
__device__ __forceinline__ void MaskGroupsFast(const RowParams& p, int lane, uint32_t (&key)[EPT], Best2& b) {
  const int G = p.num_groups;
  const int m = p.topk / p.group_topk;
  const int lanes_per_group = p.experts / G / EPT;
  // Top m keys of the group: merge the sorted pairs (k1 >= k2) of the group's lanes.
  uint32_t a1 = b.k1, a2 = b.k2;
  for (int o = 1; o < lanes_per_group; o <<= 1) {
    const uint32_t b1 = __shfl_xor_sync(kFull, a1, o);
    const uint32_t b2 = __shfl_xor_sync(kFull, a2, o);
    const uint32_t lo = min(a1, b1);
    a1 = max(a1, b1);
    a2 = max(lo, max(a2, b2));
  }
  const float score = m == 1 ? KeyFloat(a1) : KeyFloat(a1) + KeyFloat(a2);
  const float gscore = __shfl_sync(kFull, score, (lane < G ? lane : 0) * lanes_per_group);
  const uint32_t gmask = PickGroups(lane < G ? SelectKey(gscore) : 0u, p.group_topk, lane);
  const int mine = lane / lanes_per_group;  // the lane's group (lanes past the row: >= G)
  if (mine >= G || !((gmask >> mine) & 1u)) {
#pragma unroll
    for (int j = 0; j < EPT; ++j) key[j] = 0u;
    b = Best2{0u, 0u, 0, 0};
  }
}

// General path: where a lane's slots begin new groups, computed once per kernel (integer
// divisions by the runtime group size stay out of the row loop).
struct GroupLayout {
  int g0;           // group of the lane's slot 0
  uint32_t starts;  // bit j (j > 0): slot j begins a new group
};

template <int EPT>
__device__ __forceinline__ GroupLayout MakeGroupLayout(const RowParams& p, int e0) {
  const int gsize = p.experts / p.num_groups;
  GroupLayout l{e0 / gsize, 0u};
#pragma unroll
  for (int j = 1; j < EPT; ++j) {
    if ((e0 + j) % gsize == 0) l.starts |= 1u << j;
  }
  return l;
}

// General path: masks the keys of the experts outside the kept groups (0) and recomputes b.
// nvalid: the lane's slots [0, nvalid) hold experts. buf: this warp's E floats of shared memory.
// Every lane of the warp must call it.
template <int EPT>
__device__ __forceinline__ void MaskGroupsShared(const RowParams& p, const GroupLayout& l, int lane, int e0,
                                                 int nvalid, float* buf, uint32_t (&key)[EPT], Best2& b) {
  const int G = p.num_groups;
  const int m = p.topk / p.group_topk;
  // Selection scores recovered from the keys (KeyFloat inverts SelectKey for non-NaN scores).
  __syncwarp();  // the previous row's scan of buf is complete
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    if (j < nvalid) buf[e0 + j] = KeyFloat(key[j]);
  }
  __syncwarp();
  const int gsize = p.experts / G;
  uint32_t gkey = 0u;
  if (lane < G) {
    float top[kMaxPerGroupTopk];
#pragma unroll
    for (int q = 0; q < kMaxPerGroupTopk; ++q) top[q] = -INFINITY;
    const float* grp = buf + lane * gsize;
    // Lane g starts its scan at element g of its group: with 32-float groups the lanes then hit
    // 32 different banks instead of one. The top-m multiset (and its sum) is order-independent.
    int jj = lane % gsize;
    for (int j = 0; j < gsize; ++j) {
      float v = grp[jj];
      if (++jj == gsize) jj = 0;
#pragma unroll
      for (int q = 0; q < kMaxPerGroupTopk; ++q) {
        if (q >= m) break;
        if (v > top[q]) {
          const float t = top[q];
          top[q] = v;
          v = t;
        }
      }
    }
    float gsum = 0.f;  // largest first
#pragma unroll
    for (int q = 0; q < kMaxPerGroupTopk; ++q) {
      if (q < m) gsum += top[q];
    }
    gkey = SelectKey(gsum);
  }
  const uint32_t gmask = PickGroups(gkey, p.group_topk, lane);
  int g = l.g0;
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    if ((l.starts >> j) & 1u) ++g;
    const bool keep = j < nvalid && g < 32 && ((gmask >> g) & 1u);
    if (!keep) key[j] = 0u;
  }
  b = LaneBest2<EPT>(key, 0u);
}

}  // namespace te::router
