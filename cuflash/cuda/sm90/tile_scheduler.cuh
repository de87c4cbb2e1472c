// The sm_90a forward's tile scheduler: which CTA computes which tile, or which part of one.
//
// The tiles of a launch are numbered 0 .. count - 1. A (head, sequence) pair's query
// blocks go together, the last first, sharing its K and V in L2.
//
// Without a mask every tile is as long: CTA c takes c, c + gridDim.x, ... (a grid of one
// CTA a tile is the plain launch). Where the tiles do not fill the last wave (count not a
// multiple of the grid), the tiles from tail_start (the last wave's) are cut along their
// keys among tail_ctas CTAs, Stream-K's way: their turns (tile i's key tiles, the last
// first, as the tile itself takes them) are laid end to end, units 0 .. units - 1, and CTA
// c takes units [units * c / tail_ctas, units * (c + 1) / tail_ctas), a piece of one tile
// or the end of one and the start of the next. Each piece's result (O normalised and its
// LSE, over its keys) goes to the workspace, and the piece that finishes a tile last merges
// them by their LSEs (fwd.cu, finish_piece). The planner takes a multiple of the tail's
// tiles in CTAs, so that each share is a piece of one tile and a head's pieces cover the
// same keys at once (their K and V read from L2 together; uneven shares lost that). A
// call with fewer tiles than multiprocessors (a long sequence's few query rows) has its
// keys split the same way.
//
// Under a causal mask, a window or a block mask (kUneven) tiles differ in length: CTA c
// takes c, then whichever tile is next in order when it gets free, from a counter in
// global memory that the launch starts at zero (FlashAttention-3's dynamic scheduler), as
// the hardware hands out the CTAs of a grid of one a tile, yet each CTA loads its next
// tile's Q and keys under its current tile. And under a causal mask or a block mask (a section of
// more than one pair: _plan.sm90_section) the pairs go in sections of equal size whose K and V fit in L2
// together, and within a section query block by query block, the last first, across its
// pairs (tile_major, the mma.sync grid's order): the longest tiles first, the short ones
// filling in at the end, where pair after pair would leave the last pair's long tiles to
// start late and run alone. (No tail is cut: its tiles are the short ones.)
//
// A CTA's work goes round its warps as numbers: tile t as t, the piece that starts at unit
// u as count + u; `end` is past the last. cuflash/_plan/sm90.py (sm90_tail) mirrors the cut.
#pragma once
#include "common.cuh"
#include "sm90/fwd_params.cuh"

namespace cuflash {

// A CTA's unit of work: tile `tile`'s turns first_turn .. last_turn - 1 (turn j: its key
// tile n_end - 1 - j; a whole tile's last_turn is past any tile's last), or a piece of a
// tile cut in `pieces` (1: whole), slot - first_slot its number among them.
struct Sm90Work {
  int tile;
  int first_turn, last_turn;
  int pieces;
  int tail_tile;         // a piece's tile among the tail's: its arrival counters
  int slot, first_slot;  // a piece's partial result in the workspace, and its tile's first piece's
};

// The tail's cut (none: units 0), from the kernel's parameters.
struct Sm90Tail {
  int start, ctas, key_tiles, units;

  template <typename Args>
  static __device__ __forceinline__ Sm90Tail of(const Args& args, int count) {
    return {args.tail_start, args.tail_ctas, args.tail_key_tiles, (count - args.tail_start) * args.tail_key_tiles};
  }
  // The first unit of CTA c's share (c <= ctas; units at c == ctas). (The planner keeps
  // units * ctas below 2^31: 32-bit divisions, inline.)
  __device__ __forceinline__ int unit_start(int c) const { return c * units / ctas; }
  // The CTA whose share holds unit u.
  __device__ __forceinline__ int cta_of(int u) const { return ((u + 1) * ctas - 1) / units; }
};

// (The tile count and sizes are held in registers, read once: read through the parameters
// at each use, the unmasked loop's bookkeeping left the uniform datapath and ran 1-8%
// slower at 512-2k. The tail's cut is read from the parameters where it is used, at a
// work's start and end.)
template <int kBlockM, bool kUneven>
struct Sm90Tiles {
  int m_blocks, heads, count, section;

