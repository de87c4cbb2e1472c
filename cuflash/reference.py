"""Materialised attention: the float64 oracle every test compares against.

Nothing here is fast. Each function builds the full score matrix for one batch element at a
time, so it is easy to read and easy to trust. All functions take NumPy or CuPy arrays and
compute with the module the inputs came from, so GPU tests can run the oracle on the device in
float64 without a round trip through the host.

Layout (as flash-attn): q (batch, seqlen_q, nheads, d), k and v (batch, seqlen_k, nheads_kv, d)
with nheads % nheads_kv == 0; query head h reads kv head h // (nheads // nheads_kv). Packed
variable-length batches: q (total_q, nheads, d), k and v (total_k, nheads_kv, d), sequence b
being rows cu_seqlens[b]:cu_seqlens[b + 1].

The variants (flash-attn's), for query i and key j of a sequence, diag = seqlen_k - seqlen_q:

    s = scale * q_i . k_j
    s = softcap * tanh(s / softcap)                  softcap > 0
    s = s - slope[b, h] * |i + diag - j|             ALiBi
    visible iff i + diag - left <= j <= i + diag + right   (window_size = (left, right);
        a negative side, or one >= seqlen_k, is unbounded; causal makes right = 0)
    P = softmax over the visible keys;  LSE = log sum exp of the visible s (+inf if none)
    O = (P * keep / (1 - dropout_p)) V               dropout; LSE is unaffected

The dropout keep mask is an argument here (`dropout_keep`, bool (batch, nheads, seqlen_q,
seqlen_k), True = kept): tests take it from cuflash._philox, the generator the kernels use.

Programmable attention (NumPy arrays only): ``score_mod(s, b, h, i, j, *mod_tensors)``
rewrites s after ALiBi, and ``mask_mod(b, h, i, j, *mod_tensors)`` hides the keys where it is
False, with the window (cuflash.mod traces both and evaluates them on the whole score matrix;
b is the sequence index of a packed batch). The backward multiplies dS by the traced
derivative d score_mod / d s.
"""

import math

import numpy

from . import mod

__all__ = [
    "attention_reference",
    "attention_reference_backward",
    "attention_reference_varlen",
    "attention_reference_varlen_backward",
    "attention_lowp",
    "attention_lowp_backward",
    "attention_lowp_varlen",
    "attention_lowp_varlen_backward",
    "attention_textbook",
    "attention_textbook_backward",
    "normalized_window",
    "round_to",
]


