// Online softmax state for the rows a lane owns (two rows per 16-row m-tile:
// g and g + 8 of the mma C layout). Scores stay in raw units; the softmax scale
// is folded into log2 space so every score costs one FFMA and one exp2:
//   P = exp(scale * (S - m)) = exp2(S * scale_log2 - m * scale_log2).
// scale_log2 > 0 is guaranteed by the host, so -inf * scale_log2 stays -inf.
#pragma once
#include "common.cuh"

namespace cuflash {

// The four lanes of a quad (same g) share one row: reduce across them.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int kMTiles, bool kConditionalRescale>
struct OnlineSoftmax {
  float row_max[kMTiles][2];  // m: the max of raw scores at the last rescale (update)
  float row_sum[kMTiles][2];  // l: this lane's share of sum exp(scale * (S - m))

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_max[mt][h] = -kInf, row_sum[mt][h] = 0.f;
  }

  // A row that has seen only masked scores has m = -inf; offsetting by 0 instead
  // keeps exp2(-inf - -inf) = NaN out of the arithmetic.
  static __device__ __forceinline__ float scaled_max(float m, float scale_log2) {
    return m == -kInf ? 0.f : m * scale_log2;
  }

  // P = exp2(S*c - m*c) and l += rowsum(P), where m is the running max as of the last
  // rescale (m = rowmax, l *= alpha, O *= alpha with alpha = exp2((m_old - m) * c)).
  // Without kConditionalRescale the max moves at every tile. With it, only when some row
  // of the warp saw a score more than kSlack above its m in log2 units: until then P <=
  // 2^kSlack, well inside fp32 and the 16-bit types, and O / l and LSE = m * scale +
  // log(l) are the same for any m (FlashAttention-4's conditional rescale). Past the
  // first tiles the max rarely grows that much, so the O rescale (one FMUL per
  // accumulator: as many as the tile's exps at d 128 x 32 keys) is skipped. S is
  // overwritten with P.
  static constexpr float kSlack = 8.f;

  template <int kNTiles, int kDTiles>
  __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4], float (&o)[kMTiles][kDTiles][4],
                                         float scale_log2) {
    if constexpr (kConditionalRescale) {
      float tile_max[kMTiles][2];
      if (__any_sync(0xffffffffu, row_maxima(s, scale_log2, tile_max))) {  // warp-uniform: every lane or none
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) rescale(o, mt, h, tile_max[mt][h], scale_log2);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) exponentiate(s, mt, h, scale_log2);
    } else {  // row by row, in this order (the faster schedule at d 256)
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          rescale(o, mt, h, quad_max(row_max_of(s, mt, h, row_max[mt][h])), scale_log2);
          exponentiate(s, mt, h, scale_log2);
        }
    }
  }

  // update in two steps, for a caller whose O is still being written by an asynchronous
  // product when the scores arrive: update_scores moves m and l and turns S into P, keeping
  // in `alpha` the factors O is to be scaled by, and says whether any is not 1;
  // scale_output applies them once O has landed.
  template <int kNTiles>
  __device__ __forceinline__ bool update_scores(float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                                float (&alpha)[kMTiles][2]) {
    float tile_max[kMTiles][2];
    const bool grown = row_maxima(s, scale_log2, tile_max);
    const bool moves = !kConditionalRescale || __any_sync(0xffffffffu, grown);  // warp-uniform
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        alpha[mt][h] = moves ? move_max(mt, h, tile_max[mt][h], scale_log2) : 1.f;
        exponentiate(s, mt, h, scale_log2);
      }
    return moves;
  }

  // The rows' maxima over the tile and m (each across its quad of lanes), and whether any
  // of this lane's rows grew by more than kSlack.
  template <int kNTiles>
  __device__ __forceinline__ bool row_maxima(const float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                             float (&tile_max)[kMTiles][2]) const {
    bool grown = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[mt][h] = quad_max(row_max_of(s, mt, h, row_max[mt][h]));
        // The first visible score: (m - -inf) = inf. A row with nothing visible yet: NaN, false.
        grown |= (tile_max[mt][h] - row_max[mt][h]) * scale_log2 > kSlack;
      }
    return grown;
  }

  template <int kDTiles>
  static __device__ __forceinline__ void scale_output(float (&o)[kMTiles][kDTiles][4], const float (&alpha)[kMTiles][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][dt][e] *= alpha[mt][e / 2];
  }

  template <int kNTiles>
  static __device__ __forceinline__ float row_max_of(const float (&s)[kMTiles][kNTiles][4], int mt, int h, float m) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
    return m;
  }

  // Row (mt, h)'s max moves to m_new: l and O scaled by alpha.
  template <int kDTiles>
  __device__ __forceinline__ void rescale(float (&o)[kMTiles][kDTiles][4], int mt, int h, float m_new,
                                          float scale_log2) {
    const float alpha = move_max(mt, h, m_new, scale_log2);
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) o[mt][dt][2 * h] *= alpha, o[mt][dt][2 * h + 1] *= alpha;
  }

  // Row (mt, h)'s max moves to m_new and l is scaled: the factor O is to be scaled by.
  __device__ __forceinline__ float move_max(int mt, int h, float m_new, float scale_log2) {
    const float alpha = fast_exp2(row_max[mt][h] * scale_log2 - scaled_max(m_new, scale_log2));
    row_max[mt][h] = m_new;
    row_sum[mt][h] *= alpha;
    return alpha;
  }

  // Row (mt, h) of S -> P = exp2(S*c - m*c), added to l.
  template <int kNTiles>
  __device__ __forceinline__ void exponentiate(float (&s)[kMTiles][kNTiles][4], int mt, int h, float scale_log2) {
    const float offset = scaled_max(row_max[mt][h], scale_log2);
    float sum = row_sum[mt][h];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        s[mt][nt][e] = fast_exp2(s[mt][nt][e] * scale_log2 - offset);
        sum += s[mt][nt][e];
      }
    row_sum[mt][h] = sum;
  }

  // O *= out_scale / l and LSE = m * scale + log(l) (natural log). l == 0 (nothing
  // visible) gives O = 0 and LSE = +inf; a NaN l stays NaN in both.
  template <int kDTiles>
  __device__ __forceinline__ void finalize(float (&o)[kMTiles][kDTiles][4], float (&lse)[kMTiles][2],
                                           float scale_log2, float out_scale) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(row_sum[mt][h]);
        const float inv_l = l == 0.f ? 0.f : out_scale / l;
        lse[mt][h] = l == 0.f ? kInf : (scaled_max(row_max[mt][h], scale_log2) + fast_log2(l)) * kLn2;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) o[mt][dt][2 * h] *= inv_l, o[mt][dt][2 * h + 1] *= inv_l;
      }
  }
};

}  // namespace cuflash
