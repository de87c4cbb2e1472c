// Tensor-core fragments for mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for
// mma.m16n8k16"): lane = 4 * g + t holds
//   A (16x16): a0 = (g, 2t..2t+1)   a1 = (g+8, 2t..)   a2 = (g, 2t+8..)   a3 = (g+8, 2t+8..)
//   B (16x8):  b0 = (k 2t..2t+1, n g)   b1 = (k 2t+8..2t+9, n g)
//   C (16x8):  c0,c1 = (g, 2t..2t+1)    c2,c3 = (g+8, 2t..2t+1)
// ldmatrix.x4 loads four 8x8 matrices; lanes 8i..8i+7 give the row addresses of
// matrix i, and register i of every lane receives its piece of matrix i.
#pragma once
#include "common.cuh"
#include "copy.cuh"

namespace cuflash {

// kCount (4, or 2 for one n8 tile of B) 8x8 matrices into r; addr: a shared-memory byte
// address. An x2 load takes its two row addresses from lanes 0-15, which point at the
// first two matrices of the x4 order in both lane layouts below.
template <int kCount, bool kTrans>
__device__ __forceinline__ void ldmatrix(unsigned* r, unsigned addr) {
  static_assert(kCount == 2 || kCount == 4, "x2 or x4");
  if constexpr (kCount == 4 && kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  else if constexpr (kCount == 4)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  else if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// Where a lane points for an x4 load of the 16 x 16 block at the tile's origin, in
// two matrix orders. Rows first: matrices (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15),
// (8-15, 8-15). Columns first: (0-7, 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15).
// The loaders add the block's offset, in bytes, to the shared address of this lane's
// origin last: the origin does not change inside a product, and the block offset is a
// compile-time constant in unrolled loops (folded into the ldmatrix immediate) or one
// add per trip in partly unrolled ones. (Added to the element pointer before the
// conversion to a shared address, it cost two integer instructions per ldmatrix in
// partly unrolled loops; adding the lane's column to the block's first, ptxas proved
// their bits disjoint, ORed them and kept one register per block.)
template <int kStride>
__device__ __forceinline__ int lane_offset_rows_first(int lane) {
  return (lane & 15) * kStride + (lane >> 4) * 8;
}
template <int kStride>
__device__ __forceinline__ int lane_offset_cols_first(int lane) {
  return ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
}

// A fragment of rows [row0, row0+16) x cols [col0, col0+16) of a row-major tile (Q).
template <int kStride>
__device__ __forceinline__ void load_a(unsigned a[4], const elem_t* tile, int row0, int col0, int lane) {
  ldmatrix<4, false>(a, smem_addr(tile + lane_offset_rows_first<kStride>(lane)) + 2 * (row0 * kStride + col0));
}

// B fragments of two n8 tiles (n0 and n0+8) x k16 at k0, for B = tile^T where the
// tile is stored [n][k] (K in S = Q K^T). b[0..1]: tile n0, b[2..3]: tile n0+8; with
// kCount 2, tile n0 only (an odd last tile: a head dim of 96, 160 or 224 split among warps).
template <int kStride, int kCount = 4>
__device__ __forceinline__ void load_b_transposed(unsigned* b, const elem_t* tile, int n0, int k0, int lane) {
  ldmatrix<kCount, false>(b, smem_addr(tile + lane_offset_cols_first<kStride>(lane)) + 2 * (n0 * kStride + k0));
}

// B fragments of two n8 tiles (n0, n0+8), or with kCount 2 one, x k16 at k0, for B =
// tile stored [k][n] (V in O = P V); .trans hands each lane the column pairs the
// fragment wants.
template <int kStride, int kCount = 4>
__device__ __forceinline__ void load_b(unsigned* b, const elem_t* tile, int k0, int n0, int lane) {
  ldmatrix<kCount, true>(b, smem_addr(tile + lane_offset_rows_first<kStride>(lane)) + 2 * (k0 * kStride + n0));
}

// A fragment of rows [m0, m0+16) x cols [k0, k0+16) of A, where A is stored
// transposed, [k][m] (dS^T in the backward); .trans hands each lane A's pairs.
template <int kStride>
__device__ __forceinline__ void load_a_transposed(unsigned a[4], const elem_t* tile_t, int m0, int k0, int lane) {
  ldmatrix<4, true>(a, smem_addr(tile_t + lane_offset_cols_first<kStride>(lane)) + 2 * (k0 * kStride + m0));
}

// acc[kMTiles][kN / 8][4] += A . B for A of kMTiles x 16 rows by kK and B of kK x kN,
// both in shared memory from their origin: A stored [m][k] or, with kATransposed,
// [k][m]; B stored [k][n] or, with kBTransposed, [n][k]. kN is a multiple of 8: n8
// tiles go in pairs, an odd last one alone. kUnroll bounds how many k16 steps the
// compiler may overlap (their fragments are live together).
template <typename T, int kMTiles, int kN, int kK, bool kATransposed, bool kBTransposed, int kStrideA,
          int kStrideB, int kUnroll = kK / 16>
__device__ __forceinline__ void gemm_ss(float (&acc)[kMTiles][kN / 8][4], const elem_t* a, const elem_t* b,
                                        int lane) {
#pragma unroll kUnroll
  for (int kk = 0; kk < kK; kk += 16) {
    unsigned af[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if constexpr (kATransposed) load_a_transposed<kStrideA>(af[mt], a, mt * 16, kk, lane);
      else load_a<kStrideA>(af[mt], a, mt * 16, kk, lane);
    }
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      unsigned bf[4];
      const bool pair = nt + 1 < kN / 8;
      if (pair && kBTransposed) load_b_transposed<kStrideB>(bf, b, nt * 8, kk, lane);
      if (pair && !kBTransposed) load_b<kStrideB>(bf, b, kk, nt * 8, lane);
      if (!pair && kBTransposed) load_b_transposed<kStrideB, 2>(bf, b, nt * 8, kk, lane);
      if (!pair && !kBTransposed) load_b<kStrideB, 2>(bf, b, kk, nt * 8, lane);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        DType<T>::mma(acc[mt][nt], af[mt], bf[0], bf[1]);
        if (pair) DType<T>::mma(acc[mt][nt + 1], af[mt], bf[2], bf[3]);
      }
    }
  }
}

// S = Q K^T for the kMTiles x 16 rows of Q from q_row0, over the full head dim.
template <typename T, int kMTiles, int kN, int kHeadDim, int kUnroll = kHeadDim / 16>
__device__ __forceinline__ void gemm_qk(float (&acc)[kMTiles][kN / 8][4], const elem_t* q, int q_row0,
                                        const elem_t* k, int lane) {
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  gemm_ss<T, kMTiles, kN, kHeadDim, false, true, kStride, kStride, kUnroll>(acc, q + q_row0 * kStride, k, lane);
}

// S-shaped accumulators (kMTiles x 16 rows, kN columns) -> A fragments of kN / 16
// k16 steps: the C layout of two adjacent n8 tiles is exactly the A layout of one k16
// step, so each lane packs its own values.
template <typename T, int kMTiles, int kN>
__device__ __forceinline__ void pack_a_fragments(unsigned (&a)[kMTiles][kN / 16][4],
                                                 const float (&p)[kMTiles][kN / 8][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      a[mt][kk][0] = DType<T>::pack(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      a[mt][kk][1] = DType<T>::pack(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      a[mt][kk][2] = DType<T>::pack(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      a[mt][kk][3] = DType<T>::pack(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
}

// acc[kM][kCols / 8][4] += P . B with P taken from S-shaped accumulators (packed to
// A fragments first, so the fp32 P is dead before the first mma). B is stored [k][n]
// (V in O = P V; dO, Q in the backward), kCols columns from b.
template <typename T, int kMTiles, int kN, int kCols, int kStride>
__device__ __forceinline__ void gemm_pv(float (&acc)[kMTiles][kCols / 8][4],
                                        const float (&p)[kMTiles][kN / 8][4], const elem_t* b, int lane) {
  unsigned a[kMTiles][kN / 16][4];
  pack_a_fragments<T, kMTiles, kN>(a, p);
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
    for (int dt = 0; dt < kCols / 8; dt += 2) {
      unsigned bf[4];
      load_b<kStride>(bf, b, kk * 16, dt * 8, lane);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        DType<T>::mma(acc[mt][dt], a[mt][kk], bf[0], bf[1]);
        DType<T>::mma(acc[mt][dt + 1], a[mt][kk], bf[2], bf[3]);
      }
    }
}

// Accumulators in the C layout (kMTiles x 16 rows, kNTiles x 8 columns) -> a 16-bit
// row-major shared tile from its origin, times mul; each lane writes its column pairs.
template <typename T, int kMTiles, int kNTiles, int kStride>
__device__ __forceinline__ void store_fragments(elem_t* tile, const float (&acc)[kMTiles][kNTiles][4], int lane,
                                                float mul = 1.f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
        *reinterpret_cast<unsigned*>(tile + (mt * 16 + g + 8 * h) * kStride + nt * 8 + 2 * t) =
            DType<T>::pack(acc[mt][nt][2 * h] * mul, acc[mt][nt][2 * h + 1] * mul);
}

}  // namespace cuflash
