"""The CPU backend: FlashAttention's blockwise online softmax in NumPy.

Same algorithm and same semantics as the CUDA kernels, so it doubles as a readable model of
them: stream key/value blocks past each query block, keep per query row a running max m, a
running sum l and an unnormalised accumulator O, rescale both by exp(m_old - m_new) when the
max moves, and finish with O / l and LSE = m + log(l). Only a block_q x block_k tile of
scores exists at any time, never the full seqlen_q x seqlen_k matrix.

The backward (FlashAttention-2's) recomputes each tile of P from the saved LSE instead of
keeping P: key blocks in the outer loop own their dK, dV accumulators, query blocks stream
past them and add their share to a dQ accumulator of the size of q.

Every block operation is vectorised over batch and heads; query heads are viewed as
(nheads_kv, group) so that a kv head broadcasts over the query heads that share it (GQA).
"""

import math

import numpy as np

__all__ = ["attention_forward", "attention_backward"]


def attention_forward(q, k, v, *, causal, softmax_scale, block_q=128, block_k=128):
    """Exact attention of validated NumPy arrays: returns (out, lse).

    q (batch, seqlen_q, nheads, d), k and v (batch, seqlen_k, nheads_kv, d), all one dtype
    of float16, float32 or float64. Computes in float32 (float64 for float64 inputs) and
    returns out in the input dtype and lse as float32 (batch, nheads, seqlen_q). A fully
    masked row gives out 0 and lse +inf; NaN inputs propagate to the outputs that read them.
    """
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    in_dtype = q.dtype
    acc_dtype = np.float64 if in_dtype == np.float64 else np.float32

    # (batch, nheads_kv, group, seqlen, d): heads lead so the matmuls batch over them, and the
    # kv tensors get a group axis of 1 that broadcasts over the query heads of each kv head.
    q = q.astype(acc_dtype).reshape(batch, seqlen_q, nheads_kv, group, d)
    q = q.transpose(0, 2, 3, 1, 4)
    k = k.astype(acc_dtype).transpose(0, 2, 1, 3)[:, :, None]
    v = v.astype(acc_dtype).transpose(0, 2, 1, 3)[:, :, None]
    scale = acc_dtype(scale)

    out = np.empty((batch, nheads_kv, group, seqlen_q, d), dtype=acc_dtype)
    lse = np.empty((batch, nheads_kv, group, seqlen_q), dtype=acc_dtype)
    # Bottom-right alignment: query i sees key j iff j <= i + diagonal.
    diagonal = seqlen_k - seqlen_q

    # for each query block Q_i:  m = -inf, l = 0, O = 0
    for q_start in range(0, seqlen_q, block_q):
        q_end = min(q_start + block_q, seqlen_q)
        q_block = q[..., q_start:q_end, :]
        row_shape = q_block.shape[:-1]
        m = np.full(row_shape, -np.inf, dtype=acc_dtype)
        l = np.zeros(row_shape, dtype=acc_dtype)
        acc = np.zeros(q_block.shape, dtype=acc_dtype)

        # Causal: the last row of the block sees keys up to q_end - 1 + diagonal, so later key
        # blocks are entirely masked and never computed.
        k_stop = min(seqlen_k, q_end + diagonal) if causal else seqlen_k

        # for each key block K_j, V_j:
        #   S = scale * Q_i K_jᵀ;  m_new = max(m, rowmax(S));  P = exp(S - m_new)
        #   l = exp(m - m_new) l + rowsum(P);  O = exp(m - m_new) O + P V_j
        for k_start in range(0, max(k_stop, 0), block_k):
            k_end = min(k_start + block_k, seqlen_k)
            s = (q_block @ k[..., k_start:k_end, :].swapaxes(-1, -2)) * scale
            # Only blocks crossing the diagonal pay for the mask. It is applied after scaling
            # so that a scale of 0 never meets -inf.
            if causal and k_end - 1 > q_start + diagonal:
                rows = np.arange(q_start, q_end)[:, None]
                cols = np.arange(k_start, k_end)[None, :]
                s = np.where(cols <= rows + diagonal, s, -np.inf)

            m_new = np.maximum(m, s.max(axis=-1))
            # A row with nothing visible yet has m_new = -inf; offset by 0 there so that
            # -inf - -inf = NaN never appears (its P and rescale factor are then exactly 0).
            offset = np.where(m_new == -np.inf, 0, m_new)
            p = np.exp(s - offset[..., None])
            rescale = np.exp(m - offset)
            l = rescale * l + p.sum(axis=-1)
            acc = rescale[..., None] * acc + p @ v[..., k_start:k_end, :]
            m = m_new

        # O = O / l,  LSE = m + log(l);  l == 0 (nothing visible) -> O = 0, LSE = +inf
        empty = l == 0
        l_safe = np.where(empty, 1, l)
        out[..., q_start:q_end, :] = acc / l_safe[..., None]
        lse[..., q_start:q_end] = np.where(empty, np.inf, m + np.log(l_safe))

    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, seqlen_q, nheads, d)
    return out.astype(in_dtype), lse.reshape(batch, nheads, seqlen_q).astype(np.float32)


