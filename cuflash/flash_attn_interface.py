"""Drop-in names and signatures of flash-attn 2.x (``flash_attn.flash_attn_interface``).

    from cuflash.flash_attn_interface import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)

Torch tensors in, torch tensors out, differentiable, like flash-attn. Same defaults and
return conventions; what differs:

- ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``. flash-attn returns the
  attention probabilities only when dropout is on (an empty tensor otherwise); cuflash has
  no dropout yet, so the third item is None.
- Features cuflash does not have yet raise NotImplementedError naming the feature:
  ``dropout_p > 0``, ``softcap > 0``, ``alibi_slopes``, and any ``window_size`` that is not
  the full (or, with ``causal``, the causal) mask after flash-attn's own normalisation.
- Head dims need no padding to a multiple of 8, and CPU tensors run the NumPy path.
- The packed variants pass strided views of qkv / kv to the kernel (no copy); their
  gradients reach qkv / kv through those views.
"""
from . import torch as cuflash_torch

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func"]


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_func``: exact attention of q (batch, seqlen_q, nheads,
    headdim) over k, v (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0.

    causal is aligned to the bottom-right corner of the score matrix; softmax_scale
    defaults to 1 / sqrt(headdim); deterministic makes the backward bitwise reproducible.
    Returns out (batch, seqlen_q, nheads, headdim) or, with return_attn_probs,
    (out, softmax_lse, None) where softmax_lse is float32 (batch, nheads, seqlen_q).
    """
    if dropout_p > 0:
        raise NotImplementedError(f"dropout is not implemented in cuflash yet (dropout_p={dropout_p}); "
                                  f"use dropout_p=0.0")
    if softcap > 0:
        raise NotImplementedError(f"softcap (softcapping of the scores) is not implemented in cuflash yet "
                                  f"(softcap={softcap}); use softcap=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes (ALiBi) is not implemented in cuflash yet; use alibi_slopes=None")
    causal = _causal_from_window(window_size, causal, seqlen_k=k.shape[1])
    # The op takes a float; flash-attn takes any real number (a NumPy float, an int).
    scale = None if softmax_scale is None else float(softmax_scale)
    # flash-attn copies inputs whose last dimension is strided; cuflash needs it unit-stride too.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out, softmax_lse = cuflash_torch.attention_forward(q, k, v, causal, scale, deterministic)
    return (out, softmax_lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func of qkv (batch, seqlen, 3, nheads, headdim) stacked on dim 2."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func of q and kv (batch, seqlen_k, 2, nheads_k, headdim) stacked on dim 2."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def _causal_from_window(window_size, causal: bool, seqlen_k: int) -> bool:
    """Reduce (window_size, causal) the way flash-attn's mha_fwd does and return causal, or
    raise if what is left is a sliding window. A side of at least seqlen_k is unbounded (-1);
    causal sets the right side to 0; (unbounded, 0) is causal and (unbounded, unbounded) full."""
    left, right = (-1 if w >= seqlen_k else w for w in window_size)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return False
    if left < 0 and right == 0:
        return True
    raise NotImplementedError(f"window_size (sliding window local attention) is not implemented in cuflash yet "
                              f"(window_size={tuple(window_size)}, causal={causal}); use (-1, -1)")

