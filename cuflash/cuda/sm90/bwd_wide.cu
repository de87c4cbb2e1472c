// Backward attention on Hopper (sm_90a) for wide head dims (d 256; d 161-192 and 225-255 on the
// copy engine's zero columns): FlashAttention-3's structure at d 256 (bwd.cu has the overview
// of the backward and the elementwise kernels around it: D = rowsum(dO O) and dQ's accumulator
// zeroed before, dQ rounded after).
//
// sm90/bwd.cu keeps dK and dV of a consumer's 64 keys in registers, 2 x d a thread: at d 256
// they do not fit. Here the key-side products are swapped instead (dKV swapAB): a consumer owns
// half of the head dim (128 columns) for all kBlockN = 80 keys of the block, and its dK^T and
// dV^T (M = head dim, N = keys) are 2 x 2 x 40 fp32 registers a thread.
//
// One CTA per (block of 80 keys, KV head, sequence). Warpgroup 0's first warp produces: K and V
// of the block once, then for each step (query head of the group, block of 64 query rows) Q and
// the rows' LSE into one of two Q stages, dO and D into the one dO stage. Consumer warpgroups 1
// and 2 (c = 0, 1) split the scores by keys (40 each) and the key-side products by head dim
// (128 each). Per step:
//
//   S = Q K_c^T,  dP = dO V_c^T        wgmma m64n40, all operands K-major in shared memory
//   P = exp(S - LSE) -> shared memory  mask.cuh, softmax_bwd.cuh; [key][query], stmatrix
//                                      transposing; consumers meet (P of all 80 keys written)
//   dV_c^T += dO_c^T P                 m64n80 x 2 (head blocks 2c, 2c + 1): dO read MN-major,
//                                      P K-major; in flight under the next line
//   dS = P (dP - D) -> shared memory   [key][query]; consumers meet
//   dQ_c^T = K_c^T dS^T                m64n64 a head block: K MN-major, dS MN-major; the first
//                                      head block's under dK's first, then added to the
//                                      accumulator by red.global.add.v4 (dq_accum.cuh's layout)
//                                      while the second's and dK's second run
//   dK_c^T += Q_c^T dS                 m64n80 x 2: Q MN-major, dS K-major
//
// then dK (times the softmax scale) and dV through shared memory (over K and V) to global memory.
//
// Left out of this kernel (the planner keeps such calls on the mma.sync backward): softcap,
// ALiBi, dropout, score_mod / mask_mod and block masks, the deterministic order of dQ.
#include "common.cuh"
#include "dq_accum.cuh"
#include "mask.cuh"
#include "shared_memory.cuh"
#include "sm90/bwd_common.cuh"
#include "sm90/bwd_params.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "softmax_bwd.cuh"

namespace cuflash {

// The shared memory of Sm90WideBackwardSharedLayout (shared_memory.cuh), its loads and its barriers.
template <int kHeadDim, int kBlockM, int kBlockN, int kQStages>
struct Sm90WideBackwardShared : Sm90KeyBlockShared<Sm90WideBackwardSharedLayout<kHeadDim, kBlockM, kBlockN, kQStages>> {
  using Layout = Sm90WideBackwardSharedLayout<kHeadDim, kBlockM, kBlockN, kQStages>;
  using Base = Sm90KeyBlockShared<Layout>;
  using Base::barrier, Base::base, Base::kv_landed;
  using Layout::kColumnBlocks, Layout::kDelta, Layout::kDo, Layout::kDs, Layout::kLse, Layout::kP, Layout::kPdsTile,
      Layout::kQ, Layout::kQBlock, Layout::kQTile;

