"""Drop-in names and signatures of flash-attn 2.x (``flash_attn.flash_attn_interface``).

    from cuflash.flash_attn_interface import flash_attn_func
    out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True, window_size=(256, 0))

Torch tensors in, torch tensors out, differentiable, like flash-attn: ``flash_attn_func``,
``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``, ``flash_attn_varlen_func``,
``flash_attn_varlen_qkvpacked_func``, ``flash_attn_varlen_kvpacked_func`` and
``flash_attn_with_kvcache``, with the same
arguments, defaults and return conventions, and every option (dropout, sliding windows,
softcap, ALiBi, deterministic backward) passed through to ``cuflash.torch``. What differs:

- ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``. softmax_lse is
  differentiable, where flash-attn ignores its gradient: gradients reach q, k and v through
  it as well as through out (a row that sees no key has softmax_lse +inf and ignores its
  gradient), so partial attentions can be merged by their LSE and trained through.
  S_dmask is flash-attn's (for tests only, as there): with dropout, (batch, nheads,
  seqlen_q, seqlen_k rounded up to 128) in q's dtype, the unnormalised probabilities of
  each block of ``_get_block_size_n()`` keys, exp(s - m) with m the row's largest score
  in that block and the blocks after it (flash-attn visits the blocks last to first),
  negative (sign bit set) where the kernel dropped the probability: the keep mask is
  regenerated from the call's seed by ``cuflash._philox``, the scores recomputed in fp32.
  Masked positions hold 0; None without dropout. Varlen: (batch, nheads, max_seqlen_q,
  max_seqlen_k rounded up), of which sequence b uses [:seqlen_q_b, :seqlen_k_b].
- Dropout seeds come from torch's default generator of q's device (its seed and its Philox
  offset, which each call advances), so ``torch.manual_seed`` reproduces a run; the backward
  reuses the forward's seed (see ``cuflash.torch``).
- Head dims need no padding to a multiple of 8, and CPU tensors run the NumPy path.
- The packed variants pass strided views of qkv / kv to the kernel (no copy); their
  gradients reach qkv / kv through those views.
- ``flash_attn_varlen_func``'s ``block_table`` (k and v in pages) has no backward: the
  forward runs (on inputs that require grad too), a backward through it raises.
- ``flash_attn_with_kvcache``'s page size may be anything, not only multiples of 256.
- ``window_size`` may hold one-element integer tensors (flash-attn's tests draw it with
  ``torch.randint``), as flash-attn's C++ binding takes them.
- Bad arguments of ``flash_attn_with_kvcache`` and of the paged ``flash_attn_varlen_func``
  raise RuntimeError naming the argument, as flash-attn's checks do.

flash-attn 2.8's internal functions ``_flash_attn_forward``, ``_flash_attn_backward``,
``_flash_attn_varlen_forward`` and ``_flash_attn_varlen_backward`` take its parameters and
return its values, over the same custom ops (see each one for what differs;
``_flash_attn_varlen_forward`` takes ``seqused_k`` with ``block_table`` only, and its newer
``num_splits`` as flash-attn's varlen call does: 0 or 1).
"""
import contextlib
import math

import numpy as np

