// FlashAttention backward. P is recomputed from the saved LSE, never stored:
//
//   D = rowsum(dO * O) - dLSE                               attention_backward_preprocess
//   for each key tile j (one CTA), for each query head of the group and query tile i:
//     S = Q_i K_j^T,  P = exp(mod(S) - LSE)
//     dV_j += dropout(P)^T dO_i;  dP = dropout(dO_i V_j^T);  dS = P (dP - D_i) mod'(S)
//     dK_j += scale dS^T Q_i
//
// dK and dV stay in registers across the whole loop (fp32, summed over the query
// heads that share the KV head, so GQA needs no atomics). dQ comes one of two ways:
//
// - attention_backward (FlashAttention-2's scheme, the default): the same CTA adds
//   dQ_i += dS K_j into an fp32 buffer with atomics, and attention_backward_convert_dq
//   scales and rounds it. Five matmuls per tile; the order of the additions varies.
//   The buffer is laid out in 8 x 8 blocks (DqAccum below) so that each warp-wide
//   atomic covers 256 contiguous bytes.
// - attention_backward_dkdv + attention_backward_dq (deterministic, head dims the
//   one-pass warp layout does not divide, softcap / ALiBi / dropout up to d 128; see
//   cuflash/_plan.py): a second kernel, one CTA per
//   query tile, recomputes S and dP and keeps dQ in registers. Seven matmuls per tile,
//   no atomics anywhere: every gradient is bitwise reproducible.
#include "common.cuh"
#include "copy.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "score.cuh"

namespace cuflash {

// The two elementwise kernels below give each (row, head) task `lanes` lanes (head dim
// / 8 rounded up to a power of two, 4-32, so 8 * lanes >= head dim) and each lane 16
// bytes of the row where the row allows it: memory-bound, they move as many bytes per
// instruction as they can. Rows are numbered batch-major over `batch` groups of
// `rows_per_batch` (one group of all rows for packed arrays).
struct ElementwiseTask {
  int64 task, row;  // task = row * nheads + head; row counts rows over all batches
  int b, i, head, lane;
  bool exists;

  static __device__ __forceinline__ ElementwiseTask of(const Params& p, int batch, int rows_per_batch, int64 task,
                                                       int lane) {
    const int64 row = task / p.nheads;
    return ElementwiseTask{task, row, int(row / rows_per_batch), int(row % rows_per_batch), int(task % p.nheads),
                           lane, task < int64(batch) * rows_per_batch * p.nheads};
  }
  static __device__ __forceinline__ ElementwiseTask of_thread(const Params& p, int batch, int rows_per_batch,
                                                              int lanes) {
    return of(p, batch, rows_per_batch, (int64(blockIdx.x) * blockDim.x + threadIdx.x) / lanes,
              int(threadIdx.x % lanes));
  }
  template <typename Pointer>
  __device__ __forceinline__ Pointer at(Pointer base, const ArrayView& a) const {
    return base + b * a.batch_stride + i * a.row_stride + head * a.head_stride;
  }
};

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<unsigned long long>(p) % 16 == 0; }
// Every row of `a` starts on 16 bytes: one test for the whole grid, so that a thread's
// loads of several rows go out together.
__device__ __forceinline__ bool rows_aligned16(const ArrayView& a) {
  return aligned16(a.ptr) && (a.batch_stride | a.row_stride | a.head_stride) % 8 == 0;
}

// dQ's fp32 accumulator, (rows / 8, nheads, cols / 8, 8, 8): 8 x 8 blocks, row-major
// inside. A warp's red.v2 of an mma C fragment (8 rows x 8 columns) then writes one
// 256-byte block, where the plain (rows, nheads, cols) layout spread it over 8 lines:
// 4x the L1 wavefronts, and at d 256 a full memory queue (ncu). FlashAttention-2 also
// stores this buffer in its atomics' order. `row` counts rows over all batches.
struct DqAccum {
  static constexpr int kColBlock = 64;  // floats from one 8-column block to the next
  static __device__ __forceinline__ float* at(float* base, int64 row, int head, int nheads, int cols, int col) {
    return base + ((row >> 3) * nheads + head) * (8 * cols) + (col >> 3) * kColBlock + (row & 7) * 8 + (col & 7);
  }
  // floats from one row to the one 8 rows further down
  static __device__ __forceinline__ int64 eight_rows(int nheads, int cols) { return int64(8) * cols * nheads; }
};