  static __device__ __forceinline__ Sm90WideBackwardShared of(unsigned char* dynamic) {
    return {{{}, Base::aligned(dynamic)}};
  }
  __device__ __forceinline__ unsigned char* q(int stage) const { return base + kQ + stage * kQTile; }
  __device__ __forceinline__ unsigned char* dout() const { return base + kDo; }
  __device__ __forceinline__ unsigned char* probs(int buffer) const { return base + kP + buffer * kPdsTile; }
  __device__ __forceinline__ unsigned char* ds(int buffer) const { return base + kDs + buffer * kPdsTile; }
  __device__ __forceinline__ float* lse(int stage) const {
    return reinterpret_cast<float*>(base + kLse) + stage * kBlockM;
  }
  __device__ __forceinline__ float* delta() const { return reinterpret_cast<float*>(base + kDelta); }
  __device__ __forceinline__ sm90::Barrier q_landed(int stage) const { return barrier(1 + stage); }
  __device__ __forceinline__ sm90::Barrier q_released(int stage) const { return barrier(1 + kQStages + stage); }
  __device__ __forceinline__ sm90::Barrier do_landed() const { return barrier(1 + 2 * kQStages); }
  __device__ __forceinline__ sm90::Barrier do_released() const { return barrier(2 + 2 * kQStages); }

  // The loading thread arrives at K/V's "landed" barrier, the producer warp's lanes at each
  // Q stage's and at dO's (each after its own LSE or D stores), every consumer thread at each
  // "released" one.
  __device__ __forceinline__ void init_barriers(int consumer_threads) const {
    kv_landed().init(1);
    for (int s = 0; s < kQStages; ++s) q_landed(s).init(32), q_released(s).init(consumer_threads);
    do_landed().init(32), do_released().init(consumer_threads);
    sm90::Barrier::fence_init();
  }
  // A step's Q or dO (rows from `row`), by one thread (as load_kv: rows past a packed
  // sequence's end count for nothing; head-dim blocks past the array's columns arrive as zeros).
  __device__ __forceinline__ void load_rows(unsigned char* tile, const sm90::TensorMap& map, sm90::Barrier landed,
                                            int row, int head, int batch) const {
    landed.arrive_expecting(kQTile);
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) sm90::tma_load(tile + c * kQBlock, map, landed, 64 * c, row, head, batch);
  }
};

// Scores of a step's 64 queries against a consumer's keys (kKeys from key row key0 of the
// block), committed as one group: S = Q K^T (queries: Q, keys: the K tile) or dP = dO V^T
// (dO, V). Both K-major; the head dim in k16 steps, four to a 64-column block.
template <typename T, class Shared, int kKeys>
__device__ __forceinline__ void issue_scores(const unsigned char* queries, const unsigned char* keys, int key0,
                                             float (&acc)[1][kKeys / 8][4]) {
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < Shared::kColumnBlocks * 4; ++k)
    sm90::Wgmma<T, kKeys>::ss(acc, sm90::SmemDesc::k_major(queries + (k / 4) * Shared::kQBlock + (k % 4) * 32),
                              sm90::SmemDesc::k_major(keys + (k / 4) * Shared::kKvBlock + key0 * 128 + (k % 4) * 32),
                              k > 0);
  sm90::wgmma_commit();
}

