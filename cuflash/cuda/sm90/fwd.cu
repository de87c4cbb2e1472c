// Forward attention on Hopper (sm_90a): TMA loads and wgmma products.
//
// Head dims of 64, 128 and 256 (the planner rounds others up: the copy engine brings the
// columns past the array's as zeros, and the output stores only the array's own).
// Each CTA takes tiles (a block of kConsumers x 64 query rows of one head and sequence),
// or pieces of tiles cut along their keys, from the tile scheduler (Sm90Tiles,
// sm90/tile_scheduler.cuh) until none is left: a persistent grid. The producer
// warpgroup's first warp asks the copy engine for each tile's Q and for its key tiles' K
// and V, into a ring of kStages stages that runs on from tile to tile, and tells the
// consumers which tile's Q it loaded; consumer warpgroup c owns query rows 64c .. 64c + 63
// of the tile. Per key tile n (the last first, as the
// mma.sync forward):
//
//   S = Q K_n^T                    wgmma, Q and K from shared memory
//   S = mod(S);  S = mask(S)       score.cuh, mods.cuh, mask.cuh (the accumulator layout is
//                                  mma.sync's); with a block mask its empty key tiles are
//                                  never loaded
//   m, P, l, O rescaled            softmax.cuh
//   P = dropout(P)                 score.cuh
//   O += P V_n                     wgmma, P from registers, V read N-major
//
// then O / l and the LSE, finished in registers, go to global memory once the consumer has
// issued its next tile's first S, while the producer loads the next tile's Q (released at
// the tile's last S) and first keys. The pieces: the shared layout and its loads
// (Sm90Shared), the rows and key tiles of a tile (Sm90Block), the products (issue_scores,
// issue_values), the consumers' turns at the tensor cores (TurnTaking), the output
// (Sm90Output; a piece's: finish_piece, merge_pieces) and the entry that ties them together.
#include "common.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "partial.cuh"
#include "score.cuh"
#include "shared_memory.cuh"
#include "sm90/fwd_params.cuh"
#include "sm90/tile_scheduler.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "softmax.cuh"

namespace cuflash {

// The shared memory of Sm90SharedLayout (shared_memory.cuh), its loads and its barriers.
template <int kHeadDim, int kBlockM, int kBlockN, int kStages, int kKeyBitBytes = 0>
struct Sm90Shared : Sm90SharedLayout<kHeadDim, kBlockM, kBlockN, kStages, kKeyBitBytes> {
  using Layout = Sm90SharedLayout<kHeadDim, kBlockM, kBlockN, kStages, kKeyBitBytes>;
  using Layout::kApart, Layout::kBarriers, Layout::kColumnBlocks, Layout::kK, Layout::kKeyBits, Layout::kKvBlock,
      Layout::kKvTile, Layout::kQ, Layout::kQBlock, Layout::kSinks, Layout::kStageBarriers, Layout::kTile, Layout::kV;
  enum Operand { kKeys, kValues, kBoth };  // (kBoth: a stage's K and V under one pair)

  unsigned char* base;

  static __device__ __forceinline__ Sm90Shared of(unsigned char* dynamic) {
    return {{}, dynamic + ((1024 - (smem_addr(dynamic) & 1023)) & 1023)};
  }
  __device__ __forceinline__ unsigned char* q() const { return base + kQ; }
  __device__ __forceinline__ unsigned char* k(int stage) const { return base + kK + stage * kKvTile; }
  __device__ __forceinline__ unsigned char* v(int stage) const { return base + kV + stage * kKvTile; }
  __device__ __forceinline__ volatile int& tile() const { return *reinterpret_cast<int*>(base + kTile); }
  // A word of each warp's that its first lane writes and nobody reads (sm90::keep_before_wait).
  __device__ __forceinline__ volatile float& sink(int warp) const {
    return reinterpret_cast<float*>(base + kSinks)[warp];
  }
  // Round r's key tiles under a block mask (the slot of r's parity).
  __device__ __forceinline__ KeyTileBits key_bits(int round) const {
    return KeyTileBits::at(base + kKeyBits + (round & 1) * KeyTileBits::kBytes);
  }
  __device__ __forceinline__ sm90::Barrier barrier(int index) const {
    return {reinterpret_cast<unsigned long long*>(base + kBarriers) + index};
  }
  __device__ __forceinline__ sm90::Barrier q_landed() const { return barrier(0); }
  __device__ __forceinline__ sm90::Barrier q_released() const { return barrier(1); }
  // The barriers of a stage's K, V or both: V's own only where kApart.
  __device__ __forceinline__ sm90::Barrier landed(Operand x, int stage) const {
    return barrier(2 + (kApart && x == kValues ? kStages : 0) + stage);
  }
  __device__ __forceinline__ sm90::Barrier released(Operand x, int stage) const {
    return barrier(2 + kStageBarriers + (kApart && x == kValues ? kStages : 0) + stage);
  }
  // Every barrier lands once (the one thread that loads) and is released by every consumer
  // thread.
  __device__ __forceinline__ void init_barriers(int consumer_threads) const {
    q_landed().init(1), q_released().init(consumer_threads);
    for (int i = 0; i < kStageBarriers; ++i)
      barrier(2 + i).init(1), barrier(2 + kStageBarriers + i).init(consumer_threads);
    sm90::Barrier::fence_init();
  }

