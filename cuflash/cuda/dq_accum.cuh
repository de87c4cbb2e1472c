// dQ's fp32 accumulator in the one-pass backward: its layout, zeroing it, the reduction
// into it and its rounding into dq. bwd_one_pass.cu and sm90/bwd.cu add each step's dQ to
// it; bwd.cu zeroes it (in the preprocess) and rounds it into dq
// (attention_backward_convert_dq, or attention_backward_convert_dq_by_head beside the sm_90a
// backward's last CTAs; from the transposed order of its 80-row tile the _transposed twins).
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

#if __CUDA_ARCH__ >= 900
// fp32 (a, b, c, d) added to dst[0..3] (16-byte aligned) in one reduction.
__device__ __forceinline__ void atomic_add_quad(float* dst, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
#endif

// dQ's fp32 accumulator, (rows / 8, nheads, cols / 16, 8, 16): blocks of 8 rows x 16
// columns, a block's row holding its columns in pairs, (0 1 8 9) (2 3 10 11) (4 5 12 13)
// (6 7 14 15). A warp's reductions of an mma C fragment (8 rows x 8 columns) then write
// one 256-byte stretch, where the plain (rows, nheads, cols) layout spread them over 8
// lines (4x the L1 wavefronts, and at d 256 a full memory queue: ncu), and a lane's two
// pairs of neighbouring 8-column blocks are 16 contiguous bytes: one red.v4 on sm_90, and
// the fragments of 8 rows x 64 columns one contiguous 2 KB stretch for a bulk reduction.
// FlashAttention-2 and -3 also store this buffer in their reductions' order. `row` counts
// rows over all batches.
struct DqAccum {
  static constexpr int kBlockFloats = 8 * 16;
  // column `col`'s float in its row of a block
  static __device__ __forceinline__ int column(int col) {
    return (col >> 4) * kBlockFloats + ((col & 7) >> 1) * 4 + ((col >> 3) & 1) * 2 + (col & 1);
  }
  static __device__ __forceinline__ float* at(float* base, int64 row, int head, int nheads, int cols, int col) {
    return base + ((row >> 3) * nheads + head) * (8 * cols) + (row & 7) * 16 + column(col);
  }
  // The sm_90a backward at 80 rows a step adds dQ^T (rows: the head dim) and keeps each lane's
  // fragment whole: in a block, lane 4g + t's 16 bytes hold rows 2t and 2t + 1 of columns g
  // and g + 8, (2t, g) (2t + 1, g) (2t, g + 8) (2t + 1, g + 8); the blocks' order is the
  // same. Row r's (of a block) column c at:
  static __device__ __forceinline__ int transposed(int r, int c) {
    return (c & 7) * 16 + (r >> 1) * 4 + ((c >> 3) & 1) * 2 + (r & 1);
  }
  // floats from one row to the one 8 rows further down
  static __device__ __forceinline__ int64 eight_rows(int nheads, int cols) { return int64(8) * cols * nheads; }
  // After the rows (`rows` of all sequences): an int32 counter a (sequence, query head),
  // zeroed with them (_plan.backward_workspace allocates it): the sm_90a backward counts
  // there, for each (sequence, KV head), its key blocks whose dQ is all added.
  static __device__ __forceinline__ int* counters(float* base, int64 rows, int nheads, int cols) {
    return reinterpret_cast<int*>(base + ceil_div(rows, int64(8)) * 8 * nheads * cols);
  }
};

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<unsigned long long>(p) % 16 == 0; }

// A load of dQ's accumulator, through L2 only where `kThroughL2`.
template <bool kThroughL2, typename X>
__device__ __forceinline__ X load_accum(const X* from) {
  if constexpr (kThroughL2) return __ldcg(from);
  else return *from;
}

// One row of dQ: the accumulator's row (`accum`, DqAccum::at's column 0) times the scale,
// rounded into `dq`, by `lanes` lanes from `lane`, 16 bytes of dq a lane where the row
// allows it. kThroughL2: read through L2 only (beside the backward, whose CTAs add the rows
// there while this kernel runs); after it, plain loads.
template <typename T, bool kThroughL2 = false>
__device__ __forceinline__ void convert_dq_row(const Params& p, const float* accum, elem_t* dq, int lane, int lanes) {
  if (p.headdim % 8 == 0 && aligned16(dq)) {
    for (int c = 8 * lane; c < p.headdim; c += 8 * lanes) {
      const float* pairs = accum + DqAccum::column(c);  // columns c + 2i, c + 2i + 1 at 4i
      float2 x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = load_accum<kThroughL2>(reinterpret_cast<const float2*>(pairs + 4 * i));
      *reinterpret_cast<uint4*>(dq + c) =
          make_uint4(DType<T>::pack(x[0].x * p.scale, x[0].y * p.scale), DType<T>::pack(x[1].x * p.scale, x[1].y * p.scale),
                     DType<T>::pack(x[2].x * p.scale, x[2].y * p.scale), DType<T>::pack(x[3].x * p.scale, x[3].y * p.scale));
    }
  } else {
    for (int c = lane; c < p.headdim; c += lanes)
      dq[c] = DType<T>::from_float(load_accum<kThroughL2>(accum + DqAccum::column(c)) * p.scale);
  }
}

