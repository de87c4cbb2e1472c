// Partial attention results and their merge: the one contract of the KV-cache split
// kernel's in-CTA reduction, its merge step, cuflash.merge_states and the sm_90a forward's
// tail tiles cut along their keys.
//
// A part is the attention of a row over a subset of the keys: O_i normalised over that
// subset and LSE_i = log sum exp(s) over it (natural log); LSE_i = +inf or -inf marks a
// part that saw no key (its O_i is ignored). Over the union:
//   top = max of the finite LSE_i;  w_i = exp(LSE_i - top), 0 for an empty part
//   O = sum_i w_i O_i / sum_i w_i;  LSE = top + log sum_i w_i
// and a row no part saw gets O = 0 and LSE = +inf, as the forward's fully masked rows.
// Every sum runs in a fixed order, so a merge is bitwise reproducible.
#pragma once
#include "common.cuh"

namespace cuflash {

struct PartialMerge {
  float top = -kInf;  // the largest finite LSE seen
  float total = 0.f;  // sum of the weights

  static __device__ __forceinline__ bool empty(float lse) { return fabsf(lse) == kInf; }

  // First pass: every part's LSE.
  __device__ __forceinline__ void see(float lse) {
    if (!empty(lse)) top = fmaxf(top, lse);
  }
  // Second pass: each part's weight, in order (summed into total).
  __device__ __forceinline__ float weight(float lse) const { return empty(lse) ? 0.f : fast_exp2((lse - top) * kLog2e); }
  __device__ __forceinline__ float weigh(float lse) {
    const float w = weight(lse);
    total += w;
    return w;
  }
  // Third: sum_i w_i O_i, one element of a part's O at a time. An empty part's weight 0
  // selects its O away (not 0 * O: whatever its O holds, a NaN or inf included, adds nothing).
  static __device__ __forceinline__ float weighted(float w, float x) { return w != 0.f ? w * x : 0.f; }
  static __device__ __forceinline__ void add_weighted(float (&o)[4], float w, const float4& x) {
    o[0] += weighted(w, x.x), o[1] += weighted(w, x.y), o[2] += weighted(w, x.z), o[3] += weighted(w, x.w);
  }
  // The passes split among a warp's lanes, each lane seeing some of the parts: after the
  // first, every lane takes the warp's top; after the second, the warp's total.
  __device__ __forceinline__ void top_of_warp() {
#pragma unroll
    for (int lane = 16; lane > 0; lane /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, lane));
  }
  __device__ __forceinline__ void total_of_warp() {
#pragma unroll
    for (int lane = 16; lane > 0; lane /= 2) total += __shfl_xor_sync(0xffffffffu, total, lane);
  }
  // After the second pass: the factor of sum_i w_i O_i, and the merged LSE.
  __device__ __forceinline__ float out_scale() const { return total > 0.f ? 1.f / total : 0.f; }
  __device__ __forceinline__ float lse() const { return total > 0.f ? top + fast_log2(total) * kLn2 : kInf; }
};

}  // namespace cuflash
