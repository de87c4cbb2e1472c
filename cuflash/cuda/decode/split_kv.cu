// The KV-cache call (flash-attn's flash_attn_with_kvcache): a few new queries attend to a
// long cache. One CTA per (split, KV head, sequence); grid x runs over the splits, then the
// blocks of kBlockM rows. The keys of a sequence are cut into parts, and split s takes
// parts s, s + num_splits, ...: each part one softmax and one partial result.
//
// The query heads that share a KV head are packed into the tile's rows (row r is query
// r / group of head kv_head * group + r % group): each K/V byte is read once per group,
// and tensor cores do the products even for one query. The warps split each key tile
// (kBlockN / kWarps keys each), every warp with its own online softmax over its keys:
//
//   for each key tile n of the part (cp.async, kStages deep):
//     S = Q K_n^T;  S = mod(S);  S = mask(S)     this warp's keys of the tile
//     m' = max(m, rowmax S);  P = exp(scale (S - m'));  l = ...;  O = ... + P V_n
//   each warp: O /= l, LSE = scale m + log l;  the warps merged (partial.cuh)
//
// then the part's O and LSE go to the output (one part), to the partial results that
// the merge step combines in part order (merge.cu), or, where the splits of a row block
// run as one thread block cluster (sm_90, kClusterMerge), to shared memory, where the
// cluster's CTAs merge them (each CTA some of the rows, reading the others' results).
// Keys are the rows [leftpad, length + seqlen_new) of the sequence's cache (cache.cuh:
// contiguous or paged); rows outside are zero-filled, never read, and masked. New keys and
// values are read from k and v (rotated in shared memory), never from the cache rows this
// call writes: one CTA per (sequence, KV head) writes them into the cache, and no other
// reads them there.
#include "common.cuh"
#include "copy.cuh"
#include "decode/cache.cuh"
#include "decode/cluster.cuh"
#include "decode/decode_params.cuh"
#include "decode/partial.cuh"
#include "decode/rotary.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "pipeline.cuh"
#include "score.cuh"
#include "softmax.cuh"

