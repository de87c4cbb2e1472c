// Warpgroup MMA (sm_90a): the four warps of a warpgroup multiply a 64-row A by a B in
// shared memory, asynchronously. The accumulator of m64nNk16 is, warp by warp, the
// mma.sync m16n8 layout of N / 8 tiles (warp w holds rows 16w .. 16w + 15): the
// accumulators are float[1][N / 8][4] as in the mma.sync kernels, and their masks, score
// modifiers and softmax apply unchanged.
//
// Operands in shared memory are described, not addressed: a 64-bit descriptor holds the
// start (bytes >> 4), two strides and the swizzle. Tiles here are TMA's 128-byte swizzle:
// rows of 64 16-bit elements, 8-row atoms of 1024 bytes, a head dim of d as d / 64 blocks
// of 64 columns one after the other.
//   K-major (Q as A, K as B for S = Q K^T): the stride between 8-row groups is 1024; a k16
//   step starts 32 bytes further into the rows (a block further every four steps).
//   N-major (V as B for O = P V, the transpose bit set): the leading stride is the bytes
//   between 64-column blocks, the other 1024 (8 keys); a k16 step starts 16 rows further.
// (PTX ISA, "Shared Memory Matrix Layout"; HOPPER.md for what was checked on the H200.)
#pragma once
#include "common.cuh"

