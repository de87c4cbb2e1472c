// FlashAttention backward. P is recomputed from the saved LSE, never stored:
//
//   D = rowsum(dO * O)                                      attention_backward_preprocess
//   for each key tile j (one CTA), for each query head of the group and query tile i:
//     P = exp(mod(S) - LSE),  S = Q_i K_j^T                    (held as P^T: keys are rows)
//     dV_j += dropout(P)^T dO_i;  dP = dropout(dO_i V_j^T);  dS = P (dP - D_i) mod'(S)
//     dK_j += scale dS^T Q_i                                   attention_backward_dkdv
//   for each query tile i (one CTA), for each key tile j it sees:
//     the same P and dS;  dQ_i += scale dS K_j                 attention_backward_dq
//
// dK and dV stay in registers across the whole loop (fp32, summed over the query
// heads that share the KV head, so GQA needs no atomics), and so does dQ in its own
// pass. Recomputing S and dP there measured faster on the H200 than accumulating dQ
// with fp32 atomics from the dK/dV kernel (docs/performance.md), and with no atomics
// anywhere every gradient is bitwise reproducible.
#include "common.cuh"
#include "copy.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "score.cuh"

namespace cuflash {

// D = rowsum(dO * O) in fp32, one warp a (row, head). Rows are numbered batch-major
// over `batch` groups of `rows_per_batch` (one group of all rows for packed arrays).
template <typename T>
__global__ void __launch_bounds__(256)
attention_backward_preprocess(const Params p, int batch, int rows_per_batch) {
  const int64 task = int64(blockIdx.x) * 8 + threadIdx.x / 32;  // = row * nheads + head
  const int lane = threadIdx.x % 32;
  if (task >= int64(batch) * rows_per_batch * p.nheads) return;
  const int head = int(task % p.nheads);
  const int64 row = task / p.nheads;
  const int b = int(row / rows_per_batch), i = int(row % rows_per_batch);
  const elem_t* dO = p.dout.ptr + b * p.dout.batch_stride + i * p.dout.row_stride + head * p.dout.head_stride;
  const elem_t* O = p.o.ptr + b * p.o.batch_stride + i * p.o.row_stride + head * p.o.head_stride;
  float sum = 0.f;
  for (int c = lane; c < p.headdim; c += 32) sum += DType<T>::to_float(dO[c]) * DType<T>::to_float(O[c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) p.delta[b * p.lse_batch_stride + head * p.lse_head_stride + i] = sum;
}

// Above d 128, overlapping every k16 step of the two score products needs more
// registers than the gradient accumulators leave (ptxas spilled): at most 4, 2
// above d 192.
__host__ __device__ constexpr int qk_unroll(int head_dim) {
  return head_dim > 192 ? 2 : head_dim > 128 ? 4 : head_dim / 16;
}

// From the raw scores s = Q K^T and dP = dO V^T of a tile (mma C layout; with
// kTransposed the rows are keys and the columns queries), in place:
//   s  <- dropout(P), P = exp(mod(s) - LSE), 0 where hidden     (for dV)
//   dp <- dS = P (dropout(dP) - D) mod'(s)                       (for dK and dQ)
// lse_log2 / delta give each query's LSE * log2(e) and D.
template <bool kTransposed, bool kLocal, bool kExtras, int kNTiles, typename Lse, typename Delta>
__device__ __forceinline__ void probabilities_and_gradients(
    float (&s)[1][kNTiles][4], float (&dp)[1][kNTiles][4], float scale_log2, bool masked, const Mask<kLocal>& mask,
    const ScoreMod& mod, const Dropout& dropout, bool dropping, float dropout_scale, Lse lse_log2, Delta delta,
    int row0, int col0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = g + 8 * (e >> 1), c = nt * 8 + 2 * t + (e & 1);
      const int query = kTransposed ? col0 + c : row0 + r, key = kTransposed ? row0 + r : col0 + c;
      const int local = kTransposed ? c : r;  // the query's index for lse_log2 / delta
      const float raw = s[0][nt][e];
      float prob = fast_exp2((kExtras ? mod(raw, query, key) : raw) * scale_log2 - lse_log2(local, e));
      if (masked && !mask.visible(query, key)) prob = 0.f;
      float kept = 1.f;
      if (kExtras && dropping) kept = dropout.keep(query, key) ? dropout_scale : 0.f;
      float ds = prob * (dp[0][nt][e] * kept - delta(local, e));
      if constexpr (kExtras) ds *= mod.chain(raw);
      s[0][nt][e] = prob * kept;
      dp[0][nt][e] = ds;
    }
}

// @tparam kBlockM   query rows per step; a multiple of 16
// @tparam kBlockN   key rows per CTA, 16 per warp
// @tparam kStages   shared buffers for Q / dO: 2 overlaps the next step's load
// @tparam kColSplit passes over the head dim: dK and dV columns are split so that
//                   their accumulators fit in registers for large head dims
// (__launch_bounds__ minimum 1 block: without it ptxas caps small CTAs near 168
// registers and spills.)
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLocal, bool kVec,
          bool kExtras, int kColSplit>
__global__ void __launch_bounds__(kWarps * 32, 1) attention_backward_dkdv(const Params p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  constexpr int kCols = kHeadDim / kColSplit;
  constexpr int kQkUnroll = qk_unroll(kHeadDim);
  static_assert(kBlockN == 16 * kWarps && kBlockM % 16 == 0 && kCols % 16 == 0, "tile shape");

  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* k_tile = reinterpret_cast<elem_t*>(smem);
  elem_t* v_tile = k_tile + kBlockN * kStride;
  elem_t* q_tiles = v_tile + kBlockN * kStride;
  elem_t* do_tiles = q_tiles + kStages * kBlockM * kStride;
  float* lse_log2 = reinterpret_cast<float*>(do_tiles + kStages * kBlockM * kStride);  // [kStages][kBlockM]
  float* deltas = lse_log2 + kStages * kBlockM;                                // [kStages][kBlockM]

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
  const int key_end = min(n0 + kBlockN, seq.seqlen_k);
  const int m_begin = mask.query_begin(n0) / kBlockM;
  const int m_tiles = max(0, ceil_div(mask.query_end(key_end, seq.seqlen_q), kBlockM) - m_begin);
  const int steps = p.heads_per_kv * m_tiles;  // (query head of the group, query tile) pairs
  const float scale_log2 = kExtras ? kLog2e : p.scale_log2;
  const bool dropping = kExtras && p.dropout_threshold > 0;

  load_tile<kBlockN, kHeadDim, kThreads, kVec>(k_tile, k, p.k.row_stride, n0, seq.seqlen_k, p.headdim);
  load_tile<kBlockN, kHeadDim, kThreads, kVec>(v_tile, v, p.v.row_stride, n0, seq.seqlen_k, p.headdim);
  cp_async_commit();

  auto step_head = [&](int step) { return kv_head * p.heads_per_kv + step / max(m_tiles, 1); };
  auto step_m0 = [&](int step) { return (m_begin + step % max(m_tiles, 1)) * kBlockM; };
  auto load_step = [&](int step, int stage) {
    const int head = step_head(step), m0 = step_m0(step);
    load_tile<kBlockM, kHeadDim, kThreads, kVec>(q_tiles + stage * kBlockM * kStride, seq.rows(p.q, batch, head, true),
                                                 p.q.row_stride, m0, seq.seqlen_q, p.headdim);
    load_tile<kBlockM, kHeadDim, kThreads, kVec>(do_tiles + stage * kBlockM * kStride,
                                                 seq.rows(p.dout, batch, head, true), p.dout.row_stride, m0,
                                                 seq.seqlen_q, p.headdim);
    cp_async_commit();
    // Rows past seqlen_q get LSE = +inf, so their P is 0 like a fully masked row's.
    const int64 at = seq.lse_offset(p, batch, head) + m0;
    for (int i = threadIdx.x; i < kBlockM; i += kThreads) {
      const bool ok = m0 + i < seq.seqlen_q;
      lse_log2[stage * kBlockM + i] = ok ? p.lse[at + i] * kLog2e : kInf;
      deltas[stage * kBlockM + i] = ok ? p.delta[at + i] : 0.f;
    }
  };

#pragma unroll 1
  for (int pass = 0; pass < kColSplit; ++pass) {
    const int col0 = pass * kCols;
    float acc_dk[1][kCols / 8][4] = {}, acc_dv[1][kCols / 8][4] = {};
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

      ScoreMod mod{};
      Dropout dropout{};
      if constexpr (kExtras) {
        const float slope = p.alibi_slopes ? p.alibi_slopes[batch * p.alibi_batch_stride + head] : 0.f;
        mod = ScoreMod{p.scale, p.softcap, slope, mask.diagonal};
        dropout = Dropout{make_uint2(unsigned(p.seed), unsigned(p.seed >> 32)),
                          unsigned(batch * p.nheads + head), unsigned(p.rng_offset), p.dropout_threshold};
      }

      // dP^T = V dO^T and S^T = K Q^T: this warp's 16 keys x kBlockM queries.
      float acc_s[1][kBlockM / 8][4] = {}, acc_ds[1][kBlockM / 8][4] = {};
      gemm_qk<T, 1, kBlockM, kHeadDim, kQkUnroll>(acc_ds, v_tile, warp * 16, do_tile, lane);
      gemm_qk<T, 1, kBlockM, kHeadDim, kQkUnroll>(acc_s, k_tile, warp * 16, q_tile, lane);
      probabilities_and_gradients<true, kLocal, kExtras>(
          acc_s, acc_ds, scale_log2, !mask.covers(m0, min(m0 + kBlockM, seq.seqlen_q), n0, n0 + kBlockN), mask, mod,
          dropout, dropping, p.dropout_scale, [=](int c, int) { return step_lse[c]; },
          [=](int c, int) { return step_delta[c]; }, n0 + warp * 16, m0, lane);
      // dV += dropout(P)^T dO;  dK += dS^T Q (scaled once at the end)
      gemm_pv<T, 1, kBlockM, kCols, kStride>(acc_dv, acc_s, do_tile + col0, lane);
      gemm_pv<T, 1, kBlockM, kCols, kStride>(acc_dk, acc_ds, q_tile + col0, lane);

      __syncthreads();
      if (kStages == 1 && step + 1 < steps) load_step(step + 1, 0);
    }

    store_accumulators<T, kCols / 8, kVec>(dk, p.dk.row_stride, acc_dk[0], n0 + warp * 16, seq.seqlen_k, col0,
                                          p.headdim, p.scale, lane);
    store_accumulators<T, kCols / 8, kVec>(dv, p.dv.row_stride, acc_dv[0], n0 + warp * 16, seq.seqlen_k, col0,
                                          p.headdim, 1.f, lane);
  }
  cp_async_wait<0>();  // K/V copies are still pending when no query tile was visited
}

