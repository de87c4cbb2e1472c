// The backward's per-element step: from a tile's recomputed scores S and dP = dO V^T,
// with the saved LSE and D = rowsum(dO * O), the probabilities P (for dV) and the
// score gradients dS (for dK and dQ), through the mask, the score modifiers and
// dropout of the variants. Both backward paths take it, in either orientation.
#pragma once
#include "common.cuh"
#include "fragment.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "score.cuh"

namespace cuflash {

// From the raw scores s = Q K^T and dP = dO V^T of a tile (mma C layout, kMTiles
// m16 tiles; with kTransposed the rows are keys and the columns queries), in place:
//   s  <- dropout(P), P = exp(mod(s) - LSE), 0 where hidden     (for dV)
//   dp <- dS = P (dropout(dP) - D) mod'(s)                       (for dK and dQ)
// lse_log2(i, e) / delta(i, e) give LSE * log2(e) and D of the query at index i of the
// tile's queries (element e of its fragment). With Mods (and extras), mod is ScoreMod and
// then score_mod, and mask_mod hides scores too.
template <bool kTransposed, bool kLocal, bool kExtras, typename Mods, int kMTiles, int kNTiles, typename Lse,
          typename Delta>
__device__ __forceinline__ void probabilities_and_gradients(
    float (&s)[kMTiles][kNTiles][4], float (&dp)[kMTiles][kNTiles][4], float scale_log2, bool masked,
    const Mask<kLocal>& mask, const ScoreMod& mod, const ModsAt<Mods>& mods, const Dropout& dropout, bool dropping,
    float dropout_scale, Lse lse_log2, Delta delta, int row0, int col0, int lane) {
  static_assert(kExtras || !kHasMods<Mods>, "mods take the scores in natural units: the extras' instances");
  const int g = lane >> 2, t = lane & 3;
  // Without extras a hidden score becomes -inf before the exp, in a pass of its own
  // that only tiles crossing the mask's edge run: the loop below stays free of per-score
  // tests (folded into it, they doubled the integer work of every tile). (A modified
  // score of -inf need not be -inf, so extras mask P.)
  if (!kExtras && masked) mask.template apply<kTransposed>(s, row0, col0, lane);
  // (transposed, a dropout draw serves four lanes' scores: TransposedKeep)
  constexpr bool kSharedDraws = kExtras && kTransposed && (kMTiles * kNTiles) % 8 == 0;
  TransposedKeep<kSharedDraws ? kMTiles : 1, kSharedDraws ? kNTiles : 8> drawn;
  if constexpr (kSharedDraws) {
    if (dropping) drawn = decltype(drawn)::of(dropout, row0, col0, lane);
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = mt * 16 + g + 8 * (e >> 1), c = nt * 8 + 2 * t + (e & 1);
        const int query = kTransposed ? col0 + c : row0 + r, key = kTransposed ? row0 + r : col0 + c;
        const int local = kTransposed ? c : r;  // the query's index for lse_log2 / delta
        const float raw = s[mt][nt][e];
        float prob, modified, chain = 1.f;
        if constexpr (kHasMods<Mods>) {
          modified = mod.with_chain(raw, query, key, chain);
          const float score = mods.score(modified, query, key);
          const bool hidden = (masked && !mask.visible(query, key)) || !mods.visible(query, key);
          prob = hidden ? 0.f : fast_exp2(score * scale_log2 - lse_log2(local, e));
        } else {
          prob = fast_exp2((kExtras ? mod.with_chain(raw, query, key, chain) : raw) * scale_log2 - lse_log2(local, e));
          if (kExtras && masked && !mask.visible(query, key)) prob = 0.f;
        }
        float kept = 1.f;
        if (kExtras && dropping)
          kept = (kSharedDraws ? drawn.keep(mt, nt, e) : dropout.keep(query, key)) ? dropout_scale : 0.f;
        float ds = prob * (dp[mt][nt][e] * kept - delta(local, e));
        if constexpr (kExtras) ds *= chain;
        // (Where P is 0, score_mod's derivative may be NaN: hidden, or a row past the end.)
        if constexpr (Mods::kScore) ds = prob == 0.f ? 0.f : ds * mods.gradient(modified, query, key);
        s[mt][nt][e] = prob * kept;
        dp[mt][nt][e] = ds;
      }
}

// The same step in two halves, for a kernel that multiplies in between (the sm_90a
// backward runs dV += P^T dO while dS is computed), without softcap, ALiBi or dropout:
//   probabilities:    s  <- P = exp(S - LSE), 0 where hidden
//   score_gradients:  dp <- dS = P (dP - D)
template <bool kTransposed, bool kLocal, int kMTiles, int kNTiles, typename Lse>
__device__ __forceinline__ void probabilities(float (&s)[kMTiles][kNTiles][4], float scale_log2, bool masked,
                                              const Mask<kLocal>& mask, Lse lse_log2, int row0, int col0, int lane) {
  if (masked) mask.template apply<kTransposed>(s, row0, col0, lane);
  for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int r, int c) {
    s[mt][nt][e] = fast_exp2(s[mt][nt][e] * scale_log2 - lse_log2(kTransposed ? c : r, e));
  });
}

template <bool kTransposed, int kMTiles, int kNTiles, typename Delta>
__device__ __forceinline__ void score_gradients(const float (&p)[kMTiles][kNTiles][4],
                                                float (&dp)[kMTiles][kNTiles][4], Delta delta, int lane) {
  for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int r, int c) {
    dp[mt][nt][e] = p[mt][nt][e] * (dp[mt][nt][e] - delta(kTransposed ? c : r, e));
  });
}

}  // namespace cuflash
