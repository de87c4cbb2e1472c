// Partial attention results over disjoint key sets -> the result over their union
// (partial.cuh): the merge step of the KV-cache call's splits, and cuflash.merge_states.
#include "common.cuh"
#include "decode/decode_params.cuh"
#include "partial.cuh"

namespace cuflash {

// Element storage of the parts and the output: fp32, or a 16-bit type.
template <typename T> struct Storage {
  static __device__ __forceinline__ float load(const void* base, int64 i) {
    return DType<T>::to_float(static_cast<const elem_t*>(base)[i]);
  }
  static __device__ __forceinline__ void store(void* base, int64 i, float x) {
    static_cast<elem_t*>(base)[i] = DType<T>::from_float(x);
  }
};
template <> struct Storage<float> {
  static __device__ __forceinline__ float load(const void* base, int64 i) { return static_cast<const float*>(base)[i]; }
  static __device__ __forceinline__ void store(void* base, int64 i, float x) { static_cast<float*>(base)[i] = x; }
};

constexpr int kMergeWarps = 4;    // per output row: each takes every kMergeWarps-th part
constexpr int kMergeColumns = 8;  // per lane: head dims up to 256

// One CTA per output row (batch, query, head). The parts' LSEs are few: every warp reads
// them all. The O rows are many (a KV-cache call's splits): warp w sums parts w, w + 4,
// ..., several loads in flight each, and the four sums are added in warp order.
// @tparam TIn, TOut  float, half_t or bfloat16_t
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kMergeWarps * 32) merge_states(const MergeParams p) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64 task = blockIdx.x;
  const int head = int(task % p.nheads), query = int(task / p.nheads % p.seqlen_q);
  const int batch = int(task / (int64(p.nheads) * p.seqlen_q));
  const float* lses = p.lses + batch * p.lse_batch_stride + head * p.lse_head_stride + query;
  const int64 row = batch * p.batch_stride + query * p.row_stride + head * p.head_stride;
  wait_for_prerequisites();  // (the KV-cache call's split kernel, where it launched this one early)

  // The LSEs, lane j taking parts j, j + 32, ...: the top and the total over the warp.
  PartialMerge merge;
  for (int i = lane; i < p.count; i += 32) merge.see(lses[i * p.lse_part_stride]);
  merge.top_of_warp();
  for (int i = lane; i < p.count; i += 32) merge.weigh(lses[i * p.lse_part_stride]);
  merge.total_of_warp();
  // This warp's share of sum_i w_i O_i, each part's weight passed round from its lane. The
  // loads do not wait on the weights; an empty part's O, read but weighted by a select,
  // adds nothing, whatever it holds.
  float acc[kMergeColumns] = {};
  for (int first = 0; first < p.count; first += 32) {
    const float mine = first + lane < p.count ? merge.weight(lses[(first + lane) * p.lse_part_stride]) : 0.f;
    const int parts = min(32, p.count - first);
#pragma unroll 4
    for (int j = warp; j < parts; j += kMergeWarps) {
      const float weight = __shfl_sync(0xffffffffu, mine, j);
      const int64 part = (first + j) * p.part_stride + row;
#pragma unroll
      for (int c = 0; c < kMergeColumns; ++c) {
        const int col = lane + 32 * c;
        if (col < p.headdim) {
          const float x = Storage<TIn>::load(p.parts, part + col);
          acc[c] += PartialMerge::weighted(weight, x);
        }
      }
    }
  }
  __shared__ float sums[kMergeWarps][kMergeColumns * 32];
#pragma unroll
  for (int c = 0; c < kMergeColumns; ++c) sums[warp][c * 32 + lane] = acc[c];
  __syncthreads();
  if (warp != 0) return;
  const float scale = merge.out_scale();
  const int64 out = batch * p.out_batch_stride + query * p.out_row_stride + head * p.out_head_stride;
#pragma unroll
  for (int c = 0; c < kMergeColumns; ++c) {
    const int col = lane + 32 * c;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) sum += sums[w][c * 32 + lane];
    if (col < p.headdim) Storage<TOut>::store(p.out, out + col, sum * scale);
  }
  if (lane == 0 && p.out_lse != nullptr) p.out_lse[(int64(batch) * p.nheads + head) * p.seqlen_q + query] = merge.lse();
}

}  // namespace cuflash