  // The loads, each by one thread: Q's rows from `row`, and key tile n's K, V or both
  // (rows from `row`) into a stage. (A packed sequence's box may reach into the next one's
  // rows: they are masked, and never written.)
  template <typename Args>
  __device__ __forceinline__ void load_q(const Args& args, int row, int head, int batch) const {
    q_landed().arrive_expecting(kBlockM * kHeadDim * 2);
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c)
      sm90::tma_load(q() + c * kQBlock, args.q, q_landed(), 64 * c, row, head, batch);
  }
  template <typename Args>
  __device__ __forceinline__ void load(Operand x, const Args& args, int row, int stage, int kv_head,
                                       int batch) const {
    const sm90::Barrier landing = landed(x, stage);
    landing.arrive_expecting((x == kBoth ? 2 : 1) * kKvTile);
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) {
      if (x != kValues) sm90::tma_load(k(stage) + c * kKvBlock, args.k, landing, 64 * c, row, kv_head, batch);
      if (x != kKeys) sm90::tma_load(v(stage) + c * kKvBlock, args.v, landing, 64 * c, row, kv_head, batch);
    }
  }
};

// The rows a tile computes, the key tiles they see and what is done to their scores.
template <int kBlockM, int kBlockN, bool kLocal, bool kExtras>
struct Sm90Block {
  Sequence seq;
  Mask<kLocal> mask;
  ScoreMod mod;
  Dropout dropout;
  bool dropping;
  float scale_log2;  // modified scores are already scaled: then exp2 only converts to base 2
  int m0, row_end, n_begin, n_end, head, kv_head, batch;
  int tma_batch;     // the batch coordinate of the maps: 0 for packed arrays

  static __device__ __forceinline__ Sm90Block of(const Params& p, int m_block, int head, int batch) {
    Sm90Block b;
    b.head = head, b.batch = batch, b.kv_head = head / p.heads_per_kv;
    b.tma_batch = p.cu_seqlens_q ? 0 : b.batch;
    b.seq = Sequence::of(p, b.batch);
    b.mask = Mask<kLocal>::of(b.seq.seqlen_q, b.seq.seqlen_k, p.window_left, p.window_right);
    b.m0 = m_block * kBlockM;
    b.row_end = min(b.m0 + kBlockM, b.seq.seqlen_q);
    b.n_begin = b.mask.key_begin(b.m0) / kBlockN;
    b.n_end = ceil_div(b.mask.key_end(b.row_end), kBlockN);
    b.mod = ScoreMod{};
    b.dropout = Dropout{};
    score_extras<kExtras>(p, b.mask, b.batch, b.head, b.mod, b.dropout);
    b.dropping = kExtras && p.dropout_threshold > 0;
    b.scale_log2 = kExtras ? kLog2e : p.scale_log2;
    return b;
  }
  __device__ __forceinline__ int q_row() const { return seq.q_start + m0; }
  __device__ __forceinline__ int k_row(int n) const { return seq.k_start + n * kBlockN; }
};

