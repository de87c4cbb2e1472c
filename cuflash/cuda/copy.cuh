// Moving tiles between global and shared memory, and how tiles lie in shared memory.
#pragma once
#include "common.cuh"

namespace cuflash {

// Shared tiles are row-major; a layout maps (row, column) to an element offset from the
// tile's origin. Columns are moved in 16-byte chunks (8 elements), and ldmatrix reads
// eight 16-byte rows of one chunk column at a time: those eight must lie in eight
// different 4-bank groups for the read to be free of bank conflicts. Two ways:
//
// PaddedRows: rows of kCols + 8 elements. Row r starts 16 r bytes further into the
//   banks, so any eight consecutive rows of a chunk column are conflict-free. Used where
//   a row is not a whole number of 128-byte lines (head dims 32, 96, 160, 224; P and dS),
//   and at d 192, whose backward splits the columns among warps 48 at a time (those
//   starts do not compose with the swizzle, below).
// SwizzledRows: rows of exactly kCols elements (a multiple of 64: whole 128-byte lines);
//   inside each line, chunk c of row r lies at chunk c ^ (r % 8). Rows start on a line, so
//   a warp's cp.async of 128-byte row pieces writes whole lines (ncu: 4 shared wavefronts a
//   512-byte copy instruction, where the padded rows took 10.5; FlashAttention-2's copies
//   take 4 the same way). Against padded rows: forward d 256 +3.5-7.7%, forward +
//   backward +2-5% at d 64, 128 and 256 (A/B, 512-8k, not causal).
//
// Both also say how to reach (row + dr, col + dc) from a lane's own offset at (row, col)
// with dr and dc known at compile time: `tile + moved(offset, dc) + fixed(dr, dc)`, or as
// a shared-memory byte address, `address(tile, offset, dr, dc)`. The `fixed` part goes
// last, where it folds into the instruction's immediate. (Summed with the offset first,
// it cost two integer instructions per shared store; added to the element pointer
// before the conversion to a shared address, two per ldmatrix in partly unrolled loops.)
// For SwizzledRows this needs dr % 8 == 0 and dc's bits (below 64) disjoint from col's
// above its chunk: callers start a product at a column that is a multiple of 64 or of a
// power of two >= the columns it spans (`composes`), and lanes add only their chunk (0 or
// 8) or less.
template <int kColumns>
struct PaddedRows {
  static constexpr int kCols = kColumns, kRowElems = kCols + 8;
  static __host__ __device__ constexpr bool composes(int) { return true; }
  static __device__ __forceinline__ int at(int row, int col) { return row * kRowElems + col; }
  static __device__ __forceinline__ int moved(int offset, int) { return offset; }
  static __host__ __device__ constexpr int fixed(int dr, int dc) { return dr * kRowElems + dc; }
  static __device__ __forceinline__ unsigned address(const elem_t* tile, int offset, int dr, int dc) {
    return smem_addr(tile + offset) + 2 * fixed(dr, dc);
  }
};

// kXorAddress: `address` applies the swizzle to the byte address itself, one LOP3 an
// ldmatrix (the tile must start on a 128-byte line); otherwise to the lane's element
// offset, which the compiler may keep in registers, one for each of the four chunk
// pairs. A/B: the first +1-4% at d 64, forward and
// backward; the second up to 4% faster in the d 256 causal backward; within 2% either
// way at d 128. The two-kernel backward takes the first: the second's registers spilled
// its d 256 dQ kernel with extras.
template <int kColumns, bool kXorAddress>
struct SwizzledRows {
  static constexpr int kCols = kColumns, kRowElems = kCols;
  static_assert(kCols % 64 == 0, "whole 128-byte lines");
  // Products over `cols` columns may start at any multiple of `cols` (see above).
  static __host__ __device__ constexpr bool composes(int cols) { return cols % 64 == 0 || (cols & (cols - 1)) == 0; }
  static __device__ __forceinline__ int at(int row, int col) { return row * kCols + (col ^ ((row & 7) << 3)); }
  static __device__ __forceinline__ int moved(int offset, int dc) { return offset ^ (dc & 63); }
  static __host__ __device__ constexpr int fixed(int dr, int dc) { return dr * kCols + (dc & ~63); }
  static __device__ __forceinline__ unsigned address(const elem_t* tile, int offset, int dr, int dc) {
    if constexpr (kXorAddress) return (smem_addr(tile + offset) ^ (2 * (dc & 63))) + 2 * fixed(dr, dc);
    else return smem_addr(tile + moved(offset, dc)) + 2 * fixed(dr, dc);
  }
};

template <bool kFirst, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

// The layout of a head-dim-wide tile (Q, K, V, dO) of bucket kHeadDim: swizzled at 64,
// 128 and 256. (Kernels place these tiles first in shared memory, so they start on
// 128-byte lines.)
template <int kHeadDim, bool kXorAddress = kHeadDim == 64>
using SmemTile = typename Select<kHeadDim >= 64 && (kHeadDim & (kHeadDim - 1)) == 0,
                                 SwizzledRows<kHeadDim, kXorAddress>, PaddedRows<kHeadDim>>::type;

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  // src-size 0 zero-fills the 16 bytes: rows past seqlen and columns past the
  // head dim become zeros, which add nothing to Q K^T nor to P V.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
// 4 bytes (one float); src-size 0 zero-fills.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(kPending)); }

// One 16-byte chunk: cp.async for kVec, else element loads assembled in registers.
template <bool kVec>
__device__ __forceinline__ void load_chunk(elem_t* s, const elem_t* g, const elem_t* fallback, bool ok, int cols) {
  if constexpr (kVec) {
    cp_async_16(s, ok ? g : fallback, ok);
  } else {
    unsigned w[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const unsigned lo = ok && e < cols ? g[e] : 0;
      const unsigned hi = ok && e + 1 < cols ? g[e + 1] : 0;
      w[e / 2] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(s) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// How a CTA's threads share the 16-byte chunks of a tile's rows, in load_tile and
// store_tile: kLanes threads a row, each taking every kLanes-th chunk, walking down the
// rows in steps of kRowStep, so a thread's addresses advance by constants: no per-chunk
// division or 64-bit index arithmetic (at d 96 a loop over chunk indices, i / 12 and
// i % 12 per chunk, cost the forward 60% more ALU instructions than FlashAttention-2's,
// ncu). kLanes is the largest power of two dividing the chunks (4 for the 12, 20 and 28
// chunks of head dims 96, 160 and 224), at most kThreads / 8: rows then advance by a
// multiple of 8, and a thread's chunk keeps its swizzled place in every row it visits.
template <int kHeadDim, int kThreads>
struct ChunkLanes {
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kLanes = (kChunks & -kChunks) < kThreads / 8 ? (kChunks & -kChunks) : kThreads / 8;
  static constexpr int kPerLane = kChunks / kLanes, kRowStep = kThreads / kLanes;
  static_assert(kThreads % kLanes == 0 && kRowStep % 8 == 0, "threads per row");
  static __device__ __forceinline__ int first_chunk() { return threadIdx.x % kLanes; }
  static __device__ __forceinline__ int first_row() { return threadIdx.x / kLanes; }
};

// Global rows [row0, row0 + kRows) of one (batch, head) slice -> shared tile in layout S.
// kVec: every row start is 16-byte aligned and headdim % 8 == 0, so whole chunks
// go through cp.async; otherwise (odd head dims, odd strides) each element is
// loaded on its own and the chunk is assembled in registers.
template <int kRows, typename S, int kThreads, bool kVec>
__device__ __forceinline__ void load_tile(elem_t* tile, const elem_t* src, int64 row_stride,
                                          int row0, int nrows, int headdim) {
  using L = ChunkLanes<S::kCols, kThreads>;
  const int c_first = L::first_chunk(), r_first = L::first_row();
  const elem_t* g = src + (row0 + r_first) * row_stride + c_first * 8;
  const int s_first = S::at(r_first, c_first * 8);
  // Element loads are synchronous: unrolled, all their registers would be live at once.
  constexpr int kUnroll = kVec ? ceil_div(kRows, L::kRowStep) : 1, kChunkUnroll = kVec ? L::kPerLane : 1;
#pragma unroll kUnroll
  for (int it = 0; it < ceil_div(kRows, L::kRowStep); ++it, g += L::kRowStep * row_stride) {
    const int r = r_first + it * L::kRowStep;
    if (kRows % L::kRowStep != 0 && r >= kRows) break;
#pragma unroll kChunkUnroll
    for (int j = 0; j < L::kPerLane; ++j) {
      const int c = c_first + j * L::kLanes;
      load_chunk<kVec>(tile + S::moved(s_first, j * L::kLanes * 8) + S::fixed(it * L::kRowStep, j * L::kLanes * 8),
                       g + j * L::kLanes * 8, src, row0 + r < nrows && c * 8 < headdim, headdim - c * 8);
    }
  }
}

// Shared tile -> global rows [row0, row0 + kRows), clipped to nrows x headdim; the
// threads share the chunks as in load_tile. (Addresses from the row index: with
// pointers advanced as in load_tile, the d 128 causal backward spilled 4 bytes.)
template <int kRows, typename S, int kThreads, bool kVec>
__device__ __forceinline__ void store_tile(elem_t* dst, const elem_t* tile, int64 row_stride,
                                           int row0, int nrows, int headdim) {
  using L = ChunkLanes<S::kCols, kThreads>;
  const int c_first = L::first_chunk(), r_first = L::first_row();
  const int s_first = S::at(r_first, c_first * 8);
#pragma unroll 1
  for (int r = r_first; r < kRows && row0 + r < nrows; r += L::kRowStep) {
#pragma unroll
    for (int j = 0; j < L::kPerLane; ++j) {
      const int c = (c_first + j * L::kLanes) * 8;
      if (c >= headdim) continue;
      elem_t* g = dst + (row0 + r) * row_stride + c;
      const elem_t* s = tile + S::moved(s_first, j * L::kLanes * 8) + S::fixed(r - r_first, j * L::kLanes * 8);
      if constexpr (kVec) {
        *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(s);
      } else {
        for (int e = 0; e < 8 && c + e < headdim; ++e) g[e] = s[e];
      }
    }
  }
}

// mma accumulators of one warp's 16 rows (C layout, acc[kNTiles][4]) -> global
// rows row0 + g and row0 + g + 8, columns col0 + 8 nt + 2 t (+1), times mul,
// clipped to nrows x headdim. kVec: headdim % 8 == 0 and aligned rows, so each
// column pair is one 4-byte store.
template <typename T, int kNTiles, bool kVec>
__device__ __forceinline__ void store_accumulators(elem_t* dst, int64 row_stride, const float (&acc)[kNTiles][4],
                                                   int row0, int nrows, int col0, int headdim, float mul, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row >= nrows) continue;
    elem_t* out = dst + row * row_stride;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int col = col0 + nt * 8 + 2 * t;
      const unsigned pair = DType<T>::pack(acc[nt][2 * h] * mul, acc[nt][2 * h + 1] * mul);
      if (kVec) {
        if (col < headdim) *reinterpret_cast<unsigned*>(out + col) = pair;
      } else {
        if (col < headdim) out[col] = elem_t(pair & 0xffffu);
        if (col + 1 < headdim) out[col + 1] = elem_t(pair >> 16);
      }
    }
  }
}

}  // namespace cuflash
