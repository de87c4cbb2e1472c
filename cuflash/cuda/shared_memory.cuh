// Each kernel's shared memory: the byte offsets of its buffers, and kBytes, its size,
// which the planner states too (cuflash/_plan; tests/test_plan.py compiles one
// static_assert per variant that holds the two together). The loads, barriers and loops
// over these stay with the kernels.
#pragma once
#include "common.cuh"
#include "layout.cuh"

namespace cuflash {

// A kernel that streams K and V past one Q tile (the forward, the KV-cache split kernel),
// byte offsets: the Q tile, then kStages K tiles, then kStages V tiles.
// _plan.KINDS["forward"] states the same size (tests/test_plan.py holds the two together).
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct ForwardShared {
  static constexpr int kRow = HeadDimLayout<kHeadDim>::kRowElems * kElemBytes;
  static constexpr int kQ = 0, kK = kQ + kBlockM * kRow, kV = kK + kStages * kBlockN * kRow;
  static constexpr int kBytes = kV + kStages * kBlockN * kRow;
};

// The KV-cache split kernel (decode/split_kv.cu): the forward's (the Q tile, then kStages K
// tiles, then kStages V tiles).
// After the key loop the K/V buffers hold each warp's normalised O (fp32 rows of
// kHeadDim + 4, off the banks' period) and LSE. In a cluster an inbox follows the stages:
// the merged O (fp32 rows of kHeadDim) and LSE of block row q from the CTA of rank s, for
// the CTA that merges that row (rank q % ranks), at entry (q / ranks) ranks + s; apart
// from the stages, so that a CTA may write into another still in its key loop.
// _plan.KINDS["decode"] and ["decode_cluster"] state the sizes.
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct DecodeShared : ForwardShared<kHeadDim, kBlockM, kBlockN, kStages> {
  using Base = ForwardShared<kHeadDim, kBlockM, kBlockN, kStages>;
  // Splits that merge in a cluster at most (the largest cluster Hopper schedules; _plan's
  // MAX_CLUSTER_SPLITS).
  static constexpr int kMaxClusterSplits = 16;
  static constexpr int kWarpORow = kHeadDim + 4;
  static constexpr int kWarpO = Base::kK;
  template <int kWarps>
  static __host__ __device__ constexpr int warp_lse() { return kWarpO + kWarps * kBlockM * kWarpORow * 4; }
  template <int kWarps>
  static __host__ __device__ constexpr bool results_fit() {
    return warp_lse<kWarps>() + kWarps * kBlockM * 4 <= Base::kBytes;
  }
  // (ranks ceil(kBlockM / ranks) entries at most: below kBlockM + kMaxClusterSplits.)
  static constexpr int kInboxEntries = kBlockM + kMaxClusterSplits;
  static constexpr int kInboxO = Base::kBytes, kInboxLse = kInboxO + kInboxEntries * kHeadDim * 4;
};
// The size with the inbox (kClusterMerge).
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct ClusterDecodeShared : DecodeShared<kHeadDim, kBlockM, kBlockN, kStages> {
  using Base = DecodeShared<kHeadDim, kBlockM, kBlockN, kStages>;
  static constexpr int kBytes = Base::kInboxLse + Base::kInboxEntries * 4;
};

// The sm_90a forward (sm90/fwd.cu, Sm90Shared), byte offsets from a 1024-byte aligned
// start (the swizzle's atoms): Q, kStages K tiles, kStages V tiles, then the barriers:
// Q's two ("landed", "released"), then each stage's "landed" and each stage's "released";
// then the number of the tile whose Q is loaded (the producer's word to the consumers,
// under Q's barriers), and a word for each warp that the consumers write to order their
// code (sink); with a block mask, kKeyBitBytes for its rows' key tiles (two rounds'
// KeyTileBits: the producer fills one while the consumers walk the other). With two
// stages (kApart) K and V have barriers of their own (K's landed, V's landed, K's
// released, V's released): a stage's K is done with at its S, its V only at the next
// turn's P V, and the copy engine refills each as soon as it may. With three
// (d 64), a stage's K and V share one pair: the third stage keeps the copy engine ahead
// already, and releasing them apart showed no gain (H200, d 64 and a three-stage d 128).
// A tile of R rows is kHeadDim / 64 blocks of R x 128 bytes, one after the other. Dynamic
// shared memory is promised less alignment: the launch asks for 1024 bytes more
// (_sm90.shared_bytes).
template <int kHeadDim, int kBlockM, int kBlockN, int kStages, int kKeyBitBytes = 0>
struct Sm90SharedLayout {
  static constexpr int kColumnBlocks = kHeadDim / 64;
  static constexpr int kQBlock = kBlockM * 128, kKvBlock = kBlockN * 128;  // bytes of a 64-column block
  static constexpr int kKvTile = kBlockN * kHeadDim * 2;
  static constexpr int kQ = 0, kK = kQ + kBlockM * kHeadDim * 2, kV = kK + kStages * kKvTile;
  static constexpr int kBarriers = kV + kStages * kKvTile;
  static constexpr bool kApart = kStages == 2;
  static constexpr int kStageBarriers = (kApart ? 2 : 1) * kStages;  // "landed" ones, as many "released"
  static constexpr int kTile = kBarriers + (2 + 2 * kStageBarriers) * 8;
  static constexpr int kSinks = kTile + 8, kMaxWarps = 16;
  static constexpr int kKeyBits = kSinks + kMaxWarps * 4;  // (with a block mask: two KeyTileBits, mods.cuh)
  static constexpr int kBytes = kKeyBits + kKeyBitBytes + 1024;
};

// The sm_90a backward (sm90/bwd.cu, Sm90BackwardShared), byte offsets from a 1024-byte
// aligned start (the swizzle's atoms): K, V,
// kStages Q tiles, kStages dO tiles, two dS tiles ([query][key]: a step writes one
// while the other consumer may still read the one before), kStages rows of LSE (times
// log2 e) and of D, each consumer's dQ (fp32, in DqAccum's order: 2 KB a group of 8 rows x 64
// columns) for the copy engine's reduction and each group's address in the accumulator
// (kBlockM / 8 a consumer), the step's dQ turn (deterministic: a semaphore's address and
// the turn to wait for), then the barriers: K/V's "landed", each stage's "landed", each
// stage's "released", each consumer's dQ "staged" and "drained". A tile of R rows is
// kHeadDim / 64 blocks of R x 128 bytes; dS is two blocks of kBlockM x 128 bytes (a
// consumer's 64 keys each). The launch asks for 1024 bytes more (alignment).
template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct Sm90BackwardSharedLayout {
  static constexpr int kColumnBlocks = kHeadDim / 64;
  static constexpr int kKvBlock = kBlockN * 128, kQBlock = kBlockM * 128;  // bytes of a 64-column block
  static constexpr int kKvTile = kBlockN * kHeadDim * 2, kQTile = kBlockM * kHeadDim * 2;
  static constexpr int kDsTile = kBlockN * kBlockM * 2;
  static constexpr int kK = 0, kV = kKvTile, kQ = 2 * kKvTile, kDo = kQ + kStages * kQTile;
  static constexpr int kDs = kDo + kStages * kQTile;
  static constexpr int kLse = kDs + 2 * kDsTile, kDelta = kLse + kStages * kBlockM * 4;
  static constexpr int kDqSlice = kBlockM * kHeadDim * 2;  // a consumer's half of dQ: kBlockM x kHeadDim / 2 floats
  static constexpr int kDq = kDelta + kStages * kBlockM * 4;
  static constexpr int kDqDestination = kDq + 2 * kDqSlice;
  static constexpr int kDqTurn = kDqDestination + 2 * (kBlockM / 8) * 8;
  static constexpr int kBarriers = kDqTurn + 16;
  static constexpr int kBytes = kBarriers + (1 + 2 * kStages + 4) * 8 + 1024;
};

// The sm_90a backward for wide head dims (sm90/bwd_wide.cu, Sm90WideBackwardShared), byte
// offsets from a 1024-byte aligned start: K, V (kBlockN rows each), kQStages Q tiles, one dO
// tile, two P tiles and two dS tiles (a step writes one while the other consumer may still
// read the step before's), kQStages rows of LSE (times log2 e, beside Q) and one of D
// (beside dO), then the barriers: K/V's "landed", each Q stage's "landed" and "released",
// dO's "landed" and "released". A tile of R rows is kHeadDim / 64 blocks of R x 128 bytes
// (TMA's 128-byte swizzle); P and dS are stored transposed, [key][query]: kBlockN rows of
// kBlockM = 64 queries (128 bytes), the same swizzle, so that dV^T = dO^T P and dK^T = Q^T dS
// read them K-major and dQ^T = K^T dS^T MN-major. After the key loop K and V hold dK and dV
// on their way to global memory. The launch asks for 1024 bytes more (alignment).
template <int kHeadDim, int kBlockM, int kBlockN, int kQStages>
struct Sm90WideBackwardSharedLayout {
  static_assert(kBlockM == 64, "P and dS rows: 64 queries, 128 bytes");
  static constexpr int kColumnBlocks = kHeadDim / 64;
  static constexpr int kKvBlock = kBlockN * 128, kQBlock = kBlockM * 128;  // bytes of a 64-column block
  static constexpr int kKvTile = kBlockN * kHeadDim * 2, kQTile = kBlockM * kHeadDim * 2;
  static constexpr int kPdsTile = kBlockN * kBlockM * 2;
  static constexpr int kK = 0, kV = kKvTile, kQ = 2 * kKvTile, kDo = kQ + kQStages * kQTile;
  static constexpr int kP = kDo + kQTile, kDs = kP + 2 * kPdsTile;
  static constexpr int kLse = kDs + 2 * kPdsTile, kDelta = kLse + kQStages * kBlockM * 4;
  static constexpr int kBarriers = kDelta + kBlockM * 4;
  static constexpr int kBytes = kBarriers + (1 + 2 * kQStages + 2) * 8 + 1024;
};

}  // namespace cuflash
