"""The NumPy-like public functions: validate -> plan -> launch."""
from __future__ import annotations

from . import _arrays, _kernels, _options, _plan
from . import _warm as _warm_calls
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
    ``score_mod(score, b, h, q_idx, kv_idx, *mod_tensors) -> score`` and
    ``mask_mod(b, h, q_idx, kv_idx, *mod_tensors) -> bool`` (False: masked), with the
    arrays ``mod_tensors`` (of q's kind, on its device): programmable attention, traced by
    ``cuflash.mod``; score_mod applies after softcap and ALiBi, mask_mod ANDs with causal
    and the window. On CUDA arrays the traced functions are compiled into the mma.sync
    kernels (every GPU) and, on Hopper, the sm_90a backward; indices into mod tensors are
    checked over the call's positions before any launch.
    ``block_mask``: a ``cuflash.mod.BlockMask`` made for the call's shapes by
    ``cuflash.mod.create_block_mask`` (packed calls: batch the sequences, seqlen_q and
    seqlen_k max_seqlen_q and max_seqlen_k, positions within each sequence), which carries
    mask_mod and mod_tensors (a call may pass them too: the same function and arrays). The
    kernels skip the tiles of its empty blocks and evaluate mask_mod only in its partial
    ones (a full block shows every key: causal and the window still apply); the NumPy path
    applies the same rule.
"""


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0, return_lse=False, score_mod=None,
              mask_mod=None, mod_tensors=(), block_mask=None):
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
    scalars = (causal, softmax_scale, window_size, softcap, dropout_p, seed, rng_offset, return_lse)
    if block_mask is not None:
        mask_mod, mod_tensors = _options.block_mask_mods(block_mask, mask_mod, mod_tensors)
    mods = _options.has_mods(score_mod, mask_mod, mod_tensors)
    key = _key((q, k, v), scalars, alibi_slopes, (score_mod, mask_mod, mod_tensors, block_mask) if mods else None)
    warm = _warm_calls.lookup(_warm, key)
    if warm is not None:
        return _launch_warm(warm, q, k, v)
    arrays = _inspect(q=q, k=k, v=v)
    _options.check_qkv(*arrays.values(), packed=False)
    options = _options.make_options(arrays["q"], arrays["k"], causal, softmax_scale, window_size, softcap,
                                    alibi_slopes, dropout_p, seed, rng_offset, backward=False)
    if mods:
        options = _with_mods(options, arrays["q"], score_mod, mask_mod, mod_tensors, arrays["q"].shape[0],
                             arrays["q"].shape[1], arrays["k"].shape[1], block_mask)
    if arrays["q"].device is None:
        from . import cpu
        out, lse = cpu.attention_forward(q, k, v, **_cpu_options(options, alibi_slopes),
                                         **_mod_options(score_mod, mask_mod, mod_tensors, block_mask))
    else:
        warm = _Warm(options)
        out, lse = _forward_gpu(*arrays.values(), options, None, return_lse, warm)
        _warm_calls.remember(_warm, key, warm)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     seed=None, rng_offset=0, return_lse=False, block_table=None, score_mod=None, mask_mod=None,
                     mod_tensors=(), block_mask=None):
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
    call; forward only, no dropout, no score_mod or mask_mod;
    ``cuflash.kvcache.attention_varlen_paged``). score_mod and mask_mod see b, the sequence
    index, and positions within the sequence; so does a block mask, made over (sequences,
    heads, max_seqlen_q, max_seqlen_k).
    """
    if block_mask is not None:
        mask_mod, mod_tensors = _options.block_mask_mods(block_mask, mask_mod, mod_tensors)
    mods = _options.has_mods(score_mod, mask_mod, mod_tensors)
    if block_table is not None:
        if mods:
            raise NotImplementedError("score_mod and mask_mod do not take block_table (the paged call) yet")
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
    if mods:
        options = _with_mods(options, arrays["q"], score_mod, mask_mod, mod_tensors, varlen.batch,
                             varlen.max_seqlen_q, varlen.max_seqlen_k, block_mask)
    if arrays["q"].device is None:
        from . import cpu
        out, lse = cpu.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                **_cpu_options(options, alibi_slopes),
                                                **_mod_options(score_mod, mask_mod, mod_tensors, block_mask))
    else:
        out, lse = _forward_gpu(*arrays.values(), options, varlen, return_lse)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0,
                       deterministic=False, dlse=None, score_mod=None, mask_mod=None, mod_tensors=(), block_mask=None):
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
    dv always are. score_mod, mask_mod, mod_tensors and block_mask are the forward's; dS is
    multiplied by d score_mod / d score (``cuflash.mod.derivative``).
    """
    given = (dout, q, k, v, out, lse) if dlse is None else (dout, q, k, v, out, lse, dlse)
    scalars = (causal, softmax_scale, window_size, softcap, dropout_p, seed, rng_offset, deterministic)
    if block_mask is not None:
        mask_mod, mod_tensors = _options.block_mask_mods(block_mask, mask_mod, mod_tensors)
    mods = _options.has_mods(score_mod, mask_mod, mod_tensors)
    key = _key(given, scalars, alibi_slopes, (score_mod, mask_mod, mod_tensors, block_mask) if mods else None)
    warm = _warm_calls.lookup(_warm, key)
    if warm is not None:
        return _backward_warm(warm, given)
    arrays = _inspect(dout=dout, q=q, k=k, v=v, out=out, lse=lse, **({} if dlse is None else {"dlse": dlse}))
    qi, ki, vi = arrays["q"], arrays["k"], arrays["v"]
    _options.check_qkv(qi, ki, vi, packed=False)
    _options.check_outputs(arrays, (qi.shape[0], qi.shape[2], qi.shape[1]))
    _options.check_dlse(arrays)
    options = _options.make_options(qi, ki, causal, softmax_scale, window_size, softcap, alibi_slopes,
                                    dropout_p, seed, rng_offset, backward=True)
    _options.check_bool("deterministic", deterministic)
    if mods:
        options = _with_mods(options, qi, score_mod, mask_mod, mod_tensors, qi.shape[0], qi.shape[1], ki.shape[1],
                             block_mask)
    if qi.device is None:
        from . import cpu
        return cpu.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **_cpu_options(options, alibi_slopes),
                                      **_mod_options(score_mod, mask_mod, mod_tensors, block_mask))
    warm = _Warm(options)
    grads = _backward_gpu(arrays, options, None, deterministic, warm)
    _warm_calls.remember(_warm, key, warm)
    return grads


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0, deterministic=False,
                              dlse=None, score_mod=None, mask_mod=None, mod_tensors=(), block_mask=None):
    """Gradients (dq, dk, dv) of ``attention_varlen``; see ``attention_backward``
    (``dlse`` is laid out like lse, (nheads, total_q))."""
    if block_mask is not None:
        mask_mod, mod_tensors = _options.block_mask_mods(block_mask, mask_mod, mod_tensors)
    arrays = _inspect(dout=dout, q=q, k=k, v=v, out=out, lse=lse, **({} if dlse is None else {"dlse": dlse}))
    qi, ki, vi = arrays["q"], arrays["k"], arrays["v"]
    _options.check_qkv(qi, ki, vi, packed=True)
    _options.check_outputs(arrays, (qi.shape[1], qi.shape[0]))
    _options.check_dlse(arrays)
    varlen = _options.varlen(qi, ki, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = _options.make_options(qi, ki, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                                    seed, rng_offset, backward=True, batch=varlen.batch, seqlen_k=varlen.max_seqlen_k)
    _options.check_bool("deterministic", deterministic)
    if _options.has_mods(score_mod, mask_mod, mod_tensors):
        options = _with_mods(options, qi, score_mod, mask_mod, mod_tensors, varlen.batch, varlen.max_seqlen_q,
                             varlen.max_seqlen_k, block_mask)
    if qi.device is None:
        from . import cpu
        return cpu.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, dlse=dlse, **_cpu_options(options, alibi_slopes),
                                             **_mod_options(score_mod, mask_mod, mod_tensors, block_mask))
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
    work, scratch = [], None
    if launcher.plan.workspace:  # (the sm_90a forward's counters and tail pieces; stream-ordered)
        work, scratch = framework.scratch([(shape, dtype) for _, shape, dtype in launcher.plan.workspace])
    launcher(framework.stream, q.ptr, k.ptr, v.ptr, out.ptr, 0 if lse is None else lse.ptr, *(w.ptr for w in work))
    if warm:
        dtype = framework.calls.dtype
        warm.calls, warm.device = framework.calls, q.device
        warm.outputs = (out.shape, dtype(out.dtype), None if lse is None else lse.shape, dtype("float32"))
        warm.workspace = scratch
    return framework.finish(out.obj), None if lse is None else framework.finish(lse.obj)


def warm_forward(q, k, v, scalars: tuple):
    """``attention(q, k, v, ...)`` without ALiBi, where its signature is warm (``_warm``):
    its outputs allocated, its launcher launched, no array described. None otherwise.
    ``scalars``: (causal, softmax_scale, window_size, softcap, dropout_p, seed,
    rng_offset, return_lse) as the caller gave them."""
    warm = _lookup(_key((q, k, v), scalars, None))
    return None if warm is None else _launch_warm(warm, q, k, v)


def _launch_warm(warm: _Warm, q, k, v):
    """The forward of a warm signature on these arrays: out, or (out, lse)."""
    calls, device, (out_shape, dtype, lse_shape, float32) = warm.calls, warm.device, warm.outputs
    pointer = calls.pointer
    out = calls.empty(out_shape, dtype, device)
    buffer, work = (None, ()) if warm.workspace is None else _arrays.allocate_scratch(calls, device, warm.workspace)
    if lse_shape is None:
        warm.launcher(calls.stream(device), pointer(q), pointer(k), pointer(v), pointer(out), 0, *work)
        return out
    lse = calls.empty(lse_shape, float32, device)
    warm.launcher(calls.stream(device), pointer(q), pointer(k), pointer(v), pointer(out), pointer(lse), *work)
    return out, lse


def _backward_gpu(arrays: dict, options: Options, varlen: Varlen | None, deterministic: bool,
                  warm: _Warm | None = None):
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    framework = _arrays.Framework(q)
    dq, dk, dv = grads = [framework.empty(a.shape, a.dtype) for a in (q, k, v)]
    block_mask = options.mods is not None and options.mods.blocks is not None
    ordered = deterministic and _plan.backward_orders(q.shape[-1], options.extras, block_mask,
                                                      _kernels.device_facts(q.device).sm90a)
    workspace = _plan.backward_workspace(q.shape, deterministic, options.extras, ordered)
    (delta, dq_accum, dq_semaphore), scratch = framework.scratch([workspace.get(name) for name in
                                                                  ("delta", "dq_accum", "dq_semaphore")])
    launcher = _kernels.backward_launcher(arrays["dout"], q, k, v, arrays["out"], dq, dk, dv, dq_accum, options,
                                          varlen, dq_semaphore)
    pointers = (arrays["dout"], q, k, v, arrays["out"], arrays["lse"], arrays.get("dlse"), dq, dk, dv, delta,
                dq_accum, dq_semaphore)
    launcher(framework.stream, *(0 if a is None else a.ptr for a in pointers))
    if warm:  # (the same for every call of a signature: the arrays' shapes, deterministic, options)
        dtype = framework.calls.dtype
        warm.launcher, warm.calls, warm.device = launcher, framework.calls, q.device
        warm.outputs = tuple((a.shape, dtype(a.dtype)) for a in grads)
        warm.workspace = scratch
    return tuple(framework.finish(g.obj) for g in grads)


def _backward_warm(warm: _Warm, given: tuple):
    """The backward of a warm signature on ``given`` (dout, q, k, v, out, lse and dlse
    where the call has one): (dq, dk, dv) and the scratch allocated, its launcher
    launched, no array described."""
    calls, device = warm.calls, warm.device
    empty, pointer = calls.empty, calls.pointer
    grads = [empty(shape, dtype, device) for shape, dtype in warm.outputs]
    buffer, work = _arrays.allocate_scratch(calls, device, warm.workspace)
    arrays = map(pointer, given) if len(given) == 7 else (*map(pointer, given), 0)
    warm.launcher(calls.stream(device), *arrays, *map(pointer, grads), *work)
    return tuple(grads)


def _cpu_options(options: Options, alibi_slopes) -> dict:
    return dict(causal=options.causal, softmax_scale=options.scale, window_size=options.window,
                softcap=options.softcap, alibi_slopes=alibi_slopes, dropout_p=options.dropout_p,
                seed=options.seed, rng_offset=options.rng_offset)


def _with_mods(options: Options, q, score_mod, mask_mod, mod_tensors, batch: int, seqlen_q: int,
               seqlen_k: int, block_mask=None) -> Options:
    """The options of a call with mods: checked, and on CUDA arrays traced for the kernels
    over the call's positions (batch elements or sequences, the longest lengths), with the
    statuses of its block mask (a dense call's)."""
    _options.check_mods(q, score_mod, mask_mod, mod_tensors)
    blocks = None
    if block_mask is not None:
        blocks = _options.check_block_mask(block_mask, q, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    if q.device is None:  # (the NumPy path traces them itself)
        return options
    return options._replace(mods=_options.device_mods(q, score_mod, mask_mod, tuple(mod_tensors), batch=batch,
                                                      seqlen_q=seqlen_q, seqlen_k=seqlen_k, blocks=blocks))


def _mod_options(score_mod, mask_mod, mod_tensors, block_mask=None) -> dict:
    """The NumPy path's programmable-attention arguments, where a call has them."""
    if not _options.has_mods(score_mod, mask_mod, mod_tensors):
        return {}
    blocks = {} if block_mask is None else {"block_statuses": block_mask.statuses}
    return dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=tuple(mod_tensors), **blocks)


# -- warm calls (_warm) ----------------------------------------------------------------------

# ALiBi and dropout calls are always checked and planned (their slopes are an array, their
# seeds vary), and so are packed sequences (their cu_seqlens): they make no key.
class _Warm:
    """A call signature that passed the checks: its options and, once it has run on
    the GPU (the only calls kept), its launcher, its arrays' library and device, its
    outputs' shapes and dtypes ((forward) out's shape and dtype, lse's shape or None, and
    float32; (backward) dq's, dk's and dv's (shape, dtype)s) and its scratch's layout
    (``_arrays.Framework.scratch``; the forward's None where its plan has none)."""
    __slots__ = ("options", "launcher", "calls", "device", "outputs", "workspace")

    def __init__(self, options: Options):
        self.options, self.launcher, self.outputs, self.workspace = options, None, None, None


_warm: dict = {}


def _key(arrays: tuple, scalars: tuple, alibi_slopes, mods: tuple | None = None):
    """The warm key of a call on these arrays with these other arguments (causal,
    softmax_scale, window_size, softcap, dropout_p, ...) and, where it has them, its
    ``mods`` (score_mod, mask_mod, mod_tensors, block_mask), or None."""
    dropout_p = scalars[4]
    if alibi_slopes is not None or dropout_p.__class__ not in (int, float) or dropout_p != 0:
        return None
    key = _warm_calls.key(arrays, scalars, pair=2)
    return key if mods is None else _warm_calls.mods_key(key, *mods)


def _lookup(key) -> _Warm | None:
    return _warm_calls.lookup(_warm, key)


def _inspect(**arrays) -> dict[str, _arrays.ArrayInfo]:
    return {name: _arrays.inspect(x, name) for name, x in arrays.items()}
