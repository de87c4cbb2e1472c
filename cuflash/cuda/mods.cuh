// Programmable attention: the user's score_mod and mask_mod (cuflash.mod), traced into
// device functions and compiled with the kernels. A kernel takes them as its template
// argument Mods: NoMods (no code, and Params as the kernel's argument) or UserMods, the
// struct cuflash.mod.kernel_source writes in front of the kernel's source:
//   kScore, kMask                                   which of the two the call has
//   kBlocks                                         a block mask (below) comes with mask_mod
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

// Block sparsity (cuflash.mod.BlockMask): a status for each kBlockMaskSize x kBlockMaskSize
// block of (query, key) positions, per (batch, query head) or broadcast over either.
// kBlockEmpty hides the block: its tiles are never loaded. kBlockFull shows it: mask_mod is
// not evaluated there (score_mod, causal and the window still are). kBlockPartial: mask_mod
// decides score by score. Every mma.sync tile's rows and keys divide kBlockMaskSize, so a
// tile lies in one block (cuflash.mod.BLOCK_SIZE and the tile tables say the same).
constexpr int kBlockMaskSize = 128;
enum : int { kBlockEmpty = 0, kBlockPartial = 1, kBlockFull = 2 };

// The statuses, int8 (batch or 1, heads or 1, query blocks, key blocks): strides in
// elements, 0 where broadcast; the key blocks of a row are contiguous.
struct BlockMaskView {
  const signed char* status;
  int64 batch_stride, head_stride, row_stride;
};

// The argument of a kernel with mods: Params, then the mod tensors and the block mask (its
// status null without one).
struct ModParams : Params {
  ModTensor tensors[kMaxModTensors];
  BlockMaskView blocks;
};

struct NoMods {
  static constexpr bool kScore = false, kMask = false, kBlocks = false;
};

// The one argument of a kernel with Mods: Params itself without any.
template <typename Mods>
using ParamsOf = typename Select<Mods::kScore || Mods::kMask, ModParams, Params>::type;

template <typename Mods>
constexpr bool kHasMods = Mods::kScore || Mods::kMask;

// Kernels with a block mask skip its empty blocks' tiles and its full blocks' mask_mod.
template <typename Mods>
constexpr bool kBlockSparse = Mods::kBlocks;

// The mods of one (batch, head). apply() takes a tile of scores in natural units (after the
// scale, softcap and ALiBi: ScoreMod) to score_mod's, -inf where mask_mod hides them.
template <typename Mods>
struct ModsAt {
  const ModTensor* tensors;
  int batch, head;
  bool whole;  // (block mask) the tile lies in a full block: mask_mod is not evaluated

  static __device__ __forceinline__ ModsAt of(const ParamsOf<Mods>& p, int batch, int head) {
    if constexpr (kHasMods<Mods>) {
      return ModsAt{p.tensors, batch, head, false};
    } else {
      return ModsAt{nullptr, batch, head, false};
    }
  }
  // The mods of a tile, in a full block of the block mask (``whole``) or not.
  __device__ __forceinline__ ModsAt in_block(bool whole) const {
    if constexpr (kBlockSparse<Mods>) {
      return ModsAt{tensors, batch, head, whole};
    } else {
      return *this;
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
      if constexpr (kBlockSparse<Mods>) {
        if (whole) return true;
      }
      return Mods::mask(batch, head, query, key, tensors);
    } else {
      return true;
    }
  }
  // mask_mod alone, on the plain instances (scores as they are, scaled or not): -inf where
  // it hides, but in a full block; the lines of s from row0 (keys with kTransposed, else
  // queries), its columns from col0.
  template <bool kTransposed, int kMTiles, int kNTiles>
  __device__ __forceinline__ void hide(float (&s)[kMTiles][kNTiles][4], int row0, int col0, int lane) const {
    static_assert(!Mods::kScore, "score_mod takes the scores in natural units: the extras' instances");
    if (kBlockSparse<Mods> && whole) return;
    for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int r, int c) {
      if (!(kTransposed ? visible(col0 + c, row0 + r) : visible(row0 + r, col0 + c))) s[mt][nt][e] = -kInf;
    });
  }
  // s[mt][nt][e] (mma C layout) of query row0 + its row, key col0 + its column.
  template <int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kMTiles][kNTiles][4], int row0, int col0, int lane) const {
    if constexpr (kBlockSparse<Mods>) {  // score_mod, then mask_mod but in a full block (one test a tile)
      for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int r, int c) {
        s[mt][nt][e] = score(s[mt][nt][e], row0 + r, col0 + c);
      });
      if (whole) return;
      for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int r, int c) {
        if (!visible(row0 + r, col0 + c)) s[mt][nt][e] = -kInf;
      });
      return;
    }
    for_each_element<kMTiles, kNTiles>(lane, [&](int mt, int nt, int e, int r, int c) {
      const float modified = score(s[mt][nt][e], row0 + r, col0 + c);
      s[mt][nt][e] = visible(row0 + r, col0 + c) ? modified : -kInf;
    });
  }
};

