// Which scores a query may see, aligned bottom-right as flash-attn: with
// diagonal = seqlen_k - seqlen_q, query i sees key j iff j < seqlen_k and, for a
// local (causal or sliding-window) mask, i + diagonal - left <= j <= i + diagonal + right.
// Causal is right = 0.
#pragma once
#include "common.cuh"
#include "fragment.cuh"

namespace cuflash {

template <bool kLocal>
struct Mask {
  int seqlen_k;
  int diagonal;
  int left, right;

  // The band of one sequence from the window of Params: a side that is negative or
  // reaches past every key (>= seqlen_k) is unbounded, a bound beyond all keys.
  static __device__ __forceinline__ Mask of(int seqlen_q, int seqlen_k, int left, int right) {
    const int unbounded = seqlen_q + seqlen_k + 1;
    return Mask{seqlen_k, seqlen_k - seqlen_q, left < 0 || left >= seqlen_k ? unbounded : left,
                right < 0 || right >= seqlen_k ? unbounded : right};
  }

  // The band with the sides as given: negative is unbounded, any other value a bound,
  // however far (the KV-cache call normalises its window against the cache's length on
  // the host, as flash-attn does, not against each sequence's).
  static __device__ __forceinline__ Mask bounded(int seqlen_q, int seqlen_k, int left, int right) {
    const int unbounded = seqlen_q + seqlen_k + 1;
    return Mask{seqlen_k, seqlen_k - seqlen_q, left < 0 ? unbounded : min(left, unbounded),
                right < 0 ? unbounded : min(right, unbounded)};
  }

  __device__ __forceinline__ bool visible(int row, int col) const {
    return col < seqlen_k && (!kLocal || (col >= row + diagonal - left && col <= row + diagonal + right));
  }

  // Row by row: the keys query `row` sees are lo <= col <= hi (none when hi < lo) ...
  __device__ __forceinline__ int2 keys_seen_by(int row) const {
    return make_int2(kLocal ? row + diagonal - left : 0, kLocal ? min(seqlen_k - 1, row + diagonal + right) : seqlen_k - 1);
  }
  // ... and the queries that see key `col` are lo <= row <= hi.
  __device__ __forceinline__ int2 queries_seeing(int col) const {
    if (col >= seqlen_k) return make_int2(1, 0);
    return kLocal ? make_int2(col - diagonal - right, col - diagonal + left) : make_int2(-1 << 30, 1 << 30);
  }

  // The keys any of the query rows [row_begin, row_end) can see are [key_begin, key_end).
  __device__ __forceinline__ int key_begin(int row_begin) const {
    return kLocal ? max(0, row_begin + diagonal - left) : 0;
  }
  __device__ __forceinline__ int key_end(int row_end) const {
    return kLocal ? max(0, min(seqlen_k, row_end + diagonal + right)) : seqlen_k;
  }
  // The queries that can see any of the keys [col_begin, col_end) start at this row.
  __device__ __forceinline__ int query_begin(int col_begin) const {
    return kLocal ? max(0, col_begin - diagonal - right) : 0;
  }
  __device__ __forceinline__ int query_end(int col_end, int seqlen_q) const {
    return kLocal ? max(0, min(seqlen_q, col_end - diagonal + left)) : seqlen_q;
  }
  // The query tiles of kBlockM rows that see any key of [col_begin, col_end): the first, and
  // how many (the backward's loop over query tiles for one key tile).
  template <int kBlockM>
  __device__ __forceinline__ int2 query_tiles(int col_begin, int col_end, int seqlen_q) const {
    const int first = query_begin(col_begin) / kBlockM;
    return make_int2(first, max(0, ceil_div(query_end(col_end, seqlen_q), kBlockM) - first));
  }

  // Does every query of [row_begin, row_end) see every key of [col_begin, col_end)?
  // Only tiles where it does not pay for masking.
  __device__ __forceinline__ bool covers(int row_begin, int row_end, int col_begin, int col_end) const {
    return col_end <= seqlen_k &&
           (!kLocal || (col_begin >= row_end - 1 + diagonal - left && col_end - 1 <= row_begin + diagonal + right));
  }

  // s[mt][nt][e] is the score of a lane's line and column (fragment.cuh), the lines being
  // queries and the columns keys, or with kTransposed the other way round; hidden scores
  // become -inf. One range test per score, against the line's visible columns taken
  // relative to the lane's first column so that each test compares with a constant
  // (visible() per score, unrolled over a tile, compiled to a branch and predicate shuffling
  // per score). Lines from row0, columns from col0.
  template <bool kTransposed = false, int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kMTiles][kNTiles][4], int row0, int col0, int lane) const {
    const int t = lane & 3;
    for_each_line<kMTiles>(lane, row0, [&](int mt, int h, int line) {
      const int2 seen = kTransposed ? queries_seeing(line) : keys_seen_by(line);
      const int lo = seen.x - (col0 + 2 * t), hi = seen.y - (col0 + 2 * t);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if ((nt * 8 + j < lo) | (nt * 8 + j > hi)) s[mt][nt][2 * h + j] = -kInf;
    });
  }

  // As apply, where a lane's lines are not consecutive query rows (the KV-cache call packs
  // the query heads of a KV head into the tile's lines): line (mt, h) of this lane is
  // query row rows[mt][h]. Columns below 0 (left padding) are hidden too. (Its lines
  // through fragment.cuh's for_each_line, the KV-cache kernel with softcap or ALiBi came
  // out as other machine code.)
  template <int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply_to_rows(float (&s)[kMTiles][kNTiles][4], const int (&rows)[kMTiles][2],
                                                int col0, int lane) const {
    const int t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int2 seen = keys_seen_by(rows[mt][h]);
        const int lo = max(seen.x, 0) - (col0 + 2 * t), hi = seen.y - (col0 + 2 * t);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j)
            if ((nt * 8 + j < lo) | (nt * 8 + j > hi)) s[mt][nt][2 * h + j] = -kInf;
      }
  }
};

}  // namespace cuflash
