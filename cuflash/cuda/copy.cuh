// Moving tiles between global and shared memory (cp.async, predicated tails); how
// the tiles lie there is layout.cuh's.
#pragma once
#include "common.cuh"
#include "layout.cuh"

namespace cuflash {

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
    for (int e = 0; e < kChunkElems; e += 2) {
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
  static constexpr int kChunks = kHeadDim / kChunkElems;
  static constexpr int kLanes = (kChunks & -kChunks) < kThreads / 8 ? (kChunks & -kChunks) : kThreads / 8;
  static constexpr int kPerLane = kChunks / kLanes, kRowStep = kThreads / kLanes;
  static_assert(kThreads % kLanes == 0 && kRowStep % 8 == 0, "threads per row");
  static __device__ __forceinline__ int first_chunk() { return threadIdx.x % kLanes; }
  static __device__ __forceinline__ int first_row() { return threadIdx.x / kLanes; }
};

// Global rows [row0, row0 + kRows) of one (batch, head) slice -> the whole shared tile
// (every column, from its row 0). kVec: every row start is 16-byte aligned and
// headdim % 8 == 0, so whole chunks go through cp.async; otherwise (odd head dims, odd
// strides) each element is loaded on its own and the chunk is assembled in registers.
template <int kRows, int kThreads, bool kVec, typename L>
__device__ __forceinline__ void load_tile(SharedTile<L> tile, const elem_t* src, int64 row_stride,
                                          int row0, int nrows, int headdim) {
  using Lanes = ChunkLanes<L::kCols, kThreads>;
  const int c_first = Lanes::first_chunk(), r_first = Lanes::first_row();
  const elem_t* g = src + (row0 + r_first) * row_stride + c_first * kChunkElems;
  const int s_first = L::at(r_first, c_first * kChunkElems);
  // Element loads are synchronous: unrolled, all their registers would be live at once.
  constexpr int kUnroll = kVec ? ceil_div(kRows, Lanes::kRowStep) : 1, kChunkUnroll = kVec ? Lanes::kPerLane : 1;
#pragma unroll kUnroll
  for (int it = 0; it < ceil_div(kRows, Lanes::kRowStep); ++it, g += Lanes::kRowStep * row_stride) {
    const int r = r_first + it * Lanes::kRowStep;
    if (kRows % Lanes::kRowStep != 0 && r >= kRows) break;
#pragma unroll kChunkUnroll
    for (int j = 0; j < Lanes::kPerLane; ++j) {
      const int c = c_first + j * Lanes::kLanes, dc = j * Lanes::kLanes * kChunkElems;
      load_chunk<kVec>(tile.data + L::moved(s_first, dc) + L::fixed(it * Lanes::kRowStep, dc), g + dc, src,
                       row0 + r < nrows && c * kChunkElems < headdim, headdim - c * kChunkElems);
    }
  }
}

// Rows from anywhere -> the whole shared tile: row r from source(r, i), a pointer to its
// first element, or null for a row of zeros (the KV-cache call's paged caches and packed
// query heads); i counts the rows this thread copies (r = first_row() + i * kRowStep, for
// what the caller read ahead of them). Threads share the chunks as in load_tile; `any` is
// a valid global address, the source of the zero-filling copies. kUnrolled = false keeps
// the rows' loop rolled: for tiles copied once a call (the KV-cache call's edge tiles),
// whose unrolled code would cost more in instruction fetches than it saves.
template <int kRows, int kThreads, bool kVec, bool kUnrolled = true, typename L, typename Source>
__device__ __forceinline__ void load_rows(SharedTile<L> tile, Source source, int headdim, const elem_t* any) {
  using Lanes = ChunkLanes<L::kCols, kThreads>;
  const int c_first = Lanes::first_chunk(), r_first = Lanes::first_row();
  const int s_first = L::at(r_first, c_first * kChunkElems);
  constexpr int kUnroll = kVec && kUnrolled ? ceil_div(kRows, Lanes::kRowStep) : 1;
  constexpr int kChunkUnroll = kVec ? Lanes::kPerLane : 1;
#pragma unroll kUnroll
  for (int it = 0; it < ceil_div(kRows, Lanes::kRowStep); ++it) {
    const int r = r_first + it * Lanes::kRowStep;
    if (kRows % Lanes::kRowStep != 0 && r >= kRows) break;
    const elem_t* row = source(r, it);
#pragma unroll kChunkUnroll
    for (int j = 0; j < Lanes::kPerLane; ++j) {
      const int c = (c_first + j * Lanes::kLanes) * kChunkElems, dc = j * Lanes::kLanes * kChunkElems;
      const bool ok = row != nullptr && c < headdim;
      load_chunk<kVec>(tile.data + L::moved(s_first, dc) + L::fixed(it * Lanes::kRowStep, dc), ok ? row + c : any,
                       any, ok, headdim - c);
    }
  }
}

// A run of rows -> the whole shared tile: the threads that share a row's chunks (as in
// load_tile) copy kRun = kRows / kRowStep consecutive rows, [first_row() kRun, + kRun),
// from `src` (the run's first row, or null for zeros) down by row_stride, its rows from
// the nrows-th on as zeros. A paged
// cache's run then lies in one page: one page-table entry a thread a tile, where
// load_rows's rows kRowStep apart take one a row (their addresses cost the KV-cache
// call's copy of a tile about five times the instructions of load_tile's).
template <int kRows, int kThreads, bool kVec, typename L>
__device__ __forceinline__ void load_run(SharedTile<L> tile, const elem_t* src, int64 row_stride, int nrows,
                                         int headdim, const elem_t* any) {
  using Lanes = ChunkLanes<L::kCols, kThreads>;
  static_assert(kRows % Lanes::kRowStep == 0, "whole runs");
  constexpr int kRun = kRows / Lanes::kRowStep;
  const int c_first = Lanes::first_chunk() * kChunkElems, r_first = Lanes::first_row() * kRun;
  const bool ok = src != nullptr;
  const elem_t* g = ok ? src : any;
  // Element loads are synchronous: unrolled, all their registers would be live at once.
  constexpr int kUnroll = kVec ? kRun : 1, kChunkUnroll = kVec ? Lanes::kPerLane : 1;
#pragma unroll kUnroll
  for (int j = 0; j < kRun; ++j, g += ok ? row_stride : 0) {
#pragma unroll kChunkUnroll
    for (int jj = 0; jj < Lanes::kPerLane; ++jj) {
      // (A chunk not copied reads from the run's start: an offset fixed down the run, where
      // a choice of pointer a row cost two selects.)
      const int c = c_first + jj * Lanes::kLanes * kChunkElems, from = ok && c < headdim ? c : 0;
      const bool copied = ok && j < nrows && c < headdim;
      if constexpr (kVec)
        cp_async_16(tile.data + L::at(r_first + j, c), g + from, copied);
      else
        load_chunk<kVec>(tile.data + L::at(r_first + j, c), g + from, any, copied, headdim - c);
    }
  }
}

// The shared tile's rows -> anywhere: row r to dest(r), a pointer to its first element,
// or null for a row not stored; the threads share the chunks as in load_rows.
template <int kRows, int kThreads, bool kVec, typename L, typename Dest>
__device__ __forceinline__ void store_rows(SharedTile<L> tile, Dest dest, int headdim) {
  using Lanes = ChunkLanes<L::kCols, kThreads>;
  const int c_first = Lanes::first_chunk(), r_first = Lanes::first_row();
  const int s_first = L::at(r_first, c_first * kChunkElems);
#pragma unroll 1
  for (int r = r_first; r < kRows; r += Lanes::kRowStep) {
    elem_t* row = dest(r);
    if (row == nullptr) continue;
#pragma unroll
    for (int j = 0; j < Lanes::kPerLane; ++j) {
      const int c = (c_first + j * Lanes::kLanes) * kChunkElems, dc = j * Lanes::kLanes * kChunkElems;
      if (c >= headdim) continue;
      const elem_t* s = tile.data + L::moved(s_first, dc) + L::fixed(r - r_first, dc);
      if constexpr (kVec) {
        *reinterpret_cast<uint4*>(row + c) = *reinterpret_cast<const uint4*>(s);
      } else {
        for (int e = 0; e < kChunkElems && c + e < headdim; ++e) row[c + e] = s[e];
      }
    }
  }
}

// The whole shared tile -> global rows [row0, row0 + kRows), clipped to nrows x headdim;
// the threads share the chunks as in load_tile. (Addresses from the row index: with
// pointers advanced as in load_tile, the d 128 causal backward spilled 4 bytes.)
template <int kRows, int kThreads, bool kVec, typename L>
__device__ __forceinline__ void store_tile(elem_t* dst, SharedTile<L> tile, int64 row_stride,
                                           int row0, int nrows, int headdim) {
  using Lanes = ChunkLanes<L::kCols, kThreads>;
  const int c_first = Lanes::first_chunk(), r_first = Lanes::first_row();
  const int s_first = L::at(r_first, c_first * kChunkElems);
#pragma unroll 1
  for (int r = r_first; r < kRows && row0 + r < nrows; r += Lanes::kRowStep) {
#pragma unroll
    for (int j = 0; j < Lanes::kPerLane; ++j) {
      const int c = (c_first + j * Lanes::kLanes) * kChunkElems;
      if (c >= headdim) continue;
      elem_t* g = dst + (row0 + r) * row_stride + c;
      const int dc = j * Lanes::kLanes * kChunkElems;
      const elem_t* s = tile.data + L::moved(s_first, dc) + L::fixed(r - r_first, dc);
      if constexpr (kVec) {
        *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(s);
      } else {
        for (int e = 0; e < kChunkElems && c + e < headdim; ++e) g[e] = s[e];
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
