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
// run as one thread block cluster (sm_90, kClusterMerge), into the shared memory of the
// CTA that merges each row (each CTA some of the rows, from its own shared memory).
// Keys are the rows [leftpad, length + seqlen_new) of the sequence's cache (cache.cuh:
// contiguous or paged); rows outside are zero-filled, never read, and masked. New keys and
// values are read from k and v (rotated in shared memory), never from the cache rows this
// call writes: the CTA that holds a new row's tile (one per row, `append`) writes it from
// shared memory into the cache, and no CTA reads those rows there.
#include "common.cuh"
#include "copy.cuh"
#include "decode/cache.cuh"
#include "decode/cluster.cuh"
#include "decode/decode_params.cuh"
#include "decode/rotary.cuh"
#include "fragment.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "partial.cuh"
#include "pipeline.cuh"
#include "score.cuh"
#include "shared_memory.cuh"
#include "softmax.cuh"

namespace cuflash {

// What a part's new-key tile costs its CTA beyond a cached tile, in tiles (H200, batch 1,
// GQA 32/8, d 128, 4k keys, 16 parts of 4 tiles: that CTA ended its part 3.3 us after
// the others, against 0.9 us a tile; scripts/decode/decode_timeline.py).
constexpr int kAppendTiles = 3;

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

  // This sequence's queries: dense, or packed (rows q_start .. of q; the grid covers the longest).
  const int q_start = p.cu_seqlens_q ? p.cu_seqlens_q[batch] : 0;
  const int seqlen_q = p.cu_seqlens_q ? p.cu_seqlens_q[batch + 1] - q_start : p.seqlen_q;
  // Packed rows: row r is query r / group of head kv_head * group + r % group.
  const int group = p.heads_per_kv, rows = group * seqlen_q, row0 = m_block * kBlockM;
  if (row0 >= rows) return;
  // (A cluster's CTAs share their row block: all of them return above, or none.)
  if constexpr (kClusterMerge) cluster::arrive();  // this CTA has started (cluster::wait below)
  const int q_first = row0 / group, q_end = (min(row0 + kBlockM, rows) - 1) / group + 1;
  // Key columns count from leftpad; the tiles from the cache's row 0 (t = leftpad + column).
  // The KV-cache call's window is normalised against the cache's length on the host; the
  // varlen call's, as everywhere in varlen, against each sequence's keys.
  const int seqlen_k = seq.end - seq.leftpad;
  const auto mask = p.cu_seqlens_q ? Mask<kLocal>::of(seqlen_q, seqlen_k, p.window_left, p.window_right)
                                   : Mask<kLocal>::bounded(seqlen_q, seqlen_k, p.window_left, p.window_right);
  // Row block 0 also takes the new keys ahead of every query's diagonal (more new keys than
  // queries), seen or not, to write them into the cache (`append`).
  const int t_seen = seq.leftpad + mask.key_begin(q_first), t_end = seq.leftpad + mask.key_end(q_end);
  const int t_begin = row0 == 0 && p.seqlen_new > seqlen_q ? min(t_seen, seq.length) : t_seen;
  const int tile_first = t_begin / kBlockN, tiles = t_end > t_begin ? ceil_div(t_end, kBlockN) - tile_first : 0;
  // The parts of these tiles, each its own softmax and partial result (the merge step
  // combines them in part order), and this CTA's share of them: parts split, split +
  // num_splits, ... of the p.parts the workspace holds. The parts are num_splits equal ranges,
  // or, deterministic, a partition fixed by the sequence's own tiles (at most max_parts of
  // min_part_tiles or more tiles), so that its result's bits depend on neither num_splits
  // nor the rest of the batch; a part beyond the sequence's is empty.
  const int seq_parts = p.deterministic ? min(p.max_parts, ceil_div(tiles, p.min_part_tiles)) : p.num_splits;
  const int part_tiles = ceil_div(tiles, max(seq_parts, 1));
  // The part holding the new keys (the last tiles) copies its new-key tile row by row and
  // writes the new rows into the cache, code run once a call that costs its CTA about
  // kAppendTiles tiles' time while the others wait for it (at the cluster's barrier, or
  // for the merge). Where the partition is free (not deterministic), the parts share
  // tiles + kAppendTiles evenly instead, the last one short by that much.
  const int append_tiles = p.seqlen_new > 0 && !p.deterministic ? kAppendTiles : 0;
  // Tile part_tile(part) is part `part`'s first, part_tile(part + 1) its end.
  auto part_tile = [&](int part) {
    return tile_first + min(tiles, append_tiles ? part * (tiles + append_tiles) / max(seq_parts, 1) : part * part_tiles);
  };
  const bool split_result = !kClusterMerge && p.parts > 1;

