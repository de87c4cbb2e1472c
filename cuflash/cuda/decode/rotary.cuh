// Rotary position embedding (RoPE): the first rotary_dim features of a row rotate in
// pairs, pair i by the angle whose cosine and sine are cos[pos][i], sin[pos][i]. The
// pairs are (2i, 2i + 1) when interleaved, else (i, i + rotary_dim / 2) (GPT-NeoX).
// Computed in fp32 and rounded once, as flash-attn's rotary kernel does.
#pragma once
#include "common.cuh"
#include "decode/decode_params.cuh"

namespace cuflash {

struct Rotary {
  const void* cos;  // (rows, dim / 2); null: no rotary
  const void* sin;
  int dim, rows;
  bool interleaved, fp32;

  static __device__ __forceinline__ Rotary of(const DecodeParams& p) {
    return Rotary{p.rotary_cos, p.rotary_sin, p.rotary_dim, p.rotary_rows, p.rotary_interleaved != 0,
                  p.rotary_float32 != 0};
  }
  __device__ __forceinline__ bool on() const { return cos != nullptr; }
  __device__ __forceinline__ int pairs() const { return dim / 2; }

  // The features of pair i.
  __device__ __forceinline__ int2 pair(int i) const {
    return interleaved ? make_int2(2 * i, 2 * i + 1) : make_int2(i, i + dim / 2);
  }

  // (cos, sin) of pair i at position pos (clamped into the table: the host checks its
  // length where it can read the positions).
  template <typename T>
  __device__ __forceinline__ float2 angle(int pos, int i) const {
    const int64 at = int64(min(max(pos, 0), rows - 1)) * (dim / 2) + i;
    if (fp32) return make_float2(static_cast<const float*>(cos)[at], static_cast<const float*>(sin)[at]);
    return make_float2(DType<T>::to_float(static_cast<const elem_t*>(cos)[at]),
                       DType<T>::to_float(static_cast<const elem_t*>(sin)[at]));
  }

  // (x, y) of a pair rotated by (c, s).
  static __device__ __forceinline__ float2 rotate(float x, float y, float2 cs) {
    return make_float2(x * cs.x - y * cs.y, x * cs.y + y * cs.x);
  }

  // Rotate rows [row_begin, row_end) of a shared tile in layout L in place, row r at
  // position position(r); the CTA's threads share the (row, pair) items. A thread loads
  // the angles of up to kBatch items together, then rotates them: one wait on the table's
  // latency for a batch, not one an item (a one-by-one loop of a decode step's query tile
  // took several microseconds).
  template <typename T, int kBatch, typename L, typename Position>
  __device__ __forceinline__ void rotate_rows(SharedTile<L> tile, int row_begin, int row_end, Position position,
                                              int threads) const {
    const int n = pairs(), items = (row_end - row_begin) * n;
    for (int first = threadIdx.x; first < items; first += kBatch * threads) {
      float2 cs[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int item = first + j * threads;
        if (item < items) cs[j] = angle<T>(position(row_begin + item / n), item % n);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int item = first + j * threads;
        if (item >= items) break;
        const int r = row_begin + item / n;
        const int2 f = pair(item % n);
        elem_t& x = tile.data[L::at(r, f.x)];
        elem_t& y = tile.data[L::at(r, f.y)];
        const float2 xy = rotate(DType<T>::to_float(x), DType<T>::to_float(y), cs[j]);
        x = DType<T>::from_float(xy.x);
        y = DType<T>::from_float(xy.y);
      }
    }
  }

  // Ask L2 for the table rows of position pos (cos and sin), ahead of their use; a
  // warp's lanes take 128-byte lines.
  __device__ __forceinline__ void prefetch(int pos, int lane) const {
    const int bytes = pairs() * (fp32 ? 4 : 2);
    const int64 row = int64(min(max(pos, 0), rows - 1)) * bytes;
    for (int at = lane * 128; at < bytes; at += 32 * 128) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(cos) + row + at));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(sin) + row + at));
    }
  }
};

}  // namespace cuflash