// acc^T += A^T B for one 64-column head block of a consumer (dV^T += dO^T P, dK^T += Q^T dS):
// A = a step's tile (queries x head dim: dO or Q) read MN-major, its block `column_block`,
// 16 query rows (2048 bytes) a k16 step; B = P or dS, [key][query], K-major (32 bytes a step).
template <typename T, class Shared, int kBlockN>
__device__ __forceinline__ void issue_key_gradient(const unsigned char* tile, int column_block,
                                                   const unsigned char* keys_by_query,
                                                   float (&acc)[1][kBlockN / 8][4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
    sm90::Wgmma<T, kBlockN>::template ss<true, false>(
        acc, sm90::SmemDesc::n_major(tile + column_block * Shared::kQBlock + k * 2048, Shared::kQBlock),
        sm90::SmemDesc::k_major(keys_by_query + k * 32), 1);
}

// dQ^T = K^T dS^T for one 64-column head block: A = the K tile's block `column_block` read
// MN-major, B = dS ([key][query]) read MN-major; the keys in k16 steps of 16 rows (2048 bytes).
template <typename T, class Shared, int kBlockN>
__device__ __forceinline__ void issue_query_gradient(const unsigned char* keys, int column_block,
                                                     const unsigned char* ds, float (&acc)[1][8][4]) {
#pragma unroll
  for (int k = 0; k < kBlockN / 16; ++k)
    sm90::Wgmma<T, 64>::template ss<true, true>(
        acc, sm90::SmemDesc::n_major(keys + column_block * Shared::kKvBlock + k * 2048, Shared::kKvBlock),
        sm90::SmemDesc::n_major(ds + k * 2048, Shared::kPdsTile), k > 0);
}

// A warp's accumulator (its 16 rows, kNTiles n8 tiles of columns), times `scale`, stored
// transposed into a tile of 128-byte rows in the 128-byte swizzle (16-byte chunk c of row r at
// chunk c ^ (r % 8)): column j of the accumulator to row col0 + j, this warp's 16 rows to
// chunks 2 (warp % 4) and 2 (warp % 4) + 1. stmatrix transposes each 8x8 matrix: lane 8i + r
// addresses column 8 (i / 2) + r of a pair of n8 tiles, rows 8 (i % 2) .. of the warp's 16.
// P and dS ([key][query], rows: the keys, col0 the consumer's first), dK^T and dV^T
// ([key][head]: a head block's rows).
template <typename T, int kNTiles>
__device__ __forceinline__ void store_transposed(unsigned char* tile, const float (&acc)[1][kNTiles][4], int col0,
                                                 int warp, int lane, float scale = 1.f) {
  const int i = lane >> 3, r = lane & 7;
  const unsigned row = smem_addr(tile + (col0 + 8 * (i >> 1) + r) * 128 + (((2 * (warp % 4) + (i & 1)) ^ r) << 4));
  auto pack = [&](int nt, int h) { return DType<T>::pack(acc[0][nt][2 * h] * scale, acc[0][nt][2 * h + 1] * scale); };
#pragma unroll
  for (int j = 0; j < kNTiles / 2; ++j) {
    const unsigned a[4] = {pack(2 * j, 0), pack(2 * j, 1), pack(2 * j + 1, 0), pack(2 * j + 1, 1)};
    sm90::store_matrices_transposed(row + j * 16 * 128, a);
  }
  if constexpr (kNTiles % 2 == 1)
    sm90::store_matrices_transposed(row + (kNTiles / 2) * 16 * 128, pack(kNTiles - 1, 0), pack(kNTiles - 1, 1));
}

// dQ^T of one head block (this warp's head columns col0 + g and col0 + g + 8, g = lane / 4,
// col0 = the block's first + 16 (warp % 4); queries m0 + 8 nt + 2t, + 1) added to the
// accumulator. DqAccum keeps columns (c, c + 1, c + 8, c + 9) of a row together: lanes g and
// g ^ 1 trade halves, the even one taking query 2t, the odd one 2t + 1, each then one red.v4.
template <int kQueryTiles>
__device__ __forceinline__ void add_dq_transposed(const float (&acc)[1][kQueryTiles][4], const Params& p,
                                                  int accum_cols, const Sequence& seq, int head, int m0, int col0,
                                                  int lane) {
  const int g = lane >> 2, t = lane & 3;
  const bool odd = g & 1;
  const int col = col0 + (g & ~1);
  if (col0 >= accum_cols) return;  // (the same for the whole warp: accum_cols is a multiple of 16)
#pragma unroll
  for (int nt = 0; nt < kQueryTiles; ++nt) {
    const auto& a = acc[0][nt];
    // (kept: this lane's query, columns g and g + 8; sent: the other query's)
    const auto kept0 = odd ? a[1] : a[0], kept1 = odd ? a[3] : a[2];
    const auto got0 = __shfl_xor_sync(0xffffffffu, odd ? a[0] : a[1], 4);
    const auto got1 = __shfl_xor_sync(0xffffffffu, odd ? a[2] : a[3], 4);
    const int row = m0 + 8 * nt + 2 * t + odd;
    if (row < seq.seqlen_q)
      atomic_add_quad(DqAccum::at(p.dq_accum, seq.q_rows_before + row, head, p.nheads, accum_cols, col),
                      odd ? got0 : kept0, odd ? kept0 : got0, odd ? got1 : kept1, odd ? kept1 : got1);
  }
}

// The four warps of consumer c meet (named barrier 2 + c; immediate ids: a register id makes
// ptxas reserve all 16).
__device__ __forceinline__ void consumer_meets(int consumer) {
  if (consumer == 0)
    asm volatile("bar.sync 2, 128;\n" ::: "memory");
  else
    asm volatile("bar.sync 3, 128;\n" ::: "memory");
}

// Warpgroup 0 produces (24 registers a thread), warpgroups 1 and 2 compute (240: dK^T and dV^T
// of 128 head columns x 80 keys stay in them). The producer refills a stage once every
// consumer thread has released it (a fresh barrier counts as released: its waits start on the
// other parity).
// @tparam kHeadDim  256 (the head dim's bucket; smaller ones on zero columns)
// @tparam kLocal    causal or sliding window
template <typename T, int kHeadDim, bool kLocal>
__global__ void __launch_bounds__(384, 1)
    attention_backward_sm90_wide(const __grid_constant__ Sm90BackwardParams args) {
  static_assert(kHeadDim == 256, "two consumers of 128 head columns (d 192 as FlashAttention-3 takes 3)");
  constexpr int kBlockM = 64, kBlockN = 80, kQStages = 2;
  constexpr int kKeys = kBlockN / 2;        // a consumer's keys in S and dP
  constexpr int kHeadBlocks = kHeadDim / 128;  // a consumer's 64-column head blocks (dK^T, dV^T, dQ^T)
  using Shared = Sm90WideBackwardShared<kHeadDim, kBlockM, kBlockN, kQStages>;
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  const auto shared = Shared::of(dynamic_shared);
  const Params& p = args.p;
  // Under a causal mask or window, key block 0 (the longest) of every (KV head, sequence)
  // pair of a group first, then key block 1, ... (GridTile: _plan.backward_section).
  const auto grid_tile = GridTile<kLocal>::of_block(p.tile_group);
  const int n_block = grid_tile.tile, kv_head = grid_tile.head, batch = grid_tile.batch;
  const Sequence seq = Sequence::of(p, batch);
  const int n0 = n_block * kBlockN;
  if (n0 >= seq.seqlen_k) return;  // packed: the grid covers the longest sequence
  const int tma_batch = p.cu_seqlens_q ? 0 : batch;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = warp / 4;

  // The query blocks that see any key of the block, for each query head of the group.
  const auto mask = Mask<kLocal>::of(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  const int2 query_blocks = mask.template query_tiles<kBlockM>(n0, min(n0 + kBlockN, seq.seqlen_k), seq.seqlen_q);
  const int m_begin = query_blocks.x, m_blocks = query_blocks.y;
  const int steps = p.heads_per_kv * m_blocks;
  // A step's query head and first query row, counted along (no division in the producer's 24
  // registers): each query head's blocks in turn, first to last.
  const int m_first = m_begin * kBlockM, m_last = (m_begin + m_blocks - 1) * kBlockM;
  int head = kv_head * p.heads_per_kv, m0 = m_first;
  auto advance = [&] {
    if (m0 == m_last)
      m0 = m_first, ++head;
    else
      m0 += kBlockM;
  };

  set_up_shared(shared, 256);  // (_plan.Sm90WideBackward.shared_bytes)

  if (group == 0) {  // the producer
    sm90::set_max_registers<24, false>();
    if (warp == 0) {
      if (lane == 0) shared.load_kv(args, seq.k_start + n0, kv_head, tma_batch);
      for (int step = 0; step < steps; ++step, advance()) {
        const int stage = step % kQStages;
        const int64 at = seq.lse_offset(p, batch, head);
        // Q and the rows' LSE (in log2 units; rows past the sequence see no key: +inf, P = 0).
        // Each lane's arrival releases its own stores to the consumers' wait.
        shared.q_released(stage).wait(((step / kQStages) & 1) ^ 1);
#pragma unroll
        for (int r = 0; r < kBlockM / 32; ++r) {
          const int i = 32 * r + lane;
          shared.lse(stage)[i] = m0 + i < seq.seqlen_q ? p.lse[at + m0 + i] * kLog2e : kInf;
        }
        if (lane == 0)
          shared.load_rows(shared.q(stage), args.q, shared.q_landed(stage), seq.q_start + m0, head, tma_batch);
        else
          shared.q_landed(stage).arrive();
        // dO and the rows' D
        shared.do_released().wait((step & 1) ^ 1);
#pragma unroll
        for (int r = 0; r < kBlockM / 32; ++r) {
          const int i = 32 * r + lane;
          shared.delta()[i] = m0 + i < seq.seqlen_q ? p.delta[at + m0 + i] : 0.f;
        }
        if (lane == 0)
          shared.load_rows(shared.dout(), args.dout, shared.do_landed(), seq.q_start + m0, head, tma_batch);
        else
          shared.do_landed().arrive();
      }
    }
  } else {  // a consumer: keys 40c .. 40c + 39 of S and dP, head columns 128c .. 128c + 127 of the rest
    sm90::set_max_registers<240, true>();
    const int consumer = group - 1, key0 = kKeys * consumer, row16 = 16 * (warp % 4);
    const int g = lane >> 2;
    float acc_dk[kHeadBlocks][1][kBlockN / 8][4], acc_dv[kHeadBlocks][1][kBlockN / 8][4];
#pragma unroll
    for (int b = 0; b < kHeadBlocks; ++b)
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[b][0][nt][e] = acc_dv[b][0][nt][e] = 0.f;
    shared.kv_landed().wait(0);
    for (int step = 0; step < steps; ++step, advance()) {
      const int stage = step % kQStages, buffer = step & 1;
      // S = Q K^T;  dP = dO V^T
      float acc_s[1][kKeys / 8][4], acc_dp[1][kKeys / 8][4];
      shared.q_landed(stage).wait((step / kQStages) & 1);
      issue_scores<T, Shared, kKeys>(shared.q(stage), shared.k(), key0, acc_s);
      shared.do_landed().wait(step & 1);
      issue_scores<T, Shared, kKeys>(shared.dout(), shared.v(), key0, acc_dp);
      const float lse0 = shared.lse(stage)[row16 + g], lse1 = shared.lse(stage)[row16 + g + 8];
      const float delta0 = shared.delta()[row16 + g], delta1 = shared.delta()[row16 + g + 8];
      const bool masked = !mask.covers(m0, min(m0 + kBlockM, seq.seqlen_q), n0 + key0, n0 + key0 + kKeys);
      // P = exp(S - LSE), while dP is in flight -> shared memory
      sm90::wgmma_wait<1>();
      sm90::fence_operands(acc_s);
      probabilities<false, kLocal>(acc_s, p.scale_log2, masked, mask,
                                   [=](int, int e) { return e < 2 ? lse0 : lse1; }, m0 + row16, n0 + key0, lane);
      store_transposed<T>(shared.probs(buffer), acc_s, key0, warp, lane);
      fence_proxy_async();  // P's stores, before the products read them
      consumers_meet();
      // dV^T += dO^T P, running while dS is made
      sm90::wgmma_fence();
#pragma unroll
      for (int b = 0; b < kHeadBlocks; ++b)
        issue_key_gradient<T, Shared, kBlockN>(shared.dout(), kHeadBlocks * consumer + b, shared.probs(buffer),
                                               acc_dv[b]);
      sm90::wgmma_commit();
      // dS = P (dP - D) -> shared memory
      sm90::wgmma_wait<1>();
      sm90::fence_operands(acc_dp);
      score_gradients<false>(acc_s, acc_dp, [=](int, int e) { return e < 2 ? delta0 : delta1; }, lane);
      store_transposed<T>(shared.ds(buffer), acc_dp, key0, warp, lane);
      fence_proxy_async();
      consumers_meet();
      // dQ^T = K^T dS^T a head block at a time, each added to the accumulator while the tensor
      // cores go on with dK^T += Q^T dS
      float acc_dq[1][kBlockM / 8][4];
#pragma unroll
      for (int b = 0; b < kHeadBlocks; ++b) {
        const int column_block = kHeadBlocks * consumer + b;
        sm90::wgmma_fence();
        issue_query_gradient<T, Shared, kBlockN>(shared.k(), column_block, shared.ds(buffer), acc_dq);
        sm90::wgmma_commit();
        issue_key_gradient<T, Shared, kBlockN>(shared.q(stage), column_block, shared.ds(buffer), acc_dk[b]);
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();  // dQ^T's block (and dV^T before it) landed; dK^T's in flight
        sm90::fence_operands(acc_dq);
        if (b == 0) {
#pragma unroll
          for (int bv = 0; bv < kHeadBlocks; ++bv) sm90::fence_operands(acc_dv[bv]);
          shared.do_released().arrive();  // dO read (dP, dV^T)
        }
        add_dq_transposed(acc_dq, p, args.accum_cols, seq, head, m0, 64 * column_block + row16, lane);
      }
      sm90::wgmma_wait<0>();
#pragma unroll
      for (int b = 0; b < kHeadBlocks; ++b) sm90::fence_operands(acc_dk[b]);
      shared.q_released(stage).arrive();  // Q read (S, dK^T)
    }
    // dK (times the softmax scale) and dV -> shared memory over K and V ([key][head], the
    // tiles' own layout: 64-column blocks of 80 rows) once both consumers are done with them,
    // then this consumer's head blocks to global memory in 16-byte pieces.
    consumers_meet();
#pragma unroll
    for (int b = 0; b < kHeadBlocks; ++b) {
      const int column_block = kHeadBlocks * consumer + b;
      store_transposed<T>(shared.k() + column_block * Shared::kKvBlock, acc_dk[b], 0, warp, lane, p.scale);
      store_transposed<T>(shared.v() + column_block * Shared::kKvBlock, acc_dv[b], 0, warp, lane);
    }
    consumer_meets(consumer);
    const int tid = threadIdx.x % 128;
    elem_t* const dk = seq.rows(p.dk, batch, kv_head, false);
    elem_t* const dv = seq.rows(p.dv, batch, kv_head, false);
    constexpr int kChunks = kHeadBlocks * kBlockN * 8;  // 16-byte pieces of a tensor's head blocks
#pragma unroll 4
    for (int i = tid; i < 2 * kChunks; i += 128) {
      const bool is_v = i >= kChunks;
      const int j = i % kChunks, b = j / (kBlockN * 8), row = (j / 8) % kBlockN, chunk = j % 8;
      const int column_block = kHeadBlocks * consumer + b, col = 64 * column_block + 8 * chunk;
      if (n0 + row >= seq.seqlen_k || col >= p.headdim) continue;
      const unsigned char* from = (is_v ? shared.v() : shared.k()) + column_block * Shared::kKvBlock + row * 128 +
                                  ((chunk ^ (row & 7)) << 4);
      const ArrayView& a = is_v ? p.dv : p.dk;
      *reinterpret_cast<uint4*>((is_v ? dv : dk) + int64(n0 + row) * a.row_stride + col) =
          *reinterpret_cast<const uint4*>(from);
    }
  }
}

}  // namespace cuflash