// dQ: one CTA per (query tile, head, batch), each warp 16 query rows, key tiles
// streamed as in the forward.
//   S = Q K^T;  P = exp(mod(S) - LSE);  dP = dropout(dO V^T);  dS = P (dP - D) mod'(S);  dQ += dS K
// kColSplit passes over the head dim keep the dQ accumulator within registers.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLocal, bool kVec,
          bool kExtras, int kColSplit>
__global__ void __launch_bounds__(kWarps * 32, 1) attention_backward_dq(const Params p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  constexpr int kCols = kHeadDim / kColSplit;
  constexpr int kQkUnroll = qk_unroll(kHeadDim);
  static_assert(kBlockM == 16 * kWarps && kBlockN % 16 == 0 && kCols % 16 == 0, "tile shape");

  extern __shared__ __align__(16) unsigned char smem[];
  elem_t* q_tile = reinterpret_cast<elem_t*>(smem);
  elem_t* do_tile = q_tile + kBlockM * kStride;
  elem_t* k_tiles = do_tile + kBlockM * kStride;
  elem_t* v_tiles = k_tiles + kStages * kBlockN * kStride;

  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
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
  const float scale_log2 = kExtras ? kLog2e : p.scale_log2;
  const bool dropping = kExtras && p.dropout_threshold > 0;
  ScoreMod mod{};
  Dropout dropout{};
  if constexpr (kExtras) {
    const float slope = p.alibi_slopes ? p.alibi_slopes[batch * p.alibi_batch_stride + head] : 0.f;
    mod = ScoreMod{p.scale, p.softcap, slope, mask.diagonal};
    dropout = Dropout{make_uint2(unsigned(p.seed), unsigned(p.seed >> 32)), unsigned(batch * p.nheads + head),
                      unsigned(p.rng_offset), p.dropout_threshold};
  }

  // This lane's two rows: LSE in log2 units (+inf past seqlen_q, so P = 0) and D.
  float row_lse[2], row_delta[2];
  const int64 at = seq.lse_offset(p, batch, head);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + warp * 16 + g + 8 * h;
    row_lse[h] = row < seq.seqlen_q ? p.lse[at + row] * kLog2e : kInf;
    row_delta[h] = row < seq.seqlen_q ? p.delta[at + row] : 0.f;
  }

  auto load_kv = [&](int n, int stage) {
    load_tile<kBlockN, kHeadDim, kThreads, kVec>(k_tiles + stage * kBlockN * kStride, k, p.k.row_stride,
                                                  n * kBlockN, seq.seqlen_k, p.headdim);
    load_tile<kBlockN, kHeadDim, kThreads, kVec>(v_tiles + stage * kBlockN * kStride, v, p.v.row_stride,
                                                  n * kBlockN, seq.seqlen_k, p.headdim);
    cp_async_commit();
  };
  load_tile<kBlockM, kHeadDim, kThreads, kVec>(q_tile, seq.rows(p.q, batch, head, true), p.q.row_stride, m0,
                                               seq.seqlen_q, p.headdim);
  load_tile<kBlockM, kHeadDim, kThreads, kVec>(do_tile, seq.rows(p.dout, batch, head, true), p.dout.row_stride, m0,
                                               seq.seqlen_q, p.headdim);
  cp_async_commit();