from . import _options, _philox
from .torch import calls as cuflash_torch

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_func``: exact attention of q (batch, seqlen_q, nheads,
    headdim) over k, v (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0.

    causal is aligned to the bottom-right corner of the score matrix; window_size (left,
    right) keeps keys in [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]
    (-1: unbounded); softcap > 0 caps the scores with softcap * tanh(s / softcap);
    alibi_slopes (nheads,) or (batch, nheads) float32 subtracts slope * |i + seqlen_k -
    seqlen_q - j|; dropout_p drops probabilities (set it to 0.0 in evaluation);
    softmax_scale defaults to 1 / sqrt(headdim); deterministic makes the backward bitwise
    reproducible. Returns out (batch, seqlen_q, nheads, headdim) or, with
    return_attn_probs, (out, softmax_lse, S_dmask) where softmax_lse is float32 (batch,
    nheads, seqlen_q), differentiable, and S_dmask flash-attn's probabilities with the
    dropped ones negative (see the module's notes; None without dropout).
    """
    q, k, v = _unit_stride(q, k, v)
    window_size = _window(window_size)
    out, softmax_lse, rng_state = cuflash_torch._forward(q, k, v, *cuflash_torch._op_options(
        dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes), causal=causal, softmax_scale=softmax_scale,
        deterministic=deterministic, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed=None))
    if not return_attn_probs:
        return out
    return out, softmax_lse, _attention_probs(rng_state, q, k, None, dropout_p, softmax_scale, causal, window_size,
                                              softcap, alibi_slopes)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func of qkv (batch, seqlen, 3, nheads, headdim) stacked on dim 2."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func of q and kv (batch, seqlen_k, 2, nheads_k, headdim) stacked on dim 2."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn's ``flash_attn_varlen_func``: flash_attn_func over packed sequences.

    q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k
    and v (int32 (batch + 1,) on q's device); max_seqlen_q/k bound the lengths. Every
    option applies per sequence, with that sequence's own lengths. Returns out (total_q,
    nheads, headdim) or, with return_attn_probs, (out, softmax_lse, S_dmask), softmax_lse
    float32 (nheads, total_q), differentiable.
    """
    window_size = _window(window_size)
    if block_table is not None:  # k and v are page pools (flash-attn's paged varlen call)
        out = _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                            causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                            alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=return_attn_probs)
        return (*out, None) if return_attn_probs else out
    q, k, v = _unit_stride(q, k, v)
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
    out, softmax_lse, rng_state = cuflash_torch._varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *cuflash_torch._op_options(
            tensors, max_seqlens=(max_seqlen_q, max_seqlen_k), causal=causal,
            softmax_scale=softmax_scale, deterministic=deterministic, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=None))
    if not return_attn_probs:
        return out
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return out, softmax_lse, _attention_probs(rng_state, q, k, varlen, dropout_p, softmax_scale, causal, window_size,
                                              softcap, alibi_slopes)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func of qkv (total, 3, nheads, headdim) stacked on dim 1, one
    cu_seqlens and max_seqlen for queries and keys."""
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func of q and kv (total_k, 2, nheads_k, headdim) stacked on dim 1."""
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's ``flash_attn_with_kvcache`` (2.8): ``cuflash.torch.attention_with_kvcache``
    under flash-attn's argument order and return convention. k_cache and v_cache are
    updated in place where k and v are given. ``cache_seqlens=None`` means every cache is
    full (its whole length). Returns out, or (out, softmax_lse) with return_softmax_lse."""
    if cache_seqlens is None:
        cache_seqlens = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    q, k, v = _unit_stride(q, k, v)
    window_size = _window(window_size)
    with _as_flash_attn_errors():
        return cuflash_torch.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, softmax_scale=softmax_scale, num_splits=num_splits,
            return_lse=return_softmax_lse)


# --- flash-attn's internal functions ---------------------------------------------------------
# Code built on flash-attn (its own autograd Functions, ring attention) calls these directly.


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax):
    """flash-attn 2.8's ``_flash_attn_forward``: (out, softmax_lse, S_dmask, rng_state) of q
    (batch, seqlen_q, nheads, headdim) over k and v, options as ``flash_attn_func``, without
    autograd (callers wrap it in their own autograd.Function). softmax_lse is float32
    (batch, nheads, seqlen_q); rng_state the dropout's int64 [seed, offset] on the CPU,
    which ``_flash_attn_backward`` takes to regenerate the forward's mask; S_dmask, with
    return_softmax, flash_attn_func's (None without dropout), else an empty tensor as
    flash-attn's."""
    q, k, v = _unit_stride(q, k, v)
    _options.check_bool("return_softmax", return_softmax)
    args = cuflash_torch._op_options(
        dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes), causal=causal, softmax_scale=softmax_scale,
        deterministic=False, window_size=_window((window_size_left, window_size_right)), softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=None)
    out, softmax_lse, rng_state = _op(cuflash_torch.attention_forward, cuflash_torch._attention_forward)(q, k, v, *args)
    window_size = _window((window_size_left, window_size_right))
    s_dmask = q.new_empty((0,)) if not return_softmax else _attention_probs(
        rng_state, q, k, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return out, softmax_lse, s_dmask, rng_state


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn 2.8's ``_flash_attn_backward``: writes the gradients of q, k and v into dq,
    dk and dv in place (each shaped, typed and placed like its input; None: computed and
    dropped, as flash-attn allocates it and returns it nowhere) and returns softmax_d,
    (1 - dropout_p) * rowsum(dout * out), float32 laid out like softmax_lse (flash-attn
    pads its rows to a multiple of 128). rng_state: the forward's (needed with dropout)."""
    dout, q, k, v, out = _unit_stride(dout, q, k, v, out)
    *head, alibi_slopes, dropout_p, _ = cuflash_torch._op_options(
        dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes), causal=causal, softmax_scale=softmax_scale,
        deterministic=deterministic, window_size=_window((window_size_left, window_size_right)), softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=None)
    targets = _gradient_targets(dq=dq, dk=dk, dv=dv, q=q, k=k, v=v)
    grads = _op(cuflash_torch.attention_backward, cuflash_torch._attention_backward)(
        dout, q, k, v, out, softmax_lse, *head, alibi_slopes, dropout_p, rng_state, None)
    return _write_gradients(targets, grads, dout, out, dropout_p)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """flash-attn 2.8's ``_flash_attn_varlen_forward``: ``_flash_attn_forward`` of packed
    sequences (as ``flash_attn_varlen_func``), softmax_lse float32 (nheads, total_q). With
    block_table, k and v are page pools (the paged ``flash_attn_varlen_func``: no dropout,
    S_dmask None, rng_state zeros), and ``seqused_k`` int32 (batch,), when given, is each
    sequence's number of keys in its pages (in place of cu_seqlens_k's differences).
    leftpad_k must be None, and seqused_k without block_table (cuflash's contiguous varlen
    call takes every key of cu_seqlens_k's ranges). ``num_splits`` 0 or 1, as flash-attn's
    varlen call takes it (the split count stays the planner's); more raises RuntimeError.
    zero_tensors changes nothing, since every row of out belongs to a sequence and is
    written."""
    _options.check_bool("return_softmax", return_softmax)
    _options.check_bool("zero_tensors", zero_tensors)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise TypeError(f"num_splits must be a non-negative int, got {num_splits!r}")
    if num_splits > 1:
        raise RuntimeError(f"num_splits > 1 is not supported by the varlen call (expected 0 or 1), got {num_splits}")
    if leftpad_k is not None:
        raise ValueError("leftpad_k must be None: cuflash's varlen call takes every key of a sequence "
                         f"(cu_seqlens_k), got {type(leftpad_k).__qualname__}")
    if seqused_k is not None:
        if block_table is None:
            raise ValueError("seqused_k must be None without block_table: cuflash's contiguous varlen call takes "
                             f"every key of a sequence (cu_seqlens_k), got {type(seqused_k).__qualname__}")
        cu_seqlens_k = _cu_seqlens_of(seqused_k, cu_seqlens_k)
    window_size = _window((window_size_left, window_size_right))
    if block_table is not None:
        with cuflash_torch.torch.no_grad():  # (these functions carry no autograd: inputs requiring grad are fine)
            out, softmax_lse = _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             block_table, causal=causal, softmax_scale=softmax_scale,
                                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                             dropout_p=dropout_p, return_lse=True)
        return out, softmax_lse, None if return_softmax else q.new_empty((0,)), cuflash_torch._rng_state(None, 0)
    q, k, v = _unit_stride(q, k, v)
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
    args = cuflash_torch._op_options(
        tensors, max_seqlens=(max_seqlen_q, max_seqlen_k), causal=causal, softmax_scale=softmax_scale,
        deterministic=False, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed=None)
    out, softmax_lse, rng_state = _op(cuflash_torch.attention_varlen_forward, cuflash_torch._attention_varlen_forward)(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args)
    s_dmask = q.new_empty((0,)) if not return_softmax else _attention_probs(
        rng_state, q, k, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes)
    return out, softmax_lse, s_dmask, rng_state


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """flash-attn 2.8's ``_flash_attn_varlen_backward``: ``_flash_attn_backward`` of packed
    sequences; softmax_d float32 (nheads, total_q). zero_tensors changes nothing (every row
    of dq, dk and dv belongs to a sequence and is written)."""
    _options.check_bool("zero_tensors", zero_tensors)
    dout, q, k, v, out = _unit_stride(dout, q, k, v, out)
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
    *head, alibi_slopes, dropout_p, _ = cuflash_torch._op_options(
        tensors, max_seqlens=(max_seqlen_q, max_seqlen_k), causal=causal, softmax_scale=softmax_scale,
        deterministic=deterministic, window_size=_window((window_size_left, window_size_right)), softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=None)
    targets = _gradient_targets(dq=dq, dk=dk, dv=dv, q=q, k=k, v=v)
    grads = _op(cuflash_torch.attention_varlen_backward, cuflash_torch._attention_varlen_backward)(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *head, alibi_slopes,
        dropout_p, rng_state, None)
    return _write_gradients(targets, grads, dout, out, dropout_p)


