"""The CPU backend: FlashAttention's blockwise online softmax in NumPy.

Same algorithm and same semantics as the CUDA kernels, so it doubles as a readable model of
them: stream key/value blocks past each query block, keep per query row a running max m, a
running sum l and an unnormalised accumulator O, rescale both by exp(m_old - m_new) when the
max moves, and finish with O / l and LSE = m + log(l). Only a block_q x block_k tile of
scores exists at any time, never the full seqlen_q x seqlen_k matrix.

The backward (FlashAttention-2's) recomputes each tile of P from the saved LSE instead of
keeping P: key blocks in the outer loop own their dK, dV accumulators, query blocks stream
past them and add their share to a dQ accumulator of the size of q. A gradient of the LSE
(dLSE) enters through the row term alone: D = rowsum(dO ∘ O) - dLSE.

Every block operation is vectorised over batch and heads; query heads are viewed as
(nheads_kv, group) so that a kv head broadcasts over the query heads that share it (GQA).

The variants, per tile, in this order (query i, key j, diag = seqlen_k - seqlen_q):
S = scale * Q Kᵀ; softcap: S = softcap * tanh(S / softcap); ALiBi: S -= slope * |i + diag - j|;
score_mod: S = score_mod(S, b, h, i, j, *mod_tensors); mask (the sliding window
[i + diag - left, i + diag + right], causal being right = 0, and mask_mod(b, h, i, j,
*mod_tensors)); online softmax. score_mod and mask_mod are traced once a call
(``cuflash.mod``) and evaluated on each tile's scores; the backward multiplies dS by
d score_mod / d S, their traced derivative. Dropout multiplies the tile of P by
keep / (1 - p) before P V only (l and the LSE see the undropped P); the keep bits come from
cuflash._philox, tile by tile, keyed by (seed, rng_offset, batch, head, row, col). Tiles
wholly outside the window are never computed (a mask_mod skips none). A block mask's
statuses (``cuflash.mod.BlockMask``) decide per 128 x 128 block: an empty block is masked, a
full one shown without mask_mod, a partial one masked by mask_mod (the kernels' rule).

The KV-cache call (``attention_with_kvcache``) appends to the caches in place, then runs
this forward over each sequence's keys.
"""

import numpy as np

from . import _options, _philox, mod

__all__ = [
    "attention_forward",
    "attention_backward",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "attention_with_kvcache",
]


