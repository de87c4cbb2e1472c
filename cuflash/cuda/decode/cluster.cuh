// A thread block cluster (sm_90): CTAs launched together on one GPC that may write into
// each other's shared memory and wait for each other at a barrier. The KV-cache call's splits
// of one (sequence, KV head, row block) run as one cluster and merge their partial
// results there (split_kv.cu), with no second kernel and no workspace.
#pragma once
#include "common.cuh"

namespace cuflash {
namespace cluster {

// This CTA's rank in its cluster, and the cluster's CTAs.
__device__ __forceinline__ int rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return int(r);
}
__device__ __forceinline__ int size() {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return int(n);
}

// Every thread of every CTA of the cluster: the shared-memory writes before it are seen
// by the reads after it, in any CTA (release / acquire at cluster scope).
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The same barrier in two halves, for a phase whose only purpose is that every CTA has
// started (its shared memory may then be written from elsewhere): arrive at the start,
// wait before the first remote access, with work between.
__device__ __forceinline__ void arrive() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }

// The shared-memory address in CTA `rank` of what lies at `local` in this CTA's.
__device__ __forceinline__ unsigned remote(const float* local, int rank) {
  unsigned address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(address)
               : "r"(unsigned(__cvta_generic_to_shared(local))), "r"(rank));
  return address;
}
// x (four floats) to `local`'s place (16-byte aligned) in CTA `rank`'s shared memory.
__device__ __forceinline__ void store4(float* local, int rank, float4 x) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
               :: "r"(remote(local, rank)), "f"(x.x), "f"(x.y), "f"(x.z), "f"(x.w) : "memory");
}
__device__ __forceinline__ void store(float* local, int rank, float x) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote(local, rank)), "f"(x) : "memory");
}

}  // namespace cluster
}  // namespace cuflash
