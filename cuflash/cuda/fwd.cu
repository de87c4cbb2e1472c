// FlashAttention forward: one CTA per (query tile, head, batch or sequence).
//
//   for each key tile n the query tile can see (the last ones first; with a block mask,
//   those of its blocks that are not empty):
//     S = Q K_n^T                          tensor cores, fp32 accumulators
//     S = mod(S)                           variants: softcap, ALiBi (kExtras); score_mod, mask_mod (Mods)
//     S = mask(S)                          only tiles that straddle a boundary
//     m' = max(m, rowmax S);  P = exp(scale (S - m'))
//     l = l exp(scale (m - m')) + rowsum P;  O = O exp(scale (m - m')) + dropout(P) V_n
//   O /= l;  LSE = scale m + log l
//
// K/V tiles stream through shared memory with cp.async (pipeline.cuh): with kStages == 2
// the next tile is in flight while the current one is computed; with one buffer each,
// V loads during Q K^T and the next K during softmax and P V (as FlashAttention-2).
#include "common.cuh"
#include "copy.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mods.cuh"
#include "params.cuh"
#include "pipeline.cuh"
#include "score.cuh"
#include "softmax.cuh"

namespace cuflash {

// @tparam T         half_t or bfloat16_t
// @tparam kHeadDim  head-dim bucket, a multiple of 32; the real headdim <= kHeadDim is in Params
// @tparam kBlockM   query rows per CTA; each of the kWarps warps owns kBlockM / kWarps of them
// @tparam kBlockN   key rows per tile
// @tparam kStages   shared-memory K/V buffers: 2 overlaps the next load with compute
// @tparam kLocal    causal or sliding-window band (Params::window_left/right)
// @tparam kVec      rows 16-byte aligned and headdim % 8 == 0: cp.async 16-byte chunks
// @tparam kExtras   softcap, ALiBi or dropout may be on (each switched by Params)
// @tparam Mods      the call's score_mod and mask_mod (mods.cuh; with kExtras), or NoMods
// (__launch_bounds__ minimum 1 block: without it ptxas caps small CTAs near 168
// registers and spills.)
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLocal, bool kVec,
          bool kExtras, typename Mods = NoMods>
__global__ void __launch_bounds__(kWarps * 32, 1) attention_forward(const ParamsOf<Mods> p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kMTiles = kBlockM / (16 * kWarps);  // 16-row mma tiles per warp
  constexpr int kDTiles = kHeadDim / 8;
  using S = HeadDimLayout<kHeadDim>;
  static_assert(kMTiles * 16 * kWarps == kBlockM && kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shape");
  static_assert(kStages == 1 || kStages == 2, "one or two K/V buffers");
  static_assert(kExtras || !kHasMods<Mods>, "mods take the scores in natural units: the extras' instances");
  // Key tiles load as kBlockN rows, but with 32 rows per warp above d 64 and softcap,
  // ALiBi or dropout, S, the softmax and P V go 32 keys at a time: the registers of a
  // 32-key tile (a 64-key S spills next to the O accumulator and the extras' state), the
  // barriers and copies of a 64-key one.
  constexpr int kSubN = kMTiles == 2 && kHeadDim > 64 && kExtras ? 32 : kBlockN;
  static_assert(kBlockN % kSubN == 0 && (kSubN == kBlockN || kStages == 2), "key sub-tiles");
  using Shared = ForwardShared<kHeadDim, kBlockM, kBlockN, kStages>;
  extern __shared__ __align__(128) unsigned char smem[];  // swizzled rows start on 128-byte lines
  const SharedTile<S> q_tile{reinterpret_cast<elem_t*>(smem + Shared::kQ)};
  const StagedTiles<S, kBlockN, kStages> k_tiles{reinterpret_cast<elem_t*>(smem + Shared::kK)};
  const StagedTiles<S, kBlockN, kStages> v_tiles{reinterpret_cast<elem_t*>(smem + Shared::kV)};

  // Under a causal band the last query tiles see the most keys: number them first.
  const auto grid_tile = GridTile<kLocal>::of_block(p.tile_group);
  const int m_block = gridDim.x - 1 - grid_tile.tile, head = grid_tile.head, batch = grid_tile.batch;
  const Sequence seq = Sequence::of(p, batch);
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.seqlen_q) return;  // variable length: the grid covers the longest sequence
  const int lane = threadIdx.x % 32;
  const int warp_row0 = (threadIdx.x / 32) * kMTiles * 16;  // this warp's first row in the tile
  const int kv_head = head / p.heads_per_kv;
  const elem_t* q = seq.rows(p.q, batch, head, true);
  const elem_t* k = seq.rows(p.k, batch, kv_head, false);
  const elem_t* v = seq.rows(p.v, batch, kv_head, false);

  // Key tiles this query tile can see: none left of its first row's band, none
  // right of its last row's.
  const auto mask = Mask<kLocal>::of(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  const int row_end = min(m0 + kBlockM, seq.seqlen_q);
  const int n_begin = mask.key_begin(m0) / kBlockN;
  const int n_end = ceil_div(mask.key_end(row_end), kBlockN);
  // With a block mask the tiles of its empty blocks are never visited: the loop goes from
  // one tile that is not empty to the next (KeyTiles::before), where it would go from n to n - 1.
  constexpr bool kSparse = kBlockSparse<Mods>;
  const auto key_tiles = KeyTiles<Mods, kBlockN>::of(p, batch, head, m0);

  ScoreMod mod{};
  Dropout dropout{};
  score_extras<kExtras>(p, mask, batch, head, mod, dropout);
  const bool dropping = kExtras && p.dropout_threshold > 0;
  // Modified scores are already scaled: exp2 only converts to base 2.
  const float scale_log2 = kExtras ? kLog2e : p.scale_log2;

  // The copies of key tile n's K or V into a stage.
  auto issue_k = [&](int n, int stage) {
    load_tile<kBlockN, kThreads, kVec>(k_tiles[stage], k, p.k.row_stride, n * kBlockN, seq.seqlen_k, p.headdim);
  };
  auto issue_v = [&](int n, int stage) {
    load_tile<kBlockN, kThreads, kVec>(v_tiles[stage], v, p.v.row_stride, n * kBlockN, seq.seqlen_k, p.headdim);
  };

  // Q, and the first key tile's K (and V with two stages): one group
  load_tile<kBlockM, kThreads, kVec>(q_tile, q, p.q.row_stride, m0, seq.seqlen_q, p.headdim);
  // The first tile visited is n_top - 1. (With a block mask the loop steps to n_next at
  // its end: its control stays that of the kernels without one, which compile as before.)
  const int n_top = kSparse ? key_tiles.before(n_end, n_begin) + 1 : n_end;
  if (n_top > n_begin) {
    issue_k(n_top - 1, 0);
    if constexpr (kStages == 2) issue_v(n_top - 1, 0);
  }
  LoadPipeline::commit();

  // O = 0, m = -inf, l = 0
  float acc_o[kMTiles][kDTiles][4] = {};
  // The conditional rescale (softmax.cuh) measured 2-7% faster at d 128 and 1-8% at d 64
  // not causal (within 2-3% either way causal); at d 256 (one 16-row m-tile per warp, one
  // K/V buffer) its update order was up to 8% slower: there the max moves at every tile.
  OnlineSoftmax<kMTiles, (kHeadDim <= 128)> softmax;
  softmax.init();

  // kStages == 2: K and V of tile n - 1 load while tile n is computed.
  // kStages == 1 (one buffer each, half the shared memory: two CTAs fit an SM where
  // two stages would not): V of tile n loads during S = Q K^T, K of tile n - 1 during
  // softmax and P V.
  for (int i = 0, n = n_top - 1; n >= n_begin; ++i, --n) {
    const int stage = i % kStages;
    const int n_next = kSparse ? key_tiles.before(n, n_begin) : n;  // the tile visited next (sparse)
    const bool whole = kSparse && key_tiles.status(n) == kBlockFull;     // mask_mod shows all of it
    // K_n and V_n have landed. (Two stages: K_{n-1} and V_{n-1} go out first, into the
    // other stage, and stay in flight.)
    if (kStages == 2 && (kSparse ? n_next >= n_begin : n > n_begin)) {
      issue_k(kSparse ? n_next : n - 1, (i + 1) % kStages);
      issue_v(kSparse ? n_next : n - 1, (i + 1) % kStages);
      LoadPipeline::commit();
      LoadPipeline::landed<1>();
    } else {
      LoadPipeline::landed<0>();
    }
    LoadPipeline::sync();
    if constexpr (kStages == 1) {  // V_n lands during S = Q K_n^T
      issue_v(n, 0);
      LoadPipeline::commit();
    }

    // The keys n0 .. n0 + kSubN of tile n, at k_sub and v_sub:
    auto scores_and_pv = [&](int n0, SharedTile<S> k_sub, SharedTile<S> v_sub) {
      // S = Q K_n^T
      float acc_s[kMTiles][kSubN / 8][4] = {};
      mma_ABt<T>(acc_s, q_tile.from_row(warp_row0), k_sub, lane);
      // S = mod(S): softcap, ALiBi (then in natural units, already scaled)
      if constexpr (kExtras) mod.apply(acc_s, m0 + warp_row0, n0, lane);
      // S = score_mod(S), -inf where mask_mod hides it: every tile (but a block mask's full ones)
      if constexpr (kHasMods<Mods>)
        ModsAt<Mods>::of(p, batch, head).in_block(whole).apply(acc_s, m0 + warp_row0, n0, lane);
      // S = -inf where hidden, only in tiles the band or seqlen_k cuts through
      if (!mask.covers(m0, row_end, n0, n0 + kSubN)) mask.apply(acc_s, m0 + warp_row0, n0, lane);
      // m' = max(m, rowmax S);  P = exp2(c (S - m')) with c = scale log2(e);
      // l = alpha l + rowsum P;  O = alpha O, alpha = exp2(c (m - m'))  (softmax.cuh)
      softmax.update(acc_s, acc_o, scale_log2);
      // P = dropout(P)
      if (kExtras && dropping) dropout.apply(acc_s, m0 + warp_row0, n0, lane);
      if constexpr (kStages == 1) {  // V_n has landed; every warp is done with K_n: K_{n-1} goes out
        LoadPipeline::wait<0>();
        if (kSparse ? n_next >= n_begin : n > n_begin) {
          issue_k(kSparse ? n_next : n - 1, 0);
          LoadPipeline::commit();
        }
      }
      // O += P V_n
      mma_AB<T>(acc_o, acc_s, v_sub, 0, lane);
    };
    if constexpr (kSubN == kBlockN) {
      scores_and_pv(n * kBlockN, k_tiles[stage], v_tiles[stage]);
    } else {
#pragma unroll 1  // (unrolled, the sub-tiles' registers overlap and spill)
      for (int sub = kBlockN / kSubN - 1; sub >= 0; --sub)  // the later keys first, as the tiles
        scores_and_pv(n * kBlockN + sub * kSubN, k_tiles.at(stage, sub * kSubN), v_tiles.at(stage, sub * kSubN));
    }
    // Two stages: the next iteration's loads overwrite the buffers read here. (One
    // stage: its V load waits for the barrier at its top, which every warp reaches
    // after this P V.)
    if constexpr (kStages == 2) LoadPipeline::release();
    if constexpr (kSparse) n = n_next + 1;  // (then --n)
  }
  // With no key tile to visit, other threads' Q copies may still be landing in
  // the rows the epilogue reuses: wait for them all before anyone writes there.
  LoadPipeline::wait<0>();

  // The epilogue derives its sequence and pointers afresh (after the barrier the
  // compiler may not reuse the loads from before it), so nothing of them has to
  // stay in registers through the main loop.
  const Sequence out_seq = Sequence::of(p, batch);
  elem_t* o = out_seq.rows(p.o, batch, head, true);
  float* lse = p.lse + out_seq.lse_offset(p, batch, head);
  // O /= l (times 1 / (1 - p) under dropout);  LSE = scale m + log l
  float row_lse[kMTiles][2];
  softmax.finalize(acc_o, row_lse, scale_log2, dropping ? p.dropout_scale : 1.f);

  // LSE from the lane that owns each row; O through this warp's own rows of the Q tile
  // so the global store is 16-byte wide and coalesced.
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + warp_row0 + mt * 16 + g + 8 * h;
      if (t == 0 && p.lse != nullptr && row < out_seq.seqlen_q) lse[row] = row_lse[mt][h];
    }
  store_fragments<T>(q_tile.from_row(warp_row0), 0, acc_o, lane);
  __syncthreads();
  store_tile<kBlockM, kThreads, kVec>(o, q_tile, p.o.row_stride, m0, out_seq.seqlen_q, p.headdim);
}

}  // namespace cuflash
