// Backward attention on Hopper (sm_90a): TMA loads and wgmma products (bwd.cu has the
// overview of the backward and the elementwise kernels around it: D = rowsum(dO O) and
// dQ's accumulator zeroed before, dQ rounded after).
//
// One CTA per (key block of 128 keys, KV head, sequence). Warpgroup 0's first warp
// produces: K and V of the block once, then for each step (query head of the group,
// query block) Q and dO by TMA and the block's LSE and D by plain loads, into a ring of
// kStages stages. Consumer warpgroups 1 and 2 own keys 64c .. 64c + 63 of the block and
// keep their dK and dV in registers. The scores are computed transposed (FlashAttention-3's
// swapAB: a warpgroup's wgmma rows are its keys), so that P^T and dS^T come out where
// dV and dK need them, as the A operand in registers. Per step:
//
//   S^T = K Q^T,  dP^T = V dO^T           wgmma, all operands from shared memory
//   P^T = exp(S^T - LSE)                  softmax_bwd.cuh (mask.cuh), under dP^T's product
//                                         (with softcap, ALiBi, dropout or mods, P^T and dS^T
//                                         together once dP^T has landed)
//   dV += P^T dO                          wgmma, P^T from registers (with 64 query rows a
//                                         step under the next line, else after it)
//   dS^T = P^T (dP^T - D)
//   dS -> shared memory ([query][key], stmatrix transposing); both consumers' keys written
//   dQ = dS K                             wgmma, dS K-major, K MN-major (80 query rows a step,
//                                         d 128 on dense calls: dQ^T = K^T dS^T, staged as
//                                         its fragments stand, DqAccum's transposed order)
//   dK += dS^T Q                          wgmma, dS^T from registers, running under the next line
//   dQ -> shared memory (fp32)            the producer warpgroup's second warp adds it to
//                                         the accumulator (dq_accum.cuh) by the copy
//                                         engine's bulk reduction, 2 KB a group of 8 rows
//
// then dK (times the softmax scale) and dV from registers to global memory.
#include "common.cuh"
#include "dq_accum.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "score.cuh"
#include "shared_memory.cuh"
#include "sm90/bwd_common.cuh"
#include "sm90/bwd_params.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "softmax_bwd.cuh"