// The key tiles (kBlockN keys each) of one query tile's row of blocks: their statuses and
// which of them a loop visits. Without a block mask nothing is read and every tile counts
// as partial. A tile of kBlockM rows above kBlockMaskSize (the sm_90a forward's 192) spans
// two rows of blocks: a key tile is empty or full where both blocks are, else partial.
// (The statuses' address is computed at each read from the kernel's argument, in the
// constant bank: no pointer holds registers through the loop; at d 128 the forward with
// mods has none to spare.)
template <typename Mods, int kBlockN, int kBlockM = kBlockMaskSize>
struct KeyTiles {
  static_assert(!kBlockSparse<Mods> || kBlockMaskSize % kBlockN == 0, "a key tile lies in one block");
  static_assert(kBlockMaskSize % kBlockM == 0 || (kBlockM % 64 == 0 && kBlockM <= kBlockMaskSize + 64),
                "a query tile lies in one row of blocks, or (64-row aligned) spans two");
  static constexpr int kPerBlock = kBlockMaskSize / kBlockN;
  static constexpr bool kTwoRows = kBlockM > kBlockMaskSize;
  const ParamsOf<Mods>& p;
  int batch, head, m0, m_last;  // the query tile's; m_last its last row in the sequence (kTwoRows)

  static __device__ __forceinline__ KeyTiles of(const ParamsOf<Mods>& p, int batch, int head, int m0,
                                                int m_last = 0) {
    return KeyTiles{p, batch, head, m0, m_last};
  }
  __device__ __forceinline__ int status(int n) const {
    if constexpr (kBlockSparse<Mods>) {
      const BlockMaskView& b = p.blocks;
      auto of_row = [&](int m) {  // the status of row m's block
        return b.status[batch * b.batch_stride + head * b.head_stride + m / kBlockMaskSize * b.row_stride +
                        n / kPerBlock];
      };
      const int first = of_row(m0);
      if constexpr (kTwoRows) {
        return first == of_row(m_last) ? first : kBlockPartial;
      } else {
        return first;
      }
    } else {
      return kBlockPartial;
    }
  }
  // The last tile below n that is not empty (below n_begin where none is at or above it).
  __device__ __forceinline__ int before(int n, int n_begin) const {
    if constexpr (kBlockSparse<Mods>) {
      int t = n - 1;
      while (t >= n_begin && status(t) == kBlockEmpty) t = t / kPerBlock * kPerBlock - 1;
      return t;
    } else {
      return n - 1;
    }
  }
  // The first tile above n that is not empty (n_end or above where none is below n_end).
  __device__ __forceinline__ int after(int n, int n_end) const {
    if constexpr (kBlockSparse<Mods>) {
      int t = n + 1;
      while (t < n_end && status(t) == kBlockEmpty) t = (t / kPerBlock + 1) * kPerBlock;
      return t;
    } else {
      return n + 1;
    }
  }
};

// A query tile's key tiles [n_begin, n_end) under a block mask as bits in shared memory: one
// warp reads their statuses 32 at a time (fill), and the walk over them (before, full) reads
// shared words instead of a global status a tile, one load waiting for the last. Room for
// kMaxKeyTileBits key tiles (the planner sends longer rows elsewhere).
constexpr int kMaxKeyTileBits = 2048;
struct KeyTileBits {
  static constexpr int kWords = kMaxKeyTileBits / 32;
  static constexpr int kBytes = (2 * kWords + 1) * 4;
  unsigned* shown;  // bit n: key tile n lies in a block that is not empty (0 outside [n_begin, n_end))
  unsigned* whole;  // bit n: in a full block
  int* count;       // the tiles shown

