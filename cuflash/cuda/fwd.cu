// FlashAttention forward: one CTA per (query tile, head, batch).
//
//   for each key tile j (the last, masked ones first):
//     S = Q K_j^T                          tensor cores, fp32 accumulators
//     S = mask(S)                          only tiles that straddle a boundary
//     m' = max(m, rowmax S);  P = exp(scale (S - m'))
//     l = l exp(scale (m - m')) + rowsum P;  O = O exp(scale (m - m')) + P V_j
//   O /= l;  LSE = scale m + log l
//
// K/V tiles stream through shared memory with cp.async; with kStages == 2 the
// next tile is in flight while the current one is computed.
#include "common.cuh"
#include "copy.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "softmax.cuh"

namespace cuflash {

__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// @tparam T         half_t or bfloat16_t
// @tparam kHeadDim  head-dim bucket, a multiple of 32; the real headdim <= kHeadDim is an argument
// @tparam kBlockM   query rows per CTA; each of the kWarps warps owns kBlockM / kWarps of them
// @tparam kBlockN   key rows per tile
// @tparam kStages   shared-memory K/V buffers: 2 overlaps the next load with compute
// @tparam kCausal   bottom-right causal mask
// @tparam kVec      rows 16-byte aligned and headdim % 8 == 0: cp.async 16-byte chunks
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kCausal, bool kVec>
__global__ void __launch_bounds__(kWarps * 32)
attention_forward(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                  elem_t* __restrict__ o, float* __restrict__ lse,
                  int seqlen_q, int seqlen_k, int nheads, int heads_per_kv, int headdim,
                  int64 q_batch_stride, int64 q_row_stride, int64 q_head_stride,
                  int64 k_batch_stride, int64 k_row_stride, int64 k_head_stride,
                  int64 v_batch_stride, int64 v_row_stride, int64 v_head_stride,
                  int64 o_batch_stride, int64 o_row_stride, int64 o_head_stride,
                  float scale_log2) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kMTiles = kBlockM / (16 * kWarps);  // 16-row mma tiles per warp
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  static_assert(kMTiles * 16 * kWarps == kBlockM && kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shape");
  static_assert(kStages == 1 || kStages == 2, "one or two K/V buffers");

  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* q_tile = reinterpret_cast<elem_t*>(smem);
  elem_t* k_tiles = q_tile + kBlockM * kStride;
  elem_t* v_tiles = k_tiles + kStages * kBlockN * kStride;

  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int m0 = m_block * kBlockM;
  const int lane = threadIdx.x % 32;
  const int warp_row0 = (threadIdx.x / 32) * kMTiles * 16;  // this warp's first row in the tile
  const int kv_head = head / heads_per_kv;
  q += batch * q_batch_stride + head * q_head_stride;
  k += batch * k_batch_stride + kv_head * k_head_stride;
  v += batch * v_batch_stride + kv_head * v_head_stride;
  o += batch * o_batch_stride + head * o_head_stride;
  lse += (int64(batch) * nheads + head) * seqlen_q;

  // Key tiles this query tile needs: with causal, none past its last row's diagonal.
  const Mask<kCausal> mask{seqlen_k, seqlen_k - seqlen_q};
  const int n_end = kCausal ? max(0, min(seqlen_k, min(m0 + kBlockM, seqlen_q) + mask.diagonal)) : seqlen_k;
  const int n_blocks = ceil_div(n_end, kBlockN);
  // Tiles from n_masked on hold seqlen_k's tail or cross the diagonal of the first row.
  int n_masked = seqlen_k / kBlockN;
  if (kCausal) n_masked = max(0, min(n_masked, floor_div(m0 + mask.diagonal + 1, kBlockN)));

  auto load_kv = [&](int n, int stage) {
    load_tile<kBlockN, kHeadDim, kThreads, kVec>(k_tiles + stage * kBlockN * kStride, k, k_row_stride,
                                                  n * kBlockN, seqlen_k, headdim);
    load_tile<kBlockN, kHeadDim, kThreads, kVec>(v_tiles + stage * kBlockN * kStride, v, v_row_stride,
                                                  n * kBlockN, seqlen_k, headdim);
    cp_async_commit();
  };

  load_tile<kBlockM, kHeadDim, kThreads, kVec>(q_tile, q, q_row_stride, m0, seqlen_q, headdim);
  cp_async_commit();
  if (n_blocks > 0) load_kv(n_blocks - 1, 0);

  float acc_o[kMTiles][kDTiles][4] = {};
  OnlineSoftmax<kMTiles> softmax;
  softmax.init();

  for (int i = 0; i < n_blocks; ++i) {
    const int n = n_blocks - 1 - i;
    const int stage = kStages == 2 ? i % 2 : 0;
    if (kStages == 2 && n > 0) {
      load_kv(n - 1, (i + 1) % 2);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    float acc_s[kMTiles][kNTiles][4] = {};
    gemm_qk<T, kMTiles, kBlockN, kHeadDim>(acc_s, q_tile, warp_row0, k_tiles + stage * kBlockN * kStride, lane);
    if (n >= n_masked) mask.apply(acc_s, m0 + warp_row0, n * kBlockN, lane);
    softmax.update(acc_s, acc_o, scale_log2);
    gemm_pv<T, kMTiles, kBlockN, kHeadDim, kStride>(acc_o, acc_s, v_tiles + stage * kBlockN * kStride, lane);
    __syncthreads();

    if (kStages == 1 && n > 0) load_kv(n - 1, 0);
  }
  // With no key tile to visit, other threads' Q copies may still be landing in
  // the rows the epilogue reuses: wait for them all before anyone writes there.
  cp_async_wait<0>();
  __syncthreads();

  float row_lse[kMTiles][2];
  softmax.finalize(acc_o, row_lse, scale_log2);

  // Epilogue: LSE from the lane that owns each row; O through this warp's own
  // rows of the Q tile so the global store is 16-byte wide and coalesced.
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + mt * 16 + g + 8 * h;
      if (t == 0 && m0 + row < seqlen_q) lse[m0 + row] = row_lse[mt][h];
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<unsigned*>(q_tile + row * kStride + dt * 8 + 2 * t) =
            DType<T>::pack(acc_o[mt][dt][2 * h], acc_o[mt][dt][2 * h + 1]);
    }
  __syncthreads();
  store_tile<kBlockM, kHeadDim, kThreads, kVec>(o, q_tile, o_row_stride, m0, seqlen_q, headdim);
}

}  // namespace cuflash