// Rows i + 2t and i + 2t + 1 of sequence b's dQ, columns g, g + 1, g + 8 and g + 9 of the
// head's block `col_block` of 16 (g = 2 (quad / 4), t = quad % 4), from a block of DqAccum's
// transposed order whose first row is i (two float4: rows 2t and 2t + 1 of columns g and
// g + 8, then of g + 1 and g + 9), times the scale, rounded into four pairs (single elements
// where dq's rows or head dim are odd). kThroughL2 as convert_dq_row.
template <typename T, bool kThroughL2 = false>
__device__ __forceinline__ void convert_dq_transposed(const Params& p, const float* block, int b, int i, int head,
                                                      int col_block, int quad) {
  const int t = quad & 3, g = (quad >> 1) & 6;
  const float4 x = load_accum<kThroughL2>(reinterpret_cast<const float4*>(block + DqAccum::transposed(2 * t, g)));
  const float4 y = load_accum<kThroughL2>(reinterpret_cast<const float4*>(block + DqAccum::transposed(2 * t, g + 1)));
  const bool pairs = p.headdim % 2 == 0 && reinterpret_cast<unsigned long long>(p.dq.ptr) % 4 == 0 &&
                     (p.dq.batch_stride | p.dq.row_stride | p.dq.head_stride) % 2 == 0;
  elem_t* const rows = p.dq.ptr + b * p.dq.batch_stride + int64(i + 2 * t) * p.dq.row_stride + head * p.dq.head_stride;
  auto store = [&](int r, int col, float a, float c) {
    if (col >= p.headdim) return;
    elem_t* dq = rows + r * p.dq.row_stride + col;
    if (pairs) {
      *reinterpret_cast<unsigned*>(dq) = DType<T>::pack(a * p.scale, c * p.scale);
    } else {
      dq[0] = DType<T>::from_float(a * p.scale);
      if (col + 1 < p.headdim) dq[1] = DType<T>::from_float(c * p.scale);
    }
  };
  const int col = 16 * col_block + g;
  store(0, col, x.x, y.x);
  store(1, col, x.y, y.y);
  store(0, col + 8, x.z, y.z);
  store(1, col + 8, x.w, y.w);
}

// dQ's additions in a fixed order (deterministic): the key blocks that add to a query
// block take turns, their turn counted on a semaphore in global memory. One thread waits
// for its block's turn (acquire), its CTA's additions follow; once they are done, one
// thread passes the turn on (release).
__device__ __forceinline__ void wait_turn(const int* semaphore, int turn) {
  int now;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(now) : "l"(semaphore) : "memory");
  } while (now != turn);
}
__device__ __forceinline__ void pass_turn(int* semaphore) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(semaphore) : "memory");
}

// One more on `counter` (release: the CTA's additions, fenced and met before it).
__device__ __forceinline__ void count_done(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}
// Until `counter` reaches `count` (acquire), sleeping between reads.
__device__ __forceinline__ void wait_count(const int* counter, int count) {
  for (int now = 0;; __nanosleep(128)) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(now) : "l"(counter) : "memory");
    if (now >= count) return;
  }
}

// All of dQ's accumulator, (rows / 8 rounded up, nheads, accum_cols / 16, 8, 16) floats, and
// its counters, set to zero by the grid's threads, 16 contiguous bytes each at a time
// (nothing where `accum_cols` is 0: the two-pass backward has no accumulator).
__device__ __forceinline__ void zero_dq_accum(const Params& p, int batch, int rows_per_batch, int accum_cols,
                                              int64 thread) {
  const int64 rows = int64(batch) * rows_per_batch;
  const int64 count = accum_cols == 0 ? 0
                                      : (ceil_div(rows, int64(8)) * 8 * p.nheads * accum_cols +
                                         ceil_div(int64(batch) * p.nheads, int64(4)) * 4) / 4;  // float4s
  const int64 threads = int64(gridDim.x) * blockDim.x;
  for (int64 i = thread; i < count; i += threads)
    reinterpret_cast<float4*>(p.dq_accum)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

}  // namespace cuflash