def attention_backward(
    dout, q, k, v, out, lse, *, causal, softmax_scale, block_q=128, block_k=128
):
    """Gradients of attention_forward's out for validated NumPy arrays: returns (dq, dk, dv).

    dout and out are laid out like q; lse is attention_forward's float32 (batch, nheads,
    seqlen_q), cast to the compute dtype, so float64 inputs are only as exact as their lse.
    Computes in float32 (float64 for float64 inputs) and returns dq, dk, dv in the input
    dtype, shaped like q, k, v. Rows that see no key (lse = +inf) get dq = 0 and
    add nothing to dk, dv. Beyond dq and dk, dv, the extra memory is O(seqlen) per head
    plus one block_q x block_k tile.
    """
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    in_dtype = q.dtype
    acc_dtype = np.float64 if in_dtype == np.float64 else np.float32

    # The forward's layout: (batch, nheads_kv, group, seqlen, d) for the query-side tensors,
    # (batch, nheads_kv, 1, seqlen_k, d) for k and v.
    def by_head(x):
        x = x.astype(acc_dtype).reshape(batch, seqlen_q, nheads_kv, group, x.shape[-1])
        return x.transpose(0, 2, 3, 1, 4)

    q, dout = by_head(q), by_head(dout)
    k = k.astype(acc_dtype).transpose(0, 2, 1, 3)[:, :, None]
    v = v.astype(acc_dtype).transpose(0, 2, 1, 3)[:, :, None]
    lse = lse.astype(acc_dtype).reshape(batch, nheads_kv, group, seqlen_q)
    scale = acc_dtype(scale)

    # D = rowsum(dO ∘ O): the softmax backward's rowsum(P ∘ dP), known before any P exists.
    delta = (dout * by_head(out)).sum(axis=-1)

    dq = np.zeros(q.shape, dtype=acc_dtype)
    dk = np.zeros((batch, nheads_kv, seqlen_k, d), dtype=acc_dtype)
    dv = np.zeros((batch, nheads_kv, seqlen_k, v.shape[-1]), dtype=acc_dtype)
    # Bottom-right alignment: query i sees key j iff j <= i + diagonal.
    diagonal = seqlen_k - seqlen_q

    # for each key block K_j, V_j:  dK_j = 0, dV_j = 0
    for k_start in range(0, seqlen_k, block_k):
        k_end = min(k_start + block_k, seqlen_k)
        k_block, v_block = k[..., k_start:k_end, :], v[..., k_start:k_end, :]
        # Views: the += below accumulate straight into dk and dv.
        dk_block, dv_block = dk[..., k_start:k_end, :], dv[..., k_start:k_end, :]

        # Causal: rows before k_start - diagonal see none of these keys, so the query blocks
        # wholly above the diagonal are never computed.
        first_row = max(0, k_start - diagonal) if causal else 0
        q_first = first_row // block_q * block_q

        # for each query block Q_i:
        #   P = exp(scale * Q_i K_jᵀ - LSE_i);  dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ
        #   dS = P ∘ (dP - D_i);  dK_j += scale * dSᵀ Q_i;  dQ_i += scale * dS K_j
        for q_start in range(q_first, seqlen_q, block_q):
            q_end = min(q_start + block_q, seqlen_q)
            q_block, dout_block = q[..., q_start:q_end, :], dout[..., q_start:q_end, :]
            s = (q_block @ k_block.swapaxes(-1, -2)) * scale
            # Only blocks crossing the diagonal pay for the mask, applied after scaling so
            # that a scale of 0 never meets -inf.
            if causal and k_end - 1 > q_start + diagonal:
                rows = np.arange(q_start, q_end)[:, None]
                cols = np.arange(k_start, k_end)[None, :]
                s = np.where(cols <= rows + diagonal, s, -np.inf)
            # P = 0 wherever S = -inf (masked) or LSE = +inf (a row that sees no key):
            # -inf - finite and finite - +inf both give exp(-inf) = 0, and S = -inf never
            # meets LSE = -inf, which a row with any visible key cannot have.
            p = np.exp(s - lse[..., q_start:q_end, None])
            dv_block += (p.swapaxes(-1, -2) @ dout_block).sum(axis=2)
            dp = dout_block @ v_block.swapaxes(-1, -2)
            ds = p * (dp - delta[..., q_start:q_end, None])
            dk_block += scale * (ds.swapaxes(-1, -2) @ q_block).sum(axis=2)
            dq[..., q_start:q_end, :] += scale * (ds @ k_block)

    dq = dq.transpose(0, 3, 1, 2, 4).reshape(batch, seqlen_q, nheads, d)
    dk, dv = (x.transpose(0, 2, 1, 3) for x in (dk, dv))
    return dq.astype(in_dtype), dk.astype(in_dtype), dv.astype(in_dtype)