def _array_module(x):
    """NumPy or CuPy, whichever `x` belongs to; CuPy is imported only when it is needed."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return numpy


def _default_scale(softmax_scale, headdim):
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def normalized_window(window_size, causal, seqlen_k):
    """(left, right) with -1 for an unbounded side, as flash-attn normalises them: a negative
    side or one >= seqlen_k is unbounded, then causal sets right = 0 (left stays)."""
    left, right = (int(w) for w in window_size)
    left = -1 if left < 0 or left >= seqlen_k else left
    right = -1 if right < 0 or right >= seqlen_k else right
    return left, 0 if causal else right


def _visible(xp, seqlen_q, seqlen_k, causal, window_size=(-1, -1), window_limit=None):
    """Boolean (seqlen_q, seqlen_k): may query i attend to key j (bottom-right aligned).
    A window side >= ``window_limit`` (default seqlen_k) is unbounded."""
    left, right = normalized_window(window_size, causal, seqlen_k if window_limit is None else window_limit)
    # A key's offset from the query's diagonal: j - (i + seqlen_k - seqlen_q).
    offset = xp.arange(seqlen_k)[None, :] - (xp.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q)
    visible = xp.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible


class _Variant:
    """The options of one call, checked and laid out for the per-batch-element loops.

    alibi: (batch, nheads) slopes or None; keep: the dropout multiplier keep / (1 - p) as
    (batch, nheads, seqlen_q, seqlen_k) floats, or None without dropout; distance: the ALiBi
    distance |i + diag - j| as (seqlen_q, seqlen_k); mods: cuflash.mod.NumpyModifiers or
    None, whose b is batch_index[batch element] (default: the batch element itself).
    """

    def __init__(self, xp, q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                 dropout_p, dropout_keep, dtype, window_limit=None, mods=None, batch_index=None):
        batch, seqlen_q, nheads, d = q.shape
        seqlen_k = k.shape[1]
        self.mods = mods
        if mods is not None:
            if xp is not numpy:
                raise TypeError("score_mod and mask_mod take NumPy arrays in the reference")
            self.batch_index = numpy.arange(batch) if batch_index is None else numpy.asarray(batch_index)
            nheads_kv = k.shape[2]
            # (b, h, i, j) laid out like a batch element's grouped scores (nheads_kv, group, sq, sk)
            self.mod_heads = numpy.arange(nheads).reshape(nheads_kv, nheads // nheads_kv, 1, 1)
            self.mod_rows, self.mod_cols = numpy.arange(seqlen_q)[:, None], numpy.arange(seqlen_k)[None, :]
        self.scale = dtype(_default_scale(softmax_scale, d))
        self.visible = _visible(xp, seqlen_q, seqlen_k, causal, window_size, window_limit)
        self.softcap = float(softcap)
        if self.softcap < 0:
            raise ValueError(f"softcap must be >= 0, got {softcap}")
        self.alibi = self.distance = None
        if alibi_slopes is not None:
            slopes = xp.asarray(alibi_slopes, dtype=dtype)
            if slopes.shape not in ((nheads,), (batch, nheads)):
                raise ValueError(
                    f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
                    f"got {slopes.shape}"
                )
            self.alibi = xp.broadcast_to(slopes, (batch, nheads))
            diagonal = xp.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
            self.distance = xp.abs(diagonal - xp.arange(seqlen_k)[None, :]).astype(dtype)
        dropout_p = float(dropout_p)
        if not 0 <= dropout_p < 1:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        self.keep = None
        if dropout_keep is not None:
            if dropout_keep.shape != (batch, nheads, seqlen_q, seqlen_k):
                raise ValueError(
                    f"dropout_keep must have shape {(batch, nheads, seqlen_q, seqlen_k)}, "
                    f"got {dropout_keep.shape}"
                )
            self.keep = xp.asarray(dropout_keep, dtype=bool).astype(dtype) * dtype(
                1 / (1 - dropout_p)
            )
        elif dropout_p > 0:
            raise ValueError("dropout_p > 0 needs the keep mask: pass dropout_keep")

    def scores(self, q_b, k_b, b, rounded=None):
        """Masked scores of batch element b, grouped (nheads_kv, group, seqlen_q, seqlen_k)
        (-inf where masked), and tanh(s_pre / softcap) for softcap's backward (else None).

        `rounded`, if given, rounds the result of every stage (the low-precision yardstick).
        """
        xp = _array_module(q_b)
        s, tanh = self._biased(q_b, k_b, b, rounded)
        visible = self.visible
        if self.mods is not None:
            where = self._mod_indices(b)
            s = self.mods.score(s, *where)
            mask = self.mods.mask(*where, s.dtype.type)
            if mask is not None:
                visible = visible & mask
        # Mask last: a scale of 0 must not turn -inf into NaN.
        return xp.where(visible, s, -xp.inf), tanh

    def score_mod_gradient(self, q_b, k_b, b):
        """d score_mod / d s of batch element b at its scores before score_mod, grouped like
        the scores; None without a score_mod."""
        if self.mods is None:
            return None
        s, _ = self._biased(q_b, k_b, b)
        return self.mods.gradient(s, *self._mod_indices(b))

    def _mod_indices(self, b):
        return self.batch_index[b], self.mod_heads, self.mod_rows, self.mod_cols

    def _biased(self, q_b, k_b, b, rounded=None):
        """The scores of batch element b before score_mod and the mask: scaled, soft-capped,
        ALiBi-biased; and tanh(s_pre / softcap) (else None)."""
        xp = _array_module(q_b)
        r = rounded or (lambda x: x)
        nheads_kv = k_b.shape[1]
        s = r(xp.matmul(_grouped(q_b, nheads_kv), k_b.transpose(1, 2, 0)[:, None]) * self.scale)
        tanh = None
        if self.softcap > 0:
            tanh = r(xp.tanh(r(s / s.dtype.type(self.softcap))))
            s = r(tanh * s.dtype.type(self.softcap))
        if self.alibi is not None:
            slopes = self.alibi[b].reshape(nheads_kv, -1)[..., None, None]
            s = r(s - slopes * self.distance)
        return s, tanh

    def dropout(self, b, nheads_kv):
        """keep / (1 - p) of batch element b, grouped like the scores, or None."""
        if self.keep is None:
            return None
        _, nheads, seqlen_q, seqlen_k = self.keep.shape
        return self.keep[b].reshape(nheads_kv, nheads // nheads_kv, seqlen_q, seqlen_k)


def _grouped(x_b, nheads_kv):
    """(seqlen, nheads, d) -> (nheads_kv, group, seqlen, d): group g of kv head h is query head
    h * group + g, which is the rule h_q // group = h_kv."""
    seqlen, nheads, d = x_b.shape
    return x_b.reshape(seqlen, nheads_kv, nheads // nheads_kv, d).transpose(1, 2, 0, 3)


def _ungrouped(x_g):
    """(nheads_kv, group, seqlen, d) -> (seqlen, nheads, d), the inverse of _grouped."""
    nheads_kv, group, seqlen, d = x_g.shape
    return x_g.transpose(2, 0, 1, 3).reshape(seqlen, nheads_kv * group, d)


def _grouped_pv(p, v_b):
    """O = P V for one batch element: p (nheads_kv, group, sq, sk) -> (sq, nheads, d)."""
    xp = _array_module(p)
    return _ungrouped(xp.matmul(p, v_b.transpose(1, 0, 2)[:, None]))


def _softmax(s):
    """Row softmax of scores with -inf where masked: returns (P, lse), lse keeping a last axis
    of 1. A fully masked row gives P = 0 and lse = +inf."""
    xp = _array_module(s)
    m = s.max(axis=-1, keepdims=True)
    # A fully masked row has m = -inf; offset by 0 there so -inf - -inf never appears.
    m = xp.where(m == -xp.inf, 0.0, m)
    p = xp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    empty = l == 0
    l_safe = xp.where(empty, 1.0, l)
    return p / l_safe, xp.where(empty, xp.inf, m + xp.log(l_safe))


def _lse_gradient(dlse, b, nheads_kv, variant, row_lse=None):
    """dlse of batch element b, grouped like the scores' rows (nheads_kv, group, seqlen_q, 1),
    or 0 without one. Rows that see no key take 0: their P is 0 and lse +inf, and a NaN
    gradient there (a loss over +inf) must not turn 0 * NaN into NaN. ``row_lse`` (grouped
    like the result) tells those rows where the visible keys depend on more than the window
    (mask_mod, or a score_mod giving -inf)."""
    if dlse is None:
        return 0.0
    xp = _array_module(dlse)
    nheads, seqlen_q = dlse.shape[1:]
    grouped = dlse[b].reshape(nheads_kv, nheads // nheads_kv, seqlen_q, 1)
    sees = variant.visible.any(axis=-1)[:, None] if row_lse is None else row_lse != xp.inf
    return xp.where(sees, grouped, 0.0)


def _sum_over_group(x_g):
    """(nheads_kv, group, seqlen_k, d) -> (seqlen_k, nheads_kv, d): a kv head's gradient is
    the sum over the query heads that read it."""
    return x_g.sum(axis=1).transpose(1, 0, 2)


def attention_reference(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, dropout_p=0.0, dropout_keep=None, window_limit=None, score_mod=None,
    mask_mod=None, mod_tensors=(),
):
    """Exact attention in float64: returns (out, lse).

    out: float64 (batch, seqlen_q, nheads, d); lse: float64 (batch, nheads, seqlen_q), the
    natural log of the sum of exp of the (soft-capped, ALiBi-biased) visible scores, before
    dropout. A fully masked row (or seqlen_k == 0) gives out 0 and lse +inf. NaN in the inputs
    is not suppressed: it reaches every output that reads it. The options are the module's
    (see its docstring); dropout_p > 0 needs `dropout_keep`. ``window_limit``: the key count a
    window side is compared with, a side >= it being unbounded (default seqlen_k; the KV-cache
    call compares with the cache's length). ``score_mod``, ``mask_mod`` and ``mod_tensors``
    (NumPy arrays): programmable attention (see the module docstring).
    """
    return _attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                dropout_keep=dropout_keep, window_limit=window_limit,
                                mods=mod.prepare(score_mod, mask_mod, mod_tensors))


def _attention_reference(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, dropout_keep=None, window_limit=None, mods=None,
                         batch_index=None):
    """attention_reference with its modifiers traced (``mods``) and the b they see for each
    batch element (``batch_index``; a packed batch's sequence index)."""
    xp = _array_module(q)
    q, k, v = (x.astype(xp.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    variant = _Variant(xp, q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                       dropout_p, dropout_keep, xp.float64, window_limit, mods, batch_index)

    out = xp.zeros((batch, seqlen_q, nheads, v.shape[-1]), dtype=xp.float64)
    lse = xp.full((batch, nheads, seqlen_q), xp.inf, dtype=xp.float64)
    if seqlen_q == 0 or seqlen_k == 0:
        return out, lse

    for b in range(batch):  # one batch element at a time bounds the (h, sq, sk) scores
        s, _ = variant.scores(q[b], k[b], b)
        p, row_lse = _softmax(s)
        keep = variant.dropout(b, nheads_kv)
        out[b] = _grouped_pv(p if keep is None else p * keep, v[b])
        lse[b] = row_lse[..., 0].reshape(nheads, seqlen_q)
    return out, lse


def attention_reference_backward(
    dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, dropout_p=0.0, dropout_keep=None, out=None, dlse=None, score_mod=None,
    mask_mod=None, mod_tensors=(),
):
    """Exact gradients of attention_reference's out (and lse) in float64: returns (dq, dk, dv).

    `dout` is the upstream gradient, laid out like out; `dlse`, if given, lse's, laid out
    like lse (rows that see no key ignore theirs). With P the materialised softmax,
    Z = keep / (1 - p) (1 without dropout), O = (P ∘ Z) V and D = rowsum(dO ∘ O):

        dV = (P ∘ Z)ᵀ dO,  dP = (dO Vᵀ) ∘ Z,
        dS = (P ∘ (dP - D) + P ∘ dLSE) ∘ (1 - tanh²(s_pre / softcap)),
        dQ = scale dS K,   dK = scale dSᵀ Q

    (d lse_i / d s_ij = P_ij; the tanh factor only with softcap > 0; s_pre = scale q.k).
    ALiBi adds a constant, which has no gradient. Under GQA, dk and dv of a kv head sum
    over the query heads that share it. A fully masked row (or seqlen_k == 0) has P = 0,
    so it contributes nothing and its dq row is 0.

    `out`, if given, replaces O in D = rowsum(dO ∘ O): FlashAttention takes D from the out it
    stored in low precision, and passing that out gives the exact gradients of that
    computation, so a test can tell the effect of D's rounding from a kernel's own error.

    With ``score_mod``, dS is also multiplied by d score_mod / d s at the scores before it
    (cuflash.mod.derivative; 0 where the score is masked); ``mask_mod`` masks as the window does.
    """
    return _attention_reference_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                         dropout_p=dropout_p, dropout_keep=dropout_keep, out=out, dlse=dlse,
                                         mods=mod.prepare(score_mod, mask_mod, mod_tensors, backward=True))


def _attention_reference_backward(dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_keep=None, out=None,
                                  dlse=None, mods=None, batch_index=None):
    """attention_reference_backward with traced modifiers; see _attention_reference."""
    xp = _array_module(q)
    dout, q, k, v = (x.astype(xp.float64) for x in (dout, q, k, v))
    out = None if out is None else out.astype(xp.float64)
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    variant = _Variant(xp, q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                       dropout_p, dropout_keep, xp.float64, None, mods, batch_index)
    scale = variant.scale

    dq, dk, dv = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    if seqlen_q == 0 or seqlen_k == 0:
        return dq, dk, dv

    for b in range(batch):  # one batch element at a time bounds the (h, sq, sk) matrices
        s, tanh = variant.scores(q[b], k[b], b)
        p, row_lse = _softmax(s)
        keep = variant.dropout(b, nheads_kv)
        p_dropped = p if keep is None else p * keep
        q_g, do_g = _grouped(q[b], nheads_kv), _grouped(dout[b], nheads_kv)
        k_g, v_g = (x.transpose(1, 0, 2)[:, None] for x in (k[b], v[b]))  # (h_kv, 1, sk, d)

        dv[b] = _sum_over_group(xp.matmul(p_dropped.swapaxes(-1, -2), do_g))
        dp = xp.matmul(do_g, v_g.swapaxes(-1, -2))
        if keep is not None:
            dp = dp * keep
        o_g = xp.matmul(p_dropped, v_g) if out is None else _grouped(out[b], nheads_kv)
        delta = (do_g * o_g).sum(axis=-1, keepdims=True)
        ds = p * (dp - delta) + p * _lse_gradient(dlse, b, nheads_kv, variant, None if mods is None else row_lse)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        mod_gradient = variant.score_mod_gradient(q[b], k[b], b)
        if mod_gradient is not None:  # (0 where masked: P = 0 there, and the derivative may be NaN)
            ds = ds * xp.where(s == -xp.inf, 0.0, mod_gradient)
        dq[b] = _ungrouped(scale * xp.matmul(ds, k_g))
        dk[b] = _sum_over_group(scale * xp.matmul(ds.swapaxes(-1, -2), q_g))
    return dq, dk, dv


def _host_ints(x):
    """Python ints of a NumPy or CuPy array (or any sequence) of offsets."""
    return [int(n) for n in (x.tolist() if hasattr(x, "tolist") else x)]


def _sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_keep):
    """For each sequence b of a packed batch: (rows of q, rows of k, its own options).

    ALiBi slopes of shape (batch, nheads) give sequence b the row b; dropout_keep is a list
    of per-sequence masks (1, nheads, seqlen_q_b, seqlen_k_b)."""
    cu_q, cu_k = _host_ints(cu_seqlens_q), _host_ints(cu_seqlens_k)
    if len(cu_q) != len(cu_k) or len(cu_q) == 0:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, "
            f"got {len(cu_q)} and {len(cu_k)}"
        )
    batch = len(cu_q) - 1
    if dropout_keep is not None and len(dropout_keep) != batch:
        raise ValueError(f"dropout_keep must hold {batch} masks, got {len(dropout_keep)}")
    for b in range(batch):
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.ndim == 2:
            slopes = alibi_slopes[b : b + 1]
        keep = None if dropout_keep is None else dropout_keep[b]
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        yield rows_q, rows_k, {"alibi_slopes": slopes, "dropout_keep": keep}