namespace cuflash {

// Splits that merge in a cluster at most (the largest cluster Hopper schedules; _plan's
// MAX_CLUSTER_SPLITS).
constexpr int kMaxClusterSplits = 16;

// Shared memory: the forward's (the Q tile, then kStages K tiles, then kStages V tiles).
// After the key loop the K/V buffers hold each warp's normalised O (fp32 rows of
// kHeadDim + 4, off the banks' period) and LSE, then, in a cluster, the CTA's merged O
// (fp32 rows of kHeadDim) and LSE for the other CTAs to read, and the weights of the
// parts in the row it merges. _plan.KINDS["decode"] states the size.
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct DecodeShared : ForwardShared<kHeadDim, kBlockM, kBlockN, kStages> {
  using Base = ForwardShared<kHeadDim, kBlockM, kBlockN, kStages>;
  static constexpr int kWarpORow = kHeadDim + 4;
  static constexpr int kWarpO = Base::kK;
  template <int kWarps>
  static __host__ __device__ constexpr int warp_lse() { return kWarpO + kWarps * kBlockM * kWarpORow * 4; }
  template <int kWarps>
  static __host__ __device__ constexpr int cluster_o() { return warp_lse<kWarps>() + kWarps * kBlockM * 4; }
  template <int kWarps>
  static __host__ __device__ constexpr int cluster_lse() { return cluster_o<kWarps>() + kBlockM * kHeadDim * 4; }
  template <int kWarps>
  static __host__ __device__ constexpr bool results_fit() {
    return cluster_lse<kWarps>() + (kBlockM + kMaxClusterSplits + 2) * 4 <= Base::kBytes;
  }
};

// The new keys and values of one (sequence, KV head) into the cache, the keys rotated at
// positions length + j.
template <typename T>
__device__ __forceinline__ void append_to_cache(const DecodeParams& p, const CachedSequence& seq,
                                                const Rotary& rotary, int batch, int kv_head, int threads) {
  const int d = p.headdim;
  for (int item = threadIdx.x; item < p.seqlen_new * d; item += threads) {
    const int j = item / d, e = item % d, t = seq.length + j;
    const elem_t* k = p.k_new.ptr + batch * p.k_new.batch_stride + int64(j) * p.k_new.row_stride +
                      int64(kv_head) * p.k_new.head_stride;
    const elem_t* v = p.v_new.ptr + batch * p.v_new.batch_stride + int64(j) * p.v_new.row_stride +
                      int64(kv_head) * p.v_new.head_stride;
    const int64 k_at = seq.offset(p.k_cache, t), v_at = seq.offset(p.v_cache, t);
    if (k_at >= 0)
      p.k_cache.ptr[k_at + int64(kv_head) * p.k_cache.head_stride + e] =
          rotary.on() && e < rotary.dim ? DType<T>::from_float(rotary.rotated<T>(k, e, t)) : k[e];
    if (v_at >= 0) p.v_cache.ptr[v_at + int64(kv_head) * p.v_cache.head_stride + e] = v[e];
  }
}

// @tparam kBlockM   packed query rows per CTA (one 16-row mma tile, shared by the warps)
// @tparam kBlockN   keys per tile; each of the kWarps warps takes kBlockN / kWarps of them
// @tparam kStages   K/V tiles in flight
// @tparam kLocal    causal or sliding window (also: q rotates at each query's position)
// @tparam kVec      rows 16-byte aligned and headdim % 8 == 0: cp.async 16-byte chunks
// @tparam kExtras   softcap or ALiBi may be on
// @tparam kClusterMerge  the grid's x runs in clusters of num_splits CTAs, the splits of a
//                   row block, which merge their results (one part each; sm_90)
// Up to d 128 three CTAs of four warps share a multiprocessor (by shared memory, on
// Hopper): registers held to 168; split grids, clustered or not, place at most two
// (_plan.decode_splits), and the cluster's merge needs more than 168. Eight warps (the wide
// tile of grids that are not split) take a multiprocessor alone.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLocal, bool kVec,
          bool kExtras, bool kClusterMerge>
__global__ void __launch_bounds__(kWarps * 32, kHeadDim > 128 || kWarps > 4 ? 1 : kClusterMerge ? 2 : 3)
    attention_decode(const DecodeParams p) {
  constexpr int kThreads = kWarps * 32, kWarpKeys = kBlockN / kWarps, kDTiles = kHeadDim / 8;
  using L = HeadDimLayout<kHeadDim>;
  using Shared = DecodeShared<kHeadDim, kBlockM, kBlockN, kStages>;
  static_assert(kBlockM == 16 && kWarpKeys % 16 == 0 && kWarpKeys * kWarps == kBlockN, "tile shape");
  static_assert(kStages >= 2 && Shared::template results_fit<kWarps>(), "stages, and the warps' results");
  extern __shared__ __align__(128) unsigned char smem[];
  const SharedTile<L> q_tile{reinterpret_cast<elem_t*>(smem + Shared::kQ)};
  const StagedTiles<L, kBlockN, kStages> k_tiles{reinterpret_cast<elem_t*>(smem + Shared::kK)};
  const StagedTiles<L, kBlockN, kStages> v_tiles{reinterpret_cast<elem_t*>(smem + Shared::kV)};

  const int split = blockIdx.x % p.num_splits, m_block = blockIdx.x / p.num_splits;
  const int kv_head = blockIdx.y, batch = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const CachedSequence seq = CachedSequence::of(p, batch);
  const Rotary rotary = Rotary::of(p);
  if (split == 0 && m_block == 0 && p.seqlen_new > 0) append_to_cache<T>(p, seq, rotary, batch, kv_head, kThreads);

  // This sequence's queries: dense, or packed (rows q_start .. of q; the grid covers the longest).
  const int q_start = p.cu_seqlens_q ? p.cu_seqlens_q[batch] : 0;
  const int seqlen_q = p.cu_seqlens_q ? p.cu_seqlens_q[batch + 1] - q_start : p.seqlen_q;
  // Packed rows: row r is query r / group of head kv_head * group + r % group.
  const int group = p.heads_per_kv, rows = group * seqlen_q, row0 = m_block * kBlockM;
  if (row0 >= rows) return;
  const int q_first = row0 / group, q_end = (min(row0 + kBlockM, rows) - 1) / group + 1;
  // Key columns count from leftpad; the tiles from the cache's row 0 (t = leftpad + column).
  // The KV-cache call's window is normalised against the cache's length on the host; the
  // varlen call's, as everywhere in varlen, against each sequence's keys.
  const int seqlen_k = seq.end - seq.leftpad;
  const auto mask = p.cu_seqlens_q ? Mask<kLocal>::of(seqlen_q, seqlen_k, p.window_left, p.window_right)
                                   : Mask<kLocal>::bounded(seqlen_q, seqlen_k, p.window_left, p.window_right);
  const int t_begin = seq.leftpad + mask.key_begin(q_first), t_end = seq.leftpad + mask.key_end(q_end);
  const int tile_first = t_begin / kBlockN, tiles = t_end > t_begin ? ceil_div(t_end, kBlockN) - tile_first : 0;
  // The parts of these tiles, each its own softmax and partial result (the merge step
  // combines them in part order), and this CTA's share of them: parts split, split +
  // num_splits, ... of the p.parts the workspace holds. The parts are num_splits equal ranges,
  // or, deterministic, a partition fixed by the sequence's own tiles (at most max_parts of
  // min_part_tiles or more tiles), so that its result's bits depend on neither num_splits
  // nor the rest of the batch; a part beyond the sequence's is empty.
  const int seq_parts = p.deterministic ? min(p.max_parts, ceil_div(tiles, p.min_part_tiles)) : p.num_splits;
  const int part_tiles = ceil_div(tiles, max(seq_parts, 1));
  const bool split_result = !kClusterMerge && p.parts > 1;

  auto query_row = [&](int r, int) -> const elem_t* {
    const int row = row0 + r;
    if (row >= rows) return nullptr;
    return p.q.ptr + batch * p.q.batch_stride + int64(q_start + row / group) * p.q.row_stride +
           int64(kv_head * group + row % group) * p.q.head_stride;
  };
  // Key (or value) t: from the cache below length, from the new rows above.
  auto key_row = [&](const ArrayView& cache, const ArrayView& fresh, int t) -> const elem_t* {
    if (t < seq.leftpad || t >= seq.end) return nullptr;
    if (t >= seq.length)
      return fresh.ptr + batch * fresh.batch_stride + int64(t - seq.length) * fresh.row_stride +
             int64(kv_head) * fresh.head_stride;
    const int64 at = seq.offset(cache, t);
    return at < 0 ? nullptr : cache.ptr + at + int64(kv_head) * cache.head_stride;
  };
  // Key tile n's K and V into a stage: one strided copy where its rows allow (cache.cuh);
  // a tile of cached rows across pages of a power-of-two size, row by row from the pages
  // read a tile ahead; any other tile (left padding, new keys, its end) row by row.
  using Pages = TilePages<kBlockN, ChunkLanes<L::kCols, kThreads>::kRowStep>;
  const int first_row = ChunkLanes<L::kCols, kThreads>::first_row();
  const elem_t* k_head = p.k_cache.ptr + int64(kv_head) * p.k_cache.head_stride;
  const elem_t* v_head = p.v_cache.ptr + int64(kv_head) * p.v_cache.head_stride;
  Pages ahead;
  ahead.tile = -1;
  auto issue = [&](int n, int stage) {
    const int t0 = n * kBlockN;
    if (seq.strided(t0, kBlockN)) {
      const int64 k_at = seq.offset(p.k_cache, t0), v_at = seq.offset(p.v_cache, t0);
      if (k_at >= 0) {
        load_tile<kBlockN, kThreads, kVec>(k_tiles[stage], k_head + k_at, p.k_cache.row_stride, 0, kBlockN, p.headdim);
        load_tile<kBlockN, kThreads, kVec>(v_tiles[stage], v_head + v_at, p.v_cache.row_stride, 0, kBlockN, p.headdim);
        return;
      }
    }
    if (seq.pages != nullptr && seq.page_shift >= 0 && seq.cached(t0, kBlockN)) {
      const Pages pages = ahead.tile == n ? ahead : Pages::of(seq, n, t0, first_row);
      ahead = Pages::of(seq, n + 1, t0 + kBlockN, first_row);
      auto row_of = [&](const elem_t* head, const ArrayView& cache, int r, int i) -> const elem_t* {
        return pages.row[i] < 0 ? nullptr : head + seq.paged_offset(cache, t0 + r, pages.row[i]);
      };
      load_rows<kBlockN, kThreads, kVec>(k_tiles[stage], [&](int r, int i) { return row_of(k_head, p.k_cache, r, i); },
                                         p.headdim, p.q.ptr);
      load_rows<kBlockN, kThreads, kVec>(v_tiles[stage], [&](int r, int i) { return row_of(v_head, p.v_cache, r, i); },
                                         p.headdim, p.q.ptr);
      return;
    }
    load_rows<kBlockN, kThreads, kVec>(
        k_tiles[stage], [&](int r, int) { return key_row(p.k_cache, p.k_new, t0 + r); }, p.headdim, p.q.ptr);
    load_rows<kBlockN, kThreads, kVec>(
        v_tiles[stage], [&](int r, int) { return key_row(p.v_cache, p.v_new, t0 + r); }, p.headdim, p.q.ptr);
  };

  // Q, then for each part one K/V tile a group, kStages - 1 ahead. The rotary table rows
  // of the queries' positions are asked of L2 meanwhile.
  load_rows<kBlockM, kThreads, kVec>(q_tile, query_row, p.headdim, p.q.ptr);
  LoadPipeline::commit();
  const int q_rows = min(kBlockM, rows - row0);  // the tile's rows holding a query
  auto q_position = [&](int r) { return seq.length + (kLocal ? (row0 + r) / group : 0); };
  if (rotary.on() && warp == 0)
    for (int query = q_first; query < (kLocal ? q_end : q_first + 1); ++query)
      rotary.prefetch(seq.length + (kLocal ? query : 0), lane);

  // This lane's two lines (g and g + 8): their query rows, and with ALiBi their slopes.
  const int g = lane >> 2;
  int line_query[1][2];
  ScoreMod mods[2] = {};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = min(row0 + g + 8 * h, rows - 1);
    line_query[0][h] = row / group;
    if constexpr (kExtras) {
      const int head = kv_head * group + row % group;
      const float slope = p.alibi_slopes ? p.alibi_slopes[batch * p.alibi_batch_stride + head] : 0.f;
      mods[h] = ScoreMod{p.scale, p.softcap, slope, mask.diagonal};
    }
  }
  // Modified scores are already scaled: exp2 only converts to base 2.
  const float scale_log2 = kExtras ? kLog2e : p.scale_log2;

