// An accumulator fragment's elements and their places. acc[mt][nt][e] of a warp's tile
// (kMTiles m16 tiles by kNTiles n8 tiles, the mma.sync C layout, also wgmma's accumulators
// warp by warp) is row 16 mt + g + 8 (e / 2), column 8 nt + 2 t + e % 2 of the tile, with
// g = lane / 4 and t = lane % 4.
#pragma once

namespace cuflash {

// visit(mt, nt, e, row, column) for every element of a fragment, in order.
template <int kMTiles, int kNTiles, typename Visit>
__device__ __forceinline__ void for_each_element(int lane, Visit visit) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) visit(mt, nt, e, mt * 16 + g + 8 * (e >> 1), nt * 8 + 2 * t + (e & 1));
}

}  // namespace cuflash
