// What the two sm_90a backwards (bwd.cu, bwd_wide.cu) share: their shared memory's K and V
// of the CTA's key block, loaded once by TMA, and its barriers; the launch's check; the fence
// and the meeting of the consumer warpgroups around the products that read shared memory.
#pragma once
#include "common.cuh"
#include "sm90/tma.cuh"

namespace cuflash {

// A backward's shared memory (a Layout of shared_memory.cuh, from a 1024-byte aligned base):
// K and V of the key block, and the barriers, K/V's "landed" first.
template <class Layout>
struct Sm90KeyBlockShared : Layout {
  unsigned char* base;

  static __device__ __forceinline__ unsigned char* aligned(unsigned char* dynamic) {
    return dynamic + ((1024 - (smem_addr(dynamic) & 1023)) & 1023);
  }
  __device__ __forceinline__ unsigned char* k() const { return base + Layout::kK; }
  __device__ __forceinline__ unsigned char* v() const { return base + Layout::kV; }
  __device__ __forceinline__ sm90::Barrier barrier(int index) const {
    return {reinterpret_cast<unsigned long long*>(base + Layout::kBarriers) + index};
  }
  __device__ __forceinline__ sm90::Barrier kv_landed() const { return barrier(0); }
  // K and V of the block's rows from `row`, by one thread; boxes past a packed sequence's end
  // bring the next one's rows, which the mask and the LSE of +inf take out.
  template <typename Args>
  __device__ __forceinline__ void load_kv(const Args& args, int row, int kv_head, int batch) const {
    kv_landed().arrive_expecting(2 * Layout::kKvTile);
#pragma unroll
    for (int c = 0; c < Layout::kColumnBlocks; ++c) {
      sm90::tma_load(k() + c * Layout::kKvBlock, args.k, kv_landed(), 64 * c, row, kv_head, batch);
      sm90::tma_load(v() + c * Layout::kKvBlock, args.v, kv_landed(), 64 * c, row, kv_head, batch);
    }
  }
};

// Thread 0 checks that the launch's shared memory holds the layout (the planner's
// shared_bytes) and sets up the barriers; then the CTA meets.
template <class Shared>
__device__ __forceinline__ void set_up_shared(const Shared& shared, int consumer_threads) {
  if (threadIdx.x == 0) {
    unsigned launched;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(launched));
    if (launched < Shared::kBytes) __trap();
    shared.init_barriers(consumer_threads);
  }
  __syncthreads();
}

// This thread's stores to shared memory, before the tensor cores' reads of it.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// The copy engine's writes to global memory before this thread's next ordinary accesses.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// The two consumer warpgroups meet (named barrier 1).
__device__ __forceinline__ void consumers_meet() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

}  // namespace cuflash
