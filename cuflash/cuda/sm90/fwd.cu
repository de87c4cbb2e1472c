// Forward attention on Hopper (sm_90a): TMA loads and wgmma products.
//
// One CTA per (block of kConsumers x 64 query rows, head, batch); consumer warpgroup c owns
// query rows 64c .. 64c + 63 of the block. The copy engine brings Q once and each key
// tile's K and V into a ring of kStages stages, each with a barrier that completes when
// its bytes have landed. Per key tile n (the last first, as the mma.sync forward):
//
//   S = Q K_n^T                    wgmma, Q and K from shared memory
//   S = mod(S);  S = mask(S)       score.cuh, mask.cuh (the accumulator layout is mma.sync's)
//   m, P, l, O rescaled            softmax.cuh
//   P = dropout(P)                 score.cuh
//   O += P V_n                     wgmma, P from registers, V read N-major
//
// then O / l and the LSE go straight from registers to global memory. Two entries (HOPPER.md's
// milestones a and b): attention_forward_sm90, where every warpgroup computes and one thread
// also issues the loads, a stage refilled once the CTA has passed a barrier; and
// attention_forward_sm90_ws, where a producer warpgroup (its registers given up through
// setmaxnreg) issues them and the consumers release each stage through a second barrier.
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "score.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "softmax.cuh"

namespace cuflash {

// The forward's arguments and the tensor maps of Q, K and V, each 4-D (headdim, seqlen,
// heads, batch) with a box of 64 columns (128 bytes, the swizzle's width) and kBlockM or
// kBlockN rows (cuflash/_tensormap.py); packed (varlen) arrays are one batch of all rows.
struct Sm90Params {
  Params p;
  sm90::TensorMap q, k, v;
};

// Shared memory, byte offsets from a 1024-byte aligned start (the swizzle's atoms): Q,
// kStages K tiles, kStages V tiles, then the barriers: Q's, kStages "landed", kStages
// "released". A tile of R rows is kHeadDim / 64 blocks of R x 128 bytes, one after the
// other. Dynamic shared memory is promised less alignment: the launch asks for 1024 bytes
// more (_sm90.shared_bytes).
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct Sm90Shared {
  static constexpr int kColumnBlocks = kHeadDim / 64;
  static constexpr int kQBlock = kBlockM * 128, kKvBlock = kBlockN * 128;  // bytes of a 64-column block
  static constexpr int kKvTile = kBlockN * kHeadDim * 2;
  static constexpr int kQ = 0, kK = kQ + kBlockM * kHeadDim * 2, kV = kK + kStages * kKvTile;
  static constexpr int kBarriers = kV + kStages * kKvTile;
  static constexpr int kBytes = kBarriers + (2 * kStages + 1) * 8 + 1024;

  unsigned char* base;

  static __device__ __forceinline__ Sm90Shared of(unsigned char* dynamic) {
    return {dynamic + ((1024 - (sm90::shared_address(dynamic) & 1023)) & 1023)};
  }
  __device__ __forceinline__ unsigned char* q() const { return base + kQ; }
  __device__ __forceinline__ unsigned char* k(int stage) const { return base + kK + stage * kKvTile; }
  __device__ __forceinline__ unsigned char* v(int stage) const { return base + kV + stage * kKvTile; }
  __device__ __forceinline__ sm90::Barrier q_landed() const {
    return {reinterpret_cast<unsigned long long*>(base + kBarriers)};
  }
  __device__ __forceinline__ sm90::Barrier landed(int stage) const {
    return {reinterpret_cast<unsigned long long*>(base + kBarriers) + 1 + stage};
  }
  __device__ __forceinline__ sm90::Barrier released(int stage) const {
    return {reinterpret_cast<unsigned long long*>(base + kBarriers) + 1 + kStages + stage};
  }

  // The loads, each by one thread: Q's rows from `row`, and key tile n's K and V (rows
  // from `row`) into a stage. (A packed sequence's box may reach into the next one's
  // rows: they are masked, and never written.)
  __device__ __forceinline__ void load_q(const Sm90Params& args, int row, int head, int batch) const {
    q_landed().arrive_expecting(kBlockM * kHeadDim * 2);
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) sm90::tma_load(q() + c * kQBlock, args.q, q_landed(), 64 * c, row, head, batch);
  }
  __device__ __forceinline__ void load_kv(const Sm90Params& args, int row, int stage, int kv_head, int batch) const {
    landed(stage).arrive_expecting(2 * kKvTile);
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) {
      sm90::tma_load(k(stage) + c * kKvBlock, args.k, landed(stage), 64 * c, row, kv_head, batch);
      sm90::tma_load(v(stage) + c * kKvBlock, args.v, landed(stage), 64 * c, row, kv_head, batch);
    }
  }
};

