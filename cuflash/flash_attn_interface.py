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
  S_dmask is the dropout keep mask, bool (batch, nheads, seqlen_q, seqlen_k) on q's device
  (True = kept), regenerated from the call's seed by ``cuflash._philox`` (exactly the mask
  the kernel applied), or None without dropout. flash-attn returns scaled probabilities whose sign
  encodes the mask, padded to multiples of 128; like flash-attn's, this is for tests only.
  Varlen: (batch, nheads, max_seqlen_q, max_seqlen_k), of which sequence b uses
  [:seqlen_q_b, :seqlen_k_b].
- Dropout seeds come from torch's default generator of q's device (its seed and its Philox
  offset, which each call advances), so ``torch.manual_seed`` reproduces a run; the backward
  reuses the forward's seed (see ``cuflash.torch``).
- Head dims need no padding to a multiple of 8, and CPU tensors run the NumPy path.
- The packed variants pass strided views of qkv / kv to the kernel (no copy); their
  gradients reach qkv / kv through those views.
- ``flash_attn_varlen_func``'s ``block_table`` (k and v in pages) runs forward only.
- ``flash_attn_with_kvcache``'s page size may be anything, not only multiples of 256.
- ``window_size`` may hold one-element integer tensors (flash-attn's tests draw it with
  ``torch.randint``), as flash-attn's C++ binding takes them.
- Bad arguments of ``flash_attn_with_kvcache`` and of the paged ``flash_attn_varlen_func``
  raise RuntimeError naming the argument, as flash-attn's checks do.
"""
import contextlib

from . import _philox
from . import torch as cuflash_torch

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
    nheads, seqlen_q), differentiable, and S_dmask the dropout keep mask (None without
    dropout).
    """
    q, k, v = _unit_stride(q, k, v)
    window_size = _window(window_size)
    out, softmax_lse, rng_state = cuflash_torch._forward(q, k, v, *cuflash_torch._op_options(
        dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes), causal=causal, softmax_scale=softmax_scale,
        deterministic=deterministic, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed=None))
    if not return_attn_probs:
        return out
    batch, seqlen_q, nheads, _ = q.shape
    return out, softmax_lse, _keep_mask(rng_state, dropout_p, batch, nheads, seqlen_q, k.shape[1], q)


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
    if block_table is not None:  # k and v are page pools; forward only (flash-attn's paged varlen call)
        with _as_flash_attn_errors():
            out = cuflash_torch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 causal, softmax_scale, window_size=window_size, softcap=softcap,
                                                 alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                                 return_lse=return_attn_probs, block_table=block_table)
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
    batch = cu_seqlens_q.shape[0] - 1
    mask = _keep_mask(rng_state, dropout_p, batch, q.shape[1], max_seqlen_q, max_seqlen_k, q)
    return out, softmax_lse, mask


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
            return torch.from_dlpack(mask.view(cupy.uint8)).bool()
    return torch.from_numpy(_philox.keep_mask(seed, rng_offset, batch, nheads, seqlen_q, seqlen_k, dropout_p))
