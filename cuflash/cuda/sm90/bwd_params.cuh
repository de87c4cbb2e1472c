// The sm_90a backward's one argument: the Params of the mma.sync kernels (ModParams for a
// call with score_mod / mask_mod), the batch, the columns of dQ's accumulator, whether each
// CTA counts its end for the dQ conversion, and the tensor maps of Q, dO (a query block's
// rows a box), K and V (a key block's), each 4-D (headdim, seqlen, heads, batch) with
// boxes of 64 columns (cuflash/_tensormap.py); packed (varlen) arrays are one batch of all
// rows. cuflash/_params.py mirrors both.
#pragma once
#include "layout.cuh"  // (Select)
#include "mods.cuh"
#include "params.cuh"
#include "sm90/tma.cuh"

namespace cuflash {

template <bool kMods>
struct Sm90BackwardParamsOf {
  typename Select<kMods, ModParams, Params>::type p;
  int batch;       // sequences (packed: of cu_seqlens)
  int accum_cols;  // a row of dQ's accumulator (DqAccum): the head-dim bucket
  // 1: each CTA, once its dQ is all added, counts itself on its (sequence, KV head)'s
  // counter (DqAccum::counters) for the conversion running beside the grid's last CTAs
  int count_done;
  sm90::TensorMap q, k, v, dout;
};
using Sm90BackwardParams = Sm90BackwardParamsOf<false>;
using Sm90BackwardModParams = Sm90BackwardParamsOf<true>;

}  // namespace cuflash