  // Query row (b, i) of the partial results: b * seqlen_q + i, or packed, q's row.
  auto result_row = [&](int query) { return (p.cu_seqlens_q ? 0 : int64(batch) * p.seqlen_q) + q_start + query; };
  // Column c of packed row `row` of the block's rows, and its LSE, into the output.
  auto store_result = [&](int row, int c, float o, float lse) {
    const int query = row / group, head = kv_head * group + row % group;
    p.o.ptr[batch * p.o.batch_stride + int64(q_start + query) * p.o.row_stride + int64(head) * p.o.head_stride + c] =
        DType<T>::from_float(o);
    if (c == 0 && p.lse != nullptr)
      p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + q_start + query] = lse;
  };
  float* cluster_o = reinterpret_cast<float*>(smem + Shared::template cluster_o<kWarps>());
  float* cluster_lse = reinterpret_cast<float*>(smem + Shared::template cluster_lse<kWarps>());
  bool q_rotated = false;
  for (int part = split; part < p.parts; part += p.num_splits) {
    const int n_begin = tile_first + min(tiles, part * part_tiles);
    const int n_end = tile_first + min(tiles, (part + 1) * part_tiles);
    if (n_begin == n_end && split_result) {  // an empty part: its LSE says so, its O is never read
      for (int r = threadIdx.x; r < kBlockM && row0 + r < rows; r += kThreads) {
        const int head = kv_head * group + (row0 + r) % group;
        p.partial_lse[(int64(part) * p.nheads + head) * p.query_rows + result_row((row0 + r) / group)] = kInf;
      }
      continue;
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (n_begin + s < n_end) issue(n_begin + s, s);
      LoadPipeline::commit();
    }

    float acc_o[1][kDTiles][4] = {};
    OnlineSoftmax<1, true> softmax;
    softmax.init();
    for (int i = 0, n = n_begin; n < n_end; ++i, ++n) {
      const int stage = i % kStages;
      if (n + kStages - 1 < n_end) issue(n + kStages - 1, (i + kStages - 1) % kStages);
      LoadPipeline::commit();
      LoadPipeline::wait<kStages - 1>();  // tile n (and with the first, Q) has landed
      if (rotary.on()) {  // q once, at its first tile; the new keys in the tiles that hold them
        const int new_begin = max(seq.length, n * kBlockN) - n * kBlockN;
        const int new_end = min(seq.end, (n + 1) * kBlockN) - n * kBlockN;
        const bool rotate_q = !q_rotated;
        q_rotated = true;
        constexpr int kItems = ceil_div(kBlockM * kHeadDim / 2, kThreads), kBatch = kItems < 4 ? kItems : 4;
        if (rotate_q) rotary.rotate_rows<T, kBatch>(q_tile, 0, q_rows, q_position, kThreads);
        if (new_begin < new_end)
          rotary.rotate_rows<T, kBatch>(k_tiles[stage], new_begin, new_end, [&](int r) { return n * kBlockN + r; },
                                        kThreads);
        if (rotate_q || new_begin < new_end) LoadPipeline::sync();
      }

      // This warp's keys of the tile: columns col0 .. col0 + kWarpKeys.
      const int col0 = n * kBlockN + warp * kWarpKeys - seq.leftpad;
      // S = Q K^T
      float acc_s[1][kWarpKeys / 8][4] = {};
      mma_ABt<T>(acc_s, q_tile, k_tiles[stage].from_row(warp * kWarpKeys), lane);
      // S = mod(S): softcap, ALiBi (then in natural units, already scaled)
      if constexpr (kExtras) {
#pragma unroll
        for (int nt = 0; nt < kWarpKeys / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc_s[0][nt][e] =
                mods[e >> 1](acc_s[0][nt][e], line_query[0][e >> 1], col0 + nt * 8 + 2 * (lane & 3) + (e & 1));
      }
      // S = -inf where hidden: padding, past the keys, outside the band
      if (!(col0 >= 0 && mask.covers(q_first, q_end, col0, col0 + kWarpKeys)))
        mask.apply_to_rows(acc_s, line_query, col0, lane);
      softmax.update(acc_s, acc_o, scale_log2);
      // O += P V
      mma_AB<T>(acc_o, acc_s, v_tiles[stage].from_row(warp * kWarpKeys), 0, lane);
      LoadPipeline::release();  // the next issue overwrites this stage
    }
    LoadPipeline::wait<0>();  // (no tile: Q's copies may still land where the warps' results go)

    // Each warp's O /= l and LSE; then the warps' results merged, in warp order.
    float row_lse[1][2];
    softmax.finalize(acc_o, row_lse, scale_log2, 1.f);
    float* warp_o = reinterpret_cast<float*>(smem + Shared::kWarpO);
    float* warp_lse = reinterpret_cast<float*>(smem + Shared::template warp_lse<kWarps>());
    const int t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int line = warp * kBlockM + g + 8 * h;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<float2*>(warp_o + line * Shared::kWarpORow + dt * 8 + 2 * t) =
            make_float2(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
      if (t == 0) warp_lse[line] = row_lse[0][h];
    }
    __syncthreads();

    for (int item = threadIdx.x; item < kBlockM * p.headdim; item += kThreads) {
      const int r = item / p.headdim, c = item % p.headdim, row = row0 + r;
      if (row >= rows) break;
      PartialMerge merge;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) merge.see(warp_lse[w * kBlockM + r]);
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = merge.weigh(warp_lse[w * kBlockM + r]);
        if (weight != 0.f) o += weight * warp_o[(w * kBlockM + r) * Shared::kWarpORow + c];
      }
      o *= merge.out_scale();
      const int query = row / group, head = kv_head * group + row % group;
      if constexpr (kClusterMerge) {
        cluster_o[r * kHeadDim + c] = o;
        if (c == 0) cluster_lse[r] = merge.lse();
      } else if (split_result) {
        p.partial_o[((int64(part) * p.query_rows + result_row(query)) * p.nheads + head) * p.headdim + c] = o;
        if (c == 0) p.partial_lse[(int64(part) * p.nheads + head) * p.query_rows + result_row(query)] = merge.lse();
      } else {
        store_result(row, c, o, merge.lse());
      }
    }
    __syncthreads();  // the next part's loads overwrite the warps' results
  }

  if constexpr (kClusterMerge) {
    // The cluster's parts, in rank (= part) order, row by row: this CTA merges rows
    // rank, rank + size, ... of the block, reading every CTA's result where it lies.
    cluster::sync();  // every CTA's result written
    const int rank = cluster::rank(), ranks = cluster::size();
    float* weights = cluster_lse + kBlockM;  // each part's weight in the row, then 1 / total and the LSE
    for (int r = rank; r < kBlockM && row0 + r < rows; r += ranks) {
      if (warp == 0) {  // lane s: part s's LSE and weight
        const float lse = lane < ranks ? cluster::load(cluster_lse + r, lane) : kInf;
        PartialMerge merge;
        merge.see(lse);
        merge.top_of_warp();
        const float weight = merge.weigh(lse);
        merge.total_of_warp();
        if (lane < ranks) weights[lane] = weight;
        if (lane == 0) weights[kMaxClusterSplits] = merge.out_scale(), weights[kMaxClusterSplits + 1] = merge.lse();
      }
      __syncthreads();
      for (int c = threadIdx.x; c < p.headdim; c += kThreads) {
        float o = 0.f;
#pragma unroll
        for (int s = 0; s < kMaxClusterSplits; ++s)
          if (s < ranks) {
            const float x = cluster::load(cluster_o + r * kHeadDim + c, s);
            o += weights[s] != 0.f ? weights[s] * x : 0.f;  // an empty part's O is never used
          }
        store_result(row0 + r, c, o * weights[kMaxClusterSplits], weights[kMaxClusterSplits + 1]);
      }
      __syncthreads();  // (the next row's weights)
    }
    cluster::sync();  // no CTA leaves while another reads its shared memory
  }
}

}  // namespace cuflash
