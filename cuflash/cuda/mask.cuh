// Which scores a query may see. Causal is aligned bottom-right, as flash-attn:
// query i sees key j iff j <= i + seqlen_k - seqlen_q. Keys past seqlen_k are
// tile padding. Only tiles that straddle a boundary pay for this.
#pragma once
#include "common.cuh"

namespace cuflash {

template <bool kCausal>
struct Mask {
  int seqlen_k;
  int diagonal;  // seqlen_k - seqlen_q

  __device__ __forceinline__ bool visible(int row, int col) const {
    return col < seqlen_k && (!kCausal || col <= row + diagonal);
  }

  // s[mt][nt][e] is the score of query row0 + 16 mt + g + 8 (e / 2) and key
  // col0 + 8 nt + 2 t + e % 2 (mma C layout); hidden scores become -inf.
  template <int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kMTiles][kNTiles][4], int row0, int col0, int lane) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!visible(row0 + mt * 16 + g + 8 * (e >> 1), col0 + nt * 8 + 2 * t + (e & 1))) s[mt][nt][e] = -kInf;
  }
};

}  // namespace cuflash
