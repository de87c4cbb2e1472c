// FlashAttention backward. P is recomputed from the saved LSE, never stored:
//
//   D = rowsum(dO * O)                                     attention_backward_preprocess
//   for each key tile j (one CTA), for each query tile i and query head of the group:
//     P = exp(scale S - LSE),  S = Q_i K_j^T                 (as P^T = exp(scale K_j Q_i^T - LSE))
//     dV_j += P^T dO_i;  dP = dO_i V_j^T;  dS = P * (dP - D_i)
//     dK_j += scale dS^T Q_i;  dQ_i += dS K_j                 attention_backward_dkdv
//   dQ = scale dQ                                           attention_backward_convert_dq
//
// dK and dV stay in registers across the whole loop (fp32, summed over the query
// heads that share the KV head, so GQA needs no atomics); dQ is accumulated in an
// fp32 buffer with atomics. Deterministic mode skips those atomics and computes dQ
// in attention_backward_dq, one CTA per query tile, which recomputes S and dP.
#include "common.cuh"
#include "copy.cuh"
#include "mask.cuh"
#include "mma.cuh"

namespace cuflash {

// D = rowsum(dO * O) in fp32 for each (batch, head, query row), one warp a row;
// the same warp clears the row's fp32 dQ accumulator (when there is one).
template <typename T>
__global__ void __launch_bounds__(256)
attention_backward_preprocess(const elem_t* __restrict__ dout, const elem_t* __restrict__ out,
                              float* __restrict__ delta, float* __restrict__ dq_accum,
                              int batch, int seqlen_q, int nheads, int headdim,
                              int64 do_batch_stride, int64 do_row_stride, int64 do_head_stride,
                              int64 o_batch_stride, int64 o_row_stride, int64 o_head_stride) {
  const int64 row = int64(blockIdx.x) * 8 + threadIdx.x / 32;  // = (b * seqlen_q + i) * nheads + h
  const int lane = threadIdx.x % 32;
  if (row >= int64(batch) * seqlen_q * nheads) return;
  const int h = int(row % nheads), i = int(row / nheads % seqlen_q), b = int(row / nheads / seqlen_q);
  const elem_t* dO = dout + b * do_batch_stride + i * do_row_stride + h * do_head_stride;
  const elem_t* O = out + b * o_batch_stride + i * o_row_stride + h * o_head_stride;
  float sum = 0.f;
  for (int c = lane; c < headdim; c += 32) sum += DType<T>::to_float(dO[c]) * DType<T>::to_float(O[c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[(int64(b) * nheads + h) * seqlen_q + i] = sum;
  if (dq_accum != nullptr)
    for (int c = lane; c < headdim; c += 32) dq_accum[row * headdim + c] = 0.f;
}

// dq = scale * dq_accum, both (batch, seqlen_q, nheads, headdim) contiguous.
template <typename T>
__global__ void __launch_bounds__(256)
attention_backward_convert_dq(const float* __restrict__ dq_accum, elem_t* __restrict__ dq, int64 n, float scale) {
  for (int64 i = int64(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64(gridDim.x) * blockDim.x)
    dq[i] = DType<T>::from_float(dq_accum[i] * scale);
}

// exp(scale S - LSE) for the scores of acc (C layout), in log2 units:
// acc * scale_log2 - lse_log2. Hidden scores (and rows with LSE = +inf) give 0.
// kTransposed: acc holds S^T (rows are keys, columns queries).
template <bool kTransposed, bool kCausal, int kNTiles>
__device__ __forceinline__ void recompute_p(float (&acc)[1][kNTiles][4], float scale_log2,
                                            const float* lse_log2_cols, const float (&lse_log2_rows)[2],
                                            bool masked, const Mask<kCausal>& mask, int row0, int col0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = g + 8 * (e >> 1), c = nt * 8 + 2 * t + (e & 1);
      const float lse = kTransposed ? lse_log2_cols[c] : lse_log2_rows[e >> 1];
      float p = fast_exp2(acc[0][nt][e] * scale_log2 - lse);
      if (masked) {
        const bool visible = kTransposed ? mask.visible(col0 + c, row0 + r) : mask.visible(row0 + r, col0 + c);
        if (!visible) p = 0.f;
      }
      acc[0][nt][e] = p;
    }
}

// @tparam kBlockM   query rows per step; a multiple of 16 * kWarps
// @tparam kBlockN   key rows per CTA, 16 per warp
// @tparam kStages   shared buffers for Q / dO: 2 overlaps the next step's load
// @tparam kColSplit passes over the head dim: dK, dV (and dQ) columns are split so
//                   that their accumulators fit in registers for large head dims
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kCausal, bool kVec,
          int kColSplit>
__global__ void __launch_bounds__(kWarps * 32)
attention_backward_dkdv(const elem_t* __restrict__ dout, const elem_t* __restrict__ q,
                        const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        elem_t* __restrict__ dk, elem_t* __restrict__ dv, float* __restrict__ dq_accum,
                        int seqlen_q, int seqlen_k, int nheads, int heads_per_kv, int headdim,
                        int64 do_batch_stride, int64 do_row_stride, int64 do_head_stride,
                        int64 q_batch_stride, int64 q_row_stride, int64 q_head_stride,
                        int64 k_batch_stride, int64 k_row_stride, int64 k_head_stride,
                        int64 v_batch_stride, int64 v_row_stride, int64 v_head_stride,
                        int64 dk_batch_stride, int64 dk_row_stride, int64 dk_head_stride,
                        int64 dv_batch_stride, int64 dv_row_stride, int64 dv_head_stride,
                        float scale, float scale_log2) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  constexpr int kDsStride = kBlockM + 8;  // dS^T rows, padded like every tile
  constexpr int kCols = kHeadDim / kColSplit;
  constexpr int kMTiles = kBlockM / 16;
  // dQ = dS K is split among the warps by columns where each warp gets a multiple
  // of 16, else by 16-row tiles: kDqRowTiles x kDqCols per warp.
  constexpr bool kDqByCols = (kCols / kWarps) % 16 == 0;
  constexpr int kDqRowTiles = kDqByCols ? kMTiles : kMTiles / kWarps;
  constexpr int kDqCols = kDqByCols ? kCols / kWarps : kCols;
  static_assert(kBlockN == 16 * kWarps && kCols % 16 == 0, "tile shape");
  static_assert(kDqByCols || kMTiles % kWarps == 0, "dQ tiles must divide among the warps");

  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* k_tile = reinterpret_cast<elem_t*>(smem);
  elem_t* v_tile = k_tile + kBlockN * kStride;
  elem_t* q_tiles = v_tile + kBlockN * kStride;
  elem_t* do_tiles = q_tiles + kStages * kBlockM * kStride;
  elem_t* ds_tile = do_tiles + kStages * kBlockM * kStride;
  float* lse_log2 = reinterpret_cast<float*>(ds_tile + kBlockN * kDsStride);  // [kStages][kBlockM]
  float* deltas = lse_log2 + kStages * kBlockM;                                // [kStages][kBlockM]

  const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
  const int n0 = n_block * kBlockN;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane >> 2, t = lane & 3;
  k += batch * k_batch_stride + kv_head * k_head_stride;
  v += batch * v_batch_stride + kv_head * v_head_stride;
  dk += batch * dk_batch_stride + kv_head * dk_head_stride;
  dv += batch * dv_batch_stride + kv_head * dv_head_stride;

  const Mask<kCausal> mask{seqlen_k, seqlen_k - seqlen_q};
  // Query tiles that see any key of this tile: with causal, from the first row
  // whose diagonal reaches n0.
  const int m_begin = kCausal ? max(0, n0 - mask.diagonal) / kBlockM : 0;
  const int m_tiles = max(0, ceil_div(seqlen_q, kBlockM) - m_begin);
  const int steps = heads_per_kv * m_tiles;  // (query head of the group, query tile) pairs

  load_tile<kBlockN, kHeadDim, kThreads, kVec>(k_tile, k, k_row_stride, n0, seqlen_k, headdim);
  load_tile<kBlockN, kHeadDim, kThreads, kVec>(v_tile, v, v_row_stride, n0, seqlen_k, headdim);
  cp_async_commit();

  auto step_head = [&](int step) { return kv_head * heads_per_kv + step / max(m_tiles, 1); };
  auto step_m0 = [&](int step) { return (m_begin + step % max(m_tiles, 1)) * kBlockM; };
  auto load_step = [&](int step, int stage) {
    const int head = step_head(step), m0 = step_m0(step);
    load_tile<kBlockM, kHeadDim, kThreads, kVec>(q_tiles + stage * kBlockM * kStride,
                                                 q + batch * q_batch_stride + head * q_head_stride, q_row_stride,
                                                 m0, seqlen_q, headdim);
    load_tile<kBlockM, kHeadDim, kThreads, kVec>(do_tiles + stage * kBlockM * kStride,
                                                 dout + batch * do_batch_stride + head * do_head_stride,
                                                 do_row_stride, m0, seqlen_q, headdim);
    cp_async_commit();
    // Rows past seqlen_q get LSE = +inf, so their P is 0 like a fully masked row's.
    const int64 row_base = (int64(batch) * nheads + head) * seqlen_q;
    for (int i = threadIdx.x; i < kBlockM; i += kThreads) {
      const bool ok = m0 + i < seqlen_q;
      lse_log2[stage * kBlockM + i] = ok ? lse[row_base + m0 + i] * kLog2e : kInf;
      deltas[stage * kBlockM + i] = ok ? delta[row_base + m0 + i] : 0.f;
    }
  };

  for (int pass = 0; pass < kColSplit; ++pass) {
    const int col0 = pass * kCols;
    float acc_dk[kCols / 8][4] = {}, acc_dv[kCols / 8][4] = {};
    if (steps > 0) load_step(0, 0);

    for (int step = 0; step < steps; ++step) {
      const int stage = kStages == 2 ? step % 2 : 0;
      if (kStages == 2 && step + 1 < steps) {
        load_step(step + 1, (step + 1) % 2);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const int head = step_head(step), m0 = step_m0(step);
      const elem_t* q_tile = q_tiles + stage * kBlockM * kStride;
      const elem_t* do_tile = do_tiles + stage * kBlockM * kStride;
      const float* step_lse = lse_log2 + stage * kBlockM;
      const float* step_delta = deltas + stage * kBlockM;
      const bool masked = n0 + kBlockN > seqlen_k || (kCausal && n0 + kBlockN - 1 > m0 + mask.diagonal);
      const float no_rows[2] = {0.f, 0.f};

      // P^T = exp(scale K Q^T - LSE): this warp's 16 keys x kBlockM queries.
      float acc_p[1][kBlockM / 8][4] = {};
      gemm_qk<T, 1, kBlockM, kHeadDim>(acc_p, k_tile, warp * 16, q_tile, lane);
      recompute_p<true>(acc_p, scale_log2, step_lse, no_rows, masked, mask, n0 + warp * 16, m0, lane);
      // dV += P^T dO
      gemm_pv<T, 1, kBlockM, kCols, kStride>(reinterpret_cast<float(&)[1][kCols / 8][4]>(acc_dv), acc_p,
                                             do_tile + col0, lane);
      // dP^T = V dO^T;  dS^T = P^T (dP^T - D)
      float acc_ds[1][kBlockM / 8][4] = {};
      gemm_qk<T, 1, kBlockM, kHeadDim>(acc_ds, v_tile, warp * 16, do_tile, lane);
#pragma unroll
      for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_ds[0][nt][e] = acc_p[0][nt][e] * (acc_ds[0][nt][e] - step_delta[nt * 8 + 2 * t + (e & 1)]);
      // dK += dS^T Q (scaled once at the end)
      gemm_pv<T, 1, kBlockM, kCols, kStride>(reinterpret_cast<float(&)[1][kCols / 8][4]>(acc_dk), acc_ds,
                                             q_tile + col0, lane);

      if (dq_accum != nullptr) {
        // dQ += dS K: dS^T goes through shared memory so each warp can take 16 query rows.
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<unsigned*>(ds_tile + (warp * 16 + g + 8 * h) * kDsStride + nt * 8 + 2 * t) =
                DType<T>::pack(acc_ds[0][nt][2 * h], acc_ds[0][nt][2 * h + 1]);
        __syncthreads();
        const int dq_row0 = kDqByCols ? 0 : warp * kDqRowTiles * 16;
        const int dq_col0 = col0 + (kDqByCols ? warp * kDqCols : 0);
        float acc_dq[kDqRowTiles][kDqCols / 8][4] = {};
        gemm_tn<T, kDqRowTiles, kBlockN, kDqCols, kDsStride, kStride>(acc_dq, ds_tile, dq_row0, k_tile + dq_col0, lane);
        float* dq_head = dq_accum + int64(batch) * seqlen_q * nheads * headdim + int64(head) * headdim;
#pragma unroll
        for (int mt = 0; mt < kDqRowTiles; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = m0 + dq_row0 + mt * 16 + g + 8 * (e >> 1);
            if (row >= seqlen_q) continue;
#pragma unroll
            for (int dt = 0; dt < kDqCols / 8; ++dt) {
              const int col = dq_col0 + dt * 8 + 2 * t + (e & 1);
              if (col < headdim) atomicAdd(dq_head + int64(row) * nheads * headdim + col, acc_dq[mt][dt][e]);
            }
          }
      }
      __syncthreads();
      if (kStages == 1 && step + 1 < steps) load_step(step + 1, 0);
    }

    store_accumulators<T, kCols / 8, kVec>(dk, dk_row_stride, acc_dk, n0 + warp * 16, seqlen_k, col0, headdim,
                                          scale, lane);
    store_accumulators<T, kCols / 8, kVec>(dv, dv_row_stride, acc_dv, n0 + warp * 16, seqlen_k, col0, headdim,
                                          1.f, lane);
  }
  cp_async_wait<0>();  // K/V copies are still pending when no query tile was visited
}

// Deterministic dQ: one CTA per (query tile, head, batch), each warp 16 query rows,
// key tiles streamed as in the forward; no atomics, so the result is bitwise stable.
//   S = Q K^T;  P = exp(scale S - LSE);  dP = dO V^T;  dS = P (dP - D);  dQ += dS K
// kColSplit passes over the head dim keep the dQ accumulator within registers.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kCausal, bool kVec,
          int kColSplit>
__global__ void __launch_bounds__(kWarps * 32)
attention_backward_dq(const elem_t* __restrict__ dout, const elem_t* __restrict__ q,
                      const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                      const float* __restrict__ lse, const float* __restrict__ delta, elem_t* __restrict__ dq,
                      int seqlen_q, int seqlen_k, int nheads, int heads_per_kv, int headdim,
                      int64 do_batch_stride, int64 do_row_stride, int64 do_head_stride,
                      int64 q_batch_stride, int64 q_row_stride, int64 q_head_stride,
                      int64 k_batch_stride, int64 k_row_stride, int64 k_head_stride,
                      int64 v_batch_stride, int64 v_row_stride, int64 v_head_stride,
                      int64 dq_batch_stride, int64 dq_row_stride, int64 dq_head_stride,
                      float scale, float scale_log2) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  constexpr int kCols = kHeadDim / kColSplit;
  static_assert(kBlockM == 16 * kWarps && kBlockN % 16 == 0 && kCols % 16 == 0, "tile shape");

  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* q_tile = reinterpret_cast<elem_t*>(smem);
  elem_t* do_tile = q_tile + kBlockM * kStride;
  elem_t* k_tiles = do_tile + kBlockM * kStride;
  elem_t* v_tiles = k_tiles + kStages * kBlockN * kStride;

  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int m0 = m_block * kBlockM;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane >> 2;
  const int kv_head = head / heads_per_kv;
  q += batch * q_batch_stride + head * q_head_stride;
  dout += batch * do_batch_stride + head * do_head_stride;
  k += batch * k_batch_stride + kv_head * k_head_stride;
  v += batch * v_batch_stride + kv_head * v_head_stride;
  dq += batch * dq_batch_stride + head * dq_head_stride;

  const Mask<kCausal> mask{seqlen_k, seqlen_k - seqlen_q};
  const int n_end = kCausal ? max(0, min(seqlen_k, min(m0 + kBlockM, seqlen_q) + mask.diagonal)) : seqlen_k;
  const int n_blocks = ceil_div(n_end, kBlockN);

  // This lane's two rows: LSE in log2 units (+inf past seqlen_q, so P = 0) and D.
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + warp * 16 + g + 8 * h;
    const int64 at = (int64(batch) * nheads + head) * seqlen_q + row;
    row_lse[h] = row < seqlen_q ? lse[at] * kLog2e : kInf;
    row_delta[h] = row < seqlen_q ? delta[at] : 0.f;
  }

  auto load_kv = [&](int n, int stage) {
    load_tile<kBlockN, kHeadDim, kThreads, kVec>(k_tiles + stage * kBlockN * kStride, k, k_row_stride,
                                                  n * kBlockN, seqlen_k, headdim);
    load_tile<kBlockN, kHeadDim, kThreads, kVec>(v_tiles + stage * kBlockN * kStride, v, v_row_stride,
                                                  n * kBlockN, seqlen_k, headdim);
    cp_async_commit();
  };
  load_tile<kBlockM, kHeadDim, kThreads, kVec>(q_tile, q, q_row_stride, m0, seqlen_q, headdim);
  load_tile<kBlockM, kHeadDim, kThreads, kVec>(do_tile, dout, do_row_stride, m0, seqlen_q, headdim);
  cp_async_commit();

  for (int pass = 0; pass < kColSplit; ++pass) {
    const int col0 = pass * kCols;
    if (n_blocks > 0) load_kv(0, 0);
    float acc_dq[1][kCols / 8][4] = {};
    for (int n = 0; n < n_blocks; ++n) {
      const int stage = kStages == 2 ? n % 2 : 0;
      if (kStages == 2 && n + 1 < n_blocks) {
        load_kv(n + 1, (n + 1) % 2);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const elem_t* k_tile = k_tiles + stage * kBlockN * kStride;
      const elem_t* v_tile = v_tiles + stage * kBlockN * kStride;
      const int n0 = n * kBlockN;
      const bool masked = n0 + kBlockN > seqlen_k || (kCausal && n0 + kBlockN - 1 > m0 + mask.diagonal);

      float acc_p[1][kBlockN / 8][4] = {};
      gemm_qk<T, 1, kBlockN, kHeadDim>(acc_p, q_tile, warp * 16, k_tile, lane);
      recompute_p<false>(acc_p, scale_log2, nullptr, row_lse, masked, mask, m0 + warp * 16, n0, lane);
      float acc_ds[1][kBlockN / 8][4] = {};
      gemm_qk<T, 1, kBlockN, kHeadDim>(acc_ds, do_tile, warp * 16, v_tile, lane);
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_ds[0][nt][e] = acc_p[0][nt][e] * (acc_ds[0][nt][e] - row_delta[e >> 1]);
      gemm_pv<T, 1, kBlockN, kCols, kStride>(acc_dq, acc_ds, k_tile + col0, lane);
      __syncthreads();
      if (kStages == 1 && n + 1 < n_blocks) load_kv(n + 1, 0);
    }
    cp_async_wait<0>();
    store_accumulators<T, kCols / 8, kVec>(dq, dq_row_stride, acc_dq[0], m0 + warp * 16, seqlen_q, col0, headdim,
                                           scale, lane);
  }
}

}  // namespace cuflash