// The products of a consumer warpgroup, issued and committed as one group each; they run
// until wgmma_wait. S = Q K^T: its 64 query rows against the stage's keys, the head dim in
// k16 steps, four to a 64-column block (32 bytes each).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, int kKeyBitBytes>
__device__ __forceinline__ void issue_scores(
    const Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages, kKeyBitBytes>& shared, int stage, int consumer,
    float (&acc_s)[1][kBlockN / 8][4]) {
  using Shared = Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages, kKeyBitBytes>;
  const unsigned char* q_rows = shared.q() + consumer * 64 * 128;
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kHeadDim / 16; ++k)
    sm90::Wgmma<T, kBlockN>::ss(acc_s, sm90::SmemDesc::k_major(q_rows + (k / 4) * Shared::kQBlock + (k % 4) * 32),
                                sm90::SmemDesc::k_major(shared.k(stage) + (k / 4) * Shared::kKvBlock + (k % 4) * 32),
                                k > 0);
  sm90::wgmma_commit();
}

// O += P V: P from registers, the stage's keys in k16 steps of 16 rows of V (2048 bytes);
// a head dim over 128 as two products, of 128 columns (two 64-column blocks) and the rest.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, int kKeyBitBytes>
__device__ __forceinline__ void issue_values(
    const Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages, kKeyBitBytes>& shared, int stage,
    const unsigned (&p)[kBlockN / 16][4], float (&acc_o)[1][kHeadDim / 8][4]) {
  using Shared = Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages, kKeyBitBytes>;
  constexpr int kN = kHeadDim > 128 ? 128 : kHeadDim;
  using Product = sm90::Wgmma<T, kN>;
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kBlockN / 16; ++k) {
    const unsigned char* v_rows = shared.v(stage) + k * 16 * 128;
    Product::template rs_bt<0>(acc_o, p[k], sm90::SmemDesc::n_major(v_rows, Shared::kKvBlock));
    if constexpr (kHeadDim > 128)
      sm90::Wgmma<T, kHeadDim - 128>::template rs_bt<16>(
          acc_o, p[k], sm90::SmemDesc::n_major(v_rows + 2 * Shared::kKvBlock, Shared::kKvBlock));
  }
  sm90::wgmma_commit();
}

// The consumers take turns at the tensor cores (HOPPER.md's ping-pong), in a ring: a
// consumer issues its products between wait_turn and pass_turn, so that one's softmax runs
// while the others' products do. Consumer c waits on named barrier 1 + c and passes to
// consumer c + 1 (the last to consumer 0); each barrier counts the 128 threads that wait
// and the 128 of the consumer before it that arrive.
template <int kConsumers>
struct TurnTaking {
  int consumer;
  __device__ __forceinline__ bool last() const { return consumer == kConsumers - 1; }
  __device__ __forceinline__ void wait_turn() const {
    asm volatile("bar.sync %0, 256;\n" ::"r"(1 + consumer) : "memory");
  }
  __device__ __forceinline__ void pass_turn() const {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (consumer + 1) % kConsumers) : "memory");
  }
};

// A tile's output in a consumer thread's registers: O / l (and / (1 - p) under dropout)
// and the LSE of its rows g and g + 8, finished at the tile's end (finish_output) and
// written to global memory once the next tile's first S is issued (write_output), so that
// the stores run beside that product (kDeferOutput; at d 256 at once).
struct Sm90Output {
  elem_t* o;      // row g's first element of this thread's columns
  float* lse;     // row g's LSE (null: not asked for)
  bool rows[2];   // rows g and g + 8 inside the sequence (false, false: nothing to write)
  float row_lse[1][2];
};

template <typename T, int kDTiles, int kBlockM, int kBlockN, bool kLocal, bool kExtras>
__device__ __forceinline__ Sm90Output finish_output(const Params& p,
                                                    const Sm90Block<kBlockM, kBlockN, kLocal, kExtras>& block,
                                                    int warp_row0, int lane, OnlineSoftmax<1, true>& softmax,
                                                    float (&acc_o)[1][kDTiles][4]) {
  const Sequence& seq = block.seq;
  const int row = block.m0 + warp_row0 + (lane >> 2);
  Sm90Output out;
  softmax.finalize(acc_o, out.row_lse, block.scale_log2, block.dropping ? p.dropout_scale : 1.f);
  out.o = seq.rows(p.o, block.batch, block.head, true) + int64(row) * p.o.row_stride + 2 * (lane & 3);
  out.lse = p.lse != nullptr ? p.lse + seq.lse_offset(p, block.batch, block.head) + row : nullptr;
  out.rows[0] = row < seq.seqlen_q, out.rows[1] = row + 8 < seq.seqlen_q;
  return out;
}

