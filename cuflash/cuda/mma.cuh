// Tensor-core fragments for mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for
// mma.m16n8k16"): lane = 4 * g + t holds
//   A (16x16): a0 = (g, 2t..2t+1)   a1 = (g+8, 2t..)   a2 = (g, 2t+8..)   a3 = (g+8, 2t+8..)
//   B (16x8):  b0 = (k 2t..2t+1, n g)   b1 = (k 2t+8..2t+9, n g)
//   C (16x8):  c0,c1 = (g, 2t..2t+1)    c2,c3 = (g+8, 2t..2t+1)
// ldmatrix.x4 loads four 8x8 matrices; lanes 8i..8i+7 give the row addresses of
// matrix i, and register i of every lane receives its piece of matrix i.
#pragma once
#include "common.cuh"
#include "layout.cuh"

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

// The same load from a shared tile: this lane points at `offset` (rows_first or
// cols_first), moved by (dr, dc) known at compile time; the tile's layout gives the
// address.
template <int kCount, bool kTrans, typename L>
__device__ __forceinline__ void ldmatrix(unsigned* r, SharedTile<L> tile, int offset, int dr, int dc) {
  ldmatrix<kCount, kTrans>(r, L::address(tile.data, offset, dr, dc));
}

// Where a lane points for an x4 load of a 16 x 16 block, in two matrix orders, as an
// offset in layout L (layout.cuh) for the block whose first column is col0.
// Rows first: matrices (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
// Columns first: (0-7, 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15). A product computes
// its lanes' offsets once; each block's address then follows from them (L::address),
// its compile-time part folded into the ldmatrix immediate.
template <typename L>
__device__ __forceinline__ int rows_first(int col0, int lane) {
  return L::at(lane & 15, col0 + (lane >> 4) * 8);
}
template <typename L>
__device__ __forceinline__ int cols_first(int col0, int lane) {
  return L::at((lane & 7) + (lane >> 4) * 8, col0 + ((lane >> 3) & 1) * 8);
}

// Which operand of a product its shared tile holds transposed: A stored [k][m] (kA) or
// B stored [n][k] (kB), where A is [m][k] and B [k][n] otherwise.
enum class Transposed { kNone, kA, kB };

// acc[kMTiles][kNTiles][4] += A . B for A of kMTiles x 16 rows by kK and B of kK x
// kNTiles * 8, both read from shared tiles: from row 0 and column a_col0 of `a`, from
// row 0 and column b_col0 of `b`.
// n8 tiles go in pairs (ldmatrix.x4), an odd last one alone (.x2; a head dim of 96, 160
// or 224 split among warps). Fragments: A as rows first (.trans, columns first, when
// stored transposed), so each lane gets its pairs; B = tile^T columns first, B = tile
// rows first with .trans. kUnroll bounds how many k16 steps the compiler may overlap
// (their fragments are live together). The kernels call it by the names below.
template <typename T, Transposed kTransposed, int kK, int kUnroll, typename LA, typename LB, int kMTiles,
          int kNTiles>
__device__ __forceinline__ void gemm_ss(float (&acc)[kMTiles][kNTiles][4], SharedTile<LA> a, int a_col0,
                                        SharedTile<LB> b, int b_col0, int lane) {
  constexpr bool kATransposed = kTransposed == Transposed::kA, kBTransposed = kTransposed == Transposed::kB;
  static_assert(LA::composes(kATransposed ? kMTiles * 16 : kK) && LB::composes(kBTransposed ? kK : kNTiles * 8),
                "a product's first column must compose with its layout (layout.cuh)");
  const int a_lane = kATransposed ? cols_first<LA>(a_col0, lane) : rows_first<LA>(a_col0, lane);
  const int b_lane = kBTransposed ? cols_first<LB>(b_col0, lane) : rows_first<LB>(b_col0, lane);
#pragma unroll kUnroll
  for (int kk = 0; kk < kK; kk += 16) {
    unsigned af[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if constexpr (kATransposed) ldmatrix<4, true>(af[mt], a, a_lane, kk, mt * 16);
      else ldmatrix<4, false>(af[mt], a, a_lane, mt * 16, kk);
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      unsigned bf[4];
      const bool pair = nt + 1 < kNTiles;
      if (pair && kBTransposed) ldmatrix<4, false>(bf, b, b_lane, nt * 8, kk);
      if (pair && !kBTransposed) ldmatrix<4, true>(bf, b, b_lane, kk, nt * 8);
      if (!pair && kBTransposed) ldmatrix<2, false>(bf, b, b_lane, nt * 8, kk);
      if (!pair && !kBTransposed) ldmatrix<2, true>(bf, b, b_lane, kk, nt * 8);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        DType<T>::mma(acc[mt][nt], af[mt], bf[0], bf[1]);
        if (pair) DType<T>::mma(acc[mt][nt + 1], af[mt], bf[2], bf[3]);
      }
    }
  }
}

