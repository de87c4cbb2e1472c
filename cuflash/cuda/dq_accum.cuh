// dQ's fp32 accumulator in the one-pass backward: its layout, zeroing it, and the
// reduction into it. bwd_one_pass.cu adds each step's dQ to it; bwd.cu zeroes it (in the
// preprocess) and rounds it into dq (attention_backward_convert_dq).
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

// fp32 (a, b) added to dst[0], dst[1] (8-byte aligned) without reading them back.
__device__ __forceinline__ void atomic_add_pair(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
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
  for (int64 i = thread; i < count; i += threads)
    reinterpret_cast<float4*>(p.dq_accum)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

}  // namespace cuflash
