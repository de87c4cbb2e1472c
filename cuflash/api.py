"""The NumPy-like public functions: validate -> plan -> launch."""
from __future__ import annotations

from . import _arrays, _kernels, _options, _plan
from ._options import Options, Varlen

_OPTIONS_DOC = """
    Options (flash-attn's semantics; scores s = scale q.k, diagonal = seqlen_k - seqlen_q):
    ``causal``: query i sees key j iff j <= i + diagonal (aligned bottom-right).
    ``softmax_scale``: default 1 / sqrt(headdim).
    ``window_size=(left, right)``: keys in [i + diagonal - left, i + diagonal + right];
    -1 (or >= seqlen_k) is unbounded; causal means right = 0.
    ``softcap > 0``: s = softcap * tanh(s / softcap).
    ``alibi_slopes``: float32 (nheads,) or (batch, nheads): s -= slope * |i + diagonal - j|.
    ``dropout_p``: drop normalised probabilities with this probability, scale the kept
    ones by 1 / (1 - p); the mask is a counter-based Philox stream keyed by (``seed``,
    ``rng_offset``, batch, head, row, col) (``cuflash._philox.keep_mask``), so a seed
    reproduces it exactly. Without a seed one is drawn per call (pass one to run the
    backward). LSE is unaffected by dropout.
"""


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0, return_lse=False):
    """Exact softmax attention, softmax(scale * q k^T) v, as FlashAttention.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
    with nheads % nheads_kv == 0 (GQA/MQA: query head h reads KV head
    h // (nheads // nheads_kv)). CUDA arrays (CuPy, PyTorch, JAX; float16 or
    bfloat16) run the tensor-core kernel on the caller's stream and return the same
    kind of array; NumPy arrays run the CPU path. Returns ``out`` (like q) or, with
    ``return_lse``, ``(out, lse)`` where lse is float32 (batch, nheads, seqlen_q),
    the natural log-sum-exp of the modified scores (+inf for a row that sees no key).
    Both are differentiable: ``attention_backward`` takes the gradients of out and lse.
    """
    arrays = _inspect(q=q, k=k, v=v)
    key = _signature(arrays, alibi_slopes, dropout_p, causal, softmax_scale, window_size, softcap, seed, rng_offset)
    warm = _warm.get(key)
    if warm is None:
        _options.check_qkv(*arrays.values(), packed=False)
        warm = _remember(key, _options.make_options(arrays["q"], arrays["k"], causal, softmax_scale, window_size,
                                                    softcap, alibi_slopes, dropout_p, seed, rng_offset,
                                                    backward=False))
    if arrays["q"].device is None:
        from . import cpu
        out, lse = cpu.attention_forward(q, k, v, **_cpu_options(warm.options, alibi_slopes))
    else:
        out, lse = _forward_gpu(*arrays.values(), warm.options, None, return_lse, warm)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     seed=None, rng_offset=0, return_lse=False, block_table=None):
    """``attention`` over packed sequences of different lengths, with no padding.

    q: (total_q, nheads, headdim), k and v: (total_k, nheads_kv, headdim); sequence b
    is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
    of k and v (int32, shape (batch + 1,), starting at 0; empty sequences allowed);
    max_seqlen_q/k bound the lengths. Every option applies per sequence (causal and
    windows use that sequence's own lengths; ALiBi slopes of shape (batch, nheads)
    and the dropout stream use its index b). lse is float32 (nheads, total_q).

    ``block_table`` int32 (batch, max_blocks): k and v are page pools (num_pages,
    page_size, nheads_kv, headdim) instead, and sequence b's keys are the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages (flash-attn 2.8's paged varlen
    call; forward only, no dropout; ``cuflash.kvcache.attention_varlen_paged``).
    """
    if block_table is not None:
        if dropout_p != 0:
            raise ValueError(f"dropout_p must be 0 with block_table (the paged call is for inference), got {dropout_p}")
        from . import kvcache
        return kvcache.attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              block_table, causal=causal, softmax_scale=softmax_scale,
                                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                              return_lse=return_lse)
    arrays = _inspect(q=q, k=k, v=v)
    _options.check_qkv(*arrays.values(), packed=True)
    varlen = _options.varlen(arrays["q"], arrays["k"], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = _options.make_options(arrays["q"], arrays["k"], causal, softmax_scale, window_size, softcap,
                                    alibi_slopes, dropout_p, seed, rng_offset, backward=False, batch=varlen.batch,
                                    seqlen_k=varlen.max_seqlen_k)
    if arrays["q"].device is None:
        from . import cpu
        out, lse = cpu.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                **_cpu_options(options, alibi_slopes))
    else:
        out, lse = _forward_gpu(*arrays.values(), options, varlen, return_lse)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0,
                       deterministic=False, dlse=None):
    """Gradients (dq, dk, dv) of ``attention`` given the upstream gradient ``dout``.

    ``out`` and ``lse`` are what ``attention(..., return_lse=True)`` returned for the
    same arguments (with dropout: the same ``seed`` and ``rng_offset``); P is
    recomputed from ``lse``, never stored. lse is differentiable too: ``dlse``, the
    loss's gradient with respect to lse (float32, lse's shape, contiguous, beside q),
    adds its share (d lse_i / d s_ij = P_ij, the probabilities before dropout); None
    when the loss does not use lse. Rows that see no key (lse +inf) ignore their
    dlse and get zero gradients. With GQA, dk and dv are summed over the
    query heads that share a KV head. dq is accumulated with fp32 atomics, so its
    last bits can differ between runs; ``deterministic=True`` computes it in a pass
    of its own instead (slower), and every gradient is bitwise reproducible. dk and
    dv always are.
    """
    arrays = _inspect(dout=dout, q=q, k=k, v=v, out=out, lse=lse, **({} if dlse is None else {"dlse": dlse}))
    qi, ki, vi = arrays["q"], arrays["k"], arrays["v"]
    key = _signature(arrays, alibi_slopes, dropout_p, causal, softmax_scale, window_size, softcap, seed, rng_offset,
                     deterministic)
    warm = _warm.get(key)
    if warm is None:
        _options.check_qkv(qi, ki, vi, packed=False)
        _options.check_outputs(arrays, (qi.shape[0], qi.shape[2], qi.shape[1]))
        _options.check_dlse(arrays)
        options = _options.make_options(qi, ki, causal, softmax_scale, window_size, softcap, alibi_slopes,
                                        dropout_p, seed, rng_offset, backward=True)
        _options.check_bool("deterministic", deterministic)
        warm = _remember(key, options)
    if qi.device is None:
        from . import cpu
        return cpu.attention_backward(dout, q, k, v, out, lse, dlse=dlse,
                                      **_cpu_options(warm.options, alibi_slopes))
    return _backward_gpu(arrays, warm.options, None, deterministic, warm)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0, deterministic=False,
                              dlse=None):
    """Gradients (dq, dk, dv) of ``attention_varlen``; see ``attention_backward``
    (``dlse`` is laid out like lse, (nheads, total_q))."""
    arrays = _inspect(dout=dout, q=q, k=k, v=v, out=out, lse=lse, **({} if dlse is None else {"dlse": dlse}))
    qi, ki, vi = arrays["q"], arrays["k"], arrays["v"]
    _options.check_qkv(qi, ki, vi, packed=True)
    _options.check_outputs(arrays, (qi.shape[1], qi.shape[0]))
    _options.check_dlse(arrays)
    varlen = _options.varlen(qi, ki, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = _options.make_options(qi, ki, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                                    seed, rng_offset, backward=True, batch=varlen.batch, seqlen_k=varlen.max_seqlen_k)
    _options.check_bool("deterministic", deterministic)
    if qi.device is None:
        from . import cpu
        return cpu.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, dlse=dlse, **_cpu_options(options, alibi_slopes))
    return _backward_gpu(arrays, options, varlen, deterministic)