class _Variant:
    """One (fixed-length or single varlen) problem's options, and the tile operations that
    depend on them: which tiles to visit, scores, mask, dropout.

    `batch_index` holds the global batch index of each batch element here (the ALiBi row, the
    dropout counter's batch and the b of score_mod and mask_mod); alibi is
    (len(batch_index), nheads) or None; mods the call's cuflash.mod.NumpyModifiers or None;
    blocks a block mask's int8 statuses (1 or batch, 1 or nheads, query blocks, key blocks)
    or None.
    """

    def __init__(self, seqlen_q, seqlen_k, nheads, nheads_kv, acc_dtype, *, causal, scale,
                 window_size, softcap, alibi, dropout_p, seed, rng_offset, batch_index, window_limit=None,
                 mods=None, blocks=None):
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.nheads, self.nheads_kv = nheads, nheads_kv
        self.acc_dtype = acc_dtype
        self.scale = acc_dtype(scale)
        # Bottom-right alignment: key diag + i is query i's diagonal.
        self.diagonal = seqlen_k - seqlen_q
        # flash-attn's normalisation: a negative side or one >= seqlen_k (the KV-cache call:
        # the cache's length, window_limit) is unbounded (-1); causal is right = 0.
        limit = seqlen_k if window_limit is None else window_limit
        left, right = (int(w) for w in window_size)
        self.left = -1 if left < 0 or left >= limit else left
        self.right = 0 if causal else (-1 if right < 0 or right >= limit else right)
        self.softcap = float(softcap)
        self.alibi = None
        if alibi is not None:
            group = nheads // nheads_kv
            self.alibi = alibi.astype(acc_dtype).reshape(-1, nheads_kv, group, 1, 1)
        self.dropout_p = float(dropout_p)
        self.seed, self.rng_offset, self.batch_index = seed, rng_offset, batch_index
        self.mods = mods
        if mods is not None:  # the (b, h) index arrays of a tile, laid out like its scores
            group = nheads // nheads_kv
            self.mod_batch = np.asarray(batch_index, dtype=np.int64).reshape(-1, 1, 1, 1, 1)
            self.mod_heads = np.arange(nheads).reshape(1, nheads_kv, group, 1, 1)
        self.blocks = None
        if blocks is not None:  # grouped like the scores: (1 or batch, 1 or nheads_kv, 1 or group, ...)
            blocks = np.asarray(blocks)
            heads = (nheads_kv, nheads // nheads_kv) if blocks.shape[1] == nheads else (1, 1)
            self.blocks = blocks.reshape(blocks.shape[0], *heads, *blocks.shape[2:])

    def key_range(self, q_start, q_end):
        """[first, stop) of the keys any of the rows q_start .. q_end - 1 may see."""
        first, stop = 0, self.seqlen_k
        if self.left >= 0:
            first = max(first, q_start + self.diagonal - self.left)
        if self.right >= 0:
            stop = min(stop, q_end - 1 + self.diagonal + self.right + 1)
        return first, stop

    def query_range(self, k_start, k_end):
        """[first, stop) of the rows that may see any of the keys k_start .. k_end - 1."""
        first, stop = 0, self.seqlen_q
        if self.right >= 0:
            first = max(first, k_start - self.diagonal - self.right)
        if self.left >= 0:
            stop = min(stop, k_end - 1 - self.diagonal + self.left + 1)
        return first, stop

    def scores(self, q_block, k_block, q_start, q_end, k_start, k_end, gradient=False):
        """The masked tile S (-inf where invisible) and, with ``gradient``, the chain factor
        d S / d (scale q.k) of softcap and score_mod for the backward (None where there is
        none; 0 where S is masked)."""
        s = (q_block @ k_block.swapaxes(-1, -2)) * self.scale
        chain = None
        if self.softcap > 0:
            tanh = np.tanh(s / self.acc_dtype(self.softcap))
            s = self.acc_dtype(self.softcap) * tanh
            if gradient:  # d(softcap * tanh(x / softcap)) / dx
                chain = 1 - tanh * tanh
        rows = cols = None
        if self.alibi is not None:
            rows, cols = np.arange(q_start, q_end)[:, None], np.arange(k_start, k_end)[None, :]
            distance = np.abs(rows + self.diagonal - cols).astype(self.acc_dtype)
            s = s - self.alibi * distance
        mask = None
        if self.mods is not None:
            if rows is None:
                rows, cols = np.arange(q_start, q_end)[:, None], np.arange(k_start, k_end)[None, :]
            where = (self.mod_batch, self.mod_heads, rows, cols)
            mod_gradient = self.mods.gradient(s, *where) if gradient else None
            if mod_gradient is not None:
                chain = mod_gradient if chain is None else chain * mod_gradient
            s = self.mods.score(s, *where)
            mask = self.mods.mask(*where, self.acc_dtype)
            if self.blocks is not None:  # a block's status decides, but in partial blocks
                status = self.blocks[..., rows[:, 0] // mod.BLOCK_SIZE, :][..., cols[0] // mod.BLOCK_SIZE]
                mask = (status == mod.FULL) | ((status == mod.PARTIAL) & (True if mask is None else mask))
        # Only tiles crossing a window edge pay for the mask. It comes after scaling so that
        # a scale of 0 never meets -inf.
        clips_left = self.left >= 0 and k_start < q_end - 1 + self.diagonal - self.left
        clips_right = self.right >= 0 and k_end - 1 > q_start + self.diagonal + self.right
        if clips_left or clips_right:
            if rows is None:
                rows, cols = np.arange(q_start, q_end)[:, None], np.arange(k_start, k_end)[None, :]
            offset = cols - (rows + self.diagonal)  # the key's distance right of the diagonal
            visible = np.ones(offset.shape, dtype=bool)
            if clips_left:
                visible &= offset >= -self.left
            if clips_right:
                visible &= offset <= self.right
            s = np.where(visible, s, -np.inf)
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        if chain is not None and self.mods is not None:
            # A masked score has P = 0; its derivative there may be NaN (sqrt of a negative), and
            # 0 * NaN must not reach dS.
            chain = np.where(s == -np.inf, 0, chain)
        return s, chain

    def dropout(self, q_start, q_end, k_start, k_end):
        """keep / (1 - p) for the tile, grouped (batch, nheads_kv, group, rows, cols), or None
        without dropout. Only the tile's bits are generated."""
        if self.dropout_p == 0:
            return None
        keep = _philox.keep_block(self.seed, self.rng_offset, self.dropout_p, self.nheads,
                                  self.batch_index, q_start, q_end, k_start, k_end)
        group = self.nheads // self.nheads_kv
        keep = keep.reshape(len(self.batch_index), self.nheads_kv, group, *keep.shape[2:])
        return keep * self.acc_dtype(1 / (1 - self.dropout_p))


def _check_options(dropout_p, seed):
    # The arguments come checked by cuflash.api (cuflash._options); what is left is this
    # module's own contract: dropout needs its seed here, forward or backward.
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs a seed")


def _alibi_rows(alibi_slopes, batch_index, nheads):
    """The (len(batch_index), nheads) slopes of the given batch elements, or None."""
    if alibi_slopes is None:
        return None
    slopes = np.asarray(alibi_slopes)
    if slopes.ndim == 1:
        return np.broadcast_to(slopes, (len(batch_index), nheads))
    return slopes[list(batch_index)]


def attention_forward(
    q, k, v, *, causal, softmax_scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    dropout_p=0.0, seed=None, rng_offset=0, block_q=128, block_k=128, score_mod=None, mask_mod=None,
    mod_tensors=(), block_statuses=None,
):
    """Exact attention of validated NumPy arrays: returns (out, lse).

    q (batch, seqlen_q, nheads, d), k and v (batch, seqlen_k, nheads_kv, d), all one dtype
    of float16, float32 or float64. Computes in float32 (float64 for float64 inputs) and
    returns out in the input dtype and lse as float32 (batch, nheads, seqlen_q). A fully
    masked row gives out 0 and lse +inf; NaN inputs propagate to the outputs that read them.

    window_size (left, right), softcap, alibi_slopes (float32 (nheads,) or (batch, nheads))
    and dropout_p are flash-attn's (see the module docstring); dropout draws its keep mask
    from Philox keyed by `seed` (a 64-bit unsigned int, required when dropout_p > 0) and
    `rng_offset`. score_mod and mask_mod (with the NumPy arrays mod_tensors) are
    cuflash.mod's, applied after ALiBi (see the module docstring); block_statuses a
    cuflash.mod.BlockMask's statuses (with mask_mod), or None.
    """
    variant = _dense_variant(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                             softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                             rng_offset=rng_offset, mods=mod.prepare(score_mod, mask_mod, mod_tensors),
                             blocks=block_statuses)
    return _forward(q, k, v, variant, block_q, block_k)


def _dense_variant(q, k, *, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed,
                   rng_offset, mods, blocks=None):
    """The options of a dense (batch, seqlen, nheads, d) call, checked, as one _Variant."""
    _check_options(dropout_p, seed)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    batch_index = np.arange(batch)
    return _Variant(
        seqlen_q, seqlen_k, nheads, nheads_kv, _acc_dtype(q), causal=causal,
        scale=_scale(softmax_scale, q), window_size=window_size, softcap=softcap,
        alibi=_alibi_rows(alibi_slopes, batch_index, nheads), dropout_p=dropout_p, seed=seed,
        rng_offset=rng_offset, batch_index=batch_index, mods=mods, blocks=blocks,
    )


def _acc_dtype(x):
    return np.float64 if x.dtype == np.float64 else np.float32


def _scale(softmax_scale, q):
    return _options.default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _forward(q, k, v, variant, block_q, block_k):
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    in_dtype, acc_dtype = q.dtype, variant.acc_dtype

    # (batch, nheads_kv, group, seqlen, d): heads lead so the matmuls batch over them, and the
    # kv tensors get a group axis of 1 that broadcasts over the query heads of each kv head.
    q = q.astype(acc_dtype).reshape(batch, seqlen_q, nheads_kv, group, d)
    q = q.transpose(0, 2, 3, 1, 4)
    k = k.astype(acc_dtype).transpose(0, 2, 1, 3)[:, :, None]
    v = v.astype(acc_dtype).transpose(0, 2, 1, 3)[:, :, None]

    out = np.empty((batch, nheads_kv, group, seqlen_q, v.shape[-1]), dtype=acc_dtype)
    lse = np.empty((batch, nheads_kv, group, seqlen_q), dtype=acc_dtype)

    # for each query block Q_i:  m = -inf, l = 0, O = 0
    for q_start in range(0, seqlen_q, block_q):
        q_end = min(q_start + block_q, seqlen_q)
        q_block = q[..., q_start:q_end, :]
        row_shape = q_block.shape[:-1]
        m = np.full(row_shape, -np.inf, dtype=acc_dtype)
        l = np.zeros(row_shape, dtype=acc_dtype)
        acc = np.zeros(row_shape + (v.shape[-1],), dtype=acc_dtype)

        # Only the key blocks that meet the rows' window are visited (causal: none past the
        # diagonal of the block's last row; a left window: none before its first row's).
        first_key, key_stop = variant.key_range(q_start, q_end)

        # for each key block K_j, V_j:
        #   S = scores(Q_i, K_j);  m_new = max(m, rowmax(S));  P = exp(S - m_new)
        #   l = exp(m - m_new) l + rowsum(P);  O = exp(m - m_new) O + (P ∘ Z) V_j
        for k_start in range(first_key // block_k * block_k, key_stop, block_k):
            k_end = min(k_start + block_k, seqlen_k)
            s, _ = variant.scores(q_block, k[..., k_start:k_end, :], q_start, q_end, k_start, k_end)

            m_new = np.maximum(m, s.max(axis=-1))
            # A row with nothing visible yet has m_new = -inf; offset by 0 there so that
            # -inf - -inf = NaN never appears (its P and rescale factor are then exactly 0).
            offset = np.where(m_new == -np.inf, 0, m_new)
            p = np.exp(s - offset[..., None])
            rescale = np.exp(m - offset)
            l = rescale * l + p.sum(axis=-1)
            # Dropout touches P V only: l (and so the LSE) sums the undropped P.
            keep = variant.dropout(q_start, q_end, k_start, k_end)
            p_v = (p if keep is None else p * keep) @ v[..., k_start:k_end, :]
            acc = rescale[..., None] * acc + p_v
            m = m_new

        # O = O / l,  LSE = m + log(l);  l == 0 (nothing visible) -> O = 0, LSE = +inf
        empty = l == 0
        l_safe = np.where(empty, 1, l)
        out[..., q_start:q_end, :] = acc / l_safe[..., None]
        lse[..., q_start:q_end] = np.where(empty, np.inf, m + np.log(l_safe))

    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, seqlen_q, nheads, v.shape[-1])
    return out.astype(in_dtype), lse.reshape(batch, nheads, seqlen_q).astype(np.float32)


def attention_backward(
    dout, q, k, v, out, lse, *, causal, softmax_scale, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0, block_q=128, block_k=128,
    dlse=None, score_mod=None, mask_mod=None, mod_tensors=(), block_statuses=None,
):
    """Gradients of attention_forward's out and lse for validated NumPy arrays: returns
    (dq, dk, dv).

    dout and out are laid out like q; lse is attention_forward's float32 (batch, nheads,
    seqlen_q), cast to the compute dtype, so float64 inputs are only as exact as their lse.
    dlse, laid out like lse, is the gradient of lse (None: lse is not used); rows with
    lse = +inf ignore theirs.
    The options must be the forward's (the same seed and rng_offset regenerate its dropout
    mask). Computes in float32 (float64 for float64 inputs) and returns dq, dk, dv in the
    input dtype, shaped like q, k, v. Rows that see no key (lse = +inf) get dq = 0 and
    add nothing to dk, dv. Beyond dq and dk, dv, the extra memory is O(seqlen) per head
    plus one block_q x block_k tile.
    """
    variant = _dense_variant(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                             softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                             rng_offset=rng_offset,
                             mods=mod.prepare(score_mod, mask_mod, mod_tensors, backward=True), blocks=block_statuses)
    return _backward(dout, q, k, v, out, lse, dlse, variant, block_q, block_k)


def _backward(dout, q, k, v, out, lse, dlse, variant, block_q, block_k):
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    in_dtype, acc_dtype = q.dtype, variant.acc_dtype
    scale = variant.scale

    # The forward's layout: (batch, nheads_kv, group, seqlen, d) for the query-side tensors,
    # (batch, nheads_kv, 1, seqlen_k, d) for k and v.
    def by_head(x):
        x = x.astype(acc_dtype).reshape(batch, seqlen_q, nheads_kv, group, x.shape[-1])
        return x.transpose(0, 2, 3, 1, 4)

    q, dout = by_head(q), by_head(dout)
    k = k.astype(acc_dtype).transpose(0, 2, 1, 3)[:, :, None]
    v = v.astype(acc_dtype).transpose(0, 2, 1, 3)[:, :, None]
    lse = lse.astype(acc_dtype).reshape(batch, nheads_kv, group, seqlen_q)

    # D = rowsum(dO ∘ O): the softmax backward's rowsum(P ∘ dP), known before any P exists
    # (O is the dropped output, so this holds under dropout too).
    delta = (dout * by_head(out)).sum(axis=-1)
    if dlse is not None:
        # LSE = logsumexp(S) adds dLSE ∘ P to dS = P ∘ (dP - D). A row with LSE = +inf has
        # P = 0 and takes none of it (its dLSE may be NaN: 0 * NaN would poison dS).
        dlse = dlse.astype(acc_dtype).reshape(lse.shape)
        delta = delta - np.where(lse == np.inf, 0, dlse)

    dq = np.zeros(q.shape, dtype=acc_dtype)
    dk = np.zeros((batch, nheads_kv, seqlen_k, d), dtype=acc_dtype)
    dv = np.zeros((batch, nheads_kv, seqlen_k, v.shape[-1]), dtype=acc_dtype)

    # for each key block K_j, V_j:  dK_j = 0, dV_j = 0
    for k_start in range(0, seqlen_k, block_k):
        k_end = min(k_start + block_k, seqlen_k)
        k_block, v_block = k[..., k_start:k_end, :], v[..., k_start:k_end, :]
        # Views: the += below accumulate straight into dk and dv.
        dk_block, dv_block = dk[..., k_start:k_end, :], dv[..., k_start:k_end, :]

        # Only the query blocks whose window meets these keys are visited (causal: none
        # wholly above the diagonal; a left window: none wholly below it).
        first_row, row_stop = variant.query_range(k_start, k_end)

        # for each query block Q_i:
        #   P = exp(scores(Q_i, K_j) - LSE_i);  dV_j += (P ∘ Z)ᵀ dO_i;  dP = (dO_i V_jᵀ) ∘ Z
        #   dS = P ∘ (dP - D_i) [∘ (1 - tanh²), softcap] [∘ d score_mod / dS];  dK_j += scale * dSᵀ Q_i;
        #   dQ_i += scale * dS K_j
        for q_start in range(first_row // block_q * block_q, row_stop, block_q):
            q_end = min(q_start + block_q, seqlen_q)
            q_block, dout_block = q[..., q_start:q_end, :], dout[..., q_start:q_end, :]
            s, chain = variant.scores(q_block, k_block, q_start, q_end, k_start, k_end, gradient=True)
            # P = 0 wherever S = -inf (masked) or LSE = +inf (a row that sees no key):
            # -inf - finite and finite - +inf both give exp(-inf) = 0, and S = -inf never
            # meets LSE = -inf, which a row with any visible key cannot have.
            p = np.exp(s - lse[..., q_start:q_end, None])
            dp = dout_block @ v_block.swapaxes(-1, -2)
            keep = variant.dropout(q_start, q_end, k_start, k_end)
            if keep is None:
                dv_block += (p.swapaxes(-1, -2) @ dout_block).sum(axis=2)
            else:
                dv_block += ((p * keep).swapaxes(-1, -2) @ dout_block).sum(axis=2)
                dp = dp * keep
            ds = p * (dp - delta[..., q_start:q_end, None])
            if chain is not None:
                ds = ds * chain
            dk_block += scale * (ds.swapaxes(-1, -2) @ q_block).sum(axis=2)
            dq[..., q_start:q_end, :] += scale * (ds @ k_block)

    dq = dq.transpose(0, 3, 1, 2, 4).reshape(batch, seqlen_q, nheads, d)
    dk, dv = (x.transpose(0, 2, 1, 3) for x in (dk, dv))
    return dq.astype(in_dtype), dk.astype(in_dtype), dv.astype(in_dtype)


def _varlen_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """(b, rows of q, rows of k) of each sequence of a packed batch."""
    cu_q, cu_k = (np.asarray(c).tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        for rows, longest, name in ((rows_q, max_seqlen_q, "q"), (rows_k, max_seqlen_k, "k")):
            if rows.stop - rows.start > longest:
                raise ValueError(
                    f"sequence {b} has {rows.stop - rows.start} {name} rows, more than "
                    f"max_seqlen_{name}={longest}"
                )
        yield b, rows_q, rows_k


def _varlen_variant(q, k, b, rows_q, rows_k, *, causal, softmax_scale, window_size, softcap,
                    alibi_slopes, dropout_p, seed, rng_offset, mods, blocks=None):
    """Sequence b's options; ``blocks`` the block mask's statuses over (sequences or 1, ...),
    positions within each sequence: b's row of them."""
    nheads, nheads_kv = q.shape[1], k.shape[1]
    if blocks is not None and blocks.shape[0] > 1:
        blocks = blocks[b:b + 1]
    return _Variant(
        rows_q.stop - rows_q.start, rows_k.stop - rows_k.start, nheads, nheads_kv,
        _acc_dtype(q), causal=causal, scale=_scale(softmax_scale, q), window_size=window_size,
        softcap=softcap, alibi=_alibi_rows(alibi_slopes, [b], nheads), dropout_p=dropout_p,
        seed=seed, rng_offset=rng_offset, batch_index=np.array([b]), mods=mods, blocks=blocks,
    )


def attention_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal,
    softmax_scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
    seed=None, rng_offset=0, block_q=128, block_k=128, score_mod=None, mask_mod=None, mod_tensors=(),
    block_statuses=None,
):
    """attention_forward of a packed variable-length batch: returns (out, lse).

    q (total_q, nheads, d), k and v (total_k, nheads_kv, d); cu_seqlens_q and cu_seqlens_k
    int32 (batch + 1,) cumulative offsets (zero-length sequences allowed), no sequence longer
    than max_seqlen_q / max_seqlen_k. Each sequence b is attention_forward of its own rows
    with its own seqlen_q and seqlen_k (causal/window diagonal, window normalisation), ALiBi
    row b of (batch, nheads) slopes and batch index b in the dropout counter and in
    score_mod / mask_mod (rows and columns counted within the sequence), and row b of
    block_statuses (a block mask over (sequences, heads, max_seqlen_q, max_seqlen_k)). out
    like q; lse float32 (nheads, total_q).
    """
    _check_options(dropout_p, seed)
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                   rng_offset=rng_offset, mods=mod.prepare(score_mod, mask_mod, mod_tensors),
                   blocks=None if block_statuses is None else np.asarray(block_statuses))
    out = np.zeros(q.shape[:2] + v.shape[-1:], dtype=q.dtype)
    lse = np.full((q.shape[1], q.shape[0]), np.inf, dtype=np.float32)
    sequences = _varlen_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for b, rows_q, rows_k in sequences:
        variant = _varlen_variant(q, k, b, rows_q, rows_k, **options)
        args = (q[None, rows_q], k[None, rows_k], v[None, rows_k])
        o, l = _forward(*args, variant, block_q, block_k)
        out[rows_q], lse[:, rows_q] = o[0], l[0]
    return out, lse


def attention_varlen_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
    causal, softmax_scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    dropout_p=0.0, seed=None, rng_offset=0, block_q=128, block_k=128, dlse=None,
    score_mod=None, mask_mod=None, mod_tensors=(), block_statuses=None,
):
    """attention_backward of a packed variable-length batch: returns (dq, dk, dv) shaped and
    typed like q, k, v. out and lse ((nheads, total_q) float32) are
    attention_varlen_forward's for the same arguments; dlse, if given, is laid out like lse."""
    _check_options(dropout_p, seed)
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                   rng_offset=rng_offset, mods=mod.prepare(score_mod, mask_mod, mod_tensors, backward=True),
                   blocks=None if block_statuses is None else np.asarray(block_statuses))
    dq, dk, dv = (np.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
    sequences = _varlen_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for b, rows_q, rows_k in sequences:
        variant = _varlen_variant(q, k, b, rows_q, rows_k, **options)
        grads = _backward(dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k],
                          out[None, rows_q], lse[None, :, rows_q], None if dlse is None else dlse[None, :, rows_q],
                          variant, block_q, block_k)
        dq[rows_q], dk[rows_k], dv[rows_k] = (g[0] for g in grads)
    return dq, dk, dv


