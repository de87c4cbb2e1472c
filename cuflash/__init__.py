"""cuflash: exact FlashAttention as CUDA C++ compiled by NVRTC at first use.

    out = cuflash.attention(q, k, v, causal=True)

q, k, v are (batch, seqlen, nheads, headdim) CuPy, PyTorch or JAX CUDA arrays
(float16/bfloat16, tensor-core kernels) or NumPy arrays (the CPU path).
"""
from . import mod
from .api import attention, attention_backward, attention_varlen, attention_varlen_backward
from .kvcache import attention_with_kvcache, merge_states

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache", "merge_states"]
__version__ = "0.1.0"