for _f in (attention, attention_varlen, attention_backward, attention_varlen_backward):
    _f.__doc__ += _OPTIONS_DOC


# -- GPU ---------------------------------------------------------------------------------

def _forward_gpu(q, k, v, options: Options, varlen: Varlen | None, return_lse: bool, warm: _Warm | None = None):
    framework = _arrays.Framework(q)
    out = framework.empty(q.shape, q.dtype)
    lse = None
    if return_lse:  # (the kernel skips the LSE's stores otherwise)
        lse = framework.empty((q.shape[0], q.shape[2], q.shape[1]) if varlen is None else (q.shape[1], q.shape[0]),
                              "float32")
    launcher = warm and warm.launcher
    if not launcher:
        launcher = _kernels.forward_launcher(q, k, v, out, options, varlen)
        if warm:  # (out is this call's own allocation: its layout is the same every call)
            warm.launcher = launcher
    launcher(framework.stream, q.ptr, k.ptr, v.ptr, out.ptr, 0 if lse is None else lse.ptr)
    return framework.finish(out.obj), None if lse is None else framework.finish(lse.obj)


def _backward_gpu(arrays: dict, options: Options, varlen: Varlen | None, deterministic: bool,
                  warm: _Warm | None = None):
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    framework = _arrays.Framework(q)
    dq, dk, dv = grads = [framework.empty(a.shape, a.dtype) for a in (q, k, v)]
    work = {name: framework.empty(shape, dtype)
            for name, (shape, dtype) in _plan.backward_workspace(q.shape, deterministic, options.extras).items()}
    dq_accum, dlse = work.get("dq_accum"), arrays.get("dlse")
    launcher = warm and warm.launcher
    if not launcher:
        launcher = _kernels.backward_launcher(arrays["dout"], q, k, v, arrays["out"], dq, dk, dv, dq_accum, options,
                                              varlen)
        if warm:
            warm.launcher = launcher
    pointers = (arrays["dout"], q, k, v, arrays["out"], arrays["lse"], dlse, dq, dk, dv, work["delta"], dq_accum)
    launcher(framework.stream, *(0 if a is None else a.ptr for a in pointers))
    return tuple(framework.finish(g.obj) for g in grads)


