"""PyTorch glue: autograd, torch.compile and CUDA graphs through torch.library custom ops.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)   # differentiable
    out.sum().backward()

Two custom ops carry the work: ``cuflash::attention_forward`` -> (out, lse) and
``cuflash::attention_backward`` -> (dq, dk, dv). Each has a fake (meta) implementation,
so torch.compile traces them as opaque nodes with no graph break, and the forward has an
autograd formula that calls the backward op. A custom op (unlike an autograd.Function
calling CuPy) is what keeps ``torch.compile(fullgraph=True)`` whole.

CUDA tensors run the kernels on torch's current stream, outputs from torch's caching
allocator, so CUDA-graph capture works once the kernel variant has been compiled (the
first call compiles with NVRTC, which must not happen during capture).

CPU tensors run the NumPy path through zero-copy NumPy views (float16, float32, float64).
NumPy has no bfloat16, so bfloat16 CPU tensors raise TypeError. The CPU path exists to
make the glue testable without a GPU; it is not fast.

Importing this module imports torch; ``import cuflash`` alone does not.
"""
from typing import Optional

import numpy as np
import torch

from . import api

__all__ = ["attention", "attention_forward", "attention_backward"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: Optional[float] = None, deterministic: bool = False) -> torch.Tensor:
    """Differentiable ``cuflash.attention`` for torch tensors: returns out.

    q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_kv, headdim);
    see ``cuflash.attention`` for the semantics. ``deterministic`` makes the backward
    bitwise reproducible (dq accumulated in a fixed order) at some cost in speed.
    """
    out, _ = attention_forward(q, k, v, causal, softmax_scale, deterministic)
    return out


@torch.library.custom_op("cuflash::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      softmax_scale: Optional[float], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse). ``deterministic`` is not used by the forward: autograd hands it to the
    backward, and it has to be an input of this op for setup_context to see it."""
    if q.device.type != "cpu":
        return api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    out, lse = api.attention(*_numpy(q=q, k=k, v=v), causal=causal, softmax_scale=softmax_scale, return_lse=True)
    return _tensor(out), _tensor(lse)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    # new_empty, not empty_like: the real outputs are contiguous whatever q's strides are.
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                       deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): gradients of attention_forward's out, given its out and lse."""
    kwargs = dict(causal=causal, softmax_scale=softmax_scale, deterministic=deterministic)
    if q.device.type != "cpu":
        return tuple(api.attention_backward(dout, q, k, v, out, lse, **kwargs))
    arrays = _numpy(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    return tuple(_tensor(g) for g in api.attention_backward(*arrays, **kwargs))


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.softmax_scale, ctx.deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    # The backward ignores lse's gradient, so say so rather than return a wrong one.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout.stride(-1) != 1:  # e.g. the expanded gradient of out.sum(): the kernel needs unit stride
        dout = dout.contiguous()
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _numpy(**tensors) -> list:
    """Zero-copy NumPy views of CPU tensors, with the errors a caller can act on."""
    where = {name: str(t.device) for name, t in tensors.items()}
    if set(where.values()) != {"cpu"}:
        raise ValueError(f"tensors must be on one device, got {where}")
    for name, t in tensors.items():
        if t.dtype == torch.bfloat16:
            raise TypeError(f"{name} is a bfloat16 CPU tensor; the CPU path runs on NumPy, which has no "
                            f"bfloat16: use float16/float32/float64 on the CPU, or a CUDA tensor")
    return [t.detach().numpy() for t in tensors.values()]


def _tensor(x: np.ndarray) -> torch.Tensor:
    # Contiguous, as the fake implementations promise.
    return torch.from_numpy(np.ascontiguousarray(x))
