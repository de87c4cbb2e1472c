// Forward attention on Hopper (sm_90a), first form: TMA loads and wgmma products, every
// warpgroup computing (no producer warpgroup yet; HOPPER.md's milestone a).
//
// One CTA per (block of kWarpGroups x 64 query rows, head, batch); warpgroup g owns query
// rows 64g .. 64g + 63 of the block. Thread 0 asks the copy engine for Q once and for each
// key tile's K and V, kStages tiles ahead, each stage with a barrier that completes when
// its bytes have landed. Per key tile n (the last first, as the mma.sync forward):
//
//   S = Q K_n^T                    wgmma, Q and K from shared memory
//   S = mask(S)                    mask.cuh (the accumulator layout is mma.sync's)
//   m, P, l, O rescaled            softmax.cuh
//   O += P V_n                     wgmma, P from registers, V read N-major
//
// then O / l and the LSE go straight from registers to global memory.
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "softmax.cuh"

namespace cuflash {

// The forward's arguments and the tensor maps of Q, K and V, each 4-D (headdim, seqlen,
// heads, batch) with a box of 64 columns (128 bytes, the swizzle's width) and kBlockM or
// kBlockN rows (cuflash/_tensormap.py).
struct Sm90Params {
  Params p;
  sm90::TensorMap q, k, v;
};

// Shared memory, byte offsets (1024-byte aligned: the swizzle's atoms): Q, kStages K tiles,
// kStages V tiles, then the barriers. A tile of R rows is kHeadDim / 64 blocks of R x 128
// bytes, one after the other.
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct Sm90Shared {
  static constexpr int kColumnBlocks = kHeadDim / 64;
  static constexpr int kQ = 0, kK = kQ + kBlockM * kHeadDim * 2, kV = kK + kStages * kBlockN * kHeadDim * 2;
  static constexpr int kBarriers = kV + kStages * kBlockN * kHeadDim * 2;
  static constexpr int kBytes = kBarriers + (kStages + 1) * 8 + 1024;  // (+ the alignment, below)
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

// @tparam kWarpGroups  warpgroups, 64 query rows each
// @tparam kStages      K/V tiles in flight
// @tparam kLocal       causal or sliding window
template <typename T, int kHeadDim, int kBlockN, int kWarpGroups, int kStages, bool kLocal>
__global__ void __launch_bounds__(kWarpGroups * 128, 1) attention_forward_sm90(const __grid_constant__ Sm90Params args) {
  static_assert(kHeadDim == 128 && kBlockN == 128, "the m64n128k16 products: head dim 128, 128 keys a tile");
  constexpr int kBlockM = 64 * kWarpGroups, kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8;
  using Shared = Sm90Shared<kHeadDim, kBlockM, kBlockN, kStages>;
  constexpr int kQBytes = kBlockM * kHeadDim * 2, kKvBytes = 2 * kBlockN * kHeadDim * 2;
  constexpr int kQBlock = kBlockM * 128, kKvBlock = kBlockN * 128;  // bytes of a 64-column block
  const Params& p = args.p;
  // The swizzle's atoms need 1024-byte alignment, more than dynamic shared memory is
  // promised: the launch asks for 1024 bytes more, and the block starts at the first
  // aligned byte.
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  unsigned char* smem = shared_bytes + ((1024 - (sm90::shared_address(shared_bytes) & 1023)) & 1023);
  unsigned long long* barriers = reinterpret_cast<unsigned long long*>(smem + Shared::kBarriers);
  const sm90::Barrier q_landed{barriers + kStages};
  auto tile_landed = [&](int stage) { return sm90::Barrier{barriers + stage}; };

  const int m_block = gridDim.x - 1 - blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int kv_head = head / p.heads_per_kv;
  const Sequence seq = Sequence::of(p, batch);
  const int m0 = m_block * kBlockM;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = warp / 4;
  const int warp_row0 = 64 * group + 16 * (warp % 4);  // this warp's first row in the block

  const auto mask = Mask<kLocal>::of(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  const int row_end = min(m0 + kBlockM, seq.seqlen_q);
  const int n_begin = mask.key_begin(m0) / kBlockN;
  const int n_end = ceil_div(mask.key_end(row_end), kBlockN);

  // Key tile n (counting down from n_end - 1, the i-th visited) into stage i % kStages.
  auto issue = [&](int n, int stage) {
    const sm90::Barrier landed = tile_landed(stage);
    landed.arrive_expecting(kKvBytes);
    unsigned char* k_tile = smem + Shared::kK + stage * kBlockN * kHeadDim * 2;
    unsigned char* v_tile = smem + Shared::kV + stage * kBlockN * kHeadDim * 2;
#pragma unroll
    for (int c = 0; c < Shared::kColumnBlocks; ++c) {
      sm90::tma_load(k_tile + c * kKvBlock, args.k, landed, 64 * c, n * kBlockN, kv_head, batch);
      sm90::tma_load(v_tile + c * kKvBlock, args.v, landed, 64 * c, n * kBlockN, kv_head, batch);
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s <= kStages; ++s) sm90::Barrier{barriers + s}.init(1);
    sm90::Barrier::fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    q_landed.arrive_expecting(kQBytes);
#pragma unroll
    for (int c = 0; c < Shared::kColumnBlocks; ++c)
      sm90::tma_load(smem + Shared::kQ + c * kQBlock, args.q, q_landed, 64 * c, m0, head, batch);
    for (int s = 0; s < kStages && n_end - 1 - s >= n_begin; ++s) issue(n_end - 1 - s, s);
  }

  const float scale_log2 = p.scale_log2;
  float acc_o[1][kDTiles][4] = {};
  OnlineSoftmax<1, true> softmax;
  softmax.init();
  q_landed.wait(0);

  for (int i = 0, n = n_end - 1; n >= n_begin; ++i, --n) {
    const int stage = i % kStages;
    tile_landed(stage).wait((i / kStages) & 1);
    const unsigned char* k_tile = smem + Shared::kK + stage * kBlockN * kHeadDim * 2;
    const unsigned char* v_tile = smem + Shared::kV + stage * kBlockN * kHeadDim * 2;

    // S = Q K_n^T: the head dim in k16 steps, four to a 64-column block
    float acc_s[1][kNTiles][4];
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kHeadDim / 16; ++k) {
      const unsigned step = (k % 4) * 32;  // bytes into the rows of block k / 4
      sm90::wgmma_ss<T>(acc_s, sm90::SmemDesc::k_major(smem + Shared::kQ + (k / 4) * kQBlock + group * 64 * 128 + step),
                        sm90::SmemDesc::k_major(k_tile + (k / 4) * kKvBlock + step), k > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();

    // S = -inf where hidden; m, P, l, O rescaled
    const int n0 = n * kBlockN;
    if (!mask.covers(m0, row_end, n0, n0 + kBlockN)) mask.apply(acc_s, m0 + warp_row0, n0, lane);
    softmax.update(acc_s, acc_o, scale_log2);

    // O += P V_n: the keys in k16 steps, 16 rows of V (2048 bytes) each
    unsigned p_frag[kNTiles / 2][4];
    pack_p<T>(acc_s, p_frag);
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBlockN / 16; ++k)
      sm90::wgmma_rs_bt<T>(acc_o, p_frag[k], sm90::SmemDesc::n_major(v_tile + k * 16 * 128, kKvBlock));
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();

    // Every warpgroup is done with this stage: key tile n - kStages may take it.
    __syncthreads();
    if (threadIdx.x == 0 && n - kStages >= n_begin) issue(n - kStages, stage);
  }

  // O /= l;  LSE = scale m + log l;  both straight to global memory
  float row_lse[1][2];
  softmax.finalize(acc_o, row_lse, scale_log2, 1.f);
  elem_t* o = seq.rows(p.o, batch, head, true);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + warp_row0 + g + 8 * h;
    if (row >= seq.seqlen_q) continue;
    if (t == 0 && p.lse != nullptr) p.lse[seq.lse_offset(p, batch, head) + row] = row_lse[0][h];
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<unsigned*>(o + int64(row) * p.o.row_stride + dt * 8 + 2 * t) =
          DType<T>::pack(acc_o[0][dt][2 * h], acc_o[0][dt][2 * h + 1]);
  }
}

}  // namespace cuflash