// The rows a CTA computes, the key tiles they see and what is done to their scores.
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

  static __device__ __forceinline__ Sm90Block of(const Params& p) {
    Sm90Block b;
    const int m_block = gridDim.x - 1 - blockIdx.x;
    b.head = blockIdx.y, b.batch = blockIdx.z, b.kv_head = b.head / p.heads_per_kv;
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

// P (the S accumulator, fp32) -> the A fragments of O += P V, k16 step by step: columns
// 16j .. 16j + 15 are the accumulator's n8 tiles 2j and 2j + 1.
template <typename T, int kNTiles>
__device__ __forceinline__ void pack_p(const float (&s)[1][kNTiles][4], unsigned (&a)[kNTiles / 2][4]) {
#pragma unroll
  for (int j = 0; j < kNTiles / 2; ++j) {
    a[j][0] = DType<T>::pack(s[0][2 * j][0], s[0][2 * j][1]);
    a[j][1] = DType<T>::pack(s[0][2 * j][2], s[0][2 * j][3]);
    a[j][2] = DType<T>::pack(s[0][2 * j + 1][0], s[0][2 * j + 1][1]);
    a[j][3] = DType<T>::pack(s[0][2 * j + 1][2], s[0][2 * j + 1][3]);
  }
}

// One consumer warpgroup's work on key tile n, whose K and V have landed: its 64 rows of
// S = Q K_n^T, the score modifiers and the mask, the online softmax, dropout and
// O += P V_n. warp_row0: the row of the block where this warp's 16 rows start.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kStages, bool kLocal, bool kExtras>
__device__ __forceinline__ void consume_tile(const Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages>& shared,
                                             const Sm90Block<kBlockM, kBlockN, kLocal, kExtras>& block, int n,
                                             int stage, int consumer, int warp_row0, int lane,
                                             OnlineSoftmax<1, true>& softmax, float (&acc_o)[1][kHeadDim / 8][4]) {
  using Shared = Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages>;
  constexpr int kNTiles = kBlockN / 8;
  // S = Q K_n^T: the head dim in k16 steps, four to a 64-column block (32 bytes each)
  float acc_s[1][kNTiles][4];
  const unsigned char* q_rows = shared.q() + consumer * 64 * 128;
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kHeadDim / 16; ++k)
    sm90::wgmma_ss<T>(acc_s, sm90::SmemDesc::k_major(q_rows + (k / 4) * Shared::kQBlock + (k % 4) * 32),
                      sm90::SmemDesc::k_major(shared.k(stage) + (k / 4) * Shared::kKvBlock + (k % 4) * 32), k > 0);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_operands(acc_s);

  // S = mod(S): softcap, ALiBi;  S = -inf where hidden;  m, P, l, O rescaled;  P = dropout(P)
  const int n0 = n * kBlockN, row0 = block.m0 + warp_row0;
  if constexpr (kExtras) block.mod.apply(acc_s, row0, n0, lane);
  if (!block.mask.covers(block.m0, block.row_end, n0, n0 + kBlockN)) block.mask.apply(acc_s, row0, n0, lane);
  softmax.update(acc_s, acc_o, block.scale_log2);
  if (kExtras && block.dropping) block.dropout.apply(acc_s, row0, n0, lane);

  // O += P V_n: the keys in k16 steps, 16 rows of V (2048 bytes) each
  unsigned p_frag[kNTiles / 2][4];
  pack_p<T>(acc_s, p_frag);
  sm90::fence_operands(acc_o);  // (rescaled by the softmax above)
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kBlockN / 16; ++k)
    sm90::wgmma_rs_bt<T>(acc_o, p_frag[k], sm90::SmemDesc::n_major(shared.v(stage) + k * 16 * 128, Shared::kKvBlock));
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::fence_operands(acc_o);
}

// O /= l (and / (1 - p) under dropout) and the LSE, from this warp's registers to global
// memory.
template <typename T, int kDTiles, int kBlockM, int kBlockN, bool kLocal, bool kExtras>
__device__ __forceinline__ void store_output(const Params& p, const Sm90Block<kBlockM, kBlockN, kLocal, kExtras>& block,
                                             int warp_row0, int lane, OnlineSoftmax<1, true>& softmax,
                                             float (&acc_o)[1][kDTiles][4]) {
  const Sequence& seq = block.seq;
  const int batch = block.batch, head = block.head, row0 = block.m0 + warp_row0;
  float row_lse[1][2];
  softmax.finalize(acc_o, row_lse, block.scale_log2, block.dropping ? p.dropout_scale : 1.f);
  elem_t* o = seq.rows(p.o, batch, head, true);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row >= seq.seqlen_q) continue;
    if (t == 0 && p.lse != nullptr) p.lse[seq.lse_offset(p, batch, head) + row] = row_lse[0][h];
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<unsigned*>(o + int64(row) * p.o.row_stride + dt * 8 + 2 * t) =
          DType<T>::pack(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
  }
}