// Columns 8 dt0 .. 8 (dt0 + kTiles) - 1 of the rows g and g + 8 inside the sequence, from
// acc[dt][2h], acc[dt][2h + 1] (row g + 8h) times scale[h]; each row's LSE where dt0 is 0.
template <typename T, int kTiles>
__device__ __forceinline__ void write_columns(const Params& p, const Sm90Output& out, int lane, int dt0,
                                              const float (&acc)[kTiles][4], const float (&scale)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!out.rows[h]) continue;
    if (dt0 == 0 && (lane & 3) == 0 && out.lse != nullptr) out.lse[8 * h] = out.row_lse[0][h];
    elem_t* o = out.o + int64(8 * h) * p.o.row_stride + dt0 * 8;
#pragma unroll
    for (int dt = 0; dt < kTiles; ++dt)  // (a head dim the kernel's rounds up to: its columns only)
      if ((dt0 + dt) * 8 < p.headdim)
        *reinterpret_cast<unsigned*>(o + dt * 8) =
            DType<T>::pack(acc[dt][2 * h] * scale[h], acc[dt][2 * h + 1] * scale[h]);
  }
}

template <typename T, int kDTiles>
__device__ __forceinline__ void write_output(const Params& p, const Sm90Output& out, int lane,
                                             const float (&acc_o)[1][kDTiles][4]) {
  write_columns<T>(p, out, lane, 0, acc_o[0], {1.f, 1.f});
}

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// The last piece of a tail tile to arrive: every piece's O and LSE (this warp's rows) read
// back in their order, whichever warp merges, its own too (bitwise reproducible), from L2,
// merged (partial.cuh) and written as the tile's rows (`out`, its LSE replaced), kChunk n8
// tiles at a time, a piece's loads of a chunk in flight at once. A function of its own: the
// consumers' loop keeps its registers (inlined, it spilled at d 64 with softcap, ALiBi or
// dropout).
template <typename T, int kWarps, int kDTiles, typename Args>
__device__ __noinline__ void merge_pieces(const Args& args, Sm90Work work, Sm90Output out, int warp, int lane) {
  constexpr int kChunk = kDTiles < 8 ? kDTiles : 8;
  constexpr int64 kSlotO = int64(kWarps) * kDTiles * 32;  // float4s a slot
  constexpr int kSlotLse = kWarps * 16;                   // rows a slot
  const float4* parts = reinterpret_cast<const float4*>(args.partial_o) + warp * kDTiles * 32 + lane;
  const float* lses = args.partial_lse + warp * 16 + lane / 4;  // row g (+ 8)
  PartialMerge merge[2];
  for (int k = 0; k < work.pieces; ++k)
#pragma unroll
    for (int h = 0; h < 2; ++h) merge[h].see(__ldcg(lses + (work.first_slot + k) * kSlotLse + 8 * h));
  for (int k = 0; k < work.pieces; ++k)
#pragma unroll
    for (int h = 0; h < 2; ++h) merge[h].weigh(__ldcg(lses + (work.first_slot + k) * kSlotLse + 8 * h));
  const float scale[2] = {merge[0].out_scale(), merge[1].out_scale()};
  out.row_lse[0][0] = merge[0].lse(), out.row_lse[0][1] = merge[1].lse();
#pragma unroll
  for (int c = 0; c < kDTiles; c += kChunk) {
    float acc[kChunk][4] = {};
    for (int k = 0; k < work.pieces; ++k) {
      const int slot = work.first_slot + k;
      const float w0 = merge[0].weight(__ldcg(lses + slot * kSlotLse));
      const float w1 = merge[1].weight(__ldcg(lses + slot * kSlotLse + 8));
      const float4* part = parts + slot * kSlotO + c * 32;
#pragma unroll
      for (int dt = 0; dt < kChunk; ++dt) {  // (an empty part's weight 0 selects it away, whatever it holds)
        const float4 x = __ldcg(part + dt * 32);
        acc[dt][0] += PartialMerge::weighted(w0, x.x), acc[dt][1] += PartialMerge::weighted(w0, x.y);
        acc[dt][2] += PartialMerge::weighted(w1, x.z), acc[dt][3] += PartialMerge::weighted(w1, x.w);
      }
    }
    write_columns<T>(args.p, out, lane, c, acc, scale);
  }
}