  static __device__ __forceinline__ KeyTileBits at(unsigned char* base) {
    unsigned* words = reinterpret_cast<unsigned*>(base);
    return {words, words + kWords, reinterpret_cast<int*>(words + 2 * kWords)};
  }
  // By the 32 lanes of one warp, the statuses of four words' tiles loaded before any is used.
  template <typename Mods, int kBlockN, int kBlockM>
  __device__ __forceinline__ void fill(const KeyTiles<Mods, kBlockN, kBlockM>& keys, int n_begin, int n_end,
                                       int lane) const {
    int shown_tiles = 0;
    for (int w0 = n_begin / 32; w0 * 32 < n_end; w0 += 4) {
      int status[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = (w0 + i) * 32 + lane;
        status[i] = n >= n_begin && n < n_end ? keys.status(n) : kBlockEmpty;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const unsigned s = __ballot_sync(~0u, status[i] != kBlockEmpty);
        const unsigned f = __ballot_sync(~0u, status[i] == kBlockFull);
        if (lane == 0 && (w0 + i) * 32 < n_end) shown[w0 + i] = s, whole[w0 + i] = f;
        shown_tiles += __popc(s);
      }
    }
    if (lane == 0) *count = shown_tiles;
  }
  // The last shown tile below n (n_begin - 1 where none).
  __device__ __forceinline__ int before(int n, int n_begin) const {
    const int t = n - 1;
    if (t < n_begin) return n_begin - 1;
    int w = t / 32;
    unsigned bits = shown[w] & ((2u << (t % 32)) - 1);
    while (bits == 0) {
      if (--w < n_begin / 32) return n_begin - 1;
      bits = shown[w];
    }
    return w * 32 + 31 - __clz(bits);
  }
  __device__ __forceinline__ bool full(int n) const { return (whole[n / 32] >> (n % 32)) & 1; }
};

// The query tiles (kBlockM rows each) of one key tile's column of blocks, for the backward's
// loops over (query head, query tile) pairs: heads [head_begin, head_end), tiles [m_begin,
// m_end), head by head. Only with a block mask (the loops of the dense kernels number every
// pair).
template <typename Mods, int kBlockM>
struct QueryTiles {
  static_assert(!kBlockSparse<Mods> || kBlockMaskSize % kBlockM == 0, "a query tile lies in one block");
  static constexpr int kPerBlock = kBlockMaskSize / kBlockM;
  const signed char* column;  // the statuses of the key tile's column of blocks
  int64 head_stride, row_stride;
  int head_end, m_begin, m_end;

  static __device__ __forceinline__ QueryTiles of(const ParamsOf<Mods>& p, int batch, int n0, int head_end,
                                                  int m_begin, int m_end) {
    if constexpr (kBlockSparse<Mods>) {
      const BlockMaskView& b = p.blocks;
      return QueryTiles{b.status + batch * b.batch_stride + n0 / kBlockMaskSize, b.head_stride, b.row_stride,
                        head_end, m_begin, m_end};
    } else {
      return QueryTiles{nullptr, 0, 0, head_end, m_begin, m_end};
    }
  }
  __device__ __forceinline__ int status(int head, int m_tile) const {
    if constexpr (kBlockSparse<Mods>) {
      return column[head * head_stride + m_tile / kPerBlock * row_stride];
    } else {
      return kBlockPartial;
    }
  }
  // (head, m_tile), or the first pair after it that is not empty; head == head_end where none.
  __device__ __forceinline__ int2 from(int head, int m_tile) const {
    if (m_end <= m_begin) return make_int2(head_end, m_begin);  // (no query tile: m_begin may be past the end)
    while (head < head_end && status(head, m_tile) == kBlockEmpty) {
      m_tile = (m_tile / kPerBlock + 1) * kPerBlock;
      if (m_tile >= m_end) {
        ++head;
        m_tile = m_begin;
      }
    }
    return make_int2(head, m_tile);
  }
  // The pairs that are not empty, from head head_begin on.
  __device__ __forceinline__ int count(int head_begin) const {
    int pairs = 0;
    for (int head = head_begin; head < head_end; ++head)
      for (int m = m_begin; m < m_end; m = (m / kPerBlock + 1) * kPerBlock)
        if (status(head, m) != kBlockEmpty) pairs += min((m / kPerBlock + 1) * kPerBlock, m_end) - m;
    return pairs;
  }
};

}  // namespace cuflash
