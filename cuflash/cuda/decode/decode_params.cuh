// The arguments of the decode kernels, passed by value (cuflash/_params.py fills the
// same layout): the KV-cache call (split_kv.cu) and the merge of partial results
// (merge.cu), whose arguments the KV-cache call carries for its own merge step.
#pragma once
#include "params.cuh"  // ArrayView

namespace cuflash {

// Partial results over disjoint key sets, combined row by row (merge.cu): part i of row
// (b, s, h) at parts + i * part_stride + b * batch_stride + s * row_stride + h * head_stride
// (elements of type TIn), its LSE at lses + i * lse_part_stride + b * lse_batch_stride +
// h * lse_head_stride + s.
struct MergeParams {
  const void* parts;
  const float* lses;
  void* out;      // (batch, seqlen_q, nheads, headdim), strided like the parts by out_*_stride
  float* out_lse;  // (batch, nheads, seqlen_q) contiguous; null: not written
  int64 part_stride, batch_stride, row_stride, head_stride;
  int64 lse_part_stride, lse_batch_stride, lse_head_stride;
  int64 out_batch_stride, out_row_stride, out_head_stride;
  int count, batch, seqlen_q, nheads, headdim;  // count: parts
};

struct DecodeParams {
  ArrayView q, o;                 // (batch, seqlen_q, nheads, headdim)
  ArrayView k_cache, v_cache;     // batch_stride: between caches, or between pages when paged
  ArrayView k_new, v_new;         // (batch, seqlen_new, nheads_k, headdim); null when nothing is appended
  // LSE of row i of (b, h) at b * lse_batch_stride + h * lse_head_stride + first row of b + i:
  // (batch, nheads, seqlen_q), or (nheads, total_q) for packed queries; null: not written.
  float* lse;
  int64 lse_batch_stride, lse_head_stride;
  // Partial results, merged by the merge step: (parts, query rows, nheads, headdim) and
  // (parts, nheads, query rows), float32, contiguous, the query rows numbered b * seqlen_q + i
  // (or, packed, as q's); null with one part.
  float* partial_o;
  float* partial_lse;
  int query_rows;
  // Packed queries (the varlen call over a paged cache): sequence b is rows cu_seqlens_q[b] ..
  // cu_seqlens_q[b + 1] - 1 of q and o (batch_stride 0; seqlen_q the longest) and the first
  // cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages; null: dense.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* cache_seqlens;       // (batch,); null: every sequence has seqlen_cache_all rows
  const int* cache_batch_idx;     // (batch,): the cache of each sequence; null: its own
  const int* cache_leftpad;       // (batch,): rows before it are padding; null: none
  const int* block_table;         // (batch, max_blocks): pages of each sequence; null: contiguous
  int64 block_table_stride;
  const void* rotary_cos;         // (rotary_rows, rotary_dim / 2), q's dtype or float32; null: no rotary
  const void* rotary_sin;
  const float* alibi_slopes;      // slope of (b, h) at b * alibi_batch_stride + h; null: off
  int64 alibi_batch_stride;
  int seqlen_cache_all;
  int caches;                     // pages when paged, else cache rows: valid indices are [0, caches)
  int page_size;                  // rows of a page (the cache's length when contiguous)
  int capacity;                   // rows one sequence's cache holds
  int seqlen_q, seqlen_new, nheads, heads_per_kv, headdim;
  int rotary_dim, rotary_rows, rotary_interleaved, rotary_float32;
  int window_left, window_right;  // normalised on the host: -1 unbounded, else a bound in keys
  float scale, scale_log2, softcap;
  // Parts of the keys, merged by the merge step (split_kv.cu): parts in the workspace, the
  // CTAs a (sequence, KV head) takes them in turn; deterministic: a partition of each
  // sequence's tiles into min(max_parts, tiles / min_part_tiles) parts, else num_splits.
  int num_splits, parts, deterministic, max_parts, min_part_tiles;
  MergeParams merge;              // the merge step of a split call (merge.cu)
};

}  // namespace cuflash