def _op(op, function):
    """The custom op while torch.compile traces (an opaque node), else the function it runs:
    eager calls skip the op's dispatch, as cuflash.torch's autograd wrappers do."""
    return op if cuflash_torch.torch.compiler.is_compiling() else function


def _gradient_targets(**tensors) -> list:
    """dq, dk and dv as given, each None or a tensor like q, k and v (checked before the backward runs)."""
    torch = cuflash_torch.torch
    targets = []
    for name, like in (("dq", "q"), ("dk", "k"), ("dv", "v")):
        target, x = tensors[name], tensors[like]
        if target is not None:
            if not isinstance(target, torch.Tensor):
                raise TypeError(f"{name} must be None or a torch.Tensor, got {type(target).__qualname__}")
            if (target.shape, target.dtype, target.device) != (x.shape, x.dtype, x.device):
                raise ValueError(f"{name} must have {like}'s shape {tuple(x.shape)}, dtype {x.dtype} and device "
                                 f"{x.device}, got {tuple(target.shape)}, {target.dtype} and {target.device}")
        targets.append(target)
    return targets


def _write_gradients(targets, grads, dout, out, dropout_p):
    """Copy the gradients into the given dq, dk and dv; return flash-attn's softmax_d."""
    for target, grad in zip(targets, grads):
        if target is not None:
            target.copy_(grad)
    torch = cuflash_torch.torch
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    # flash-attn keeps D scaled down by the keep probability, as its dP is (flash_bwd_preprocess_kernel.h)
    d = (dout.to(acc) * out.to(acc)).sum(-1) * (1.0 - float(dropout_p))
    # heads before rows, as lse: (batch, nheads, seqlen_q), or (nheads, total_q) packed
    return d.movedim(-1, -2).to(torch.float32).contiguous()


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, **options):
    """The varlen call over page pools k and v. It has no backward: where q, k or v take
    part in autograd the forward runs all the same, and a backward through it raises."""
    torch = cuflash_torch.torch

    def run():
        with _as_flash_attn_errors():
            return cuflash_torch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  block_table=block_table, **options)

    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        return _PagedVarlen.apply(q, k, v, run)
    return run()