namespace cuflash {
namespace sm90 {

struct SmemDesc {
  static __device__ __forceinline__ unsigned long long field(unsigned bytes) { return (bytes & 0x3FFFF) >> 4; }
  // 128-byte swizzle (1 << 62); stride between 8-row groups 1024 bytes.
  static __device__ __forceinline__ unsigned long long make(const void* start, unsigned leading_bytes) {
    return field(smem_addr(start)) | field(leading_bytes) << 16 | field(1024) << 32 | 1ull << 62;
  }
  static __device__ __forceinline__ unsigned long long k_major(const void* start) { return make(start, 16); }
  static __device__ __forceinline__ unsigned long long n_major(const void* start, unsigned block_bytes) {
    return make(start, block_bytes);
  }
};

// Ordering around the asynchronous products: fence (registers written by ordinary code,
// the accumulators among them, before a wgmma reads them), commit the issued products as a
// group, wait until at most kPending groups are in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// ptxas schedules a wgmma wait as early as its block allows, ahead of independent code
// written before it: the softmax meant to run while P V is in flight would wait for P V to
// land (in every variant without softcap, ALiBi or dropout). A shared-memory store of a
// value that code computes stays ahead of the wait (ptxas keeps stores and waits in
// order), and the code with it. One lane a word stores (a predicated store still waits for
// the value in every lane; words written by several threads are races to racecheck).
__device__ __forceinline__ void keep_before_wait(volatile float& sink, bool writer, float value) {
  if (writer) sink = value;
}

// The products write their accumulators asynchronously, until wgmma_wait; the compiler sees
// them written at the product's asm and could move ordinary code that reads them (or writes
// them, before a product) across the wait. An empty asm that "writes" each register pins
// that code on its side of the wait.
template <int kNTiles>
__device__ __forceinline__ void fence_operands(float (&d)[1][kNTiles][4]) {
#pragma unroll
  for (int j = 0; j < kNTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[0][j][e])::"memory");
}

// A warpgroup's registers a thread from here on: fewer for a producer, more for the
// consumers (setmaxnreg; ptxas heeds it only under __launch_bounds__(threads, 1) with each
// role one branch of an if/else, and says so otherwise: warning C7508).
template <int kRegisters, bool kMore>
__device__ __forceinline__ void set_max_registers() {
  if constexpr (kMore)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
  else
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// An accumulator (fp32, the m16n8 layout of a warp's 16 rows) as the A operand of a
// product that follows from registers (rs_bt), k16 step by step: columns 16j .. 16j + 15
// are the accumulator's n8 tiles 2j and 2j + 1 (P for O += P V; P^T and dS^T for dV and dK).
template <typename T, int kNTiles>
__device__ __forceinline__ void as_a_operand(const float (&s)[1][kNTiles][4], unsigned (&a)[kNTiles / 2][4]) {
#pragma unroll
  for (int j = 0; j < kNTiles / 2; ++j) {
    a[j][0] = DType<T>::pack(s[0][2 * j][0], s[0][2 * j][1]);
    a[j][1] = DType<T>::pack(s[0][2 * j][2], s[0][2 * j][3]);
    a[j][2] = DType<T>::pack(s[0][2 * j + 1][0], s[0][2 * j + 1][1]);
    a[j][3] = DType<T>::pack(s[0][2 * j + 1][2], s[0][2 * j + 1][3]);
  }
}

// The products, m64nNk16 with fp32 accumulators d[0][kFirst + j][0..3] (j < N / 8: the
// accumulator tiles of a larger array from tile kFirst on, so that a product of N = 256 can
// be two of N = 128), for N = 40, 64, 80, 128 and 176 (the key tiles and head dims of
// _plan.SM90_TILES; 80 keys is FlashAttention-3's tile at d 256, 176 its tile at d 128
// without a causal mask; 40 a consumer's half of 80 keys in the wide backward, bwd_wide.cu):
//   Wgmma<T, N>::ss      D (+)= A B, A and B K-major in shared memory (or, kMnMajorA /
//                        kMnMajorB, MN-major: the transpose bits, A stored [k][m], B [k][n],
//                        each with its m or n contiguous); D is overwritten where accumulate is 0.
//   Wgmma<T, N>::rs_bt   D += A B, A in registers (the mma.sync A fragment of each warp's
//                        16 rows), B N-major in shared memory (the transpose bit).
template <typename T, int N>
struct Wgmma;

#define CUFLASH_WGMMA_D4(j) \
  "+f"(d[0][kFirst + j][0]), "+f"(d[0][kFirst + j][1]), "+f"(d[0][kFirst + j][2]), "+f"(d[0][kFirst + j][3])

// One specialisation: the instruction's type and N, the accumulators as PTX operands and
// as asm outputs, then the PTX operands that follow them (ss: a, b, accumulate, the
// transpose bits of A and B; rs_bt: a's four registers, b).
#define CUFLASH_WGMMA(T, TYPE, N, D_PTX, D_OUTPUTS, A, B, ACCUMULATE, TRANSPOSE_A, TRANSPOSE_B, RS_OPERANDS)      \
  template <>                                                                                                   \
  struct Wgmma<T, N> {                                                                                          \
    template <bool kMnMajorA = false, bool kMnMajorB = kMnMajorA, int kTiles>                                   \
    static __device__ __forceinline__ void ss(float (&d)[1][kTiles][4], unsigned long long a,                   \
                                              unsigned long long b, int accumulate) {                           \
      constexpr int kFirst = 0;                                                                                 \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACCUMULATE ", 0;\n"                                     \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " D_PTX ", " A ", " B       \
                   ", p, 1, 1, " TRANSPOSE_A ", " TRANSPOSE_B ";\n}\n"                                           \
                   : D_OUTPUTS                                                                                  \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kMnMajorA ? 1 : 0), "n"(kMnMajorB ? 1 : 0));          \
    }                                                                                                           \
    template <int kFirst, int kTiles>                                                                           \
    static __device__ __forceinline__ void rs_bt(float (&d)[1][kTiles][4], const unsigned (&a)[4],              \
                                                 unsigned long long b) {                                        \
      asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " D_PTX ", " RS_OPERANDS    \
                   ", 1, 1, 1, 1;\n"                                                                             \
                   : D_OUTPUTS                                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                       \
    }                                                                                                           \
  };
// Both types at one N, whose accumulators are CUFLASH_WGMMA_D<N> as asm outputs and
// CUFLASH_WGMMA_R<N> as PTX operands (named here, expanded as CUFLASH_WGMMA's arguments:
// passed on expanded, the outputs' commas would split them); the operands after them are
// numbered K0 .. K4 (K0 = N / 2).
#define CUFLASH_WGMMA_N(N, K0, K1, K2, K3, K4)                                                                \
  CUFLASH_WGMMA(half_t, "f16", N, "{" CUFLASH_WGMMA_R##N "}", CUFLASH_WGMMA_D##N, "%" #K0, "%" #K1, "%" #K2,   \
                "%" #K3, "%" #K4, "{%" #K0 ", %" #K1 ", %" #K2 ", %" #K3 "}, %" #K4)                         \
  CUFLASH_WGMMA(bfloat16_t, "bf16", N, "{" CUFLASH_WGMMA_R##N "}", CUFLASH_WGMMA_D##N, "%" #K0, "%" #K1,       \
                "%" #K2, "%" #K3, "%" #K4, "{%" #K0 ", %" #K1 ", %" #K2 ", %" #K3 "}, %" #K4)

// The accumulators of each N, each list the one before it and the tiles N adds; as asm
// outputs (D) and as PTX operands (R).
#define CUFLASH_WGMMA_D40 \
  CUFLASH_WGMMA_D4(0), CUFLASH_WGMMA_D4(1), CUFLASH_WGMMA_D4(2), CUFLASH_WGMMA_D4(3), CUFLASH_WGMMA_D4(4)
#define CUFLASH_WGMMA_D64 \
  CUFLASH_WGMMA_D4(0), CUFLASH_WGMMA_D4(1), CUFLASH_WGMMA_D4(2), CUFLASH_WGMMA_D4(3), CUFLASH_WGMMA_D4(4), \
  CUFLASH_WGMMA_D4(5), CUFLASH_WGMMA_D4(6), CUFLASH_WGMMA_D4(7)
#define CUFLASH_WGMMA_D80 CUFLASH_WGMMA_D64, CUFLASH_WGMMA_D4(8), CUFLASH_WGMMA_D4(9)
#define CUFLASH_WGMMA_D128 \
  CUFLASH_WGMMA_D80, CUFLASH_WGMMA_D4(10), CUFLASH_WGMMA_D4(11), CUFLASH_WGMMA_D4(12), CUFLASH_WGMMA_D4(13), \
  CUFLASH_WGMMA_D4(14), CUFLASH_WGMMA_D4(15)
#define CUFLASH_WGMMA_D176 \
  CUFLASH_WGMMA_D128, CUFLASH_WGMMA_D4(16), CUFLASH_WGMMA_D4(17), CUFLASH_WGMMA_D4(18), CUFLASH_WGMMA_D4(19), \
  CUFLASH_WGMMA_D4(20), CUFLASH_WGMMA_D4(21)
#define CUFLASH_WGMMA_R40 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19"
#define CUFLASH_WGMMA_R64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CUFLASH_WGMMA_R80 CUFLASH_WGMMA_R64 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define CUFLASH_WGMMA_R128 CUFLASH_WGMMA_R80 ", %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUFLASH_WGMMA_R176 CUFLASH_WGMMA_R128 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87"
CUFLASH_WGMMA_N(40, 20, 21, 22, 23, 24)
CUFLASH_WGMMA_N(64, 32, 33, 34, 35, 36)
CUFLASH_WGMMA_N(80, 40, 41, 42, 43, 44)
CUFLASH_WGMMA_N(128, 64, 65, 66, 67, 68)
CUFLASH_WGMMA_N(176, 88, 89, 90, 91, 92)
#undef CUFLASH_WGMMA_R176
#undef CUFLASH_WGMMA_R128
#undef CUFLASH_WGMMA_R80
#undef CUFLASH_WGMMA_R64
#undef CUFLASH_WGMMA_R40
#undef CUFLASH_WGMMA_D176
#undef CUFLASH_WGMMA_D128
#undef CUFLASH_WGMMA_D80
#undef CUFLASH_WGMMA_D64
#undef CUFLASH_WGMMA_D40

#undef CUFLASH_WGMMA_N
#undef CUFLASH_WGMMA
#undef CUFLASH_WGMMA_D4

// Four 8x8 matrices of 16-bit elements to shared memory, each transposed (stmatrix.x4.trans):
// register i of lane 4r + c holds row r, columns 2c and 2c + 1 of matrix i (a 16x16 block
// of an A operand: its rows 0-7 / 8-15 by columns 0-7, then by columns 8-15), and lane
// 8i + r gives the 16-byte address that receives column r of matrix i.
__device__ __forceinline__ void store_matrices_transposed(unsigned address, const unsigned (&a)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(a[0]),
               "r"(a[1]), "r"(a[2]), "r"(a[3])
               : "memory");
}

// The first two of those matrices alone (stmatrix.x2.trans: lanes 0-15 give the addresses).
__device__ __forceinline__ void store_matrices_transposed(unsigned address, unsigned a0, unsigned a1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(address), "r"(a0), "r"(a1)
               : "memory");
}

}  // namespace sm90
}  // namespace cuflash