def attention_reference_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_keep=None, score_mod=None,
    mask_mod=None, mod_tensors=(), **options
):
    """attention_reference of a packed variable-length batch: returns (out, lse).

    q (total_q, nheads, d), k and v (total_k, nheads_kv, d); cu_seqlens_q and cu_seqlens_k
    (batch + 1,) cumulative offsets (zero-length sequences allowed). Every option applies per
    sequence with that sequence's own seqlen_q and seqlen_k (the causal/window diagonal, the
    window normalisation); ALiBi slopes of shape (batch, nheads) give sequence b the row b;
    `dropout_keep` is a list of per-sequence keep masks (1, nheads, seqlen_q_b, seqlen_k_b);
    score_mod and mask_mod see b, the sequence index, and positions within the sequence.
    out: float64 (total_q, nheads, d); lse: float64 (nheads, total_q).
    """
    xp = _array_module(q)
    out = xp.zeros(q.shape[:2] + v.shape[-1:], dtype=xp.float64)
    lse = xp.full(q.shape[1::-1], xp.inf, dtype=xp.float64)
    mods = mod.prepare(score_mod, mask_mod, mod_tensors)
    for b, (rows_q, rows_k, own) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_keep)):
        args = (q[None, rows_q], k[None, rows_k], v[None, rows_k])
        o, l = _attention_reference(*args, **own, **options, mods=mods, batch_index=[b])
        out[rows_q], lse[:, rows_q] = o[0], l[0]
    return out, lse


