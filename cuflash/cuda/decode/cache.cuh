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
  int page_size, pages_total;
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
    s.pages_total = p.caches;
    const int length = p.cu_seqlens_k    ? p.cu_seqlens_k[batch + 1] - p.cu_seqlens_k[batch]
                       : p.cache_seqlens ? p.cache_seqlens[batch]
                                         : p.seqlen_cache_all;
    s.length = min(max(length, 0), p.capacity - p.seqlen_new);
    s.leftpad = p.cache_leftpad ? min(max(p.cache_leftpad[batch], 0), s.length) : 0;
    s.end = s.length + p.seqlen_new;
    return s;
  }

  // Element offset of logical row t's (head 0) in a cache laid out as `a`; -1 where its page
  // index is out of range (the row then reads as zeros and is never written).
  __device__ __forceinline__ int64 offset(const ArrayView& a, int t) const {
    if (pages == nullptr) return cache_row * a.batch_stride + int64(t) * a.row_stride;
    const int page = pages[t / page_size];
    if (page < 0 || page >= pages_total) return -1;
    return int64(page) * a.batch_stride + int64(t % page_size) * a.row_stride;
  }

  // Are rows [t, t + rows) all cached rows of this call (past the left padding, before
  // the new ones) lying one row stride apart: in a contiguous cache, or in one page?
  // Then a tile of them is one strided copy from the first (most tiles of a long cache).
  __device__ __forceinline__ bool strided(int t, int rows) const {
    return t >= leftpad && t + rows <= length && (pages == nullptr || t / page_size == (t + rows - 1) / page_size);
  }
};

}  // namespace cuflash
