// How tiles lie in shared memory: the layout types, and SharedTile, a tile (or a block
// of one) that carries its layout in its type. The copies (copy.cuh) and the fragment
// loads (ldmatrix, mma.cuh) take a SharedTile and ask its layout for every address.
#pragma once
#include "common.cuh"

namespace cuflash {

// Columns move in 16-byte chunks of 8 elements; a 128-byte line of shared memory (the
// 32 banks once) holds 8 chunks.
constexpr int kChunkElems = 8;
constexpr int kLineElems = 64;
constexpr int kElemBytes = 2;  // fp16 / bf16

// Shared tiles are row-major; a layout maps (row, column) to an element offset from the
// tile's origin. ldmatrix reads eight 16-byte rows of one chunk column at a time: those
// eight must lie in eight different 4-bank groups for the read to be free of bank
// conflicts. Two ways:
//
// PaddedRows: rows of kCols + 8 elements. Row r starts 16 r bytes further into the
//   banks, so any eight consecutive rows of a chunk column are conflict-free. Used where
//   a row is not a whole number of 128-byte lines (head dims 32, 96, 160, 224; P and dS),
//   and at d 192, whose backward splits the columns among warps 48 at a time (those
//   starts do not compose with the swizzle, below).
// SwizzledRows: rows of exactly kCols elements (a multiple of 64: whole 128-byte lines);
//   inside each line, chunk c of row r lies at chunk c ^ (r % 8) (Swizzle). Rows start on
//   a line, so a warp's cp.async of 128-byte row pieces writes whole lines (ncu: 4 shared
//   wavefronts a 512-byte copy instruction, where the padded rows took 10.5;
//   FlashAttention-2's copies take 4 the same way). Against padded rows: forward d 256
//   +3.5-7.7%, forward + backward +2-5% at d 64, 128 and 256 (A/B, 512-8k, not causal).
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
  static constexpr int kCols = kColumns, kRowElems = kCols + kChunkElems;
  static __host__ __device__ constexpr bool composes(int) { return true; }
  static __device__ __forceinline__ int at(int row, int col) { return row * kRowElems + col; }
  static __device__ __forceinline__ int moved(int offset, int) { return offset; }
  static __host__ __device__ constexpr int fixed(int dr, int dc) { return dr * kRowElems + dc; }
  static __device__ __forceinline__ unsigned address(const elem_t* tile, int offset, int dr, int dc) {
    return smem_addr(tile + offset) + kElemBytes * fixed(dr, dc);
  }
};

// The 128-byte swizzle of SwizzledRows: inside a line, chunk c of row r lies at chunk
// c ^ (r % 8). An offset dc from a column splits into the part inside a line, which the
// XOR moves, and whole lines, which it leaves in place.
struct Swizzle {
  static __device__ __forceinline__ int col(int row, int col) { return col ^ ((row & 7) << 3); }
  static __host__ __device__ constexpr int in_line(int dc) { return dc & (kLineElems - 1); }
  static __host__ __device__ constexpr int whole_lines(int dc) { return dc & ~(kLineElems - 1); }
};

// kXorAddress: `address` applies the swizzle to the byte address itself, one LOP3 an
// ldmatrix (the tile must start on a 128-byte line); otherwise to the lane's element
// offset, which the compiler may keep in registers, one for each of the four chunk
// pairs. A/B: the first +1-4% at d 64, forward and backward; the second up to 4% faster
// in the d 256 causal backward; within 2% either way at d 128. The two-kernel backward
// takes the first: the second's registers spilled its d 256 dQ kernel with extras.
template <int kColumns, bool kXorAddress>
struct SwizzledRows {
  static constexpr int kCols = kColumns, kRowElems = kCols;
  static_assert(kCols % kLineElems == 0, "whole 128-byte lines");
  // Products over `cols` columns may start at any multiple of `cols` (see above).
  static __host__ __device__ constexpr bool composes(int cols) {
    return cols % kLineElems == 0 || (cols & (cols - 1)) == 0;
  }
  static __device__ __forceinline__ int at(int row, int col) { return row * kCols + Swizzle::col(row, col); }
  static __device__ __forceinline__ int moved(int offset, int dc) { return offset ^ Swizzle::in_line(dc); }
  static __host__ __device__ constexpr int fixed(int dr, int dc) { return dr * kCols + Swizzle::whole_lines(dc); }
  static __device__ __forceinline__ unsigned address(const elem_t* tile, int offset, int dr, int dc) {
    if constexpr (kXorAddress) {
      return (smem_addr(tile + offset) ^ (kElemBytes * Swizzle::in_line(dc))) + kElemBytes * fixed(dr, dc);
    } else {
      return smem_addr(tile + moved(offset, dc)) + kElemBytes * fixed(dr, dc);
    }
  }
};

template <bool kFirst, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

// The layout of a head-dim-wide tile (Q, K, V, dO) of bucket kHeadDim: swizzled at 64,
// 128 and 256. (Kernels place these tiles first in shared memory, so they start on
// 128-byte lines.)
template <int kHeadDim, bool kXorAddress = kHeadDim == 64>
using HeadDimLayout = typename Select<kHeadDim >= 64 && (kHeadDim & (kHeadDim - 1)) == 0,
                                      SwizzledRows<kHeadDim, kXorAddress>, PaddedRows<kHeadDim>>::type;

// A tile in shared memory laid out by Layout: copies and products take the layout from
// the tile's type. A product's first column goes beside it as a plain int, not inside
// it: passed by value, an aggregate of pointer and column reordered the backward's
// instructions.
template <typename Layout>
struct SharedTile {
  elem_t* data;  // row 0

  // The tile from `row` on: row must keep the layout's phase (a multiple of 8).
  __device__ __forceinline__ SharedTile from_row(int row) const { return SharedTile{data + row * Layout::kRowElems}; }
};

}  // namespace cuflash