def attention_reference_varlen_backward(
    dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_keep=None,
    out=None, dlse=None, score_mod=None, mask_mod=None, mod_tensors=(), **options
):
    """attention_reference_backward of a packed variable-length batch (laid out as
    attention_reference_varlen, dlse (nheads, total_q)): returns float64 (dq, dk, dv)
    shaped like q, k, v."""
    mods = mod.prepare(score_mod, mask_mod, mod_tensors, backward=True)
    return _varlen_backward(_attention_reference_backward, "float64", dout, q, k, v, cu_seqlens_q, cu_seqlens_k,
                            alibi_slopes, dropout_keep, dlse, out=out, mods=mods, **options)


def _varlen_backward(backward, dtype, dout, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_keep, dlse,
                     *, out=None, mods=None, **options):
    """``backward`` (a dense backward of this module) sequence by sequence: (dq, dk, dv)
    of ``dtype``, shaped like q, k, v. ``mods``, where given, go to ``backward`` with the
    sequence's index."""
    xp = _array_module(q)
    dq, dk, dv = (xp.zeros(x.shape, dtype=dtype) for x in (q, k, v))
    for b, (rows_q, rows_k, own) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_keep)):
        if mods is not None:
            own.update(mods=mods, batch_index=[b])
        if out is not None:
            own["out"] = out[None, rows_q]
        if dlse is not None:
            own["dlse"] = dlse[None, :, rows_q]
        grads = backward(dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k], **own, **options)
        dq[rows_q], dk[rows_k], dv[rows_k] = (g[0] for g in grads)
    return dq, dk, dv


