// The tensor memory accelerator (TMA) and the barriers it signals (sm_90).
//
// A tensor map (built on the host by cuTensorMapEncodeTiled, cuflash/_tensormap.py)
// describes a global array and a box; one thread asks for a box at some coordinates and
// the copy engine writes it into shared memory in the map's swizzle, rows outside the
// array as zeros, then adds the bytes it wrote to an mbarrier's transaction count. Threads
// wait on the barrier's phase: it completes when the expected bytes have all arrived.
#pragma once
#include "common.cuh"

namespace cuflash {
namespace sm90 {

// The 128-byte CUtensorMap, passed by value inside the kernel's parameters (a
// __grid_constant__ parameter, so that TMA may read it where it lies).
struct alignas(64) TensorMap {
  unsigned long long v[16];
};

struct Barrier {
  unsigned long long* at;  // in shared memory

  __device__ __forceinline__ void init(int arrivals) const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(at)), "r"(arrivals));
  }
  // Make initialised barriers visible to the copy engine (then a CTA barrier).
  static __device__ __forceinline__ void fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // This thread's arrival, announcing `bytes` more to come from the copy engine.
  __device__ __forceinline__ void arrive_expecting(unsigned bytes) const {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(at)), "r"(bytes)
                 : "memory");
  }
  // This thread's arrival (with no bytes to wait for).
  __device__ __forceinline__ void arrive() const {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(at)) : "memory");
  }
  // Wait until phase `parity` (0, 1, 0, ... for its successive completions) has completed.
  __device__ __forceinline__ void wait(int parity) const {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_addr(at)),
        "r"(parity)
        : "memory");
  }
};

// Box (c0, c1, c2, c3) of a 4-D map (innermost coordinate first) -> shared memory at dst;
// its bytes count toward `barrier`.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap& map, const Barrier& barrier, int c0, int c1,
                                         int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(smem_addr(barrier.at)), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3)
      : "memory");
}

// fp32 `bytes` (a multiple of 16) of shared memory at src added to global memory at dst by
// the copy engine, in this thread's bulk group (sm90::bulk_commit).
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most kPending of this thread's bulk groups may still read their shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Until at most kPending of this thread's bulk groups are unfinished (their writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace sm90
}  // namespace cuflash
