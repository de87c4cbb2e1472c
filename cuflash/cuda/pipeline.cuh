// The multi-stage load pipeline of the sm_80 kernels: operands that a loop's steps
// read from shared memory are copied there ahead of their step with cp.async, into
// kStages buffers that the steps take in turn.
//
//   step % kStages  the stage (buffer) a step's operands go to
//   issue           the kernel's copies of one step (load_tile, cp_async_4), then
//                   commit(): those copies become one group, the newest in flight
//   landed<k>()     every group but the newest k has landed, in this thread
//   sync()          the barrier after it: every thread's copies are visible to the CTA
//                   (and every warp is done with whatever came before it)
//   wait<k>()       the two together
//   release()       a barrier: every warp is done reading the step's buffers, so a
//                   later issue may overwrite them
//
// A step that issues a later step's copies before it waits, where there is one, is
// written out in the kernel as `if (ahead) { issue; commit(); landed<1>(); } else
// landed<0>(); sync();`: the same step as one call taking the issue as a lambda, or with
// the issue in an `if` of its own, came out as other machine code.
//
// Which step is issued when is the kernel's schedule (fwd.cu, bwd_*.cu: how far ahead,
// and where the issue sits among the products); these are its verbs.
#pragma once
#include "copy.cuh"
#include "layout.cuh"
#include "shared_memory.cuh"  // ForwardShared: the stages in shared memory

namespace cuflash {

struct LoadPipeline {
  static __device__ __forceinline__ void commit() { cp_async_commit(); }
  template <int kInFlight>
  static __device__ __forceinline__ void landed() { cp_async_wait<kInFlight>(); }
  static __device__ __forceinline__ void sync() { __syncthreads(); }
  template <int kInFlight>
  static __device__ __forceinline__ void wait() {
    landed<kInFlight>();
    sync();
  }
  static __device__ __forceinline__ void release() { __syncthreads(); }
};

// The kStages buffers of one operand: tiles of kRows rows in layout L, one after another.
template <typename L, int kRows, int kStages>
struct StagedTiles {
  elem_t* data;

  __device__ __forceinline__ SharedTile<L> operator[](int stage) const {
    return SharedTile<L>{data + stage * kRows * L::kRowElems};
  }
  // Stage `stage` from its row `row` on.
  __device__ __forceinline__ SharedTile<L> at(int stage, int row) const {
    return SharedTile<L>{data + (stage * kRows + row) * L::kRowElems};
  }
};

// The kStages buffers of kRows floats of a staged operand's rows (the backward's LSE
// and D).
template <int kRows, int kStages>
struct StagedRows {
  float* data;

  __device__ __forceinline__ float* operator[](int stage) const { return data + stage * kRows; }
  __device__ __forceinline__ float& at(int stage, int row) const { return data[stage * kRows + row]; }
};

}  // namespace cuflash