def _is_bfloat16(dtype):
    try:
        return numpy.dtype(dtype).name == "bfloat16"
    except TypeError:  # the string "bfloat16" without ml_dtypes installed
        return str(dtype) == "bfloat16"


def round_to(x, dtype, xp=numpy):
    """Round float32 `x` to `dtype` (float16, bfloat16 or float32) and return it as float32.

    bfloat16 is rounded by hand on the float32 bit pattern (round to nearest, ties to even)
    because CuPy may not cast to bfloat16; the same integer ops run under NumPy and CuPy.
    """
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    if _is_bfloat16(dtype):
        bits = x.view(xp.uint32)
        # bfloat16 keeps the top 16 bits; adding 0x7FFF plus the lowest kept bit rounds the
        # dropped half to nearest with ties going to the even kept value.
        lowest_kept = (bits >> xp.uint32(16)) & xp.uint32(1)
        rounded = (bits + xp.uint32(0x7FFF) + lowest_kept) & xp.uint32(0xFFFF0000)
        # The carry could turn a NaN payload into inf or wrap it; NaN stays NaN instead.
        return xp.where(xp.isnan(x), x, rounded.view(xp.float32))
    dtype = numpy.dtype(dtype)
    if dtype == numpy.float32:
        return x
    if dtype == numpy.float16:
        # Overflow to inf is the correct rounding of a value beyond float16's range.
        with numpy.errstate(over="ignore"):
            return x.astype(xp.float16).astype(xp.float32)
    raise ValueError(f"round_to: dtype must be float16, bfloat16 or float32, got {dtype}")