  template <typename Args>
  static __device__ __forceinline__ Sm90Tiles of(const Args& args) {
    const int m_blocks = ceil_div(args.p.seqlen_q, kBlockM);  // packed: the longest sequence's
    return {m_blocks, args.p.nheads, m_blocks * args.p.nheads * args.batch, args.section};
  }

  // Past the last work.
  template <typename Args>
  __device__ __forceinline__ int end(const Args& args) const {
    return kUneven ? count : count + Sm90Tail::of(args, count).units;
  }
  // CTA c's first piece of the tail, or end where it has none.
  template <typename Args>
  __device__ __forceinline__ int tail_of(int c, const Args& args) const {
    const Sm90Tail tail = Sm90Tail::of(args, count);
    return c < tail.ctas && tail.unit_start(c) < tail.unit_start(c + 1) ? count + tail.unit_start(c)
                                                                          : count + tail.units;
  }
  // This CTA's first work.
  template <typename Args>
  __device__ __forceinline__ int first(const Args& args) const {
    return kUneven || int(blockIdx.x) < args.tail_start ? int(blockIdx.x) : tail_of(blockIdx.x, args);
  }
  // The work this warp takes after t (kUneven: lane 0 takes it from the launch's counter,
  // of the tiles taken past the first gridDim.x).
  template <typename Args>
  __device__ __forceinline__ int next(int t, const Args& args, int lane) const {
    if constexpr (kUneven) {
      return gridDim.x + __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(args.tile_counter, 1) : 0, 0);
    } else {
      if (t + int(gridDim.x) < args.tail_start) return t + int(gridDim.x);
      if (t < args.tail_start) return tail_of(blockIdx.x, args);
      const Sm90Tail tail = Sm90Tail::of(args, count);
      const int u = t - count, share_end = tail.unit_start(tail.cta_of(u) + 1);
      const int piece_end = min(share_end, (u / tail.key_tiles + 1) * tail.key_tiles);
      return count + (piece_end < share_end ? piece_end : tail.units);
    }
  }

  // Work t: a whole tile or a piece of one.
  template <typename Args>
  __device__ __forceinline__ Sm90Work work(int t, const Args& args) const {
    if (kUneven || t < count) return {t, 0, 1 << 30, 1, 0, 0, 0};
    const Sm90Tail tail = Sm90Tail::of(args, count);
    const int u = t - count;
    return piece(tail, u / tail.key_tiles, tail.cta_of(u));
  }
  // This CTA's piece of tail tile `tile` (its work's number not kept: a register less).
  template <typename Args>
  __device__ __forceinline__ Sm90Work piece_of(int tile, const Args& args) const {
    return piece(Sm90Tail::of(args, count), tile - args.tail_start, blockIdx.x);
  }
  // CTA c's piece of the tail's tile i.
  static __device__ __forceinline__ Sm90Work piece(const Sm90Tail& tail, int i, int c) {
    const int n = tail.key_tiles, begin = max(tail.unit_start(c), i * n), end = min(tail.unit_start(c + 1), (i + 1) * n);
    const int first = tail.cta_of(i * n), last = tail.cta_of((i + 1) * n - 1);
    return {tail.start + i, begin - i * n, end - i * n, last - first + 1, i, i + c, i + first};
  }
  // The number of the tile of (query block, head, batch) (at's inverse; not kUneven).
  __device__ __forceinline__ int number(int m_block, int head, int batch) const {
    return (batch * heads + head) * m_blocks + m_blocks - 1 - m_block;
  }

  // Tile t's (query block, head, batch).
  __device__ __forceinline__ void at(int t, int& m_block, int& head, int& batch) const {
    int pair, from_last;  // pair: head + heads * batch
    if (kUneven && section > 1) {
      tile_major(t, m_blocks, count / m_blocks, section, from_last, pair);  // (common.cuh)
    } else {
      pair = t / m_blocks, from_last = t % m_blocks;
    }
    m_block = m_blocks - 1 - from_last, head = pair % heads, batch = pair / heads;
  }
};

}  // namespace cuflash
