// Programmable attention: the user's score_mod and mask_mod (cuflash.mod), traced into
// device functions and compiled with the kernels. A kernel takes them as its template
// argument Mods: NoMods (no code, and Params as the kernel's argument) or UserMods, the
// struct cuflash.mod.kernel_source writes in front of the kernel's source:
//   kScore, kMask                                   which of the two the call has
//   score(s, b, h, q_idx, kv_idx, tensors)          the modified score
//   gradient(s, b, h, q_idx, kv_idx, tensors)       d score / d s
//   mask(b, h, q_idx, kv_idx, tensors)              false: hidden
// b is the batch element (a packed batch: the sequence), h the query head, q_idx and
// kv_idx positions inside the sequence; the mod tensors come after Params (ModParams).
#pragma once
#include "common.cuh"
#include "fragment.cuh"
#include "layout.cuh"  // (Select)
#include "params.cuh"

namespace cuflash {

// One mod tensor: its data, its strides in elements and its sizes (the traced functions
// clamp every index into them). cuflash.mod.MAX_KERNEL_TENSORS and MAX_KERNEL_DIMS, and
// cuflash/_params.py, state the same limits.
constexpr int kMaxModTensors = 8, kMaxModDims = 4;
struct ModTensor {
  const void* ptr;
  int64 stride[kMaxModDims];
  int size[kMaxModDims];
};

// The argument of a kernel with mods: Params, then the mod tensors.
struct ModParams : Params {
  ModTensor tensors[kMaxModTensors];
};

struct NoMods {
  static constexpr bool kScore = false, kMask = false;
};

// The one argument of a kernel with Mods: Params itself without any.
template <typename Mods>
using ParamsOf = typename Select<Mods::kScore || Mods::kMask, ModParams, Params>::type;

template <typename Mods>
constexpr bool kHasMods = Mods::kScore || Mods::kMask;

// The mods of one (batch, head). apply() takes a tile of scores in natural units (after the
// scale, softcap and ALiBi: ScoreMod) to score_mod's, -inf where mask_mod hides them.
template <typename Mods>
struct ModsAt {
  const ModTensor* tensors;
  int batch, head;

  static __device__ __forceinline__ ModsAt of(const ParamsOf<Mods>& p, int batch, int head) {
    if constexpr (kHasMods<Mods>) {
      return ModsAt{p.tensors, batch, head};
    } else {
      return ModsAt{nullptr, batch, head};
    }
  }
  __device__ __forceinline__ float score(float s, int query, int key) const {
    if constexpr (Mods::kScore) {
      return Mods::score(s, batch, head, query, key, tensors);
    } else {
      return s;
    }
  }
  __device__ __forceinline__ float gradient(float s, int query, int key) const {
    if constexpr (Mods::kScore) {
      return Mods::gradient(s, batch, head, query, key, tensors);
    } else {
      return 1.f;
    }
  }
  __device__ __forceinline__ bool visible(int query, int key) const {
    if constexpr (Mods::kMask) {
      return Mods::mask(batch, head, query, key, tensors);
    } else {
      return true;
    }
  }
  // s[mt][nt][e] (mma C layout) of query row0 + its row, key col0 + its column.
  template <int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kMTiles][kNTiles][4], int row0, int col0, int lane) const {
    for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int r, int c) {
      const float modified = score(s[mt][nt][e], row0 + r, col0 + c);
      s[mt][nt][e] = visible(row0 + r, col0 + c) ? modified : -kInf;
    });
  }
};

}  // namespace cuflash