// All of dQ's accumulator, (rows / 8 rounded up, nheads, accum_cols / 8, 8, 8) floats,
// set to zero by the grid's threads, 16 contiguous bytes each at a time.
__device__ __forceinline__ void zero_dq_accum(const Params& p, int64 rows, int accum_cols, int64 thread) {
  const int64 count = ceil_div(rows, int64(8)) * 8 * p.nheads * accum_cols / 4;  // float4s
  const int64 threads = int64(gridDim.x) * blockDim.x;
  for (int64 i = thread; i < count; i += threads) reinterpret_cast<float4*>(p.dq_accum)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// D = rowsum(dO * O) - dLSE in fp32, and the dQ accumulator (accum_cols floats a row, a
// multiple of 8; 0 without one) set to zero. dLSE, the loss's gradient with respect to
// the LSE (0 where p.dlse is null): LSE = logsumexp(S) adds dLSE * P to dS = P (dP - D),
// so it joins D. A row whose LSE is +inf sees no key (P = 0) and takes none of it: a NaN
// or inf gradient there would make 0 * NaN in dS. Each group of `lanes` threads takes
// kPreprocessRows tasks, task_groups apart (a warp's loads stay contiguous), and issues
// all their loads before it adds: with one task a thread, one 16-byte load of each
// tensor was in flight and the kernel ran at half FlashAttention-2's bandwidth (122-125
// us against its 67-68 at seqlen 512 and 1k; now about 70). The zeros go out in the
// accumulator's own order, 16 contiguous bytes a lane (a row's 8 floats of each 8 x 8
// block, 256 bytes apart, were half-sector stores). (_kernels.PREPROCESS_ROWS is this
// count.)
constexpr int kPreprocessRows = 4;

template <typename T>
__global__ void __launch_bounds__(256)
attention_backward_preprocess(const Params p, int batch, int rows_per_batch, int accum_cols, int lanes) {
  const int64 thread = int64(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64 rows = int64(batch) * rows_per_batch;
  const int64 n_tasks = rows * p.nheads, task_groups = ceil_div(n_tasks, int64(kPreprocessRows));
  const int64 group = thread / lanes;  // the grid may hold more groups than there are
  ElementwiseTask tasks[kPreprocessRows];
#pragma unroll
  for (int k = 0; k < kPreprocessRows; ++k)
    tasks[k] = ElementwiseTask::of(p, batch, rows_per_batch, group < task_groups ? group + k * task_groups : n_tasks,
                                   int(thread % lanes));
  const int lane = tasks[0].lane;
  float sums[kPreprocessRows] = {};
  if (p.headdim % 8 == 0 && rows_aligned16(p.dout) && rows_aligned16(p.o)) {
    uint4 x[kPreprocessRows], y[kPreprocessRows];
#pragma unroll
    for (int k = 0; k < kPreprocessRows; ++k) {
      const bool load = tasks[k].exists && 8 * lane < p.headdim;
      x[k] = load ? *reinterpret_cast<const uint4*>(tasks[k].at(p.dout.ptr, p.dout) + 8 * lane) : uint4{};
      y[k] = load ? *reinterpret_cast<const uint4*>(tasks[k].at(p.o.ptr, p.o) + 8 * lane) : uint4{};
    }
    zero_dq_accum(p, rows, accum_cols, thread);  // under the loads
#pragma unroll
    for (int k = 0; k < kPreprocessRows; ++k) {
      const unsigned xs[4] = {x[k].x, x[k].y, x[k].z, x[k].w}, ys[4] = {y[k].x, y[k].y, y[k].z, y[k].w};
#pragma unroll
      for (int w = 0; w < 4; ++w)
        sums[k] += DType<T>::to_float(elem_t(xs[w])) * DType<T>::to_float(elem_t(ys[w])) +
                   DType<T>::to_float(elem_t(xs[w] >> 16)) * DType<T>::to_float(elem_t(ys[w] >> 16));
    }
  } else {
    zero_dq_accum(p, rows, accum_cols, thread);
#pragma unroll
    for (int k = 0; k < kPreprocessRows; ++k) {
      if (!tasks[k].exists) continue;
      const elem_t* dO = tasks[k].at(p.dout.ptr, p.dout);
      const elem_t* O = tasks[k].at(p.o.ptr, p.o);
      for (int c = lane; c < p.headdim; c += lanes) sums[k] += DType<T>::to_float(dO[c]) * DType<T>::to_float(O[c]);
    }
  }
#pragma unroll
  for (int k = 0; k < kPreprocessRows; ++k) {
    for (int offset = lanes / 2; offset > 0; offset /= 2) sums[k] += __shfl_xor_sync(0xffffffffu, sums[k], offset);
    const ElementwiseTask& task = tasks[k];
    if (task.exists && lane == 0) {
      const int64 at = task.b * p.lse_batch_stride + task.head * p.lse_head_stride + task.i;
      p.delta[at] = sums[k] - (p.dlse != nullptr && p.lse[at] != kInf ? p.dlse[at] : 0.f);
    }
  }
}

// dQ = scale * dq_accum, rounded to the element type; the same tasks as the preprocess.
template <typename T>
__global__ void __launch_bounds__(256)
attention_backward_convert_dq(const Params p, int batch, int rows_per_batch, int accum_cols, int lanes) {
  const auto task = ElementwiseTask::of_thread(p, batch, rows_per_batch, lanes);
  if (!task.exists) return;
  elem_t* dq = task.at(p.dq.ptr, p.dq);
  const float* accum = DqAccum::at(p.dq_accum, task.row, task.head, p.nheads, accum_cols, 0);
  if (p.headdim % 8 == 0 && aligned16(dq)) {
    for (int c = 8 * task.lane; c < p.headdim; c += 8 * lanes) {
      const float* block_row = accum + (c >> 3) * DqAccum::kColBlock;
      const float4 lo = *reinterpret_cast<const float4*>(block_row), hi = *reinterpret_cast<const float4*>(block_row + 4);
      *reinterpret_cast<uint4*>(dq + c) =
          make_uint4(DType<T>::pack(lo.x * p.scale, lo.y * p.scale), DType<T>::pack(lo.z * p.scale, lo.w * p.scale),
                     DType<T>::pack(hi.x * p.scale, hi.y * p.scale), DType<T>::pack(hi.z * p.scale, hi.w * p.scale));
    }
  } else {
    for (int c = task.lane; c < p.headdim; c += lanes)
      dq[c] = DType<T>::from_float(accum[(c >> 3) * DqAccum::kColBlock + (c & 7)] * p.scale);
  }
}

// Above d 128, overlapping every k16 step of the two score products needs more
// registers than the gradient accumulators leave (ptxas spilled): at most 4, 2
// above d 192.
__host__ __device__ constexpr int qk_unroll(int head_dim) {
  return head_dim > 192 ? 2 : head_dim > 128 ? 4 : head_dim / 16;
}

// From the raw scores s = Q K^T and dP = dO V^T of a tile (mma C layout, kMTiles
// m16 tiles; with kTransposed the rows are keys and the columns queries), in place:
//   s  <- dropout(P), P = exp(mod(s) - LSE), 0 where hidden     (for dV)
//   dp <- dS = P (dropout(dP) - D) mod'(s)                       (for dK and dQ)
// lse_log2(i, e) / delta(i, e) give LSE * log2(e) and D of the query at index i of the
// tile's queries (element e of its fragment).
template <bool kTransposed, bool kLocal, bool kExtras, int kMTiles, int kNTiles, typename Lse, typename Delta>
__device__ __forceinline__ void probabilities_and_gradients(
    float (&s)[kMTiles][kNTiles][4], float (&dp)[kMTiles][kNTiles][4], float scale_log2, bool masked,
    const Mask<kLocal>& mask, const ScoreMod& mod, const Dropout& dropout, bool dropping, float dropout_scale,
    Lse lse_log2, Delta delta, int row0, int col0, int lane) {
  const int g = lane >> 2, t = lane & 3;
  // Without extras a hidden score becomes -inf before the exp, in a pass of its own
  // that only tiles crossing the mask's edge run: the loop below stays free of per-score
  // tests (folded into it, they doubled the integer work of every tile). (A modified
  // score of -inf need not be -inf, so extras mask P.)
  if (!kExtras && masked) mask.template apply<kTransposed>(s, row0, col0, lane);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = mt * 16 + g + 8 * (e >> 1), c = nt * 8 + 2 * t + (e & 1);
        const int query = kTransposed ? col0 + c : row0 + r, key = kTransposed ? row0 + r : col0 + c;
        const int local = kTransposed ? c : r;  // the query's index for lse_log2 / delta
        const float raw = s[mt][nt][e];
        float prob = fast_exp2((kExtras ? mod(raw, query, key) : raw) * scale_log2 - lse_log2(local, e));
        if (kExtras && masked && !mask.visible(query, key)) prob = 0.f;
        float kept = 1.f;
        if (kExtras && dropping) kept = dropout.keep(query, key) ? dropout_scale : 0.f;
        float ds = prob * (dp[mt][nt][e] * kept - delta(local, e));
        if constexpr (kExtras) ds *= mod.chain(raw);
        s[mt][nt][e] = prob * kept;
        dp[mt][nt][e] = ds;
      }
}

// fp32 (a, b) added to dst[0], dst[1] (8-byte aligned) without reading them back.
__device__ __forceinline__ void atomic_add_pair(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// One-pass backward: one CTA per (key tile, KV head, batch), dK and dV in registers,
// dQ added to p.dq_accum. Per step (query head of the group, query tile):
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
          bool kExtras>
__global__ void __launch_bounds__(kWarps * 32, 1) attention_backward(const Params p) {
  constexpr int kThreads = kWarps * 32;
  using S = SmemTile<kHeadDim>;
  using P = PaddedRows<kBlockN>;  // P and dS, [query][key]
  constexpr int kStride = S::kRowElems, kPStride = P::kRowElems;  // elements from one row to the next
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

  extern __shared__ __align__(128) unsigned char smem[];  // swizzled rows start on 128-byte lines
  elem_t* k_tile = reinterpret_cast<elem_t*>(smem);
  elem_t* v_tile = k_tile + kBlockN * kStride;
  elem_t* q_tiles = v_tile + kBlockN * kStride;
  elem_t* do_tiles = q_tiles + kStages * kBlockM * kStride;
  elem_t* p_tile = do_tiles + kStages * kBlockM * kStride;  // [kBlockM][kPStride]
  elem_t* ds_tile = p_tile + kBlockM * kPStride;
  float* lses = reinterpret_cast<float*>(ds_tile + kBlockM * kPStride);  // [kStages][kBlockM]
  float* deltas = lses + kStages * kBlockM;                             // [kStages][kBlockM]

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
  const int key_end = min(n0 + kBlockN, seq.seqlen_k);
  const int m_begin = mask.query_begin(n0) / kBlockM;
  const int m_tiles = max(0, ceil_div(mask.query_end(key_end, seq.seqlen_q), kBlockM) - m_begin);
  const int steps = p.heads_per_kv * m_tiles;  // (query head of the group, query tile) pairs
  const float scale_log2 = kExtras ? kLog2e : p.scale_log2;
  const bool dropping = kExtras && p.dropout_threshold > 0;

  load_tile<kBlockN, S, kThreads, kVec>(k_tile, seq.rows(p.k, batch, kv_head, false), p.k.row_stride, n0,
                                        seq.seqlen_k, p.headdim);
  load_tile<kBlockN, S, kThreads, kVec>(v_tile, seq.rows(p.v, batch, kv_head, false), p.v.row_stride, n0,
                                        seq.seqlen_k, p.headdim);
  cp_async_commit();

  // The steps walk (query head of the group, query tile) in order: each step's position
  // follows from the previous one's, with no division of a step index by m_tiles.
  struct Position {
    int head, m_tile;
  };
  auto following = [&](Position at) {
    return at.m_tile + 1 < m_begin + m_tiles ? Position{at.head, at.m_tile + 1} : Position{at.head + 1, m_begin};
  };
  // A step's loads in two parts (each its own cp.async group): Q, LSE and D, then dO.
  enum Part { kQ = 1, kDo = 2, kBoth = 3 };
  auto load_step = [&](Position at, int stage, int parts) {
    const int head = at.head, m0 = at.m_tile * kBlockM;
    if (parts & kQ)
      load_tile<kBlockM, S, kThreads, kVec>(q_tiles + stage * kBlockM * kStride,
                                            seq.rows(p.q, batch, head, true), p.q.row_stride, m0, seq.seqlen_q,
                                            p.headdim);
    if (parts & kDo)
      load_tile<kBlockM, S, kThreads, kVec>(do_tiles + stage * kBlockM * kStride,
                                            seq.rows(p.dout, batch, head, true), p.dout.row_stride, m0,
                                            seq.seqlen_q, p.headdim);
    if (!(parts & kQ)) {
      cp_async_commit();
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
      cp_async_4(lses + stage * kBlockM + i, p.lse + (ok ? lse_at + i : 0), ok);
      cp_async_4(deltas + stage * kBlockM + i, p.delta + (ok ? lse_at + i : 0), ok);
    }
    cp_async_commit();
  };

  float acc_dk[2][kKvCols / 8][4] = {}, acc_dv[2][kKvCols / 8][4] = {};
  Position at{kv_head * p.heads_per_kv, m_begin};
  if (steps > 0) load_step(at, 0, kBoth);
  if (kStages == 3 && steps > 1) load_step(following(at), 1, kBoth);

  for (int step = 0; step < steps; ++step, at = following(at)) {
    const int stage = step % kStages;
    // This step's Q, dO, LSE and D (loaded during an earlier step) are in; past this
    // barrier every warp is also done with the previous step's P, dS and stage buffers.
    if (kStages == 3 && step + 1 < steps) {
      cp_async_wait<1>();  // the next step's loads may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int head = at.head, m0 = at.m_tile * kBlockM;
    const elem_t* q_tile = q_tiles + stage * kBlockM * kStride;
    const elem_t* do_tile = do_tiles + stage * kBlockM * kStride;

    {  // S and dP of this warp's 32 queries x kSKeys keys -> P and dS in shared memory
      ScoreMod mod{};
      Dropout dropout{};
      score_extras<kExtras>(p, mask, batch, head, mod, dropout);
      const float* step_lse = lses + stage * kBlockM + s_row0;
      const float* step_delta = deltas + stage * kBlockM + s_row0;
      const int warp_rows = seq.seqlen_q - m0 - s_row0;  // of this warp's 32 rows, those that exist
      float acc_s[2][kSKeys / 8][4] = {}, acc_dp[2][kSKeys / 8][4] = {};
      gemm_qk<T, 2, kSKeys, S, kQkUnroll>(acc_s, q_tile, s_row0, k_tile + s_key0 * kStride, lane);
      gemm_qk<T, 2, kSKeys, S, kQkUnroll>(acc_dp, do_tile, s_row0, v_tile + s_key0 * kStride, lane);
      probabilities_and_gradients<false, kLocal, kExtras>(
          acc_s, acc_dp, scale_log2, !mask.covers(m0, min(m0 + kBlockM, seq.seqlen_q), n0, n0 + kBlockN), mask,
          mod, dropout, dropping, p.dropout_scale, [=](int r, int) { return !kExtras || r < warp_rows ? step_lse[r] * kLog2e : kInf; },
          [=](int r, int) { return step_delta[r]; }, m0 + s_row0, n0 + s_key0, lane);
      store_fragments<T, 2, kSKeys / 8, P>(p_tile + s_row0 * kPStride, s_key0, acc_s, lane);
      store_fragments<T, 2, kSKeys / 8, P>(ds_tile + s_row0 * kPStride, s_key0, acc_dp, lane);
    }
    __syncthreads();
    // The next step's loads (with three buffers, the step after's) go into a free stage
    // here, ahead of this step's dQ atomics in the memory queue, and have the three
    // products below to land in.
    // Above d 128 without a band, the next step's dO follows dV's product, apart from its
    // Q: one burst of copies less in the memory queue (d 256's LG-throttle stalls; +2.5-4.4%
    // in two A/B rounds, but -1 to -2% causal and -2 to -3.6% at d 128).
    constexpr bool kSplitLoads = kStages == 2 && kHeadDim > 128 && !kLocal;
    if (kStages == 2 && step + 1 < steps) load_step(following(at), (step + 1) % 2, kSplitLoads ? kQ : kBoth);
    if (kStages == 3 && step + 2 < steps) load_step(following(following(at)), (step + 2) % 3, kBoth);

    // dV += dropout(P)^T dO
    gemm_ss<T, 2, kKvCols, kBlockM, true, false, P, S>(acc_dv, p_tile, kv_key0, do_tile, kv_col0, lane);
    if (kSplitLoads && step + 1 < steps) load_step(following(at), (step + 1) % 2, kDo);
    // dQ += dS K for this warp's 32 queries x kDqCols columns, added to the fp32 buffer.
    // 64 columns a warp (d 256) go in two parts: the first part's reductions drain under
    // the second's products, in half the accumulator (+1-5% not causal in two A/B rounds).
    constexpr int kDqParts = kDqCols >= 64 ? 2 : 1, kPartCols = kDqCols / kDqParts;
#pragma unroll
    for (int part = 0; part < kDqParts; ++part) {
      const int col0 = dq_col0 + part * kPartCols;
      float acc_dq[2][kPartCols / 8][4] = {};
      gemm_ss<T, 2, kPartCols, kBlockN, false, false, P, S, kDqUnroll>(acc_dq, ds_tile + s_row0 * kPStride, 0,
                                                                        k_tile, col0, lane);
      // This lane's first row (g), then rows 8 apart: 8 x 8 blocks (DqAccum) one step of
      // eight_rows apart, from one address per step.
      const int64 first_row = seq.q_rows_before + m0 + s_row0 + g;
      float* dq_rows = DqAccum::at(p.dq_accum, first_row, head, p.nheads, kHeadDim, col0 + 2 * t);
      const int64 eight_rows = DqAccum::eight_rows(p.nheads, kHeadDim);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = mt * 16 + g + 8 * h;
          if (m0 + s_row0 + r >= seq.seqlen_q) continue;
          float* dst = dq_rows + (2 * mt + h) * eight_rows;
#pragma unroll
          for (int dt = 0; dt < kPartCols / 8; ++dt)
            atomic_add_pair(dst + dt * DqAccum::kColBlock, acc_dq[mt][dt][2 * h], acc_dq[mt][dt][2 * h + 1]);
        }
    }
    // dK += dS^T Q (scaled once at the end), after dQ: its products cover the atomics'
    // drain (FlashAttention-2's order; -0.6 to +5.6% in an A/B, the most causal)
    gemm_ss<T, 2, kKvCols, kBlockM, true, false, P, S>(acc_dk, ds_tile, kv_key0, q_tile, kv_col0, lane);
    if (kStages == 1 && step + 1 < steps) {
      __syncthreads();  // one buffer: every warp is done with this step's Q and dO
      load_step(following(at), 0, kBoth);
    }
  }
  cp_async_wait<0>();  // K/V copies are still pending when no query tile was visited
  __syncthreads();     // every warp is done reading K and V

  // dK and dV through the K and V tiles, so that the global stores are 16 bytes wide
  // and coalesced (from the fragments they were 4-byte pieces of 8 rows).
  store_fragments<T, 2, kKvCols / 8, S>(k_tile + kv_key0 * kStride, kv_col0, acc_dk, lane, p.scale);
  store_fragments<T, 2, kKvCols / 8, S>(v_tile + kv_key0 * kStride, kv_col0, acc_dv, lane);
  __syncthreads();
  const Sequence out_seq = Sequence::of(p, batch);
  store_tile<kBlockN, S, kThreads, kVec>(out_seq.rows(p.dk, batch, kv_head, false), k_tile, p.dk.row_stride,
                                         n0, out_seq.seqlen_k, p.headdim);
  store_tile<kBlockN, S, kThreads, kVec>(out_seq.rows(p.dv, batch, kv_head, false), v_tile, p.dv.row_stride,
                                         n0, out_seq.seqlen_k, p.headdim);
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
  using S = SmemTile<kHeadDim, true>;  // (copy.cuh: kXorAddress)
  constexpr int kStride = S::kRowElems;  // elements from one row of a tile to the next
  constexpr int kCols = kHeadDim / kColSplit;
  constexpr int kQkUnroll = qk_unroll(kHeadDim);
  static_assert(kBlockN == 16 * kWarps && kBlockM % 16 == 0 && kCols % 16 == 0, "tile shape");

  extern __shared__ __align__(128) unsigned char smem[];  // swizzled rows start on 128-byte lines
  elem_t* k_tile = reinterpret_cast<elem_t*>(smem);
  elem_t* v_tile = k_tile + kBlockN * kStride;
  elem_t* q_tiles = v_tile + kBlockN * kStride;
  elem_t* do_tiles = q_tiles + kStages * kBlockM * kStride;
  float* lse_log2 = reinterpret_cast<float*>(do_tiles + kStages * kBlockM * kStride);  // [kStages][kBlockM]
  float* deltas = lse_log2 + kStages * kBlockM;                                // [kStages][kBlockM]

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
  const int key_end = min(n0 + kBlockN, seq.seqlen_k);
  const int m_begin = mask.query_begin(n0) / kBlockM;
  const int m_tiles = max(0, ceil_div(mask.query_end(key_end, seq.seqlen_q), kBlockM) - m_begin);
  const int steps = p.heads_per_kv * m_tiles;  // (query head of the group, query tile) pairs
  const float scale_log2 = kExtras ? kLog2e : p.scale_log2;
  const bool dropping = kExtras && p.dropout_threshold > 0;

  load_tile<kBlockN, S, kThreads, kVec>(k_tile, k, p.k.row_stride, n0, seq.seqlen_k, p.headdim);
  load_tile<kBlockN, S, kThreads, kVec>(v_tile, v, p.v.row_stride, n0, seq.seqlen_k, p.headdim);
  cp_async_commit();

  auto step_head = [&](int step) { return kv_head * p.heads_per_kv + step / max(m_tiles, 1); };
  auto step_m0 = [&](int step) { return (m_begin + step % max(m_tiles, 1)) * kBlockM; };
  auto load_step = [&](int step, int stage) {
    const int head = step_head(step), m0 = step_m0(step);
    load_tile<kBlockM, S, kThreads, kVec>(q_tiles + stage * kBlockM * kStride, seq.rows(p.q, batch, head, true),
                                          p.q.row_stride, m0, seq.seqlen_q, p.headdim);
    load_tile<kBlockM, S, kThreads, kVec>(do_tiles + stage * kBlockM * kStride,
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
      score_extras<kExtras>(p, mask, batch, head, mod, dropout);

      // dP^T = V dO^T and S^T = K Q^T: this warp's 16 keys x kBlockM queries.
      float acc_s[1][kBlockM / 8][4] = {}, acc_ds[1][kBlockM / 8][4] = {};
      gemm_qk<T, 1, kBlockM, S, kQkUnroll>(acc_ds, v_tile, warp * 16, do_tile, lane);
      gemm_qk<T, 1, kBlockM, S, kQkUnroll>(acc_s, k_tile, warp * 16, q_tile, lane);
      probabilities_and_gradients<true, kLocal, kExtras>(
          acc_s, acc_ds, scale_log2, !mask.covers(m0, min(m0 + kBlockM, seq.seqlen_q), n0, n0 + kBlockN), mask, mod,
          dropout, dropping, p.dropout_scale, [=](int c, int) { return step_lse[c]; },
          [=](int c, int) { return step_delta[c]; }, n0 + warp * 16, m0, lane);
      // dV += dropout(P)^T dO;  dK += dS^T Q (scaled once at the end)
      gemm_pv<T, 1, kBlockM, kCols, S>(acc_dv, acc_s, do_tile, col0, lane);
      gemm_pv<T, 1, kBlockM, kCols, S>(acc_dk, acc_ds, q_tile, col0, lane);

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
  using S = SmemTile<kHeadDim, true>;  // (copy.cuh: kXorAddress)
  constexpr int kStride = S::kRowElems;  // elements from one row of a tile to the next
  constexpr int kCols = kHeadDim / kColSplit;
  constexpr int kQkUnroll = qk_unroll(kHeadDim);
  static_assert(kBlockM == 16 * kWarps && kBlockN % 16 == 0 && kCols % 16 == 0, "tile shape");

  extern __shared__ __align__(128) unsigned char smem[];  // swizzled rows start on 128-byte lines
  elem_t* q_tile = reinterpret_cast<elem_t*>(smem);
  elem_t* do_tile = q_tile + kBlockM * kStride;
  elem_t* k_tiles = do_tile + kBlockM * kStride;
  elem_t* v_tiles = k_tiles + kStages * kBlockN * kStride;

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

  auto load_kv = [&](int n, int stage) {
    load_tile<kBlockN, S, kThreads, kVec>(k_tiles + stage * kBlockN * kStride, k, p.k.row_stride,
                                          n * kBlockN, seq.seqlen_k, p.headdim);
    load_tile<kBlockN, S, kThreads, kVec>(v_tiles + stage * kBlockN * kStride, v, p.v.row_stride,
                                          n * kBlockN, seq.seqlen_k, p.headdim);
    cp_async_commit();
  };
  load_tile<kBlockM, S, kThreads, kVec>(q_tile, seq.rows(p.q, batch, head, true), p.q.row_stride, m0,
                                        seq.seqlen_q, p.headdim);
  load_tile<kBlockM, S, kThreads, kVec>(do_tile, seq.rows(p.dout, batch, head, true), p.dout.row_stride, m0,
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
      gemm_qk<T, 1, kBlockN, S, kQkUnroll>(acc_s, q_tile, warp * 16, k_tile, lane);
      gemm_qk<T, 1, kBlockN, S, kQkUnroll>(acc_ds, do_tile, warp * 16, v_tile, lane);
      probabilities_and_gradients<false, kLocal, kExtras>(
          acc_s, acc_ds, scale_log2, !mask.covers(m0, row_end, n0, n0 + kBlockN), mask, mod, dropout, dropping,
          p.dropout_scale, [=](int, int e) { return row_lse[e >> 1]; }, [=](int, int e) { return row_delta[e >> 1]; },
          m0 + warp * 16, n0, lane);
      gemm_pv<T, 1, kBlockN, kCols, S>(acc_dq, acc_ds, k_tile, col0, lane);
      __syncthreads();
      if (kStages == 1 && n + 1 < n_end) load_kv(n + 1, 0);
    }
    cp_async_wait<0>();
    store_accumulators<T, kCols / 8, kVec>(dq, p.dq.row_stride, acc_dq[0], m0 + warp * 16, seq.seqlen_q, col0,
                                           p.headdim, p.scale, lane);
  }
}

}  // namespace cuflash