# --- the KV-cache call -------------------------------------------------------------------------

def attention_with_kvcache(q, k_cache, v_cache, k, v, cache: _options.KVCache, options: _options.Options):
    """The KV-cache call (``cuflash.attention_with_kvcache``) on checked NumPy arrays: the new
    keys (rotated in the accumulator type, stored in the cache's) and values appended to
    the caches in place, then each sequence's forward over its keys. Returns (out, lse)."""
    batch, seqlen_q, nheads, _ = q.shape
    nheads_k = k_cache.shape[2]
    acc = np.float64 if q.dtype == np.float64 else np.float32
    lengths = cache.lengths.astype(np.int64)
    batch_idx = None if cache.batch_idx is None else np.asarray(cache.batch_idx.obj)
    table = None if cache.block_table is None else np.asarray(cache.block_table.obj)
    leftpad = np.zeros(batch, np.int64) if cache.leftpad is None else np.asarray(cache.leftpad.obj)
    cos = sin = None
    if cache.rotary_cos is not None:
        cos, sin = (np.asarray(a.obj).astype(acc) for a in (cache.rotary_cos, cache.rotary_sin))
    local = options.window != (-1, -1)
    alibi = None if options.alibi is None else np.broadcast_to(np.asarray(options.alibi.obj), (batch, nheads))

    out = np.empty(q.shape[:3] + v_cache.shape[-1:], dtype=q.dtype)
    lse = np.empty((batch, nheads, seqlen_q), dtype=np.float32)
    for b in range(batch):
        n = int(lengths[b])
        if cache.seqlen_new:
            new_k = k[b]
            if cos is not None:  # rotated in the accumulator type, stored in the cache's
                new_k = _rotate(new_k.astype(acc), cos, sin, np.arange(n, n + cache.seqlen_new),
                                cache.rotary_interleaved)
            where = _rows(b, np.arange(n, n + cache.seqlen_new), batch_idx, table, cache.page_size)
            k_cache[where] = new_k.astype(k_cache.dtype)
            v_cache[where] = v[b]
        keys = _rows(b, np.arange(int(leftpad[b]), n + cache.seqlen_new), batch_idx, table, cache.page_size)
        q_b = q[b]
        if cos is not None:
            positions = np.arange(n, n + seqlen_q) if local else np.full(seqlen_q, n)
            q_b = _rotate(q_b.astype(acc), cos, sin, positions, cache.rotary_interleaved).astype(q.dtype)
        variant = _Variant(
            seqlen_q, len(keys[0]), nheads, nheads_k, acc, causal=options.causal, scale=options.scale,
            window_size=options.window, softcap=options.softcap,
            alibi=None if alibi is None else alibi[b:b + 1], dropout_p=0.0, seed=0, rng_offset=0,
            batch_index=np.array([b]), window_limit=cache.capacity)
        o, l = _forward(q_b[None], k_cache[keys][None], v_cache[keys][None], variant, 128, 128)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def _rows(b, positions, batch_idx, table, page_size):
    """(cache row or page, row in it) of sequence b's logical rows ``positions``."""
    if table is not None:
        return table[b].astype(np.int64)[positions // page_size], positions % page_size
    return np.full(len(positions), b if batch_idx is None else int(batch_idx[b])), positions


def _rotate(x, cos, sin, positions, interleaved):
    """x (seqlen, nheads, d) with its first 2 * cos.shape[1] features rotated at ``positions``."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    pairs = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half), slice(half, 2 * half))
    first, second = x[..., pairs[0]], x[..., pairs[1]]
    out = x.copy()
    out[..., pairs[0]], out[..., pairs[1]] = first * c - second * s, first * s + second * c
    return out