// A piece's end (a tail tile cut along its keys: sm90/tile_scheduler.cuh): each consumer
// warp stores its O (normalised over the piece's keys) and LSE into the piece's slot, and
// the warp whose piece arrives last at its tile merges every piece's (partial.cuh) and
// writes the tile's rows (merge_pieces). A slot holds a float4 of O a lane and n8 tile, and
// one LSE a row. The warp's stores are ordered before the tile's counter moves, and the
// counter before the merging warp's loads, by fences at the GPU's scope around the atomic
// (the PTX memory model's release and acquire patterns; __syncwarp carries the other lanes'
// stores and loads to and from lane 0's). O's registers are zeroed once stored: free (and
// nothing to save) for the merge.
template <typename T, int kWarps, int kDTiles, typename Args>
__device__ __forceinline__ void finish_piece(const Args& args, const Sm90Work& work, const Sm90Output& out,
                                             int warp, int lane, float (&acc_o)[1][kDTiles][4]) {
  constexpr int kSlotLse = kWarps * 16;  // rows a slot
  float4* mine = reinterpret_cast<float4*>(args.partial_o) + (int64(work.slot) * kWarps + warp) * kDTiles * 32 + lane;
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
    mine[dt * 32] = make_float4(acc_o[0][dt][0], acc_o[0][dt][1], acc_o[0][dt][2], acc_o[0][dt][3]);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
  }
  float* lse = args.partial_lse + work.slot * kSlotLse + warp * 16 + lane / 4;  // row g (+ 8)
  if (lane % 4 == 0) lse[0] = out.row_lse[0][0], lse[8] = out.row_lse[0][1];
  __syncwarp();
  int arrived = 0;
  if (lane == 0) {
    fence_acq_rel_gpu();  // release: the warp's stores (before it by __syncwarp) before the count
    arrived = atomicAdd(args.arrivals + work.tail_tile * kWarps + warp, 1);
    fence_acq_rel_gpu();  // acquire: the other pieces' stores before this warp's loads
  }
  if (__shfl_sync(0xffffffffu, arrived, 0) == work.pieces - 1) {
    __syncwarp();
    merge_pieces<T, kWarps, kDTiles>(args, work, out, warp, lane);
  }
}

// Warpgroup 0 produces, warpgroups 1 .. kConsumers compute. The producer keeps 24 registers
// a thread and gives the rest to the consumers (setmaxnreg, in multiples of 8: 128 x 24 +
// 256 x 240, or with three consumers 128 x 24 + 384 x 160, fits the 65,536 of a
// multiprocessor). Its first warp runs the tile loop, lane 0 asking for the loads: values
// the whole warp computes alike go to the uniform datapath's registers (one thread alone
// spilled its 24 once it also took tiles from the counter). A stage's K (and its V) is
// "landed" when its bytes have arrived and "released" when every consumer thread is done
// with it; the producer waits for the release before it refills it (a fresh barrier counts
// as released: its waits start on the other parity). The ring's stages and their phases
// count key tiles across the CTA's tiles (`loaded`, `used`); Q is landed and released once
// a tile, the tile's number written beside it (Sm90Shared::tile; -1: none left).
//
// A consumer's turn j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, then turns
// S_j into P_j while the second product runs (HOPPER.md's intra-warpgroup overlap): O is
// scaled by the softmax's factors only once that product has landed. With two stages
// (all that fits beside Q: d 128's 176-key tiles, d 256) the producer loads K_j before
// V_{j-1}, FlashAttention-3's order, and K_j is released at S_j, a turn before V_j: with K
// and V released together the copy engine could refill neither before P_j V_j, and ran
// behind the consumers (H200, bf16, d 256: 1.15-1.64x not causal, 1.04-1.36x causal).
// @tparam kConsumers  warpgroups, 64 query rows each: 2 or 3
// @tparam kStages     K/V tiles in flight
// @tparam kLocal      causal or sliding window
// @tparam kExtras     softcap, ALiBi, dropout or score_mod may be on (mask_mod alone: either)
// @tparam Mods        score_mod / mask_mod (mods.cuh); with a block mask the key tiles of its
//                     empty blocks are left out (the producer's and the consumers' walks
//                     alike, over the bits the producer fills: KeyTileBits) and mask_mod is
//                     skipped in its full ones
template <typename T, int kHeadDim, int kBlockN, int kConsumers, int kStages, bool kLocal, bool kExtras,
          typename Mods = NoMods>
