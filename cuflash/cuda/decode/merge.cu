// Partial attention results over disjoint key sets -> the result over their union
// (partial.cuh): the merge step of the KV-cache call's splits, and cuflash.merge_states.
// One warp per output row (batch, query, head); its lanes take the columns in turn.
#include "common.cuh"
#include "decode/decode_params.cuh"
#include "decode/partial.cuh"

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

constexpr int kMergeWarps = 4;
constexpr int kMergeColumns = 8;  // per lane: head dims up to 256

// @tparam TIn, TOut  float, half_t or bfloat16_t
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kMergeWarps * 32) merge_states(const MergeParams p) {
  const int lane = threadIdx.x % 32;
  const int64 task = int64(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  if (task >= int64(p.batch) * p.seqlen_q * p.nheads) return;
  const int head = int(task % p.nheads), query = int(task / p.nheads % p.seqlen_q);
  const int batch = int(task / (int64(p.nheads) * p.seqlen_q));
  const float* lses = p.lses + batch * p.lse_batch_stride + head * p.lse_head_stride + query;
  const int64 row = batch * p.batch_stride + query * p.row_stride + head * p.head_stride;

  PartialMerge merge;
  for (int i = 0; i < p.count; ++i) merge.see(lses[i * p.lse_part_stride]);
  float acc[kMergeColumns] = {};
  for (int i = 0; i < p.count; ++i) {
    const float weight = merge.weigh(lses[i * p.lse_part_stride]);
    if (weight == 0.f) continue;  // an empty part: its O is not read
#pragma unroll
    for (int j = 0; j < kMergeColumns; ++j) {
      const int c = lane + 32 * j;
      if (c < p.headdim) acc[j] += weight * Storage<TIn>::load(p.parts, i * p.part_stride + row + c);
    }
  }
  const float scale = merge.out_scale();
  const int64 out = batch * p.out_batch_stride + query * p.out_row_stride + head * p.out_head_stride;
#pragma unroll
  for (int j = 0; j < kMergeColumns; ++j) {
    const int c = lane + 32 * j;
    if (c < p.headdim) Storage<TOut>::store(p.out, out + c, acc[j] * scale);
  }
  if (lane == 0 && p.out_lse != nullptr) p.out_lse[(int64(batch) * p.nheads + head) * p.seqlen_q + query] = merge.lse();
}

}  // namespace cuflash
