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
// - attention_backward (bwd_one_pass.cu; FlashAttention-2's scheme, the default): the
//   same CTA adds dQ_i += dS K_j into an fp32 buffer with atomics, and
//   attention_backward_convert_dq scales and rounds it. Five matmuls per tile; the order
//   of the additions varies. The buffer is laid out in 8 x 16 blocks (dq_accum.cuh) so
//   that each warp-wide atomic covers 256 contiguous bytes.
// - attention_backward_dkdv + attention_backward_dq (bwd_two_kernel.cu; deterministic,
//   softcap / ALiBi / dropout up to d 128, and where the one-pass tiles do not fit the
//   shared memory; see cuflash/_plan/mma_sync.py): a second kernel, one CTA per query tile,
//   recomputes S and dP and keeps dQ in registers. Seven matmuls per tile, no atomics
//   anywhere: every gradient is bitwise reproducible.
//
// Both paths share the per-element step from S and dP to P and dS (softmax_bwd.cuh).
// This file holds the elementwise kernels around them: the preprocess (D, and the dQ
// accumulator zeroed) and the conversion of the accumulator into dq (after the backward, or
// beside the sm_90a backward's last CTAs; from DqAccum's order or its transposed one).
#include "common.cuh"
#include "dq_accum.cuh"
#include "params.cuh"

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

// Every row of `a` starts on 16 bytes: one test for the whole grid, so that a thread's
// loads of several rows go out together.
__device__ __forceinline__ bool rows_aligned16(const ArrayView& a) {
  return aligned16(a.ptr) && (a.batch_stride | a.row_stride | a.head_stride) % 8 == 0;
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
// block, 256 bytes apart, were half-sector stores). (_plan.PREPROCESS_ROWS is this
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
    zero_dq_accum(p, batch, rows_per_batch, accum_cols, thread);  // under the loads
#pragma unroll
    for (int k = 0; k < kPreprocessRows; ++k) {
      const unsigned xs[4] = {x[k].x, x[k].y, x[k].z, x[k].w}, ys[4] = {y[k].x, y[k].y, y[k].z, y[k].w};
#pragma unroll
      for (int w = 0; w < 4; ++w)
        sums[k] += DType<T>::to_float(elem_t(xs[w])) * DType<T>::to_float(elem_t(ys[w])) +
                   DType<T>::to_float(elem_t(xs[w] >> 16)) * DType<T>::to_float(elem_t(ys[w] >> 16));
    }
  } else {
    zero_dq_accum(p, batch, rows_per_batch, accum_cols, thread);
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
      if (p.dq_semaphore != nullptr) p.dq_semaphore[at] = 0;
    }
  }
}

// dQ = scale * dq_accum, rounded to the element type; the same tasks as the preprocess.
template <typename T>
__global__ void __launch_bounds__(256)
attention_backward_convert_dq(const Params p, int batch, int rows_per_batch, int accum_cols, int lanes) {
  const auto task = ElementwiseTask::of_thread(p, batch, rows_per_batch, lanes);
  if (!task.exists) return;
  convert_dq_row<T>(p, DqAccum::at(p.dq_accum, task.row, task.head, p.nheads, accum_cols, 0), task.at(p.dq.ptr, p.dq),
                    task.lane, lanes);
}

// The same from DqAccum's transposed order (the sm_90a backward at 80 rows a step: dense
// rows, a multiple of 8 a sequence). A thread a (group of 8 rows, head, block of 16 columns,
// t, g / 2), 16 a block: attention_backward_convert_dq_transposed.
template <typename T>
__global__ void __launch_bounds__(256)
attention_backward_convert_dq_transposed(const Params p, int batch, int rows_per_batch, int accum_cols, int) {
  const int64 thread = int64(blockIdx.x) * blockDim.x + threadIdx.x;
  const int blocks = accum_cols / 16;
  const int64 block = thread >> 4;  // (group of 8 rows, head, block of 16 columns)
  const int64 group_head = block / blocks;
  const int64 row = (group_head / p.nheads) * 8;
  if (row >= int64(batch) * rows_per_batch) return;
  convert_dq_transposed<T>(p, p.dq_accum + block * DqAccum::kBlockFloats, int(row / rows_per_batch),
                           int(row % rows_per_batch), int(group_head % p.nheads), int(block % blocks),
                           int(thread & 15));
}

// The same beside the sm_90a backward (launched as its programmatic dependent: it starts as
// the backward's last CTAs leave multiprocessors free): a grid column a (sequence, head),
// 256 / lanes of its rows a CTA, which first waits for every one of its KV head's
// `key_blocks` CTAs to have counted its end (Sm90BackwardParams::count_done), so that the
// heads done first are converted while the last ones still run.
template <typename T>
__global__ void __launch_bounds__(256) attention_backward_convert_dq_by_head(const Params p, int batch,
                                                                             int rows_per_batch, int accum_cols,
                                                                             int lanes, int key_blocks) {
  const int b = blockIdx.z, head = blockIdx.y, i = blockIdx.x * (blockDim.x / lanes) + threadIdx.x / lanes;
  if (threadIdx.x == 0)
    wait_count(DqAccum::counters(p.dq_accum, int64(batch) * rows_per_batch, p.nheads, accum_cols) +
                   b * (p.nheads / p.heads_per_kv) + head / p.heads_per_kv,
               key_blocks);
  __syncthreads();
  if (i >= rows_per_batch) return;
  convert_dq_row<T, true>(p, DqAccum::at(p.dq_accum, int64(b) * rows_per_batch + i, head, p.nheads, accum_cols, 0),
                          p.dq.ptr + b * p.dq.batch_stride + i * p.dq.row_stride + head * p.dq.head_stride,
                          int(threadIdx.x % lanes), lanes);
}

// The same from DqAccum's transposed order: a grid column a (sequence, head), 256 threads of
// its (group of 8 rows, block of 16 columns, t, g / 2) a CTA.
template <typename T>
__global__ void __launch_bounds__(256)
attention_backward_convert_dq_transposed_by_head(const Params p, int batch, int rows_per_batch, int accum_cols, int,
                                                 int key_blocks) {
  const int b = blockIdx.z, head = blockIdx.y, thread = blockIdx.x * blockDim.x + threadIdx.x;
  if (threadIdx.x == 0)
    wait_count(DqAccum::counters(p.dq_accum, int64(batch) * rows_per_batch, p.nheads, accum_cols) +
                   b * (p.nheads / p.heads_per_kv) + head / p.heads_per_kv,
               key_blocks);
  __syncthreads();
  const int blocks = accum_cols / 16, group = (thread >> 4) / blocks, col_block = (thread >> 4) % blocks;
  if (8 * group >= rows_per_batch) return;
  const int64 block = ((int64(b) * rows_per_batch / 8 + group) * p.nheads + head) * blocks + col_block;
  convert_dq_transposed<T, true>(p, p.dq_accum + block * DqAccum::kBlockFloats, b, 8 * group, head, col_block,
                                 thread & 15);
}

}  // namespace cuflash
