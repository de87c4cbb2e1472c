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

  // The score in natural units from the raw dot product s of (row, col) (with_chain's).
  __device__ __forceinline__ float operator()(float s, int row, int col) const {
    float chain;
    return with_chain(s, row, col, chain);
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
  // The score, and d score / d (scale q.k) in `chain`: softcap's 1 - tanh^2 from the same
  // tanh (ALiBi adds a constant).
  __device__ __forceinline__ float with_chain(float s, int row, int col, float& chain) const {
    s *= scale;
    chain = 1.f;
    if (softcap > 0.f) {
      const float t = tanhf(s / softcap);
      s = softcap * t, chain = 1.f - t * t;
    }
    if (slope != 0.f) s -= slope * float(abs(row + diagonal - col));
    return s;
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

// Dropout's keep bits of a transposed fragment (mma C layout, kMTiles x kNTiles; its rows keys
// from row0, a multiple of 4, its columns queries from col0), drawn once a draw: the lanes
// g = 4i .. 4i + 3 of a t hold keys 4i' .. 4i' + 3 of the same queries, the four words of one
// draw (col / 4 = the key's group), so each lane draws a quarter of the fragment's draws and
// the four swap their keep bits (32 draws a word, four bits a draw: lane g % 4 = j's is bit j).
template <int kMTiles, int kNTiles>
struct TransposedKeep {
  static constexpr int kDraws = 4 * kMTiles * kNTiles, kWords = kDraws / 32;
  static_assert(kDraws % 32 == 0, "whole words of keep bits");
  unsigned bits[4][kWords];  // [source lane's g % 4][word], shifted down by this lane's g % 4

  // Draw d = ((2 mt + h) kNTiles + nt) 2 + e % 2 (h = e / 2: the row's half) is source lane
  // d % 4's, bits 4 (d / 4) .. + 3 of its words.
  static __device__ __forceinline__ TransposedKeep of(const Dropout& dropout, int row0, int col0, int lane) {
    const int g = lane >> 2, t = lane & 3, j = g & 3;
    unsigned own[kWords] = {};
#pragma unroll
    for (int q = 0; q < kDraws / 4; ++q) {
      const int d = 4 * q + j, pair = d >> 1, line = pair / kNTiles, nt = pair % kNTiles;
      const int key = row0 + 16 * (line >> 1) + 8 * (line & 1) + 4 * (g >> 2);  // (the group's first)
      const uint4 w = dropout.words(col0 + 8 * nt + 2 * t + (d & 1), key);
      const unsigned keep = unsigned(w.x >= dropout.threshold) | unsigned(w.y >= dropout.threshold) << 1 |
                            unsigned(w.z >= dropout.threshold) << 2 | unsigned(w.w >= dropout.threshold) << 3;
      own[(4 * q) / 32] |= keep << ((4 * q) % 32);
    }
    TransposedKeep k;
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int w = 0; w < kWords; ++w) k.bits[s][w] = __shfl_xor_sync(0xffffffffu, own[w], (s ^ j) << 2) >> j;
    return k;
  }
  // Element e of n8 tile nt of m16 tile mt kept?
  __device__ __forceinline__ bool keep(int mt, int nt, int e) const {
    const int d = ((2 * mt + (e >> 1)) * kNTiles + nt) * 2 + (e & 1), position = 4 * (d >> 2);
    return (bits[d & 3][position / 32] >> (position % 32)) & 1u;
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
