// What happens to a score between Q K^T and the softmax, for the variants:
//   s = scale q.k;  softcap: s = softcap tanh(s / softcap);  ALiBi: s -= slope |i + diagonal - j|
// and dropout's keep mask (Philox4x32-10, counter-based: the same (seed, offset,
// batch, head, row, col) always gives the same decision, whatever the launch shape).
#pragma once
#include "common.cuh"
#include "fragment.cuh"
#include "mask.cuh"
#include "params.cuh"

namespace cuflash {

struct ScoreMod {
  float scale;
  float softcap;  // 0: off
  float slope;    // ALiBi slope of this (batch, head); 0: off
  int diagonal;

  // The score in natural units from the raw dot product s of (row, col).
  __device__ __forceinline__ float operator()(float s, int row, int col) const {
    s *= scale;
    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    if (slope != 0.f) s -= slope * float(abs(row + diagonal - col));
    return s;
  }
  // Every score of acc (mma C layout, rows from row0, columns from col0) through the mod,
  // with kPerTile softcap and ALiBi each tested once a tile (per score, their branches and
  // untaken arithmetic cost every extras instance, on or off), else once a score.
  template <bool kPerTile = true, int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kMTiles][kNTiles][4], int row0, int col0, int lane) const {
    if constexpr (!kPerTile) {
      for_each_element<kMTiles, kNTiles>(lane, row0, col0, [&](int mt, int nt, int e, int row, int col) {
        s[mt][nt][e] = (*this)(s[mt][nt][e], row, col);
      });
      return;
    }
    if (softcap > 0.f)
      for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int, int) {
        s[mt][nt][e] = softcap * tanhf(s[mt][nt][e] * scale / softcap);
      });
    else
      for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int, int) { s[mt][nt][e] *= scale; });
    if (slope != 0.f)
      for_each_element<kMTiles, kNTiles>(lane, row0, col0, [&](int mt, int nt, int e, int row, int col) {
        s[mt][nt][e] -= slope * float(abs(row + diagonal - col));
      });
  }
  // d score / d (scale q.k): softcap's 1 - tanh^2 (ALiBi adds a constant).
  __device__ __forceinline__ float chain(float s) const {
    if (softcap <= 0.f) return 1.f;
    const float t = tanhf(s * scale / softcap);
    return 1.f - t * t;
  }
};

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
__device__ __forceinline__ uint4 philox(uint4 c, uint2 key) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) key.x += 0x9E3779B9u, key.y += 0xBB67AE85u;
    const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
  }
  return c;
}

// Counter (col / 4, row, batch * nheads + head, offset), key = seed; the element
// takes word col % 4 and is dropped iff it is below the threshold (cuflash/_philox.py).
struct Dropout {
  uint2 key;
  unsigned stream;  // batch * nheads + head
  unsigned offset;
  unsigned threshold;

  __device__ __forceinline__ uint4 words(int row, int col) const {
    return philox(make_uint4(unsigned(col) >> 2, unsigned(row), stream, offset), key);
  }
  __device__ __forceinline__ bool keep(int row, int col) const {
    const uint4 w = words(row, col);
    const unsigned word = (col & 3) == 0 ? w.x : (col & 3) == 1 ? w.y : (col & 3) == 2 ? w.z : w.w;
    return word >= threshold;
  }
  // Zero the dropped probabilities of p (mma C layout); column pairs share a call.
  template <int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&p)[kMTiles][kNTiles][4], int row0, int col0, int lane) const {
    for_each_element<kMTiles, kNTiles, 2>(lane, row0, col0, [&](int mt, int nt, int e, int row, int col) {
      bool first, second;
      keep_pair(row, col, first, second);
      if (!first) p[mt][nt][e] = 0.f;
      if (!second) p[mt][nt][e + 1] = 0.f;
    });
  }
  // (row, col) and (row, col + 1) for an even col: one Philox call.
  __device__ __forceinline__ void keep_pair(int row, int col, bool& first, bool& second) const {
    const uint4 w = words(row, col);
    first = ((col & 2) ? w.z : w.x) >= threshold;
    second = ((col & 2) ? w.w : w.y) >= threshold;
  }
};

// The ScoreMod and Dropout of one (batch, head) (extras only).
template <bool kExtras, bool kLocal>
__device__ __forceinline__ void score_extras(const Params& p, const Mask<kLocal>& mask, int batch, int head,
                                             ScoreMod& mod, Dropout& dropout) {
  if constexpr (kExtras) {
    const float slope = p.alibi_slopes ? p.alibi_slopes[batch * p.alibi_batch_stride + head] : 0.f;
    mod = ScoreMod{p.scale, p.softcap, slope, mask.diagonal};
    dropout = Dropout{make_uint2(unsigned(p.seed), unsigned(p.seed >> 32)), unsigned(batch * p.nheads + head),
                      unsigned(p.rng_offset), p.dropout_threshold};
  }
}

}  // namespace cuflash
