"""Materialised attention: the float64 oracle every test compares against.

Nothing here is fast. Each function builds the full score matrix S = scale * Q Kᵀ for one
batch element at a time, so it is easy to read and easy to trust. All functions take NumPy or
CuPy arrays and compute with the module the inputs came from, so GPU tests can run the oracle
on the device in float64 without a round trip through the host.

Layout (as flash-attn): q (batch, seqlen_q, nheads, d), k and v (batch, seqlen_k, nheads_kv, d)
with nheads % nheads_kv == 0; query head h reads kv head h // (nheads // nheads_kv).
Causal masking is aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
"""

import math

import numpy

__all__ = [
    "attention_reference",
    "attention_reference_backward",
    "attention_lowp",
    "attention_lowp_backward",
    "attention_textbook",
    "attention_textbook_backward",
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


def _visible(xp, seqlen_q, seqlen_k, causal):
    """Boolean (seqlen_q, seqlen_k): may query i attend to key j (bottom-right causal)."""
    if not causal:
        return xp.ones((seqlen_q, seqlen_k), dtype=bool)
    i = xp.arange(seqlen_q)[:, None]
    j = xp.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _grouped_scores(q_b, k_b, scale, visible):
    """S for one batch element, shape (nheads_kv, group, seqlen_q, seqlen_k); masked -> -inf.

    Query heads are split as (nheads_kv, group) so that group g of kv head h is query head
    h * group + g, which is the rule h_q // group = h_kv.
    """
    xp = _array_module(q_b)
    q_g = _grouped(q_b, k_b.shape[1])
    k_t = k_b.transpose(1, 2, 0)[:, None]  # (nheads_kv, 1, d, seqlen_k): broadcasts over group
    s = xp.matmul(q_g, k_t) * scale
    # Mask after scaling: a scale of 0 must not turn -inf into NaN.
    return xp.where(visible, s, -xp.inf)


def _grouped(x_b, nheads_kv):
    """(seqlen, nheads, d) -> (nheads_kv, group, seqlen, d), the layout of _grouped_scores."""
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


def attention_reference(q, k, v, *, causal=False, softmax_scale=None):
    """Exact attention in float64: returns (out, lse).

    out: float64 (batch, seqlen_q, nheads, d); lse: float64 (batch, nheads, seqlen_q), the
    natural log of the sum of exp of the scaled scores. A fully masked row (or seqlen_k == 0)
    gives out 0 and lse +inf. NaN in the inputs is not suppressed: it reaches every output
    that reads it.
    """
    xp = _array_module(q)
    q, k, v = (x.astype(xp.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k = k.shape[1]
    scale = _default_scale(softmax_scale, d)

    out = xp.zeros((batch, seqlen_q, nheads, v.shape[-1]), dtype=xp.float64)
    lse = xp.full((batch, nheads, seqlen_q), xp.inf, dtype=xp.float64)
    if seqlen_q == 0 or seqlen_k == 0:
        return out, lse

    visible = _visible(xp, seqlen_q, seqlen_k, causal)
    for b in range(batch):  # one batch element at a time bounds the (h, sq, sk) scores
        p, row_lse = _softmax(_grouped_scores(q[b], k[b], scale, visible))
        out[b] = _grouped_pv(p, v[b])
        lse[b] = row_lse[..., 0].reshape(nheads, seqlen_q)
    return out, lse


def _sum_over_group(x_g):
    """(nheads_kv, group, seqlen_k, d) -> (seqlen_k, nheads_kv, d): a kv head's gradient is
    the sum over the query heads that read it."""
    return x_g.sum(axis=1).transpose(1, 0, 2)


def attention_reference_backward(dout, q, k, v, *, causal=False, softmax_scale=None):
    """Exact gradients of attention_reference's out in float64: returns (dq, dk, dv).

    `dout` is the upstream gradient, laid out like out. With P the materialised softmax,
    O = P V and D = rowsum(dO ∘ O):
    dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - D), dQ = scale dS K, dK = scale dSᵀ Q.
    Under GQA, dk and dv of a kv head sum over the query heads that share it. A fully masked
    row (or seqlen_k == 0) has P = 0, so it contributes nothing and its dq row is 0.
    """
    xp = _array_module(q)
    dout, q, k, v = (x.astype(xp.float64) for x in (dout, q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    scale = _default_scale(softmax_scale, d)

    dq, dk, dv = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    if seqlen_q == 0 or seqlen_k == 0:
        return dq, dk, dv

    visible = _visible(xp, seqlen_q, seqlen_k, causal)
    for b in range(batch):  # one batch element at a time bounds the (h, sq, sk) matrices
        p, _ = _softmax(_grouped_scores(q[b], k[b], scale, visible))
        q_g, do_g = _grouped(q[b], nheads_kv), _grouped(dout[b], nheads_kv)
        k_g, v_g = (x.transpose(1, 0, 2)[:, None] for x in (k[b], v[b]))  # (h_kv, 1, sk, d)

        dv[b] = _sum_over_group(xp.matmul(p.swapaxes(-1, -2), do_g))
        dp = xp.matmul(do_g, v_g.swapaxes(-1, -2))
        delta = (do_g * xp.matmul(p, v_g)).sum(axis=-1, keepdims=True)
        ds = p * (dp - delta)
        dq[b] = _ungrouped(scale * xp.matmul(ds, k_g))
        dk[b] = _sum_over_group(scale * xp.matmul(ds.swapaxes(-1, -2), q_g))
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


def attention_lowp(q, k, v, *, causal=False, softmax_scale=None, dtype=None):
    """Plain attention in low precision, the yardstick of flash-attn's tolerance rule.

    Mimics a framework computing softmax(Q Kᵀ * scale) V in `dtype` (default q.dtype): each
    stage runs in float32 and its result is rounded to `dtype`, as fp16/bf16 tensor ops do:
    S = round(scale * Q Kᵀ), P = round(softmax(S)), O = round(P V). The inputs are rounded to
    `dtype` first. Masked scores give P = 0; a fully masked row gives O = 0.

    Returns float32 (batch, seqlen_q, nheads, d) whose values are exactly representable in
    `dtype` (float32 so that bfloat16 needs no CuPy support and differences stay exact).
    """
    xp = _array_module(q)
    dtype = q.dtype if dtype is None else dtype
    q, k, v = (round_to(x.astype(xp.float32), dtype, xp) for x in (q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k = k.shape[1]
    scale = _default_scale(softmax_scale, d)

    out = xp.zeros((batch, seqlen_q, nheads, v.shape[-1]), dtype=xp.float32)
    if seqlen_q == 0 or seqlen_k == 0:
        return out

    visible = _visible(xp, seqlen_q, seqlen_k, causal)
    for b in range(batch):
        p = _lowp_probabilities(q[b], k[b], xp.float32(scale), visible, dtype)
        out[b] = round_to(_grouped_pv(p, v[b]), dtype, xp)
    return out


def _lowp_probabilities(q_b, k_b, scale, visible, dtype):
    """P = round(softmax(round(scale * Q Kᵀ))) for one batch element, from float32 q_b, k_b
    holding `dtype` values; grouped like _grouped_scores. Masked -> 0."""
    xp = _array_module(q_b)
    s = round_to(_grouped_scores(q_b, k_b, scale, visible), dtype, xp)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(m == -xp.inf, xp.float32(0), m)
    p = xp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return round_to(p / xp.where(l == 0, xp.float32(1), l), dtype, xp)


def attention_lowp_backward(dout, q, k, v, *, causal=False, softmax_scale=None, dtype=None):
    """Plain attention's backward in low precision, the yardstick of the gradient rule.

    Mimics autograd through attention_lowp's stages in `dtype` (default q.dtype): every
    tensor op runs in float32 on inputs rounded to `dtype` and rounds its result, as fp16/bf16
    tensor ops do. After the forward's S = round(scale * Q Kᵀ) and P = round(softmax(S)):

        dV_h = round(Pᵀ dO)                       per query head
        dP   = round(dO Vᵀ)
        dS   = round(P ∘ (dP - rowsum(P ∘ dP)))   the softmax backward, from rounded P and dP
        dQ   = round(scale * dS K)                the backward of the scaled product
        dK_h = round(scale * dSᵀ Q)               per query head
        dK, dV = round(sum of dK_h, dV_h over the query heads of a kv head)   (GQA only)

    The last line is the backward of broadcasting a kv head to its query heads: a float32
    sum rounded once. Unlike FlashAttention, D comes from P and dP, not from dO and O.
    Returns float32 (dq, dk, dv) shaped like q, k, v with values exact in `dtype`.
    """
    xp = _array_module(q)
    dtype = q.dtype if dtype is None else dtype

    def rounded(x):
        return round_to(x, dtype, xp)

    dout, q, k, v = (rounded(x.astype(xp.float32)) for x in (dout, q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    scale = xp.float32(_default_scale(softmax_scale, d))

    dq, dk, dv = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    if seqlen_q == 0 or seqlen_k == 0:
        return dq, dk, dv

    visible = _visible(xp, seqlen_q, seqlen_k, causal)
    for b in range(batch):
        p = _lowp_probabilities(q[b], k[b], scale, visible, dtype)
        q_g, do_g = _grouped(q[b], nheads_kv), _grouped(dout[b], nheads_kv)
        k_g, v_g = (x.transpose(1, 0, 2)[:, None] for x in (k[b], v[b]))
        dv[b] = rounded(_sum_over_group(rounded(xp.matmul(p.swapaxes(-1, -2), do_g))))
        dp = rounded(xp.matmul(do_g, v_g.swapaxes(-1, -2)))
        ds = rounded(p * (dp - (p * dp).sum(axis=-1, keepdims=True)))
        dq[b] = _ungrouped(rounded(scale * xp.matmul(ds, k_g)))
        dk_h = rounded(scale * xp.matmul(ds.swapaxes(-1, -2), q_g))
        dk[b] = rounded(_sum_over_group(dk_h))
    return dq, dk, dv


def attention_textbook(q, k, v, causal=False, scale=None):
    """softmax(Q Kᵀ * scale + mask) V, one (batch, head, query) at a time, in float64.

    The most literal implementation there is, for tiny shapes only: it exists to test
    attention_reference. NumPy only. Returns (out, lse) like attention_reference.
    """
    q, k, v = (numpy.asarray(x, dtype=numpy.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = _default_scale(scale, d)

    out = numpy.zeros((batch, seqlen_q, nheads, v.shape[-1]))
    lse = numpy.full((batch, nheads, seqlen_q), numpy.inf)
    for b in range(batch):
        for h in range(nheads):
            h_kv = h // group
            for i in range(seqlen_q):
                keys = [
                    j
                    for j in range(seqlen_k)
                    if not causal or j <= i + seqlen_k - seqlen_q
                ]
                if not keys:
                    continue  # nothing to attend to: out 0, lse +inf
                scores = numpy.array([scale * (q[b, i, h] @ k[b, j, h_kv]) for j in keys])
                weights = numpy.exp(scores - scores.max())
                probabilities = weights / weights.sum()
                out[b, i, h] = sum(p * v[b, j, h_kv] for p, j in zip(probabilities, keys))
                lse[b, h, i] = scores.max() + numpy.log(weights.sum())
    return out, lse


def attention_textbook_backward(dout, q, k, v, causal=False, scale=None):
    """Gradients of attention_textbook's out, one (batch, head, query) at a time, in float64.

    The chain rule written out for one query row i with probabilities p over its keys:
    dp_j = dO_i · v_j, ds_j = p_j (dp_j - Σ_l p_l dp_l) (the softmax Jacobian), then
    dq_i += scale ds_j k_j, dk_j += scale ds_j q_i, dv_j += p_j dO_i. Tiny shapes only;
    it exists to test attention_reference_backward. NumPy only. Returns (dq, dk, dv).
    """
    dout, q, k, v = (numpy.asarray(x, dtype=numpy.float64) for x in (dout, q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = _default_scale(scale, d)

    dq, dk, dv = numpy.zeros_like(q), numpy.zeros_like(k), numpy.zeros_like(v)
    for b in range(batch):
        for h in range(nheads):
            h_kv = h // group
            for i in range(seqlen_q):
                keys = [
                    j
                    for j in range(seqlen_k)
                    if not causal or j <= i + seqlen_k - seqlen_q
                ]
                if not keys:
                    continue  # nothing attended to: no gradient flows through this row
                scores = numpy.array([scale * (q[b, i, h] @ k[b, j, h_kv]) for j in keys])
                weights = numpy.exp(scores - scores.max())
                probabilities = weights / weights.sum()
                dp = numpy.array([dout[b, i, h] @ v[b, j, h_kv] for j in keys])
                ds = probabilities * (dp - probabilities @ dp)
                for p_j, ds_j, j in zip(probabilities, ds, keys):
                    dq[b, i, h] += scale * ds_j * k[b, j, h_kv]
                    dk[b, j, h_kv] += scale * ds_j * q[b, i, h]
                    dv[b, j, h_kv] += p_j * dout[b, i, h]
    return dq, dk, dv