#pragma unroll 1
  for (int pass = 0; pass < kColSplit; ++pass) {
    const int col0 = pass * kCols;
    if (n_end > n_begin) load_kv(n_begin, 0);
    float acc_dq[1][kCols / 8][4] = {};
    for (int i = 0, n = n_begin; n < n_end; ++i, ++n) {
      const int stage = kStages == 2 ? i % 2 : 0;
      if (kStages == 2 && n + 1 < n_end) {
        load_kv(n + 1, (i + 1) % 2);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const elem_t* k_tile = k_tiles + stage * kBlockN * kStride;
      const elem_t* v_tile = v_tiles + stage * kBlockN * kStride;
      const int n0 = n * kBlockN;

      float acc_s[1][kBlockN / 8][4] = {}, acc_ds[1][kBlockN / 8][4] = {};
      gemm_qk<T, 1, kBlockN, kHeadDim, kQkUnroll>(acc_s, q_tile, warp * 16, k_tile, lane);
      gemm_qk<T, 1, kBlockN, kHeadDim, kQkUnroll>(acc_ds, do_tile, warp * 16, v_tile, lane);
      probabilities_and_gradients<false, kLocal, kExtras>(
          acc_s, acc_ds, scale_log2, !mask.covers(m0, row_end, n0, n0 + kBlockN), mask, mod, dropout, dropping,
          p.dropout_scale, [=](int, int e) { return row_lse[e >> 1]; }, [=](int, int e) { return row_delta[e >> 1]; },
          m0 + warp * 16, n0, lane);
      gemm_pv<T, 1, kBlockN, kCols, kStride>(acc_dq, acc_ds, k_tile + col0, lane);
      __syncthreads();
      if (kStages == 1 && n + 1 < n_end) load_kv(n + 1, 0);
    }
    cp_async_wait<0>();
    store_accumulators<T, kCols / 8, kVec>(dq, p.dq.row_stride, acc_dq[0], m0 + warp * 16, seq.seqlen_q, col0,
                                           p.headdim, p.scale, lane);
  }
}

}  // namespace cuflash