namespace cuflash {

// The shared memory of Sm90BackwardSharedLayout (shared_memory.cuh), its loads and its barriers.
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct Sm90BackwardShared : Sm90KeyBlockShared<Sm90BackwardSharedLayout<kHeadDim, kBlockM, kBlockN, kStages>> {
  using Layout = Sm90BackwardSharedLayout<kHeadDim, kBlockM, kBlockN, kStages>;
  using Base = Sm90KeyBlockShared<Layout>;
  using Base::barrier, Base::base, Base::kv_landed;
  using Layout::kColumnBlocks, Layout::kDelta, Layout::kDo, Layout::kDs, Layout::kDsTile, Layout::kDq,
      Layout::kDqDestination, Layout::kDqSlice, Layout::kDqTurn, Layout::kLse, Layout::kQ, Layout::kQBlock,
      Layout::kQTile;

  static __device__ __forceinline__ Sm90BackwardShared of(unsigned char* dynamic) {
    return {{{}, Base::aligned(dynamic)}};
  }
  __device__ __forceinline__ unsigned char* q(int stage) const { return base + kQ + stage * kQTile; }
  __device__ __forceinline__ unsigned char* dout(int stage) const { return base + kDo + stage * kQTile; }
  __device__ __forceinline__ unsigned char* ds(int buffer) const { return base + kDs + buffer * kDsTile; }
  __device__ __forceinline__ float* lse(int stage) const {
    return reinterpret_cast<float*>(base + kLse) + stage * kBlockM;
  }
  __device__ __forceinline__ float* delta(int stage) const {
    return reinterpret_cast<float*>(base + kDelta) + stage * kBlockM;
  }
  __device__ __forceinline__ float* dq(int consumer) const {
    return reinterpret_cast<float*>(base + kDq + consumer * kDqSlice);
  }
  __device__ __forceinline__ float** dq_destination(int consumer) const {
    return reinterpret_cast<float**>(base + kDqDestination) + (kBlockM / 8) * consumer;
  }
  // The step's turn in the dQ order (deterministic): written by the first consumer with
  // its dQ, read by the writer.
  struct DqTurn {
    int* semaphore;
    int turn;
  };
  __device__ __forceinline__ DqTurn* dq_turn() const { return reinterpret_cast<DqTurn*>(base + kDqTurn); }
  __device__ __forceinline__ sm90::Barrier landed(int stage) const { return barrier(1 + stage); }
  __device__ __forceinline__ sm90::Barrier released(int stage) const { return barrier(1 + kStages + stage); }
  __device__ __forceinline__ sm90::Barrier dq_staged(int consumer) const {
    return barrier(1 + 2 * kStages + consumer);
  }
  __device__ __forceinline__ sm90::Barrier dq_drained(int consumer) const {
    return barrier(3 + 2 * kStages + consumer);
  }

  // The loading thread arrives at K/V's "landed" barrier, the producer warp's lanes at
  // each stage's (each after its own LSE and D stores), every consumer thread at each
  // "released" one and at its dQ's "staged", the dQ writer's lanes of a consumer (one a
  // group of 8 rows) at its "drained".
  __device__ __forceinline__ void init_barriers(int consumer_threads) const {
    kv_landed().init(1);
    for (int s = 0; s < kStages; ++s) landed(s).init(32), released(s).init(consumer_threads);
    for (int c = 0; c < 2; ++c) dq_staged(c).init(consumer_threads / 2), dq_drained(c).init(kBlockM / 8);
    sm90::Barrier::fence_init();
  }
  // A step's Q and dO (rows from `row`), by one thread (as load_kv: rows past a packed
  // sequence's end count for nothing).
  template <typename Args>
  __device__ __forceinline__ void load_step(const Args& args, int stage, int row, int head, int batch) const {
    landed(stage).arrive_expecting(2 * kQTile);
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) {
      sm90::tma_load(q(stage) + c * kQBlock, args.q, landed(stage), 64 * c, row, head, batch);
      sm90::tma_load(dout(stage) + c * kQBlock, args.dout, landed(stage), 64 * c, row, head, batch);
    }
  }
};

// Transposed scores of a consumer's 64 keys against a step's queries, committed as one
// group: S^T = K Q^T (keys: the K tile, queries: Q) or dP^T = V dO^T (V, dO). A: the keys'
// rows, B: the queries' rows, both K-major; the head dim in k16 steps, four to a
// 64-column block.
template <typename T, class Shared, int kBlockM>
__device__ __forceinline__ void issue_transposed_scores(const unsigned char* keys, const unsigned char* queries,
                                                        int consumer, float (&acc)[1][kBlockM / 8][4]) {
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < Shared::kColumnBlocks * 4; ++k)
    sm90::Wgmma<T, kBlockM>::ss(
        acc, sm90::SmemDesc::k_major(keys + (k / 4) * Shared::kKvBlock + consumer * 64 * 128 + (k % 4) * 32),
        sm90::SmemDesc::k_major(queries + (k / 4) * Shared::kQBlock + (k % 4) * 32), k > 0);
  sm90::wgmma_commit();
}

// acc += A B for a consumer's 64 keys: A (64 keys x the step's queries) from registers,
// B = a step's tile (queries x head dim: dO for dV, Q for dK) read N-major, 16 queries
// (2048 bytes) a k16 step.
template <typename T, class Shared, int kBlockM>
__device__ __forceinline__ void issue_key_gradient(const unsigned char* tile, const unsigned (&a)[kBlockM / 16][4],
                                                   float (&acc)[1][Shared::kColumnBlocks * 8][4]) {
  using Product = sm90::Wgmma<T, Shared::kColumnBlocks * 64>;
#pragma unroll
  for (int k = 0; k < kBlockM / 16; ++k)
    Product::template rs_bt<0>(acc, a[k], sm90::SmemDesc::n_major(tile + k * 16 * 128, Shared::kQBlock));
}