  auto query_row = [&](int r, int) -> const elem_t* {
    const int row = row0 + r;
    if (row >= rows) return nullptr;
    return p.q.ptr + batch * p.q.batch_stride + int64(q_start + row / group) * p.q.row_stride +
           int64(kv_head * group + row % group) * p.q.head_stride;
  };
  // Key (or value) t of a contiguous cache: from the cache below length, from the new rows above.
  auto fresh_row = [&](const ArrayView& fresh, int t) -> const elem_t* {
    return fresh.ptr + batch * fresh.batch_stride + int64(t - seq.length) * fresh.row_stride +
           int64(kv_head) * fresh.head_stride;
  };
  auto key_row = [&](const ArrayView& cache, const ArrayView& fresh, int t) -> const elem_t* {
    if (t < seq.leftpad || t >= seq.end) return nullptr;
    if (t >= seq.length) return fresh_row(fresh, t);
    return cache.ptr + seq.offset(cache, t) + int64(kv_head) * cache.head_stride;
  };
  // Key tile n's K and V into a stage. A contiguous cache: one strided copy where the tile
  // is plain (no left padding, no new keys: most tiles, CachedSequence::plain), else row
  // by row. A paged one, of any page size, from the page-table entries read a tile ahead:
  // in runs of rows where the tile is plain and the pages a whole number of runs, else
  // row by row.
  using Pages = TilePages<kBlockN, ChunkLanes<L::kCols, kThreads>::kRowStep>;
  const int first_row = ChunkLanes<L::kCols, kThreads>::first_row();
  const elem_t* k_head = p.k_cache.ptr + int64(kv_head) * p.k_cache.head_stride;
  const elem_t* v_head = p.v_cache.ptr + int64(kv_head) * p.v_cache.head_stride;
  const bool runs = p.page_size % Pages::kPerThread == 0;  // a run of rows never straddles two pages
  Pages ahead;  // the next tile's
  auto issue = [&](int n, int stage, bool first) {  // first: a part's first tile, not read ahead
    const int t0 = n * kBlockN;
    if (seq.pages == nullptr) {
      if (seq.plain(t0, kBlockN)) {
        const int rows = seq.length - t0;
        load_tile<kBlockN, kThreads, kVec>(k_tiles[stage], k_head + seq.offset(p.k_cache, t0), p.k_cache.row_stride,
                                           0, rows, p.headdim);
        load_tile<kBlockN, kThreads, kVec>(v_tiles[stage], v_head + seq.offset(p.v_cache, t0), p.v_cache.row_stride,
                                           0, rows, p.headdim);
      } else {  // an edge tile: left padding or new keys
        load_rows<kBlockN, kThreads, kVec, false>(
            k_tiles[stage], [&](int r, int) { return key_row(p.k_cache, p.k_new, t0 + r); }, p.headdim, p.q.ptr);
        load_rows<kBlockN, kThreads, kVec, false>(
            v_tiles[stage], [&](int r, int) { return key_row(p.v_cache, p.v_new, t0 + r); }, p.headdim, p.q.ptr);
      }
      return;
    }
    const Pages pages = first ? Pages::of(seq, n, first_row, runs) : ahead;
    ahead = Pages::of(seq, n + 1, first_row, runs);
    if (runs && seq.plain(t0, kBlockN)) {  // most tiles: a thread's run in one page
      const int t = t0 + first_row * Pages::kPerThread, page = pages.row[0];
      const bool ok = seq.valid(page);
      load_run<kBlockN, kThreads, kVec>(k_tiles[stage], ok ? k_head + seq.row_offset(p.k_cache, t, page) : nullptr,
                                        p.k_cache.row_stride, seq.length - t, p.headdim, p.q.ptr);
      load_run<kBlockN, kThreads, kVec>(v_tiles[stage], ok ? v_head + seq.row_offset(p.v_cache, t, page) : nullptr,
                                        p.v_cache.row_stride, seq.length - t, p.headdim, p.q.ptr);
      return;
    }
    // An edge tile, or pages of another size. Row r (this thread's i-th): cached (its page
    // read ahead; -1 before leftpad), new, or past the end.
    auto row_of = [&](const elem_t* head, const ArrayView& cache, const ArrayView& fresh, int r,
                      int i) -> const elem_t* {
      const int t = t0 + r, page = pages.at(i);
      if (t >= seq.length) return t < seq.end ? fresh_row(fresh, t) : nullptr;
      return seq.valid(page) ? head + seq.row_offset(cache, t, page) : nullptr;
    };
    load_rows<kBlockN, kThreads, kVec, false>(
        k_tiles[stage], [&](int r, int i) { return row_of(k_head, p.k_cache, p.k_new, r, i); }, p.headdim, p.q.ptr);
    load_rows<kBlockN, kThreads, kVec, false>(
        v_tiles[stage], [&](int r, int i) { return row_of(v_head, p.v_cache, p.v_new, r, i); }, p.headdim, p.q.ptr);
  };
  // The new keys and values of a tile, rows [begin, end) of its stage (the keys rotated),
  // into the cache at rows t0 + r. Each is written once: by the row block holding its
  // diagonal query (query seqlen_q - seqlen_new + j for new key j), which sees it whatever
  // the mask, or row block 0 for a key ahead of every diagonal; there by the split whose
  // part holds the tile.
  auto append = [&](int t0, int stage, int begin, int end) {
    auto into = [&](const ArrayView& cache, int r) -> elem_t* {
      const int t = t0 + r, diagonal_query = max(p.seqlen_q - p.seqlen_new + t - seq.length, 0);
      if (r < begin || r >= end || diagonal_query * group / kBlockM != m_block) return nullptr;
      const int64 at = seq.offset(cache, t);
      return at < 0 ? nullptr : cache.ptr + at + int64(kv_head) * cache.head_stride;
    };
    store_rows<kBlockN, kThreads, kVec>(k_tiles[stage], [&](int r) { return into(p.k_cache, r); }, p.headdim);
    store_rows<kBlockN, kThreads, kVec>(v_tiles[stage], [&](int r) { return into(p.v_cache, r); }, p.headdim);
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
  float* inbox_o = reinterpret_cast<float*>(smem + Shared::kInboxO);
  float* inbox_lse = reinterpret_cast<float*>(smem + Shared::kInboxLse);
  bool q_rotated = false;
  for (int part = split; part < p.parts; part += p.num_splits) {
    const int n_begin = part_tile(part), n_end = part_tile(part + 1);
    if (n_begin == n_end && split_result) {  // an empty part: its LSE says so, its O is never read
      for (int r = threadIdx.x; r < kBlockM && row0 + r < rows; r += kThreads) {
        const int head = kv_head * group + (row0 + r) % group;
        p.partial_lse[(int64(part) * p.nheads + head) * p.query_rows + result_row((row0 + r) / group)] = kInf;
      }
      continue;
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (n_begin + s < n_end) issue(n_begin + s, s, s == 0);
      LoadPipeline::commit();
    }
    constexpr int kItems = ceil_div(kBlockM * kHeadDim / 2, kThreads), kBatch = kItems < 4 ? kItems : 4;
    if (rotary.on() && !q_rotated) {  // q once, while the first tiles load (the key loop's wait syncs)
      LoadPipeline::wait<kStages - 1>();
      rotary.rotate_rows<T, kBatch>(q_tile, 0, q_rows, q_position, kThreads);
      q_rotated = true;
    }

    float acc_o[1][kDTiles][4] = {};
    OnlineSoftmax<1, true> softmax;
    softmax.init();
    for (int i = 0, n = n_begin; n < n_end; ++i, ++n) {
      const int stage = i % kStages;
      if (n + kStages - 1 < n_end) issue(n + kStages - 1, (i + kStages - 1) % kStages, false);
      LoadPipeline::commit();
      LoadPipeline::wait<kStages - 1>();  // tile n (and with the first, Q) has landed
      // The tile's new keys, rows [new_begin, new_end): rotated, and into the cache.
      const int t0 = n * kBlockN;
      const int new_begin = max(seq.length, t0) - t0, new_end = min(seq.end, t0 + kBlockN) - t0;
      if (new_begin < new_end) {
        if (rotary.on()) {
          rotary.rotate_rows<T, kBatch>(k_tiles[stage], new_begin, new_end, [&](int r) { return t0 + r; }, kThreads);
          LoadPipeline::sync();
        }
        append(t0, stage, new_begin, new_end);
      }

      // This warp's keys of the tile: columns col0 .. col0 + kWarpKeys.
      const int col0 = n * kBlockN + warp * kWarpKeys - seq.leftpad;
      // S = Q K^T
      float acc_s[1][kWarpKeys / 8][4] = {};
      mma_ABt<T>(acc_s, q_tile, k_tiles[stage].from_row(warp * kWarpKeys), lane);
      // S = mod(S): softcap, ALiBi (then in natural units, already scaled)
      if constexpr (kExtras) {
        for_each_element<1, kWarpKeys / 8>(lane, line_query, col0, [&](int mt, int nt, int e, int query, int col) {
          acc_s[mt][nt][e] = mods[e >> 1](acc_s[mt][nt][e], query, col);
        });
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
    // This CTA's keys are read: the merge kernel may start (it waits for the results).
    if (split_result && part + p.num_splits >= p.parts) allow_dependents();

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

    // Four columns of a row an item: the warps' weights, then their sum of O; in a
    // cluster, into the inbox of the CTA that merges the row (one part a CTA: once).
    if constexpr (kClusterMerge) cluster::wait();  // every CTA started
    constexpr int kQuads = kHeadDim / 4;
    for (int item = threadIdx.x; item < kBlockM * kQuads; item += kThreads) {
      const int r = item / kQuads, c = item % kQuads * 4, row = row0 + r;
      if (row >= rows) break;
      if (c >= p.headdim) continue;
      PartialMerge merge;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) merge.see(warp_lse[w * kBlockM + r]);
      float o[4] = {};
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = merge.weigh(warp_lse[w * kBlockM + r]);
        const float4 x = *reinterpret_cast<const float4*>(warp_o + (w * kBlockM + r) * Shared::kWarpORow + c);
        // (A branch, where PartialMerge::add_weighted selects: the same sums, o starting at +0;
        // the branch is the machine code this kernel was measured with.)
        if (weight != 0.f) o[0] += weight * x.x, o[1] += weight * x.y, o[2] += weight * x.z, o[3] += weight * x.w;
      }
      const float scale = merge.out_scale(), lse = merge.lse();
      const int query = row / group, head = kv_head * group + row % group;
      if constexpr (kClusterMerge) {
        const int ranks = cluster::size(), owner = r % ranks, entry = r / ranks * ranks + cluster::rank();
        cluster::store4(inbox_o + entry * kHeadDim + c, owner,
                        make_float4(o[0] * scale, o[1] * scale, o[2] * scale, o[3] * scale));
        if (c == 0) cluster::store(inbox_lse + entry, owner, lse);
        continue;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (c + e >= p.headdim) break;
        if (split_result)
          p.partial_o[((int64(part) * p.query_rows + result_row(query)) * p.nheads + head) * p.headdim + c + e] =
              o[e] * scale;
        else
          store_result(row, c + e, o[e] * scale, lse);
      }
      if (split_result && c == 0)
        p.partial_lse[(int64(part) * p.nheads + head) * p.query_rows + result_row(query)] = lse;
    }
    __syncthreads();  // the next part's loads overwrite the warps' results
  }

  if constexpr (kClusterMerge) {
    // The cluster's parts, in rank (= part) order, row by row from the inbox: warp w of
    // this CTA merges rows rank + (w + i kWarps) ranks of the block; lane s weighs part s,
    // then each lane takes four columns. No CTA reads another's shared memory: none waits
    // for the others before it leaves.
    cluster::sync();  // every CTA's rows in their inboxes
    const int rank = cluster::rank(), ranks = cluster::size();
    for (int r = rank + warp * ranks; r < kBlockM && row0 + r < rows; r += kWarps * ranks) {
      const int first = r / ranks * ranks;  // the row's entries: first + s, part s
      const float lse = lane < ranks ? inbox_lse[first + lane] : kInf;
      PartialMerge merge;
      merge.see(lse);
      merge.top_of_warp();
      const float weight = merge.weigh(lse);
      merge.total_of_warp();
      float weights[Shared::kMaxClusterSplits];
#pragma unroll
      for (int s = 0; s < Shared::kMaxClusterSplits; ++s) weights[s] = __shfl_sync(0xffffffffu, weight, s);
      const float scale = merge.out_scale(), row_lse = merge.lse();
      for (int c = lane * 4; c < p.headdim; c += 32 * 4) {
        float o[4] = {};
        // Every load issued before any is used (no branch between them: a part past the
        // cluster reads the last part's entry, and weighs 0).
        float4 x[Shared::kMaxClusterSplits];
#pragma unroll
        for (int s = 0; s < Shared::kMaxClusterSplits; ++s)
          x[s] = *reinterpret_cast<const float4*>(inbox_o + (first + min(s, ranks - 1)) * kHeadDim + c);
#pragma unroll
        for (int s = 0; s < Shared::kMaxClusterSplits; ++s) {
          PartialMerge::add_weighted(o, weights[s], x[s]);  // (an empty part's O is never used)
        }
#pragma unroll
        for (int e = 0; e < 4 && c + e < p.headdim; ++e) store_result(row0 + r, c + e, o[e] * scale, row_lse);
      }
    }
  }
}

}  // namespace cuflash
