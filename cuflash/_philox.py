"""Philox4x32-10, the counter-based RNG behind the dropout mask, in vectorised NumPy.

Counter-based: the random word for an element is a pure function of (seed, offset, batch,
head, row, col), so the mask does not depend on tiles, launch geometry or the order of work,
and the forward and the backward regenerate the same mask independently. The GPU kernels
compute exactly this (Random123's philox4x32_10, the generator curand also ships).

For the element (row, col) of head `head` of batch element `batch` (row and col counted
within the sequence, also for varlen):

    key     = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    counter = (col >> 2, row, batch * nheads + head, offset & 0xFFFFFFFF)
    word    = philox4x32(counter, key)[col & 3]
    dropped iff word < dropout_threshold(p) = min(floor(p * 2**32), 2**32 - 1)

so four consecutive columns (4c .. 4c+3) share one Philox call. Works on NumPy arrays, and on
CuPy arrays when the counters are CuPy arrays (`xp=cupy` for the mask helpers).
"""

import math

import numpy

__all__ = ["philox4x32", "dropout_threshold", "keep_mask", "keep_block", "varlen_keep_masks"]

# Random123's multipliers and Weyl key increments (the golden ratio and sqrt(3) - 1).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF


def _mulhilo(multiplier, x, xp):
    """(hi, lo) 32-bit halves of the 64-bit product multiplier * x, x a uint32 array."""
    product = x.astype(xp.uint64) * xp.uint64(multiplier)
    return (product >> xp.uint64(32)).astype(xp.uint32), product.astype(xp.uint32)


def _array_module(x):
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return numpy


def philox4x32(counter, key):
    """Philox4x32-10 of `counter`, four uint32 arrays (broadcast together), under `key`, two
    integers: returns the four uint32 output words, each of the broadcast shape.

    Each round: (hi0, lo0) = M0 * c0, (hi1, lo1) = M1 * c2 (64-bit products);
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0); then the key is bumped by (W0, W1), so
    the ten rounds use keys k, k + W, ..., k + 9W (mod 2**32).
    """
    xp = next((_array_module(c) for c in counter if not isinstance(c, int)), numpy)
    c0, c1, c2, c3 = xp.broadcast_arrays(*(xp.asarray(c, dtype=xp.uint32) for c in counter))
    k0, k1 = (int(k) & _MASK32 for k in key)
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0, xp)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2, xp)
        c0, c1, c2, c3 = hi1 ^ c1 ^ xp.uint32(k0), lo1, hi0 ^ c3 ^ xp.uint32(k1), lo0
        k0, k1 = (k0 + PHILOX_W0) & _MASK32, (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def dropout_threshold(p):
    """The uint32 threshold below which a word drops its element: floor(p * 2**32), capped at
    2**32 - 1. p * 2**32 is exact in float64 (a power of two), so this is exact too."""
    return min(math.floor(float(p) * 2**32), _MASK32)


def keep_block(seed, offset, p, nheads, batch, row_start, row_stop, col_start, col_stop, *,
               xp=numpy):
    """The keep mask (True = kept) of one tile: rows [row_start, row_stop) and columns
    [col_start, col_stop) of every head of the batch elements `batch` (a sequence of batch
    indices). Returns bool (len(batch), nheads, row_stop - row_start, col_stop - col_start).

    Only the tile is generated (one Philox call per row and group of four columns it
    touches), so a blockwise implementation never holds a seqlen_q x seqlen_k mask.
    """
    batch = xp.asarray(list(batch) if isinstance(batch, range) else batch, dtype=xp.uint64)
    batch = batch.reshape(-1)
    n_rows, n_cols = max(row_stop - row_start, 0), max(col_stop - col_start, 0)
    if batch.size == 0 or nheads == 0 or n_rows == 0 or n_cols == 0:
        return xp.ones((batch.size, nheads, n_rows, n_cols), dtype=bool)
    first_group, last_group = col_start >> 2, (col_stop - 1) >> 2
    groups = xp.arange(first_group, last_group + 1, dtype=xp.uint32)
    rows = xp.arange(row_start, row_stop, dtype=xp.uint32)
    heads = xp.arange(nheads, dtype=xp.uint64)
    batch_head = (batch[:, None] * xp.uint64(nheads) + heads[None, :]) & xp.uint64(_MASK32)
    counter = (
        groups[None, None, None, :],
        rows[None, None, :, None],
        batch_head.astype(xp.uint32)[:, :, None, None],
        int(offset) & _MASK32,
    )
    seed = int(seed)
    words = philox4x32(counter, (seed & _MASK32, (seed >> 32) & _MASK32))
    # Word w of group g belongs to column 4g + w: interleave the words along the columns.
    words = xp.stack(words, axis=-1).reshape(batch.size, nheads, n_rows, -1)
    first = col_start - 4 * first_group
    return words[..., first : first + n_cols] >= xp.uint32(dropout_threshold(p))


def keep_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, p, *, xp=numpy):
    """The whole keep mask, bool (batch, nheads, seqlen_q, seqlen_k), True = kept."""
    return keep_block(seed, offset, p, nheads, range(batch), 0, seqlen_q, 0, seqlen_k, xp=xp)


def varlen_keep_masks(seed, offset, nheads, seqlens_q, seqlens_k, p, *, xp=numpy):
    """Per-sequence keep masks of a varlen batch: a list whose entry b is bool
    (1, nheads, seqlens_q[b], seqlens_k[b]), generated with batch index b (rows and columns
    counted within the sequence), the form attention_reference_varlen takes."""
    return [
        keep_block(seed, offset, p, nheads, [b], 0, int(sq), 0, int(sk), xp=xp)
        for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k))
    ]