// dS^T (this warp's 16 keys, the A fragments of sm90::as_a_operand) -> the dS tile, [query][key]:
// a consumer's 64 keys are a block of kBlockM rows of 128 bytes in the 128-byte swizzle
// (16-byte chunk c of row r at chunk c ^ (r % 8)). stmatrix transposes each 8x8 matrix:
// lane 8i + r addresses query 8 (i / 2) + r of a k16 step's 16, keys 8 (i % 2) .. of the
// warp's 16 (chunk 2 (warp % 4) + i % 2 of the row).
template <class Shared, int kBlockM>
__device__ __forceinline__ void store_gradients(unsigned char* tile, const unsigned (&a)[kBlockM / 16][4],
                                                int consumer, int warp, int lane) {
  const int i = lane >> 3, r = lane & 7;
  const unsigned row = smem_addr(tile + consumer * Shared::kQBlock + (8 * (i >> 1) + r) * 128 +
                                 ((2 * (warp % 4) + (i & 1)) ^ r) * 16);
#pragma unroll
  for (int j = 0; j < kBlockM / 16; ++j) sm90::store_matrices_transposed(row + j * 16 * 128, a[j]);
}

// dQ added to the accumulator by red.v4, where the copy engine cannot take it (128 rows a
// step, or a packed sequence that starts inside a group of 8 rows): this warp's rows g and
// g + 8 (none past the end), 16 bytes of a lane's two neighbouring 8-column fragments.
template <int kDqCols>
__device__ __forceinline__ void add_dq(const float (&acc_dq)[1][kDqCols / 8][4], const Params& p, int accum_cols,
                                       const Sequence& seq, int head, int m0, int dq_rows, int dq_col0, int warp,
                                       int lane) {
  const int g = lane >> 2, t = lane & 3, row = m0 + dq_rows + 16 * (warp % 4) + g;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (row + 8 * h >= seq.seqlen_q) continue;
    float* dst = DqAccum::at(p.dq_accum, seq.q_rows_before + row + 8 * h, head, p.nheads, accum_cols, 2 * t);
#pragma unroll
    for (int j = 0; j < kDqCols / 16; ++j)
      if (dq_col0 + 16 * j < accum_cols)
        atomic_add_quad(dst + DqAccum::column(dq_col0 + 16 * j), acc_dq[0][2 * j][2 * h], acc_dq[0][2 * j][2 * h + 1],
                        acc_dq[0][2 * j + 1][2 * h], acc_dq[0][2 * j + 1][2 * h + 1]);
  }
}

