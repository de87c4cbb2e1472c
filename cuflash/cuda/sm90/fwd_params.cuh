// The sm_90a forward's one argument: the Params of the mma.sync kernels (ModParams for a
// call with score_mod / mask_mod), the batch, the section, the tile counter and the tail's
// cut (the tile scheduler counts, orders and hands out the tiles of a launch:
// sm90/tile_scheduler.cuh), and the tensor maps of Q, K and V, each 4-D (headdim, seqlen,
// heads, batch) with a box of 64 columns (128 bytes, the swizzle's width) and a tile's rows
// (cuflash/_tensormap.py); packed (varlen) arrays are one batch of all rows.
// cuflash/_params.py mirrors both.
#pragma once
#include "layout.cuh"  // (Select)
#include "mods.cuh"
#include "params.cuh"
#include "sm90/tma.cuh"

namespace cuflash {

template <bool kMods>
struct Sm90ParamsOf {
  typename Select<kMods, ModParams, Params>::type p;
  int batch;    // sequences (packed: of cu_seqlens)
  int section;  // (head, sequence) pairs whose tiles the scheduler interleaves (Sm90Tiles)
  int* tile_counter;  // causal or windowed: 0 at launch, the tiles taken past the first wave
  // The tail cut along its keys (no mask; tail_start = the tile count: none): its first
  // tile, its CTAs and the key tiles of each of its tiles; each piece's O and LSE
  // (float32, a slot each: Sm90Work::slot), and the pieces of each tail tile stored so
  // far, warp by warp (0 at launch).
  int tail_start, tail_ctas, tail_key_tiles;
  float* partial_o;
  float* partial_lse;
  int* arrivals;
  sm90::TensorMap q, k, v;
};
using Sm90Params = Sm90ParamsOf<false>;
using Sm90ModParams = Sm90ParamsOf<true>;

}  // namespace cuflash