def _cpu_options(options: Options, alibi_slopes) -> dict:
    return dict(causal=options.causal, softmax_scale=options.scale, window_size=options.window,
                softcap=options.softcap, alibi_slopes=alibi_slopes, dropout_p=options.dropout_p,
                seed=options.seed, rng_offset=options.rng_offset)


# -- warm calls ----------------------------------------------------------------------------

# Every user error becomes an exception in _options, before anything runs. Warm calls skip
# the checks and the planning: a signature (every array's kind, device, shape, strides
# and dtype, and every option with its type) that passed once passes again and launches
# what it launched. ALiBi and dropout calls are always checked and planned (their arrays
# and seeds vary), and so are packed sequences (their cu_seqlens).
class _Warm:
    """A call signature that passed the checks: its options and, once it has run on
    the GPU, its launcher."""
    __slots__ = ("options", "launcher")

    def __init__(self, options: Options):
        self.options, self.launcher = options, None


_warm: dict = {}


def _signature(arrays: dict, alibi_slopes, dropout_p, *scalars):
    if alibi_slopes is not None or dropout_p.__class__ not in (int, float) or dropout_p != 0 \
            or len(_warm) > 4096:
        return None
    # repr tells apart what == would not (True / 1 / 1.0, a list from a tuple). The
    # pointers' 16-byte alignment picks the kernel's copy width.
    return (tuple([(a.framework, a.device, a.shape, a.strides, a.dtype, a.ptr % 16 == 0) for a in arrays.values()]),
            repr((dropout_p, *scalars)))


def _remember(key, options: Options) -> _Warm:
    warm = _Warm(options)
    if key is not None:
        _warm[key] = warm
    return warm


def _inspect(**arrays) -> dict[str, _arrays.ArrayInfo]:
    return {name: _arrays.inspect(x, name) for name, x in arrays.items()}