def _cu_seqlens_of(seqused_k, cu_seqlens_k):
    """cu_seqlens_k of the paged call whose sequence b holds seqused_k[b] keys: 0 then the
    running sums, on the device, without reading the lengths (graph capture)."""
    torch = cuflash_torch.torch
    if not isinstance(seqused_k, torch.Tensor):
        raise TypeError(f"seqused_k must be None or a torch.Tensor, got {type(seqused_k).__qualname__}")
    batch = cu_seqlens_k.shape[0] - 1 if isinstance(cu_seqlens_k, torch.Tensor) and cu_seqlens_k.ndim == 1 else None
    if seqused_k.dtype != torch.int32 or seqused_k.ndim != 1 or seqused_k.shape[0] != batch:
        raise ValueError(f"seqused_k must be int32 of shape ({batch},) (one length a sequence of cu_seqlens_k), "
                         f"got {seqused_k.dtype} of shape {tuple(seqused_k.shape)}")
    if seqused_k.device != cu_seqlens_k.device:
        raise ValueError(f"seqused_k must be on cu_seqlens_k's device {cu_seqlens_k.device}, got {seqused_k.device}")
    return torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))


class _PagedVarlen(cuflash_torch.torch.autograd.Function):
    """The paged varlen call as an autograd node: the forward as it is (flash-attn runs it on
    inputs that require grad too), a backward that says there is none."""

    @staticmethod
    def forward(ctx, q, k, v, run):
        return run()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("block_table: flash_attn_varlen_func over paged k and v has no backward (expected "
                           "block_table=None, contiguous packed k and v, to train through it; got a block_table)")


