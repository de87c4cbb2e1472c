// Everything a kernel needs to know about one call, passed by value as the one
// kernel argument (the host fills the same layout: cuflash/_params.py).
#pragma once
#include "common.cuh"

namespace cuflash {

// A (batch, seqlen, nheads, headdim) array: strides in elements; the last dim is
// contiguous. Packed variable-length arrays have batch_stride 0.
struct ArrayView {
  elem_t* ptr;
  int64 batch_stride, row_stride, head_stride;
};

struct Params {
  ArrayView q, k, v, o;
  ArrayView dout, dq, dk, dv;  // backward only
  // LSE (and the backward's D = rowsum(dO O), same layout): row i of (batch, head) is
  // at batch * lse_batch_stride + head * lse_head_stride + first row of the sequence + i.
  float* lse;  // the forward writes none where this is null (a caller that asked for none)
  // Backward: the loss's gradient with respect to the LSE, same layout; null where the
  // loss does not use the LSE. The preprocess folds it into D (bwd.cu).
  const float* dlse;
  float* delta;
  // Backward, dQ by atomics: fp32 in 8 x 16 blocks of (rows, nheads, kHeadDim)
  // (dq_accum.cuh, DqAccum), rows numbered as Sequence::q_rows_before counts them; null
  // when dQ has its own pass.
  float* dq_accum;
  // Backward, dQ by atomics in a fixed order (deterministic, the sm_90a kernel): for each
  // query head and query block, the key blocks that have added their dQ, at the block's
  // first row in the LSE's layout; zeroed by the preprocess. Null otherwise.
  int* dq_semaphore;
  int64 lse_batch_stride, lse_head_stride;
  const int* cu_seqlens_q;  // variable length: sequence b is rows [cu[b], cu[b+1]); null when dense
  const int* cu_seqlens_k;
  const float* alibi_slopes;  // slope of (b, h) at b * alibi_batch_stride + h; null when off
  int64 alibi_batch_stride;
  unsigned long long seed, rng_offset;  // dropout's Philox key and counter offset
  int seqlen_q, seqlen_k;  // dense: the lengths; variable length: the longest
  int nheads, heads_per_kv, headdim;
  int window_left, window_right;  // keys [i + diagonal - left, i + diagonal + right]; -1: unbounded
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e), at least FLT_MIN so that -inf stays -inf
  float softcap;     // > 0: scores become softcap * tanh(scale * q.k / softcap)
  unsigned dropout_threshold;  // a probability is dropped iff its Philox word < this; 0: no dropout
  float dropout_scale;         // 1 / (1 - dropout_p)
  int tile_group;  // (head, batch) pairs per group of GridTile's tile-major order, 1..all
};

// Where one sequence lives: its lengths and the global index of its first row.
struct Sequence {
  int seqlen_q, seqlen_k;
  int q_start, k_start;  // first row in the packed arrays (0 when dense)
  int64 q_rows_before;   // rows of all earlier sequences: the offset into (rows, ...) buffers

  static __device__ __forceinline__ Sequence of(const Params& p, int batch) {
    if (p.cu_seqlens_q == nullptr)
      return {p.seqlen_q, p.seqlen_k, 0, 0, int64(batch) * p.seqlen_q};
    const int qs = p.cu_seqlens_q[batch], ks = p.cu_seqlens_k[batch];
    return {p.cu_seqlens_q[batch + 1] - qs, p.cu_seqlens_k[batch + 1] - ks, qs, ks, qs};
  }

  // Row 0 of (batch, head) in a (batch, seqlen, nheads, headdim) array.
  __device__ __forceinline__ elem_t* rows(const ArrayView& a, int batch, int head, bool is_q) const {
    return a.ptr + batch * a.batch_stride + int64(is_q ? q_start : k_start) * a.row_stride + head * a.head_stride;
  }
  // Row 0 of (batch, head) in an LSE-shaped buffer.
  __device__ __forceinline__ int64 lse_offset(const Params& p, int batch, int head) const {
    return batch * p.lse_batch_stride + head * p.lse_head_stride + q_start;
  }
};

}  // namespace cuflash
