// Where a sequence's cached keys and values lie: one small object for contiguous and
// paged caches alike. A contiguous cache is the case of one page per sequence: logical
// row t of sequence b lies in page block_table[b][t / page_size] at row t % page_size,
// or, without a table, in cache row cache_batch_idx[b] (default b) at row t.
#pragma once
#include "common.cuh"
#include "decode/decode_params.cuh"

namespace cuflash {

// One sequence of a KV-cache call: its rows and where they lie.
struct CachedSequence {
  const int* pages;   // this sequence's row of block_table; null: contiguous
  int64 cache_row;    // contiguous: the cache row serving this sequence
  int page_size, page_shift, pages_total;  // page_shift: log2 page_size, or -1
  int length;         // rows cached before this call (cache_seqlens[b])
  int leftpad;        // rows before it are padding
  int end;            // length + seqlen_new: the rows attended to end here

  // Lengths, left padding and cache indices come from device arrays the host cannot read
  // without a synchronisation: clamped here into the cache, so that no value reads or
  // writes outside it (the host checks them wherever it can read them).
  static __device__ __forceinline__ CachedSequence of(const DecodeParams& p, int batch) {
    CachedSequence s;
    s.pages = p.block_table ? p.block_table + batch * p.block_table_stride : nullptr;
    const int row = p.cache_batch_idx ? p.cache_batch_idx[batch] : batch;
    s.cache_row = min(max(row, 0), p.caches - 1);
    s.page_size = p.page_size;
    s.page_shift = __popc(p.page_size) == 1 ? __ffs(p.page_size) - 1 : -1;
    s.pages_total = p.caches;
    const int length = p.cu_seqlens_k    ? p.cu_seqlens_k[batch + 1] - p.cu_seqlens_k[batch]
                       : p.cache_seqlens ? p.cache_seqlens[batch]
                                         : p.seqlen_cache_all;
    s.length = min(max(length, 0), p.capacity - p.seqlen_new);
    s.leftpad = p.cache_leftpad ? min(max(p.cache_leftpad[batch], 0), s.length) : 0;
    s.end = s.length + p.seqlen_new;
    return s;
  }

  // Which entry of the sequence's pages holds row t, and where in its page: shifts for the
  // usual page sizes, powers of two.
  __device__ __forceinline__ int page_of(int t) const { return page_shift >= 0 ? t >> page_shift : t / page_size; }
  __device__ __forceinline__ int row_in_page(int t) const {
    return page_shift >= 0 ? t & (page_size - 1) : t % page_size;
  }
  // The page-table entry of a cached row t, as stored (checked where it is used,
  // row_offset): -1 for a row outside [leftpad, length) or a contiguous cache. A global
  // load that the row's copy depends on, which a caller issues a tile early (TilePages).
  __device__ __forceinline__ int page(int t) const {
    return pages != nullptr && t >= leftpad && t < length ? pages[page_of(t)] : -1;
  }
  // Is `page` (a page-table entry) a page of the cache?
  __device__ __forceinline__ bool valid(int page) const { return unsigned(page) < unsigned(pages_total); }

  // Element offset of logical row t (head 0) in a cache laid out as `a`; -1 where its page
  // index is out of range (the row then reads as zeros and is never written).
  __device__ __forceinline__ int64 offset(const ArrayView& a, int t) const {
    if (pages == nullptr) return cache_row * a.batch_stride + int64(t) * a.row_stride;
    const int page = pages[page_of(t)];
    return valid(page) ? row_offset(a, t, page) : -1;
  }
  // The same for a row t of a paged cache whose page-table entry `page` is valid.
  __device__ __forceinline__ int64 row_offset(const ArrayView& a, int t, int page) const {
    return int64(page) * a.batch_stride + int64(row_in_page(t)) * a.row_stride;
  }

  // Do rows [t, t + rows) hold no left padding and no new rows: cached rows, then perhaps
  // rows past the end (copied as zeros)? Most tiles, the last one of a call without new
  // rows included.
  __device__ __forceinline__ bool plain(int t, int rows) const {
    return t >= leftpad && (t + rows <= length || end == length);
  }
};

// The page-table entries of the rows one thread copies in a key tile, read a tile ahead:
// a page index is a global load that the tile's copies would otherwise wait on, once a
// tile (FlashInfer's paged decode reads its page offsets ahead likewise). With `runs`
// (pages a whole number of runs long) a plain tile (CachedSequence::plain) is copied in runs
// (load_run: rows first * kPerThread + j), and row[0] is the entry of the thread's run;
// any other tile row by row (load_rows: rows first + i * kStep), row[i] the entry of
// each. Stored unchecked: a check here would wait on the loads at once (ptxas placed the
// compare three instructions after each load).
template <int kRows, int kStep>
struct TilePages {
  static constexpr int kPerThread = ceil_div(kRows, kStep);  // rows a thread copies (a run's length)
  int row[kPerThread];

  static __device__ __forceinline__ TilePages of(const CachedSequence& seq, int tile, int first, bool runs) {
    TilePages pages;
    const int t0 = tile * kRows;
    if (runs && seq.plain(t0, kRows)) {
      pages.row[0] = seq.page(t0 + first * kPerThread);
    } else {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) pages.row[i] = seq.page(t0 + first + i * kStep);
    }
    return pages;
  }
  // row[i] for an i known only at run time (a rolled loop), without moving the array to
  // local memory.
  __device__ __forceinline__ int at(int i) const {
    int page = row[0];
#pragma unroll
    for (int j = 1; j < kPerThread; ++j) page = i == j ? row[j] : page;
    return page;
  }
};

}  // namespace cuflash
