// The two-kernel backward (bwd.cu has the overview of both backward paths):
// attention_backward_dkdv (one CTA per key tile: dK and dV) and attention_backward_dq
// (one CTA per query tile: dQ), each recomputing S and dP, so that no gradient needs
// atomics and every one is bitwise reproducible. Both run after
// attention_backward_preprocess.
#include "common.cuh"
#include "copy.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mods.cuh"
#include "params.cuh"
#include "pipeline.cuh"
#include "score.cuh"
#include "softmax_bwd.cuh"

namespace cuflash {

// Above d 128, overlapping every k16 step of the two score products needs more
// registers than the gradient accumulators leave (ptxas spilled): at most 4, 2
// above d 192.
__host__ __device__ constexpr int qk_unroll(int head_dim) {
  return head_dim > 192 ? 2 : head_dim > 128 ? 4 : head_dim / 16;
}

// Shared memory of the dK/dV kernel, byte offsets: the K and V tiles, kStages Q and dO
// tiles, then kStages rows of LSE and of D (float).
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct BackwardDkDvShared {
  static constexpr int kRow = HeadDimLayout<kHeadDim>::kRowElems * kElemBytes;
  static constexpr int kK = 0, kV = kK + kBlockN * kRow, kQ = kV + kBlockN * kRow;
  static constexpr int kDo = kQ + kStages * kBlockM * kRow, kLse = kDo + kStages * kBlockM * kRow;
  static constexpr int kDelta = kLse + kStages * kBlockM * 4;
  static constexpr int kBytes = kDelta + kStages * kBlockM * 4;
};

// Shared memory of the dQ kernel, byte offsets: the Q and dO tiles, then kStages K
// tiles and kStages V tiles. _plan.KINDS["backward_dkdv"] and ["backward_dq"] state the
// same sizes (tests/test_plan.py holds them together).
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct BackwardDqShared {
  static constexpr int kRow = HeadDimLayout<kHeadDim>::kRowElems * kElemBytes;
  static constexpr int kQ = 0, kDo = kQ + kBlockM * kRow, kK = kDo + kBlockM * kRow;
  static constexpr int kV = kK + kStages * kBlockN * kRow;
  static constexpr int kBytes = kV + kStages * kBlockN * kRow;
};

// dK and dV: one CTA per (key tile j, KV head, batch), each warp 16 keys, query tiles
// streamed through kStages buffers. For each query head of the group and query tile i:
//   S^T = K_j Q_i^T;  dP^T = V_j dO_i^T
//   P^T = dropout(exp(mod(S^T) - LSE));  dS^T = P^T (dropout(dP^T) - D) mod'(S^T)
//   dV_j += P^T dO_i;  dK_j += dS^T Q_i
// @tparam kBlockM   query rows per step; a multiple of 16
// @tparam kBlockN   key rows per CTA, 16 per warp
// @tparam kStages   shared buffers for Q / dO: 2 overlaps the next step's load
// @tparam kColSplit passes over the head dim: dK and dV columns are split so that
//                   their accumulators fit in registers for large head dims
// (__launch_bounds__ minimum 1 block: without it ptxas caps small CTAs near 168
// registers and spills.)
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLocal, bool kVec,
          bool kExtras, int kColSplit, typename Mods = NoMods>
__global__ void __launch_bounds__(kWarps * 32, 1) attention_backward_dkdv(const ParamsOf<Mods> p) {
  constexpr int kThreads = kWarps * 32;
  using S = HeadDimLayout<kHeadDim, true>;  // (layout.cuh: kXorAddress)
  constexpr int kCols = kHeadDim / kColSplit;
  constexpr int kQkUnroll = qk_unroll(kHeadDim);
  static_assert(kBlockN == 16 * kWarps && kBlockM % 16 == 0 && kCols % 16 == 0, "tile shape");

  using Shared = BackwardDkDvShared<kHeadDim, kBlockM, kBlockN, kStages>;
  extern __shared__ __align__(128) unsigned char smem[];  // swizzled rows start on 128-byte lines
  const SharedTile<S> k_tile{reinterpret_cast<elem_t*>(smem + Shared::kK)};
  const SharedTile<S> v_tile{reinterpret_cast<elem_t*>(smem + Shared::kV)};
  const StagedTiles<S, kBlockM, kStages> q_tiles{reinterpret_cast<elem_t*>(smem + Shared::kQ)};
  const StagedTiles<S, kBlockM, kStages> do_tiles{reinterpret_cast<elem_t*>(smem + Shared::kDo)};
  const StagedRows<kBlockM, kStages> lse_log2{reinterpret_cast<float*>(smem + Shared::kLse)};
  const StagedRows<kBlockM, kStages> deltas{reinterpret_cast<float*>(smem + Shared::kDelta)};

  // Head by head, not in GridTile's longest-first order: decoding that order costs
  // this kernel ~18 registers it does not have (spills at d 256).
  const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
  const Sequence seq = Sequence::of(p, batch);
  const int n0 = n_block * kBlockN;
  if (n0 >= seq.seqlen_k) return;  // variable length: the grid covers the longest sequence
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const elem_t* k = seq.rows(p.k, batch, kv_head, false);
  const elem_t* v = seq.rows(p.v, batch, kv_head, false);
  elem_t* dk = seq.rows(p.dk, batch, kv_head, false);
  elem_t* dv = seq.rows(p.dv, batch, kv_head, false);

  // Query tiles that can see any key of this tile.
  const auto mask = Mask<kLocal>::of(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  const int2 query_tiles = mask.template query_tiles<kBlockM>(n0, min(n0 + kBlockN, seq.seqlen_k), seq.seqlen_q);
  const int m_begin = query_tiles.x, m_tiles = query_tiles.y;
  // With a block mask the steps leave out the pairs of its empty blocks (QueryTiles).
  const auto pairs = QueryTiles<Mods, kBlockM>::of(p, batch, n0, (kv_head + 1) * p.heads_per_kv, m_begin,
                                                   m_begin + m_tiles);
  // (query head of the group, query tile) pairs
  const int steps = kBlockSparse<Mods> ? pairs.count(kv_head * p.heads_per_kv) : p.heads_per_kv * m_tiles;
  const float scale_log2 = kExtras ? kLog2e : p.scale_log2;
  const bool dropping = kExtras && p.dropout_threshold > 0;

  // K_j and V_j -> shared memory, where they stay
  load_tile<kBlockN, kThreads, kVec>(k_tile, k, p.k.row_stride, n0, seq.seqlen_k, p.headdim);
  load_tile<kBlockN, kThreads, kVec>(v_tile, v, p.v.row_stride, n0, seq.seqlen_k, p.headdim);
  LoadPipeline::commit();

  // The pair of a step. With a block mask the steps are walked in order: `at` is the
  // (head, query tile) of step walked, `ahead` that of the step after it (the loop asks
  // for no other).
  int2 at = {}, ahead = {};
  int walked = 0;
  auto following = [&](int2 pair) {
    const bool last = pair.y + 1 >= m_begin + m_tiles;
    return pairs.from(pair.x + last, last ? m_begin : pair.y + 1);
  };
  auto restart = [&]() {
    if constexpr (kBlockSparse<Mods>) {
      walked = 0;
      at = pairs.from(kv_head * p.heads_per_kv, m_begin);
      ahead = following(at);
    }
  };
  auto advance = [&]() {
    if constexpr (kBlockSparse<Mods>) {
      ++walked;
      at = ahead;
      ahead = following(at);
    }
  };
  auto step_head = [&](int step) {
    if constexpr (kBlockSparse<Mods>) {
      return step == walked ? at.x : ahead.x;
    } else {
      return kv_head * p.heads_per_kv + step / max(m_tiles, 1);
    }
  };
  auto step_m0 = [&](int step) {
    if constexpr (kBlockSparse<Mods>) {
      return (step == walked ? at.y : ahead.y) * kBlockM;
    } else {
      return (m_begin + step % max(m_tiles, 1)) * kBlockM;
    }
  };
  // The copies of a step's Q_i and dO_i into a stage (one group); its LSE_i (in log2
  // units) and D_i go in with plain loads.
  auto issue_step = [&](int step, int stage) {
    const int head = step_head(step), m0 = step_m0(step);
    load_tile<kBlockM, kThreads, kVec>(q_tiles[stage], seq.rows(p.q, batch, head, true), p.q.row_stride, m0,
                                       seq.seqlen_q, p.headdim);
    load_tile<kBlockM, kThreads, kVec>(do_tiles[stage], seq.rows(p.dout, batch, head, true), p.dout.row_stride, m0,
                                       seq.seqlen_q, p.headdim);
    LoadPipeline::commit();
    // Rows past seqlen_q get LSE = +inf, so their P is 0 like a fully masked row's.
    const int64 at = seq.lse_offset(p, batch, head) + m0;
    for (int i = threadIdx.x; i < kBlockM; i += kThreads) {
      const bool ok = m0 + i < seq.seqlen_q;
      lse_log2.at(stage, i) = ok ? p.lse[at + i] * kLog2e : kInf;
      deltas.at(stage, i) = ok ? p.delta[at + i] : 0.f;
    }
  };

#pragma unroll 1
  for (int pass = 0; pass < kColSplit; ++pass) {
    const int col0 = pass * kCols;
    // dK_j = 0, dV_j = 0 (this pass's columns)
    float acc_dk[1][kCols / 8][4] = {}, acc_dv[1][kCols / 8][4] = {};
    restart();
    if (steps > 0) issue_step(0, 0);

    for (int step = 0; step < steps; ++step) {
      const int stage = step % kStages;
      // This step's Q, dO, LSE and D have landed (two stages: the next step's go out
      // first, into the other stage, and stay in flight).
      if (kStages == 2 && step + 1 < steps) {
        issue_step(step + 1, (step + 1) % kStages);
        LoadPipeline::landed<1>();
      } else {
        LoadPipeline::landed<0>();
      }
      LoadPipeline::sync();
      const int head = step_head(step), m0 = step_m0(step);
      const SharedTile<S> q_tile = q_tiles[stage], do_tile = do_tiles[stage];
      const float* step_lse = lse_log2[stage];
      const float* step_delta = deltas[stage];

      ScoreMod mod{};
      Dropout dropout{};
      score_extras<kExtras>(p, mask, batch, head, mod, dropout);

      // dP^T = V dO^T;  S^T = K Q^T: this warp's 16 keys x kBlockM queries
      float acc_s[1][kBlockM / 8][4] = {}, acc_ds[1][kBlockM / 8][4] = {};
      mma_ABt<T, kQkUnroll>(acc_ds, v_tile.from_row(warp * 16), do_tile, lane);
      mma_ABt<T, kQkUnroll>(acc_s, k_tile.from_row(warp * 16), q_tile, lane);
      // P^T = dropout(exp(mod(S^T) - LSE));  dS^T = P^T (dropout(dP^T) - D) mod'(S^T)
      probabilities_and_gradients<true, kLocal, kExtras, Mods>(
          acc_s, acc_ds, scale_log2, !mask.covers(m0, min(m0 + kBlockM, seq.seqlen_q), n0, n0 + kBlockN), mask, mod,
          ModsAt<Mods>::of(p, batch, head).in_block(pairs.status(head, m0 / kBlockM) == kBlockFull), dropout,
          dropping, p.dropout_scale, [=](int c, int) { return step_lse[c]; },
          [=](int c, int) { return step_delta[c]; }, n0 + warp * 16, m0, lane);
      // dV_j += P^T dO;  dK_j += dS^T Q (scaled once at the end)
      mma_AB<T>(acc_dv, acc_s, do_tile, col0, lane);
      mma_AB<T>(acc_dk, acc_ds, q_tile, col0, lane);

      LoadPipeline::release();
      if (kStages == 1 && step + 1 < steps) issue_step(step + 1, 0);
      advance();
    }

    // dK_j (times the softmax scale) and dV_j of this pass's columns -> global memory
    store_accumulators<T, kCols / 8, kVec>(dk, p.dk.row_stride, acc_dk[0], n0 + warp * 16, seq.seqlen_k, col0,
                                          p.headdim, p.scale, lane);
    store_accumulators<T, kCols / 8, kVec>(dv, p.dv.row_stride, acc_dv[0], n0 + warp * 16, seq.seqlen_k, col0,
                                          p.headdim, 1.f, lane);
  }
  LoadPipeline::landed<0>();  // K/V copies are still pending when no query tile was visited
}

// dQ: one CTA per (query tile, head, batch), each warp 16 query rows, key tiles
// streamed as in the forward.
//   S = Q K^T;  P = exp(mod(S) - LSE);  dP = dropout(dO V^T);  dS = P (dP - D) mod'(S);  dQ += dS K
// kColSplit passes over the head dim keep the dQ accumulator within registers.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLocal, bool kVec,
          bool kExtras, int kColSplit, typename Mods = NoMods>
__global__ void __launch_bounds__(kWarps * 32, 1) attention_backward_dq(const ParamsOf<Mods> p) {
  constexpr int kThreads = kWarps * 32;
  using S = HeadDimLayout<kHeadDim, true>;  // (layout.cuh: kXorAddress)
  constexpr int kCols = kHeadDim / kColSplit;
  constexpr int kQkUnroll = qk_unroll(kHeadDim);
  static_assert(kBlockM == 16 * kWarps && kBlockN % 16 == 0 && kCols % 16 == 0, "tile shape");

  using Shared = BackwardDqShared<kHeadDim, kBlockM, kBlockN, kStages>;
  extern __shared__ __align__(128) unsigned char smem[];  // swizzled rows start on 128-byte lines
  const SharedTile<S> q_tile{reinterpret_cast<elem_t*>(smem + Shared::kQ)};
  const SharedTile<S> do_tile{reinterpret_cast<elem_t*>(smem + Shared::kDo)};
  const StagedTiles<S, kBlockN, kStages> k_tiles{reinterpret_cast<elem_t*>(smem + Shared::kK)};
  const StagedTiles<S, kBlockN, kStages> v_tiles{reinterpret_cast<elem_t*>(smem + Shared::kV)};

  // Under a causal band the last query tiles see the most keys: number them first.
  const auto grid_tile = GridTile<kLocal>::of_block(p.tile_group);
  const int m_block = gridDim.x - 1 - grid_tile.tile, head = grid_tile.head, batch = grid_tile.batch;
  const Sequence seq = Sequence::of(p, batch);
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.seqlen_q) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane >> 2;
  const int kv_head = head / p.heads_per_kv;
  const elem_t* k = seq.rows(p.k, batch, kv_head, false);
  const elem_t* v = seq.rows(p.v, batch, kv_head, false);
  elem_t* dq = seq.rows(p.dq, batch, head, true);

  const auto mask = Mask<kLocal>::of(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  const int row_end = min(m0 + kBlockM, seq.seqlen_q);
  const int n_begin = mask.key_begin(m0) / kBlockN;
  const int n_end = ceil_div(mask.key_end(row_end), kBlockN);
  // With a block mask the tiles of its empty blocks are never visited: the loop goes from
  // one tile that is not empty to the next (KeyTiles::after), where it would go from n to n + 1.
  constexpr bool kSparse = kBlockSparse<Mods>;
  const auto key_tiles = KeyTiles<Mods, kBlockN>::of(p, batch, head, m0);
  const int n_first = kSparse ? key_tiles.after(n_begin - 1, n_end) : n_begin;  // the first tile visited
  const float scale_log2 = kExtras ? kLog2e : p.scale_log2;
  const bool dropping = kExtras && p.dropout_threshold > 0;
  ScoreMod mod{};
  Dropout dropout{};
  score_extras<kExtras>(p, mask, batch, head, mod, dropout);

  // This lane's two rows: LSE in log2 units (+inf past seqlen_q, so P = 0) and D.
  float row_lse[2], row_delta[2];
  const int64 at = seq.lse_offset(p, batch, head);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + warp * 16 + g + 8 * h;
    row_lse[h] = row < seq.seqlen_q ? p.lse[at + row] * kLog2e : kInf;
    row_delta[h] = row < seq.seqlen_q ? p.delta[at + row] : 0.f;
  }

  // The copies of key tile n's K and V into a stage: one group.
  auto issue_kv = [&](int n, int stage) {
    load_tile<kBlockN, kThreads, kVec>(k_tiles[stage], k, p.k.row_stride, n * kBlockN, seq.seqlen_k, p.headdim);
    load_tile<kBlockN, kThreads, kVec>(v_tiles[stage], v, p.v.row_stride, n * kBlockN, seq.seqlen_k, p.headdim);
    LoadPipeline::commit();
  };
  // Q_i and dO_i -> shared memory, where they stay
  load_tile<kBlockM, kThreads, kVec>(q_tile, seq.rows(p.q, batch, head, true), p.q.row_stride, m0, seq.seqlen_q,
                                     p.headdim);
  load_tile<kBlockM, kThreads, kVec>(do_tile, seq.rows(p.dout, batch, head, true), p.dout.row_stride, m0,
                                     seq.seqlen_q, p.headdim);
  LoadPipeline::commit();

#pragma unroll 1
  for (int pass = 0; pass < kColSplit; ++pass) {
    const int col0 = pass * kCols;
    if (kSparse ? n_end > n_first : n_end > n_begin) issue_kv(kSparse ? n_first : n_begin, 0);
    // dQ_i = 0 (this pass's columns)
    float acc_dq[1][kCols / 8][4] = {};
    for (int i = 0, n = kSparse ? n_first : n_begin; n < n_end;
         ++i, n = kSparse ? key_tiles.after(n, n_end) : n + 1) {
      const int stage = i % kStages;
      const int n_next = kSparse ? key_tiles.after(n, n_end) : n + 1;  // the tile visited next
      // K_n and V_n have landed (two stages: K_{n+1} and V_{n+1} go out first, into the
      // other stage, and stay in flight).
      if (kStages == 2 && (kSparse ? n_next : n + 1) < n_end) {
        issue_kv(kSparse ? n_next : n + 1, (i + 1) % kStages);
        LoadPipeline::landed<1>();
      } else {
        LoadPipeline::landed<0>();
      }
      LoadPipeline::sync();
      const SharedTile<S> k_tile = k_tiles[stage], v_tile = v_tiles[stage];
      const int n0 = n * kBlockN;

      // S = Q K^T;  dP = dO V^T: this warp's 16 queries x kBlockN keys
      float acc_s[1][kBlockN / 8][4] = {}, acc_ds[1][kBlockN / 8][4] = {};
      mma_ABt<T, kQkUnroll>(acc_s, q_tile.from_row(warp * 16), k_tile, lane);
      mma_ABt<T, kQkUnroll>(acc_ds, do_tile.from_row(warp * 16), v_tile, lane);
      // P = dropout(exp(mod(S) - LSE));  dS = P (dropout(dP) - D) mod'(S)
      probabilities_and_gradients<false, kLocal, kExtras, Mods>(
          acc_s, acc_ds, scale_log2, !mask.covers(m0, row_end, n0, n0 + kBlockN), mask, mod,
          ModsAt<Mods>::of(p, batch, head).in_block(key_tiles.status(n) == kBlockFull), dropout, dropping,
          p.dropout_scale, [=](int, int e) { return row_lse[e >> 1]; }, [=](int, int e) { return row_delta[e >> 1]; },
          m0 + warp * 16, n0, lane);
      // dQ_i += dS K (scaled once at the end)
      mma_AB<T>(acc_dq, acc_ds, k_tile, col0, lane);
      LoadPipeline::release();
      if (kStages == 1 && (kSparse ? n_next : n + 1) < n_end) issue_kv(kSparse ? n_next : n + 1, 0);
    }
    LoadPipeline::landed<0>();
    // dQ_i (times the softmax scale) of this pass's columns -> global memory
    store_accumulators<T, kCols / 8, kVec>(dq, p.dq.row_stride, acc_dq[0], m0 + warp * 16, seq.seqlen_q, col0,
                                           p.headdim, p.scale, lane);
  }
}

}  // namespace cuflash