@contextlib.contextmanager
def _as_flash_attn_errors():
    """flash-attn's inference calls refuse bad arguments with RuntimeError (its C++ checks):
    cuflash's ValueError and TypeError become one, with the same message naming the
    argument, so that code written for flash-attn catches what it expects."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise RuntimeError(str(e)) from e


def _window(window_size):
    """window_size with one-element integer tensors as ints: flash-attn's binding converts
    them (its tests pass ``torch.randint(0, seqlen_k, (2,))``). Anything else goes on to the
    checks, which say what a window must be."""
    torch = cuflash_torch.torch
    if isinstance(window_size, torch.Tensor) and window_size.shape == (2,):
        window_size = tuple(window_size.unbind(0))
    if not isinstance(window_size, (tuple, list)):
        return window_size
    integers = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
    return tuple(int(w) if isinstance(w, torch.Tensor) and w.numel() == 1 and w.dtype in integers else w
                 for w in window_size)


def _unit_stride(*tensors):
    # flash-attn copies inputs whose last dimension is strided; cuflash needs it unit-stride too.
    # (anything else goes on to the checks, which say what a tensor must be)
    return [x.contiguous() if isinstance(x, cuflash_torch.torch.Tensor) and x.stride(-1) != 1 else x
            for x in tensors]


# Keys a block of S_dmask: flash-attn's tests read the blocks' maxima with this function.
_S_DMASK_BLOCK = 128


def _get_block_size_n(device=None, head_dim=None, is_dropout=None, is_causal=None) -> int:
    """The keys of one block of S_dmask (flash-attn's name; its tests call it to undo the
    blocks' scaling). cuflash's blocks do not depend on the arguments."""
    return _S_DMASK_BLOCK


# flash-attn's tests import this flag of its ROCm build; cuflash is never that build.
USE_TRITON_ROCM = False


def _attention_probs(rng_state, q, k, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """S_dmask as flash-attn returns it (the module's notes), or None without dropout:
    computed in fp32 from q and k, sequence by sequence, on q's device."""
    torch = cuflash_torch.torch
    if not dropout_p > 0:
        return None
    from .reference import _visible
    d, nheads, nheads_k = q.shape[-1], q.shape[-2], k.shape[-2]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    if varlen is None:
        batch, rows, cols = q.shape[0], q.shape[1], k.shape[1]
        sequences = [(q[b], k[b]) for b in range(batch)]
    else:
        cu_q, cu_k = (c.tolist() for c in varlen[:2])
        batch, rows, cols = len(cu_q) - 1, varlen[2], varlen[3]
        sequences = [(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]]) for b in range(batch)]
    keep = _keep_mask(rng_state, dropout_p, batch, nheads, rows, cols, q)
    block = _S_DMASK_BLOCK
    padded_cols = -(-cols // block) * block
    probs = torch.zeros((batch, nheads, -(-rows // block) * block, padded_cols), dtype=q.dtype, device=q.device)
    slopes = None if alibi_slopes is None else alibi_slopes.float().reshape(-1, nheads).expand(batch, nheads)
    for b, (qb, kb) in enumerate(sequences):
        sq, sk = qb.shape[0], kb.shape[0]
        if not sq or not sk:
            continue
        kb = kb.float().repeat_interleave(nheads // nheads_k, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb.float(), kb) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        diagonal = torch.arange(sk, device=q.device)[None, :] - torch.arange(sq, device=q.device)[:, None] - (sk - sq)
        if slopes is not None:
            s = s - slopes[b][:, None, None].to(q.device) * diagonal.abs()
        visible = torch.from_numpy(_visible(np, sq, sk, causal, window_size)).to(q.device)
        s = s.masked_fill(~visible, -math.inf)
        # the row's maximum over this block and every block after it
        blocks = torch.nn.functional.pad(s, (0, padded_cols - sk), value=-math.inf).unflatten(-1, (-1, block))
        later = blocks.amax(-1).flip(-1).cummax(-1).values.flip(-1)
        m = later.repeat_interleave(block, dim=-1)[..., :sk]
        p = torch.where(visible, torch.exp(s - m.masked_fill(m == -math.inf, 0.0)), 0.0)
        probs[b, :, :sq, :sk] = torch.where(keep[b, :, :sq, :sk], p, -p).to(q.dtype)
    return probs


def _keep_mask(rng_state, dropout_p, batch, nheads, seqlen_q, seqlen_k, like):
    """The forward's dropout keep mask as a bool tensor on like's device, or None."""
    if not dropout_p > 0:
        return None
    import torch

    seed, rng_offset = cuflash_torch._from_rng_state(rng_state)
    if like.device.type == "cuda":
        import cupy

        with cupy.cuda.Device(like.device.index):
            mask = _philox.keep_mask(seed, rng_offset, batch, nheads, seqlen_q, seqlen_k, dropout_p, xp=cupy)
            # bytes through DLPack (every version takes uint8), then bool
            keep = torch.from_dlpack(mask.view(cupy.uint8)).bool()
            del mask
            # CuPy's pool would keep the Philox intermediates (uint32, 4x the mask) from torch's allocator.
            cupy.get_default_memory_pool().free_all_blocks()
            return keep
    return torch.from_numpy(_philox.keep_mask(seed, rng_offset, batch, nheads, seqlen_q, seqlen_k, dropout_p))