// acc += A B^T over every column of A's and B's tiles (k = their kCols), from each
// tile's row 0 (SharedTile::from_row picks the rows): S = Q K^T, dP = dO V^T. kUnroll:
// the k16 steps the compiler may overlap, 0 for all of them.
template <typename T, int kUnroll = 0, typename LA, typename LB, int kMTiles, int kNTiles>
__device__ __forceinline__ void mma_ABt(float (&acc)[kMTiles][kNTiles][4], SharedTile<LA> a, SharedTile<LB> b,
                                        int lane) {
  gemm_ss<T, Transposed::kB, LA::kCols, kUnroll == 0 ? LA::kCols / 16 : kUnroll>(acc, a, 0, b, 0, lane);
}

// acc += A B over kK, from columns a_col0 of A's tile and b_col0 of B's: dQ = dS K.
template <typename T, int kK, int kUnroll = kK / 16, typename LA, typename LB, int kMTiles, int kNTiles>
__device__ __forceinline__ void mma_AB(float (&acc)[kMTiles][kNTiles][4], SharedTile<LA> a, int a_col0,
                                       SharedTile<LB> b, int b_col0, int lane) {
  gemm_ss<T, Transposed::kNone, kK, kUnroll>(acc, a, a_col0, b, b_col0, lane);
}

// acc += A^T B over kK, A's tile holding A^T (A's rows from its column a_col0): dV =
// P^T dO and dK = dS^T Q from the P and dS tiles, [query][key].
template <typename T, int kK, int kUnroll = kK / 16, typename LA, typename LB, int kMTiles, int kNTiles>
__device__ __forceinline__ void mma_AtB(float (&acc)[kMTiles][kNTiles][4], SharedTile<LA> a, int a_col0,
                                        SharedTile<LB> b, int b_col0, int lane) {
  gemm_ss<T, Transposed::kA, kK, kUnroll>(acc, a, a_col0, b, b_col0, lane);
}

// S-shaped accumulators (kMTiles x 16 rows, kKTiles x 8 columns) -> A fragments of
// kKTiles / 2 k16 steps: the C layout of two adjacent n8 tiles is exactly the A layout
// of one k16 step, so each lane packs its own values.
template <typename T, int kMTiles, int kKTiles>
__device__ __forceinline__ void pack_a_fragments(unsigned (&a)[kMTiles][kKTiles / 2][4],
                                                 const float (&p)[kMTiles][kKTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int kk = 0; kk < kKTiles / 2; ++kk) {
      a[mt][kk][0] = DType<T>::pack(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      a[mt][kk][1] = DType<T>::pack(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      a[mt][kk][2] = DType<T>::pack(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      a[mt][kk][3] = DType<T>::pack(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
}

// acc += A B with A in registers: the fp32 accumulators of an earlier product (S-shaped,
// packed to A fragments first, so the fp32 copy is dead before the first mma) and B
// stored [k][n] in a shared tile from its column b_col0: O += P V; dV += P^T dO,
// dK += dS^T Q and dQ += dS K in the two-kernel backward.
template <typename T, typename L, int kMTiles, int kKTiles, int kNTiles>
__device__ __forceinline__ void mma_AB(float (&acc)[kMTiles][kNTiles][4], const float (&a)[kMTiles][kKTiles][4],
                                       SharedTile<L> b, int b_col0, int lane) {
  static_assert(L::composes(kNTiles * 8), "a product's first column must compose with its layout (layout.cuh)");
  unsigned af[kMTiles][kKTiles / 2][4];
  pack_a_fragments<T, kMTiles, kKTiles>(af, a);
  const int b_lane = rows_first<L>(b_col0, lane);
#pragma unroll
  for (int kk = 0; kk < kKTiles / 2; ++kk)
#pragma unroll
    for (int dt = 0; dt < kNTiles; dt += 2) {
      unsigned bf[4];
      ldmatrix<4, true>(bf, b, b_lane, kk * 16, dt * 8);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        DType<T>::mma(acc[mt][dt], af[mt][kk], bf[0], bf[1]);
        DType<T>::mma(acc[mt][dt + 1], af[mt][kk], bf[2], bf[3]);
      }
    }
}

// Accumulators in the C layout (kMTiles x 16 rows, kNTiles x 8 columns) -> a 16-bit
// shared tile from row 0 and column col0, times mul; each lane writes its column pairs.
template <typename T, typename L, int kMTiles, int kNTiles>
__device__ __forceinline__ void store_fragments(SharedTile<L> tile, int col0, const float (&acc)[kMTiles][kNTiles][4],
                                                int lane, float mul = 1.f) {
  static_assert(L::composes(kNTiles * 8), "a product's first column must compose with its layout (layout.cuh)");
  const int g = lane >> 2, t = lane & 3;
  const int origin = L::at(g, col0 + 2 * t);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
        // (the pointer first, the constant last: folded into the store's immediate)
        *reinterpret_cast<unsigned*>(tile.data + L::moved(origin, nt * 8) + L::fixed(mt * 16 + 8 * h, nt * 8)) =
            DType<T>::pack(acc[mt][nt][2 * h] * mul, acc[mt][nt][2 * h + 1] * mul);
}

}  // namespace cuflash