// Every warpgroup computes; thread 0 also issues the loads (HOPPER.md's milestone a).
// @tparam kConsumers  warpgroups, 64 query rows each
// @tparam kStages     K/V tiles in flight
// @tparam kLocal      causal or sliding window
// @tparam kExtras     softcap, ALiBi or dropout may be on
template <typename T, int kHeadDim, int kBlockN, int kConsumers, int kStages, bool kLocal, bool kExtras>
__global__ void __launch_bounds__(kConsumers * 128, 1) attention_forward_sm90(const __grid_constant__ Sm90Params args) {
  static_assert(kHeadDim == 128 && kBlockN == 128, "the m64n128k16 products: head dim 128, 128 keys a tile");
  constexpr int kBlockM = 64 * kConsumers;
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  const auto shared = Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages>::of(dynamic_shared);
  const Params& p = args.p;
  const auto block = Sm90Block<kBlockM, kBlockN, kLocal, kExtras>::of(p);
  if (block.m0 >= block.seq.seqlen_q) return;  // packed: the grid covers the longest sequence
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, consumer = warp / 4;
  const int warp_row0 = 64 * consumer + 16 * (warp % 4);

  if (threadIdx.x == 0) {
    shared.q_landed().init(1);
    for (int s = 0; s < kStages; ++s) shared.landed(s).init(1);
    sm90::Barrier::fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    shared.load_q(args, block.q_row(), block.head, block.tma_batch);
    for (int s = 0; s < kStages && block.n_end - 1 - s >= block.n_begin; ++s)
      shared.load_kv(args, block.k_row(block.n_end - 1 - s), s, block.kv_head, block.tma_batch);
  }
  float acc_o[1][kHeadDim / 8][4] = {};
  OnlineSoftmax<1, true> softmax;
  softmax.init();
  shared.q_landed().wait(0);
  for (int i = 0, n = block.n_end - 1; n >= block.n_begin; ++i, --n) {
    const int stage = i % kStages;
    shared.landed(stage).wait((i / kStages) & 1);
    consume_tile<T>(shared, block, n, stage, consumer, warp_row0, lane, softmax, acc_o);
    __syncthreads();  // every warpgroup is done with this stage: key tile n - kStages may take it
    if (threadIdx.x == 0 && n - kStages >= block.n_begin)
      shared.load_kv(args, block.k_row(n - kStages), stage, block.kv_head, block.tma_batch);
  }
  store_output<T>(p, block, warp_row0, lane, softmax, acc_o);
}

// Warpgroup 0 produces, warpgroups 1 .. kConsumers compute (HOPPER.md's milestone b): the
// producer keeps 24 registers a thread and gives the rest to the consumers (setmaxnreg;
// 128 x 24 + 256 x 240 fits the 65,536 of a multiprocessor). A stage is "landed" when its
// bytes have arrived and "released" when every consumer thread is done with it; the
// producer waits for the release before it refills the stage (a fresh barrier counts as
// released: its waits start on the other parity).
template <typename T, int kHeadDim, int kBlockN, int kConsumers, int kStages, bool kLocal, bool kExtras>
__global__ void __launch_bounds__((kConsumers + 1) * 128, 1)
    attention_forward_sm90_ws(const __grid_constant__ Sm90Params args) {
  static_assert(kHeadDim == 128 && kBlockN == 128, "the m64n128k16 products: head dim 128, 128 keys a tile");
  constexpr int kBlockM = 64 * kConsumers;
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  const auto shared = Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages>::of(dynamic_shared);
  const Params& p = args.p;
  const auto block = Sm90Block<kBlockM, kBlockN, kLocal, kExtras>::of(p);
  if (block.m0 >= block.seq.seqlen_q) return;  // packed: the grid covers the longest sequence
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = warp / 4;

  if (threadIdx.x == 0) {
    shared.q_landed().init(1);
    for (int s = 0; s < kStages; ++s) shared.landed(s).init(1), shared.released(s).init(kConsumers * 128);
    sm90::Barrier::fence_init();
  }
  __syncthreads();

  if (group == 0) {  // the producer
    sm90::set_max_registers<24, false>();
    if (threadIdx.x == 0) {
      shared.load_q(args, block.q_row(), block.head, block.tma_batch);
      for (int i = 0, n = block.n_end - 1; n >= block.n_begin; ++i, --n) {
        const int stage = i % kStages;
        shared.released(stage).wait(((i / kStages) & 1) ^ 1);
        shared.load_kv(args, block.k_row(n), stage, block.kv_head, block.tma_batch);
      }
    }
  } else {  // a consumer
    sm90::set_max_registers<240, true>();
    const int consumer = group - 1, warp_row0 = 64 * consumer + 16 * (warp % 4);
    float acc_o[1][kHeadDim / 8][4] = {};
    OnlineSoftmax<1, true> softmax;
    softmax.init();
    shared.q_landed().wait(0);
    for (int i = 0, n = block.n_end - 1; n >= block.n_begin; ++i, --n) {
      const int stage = i % kStages;
      shared.landed(stage).wait((i / kStages) & 1);
      consume_tile<T>(shared, block, n, stage, consumer, warp_row0, lane, softmax, acc_o);
      shared.released(stage).arrive();
    }
    store_output<T>(p, block, warp_row0, lane, softmax, acc_o);
  }
}

}  // namespace cuflash
