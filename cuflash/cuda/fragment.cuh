// An accumulator fragment's elements and their places. acc[mt][nt][e] of a warp's tile
// (kMTiles m16 tiles by kNTiles n8 tiles, the mma.sync C layout, also wgmma's accumulators
// warp by warp) is row 16 mt + g + 8 (e / 2), column 8 nt + 2 t + e % 2 of the tile, with
// g = lane / 4 and t = lane % 4: a lane holds two lines of each m16 tile (h = e / 2), and
// in each n8 tile a pair of adjacent columns of both (elements 2 h and 2 h + 1).
//
// The lines are rows: consecutive, line h of tile mt being row row0 + 16 mt + g + 8 h, or
// packed (the KV-cache call packs the query heads of a KV head into a tile's lines), a
// lane's lines given as rows[mt][h].
//
// The visitors are taken by reference: a closure passed by value (an aggregate of its
// captures) reordered the instructions of the code around it.
#pragma once

namespace cuflash {

// The row of line h of m16 tile mt of lane group g: consecutive from row0, or packed.
__device__ __forceinline__ int line_row(int row0, int mt, int g, int h) { return row0 + mt * 16 + g + 8 * h; }
template <int kMTiles>
__device__ __forceinline__ int line_row(const int (&rows)[kMTiles][2], int mt, int, int h) { return rows[mt][h]; }

// visit(mt, h, row) for each of a lane's lines, in order.
template <int kMTiles, typename Rows, typename Visit>
__device__ __forceinline__ void for_each_line(int lane, const Rows& rows, const Visit& visit) {
  const int g = lane >> 2;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) visit(mt, h, line_row(rows, mt, g, h));
}

// visit(mt, nt, e, row, column) for every element of a fragment, in order, the columns
// counted from col0; with kStep 2, for every pair instead (elements e and e + 1, columns
// `column` and `column` + 1 of `row`).
template <int kMTiles, int kNTiles, int kStep = 1, typename Rows, typename Visit>
__device__ __forceinline__ void for_each_element(int lane, const Rows& rows, int col0, const Visit& visit) {
  static_assert(kStep == 1 || kStep == 2, "elements or pairs");
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += kStep) visit(mt, nt, e, line_row(rows, mt, g, e >> 1), col0 + nt * 8 + 2 * t + (e & 1));
}
// The same with the rows and columns of the tile (from 0).
template <int kMTiles, int kNTiles, typename Visit>
__device__ __forceinline__ void for_each_element(int lane, const Visit& visit) {
  for_each_element<kMTiles, kNTiles>(lane, 0, 0, visit);
}

}  // namespace cuflash