def attention_lowp(
    q, k, v, *, causal=False, softmax_scale=None, dtype=None, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_keep=None,
):
    """Plain attention in low precision, the yardstick of flash-attn's tolerance rule.

    Mimics a framework computing the attention op by op in `dtype` (default q.dtype), as
    flash-attn's own test reference does: each stage runs in float32 and its result is
    rounded to `dtype`, as fp16/bf16 tensor ops do:

        S = round(scale * Q Kᵀ)
        S = round(round(tanh(round(S / softcap))) * softcap)     softcap > 0
        S = round(S - slope * |i + diag - j|)                      ALiBi
        P = round(softmax(S))                                      (masked -> 0)
        P = round(P * keep / (1 - dropout_p))                      dropout
        O = round(P V)

    The inputs are rounded to `dtype` first. A fully masked row gives O = 0. Returns float32
    (batch, seqlen_q, nheads, d) whose values are exactly representable in `dtype` (float32
    so that bfloat16 needs no CuPy support and differences stay exact).
    """
    xp = _array_module(q)
    dtype = q.dtype if dtype is None else dtype
    q, k, v = (round_to(x.astype(xp.float32), dtype, xp) for x in (q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    variant = _Variant(xp, q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                       dropout_p, dropout_keep, xp.float32)

    out = xp.zeros((batch, seqlen_q, nheads, v.shape[-1]), dtype=xp.float32)
    if seqlen_q == 0 or seqlen_k == 0:
        return out

    for b in range(batch):
        p, _ = _lowp_probabilities(q[b], k[b], b, variant, dtype)
        keep = variant.dropout(b, nheads_kv)
        if keep is not None:
            p = round_to(p * keep, dtype, xp)
        out[b] = round_to(_grouped_pv(p, v[b]), dtype, xp)
    return out


def _lowp_probabilities(q_b, k_b, b, variant, dtype):
    """P = round(softmax(S)) for batch element b, S with every stage rounded (see
    attention_lowp), from float32 q_b, k_b holding `dtype` values; grouped like the scores.
    Masked -> 0. Also returns the rounded tanh of softcap (None without softcap)."""
    xp = _array_module(q_b)
    s, tanh = variant.scores(q_b, k_b, b, rounded=lambda x: round_to(x, dtype, xp))
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(m == -xp.inf, xp.float32(0), m)
    p = xp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return round_to(p / xp.where(l == 0, xp.float32(1), l), dtype, xp), tanh


def attention_lowp_backward(
    dout, q, k, v, *, causal=False, softmax_scale=None, dtype=None, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_keep=None, dlse=None,
):
    """Plain attention's backward in low precision, the yardstick of the gradient rule.

    Mimics autograd through attention_lowp's stages in `dtype` (default q.dtype): every
    tensor op runs in float32 on inputs rounded to `dtype` and rounds its result, as fp16/bf16
    tensor ops do. After the forward's stages (S, T = the rounded tanh, P), with
    Z = keep / (1 - dropout_p) and P_d = round(P ∘ Z) under dropout (else Z = 1, P_d = P):

        dV_h = round(P_dᵀ dO)                     per query head
        dP   = round(dO Vᵀ)
        dP   = round(dP ∘ Z)                      dropout
        dS   = round(P ∘ (dP - rowsum(P ∘ dP)))   the softmax backward, from rounded P and dP
        dS   = round(dS + round(P ∘ dLSE))        with dlse: logsumexp's backward (float32 dlse)
        dS   = round(round(round(dS * softcap) * (1 - T²)) / softcap)   softcap > 0
        dQ   = round(scale * dS K)                the backward of the scaled product
        dK_h = round(scale * dSᵀ Q)               per query head
        dK, dV = round(sum of dK_h, dV_h over the query heads of a kv head)   (GQA only)

    ALiBi and the mask pass dS through unchanged. The GQA line is the backward of
    broadcasting a kv head to its query heads: a float32 sum rounded once. Unlike
    FlashAttention, D comes from P and dP, not from dO and O. Returns float32 (dq, dk, dv)
    shaped like q, k, v with values exact in `dtype`.
    """
    xp = _array_module(q)
    dtype = q.dtype if dtype is None else dtype

    def rounded(x):
        return round_to(x, dtype, xp)

    dout, q, k, v = (rounded(x.astype(xp.float32)) for x in (dout, q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    variant = _Variant(xp, q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                       dropout_p, dropout_keep, xp.float32)
    scale, softcap = variant.scale, xp.float32(variant.softcap)

    dq, dk, dv = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    if seqlen_q == 0 or seqlen_k == 0:
        return dq, dk, dv

    for b in range(batch):
        p, tanh = _lowp_probabilities(q[b], k[b], b, variant, dtype)
        keep = variant.dropout(b, nheads_kv)
        p_dropped = p if keep is None else rounded(p * keep)
        q_g, do_g = _grouped(q[b], nheads_kv), _grouped(dout[b], nheads_kv)
        k_g, v_g = (x.transpose(1, 0, 2)[:, None] for x in (k[b], v[b]))
        dv[b] = rounded(_sum_over_group(rounded(xp.matmul(p_dropped.swapaxes(-1, -2), do_g))))
        dp = rounded(xp.matmul(do_g, v_g.swapaxes(-1, -2)))
        if keep is not None:
            dp = rounded(dp * keep)
        ds = rounded(p * (dp - (p * dp).sum(axis=-1, keepdims=True)))
        if dlse is not None:
            ds = rounded(ds + rounded(p * _lse_gradient(dlse, b, nheads_kv, variant)))
        if tanh is not None:
            ds = rounded(rounded(rounded(ds * softcap) * (1 - tanh * tanh)) / softcap)
        dq[b] = _ungrouped(rounded(scale * xp.matmul(ds, k_g)))
        dk_h = rounded(scale * xp.matmul(ds.swapaxes(-1, -2), q_g))
        dk[b] = rounded(_sum_over_group(dk_h))
    return dq, dk, dv


def attention_lowp_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_keep=None, **options
):
    """attention_lowp of a packed variable-length batch, laid out as
    attention_reference_varlen: returns float32 out (total_q, nheads, d)."""
    xp = _array_module(q)
    out = xp.zeros(q.shape[:2] + v.shape[-1:], dtype=xp.float32)
    for rows_q, rows_k, own in _sequences(cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_keep):
        args = (q[None, rows_q], k[None, rows_k], v[None, rows_k])
        out[rows_q] = attention_lowp(*args, **own, **options)[0]
    return out


def attention_lowp_varlen_backward(
    dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_keep=None, dlse=None,
    **options
):
    """attention_lowp_backward of a packed variable-length batch: float32 (dq, dk, dv)."""
    return _varlen_backward(attention_lowp_backward, "float32", dout, q, k, v, cu_seqlens_q, cu_seqlens_k,
                            alibi_slopes, dropout_keep, dlse, **options)


def _textbook_row(q, k, b, h, i, h_kv, scale, causal, window_size, softcap, alibi_slopes):
    """The keys query i of head h sees and their scores, written out element by element;
    also the softcap chain factor 1 - tanh²(s_pre / softcap) of each (1 without softcap)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    left, right = (int(w) for w in window_size)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    diagonal = i + seqlen_k - seqlen_q  # the key aligned with query i (bottom right)
    keys, scores, chain = [], [], []
    for j in range(seqlen_k):
        if (left >= 0 and j < diagonal - left) or (right >= 0 and j > diagonal + right):
            continue
        score = scale * (q[b, i, h] @ k[b, j, h_kv])
        factor = 1.0
        if softcap > 0:
            factor = 1 - math.tanh(score / softcap) ** 2
            score = softcap * math.tanh(score / softcap)
        if alibi_slopes is not None:
            slope = alibi_slopes[h] if alibi_slopes.ndim == 1 else alibi_slopes[b, h]
            score -= float(slope) * abs(diagonal - j)
        keys.append(j)
        scores.append(score)
        chain.append(factor)
    return keys, numpy.array(scores), numpy.array(chain)


def _textbook_rows(q, k, scale, causal, window_size, softcap, alibi_slopes):
    """Each (batch, head, query) row that sees a key, as (b, h, h_kv, i, keys, scores,
    chain, weights): _textbook_row's keys, scores and chain factors, and exp(scores - max)."""
    batch, seqlen_q, nheads, d = q.shape
    group = nheads // k.shape[2]
    scale = _default_scale(scale, d)
    for b in range(batch):
        for h in range(nheads):
            for i in range(seqlen_q):
                keys, scores, chain = _textbook_row(q, k, b, h, i, h // group, scale, causal, window_size, softcap,
                                                    alibi_slopes)
                if keys:
                    yield b, h, h // group, i, keys, scores, chain, numpy.exp(scores - scores.max())


def attention_textbook(
    q, k, v, causal=False, scale=None, *, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, dropout_p=0.0, dropout_keep=None,
):
    """softmax(scores + mask) V, one (batch, head, query) at a time, in float64.

    The most literal implementation there is, for tiny shapes only: it exists to test
    attention_reference, and takes the same options. NumPy only. Returns (out, lse) like
    attention_reference.
    """
    q, k, v = (numpy.asarray(x, dtype=numpy.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, _ = q.shape
    out = numpy.zeros((batch, seqlen_q, nheads, v.shape[-1]))
    lse = numpy.full((batch, nheads, seqlen_q), numpy.inf)  # a row that sees no key: out 0, lse +inf
    for b, h, h_kv, i, keys, scores, _, weights in _textbook_rows(q, k, scale, causal, window_size, softcap,
                                                                 alibi_slopes):
        for p, j in zip(weights / weights.sum(), keys):
            if dropout_keep is not None:
                p = p * dropout_keep[b, h, i, j] / (1 - dropout_p)
            out[b, i, h] += p * v[b, j, h_kv]
        lse[b, h, i] = scores.max() + numpy.log(weights.sum())
    return out, lse


def attention_textbook_backward(
    dout, q, k, v, causal=False, scale=None, *, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, dropout_p=0.0, dropout_keep=None,
):
    """Gradients of attention_textbook's out, one (batch, head, query) at a time, in float64.

    The chain rule written out for one query row i with probabilities p over its keys and
    dropout weights z_j = keep_j / (1 - dropout_p) (1 without dropout): out_i = Σ p_j z_j v_j,
    so dp_j = z_j dO_i · v_j; ds_j = p_j (dp_j - Σ_l p_l dp_l) (the softmax Jacobian), times
    1 - tanh²(s_pre_j / softcap) under softcap; then dq_i += scale ds_j k_j,
    dk_j += scale ds_j q_i, dv_j += p_j z_j dO_i. Tiny shapes only; it exists to test
    attention_reference_backward. NumPy only. Returns (dq, dk, dv).
    """
    dout, q, k, v = (numpy.asarray(x, dtype=numpy.float64) for x in (dout, q, k, v))
    dq, dk, dv = numpy.zeros_like(q), numpy.zeros_like(k), numpy.zeros_like(v)
    scale = _default_scale(scale, q.shape[-1])
    # (a row that sees no key passes no gradient)
    for b, h, h_kv, i, keys, scores, chain, weights in _textbook_rows(q, k, scale, causal, window_size, softcap,
                                                                     alibi_slopes):
        probabilities = weights / weights.sum()
        if dropout_keep is None:
            z = numpy.ones(len(keys))
        else:
            z = numpy.array([dropout_keep[b, h, i, j] / (1 - dropout_p) for j in keys])
        dp = numpy.array([z_j * (dout[b, i, h] @ v[b, j, h_kv]) for z_j, j in zip(z, keys)])
        ds = probabilities * (dp - probabilities @ dp) * chain
        for p_j, z_j, ds_j, j in zip(probabilities, z, ds, keys):
            dq[b, i, h] += scale * ds_j * k[b, j, h_kv]
            dk[b, j, h_kv] += scale * ds_j * q[b, i, h]
            dv[b, j, h_kv] += p_j * z_j * dout[b, i, h]
    return dq, dk, dv