// Warpgroup 0 produces (its first warp loads, its second adds dQ to the accumulator; 24
// registers a thread), warpgroups 1 and 2 compute
// (240 registers: dK and dV of 64 keys stay in them). The producer refills a stage once
// every consumer thread has released it (a fresh barrier counts as released: its waits
// start on the other parity).
// @tparam kBlockM  query rows a step: 64 or 128 (the registers of dK, dV, S^T, dP^T and
//                  P^T's fragments: _plan.SM90_BACKWARD_TILES), or 80 at d 128 on dense
//                  rows whose count is a multiple of 8 (dQ^T, in DqAccum's transposed
//                  order: _plan.SM90_BACKWARD_DENSE_TILES)
// @tparam kStages  Q/dO stages in flight
// @tparam kLocal   causal or sliding window
// @tparam kExtras  softcap, ALiBi, dropout or score_mod may be on: P and dS in one step
//                  (softmax_bwd.cuh, probabilities_and_gradients) once dP^T has landed
// @tparam Mods     score_mod / mask_mod (mods.cuh; with a block mask the steps leave out its
//                  empty blocks); mask_mod alone also on the plain instance, its hidden
//                  scores -inf before the exp (ModsAt::hide)
template <typename T, int kHeadDim, int kBlockM, int kStages, bool kLocal, bool kExtras, typename Mods = NoMods>
__global__ void __launch_bounds__(384, 1)
    attention_backward_sm90(const __grid_constant__ Sm90BackwardParamsOf<kHasMods<Mods>> args) {
  // 80 rows a step: FlashAttention-3's tile at d 128, on dense rows whose count is a multiple
  // of 8 (the planner's), so that every step's dQ goes by the copy engine.
  constexpr bool kTransposedDq = kBlockM % 64 != 0;
  static_assert((kHeadDim == 64 || kHeadDim == 128) && (kBlockM == 64 || kBlockM == 128 || kTransposedDq),
                "the products: m64n64 / m64n80 / m64n128 (S^T, dP^T over the queries, dK and dV over the head dim)");
  static_assert(!kTransposedDq || (kHeadDim == 128 && !kExtras && !kHasMods<Mods>), "80 rows a step: d 128, no extras");
  static_assert(kExtras || !Mods::kScore, "score_mod takes the scores in natural units: the extras' instances");
  constexpr int kBlockN = 128, kGroups = kBlockM / 8;  // dQ's groups of 8 rows
  // dQ = dS K: with 64 query rows a step the consumers take half the head dim each, with
  // 128 rows each its 64 rows. With 80 rows (no multiple of wgmma's 64), dQ^T = K^T dS^T,
  // each consumer's half of the head dim as the product's rows.
  constexpr int kDqCols = kBlockM == 128 ? kHeadDim : kHeadDim / 2;
  static_assert(kDqCols == 64, "dQ's products: m64n64 / m64n80");
  // dV's product issued before dS^T is computed, running under it, where P^T's fragments
  // fit beside S^T, dP^T, dK and dV (64 rows a step); with 128 rows (or extras, P and dS
  // made together) dS^T first, then dV and dK together.
  constexpr bool kEarlyValues = kBlockM == 64 && !kExtras;
  using Shared = Sm90BackwardShared<kHeadDim, kBlockM, kBlockN, kStages>;
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  const auto shared = Shared::of(dynamic_shared);
  const ParamsOf<Mods>& p = args.p;
  // Deterministic under a causal mask or window, the key blocks take their turns on a query
  // block last first and walk their query blocks backwards (FlashAttention-3's shortest
  // first): each block's first step is then the last query block, whose turns come one
  // after another, where in the forward order key block n's first query block waits until
  // key block 0 has walked down to it. Turns follow the launch order: the grid runs its
  // key blocks in reverse.
  // Otherwise, under a causal mask or window, key block 0 (the longest) of every (KV head,
  // sequence) pair of a group starts first, then key block 1, ... (GridTile, p.tile_group:
  // _plan.backward_section), so that the short blocks fill the last wave (not with mods:
  // decoding the order spilled the producer's 24 registers).
  const bool backwards = kLocal && p.dq_semaphore != nullptr;
  const auto grid_tile = GridTile<kLocal && !kHasMods<Mods>>::of_block(backwards ? 1 : p.tile_group);
  const int n_block = backwards ? gridDim.x - 1 - blockIdx.x : grid_tile.tile;
  const int kv_head = grid_tile.head, batch = grid_tile.batch;
  const Sequence seq = Sequence::of(p, batch);
  const int n0 = n_block * kBlockN;
  if (n0 >= seq.seqlen_k) return;  // packed: the grid covers the longest sequence
  const int tma_batch = p.cu_seqlens_q ? 0 : batch;
  // dQ by the copy engine where the sequence's rows start one of DqAccum's blocks of 8
  // (each block's 64 columns then 2 KB in one piece), else by the consumers' red.v4; with
  // 128 rows a step the producer's loads of LSE and D leave the writer too few registers.
  const bool staged_dq = kTransposedDq || (kBlockM != 128 && seq.q_rows_before % 8 == 0);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = warp / 4;

  // The query blocks that see any key of the block, for each query head of the group.
  const auto mask = Mask<kLocal>::of(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  const int2 query_blocks = mask.template query_tiles<kBlockM>(n0, min(n0 + kBlockN, seq.seqlen_k), seq.seqlen_q);
  const int m_begin = query_blocks.x, m_blocks = query_blocks.y;
  // With a block mask the steps leave out the (query head, query block) pairs of its empty
  // blocks (and the calls with one are never deterministic: the turns count every pair).
  const auto pairs = QueryTiles<Mods, kBlockM>::of(p, batch, n0, (kv_head + 1) * p.heads_per_kv, m_begin,
                                                   m_begin + m_blocks);
  const int steps = kBlockSparse<Mods> ? pairs.count(kv_head * p.heads_per_kv) : p.heads_per_kv * m_blocks;
  // A step's query head and first query row, counted along (no division in the producer's
  // 24 registers): each query head's blocks in turn, first to last (or backwards).
  const int m_first = (backwards ? m_begin + m_blocks - 1 : m_begin) * kBlockM;
  const int m_last = (backwards ? m_begin : m_begin + m_blocks - 1) * kBlockM;
  int head = kv_head * p.heads_per_kv, m0 = m_first;
  auto skip_empty = [&](int from_head, int from_block) {
    const int2 visible = pairs.from(from_head, from_block);
    head = visible.x, m0 = visible.y * kBlockM;
  };
  if constexpr (kBlockSparse<Mods>) skip_empty(head, m_begin);
  auto advance = [&] {
    if constexpr (kBlockSparse<Mods>) {
      const bool last = m0 == m_last;
      skip_empty(head + last, last ? m_begin : m0 / kBlockM + 1);
    } else if (m0 == m_last) {
      m0 = m_first, ++head;
    } else {
      m0 += backwards ? -kBlockM : kBlockM;
    }
  };

  // args.count_done: once all of the CTA's dQ is in the accumulator (the writer's additions,
  // or the consumers'), one thread counts the CTA on its (sequence, KV head)'s counter for the
  // conversion beside the grid (bwd.cu, attention_backward_convert_dq[_transposed]_by_head); its block is
  // decoded again there (kept from here, it spilled the producer's 24 registers). Only the
  // tiles of 64 and 80 rows have it (_plan.sm90.converts_beside: at 128 it measured slower).
  constexpr bool kCounts = kBlockM != 128;
  auto count_end = [&] {
    const auto tile = GridTile<kLocal && !kHasMods<Mods>>::of_block(kLocal && p.dq_semaphore ? 1 : p.tile_group);
    count_done(DqAccum::counters(p.dq_accum, int64(args.batch) * p.seqlen_q, p.nheads, args.accum_cols) +
               tile.batch * (p.nheads / p.heads_per_kv) + tile.head);
  };
  set_up_shared(shared, 256);  // (_plan.Sm90Backward.shared_bytes)
  if (kCounts) allow_dependents();  // (the conversion may start on free multiprocessors once every CTA has)

  if (group == 0) {  // the producer
    sm90::set_max_registers<24, false>();
    if (warp == 0) {
      if (lane == 0) shared.load_kv(args, seq.k_start + n0, kv_head, tma_batch);
      for (int step = 0; step < steps; ++step, advance()) {
        const int stage = step % kStages;
        shared.released(stage).wait(((step / kStages) & 1) ^ 1);
        // The step's LSE (in log2 units) and D; rows past the sequence see no key (LSE
        // +inf: P = 0). Each lane's arrival releases its own stores to the consumers' wait.
        const int64 at = seq.lse_offset(p, batch, head);
#pragma unroll  // (the loads in flight together)
        for (int r = 0; r < (kBlockM + 31) / 32; ++r) {
          const int i = 32 * r + lane;
          if (kBlockM % 32 != 0 && i >= kBlockM) continue;
          const bool inside = m0 + i < seq.seqlen_q;
          shared.lse(stage)[i] = inside ? p.lse[at + m0 + i] * kLog2e : kInf;
          shared.delta(stage)[i] = inside ? p.delta[at + m0 + i] : 0.f;
        }
        if (lane == 0)
          shared.load_step(args, stage, seq.q_start + m0, head, tma_batch);
        else
          shared.landed(stage).arrive();
      }
    } else if (warp == 1 && staged_dq && lane < 2 * kGroups) {  // the dQ writer: lane kGroups c + r, rows 8r ..
      const int c = lane / kGroups, col0 = 64 * c;
      const unsigned bytes = min(kDqCols, args.accum_cols - col0) * 8 * 4;
      const float* staged = shared.dq(c) + (lane % kGroups) * 8 * kDqCols;
      float* const* destination = shared.dq_destination(c) + lane % kGroups;
      // Deterministic: lane 0 waits for the step's turn, every writer lane adds its group,
      // and once all of them are written lane 0 passes the turn on.
      const bool ordered = p.dq_semaphore != nullptr;
      constexpr unsigned kWriters = unsigned((1ull << (2 * kGroups)) - 1);
      for (int step = 0; step < steps; ++step) {
        shared.dq_staged(c).wait(step & 1);
        int* semaphore = nullptr;
        if (ordered) {
          if (lane == 0) semaphore = shared.dq_turn()->semaphore, wait_turn(semaphore, shared.dq_turn()->turn);
          __syncwarp(kWriters);
        }
        if (*destination != nullptr) sm90::bulk_reduce_add(*destination, staged, bytes);
        sm90::bulk_commit();
        if (ordered) {
          sm90::bulk_wait<0>();
          fence_proxy_async_global();
          __syncwarp(kWriters);
          if (lane == 0) pass_turn(semaphore);
        } else {
          sm90::bulk_wait_read<0>();
        }
        shared.dq_drained(c).arrive();
      }
      sm90::bulk_wait<0>();
      if (args.count_done) {  // (every addition of the CTA's dQ done)
        fence_proxy_async_global();
        __syncwarp(kWriters);
        if (lane == 0) count_end();
      }
    }
  } else {  // a consumer: keys 64c .. 64c + 63 of the block
    sm90::set_max_registers<240, true>();
    const int consumer = group - 1, key_row = 64 * consumer + 16 * (warp % 4);  // this warp's first key
    const int g = lane >> 2, t = lane & 3;
    float acc_dk[1][kHeadDim / 8][4], acc_dv[1][kHeadDim / 8][4];
#pragma unroll
    for (int dt = 0; dt < kHeadDim / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[0][dt][e] = acc_dv[0][dt][e] = 0.f;
    shared.kv_landed().wait(0);
    for (int step = 0; step < steps; ++step, advance()) {
      const int stage = step % kStages;
      shared.landed(stage).wait((step / kStages) & 1);
      // S^T = K Q^T;  dP^T = V dO^T
      float acc_s[1][kBlockM / 8][4], acc_dp[1][kBlockM / 8][4];
      issue_transposed_scores<T, Shared, kBlockM>(shared.k(), shared.q(stage), consumer, acc_s);
      issue_transposed_scores<T, Shared, kBlockM>(shared.v(), shared.dout(stage), consumer, acc_dp);
      const float* lse = shared.lse(stage);
      const float* delta = shared.delta(stage);
      const bool masked = !mask.covers(m0, min(m0 + kBlockM, seq.seqlen_q), n0, n0 + kBlockN);
      unsigned p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
      if constexpr (kExtras) {
        // P^T = dropout(exp(mod(S^T) - LSE));  dS^T = P^T (dropout(dP^T) - D) mod'(S^T)
        sm90::wgmma_wait<0>();
        sm90::fence_operands(acc_s);
        sm90::fence_operands(acc_dp);
        ScoreMod mod{};
        Dropout dropout{};
        score_extras<true>(p, mask, batch, head, mod, dropout);
        probabilities_and_gradients<true, kLocal, true, Mods>(
            acc_s, acc_dp, kLog2e, masked, mask, mod,
            ModsAt<Mods>::of(p, batch, head).in_block(pairs.status(head, m0 / kBlockM) == kBlockFull), dropout,
            p.dropout_threshold > 0, p.dropout_scale, [=](int c, int) { return lse[c]; },
            [=](int c, int) { return delta[c]; }, n0 + key_row, m0, lane);
      } else {
        // P^T = exp(S^T - LSE), while dP^T is in flight (mask_mod alone: its hidden scores -inf first)
        sm90::wgmma_wait<1>();
        sm90::fence_operands(acc_s);
        if constexpr (kHasMods<Mods>)
          ModsAt<Mods>::of(p, batch, head)
              .in_block(pairs.status(head, m0 / kBlockM) == kBlockFull)
              .template hide<true>(acc_s, n0 + key_row, m0, lane);
        probabilities<true, kLocal>(acc_s, p.scale_log2, masked, mask, [=](int c, int) { return lse[c]; },
                                    n0 + key_row, m0, lane);
        // dV += P^T dO;  dS^T = P^T (dP^T - D) -> shared memory;  dK += dS^T Q
        if constexpr (kEarlyValues) {
          sm90::as_a_operand<T>(acc_s, p_frag);
          sm90::wgmma_fence();
          issue_key_gradient<T, Shared, kBlockM>(shared.dout(stage), p_frag, acc_dv);
          sm90::wgmma_commit();
          sm90::wgmma_wait<1>();
        } else {
          sm90::wgmma_wait<0>();
        }
        sm90::fence_operands(acc_dp);
        score_gradients<true>(acc_s, acc_dp, [=](int c, int) { return delta[c]; }, lane);
      }
      if constexpr (!kEarlyValues) sm90::as_a_operand<T>(acc_s, p_frag);
      sm90::as_a_operand<T>(acc_dp, ds_frag);
      unsigned char* ds_tile = shared.ds(step & 1);
      store_gradients<Shared, kBlockM>(ds_tile, ds_frag, consumer, warp, lane);
      if constexpr (!kEarlyValues) {  // (dV's product, running while the consumers meet)
        sm90::wgmma_fence();
        issue_key_gradient<T, Shared, kBlockM>(shared.dout(stage), p_frag, acc_dv);
        sm90::wgmma_commit();
      }
      fence_proxy_async();  // dS's stores, before the products read them
      consumers_meet();
      // dQ = dS K: dS K-major, K read MN-major; keys in k16 steps (a dS block's 32 bytes,
      // K's 16 rows of 2048 bytes). (80 rows: dQ^T = K^T dS^T, the same operands as A and B.)
      // Then dK += dS^T Q, running while dQ is handed on.
      float acc_dq[1][kTransposedDq ? kBlockM / 8 : kDqCols / 8][4];
      const int dq_rows = kBlockM == 128 ? 64 * consumer : 0, dq_col0 = kBlockM == 128 ? 0 : 64 * consumer;
      sm90::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockN / 16; ++k) {
        const auto ds = sm90::SmemDesc::k_major(ds_tile + (k / 4) * Shared::kQBlock + dq_rows * 128 + (k % 4) * 32);
        const auto keys =
            sm90::SmemDesc::n_major(shared.k() + (dq_col0 / 64) * Shared::kKvBlock + k * 2048, Shared::kKvBlock);
        if constexpr (kTransposedDq)
          sm90::Wgmma<T, kBlockM>::template ss<true, false>(acc_dq, keys, ds, k > 0);
        else
          sm90::Wgmma<T, kDqCols>::template ss<false, true>(acc_dq, ds, keys, k > 0);
      }
      sm90::wgmma_commit();
      issue_key_gradient<T, Shared, kBlockM>(shared.q(stage), ds_frag, acc_dk);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();
      sm90::fence_operands(acc_dq);
      // Deterministic: the key blocks before this one (after it, backwards) that add to this
      // query block go first.
      int* const semaphore = p.dq_semaphore ? p.dq_semaphore + seq.lse_offset(p, batch, head) + m0 : nullptr;
      const int turn = backwards ? (mask.key_end(min(m0 + kBlockM, seq.seqlen_q)) - 1) / kBlockN - n_block
                                 : n_block - mask.key_begin(m0) / kBlockN;
      if (staged_dq) {
        shared.dq_drained(consumer).wait((step & 1) ^ 1);
        if constexpr (kTransposedDq) {
          // dQ^T: this warp's 16 columns (one of DqAccum's blocks) of each group of 8 rows, a
          // lane's fragment as it stands, 16 bytes (DqAccum's transposed order)
          float* staged = shared.dq(consumer) + (warp % 4) * DqAccum::kBlockFloats + 4 * lane;
#pragma unroll
          for (int j = 0; j < kGroups; ++j)
            *reinterpret_cast<float4*>(staged + j * 8 * kDqCols) =
                make_float4(acc_dq[0][j][0], acc_dq[0][j][1], acc_dq[0][j][2], acc_dq[0][j][3]);
        } else {
          // dQ: this warp's rows g and g + 8 (its groups 2 (warp % 4) and 2 (warp % 4) + 1 of
          // 8 rows), a lane's two neighbouring 8-column fragments 16 bytes in DqAccum's order
          float* staged = shared.dq(consumer) + 16 * (warp % 4) * kDqCols + 16 * g + 4 * t;
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < kDqCols / 16; ++j)
              *reinterpret_cast<float4*>(staged + h * 8 * kDqCols + j * DqAccum::kBlockFloats) =
                  make_float4(acc_dq[0][2 * j][2 * h], acc_dq[0][2 * j][2 * h + 1], acc_dq[0][2 * j + 1][2 * h],
                              acc_dq[0][2 * j + 1][2 * h + 1]);
        }
        // where each group of 8 rows goes (the writer keeps to 24 registers): none past the end
        if (warp % 4 == 0 && lane < kGroups) {
          const int row = m0 + dq_rows + 8 * lane;
          shared.dq_destination(consumer)[lane] =
              row < seq.seqlen_q
                  ? DqAccum::at(p.dq_accum, seq.q_rows_before + row, head, p.nheads, args.accum_cols, dq_col0)
                  : nullptr;
        }
        if (semaphore != nullptr && consumer == 0 && warp % 4 == 0 && lane == 0) *shared.dq_turn() = {semaphore, turn};
        fence_proxy_async();  // before the copy engine reads them
        shared.dq_staged(consumer).arrive();
      } else if constexpr (!kTransposedDq) {
        // (deterministic: one thread waits for the turn, the consumers' additions follow,
        // fenced, and one thread passes it on)
        if (semaphore != nullptr) {
          if (threadIdx.x == 128) wait_turn(semaphore, turn);
          consumers_meet();
        }
        add_dq<kDqCols>(acc_dq, p, args.accum_cols, seq, head, m0, dq_rows, dq_col0, warp, lane);
        if (semaphore != nullptr) {
          __threadfence();
          consumers_meet();
          if (threadIdx.x == 128) pass_turn(semaphore);
        }
      }
      sm90::wgmma_wait<0>();
      sm90::fence_operands(acc_dk);
      sm90::fence_operands(acc_dv);
      shared.released(stage).arrive();  // Q and dO read
    }
    // dK (times the softmax scale) and dV: this warp's keys g and g + 8, the array's columns
    const int key = n0 + key_row + g;
    elem_t* dk = seq.rows(p.dk, batch, kv_head, false) + int64(key) * p.dk.row_stride + 2 * t;
    elem_t* dv = seq.rows(p.dv, batch, kv_head, false) + int64(key) * p.dv.row_stride + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (key + 8 * h >= seq.seqlen_k) continue;
#pragma unroll
      for (int dt = 0; dt < kHeadDim / 8; ++dt) {
        if (dt * 8 >= p.headdim) continue;
        *reinterpret_cast<unsigned*>(dk + int64(8 * h) * p.dk.row_stride + dt * 8) =
            DType<T>::pack(acc_dk[0][dt][2 * h] * p.scale, acc_dk[0][dt][2 * h + 1] * p.scale);
        *reinterpret_cast<unsigned*>(dv + int64(8 * h) * p.dv.row_stride + dt * 8) =
            DType<T>::pack(acc_dv[0][dt][2 * h], acc_dv[0][dt][2 * h + 1]);
      }
    }
    if (kCounts && args.count_done && !staged_dq) {  // (the consumers' additions done)
      __threadfence();
      consumers_meet();
      if (threadIdx.x == 128) count_end();
    }
  }
}

}  // namespace cuflash
