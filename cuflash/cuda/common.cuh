// Shared vocabulary of every kernel: element storage, dtype traits, constants.
#pragma once

namespace cuflash {

using int64 = long long;
// fp16 and bf16 are both moved around as raw 16-bit words; only the tensor-core
// instruction and the float conversion need to know which one they are.
using elem_t = unsigned short;

// Compiling for a GPU before Hopper (sm_80 / 86 / 89): fewer registers to spare there
// under CUDA 12's ptxas.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kBeforeSm90 = true;
#else
constexpr bool kBeforeSm90 = false;
#endif

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) == exp2(x * kLog2e)
constexpr float kLn2 = 0.6931471805599453f;    // log(x) == log2(x) * kLn2
constexpr float kInf = __builtin_bit_cast(float, 0x7f800000u);

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int64 ceil_div(int64 a, int64 b) { return (a + b - 1) / b; }

struct half_t {};      // IEEE fp16
struct bfloat16_t {};  // bf16

template <typename T> struct DType;

// A 16-bit type's float conversion, pack and product, all alike but for the type's PTX
// name (TYPE: "f16" or "bf16"):
//   from_float  one float rounded to nearest
//   pack        two floats -> one register holding {lo, hi} rounded to nearest
//   mma         D = A * B + D, m16n8k16, fp32 accumulators
#define CUFLASH_DTYPE_16(TYPE)                                                                          \
  static __device__ __forceinline__ elem_t from_float(float f) {                                        \
    elem_t x;                                                                                           \
    asm("cvt.rn." TYPE ".f32 %0, %1;" : "=h"(x) : "f"(f));                                              \
    return x;                                                                                           \
  }                                                                                                     \
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {                                 \
    unsigned r;                                                                                         \
    asm("cvt.rn." TYPE "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                              \
    return r;                                                                                           \
  }                                                                                                     \
  static __device__ __forceinline__ void mma(float d[4], const unsigned a[4], unsigned b0, unsigned b1) { \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                           \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                       \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                       \
  }

template <> struct DType<half_t> {
  static __device__ __forceinline__ float to_float(elem_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
  CUFLASH_DTYPE_16("f16")
};

template <> struct DType<bfloat16_t> {
  static __device__ __forceinline__ float to_float(elem_t x) { return __uint_as_float(unsigned(x) << 16); }
  CUFLASH_DTYPE_16("bf16")
};

#undef CUFLASH_DTYPE_16

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Which (tile, head, batch) a CTA of a (tiles, heads, batch) grid computes. CTAs start
// in order of blockIdx x, then y, then z. Under a causal or local band the tiles of a
// head differ in length: with kTileMajor the order visits tile 0 of every head of a
// group of `group` (head, batch) pairs, then tile 1, ..., then the next group. When
// tile 0 is the longest (callers number them so), the longest start first and the
// short ones fill the group's last wave (longest-processing-time first: head by head,
// the last heads' long tiles would start late and finish alone). The groups keep the
// rows their tiles share (K and V in the forward; Q, dO and dQ's accumulator in the
// backward) in L2 while they run (_plan.tile_group; over all heads at once, at
// seqlen 512 they were read from memory again by every tile). tile_major is the order
// (the sm_90a forward's tile scheduler takes it too).
__device__ __forceinline__ void tile_major(int linear, int tiles, int pairs, int group, int& tile, int& pair) {
  const int first = linear / (group * tiles) * group;  // the group's first (head, batch)
  const int in_group = min(group, pairs - first), at = linear - first * tiles;
  pair = first + at % in_group, tile = at / in_group;
}

template <bool kTileMajor>
struct GridTile {
  int tile, head, batch;

  static __device__ __forceinline__ GridTile of_block(int group) {
    if constexpr (!kTileMajor) {
      return GridTile{int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
    } else {
      const int tiles = gridDim.x, heads = gridDim.y * gridDim.z;
      const int linear = blockIdx.x + tiles * (blockIdx.y + gridDim.y * blockIdx.z);
      int tile, pair;
      tile_major(linear, tiles, heads, group, tile, pair);
      return GridTile{tile, pair % int(gridDim.y), pair / int(gridDim.y)};
    }
  }
};

// A generic pointer into shared memory -> the 32-bit address that PTX's shared-memory
// operands take (ldmatrix, cp.async, mbarrier, TMA, wgmma descriptors).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Programmatic dependent launch (sm_90). A kernel launched as a programmatic dependent of
// the one before it on the stream may start once every CTA of that one has called
// allow_dependents() or exited, so its launch and start-up overlap that kernel's tail;
// it waits in wait_for_prerequisites() until that kernel has finished and its writes are
// visible. Both do nothing before sm_90 or where the launch did not ask for it.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cuflash
