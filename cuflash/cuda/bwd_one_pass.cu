// The one-pass backward, FlashAttention-2's and the default (bwd.cu has the overview
// of both backward paths): dK, dV and dQ from one kernel, dQ added with atomics to the
// fp32 accumulator (dq_accum.cuh) that attention_backward_preprocess zeroes and
// attention_backward_convert_dq rounds into dq.
#include "common.cuh"
#include "copy.cuh"
#include "dq_accum.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mods.cuh"
#include "params.cuh"
#include "pipeline.cuh"
#include "score.cuh"
#include "softmax_bwd.cuh"

namespace cuflash {

// Shared memory, byte offsets: the K and V tiles, kStages Q and dO tiles, the P and dS
// tiles ([query][key], padded rows), then kStages rows of LSE and of D (float).
// _plan.KINDS["backward"] states the same size (tests/test_plan.py holds the two together).
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct BackwardShared {
  static constexpr int kRow = HeadDimLayout<kHeadDim>::kRowElems * kElemBytes;
  static constexpr int kPRow = PaddedRows<kBlockN>::kRowElems * kElemBytes;
  static constexpr int kK = 0, kV = kK + kBlockN * kRow, kQ = kV + kBlockN * kRow;
  static constexpr int kDo = kQ + kStages * kBlockM * kRow, kP = kDo + kStages * kBlockM * kRow;
  static constexpr int kDs = kP + kBlockM * kPRow, kLse = kDs + kBlockM * kPRow;
  static constexpr int kDelta = kLse + kStages * kBlockM * 4;
  static constexpr int kBytes = kDelta + kStages * kBlockM * 4;
};

// One CTA per (key tile j, KV head, batch), dK_j and dV_j in registers, dQ added to
// p.dq_accum. Per step (query head of the group, query tile i):
//   S = Q K^T, dP = dO V^T     warps split queries x keys, 32 queries each
//   P, dS -> shared memory     16-bit, [query][key]
//   dV += P^T dO               warps split keys x head dim, 32 keys each
//   dQ += dS K                 warps split queries x head dim, 32 queries each; fp32 red
//   dK += dS^T Q               as dV
// Each fragment read from shared memory feeds 4-8 mma (the two-kernel path: 2).
// @tparam kBlockM  query rows per step, kBlockN key rows per CTA: multiples of 32
// @tparam kStages  shared buffers for Q / dO: 2 overlaps the next step's load with this
//                  step's products, 3 loads two steps ahead
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLocal, bool kVec,
          bool kExtras, typename Mods = NoMods>
__global__ void __launch_bounds__(kWarps * 32, 1) attention_backward(const ParamsOf<Mods> p) {
  constexpr int kThreads = kWarps * 32;
  using S = HeadDimLayout<kHeadDim>;
  using P = PaddedRows<kBlockN>;  // P and dS, [query][key]
  constexpr int kQueryWarps = kBlockM / 32, kKeyWarps = kBlockN / 32;
  constexpr int kSKeys = kBlockN / (kWarps / kQueryWarps);    // S, dP: 32 queries x kSKeys keys a warp
  constexpr int kKvCols = kHeadDim / (kWarps / kKeyWarps);    // dK, dV: 32 keys x kKvCols a warp
  constexpr int kDqCols = kHeadDim / (kWarps / kQueryWarps);  // dQ: 32 queries x kDqCols a warp
  // k16 steps of the S / dP and dQ products the compiler may overlap: more needs more
  // registers than the dK and dV accumulators leave (ptxas spilled; with one Q/dO
  // buffer, the tiles of GPUs with less shared memory, already at these depths under
  // CUDA 12.9 for sm_80, and at d 128 before sm_90, where 8 spilled 4 bytes causal).
  constexpr int kQkUnroll = (kHeadDim <= 64 ? 2 : kHeadDim == 128 && kBeforeSm90 ? 4 : 8) / (kStages >= 2 ? 1 : 2);
  constexpr int kDqUnroll = kHeadDim <= 192 ? 4 : 2;  // 2 at d 256: +3% not causal over 1, no spill
  static_assert(kBlockM % 32 == 0 && kBlockN % 32 == 0 && kWarps % kQueryWarps == 0 && kWarps % kKeyWarps == 0,
                "warp layout");
  static_assert(kSKeys % 16 == 0 && kKvCols % 8 == 0 && kDqCols % 8 == 0, "tile shape");

  using Shared = BackwardShared<kHeadDim, kBlockM, kBlockN, kStages>;
  extern __shared__ __align__(128) unsigned char smem[];  // swizzled rows start on 128-byte lines
  const SharedTile<S> k_tile{reinterpret_cast<elem_t*>(smem + Shared::kK)};
  const SharedTile<S> v_tile{reinterpret_cast<elem_t*>(smem + Shared::kV)};
  const StagedTiles<S, kBlockM, kStages> q_tiles{reinterpret_cast<elem_t*>(smem + Shared::kQ)};
  const StagedTiles<S, kBlockM, kStages> do_tiles{reinterpret_cast<elem_t*>(smem + Shared::kDo)};
  const SharedTile<P> p_tile{reinterpret_cast<elem_t*>(smem + Shared::kP)};
  const SharedTile<P> ds_tile{reinterpret_cast<elem_t*>(smem + Shared::kDs)};
  const StagedRows<kBlockM, kStages> lses{reinterpret_cast<float*>(smem + Shared::kLse)};
  const StagedRows<kBlockM, kStages> deltas{reinterpret_cast<float*>(smem + Shared::kDelta)};

  // Under a causal band the first key tiles see the most queries: they are numbered first.
  // (Not with extras: decoding GridTile's order costs registers those variants lack.)
  const auto grid_tile = GridTile<kLocal && !kExtras>::of_block(p.tile_group);
  const int n_block = grid_tile.tile, kv_head = grid_tile.head, batch = grid_tile.batch;
  const Sequence seq = Sequence::of(p, batch);
  const int n0 = n_block * kBlockN;
  if (n0 >= seq.seqlen_k) return;  // variable length: the grid covers the longest sequence
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane >> 2, t = lane & 3;
  const int s_row0 = warp % kQueryWarps * 32, s_key0 = warp / kQueryWarps * kSKeys;
  const int kv_key0 = warp % kKeyWarps * 32, kv_col0 = warp / kKeyWarps * kKvCols;
  const int dq_col0 = warp / kQueryWarps * kDqCols;  // dQ rows: s_row0

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
  load_tile<kBlockN, kThreads, kVec>(k_tile, seq.rows(p.k, batch, kv_head, false), p.k.row_stride, n0,
                                     seq.seqlen_k, p.headdim);
  load_tile<kBlockN, kThreads, kVec>(v_tile, seq.rows(p.v, batch, kv_head, false), p.v.row_stride, n0,
                                     seq.seqlen_k, p.headdim);
  LoadPipeline::commit();

  // The steps walk (query head of the group, query tile) in order: each step's position
  // follows from the previous one's, with no division of a step index by m_tiles.
  struct Position {
    int head, m_tile;
  };
  auto following = [&](Position at) {
    if constexpr (kBlockSparse<Mods>) {
      const bool last = at.m_tile + 1 >= m_begin + m_tiles;
      const int2 visible = pairs.from(at.head + last, last ? m_begin : at.m_tile + 1);
      return Position{visible.x, visible.y};
    } else {
      return at.m_tile + 1 < m_begin + m_tiles ? Position{at.head, at.m_tile + 1} : Position{at.head + 1, m_begin};
    }
  };
  // The copies of a step's Q_i, dO_i, LSE_i and D_i into a stage, in two parts (each its
  // own group): Q, LSE and D, then dO.
  enum Part { kQ = 1, kDo = 2, kBoth = 3 };
  auto issue_step = [&](Position at, int stage, int parts) {
    const int head = at.head, m0 = at.m_tile * kBlockM;
    if (parts & kQ)
      load_tile<kBlockM, kThreads, kVec>(q_tiles[stage], seq.rows(p.q, batch, head, true), p.q.row_stride, m0,
                                         seq.seqlen_q, p.headdim);
    if (parts & kDo)
      load_tile<kBlockM, kThreads, kVec>(do_tiles[stage], seq.rows(p.dout, batch, head, true), p.dout.row_stride,
                                         m0, seq.seqlen_q, p.headdim);
    if (!(parts & kQ)) {
      LoadPipeline::commit();
      return;
    }
    // Rows past seqlen_q read zeros everywhere (Q, dO, LSE, D): their dS is 0 and
    // their dO is 0, so they add nothing to dK and dV, and their dQ is never stored.
    // (With extras their LSE counts as +inf: a modified score of 0, e.g. ALiBi with a
    // negative slope, could overflow exp and turn 0 * inf into NaN.)
    const int64 lse_at = seq.lse_offset(p, batch, head) + m0;
#pragma unroll
    for (int i0 = 0; i0 < kBlockM; i0 += kThreads) {  // a trip count the compiler knows
      const int i = i0 + threadIdx.x;
      if (kBlockM % kThreads != 0 && i >= kBlockM) break;
      const bool ok = m0 + i < seq.seqlen_q;
      cp_async_4(lses[stage] + i, p.lse + (ok ? lse_at + i : 0), ok);
      cp_async_4(deltas[stage] + i, p.delta + (ok ? lse_at + i : 0), ok);
    }
    LoadPipeline::commit();
  };

  // dK_j = 0, dV_j = 0; the first step's loads (the first two with three stages)
  float acc_dk[2][kKvCols / 8][4] = {}, acc_dv[2][kKvCols / 8][4] = {};
  Position at{kv_head * p.heads_per_kv, m_begin};
  if constexpr (kBlockSparse<Mods>) {
    const int2 visible = pairs.from(at.head, at.m_tile);
    at = Position{visible.x, visible.y};
  }
  if (steps > 0) issue_step(at, 0, kBoth);
  if (kStages == 3 && steps > 1) issue_step(following(at), 1, kBoth);

  for (int step = 0; step < steps; ++step, at = following(at)) {
    const int stage = step % kStages;
    // This step's Q, dO, LSE and D (loaded during an earlier step) have landed (three
    // stages: the next step's may still be in flight); past this barrier every warp is
    // also done with the previous step's P, dS and stage buffers.
    if (kStages == 3 && step + 1 < steps) {
      LoadPipeline::landed<1>();
    } else {
      LoadPipeline::landed<0>();
    }
    LoadPipeline::sync();
    const int head = at.head, m0 = at.m_tile * kBlockM;
    const SharedTile<S> q_tile = q_tiles[stage], do_tile = do_tiles[stage];

    {  // This warp's 32 queries x kSKeys keys:
      ScoreMod mod{};
      Dropout dropout{};
      score_extras<kExtras>(p, mask, batch, head, mod, dropout);
      const float* step_lse = lses[stage] + s_row0;
      const float* step_delta = deltas[stage] + s_row0;
      const int warp_rows = seq.seqlen_q - m0 - s_row0;  // of this warp's 32 rows, those that exist
      // S = Q K^T;  dP = dO V^T
      float acc_s[2][kSKeys / 8][4] = {}, acc_dp[2][kSKeys / 8][4] = {};
      mma_ABt<T, kQkUnroll>(acc_s, q_tile.from_row(s_row0), k_tile.from_row(s_key0), lane);
      mma_ABt<T, kQkUnroll>(acc_dp, do_tile.from_row(s_row0), v_tile.from_row(s_key0), lane);
      // P = dropout(exp(mod(S) - LSE));  dS = P (dropout(dP) - D) mod'(S)
      probabilities_and_gradients<false, kLocal, kExtras, Mods>(
          acc_s, acc_dp, scale_log2, !mask.covers(m0, min(m0 + kBlockM, seq.seqlen_q), n0, n0 + kBlockN), mask,
          mod, ModsAt<Mods>::of(p, batch, head).in_block(pairs.status(head, at.m_tile) == kBlockFull), dropout,
          dropping, p.dropout_scale,
          [=](int r, int) { return !kExtras || r < warp_rows ? step_lse[r] * kLog2e : kInf; },
          [=](int r, int) { return step_delta[r]; }, m0 + s_row0, n0 + s_key0, lane);
      // P, dS -> shared memory, for the products of every warp
      store_fragments<T>(p_tile.from_row(s_row0), s_key0, acc_s, lane);
      store_fragments<T>(ds_tile.from_row(s_row0), s_key0, acc_dp, lane);
    }
    __syncthreads();
    // The next step's loads (with three buffers, the step after's) go into a free stage
    // here, ahead of this step's dQ atomics in the memory queue, and have the three
    // products below to land in.
    // Above d 128 without a band, the next step's dO follows dV's product, apart from its
    // Q: one burst of copies less in the memory queue (d 256's LG-throttle stalls; +2.5-4.4%
    // in two A/B rounds, but -1 to -2% causal and -2 to -3.6% at d 128).
    constexpr bool kSplitLoads = kStages == 2 && kHeadDim > 128 && !kLocal;
    if (kStages == 2 && step + 1 < steps)
      issue_step(following(at), (step + 1) % kStages, kSplitLoads ? kQ : kBoth);
    if (kStages == 3 && step + 2 < steps) issue_step(following(following(at)), (step + 2) % kStages, kBoth);

    // dV_j += dropout(P)^T dO_i
    mma_AtB<T, kBlockM>(acc_dv, p_tile, kv_key0, do_tile, kv_col0, lane);
    if (kSplitLoads && step + 1 < steps) issue_step(following(at), (step + 1) % kStages, kDo);
    // dQ_i += dS K_j for this warp's 32 queries x kDqCols columns, into the fp32
    // accumulator. 64 columns a warp (d 256) go in two parts: the first part's reductions
    // drain under the second's products, in half the accumulator (+1-5% not causal in two
    // A/B rounds).
    constexpr int kDqParts = kDqCols >= 64 ? 2 : 1, kPartCols = kDqCols / kDqParts;
#pragma unroll
    for (int part = 0; part < kDqParts; ++part) {
      const int col0 = dq_col0 + part * kPartCols;
      float acc_dq[2][kPartCols / 8][4] = {};
      mma_AB<T, kBlockN, kDqUnroll>(acc_dq, ds_tile.from_row(s_row0), 0, k_tile, col0, lane);
      // This lane's first row (g), then rows 8 apart: blocks of 8 rows (DqAccum) one step
      // of eight_rows apart, from one address per step. (Written as a DqAccum function of
      // the lane's row and column, the same arithmetic came out in another order.)
      const int64 first_row = seq.q_rows_before + m0 + s_row0 + g;
      float* dq_rows = DqAccum::at(p.dq_accum, first_row, head, p.nheads, kHeadDim, 2 * t);
      const int64 eight_rows = DqAccum::eight_rows(p.nheads, kHeadDim);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = mt * 16 + g + 8 * h;
          if (m0 + s_row0 + r >= seq.seqlen_q) continue;
          float* dst = dq_rows + (2 * mt + h) * eight_rows;
#if __CUDA_ARCH__ >= 900
          if constexpr (kDqCols % 16 == 0 && kPartCols % 16 == 0) {  // two fragments a red.v4
#pragma unroll
            for (int j = 0; j < kPartCols / 16; ++j)
              atomic_add_quad(dst + DqAccum::column(col0 + 16 * j), acc_dq[mt][2 * j][2 * h],
                              acc_dq[mt][2 * j][2 * h + 1], acc_dq[mt][2 * j + 1][2 * h],
                              acc_dq[mt][2 * j + 1][2 * h + 1]);
            continue;
          }
#endif
#pragma unroll
          for (int dt = 0; dt < kPartCols / 8; ++dt)
            atomic_add_pair(dst + DqAccum::column(col0 + 8 * dt), acc_dq[mt][dt][2 * h], acc_dq[mt][dt][2 * h + 1]);
        }
    }
    // dK_j += dS^T Q_i (scaled once at the end), after dQ: its products cover the
    // atomics' drain (FlashAttention-2's order; -0.6 to +5.6% in an A/B, the most causal)
    mma_AtB<T, kBlockM>(acc_dk, ds_tile, kv_key0, q_tile, kv_col0, lane);
    if (kStages == 1 && step + 1 < steps) {
      LoadPipeline::release();  // one buffer: every warp is done with this step's Q and dO
      issue_step(following(at), 0, kBoth);
    }
  }
  // (K/V copies are still pending when no query tile was visited.) Every warp is done
  // reading K and V:
  LoadPipeline::wait<0>();

  // dK_j (times the softmax scale) and dV_j out, through the K and V tiles, so that the
  // global stores are 16 bytes wide and coalesced (from the fragments they were 4-byte
  // pieces of 8 rows).
  store_fragments<T>(k_tile.from_row(kv_key0), kv_col0, acc_dk, lane, p.scale);
  store_fragments<T>(v_tile.from_row(kv_key0), kv_col0, acc_dv, lane);
  __syncthreads();
  const Sequence out_seq = Sequence::of(p, batch);
  store_tile<kBlockN, kThreads, kVec>(out_seq.rows(p.dk, batch, kv_head, false), k_tile, p.dk.row_stride, n0,
                                      out_seq.seqlen_k, p.headdim);
  store_tile<kBlockN, kThreads, kVec>(out_seq.rows(p.dv, batch, kv_head, false), v_tile, p.dv.row_stride, n0,
                                      out_seq.seqlen_k, p.headdim);
}

}  // namespace cuflash