__global__ void __launch_bounds__((kConsumers + 1) * 128, 1)
    attention_forward_sm90(const __grid_constant__ Sm90ParamsOf<kHasMods<Mods>> args) {
  static_assert((kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256) &&
                    (kBlockN == 64 || kBlockN == 80 || kBlockN == 128 || kBlockN == 176),
                "the products: m64n64, m64n80, m64n128, m64n176 (S); m64n64, m64n128 (O; two over d 128)");
  static_assert(kConsumers == 2 || kConsumers == 3, "turn taking among two or three consumers");
  static_assert(kExtras || !Mods::kScore, "score_mod takes the scores in natural units: the extras' instances");
  constexpr int kBlockM = 64 * kConsumers;
  constexpr bool kSparse = kBlockSparse<Mods>;
  // A tile's output written under the next tile's first S; at d 256 O's 128 registers a
  // thread, kept that long, spill, and so do the extras' with mods: written at once.
  constexpr bool kDeferOutput = kHeadDim < 256 && !(kHasMods<Mods> && kExtras);
  // The softmax kept ahead of P V's wait (sm90::keep_before_wait), but at d 256 under a
  // mask: there its registers beside O's 128 spill.
  constexpr bool kOverlapSoftmax = kHeadDim < 256 || !kLocal;
  constexpr int kProducerRegisters = 24, kConsumerRegisters = kConsumers == 2 ? 240 : 160;
  using Block = Sm90Block<kBlockM, kBlockN, kLocal, kExtras>;
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  using Shared = Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages, kSparse ? 2 * KeyTileBits::kBytes : 0>;
  static_assert((kConsumers + 1) * 4 <= Shared::kMaxWarps, "a sink word a warp");
  const auto shared = Shared::of(dynamic_shared);
  const ParamsOf<Mods>& p = args.p;
  const auto schedule = Sm90Tiles<kBlockM, kLocal || kSparse>::of(args);  // (a block mask's tiles differ too)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = warp / 4;
  // Work t's rows and key tiles (a piece's share of its tile's); false where they are past
  // its sequence (packed arrays: the tiles cover the longest).
  auto tile = [&](const Sm90Work& work, Block& block) {
    int m_block, head, batch;
    schedule.at(work.tile, m_block, head, batch);
    block = Block::of(p, m_block, head, batch);
    const int n_end = block.n_end;
    block.n_end = n_end - work.first_turn, block.n_begin = max(block.n_begin, n_end - work.last_turn);
    return block.m0 < block.seq.seqlen_q;
  };

  if (threadIdx.x == 0) shared.init_barriers(kConsumers * 128);
  __syncthreads();

  if (group == 0) {  // the producer
    sm90::set_max_registers<kProducerRegisters, false>();
    if (warp == 0) {  // (its values uniform: in the uniform datapath's registers)
      const bool leader = lane == 0;  // asks for the loads and announces their bytes
      int loaded = 0, round = 0;  // key tiles and tiles so far
      for (int t = schedule.first(args); t < schedule.end(args); t = schedule.next(t, args, lane)) {
        Block block;
        if (!tile(schedule.work(t, args), block)) continue;
        // With a block mask the round's key tiles as bits, in the slot of the round before
        // last (the consumers read it before releasing that round's Q, awaited last round).
        const KeyTileBits bits = shared.key_bits(round);
        if constexpr (kSparse) {
          // (a block mask comes without the tail's cut: a tile is whole)
          bits.fill(KeyTiles<Mods, kBlockN, kBlockM>::of(p, block.batch, block.head, block.m0, block.row_end - 1),
                    block.n_begin, block.n_end, lane);
          __syncwarp();
        }
        shared.q_released().wait((round++ & 1) ^ 1);
        if (leader) shared.tile() = t, shared.load_q(args, block.q_row(), block.head, block.tma_batch);
        // Key tile n (key tiles go from n_end - 1 down) into stage `loaded`: its K and V,
        // or, kApart, its K then the tile before it's V (the last V after the loop).
        auto load = [&](typename Shared::Operand x, int n, int i) {
          shared.released(x, i % kStages).wait(((i / kStages) & 1) ^ 1);
          if (leader) shared.load(x, args, block.k_row(n), i % kStages, block.kv_head, block.tma_batch);
        };
        if constexpr (kSparse) {
          int before = -1;  // the tile loaded before n
          for (int n = bits.before(block.n_end, block.n_begin); n >= block.n_begin;
               before = n, n = bits.before(n, block.n_begin), ++loaded) {
            if constexpr (Shared::kApart) {
              load(Shared::kKeys, n, loaded);
              if (before >= 0) load(Shared::kValues, before, loaded - 1);
            } else {
              load(Shared::kBoth, n, loaded);
            }
          }
          if (Shared::kApart && before >= 0) load(Shared::kValues, before, loaded - 1);
        } else {
          for (int n = block.n_end - 1; n >= block.n_begin; --n, ++loaded) {
            if constexpr (Shared::kApart) {
              load(Shared::kKeys, n, loaded);
              if (n < block.n_end - 1) load(Shared::kValues, n + 1, loaded - 1);
            } else {
              load(Shared::kBoth, n, loaded);
            }
          }
          if (Shared::kApart && block.n_end > block.n_begin) load(Shared::kValues, block.n_begin, loaded - 1);
        }
      }
      shared.q_released().wait((round & 1) ^ 1);  // none left: a Q "landed" with no tile
      if (leader) shared.tile() = -1, shared.q_landed().arrive();
    }
  } else {  // a consumer
    sm90::set_max_registers<kConsumerRegisters, true>();
    const int consumer = group - 1, warp_row0 = 64 * consumer + 16 * (warp % 4);
    const TurnTaking<kConsumers> turns{consumer};
    float acc_o[1][kHeadDim / 8][4];
    float acc_s[1][kBlockN / 8][4];
    unsigned p_frag[kBlockN / 16][4];
    float alpha[1][2];
    int used = 0;  // key tiles so far
    Sm90Output pending{nullptr, nullptr, {false, false}, {{0.f, 0.f}}};  // the last tile's, not yet written
    if (turns.last()) turns.pass_turn();  // (consumer 0's first turn)
    for (int round = 0;; ++round) {  // the tiles the producer loads, in its order
      shared.q_landed().wait(round & 1);
      const int t = shared.tile();
      if (t < 0) {
        write_output<T>(p, pending, lane, acc_o);
        if (consumer == 0) turns.wait_turn();  // (the last consumer's last pass)
        break;
      }
      Block block;
      tile(schedule.work(t, args), block);
      // key tiles n_end - 1 down to n_begin (with a block mask those not empty, from the
      // producer's bits: n, the one the turn at hand takes, and whether its block is full,
      // read before the tile's last S releases Q and with it the bits' slot)
      const KeyTileBits bits = shared.key_bits(round);
      int tiles = max(0, block.n_end - block.n_begin), n = block.n_end - 1;
      bool whole = false;
      if constexpr (kSparse) {
        tiles = *bits.count;
        n = bits.before(block.n_end, block.n_begin);
        whole = tiles > 0 && bits.full(n);
      }
      const int row0 = block.m0 + warp_row0;
      OnlineSoftmax<1, true> softmax;
      softmax.init();
      // The last tile's output written (beside this tile's first S), then O = 0.
      auto write_pending = [&]() {
        write_output<T>(p, pending, lane, acc_o);
#pragma unroll
        for (int dt = 0; dt < kHeadDim / 8; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
      };
      auto stage_of = [&](int j) { return (used + j) % kStages; };
      auto phase_of = [&](int j) { return ((used + j) / kStages) & 1; };
      // S_j -> P_j: S = mod(S) (softcap, ALiBi); S = -inf where hidden; m and l moved,
      // P = exp(S - m); then, once O += P_{j-1} V_{j-1} has landed (its stage released),
      // O scaled and P = dropout(P). After the tile's last S, Q is released.
      auto softmax_step = [&](int j, bool values_in_flight) {
        const int n0 = (kSparse ? n : block.n_end - 1 - j) * kBlockN;
        if (values_in_flight) sm90::wgmma_wait<1>(); else sm90::wgmma_wait<0>();
        sm90::fence_operands(acc_s);
        if constexpr (Shared::kApart) shared.released(Shared::kKeys, stage_of(j)).arrive();
        if (j == tiles - 1) shared.q_released().arrive();
        if constexpr (kExtras) block.mod.template apply<false>(acc_s, row0, n0, lane);  // (per tile: d 64 spills)
        if constexpr (kHasMods<Mods>)  // score_mod, -inf where mask_mod hides (not in a block mask's full blocks)
          ModsAt<Mods>::of(p, block.batch, block.head)
              .in_block(kSparse && whole)
              .apply(acc_s, row0, n0, lane);
        if (!block.mask.covers(block.m0, block.row_end, n0, n0 + kBlockN)) block.mask.apply(acc_s, row0, n0, lane);
        const bool moves = softmax.update_scores(acc_s, block.scale_log2, alpha);
        if (values_in_flight) {
          if constexpr (kOverlapSoftmax)
            sm90::keep_before_wait(shared.sink(warp), lane == 0, softmax.row_sum[0][0] + softmax.row_sum[0][1]);
          sm90::wgmma_wait<0>();
          sm90::fence_operands(acc_o);
          shared.released(Shared::kValues, stage_of(j - 1)).arrive();
        }
        if (moves) softmax.scale_output(acc_o, alpha);
        if (kExtras && block.dropping) block.dropout.apply(acc_s, row0, n0, lane);
        sm90::as_a_operand<T>(acc_s, p_frag);
      };
      // Turns 0 .. tiles of every consumer, round the ring from consumer 0, and on from tile
      // to tile: consumer 0's first turn of a tile follows the last consumer's last turn of
      // the one before (passed before that turn's product lands), so that the next tile's
      // first S runs beside the last P V, the softmax's end and the stores. Each consumer
      // takes tiles + 1 turns a tile (its key tiles, the same for all); the last consumer
      // passes once more before its first, which consumer 0 waits for once more after its
      // last. No barrier is arrived at twice before its wait: a consumer's next pass
      // follows its next turn, which the ring reaches only through the turn it passed.
      // (The products stay out of branches: ptxas serialises wgmma in a path it cannot
      // prove warp-uniform.)
      if (tiles > 0) {
        shared.landed(Shared::kKeys, stage_of(0)).wait(phase_of(0));
        turns.wait_turn();
        issue_scores<T>(shared, stage_of(0), consumer, acc_s);
        turns.pass_turn();
        write_pending();
        softmax_step(0, false);
        for (int j = 1; j < tiles; ++j) {
          if constexpr (kSparse) n = bits.before(n, block.n_begin), whole = bits.full(n);
          shared.landed(Shared::kKeys, stage_of(j)).wait(phase_of(j));
          if constexpr (Shared::kApart) shared.landed(Shared::kValues, stage_of(j - 1)).wait(phase_of(j - 1));
          turns.wait_turn();
          issue_scores<T>(shared, stage_of(j), consumer, acc_s);
          issue_values<T>(shared, stage_of(j - 1), p_frag, acc_o);
          turns.pass_turn();
          softmax_step(j, true);
        }
        if constexpr (Shared::kApart) shared.landed(Shared::kValues, stage_of(tiles - 1)).wait(phase_of(tiles - 1));
        turns.wait_turn();
        issue_values<T>(shared, stage_of(tiles - 1), p_frag, acc_o);
        turns.pass_turn();
        sm90::wgmma_wait<0>();
        sm90::fence_operands(acc_o);
        shared.released(Shared::kValues, stage_of(tiles - 1)).arrive();
      } else {
        shared.q_released().arrive();  // (rows that see no key: O = 0, LSE = +inf)
        write_pending();
      }
      used += tiles;
      pending = finish_output<T>(p, block, warp_row0, lane, softmax, acc_o);
      const int number = kLocal ? 0 : schedule.number(block.m0 / kBlockM, block.head, block.batch);
      if (!kLocal && number >= args.tail_start) {  // a piece of a tile: stored, and merged by the last
        const Sm90Work work = schedule.piece_of(number, args);
        if (work.pieces > 1) {
          finish_piece<T, 4 * kConsumers>(args, work, pending, warp - 4, lane, acc_o);
          pending.rows[0] = pending.rows[1] = false;  // (written, or another piece writes the tile)
        }
      }
      if constexpr (!kDeferOutput) {
        write_output<T>(p, pending, lane, acc_o);
        pending.rows[0] = pending.rows[1] = false;
      }
    }
  }
}

}  // namespace cuflash
